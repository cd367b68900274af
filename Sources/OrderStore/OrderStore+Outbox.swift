public import Foundation
public import IAPCore
import Store

/// A message to be published once the transaction that wrote it has committed.
public struct OutboxMessage: Sendable, Equatable {
    /// Row id; assigned by the store.
    public var id: Int64?
    /// Exchange to publish to (`""` for the default exchange).
    public var exchange: String
    /// Routing key (a queue name on the default exchange).
    public var routingKey: String
    /// The encoded envelope; empty for a verify request built from its submission (`request`).
    public var body: [UInt8]
    /// The submission whose verify request this message carries, built from its row when the
    /// message is published, so the receipt is stored once; nil: `body` is the whole message.
    public var submissionId: SubmissionID?
    /// Filled by `claimUnpublished` for a message that names its submission: the request to
    /// encode (its next attempt); nil when the submission is gone.
    public var request: VerifyRequest?
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

    /// The message that asks for `request`'s verification on `routingKey`: it names the
    /// submission, whose row the relay builds the message from when it publishes.
    public static func verify(_ request: VerifyRequest, routingKey: String, priority: UInt8) -> OutboxMessage {
        var message = OutboxMessage(
            routingKey: routingKey, body: [], messageId: request.submissionId.uuidString, priority: priority)
        message.submissionId = request.submissionId
        return message
    }
}

extension OrderStore {
    /// Whether a relay renews its claims while it publishes them: on PostgreSQL, where the
    /// relays of other order services take over a claim whose lease ran out; a SQLite store's one
    /// relay claims nothing.
    public var claimsLapse: Bool { database.dialect == .postgres }

    /// The oldest unpublished messages, at most `limit`, claimed for `relay` until `lease` has
    /// passed: several order services relay one PostgreSQL outbox at once.
    ///
    /// Work messages (verify requests) go to whichever relay claims them first; rows another
    /// relay holds are skipped (`FOR UPDATE SKIP LOCKED`), and a relay that died lets its
    /// claims lapse. Events keep their commit order across relays: a relay claims the oldest
    /// events only while no other relay holds a claim on any of them.
    ///
    /// A SQLite store has one order service, so one relay, which claims nothing: it reads the
    /// oldest rows, as a restart after a crash must too (and writes nothing the writer of
    /// uploads and results would wait for).
    public func claimUnpublished(
        limit: Int, relay: String, lease: TimeInterval = 30, now: Date = Date()
    ) async throws -> [OutboxMessage] {
        if database.dialect == .sqlite {
            return try await database.read { db in
                let rows = try await db.rows(sql: "SELECT * FROM outbox ORDER BY id LIMIT ?", arguments: [limit])
                return try await Self.withRequests(rows.map(Self.outboxMessage), in: db)
            }
        }
        return try await database.writeQueues { db in
            let work = try await db.rows(
                sql: """
                    SELECT * FROM outbox
                    WHERE mandatory = 1 AND (claimedUntil IS NULL OR claimedUntil < ? OR claimedBy = ?)
                    ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED
                    """,
                arguments: [now, relay, limit])
            var events = try await db.rows(
                sql: "SELECT * FROM outbox WHERE mandatory = 0 ORDER BY id LIMIT ? FOR UPDATE",
                arguments: [max(1, limit - work.count)])
            if events.contains(where: { row in
                (row["claimedUntil"] as Date?).map { $0 >= now } == true && (row["claimedBy"] as String?) != relay
            }) {
                events = []
            }
            let rows = (work + events).sorted { ($0["id"] as Int64) < ($1["id"] as Int64) }
            guard !rows.isEmpty else { return [] }
            let ids = rows.map { $0["id"] as Int64 }
            try await db.execute(
                sql: "UPDATE outbox SET claimedBy = ?, claimedUntil = ? WHERE id IN (\(sqlMarks(ids.count)))",
                arguments: SQLArguments(values: [relay.sqlValue, now.addingTimeInterval(lease).sqlValue] + ids.map(\.sqlValue)))
            return try await Self.withRequests(rows.map(Self.outboxMessage), in: db)
        }
    }

    /// Extends `relay`'s claims on `ids` to `lease` from now, while it is still publishing
    /// them (a publish waiting for a broker can outlast one lease; another relay taking the
    /// rows then would send them twice and events out of order). Nothing to do on SQLite.
    public func renewClaims(_ ids: [Int64], relay: String, lease: TimeInterval = 30, now: Date = Date()) async throws {
        guard database.dialect == .postgres, !ids.isEmpty else { return }
        try await database.writeQueues { db in
            try await db.execute(
                sql: "UPDATE outbox SET claimedUntil = ? WHERE claimedBy = ? AND id IN (\(sqlMarks(ids.count)))",
                arguments: SQLArguments(values: [now.addingTimeInterval(lease).sqlValue, relay.sqlValue] + ids.map(\.sqlValue)))
        }
    }

    /// Gives up `relay`'s claims on `ids` (rows it did not get to publish), so that any relay
    /// may take them at once rather than after the lease.
    public func releaseClaims(_ ids: [Int64], relay: String) async throws {
        guard database.dialect == .postgres, !ids.isEmpty else { return }
        try await database.writeQueues { db in
            try await db.execute(
                sql: "UPDATE outbox SET claimedUntil = NULL WHERE claimedBy = ? AND id IN (\(sqlMarks(ids.count)))",
                arguments: SQLArguments(values: [relay.sqlValue] + ids.map(\.sqlValue)))
        }
    }

    /// A row of `outbox` as a message.
    private static func outboxMessage(_ row: SQLRow) -> OutboxMessage {
        var message = OutboxMessage(
            exchange: row["exchange"], routingKey: row["routingKey"], body: [UInt8](row["body"] as Data),
            messageId: row["messageId"], priority: (row["priority"] as Int?).map { UInt8(clamping: $0) })
        message.id = row["id"]
        message.mandatory = row["mandatory"]
        message.attempts = row["attempts"]
        message.submissionId = (row["submissionId"] as String?).flatMap(UUID.init(uuidString:))
        return message
    }

    /// `messages` with the verify request of each that names its submission, read in one query.
    private static func withRequests(_ messages: [OutboxMessage], in db: any SQLConnection) async throws -> [OutboxMessage] {
        let ids = Set(messages.compactMap(\.submissionId)).map(\.uuidString)
        guard !ids.isEmpty else { return messages }
        let rows = try await db.rows(
            sql: "SELECT \(submissionColumns) FROM \(StoredReceipt.source) WHERE id IN (\(sqlMarks(ids.count)))",
            arguments: SQLArguments(ids))
        var requests: [SubmissionID: VerifyRequest] = [:]
        for row in rows {
            guard let id = UUID(uuidString: row["id"]) else { continue }
            requests[id] = nextAttempt(of: row, id: id)
        }
        return messages.map { message in
            var message = message
            message.request = message.submissionId.flatMap { requests[$0] }
            return message
        }
    }

    /// Forgets messages the broker confirmed.
    public func markPublished(_ ids: [Int64]) async throws {
        guard !ids.isEmpty else { return }
        try await database.writeQueues { db in
            try await db.execute(
                sql: "DELETE FROM outbox WHERE id IN (\(sqlMarks(ids.count)))",
                arguments: SQLArguments(ids))
        }
    }

    /// Records a failed publish; the message stays, unclaimed, for the next round.
    public func markPublishFailed(_ id: Int64, error: String) async throws {
        try await database.writeQueues { db in
            try await db.execute(
                sql: "UPDATE outbox SET attempts = attempts + 1, lastError = ?, claimedUntil = NULL WHERE id = ?",
                arguments: [error, id])
        }
    }

    /// How many messages wait to be published.
    public func outboxBacklog() async throws -> Int {
        try await database.read { db in try await Int.fetchOne(db, sql: "SELECT COUNT(*) FROM outbox") ?? 0 }
    }

    static func insert(_ message: OutboxMessage, now: Date, in db: any SQLConnection) async throws {
        try await db.executeLater([insertStatement(message, now: now)])
    }

    /// The outbox row of `message`.
    static func insertStatement(_ message: OutboxMessage, now: Date) -> SQLStatement {
        SQLStatement(
            """
            INSERT INTO outbox (exchange, routingKey, body, messageId, priority, mandatory, createdAt, submissionId)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?)
            """,
            [
                message.exchange, message.routingKey, Data(message.body), message.messageId,
                message.priority.map { Int($0) }, message.mandatory, now, message.submissionId?.uuidString,
            ], fills: .outbox)
    }
}
