import Hummingbird
import NIOCore

/// The intake's request context: the peer's address (for per-address limits) and, once
/// authenticated, the user the request acts for.
public struct IntakeContext: RequestContext, RemoteAddressRequestContext {
    public var coreContext: CoreRequestContextStorage
    /// The TCP peer.
    public let remoteAddress: SocketAddress?
    /// The authenticated user (the token's `sub`); nil when authentication is off.
    public var userId: String?

    public init(source: ApplicationRequestContextSource) {
        coreContext = .init(source: source)
        remoteAddress = source.channel.remoteAddress
    }
}
