/// The names of the queues the roles share, all under one prefix so that
/// several pipelines (or test runs) can share one broker.
public struct PipelineNames: Sendable, Equatable {
    /// The common prefix, `iap` by default.
    public var prefix: String

    /// Creates the names under `prefix`.
    public init(prefix: String = "iap") {
        self.prefix = prefix
    }

    /// Uploads waiting for verification (first attempts and due retries).
    public var verify: String { "\(prefix).verify" }
    /// Verification results waiting for the finisher.
    public var results: String { "\(prefix).results" }
    /// Verify messages that could not be processed at all (undecodable, crashed).
    public var verifyDead: String { "\(prefix).verify.dead" }
    /// Result messages that could not be processed at all.
    public var resultsDead: String { "\(prefix).results.dead" }

    /// The topic exchange of events for the app's own services (`grant.created`, `grant.revoked`, `order.paid`).
    public var events: String { "\(prefix).events" }

    /// The delay queue that holds a retry for `seconds` before it returns to `verify`.
    public func verifyRetry(delaySeconds seconds: Int) -> String {
        "\(prefix).verify.retry.\(seconds)s"
    }
}

/// Priorities in the verify queue: first attempts are served before retries, so a backlog
/// of retries (an Apple outage) never delays a new upload.
public enum VerifyPriority {
    /// The highest priority the verify queue knows (`x-max-priority`).
    public static let maximum: UInt8 = 2
    /// An upload's first attempt.
    public static let firstAttempt: UInt8 = 2
    /// Every later attempt.
    public static let retry: UInt8 = 0
}

/// The growing delays between verification attempts, and how they are chosen.
public struct RetrySchedule: Sendable, Equatable {
    /// The delay before attempt 2, 3, …; the last one repeats.
    public var delaysSeconds: [Int]
    /// Each delay is spread by up to this fraction either way, so a burst of failures does
    /// not come back as one burst.
    public var jitter: Double

    /// Creates a schedule.
    public init(delaysSeconds: [Int] = [5, 30, 120, 600, 1800], jitter: Double = 0.1) {
        precondition(!delaysSeconds.isEmpty, "a retry schedule needs at least one delay")
        self.delaysSeconds = delaysSeconds
        self.jitter = min(max(jitter, 0), 0.2)
    }

    /// The delay level to wait after failed attempt number `attempt` (1-based): it names the delay queue.
    public func delaySeconds(afterAttempt attempt: Int) -> Int {
        delaysSeconds[min(max(attempt - 1, 0), delaysSeconds.count - 1)]
    }

    /// The actual wait for a level, with jitter, in milliseconds.
    public func jitteredDelayMilliseconds(level seconds: Int) -> Int64 {
        let base = Double(seconds) * 1000
        return Int64((base * (1 + Double.random(in: -jitter...jitter))).rounded())
    }
}
