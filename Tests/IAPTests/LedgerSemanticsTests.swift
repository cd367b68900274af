import Foundation
import GRDB
import IAPCore
import Ledger
import NIOConcurrencyHelpers
import OrderStore
@testable import Store
import Testing
import TestSupport

/// The ledger's rules, one store and one rule at a time: what each product type is credited
/// once by, what Apple takes back, who keeps a restore, and what the app may finish.
/// Serialized: each test opens a store of its own synchronously (on PostgreSQL, a new database
/// and its migrations), which holds one of the 2 cooperative threads; run all at once, they
/// starved the suites that start servers with a time limit.
@Suite("Ledger semantics", .serialized)
struct LedgerSemanticsTests {
    let policy = CreditPolicy(catalog: PipelineHarness.testCatalog)

    func makeStore(_ backend: Backend, observer: (@Sendable (String) -> Void)? = nil) async throws -> (OrderStore, String) {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-ledger-\(UUID().uuidString)")
        let path = folder.appendingPathComponent("orders.sqlite").path
        return await (try TestStore.open(in: folder, on: backend, statementObserver: observer), path)
    }

    func purchase(
        _ transactionId: String, original: String? = nil, product: String, period: String? = nil,
        environment: AppStoreEnvironment = .production, cancelled: Date? = nil, token: String? = nil,
        expires: Date? = nil, signed: Date? = nil
    ) -> VerifiedPurchase {
        VerifiedPurchase(
            transactionId: transactionId, originalTransactionId: original ?? transactionId, productId: product, quantity: 1,
            purchaseDate: Date(), environment: environment, cancellationDate: cancelled, expiresDate: expires,
            appAccountToken: token, webOrderLineItemId: period, signedDate: signed)
    }

    /// What an upload names besides its receipt.
    enum Naming {
        /// The first purchase's transaction, as an app finishing that transaction does.
        case firstTransaction
        case transaction(String)
        case order(String)
        /// A transaction named with the order it was bought for.
        case transactionForOrder(String, order: String)
        /// Nothing: a receipt on its own.
        case nothing
    }

    /// Uploads `purchases` as `user` and applies Apple's answer; the upload's status after it.
    @discardableResult
    func upload(
        _ purchases: [VerifiedPurchase], by user: String, to store: OrderStore, policy: CreditPolicy? = nil,
        naming: Naming = .firstTransaction
    ) async throws -> SubmissionStatus {
        var transactionId: String?
        var orderId: String?
        switch naming {
        case .firstTransaction: transactionId = purchases.first?.transactionId
        case .transaction(let id): transactionId = id
        case .order(let id): orderId = id
        case .transactionForOrder(let id, let order):
            transactionId = id
            orderId = order
        case .nothing: break
        }
        let request = VerifyRequest(
            submissionId: UUID(), userId: user, receiptData: "AAAA", transactionId: transactionId, orderId: orderId,
            acceptedAt: Date())
        try await store.accept(request, message: nil)
        let result = VerifyResult(
            submissionId: request.submissionId, userId: user, orderId: orderId, attempt: 1,
            outcome: .verified(VerifiedReceipt(bundleId: "b", environment: .production, purchases: purchases)))
        _ = try await store.apply(result, policy: policy ?? self.policy)
        return try #require(try await store.status(of: request.submissionId))
    }

    /// Applies a notification of `type` about `purchase`, as the finisher does.
    func notify(
        _ type: String, _ purchase: VerifiedPurchase, to store: OrderStore, signed: Date = Date(),
        environment: AppStoreEnvironment = .production, status: Int? = nil, policy: CreditPolicy? = nil,
        subtype: String? = nil, renewal: RenewalTerms? = nil
    ) async throws -> String? {
        var request = VerifyRequest(submissionId: UUID(), userId: "", receiptData: "", acceptedAt: Date())
        request.signedPayload = "x.y.z"
        try await store.accept(request, message: nil)
        let notification = AppStoreNotification(
            notificationUUID: UUID().uuidString, notificationType: type, subtype: subtype, environment: environment,
            bundleId: "b", signedDate: signed, purchase: purchase, subscriptionStatus: status, renewal: renewal)
        _ = try await store.apply(
            VerifyResult(
                submissionId: request.submissionId, userId: "", orderId: nil, attempt: 1, outcome: .notification(notification)),
            policy: policy ?? self.policy)
        return try await store.status(of: request.submissionId)?.reasonMessage
    }

    func active(_ store: OrderStore, _ user: String) async throws -> [String] {
        try await store.grants(ofUser: user).filter { $0.state == .active }.map(\.transactionId)
    }

    /// Apple's renewal information is kept on the subscription, as signed last: the next
    /// period's product and price, and a price increase's consent (`PRICE_INCREASE` `PENDING`,
    /// then `ACCEPTED`), which customer service and the app read; nothing is credited or taken
    /// back by it, and a notification without renewal information leaves what was kept.
    @Test(arguments: TestStore.backends) func aPriceIncreaseAndTheRenewalTermsAreKeptOnTheSubscription(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let now = Date()
        try await upload([purchase("s1", product: "com.example.vip.month", period: "w1", expires: now.addingTimeInterval(86_400))], by: "ana", to: store)
        let increase = RenewalTerms(autoRenewProductId: "com.example.vip.month", renewalPrice: 12_990, currency: "EUR", priceIncreaseStatus: 0)
        let period = purchase("s1", product: "com.example.vip.month", period: "w1", expires: now.addingTimeInterval(86_400))
        _ = try await notify("PRICE_INCREASE", period, to: store, signed: now.addingTimeInterval(1), status: 1, subtype: "PENDING", renewal: increase)
        var kept = try #require(try await store.subscriptions(ofUser: "ana").first)
        #expect(kept.renewal == increase && kept.renewal?.priceIncrease == "pending", "\(String(describing: kept.renewal))")
        #expect(try await active(store, "ana") == ["s1"])
        // Accepted, told by the subtype alone: the price stays, the consent is given.
        _ = try await notify("PRICE_INCREASE", period, to: store, signed: now.addingTimeInterval(2), status: 1, subtype: "ACCEPTED")
        kept = try #require(try await store.subscriptions(ofUser: "ana").first)
        #expect(kept.renewal?.priceIncrease == "accepted" && kept.renewal?.renewalPrice == 12_990, "\(String(describing: kept.renewal))")
        // A later notification without renewal information leaves the terms.
        _ = try await notify("DID_CHANGE_RENEWAL_STATUS", period, to: store, signed: now.addingTimeInterval(3), status: 1)
        #expect(try await store.subscriptions(ofUser: "ana").first?.renewal?.currency == "EUR")
        #expect(try await active(store, "ana") == ["s1"])
        #expect(try await store.auditLog(limit: 100).filter { $0.action == "price_increase" }.count == 2)
    }

    @Test(arguments: TestStore.backends) func aRestoreCreditsNothingNewAndAnotherUsersRestoreStaysWithTheOwner(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let bought = try await upload([purchase("t1", product: "com.example.premium")], by: "ana", to: store)
        #expect(bought.transactions.map(\.state) == [.credited])
        // The same purchase restored on a second device: a new transaction id, the same original.
        let restored = try await upload([purchase("t2", original: "t1", product: "com.example.premium")], by: "ana", to: store)
        #expect(restored.state == .credited && restored.transactions.map(\.state) == [.alreadyCredited])
        let other = try await upload([purchase("t3", original: "t1", product: "com.example.premium")], by: "ben", to: store)
        #expect(other.transactions.map(\.state) == [.ownedByOtherUser])
        #expect(other.state == .rejected && other.reason == .ownedByOtherUser && other.finishTransaction)
        #expect(try await active(store, "ana") == ["t1"])
        #expect(try await active(store, "ben").isEmpty)
        #expect(try await store.auditLog(limit: 10).contains { $0.action == "restore_kept_by_owner" })
    }

    @Test(arguments: TestStore.backends) func underTransferTheRestoringUserTakesTheEntitlement(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let transfer = CreditPolicy(catalog: PipelineHarness.testCatalog, restore: .transfer)
        try await upload([purchase("t1", product: "com.example.premium")], by: "ana", to: store, policy: transfer)
        let moved = try await upload(
            [purchase("t2", original: "t1", product: "com.example.premium")], by: "ben", to: store, policy: transfer)
        #expect(moved.state == .credited && moved.transactions.map(\.state) == [.credited])
        #expect(try await active(store, "ana").isEmpty)
        #expect(try await active(store, "ben") == ["t2"])
        #expect(try await store.grants(ofUser: "ana").first?.state == .revoked)
        // And back: the first owner's grant is active again; still one in all.
        try await upload([purchase("t3", original: "t1", product: "com.example.premium")], by: "ana", to: store, policy: transfer)
        #expect(try await active(store, "ana") == ["t1"])
        #expect(try await active(store, "ben").isEmpty)
        #expect(try await store.auditLog(limit: 20).filter { $0.action == "grant_transferred" }.count == 2)
        // Consumables never move: a replay stays a replay.
        try await upload([purchase("c1", product: "com.example.coins.60")], by: "ana", to: store, policy: transfer)
        let replay = try await upload([purchase("c1", product: "com.example.coins.60")], by: "ben", to: store, policy: transfer)
        #expect(replay.transactions.map(\.state) == [.replayedFromOtherUser])
    }

    @Test(arguments: TestStore.backends) func aRefundThatArrivesBeforeTheUploadIsRemembered(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let coins = purchase("t1", product: "com.example.coins.60")
        #expect(try await notify("REFUND", coins, to: store) == "REFUND: revocation_pending")
        // The signed transaction saved before the refund carries no revocation date.
        let late = try await upload([coins], by: "ana", to: store)
        #expect(late.transactions.map(\.state) == [.revoked])
        #expect(late.state == .rejected && late.reason == .purchaseRevoked && late.finishTransaction)
        #expect(try await active(store, "ana").isEmpty)
        // Apple reverses the refund: what the refund took is given back to its uploader.
        #expect(try await notify("REFUND_REVERSED", coins, to: store) == "REFUND_REVERSED: credited")
        #expect(try await active(store, "ana") == ["t1"])
        // A reversal of a purchase nobody was credited with or proved credits nobody: it is kept
        // for its owner's proof and listed for customer service (its app may have finished it on
        // the refund, so no later receipt holds it), never dropped.
        #expect(
            try await notify("REFUND_REVERSED", purchase("t9", product: "com.example.coins.60"), to: store)
                == "REFUND_REVERSED: owner_unknown")
        #expect(try await store.purchase("t9")?.heldReason == "owner_unknown")
        #expect(try await active(store, "ana") == ["t1"])
        // With a token naming one of our orders, its owner is credited: the token says whose it is.
        let order = try await store.createOrder(userId: "bea", productId: "com.example.coins.60")
        let tokened = purchase("t10", product: "com.example.coins.60", token: order.id)
        #expect(try await notify("REFUND", tokened, to: store) == "REFUND: revocation_pending")
        #expect(try await notify("REFUND_REVERSED", tokened, to: store) == "REFUND_REVERSED: credited")
        #expect(try await active(store, "bea") == ["t10"])
    }

    @Test(arguments: TestStore.backends) func aRefundOfANonConsumableCoversItsRestores(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        try await upload([purchase("t1", product: "com.example.premium")], by: "ana", to: store)
        #expect(try await notify("REFUND", purchase("t1", product: "com.example.premium"), to: store) == "REFUND: revoked")
        let restored = try await upload([purchase("t2", original: "t1", product: "com.example.premium")], by: "ana", to: store)
        #expect(restored.transactions.map(\.state) == [.revoked])
        #expect(try await active(store, "ana").isEmpty)
        #expect(try await notify("REFUND_REVERSED", purchase("t1", product: "com.example.premium"), to: store) == "REFUND_REVERSED: restored")
        #expect(try await active(store, "ana") == ["t1"])
    }

    @Test(arguments: TestStore.backends) func aRevocationInALaterAnswerRevokesTheGrant(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        try await upload([purchase("t1", product: "com.example.coins.60")], by: "ana", to: store)
        let refundedAt = Date().addingTimeInterval(-60)
        let again = try await upload([purchase("t1", product: "com.example.coins.60", cancelled: refundedAt)], by: "ana", to: store)
        #expect(again.transactions.map(\.state) == [.revoked])
        #expect(try await store.grants(ofUser: "ana").map(\.state) == [.revoked])
        // Reversed after that answer: an answer signed before the reversal does not take it again.
        #expect(try await notify("REFUND_REVERSED", purchase("t1", product: "com.example.coins.60"), to: store) == "REFUND_REVERSED: restored")
        try await upload([purchase("t1", product: "com.example.coins.60", cancelled: refundedAt)], by: "ana", to: store)
        #expect(try await active(store, "ana") == ["t1"])
    }

    @Test(arguments: TestStore.backends) func subscriptionsAreCreditedOncePerBillingPeriod(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let month = "com.example.vip.month"
        let first = try await upload(
            [purchase("t1", product: month, period: "w1", expires: Date().addingTimeInterval(3600))], by: "ana", to: store)
        #expect(first.transactions.map(\.state) == [.credited])
        // The subscription has its owner and expiry from the upload, without any notification.
        let subscription = try #require(try await store.subscriptions(ofUser: "ana").first)
        #expect(subscription.originalTransactionId == "t1" && subscription.state == .active && subscription.expiresDate != nil)
        // A restore of that period: nothing new. A renewal: a new period, credited.
        let restore = try await upload([purchase("t2", original: "t1", product: month, period: "w1")], by: "ana", to: store)
        #expect(restore.transactions.map(\.state) == [.alreadyCredited])
        let renewal = try await upload(
            [purchase("t3", original: "t1", product: month, period: "w2", expires: Date().addingTimeInterval(7200))],
            by: "ana", to: store)
        #expect(renewal.transactions.map(\.state) == [.credited])
        #expect(try await active(store, "ana") == ["t1", "t3"])
        // A renewal notification goes to the owner whoever uploaded first; a late, older
        // notification does not overwrite the newer state.
        let now = Date()
        _ = try await notify(
            "DID_RENEW", purchase("t4", original: "t1", product: month, period: "w3", expires: now.addingTimeInterval(9000)),
            to: store, signed: now, status: 1)
        #expect(try await active(store, "ana") == ["t1", "t3", "t4"])
        _ = try await notify(
            "EXPIRED", purchase("t3", original: "t1", product: month, period: "w2"), to: store, signed: now.addingTimeInterval(-600),
            status: 2)
        #expect(try await store.subscriptions(ofUser: "ana").first?.state == .active)
        _ = try await notify(
            "EXPIRED", purchase("t4", original: "t1", product: month, period: "w3"), to: store, signed: now.addingTimeInterval(60),
            status: 2)
        #expect(try await store.subscriptions(ofUser: "ana").first?.state == .expired)
    }

    @Test(arguments: TestStore.backends) func aSandboxNotificationGrantsNothingWhenTheSandboxIsRefused(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let strict = CreditPolicy(catalog: PipelineHarness.testCatalog, sandbox: .reject)
        let order = try await store.createOrder(userId: "ana", productId: "com.example.vip.month")
        let sandbox = purchase(
            "s1", product: "com.example.vip.month", period: "w1", environment: .sandbox, token: order.id,
            expires: Date().addingTimeInterval(3600))
        let outcome = try await notify("SUBSCRIBED", sandbox, to: store, environment: .sandbox, status: 1, policy: strict)
        #expect(outcome == "SUBSCRIBED: sandbox_not_allowed")
        #expect(try await store.grants(ofUser: "ana").isEmpty)
        #expect(try await store.subscriptions(ofUser: "ana").isEmpty)
        // The same notification under the default policy credits the order's owner.
        _ = try await notify("SUBSCRIBED", sandbox, to: store, environment: .sandbox, status: 1)
        #expect(try await active(store, "ana") == ["s1"])
    }

    @Test(arguments: TestStore.backends) func renewalsOfAPaidOrderAreNotHeldAfterAPlanChange(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let order = try await store.createOrder(userId: "ana", productId: "com.example.vip.month")
        try await upload([purchase("t1", product: "com.example.vip.month", period: "w1", token: order.id)], by: "ana", to: store)
        #expect(try await store.order(order.id)?.state == .paid)
        let yearly = try await upload(
            [purchase("t2", original: "t1", product: "com.example.vip.year", period: "w2", token: order.id)], by: "ana",
            to: store)
        #expect(yearly.state == .credited && yearly.transactions.map(\.state) == [.credited])
        #expect(try await active(store, "ana") == ["t1", "t2"])
    }

    @Test(arguments: TestStore.backends) func aLookupCreditsNobodyAndLeavesThePurchaseToItsOwner(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        // A bare transaction id (or an unsigned receipt): Apple answers for any transaction of the app.
        var looked = purchase("v1", product: "com.example.coins.300")
        looked.evidence = .lookup
        // Nobody owns it yet: answered as an unknown id would be (nothing listed, no case for
        // customer service), never finishable (the app may hold it, unproven).
        let claimed = try await upload([looked], by: "mallory", to: store)
        #expect(claimed.transactions.isEmpty && claimed.state == .rejected && claimed.reason == .proofRequired, "\(claimed)")
        #expect(!claimed.finishTransaction)
        #expect(try await active(store, "mallory").isEmpty)
        #expect(try await store.purchase("v1") == nil, "a lookup records nothing as the uploader's")
        // The victim's own signed upload is credited to them, and finishable.
        let own = try await upload([purchase("v1", product: "com.example.coins.300")], by: "victor", to: store)
        #expect(own.state == .credited && own.finishTransaction && own.transactions.map(\.state) == [.credited])
        #expect(try await active(store, "victor") == ["v1"])
        // A lookup of what is already the uploader's is settled; the stranger's proves nothing
        // and tells nothing: answered as an unknown id, with no transactions listed.
        #expect(try await upload([looked], by: "victor", to: store).transactions.map(\.state) == [.alreadyCredited])
        let strangers = try await upload([looked], by: "mallory", to: store)
        #expect(strangers.transactions.isEmpty && strangers.state == .rejected && strangers.reason == .proofRequired)
        #expect(!strangers.finishTransaction)
        // A token naming the uploader's order is a proof: credited on a lookup.
        let order = try await store.createOrder(userId: "mallory", productId: "com.example.coins.60")
        var tokened = purchase("v2", product: "com.example.coins.60", token: order.id)
        tokened.evidence = .lookup
        #expect(try await upload([tokened], by: "mallory", to: store).transactions.map(\.state) == [.credited])
    }

    @Test(arguments: TestStore.backends) func aNewBillingPeriodGoesToTheSubscriptionsOwnerWhoeverUploadsIt(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let first = purchase("s1", product: "com.example.vip.month", period: "w1", expires: Date().addingTimeInterval(60))
        try await upload([first], by: "ana", to: store)
        // Apple renews; before DID_RENEW arrives, another account uploads the owner's receipt.
        let renewal = purchase("s2", original: "s1", product: "com.example.vip.month", period: "w2", expires: Date().addingTimeInterval(3600))
        let stranger = try await upload([first, renewal], by: "ben", to: store, naming: .transaction("s2"))
        // The very transaction the owner was credited with is a replay; the new period is the owner's.
        #expect(stranger.transactions.map(\.state) == [.replayedFromOtherUser, .ownedByOtherUser])
        #expect(stranger.state == .rejected && stranger.reason == .replayedFromOtherUser && stranger.finishTransaction)
        #expect(try await active(store, "ben").isEmpty)
        #expect(try await active(store, "ana") == ["s1", "s2"])
        #expect(try await store.subscriptions(ofUser: "ana").map(\.originalTransactionId) == ["s1"])
        // The renewal's own notification later credits nothing twice.
        _ = try await notify("DID_RENEW", renewal, to: store)
        #expect(try await active(store, "ana") == ["s1", "s2"])
        // A bare id of a later period: still the owner's, never the stranger's.
        var third = purchase("s3", original: "s1", product: "com.example.vip.month", period: "w3")
        third.evidence = .lookup
        // The stranger's lookup proves nothing and tells nothing (nothing listed).
        let looked = try await upload([third], by: "ben", to: store)
        #expect(looked.transactions.isEmpty && looked.reason == .proofRequired, "\(looked)")
        #expect(try await active(store, "ana") == ["s1", "s2", "s3"])
    }

    @Test(arguments: TestStore.backends) func underTransferTheSubscriptionMovesAndItsRenewalsFollowTheNewOwner(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let transfer = CreditPolicy(catalog: PipelineHarness.testCatalog, restore: .transfer)
        let first = purchase("s1", product: "com.example.vip.month", period: "w1", expires: Date().addingTimeInterval(60))
        try await upload([first], by: "ana", to: store, policy: transfer)
        // Ben restores the period on his device (a new transaction id, the same period).
        let restored = purchase("s1r", original: "s1", product: "com.example.vip.month", period: "w1", expires: Date().addingTimeInterval(60))
        #expect(try await upload([restored], by: "ben", to: store, policy: transfer).transactions.map(\.state) == [.credited])
        #expect(try await store.subscriptions(ofUser: "ben").map(\.originalTransactionId) == ["s1"])
        #expect(try await store.subscriptions(ofUser: "ana").isEmpty)
        // Apple renews: the new period goes to the subscription's new owner.
        let renewal = purchase("s2", original: "s1", product: "com.example.vip.month", period: "w2", expires: Date().addingTimeInterval(3600))
        #expect(try await notify("DID_RENEW", renewal, to: store, policy: transfer) == "DID_RENEW: credited")
        #expect(try await active(store, "ben") == ["s1r", "s2"])
        #expect(try await active(store, "ana").isEmpty)
        #expect(try await store.auditLog(limit: 20).contains { $0.action == "subscription_transferred" })
    }

    @Test(arguments: TestStore.backends) func aReceiptThatNamesNothingIsFinishedTransactionByTransaction(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let status = try await upload(
            [purchase("c1", product: "com.example.coins.60"), purchase("x1", product: "com.example.unknown")], by: "ana",
            to: store, naming: .nothing)
        #expect(status.transactions.map(\.state) == [.credited, .held])
        #expect(status.transactions.map(\.finishTransaction) == [true, false])
        #expect(!status.finishTransaction)
        let settled = try await upload([purchase("c2", product: "com.example.coins.60")], by: "ana", to: store, naming: .nothing)
        #expect(settled.state == .credited && !settled.finishTransaction && settled.transactions.map(\.finishTransaction) == [true])
    }

    @Test(arguments: TestStore.backends) func anOrderTheReceiptDoesNotPayYetIsNotFinishable(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        var earlier = purchase("c1", product: "com.example.coins.60")
        earlier.purchaseDate = Date().addingTimeInterval(-3600)
        try await upload([earlier], by: "ana", to: store)
        // The app buys 300 coins for an order; the receipt it holds is still the old one.
        let order = try await store.createOrder(userId: "ana", productId: "com.example.coins.300")
        let stale = try await upload([earlier], by: "ana", to: store, naming: .order(order.id))
        #expect(stale.state == .rejected && stale.reason == .transactionNotInReceipt && !stale.finishTransaction)
        #expect(try await store.order(order.id)?.state == .created)
        // The refreshed receipt holds the new purchase: it pays the order, but the order was
        // named alone, so the app names the transaction it holds before it is told to finish.
        let fresh = purchase("c2", product: "com.example.coins.300")
        let refreshed = try await upload([earlier, fresh], by: "ana", to: store, naming: .order(order.id))
        #expect(refreshed.state == .credited && refreshed.reason == .nameTheTransaction && !refreshed.finishTransaction, "\(refreshed)")
        #expect(try await store.order(order.id)?.state == .paid)
        let named = try await upload([earlier, fresh], by: "ana", to: store, naming: .transactionForOrder("c2", order: order.id))
        #expect(named.state == .credited && named.finishTransaction, "\(named)")
    }

    @Test(arguments: TestStore.backends) func aReversalThatArrivesBeforeItsRefundIsRemembered(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let coins = purchase("c1", product: "com.example.coins.60")
        try await upload([coins], by: "ana", to: store)
        let refunded = Date().addingTimeInterval(-120)
        // Apple's order: REFUND (signed first), then REFUND_REVERSED; delivered reversed.
        #expect(try await notify("REFUND_REVERSED", coins, to: store, signed: refunded.addingTimeInterval(60)) == "REFUND_REVERSED: nothing_revoked")
        #expect(try await notify("REFUND", coins, to: store, signed: refunded) == "REFUND: reversed_already")
        #expect(try await active(store, "ana") == ["c1"])
        // A refund Apple signed after the reversal stands.
        #expect(try await notify("REFUND", coins, to: store, signed: refunded.addingTimeInterval(90)) == "REFUND: revoked")
        #expect(try await active(store, "ana").isEmpty)
        // And its own reversal, signed later still, gives it back.
        #expect(try await notify("REFUND_REVERSED", coins, to: store, signed: refunded.addingTimeInterval(100)) == "REFUND_REVERSED: restored")
        #expect(try await active(store, "ana") == ["c1"])
    }

    @Test(arguments: TestStore.backends) func aRefundOfAnEarlierPeriodLeavesTheCurrentOneInForce(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let first = purchase("s1", product: "com.example.vip.month", period: "w1", expires: Date().addingTimeInterval(60))
        let current = purchase("s2", original: "s1", product: "com.example.vip.month", period: "w2", expires: Date().addingTimeInterval(3600))
        try await upload([first, current], by: "ana", to: store)
        #expect(try await notify("REFUND", first, to: store) == "REFUND: revoked")
        #expect(try await active(store, "ana") == ["s2"])
        let subscription = try #require(try await store.subscriptions(ofUser: "ana").first)
        #expect(subscription.state == .active, "\(subscription)")
        #expect(abs((subscription.expiresDate ?? .distantPast).timeIntervalSince(current.expiresDate!)) < 1, "\(subscription)")
        // A refund of the current period revokes the subscription.
        #expect(try await notify("REFUND", current, to: store) == "REFUND: revoked")
        #expect(try await store.subscriptions(ofUser: "ana").first?.state == .revoked)
    }

    @Test(arguments: TestStore.backends) func anExtensionMovesTheEndOfTheGrantInForce(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let period = purchase("s1", product: "com.example.vip.month", period: "w1", expires: Date().addingTimeInterval(60))
        try await upload([period], by: "ana", to: store)
        let later = Date().addingTimeInterval(7 * 86_400)
        let extended = purchase("s1", product: "com.example.vip.month", period: "w1", expires: later)
        #expect(try await notify("RENEWAL_EXTENDED", extended, to: store) == "RENEWAL_EXTENDED: extended")
        let grant = try #require(try await store.grants(ofUser: "ana").first)
        #expect(abs((grant.expiresAt ?? .distantPast).timeIntervalSince(later)) < 1, "\(grant)")
        // A late copy of an older end does not shorten it.
        _ = try await notify("RENEWAL_EXTENDED", period, to: store)
        #expect(abs((try await store.grants(ofUser: "ana").first?.expiresAt ?? .distantPast).timeIntervalSince(later)) < 1)
    }

    @Test(arguments: TestStore.backends) func aHeldPeriodGrantedByHandEndsWithThePeriod(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let order = try await store.createOrder(userId: "ana", productId: "com.example.coins.300")
        let ends = Date().addingTimeInterval(30 * 86_400)
        let held = try await upload(
            [purchase("s1", product: "com.example.vip.month", period: "w1", token: order.id, expires: ends)], by: "ana",
            to: store)
        #expect(held.transactions.first?.reason == .productMismatch)
        let granted = try await store.grantManually(
            userId: "ana", productId: "com.example.vip.month", quantity: 1, grant: ["entitlement": .name("vip")],
            transactionId: "s1", actor: "carla", reason: "bought the wrong plan for the order", policy: policy)
        #expect(abs((granted.expiresAt ?? .distantPast).timeIntervalSince(ends)) < 1, "\(granted)")
    }

    @Test(arguments: TestStore.backends) func anUpgradedTransactionIsNeverCredited(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        var superseded = purchase("t1", product: "com.example.vip.month", period: "w1")
        superseded.isUpgraded = true
        let status = try await upload([superseded, purchase("t2", product: "com.example.vip.year", period: "w2")], by: "ana", to: store)
        #expect(status.transactions.map(\.state) == [.superseded, .credited])
        #expect(try await active(store, "ana") == ["t2"])
    }

    @Test(arguments: TestStore.backends) func historyTheReceiptDoesNotProveIsHeldForCustomerService(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        var unproven = purchase("t1", product: "com.example.coins.60")
        unproven.inUploadedReceipt = false
        var proven = purchase("t2", product: "com.example.coins.60")
        proven.inUploadedReceipt = true
        let status = try await upload([unproven, proven], by: "eve", to: store)
        #expect(status.transactions.map(\.state) == [.held, .credited])
        #expect(status.state == .needsReview && status.reason == .ownerUnknown && !status.finishTransaction)
        #expect(try await active(store, "eve") == ["t2"])
        // Its real owner uploads a receipt that holds it: credited to them.
        unproven.inUploadedReceipt = true
        #expect(try await upload([unproven], by: "ana", to: store).transactions.map(\.state) == [.credited])
        #expect(try await active(store, "ana") == ["t1"])
    }

    @Test(arguments: TestStore.backends) func theAppFinishesARejectionOnlyWhenApplesAnswerSettlesIt(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        func rejected(_ reason: ReasonCode) async throws -> Bool {
            let request = VerifyRequest(
                submissionId: UUID(), userId: "ana", receiptData: "AAAA", transactionId: "1000", acceptedAt: Date())
            try await store.accept(request, message: nil)
            _ = try await store.apply(
                VerifyResult(
                    submissionId: request.submissionId, userId: "ana", orderId: nil, attempt: 1,
                    outcome: .rejected(reason, message: "")))
            return try #require(try await store.status(of: request.submissionId)).finishTransaction
        }
        #expect(try await rejected(.invalidReceipt))
        #expect(try await rejected(.transactionNotFound))
        // A bare id that proves nothing: the app may hold that very purchase, unproven.
        #expect(try await !rejected(.proofRequired))
        #expect(try await rejected(ReasonCode("jws_invalid_signature")))
        // Our own settings (trusted roots, bundle ids, app id) could cause these: held, not finished.
        #expect(try await !rejected(ReasonCode("jws_untrusted_chain")))
        #expect(try await !rejected(.bundleIdMismatch))
        #expect(try await !rejected(.transactionNotInReceipt))
        #expect(try await !rejected(.unexpectedAppleResponse))
        #expect(try await !rejected(.notConfigured))
    }

    @Test(arguments: TestStore.backends) func theStatusAnAppPollsFollowsWhatHappenedLater(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        // Held (not in the catalog), then granted by customer service: the upload is settled.
        let held = try await upload([purchase("h1", product: "com.example.unknown")], by: "ana", to: store)
        #expect(held.state == .needsReview && !held.finishTransaction)
        _ = try await store.grantManually(
            userId: "ana", productId: "com.example.unknown", quantity: 1, grant: ["coins": .number(10)], transactionId: "h1",
            actor: "carla", reason: "paid, product missing from the catalog", policy: policy)
        let granted = try #require(try await store.status(of: held.submissionId))
        #expect(granted.state == .credited && granted.finishTransaction)
        #expect(granted.transactions.map(\.state) == [.credited])
        #expect(granted.transactions.first?.grantedBy == "carla")
        // Credited, then refunded: the upload's transaction reads revoked.
        let coins = try await upload([purchase("c1", product: "com.example.coins.60")], by: "ana", to: store)
        _ = try await notify("REFUND", purchase("c1", product: "com.example.coins.60"), to: store)
        let refunded = try #require(try await store.status(of: coins.submissionId))
        #expect(refunded.transactions.map(\.state) == [.revoked])
        #expect(refunded.transactions.first?.reason == .purchaseRevoked)
        // Refunded before the upload, then reversed: credited by Apple's reversal.
        _ = try await notify("REFUND", purchase("c2", product: "com.example.coins.60"), to: store)
        let early = try await upload([purchase("c2", product: "com.example.coins.60")], by: "ana", to: store)
        _ = try await notify("REFUND_REVERSED", purchase("c2", product: "com.example.coins.60"), to: store)
        let reversed = try #require(try await store.status(of: early.submissionId))
        #expect(reversed.state == .credited && reversed.transactions.first?.grantedBy == "apple")
    }

    @Test(arguments: TestStore.backends) func entitlementsAreWhatTheUserMayUseNow(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let now = Date()
        try await upload(
            [
                purchase("c1", product: "com.example.coins.60"), purchase("c2", product: "com.example.coins.120"),
                purchase("p1", product: "com.example.premium"),
                purchase("w1", product: "com.example.vip.month", period: "a1", expires: now.addingTimeInterval(-3600)),
                purchase("w2", original: "w1", product: "com.example.vip.month", period: "a2", expires: now.addingTimeInterval(3600)),
            ], by: "ana", to: store)
        let grants = try await store.grants(ofUser: "ana")
        #expect(grants.first { $0.transactionId == "w2" }?.expiresAt != nil)
        #expect(grants.first { $0.transactionId == "p1" }?.expiresAt == nil)
        let entitlements = try await store.entitlements(ofUser: "ana", catalog: PipelineHarness.testCatalog, now: now)
        #expect(Set(entitlements.grants.map(\.transactionId)) == ["c1", "c2", "p1", "w2"])
        #expect(entitlements.balances == ["coins": 180])
        #expect(entitlements.subscriptions.map(\.originalTransactionId) == ["w1"])
        #expect(entitlements.subscriptions.first?.expiresDate.map { $0 > now } == true)
        // Past the period (and any grace): nothing of the subscription is in force.
        let later = try await store.entitlements(ofUser: "ana", catalog: PipelineHarness.testCatalog, now: now.addingTimeInterval(7200))
        #expect(Set(later.grants.map(\.transactionId)) == ["c1", "c2", "p1"] && later.subscriptions.isEmpty)
    }

    @Test(arguments: TestStore.backends) func grantsCreditedBeforeCreditKeysAreFoundByTheirProductsKey(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        // As an earlier version credited it: one grant per transaction, whatever the product.
        let earlier = CreditPolicy()
        try await upload([purchase("t1", product: "com.example.premium")], by: "ana", to: store, policy: earlier)
        #expect(try await store.rekeyEarlierGrants(policy: policy) == 1)
        #expect(try await store.rekeyEarlierGrants(policy: policy) == 0, "once per catalog")
        let restored = try await upload([purchase("t2", original: "t1", product: "com.example.premium")], by: "ana", to: store)
        #expect(restored.transactions.map(\.state) == [.alreadyCredited])
        let other = try await upload([purchase("t3", original: "t1", product: "com.example.premium")], by: "ben", to: store)
        #expect(other.transactions.map(\.state) == [.ownedByOtherUser])
        #expect(try await notify("REFUND", purchase("t2", original: "t1", product: "com.example.premium"), to: store) == "REFUND: revoked")
        #expect(try await active(store, "ana").isEmpty)
        // The very transaction uploaded again is credited already, whatever its key.
        try await upload([purchase("c1", product: "com.example.coins.60")], by: "ana", to: store, policy: earlier)
        #expect(try await upload([purchase("c1", product: "com.example.coins.60")], by: "ana", to: store).transactions.map(\.state) == [.alreadyCredited])
    }

    @Test(arguments: TestStore.backends) func customerServiceCannotGrantWhatAppleTookBack(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let coins = purchase("t1", product: "com.example.coins.60")
        _ = try await notify("REFUND", coins, to: store)
        try await upload([coins], by: "ana", to: store)
        await #expect(throws: OrderStoreError.self) {
            _ = try await store.grantManually(
                userId: "ana", productId: "com.example.coins.60", quantity: 1, grant: ["coins": .number(60)],
                transactionId: "t1", actor: "carla", reason: "says she paid", policy: policy)
        }
        #expect(try await active(store, "ana").isEmpty)
        // An operator named like Apple does not make a revocation Apple's: a reversal leaves it.
        try await upload([purchase("t2", product: "com.example.coins.60")], by: "ana", to: store)
        _ = try await store.revoke(transactionId: "t2", actor: "apple", reason: "fraud", policy: policy)
        _ = try await notify("REFUND_REVERSED", purchase("t2", product: "com.example.coins.60"), to: store)
        #expect(try await active(store, "ana").isEmpty)
    }

    @Test(arguments: TestStore.backends) func answeredCommitsAreSyncedToDisk(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let durability = try await store.durability()
        switch store.dialect {
        case .sqlite:
            #expect(durability["synchronous"] == "2", "PRAGMA synchronous must be FULL (2)")
            #expect(durability["journal_mode"] == "wal")
            // Each unit of a group commit runs in a savepoint; its journal on file was most of
            // the bytes an upload wrote (docs/benchmarks.md). Kept in memory, it costs none.
            #expect(durability["temp_store"] == "2", "PRAGMA temp_store must be MEMORY (2)")
        case .postgres:
            // The store asks for it on every connection, whatever the server's default.
            // (`fsync` is the server's own setting; the test server runs without it.)
            #expect(durability["synchronous_commit"] == "on", "\(durability)")
        }
    }

    /// The store reports every statement it runs, and their plans are read here: on SQLite with
    /// EXPLAIN QUERY PLAN, on PostgreSQL as generic plans with sequential scans priced out.
    @Test(arguments: TestStore.backends) func theFinishersAndSweepersLookupsNeverScanATable(_ backend: Backend) async throws {
        let statements = NIOLockedValueBox(Set<String>())
        // Each statement a batch ran too (`SQLTrace.inBatch`), as it would run alone.
        let (store, path) = try await makeStore(backend) { sql in
            let statement = sql.hasPrefix(SQLTrace.inBatch) ? String(sql.dropFirst(SQLTrace.inBatch.count)) : sql
            statements.withLockedValue { _ = $0.insert(statement) }
        }
        statements.withLockedValue { $0.removeAll() }  // the migrations' statements run once, at start
        // Every path of crediting, revoking, restoring and sweeping at least once.
        let transfer = CreditPolicy(catalog: PipelineHarness.testCatalog, restore: .transfer)
        try await upload([purchase("t1", product: "com.example.premium")], by: "ana", to: store)
        try await upload([purchase("t2", original: "t1", product: "com.example.premium")], by: "ben", to: store)
        try await upload([purchase("t3", original: "t1", product: "com.example.premium")], by: "ben", to: store, policy: transfer)
        _ = try await notify("REFUND", purchase("t3", original: "t1", product: "com.example.premium"), to: store)
        _ = try await notify("REFUND_REVERSED", purchase("t3", original: "t1", product: "com.example.premium"), to: store)
        _ = try await notify("REFUND", purchase("c1", product: "com.example.coins.60"), to: store)
        try await upload([purchase("c1", product: "com.example.coins.60")], by: "ana", to: store)
        _ = try await notify("REFUND_REVERSED", purchase("c1", product: "com.example.coins.60"), to: store)
        try await upload([purchase("w1", product: "com.example.vip.month", period: "p1")], by: "ana", to: store)
        _ = try await notify("DID_RENEW", purchase("w2", original: "w1", product: "com.example.vip.month", period: "p2"), to: store, status: 1)
        _ = try await notify("EXPIRED", purchase("w2", original: "w1", product: "com.example.vip.month", period: "p2"), to: store, status: 2)
        // Customer service: a goodwill grant, taken back again.
        let goodwill = try await store.grantManually(
            userId: "ana", productId: "com.example.coins.60", quantity: 1, grant: ["coins": .number(5)], transactionId: nil,
            actor: "agent", reason: "sorry", policy: transfer)
        _ = try await store.revoke(transactionId: goodwill.transactionId, actor: "agent", reason: "twice", policy: transfer)
        let pending = VerifyRequest(submissionId: UUID(), userId: "ana", receiptData: "AAAA", acceptedAt: Date())
        try await store.accept(pending, message: OutboxMessage(routingKey: "q", body: [1], messageId: pending.submissionId.uuidString))
        _ = try await store.requeueStuck(pendingBefore: Date(), retryDueBefore: Date(), limit: 10) { request in
            OutboxMessage(routingKey: "q", body: [1], messageId: request.submissionId.uuidString)
        }

        let ledgerTables = ["purchase", "grants", "revocation", "subscription", "notification", "outbox", "submission_transaction", "orders"]
        let seen = statements.withLockedValue { $0 }
        #expect(seen.count > 20, "the workload ran too few statements to judge")
        let queries = seen.filter { sql in
            let verb = sql.trimmingCharacters(in: .whitespacesAndNewlines).prefix(6).uppercased()
            return ["SELECT", "UPDATE", "DELETE", "INSERT"].contains(verb) && sql.contains("WHERE")
        }
        var scans: [String] = []
        switch store.dialect {
        case .sqlite:
            let reader = try DatabaseQueue(path: path)
            for sql in queries {
                let plan = try await reader.read { db in
                    try Row.fetchAll(db, sql: "EXPLAIN QUERY PLAN " + sql, arguments: StatementArguments(
                        Array(repeating: nil as String?, count: sql.filter { $0 == "?" }.count)))
                        .map { $0["detail"] as String }
                }
                for step in plan where step.hasPrefix("SCAN ") && !step.contains("USING") {
                    let table = step.dropFirst(5).split(separator: " ").first.map(String.init) ?? ""
                    if ledgerTables.contains(table) { scans.append("\(step)  <-  \(sql)") }
                }
            }
        case .postgres:
            // The ledger's shell reads each kind of row with one statement: fewer, broader ones.
            #expect(queries.count > 15, "the workload ran too few queries to judge")
            for sql in queries {
                for step in try await store.testGenericPlan(sql) {
                    guard let on = step.range(of: "Seq Scan on ") else { continue }
                    let table = step[on.upperBound...].split(separator: " ").first.map(String.init) ?? ""
                    if ledgerTables.contains(table) { scans.append("\(step)  <-  \(sql)") }
                }
            }
        }
        #expect(scans.isEmpty, "full scans on hot paths:\n\(scans.joined(separator: "\n"))")
    }
    @Test(arguments: TestStore.backends) func whatIsSettledIsQueuedToBeFinishedAtAppleOnceAndNothingHeldIs(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        var finishing = policy
        finishing.finishAtApple = true
        func queued() async throws -> [String] {
            try await store.finishStates(of: ["c1", "c2", "p1", "p2", "v1", "r1", "s1", "s2"]).filter { $0.value.state == "queued" }
                .keys.sorted()
        }
        // Credited: both purchases of the upload; the same upload again, or another user's
        // replay of it, queues nothing more.
        let first = try await upload(
            [purchase("c1", product: "com.example.coins.60"), purchase("c2", product: "com.example.coins.120")], by: "ana",
            to: store, policy: finishing)
        try await upload([purchase("c1", product: "com.example.coins.60")], by: "ana", to: store, policy: finishing)
        let replay = try await upload([purchase("c1", product: "com.example.coins.60")], by: "eve", to: store, policy: finishing)
        #expect(replay.transactions.map(\.state) == [.replayedFromOtherUser])
        #expect(try await queued() == ["c1", "c2"])
        #expect(try await store.testRows("SELECT * FROM apple_finish").count == 2)
        // A lookup that proves nothing is answered alike (nothing listed), and never finished at Apple.
        var looked = purchase("v1", product: "com.example.coins.300")
        looked.evidence = .lookup
        #expect(try await upload([looked], by: "mallory", to: store, policy: finishing).reason == .proofRequired)
        // A restore (a new transaction id of a credited non-consumable) is settled as the
        // purchase it restores: finished too.
        try await upload([purchase("p1", product: "com.example.premium")], by: "ana", to: store, policy: finishing)
        let restore = try await upload(
            [purchase("p2", original: "p1", product: "com.example.premium")], by: "ana", to: store, policy: finishing)
        #expect(restore.transactions.map(\.state) == [.alreadyCredited])
        // A renewal credited by Apple's notification is finished as an upload's credit is.
        try await upload([purchase("s1", product: "com.example.vip.month", period: "w1")], by: "ana", to: store, policy: finishing)
        _ = try await notify(
            "DID_RENEW", purchase("s2", original: "s1", product: "com.example.vip.month", period: "w2"), to: store, status: 1,
            policy: finishing)
        #expect(try await queued() == ["c1", "c2", "p1", "p2", "s1", "s2"])
        // Without the setting (the app finishes) nothing is queued.
        try await upload([purchase("r1", product: "com.example.coins.60")], by: "ana", to: store)
        #expect(try await store.finishStates(of: ["r1"]).isEmpty)

        // The worker claims what is due once (a second claim while the first holds finds
        // nothing), and records what Apple answered; only `finished` says so in the answer.
        let now = Date()
        let claimed = try await store.claimDueFinishes(limit: 10, worker: "w1", now: now)
        #expect(claimed.map(\.transactionId).sorted() == ["c1", "c2", "p1", "p2", "s1", "s2"])
        #expect(try await store.claimDueFinishes(limit: 10, worker: "w2", now: now).isEmpty)
        try await store.recordFinish("c1", .finished, now: now)
        try await store.recordFinish("c2", .retry(at: now.addingTimeInterval(30), error: "503"), now: now)
        try await store.recordFinish("p1", .refused("4040010"), now: now)
        let later = try await store.claimDueFinishes(limit: 10, worker: "w2", now: now.addingTimeInterval(61))
        #expect(later.map(\.transactionId).sorted() == ["c2", "p2", "s1", "s2"], "lapsed claims and due retries come back")
        #expect(later.first { $0.transactionId == "c2" }?.attempts == 1)
        try await store.recordFinish("c1", .retry(at: now, error: "late"), now: now)
        let states = try await store.finishStates(of: ["c1", "c2", "p1"])
        #expect(states["c1"]?.state == "finished" && states["c1"]?.finishedBy == "server", "a finished one stays finished")
        #expect(states["p1"]?.state == "refused" && states["p1"]?.lastError == "4040010")
        let answered = try await store.status(of: first.submissionId)
        #expect(answered?.transactions.map(\.finishedBy) == ["server", nil])
    }
}
