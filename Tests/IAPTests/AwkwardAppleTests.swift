import Foundation
import IAPCore
import OrderStore
import Ledger
import Testing
import TestSupport

/// Where Apple is awkward, through the real pipeline and the fake App Store's routes for it:
/// upgrades within a subscription group, extended renewal dates, `verifyReceipt` leaving out
/// what it refunded, and notifications that arrive late, reversed and twice.
extension BrokerTests {
    @Suite("Apple's awkward moments: upgrades, extensions, refunded purchases left out, held notifications")
    struct AwkwardAppleTests {
        static let month = "com.example.vip.month"
        static let year = "com.example.vip.year"

        struct Mint: Encodable {
            var bundleId = PipelineHarness.bundleId
            var productId: String
            var type: String
            var deviceId: String?
        }

        func mint(_ pipeline: PipelineHarness, _ productId: String, type: String, deviceId: String? = nil) async throws
            -> FakePurchaseAnswer
        {
            let answer = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases", json: Mint(productId: productId, type: type, deviceId: deviceId))
            #expect(answer.status == 201, "\(answer.text)")
            return try JSONDecoder().decode(FakePurchaseAnswer.self, from: answer.body)
        }

        func grant(_ pipeline: PipelineHarness, of transactionId: String) async throws -> Grant? {
            try await pipeline.store.grants(ofTransaction: transactionId).first
        }

        /// The fake's `verifyReceipt` answer for a receipt.
        func verifyReceipt(_ pipeline: PipelineHarness, _ receiptData: String) async throws -> [[String: Any]] {
            let answer = try await HTTP.post(pipeline.fakeURL + "/verifyReceipt", json: ["receipt-data": receiptData])
            #expect(answer.status == 200, "\(answer.text)")
            return ((answer.json["receipt"] as? [String: Any])?["in_app"] as? [[String: Any]]) ?? []
        }

        /// An upgrade from the monthly to the yearly tier, as Apple makes it: a new period of the
        /// higher tier in the same chain (`transactionReason` PURCHASE), DID_CHANGE_RENEWAL_PREF
        /// (UPGRADE) about it. An upgrade is a new purchase, and another account of the app on the
        /// same Apple ID may have made it: without a token, Apple's notification alone credits
        /// nobody (`buyer_unknown`) and the month stays in force; the buyer's upload credits the
        /// year and ends the month at the upgrade; another user's upload then gets nothing; the
        /// owner's refreshed receipt marks the month `is_upgraded`.
        @Test func anUpgradeEndsTheLowerTierAndCreditsTheHigherToItsBuyer() async throws {
            let pipeline = try await PipelineHarness.start(name: "upgrade")
            Teardown.add { await pipeline.stop() }
            let month = try await mint(pipeline, Self.month, type: "auto_renewable", deviceId: "uma-phone")
            let first = try await pipeline.upload(["userId": "uma", "signedTransaction": month.signedTransaction])
            #expect(try await pipeline.waitForState(first)["state"] as? String == "credited")

            struct Upgrade: Encodable {
                var productId = AwkwardAppleTests.year
                var expiresInSeconds = 365 * 86_400
            }
            let upgraded = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/upgrade", json: Upgrade())
            #expect(upgraded.status == 201, "\(upgraded.text)")
            let year = try JSONDecoder().decode(FakePurchaseAnswer.self, from: upgraded.body)
            #expect(year.originalTransactionId == month.originalTransactionId && year.transactionId != month.transactionId)
            #expect(year.webOrderLineItemId != nil && year.webOrderLineItemId != month.webOrderLineItemId)

            // The notification keeps the year for its buyer: nobody is credited, the month runs on.
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.purchase(year.transactionId)?.heldReason == "buyer_unknown"
                }, "DID_CHANGE_RENEWAL_PREF did not keep the yearly tier for its buyer")
            #expect(try await grant(pipeline, of: year.transactionId) == nil)
            #expect(try await grant(pipeline, of: month.transactionId).map { $0.state == .active && ($0.expiresAt ?? .distantPast) > Date() } == true)

            // The buyer's app uploads the upgrade: the year is hers and the month ends at the upgrade.
            let bought = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "uma", "signedTransaction": year.signedTransaction]))
            #expect(bought["state"] as? String == "credited" && bought["finishTransaction"] as? Bool == true, "\(bought)")
            let yearGrant = try #require(try await grant(pipeline, of: year.transactionId))
            let monthGrant = try #require(try await grant(pipeline, of: month.transactionId))
            #expect(yearGrant.productId == Self.year && yearGrant.userId == "uma")
            let upgradedAt = yearGrant.grantedAt
            #expect(
                (monthGrant.expiresAt ?? .distantFuture) <= upgradedAt.addingTimeInterval(5),
                "the monthly tier still runs to \(monthGrant.expiresAt as Any), past the upgrade at \(upgradedAt)")
            #expect((yearGrant.expiresAt ?? .distantPast) > Date().addingTimeInterval(300 * 86_400))

            // Another user uploading the new period: this very transaction is credited to her.
            let stranger = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "vic", "signedTransaction": year.signedTransaction]))
            #expect(
                stranger["state"] as? String == "rejected" && stranger["reason"] as? String == "replayed_from_other_user",
                "\(stranger)")
            #expect(try await pipeline.grants(of: "vic").filter { $0["state"] as? String == "active" }.isEmpty)

            // The owner's refreshed receipt: the month is marked upgraded, and nothing is left open.
            let refreshed = try await HTTP.post(pipeline.fakeURL + "/fake/devices/uma-phone/receipt", json: [String: String]())
            let receipt = try #require(refreshed.json["receiptData"] as? String, "\(refreshed.text)")
            let listed = try await verifyReceipt(pipeline, receipt)
            #expect(listed.first { $0["transaction_id"] as? String == month.transactionId }?["is_upgraded"] as? String == "true")
            let own = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "uma", "receiptData": receipt, "transactionId": year.transactionId]))
            #expect(own["state"] as? String == "credited" && own["finishTransaction"] as? Bool == true, "\(own)")
            let states = (own["transactions"] as? [[String: Any]] ?? []).reduce(into: [String: String]()) {
                $0[$1["transactionId"] as? String ?? ""] = $1["state"] as? String
            }
            #expect(states[month.transactionId] == "superseded" && states[year.transactionId] == "already_credited", "\(own)")
            let active = try await pipeline.grants(of: "uma").filter {
                $0["state"] as? String == "active" && $0["productId"] as? String == Self.year
            }
            #expect(active.count == 1, "\(active)")

            // Refused as Apple would: the same tier again, an unknown chain, a consumable.
            let again = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/upgrade", json: ["productId": Self.year])
            #expect(again.status == 409, "\(again.text)")
            let unknown = try await HTTP.post(pipeline.fakeURL + "/fake/subscriptions/1/upgrade", json: ["productId": Self.year])
            #expect(unknown.status == 404, "\(unknown.text)")
        }

        /// Apple extends the period in force (RENEWAL_EXTENDED): the grant lasts as long; days
        /// outside Apple's 1 to 90 and a purchase that is no subscription are refused.
        @Test func anExtensionMovesTheEndOfTheGrantInForce() async throws {
            let pipeline = try await PipelineHarness.start(name: "extend")
            Teardown.add { await pipeline.stop() }
            let month = try await mint(pipeline, Self.month, type: "auto_renewable")
            let id = try await pipeline.upload(["userId": "ulla", "signedTransaction": month.signedTransaction])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            let before = try #require(try await grant(pipeline, of: month.transactionId)?.expiresAt)

            let extended = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/extend", json: ["days": 10])
            #expect(extended.status == 200 && extended.json["notificationType"] as? String == "RENEWAL_EXTENDED", "\(extended.text)")
            let expected = before.addingTimeInterval(10 * 86_400)
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    abs((try await grant(pipeline, of: month.transactionId)?.expiresAt ?? .distantPast).timeIntervalSince(expected)) < 2
                }, "the grant did not move to \(expected)")
            let outcomes = try await pipeline.store.notifications(ofTransaction: month.transactionId)
            #expect(outcomes.map(\.outcome) == ["extended"], "\(outcomes)")

            for days in [0, 91] {
                let refused = try await HTTP.post(
                    pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/extend", json: ["days": days])
                #expect(refused.status == 400, "\(days): \(refused.text)")
            }
            let coins = try await mint(pipeline, "com.example.coins.60", type: "consumable")
            let notASubscription = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(coins.originalTransactionId)/extend", json: ["days": 3])
            #expect(notASubscription.status == 409, "\(notASubscription.text)")
        }

        struct PriceIncrease: Encodable {
            var price: Int
            var consent: String
        }

        /// Apple raises a subscription's price: PRICE_INCREASE, PENDING while it awaits the
        /// customer's consent (without it the subscription ends at its renewal date), then
        /// ACCEPTED. The subscription says so, with the next period's price, to the app
        /// (`/subscriptions`) as the renewal information Apple signed last; no grant changes.
        /// Before, the type was unknown and the renewal's price and consent were dropped.
        @Test(arguments: TestStore.backends)
        func aPriceIncreaseAndItsConsentAreKeptOnTheSubscription(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "price-increase", on: backend)
            Teardown.add { await pipeline.stop() }
            let month = try await mint(pipeline, Self.month, type: "auto_renewable")
            let id = try await pipeline.upload(["userId": "ulla", "signedTransaction": month.signedTransaction])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            func subscription() async throws -> [String: Any] {
                let answer = try await HTTP.get(pipeline.intakeURL + "/v1/users/ulla/subscriptions")
                return (answer.json["subscriptions"] as? [[String: Any]])?.first ?? [:]
            }
            for consent in ["pending", "accepted"] {
                let told = try await HTTP.post(
                    pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/price-increase",
                    json: PriceIncrease(price: 12_990, consent: consent))
                #expect(told.status == 200 && told.json["notificationType"] as? String == "PRICE_INCREASE", "\(told.text)")
                let said = try await eventually(timeout: .seconds(20)) { try await subscription()["priceIncrease"] as? String == consent }
                let kept = try await subscription()
                #expect(said, "the subscription does not say the price increase is \(consent): \(kept)")
                #expect(kept["renewalPrice"] as? Int == 12_990 && kept["renewalCurrency"] as? String == "USD", "\(kept)")
            }
            #expect(try await grant(pipeline, of: month.transactionId)?.state == .active)
            let refused = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/price-increase",
                json: PriceIncrease(price: 0, consent: "pending"))
            #expect(refused.status == 400, "\(refused.text)")
        }

        /// Apple's `verifyReceipt` leaves a consumable it refunded out of every receipt. While
        /// the REFUND has not arrived, an upload naming the purchase is told to refresh and
        /// upload again (not finished: we cannot tell it from a receipt older than the
        /// purchase); once the REFUND is in, the same upload is finishable, and nothing is
        /// credited. A refunded subscription period stays in the receipt, with its date.
        @Test func aRefundedPurchaseLeftOutOfTheReceiptIsFinishableOnceTheRefundIsIn() async throws {
            let pipeline = try await PipelineHarness.start(name: "leftout")
            Teardown.add { await pipeline.stop() }
            let coins = try await mint(pipeline, "com.example.coins.60", type: "consumable", deviceId: "wes-phone")
            let hold = try await HTTP.post(pipeline.fakeURL + "/fake/notifications/hold", json: [String: String]())
            #expect(hold.status == 204, "\(hold.text)")
            let refund = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(coins.transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            let refreshed = try await HTTP.post(pipeline.fakeURL + "/fake/devices/wes-phone/receipt", json: [String: String]())
            let receipt = try #require(refreshed.json["receiptData"] as? String, "\(refreshed.text)")
            #expect(try await verifyReceipt(pipeline, receipt).isEmpty, "a refunded consumable is still listed")

            let early = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "wes", "receiptData": receipt, "transactionId": coins.transactionId]))
            #expect(
                early["reason"] as? String == "transaction_not_in_receipt" && early["finishTransaction"] as? Bool == false, "\(early)")

            let released = try await HTTP.post(pipeline.fakeURL + "/fake/notifications/release", json: [String: String]())
            #expect(released.status == 200, "\(released.text)")
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    // Its ONE_TIME_CHARGE came before the hold.
                    try await pipeline.store.notifications(ofTransaction: coins.transactionId).map(\.type) == ["ONE_TIME_CHARGE", "REFUND"]
                })
            let late = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "wes", "receiptData": receipt, "transactionId": coins.transactionId]))
            #expect(
                late["state"] as? String == "rejected" && late["reason"] as? String == "purchase_revoked"
                    && late["finishTransaction"] as? Bool == true, "\(late)")
            #expect(try await pipeline.grants(of: "wes").filter { $0["state"] as? String == "active" }.isEmpty)

            // A refunded billing period stays in the receipt with its cancellation date.
            let month = try await mint(pipeline, Self.month, type: "auto_renewable")
            let cancelled = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(month.transactionId)/refund", json: [String: String]())
            #expect(cancelled.status == 200, "\(cancelled.text)")
            let period = try await verifyReceipt(pipeline, month.receiptData).first { $0["transaction_id"] as? String == month.transactionId }
            #expect(period?["cancellation_date_ms"] != nil, "\(period as Any)")
        }

        /// Held notifications keep the `signedDate` they were signed with and are delivered in the
        /// order asked: a refund and its reversal released in reverse, each twice, leave the
        /// purchase credited, as in Apple's order.
        @Test func heldNotificationsAreReleasedInTheOrderAskedAndTheLedgerKeepsApplesOrder() async throws {
            let pipeline = try await PipelineHarness.start(name: "held")
            Teardown.add { await pipeline.stop() }
            let premium = try await mint(pipeline, "com.example.premium", type: "non_consumable")
            let id = try await pipeline.upload(["userId": "xia", "signedTransaction": premium.signedTransaction])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")

            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/notifications/hold", json: [String: String]()).status == 204)
            let refund = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(premium.transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            let reversal = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(premium.transactionId)/notify", json: ["notificationType": "REFUND_REVERSED"])
            #expect(reversal.status == 200, "\(reversal.text)")
            // Nothing has arrived since the purchase's ONE_TIME_CHARGE, from before the hold.
            #expect(try await pipeline.store.notifications(ofTransaction: premium.transactionId).map(\.type) == ["ONE_TIME_CHARGE"])

            struct Release: Encodable {
                var order: String
                var seed: UInt64?
                var duplicate: Bool?
            }
            let refused = try await HTTP.post(
                pipeline.fakeURL + "/fake/notifications/release", json: Release(order: "sideways", seed: nil, duplicate: nil))
            #expect(refused.status == 400, "\(refused.text)")
            let seedWithoutShuffle = try await HTTP.post(
                pipeline.fakeURL + "/fake/notifications/release", json: Release(order: "signed", seed: 3, duplicate: nil))
            #expect(seedWithoutShuffle.status == 400, "\(seedWithoutShuffle.text)")

            let released = try await HTTP.post(
                pipeline.fakeURL + "/fake/notifications/release", json: Release(order: "reverse", seed: nil, duplicate: true))
            #expect(released.status == 200, "\(released.text)")
            let delivered = released.json["released"] as? [[String: Any]] ?? []
            #expect(delivered.map { $0["notificationType"] as? String } == ["REFUND_REVERSED", "REFUND"], "\(released.text)")
            let signed = delivered.compactMap { ($0["signedDate"] as? NSNumber)?.int64Value }
            #expect(signed.count == 2 && signed[0] >= signed[1], "\(released.text)")
            #expect(delivered.allSatisfy { ($0["results"] as? [String]) == ["SUCCESS", "SUCCESS"] }, "\(released.text)")

            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.notifications(ofTransaction: premium.transactionId).count >= 3
                })
            // Settled: the reversal, signed after the refund, wins whichever came first.
            try await Task.sleep(for: .milliseconds(500))
            #expect(try await pipeline.grantState(of: premium.transactionId, user: "xia") == "active")
            let outcomes = try await pipeline.store.notifications(ofTransaction: premium.transactionId)
            #expect(outcomes.map(\.type).sorted() == ["ONE_TIME_CHARGE", "REFUND", "REFUND_REVERSED"], "\(outcomes)")

            // Released, the hold is over: the next notification goes out at once.
            let declined = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(premium.transactionId)/decline-refund", json: [String: String]())
            #expect(declined.status == 200, "\(declined.text)")
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.notifications(ofTransaction: premium.transactionId).contains { $0.type == "REFUND_DECLINED" }
                })
        }
    }
}
