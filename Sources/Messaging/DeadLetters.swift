/// Reading and re-queueing what landed in a dead-letter queue (`iap admin dead-letters`).
public struct DeadLetters: Sendable {
    /// One dead message as an operator sees it.
    public struct Entry: Sendable {
        /// The message body.
        public var body: [UInt8]
        /// Why it was dead-lettered: ours (`x-iap-dead-reason`), else the broker's newest
        /// (`x-last-death-reason`: `rejected`, `delivery_limit`), when known.
        public var reason: String?
        /// The queue it came from (`x-iap-dead-from`, else `x-last-death-queue`), when known.
        public var from: String?
        /// Its message id.
        public var messageId: String?
        /// How `body` is encoded (AMQP's `content-encoding`), if its publisher said.
        public var contentEncoding: String?

        /// The body as its publisher wrote it (see `AMQPDelivery.decodedBody()`).
        public func decodedBody() throws(AMQPError) -> [UInt8] {
            try ContentEncoding.decode(body, named: contentEncoding)
        }
    }

    private let connection: AMQPConnection

    /// Works through `connection`.
    public init(connection: AMQPConnection) {
        self.connection = connection
    }

    /// The first `limit` messages of `queue`, left in place (requeued in order).
    public func list(_ queue: String, limit: Int) async throws(AMQPError) -> [Entry] {
        var held: [AMQPDelivery] = []
        do {
            while held.count < limit, let delivery = try await connection.get(queue) {
                held.append(delivery)
            }
        } catch {
            for delivery in held { try? await delivery.reject(requeue: true) }
            throw error
        }
        for delivery in held { try? await delivery.reject(requeue: true) }
        return held.map {
            Entry(
                body: $0.body, reason: $0.headers["x-iap-dead-reason"] ?? $0.headers["x-last-death-reason"],
                from: $0.headers["x-iap-dead-from"] ?? $0.headers["x-last-death-queue"],
                messageId: $0.messageId, contentEncoding: $0.contentEncoding)
        }
    }

    /// Moves up to `limit` messages from `queue` back to where they came from (or to
    /// `fallback` when that is unknown); each is acked only after its re-publish is confirmed.
    /// Returns how many moved.
    public func redrive(_ queue: String, fallback: String, limit: Int, priority: UInt8? = nil) async throws(AMQPError)
        -> Int
    {
        var moved = 0
        while moved < limit, let delivery = try await connection.get(queue) {
            var headers = delivery.headers
            let brokerReason = headers.removeValue(forKey: "x-last-death-reason")
            let brokerQueue = headers.removeValue(forKey: "x-last-death-queue")
            for key in ["x-last-death-exchange", "x-first-death-reason", "x-first-death-queue", "x-first-death-exchange",
                "x-delivery-count"]
            {
                headers[key] = nil
            }
            let target = headers.removeValue(forKey: "x-iap-dead-from") ?? brokerQueue ?? fallback
            headers["x-iap-redriven-reason"] = headers.removeValue(forKey: "x-iap-dead-reason") ?? brokerReason
            var message = OutgoingMessage(
                routingKey: target, body: delivery.body, headers: headers, messageId: delivery.messageId, priority: priority)
            message.contentEncoding = delivery.contentEncoding
            do {
                try await connection.publish(message)
                try await delivery.ack()
                moved += 1
            } catch {
                try? await delivery.reject(requeue: true)
                throw error
            }
        }
        return moved
    }
}
