import Foundation
import IAPCore
@testable import OrderStore
import Testing

@Suite("Order store invariants")
struct OrderStoreTests {
    func makeStore() async throws -> OrderStore {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-store-\(UUID().uuidString)")
        return try await TestStore.open(in: folder)
    }

    func accept(_ store: OrderStore, user: String) async throws -> VerifyRequest {
        let request = VerifyRequest(submissionId: UUID(), userId: user, receiptData: "AAAA", acceptedAt: Date())
        try await store.accept(request, message: OutboxMessage(routingKey: "q", body: [1]))
        return request
    }

    func verified(_ request: VerifyRequest, transactions: [String], attempt: Int = 1) -> VerifyResult {
        let purchases = transactions.map {
            VerifiedPurchase(
                transactionId: $0, originalTransactionId: $0, productId: "p", quantity: 1, purchaseDate: nil,
                environment: .production)
        }
        return VerifyResult(
            submissionId: request.submissionId, userId: request.userId, orderId: nil, attempt: attempt,
            outcome: .verified(VerifiedReceipt(bundleId: "b", environment: .production, purchases: purchases)))
    }

    @Test func applyingTheSameResultTwiceCreditsOnce() async throws {
        let store = try await makeStore()
        let request = try await accept(store, user: "u1")
        let result = verified(request, transactions: ["t1", "t2"])
        #expect(try await store.apply(result) == .credited)
        #expect(try await store.apply(result) == .credited)
        #expect(try await store.grants(ofUser: "u1").count == 2)
        let status = try #require(try await store.status(of: request.submissionId))
        #expect(status.transactions.map(\.state) == [.credited, .credited])
    }

    @Test func lateTransientResultDoesNotUndoACredit() async throws {
        let store = try await makeStore()
        let request = try await accept(store, user: "u1")
        #expect(try await store.apply(verified(request, transactions: ["t1"], attempt: 2)) == .credited)
        let late = VerifyResult(
            submissionId: request.submissionId, userId: "u1", orderId: nil, attempt: 1,
            outcome: .retryLater(.appleUnavailable, message: "503"), nextAttemptAt: Date())
        #expect(try await store.apply(late) == .credited)
        #expect(try #require(try await store.status(of: request.submissionId)).state == .credited)
    }

    @Test func transientFailureRetriesAndGivingUpNeedsReviewNeverRejects() async throws {
        let store = try await makeStore()
        let request = try await accept(store, user: "u1")
        var result = VerifyResult(
            submissionId: request.submissionId, userId: "u1", orderId: nil, attempt: 1,
            outcome: .retryLater(.appleUnavailable, message: "503"), nextAttemptAt: Date().addingTimeInterval(5))
        #expect(try await store.apply(result) == .retrying)
        let retrying = try #require(try await store.status(of: request.submissionId))
        #expect(retrying.attempts == 1)
        #expect(retrying.nextAttemptAt != nil)
        #expect(!retrying.finishTransaction)
        result.attempt = 9
        result.gaveUp = true
        #expect(try await store.apply(result) == .needsReview)
        let status = try #require(try await store.status(of: request.submissionId))
        #expect(status.reason == .retriesExhausted)
        #expect(!status.finishTransaction)
    }

    @Test func aTransactionBelongsToTheFirstUserItWasCreditedTo() async throws {
        let store = try await makeStore()
        let first = try await accept(store, user: "owner")
        let second = try await accept(store, user: "other")
        #expect(try await store.apply(verified(first, transactions: ["t1"])) == .credited)
        #expect(try await store.apply(verified(second, transactions: ["t1", "t2"])) == .credited)
        #expect(try await store.grants(ofUser: "owner").map(\.transactionId) == ["t1"])
        #expect(try await store.grants(ofUser: "other").map(\.transactionId) == ["t2"])
        let status = try #require(try await store.status(of: second.submissionId))
        #expect(status.transactions.map(\.state) == [.replayedFromOtherUser, .credited])
    }

    @Test func theSchemaRefusesASecondPurchaseRowForOneTransaction() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-store-\(UUID().uuidString)")
        let store = try await TestStore.open(in: folder)
        let request = try await accept(store, user: "u1")
        #expect(try await store.apply(verified(request, transactions: ["t1"])) == .credited)
        // Even a writer that skipped the store's checks cannot credit the transaction again.
        await #expect(throws: SQLError.self) {
            try await store.database.write { db in
                try await db.execute(
                    sql: """
                        INSERT INTO purchase (transactionId, originalTransactionId, productId, quantity, environment,
                            bundleId, userId, submissionId, creditedAt)
                        VALUES ('t1', 't1', 'p', 1, 'Production', 'b', 'u2', ?, CURRENT_TIMESTAMP)
                        """, arguments: [request.submissionId.uuidString])
            }
        }
        // The same rows for a fresh transaction id go in: only the uniqueness refuses the ones above.
        try await store.database.write { db in
            try await db.execute(
                sql: """
                    INSERT INTO purchase (transactionId, originalTransactionId, productId, quantity, environment,
                        bundleId, userId, submissionId, creditedAt)
                    VALUES ('t9', 't9', 'p', 1, 'Production', 'b', 'u2', ?, CURRENT_TIMESTAMP)
                    """, arguments: [request.submissionId.uuidString])
            try await db.execute(
                sql: """
                    INSERT INTO grants (transactionId, userId, productId, quantity, grantJSON, environment, source,
                        state, grantedAt)
                    VALUES ('t9', 'u2', 'p', 1, '{}', 'Production', 'apple', 'active', CURRENT_TIMESTAMP)
                    """)
        }
        await #expect(throws: SQLError.self) {
            try await store.database.write { db in
                try await db.execute(
                    sql: """
                        INSERT INTO grants (transactionId, userId, productId, quantity, grantJSON, environment, source,
                            state, grantedAt)
                        VALUES ('t1', 'u2', 'p', 1, '{}', 'Production', 'apple', 'active', CURRENT_TIMESTAMP)
                        """)
            }
        }
    }

    /// A batch of writes (one `iap_batch` call on PostgreSQL) stores every value as a bound
    /// statement would: quotes, percent signs, marks, backslashes, line breaks, NULL, bytes.
    @Test func aBatchOfWritesStoresEveryValueAsWritten() async throws {
        let store = try await makeStore()
        defer { Task { await store.close() } }
        let tricky = "it's 100% ? \\x41 \"quoted\"\nnext line -- not a comment"
        try await store.database.write { db in
            try await db.executeBatch([
                SQLStatement(
                    "INSERT INTO audit_log (at, actor, action, subject, reason, details) VALUES (?, ?, ?, ?, ?, ?)",
                    [Date(), tricky, "batch", "s:1", "r", "{}"]),
                SQLStatement(
                    """
                    INSERT INTO outbox (exchange, routingKey, body, messageId, priority, mandatory, createdAt)
                    VALUES (?, ?, ?, ?, ?, ?, ?)
                    """,
                    ["", tricky, Data([0, 39, 37, 92, 255]), "m-1", nil as Int?, true, Date()],
                    check: { changed in #expect(changed == 1) }),
            ])
        }
        let actor: String? = try await store.testValue("SELECT actor FROM audit_log WHERE action = 'batch'")
        #expect(actor == tricky)
        let rows = try await store.testRows("SELECT routingKey, body, priority FROM outbox WHERE messageId = 'm-1'")
        #expect(rows.first?["routingKey"] as String? == tricky)
        #expect(rows.first?["body"] as Data? == Data([0, 39, 37, 92, 255]))
        #expect(rows.first?.hasValue("priority") == false)
    }

    @Test func theAuditLogIsAppendOnly() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-store-\(UUID().uuidString)")
        let store = try await TestStore.open(in: folder)
        let request = try await accept(store, user: "u1")
        try await store.markFinishable(request.submissionId, actor: "ann", reason: "settled")
        #expect(try await store.auditLog(limit: 10).map(\.action) == ["submission_finishable"])
        await #expect(throws: SQLError.self) {
            try await store.database.write { db in try await db.execute(sql: "UPDATE audit_log SET reason = 'nothing happened'") }
        }
        await #expect(throws: SQLError.self) {
            try await store.database.write { db in try await db.execute(sql: "DELETE FROM audit_log") }
        }
        #expect(try await store.auditLog(limit: 10).first?.reason == "settled")
    }

    /// SQLite only: on PostgreSQL the server's roles and passwords guard the data.
    @Test(.enabled(if: !TestStore.usesPostgres)) func theFileAndItsLogAreReadableByTheirOwnerOnly() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-store-\(UUID().uuidString)")
        let path = folder.appendingPathComponent("orders.sqlite").path
        let store = try await OrderStore(path: path)
        _ = try await accept(store, user: "u1")
        // SQLite gives its write-ahead log the database file's mode.
        #expect(FileManager.default.fileExists(atPath: path + "-wal"))
        for file in [path, path + "-wal"] {
            let permissions = try FileManager.default.attributesOfItem(atPath: file)[.posixPermissions] as? Int
            #expect(permissions == 0o600, "\(file)")
        }
    }

    @Test func acceptedUploadAndItsOutboxMessageAreWrittenTogether() async throws {
        let store = try await makeStore()
        _ = try await accept(store, user: "u1")
        _ = try await accept(store, user: "u2")
        let messages = try await store.claimUnpublished(limit: 10, relay: "test")
        #expect(messages.count == 2)
        try await store.markPublished(messages.compactMap(\.id))
        #expect(try await store.outboxBacklog() == 0)
        #expect(try await store.submissionCounts()[.pending] == 2)
    }
}
