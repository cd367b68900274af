import Foundation

/// The time as the client sees it: the wall clock in an app, a hand-turned one in tests.
public protocol ClientClock: Sendable {
    /// Now.
    func now() -> Date
    /// Returns at `deadline` (or at once when it is past); throws when the task is cancelled.
    func sleep(until deadline: Date) async throws
}

/// The wall clock.
public struct SystemClock: ClientClock {
    /// The wall clock.
    public init() {}

    public func now() -> Date { Date() }

    public func sleep(until deadline: Date) async throws {
        let wait = deadline.timeIntervalSinceNow
        guard wait > 0 else { return }
        try await Task.sleep(nanoseconds: UInt64(min(wait, 86_400 * 365) * 1_000_000_000))
    }
}

/// SplitMix64: a small seeded generator, so that a run's jitter can be replayed.
public struct SeededGenerator: RandomNumberGenerator, Sendable {
    private var state: UInt64

    /// A generator starting from `seed`.
    public init(seed: UInt64) {
        state = seed
    }

    public mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}
