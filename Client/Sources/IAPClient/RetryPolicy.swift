import Foundation

/// How long the uploader waits before trying an entry again: growing delays with jitter and a
/// cap, `Retry-After` honoured, an alert after so many failures in a row.
public struct RetryPolicy: Sendable, Equatable {
    /// The wait after the first failure.
    public var initialDelay: Duration
    /// Each further failure multiplies the wait by this.
    public var multiplier: Double
    /// No wait is longer (before `Retry-After`).
    public var maximumDelay: Duration
    /// The share of each wait drawn at random (0 to 1): devices that failed together do not
    /// come back together.
    public var jitter: Double
    /// The longest `Retry-After` taken from a server: an answer cannot park the queue for days.
    public var maximumRetryAfter: Duration
    /// Failures in a row after which the alert hook is called, once per entry.
    public var alertAfterFailures: Int
    /// The wait before reading again the status of an upload that is not final yet (`pending`).
    public var statusPollDelay: Duration

    /// The defaults: 2 s, doubling, at most 10 minutes, half of it random, `Retry-After` up to an
    /// hour, an alert after 10 failures, a pending upload read again after 2 s.
    public init(
        initialDelay: Duration = .seconds(2), multiplier: Double = 2, maximumDelay: Duration = .seconds(600),
        jitter: Double = 0.5, maximumRetryAfter: Duration = .seconds(3600), alertAfterFailures: Int = 10,
        statusPollDelay: Duration = .seconds(2)
    ) {
        self.initialDelay = initialDelay
        self.multiplier = max(1, multiplier)
        self.maximumDelay = max(initialDelay, maximumDelay)
        self.jitter = min(1, max(0, jitter))
        self.maximumRetryAfter = maximumRetryAfter
        self.alertAfterFailures = max(1, alertAfterFailures)
        self.statusPollDelay = statusPollDelay
    }

    /// The wait after `failures` failures in a row (1 for the first): `initialDelay ×
    /// multiplier^(failures-1)`, capped, its `jitter` share drawn from `random`; never shorter
    /// than the server's `Retry-After` (itself capped by `maximumRetryAfter`).
    public func delay(
        afterFailures failures: Int, retryAfter: Duration? = nil, using random: inout some RandomNumberGenerator
    ) -> Duration {
        let cap = Self.seconds(maximumDelay)
        // In Double, clamped before it can overflow: 2^1000 failures still give the cap.
        let exponent = Double(min(max(failures, 1) - 1, 64))
        let full = min(cap, Self.seconds(initialDelay) * pow(multiplier, exponent))
        let fixed = full * (1 - jitter)
        let drawn = full * jitter * Double.random(in: 0...1, using: &random)
        var wait = fixed + drawn
        if let retryAfter {
            wait = max(wait, min(Self.seconds(retryAfter), Self.seconds(maximumRetryAfter)))
        }
        return .milliseconds(Int64((wait * 1000).rounded()))
    }

    /// The first and last waits `delay(afterFailures:)` can give without `Retry-After`.
    public func bounds(afterFailures failures: Int) -> ClosedRange<Duration> {
        let exponent = Double(min(max(failures, 1) - 1, 64))
        let full = min(Self.seconds(maximumDelay), Self.seconds(initialDelay) * pow(multiplier, exponent))
        return .milliseconds(Int64((full * (1 - jitter) * 1000).rounded()))...(.milliseconds(Int64((full * 1000).rounded())))
    }

    static func seconds(_ duration: Duration) -> Double {
        let parts = duration.components
        return Double(parts.seconds) + Double(parts.attoseconds) / 1e18
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
