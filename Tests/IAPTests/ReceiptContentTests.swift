import Foundation
import IAPCore
import OrderStore
import Ledger
import Testing
import TestSupport
import Verifier

extension BrokerTests {
    @Suite("What a receipt holds, credited as it should be")
    struct ReceiptContentTests {
        @Test func receiptWithThreePurchasesOneCreditedBeforeGivesTwoNewGrants() async throws {
            let pipeline = try await PipelineHarness.start(name: "three")
            Teardown.add { await pipeline.stop() }
            let first = try await pipeline.mint(deviceId: "phone")
            let earlier = try await pipeline.upload(userId: "frank", receiptData: first.receiptData)
            #expect(try await pipeline.waitForState(earlier)["state"] as? String == "credited")

            // Two more purchases whose uploads were lost: the device's newest receipt holds all three.
            let second = try await pipeline.mint(productId: "com.example.coins.120", deviceId: "phone")
            let third = try await pipeline.mint(productId: "com.example.coins.300", deviceId: "phone")
            let id = try await pipeline.upload(userId: "frank", receiptData: third.receiptData)
            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "credited")
            let states = Dictionary(
                uniqueKeysWithValues: (status["transactions"] as? [[String: Any]] ?? []).map {
                    ($0["transactionId"] as? String ?? "", $0["state"] as? String ?? "")
                })
            #expect(
                states == [
                    first.transactionId: "already_credited", second.transactionId: "credited",
                    third.transactionId: "credited",
                ])
            #expect(try await pipeline.store.grants(ofUser: "frank").count == 3)
        }

        @Test func cancelledPurchaseIsNotCredited() async throws {
            let pipeline = try await PipelineHarness.start(name: "cancelled")
            Teardown.add { await pipeline.stop() }
            let refunded = try await pipeline.mint(deviceId: "tablet")
            let kept = try await pipeline.mint(productId: "com.example.coins.120", deviceId: "tablet")
            try await pipeline.cancel(refunded.transactionId)
            let id = try await pipeline.upload(userId: "gina", receiptData: kept.receiptData)
            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "credited")
            let states = (status["transactions"] as? [[String: Any]] ?? []).reduce(into: [String: String]()) {
                $0[$1["transactionId"] as? String ?? ""] = $1["state"] as? String
            }
            // Apple's verifyReceipt leaves the refunded consumable out of the receipt.
            #expect(states == [kept.transactionId: "credited"])
            #expect(try await pipeline.store.grants(ofUser: "gina").map(\.transactionId) == [kept.transactionId])
        }

        @Test func namedTransactionMissingFromTheReceiptAsksForARefreshedReceipt() async throws {
            let pipeline = try await PipelineHarness.start(name: "notinreceipt")
            Teardown.add { await pipeline.stop() }
            let inReceipt = try await pipeline.mint(deviceId: "old-receipt")
            let missing = try await pipeline.mint(deviceId: "other-device")
            let id = try await pipeline.upload(
                userId: "hank", receiptData: inReceipt.receiptData, transactionId: missing.transactionId)
            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "rejected")
            #expect(status["reason"] as? String == "transaction_not_in_receipt")
            #expect(status["finishTransaction"] as? Bool == false)
            // What the receipt did hold is credited all the same.
            #expect(try await pipeline.store.grants(ofUser: "hank").map(\.transactionId) == [inReceipt.transactionId])

            // With the refreshed receipt the named transaction is credited and may be finished.
            let refreshed = try await pipeline.upload(
                userId: "hank", receiptData: missing.receiptData, transactionId: missing.transactionId)
            let after = try await pipeline.waitForState(refreshed)
            #expect(after["state"] as? String == "credited")
            #expect(after["finishTransaction"] as? Bool == true)
        }

        @Test func sandboxPurchasesFollowThePolicy() async throws {
            let pipeline = try await PipelineHarness.start(name: "sandboxpolicy", sandboxPolicy: .allowlist(["tester"]))
            Teardown.add { await pipeline.stop() }
            let strangers = try await pipeline.mint(environment: "Sandbox")
            let stranger = try await pipeline.upload(userId: "stranger", receiptData: strangers.receiptData)
            let refused = try await pipeline.waitForState(stranger)
            #expect(refused["state"] as? String == "rejected")
            #expect(refused["reason"] as? String == "sandbox_not_allowed")
            #expect(try await pipeline.store.grants(ofUser: "stranger").isEmpty)

            let testers = try await pipeline.mint(environment: "Sandbox")
            let tester = try await pipeline.upload(userId: "tester", receiptData: testers.receiptData)
            #expect(try await pipeline.waitForState(tester)["state"] as? String == "credited")

            let real = try await pipeline.mint(environment: "Production")
            let paying = try await pipeline.upload(userId: "stranger", receiptData: real.receiptData)
            #expect(try await pipeline.waitForState(paying)["state"] as? String == "credited")
        }

        @Test func transientStatusesNeverBecomeRejections() async throws {
            let pipeline = try await PipelineHarness.start(name: "neverrejected", retryDelays: [1])
            Teardown.add { await pipeline.stop() }
            var submissions: [String] = []
            for (index, status) in [21005, 21009, 21100, 21004].enumerated() {
                let purchase = try await pipeline.mint()
                try await pipeline.injectFault(
                    .init(status: status, count: 2, transactionId: purchase.transactionId))
                submissions.append(try await pipeline.upload(userId: "user\(index)", receiptData: purchase.receiptData))
            }
            let unavailable = try await pipeline.mint()
            try await pipeline.injectFault(.init(httpStatus: 503, count: 2, transactionId: unavailable.transactionId))
            submissions.append(try await pipeline.upload(userId: "user9", receiptData: unavailable.receiptData))

            for id in submissions {
                let status = try await pipeline.waitForState(id, timeout: .seconds(40))
                #expect(status["state"] as? String == "credited", "\(status)")
                #expect(status["attempts"] as? Int == 3)
            }
        }
    }
}
