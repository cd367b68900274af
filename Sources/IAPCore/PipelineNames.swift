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

    /// The delay queue that holds a retry for `seconds` before it returns to `verify`.
    public func verifyRetry(delaySeconds seconds: Int) -> String {
        "\(prefix).verify.retry.\(seconds)s"
    }
}

/// The growing delays between verification attempts, and how they are chosen.
public struct RetrySchedule: Sendable, Equatable {
    /// The delay before attempt 2, 3, …; the last one repeats.
    public var delaysSeconds: [Int]

    /// Creates a schedule.
    public init(delaysSeconds: [Int] = [5, 30, 120, 600, 1800]) {
        precondition(!delaysSeconds.isEmpty, "a retry schedule needs at least one delay")
        self.delaysSeconds = delaysSeconds
    }

    /// The delay to wait after failed attempt number `attempt` (1-based).
    public func delaySeconds(afterAttempt attempt: Int) -> Int {
        delaysSeconds[min(max(attempt - 1, 0), delaysSeconds.count - 1)]
    }
}
