import Foundation

/// Where and how to reach the broker: one node, or the nodes of a cluster.
public struct AMQPConfiguration: Sendable, Equatable {
    /// One broker node and how to log in to it.
    public struct Node: Sendable, Equatable {
        /// Host name or address of the node.
        public var host: String
        /// TCP port, 5672 unless the URL says otherwise.
        public var port: Int
        /// Login name.
        public var user: String
        /// Login password.
        public var password: String
        /// Virtual host, `/` by default.
        public var virtualHost: String

        /// Reads one `amqp://user:password@host:port/vhost` URL.
        ///
        /// An empty path means the default virtual host `/`; `%2f` spells `/` explicitly.
        public init(url: String) throws(AMQPError) {
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
        }

        /// The URL without its password, for logs.
        public var redactedURL: String {
            "amqp://\(user)@\(host):\(port)/\(virtualHost == "/" ? "" : virtualHost)"
        }
    }

    /// The nodes to connect to, tried in turn (never empty). A connection starts with the
    /// first; one that is lost or refused moves on to the next, round-robin.
    public var nodes: [Node]
    /// Heartbeat interval negotiated with the broker, in seconds (0 disables heartbeats).
    public var heartbeatSeconds: Int
    /// Time allowed for the TCP connect and the AMQP handshake.
    public var connectTimeout: Duration
    /// First delay between reconnection attempts; doubles up to `maximumReconnectDelay`.
    /// With several nodes, the delay comes after each round in which every node failed.
    public var minimumReconnectDelay: Duration
    /// Longest delay between reconnection attempts.
    public var maximumReconnectDelay: Duration
    /// The name the broker shows for this connection.
    public var connectionName: String

    /// Reads an `amqp://user:password@host:port/vhost` URL, or several separated by commas
    /// (the nodes of one cluster, in the order they are tried).
    ///
    /// The heartbeat is at least one second: without heartbeats a broker that stops
    /// answering would hold the connection's thread until TCP gives up.
    public init(url: String, heartbeatSeconds: Int, connectionName: String = "iap") throws(AMQPError) {
        let parts = url.split(separator: ",", omittingEmptySubsequences: false)
            .map { $0.trimmingCharacters(in: .whitespaces) }
        var nodes: [Node] = []
        for (index, part) in parts.enumerated() {
            do throws(AMQPError) {
                nodes.append(try Node(url: part))
            } catch {
                guard parts.count > 1 else { throw error }
                throw AMQPError(.invalidURL, "URL \(index + 1) of \(parts.count): \(error.message)")
            }
        }
        self.nodes = nodes
        self.heartbeatSeconds = max(1, heartbeatSeconds)
        self.connectionName = connectionName
        self.connectTimeout = .seconds(5)
        self.minimumReconnectDelay = .milliseconds(200)
        self.maximumReconnectDelay = .seconds(5)
    }

    /// Host name or address of the first node.
    public var host: String {
        get { nodes[0].host }
        set { nodes[0].host = newValue }
    }

    /// TCP port of the first node.
    public var port: Int {
        get { nodes[0].port }
        set { nodes[0].port = newValue }
    }

    /// The URLs without their passwords, for logs (comma-separated for a cluster).
    public var redactedURL: String {
        nodes.map(\.redactedURL).joined(separator: ",")
    }
}
