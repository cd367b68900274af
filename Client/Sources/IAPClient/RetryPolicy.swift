import Foundation

/// How long the uploader waits before trying an entry again: growing delays with jitter and a
/// cap, `Retry-After` honoured, an alert after so many failures in a row.
public struct RetryPolicy: Sendable, Equatable {
    /// The wait after the first failure.
    public var initialDelay: TimeInterval
    /// Each further failure multiplies the wait by this.
    public var multiplier: Double
    /// No wait is longer (before `Retry-After`).
    public var maximumDelay: TimeInterval
    /// The share of each wait drawn at random (0 to 1): devices that failed together do not
    /// come back together.
    public var jitter: Double
    /// The longest `Retry-After` taken from a server: an answer cannot park the queue for days.
    public var maximumRetryAfter: TimeInterval
    /// Failures in a row after which the alert hook is called, once per entry.
    public var alertAfterFailures: Int
    /// The wait before reading again the status of an upload that is not final yet (`pending`).
    public var statusPollDelay: TimeInterval

    /// The defaults: 2 s, doubling, at most 10 minutes, half of it random, `Retry-After` up to an
    /// hour, an alert after 10 failures, a pending upload read again after 2 s.
    public init(
        initialDelay: TimeInterval = 2, multiplier: Double = 2, maximumDelay: TimeInterval = 600,
        jitter: Double = 0.5, maximumRetryAfter: TimeInterval = 3600, alertAfterFailures: Int = 10,
        statusPollDelay: TimeInterval = 2
    ) {
        self.initialDelay = max(0.001, initialDelay)
        self.multiplier = max(1, multiplier)
        self.maximumDelay = max(self.initialDelay, maximumDelay)
        self.jitter = min(1, max(0, jitter))
        self.maximumRetryAfter = max(0, maximumRetryAfter)
        self.alertAfterFailures = max(1, alertAfterFailures)
        self.statusPollDelay = max(0.001, statusPollDelay)
    }

    /// The wait in seconds (to the millisecond) after `failures` failures in a row (1 for the
    /// first): `initialDelay × multiplier^(failures-1)`, capped, its `jitter` share drawn from
    /// `random`; never shorter than the server's `Retry-After` (itself capped by
    /// `maximumRetryAfter`).
    public func delay(
        afterFailures failures: Int, retryAfter: TimeInterval? = nil, using random: inout some RandomNumberGenerator
    ) -> TimeInterval {
        let full = fullDelay(afterFailures: failures)
        var wait = full * (1 - jitter) + full * jitter * Double.random(in: 0...1, using: &random)
        if let retryAfter, retryAfter.isFinite {
            wait = max(wait, min(retryAfter, maximumRetryAfter))
        }
        return Self.milliseconds(wait)
    }

    /// The first and last waits `delay(afterFailures:)` can give without `Retry-After`.
    public func bounds(afterFailures failures: Int) -> ClosedRange<TimeInterval> {
        let full = fullDelay(afterFailures: failures)
        return Self.milliseconds(full * (1 - jitter))...Self.milliseconds(full)
    }

    /// In Double, clamped before it can overflow: 2^1000 failures still give the cap.
    private func fullDelay(afterFailures failures: Int) -> TimeInterval {
        let exponent = Double(min(max(failures, 1) - 1, 64))
        return min(maximumDelay, initialDelay * pow(multiplier, exponent))
    }

    private static func milliseconds(_ seconds: TimeInterval) -> TimeInterval {
        (seconds * 1000).rounded() / 1000
    }
}

extension QueueEntry {
    /// The order the uploader takes entries in: never uploaded first (a purchase nobody has
    /// heard of yet), then the fewest attempts, then the oldest.
    public static func uploadOrder(_ a: QueueEntry, _ b: QueueEntry) -> Bool {
        if (a.uploads == 0) != (b.uploads == 0) { return a.uploads == 0 }
        if a.attempts != b.attempts { return a.attempts < b.attempts }
        if a.addedAt != b.addedAt { return a.addedAt < b.addedAt }
        return a.transactionId < b.transactionId
    }
}
