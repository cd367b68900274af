public import Foundation
import Synchronization

/// Failed attempts at a secret (an admin token, a console sign-in) per client address.
///
/// Each attempt counts when it starts (`reserve`), before its body is read, and is forgiven
/// only when it succeeds (`release`): guesses held back mid-body count like any other. After
/// `limit` attempts within `window`, the address is locked: its attempts are refused before
/// anything is checked, except one every `lockedInterval`, which is checked like any other.
///
/// That one check is what a stranger behind the same address (an office NAT, a proxy without
/// `IAP_CLIENT_IP_HEADER`) cannot take from an operator for long: the right token gets through
/// a lockout the stranger caused as soon as the stranger pauses for `lockedInterval`. The cost:
/// a locked address may still guess once per `lockedInterval` (with 32-character tokens, no help
/// to a guesser), and a stranger who keeps guessing faster than that from the operator's own
/// address keeps crowding the operator out.
public final class FailedAttempts: Sendable {
    /// What `reserve` decided.
    public enum Admission: Sendable, Equatable {
        /// Check the secret; `release(id)` when it is right.
        case attempt(id: UInt64)
        /// Locked out: refuse without checking; the whole seconds to wait.
        case refused(retryAfter: Int)
    }

    private struct Attempt {
        var id: UInt64
        var at: Date
    }

    private struct State {
        var next: UInt64 = 0
        var attempts: [String: [Attempt]] = [:]
        /// When a locked address last had its one check.
        var lockedChecks: [String: Date] = [:]
    }

    private let state = Mutex(State())
    /// Attempts an address may make within `window` before it is locked.
    public let limit: Int
    /// How long an attempt counts, in seconds.
    public let window: TimeInterval
    /// How often a locked address still has one attempt checked, in seconds.
    public let lockedInterval: TimeInterval
    private let maxAddresses: Int

    /// Creates a limiter: five attempts in five minutes, then one every two seconds. A `limit`
    /// of `Int.max` counts nothing.
    public init(limit: Int = 5, window: TimeInterval = 300, lockedInterval: TimeInterval = 2, maxAddresses: Int = 10_000) {
        self.limit = limit
        self.window = window
        self.lockedInterval = lockedInterval
        self.maxAddresses = maxAddresses
    }

    /// Counts an attempt from `address`, or refuses it when the address is locked and has had
    /// its one check within `lockedInterval`.
    public func reserve(_ address: String, now: Date = Date()) -> Admission {
        state.withLock { state in
            state.next += 1
            // Unlimited (`Int.max`): nothing is kept.
            if limit == .max { return .attempt(id: state.next) }
            if state.attempts.count > maxAddresses {
                state.attempts = state.attempts.filter { ($0.value.last.map { now.timeIntervalSince($0.at) } ?? window) < window }
                state.lockedChecks = state.lockedChecks.filter { now.timeIntervalSince($0.value) < lockedInterval }
            }
            let recent = (state.attempts[address] ?? []).filter { now.timeIntervalSince($0.at) < window }
            if recent.count >= limit {
                if let last = state.lockedChecks[address], now.timeIntervalSince(last) < lockedInterval {
                    state.attempts[address] = recent
                    let lockedFor = recent.first.map { window - now.timeIntervalSince($0.at) } ?? window
                    return .refused(retryAfter: max(1, Int(min(lockedFor, lockedInterval).rounded(.up))))
                }
                state.lockedChecks[address] = now
            }
            // A locked address's list stays at `limit` entries: the oldest gives way.
            state.attempts[address] = Array((recent + [Attempt(id: state.next, at: now)]).suffix(limit))
            return .attempt(id: state.next)
        }
    }

    /// Forgives an attempt that proved the secret.
    public func release(_ id: UInt64) {
        state.withLock { state in
            for (address, list) in state.attempts where list.contains(where: { $0.id == id }) {
                let left = list.filter { $0.id != id }
                state.attempts[address] = left.isEmpty ? nil : left
            }
        }
    }

    /// Whether `address` is locked now (its attempts are refused but for one per `lockedInterval`).
    public func isLocked(_ address: String, now: Date = Date()) -> Bool {
        state.withLock { state in
            (state.attempts[address] ?? []).filter { now.timeIntervalSince($0.at) < window }.count >= limit
        }
    }
}
