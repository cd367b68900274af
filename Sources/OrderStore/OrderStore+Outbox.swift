import Foundation

/// A message to be published once the transaction that wrote it has committed.
public struct OutboxMessage: Sendable, Equatable {
    /// Row id; assigned by the store.
    public var id: Int64?
    /// Exchange to publish to (`""` for the default exchange).
    public var exchange: String
    /// Routing key (a queue name on the default exchange).
    public var routingKey: String
    /// The encoded envelope.
    public var body: [UInt8]
    /// A message id for tracing.
    public var messageId: String?
    /// The message's priority, for priority queues.
    public var priority: UInt8?
    /// Whether an unroutable message is an error (true for work queues, false for events).
    public var mandatory: Bool
    /// Failed publish attempts so far.
    public var attempts: Int

    /// Creates a message for the outbox.
    public init(
        exchange: String = "", routingKey: String, body: [UInt8], messageId: String? = nil, priority: UInt8? = nil
    ) {
        self.id = nil
        self.exchange = exchange
        self.routingKey = routingKey
        self.body = body
        self.messageId = messageId
        self.priority = priority
        self.mandatory = true
        self.attempts = 0
    }
}

extension OrderStore {
    /// The oldest unpublished messages, at most `limit`.
    public func unpublishedMessages(limit: Int) async throws -> [OutboxMessage] {
        try await database.read { db in
            try db.rows(sql: """
                    SELECT id, exchange, routingKey, body, messageId, priority, mandatory, attempts FROM outbox
                    ORDER BY id LIMIT ?
                    """,
                arguments: [limit]
            ).map { row in
                var message = OutboxMessage(
                    exchange: row["exchange"], routingKey: row["routingKey"], body: [UInt8](row["body"] as Data),
                    messageId: row["messageId"], priority: (row["priority"] as Int?).map { UInt8(clamping: $0) })
                message.id = row["id"]
                message.mandatory = row["mandatory"]
                message.attempts = row["attempts"]
                return message
            }
        }
    }

    /// Forgets messages the broker confirmed.
    public func markPublished(_ ids: [Int64]) async throws {
        guard !ids.isEmpty else { return }
        try await database.write { db in
            try db.execute(
                sql: "DELETE FROM outbox WHERE id IN (\(sqlMarks(ids.count)))",
                arguments: SQLArguments(ids))
        }
    }

    /// Records a failed publish; the message stays for the next round.
    public func markPublishFailed(_ id: Int64, error: String) async throws {
        try await database.write { db in
            try db.execute(
                sql: "UPDATE outbox SET attempts = attempts + 1, lastError = ? WHERE id = ?", arguments: [error, id])
        }
    }

    /// How many messages wait to be published.
    public func outboxBacklog() async throws -> Int {
        try await database.read { db in try Int.fetchOne(db, sql: "SELECT COUNT(*) FROM outbox") ?? 0 }
    }

    static func insert(_ message: OutboxMessage, now: Date, in db: any SQLConnection) throws {
        try db.executeCached(
            sql: """
                INSERT INTO outbox (exchange, routingKey, body, messageId, priority, mandatory, createdAt)
                VALUES (?, ?, ?, ?, ?, ?, ?)
                """,
            arguments: [
                message.exchange, message.routingKey, Data(message.body), message.messageId,
                message.priority.map { Int($0) }, message.mandatory, now,
            ])
    }
}
