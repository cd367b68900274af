import Foundation

/// Where and how to reach the broker.
public struct AMQPConfiguration: Sendable, Equatable {
    /// Host name or address of the broker.
    public var host: String
    /// TCP port, 5672 unless the URL says otherwise.
    public var port: Int
    /// Login name.
    public var user: String
    /// Login password.
    public var password: String
    /// Virtual host, `/` by default.
    public var virtualHost: String
    /// Heartbeat interval negotiated with the broker, in seconds (0 disables heartbeats).
    public var heartbeatSeconds: Int
    /// Time allowed for the TCP connect and the AMQP handshake.
    public var connectTimeout: Duration
    /// First delay between reconnection attempts; doubles up to `maximumReconnectDelay`.
    public var minimumReconnectDelay: Duration
    /// Longest delay between reconnection attempts.
    public var maximumReconnectDelay: Duration
    /// The name the broker shows for this connection.
    public var connectionName: String

    /// Reads an `amqp://user:password@host:port/vhost` URL.
    ///
    /// An empty path means the default virtual host `/`; `%2f` spells `/` explicitly.
    ///
    /// The heartbeat is at least one second: without heartbeats a broker that stops
    /// answering would hold the connection's thread until TCP gives up.
    public init(url: String, heartbeatSeconds: Int = 10, connectionName: String = "iap") throws(AMQPError) {
        guard let components = URLComponents(string: url), components.scheme == "amqp",
            let host = components.host, !host.isEmpty
        else {
            throw AMQPError(.invalidURL, "expected amqp://user:password@host:port/vhost")
        }
        self.host = host
        self.port = components.port ?? 5672
        self.user = components.user.flatMap { $0.removingPercentEncoding } ?? "guest"
        self.password = components.password.flatMap { $0.removingPercentEncoding } ?? "guest"
        let path = components.percentEncodedPath
        let vhost = path.hasPrefix("/") ? String(path.dropFirst()) : path
        self.virtualHost = vhost.isEmpty ? "/" : (vhost.removingPercentEncoding ?? vhost)
        self.heartbeatSeconds = max(1, heartbeatSeconds)
        self.connectionName = connectionName
        self.connectTimeout = .seconds(5)
        self.minimumReconnectDelay = .milliseconds(200)
        self.maximumReconnectDelay = .seconds(5)
    }

    /// The URL without its password, for logs.
    public var redactedURL: String {
        "amqp://\(user)@\(host):\(port)/\(virtualHost == "/" ? "" : virtualHost)"
    }
}
