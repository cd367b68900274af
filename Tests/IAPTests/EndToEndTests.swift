import Foundation
import IAPCore
import OrderStore
import Testing

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
            #expect(Set(ids).count == 20)

            var transactionStates: [String] = []
            for id in ids {
                let status = try await pipeline.waitForState(id)
                #expect(status["state"] as? String == "credited")
                #expect(status["finishTransaction"] as? Bool == true)
                let transactions = status["transactions"] as? [[String: Any]] ?? []
                transactionStates += transactions.compactMap { $0["state"] as? String }
            }
            #expect(transactionStates.filter { $0 == "credited" }.count == 1)
            #expect(transactionStates.filter { $0 == "already_credited" }.count == 19)
            #expect(try await pipeline.store.grants(ofTransaction: purchase.transactionId).count == 1)
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
