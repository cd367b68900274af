import Crypto
import Foundation
import NIOConcurrencyHelpers

/// What a signed-in person may do.
public enum ConsoleRole: String, Sendable {
    /// Reads and acts (grants, revokes, redrives, notes).
    case operator_ = "operator"
    /// Reads only: every change answers 403.
    case viewer
}

/// One signed-in person: kept in memory only, so a restart signs everyone out.
struct ConsoleSession: Sendable {
    var id: String
    var role: ConsoleRole
    /// Who, for the audit log: the name given at sign-in, else the role.
    var actor: String
    /// Every form that changes something carries it; compared in constant time.
    var csrfToken: String
    var expiresAt: Date
    /// A message for the next page (what the last action did).
    var flash: Flash?

    struct Flash: Sendable {
        var kind: String
        var text: String
    }

    /// The CSRF token of one action (`note`, `revoke`, …, `logout`): an HMAC of the action's
    /// name under the session's secret, so a form's token is good for that form's action only.
    func csrfToken(for action: String) -> String {
        let code = HMAC<SHA256>.authenticationCode(for: Data(action.utf8), using: SymmetricKey(data: Data(csrfToken.utf8)))
        return Data(code).base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }
}

/// Sessions in memory, by a random id (the cookie's value).
final class ConsoleSessions: Sendable {
    private let sessions = NIOLockedValueBox([String: ConsoleSession]())
    let lifetime: TimeInterval

    init(lifetime: TimeInterval) {
        self.lifetime = lifetime
    }

    func create(role: ConsoleRole, actor: String, now: Date = Date()) -> ConsoleSession {
        let session = ConsoleSession(
            id: Self.randomToken(), role: role, actor: actor, csrfToken: Self.randomToken(),
            expiresAt: now.addingTimeInterval(lifetime))
        sessions.withLockedValue { all in
            all = all.filter { $0.value.expiresAt > now }
            all[session.id] = session
        }
        return session
    }

    func session(_ id: String?, now: Date = Date()) -> ConsoleSession? {
        guard let id else { return nil }
        return sessions.withLockedValue { all in
            guard let session = all[id] else { return nil }
            guard session.expiresAt > now else {
                all[id] = nil
                return nil
            }
            return session
        }
    }

    /// Takes the session's pending message, once.
    func takeFlash(_ id: String) -> ConsoleSession.Flash? {
        sessions.withLockedValue { all in
            let flash = all[id]?.flash
            all[id]?.flash = nil
            return flash
        }
    }

    func setFlash(_ id: String, kind: String, text: String) {
        sessions.withLockedValue { $0[id]?.flash = .init(kind: kind, text: text) }
    }

    func end(_ id: String) {
        sessions.withLockedValue { $0[id] = nil }
    }

    /// 32 random bytes, base64url.
    static func randomToken() -> String {
        let bytes = SymmetricKey(size: .bits256).withUnsafeBytes { Data($0) }
        return bytes.base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }

    /// Equal strings, compared through fixed-length digests without an early exit.
    static func constantTimeEqual(_ left: String, _ right: String) -> Bool {
        var difference: UInt8 = 0
        for (a, b) in zip(SHA256.hash(data: Data(left.utf8)), SHA256.hash(data: Data(right.utf8))) { difference |= a ^ b }
        return difference == 0
    }
}

/// Failed sign-ins per address: after `limit` failures within `window`, that address waits.
/// Each attempt is counted when it starts (`reserve`), before its body is read, and forgiven
/// only when it succeeds (`release`): guesses held back mid-body count like any other.
final class SignInLimiter: Sendable {
    private struct Attempt {
        var id: UInt64
        var at: Date
    }

    private let attempts = NIOLockedValueBox((next: UInt64(0), all: [String: [Attempt]]()))
    let limit: Int
    let window: TimeInterval

    init(limit: Int = 5, window: TimeInterval = 300) {
        self.limit = limit
        self.window = window
    }

    /// Counts an attempt from `address`: its id, or nil when the address must wait.
    func reserve(_ address: String, now: Date = Date()) -> UInt64? {
        attempts.withLockedValue { state in
            if state.all.count > 10_000 {
                state.all = state.all.filter { ($0.value.last.map { now.timeIntervalSince($0.at) } ?? window) < window }
            }
            let recent = (state.all[address] ?? []).filter { now.timeIntervalSince($0.at) < window }
            guard recent.count < limit else {
                state.all[address] = recent
                return nil
            }
            state.next += 1
            state.all[address] = recent + [Attempt(id: state.next, at: now)]
            return state.next
        }
    }

    /// Forgives a reserved attempt that signed in.
    func release(_ id: UInt64) {
        attempts.withLockedValue { state in
            for (address, list) in state.all where list.contains(where: { $0.id == id }) {
                let left = list.filter { $0.id != id }
                state.all[address] = left.isEmpty ? nil : left
            }
        }
    }

    /// Seconds to wait before the next try, or nil when the address may try now.
    func retryAfter(_ address: String, now: Date = Date()) -> Int? {
        attempts.withLockedValue { state in
            let recent = (state.all[address] ?? []).filter { now.timeIntervalSince($0.at) < window }
            guard recent.count >= limit, let oldest = recent.first else { return nil }
            return max(1, Int((window - now.timeIntervalSince(oldest.at)).rounded(.up)))
        }
    }
}

/// Each change form carries a one-time key: the first post does the work, a second post of the
/// same form (a double click, a reload) is told what the first did.
final class IdempotencyKeys: Sendable {
    enum Claim {
        case first
        case inProgress
        case done(String)
    }

    private let keys = NIOLockedValueBox([String: (outcome: String?, at: Date)]())

    func claim(_ key: String, now: Date = Date()) -> Claim {
        keys.withLockedValue { all in
            if let existing = all[key] {
                return existing.outcome.map(Claim.done) ?? .inProgress
            }
            if all.count > 50_000 { all = all.filter { now.timeIntervalSince($0.value.at) < 86_400 } }
            all[key] = (nil, now)
            return .first
        }
    }

    func finish(_ key: String, outcome: String) {
        keys.withLockedValue { $0[key] = (outcome, Date()) }
    }

    /// The work failed before it changed anything: the form may be sent again.
    func release(_ key: String) {
        keys.withLockedValue { $0[key] = nil }
    }
}
