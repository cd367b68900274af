import Foundation
import IAPCore
@testable import OrderStore
@testable import Store
import Ledger
import Testing
import TestSupport

/// What docs/scaling.md tells a team to do, on a store the pipeline wrote: stop the order
/// service, `iap admin migrate-store --from FILE --to URL`, start the order service on
/// PostgreSQL. Not a grant may be lost or doubled on the way, and an upload accepted just
/// before the stop (its queue message still in the outbox) is credited after the move.
@Suite("Moving a SQLite deployment to PostgreSQL", .needsPostgres, .teardown)
struct MigrateStoreTests {
    @Test func aLedgerWrittenByThePipelineMovesWithoutLosingOrDoublingAGrant() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-migrate-\(UUID().uuidString)")
        let sqlitePath = folder.appendingPathComponent("orders.sqlite").path
        // Apple (the fake App Store) outlives both order services, as the real one does.
        let apple = try await PipelineHarness.start(name: "migrate", roles: [])
        Teardown.add { await apple.stop() }
        let pipeline = try await PipelineHarness.start(name: "migrate", sharing: apple, store: .sqlite(path: sqlitePath))
        let users = ["ana", "ben", "cem", "dee"]
        var purchases: [PipelineHarness.Purchase] = []
        var submissions: [String: String] = [:]
        func product(_ index: Int) -> String { index.isMultiple(of: 4) ? "com.example.premium" : "com.example.coins.60" }
        for index in 0..<12 {
            let purchase = try await pipeline.mint(productId: product(index))
            purchases.append(purchase)
            submissions[try await pipeline.upload(userId: users[index % users.count], receiptData: purchase.receiptData)] =
                users[index % users.count]
        }
        // A replay by someone else, and a refund: the ledger holds more than plain credits.
        submissions[try await pipeline.upload(userId: "eve", receiptData: purchases[1].receiptData)] = "eve"
        for id in submissions.keys { _ = try await pipeline.waitForState(id) }
        // Apple refunds one: the fake signs a REFUND notification and sends it to the intake.
        let refund = try await HTTP.post(
            pipeline.fakeURL + "/fake/purchases/\(purchases[2].transactionId)/refund", json: [String: String]())
        #expect(refund.status == 200, "\(refund.text)")
        let revoked = try await eventually(timeout: .seconds(20)) {
            try await pipeline.store.grants(ofTransaction: purchases[2].transactionId).first?.state == .revoked
        }
        #expect(revoked, "the refund reached the ledger before the move")
        var before: [String: [Grant]] = [:]
        for user in users + ["eve"] { before[user] = try await pipeline.store.grants(ofUser: user) }
        var statuses: [String: SubmissionStatus] = [:]
        for id in submissions.keys { statuses[id] = try await pipeline.store.status(of: UUID(uuidString: id)!) }
        let audit = try await pipeline.store.auditLog(limit: 1000)
        await pipeline.stop()

        // An upload accepted at the last moment: stored with its queue message, not yet relayed.
        let late = try await apple.mint(productId: "com.example.coins.60")
        let lateRequest = VerifyRequest(submissionId: UUID(), userId: "fay", receiptData: late.receiptData, acceptedAt: Date())
        let sqlite = try await OrderStore(path: sqlitePath)
        try await sqlite.accept(
            lateRequest,
            message: OutboxMessage(
                routingKey: apple.names.verify, body: try MessageCodec().encode(lateRequest),
                messageId: lateRequest.submissionId.uuidString, priority: VerifyPriority.firstAttempt))
        await sqlite.close()

        // The move, with the command the guide gives.
        let target = try await TestStore.emptyPostgresDatabase()
        let binary = try #require(ProcessInfo.processInfo.environment["IAP_TEST_IAP_BINARY"])
        let run = try await runProgram(binary, ["admin", "migrate-store", "--from", sqlitePath, "--to", target.url])
        #expect(run.status == 0, "migrate-store failed: \(run.error)")
        let report = try JSONDecoder().decode(StoreCopyReport.self, from: Data(run.output.utf8))
        #expect(report.verified && report.tables.count == OrderStore.ledgerTables.count)
        #expect(report.tables.first { $0.table == "grants" }?.rows == 12)
        #expect((report.tables.first { $0.table == "outbox" }?.rows ?? 0) >= 1, "the late upload's message moves too")

        // Everything a user or customer service sees is the same on PostgreSQL.
        let moved = try await OrderStore(location: .postgres(target))
        for user in users + ["eve"] { #expect(try await moved.grants(ofUser: user) == before[user], "\(user)") }
        for (id, status) in statuses { #expect(try await moved.status(of: UUID(uuidString: id)!) == status) }
        #expect(try await moved.auditLog(limit: 1000) == audit)
        await moved.close()

        // The order service starts on PostgreSQL and the ledger goes on: the late upload is
        // relayed and credited, uploads of what was credited credit nothing again, and what
        // Apple refunded stays refunded.
        let onPostgres = try await PipelineHarness.start(name: "migrate", sharing: apple, store: .postgres(target))
        Teardown.add { await onPostgres.stop() }
        let lateState = try await onPostgres.waitForState(lateRequest.submissionId.uuidString)
        #expect(lateState["state"] as? String == "credited", "\(lateState)")
        #expect(try await onPostgres.store.grants(ofUser: "fay").count == 1)
        for (index, purchase) in purchases.enumerated().prefix(4) {
            if index == 2 {
                // Refunded: Apple's verifyReceipt leaves it out of the receipt; the upload naming it
                // is finishable on the refund the ledger moved.
                let id = try await onPostgres.upload(
                    userId: users[index % users.count], receiptData: purchase.receiptData, transactionId: purchase.transactionId)
                let answer = try await onPostgres.waitForState(id)
                #expect(
                    answer["reason"] as? String == "purchase_revoked" && answer["finishTransaction"] as? Bool == true,
                    "transaction \(index): \(answer)")
                continue
            }
            let id = try await onPostgres.upload(userId: users[index % users.count], receiptData: purchase.receiptData)
            let answer = try await onPostgres.waitForState(id)
            let transactions = answer["transactions"] as? [[String: Any]] ?? []
            let state = transactions.first { $0["transactionId"] as? String == purchase.transactionId }?["state"] as? String
            // Credited once: a new upload finds it credited already, and the owner's repeat of the
            // upload credited within the hour is answered with that one (moved with the ledger).
            #expect(state == "already_credited" || state == "credited", "transaction \(index): \(answer)")
            #expect(try await onPostgres.store.grants(ofTransaction: purchase.transactionId).count == 1)
        }
        let fresh = try await apple.mint(productId: "com.example.coins.60")
        let freshState = try await onPostgres.waitForState(try await onPostgres.upload(userId: "ana", receiptData: fresh.receiptData))
        #expect(freshState["state"] as? String == "credited", "\(freshState)")
        for user in users + ["eve"] {
            let after = try await onPostgres.store.grants(ofUser: user)
            #expect(after.count == before[user]!.count + (user == "ana" ? 1 : 0), "\(user): \(after.count)")
            #expect(Set(before[user]!.map(\.transactionId)).isSubset(of: Set(after.map(\.transactionId))), "\(user)")
        }
    }
}
