import Foundation
import IAPCore
import NIOHTTP1
import OrderStore
import Ledger
import Testing
import TestSupport

/// The core's answers checked against who really paid, through the real pipeline (fake App
/// Store, broker, verifier, finisher) on the pass's store: an order is paid only by the purchase
/// made for it, a renewal told before the first upload reaches its owner, a new purchase in a
/// chain is its buyer's, a cancellation without Apple's type takes back no more than Apple's
/// typed word, an order placed for an upgrade is paid by it, and the lesser edges.
extension BrokerTests {
    @Suite("Who really paid: orders, renewals, resubscriptions, untyped cancellations")
    struct WhoReallyPaidTests {
        static let coins = "com.example.coins.300"
        static let month = "com.example.vip.month"
        static let year = "com.example.vip.year"

        struct Mint: Encodable {
            var bundleId = PipelineHarness.bundleId
            var productId: String
            var type: String = "consumable"
            var quantity: Int?
            var deviceId: String?
            var expiresInSeconds: Int?
            var receiptIncludesPurchase: Bool?
        }

        struct RestoreAsk: Encodable {
            var deviceId: String
            var inReceipt: Bool
        }

        func mint(_ pipeline: PipelineHarness, _ mint: Mint) async throws -> FakePurchaseAnswer {
            let answer = try await HTTP.post(pipeline.fakeURL + "/fake/purchases", json: mint)
            #expect(answer.status == 201, "\(answer.text)")
            return try JSONDecoder().decode(FakePurchaseAnswer.self, from: answer.body)
        }

        func upload(_ pipeline: PipelineHarness, _ body: [String: String]) async throws -> [String: Any] {
            try await pipeline.waitForState(try await pipeline.upload(body))
        }

        func balance(_ pipeline: PipelineHarness, of user: String) async throws -> Int {
            let answer = try await HTTP.get(pipeline.intakeURL + "/v1/users/\(user)/entitlements")
            return (answer.json["balances"] as? [String: Any])?["coins"] as? Int ?? 0
        }

        func receipt(_ pipeline: PipelineHarness, device: String) async throws -> String {
            let answer = try await HTTP.post(pipeline.fakeURL + "/fake/devices/\(device)/receipt", json: [String: String]())
            return try #require(answer.json["receiptData"] as? String, "\(answer.text)")
        }

        /// Finding 1. The app buys 300 coins for o1; the upload is lost. The user orders again
        /// (o2) and buys again; the receipt is not refreshed yet: it holds the first purchase
        /// only. An upload naming o2 with that receipt must not let the first purchase pay o2,
        /// nor tell the app to finish: the second purchase is not credited, and a finished
        /// consumable leaves every later receipt. The first purchase's own retry, naming it,
        /// pays o1; the refreshed receipt pays o2; the user holds 600.
        @Test func anOrderIsNeverPaidByAPurchaseMadeBeforeIt() async throws {
            let pipeline = try await PipelineHarness.start(name: "paid-before")
            Teardown.add { await pipeline.stop() }
            let o1 = try await pipeline.createOrder(userId: "olga", productId: Self.coins)
            let first = try await mint(pipeline, Mint(productId: Self.coins, deviceId: "olga-phone"))
            try await Task.sleep(for: .milliseconds(20))
            let o2 = try await pipeline.createOrder(userId: "olga", productId: Self.coins)
            try await Task.sleep(for: .milliseconds(20))
            let second = try await mint(pipeline, Mint(productId: Self.coins, deviceId: "olga-phone"))

            // The first purchase came milliseconds before o2, within what our clock may run
            // ahead of Apple's, and o1 is open too: which order it was made for only the app
            // knows. Nothing is paid by a guess; the app is asked to name its transaction.
            let stale = try await upload(pipeline, ["userId": "olga", "receiptData": first.receiptData, "orderId": o2])
            #expect(stale["state"] as? String == "rejected", "\(stale)")
            #expect(stale["reason"] as? String == "name_the_transaction", "\(stale)")
            #expect(stale["finishTransaction"] as? Bool == false, "\(stale)")
            #expect(try await pipeline.order(o2)["state"] as? String == "created")
            #expect(try await pipeline.order(o1)["state"] as? String == "created")

            // The first purchase's own retry names it with its order: it pays o1.
            let retry = try await upload(
                pipeline, ["userId": "olga", "receiptData": first.receiptData, "orderId": o1, "transactionId": first.transactionId])
            #expect(retry["state"] as? String == "credited" && retry["finishTransaction"] as? Bool == true, "\(retry)")
            #expect(try await pipeline.order(o1)["state"] as? String == "paid")
            #expect(try await pipeline.order(o1)["transactionId"] as? String == first.transactionId)
            // The app finishes the first purchase: StoreKit drops a finished consumable from
            // every later receipt, as the fake does.
            let finished = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(first.transactionId)/finish", json: [String: String]())
            #expect(finished.status == 200, "\(finished.text)")

            // The refreshed receipt holds the second purchase only: it pays o2 (named alone, the
            // app is told to name its transaction before it finishes).
            let refreshedReceipt = try await receipt(pipeline, device: "olga-phone")
            let refreshed = try await upload(pipeline, ["userId": "olga", "receiptData": refreshedReceipt, "orderId": o2])
            #expect(refreshed["state"] as? String == "credited" && refreshed["reason"] as? String == "name_the_transaction", "\(refreshed)")
            #expect(refreshed["finishTransaction"] as? Bool == false, "\(refreshed)")
            let named = try await upload(
                pipeline, ["userId": "olga", "receiptData": refreshedReceipt, "orderId": o2, "transactionId": second.transactionId])
            #expect(named["state"] as? String == "credited" && named["finishTransaction"] as? Bool == true, "\(named)")
            #expect(try await pipeline.order(o2)["transactionId"] as? String == second.transactionId)
            #expect(try await balance(pipeline, of: "olga") == 600)
        }

        /// Finding 2. Apple announces a renewal before the app's first upload (nobody owns the
        /// subscription yet). When the first upload makes the user its owner, the renewed
        /// period is credited to them too: Apple does not tell again.
        @Test func aRenewalToldBeforeTheFirstUploadIsCreditedToTheOwner() async throws {
            let pipeline = try await PipelineHarness.start(name: "renew-first")
            Teardown.add { await pipeline.stop() }
            let first = try await mint(pipeline, Mint(productId: Self.month, type: "auto_renewable", deviceId: "rita-phone"))
            let renewed = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(first.originalTransactionId)/renew", json: [String: String]())
            #expect(renewed.status == 201, "\(renewed.text)")
            let renewal = try JSONDecoder().decode(FakePurchaseAnswer.self, from: renewed.body)
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.notifications(ofTransaction: renewal.transactionId).contains { $0.outcome == "owner_unknown" }
                }, "DID_RENEW was not applied before the upload")

            let answer = try await upload(pipeline, ["userId": "rita", "signedTransaction": first.signedTransaction])
            #expect(answer["state"] as? String == "credited", "\(answer)")
            let grant = try #require(try await pipeline.store.grants(ofTransaction: renewal.transactionId).first)
            #expect(grant.userId == "rita" && grant.state == .active)
            #expect((grant.expiresAt ?? .distantPast) > Date().addingTimeInterval(40 * 86_400))
            let active = try await HTTP.get(pipeline.intakeURL + "/v1/users/rita/entitlements")
            #expect((active.json["grants"] as? [[String: Any]] ?? []).contains { $0["transactionId"] as? String == renewal.transactionId })
        }

        /// Ana buys a month on the family iPad and uploads it; it lapses; someone on the same
        /// Apple ID resubscribes without a token. The first purchase and the resubscription.
        func anasMonthLapsedAndBoughtAgain(_ pipeline: PipelineHarness) async throws -> (FakePurchaseAnswer, FakePurchaseAnswer) {
            let month = try await mint(
                pipeline, Mint(productId: Self.month, type: "auto_renewable", deviceId: "family-ipad", expiresInSeconds: 2))
            let first = try await upload(pipeline, ["userId": "ana", "signedTransaction": month.signedTransaction])
            #expect(first["state"] as? String == "credited", "\(first)")
            try await Task.sleep(for: .seconds(3))
            // The new period lasts an hour: the tests renew it however long a loaded machine
            // takes to get there (with the first period's 2 s, the renewal found it lapsed).
            struct Resubscribe: Encodable {
                var deviceId = "family-ipad"
                var expiresInSeconds = 3600
            }
            let resubscribed = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/resubscribe", json: Resubscribe())
            #expect(resubscribed.status == 201, "\(resubscribed.text)")
            return (month, try JSONDecoder().decode(FakePurchaseAnswer.self, from: resubscribed.body))
        }

        /// Finding 3. A subscription lapses; another account of the app on the same Apple ID
        /// resubscribes (Apple keeps the chain's original transaction id). The resubscription
        /// is a new purchase: it is credited to the account that proves it bought it, not to the
        /// chain's first owner, and that buyer is not told its purchase belongs to someone else.
        /// Apple's SUBSCRIBED (RESUBSCRIBE) notification alone gives it to nobody.
        @Test func aResubscriptionByAnotherAccountIsCreditedToItsBuyer() async throws {
            let pipeline = try await PipelineHarness.start(name: "resubscribe")
            Teardown.add { await pipeline.stop() }
            let (month, again) = try await anasMonthLapsedAndBoughtAgain(pipeline)
            #expect(again.originalTransactionId == month.originalTransactionId && again.transactionId != month.transactionId)
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await !pipeline.store.notifications(ofTransaction: again.transactionId).isEmpty
                }, "SUBSCRIBED (RESUBSCRIBE) was not applied")
            #expect(try await pipeline.store.grants(ofTransaction: again.transactionId).isEmpty, "the notification gave it to ana")

            let bought = try await upload(pipeline, ["userId": "ben", "signedTransaction": again.signedTransaction])
            #expect(bought["state"] as? String == "credited" && bought["finishTransaction"] as? Bool == true, "\(bought)")
            let grant = try #require(try await pipeline.store.grants(ofTransaction: again.transactionId).first)
            #expect(grant.userId == "ben" && grant.state == .active)
            // The earlier period stays ana's; the subscription (its renewals) is ben's now.
            #expect(try await pipeline.store.grants(ofTransaction: month.transactionId).first?.userId == "ana")
            let listed = try await HTTP.get(pipeline.intakeURL + "/v1/users/ben/subscriptions")
            #expect((listed.json["subscriptions"] as? [[String: Any]] ?? []).count == 1, "\(listed.text)")
            let renewed = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/renew", json: [String: String]())
            #expect(renewed.status == 201, "\(renewed.text)")
            let renewal = try JSONDecoder().decode(FakePurchaseAnswer.self, from: renewed.body)
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.grants(ofTransaction: renewal.transactionId).first?.userId == "ben"
                }, "the resubscription's renewal did not go to its buyer")
        }

        /// A resubscription by another account without a token begins a stretch of the chain
        /// owned by its buyer: a renewal of it that Apple tells of before the buyer's upload is
        /// nobody's yet (not the first owner's), the first owner's upload of it is not told to
        /// finish, and the buyer's proof of the resubscription credits both to the buyer; the
        /// earlier period stays with the first owner.
        @Test func aRenewalOfAnotherAccountsResubscriptionWaitsForItsBuyer() async throws {
            let pipeline = try await PipelineHarness.start(name: "stretch")
            Teardown.add { await pipeline.stop() }
            let (month, again) = try await anasMonthLapsedAndBoughtAgain(pipeline)
            let renewed = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/renew", json: [String: String]())
            #expect(renewed.status == 201, "\(renewed.text)")
            let renewal = try JSONDecoder().decode(FakePurchaseAnswer.self, from: renewed.body)
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await !pipeline.store.notifications(ofTransaction: renewal.transactionId).isEmpty
                }, "DID_RENEW was not applied")
            #expect(try await pipeline.store.grants(ofTransaction: renewal.transactionId).isEmpty, "the renewal went to ana")

            // Ana's app holds the renewal too (the same Apple ID): it is not hers to finish.
            let anas = try await upload(pipeline, ["userId": "ana", "signedTransaction": renewal.signedTransaction])
            #expect(anas["finishTransaction"] as? Bool == false && anas["state"] as? String != "credited", "\(anas)")
            #expect(try await pipeline.store.grants(ofTransaction: renewal.transactionId).isEmpty, "ana's upload took the renewal")

            let bought = try await upload(pipeline, ["userId": "ben", "signedTransaction": again.signedTransaction])
            #expect(bought["state"] as? String == "credited" && bought["finishTransaction"] as? Bool == true, "\(bought)")
            #expect(try await pipeline.store.grants(ofTransaction: again.transactionId).first?.userId == "ben")
            #expect(try await pipeline.store.grants(ofTransaction: renewal.transactionId).first?.userId == "ben")
            #expect(try await pipeline.store.grants(ofTransaction: month.transactionId).first?.userId == "ana")
            let bens = try await upload(pipeline, ["userId": "ben", "signedTransaction": renewal.signedTransaction])
            let bensRenewal = (bens["transactions"] as? [[String: Any]])?.first
            #expect(bensRenewal?["state"] as? String == "already_credited" && bens["finishTransaction"] as? Bool == true, "\(bens)")
            // Settled for its buyer now: ana's app may finish it.
            let anasAgain = try await upload(pipeline, ["userId": "ana", "signedTransaction": renewal.signedTransaction])
            #expect(anasAgain["reason"] as? String == "replayed_from_other_user", "\(anasAgain)")
        }

        /// Finding 4. Three packs, one refunded prorated: two are left. `verifyReceipt` then
        /// dates a cancellation of the purchase but says neither its type nor how much: the app's
        /// next receipt upload must not take the other two back, whether it comes after Apple's
        /// REFUND notification or before it.
        @Test(arguments: [false, true])
        func aCancellationWithoutItsTypeTakesBackNoMoreThanApplesWord(receiptFirst: Bool) async throws {
            let pipeline = try await PipelineHarness.start(name: "untyped-\(receiptFirst)")
            Teardown.add { await pipeline.stop() }
            let packs = try await mint(pipeline, Mint(productId: Self.coins, quantity: 3, deviceId: "pia-phone"))
            let credited = try await upload(
                pipeline, ["userId": "pia", "receiptData": packs.receiptData, "transactionId": packs.transactionId])
            #expect(credited["state"] as? String == "credited", "\(credited)")
            #expect(try await balance(pipeline, of: "pia") == 900)

            if receiptFirst {
                let held = try await HTTP.post(pipeline.fakeURL + "/fake/notifications/hold", json: [String: String]())
                #expect(held.status < 300, "\(held.text)")
            }
            struct Refund: Encodable {
                var revocationType = "REFUND_PRORATED"
                var revocationPercentage = 33_333
            }
            let refunded = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(packs.transactionId)/refund", json: Refund())
            #expect(refunded.status == 200, "\(refunded.text)")
            if !receiptFirst {
                #expect(
                    try await eventually(timeout: .seconds(20)) { try await balance(pipeline, of: "pia") == 600 },
                    "the prorated refund did not take one pack back")
            }
            // The refreshed receipt lists the purchase with a cancellation date and no type.
            let again = try await upload(
                pipeline,
                ["userId": "pia", "receiptData": try await receipt(pipeline, device: "pia-phone"), "transactionId": packs.transactionId])
            #expect(again["finishTransaction"] as? Bool == true, "\(again)")
            #expect(try await balance(pipeline, of: "pia") == (receiptFirst ? 900 : 600), "the receipt took back more than Apple did")
            if receiptFirst {
                let audit = try await pipeline.admin(.GET, "/v1/admin/audit?limit=500")
                #expect(audit.text.contains("cancellation_untyped"), "\(audit.text)")
                let released = try await HTTP.post(pipeline.fakeURL + "/fake/notifications/release", json: [String: String]())
                #expect(released.status == 200, "\(released.text)")
                #expect(
                    try await eventually(timeout: .seconds(20)) { try await balance(pipeline, of: "pia") == 600 },
                    "Apple's REFUND did not take its share back")
            }
        }

        /// Finding 5. An order placed for an upgrade is paid by the upgrade's own upload: Apple
        /// keeps the chain's original transaction id, and the upgrade is a purchase the customer
        /// made (`transactionReason` PURCHASE), not a renewal.
        @Test func anOrderPlacedForAnUpgradeIsPaidByIt() async throws {
            let pipeline = try await PipelineHarness.start(name: "upgrade-order")
            Teardown.add { await pipeline.stop() }
            let month = try await mint(pipeline, Mint(productId: Self.month, type: "auto_renewable", deviceId: "ugo-phone"))
            let first = try await upload(pipeline, ["userId": "ugo", "signedTransaction": month.signedTransaction])
            #expect(first["state"] as? String == "credited", "\(first)")
            let order = try await pipeline.createOrder(userId: "ugo", productId: Self.year)
            let upgraded = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(month.originalTransactionId)/upgrade", json: ["productId": Self.year])
            #expect(upgraded.status == 201, "\(upgraded.text)")
            let year = try JSONDecoder().decode(FakePurchaseAnswer.self, from: upgraded.body)
            let answer = try await upload(pipeline, ["userId": "ugo", "signedTransaction": year.signedTransaction, "orderId": order])
            #expect(answer["state"] as? String == "credited" && answer["finishTransaction"] as? Bool == true, "\(answer)")
            #expect(
                try await eventually(timeout: .seconds(10)) { try await pipeline.order(order)["state"] as? String == "paid" },
                "the order placed for the upgrade stayed unpaid")
            #expect(try await pipeline.order(order)["transactionId"] as? String == year.transactionId)
        }

        /// Lesser: a stranger's bare id proves nothing and tells nothing. Someone else's
        /// purchase, a refunded one, a genuine purchase nobody has uploaded yet and an unknown id
        /// answer alike: the same state, reason, message and advice, no transactions listed, and
        /// no case opened for customer service. Before, the genuine purchase nobody had uploaded
        /// answered `needs_review`/`owner_unknown` and listed it (a probe told real ids apart and
        /// opened a case each time). Never finishable: its buyer's app may be the one asking, and
        /// uploading its signed transaction or receipt settles it.
        @Test(arguments: TestStore.backends)
        func aStrangersLookupAnswersAlikeForTakenRefundedUnuploadedAndUnknownIds(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "lookup-alike", on: backend)
            Teardown.add { await pipeline.stop() }
            let taken = try await mint(pipeline, Mint(productId: Self.coins, deviceId: "tom-phone"))
            #expect(try await upload(pipeline, ["userId": "tom", "signedTransaction": taken.signedTransaction])["state"] as? String == "credited")
            let refunded = try await mint(pipeline, Mint(productId: Self.coins, deviceId: "tom-phone"))
            #expect(try await upload(pipeline, ["userId": "tom", "signedTransaction": refunded.signedTransaction])["state"] as? String == "credited")
            let refund = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(refunded.transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            #expect(try await eventually(timeout: .seconds(20)) { try await balance(pipeline, of: "tom") == 300 })
            let unuploaded = try await mint(pipeline, Mint(productId: Self.coins, deviceId: "una-phone"))

            var answers: [[String: Any]] = []
            for id in [taken.transactionId, refunded.transactionId, unuploaded.transactionId, "2000000999999999"] {
                answers.append(try await upload(pipeline, ["userId": "eve", "transactionId": id]))
            }
            for answer in answers {
                #expect(answer["state"] as? String == "rejected", "\(answer)")
                #expect(answer["reason"] as? String == "proof_required", "\(answer)")
                #expect(answer["message"] as? String == answers[0]["message"] as? String, "\(answer)")
                #expect((answer["transactions"] as? [Any] ?? []).isEmpty, "\(answer)")
                #expect(answer["finishTransaction"] as? Bool == false, "\(answer)")
            }
            #expect(try await balance(pipeline, of: "eve") == 0)
            let queues = try await pipeline.store.consoleWorkQueues(alertsSince: .distantPast)
            #expect(queues.needsReviewCount == 0 && queues.heldCount == 0, "a probe opened a case: \(queues.needsReview)")

            // The buyer's app does what the answer says: its signed transaction is credited to it.
            let own = try await upload(pipeline, ["userId": "una", "transactionId": unuploaded.transactionId])
            #expect(own["reason"] as? String == "proof_required", "\(own)")
            let proven = try await upload(pipeline, ["userId": "una", "signedTransaction": unuploaded.signedTransaction])
            #expect(proven["state"] as? String == "credited" && proven["finishTransaction"] as? Bool == true, "\(proven)")
            #expect(try await balance(pipeline, of: "una") == 300)
        }

        /// Lesser: StoreKit 1 hands a restore an id that Apple may never put in the receipt. Named
        /// with what it stands for (its original transaction and product), it is settled by the
        /// credited purchase the receipt holds, and finishable with its own reason; named alone it
        /// still asks for a refreshed receipt. A consumable never: one the receipt lacks is a
        /// purchase not in it yet, and finishing it would lose it.
        @Test func aStoreKit1RestoreTheReceiptDoesNotHoldIsSettledByItsOriginal() async throws {
            let pipeline = try await PipelineHarness.start(name: "sk1-restore", finishTransactions: .both)
            Teardown.add { await pipeline.stop() }
            let premium = try await mint(pipeline, Mint(productId: "com.example.premium", type: "non_consumable", deviceId: "ria-phone"))
            #expect(try await upload(pipeline, ["userId": "ria", "receiptData": premium.receiptData])["state"] as? String == "credited")
            let restore = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(premium.transactionId)/restore", json: RestoreAsk(deviceId: "ria-ipad", inReceipt: false))
            #expect(restore.status == 201, "\(restore.text)")
            let restored = try JSONDecoder().decode(FakePurchaseAnswer.self, from: restore.body)
            #expect(restored.transactionId != premium.transactionId)

            let alone = try await upload(pipeline, ["userId": "ria", "receiptData": restored.receiptData, "transactionId": restored.transactionId])
            #expect(alone["reason"] as? String == "transaction_not_in_receipt" && alone["finishTransaction"] as? Bool == false, "\(alone)")
            #expect(try await pipeline.store.finishStates(of: [restored.transactionId]).isEmpty)
            let named = try await upload(
                pipeline,
                [
                    "userId": "ria", "receiptData": restored.receiptData, "transactionId": restored.transactionId,
                    "originalTransactionId": premium.originalTransactionId, "productId": "com.example.premium",
                ])
            #expect(named["state"] as? String == "credited", "\(named)")
            #expect(named["reason"] as? String == "original_transaction_settled", "\(named)")
            #expect(named["finishTransaction"] as? Bool == true, "\(named)")
            // The answer lets the app finish the restore on its device; the server never does:
            // the original the upload names proves nothing of the id itself, and Finish
            // Transaction reaches any transaction of the app.
            try await Task.sleep(for: .seconds(2))
            #expect(try await FakeFinishRecord.of(restored.transactionId, at: pipeline.fakeURL) == .init(serverFinishCalls: 0))
            // Another product named with the same original: not what the receipt holds.
            let wrongProduct = try await upload(
                pipeline,
                [
                    "userId": "ria", "receiptData": restored.receiptData, "transactionId": restored.transactionId,
                    "originalTransactionId": premium.originalTransactionId, "productId": "com.example.vip.month",
                ])
            #expect(wrongProduct["reason"] as? String == "transaction_not_in_receipt", "\(wrongProduct)")
            // Someone else's app naming the same pair holds nothing of it: not finishable as theirs.
            let stranger = try await upload(
                pipeline,
                [
                    "userId": "sid", "receiptData": restored.receiptData, "transactionId": restored.transactionId,
                    "originalTransactionId": premium.originalTransactionId,
                ])
            #expect(stranger["state"] as? String != "credited", "\(stranger)")

            // A consumable the receipt lacks, named with an earlier credited consumable as its
            // "original": the new purchase is not in the receipt yet; never finishable.
            let first = try await mint(pipeline, Mint(productId: Self.coins, deviceId: "ria-phone"))
            #expect(try await upload(pipeline, ["userId": "ria", "signedTransaction": first.signedTransaction])["state"] as? String == "credited")
            let second = try await mint(pipeline, Mint(productId: Self.coins, deviceId: "ria-phone", receiptIncludesPurchase: false))
            let coins = try await upload(
                pipeline,
                [
                    "userId": "ria", "receiptData": second.receiptData, "transactionId": second.transactionId,
                    "originalTransactionId": first.transactionId, "productId": Self.coins,
                ])
            #expect(coins["reason"] as? String == "transaction_not_in_receipt" && coins["finishTransaction"] as? Bool == false, "\(coins)")
            #expect(try await balance(pipeline, of: "ria") == 300)
        }

        /// Lesser: a goodwill grant naming the Apple transaction the customer wrote about is
        /// bound to it: the purchase's later upload is `already_credited`, not a second credit.
        @Test func aGoodwillGrantNamingTheApplePurchaseIsNotCreditedTwice() async throws {
            let pipeline = try await PipelineHarness.start(name: "goodwill-bound")
            Teardown.add { await pipeline.stop() }
            let purchase = try await mint(pipeline, Mint(productId: Self.coins, deviceId: "gil-phone"))
            let granted = try await pipeline.admin(
                .POST, "/v1/admin/grants",
                ["userId": "gil", "productId": Self.coins, "appleTransactionId": purchase.transactionId, "reason": "paid, nothing came"])
            #expect(granted.status == 201, "\(granted.text)")
            #expect(try await balance(pipeline, of: "gil") == 300)
            let answer = try await upload(
                pipeline, ["userId": "gil", "receiptData": purchase.receiptData, "transactionId": purchase.transactionId])
            #expect(answer["state"] as? String == "credited" && answer["finishTransaction"] as? Bool == true, "\(answer)")
            let state = (answer["transactions"] as? [[String: Any]])?.first?["state"] as? String
            #expect(state == "already_credited", "\(answer)")
            #expect(try await balance(pipeline, of: "gil") == 300)

            // Apple's word on the id comes first: one Apple does not have (a typo), another
            // product, or a purchase made for another user's order is refused.
            func goodwill(_ id: String, product: String = Self.coins) async throws -> HTTP.Answer {
                try await pipeline.admin(
                    .POST, "/v1/admin/grants",
                    ["userId": "mallory", "productId": product, "appleTransactionId": id, "reason": "says she paid"])
            }
            let typo = try await goodwill("2999999999999999")
            #expect(typo.status == 404 && typo.errorCode == "purchase_not_found", "\(typo.text)")
            let kims = try await mint(pipeline, Mint(productId: Self.coins, deviceId: "kim-phone"))
            let product = try await goodwill(kims.transactionId, product: "com.example.coins.60")
            #expect(product.status == 409 && product.text.contains("bought \(Self.coins)"), "\(product.text)")
            let verasOrder = try await pipeline.createOrder(userId: "vera", productId: Self.coins)
            let veras = try await pipeline.mint(productId: Self.coins, token: ("appAccountToken", verasOrder))
            let forVera = try await goodwill(veras.transactionId)
            #expect(forVera.status == 409 && forVera.errorCode == "conflict", "\(forVera.text)")

            // Mallory writes that Bea's purchase is hers, and gets it by hand; Bea's own upload
            // proves she bought it: held for a person, never a replay her app may finish.
            let beas = try await mint(pipeline, Mint(productId: Self.coins, deviceId: "bea-phone"))
            let claimed = try await pipeline.admin(
                .POST, "/v1/admin/grants",
                ["userId": "mallory", "productId": Self.coins, "appleTransactionId": beas.transactionId, "reason": "says she paid"])
            #expect(claimed.status == 201, "\(claimed.text)")
            let proof = try await upload(
                pipeline, ["userId": "bea", "receiptData": beas.receiptData, "transactionId": beas.transactionId])
            #expect(
                proof["state"] as? String == "needs_review" && proof["reason"] as? String == "granted_by_hand_to_another_user"
                    && proof["finishTransaction"] as? Bool == false, "\(proof)")
            let held = (proof["transactions"] as? [[String: Any]])?.first
            #expect(held?["state"] as? String == "held" && held?["finishTransaction"] as? Bool == false, "\(proof)")
            #expect(try await balance(pipeline, of: "bea") == 0)
            #expect(try await balance(pipeline, of: "mallory") == 300)
        }

        /// Lesser: `/subscriptions` never says `active` past the period's end and grace, when
        /// Apple said nothing as it ended (`/entitlements` agrees).
        @Test func aSubscriptionPastItsPeriodIsNotActive() async throws {
            let pipeline = try await PipelineHarness.start(name: "past-period")
            Teardown.add { await pipeline.stop() }
            let month = try await mint(
                pipeline, Mint(productId: Self.month, type: "auto_renewable", deviceId: "sam-phone", expiresInSeconds: 2))
            #expect(try await upload(pipeline, ["userId": "sam", "signedTransaction": month.signedTransaction])["state"] as? String == "credited")
            try await Task.sleep(for: .seconds(3))
            let listed = try await HTTP.get(pipeline.intakeURL + "/v1/users/sam/subscriptions")
            let states = (listed.json["subscriptions"] as? [[String: Any]] ?? []).compactMap { $0["state"] as? String }
            #expect(states == ["expired"], "\(listed.text)")
            let entitled = try await HTTP.get(pipeline.intakeURL + "/v1/users/sam/entitlements")
            #expect((entitled.json["subscriptions"] as? [Any] ?? []).isEmpty, "\(entitled.text)")
        }
    }
}
