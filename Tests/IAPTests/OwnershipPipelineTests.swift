import Foundation
import IAPCore
import OrderStore
import Ledger
import Testing
import TestSupport

extension BrokerTests {
    /// Ownership and finish advice through the real pipeline (fake App Store, intake, broker,
    /// verifier, finisher, and the store under test): what an app or an attacker can do with the
    /// receipts and ids it holds.
    @Suite("Ownership and finish advice, end to end")
    struct OwnershipPipelineTests {
        func transactions(_ status: [String: Any]) -> [[String: Any]] { status["transactions"] as? [[String: Any]] ?? [] }

        /// The app holds purchase 2 while its receipt still holds only purchase 1 (Apple tells the
        /// app first and refreshes the receipt later): the receipt's word never finishes purchase 2.
        @Test func aStaleReceiptNeverFinishesThePurchaseTheAppHolds() async throws {
            let pipeline = try await PipelineHarness.start(name: "stalereceipt")
            Teardown.add { await pipeline.stop() }
            let device = UUID().uuidString
            let first = try await pipeline.mint(productId: "com.example.coins.60", deviceId: device)
            let credited = try await pipeline.waitForState(
                try await pipeline.upload(userId: "ana", receiptData: first.receiptData, transactionId: first.transactionId))
            #expect(credited["state"] as? String == "credited" && credited["finishTransaction"] as? Bool == true, "\(credited)")

            // 300 coins for an order of ana's, bought on the same device; the receipt the app
            // has then does not hold them yet, and Apple's ONE_TIME_CHARGE about them is late.
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/notifications/hold", json: [String: String]()).status == 204)
            let orderId = try await pipeline.createOrder(userId: "ana", productId: "com.example.coins.300")
            let minted = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases",
                json: PipelineHarness.StaleMint(
                    bundleId: PipelineHarness.bundleId, productId: "com.example.coins.300", deviceId: device,
                    appAccountToken: orderId, receiptIncludesPurchase: false))
            #expect(minted.status == 201, "\(minted.text)")
            let second = try JSONDecoder().decode(PipelineHarness.Purchase.self, from: minted.body)
            let stale = second.receiptData

            // The stale receipt on its own: purchase 1 is settled, nothing at the top says finish.
            let alone = try await pipeline.waitForState(try await pipeline.upload(userId: "ana", receiptData: stale))
            #expect(alone["finishTransaction"] as? Bool == false, "\(alone)")
            #expect(transactions(alone).map { $0["transactionId"] as? String } == [first.transactionId])
            #expect(transactions(alone).first?["finishTransaction"] as? Bool == true, "\(alone)")
            // Naming purchase 2, or its order: refresh and upload again.
            for body in [
                ["userId": "ana", "receiptData": stale, "transactionId": second.transactionId],
                ["userId": "ana", "receiptData": stale, "orderId": orderId],
            ] {
                let stale = try await pipeline.waitForState(try await pipeline.upload(body))
                #expect(stale["state"] as? String == "rejected" && stale["reason"] as? String == "transaction_not_in_receipt", "\(stale)")
                #expect(stale["finishTransaction"] as? Bool == false, "\(stale)")
            }
            #expect(try await pipeline.order(orderId)["state"] as? String == "created")
            #expect(try await pipeline.grantState(of: second.transactionId, user: "ana") == nil)

            // The app refreshes its receipt (SKReceiptRefreshRequest): it holds both; credited, finishable.
            let refresh = try await HTTP.post(pipeline.fakeURL + "/fake/devices/\(device)/receipt", json: [String: String]())
            #expect(refresh.status == 200, "\(refresh.text)")
            let refreshedReceipt = try #require(refresh.json["receiptData"] as? String)
            #expect(refreshedReceipt != stale)
            let refreshed = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "ana", "receiptData": refreshedReceipt, "orderId": orderId]))
            #expect(refreshed["state"] as? String == "credited" && refreshed["finishTransaction"] as? Bool == true, "\(refreshed)")
            #expect(try await pipeline.order(orderId)["state"] as? String == "paid")
            #expect(try await pipeline.grantState(of: second.transactionId, user: "ana") == "active")

            // The late ONE_TIME_CHARGE finds the order paid: nothing more.
            let released = try await HTTP.post(pipeline.fakeURL + "/fake/notifications/release", json: [String: String]())
            #expect(released.status == 200 && (released.json["released"] as? [Any])?.count == 1, "\(released.text)")
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.notifications(ofTransaction: second.transactionId).map(\.type) == ["ONE_TIME_CHARGE"]
                })
            #expect(try await pipeline.store.grants(ofTransaction: second.transactionId).count == 1)
        }

        /// A transaction id is a lookup: naming another customer's purchase credits nothing, and
        /// the customer's own upload is credited to them.
        @Test func aBareTransactionIdDoesNotTakeAnotherCustomersPurchase() async throws {
            let pipeline = try await PipelineHarness.start(name: "bareid")
            Teardown.add { await pipeline.stop() }
            let victims = try await pipeline.mintStoreKit2(productId: "com.example.coins.300")
            let claim = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "mallory", "transactionId": victims.transactionId]))
            // Answered as an unknown id is: nothing listed, never finishable, no case opened.
            #expect(claim["state"] as? String == "rejected" && claim["reason"] as? String == "proof_required", "\(claim)")
            #expect(claim["finishTransaction"] as? Bool == false)
            #expect(transactions(claim).isEmpty, "\(claim)")
            #expect(try await pipeline.grants(of: "mallory").isEmpty)

            let own = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "victor", "signedTransaction": try #require(victims.signedTransaction)]))
            #expect(own["state"] as? String == "credited" && own["finishTransaction"] as? Bool == true, "\(own)")
            #expect(try await pipeline.grantState(of: victims.transactionId, user: "victor") == "active")
            #expect(try await pipeline.grants(of: "mallory").isEmpty)

            // With an appAccountToken naming the uploader's order, the id alone is enough.
            let orderId = try await pipeline.createOrder(userId: "tom", productId: "com.example.coins.60")
            let tokened = try await pipeline.mintStoreKit2(productId: "com.example.coins.60", appAccountToken: orderId)
            let paid = try await pipeline.waitForState(try await pipeline.upload(["userId": "tom", "transactionId": tokened.transactionId]))
            #expect(paid["state"] as? String == "credited" && paid["finishTransaction"] as? Bool == true, "\(paid)")
            #expect(try await pipeline.order(orderId)["state"] as? String == "paid")
        }

        /// On the App Store Server API's receipt route, what the receipt holds is proven by its
        /// signature; what only the account's history lists is a lookup, credited to nobody.
        @Test func whatOnlyTheHistoryListsCreditsNobody() async throws {
            let pipeline = try await PipelineHarness.start(name: "historylookup", receiptsThroughServerAPI: true)
            Teardown.add { await pipeline.stop() }
            let device = UUID().uuidString
            let first = try await pipeline.mint(productId: "com.example.coins.300", deviceId: device)
            let later = try await pipeline.mint(productId: "com.example.coins.60", deviceId: device)
            // The first receipt (its signature checked) proves what it holds; the account's
            // history also lists a later purchase the receipt does not hold: that is a lookup.
            let claim = try await pipeline.waitForState(try await pipeline.upload(userId: "ana", receiptData: first.receiptData))
            let states = Dictionary(uniqueKeysWithValues: transactions(claim).map {
                ($0["transactionId"] as? String ?? "", $0["state"] as? String ?? "")
            })
            #expect(states[first.transactionId] == "credited" && states[later.transactionId] == "held", "\(claim)")
            #expect(try await pipeline.grantState(of: later.transactionId, user: "ana") == nil)
        }

        /// Apple renews a subscription; before its DID_RENEW arrives, another account uploads the
        /// owner's old receipt, whose answer lists the new period: the period is the owner's.
        @Test func aNewBillingPeriodGoesToTheSubscriptionsOwner() async throws {
            let pipeline = try await PipelineHarness.start(name: "periodowner")
            Teardown.add { await pipeline.stop() }
            let device = UUID().uuidString
            let first = try await pipeline.mint(productId: "com.example.vip.month", token: nil, deviceId: device, type: "auto_renewable")
            let owned = try await pipeline.waitForState(
                try await pipeline.upload(userId: "olga", receiptData: first.receiptData, transactionId: first.transactionId))
            #expect(owned["state"] as? String == "credited", "\(owned)")

            // Apple's notification is late: nothing is delivered until the test says so.
            _ = try await HTTP.post(pipeline.fakeURL + "/fake/config", json: ["notificationURL": ""])
            let renewal = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(first.originalTransactionId)/renew", json: [String: String]())
            #expect(renewal.status == 201, "\(renewal.text)")
            let renewed = try #require(renewal.json["transactionId"] as? String)

            let stranger = try await pipeline.waitForState(
                try await pipeline.upload(userId: "sam", receiptData: first.receiptData, transactionId: renewed))
            #expect(try await pipeline.grants(of: "sam").isEmpty, "\(stranger)")
            #expect(try await pipeline.grantState(of: renewed, user: "olga") == "active", "\(stranger)")
            let states = Dictionary(uniqueKeysWithValues: transactions(stranger).map {
                ($0["transactionId"] as? String ?? "", $0["state"] as? String ?? "")
            })
            #expect(states[renewed] == "owned_by_other_user", "\(stranger)")
        }
    }
}

extension PipelineHarness {
    /// A purchase whose receipt does not hold it yet.
    struct StaleMint: Encodable {
        var bundleId: String
        var productId: String
        var deviceId: String
        var appAccountToken: String
        var receiptIncludesPurchase: Bool
    }

    /// Mints a purchase of any type, with an optional token, on a device.
    func mint(
        productId: String, token: (field: String, value: String)?, deviceId: String?, type: String
    ) async throws -> Purchase {
        var body = ["bundleId": Self.bundleId, "productId": productId, "type": type]
        if let token { body[token.field] = token.value }
        body["deviceId"] = deviceId
        let answer = try await HTTP.post(fakeURL + "/fake/purchases", json: body)
        #expect(answer.status == 201, "\(answer.text)")
        return try JSONDecoder().decode(Purchase.self, from: answer.body)
    }
}
