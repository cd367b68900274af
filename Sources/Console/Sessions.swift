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

/// The sign-ins in progress, a cap of their own. When every slot is taken, the oldest
/// sign-in still waiting for its body gives way (its form read ends, and it is answered 400):
/// a form of about 100 bytes arrives with its headers, so half-sent sign-ins from any number
/// of addresses never keep out one that arrives whole.
final class SignInSlots: Sendable {
    private struct Slot {
        var id: UInt64
        var waitingForBody: Bool
        var evict: AsyncStream<Void>.Continuation
    }

    private let state = NIOLockedValueBox((next: UInt64(0), slots: [Slot]()))
    let capacity: Int

    init(capacity: Int) {
        self.capacity = max(1, capacity)
    }

    /// A slot, and what yields when it must give way; nil when every slot holds a sign-in
    /// whose body has arrived (each is done in moments).
    func acquire() -> (id: UInt64, evicted: AsyncStream<Void>)? {
        let (stream, continuation) = AsyncStream<Void>.makeStream()
        let (id, evicted) = state.withLockedValue { state -> (UInt64?, AsyncStream<Void>.Continuation?) in
            var evicted: AsyncStream<Void>.Continuation?
            if state.slots.count >= capacity {
                guard let oldest = state.slots.firstIndex(where: \.waitingForBody) else { return (nil, nil) }
                evicted = state.slots.remove(at: oldest).evict
            }
            state.next += 1
            state.slots.append(Slot(id: state.next, waitingForBody: true, evict: continuation))
            return (state.next, evicted)
        }
        evicted?.yield()
        evicted?.finish()
        guard let id else { return nil }
        return (id, stream)
    }

    /// The slot's body arrived: it no longer gives way.
    func bodyArrived(_ id: UInt64) {
        state.withLockedValue { state in
            if let index = state.slots.firstIndex(where: { $0.id == id }) { state.slots[index].waitingForBody = false }
        }
    }

    /// Gives the slot back (a no-op for one that gave way already).
    func release(_ id: UInt64) {
        let continuation = state.withLockedValue { state -> AsyncStream<Void>.Continuation? in
            guard let index = state.slots.firstIndex(where: { $0.id == id }) else { return nil }
            return state.slots.remove(at: index).evict
        }
        continuation?.finish()
    }

    /// Sign-ins in progress now.
    var count: Int { state.withLockedValue { $0.slots.count } }
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
