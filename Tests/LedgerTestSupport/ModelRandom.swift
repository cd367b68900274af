import Foundation
import IAPCore

// MARK: - A seeded generator

/// Draws from `SplitMix64`: every sequence from its own seed, the same on every machine and
/// toolchain (the standard library's `random(in:using:)` may change its algorithm; these
/// functions do not).
struct ModelRandom {
    private var generator: SplitMix64

    init(seed: UInt64) { generator = SplitMix64(seed: seed) }

    mutating func next() -> UInt64 { generator.next() }

    /// A number in `0..<bound`.
    mutating func below(_ bound: Int) -> Int { Int(next() % UInt64(max(bound, 1))) }

    /// A number in `range`.
    mutating func within(_ range: ClosedRange<Int>) -> Int { range.lowerBound + below(range.count) }

    /// True with probability `percent` / 100.
    mutating func chance(_ percent: Int) -> Bool { below(100) < percent }

    mutating func pick<T>(_ items: [T]) -> T { items[below(items.count)] }

    /// A lowercased UUID made of drawn bits (an `appAccountToken`).
    mutating func uuid() -> String {
        let high = next()
        let low = next()
        let bytes = (0..<8).map { UInt8(truncatingIfNeeded: high >> (8 * $0)) } + (0..<8).map { UInt8(truncatingIfNeeded: low >> (8 * $0)) }
        let uuid = UUID(
            uuid: (
                bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5], bytes[6] & 0x0F | 0x40, bytes[7],
                bytes[8] & 0x3F | 0x80, bytes[9], bytes[10], bytes[11], bytes[12], bytes[13], bytes[14], bytes[15]
            ))
        return uuid.uuidString.lowercased()
    }

    /// The base of the random seeds: fixed (reproducible CI) unless IAP_TEST_MODEL_SEED says.
    static var base: UInt64 {
        ProcessInfo.processInfo.environment["IAP_TEST_MODEL_SEED"].flatMap(parse) ?? 0x1ED6_E5A0_DE15_0001
    }

    /// A seed as the fixtures and messages write it (`0x…`).
    static func hex(_ seed: UInt64) -> String { "0x" + String(seed, radix: 16, uppercase: false) }

    /// A seed written in hexadecimal (`0x…`) or decimal.
    static func parse(_ text: String) -> UInt64? {
        let trimmed = text.trimmingCharacters(in: .whitespaces).lowercased()
        return trimmed.hasPrefix("0x") ? UInt64(trimmed.dropFirst(2), radix: 16) : UInt64(trimmed)
    }

    /// The seed of sequence `index` of a run with `base`, distinct per restore policy.
    static func sequenceSeed(base: UInt64, policy: RestorePolicy, index: Int) -> UInt64 {
        var generator = ModelRandom(seed: base ^ (policy == .keep ? 0 : 0x5452_414E_5346_4552) ^ (UInt64(index) &* 0xD1B5_4A32_D192_ED03))
        return generator.next()
    }
}

/// A small seeded generator, so that a failing case can be replayed.
struct SplitMix64: RandomNumberGenerator {
    var state: UInt64

    init(seed: UInt64) {
        state = seed
    }

    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}
