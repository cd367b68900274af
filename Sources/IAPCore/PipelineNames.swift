/// The kind of queues the pipeline declares.
public enum QueueType: Sendable, Equatable {
    /// Classic queues on one node; `verify` is a priority queue (first attempts before retries).
    case classic
    /// Quorum queues, replicated across a cluster. They have no priorities, so due retries
    /// wait in a queue of their own (`verifyRetries`) that verifiers serve only when no first
    /// attempt is waiting. A message delivered `deliveryLimit` times without being settled
    /// (a verifier that crashes on it, or keeps giving it back) is dead-lettered.
    case quorum(deliveryLimit: Int)

    /// The delivery limit of quorum queues when none is configured.
    public static let defaultDeliveryLimit = Setting.queueDeliveryLimit.defaultInt
}

/// The names of the queues the roles share, all under one prefix so that
/// several pipelines (or test runs) can share one broker, and the kind of those queues
/// (which decides where a retry waits).
public struct PipelineNames: Sendable, Equatable {
    /// The common prefix, `iap` by default.
    public var prefix: String
    /// Classic (one node) or quorum (a cluster) queues.
    public var queueType: QueueType

    /// Creates the names under `prefix`.
    public init(prefix: String = Setting.queuePrefix.defaultText, queueType: QueueType = .classic) {
        self.prefix = prefix
        self.queueType = queueType
    }

    /// Uploads waiting for verification: first attempts, and with classic queues due retries too.
    public var verify: String { "\(prefix).verify" }
    /// Due retries waiting for verification, with quorum queues only (classic queues keep
    /// them in `verify` at a lower priority).
    public var verifyRetries: String { "\(prefix).verify.retries" }

    /// Whether due retries have a queue of their own (`verifyRetries`).
    public var separatesRetries: Bool {
        if case .quorum = queueType { return true }
        return false
    }

    /// The queue a verify message of `priority` is published to: `verify`, or `verifyRetries`
    /// for a retry when retries have a queue of their own.
    public func verifyQueue(priority: UInt8) -> String {
        separatesRetries && priority < VerifyPriority.firstAttempt ? verifyRetries : verify
    }

    /// Every queue that holds uploads waiting for verification.
    public var verifyQueues: [String] { separatesRetries ? [verify, verifyRetries] : [verify] }
    /// Verification results waiting for the finisher.
    public var results: String { "\(prefix).results" }
    /// The app's reports for Apple's refund requests (how much of a purchase was used, the
    /// user's consent), published by the app's own services; the order service records them.
    public var consumption: String { "\(prefix).consumption" }
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
    public init(delaysSeconds: [Int] = Setting.retryDelays.defaultText.split(separator: ",").compactMap { Int($0) }, jitter: Double = 0.1) {
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
