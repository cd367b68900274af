import Foundation
import IAPCore
import Ledger
import Testing

/// The core's new rules as examples, with no store, broker or clock: the verdict of an upload,
/// which purchase pays an order, a new purchase in a chain, a cancellation without Apple's
/// type, a renewal told before its subscription had an owner, goodwill bound to an Apple
/// purchase, and what is in force now.
@Suite("Ledger rules: the verdict and who really paid")
struct LedgerVerdictTests {
    static let t0 = Date(timeIntervalSince1970: 1_800_000_000)
    let catalog = Catalog(products: [
        .init(productId: "coins", type: .consumable, grant: ["coins": .number(100)]),
        .init(productId: "month", type: .autoRenewable, grant: ["tier": .name("vip")]),
        .init(productId: "year", type: .autoRenewable, grant: ["tier": .name("vip")]),
    ])
    var policy: LedgerPolicy { LedgerPolicy(catalog: catalog) }

    func coins(_ id: String, at date: Date, quantity: Int = 1) -> VerifiedPurchase {
        VerifiedPurchase(
            transactionId: id, originalTransactionId: id, productId: "coins", quantity: quantity, purchaseDate: date,
            environment: .production)
    }

    func upload(_ user: String, order: String? = nil, transaction: String? = nil) -> LedgerEvent.Upload {
        LedgerEvent.Upload(userId: user, submissionId: "s", orderId: order, transactionId: transaction, bundleId: "app")
    }

    func order(_ id: String, user: String = "olga", product: String = "coins", at date: Date, state: OrderState = .created)
        -> Order
    {
        Order(id: id, userId: user, productId: product, state: state, transactionId: nil, createdAt: date)
    }

    func plan(_ event: LedgerEvent, _ facts: LedgerFacts = LedgerFacts()) -> LedgerPlan {
        Ledger.plan(event, facts: facts, policy: policy, now: Self.t0 + 3_600)
    }

    func boundOrders(_ plan: LedgerPlan) -> [String] {
        plan.changes.compactMap { if case .bindOrder(let id, _, _) = $0 { id } else { nil } }
    }

    func candidate(
        _ id: String, at date: Date, product: String = "coins", original: String? = nil, granted: Bool = true,
        ownership: String? = "PURCHASED"
    ) -> LedgerFacts.OrderCandidate {
        LedgerFacts.OrderCandidate(
            transactionId: id, originalTransactionId: original ?? id, productId: product, purchaseDate: date, orderId: nil,
            granted: granted, ownershipType: ownership)
    }

    func naming(_ user: String = "olga", order: String?, missing: String? = nil) -> LedgerEvent {
        .naming(.init(userId: user, submissionId: "s", orderId: order, missingTransactionId: missing))
    }

    /// Crediting a purchase never pays an order named alone: which purchase the app holds for it
    /// is decided once every purchase of the upload is in the ledger (`LedgerEvent.Naming`).
    /// Named together with the transaction, the binding is explicit, whatever the dates.
    @Test func creditingPaysAnOrderOnlyWhenTheUploadNamesTheTransactionWithIt() {
        let o2 = order("o2", at: Self.t0)
        let alone = plan(.upload(coins("t2", at: Self.t0 + 1), upload("olga", order: "o2")), LedgerFacts(uploadOrder: o2))
        #expect(alone.outcome == .transaction(.credited, nil))
        #expect(boundOrders(alone).isEmpty)
        let named = plan(.upload(coins("t1", at: Self.t0 - 1), upload("olga", order: "o2", transaction: "t1")), LedgerFacts(uploadOrder: o2))
        #expect(boundOrders(named) == ["o2"])
        let other = plan(.upload(coins("t3", at: Self.t0 + 1), upload("mallory", order: "o2", transaction: "t3")), LedgerFacts(uploadOrder: o2))
        #expect(boundOrders(other).isEmpty)
        // Access someone else paid for (a family member's sharing, an assigned seat) is
        // credited, but pays no order of the one who holds it.
        for ownership in ["FAMILY_SHARED", "ASSIGNED"] {
            var shared = coins("t4", at: Self.t0 + 1)
            shared.ownershipType = ownership
            let access = plan(.upload(shared, upload("olga", order: "o2", transaction: "t4")), LedgerFacts(uploadOrder: o2))
            #expect(access.outcome == .transaction(.credited, nil))
            #expect(boundOrders(access).isEmpty, "\(ownership)")
        }
    }

    /// An order named alone is paid only by the one purchase that can be its: of its product,
    /// bought since it was placed (our clock may run `clockSkewAllowed` ahead of Apple's), no
    /// other order's, and no other open order of the user could be paid by it. Anything else
    /// is for the app to say (`name_the_transaction`), never a guess.
    @Test func anOrderNamedAloneIsPaidOnlyWhenOnePurchaseCanBeItsAndNoOtherOrderCouldTakeIt() {
        let o2 = order("o2", at: Self.t0)
        func decide(
            _ candidates: [LedgerFacts.OrderCandidate], open: [Order] = [], inUpload: Set<String> = ["t1", "t2"]
        ) -> LedgerPlan {
            var event = LedgerEvent.Naming(userId: "olga", submissionId: "s", orderId: "o2", missingTransactionId: nil)
            event.inUpload = inUpload
            return plan(.naming(event), LedgerFacts(uploadOrder: o2, openOrders: [o2] + open, orderCandidates: candidates))
        }
        let one = decide([candidate("t2", at: Self.t0 + 1)])
        #expect(one.outcome == .naming(.orderPaid(transactionId: "t2")))
        #expect(boundOrders(one) == ["o2"] && one.changes.contains(.attachOrder(orderId: "o2", transactionId: "t2")))
        // Bought before the order was placed, beyond what our clock may run ahead: another's.
        #expect(decide([candidate("t1", at: Self.t0 - LedgerPolicy.clockSkewAllowed - 1)]).outcome == .naming(.orderUnpaid))
        #expect(decide([candidate("t1", at: Self.t0 - LedgerPolicy.clockSkewAllowed + 1)]).outcome == .naming(.orderPaid(transactionId: "t1")))
        #expect(decide([candidate("t1", at: Self.t0 + 1, product: "year")]).outcome == .naming(.orderUnpaid))
        // Two purchases, or another open order placed before the one purchase: ambiguous.
        let ambiguous: [LedgerPlan] = [
            decide([candidate("t2", at: Self.t0 + 2), candidate("t1", at: Self.t0 + 1)]),
            decide([candidate("t2", at: Self.t0 + 2)], open: [order("o1", at: Self.t0 - 5)]),
            decide([candidate("t2", at: Self.t0 + 2)], open: [order("o3", at: Self.t0 + 1)]),
            // It cannot pay orders at all: a seat, a purchase taken back. The app names it.
            decide([candidate("t2", at: Self.t0 + 2, ownership: "ASSIGNED")]),
            decide([candidate("t2", at: Self.t0 + 2, granted: false)]),
        ]
        for plan in ambiguous {
            #expect(plan.outcome == .naming(.orderAmbiguous), "\(plan.outcome)")
            #expect(boundOrders(plan).isEmpty && plan.changes.isEmpty)
        }
        // The one purchase, credited from another upload and not in this one: the app names it.
        #expect(decide([candidate("t2", at: Self.t0 + 2)], inUpload: ["t1"]).outcome == .naming(.orderAmbiguous))
        // An open order placed after the purchase cannot be what it was made for.
        #expect(decide([candidate("t2", at: Self.t0 + 2)], open: [order("o3", at: Self.t0 + 3_600)]).outcome
            == .naming(.orderPaid(transactionId: "t2")))
        // A renewal never pays an order; the subscription's first period does.
        let month = Order(id: "o2", userId: "olga", productId: "month", state: .created, transactionId: nil, createdAt: Self.t0)
        let renewal = plan(naming(order: "o2"), LedgerFacts(uploadOrder: month, openOrders: [month], orderCandidates: [
            candidate("t5", at: Self.t0 + 1, product: "month", original: "t4")
        ]))
        #expect(renewal.outcome == .naming(.orderAmbiguous))
        // Someone else's order, or one paid already: nothing changes.
        let theirs = plan(naming("mallory", order: "o2"), LedgerFacts(uploadOrder: o2, openOrders: [o2], orderCandidates: [candidate("t2", at: Self.t0 + 1)]))
        #expect(theirs.outcome == .naming(.nothing) && theirs.changes.isEmpty)
    }

    /// The ledger is the memory, not the receipt: a named transaction the receipt lacks (the
    /// server finished the consumable, so it left every later receipt) that the ledger holds
    /// credited to the uploader settles the upload, and pays the order named with it.
    @Test func aNamedTransactionTheReceiptLacksIsAnsweredFromTheLedger() {
        let o1 = order("o1", at: Self.t0 - 10)
        let row = LedgerFacts.Purchase(
            transactionId: "t1", originalTransactionId: "t1", productId: "coins", quantity: 1, environment: .production,
            bundleId: "app", purchaseDate: Self.t0, userId: "olga", orderId: nil, submissionId: "s0", appAccountToken: nil,
            heldReason: nil, creditedAt: Self.t0, creditKey: .transaction("t1"), webOrderLineItemId: nil, expiresDate: nil)
        var grant = Grant(
            id: 1, transactionId: "t1", userId: "olga", productId: "coins", orderId: nil, quantity: 1, grantJSON: "{}",
            environment: "Production", source: .apple, isActive: true, grantedAt: Self.t0, revokedAt: nil, revokedBy: nil,
            creditKey: .transaction("t1"), originalTransactionId: "t1", expiresAt: nil, gracePeriodExpiresAt: nil)
        let held = plan(naming(order: "o1", missing: "t1"), LedgerFacts(purchase: row, grants: [grant], uploadOrder: o1))
        #expect(held.outcome == .naming(.fromLedger(.alreadyCredited)))
        #expect(boundOrders(held) == ["o1"] && held.changes.contains(.attachOrder(orderId: "o1", transactionId: "t1")))
        // Named by another account of the app (the same Apple ID's other user): credited to
        // olga, so settled for the app that holds it, and nothing changes.
        let other = plan(naming("mallory", order: "o1", missing: "t1"), LedgerFacts(purchase: row, grants: [grant], uploadOrder: o1))
        #expect(other.outcome == .naming(.fromLedger(.replayedFromOtherUser)) && other.changes.isEmpty)
        grant.isActive = false
        let taken = plan(naming(order: "o1", missing: "t1"), LedgerFacts(purchase: row, grants: [grant], uploadOrder: o1))
        #expect(taken.outcome == .naming(.fromLedger(.revoked)) && boundOrders(taken).isEmpty)
    }

    @Test func aPurchaseCreditedWithoutItsOrderPaysItWhenAnUploadNamesItWithIt() {
        let o1 = order("o1", at: Self.t0 - 10)
        let grant = Grant(
            id: 1, transactionId: "t1", userId: "olga", productId: "coins", orderId: nil, quantity: 1, grantJSON: "{}",
            environment: "Production", source: .apple, isActive: true, grantedAt: Self.t0, revokedAt: nil, revokedBy: nil,
            creditKey: .transaction("t1"), originalTransactionId: "t1", expiresAt: nil, gracePeriodExpiresAt: nil)
        let retry = plan(
            .upload(coins("t1", at: Self.t0), upload("olga", order: "o1", transaction: "t1")), LedgerFacts(grants: [grant], uploadOrder: o1))
        #expect(retry.outcome == .transaction(.alreadyCredited, nil))
        #expect(boundOrders(retry) == ["o1"])
        #expect(retry.changes.contains(.attachOrder(orderId: "o1", transactionId: "t1")))
    }

    @Test func theVerdictOfAnOrderNamedUploadWaitsForThePurchaseMadeForIt() {
        let credited = [FinishAdvice.PurchaseOutcome(transactionId: "t1", state: .credited, reason: nil)]
        let unpaid = FinishAdvice.verdict(
            userId: "olga", transactionId: nil, orderId: "o2", outcomes: credited, namedRevocations: [],
            namedOrder: order("o2", at: Self.t0))
        #expect(unpaid.state == .rejected && unpaid.reason == .transactionNotInReceipt)
        #expect(!FinishAdvice.mayFinishUpload(state: unpaid.state, reason: unpaid.reason, named: .order, settledByHand: false))
        let paid = FinishAdvice.verdict(
            userId: "olga", transactionId: nil, orderId: "o2", outcomes: credited, namedRevocations: [],
            namedOrder: order("o2", at: Self.t0, state: .paid), naming: .orderTokenInUpload)
        #expect(paid == UploadVerdict(state: .credited))
        // Paid, but no purchase of the upload carries the order's token: what the app holds only
        // the app knows, so it names it before it is told to finish (the order's state alone is
        // no proof), whatever the order's state.
        for state in [OrderState.paid, .refunded, .cancelled] {
            let guessed = FinishAdvice.verdict(
                userId: "olga", transactionId: nil, orderId: "o2", outcomes: credited, namedRevocations: [],
                namedOrder: order("o2", at: Self.t0, state: state), naming: .orderPaid(transactionId: "t1"))
            #expect(guessed.reason == .nameTheTransaction, "\(state): \(guessed)")
            #expect(!FinishAdvice.mayFinishUpload(state: guessed.state, reason: guessed.reason, named: .order, settledByHand: false))
        }
        let ambiguous = FinishAdvice.verdict(
            userId: "olga", transactionId: nil, orderId: "o2", outcomes: credited, namedRevocations: [],
            namedOrder: order("o2", at: Self.t0), naming: .orderAmbiguous)
        #expect(ambiguous.state == .rejected && ambiguous.reason == .nameTheTransaction)
        #expect(!FinishAdvice.mayFinishUpload(state: ambiguous.state, reason: ambiguous.reason, named: .order, settledByHand: false))
        // A named transaction the receipt lacks, credited to the uploader before: settled.
        let fromLedger = FinishAdvice.verdict(
            userId: "olga", transactionId: "t9", orderId: nil, outcomes: credited, namedRevocations: [], namedOrder: nil,
            naming: .fromLedger(.alreadyCredited))
        #expect(fromLedger.state == .credited)
        #expect(FinishAdvice.mayFinishUpload(state: fromLedger.state, reason: fromLedger.reason, named: .transaction, settledByHand: false))
        let takenBack = FinishAdvice.verdict(
            userId: "olga", transactionId: "t9", orderId: nil, outcomes: [], namedRevocations: [], namedOrder: nil,
            naming: .fromLedger(.revoked))
        #expect(takenBack.reason == .purchaseRevoked)
        #expect(FinishAdvice.verdictQuery(transactionId: nil, orderId: "o2", outcomes: credited).order == "o2")
        #expect(FinishAdvice.verdictQuery(transactionId: "t9", orderId: "o2", outcomes: credited).revocationsOf == "t9")
    }

    /// An order that is not the uploader's (unknown, or another user's, paid or not) says nothing
    /// of the purchase the app holds: never finishable at the top, whatever the receipt credited.
    @Test func anOrderThatIsNotTheUploadersIsNeverFinishableAtTheTop() {
        let credited = [FinishAdvice.PurchaseOutcome(transactionId: "t1", state: .credited, reason: nil)]
        for (outcomes, order) in [
            (credited, nil), ([], nil), (credited, order("o2", user: "mallory", at: Self.t0, state: .paid)),
            ([], order("o2", user: "mallory", at: Self.t0)),
        ] as [([FinishAdvice.PurchaseOutcome], Order?)] {
            let verdict = FinishAdvice.verdict(
                userId: "olga", transactionId: nil, orderId: "o2", outcomes: outcomes, namedRevocations: [], namedOrder: order)
            #expect(verdict.state == .rejected && verdict.reason == .orderUnknown, "\(verdict)")
            #expect(!FinishAdvice.mayFinishUpload(state: verdict.state, reason: verdict.reason, named: .order, settledByHand: false))
        }
    }

    @Test func aLookupThatProvesNothingAnswersAlike() {
        // Also a purchase nobody proved yet (held): a probe of a genuine id must not read
        // otherwise than an unknown one, nor open a case for customer service.
        let held = [(TransactionCreditState.held, ReasonCode.ownerUnknown), (.held, .buyerUnknown), (.held, .grantedByHandToAnotherUser)]
        for (state, reason) in [(TransactionCreditState.replayedFromOtherUser, nil), (.revoked, nil), (.ownedByOtherUser, nil)] + held {
            let verdict = FinishAdvice.verdict(
                userId: "eve", transactionId: "t1", orderId: nil,
                outcomes: [.init(transactionId: "t1", state: state, reason: reason, lookup: true)], namedRevocations: [],
                namedOrder: nil)
            #expect(verdict == FinishAdvice.lookupProvesNothing, "\(state)")
            // The app may hold that very purchase, unproven: never told to finish it.
            #expect(!FinishAdvice.mayFinishUpload(state: verdict.state, reason: verdict.reason, named: .transaction, settledByHand: false))
        }
        // An id Apple does not know, looked up alone, reads the same; not so an unknown signed
        // transaction (the upload proves what it is) or another rejection.
        #expect(FinishAdvice.rejection(.transactionNotFound, message: "Apple knows no such transaction", lookup: true) == FinishAdvice.lookupProvesNothing)
        #expect(FinishAdvice.rejection(.transactionNotFound, message: "x", lookup: false).reason == .transactionNotFound)
        #expect(FinishAdvice.rejection(.invalidReceipt, message: "x", lookup: true).reason == .invalidReceipt)
        // The same outcome on an upload Apple vouches for says what it is.
        let signed = FinishAdvice.verdict(
            userId: "eve", transactionId: "t1", orderId: nil,
            outcomes: [.init(transactionId: "t1", state: .replayedFromOtherUser, reason: nil)], namedRevocations: [], namedOrder: nil)
        #expect(signed.reason == .replayedFromOtherUser && signed.listsTransactions)
    }

    /// A StoreKit 1 id the receipt does not hold, named with what it stands for: settled as the
    /// purchase of that original transaction and product in the receipt is, for a product that
    /// stays in receipts; never for a consumable, a product that differs, or the named id itself.
    @Test func aNamedStoreKit1IdTheReceiptLacksIsSettledByItsOriginalOnly() {
        func outcome(_ state: TransactionCreditState, product: String = "premium", stays: Bool = true) -> FinishAdvice.PurchaseOutcome {
            .init(transactionId: "t1", state: state, reason: nil, originalTransactionId: "t1", productId: product, staysInReceipts: stays)
        }
        func verdict(_ outcome: FinishAdvice.PurchaseOutcome, named: String = "t9", original: String = "t1", product: String? = "premium")
            -> UploadVerdict
        {
            FinishAdvice.verdict(
                userId: "ria", transactionId: named, orderId: nil, outcomes: [outcome], namedRevocations: [], namedOrder: nil,
                namedOriginal: .init(originalTransactionId: original, productId: product))
        }
        for state in [TransactionCreditState.credited, .alreadyCredited, .superseded] {
            #expect(verdict(outcome(state)) == UploadVerdict(state: .credited, reason: .originalTransactionSettled, message: verdict(outcome(state)).message))
            #expect(verdict(outcome(state), product: nil).reason == .originalTransactionSettled)
        }
        #expect(verdict(outcome(.replayedFromOtherUser)).reason == .ownedByOtherUser)
        #expect(verdict(outcome(.revoked)).reason == .purchaseRevoked)
        #expect(verdict(outcome(.held)).state == .needsReview)
        // Not a stand-in: a consumable, another product, another original, the id itself.
        #expect(verdict(outcome(.credited, product: "coins", stays: false)).reason == .transactionNotInReceipt)
        #expect(verdict(outcome(.credited), product: "month").reason == .transactionNotInReceipt)
        #expect(verdict(outcome(.credited), original: "t2").reason == .transactionNotInReceipt)
        #expect(verdict(outcome(.credited), named: "t1", original: "t1").reason == nil)
        let unnamed = FinishAdvice.verdict(
            userId: "ria", transactionId: "t9", orderId: nil, outcomes: [outcome(.credited)], namedRevocations: [], namedOrder: nil)
        #expect(unnamed.reason == .transactionNotInReceipt)
        #expect(FinishAdvice.mayFinishUpload(state: .credited, reason: .originalTransactionSettled, named: .transaction, settledByHand: false))
    }

    func period(_ id: String, product: String = "month", reason: String?, token: String? = nil) -> VerifiedPurchase {
        var purchase = VerifiedPurchase(
            transactionId: id, originalTransactionId: "t1", productId: product, quantity: 1, purchaseDate: Self.t0 + 60,
            environment: .production, expiresDate: Self.t0 + 30 * 86_400, appAccountToken: token, webOrderLineItemId: "w-\(id)")
        purchase.transactionReason = reason
        purchase.originalPurchaseDate = Self.t0 - 86_400
        return purchase
    }

    func subscription(owner: String?) -> Subscription {
        Subscription(
            originalTransactionId: "t1", userId: owner, productId: "month", environment: "Production", state: .expired,
            expiresDate: Self.t0, autoRenew: false, gracePeriodExpiresDate: nil, lastTransactionId: "t1", updatedAt: Self.t0,
            stateDate: Self.t0)
    }

    @Test func aResubscriptionIsItsBuyersAndARenewalItsOwners() {
        #expect(
            Ownership.decide(
                .init(uploader: "ben", evidence: .signedUpload, subscriptionOwner: "ana", newPurchaseInChain: true), restore: .keep)
                == .creditMovingSubscription(from: "ana", to: "ben"))
        #expect(
            Ownership.decide(.init(uploader: "ben", evidence: .lookup, subscriptionOwner: "ana", newPurchaseInChain: true), restore: .keep)
                == .held(.ownerUnknown))
        // A bare id of a new purchase proves nobody's, not even the owner's: another account of
        // the app on the same Apple ID may have bought it.
        #expect(
            Ownership.decide(.init(uploader: "ana", evidence: .lookup, subscriptionOwner: "ana", newPurchaseInChain: true), restore: .keep)
                == .held(.ownerUnknown))
        let facts = LedgerFacts(subscription: subscription(owner: "ana"))
        let bought = plan(.upload(period("t5", reason: "PURCHASE"), upload("ben")), facts)
        #expect(bought.outcome == .transaction(.credited, nil))
        #expect(bought.changes.contains { if case .putSubscription(let row) = $0 { row.userId == "ben" } else { false } })
        let renewal = plan(.upload(period("t5", reason: "RENEWAL"), upload("ben")), facts)
        #expect(renewal.outcome == .transaction(.ownedByOtherUser, nil))
        // A restore of the chain's first period keeps its purchase date: not a new purchase.
        var restore = period("t5", reason: "PURCHASE")
        restore.purchaseDate = restore.originalPurchaseDate
        #expect(!restore.isNewPurchaseInChain)
        #expect(plan(.upload(restore, upload("ben")), facts).outcome == .transaction(.ownedByOtherUser, nil))
        // Without Apple's word (verifyReceipt), a later period of a chain in force follows the
        // owner, unless the ledger recorded Apple's word that it is a new purchase awaiting its
        // buyer (below), or its dates say so (`aReceiptsLaterPeriodIsANewPurchaseByItsDates`).
        var inForce = facts
        inForce.subscription?.state = .active
        inForce.subscription?.expiresDate = Self.t0 + 30 * 86_400
        let unsaid = plan(.upload(period("t5", reason: nil), upload("ben")), inForce)
        #expect(unsaid.outcome == .transaction(.ownedByOtherUser, nil))
        var awaiting = facts
        awaiting.purchase = LedgerFacts.Purchase(
            transactionId: "t5", originalTransactionId: "t1", productId: "month", quantity: 1, environment: .production,
            bundleId: "app", purchaseDate: period("t5", reason: nil).purchaseDate, userId: "", orderId: nil, submissionId: "n",
            appAccountToken: nil, heldReason: .buyerUnknown, creditedAt: Self.t0, creditKey: nil, webOrderLineItemId: nil,
            expiresDate: nil)
        #expect(plan(.upload(period("t5", reason: nil), upload("ben")), awaiting).outcome == .transaction(.credited, nil))
    }

    /// A receipt's later period says nothing of why it was bought (`verifyReceipt` has no
    /// `transactionReason`): bought after Apple said the chain expired, or after the period
    /// before it ended, it is a resubscription; of another product while the period before it
    /// is in force, an upgrade. Each is its buyer's and pays the order it was bought for. A
    /// period bought while the ledger holds the chain in Apple's billing retry is the renewal
    /// Apple recovered, and so is one bought while the period before it is in force.
    @Test func aReceiptsLaterPeriodIsANewPurchaseByItsDates() {
        func credited(_ start: Date, product: String = "month", state: SubscriptionState, expired: Date? = nil) -> LedgerFacts {
            var chain = subscription(owner: "ana")
            chain.state = state
            chain.expiresDate = expired ?? start + 30 * 86_400
            let grant = Grant(
                id: 1, transactionId: "t1", userId: "ana", productId: product, orderId: nil, quantity: 1, grantJSON: "{}",
                environment: "Production", source: .apple, isActive: true, grantedAt: start, revokedAt: nil, revokedBy: nil,
                creditKey: .billingPeriod("w-t1"), originalTransactionId: "t1", expiresAt: start + 30 * 86_400,
                gracePeriodExpiresAt: nil, periodStart: start)
            return LedgerFacts(grants: [grant], subscription: chain, uploadOrder: order("o9", user: "ben", product: "month", at: Self.t0))
        }
        func receipt(_ facts: LedgerFacts) -> LedgerPlan {
            plan(.upload(period("t5", reason: nil), upload("ben", order: "o9", transaction: "t5")), facts)
        }
        // Apple said the chain expired (EXPIRED) before it was bought, though the last period's
        // end is later (the period ended early).
        let afterExpiry = receipt(credited(Self.t0 - 86_400, state: .expired, expired: Self.t0))
        #expect(afterExpiry.outcome == .transaction(.credited, nil))
        #expect(boundOrders(afterExpiry) == ["o9"])
        #expect(afterExpiry.changes.contains { if case .putSubscription(let row) = $0 { row.userId == "ben" } else { false } })
        // The period before it ended, with no word from Apple: a resubscription by its dates.
        let lapsed = receipt(credited(Self.t0 - 40 * 86_400, state: .active))
        #expect(lapsed.outcome == .transaction(.credited, nil))
        #expect(boundOrders(lapsed) == ["o9"])
        // Of another product while the period before it is in force: an upgrade.
        let upgraded = receipt(credited(Self.t0 - 86_400, product: "week", state: .active))
        #expect(upgraded.outcome == .transaction(.credited, nil))
        #expect(boundOrders(upgraded) == ["o9"])
        // Bought while the period before it is in force, of its product: a renewal, the owner's.
        let renewal = receipt(credited(Self.t0 - 86_400, state: .active))
        #expect(renewal.outcome == .transaction(.ownedByOtherUser, nil))
        #expect(boundOrders(renewal).isEmpty)
        // Bought after the period ended while Apple retries the failed renewal: the recovery.
        for retrying in [SubscriptionState.billingRetry, .gracePeriod] {
            let recovered = receipt(credited(Self.t0 - 40 * 86_400, state: retrying))
            #expect(recovered.outcome == .transaction(.ownedByOtherUser, nil), "\(retrying)")
            #expect(boundOrders(recovered).isEmpty, "\(retrying)")
        }
        // Apple's notification recorded it as a renewal nobody owned yet: its word stands.
        var told = credited(Self.t0 - 40 * 86_400, state: .active)
        told.purchase = LedgerFacts.Purchase(
            transactionId: "t5", originalTransactionId: "t1", productId: "month", quantity: 1, environment: .production,
            bundleId: "app", purchaseDate: period("t5", reason: nil).purchaseDate, userId: "", orderId: nil, submissionId: "n",
            appAccountToken: nil, heldReason: .ownerUnknown, creditedAt: Self.t0, creditKey: nil, webOrderLineItemId: nil,
            expiresDate: nil)
        #expect(boundOrders(receipt(told)).isEmpty)
        // The receipt lists the period before it, ending where it begins: a renewal, though
        // Apple's last word of the chain was EXPIRED (a renewal of a resubscription whose
        // SUBSCRIBED has not arrived yet); one the listing dates after a lapse is new.
        let stale = credited(Self.t0 - 86_400, state: .expired, expired: Self.t0)
        var listed = period("t5", reason: nil)
        listed.previousPeriodEnd = listed.purchaseDate
        listed.previousPeriodProductId = "month"
        #expect(plan(.upload(listed, upload("ben", order: "o9", transaction: "t5")), stale).outcome == .transaction(.ownedByOtherUser, nil))
        listed.previousPeriodEnd = Self.t0
        #expect(boundOrders(plan(.upload(listed, upload("ben", order: "o9", transaction: "t5")), stale)) == ["o9"])
    }

    /// What a receipt lists of a chain dates each period: the period of another line item bought
    /// latest before it (its copies listed twice skipped), with its end and product.
    @Test func aListingGivesEachPeriodThePeriodBeforeIt() {
        func listed(_ id: String, line: String, product: String = "month", bought: Double, ends: Double) -> VerifiedPurchase {
            VerifiedPurchase(
                transactionId: id, originalTransactionId: "t1", productId: product, quantity: 1, purchaseDate: Self.t0 + bought,
                environment: .production, expiresDate: Self.t0 + ends, webOrderLineItemId: line)
        }
        let listing = VerifiedPurchase.withPreviousPeriods([
            listed("t3", line: "w3", product: "year", bought: 40, ends: 400),
            listed("t1", line: "w1", bought: 0, ends: 30),
            listed("t2", line: "w2", bought: 30, ends: 60),
            listed("t2", line: "w2", bought: 30, ends: 60),
            listed("t9", line: "w9", bought: 500, ends: 530),
            VerifiedPurchase(transactionId: "c1", originalTransactionId: "c1", productId: "coins", quantity: 1, purchaseDate: Self.t0, environment: .production),
        ])
        #expect(listing.map(\.previousPeriodEnd) == [Self.t0 + 60, nil, Self.t0 + 30, Self.t0 + 30, Self.t0 + 400, nil])
        #expect(listing.map(\.previousPeriodProductId) == ["month", nil, "month", "month", "year", nil])
    }

    @Test func anOrderPlacedForAnUpgradeOrResubscriptionIsPaidByIt() {
        let yearOrder = order("o9", user: "ana", product: "year", at: Self.t0)
        let facts = LedgerFacts(subscription: subscription(owner: "ana"), uploadOrder: yearOrder)
        // The signed transaction uploaded with the order: what the app holds for it.
        let upgrade = plan(.upload(period("t5", product: "year", reason: "PURCHASE"), upload("ana", order: "o9", transaction: "t5")), facts)
        #expect(boundOrders(upgrade) == ["o9"])
        // A renewal pays nothing, even of the order's product after the order.
        let renewal = plan(.upload(period("t6", product: "year", reason: "RENEWAL"), upload("ana", order: "o9", transaction: "t6")), facts)
        #expect(boundOrders(renewal).isEmpty)
    }

    @Test func aCancellationWithoutItsTypeTakesBackOnlyWhatAppleTyped() {
        var packs = coins("t1", at: Self.t0, quantity: 3)
        packs.cancellationDate = Self.t0 + 100
        // Several units, no type: nothing taken back by the answer alone; listed for a person.
        let untyped = plan(.upload(packs, upload("pia", transaction: "t1")))
        #expect(untyped.outcome == .transaction(.credited, nil))
        #expect(!untyped.changes.contains { if case .putRevocation = $0 { true } else { false } })
        #expect(untyped.changes.contains { if case .audit(let entry) = $0 { entry.action == "cancellation_untyped" } else { false } })
        // Apple's prorated refund recorded already: it stands, nothing more is taken, nothing listed.
        let prorated = LedgerFacts.Revocation(
            creditKey: .transaction("t1"), transactionId: "t1", source: "REFUND", revokedAt: Self.t0 + 100, reversedAt: nil,
            partlyRevokedAt: Self.t0 + 100, revokedUnits: 1)
        let typed = plan(.upload(packs, upload("pia", transaction: "t1")), LedgerFacts(revocation: prorated))
        #expect(typed.outcome == .transaction(.credited, nil))
        #expect(!typed.changes.contains { if case .putRevocation = $0 { true } else { false } })
        #expect(!typed.changes.contains { if case .audit(let entry) = $0 { entry.action == "cancellation_untyped" } else { false } })
        #expect(typed.changes.contains { if case .grant(let grant) = $0 { grant.quantity == 2 } else { false } })
        // One unit: the whole purchase.
        var one = coins("t2", at: Self.t0)
        one.cancellationDate = Self.t0 + 100
        #expect(plan(.upload(one, upload("pia", transaction: "t2"))).outcome == .transaction(.revoked, .purchaseRevoked))
        // Apple's typed word: a full refund takes all.
        packs.revocationType = "REFUND_FULL"
        #expect(plan(.upload(packs, upload("pia", transaction: "t1"))).outcome == .transaction(.revoked, .purchaseRevoked))
    }

    @Test func aRenewalToldBeforeTheOwnerIsCreditedWhenTheOwnerBecomesKnown() {
        let renewal = period("t2", reason: "RENEWAL")
        let told = AppStoreNotification(
            notificationUUID: "n1", notificationType: "DID_RENEW", subtype: nil, environment: .production, bundleId: "app",
            signedDate: Self.t0 + 60, purchase: renewal)
        let kept = plan(.notification(told, submissionId: "s1"))
        guard case .recordPurchase(let row, true)? = kept.changes.first(where: { if case .recordPurchase = $0 { true } else { false } })
        else {
            Issue.record("the renewal was not kept: \(kept.changes)")
            return
        }
        #expect(row.heldReason == .ownerUnknown && row.userId.isEmpty)
        #expect(!kept.changes.contains { if case .grant = $0 { true } else { false } })

        // The owner's first upload, of the first period: the renewal is theirs too.
        let first = VerifiedPurchase(
            transactionId: "t1", originalTransactionId: "t1", productId: "month", quantity: 1, purchaseDate: Self.t0 - 86_400,
            environment: .production, expiresDate: Self.t0 + 60, webOrderLineItemId: "w-t1")
        let facts = LedgerFacts(subscription: subscription(owner: nil), unownedPeriods: [row])
        let credited = plan(.upload(first, upload("rita")), facts)
        #expect(credited.outcome == .transaction(.credited, nil))
        let granted = credited.changes.compactMap { if case .grant(let grant) = $0 { grant.transactionId } else { nil } }
        #expect(granted == ["t1", "t2"])
        #expect(credited.changes.contains { if case .claimPurchase(let claimed) = $0 { claimed.userId == "rita" && claimed.heldReason == nil } else { false } })
    }

    @Test func goodwillNamingAnApplePurchaseIsBoundToIt() {
        let request = LedgerEvent.ManualGrant(
            userId: "gil", productId: "coins", quantity: 1, grant: ["coins": .number(100)], transactionId: nil,
            goodwillId: "manual-1", actor: "agent", reason: "paid, nothing came", appleTransactionId: "t7")
        let query = Ledger.query(for: .manualGrant(request), policy: policy)
        #expect(query.creditKey == .transaction("t7"))
        let granted = plan(.manualGrant(request))
        #expect(granted.outcome == .grant(transactionId: "t7"))
        let grant = granted.changes.compactMap { if case .grant(let grant) = $0 { grant } else { nil } }.first
        #expect(grant?.creditKey == .transaction("t7") && grant?.source == .manual)
        // The purchase's later upload finds it.
        let facts = LedgerFacts(grants: grant.map { [$0] } ?? [])
        #expect(plan(.upload(coins("t7", at: Self.t0), upload("gil", transaction: "t7")), facts).outcome == .transaction(.alreadyCredited, nil))
        // Another user's upload that proves the purchase theirs: word against proof, held for
        // a person (never a replay the app may finish); a bare id of it proves nobody's: held
        // as a purchase nobody owns is.
        #expect(
            plan(.upload(coins("t7", at: Self.t0), upload("bea", transaction: "t7")), facts).outcome
                == .transaction(.held, .grantedByHandToAnotherUser))
        var looked = coins("t7", at: Self.t0)
        looked.evidence = .lookup
        #expect(plan(.upload(looked, upload("bea", transaction: "t7")), facts).outcome == .transaction(.held, .ownerUnknown))
    }

    @Test func nothingIsInForcePastItsPeriodAndGrace() {
        let now = Self.t0
        #expect(InForce.subscriptionState(recorded: .active, expiresDate: now - 1, gracePeriodExpiresDate: nil, at: now) == .expired)
        #expect(InForce.subscriptionState(recorded: .active, expiresDate: now - 1, gracePeriodExpiresDate: now + 1, at: now) == .active)
        #expect(InForce.subscriptionState(recorded: .billingRetry, expiresDate: now - 1, gracePeriodExpiresDate: nil, at: now) == .billingRetry)
        #expect(!InForce.subscription(recorded: .active, expiresDate: now - 1, gracePeriodExpiresDate: nil, at: now))
        #expect(InForce.subscription(recorded: .gracePeriod, expiresDate: now - 1, gracePeriodExpiresDate: now + 1, at: now))
        #expect(!InForce.grant(isActive: true, expiresAt: now - 1, gracePeriodExpiresAt: nil, at: now))
        #expect(InForce.grant(isActive: true, expiresAt: nil, gracePeriodExpiresAt: nil, at: now))
    }

    /// A period of chain t1 kept unowned (or refunded) since `date`, as the store records it.
    func kept(_ id: String, at date: Date, reason: ReasonCode, for user: String = "") -> LedgerFacts.Purchase {
        LedgerFacts.Purchase(
            transactionId: id, originalTransactionId: "t1", productId: "month", quantity: 1, environment: .production,
            bundleId: "app", purchaseDate: date, userId: user, orderId: nil, submissionId: "n", appAccountToken: nil,
            heldReason: reason, creditedAt: Self.t0, creditKey: .billingPeriod("w-\(id)"), webOrderLineItemId: "w-\(id)",
            expiresDate: date + 30 * 86_400)
    }

    @Test func aRenewalAfterAnUnprovenNewPurchaseWaitsForItsBuyer() {
        // Ana owns the chain; someone bought it again (t2, told by Apple, kept for its buyer);
        // t3 renews t2. Ana's signed upload of t3 proves nothing of t2: held, kept for nobody.
        var renewal = period("t3", reason: "RENEWAL")
        renewal.purchaseDate = Self.t0 + 200
        renewal.evidence = .signedUpload
        let waiting = LedgerFacts(
            subscription: subscription(owner: "ana"), unownedPeriods: [kept("t2", at: Self.t0 + 100, reason: .buyerUnknown)])
        let anas = plan(.upload(renewal, upload("ana", transaction: "t3")), waiting)
        #expect(anas.outcome == .transaction(.held, .buyerUnknown))
        #expect(!anas.changes.contains { if case .grant = $0 { true } else { false } })

        // Ben proves t2: it and the renewal kept after it are his, and the chain is his from t2 on.
        var bought = period("t2", reason: "PURCHASE")
        bought.purchaseDate = Self.t0 + 100
        bought.evidence = .signedUpload
        let proven = LedgerFacts(
            subscription: subscription(owner: "ana"),
            unownedPeriods: [kept("t2", at: Self.t0 + 100, reason: .buyerUnknown), kept("t3", at: Self.t0 + 200, reason: .ownerUnknown)])
        let bens = plan(.upload(bought, upload("ben", transaction: "t2")), proven)
        #expect(bens.outcome == .transaction(.credited, nil))
        let granted = bens.changes.compactMap { if case .grant(let grant) = $0 { grant } else { nil } }
        #expect(granted.map(\.transactionId).sorted() == ["t2", "t3"] && granted.allSatisfy { $0.userId == "ben" })
        let moved = bens.changes.compactMap { if case .putSubscription(let row) = $0 { row } else { nil } }.last
        #expect(moved?.userId == "ben" && moved?.ownedSince == Self.t0 + 100)
    }

    @Test func aRenewalOfARefundedNewPurchaseIsItsBuyersNotTheChainsLaterOwners() {
        // Ana bought the chain (t1, credited); Ben resubscribed (t2), and Apple took it back
        // (FAMILY_REVOKE) before Ben's upload proved it (kept for Ben, refunded); t3 renewed t2
        // and was kept while nobody owned it; Cy resubscribed later (t4) and owns the chain now.
        // t3 is Ben's stretch: his upload is credited, Cy's and Ana's are not.
        let anas = Grant(
            id: 1, transactionId: "t1", userId: "ana", productId: "month", orderId: nil, quantity: 1, grantJSON: "{}",
            environment: "Production", source: .apple, isActive: true, grantedAt: Self.t0, revokedAt: nil, revokedBy: nil,
            creditKey: .billingPeriod("w-t1"), originalTransactionId: "t1", expiresAt: Self.t0 + 30 * 86_400,
            gracePeriodExpiresAt: nil, periodStart: Self.t0)
        var cys = subscription(owner: "cy")
        cys.ownedSince = Self.t0 + 300
        var facts = LedgerFacts(
            grants: [anas], subscription: cys, unownedPeriods: [kept("t3", at: Self.t0 + 200, reason: .ownerUnknown)])
        var resubscription = kept("t2", at: Self.t0 + 100, reason: .stoppedByRefund, for: "ben")
        resubscription.beginsStretch = true
        facts.refundedPeriods = [resubscription]
        var renewal = period("t3", reason: "RENEWAL")
        renewal.purchaseDate = Self.t0 + 200
        renewal.evidence = .signedUpload
        let bens = plan(.upload(renewal, upload("ben", transaction: "t3")), facts)
        #expect(bens.outcome == .transaction(.credited, nil))
        let granted = bens.changes.compactMap { if case .grant(let grant) = $0 { grant } else { nil } }
        #expect(granted.map(\.userId) == ["ben"])
        for other in ["cy", "ana"] {
            // Their upload proves t3 Apple's: it is credited to Ben, whose stretch it is.
            let planned = plan(.upload(renewal, upload(other, transaction: "t3")), facts)
            #expect(planned.outcome == .transaction(.ownedByOtherUser, nil), "\(other)")
            let granted = planned.changes.compactMap { if case .grant(let grant) = $0 { grant } else { nil } }
            #expect(granted.allSatisfy { $0.userId == "ben" }, "\(other): \(granted.map(\.userId))")
        }

        // A refunded renewal (no new purchase) begins no stretch: t3 stays in Ana's.
        resubscription.beginsStretch = false
        facts.refundedPeriods = [resubscription]
        let notBens = plan(.upload(renewal, upload("ben", transaction: "t3")), facts)
        #expect(notBens.outcome == .transaction(.ownedByOtherUser, nil))
    }

    @Test func aTransferNeverGivesATransactionIdASecondGrant() {
        // Under transfer, ben once took period w-t1 by uploading t1 and ana took it back with her
        // restore r5: a third account uploading t1 cannot be granted under t1 again (one grant
        // per transaction), so ana keeps it, as under keep.
        func grant(_ id: Int64, _ transaction: String, _ user: String, active: Bool) -> Grant {
            Grant(
                id: id, transactionId: transaction, userId: user, productId: "month", orderId: nil, quantity: 1, grantJSON: "{}",
                environment: "Production", source: .apple, isActive: active, grantedAt: Self.t0, revokedAt: nil,
                revokedBy: active ? nil : .transfer, creditKey: .billingPeriod("w-t1"), originalTransactionId: "t1",
                expiresAt: Self.t0 + 30 * 86_400, gracePeriodExpiresAt: nil)
        }
        let facts = LedgerFacts(
            grants: [grant(1, "r5", "ana", active: true), grant(2, "t1", "ben", active: false)], subscription: subscription(owner: "ana"))
        var first = period("t1", reason: "PURCHASE")
        first.evidence = .signedUpload
        let transfer = LedgerPolicy(catalog: catalog, restore: .transfer)
        let planned = Ledger.plan(.upload(first, upload("cleo", transaction: "t1")), facts: facts, policy: transfer, now: Self.t0 + 3_600)
        #expect(planned.outcome == .transaction(.ownedByOtherUser, nil))
        #expect(!planned.changes.contains { if case .grant = $0 { true } else { false } })
        // Ben, who held it under t1 before, takes it back as transfer says.
        let back = Ledger.plan(.upload(first, upload("ben", transaction: "t1")), facts: facts, policy: transfer, now: Self.t0 + 3_600)
        #expect(back.outcome == .transaction(.credited, nil))
        #expect(back.changes.contains(.reactivateGrant(transactionId: "t1")))
    }

    @Test func reconciliationAsksAboutWhatMayBeOutOfDateSoonestFirst() {
        let now = Self.t0
        let horizon = now + 86_400
        func candidate(_ id: String, _ state: SubscriptionState, ends: Date?, grace: Date? = nil, unowned: Bool = false)
            -> ReconciliationChoice.Candidate
        {
            .init(originalTransactionId: id, state: state, expiresDate: ends, gracePeriodExpiresDate: grace, holdsUnownedPeriods: unowned)
        }
        let all = [
            candidate("a-far", .active, ends: now + 30 * 86_400),
            // A renewal nobody owns yet moved the recorded end a month on: still asked about.
            candidate("b-unowned", .active, ends: now + 30 * 86_400, unowned: true),
            candidate("c-soon", .active, ends: now + 3_600),
            candidate("d-ended", .active, ends: now - 3_600),
            candidate("e-retry", .billingRetry, ends: now - 7 * 86_400),
            candidate("f-grace", .gracePeriod, ends: now - 86_400, grace: now + 5 * 86_400),
            candidate("g-expired", .expired, ends: now - 86_400, unowned: true),
            candidate("h-revoked", .revoked, ends: now + 3_600),
            candidate("i-open", .active, ends: nil),
            candidate("j-unknown-end", .billingRetry, ends: nil),
            // Active, its grace (recorded) reaching past the horizon: not due yet.
            candidate("k-graced", .active, ends: now + 3_600, grace: horizon + 3_600),
        ]
        let due = ReconciliationChoice.due(all, horizon: horizon, by: { $0 }).map(\.originalTransactionId)
        #expect(due == ["j-unknown-end", "e-retry", "f-grace", "d-ended", "c-soon", "b-unowned"])
    }

    /// Two periods of one product in force: the later period is the subscription's state in
    /// either arrival order, however late the earlier one was signed (a history read, or an old
    /// transaction signed anew, carries the time it was read).
    @Test func theLaterPeriodInForceIsTheSubscriptionsStateInEitherOrder() {
        func renewal(_ id: String, ends: Date, signed: Date, type: String = "DID_RENEW") -> AppStoreNotification {
            var purchase = period(id, reason: "RENEWAL")
            purchase.expiresDate = ends
            return AppStoreNotification(
                notificationUUID: "n-\(id)", notificationType: type, subtype: nil, environment: .production,
                bundleId: "app", signedDate: signed, purchase: purchase)
        }
        func row(_ id: String, ends: Date, signed: Date) -> Subscription {
            var row = subscription(owner: "ana")
            (row.state, row.expiresDate, row.lastTransactionId, row.stateDate) = (.active, ends, id, signed)
            return row
        }
        func recorded(_ planned: LedgerPlan) -> Subscription? {
            planned.changes.compactMap { if case .putSubscription(let row) = $0 { row } else { nil } }.last
        }
        let (earlierEnd, laterEnd) = (Self.t0 + 30 * 86_400, Self.t0 + 60 * 86_400)
        let (early, late) = (Self.t0 + 20 * 86_400, Self.t0 + 45 * 86_400)
        // The later period recorded first (signed early); the earlier one read late.
        let kept = recorded(plan(
            .notification(renewal("t2", ends: earlierEnd, signed: late), submissionId: "s1"),
            LedgerFacts(subscription: row("t3", ends: laterEnd, signed: early))))
        #expect(kept?.expiresDate == laterEnd && kept?.lastTransactionId == "t3", "\(String(describing: kept))")
        // The earlier period recorded first (read late); the later one signed early.
        let replaced = recorded(plan(
            .notification(renewal("t3", ends: laterEnd, signed: early), submissionId: "s1"),
            LedgerFacts(subscription: row("t2", ends: earlierEnd, signed: late))))
        #expect(replaced?.expiresDate == laterEnd && replaced?.lastTransactionId == "t3", "\(String(describing: replaced))")
        // An earlier period uploaded with a late signature, a refund of the later period and
        // that period's renewal, in every order: the refund stands (its date is the latest of
        // what Apple said about the subscription; the upload's state began with its period).
        func upload(_ id: String, ends: Date, begins: Date, signed: Date) -> LedgerEvent {
            var purchase = period(id, reason: "RENEWAL")
            (purchase.expiresDate, purchase.purchaseDate, purchase.signedDate) = (ends, begins, signed)
            return .upload(purchase, self.upload("ana"))
        }
        let p1 = upload("t2", ends: earlierEnd, begins: Self.t0, signed: late)
        let renewed = LedgerEvent.notification(renewal("t3", ends: laterEnd, signed: early), submissionId: "s2")
        let refunded = LedgerEvent.notification(renewal("t3", ends: laterEnd, signed: early + 60, type: "REFUND"), submissionId: "s3")
        for order in [[p1, refunded, renewed], [renewed, refunded, p1], [p1, renewed, refunded], [refunded, renewed, p1]] {
            var facts = LedgerFacts(subscription: row("t1", ends: Self.t0, signed: Self.t0))
            for event in order {
                if let next = recorded(plan(event, facts)) { facts.subscription = next }
            }
            #expect(facts.subscription?.state == .revoked, "\(order.map { "\($0)".prefix(40) })")
        }
        // A state Apple gives (here: expired) is still ranked by when Apple signed it.
        let expired = renewal("t2", ends: earlierEnd, signed: late, type: "EXPIRED")
        let ended = recorded(plan(.notification(expired, submissionId: "s1"), LedgerFacts(subscription: row("t3", ends: laterEnd, signed: early))))
        #expect(ended?.state == .expired, "\(String(describing: ended))")
    }

    @Test func theGraceEndingLeavesBillingRetryNotTheEnd() {
        let notification = AppStoreNotification(
            notificationUUID: "n2", notificationType: "GRACE_PERIOD_EXPIRED", subtype: nil, environment: .production,
            bundleId: "app", signedDate: Self.t0, purchase: period("t1", reason: "PURCHASE"))
        let planned = plan(.notification(notification, submissionId: "s2"), LedgerFacts(subscription: subscription(owner: "ana")))
        #expect(planned.outcome == .notification(.subscriptionState(.billingRetry)))
        #expect(planned.changes.contains { if case .putSubscription(let row) = $0 { row.state == .billingRetry } else { false } })
    }

    /// `MIGRATION`: Apple moved a subscription to a new chain (the Advanced Commerce API), whose
    /// transaction names the old one. Nothing was bought: nothing is credited and no order is
    /// paid; the new chain is its old chain's owner's, so its next renewal is credited to them.
    /// Before, the type was recorded as unknown and the new chain stayed nobody's.
    @Test func aMigrationCreditsNothingAndTheNewChainFollowsTheOldOwner() {
        var migrated = VerifiedPurchase(
            transactionId: "m1", originalTransactionId: "m1", productId: "month", quantity: 1, purchaseDate: Self.t0 + 60,
            environment: .production, expiresDate: Self.t0 + 30 * 86_400, webOrderLineItemId: "w-m1")
        migrated.previousOriginalTransactionId = "t1"
        let notification = AppStoreNotification(
            notificationUUID: "n-m1", notificationType: "MIGRATION", subtype: nil, environment: .production, bundleId: "app",
            signedDate: Self.t0 + 120, purchase: migrated, subscriptionStatus: 1, autoRenewStatus: 1)
        var facts = LedgerFacts()
        facts.previousChainOwner = "ana"
        let planned = plan(.notification(notification, submissionId: "s1"), facts)
        #expect(planned.outcome == .notification(.recorded))
        #expect(!planned.changes.contains { if case .grant = $0 { true } else { false } })
        #expect(!planned.changes.contains { if case .bindOrder = $0 { true } else { false } })
        let row = planned.changes.compactMap { if case .putSubscription(let row) = $0 { row } else { nil } }.last
        #expect(row?.originalTransactionId == "m1" && row?.userId == "ana" && row?.state == .active, "\(String(describing: row))")
        #expect(planned.changes.contains { if case .audit(let entry) = $0 { entry.action == "subscription_migrated" } else { false } })
        // The new chain's renewal is its owner's.
        var renewal = migrated
        (renewal.transactionId, renewal.webOrderLineItemId, renewal.purchaseDate) = ("m2", "w-m2", Self.t0 + 30 * 86_400)
        renewal.expiresDate = Self.t0 + 60 * 86_400
        var after = LedgerFacts(subscription: row)
        after.previousChainOwner = "ana"
        let renewed = plan(
            .notification(
                AppStoreNotification(
                    notificationUUID: "n-m2", notificationType: "DID_RENEW", subtype: nil, environment: .production, bundleId: "app",
                    signedDate: Self.t0 + 30 * 86_400, purchase: renewal, subscriptionStatus: 1),
                submissionId: "s2"),
            after)
        #expect(renewed.changes.contains { if case .grant(let grant) = $0 { grant.userId == "ana" } else { false } }, "\(renewed.changes)")
    }
}
