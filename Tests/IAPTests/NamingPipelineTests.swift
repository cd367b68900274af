import Foundation
import IAPCore
import NIOHTTP1
import OrderStore
import Ledger
import Testing
import TestSupport

extension BrokerTests {
    /// The server never guesses which purchase the app holds: an order named alone is paid only
    /// by the one purchase that can be its, and the ledger, not the receipt, remembers what was
    /// credited. Through the real intake, broker, verifier and order service, on both stores.
    @Suite("The server never guesses which purchase the app holds")
    struct NamingPipelineTests {
        /// A purchase on `device` without a token, whose receipt does not hold it yet.
        struct StaleMint: Encodable {
            var bundleId = PipelineHarness.bundleId
            var productId: String
            var deviceId: String
            var receiptIncludesPurchase = false
        }

        func transactionIds(_ status: [String: Any]) -> [String] {
            (status["transactions"] as? [[String: Any]] ?? []).compactMap { $0["transactionId"] as? String }
        }

        /// A double tap: two orders of one product open at once, then their purchases p1 and p2.
        /// The app holding p2 uploads a receipt that holds only p1, naming o2. Before, p1 paid o2
        /// and the answer said finish: the app finished p2, which nothing credited, and o1 was
        /// never paid. Now nothing is paid by a guess, the app is asked to name its transaction,
        /// and each order ends paid by the purchase made for it.
        @Test(arguments: TestStore.backends)
        func aDoubleTapWithAStaleReceiptPaysEachOrderByItsOwnPurchase(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "doubletap", on: backend)
            Teardown.add { await pipeline.stop() }
            let device = UUID().uuidString
            let o1 = try await pipeline.createOrder(userId: "ana", productId: "com.example.coins.300")
            let o2 = try await pipeline.createOrder(userId: "ana", productId: "com.example.coins.300")
            let p1 = try await pipeline.mint(productId: "com.example.coins.300", token: nil, deviceId: device)
            let minted = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases", json: StaleMint(productId: "com.example.coins.300", deviceId: device))
            #expect(minted.status == 201, "\(minted.text)")
            let p2 = try JSONDecoder().decode(PipelineHarness.Purchase.self, from: minted.body)

            // The app holding p2 (for o2) uploads its stale receipt, naming o2.
            let guessed = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "ana", "receiptData": p2.receiptData, "orderId": o2]))
            #expect(transactionIds(guessed) == [p1.transactionId], "the drill's receipt must hold p1 alone: \(guessed)")
            #expect(guessed["state"] as? String == "rejected" && guessed["reason"] as? String == "name_the_transaction", "\(guessed)")
            #expect(guessed["finishTransaction"] as? Bool == false, "\(guessed)")
            #expect(try await pipeline.order(o2)["state"] as? String == "created")
            #expect(try await pipeline.order(o1)["state"] as? String == "created")

            // It does what the answer says: names p2, with a refreshed receipt.
            let refresh = try await HTTP.post(pipeline.fakeURL + "/fake/devices/\(device)/receipt", json: [String: String]())
            let receipt = try #require(refresh.json["receiptData"] as? String)
            let named = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "ana", "receiptData": receipt, "orderId": o2, "transactionId": p2.transactionId]))
            #expect(named["state"] as? String == "credited" && named["finishTransaction"] as? Bool == true, "\(named)")
            #expect(try await pipeline.order(o2)["transactionId"] as? String == p2.transactionId)

            // The app holding p1 (for o1) names o1 alone: p1 is the one purchase that can be its,
            // and pays it; but a match of dates is no proof of what the app holds, so it is told
            // to name its transaction, not to finish.
            let first = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "ana", "receiptData": receipt, "orderId": o1]))
            #expect(first["state"] as? String == "credited" && first["reason"] as? String == "name_the_transaction", "\(first)")
            #expect(first["finishTransaction"] as? Bool == false, "\(first)")
            #expect(try await pipeline.order(o1)["transactionId"] as? String == p1.transactionId)
            let namedFirst = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "ana", "receiptData": receipt, "orderId": o1, "transactionId": p1.transactionId]))
            #expect(namedFirst["state"] as? String == "credited" && namedFirst["finishTransaction"] as? Bool == true, "\(namedFirst)")
            let grants = try await pipeline.grants(of: "ana")
            #expect(Set(grants.compactMap { $0["transactionId"] as? String }) == [p1.transactionId, p2.transactionId])
        }

        /// The server finishes a credited consumable at Apple, so it leaves every later receipt.
        /// An upload naming its order (alone, or with the transaction) afterwards was told "refresh
        /// the receipt and upload again" for ever. The ledger holds the purchase credited to the
        /// user: named alone, the app is asked to name its transaction; named with it, the order
        /// is paid and the answer says finish.
        @Test(arguments: TestStore.backends)
        func aPurchaseTheServerFinishedStillPaysItsOrderFromTheLedger(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "ledgermemory", finishTransactions: .both, on: backend)
            Teardown.add { await pipeline.stop() }
            let device = UUID().uuidString
            let alone = try await pipeline.createOrder(userId: "ana", productId: "com.example.coins.300")
            let withIt = try await pipeline.createOrder(userId: "ana", productId: "com.example.coins.60")
            let p = try await pipeline.mint(productId: "com.example.coins.300", token: nil, deviceId: device)
            let q = try await pipeline.mint(productId: "com.example.coins.60", token: nil, deviceId: device)
            // The receipt on its own (the app restarted before it knew the order): both credited.
            let credited = try await pipeline.waitForState(try await pipeline.upload(userId: "ana", receiptData: q.receiptData))
            #expect(credited["state"] as? String == "credited", "\(credited)")
            #expect(Set(transactionIds(credited)) == [p.transactionId, q.transactionId])
            for id in [p.transactionId, q.transactionId] {
                let finished = try await eventually(timeout: .seconds(20)) {
                    try await FakeFinishRecord.of(id, at: pipeline.fakeURL).finishedDateMs != nil
                }
                #expect(finished, "the server did not finish \(id) at Apple")
            }
            let refresh = try await HTTP.post(pipeline.fakeURL + "/fake/devices/\(device)/receipt", json: [String: String]())
            let receipt = try #require(refresh.json["receiptData"] as? String)

            // Named alone: the one purchase that can be the order's is in the ledger, not in this
            // upload, so the app is asked to name the transaction it holds; doing so pays it.
            let byOrder = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "ana", "receiptData": receipt, "orderId": alone]))
            #expect(!transactionIds(byOrder).contains(p.transactionId), "the drill's receipt must lack the finished purchase")
            #expect(byOrder["reason"] as? String == "name_the_transaction" && byOrder["finishTransaction"] as? Bool == false, "\(byOrder)")
            let named = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "ana", "receiptData": receipt, "orderId": alone, "transactionId": p.transactionId]))
            #expect(named["state"] as? String == "credited" && named["finishTransaction"] as? Bool == true, "\(named)")
            #expect(try await pipeline.order(alone)["transactionId"] as? String == p.transactionId)

            let byTransaction = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "ana", "receiptData": receipt, "orderId": withIt, "transactionId": q.transactionId]))
            #expect(byTransaction["state"] as? String == "credited" && byTransaction["finishTransaction"] as? Bool == true, "\(byTransaction)")
            #expect(try await pipeline.order(withIt)["transactionId"] as? String == q.transactionId)
            // Still one grant each: the ledger answered, nothing was credited again.
            #expect(try await pipeline.grants(of: "ana").count == 2)
            // Another account of the app on the same device holding q: it is ana's, settled.
            let other = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "eve", "receiptData": receipt, "transactionId": q.transactionId]))
            #expect(other["reason"] as? String == "replayed_from_other_user", "\(other)")
            #expect(try await pipeline.grants(of: "eve").isEmpty)
        }
        /// Goodwill naming an Apple transaction, with Apple asked: it credits what Apple sold
        /// (its quantity, not one unit), keyed by the purchase Apple says it is (a restore's id by
        /// the original it restores, so Apple's refund takes it back), in Apple's environment.
        @Test(arguments: TestStore.backends)
        func goodwillNamingAnApplePurchaseCreditsWhatAppleSold(_ backend: Backend) async throws {
            struct Mint: Encodable {
                var bundleId = PipelineHarness.bundleId
                var productId: String
                var type: String
                var quantity: Int?
                var deviceId: String
                var environment: String?
            }
            struct RestoreAsk: Encodable {
                var deviceId: String
                var inReceipt: Bool
            }
            let pipeline = try await PipelineHarness.start(name: "goodwill-apple", on: backend)
            Teardown.add { await pipeline.stop() }
            func mint(_ body: Mint) async throws -> FakePurchaseAnswer {
                let answer = try await HTTP.post(pipeline.fakeURL + "/fake/purchases", json: body)
                #expect(answer.status == 201, "\(answer.text)")
                return try JSONDecoder().decode(FakePurchaseAnswer.self, from: answer.body)
            }
            struct Goodwill: Encodable {
                var userId: String
                var productId: String
                var appleTransactionId: String
                var quantity: Int?
                var reason = "paid, nothing came"
            }
            func goodwill(_ user: String, _ product: String, _ id: String, quantity: Int? = nil) async throws -> HTTP.Answer {
                try await HTTP.send(
                    pipeline.intakeURL + "/v1/admin/grants", method: .POST,
                    body: try JSONEncoder().encode(Goodwill(userId: user, productId: product, appleTransactionId: id, quantity: quantity)),
                    headers: ["Content-Type": "application/json", "Authorization": "Bearer \(PipelineHarness.adminToken)"])
            }
            func coins(_ user: String) async throws -> Int {
                let answer = try await HTTP.get(pipeline.intakeURL + "/v1/users/\(user)/entitlements")
                return (answer.json["balances"] as? [String: Any])?["coins"] as? Int ?? 0
            }

            let packs = try await mint(Mint(productId: "com.example.coins.300", type: "consumable", quantity: 3, deviceId: "gil-phone"))
            let one = try await goodwill("gil", "com.example.coins.300", packs.transactionId, quantity: 1)
            #expect(one.status == 409 && one.text.contains("bought 3"), "\(one.text)")
            let granted = try await goodwill("gil", "com.example.coins.300", packs.transactionId)
            #expect(granted.status == 201 && granted.json["quantity"] as? Int == 3, "\(granted.text)")
            #expect(try await coins("gil") == 900)
            let upload = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "gil", "receiptData": packs.receiptData, "transactionId": packs.transactionId]))
            #expect(upload["state"] as? String == "credited", "\(upload)")
            #expect((upload["transactions"] as? [[String: Any]])?.first?["state"] as? String == "already_credited", "\(upload)")
            #expect(try await coins("gil") == 900)

            // A restore's id stands for the purchase it restores: Apple's refund of that purchase
            // takes the goodwill back.
            let premium = try await mint(Mint(productId: "com.example.premium", type: "non_consumable", deviceId: "hal-phone"))
            let restore = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(premium.transactionId)/restore", json: RestoreAsk(deviceId: "hal-ipad", inReceipt: false))
            #expect(restore.status == 201, "\(restore.text)")
            let restored = try JSONDecoder().decode(FakePurchaseAnswer.self, from: restore.body)
            #expect(restored.transactionId != premium.transactionId && restored.originalTransactionId == premium.transactionId)
            let byRestore = try await goodwill("hal", "com.example.premium", restored.transactionId)
            #expect(byRestore.status == 201, "\(byRestore.text)")
            let refunded = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(premium.transactionId)/refund", json: [String: String]())
            #expect(refunded.status == 200, "\(refunded.text)")
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.grantState(of: restored.transactionId, user: "hal") == "revoked"
                }, "Apple's refund of the purchase the restore stands for left the goodwill in force")

            // A sandbox purchase: granted in the sandbox.
            let test = try await mint(Mint(productId: "com.example.coins.60", type: "consumable", deviceId: "ivy-phone", environment: "Sandbox"))
            let sandbox = try await goodwill("ivy", "com.example.coins.60", test.transactionId)
            #expect(sandbox.status == 201 && sandbox.json["environment"] as? String == "Sandbox", "\(sandbox.text)")
        }
        /// The runbook's "Verify with Apple and grant to this user": Apple lists the transaction
        /// under the customer's order id, the operator confirms the user. The transaction goes
        /// through the pipeline as Apple signed it, so it is credited to that user (before, it
        /// went as a bare id, was held `owner_unknown` with no purchase to grant, and "Grant
        /// this purchase" found nothing); the app's own upload later is `already_credited`.
        @Test(arguments: TestStore.backends)
        func anOperatorsConfirmedAppleOrderIsCreditedToTheCustomer(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "console-apple-grant", separateAdmin: true, on: backend)
            Teardown.add { await pipeline.stop() }
            let admin = try #require(pipeline.adminURL)
            let dropped = try await pipeline.mint(productId: "com.example.coins.300")
            let appleOrder = try #require(dropped.orderId)
            let signedIn = try await EdgeSecurityTests.signIn(admin, token: PipelineHarness.adminToken)
            let cookie = try #require(signedIn.cookie, "\(signedIn.status) \(signedIn.text)")
            let page = try await EdgeSecurityTests.send(admin + "/admin/apple-orders/\(appleOrder)", headers: ["Cookie": cookie])
            #expect(page.status == 200, "\(page.text)")
            let form = try #require(page.text.range(of: "action=\"/admin/actions/apple-grant\""), "no grant form: \(page.text)")
            let rest = page.text[form.upperBound...]
            let csrfField = try #require(rest.range(of: "name=\"csrf\" value=\""))
            let csrf = String(rest[csrfField.upperBound...].prefix { $0 != "\"" })
            let body = [
                "orderId": appleOrder, "transactionId": dropped.transactionId, "userId": "gil", "csrf": csrf,
                "reason": "ticket 88: paid, nothing came", "key": UUID().uuidString, "back": "/admin/",
            ].map { "\($0.key)=\($0.value.addingPercentEncoding(withAllowedCharacters: .alphanumerics) ?? "")" }.joined(separator: "&")
            let acted = try await EdgeSecurityTests.send(
                admin + "/admin/actions/apple-grant", method: .POST, form: body, headers: ["Cookie": cookie])
            #expect(acted.status == 303, "\(acted.status) \(acted.text)")
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.grantState(of: dropped.transactionId, user: "gil") == "active"
                }, "the transaction Apple listed under the customer's order was not credited to them")
            let upload = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "gil", "receiptData": dropped.receiptData, "transactionId": dropped.transactionId]))
            #expect((upload["transactions"] as? [[String: Any]])?.first?["state"] as? String == "already_credited", "\(upload)")
            #expect(try await pipeline.grants(of: "gil").count == 1)
        }
        /// Ana's month, credited from the upload `first` makes of it, then ended at Apple
        /// (voluntarily) and Apple's EXPIRED recorded.
        static func lapsedMonth(
            _ pipeline: PipelineHarness, first: (PipelineHarness.Purchase) throws -> [String: String]
        ) async throws -> PipelineHarness.Purchase {
            let month = try await pipeline.mint(
                productId: "com.example.vip.month", token: nil, deviceId: "ana-phone", type: "auto_renewable")
            let credited = try await pipeline.waitForState(try await pipeline.upload(try first(month)))
            #expect(credited["state"] as? String == "credited", "\(credited)")
            let expired = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/expire", json: [String: String]())
            #expect(expired.status == 200, "\(expired.text)")
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.subscriptions(ofUser: "ana").first?.state == .expired
                }, "Apple's EXPIRED did not reach the ledger")
            return month
        }

        /// Bea, another account of the app on the same Apple ID, places an order for `month`'s
        /// product and buys the lapsed chain again for it on her device: her order and the new
        /// period.
        static func resubscribedByBea(
            _ pipeline: PipelineHarness, _ month: PipelineHarness.Purchase
        ) async throws -> (order: String, period: PipelineHarness.Purchase) {
            let order = try await pipeline.createOrder(userId: "bea", productId: "com.example.vip.month")
            let again = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/resubscribe", json: ["deviceId": "bea-phone"])
            #expect(again.status == 201, "\(again.text)")
            return (order, try JSONDecoder().decode(PipelineHarness.Purchase.self, from: again.body))
        }

        /// Bea's receipt, naming the new period with her order: credited to her, finishable, her
        /// order paid by it, nothing of it Ana's.
        static func expectBeaPaid(
            _ pipeline: PipelineHarness, order: String, period: PipelineHarness.Purchase
        ) async throws {
            let named = try await pipeline.waitForState(
                try await pipeline.upload([
                    "userId": "bea", "receiptData": period.receiptData, "transactionId": period.transactionId, "orderId": order,
                ]))
            #expect(named["state"] as? String == "credited" && named["finishTransaction"] as? Bool == true, "\(named)")
            #expect(try await pipeline.grantState(of: period.transactionId, user: "bea") == "active")
            #expect(try await pipeline.grantState(of: period.transactionId, user: "ana") == nil)
            #expect(try await pipeline.order(order)["transactionId"] as? String == period.transactionId)
        }

        /// A resubscription arrives as a receipt, which says nothing of why a period was bought
        /// (`verifyReceipt` has no `transactionReason`). Before, it was taken for a renewal and
        /// went to the chain's old owner, though Apple's notification had recorded it awaiting
        /// its buyer, and the buyer's order was never paid. Now the ledger's memory (and a
        /// period bought after the chain expired) makes it a new purchase: the buyer's, paying
        /// the order it was bought for.
        @Test(arguments: TestStore.backends)
        func aResubscriptionUploadedAsAReceiptIsItsBuyers(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "resubscribe-receipt", on: backend)
            Teardown.add { await pipeline.stop() }
            let month = try await Self.lapsedMonth(pipeline) { ["userId": "ana", "signedTransaction": try #require($0.signedTransaction)] }
            let (order, period) = try await Self.resubscribedByBea(pipeline, month)
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.notifications(ofTransaction: period.transactionId).map(\.outcome) == ["buyer_unknown"]
                }, "Apple's SUBSCRIBED did not record the new purchase awaiting its buyer")
            try await Self.expectBeaPaid(pipeline, order: order, period: period)
        }

        /// The same resubscription, its receipt uploaded before Apple's SUBSCRIBED reaches the
        /// ledger: nothing recorded it as a new purchase, so its dates say it (the receipt lists
        /// the chain's period before it, ended when Apple ended the chain). Before, it went to
        /// the chain's old owner and the buyer's order was never paid; Apple's notification,
        /// arriving after, changes nothing.
        @Test(arguments: TestStore.backends)
        func aResubscriptionUploadedBeforeApplesWordIsItsBuyersByItsDates(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "resubscribe-dates", on: backend)
            Teardown.add { await pipeline.stop() }
            let month = try await Self.lapsedMonth(pipeline) {
                ["userId": "ana", "receiptData": $0.receiptData, "transactionId": $0.transactionId]
            }
            // Apple's next notifications wait while Bea buys the chain again for her order.
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/notifications/hold", json: [String: String]()).status == 204)
            let (order, period) = try await Self.resubscribedByBea(pipeline, month)
            try await Self.expectBeaPaid(pipeline, order: order, period: period)

            // Apple's SUBSCRIBED (RESUBSCRIBE) arrives: it names what is credited already.
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/notifications/release", json: [String: String]()).status == 200)
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await !pipeline.store.notifications(ofTransaction: period.transactionId).isEmpty
                }, "Apple's SUBSCRIBED did not reach the ledger")
            #expect(try await pipeline.grantState(of: period.transactionId, user: "bea") == "active")
            #expect(try await pipeline.store.subscriptions(ofUser: "bea").first?.originalTransactionId == month.originalTransactionId)
        }
    }
}
