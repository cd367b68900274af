import Foundation
import IAPCore
public import Hummingbird
public import NIOCore

/// The intake's request context: the peer's address (for per-address limits) and, once
/// authenticated, the user the request acts for.
public struct IntakeContext: RequestContext, RemoteAddressRequestContext {
    public var coreContext: CoreRequestContextStorage
    /// The TCP peer.
    public let remoteAddress: SocketAddress?
    /// The user the request acts for: the token's `sub`, or with authentication off the user
    /// the query or path names; nil when neither says.
    public var userId: String?
    /// With authentication off, the per-user rate limit still to apply once a body names the user.
    var pendingUserLimit: RateLimiter?

    public init(source: ApplicationRequestContextSource) {
        coreContext = .init(source: source)
        remoteAddress = source.channel.remoteAddress
    }
}

extension IntakeContext {
    /// A path parameter, percent-decoded: the router hands it over as the client encoded it,
    /// and an id such as `aña` or `a b` arrives as `a%C3%B1a` or `a%20b`. An id no user, order
    /// or purchase can have (`IdentifierText`, longer than 256 characters) is refused with 400
    /// `invalid_field`.
    func pathParameter(_ name: String) throws -> String {
        let raw = try parameters.require(name)
        let value = raw.removingPercentEncoding ?? raw
        if let problem = IdentifierText.problem(value) { throw APIError.invalidField(name, problem) }
        guard value.utf8.count <= 256 || value.unicodeScalars.count <= 256 else {
            throw APIError.invalidField(name, "is longer than 256 characters")
        }
        return value
    }
}
