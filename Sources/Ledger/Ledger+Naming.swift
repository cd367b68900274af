public import Foundation
public import IAPCore

extension LedgerEvent {
    /// What an upload named that its purchases did not settle by themselves, planned after
    /// each of them was credited: an order named without a transaction, or a transaction its
    /// receipt lacks. Only the app knows which transaction it holds for which order; the
    /// ledger pays an order from what it can tell, never from a guess.
    public struct Naming: Sendable, Equatable {
        /// The uploader.
        public var userId: String
        public var submissionId: String
        /// The order the upload names.
        public var orderId: String?
        /// The transaction the upload names, when its receipt does not hold it.
        public var missingTransactionId: String?
        /// Whether a purchase of the upload carries the named order's token.
        public var tokenNamesOrder = false
        /// The transactions the upload's receipt (or signed transaction) holds.
        public var inUpload: Set<String> = []

        /// Creates a naming.
        public init(userId: String, submissionId: String, orderId: String?, missingTransactionId: String?) {
            self.userId = userId
            self.submissionId = submissionId
            self.orderId = orderId
            self.missingTransactionId = missingTransactionId
        }

        /// Whether there is anything to plan: an order named alone, or a named transaction the
        /// receipt lacks.
        public var isNeeded: Bool { orderId != nil || missingTransactionId != nil }
    }
}

/// What an upload's naming came to (`LedgerEvent.Naming`).
public enum NamingOutcome: Sendable, Equatable {
    /// Nothing to say beyond the purchases' own outcomes.
    case nothing
    /// A purchase of the upload carries the order named alone's token: that purchase is the
    /// order's, and its own outcome answers (the only case in which an order named alone may be
    /// finished on at the top).
    case orderTokenInUpload
    /// The order named alone is paid (by this upload or before) by the one purchase that can be
    /// its.
    case orderPaid(transactionId: String)
    /// No purchase the ledger holds can pay the order named alone yet: the receipt is older
    /// than its purchase.
    case orderUnpaid
    /// Purchases or orders the ledger holds could each be the order's: which one the app holds
    /// only the app knows, so it names it.
    case orderAmbiguous
    /// The named transaction, missing from the receipt, as the ledger holds it: credited to the
    /// uploader (an order named with it is paid by it when it can be), taken back, or credited
    /// to another account of the app.
    case fromLedger(TransactionCreditState)
}

extension LedgerPolicy {
    /// How far our clock may run ahead of Apple's: a purchase Apple dates up to this long
    /// before an order was created may still have been made for it. Small on purpose: the
    /// purchase sheet takes seconds after the order is placed, and a wider window lets a
    /// purchase made before the order (for nothing, or for an order refunded since) pass for
    /// its purchase.
    public static let clockSkewAllowed: TimeInterval = 5
}

extension Ledger {
    /// Which purchase pays an order the upload named alone, from the purchases the ledger holds
    /// for its user (`LedgerFacts.orderCandidates`) and the user's open orders of its product
    /// (`LedgerFacts.openOrders`): one that can only be this order's, or none.
    ///
    /// A purchase can be an order's when it is of the order's product, bought (Apple's
    /// `purchaseDate`) at or after the order was created (less `clockSkewAllowed`), carrying no
    /// token and no other order's yet. The order is paid only when exactly one purchase can be
    /// its, the upload holds it (`inUpload`: the app's own device's receipt), and no other open
    /// order of the user could be paid by it; and only when that purchase pays orders at all
    /// (granted, not access someone else paid for, not a renewal). Several, or one credited
    /// from another upload (a consumable finished since, an account sharing the Apple ID), is
    /// `orderAmbiguous`: the app names the transaction it holds.
    public static func orderPurchase(
        for order: Order, inUpload: Set<String>, facts: LedgerFacts, policy: LedgerPolicy
    ) -> NamingOutcome {
        let earliest = order.createdAt.addingTimeInterval(-LedgerPolicy.clockSkewAllowed)
        let candidates = facts.orderCandidates.filter {
            $0.orderId == nil && $0.productId == order.productId && ($0.purchaseDate.map { $0 >= earliest } ?? false)
        }
        guard let only = candidates.first else { return .orderUnpaid }
        // Only a purchase the upload itself holds (its device's receipt) may be taken for the
        // one the app holds; one the ledger credited from another upload is for the app to name.
        guard candidates.count == 1, inUpload.contains(only.transactionId), let bought = only.purchaseDate else {
            return .orderAmbiguous
        }
        let rivals = facts.openOrders.filter {
            $0.id != order.id && $0.productId == order.productId
                && $0.createdAt.addingTimeInterval(-LedgerPolicy.clockSkewAllowed) <= bought
        }
        guard rivals.isEmpty, only.pays(policy: policy) else { return .orderAmbiguous }
        return .orderPaid(transactionId: only.transactionId)
    }
}

extension LedgerFacts.OrderCandidate {
    /// Whether this purchase pays an order at all: granted and in force, not access someone
    /// else paid for (an assigned seat, a family member's sharing), and not a later period of a subscription (the
    /// ledger cannot tell a resubscription from a renewal by its row: the app names it).
    func pays(policy: LedgerPolicy) -> Bool {
        guard granted, !Ledger.accessPaidByOthers(ownershipType) else { return false }
        if policy.catalog?.product(productId)?.type == .autoRenewable { return transactionId == originalTransactionId }
        return true
    }
}

extension Planner {
    /// Plans what an upload named that its purchases did not settle (`LedgerEvent.Naming`).
    mutating func plan(_ naming: LedgerEvent.Naming) -> NamingOutcome {
        if let missing = naming.missingTransactionId {
            return fromLedger(missing, naming: naming)
        }
        guard let orderId = naming.orderId, let order = facts.uploadOrder, sameUser(order.userId, naming.userId) else {
            return .nothing
        }
        // A purchase of the upload carries the order's token: that purchase is the order's, and
        // its own outcome (paid, held for a person) is the answer.
        if naming.tokenNamesOrder { return .orderTokenInUpload }
        guard order.state == .created else {
            return order.transactionId.map { .orderPaid(transactionId: $0) } ?? .nothing
        }
        let outcome = Ledger.orderPurchase(for: order, inUpload: naming.inUpload, facts: facts, policy: policy)
        if case .orderPaid(let transactionId) = outcome,
            let candidate = facts.orderCandidates.first(where: { $0.transactionId == transactionId })
        {
            pay(orderId, by: candidate, owner: order.userId)
        }
        return outcome
    }

    /// The named transaction the receipt lacks, as the ledger holds it: the receipt is not the
    /// memory. Credited to the uploader, it settles the upload (a finished consumable leaves
    /// every later receipt, so refreshing would never bring it back), and pays the order named
    /// with it when it can; taken back, it is settled as refunded.
    mutating func fromLedger(_ transactionId: String, naming: LedgerEvent.Naming) -> NamingOutcome {
        guard let row = facts.purchase, row.transactionId == transactionId, row.heldReason == nil,
            let grant = facts.grant(ofTransaction: transactionId), sameUser(grant.userId, row.userId)
        else { return .nothing }
        guard sameUser(row.userId, naming.userId) else {
            // Credited to another account of the app (the same Apple ID's other user uploaded it
            // first), or taken back from it since: settled, and the app that holds it finishes
            // it; never the uploader's.
            return .fromLedger(grant.isActive ? .replayedFromOtherUser : .revoked)
        }
        guard grant.isActive else { return .fromLedger(.revoked) }
        if naming.orderId != nil, row.orderId == nil, let order = facts.uploadOrder, order.state == .created,
            sameUser(order.userId, naming.userId), order.productId == row.productId
        {
            let candidate = LedgerFacts.OrderCandidate(
                transactionId: row.transactionId, originalTransactionId: row.originalTransactionId,
                productId: row.productId, purchaseDate: row.purchaseDate, orderId: nil, granted: true,
                ownershipType: row.ownershipType)
            if candidate.pays(policy: policy) { pay(order.id, by: candidate, owner: row.userId) }
        }
        return .fromLedger(.alreadyCredited)
    }

    /// The order is paid by a purchase the ledger credited before without it: the purchase,
    /// its grant and the order are bound (`order.paid`).
    mutating func pay(_ orderId: String, by candidate: LedgerFacts.OrderCandidate, owner: String) {
        emit(.attachOrder(orderId: orderId, transactionId: candidate.transactionId))
        payOrder(orderId, transactionId: candidate.transactionId, productId: candidate.productId, owner: owner)
    }
}
