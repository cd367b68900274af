import Foundation
import IAPCore
import OrderStore
import Ledger
import Testing
import TestSupport

extension BrokerTests {
    @Suite("End to end: upload → verify → credit")
    struct EndToEndTests {
        @Test func productionPurchaseIsCredited() async throws {
            let pipeline = try await PipelineHarness.start(name: "e2e")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            let id = try await pipeline.upload(
                userId: "alice", receiptData: purchase.receiptData, transactionId: purchase.transactionId)

            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "credited")
            #expect(status["finishTransaction"] as? Bool == true)
            #expect(status["environment"] as? String == "Production")
            let transactions = status["transactions"] as? [[String: Any]] ?? []
            #expect(transactions.count == 1)
            #expect(transactions.first?["transactionId"] as? String == purchase.transactionId)
            #expect(transactions.first?["state"] as? String == "credited")
            #expect(transactions.first?["productId"] as? String == "com.example.coins.60")
            let grants = try await pipeline.store.grants(ofUser: "alice")
            #expect(grants.map(\.transactionId) == [purchase.transactionId])
        }

        @Test func sandboxReceiptIsCreditedThroughThe21007Fallback() async throws {
            let pipeline = try await PipelineHarness.start(name: "sandbox")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint(environment: "Sandbox")
            let id = try await pipeline.upload(userId: "reviewer", receiptData: purchase.receiptData)

            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "credited")
            #expect(status["environment"] as? String == "Sandbox")
            let transactions = status["transactions"] as? [[String: Any]] ?? []
            #expect(transactions.first?["environment"] as? String == "Sandbox")
        }

        @Test func sameReceiptUploadedTwentyTimesConcurrentlyCreditsOneGrant() async throws {
            let pipeline = try await PipelineHarness.start(name: "twenty")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            let ids = try await withThrowingTaskGroup(of: String.self) { group in
                for _ in 0..<20 {
                    group.addTask {
                        try await pipeline.upload(userId: "bob", receiptData: purchase.receiptData, transactionId: purchase.transactionId)
                    }
                }
                return try await group.reduce(into: []) { $0.append($1) }
            }
            // An upload accepted after the first was credited is answered with that one (the
            // owner's repeat within the hour): however the twenty fell, one grant.
            var transactionStates: [String] = []
            for id in Set(ids) {
                let status = try await pipeline.waitForState(id)
                #expect(status["state"] as? String == "credited")
                #expect(status["finishTransaction"] as? Bool == true)
                let transactions = status["transactions"] as? [[String: Any]] ?? []
                transactionStates += transactions.compactMap { $0["state"] as? String }
            }
            #expect(transactionStates.filter { $0 == "credited" }.count == 1)
            #expect(transactionStates.filter { $0 == "already_credited" }.count == Set(ids).count - 1)
            #expect(try await pipeline.store.grants(ofTransaction: purchase.transactionId).count == 1)
        }

        /// One genuine receipt re-uploaded 100 times by its owner once it is credited: every
        /// answer is the credited submission, Apple is asked once, and the store keeps one
        /// submission and one copy of the receipt. Another user's, or another order's, upload of
        /// it is a question of its own and is taken as one.
        @Test(arguments: TestStore.backends) func aCreditedReceiptReuploadedByItsOwnerIsAnsweredFromTheLedger(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "reupload", on: backend)
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            let first = try await pipeline.upload(userId: "rhea", receiptData: purchase.receiptData, transactionId: purchase.transactionId)
            #expect(try await pipeline.waitForState(first)["state"] as? String == "credited")
            let callsBefore = try await HTTP.get(pipeline.fakeURL + "/fake/stats").json["verifyReceiptCalls"] as? Int ?? -1
            let submissionsBefore = try await pipeline.store.submissionCounts().values.reduce(0, +)
            let bytesBefore = try await pipeline.keptBytes()
            let auditBefore = try await pipeline.store.auditLog(limit: 1000).count
            for _ in 0..<100 {
                let again = try await HTTP.post(
                    pipeline.intakeURL + "/v1/receipts",
                    json: ["userId": "rhea", "receiptData": purchase.receiptData, "transactionId": purchase.transactionId])
                #expect(again.status == 202 && again.json["submissionId"] as? String == first, "\(again.text)")
                #expect(again.json["state"] as? String == "credited")
            }
            #expect(try await pipeline.store.submissionCounts().values.reduce(0, +) == submissionsBefore)
            #expect(try await HTTP.get(pipeline.fakeURL + "/fake/stats").json["verifyReceiptCalls"] as? Int == callsBefore)
            // And 1,000 consent reports, the answer flipping each time: one state row, one audit entry.
            for index in 0..<1_000 {
                let report = try await HTTP.post(
                    pipeline.intakeURL + "/v1/users/rhea/consumption", json: ["customerConsented": index.isMultiple(of: 2)])
                #expect(report.status == 204, "\(report.text)")
            }
            #expect(try await pipeline.store.auditLog(limit: 1000).count == auditBefore + 1)
            let grown = try await pipeline.keptBytes() - bytesBefore
            print("one user's 100 re-uploads and 1,000 consent reports on \(backend): the store grew by \(grown) bytes")
            #expect(grown < 256 * 1024, "the store grew by \(grown) bytes")
            // Someone else's upload of the same receipt asks its own question (a replay), as does
            // the owner's naming another transaction.
            let stranger = try await pipeline.upload(userId: "sid", receiptData: purchase.receiptData, transactionId: purchase.transactionId)
            #expect(stranger != first)
            #expect(try await pipeline.store.submissionCounts().values.reduce(0, +) == submissionsBefore + 1)
        }

        @Test func purchaseReplayedByAnotherUserIsNotCreditedToThem() async throws {
            let pipeline = try await PipelineHarness.start(name: "replay")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            let first = try await pipeline.upload(userId: "owner", receiptData: purchase.receiptData)
            #expect(try await pipeline.waitForState(first)["state"] as? String == "credited")

            let replay = try await pipeline.upload(userId: "thief", receiptData: purchase.receiptData)
            let status = try await pipeline.waitForState(replay)
            #expect(status["state"] as? String == "rejected")
            #expect(status["reason"] as? String == "replayed_from_other_user")
            let transactions = status["transactions"] as? [[String: Any]] ?? []
            #expect(transactions.first?["state"] as? String == "replayed_from_other_user")
            #expect(try await pipeline.store.grants(ofUser: "thief").isEmpty)
            #expect(try await pipeline.store.grants(ofUser: "owner").count == 1)
        }

        @Test func transientAppleFailureIsRetriedNotRejected() async throws {
            let pipeline = try await PipelineHarness.start(name: "transient", retryDelays: [1])
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            try await pipeline.injectFault(["httpStatus": 503, "count": 1])
            try await pipeline.injectFault(["status": 21005, "count": 1])
            let id = try await pipeline.upload(userId: "carol", receiptData: purchase.receiptData)

            let retrying = try await pipeline.waitForState(id, ["retrying", "credited", "rejected"])
            #expect(retrying["state"] as? String == "retrying")
            #expect(retrying["finishTransaction"] as? Bool == false)
            #expect(retrying["nextAttemptAt"] is String)

            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "credited")
            #expect(status["attempts"] as? Int == 3)
        }

        @Test func receiptOfAnotherAppIsRefusedBeforeStoring() async throws {
            let pipeline = try await PipelineHarness.start(name: "bundle")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint(bundleId: "com.someone.else")
            // Refused with a 4xx and nothing stored: no answer tells the app to finish it (if
            // IAP_BUNDLE_IDS is what is wrong, the purchase is uploaded again once it is fixed).
            let answer = try await HTTP.post(
                pipeline.intakeURL + "/v1/receipts", json: ["userId": "dave", "receiptData": purchase.receiptData])
            #expect(answer.status == 400 && answer.errorCode == "receipt_other_app", "\(answer.text)")
            #expect(try await pipeline.store.submissionCounts().values.reduce(0, +) == 0)
            #expect(try await pipeline.store.grants(ofUser: "dave").isEmpty)
        }

        @Test func everyPurchaseInOneReceiptIsCredited() async throws {
            let pipeline = try await PipelineHarness.start(name: "several")
            Teardown.add { await pipeline.stop() }
            let first = try await pipeline.mint(deviceId: "phone-1")
            let second = try await pipeline.mint(productId: "com.example.coins.120", deviceId: "phone-1")
            let id = try await pipeline.upload(userId: "erin", receiptData: second.receiptData)
            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "credited")
            let credited = (status["transactions"] as? [[String: Any]] ?? []).compactMap { $0["transactionId"] as? String }
            #expect(Set(credited) == [first.transactionId, second.transactionId])
            #expect(try await pipeline.store.grants(ofUser: "erin").count == 2)
        }
    }
}
