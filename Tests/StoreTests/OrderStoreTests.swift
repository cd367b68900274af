import FakeAppStore
import Foundation
import IAPCore
import Ledger
import NIOConcurrencyHelpers
@testable import OrderStore
@testable import Store
import Testing
import TestSupport

@Suite("Order store invariants", .teardown)
struct OrderStoreTests {
    func makeStore(_ backend: Backend) async throws -> OrderStore {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-store-\(UUID().uuidString)")
        return try await TestStore.open(in: folder, on: backend)
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

    /// A state or reason named in a query's text is one SQL literal whatever it holds: a quote in
    /// it is doubled, on both backends.
    @Test(arguments: TestStore.backends) func aValueNamedInAQuerysTextStaysOneLiteral(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        for text in ["revoked", "it's", "x' OR '1'='1"] {
            let rows = try await store.testRows("SELECT \(ReasonCode(text).sql) AS v")
            #expect(rows.count == 1 && rows.first?["v"] == text, "\(text)")
        }
    }

    @Test(arguments: TestStore.backends) func applyingTheSameResultTwiceCreditsOnce(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        let request = try await accept(store, user: "u1")
        let result = verified(request, transactions: ["t1", "t2"])
        #expect(try await store.apply(result) == .credited)
        #expect(try await store.apply(result) == .credited)
        #expect(try await store.grants(ofUser: "u1").count == 2)
        let status = try #require(try await store.status(of: request.submissionId))
        #expect(status.transactions.map(\.state) == [.credited, .credited])
    }

    /// Each queue wakes its own workers: an accepted upload (a message in the outbox) wakes the
    /// relay and not the calls to Apple; a credit the server finishes at Apple wakes both (its
    /// events, its finish).
    @Test(arguments: TestStore.backends) func aCommitWakesTheWorkersOfTheQueuesItFilledAndNoOthers(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        let (outbox, apple) = (store.outboxSignal.commits, store.appleCallSignal.commits)
        let request = try await accept(store, user: "u1")
        #expect(store.outboxSignal.commits > outbox && store.appleCallSignal.commits == apple)
        let policy = CreditPolicy(eventsExchange: "events", finishAtApple: true)
        #expect(try await store.apply(verified(request, transactions: ["t1"]), policy: policy) == .credited)
        #expect(store.appleCallSignal.commits > apple)
        #expect(try await store.claimDueFinishes(limit: 10, worker: "w", now: Date()).map(\.transactionId) == ["t1"])
    }

    @Test(arguments: TestStore.backends) func lateTransientResultDoesNotUndoACredit(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        let request = try await accept(store, user: "u1")
        #expect(try await store.apply(verified(request, transactions: ["t1"], attempt: 2)) == .credited)
        let late = VerifyResult(
            submissionId: request.submissionId, userId: "u1", orderId: nil, attempt: 1,
            outcome: .retryLater(.appleUnavailable, message: "503"), nextAttemptAt: Date())
        #expect(try await store.apply(late) == .credited)
        #expect(try #require(try await store.status(of: request.submissionId)).state == .credited)
    }

    @Test(arguments: TestStore.backends) func transientFailureRetriesAndGivingUpNeedsReviewNeverRejects(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
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

    @Test(arguments: TestStore.backends) func aTransactionBelongsToTheFirstUserItWasCreditedTo(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        let first = try await accept(store, user: "owner")
        let second = try await accept(store, user: "other")
        #expect(try await store.apply(verified(first, transactions: ["t1"])) == .credited)
        #expect(try await store.apply(verified(second, transactions: ["t1", "t2"])) == .credited)
        #expect(try await store.grants(ofUser: "owner").map(\.transactionId) == ["t1"])
        #expect(try await store.grants(ofUser: "other").map(\.transactionId) == ["t2"])
        let status = try #require(try await store.status(of: second.submissionId))
        #expect(status.transactions.map(\.state) == [.replayedFromOtherUser, .credited])
    }

    @Test(arguments: TestStore.backends) func theSchemaRefusesASecondPurchaseRowForOneTransaction(_ backend: Backend) async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-store-\(UUID().uuidString)")
        let store = try await TestStore.open(in: folder, on: backend)
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

    /// A batch of writes (one `iap_write` call on PostgreSQL) stores every value as a bound
    /// statement would: quotes, percent signs, marks, backslashes, line breaks, NULL, bytes.
    @Test(arguments: TestStore.backends) func aBatchOfWritesStoresEveryValueAsWritten(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        Teardown.add { await store.close() }
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
                    requiresChange: SQLError(.other, "the outbox row was not written")),
            ])
        }
        let actor: String? = try await store.testValue("SELECT actor FROM audit_log WHERE action = 'batch'")
        #expect(actor == tricky)
        let rows = try await store.testRows("SELECT routingKey, body, priority FROM outbox WHERE messageId = 'm-1'")
        #expect(rows.first?["routingKey"] as String? == tricky)
        #expect(rows.first?["body"] as Data? == Data([0, 39, 37, 92, 255]))
        #expect(rows.first?.hasValue("priority") == false)
    }

    /// A batch is all or nothing: a statement that fails, or changes no row where it must,
    /// undoes the statements before it, and the transaction goes on and commits the rest.
    @Test(arguments: TestStore.backends) func aFailedBatchIsUndoneWholeAndTheTransactionGoesOn(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        Teardown.add { await store.close() }
        let audit = "INSERT INTO audit_log (at, actor, action, subject, reason, details) VALUES (?, ?, ?, ?, ?, ?)"
        try await store.database.write { db in
            // Changes no row where it must.
            await #expect(throws: SQLError.self) {
                try await db.executeBatch([
                    SQLStatement(audit, [Date(), "ann", "first", "s:1", "r", "{}"]),
                    SQLStatement(
                        "UPDATE submission SET state = 'credited' WHERE id = 'none'",
                        requiresChange: SQLError(.other, "no such submission")),
                ])
            }
            try await db.executeBatch([SQLStatement(audit, [Date(), "ann", "kept", "s:2", "r", "{}"])])
            // Fails outright (a duplicate key).
            let subscription = """
                INSERT INTO subscription (originalTransactionId, productId, environment, state, lastTransactionId, updatedAt)
                VALUES ('o1', 'p', 'Production', 'active', 'o1', '2026-01-01 00:00:00.000')
                """
            try await db.executeBatch([SQLStatement(subscription)])
            await #expect(throws: SQLError.self) {
                try await db.executeBatch([
                    SQLStatement(audit, [Date(), "ann", "second", "s:3", "r", "{}"]),
                    SQLStatement(subscription),
                ])
            }
            try await db.executeLater([SQLStatement(audit, [Date(), "ann", "last", "s:4", "r", "{}"])])
        }
        let actions = try await store.testRows("SELECT action FROM audit_log ORDER BY id").map { $0["action"] as String }
        #expect(actions == ["kept", "last"])
    }

    /// Writes queued with `executeLater` are seen by the unit's next read, and vanish with a
    /// unit that fails after them; a group commit's other units keep theirs.
    @Test(arguments: TestStore.backends) func queuedWritesAreReadBackAndGoWithTheirUnit(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        Teardown.add { await store.close() }
        let audit = "INSERT INTO audit_log (at, actor, action, subject, reason, details) VALUES (?, ?, ?, ?, ?, ?)"
        struct Refused: Error {}
        try await store.database.write { db in
            try await db.inSavepoint {
                try await db.executeLater([SQLStatement(audit, [Date(), "ann", "kept", "s:1", "r", "{}"])])
                let seen = try await db.readBatch([
                    SQLStatement("SELECT action FROM audit_log WHERE subject = ?", ["s:1"]),
                    SQLStatement("SELECT action FROM audit_log WHERE subject = ?", ["s:2"]),
                ])
                #expect(seen.map(\.count) == [1, 0])
            }
            // Queued, read back (so sent), then the unit fails: all of it goes.
            await #expect(throws: Refused.self) {
                try await db.inSavepoint {
                    try await db.executeLater([SQLStatement(audit, [Date(), "ann", "sent", "s:2", "r", "{}"])])
                    _ = try await db.rows(sql: "SELECT action FROM audit_log", arguments: [])
                    try await db.executeLater([SQLStatement(audit, [Date(), "ann", "queued", "s:3", "r", "{}"])])
                    throw Refused()
                }
            }
            // Queued only, then the unit fails: nothing is sent.
            await #expect(throws: Refused.self) {
                try await db.inSavepoint {
                    try await db.executeLater([SQLStatement(audit, [Date(), "ann", "never", "s:4", "r", "{}"])])
                    throw Refused()
                }
            }
            // A unit whose one write fails at its end leaves the transaction usable.
            await #expect(throws: SQLError.self) {
                try await db.inSavepoint {
                    try await db.executeLater([
                        SQLStatement(audit, [Date(), "ann", "undone", "s:5", "r", "{}"]),
                        SQLStatement("UPDATE submission SET state = 'x' WHERE id = 'none'", requiresChange: SQLError(.other, "none")),
                    ])
                }
            }
            try await db.inSavepoint {
                try await db.executeLater([SQLStatement(audit, [Date(), "ann", "after", "s:6", "r", "{}"])])
            }
        }
        let actions = try await store.testRows("SELECT action FROM audit_log ORDER BY id").map { $0["action"] as String }
        #expect(actions == ["kept", "after"])
    }

    /// A batch of reads (one `iap_read` call on PostgreSQL, its rows as JSON) answers each
    /// query's rows exactly as the query run alone does: text of every kind, integers, reals,
    /// NULL, booleans, dates, and no rows.
    @Test(arguments: TestStore.backends) func aReadBatchAnswersAsEachQueryAlone(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        Teardown.add { await store.close() }
        let tricky = "it's 100% ? \\x41 \"quoted\"\nnext line\ttab \u{1}\u{1F600} é ́ -- not a comment"
        try await store.database.write { db in
            try await db.executeBatch([
                SQLStatement(
                    "INSERT INTO audit_log (at, actor, action, subject, reason, details) VALUES (?, ?, ?, ?, ?, ?)",
                    [Date(timeIntervalSince1970: 1_790_000_000.123), tricky, "read", "s:1", "", "{\"a\": [1]}"]),
                SQLStatement(
                    """
                    INSERT INTO subscription (originalTransactionId, userId, productId, environment, state, expiresDate,
                        autoRenew, lastTransactionId, updatedAt)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
                    """,
                    ["o1", tricky, "p", "Production", "active", nil as Date?, true, "o1", Date()]),
                SQLStatement(
                    "INSERT INTO rate_bucket (key, tokens, allowed, updated) VALUES (?, ?, ?, ?)",
                    ["k", 2.5, 3, 1_790_000_000.25]),
            ])
        }
        let queries = [
            SQLStatement("SELECT * FROM audit_log WHERE action = ?", ["read"]),
            SQLStatement("SELECT * FROM subscription WHERE originalTransactionId = ?", ["o1"]),
            SQLStatement("SELECT * FROM subscription WHERE originalTransactionId = ?", ["none"]),
            SQLStatement("SELECT key, tokens, updated, -9007199254740993 AS big FROM rate_bucket", []),
            SQLStatement("SELECT COUNT(*) AS n FROM audit_log", []),
        ]
        let (batched, alone) = try await store.database.read { db in
            let batched = try await db.readBatch(queries)
            var alone: [[SQLRow]] = []
            for query in queries { alone.append(try await db.rows(sql: query.sql, arguments: query.arguments)) }
            return (batched, alone)
        }
        #expect(batched.map(\.count) == [1, 1, 0, 1, 1])
        for (set, expected) in zip(batched, alone) {
            #expect(set.map { $0.columns.map { $0.lowercased() } } == expected.map { $0.columns.map { $0.lowercased() } })
            #expect(set.map(\.values) == expected.map(\.values))
        }
        #expect(batched[0].first?["actor"] as String? == tricky)
        #expect(batched[1].first?["autoRenew"] as Bool? == true)
    }

    /// On PostgreSQL an upload accepted and credited alone takes 8 round trips: the
    /// acceptance's one write in its transaction, then in the result's own the ledger's locks
    /// on the rows it names, its one read (the upload's row and the ledger's facts) and one
    /// write (the plan and what the upload became).
    @Test(.needsPostgres) func anUploadIsEightRoundTripsOnPostgreSQL() async throws {
        let sent = NIOLockedValueBox([String]())
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-store-\(UUID().uuidString)")
        let store = try await TestStore.open(in: folder, on: .postgres) { sql in
            if !sql.hasPrefix(SQLTrace.inBatch) { sent.withLockedValue { $0.append(sql) } }
        }
        Teardown.add { await store.close() }
        sent.withLockedValue { $0 = [] }
        let request = try await accept(store, user: "u1")
        #expect(try await store.apply(verified(request, transactions: ["t1"])) == .credited)
        let verbs = sent.withLockedValue { $0 }.map { $0.split(separator: " ").prefix(2).joined(separator: " ") }
        #expect(
            verbs == [
                "BEGIN ISOLATION", "SELECT iap_write(?,", "COMMIT",
                "BEGIN ISOLATION", "SELECT count(*)", "SELECT iap_read(?,", "SELECT iap_write(?,", "COMMIT",
            ],
            "\(verbs)")
        #expect(try await store.grants(ofUser: "u1").count == 1)
    }

    @Test(arguments: TestStore.backends) func theAuditLogIsAppendOnly(_ backend: Backend) async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-store-\(UUID().uuidString)")
        let store = try await TestStore.open(in: folder, on: backend)
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

    /// A consent report is state: 1,000 reports by one user, the same answer or flipping, leave
    /// one consent row and at most one audit row an hour; the state is always the last answer.
    @Test(arguments: TestStore.backends) func consentReportsAreStateAndAuditedAtMostHourly(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        let start = Date(timeIntervalSince1970: 1_800_000_000)
        for index in 0..<1_000 {
            let report = ConsumptionReport(userId: "flo", transactionId: nil, consumptionPercentage: nil, customerConsented: index % 3 != 0)
            try await store.reportConsumption(report, now: start.addingTimeInterval(Double(index)))
        }
        let consentRows = try await store.database.read { db in try await db.rows(sql: "SELECT consented FROM consumption_consent") }
        #expect(consentRows.count == 1 && (consentRows.first?["consented"] as Bool?) == false)
        #expect(try await store.auditLog(limit: 100).count == 1)
        // An hour on, the next change is audited again; the same answer again is not.
        try await store.reportConsumption(
            .init(userId: "flo", transactionId: nil, consumptionPercentage: nil, customerConsented: true), now: start.addingTimeInterval(4_000))
        try await store.reportConsumption(
            .init(userId: "flo", transactionId: nil, consumptionPercentage: nil, customerConsented: true), now: start.addingTimeInterval(9_000))
        #expect(try await store.auditLog(limit: 100).map(\.action) == ["consumption_consent_given", "consumption_consent_withdrawn"])
    }

    /// Audit entries about no money (consent reports) go once past the retention period; an
    /// entry about money stays whatever its age, and the schema itself refuses to delete one.
    @Test(arguments: TestStore.backends) func auditEntriesAboutNoMoneyAloneArePurged(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        let old = Date(timeIntervalSince1970: 1_700_000_000)
        for (index, consented) in [true, false, true].enumerated() {
            try await store.reportConsumption(
                .init(userId: "flo", transactionId: nil, consumptionPercentage: nil, customerConsented: consented),
                now: old.addingTimeInterval(Double(index) * 7200))
        }
        let request = try await accept(store, user: "u1")
        try await store.markFinishable(request.submissionId, actor: "ann", reason: "settled")
        #expect(try await store.auditLog(limit: 10).count == 4)
        #expect(try await store.purgeAuditEntries(olderThan: Date().addingTimeInterval(60)) == 3)
        #expect(try await store.auditLog(limit: 10).map(\.action) == ["submission_finishable"])
        await #expect(throws: SQLError.self) {
            try await store.database.write { db in try await db.execute(sql: "DELETE FROM audit_log") }
        }
    }

    /// SQLite only: on PostgreSQL the server's roles and passwords guard the data.
    @Test func theFileAndItsLogAreReadableByTheirOwnerOnly() async throws {
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

    @Test(arguments: TestStore.backends) func acceptedUploadAndItsOutboxMessageAreWrittenTogether(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        _ = try await accept(store, user: "u1")
        _ = try await accept(store, user: "u2")
        let messages = try await store.claimUnpublished(limit: 10, relay: "test")
        #expect(messages.count == 2)
        try await store.markPublished(messages.compactMap(\.id))
        #expect(try await store.outboxBacklog() == 0)
        #expect(try await store.submissionCounts()[.pending] == 2)
    }

    /// An uploaded app receipt is kept once, as bytes (not base64) in a row nothing updates:
    /// the submission row holds no copy, the verify message the relay builds and the sweeper's
    /// next attempt carry the text exactly as the app sent it, and a rejected receipt's digest
    /// and the retention purge take that row too. Text too short to be a receipt stays as it came.
    @Test(arguments: TestStore.backends) func aReceiptIsKeptOnceAsBytesAndReadBackAsUploaded(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        let payload = ReceiptPayload(
            bundleId: "com.example.app", appVersion: "2.3", originalAppVersion: "1.0", opaqueValue: [0xD1, 0xBC],
            sha1Hash: Array(repeating: 0xAB, count: 20), creationDate: Date(timeIntervalSince1970: 1_800_000_000),
            inApp: [
                InAppPurchasePayload(
                    quantity: 3, productId: "com.example.coins.60", transactionId: "2000000000000001",
                    purchaseDate: Date(timeIntervalSince1970: 1_799_990_000))
            ])
        let receipt = Data(try ReceiptMinter(authority: try FakeCertificateAuthority.generate()).mint(payload)).base64EncodedString()
        let accepted = Date().addingTimeInterval(-3600)
        let minted = VerifyRequest(submissionId: UUID(), userId: "u1", receiptData: receipt, acceptedAt: accepted)
        let short = VerifyRequest(submissionId: UUID(), userId: "u2", receiptData: "AAAA", acceptedAt: accepted)
        for request in [minted, short] {
            try await store.accept(request, message: .verify(request, routingKey: "q", priority: 0))
        }

        func stored(_ request: VerifyRequest) async throws -> (text: String, bytes: Data?) {
            let text = try await store.testRows("SELECT receiptData FROM submission WHERE id = ?", [request.submissionId.uuidString])
            let bytes = try await store.testRows(
                "SELECT receipt FROM submission_receipt WHERE submissionId = ?", [request.submissionId.uuidString])
            return (try #require(text.first)["receiptData"], bytes.first.map { $0["receipt"] as Data })
        }
        let kept = try await stored(minted)
        #expect(kept.text.isEmpty)
        #expect(kept.bytes == Data(base64Encoded: receipt))
        #expect(try await stored(short).text == "AAAA")
        #expect(try await stored(short).bytes == nil)
        // Base64 whose bytes give back other text (padding bits set) is kept as it came.
        let odd = String(repeating: "QUJD", count: 300) + "RB=="  // "ABC"… and "D", its last bits set
        let oddRequest = VerifyRequest(submissionId: UUID(), userId: "u3", receiptData: odd, acceptedAt: accepted)
        try await store.accept(oddRequest, message: nil)
        #expect(try await stored(oddRequest).text == odd)
        #expect(try await stored(oddRequest).bytes == nil)

        // What the relay publishes, and what the sweeper sends again, is what the app uploaded.
        let messages = try await store.claimUnpublished(limit: 10, relay: "test")
        #expect(Set(messages.compactMap(\.request?.receiptData)) == [receipt, "AAAA"])
        try await store.markPublished(messages.compactMap(\.id))
        let requeued = try await store.requeueStuck(pendingBefore: Date(), retryDueBefore: Date(), limit: 10) { request in
            .verify(request, routingKey: "q", priority: 0)
        }
        #expect(Set(requeued.map(\.receiptData)) == [receipt, "AAAA", odd])
        // A receipt on its own names nothing: the app is told to finish only what it carried.
        #expect(try await store.status(of: minted.submissionId)?.named == .nothing)

        // Rejected: only a digest stays; the retention purge leaves no receipt row behind.
        let again = VerifyRequest(submissionId: UUID(), userId: "u1", receiptData: receipt, acceptedAt: accepted)
        try await store.accept(again, message: nil)
        for request in [minted, again] {
            _ = try await store.apply(
                VerifyResult(
                    submissionId: request.submissionId, userId: "u1", orderId: nil, attempt: 2,
                    outcome: .rejected(.invalidReceipt, message: "Apple: 21002")))
        }
        try await store.keepOnlyDigests(ofRejected: minted.submissionId) { "sha256:\($0.utf8.count)" }
        #expect(try await stored(minted).text == "sha256:\(receipt.utf8.count)")
        #expect(try await stored(minted).bytes == nil)
        #expect(try await stored(again).bytes != nil)
        #expect(try await store.purgeRejected(olderThan: Date().addingTimeInterval(60), now: Date()) == 2)
        #expect(try await store.testRows("SELECT * FROM submission_receipt").isEmpty)
    }
}
