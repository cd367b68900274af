/// A message to publish.
public struct OutgoingMessage: Sendable, Equatable {
    /// Exchange to publish to; `""` is the default exchange (routing key = queue name).
    public var exchange: String
    /// Routing key.
    public var routingKey: String
    /// The payload.
    public var body: [UInt8]
    /// String headers carried with the message.
    public var headers: [String: String]
    /// MIME type of the body.
    public var contentType: String
    /// A message id for tracing.
    public var messageId: String?
    /// Priority in a queue declared with `x-max-priority` (higher is served first).
    public var priority: UInt8?
    /// Time after which the broker dead-letters the message (per-message TTL).
    public var expiration: Duration?
    /// Whether a message that reaches no queue fails its publish (`unroutable`). True for work
    /// queues, where it would be lost; false for events nobody may subscribe to yet.
    public var mandatory: Bool = true
    /// How `body` is encoded (AMQP's `content-encoding`: a `ContentEncoding` raw value), or
    /// nil for a body as it is.
    public var contentEncoding: String?

    /// Creates a persistent message.
    public init(
        exchange: String = "", routingKey: String, body: [UInt8], headers: [String: String] = [:],
        contentType: String = "application/json", messageId: String? = nil, priority: UInt8? = nil,
        expiration: Duration? = nil
    ) {
        self.exchange = exchange
        self.routingKey = routingKey
        self.body = body
        self.headers = headers
        self.contentType = contentType
        self.messageId = messageId
        self.priority = priority
        self.expiration = expiration
    }
}

/// A message handed to a consumer. Settle it exactly once with `ack()` or `reject(requeue:)`.
public struct AMQPDelivery: Sendable {
    /// The payload.
    public var body: [UInt8]
    /// Headers whose values are strings or numbers, as strings.
    public var headers: [String: String]
    /// The exchange the message was published to.
    public var exchange: String
    /// The routing key it was published with.
    public var routingKey: String
    /// Whether the broker delivered it before (to this or another consumer).
    public var redelivered: Bool
    /// The message id, if the publisher set one.
    public var messageId: String?
    /// How `body` is encoded (AMQP's `content-encoding`), if the publisher said.
    public var contentEncoding: String?

    /// The body as its publisher wrote it, decoded when the message names a content
    /// encoding; throws `undecodable` for an encoding this module does not read, or a body
    /// that is not what its encoding says.
    public func decodedBody() throws(AMQPError) -> [UInt8] {
        try ContentEncoding.decode(body, named: contentEncoding)
    }

    let deliveryTag: UInt64
    let channel: UInt16
    let generation: UInt64
    /// Which opening of its channel it came on (a channel can be reopened within a connection).
    let channelEpoch: UInt64
    let mailbox: Mailbox

    /// Tells the broker the message is handled; it will not be delivered again.
    ///
    /// - Important: Ack only after every effect of the message is durable
    ///   (a result confirmed by the broker, a database commit).
    ///   Throws `staleDelivery` when the connection was lost since the delivery:
    ///   the broker then delivers the message again.
    public func ack() async throws(AMQPError) {
        try await mailbox.settle(.ack, delivery: self)
    }

    /// Gives the message back: to the queue when `requeue` is true, else to the queue's
    /// dead-letter exchange.
    public func reject(requeue: Bool) async throws(AMQPError) {
        try await mailbox.settle(requeue ? .requeue : .deadLetter, delivery: self)
    }
}

/// Publishes a message and returns once the broker confirmed it: a broker connection, or a
/// stand-in where a test needs no broker.
public protocol MessagePublisher: Sendable {
    func publish(_ message: OutgoingMessage) async throws
}

extension AMQPConnection: MessagePublisher {}
