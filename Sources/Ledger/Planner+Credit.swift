import Foundation
import IAPCore

/// Crediting an upload's purchase: the planner's steps, each a function of its own.
extension Planner {
    /// Credits one purchase once per credit key; binds it to its order; applies Apple's
    /// revocations whatever came first; holds it when nothing proves whose it is or it cannot
    /// be granted as is. Says what became of it.
    mutating func credit(_ purchase: VerifiedPurchase, upload: LedgerEvent.Upload) -> (TransactionCreditState, ReasonCode?) {
        if purchase.isUpgraded == true { return (.superseded, nil) }
        var purchase = purchase
        if purchase.transactionReason == nil, boughtAnew(purchase) { purchase.transactionReason = "PURCHASE" }
        let key = policy.creditKey(of: purchase)
        applyAnswersCancellation(purchase, key: key, upload: upload)
        if facts.revocation?.creditKey == key, facts.revocation?.standsFully == true {
            // Nothing was credited: kept, so that Apple's reversal credits this upload.
            recordBlocked(purchase, key: key, upload: upload)
            return (.revoked, .purchaseRevoked)
        }
        // A period Apple told of before its subscription had an owner is recorded, not owned:
        // this upload decides whose it is, as if nothing were recorded.
        let claiming = facts.purchase?.isUnowned == true
        let exact = claiming ? nil : facts.purchase
        if let active = facts.activeGrant(of: key) {
            return creditHeld(by: active, purchase, key: key, exact: exact, upload: upload)
        }
        // Revoked by customer service (or Apple's revocation that nothing lifted): stays revoked.
        if !facts.grants(of: key).isEmpty { return (.revoked, .purchaseRevoked) }
        if let exact {
            // Held for a person (whoever uploads it): nobody is credited, nobody may finish it.
            if let held = exact.heldReason, held != .stoppedByRefund { return (.held, held) }
            if !sameUser(exact.userId, upload.userId) { return (.replayedFromOtherUser, nil) }
            if let held = exact.heldReason { return (.held, held) }
            // Recorded and credited before, under a key of an older version: nothing new.
            return (.alreadyCredited, nil)
        }
        switch decideOwner(of: purchase, key: key, upload: upload) {
        case .answered(let state, let reason):
            return (state, reason)
        case .proven(let proven):
            return creditNew(purchase, key: key, proven: proven, claiming: claiming, upload: upload)
        }
    }

    /// Apple's own answer says the purchase is refunded or revoked: remembered, and applied to
    /// a grant. A cancellation without Apple's type (`verifyReceipt` says neither a full refund
    /// nor how much) never takes back more than Apple's typed word: with one unit it is the
    /// whole purchase; with several, a prorated refund may have taken only some, so the
    /// purchase waits for the REFUND notification (or reconciliation), listed for customer
    /// service, and what Apple's typed word recorded stands.
    mutating func applyAnswersCancellation(_ purchase: VerifiedPurchase, key: CreditKey, upload: LedgerEvent.Upload) {
        guard let cancelled = purchase.cancellationDate else { return }
        let quantity = max(purchase.quantity, 1)
        guard purchase.revocationType != nil || quantity == 1 else {
            // Listed until Apple's typed word arrives; once recorded, it settles the grant.
            guard facts.revocation?.creditKey != key else { return }
            audit(
                actor: "system", action: "cancellation_untyped", subject: "transaction:\(purchase.transactionId)",
                reason: "Apple's answer dates a cancellation but not how much it took back; waiting for Apple's refund notification",
                details: [
                    "uploader": upload.userId, "productId": purchase.productId, "quantity": "\(quantity)",
                    "cancellationDate": Ledger.iso8601(cancelled), "submissionId": upload.submissionId,
                ])
            return
        }
        recordRevocation(
            key: key, transactionId: purchase.transactionId, source: "apple_answer", at: cancelled,
            units: partialUnits(purchase, quantity: quantity))
        if settle(key: key, quantity: quantity, reason: "revoked in Apple's answer", tag: "answer:\(upload.submissionId)") {
            revoked += 1
        }
    }

    /// A purchase whose credit key has an active grant (`active`): the same owner's again, a
    /// replay, or a restore by someone else, which the restore policy decides.
    mutating func creditHeld(
        by active: Grant, _ purchase: VerifiedPurchase, key: CreditKey, exact: LedgerFacts.Purchase?,
        upload: LedgerEvent.Upload
    ) -> (TransactionCreditState, ReasonCode?) {
        let owner = active.userId
        if sameUser(owner, upload.userId) {
            // Credited before without its order (its upload named none, or the receipt then
            // was older than the order's purchase): the order it was bought for is paid now.
            if active.transactionId == purchase.transactionId, active.orderId == nil, exact?.orderId == nil,
                let named = namedOrder(for: purchase, upload: upload), pays(named, purchase),
                named.productId == purchase.productId
            {
                emit(.attachOrder(orderId: named.id, transactionId: purchase.transactionId))
                payOrder(named.id, by: purchase, owner: owner)
            }
            return (.alreadyCredited, nil)
        }
        let evidence = purchase.ownershipEvidence
        // A consumable granted by hand to another user on their word (goodwill naming this
        // Apple id, with no purchase of it verified here): nobody proved it theirs yet. An
        // upload that proves it the uploader's sets word against proof, so a person decides;
        // a bare id proves nobody's, and is held as any purchase nobody owns is. Never a
        // replay the app may finish: a finished consumable leaves its buyer's receipts for
        // good. (What stays in receipts follows the restore policy below.)
        if active.source == .manual, facts.purchase == nil, key.isPerTransaction {
            guard evidence != .lookup else { return (.held, .ownerUnknown) }
            audit(
                actor: "system", action: "purchase_held", subject: "transaction:\(purchase.transactionId)",
                reason: ReasonCode.grantedByHandToAnotherUser.rawValue,
                details: [
                    "uploader": upload.userId, "grantedTo": owner, "productId": purchase.productId, "submissionId": upload.submissionId,
                ])
            return (.held, .grantedByHandToAnotherUser)
        }
        // The very transaction another user was credited with: a replay. Consumables are
        // keyed per transaction, so for them this is always the case.
        if exact.map({ !sameUser($0.userId, upload.userId) }) ?? false || active.transactionId == purchase.transactionId
            || key.isPerTransaction
        {
            return (.replayedFromOtherUser, nil)
        }
        // Only an upload Apple vouches for moves an entitlement; a lookup never does. Nor can
        // it move to a third user under a transaction id another user's grant already bears
        // (one grant per transaction): the holder keeps it, as under `keep`.
        let idTaken =
            facts.grants(of: key).first(where: { sameUser($0.userId, upload.userId) }) == nil
            && facts.grant(ofTransaction: purchase.transactionId) != nil
        switch evidence == .signedUpload && !idTaken ? policy.restore : .keep {
        case .keep:
            audit(
                actor: "system", action: "restore_kept_by_owner", subject: "transaction:\(purchase.transactionId)",
                reason: "restored by \(upload.userId); \(key) stays with \(owner)",
                details: ["owner": owner, "uploader": upload.userId, "creditKey": key.stored])
            return (.ownedByOtherUser, nil)
        case .transfer:
            transfer(active, to: upload, purchase: purchase, key: key)
            revoked += 1
            return (.credited, nil)
        }
    }

    /// Who a purchase nothing was credited for is proven to be, and what proved it.
    struct ProvenOwner {
        var owner: String
        var order: Order?
        var subscriptionOwner: String?
        var subscriptionBefore: Subscription?
        var movesSubscriptionFrom: String?
        var tokenOrderOwner: String?
    }

    /// What `decideOwner` found: an owner, or the answer the upload gets without one.
    enum OwnerDecision {
        case proven(ProvenOwner)
        case answered(TransactionCreditState, ReasonCode?)
    }

    /// Whose a purchase nothing was credited for is (`Ownership`): the token Apple carries
    /// names one of our orders, the subscription it renews has an owner, or the upload itself
    /// is Apple's word. Held, and audited, when none of them proves it.
    mutating func decideOwner(of purchase: VerifiedPurchase, key: CreditKey, upload: LedgerEvent.Upload) -> OwnerDecision {
        let evidence = purchase.ownershipEvidence
        let order = purchase.appAccountToken != nil ? facts.tokenOrder : nil
        let subscriptionBefore = facts.subscription
        var subscriptionOwner: String?
        if case .billingPeriod = key, facts.subscription != nil {
            // The owner of its stretch of the chain; nil while nobody owns that stretch.
            switch stretchOwner(of: purchase) {
            case .owner(let owner):
                subscriptionOwner = owner
            case .awaitsBuyer where !purchase.isNewPurchaseInChain && order == nil:
                // A renewal after a new purchase nobody proved yet (the same Apple ID may serve
                // several accounts of the app): it waits with it, kept for its buyer's proof.
                recordUnowned(purchase, key: key, submissionId: upload.submissionId, bundleId: upload.bundleId)
                auditHeld(purchase, reason: .buyerUnknown, upload: upload)
                return .answered(.held, .buyerUnknown)
            case .unclaimed, .awaitsBuyer:
                break
            }
        }
        if subscriptionOwner == nil, stretchOwner(of: purchase) != .awaitsBuyer,
            facts.subscription?.originalTransactionId != purchase.originalTransactionId || facts.subscription?.userId == nil,
            let continued = facts.previousChainOwner
        {
            // A migrated subscription: the new chain continues its old chain, and its owner's,
            // also when Apple told of the new chain (a renewal preference, an expiry) before
            // anything of it was credited, which left its row with no owner.
            subscriptionOwner = continued
        }
        let ownership = Ownership.Facts(
            uploader: upload.userId, evidence: evidence, tokenOrderOwner: order?.userId, subscriptionOwner: subscriptionOwner,
            newPurchaseInChain: purchase.isNewPurchaseInChain)
        var proven = ProvenOwner(
            owner: upload.userId, order: order, subscriptionOwner: subscriptionOwner, subscriptionBefore: subscriptionBefore,
            tokenOrderOwner: order?.userId)
        switch Ownership.decide(ownership, restore: policy.restore) {
        case .held(let reason):
            // Recorded nowhere but in the upload's answer: a lookup that proves nothing must not
            // make the purchase look like the uploader's to a later upload by its owner. Nor is a
            // bare id's audited: it is answered `proof_required` like any id (`FinishAdvice`), and
            // a stranger's probes must leave nothing to tell ids apart by, nor rows to keep.
            if evidence == .lookup, upload.transactionId == purchase.transactionId { return .answered(.held, reason) }
            auditHeld(purchase, reason: reason, upload: upload)
            return .answered(.held, reason)
        case .credit(let owner):
            proven.owner = owner
        case .creditMovingSubscription(let from, let to):
            proven.owner = to
            proven.movesSubscriptionFrom = from
        }
        // The upload's own order (the client's word) binds only a purchase credited to the uploader.
        if proven.order == nil, sameUser(proven.owner, upload.userId), let named = namedOrder(for: purchase, upload: upload) {
            proven.order = named
        }
        return .proven(proven)
    }

    /// Audits a purchase held for a person, with what the upload proved.
    mutating func auditHeld(_ purchase: VerifiedPurchase, reason: ReasonCode, upload: LedgerEvent.Upload) {
        audit(
            actor: "system", action: "purchase_held", subject: "transaction:\(purchase.transactionId)",
            reason: reason.rawValue,
            details: [
                "uploader": upload.userId, "productId": purchase.productId, "submissionId": upload.submissionId,
                "evidence": purchase.ownershipEvidence.rawValue,
            ])
    }

    /// Records a purchase nothing was credited for with its proven owner, then grants it
    /// (or holds it, when it cannot be granted as is) and answers the upload.
    mutating func creditNew(
        _ purchase: VerifiedPurchase, key: CreditKey, proven: ProvenOwner, claiming: Bool, upload: LedgerEvent.Upload
    ) -> (TransactionCreditState, ReasonCode?) {
        let owner = proven.owner
        let quantity = max(purchase.quantity, 1)
        let product = product(purchase.productId)
        // An assigned seat's token proves whose it is, but it pays no order (`pays`).
        let unpaidOrder = proven.order.map { pays($0, purchase) } ?? false
        var heldReason: ReasonCode?
        if policy.catalog != nil && product == nil {
            heldReason = .unknownProduct
        } else if let order = proven.order, unpaidOrder, order.productId != purchase.productId {
            heldReason = .productMismatch
        }
        let boundOrder: String? = heldReason == nil && unpaidOrder ? proven.order?.id : nil
        let row = LedgerFacts.Purchase(
            transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId,
            productId: purchase.productId, quantity: quantity, environment: purchase.environment,
            bundleId: upload.bundleId, purchaseDate: purchase.purchaseDate, userId: owner, orderId: boundOrder,
            submissionId: upload.submissionId, appAccountToken: purchase.appAccountToken,
            heldReason: heldReason, creditedAt: now, creditKey: key,
            webOrderLineItemId: purchase.webOrderLineItemId, expiresDate: purchase.expiresDate,
            ownershipType: purchase.ownershipType)
        emit(claiming ? .claimPurchase(row) : .recordPurchase(row, ifAbsent: false))
        if let heldReason {
            if product?.type == .autoRenewable {
                // Held for a person, but proven theirs: the subscription is theirs too.
                recordSubscription(of: purchase, owner: owner)
            }
            audit(
                actor: "system", action: "purchase_held", subject: "transaction:\(purchase.transactionId)",
                reason: heldReason.rawValue, details: ["userId": owner, "productId": purchase.productId])
            // Held for whoever it turns out to be: nobody is credited yet, so nobody may finish it.
            return (.held, heldReason)
        }
        if let boundOrder {
            payOrder(boundOrder, by: purchase, owner: owner)
        }
        grantNew(purchase, key: key, proven: proven, product: product, orderId: boundOrder, upload: upload)
        return answer(purchase, key: key, proven: proven, upload: upload, orderId: boundOrder)
    }

    /// Grants a recorded purchase to its proven owner, with what it changes of its subscription.
    mutating func grantNew(
        _ purchase: VerifiedPurchase, key: CreditKey, proven: ProvenOwner, product: Catalog.Product?, orderId: String?,
        upload: LedgerEvent.Upload
    ) {
        let owner = proven.owner
        // A prorated refund that arrived first took part of it back: the rest is credited.
        let refundedUnits = facts.revocation.map { $0.creditKey == key ? $0.standingUnits : 0 } ?? 0
        let units = max(max(purchase.quantity, 1) - refundedUnits, 1)
        let autoRenewable = product?.type == .autoRenewable
        let ends = autoRenewable ? replacedTiers(by: purchase, key: key) : nil
        grant(
            transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId, creditKey: key,
            userId: owner, productId: purchase.productId, orderId: orderId, quantity: units,
            grant: product?.grant(quantity: units) ?? [:], environment: purchase.environment,
            source: .apple, expiresAt: autoRenewable ? (ends?.own ?? purchase.expiresDate) : nil, periodStart: purchase.purchaseDate,
            ownership: purchase.ownershipType, terms: purchase.terms)
        if autoRenewable || (product == nil && purchase.expiresDate != nil) {
            recordSubscription(of: purchase, owner: owner)
        }
        endReplaced(ends?.others ?? [], by: purchase)
        if case .billingPeriod = key {
            // Its stretch has its owner now: the periods Apple told of meanwhile are theirs, and
            // a new purchase later than the owner's makes the subscription theirs from it on.
            claimStretch(
                of: purchase, owner: owner, upload: upload, before: proven.subscriptionBefore,
                claims: proven.subscriptionOwner == nil || purchase.isNewPurchaseInChain)
        }
        if let from = proven.movesSubscriptionFrom, !purchase.isNewPurchaseInChain, inOwnersStretch(purchase) {
            // `IAP_RESTORE=transfer`: the subscription follows who proved they hold a period.
            moveSubscription(purchase.originalTransactionId, from: from, to: owner)
        }
    }

    /// The upload's answer for a purchase just credited: the uploader's, or someone else's
    /// (audited as such).
    mutating func answer(
        _ purchase: VerifiedPurchase, key: CreditKey, proven: ProvenOwner, upload: LedgerEvent.Upload, orderId: String?
    ) -> (TransactionCreditState, ReasonCode?) {
        let owner = proven.owner
        if proven.tokenOrderOwner == nil, let subscriptionOwner = proven.subscriptionOwner, !sameUser(owner, upload.userId) {
            // A billing period of someone else's subscription: theirs, whoever uploads it.
            audit(
                actor: "system", action: "period_credited_to_subscription_owner", subject: "transaction:\(purchase.transactionId)",
                reason: "a billing period of \(subscriptionOwner)'s subscription; uploaded by \(upload.userId)",
                details: ["owner": subscriptionOwner, "uploader": upload.userId, "creditKey": key.stored])
            return (.ownedByOtherUser, nil)
        }
        if !sameUser(owner, upload.userId) {
            audit(
                actor: "system", action: "credited_to_order_owner", subject: "transaction:\(purchase.transactionId)",
                reason: "the purchase names an order of \(owner); uploaded by \(upload.userId)",
                details: ["orderId": orderId ?? ""])
            return (.replayedFromOtherUser, nil)
        }
        return (.credited, nil)
    }

    /// Whether a later period of a chain whose answer says nothing of why it was bought
    /// (`verifyReceipt` has no `transactionReason`) is a new purchase. Apple's signed word first:
    /// the ledger recorded the period awaiting its buyer, or as the purchase that began its
    /// owner's stretch of the chain (a new purchase), or as a period Apple told of otherwise (a
    /// renewal). Then by its dates against the period of its chain bought latest before it, as
    /// the answer itself lists the chain (`previousPeriodEnd`); without that, Apple's word that
    /// the chain expired before it was bought, else the chain as the ledger credited it. A
    /// period of another product that begins while that one is in force is an upgrade or a
    /// crossgrade, and one bought after that one ended is a resubscription, unless the ledger
    /// holds the chain in Apple's billing retry or grace period from a failure signed before it
    /// was bought (then it is the renewal Apple recovered). A receipt-only ledger that never
    /// hears of the retry reads a renewal recovered after the period ended as a resubscription
    /// (docs/ledger.md).
    func boughtAnew(_ purchase: VerifiedPurchase) -> Bool {
        guard purchase.transactionId != purchase.originalTransactionId, let bought = purchase.purchaseDate else { return false }
        if let row = facts.purchase, row.transactionId == purchase.transactionId {
            if row.awaitsBuyer { return true }
            if facts.subscription?.originalTransactionId == purchase.originalTransactionId,
                facts.subscription?.ownedSince == bought, facts.subscription?.userId != nil
            {
                return true
            }
            // A period Apple's notification told of, with its reason: not a new purchase.
            if row.isUnowned { return false }
        }
        let chain = facts.subscription?.originalTransactionId == purchase.originalTransactionId ? facts.subscription : nil
        // Apple's retry of the renewal that failed before it was bought (a failure Apple signed
        // later is about a later renewal).
        let retrying = chain.map {
            $0.state.isRetrying && $0.lastTransactionId != purchase.transactionId
                && ($0.stateDate ?? .distantPast) <= bought
        } ?? false
        // The answer's own listing of the chain first (a receipt holds every period of it): a
        // renewal of a resubscription follows the resubscription, whatever Apple said of the
        // chain before it.
        if let ended = purchase.previousPeriodEnd {
            if bought < ended { return purchase.previousPeriodProductId.map { $0 != purchase.productId } ?? false }
            return bought > ended && !retrying
        }
        // Apple said the chain expired before this was bought: only a purchase follows a lapse.
        if let chain, chain.state == .expired, let lapsed = chain.expiresDate, lapsed <= bought { return true }
        let earlier = facts.grants.filter {
            $0.originalTransactionId == purchase.originalTransactionId && $0.source == .apple
                && $0.transactionId != purchase.transactionId && ($0.periodStart ?? .distantFuture) < bought
        }
        let previous = earlier.max { ($0.periodStart ?? .distantPast, $0.id) < ($1.periodStart ?? .distantPast, $1.id) }
        // With no period of the chain credited before it (held for a person, refunded before
        // anyone uploaded it), the chain's own end as the ledger recorded it, when it is past.
        guard let ended = previous.map(\.expiresAt) ?? chain?.expiresDate.flatMap({ $0 < bought ? $0 : nil }) else { return false }
        if bought < ended { return previous.map { $0.productId != purchase.productId } ?? false }
        return bought > ended && !retrying
    }

    /// The uploader's own unpaid order that the upload names together with this very
    /// transaction: an explicit binding, checked like a token. An order named alone is paid
    /// after the upload's purchases are credited, only by the one purchase that can be its
    /// (`LedgerEvent.Naming`): a receipt may hold purchases made for other orders.
    func namedOrder(for purchase: VerifiedPurchase, upload: LedgerEvent.Upload) -> Order? {
        guard upload.orderId != nil, let named = facts.uploadOrder, named.state == .created, sameUser(named.userId, upload.userId),
            upload.transactionId == purchase.transactionId
        else { return nil }
        return named
    }

    /// The order is paid by `purchase`, credited to `owner`: `order.paid` for the app's services.
    mutating func payOrder(_ orderId: String, by purchase: VerifiedPurchase, owner: String) {
        payOrder(orderId, transactionId: purchase.transactionId, productId: purchase.productId, owner: owner)
    }

    /// The order is paid by transaction `transactionId` of `productId`, credited to `owner`.
    mutating func payOrder(_ orderId: String, transactionId: String, productId: String, owner: String) {
        emit(.bindOrder(orderId: orderId, transactionId: transactionId, at: now))
        publish(
            "order.paid",
            [
                "orderId": .string(orderId), "userId": .string(owner), "productId": .string(productId),
                "transactionId": .string(transactionId), "paidAt": .string(nowText),
            ], id: "order.paid:\(orderId)")
    }

    /// Whether `purchase` pays `order`: the order is unpaid, and the purchase is what it was
    /// placed for: a one-time purchase, or the first period of a subscription. Later periods
    /// (renewals, a plan change in the group) name the same order and pay nothing, whether they
    /// arrive before the first or after it.
    ///
    /// A later period pays an order only when the customer bought it (Apple's
    /// `transactionReason` PURCHASE: a resubscription after the chain lapsed, an upgrade or a
    /// crossgrade), and only an order for its product: Apple keeps the chain's
    /// `originalTransactionId` for those, so the order placed for them is paid by them.
    func pays(_ order: Order, _ purchase: VerifiedPurchase) -> Bool {
        // Access someone else paid for pays no order of ours, whichever way it arrives: an
        // assigned seat (multiseat, an organization paid) or a family member's shared access.
        guard order.state == .created, !Ledger.accessPaidByOthers(purchase.ownershipType) else { return false }
        let laterPeriod = product(purchase.productId)?.type == .autoRenewable && purchase.transactionId != purchase.originalTransactionId
        guard laterPeriod else { return true }
        return purchase.isNewPurchaseInChain && order.productId == purchase.productId
    }

    /// The units a prorated refund of a consumable took back, when it took back only some;
    /// nil when the whole purchase was taken back (a full refund, a revocation, anything but a
    /// consumable).
    func partialUnits(_ purchase: VerifiedPurchase, quantity: Int) -> Int? {
        guard purchase.revocationType == "REFUND_PRORATED", let percentage = purchase.revocationPercentage,
            product(purchase.productId)?.type == .consumable
        else { return nil }
        let units = Ledger.refundedUnits(of: quantity, percentage: percentage)
        return units < quantity ? units : nil
    }

    /// A plan change within a subscription (an upgrade): where two periods of different
    /// products overlap, the one that began later replaces the other from its start (Apple
    /// refunds the rest of the old one). Whichever of the two is credited first, the same
    /// periods end at the same dates: `own` is the new period's end when a later-begun period
    /// of the chain replaced it already, `others` the grants it replaces.
    func replacedTiers(by purchase: VerifiedPurchase, key: CreditKey) -> (own: Date?, others: [(Grant, Date)]) {
        guard let start = purchase.purchaseDate else { return (nil, []) }
        var own: Date?
        var others: [(Grant, Date)] = []
        // Revoked periods too: a refund's reversal gives back a period as the plan change left it.
        for grant in facts.grants
        where grant.originalTransactionId == purchase.originalTransactionId && grant.creditKey != key
            && grant.productId != purchase.productId
        {
            guard let begun = grant.periodStart else { continue }
            if begun < start, start < (grant.expiresAt ?? .distantFuture) {
                others.append((grant, start))
            } else if start < begun, begun < (purchase.expiresDate ?? .distantFuture) {
                own = min(own ?? begun, begun)
            }
        }
        return (own, others)
    }

    /// Ends the periods a plan change replaced (see `replacedTiers`), audited.
    mutating func endReplaced(_ replaced: [(Grant, Date)], by purchase: VerifiedPurchase) {
        for (grant, at) in replaced {
            emit(.endGrant(transactionId: grant.transactionId, at: at))
            audit(
                actor: "apple", action: "grant_upgraded", subject: "transaction:\(grant.transactionId)",
                reason: "replaced by \(purchase.productId) from \(Ledger.iso8601(at))",
                details: ["userId": grant.userId, "by": purchase.transactionId])
        }
    }

    /// `IAP_RESTORE=transfer`: the entitlement moves from its owner to the uploader of a
    /// restore: revoked for the one, granted to the other, one audit entry naming both.
    mutating func transfer(_ active: Grant, to upload: LedgerEvent.Upload, purchase: VerifiedPurchase, key: CreditKey) {
        let previous = active.userId
        revokeGrant(
            active, actor: "transfer", reason: "restored by \(upload.userId)",
            eventId: "grant.revoked:\(active.transactionId):transfer:\(upload.submissionId)", audited: false)
        if let earlier = facts.grants(of: key).first(where: { $0.userId == upload.userId }) {
            // Moving back to a user who held it before: that grant is active again.
            emit(.reactivateGrant(transactionId: earlier.transactionId))
            publish(
                "grant.created",
                [
                    "transactionId": .string(earlier.transactionId),
                    "originalTransactionId": .string(purchase.originalTransactionId), "userId": .string(upload.userId),
                    "productId": .string(earlier.productId), "orderId": .null, "quantity": .int(earlier.quantity),
                    "grant": .json(earlier.grantJSON), "environment": .string(earlier.environment),
                    "source": .string("transfer"), "grantedAt": .string(nowText),
                ], id: "grant.created:\(earlier.transactionId):transfer:\(upload.submissionId)")
        } else {
            grant(
                transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId, creditKey: key,
                userId: upload.userId, productId: purchase.productId, orderId: nil, quantity: active.quantity,
                grant: product(purchase.productId)?.grant(quantity: active.quantity) ?? [:],
                environment: purchase.environment, source: .apple, expiresAt: active.expiresAt,
                periodStart: purchase.purchaseDate)
        }
        // The restore's own transaction, unless it is recorded already.
        emit(
            .recordPurchase(
                .init(
                    transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId,
                    productId: purchase.productId, quantity: max(purchase.quantity, 1), environment: purchase.environment,
                    bundleId: upload.bundleId, purchaseDate: purchase.purchaseDate, userId: upload.userId, orderId: nil,
                    submissionId: upload.submissionId, appAccountToken: purchase.appAccountToken, heldReason: nil,
                    creditedAt: now, creditKey: key, webOrderLineItemId: purchase.webOrderLineItemId, expiresDate: nil),
                ifAbsent: true))
        audit(
            actor: "system", action: "grant_transferred", subject: "transaction:\(purchase.transactionId)",
            reason: "restored by \(upload.userId); moved from \(previous)",
            details: ["from": previous, "to": upload.userId, "creditKey": key.stored])
        if case .billingPeriod = key, inOwnersStretch(purchase) {
            // The subscription moves with its period, so that its renewals follow the new owner
            // (not for a period of an earlier stretch: the later one is someone else's).
            moveSubscription(purchase.originalTransactionId, from: previous, to: upload.userId)
        }
    }

    /// The subscription's owner becomes `to` (`IAP_RESTORE=transfer`, or a new purchase in the
    /// chain that `to` proved); audited.
    /// A new purchase passes `boughtAt`, its purchase date: the new owner's stretch begins there
    /// (`ownedSince`). Audited only when the owner changes.
    mutating func moveSubscription(_ originalTransactionId: String, from: String, to: String, boughtAt: Date? = nil) {
        let newPurchase = boughtAt != nil
        if var subscription = facts.subscription, subscription.originalTransactionId == originalTransactionId {
            subscription.userId = to
            if newPurchase { subscription.ownedSince = boughtAt }
            subscription.updatedAt = now
            emit(.putSubscription(subscription))
        }
        guard !sameUser(from, to) else { return }
        audit(
            actor: "system", action: "subscription_transferred", subject: "subscription:\(originalTransactionId)",
            reason: newPurchase ? "bought again by \(to); moved from \(from)" : "restored by \(to); moved from \(from)",
            details: ["from": from, "to": to])
    }

    /// A new grant and its `grant.created` event.
    mutating func grant(
        transactionId: String, originalTransactionId: String, creditKey: CreditKey, userId: String, productId: String,
        orderId: String?, quantity: Int, grant: [String: Catalog.GrantValue], environment: AppStoreEnvironment,
        source: GrantSource, expiresAt: Date?, periodStart: Date? = nil, ownership: String? = nil, terms: PurchaseTerms? = nil
    ) {
        let grantJSON = Ledger.grantJSON(grant)
        var fields: [String: EventField] = [
            "transactionId": .string(transactionId), "originalTransactionId": .string(originalTransactionId),
            "userId": .string(userId), "productId": .string(productId), "orderId": orderId.map(EventField.string) ?? .null,
            "quantity": .int(quantity), "grant": .json(grantJSON), "environment": .string(environment.rawValue),
            "source": .string(source.rawValue), "grantedAt": .string(nowText),
        ]
        // Access an organization paid for (multiseat) or a family member shares: not a payment
        // of this user's, which the app's revenue must not count.
        if let ownership, ownership != "PURCHASED" { fields["ownership"] = .string(ownership) }
        if let terms {
            // What the customer paid and under which offer, for the app's revenue: as Apple signed it.
            if let price = terms.price { fields["price"] = .int(Int(price)) }
            if let currency = terms.currency { fields["currency"] = .string(currency) }
            if let offerType = terms.offerType { fields["offerType"] = .int(offerType) }
            if let offer = terms.offerIdentifier { fields["offerIdentifier"] = .string(offer) }
            if let discount = terms.offerDiscountType { fields["offerDiscountType"] = .string(discount) }
            if let period = terms.offerPeriod { fields["offerPeriod"] = .string(period) }
            if let plan = terms.billingPlanType { fields["billingPlanType"] = .string(plan) }
            if let commitment = terms.commitment {
                // A commitment plan: this period's place in it, its end and its whole price.
                if let number = commitment.billingPeriodNumber { fields["commitmentBillingPeriod"] = .int(number) }
                if let total = commitment.totalBillingPeriods { fields["commitmentTotalPeriods"] = .int(total) }
                if let ends = commitment.commitmentExpiresDate { fields["commitmentExpiresDate"] = .string(Ledger.iso8601(ends)) }
                if let price = commitment.commitmentPrice { fields["commitmentPrice"] = .int(Int(price)) }
            }
            emit(.recordTerms(transactionId: transactionId, terms))
        }
        emit(
            .grant(
                .init(
                    id: 0, transactionId: transactionId, userId: userId, productId: productId, orderId: orderId,
                    quantity: quantity, grantJSON: grantJSON, environment: environment.rawValue, source: source,
                    isActive: true, grantedAt: now, revokedAt: nil, revokedBy: nil, creditKey: creditKey,
                    originalTransactionId: originalTransactionId, expiresAt: expiresAt, gracePeriodExpiresAt: nil,
                    periodStart: periodStart)))
        publish("grant.created", fields, id: "grant.created:\(transactionId)")
    }

    /// Records an auto-renewable subscription credited through any route: its owner (the
    /// first one credited), product, expiry and state, unless a state Apple signed later is
    /// recorded.
    mutating func recordSubscription(of purchase: VerifiedPurchase, owner: String) {
        // When the period's state began: its purchase date, or when Apple signed it if that is
        // earlier. A transaction's signature may be much later than its period (signed anew on
        // the device, or read from Apple's history) and must not outrank what Apple said since.
        let dates = [purchase.purchaseDate, purchase.signedDate].compactMap { $0 }
        let stateDate = dates.min() ?? now
        let state: SubscriptionState = (purchase.expiresDate ?? .distantFuture) > now ? .active : .expired
        updateSubscription(
            purchase, owner: owner, environment: purchase.environment.rawValue, state: state, autoRenew: nil,
            grace: .keep, stateDate: stateDate)
    }

    /// What becomes of the subscription's grace period end when a state is recorded.
    enum GraceUpdate {
        case keep
        case set(Date?)
    }

    /// The subscription with `state` recorded, when Apple signed it no earlier than the one
    /// recorded (between two periods of one product in force, when it is the later period);
    /// its owner stays whoever was credited first. Ties in `stateDate` are settled by the
    /// later period end, then the transaction id, then the state, so every order service and
    /// every arrival order come to the same row.
    mutating func updateSubscription(
        _ purchase: VerifiedPurchase, owner: String?, environment: String, state: SubscriptionState, autoRenew: Bool?,
        renewal: RenewalTerms? = nil, grace: GraceUpdate, stateDate: Date
    ) {
        let current = facts.subscription?.originalTransactionId == purchase.originalTransactionId ? facts.subscription : nil
        var row =
            current
            ?? Subscription(
                originalTransactionId: purchase.originalTransactionId, userId: owner, productId: purchase.productId,
                environment: environment, state: state, expiresDate: purchase.expiresDate, autoRenew: autoRenew,
                gracePeriodExpiresDate: nil, lastTransactionId: purchase.transactionId, updatedAt: now, stateDate: stateDate,
                renewal: renewal)
        if current != nil {
            row.userId = row.userId ?? owner
            let incoming = (stateDate, purchase.expiresDate ?? .distantPast, purchase.transactionId, Self.stateRank(state))
            let recorded = (
                row.stateDate ?? .distantPast, row.expiresDate ?? .distantPast, row.lastTransactionId, Self.stateRank(row.state)
            )
            // Between two periods of the same product in force, the later period is the newer
            // state whenever each was signed: an older period is often read late (found by a
            // history read, or its transaction signed anew and uploaded now), with a signature
            // newer than the state it would replace. It is credited, and the subscription stays
            // as the later period left it, in either arrival order.
            let inForce = Self.stateRank(state) == 0 && purchase.productId == row.productId
            let incomingEnd = purchase.expiresDate ?? .distantFuture, recordedEnd = row.expiresDate ?? .distantPast
            let olderPeriod = inForce && incomingEnd < recordedEnd
            let newerPeriod = inForce && Self.stateRank(row.state) == 0 && incomingEnd > recordedEnd
            if row.stateDate == nil || newerPeriod || (!(incoming < recorded) && !olderPeriod) {
                row.productId = purchase.productId
                row.environment = environment
                row.state = state
                row.expiresDate = purchase.expiresDate ?? row.expiresDate
                row.autoRenew = autoRenew ?? row.autoRenew
                row.lastTransactionId = purchase.transactionId
                row.stateDate = stateDate
                // What it renews to, as Apple signed it last (a notification without renewal
                // information leaves it).
                row.renewal = renewal ?? row.renewal
                if case .set(let end) = grace { row.gracePeriodExpiresDate = end }
            }
            row.updatedAt = now
        } else if case .set(let end) = grace {
            row.gracePeriodExpiresDate = end
        }
        emit(.putSubscription(row))
    }

    /// Ranks states for ties in Apple's date: an ending outranks a lapse, a lapse outranks
    /// being in force.
    static func stateRank(_ state: SubscriptionState) -> Int {
        switch state {
        case .revoked: 4
        case .expired: 3
        case .billingRetry: 2
        case .gracePeriod: 1
        case .active: 0
        }
    }
}
