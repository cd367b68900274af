import Foundation
import IAPCore
@testable import OrderStore
import Testing

/// What docs/scaling.md tells a team to do, on a store the pipeline wrote: stop the order
/// service, `iap admin migrate-store --from FILE --to URL`, start on PostgreSQL. Not a grant
/// may be lost or doubled on the way.
@Suite(
    "Moving a SQLite deployment to PostgreSQL",
    .enabled(if: ProcessInfo.processInfo.environment["IAP_TEST_DATABASE_URL"] != nil))
struct MigrateStoreTests {
    @Test func aLedgerWrittenByThePipelineMovesWithoutLosingOrDoublingAGrant() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-migrate-\(UUID().uuidString)")
        let sqlitePath = folder.appendingPathComponent("orders.sqlite").path
        let pipeline = try await PipelineHarness.start(name: "migrate", store: .sqlite(path: sqlitePath))
        let users = ["ana", "ben", "cem", "dee"]
        var purchases: [PipelineHarness.Purchase] = []
        var submissions: [String: String] = [:]
        for index in 0..<12 {
            let purchase = try await pipeline.mint(
                productId: index.isMultiple(of: 4) ? "com.example.premium" : "com.example.coins.60")
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
            try await pipeline.store.grants(ofTransaction: purchases[2].transactionId).first?.state == "revoked"
        }
        #expect(revoked, "the refund reached the ledger before the move")
        var before: [String: [Grant]] = [:]
        for user in users + ["eve"] { before[user] = try await pipeline.store.grants(ofUser: user) }
        var statuses: [String: SubmissionStatus] = [:]
        for id in submissions.keys { statuses[id] = try await pipeline.store.status(of: UUID(uuidString: id)!) }
        let audit = try await pipeline.store.auditLog(limit: 1000)
        await pipeline.stop()

        // The move, with the command the guide gives.
        let target = try TestStore.emptyPostgresDatabase()
        let binary = try #require(ProcessInfo.processInfo.environment["IAP_TEST_IAP_BINARY"])
        let run = try runProgram(binary, ["admin", "migrate-store", "--from", sqlitePath, "--to", target.url])
        #expect(run.status == 0, "migrate-store failed: \(run.error)")
        let report = try JSONDecoder().decode(StoreCopyReport.self, from: Data(run.output.utf8))
        #expect(report.verified && report.tables.count == OrderStore.ledgerTables.count)
        #expect(report.tables.first { $0.table == "grants" }?.rows == 12)

        // Everything a user or customer service sees is the same on PostgreSQL.
        let moved = try OrderStore(location: .postgres(target))
        for user in users + ["eve"] { #expect(try await moved.grants(ofUser: user) == before[user], "\(user)") }
        for (id, status) in statuses { #expect(try await moved.status(of: UUID(uuidString: id)!) == status) }
        #expect(try await moved.auditLog(limit: 1000) == audit)

        // And the ledger goes on: what was credited stays credited once, new ids follow the old.
        let policy = CreditPolicy(catalog: PipelineHarness.testCatalog)
        for (index, purchase) in purchases.enumerated().prefix(4) {
            let request = VerifyRequest(submissionId: UUID(), userId: users[index % users.count], receiptData: "AAAA", acceptedAt: Date())
            try await moved.accept(request, message: OutboxMessage(routingKey: "q", body: [1]))
            let result = VerifyResult(
                submissionId: request.submissionId, userId: request.userId, orderId: nil, attempt: 1,
                outcome: .verified(
                    VerifiedReceipt(
                        bundleId: PipelineHarness.bundleId, environment: .production,
                        purchases: [
                            VerifiedPurchase(
                                transactionId: purchase.transactionId, originalTransactionId: purchase.transactionId,
                                productId: index.isMultiple(of: 4) ? "com.example.premium" : "com.example.coins.60",
                                quantity: 1, purchaseDate: nil, environment: .production)
                        ])))
            _ = try await moved.apply(result, policy: policy)
            let state = try await moved.status(of: request.submissionId)?.transactions.first?.state
            #expect(state == (index == 2 ? .revoked : .alreadyCredited), "transaction \(index): \(String(describing: state))")
        }
        _ = try await moved.grantManually(
            userId: "ana", productId: "com.example.coins.60", quantity: 1, grant: [:], transactionId: nil, actor: "ops",
            reason: "goodwill", policy: policy)
        #expect(try await moved.grants(ofUser: "ana").count == before["ana"]!.count + 1)
        await moved.close()
    }
}
