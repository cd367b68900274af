import Foundation

/// What went wrong talking to the order service or the store.
public struct IAPClientError: Error, Sendable, Equatable, CustomStringConvertible {
    /// The kind of trouble, which says whether asking again can help.
    public enum Kind: String, Sendable, Equatable {
        /// No answer: no connection, a timeout, an answer cut short or unreadable. Try again later.
        case unreachable
        /// The service answered that it cannot now (408, 429, 5xx). Try again later.
        case unavailable
        /// The service refused the request (a 4xx with an error code). Asking again the same way
        /// gets the same answer.
        case refused
        /// No user is signed in (`IAPClient.signIn`).
        case notSignedIn
    }

    /// The kind of trouble.
    public var kind: Kind
    /// The HTTP status, when there was an answer.
    public var status: Int?
    /// The service's error code (`unknown_product`, `rate_limited`, …), when it gave one.
    public var code: String?
    /// What happened, for people.
    public var message: String
    /// The wait the service asked for (`Retry-After`), in seconds.
    public var retryAfter: TimeInterval?

    /// An error.
    public init(kind: Kind, status: Int? = nil, code: String? = nil, message: String, retryAfter: TimeInterval? = nil) {
        self.kind = kind
        self.status = status
        self.code = code
        self.message = message
        self.retryAfter = retryAfter
    }

    /// Whether asking again later can succeed.
    public var isTransient: Bool { kind == .unreachable || kind == .unavailable }

    public var description: String {
        [kind.rawValue, status.map { "HTTP \($0)" }, code, message].compactMap { $0 }.joined(separator: ": ")
    }
}
