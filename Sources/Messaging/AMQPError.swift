/// Every failure the `Messaging` module reports.
public struct AMQPError: Error, Sendable, CustomStringConvertible {
    /// What kind of failure, stable enough to switch on.
    public struct Code: RawRepresentable, Sendable, Hashable, CustomStringConvertible {
        public var rawValue: String
        public init(rawValue: String) { self.rawValue = rawValue }
        public var description: String { rawValue }

        /// The broker URL could not be read.
        public static let invalidURL = Code(rawValue: "invalid_url")
        /// The broker refused the message (`basic.nack`): it was not stored.
        public static let nacked = Code(rawValue: "nacked")
        /// The message matched no queue (returned as unroutable).
        public static let unroutable = Code(rawValue: "unroutable")
        /// The broker closed the channel while the message was unconfirmed (e.g. no such exchange).
        public static let channelClosed = Code(rawValue: "channel_closed")
        /// The delivery came from an earlier connection; the broker will deliver it again.
        public static let staleDelivery = Code(rawValue: "stale_delivery")
        /// The connection is shut down for good.
        public static let shutdown = Code(rawValue: "shutdown")
        /// The broker did not confirm in time; the message may or may not be stored.
        public static let timedOut = Code(rawValue: "timed_out")
        /// The caller's task was cancelled before the message was sent.
        public static let cancelled = Code(rawValue: "cancelled")
        /// The connection or a protocol operation failed.
        public static let connectionFailed = Code(rawValue: "connection_failed")
        /// A body's `content-encoding` is not one this module reads, the body is not what its
        /// encoding says, or (never seen) zlib could not encode one.
        public static let undecodable = Code(rawValue: "undecodable")
    }

    /// What kind of failure.
    public var code: Code
    /// A human-readable detail.
    public var message: String

    /// Creates an error.
    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }

    public var description: String { "AMQPError(\(code)): \(message)" }
}
