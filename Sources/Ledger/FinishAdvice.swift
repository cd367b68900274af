public import IAPCore

/// What the app may `finishTransaction`: only what is settled.
///
/// A transaction is settled when it is credited (by this upload or before), belongs to
/// another user who was credited with it, was revoked or refunded by Apple, or was replaced by
/// an upgrade; a held one is not. An upload's own answer speaks of the transaction or order it
/// names; an upload that names neither (a receipt sent on its own) gets advice per transaction
/// only, because the receipt may be older than the purchase the app is holding.
public enum FinishAdvice {
    /// What an upload named, as the status answer's top-level advice speaks of it.
    public enum Named: Sendable, Equatable {
        /// A transaction: the one named, the one signed transaction uploaded, or the bare id.
        case transaction
        /// One of our orders, without a transaction.
        case order
        /// Nothing: a receipt on its own.
        case nothing
    }

    /// Whether the app may finish a transaction this upload left in `state`.
    public static func mayFinish(_ state: TransactionCreditState) -> Bool {
        switch state {
        case .credited, .alreadyCredited, .replayedFromOtherUser, .ownedByOtherUser, .revoked, .cancelled, .superseded:
            true
        case .held:
            false
        }
    }

    /// Why an upload whose receipt does not hold the transaction it names is rejected, from
    /// Apple's refunds and revocations of that transaction (of its own id, or of its credit key
    /// once credited): refunded in full, it is `purchase_revoked` and settled, because Apple's
    /// `verifyReceipt` leaves such a purchase out of every receipt and refreshing would never
    /// help; otherwise the receipt may be older than the purchase, and the app refreshes it and
    /// uploads again (`transaction_not_in_receipt`, not finishable).
    public static func namedTransactionMissing(revocations: [LedgerFacts.Revocation]) -> ReasonCode {
        revocations.contains(where: \.standsFully) ? .purchaseRevoked : .transactionNotInReceipt
    }

    /// Whether the app may finish the transaction the upload names (the answer's top-level
    /// `finishTransaction`): customer service settled it; or the upload names a transaction or
    /// an order and is credited, or rejected for a reason that settles it (Apple said it is
    /// invalid, unknown or refunded; it is another user's; it is not real money; the signed
    /// data cannot be Apple's). Never while work is pending or a person has to look, and never
    /// for an upload that names nothing.
    public static func mayFinishUpload(
        state: SubmissionState, reason: ReasonCode?, named: Named, settledByHand: Bool
    ) -> Bool {
        if settledByHand { return true }
        if named == .nothing { return false }
        switch state {
        // Credited, but the upload named an order alone whose purchase carries no token: the
        // app names the transaction it holds before it is told to finish it.
        case .credited: return reason != .nameTheTransaction
        case .rejected: return reason.map(ReasonCode.finishableRejections.contains) ?? false
        case .pending, .retrying, .needsReview: return false
        }
    }
}

/// What an upload amounts to, decided by the core from what became of each purchase in it:
/// the submission's state, its reason and a message for people. The top-level
/// `finishTransaction` follows from it (`FinishAdvice.mayFinishUpload`).
public struct UploadVerdict: Sendable, Equatable {
    public var state: SubmissionState
    public var reason: ReasonCode?
    public var message: String?
    /// Whether the status answer lists the upload's transactions: not for a lookup that
    /// proved nothing, which must not tell a stranger what the id is.
    public var listsTransactions: Bool

    /// Creates a verdict.
    public init(state: SubmissionState, reason: ReasonCode? = nil, message: String? = nil, listsTransactions: Bool = true) {
        self.state = state
        self.reason = reason
        self.message = message
        self.listsTransactions = listsTransactions
    }
}

extension FinishAdvice {
    /// What became of one purchase of an upload (`Ledger.plan`'s outcome for it).
    public struct PurchaseOutcome: Sendable, Equatable {
        public var transactionId: String
        public var state: TransactionCreditState
        public var reason: ReasonCode?
        /// Whether the upload only looked the purchase up (a bare id): it proves nothing.
        public var lookup: Bool
        /// Apple's original transaction id and product of the purchase.
        public var originalTransactionId: String?
        public var productId: String?
        /// Whether it stays in every later receipt once finished (a non-consumable or a
        /// subscription period; a finished consumable leaves them).
        public var staysInReceipts: Bool

        /// Creates an outcome.
        public init(
            transactionId: String, state: TransactionCreditState, reason: ReasonCode?, lookup: Bool = false,
            originalTransactionId: String? = nil, productId: String? = nil, staysInReceipts: Bool = false
        ) {
            self.transactionId = transactionId
            self.state = state
            self.reason = reason
            self.lookup = lookup
            self.originalTransactionId = originalTransactionId
            self.productId = productId
            self.staysInReceipts = staysInReceipts
        }
    }

    /// What a StoreKit 1 upload says the transaction it names stands for, when its id is not the
    /// receipt's (a restore: `SKPaymentTransaction.original`): the original transaction and
    /// the product.
    public struct NamedOriginal: Sendable, Equatable {
        public var originalTransactionId: String
        public var productId: String?

        /// Creates the pair.
        public init(originalTransactionId: String, productId: String?) {
            self.originalTransactionId = originalTransactionId
            self.productId = productId
        }
    }

    /// The purchase in `outcomes` that a named transaction missing from the receipt stands for:
    /// one of the original transaction and product the upload named (never the named id itself),
    /// of a product that stays in every later receipt. Nil for a consumable: a consumable the
    /// receipt lacks is a purchase not in it yet, and finishing it would lose it.
    static func standIn(for named: String, original: NamedOriginal?, in outcomes: [PurchaseOutcome]) -> PurchaseOutcome? {
        guard let original, original.originalTransactionId != named else { return nil }
        return outcomes.first {
            $0.staysInReceipts && $0.originalTransactionId == original.originalTransactionId
                && (original.productId == nil || $0.productId == original.productId)
        }
    }

    /// The rows the verdict of an upload needs once its purchases are planned: Apple's
    /// revocations of the transaction it names when the receipt lacks it, and the order it names.
    public struct VerdictQuery: Sendable, Equatable {
        /// Read Apple's revocations of this transaction (`FinishAdvice.namedTransactionMissing`).
        public var revocationsOf: String?
        /// Read this order, as the plans left it.
        public var order: String?
    }

    /// What `verdict` needs read, for an upload naming `transactionId` and `orderId` whose
    /// purchases came to `outcomes`.
    public static func verdictQuery(transactionId: String?, orderId: String?, outcomes: [PurchaseOutcome]) -> VerdictQuery {
        var query = VerdictQuery()
        if let transactionId, !outcomes.contains(where: { $0.transactionId == transactionId }) {
            query.revocationsOf = transactionId
        }
        if transactionId == nil { query.order = orderId }
        return query
    }

    /// The verdict of an upload that Apple verified.
    ///
    /// - `userId`, `transactionId`, `orderId`: who uploaded it and what it named.
    /// - `outcomes`: what became of each purchase in it, in receipt order.
    /// - `namedRevocations`, `namedOrder`: the rows `verdictQuery` asked for.
    ///
    /// An upload naming an order (and no transaction) is credited only once that order is
    /// paid, which only the purchase made for it does (`Ledger`): a receipt that does not hold
    /// that purchase yet is never an answer the app may finish on, whatever else it credited.
    /// A named StoreKit 1 transaction the receipt lacks, where the receipt holds the purchase it
    /// stands for (`namedOriginal`: its original transaction and product, a non-consumable or a
    /// subscription), is settled as that purchase is: `credited` with
    /// `original_transaction_settled` when it is the uploader's, else the reason it is not.
    public static func verdict(
        userId: String, transactionId: String?, orderId: String?, outcomes: [PurchaseOutcome],
        namedRevocations: [LedgerFacts.Revocation], namedOrder: Order?, namedOriginal: NamedOriginal? = nil,
        naming: NamingOutcome = .nothing
    ) -> UploadVerdict {
        // What the upload names comes first: a purchase held elsewhere in the receipt is
        // listed with its own advice, and never keeps the app from what its named transaction
        // or order already says.
        let missing = transactionId.flatMap { named in outcomes.contains { $0.transactionId == named } ? nil : named }
        if let missing, case .fromLedger(let state) = naming {
            return creditedBefore(missing, state: state)
        }
        if transactionId == nil, let orderId, let order = namedOrder, IAPCore.sameUser(order.userId, userId),
            naming != .orderTokenInUpload, let answer = orderNamedAlone(orderId, order: order, naming: naming)
        {
            return answer
        }
        let settledForUploader = outcomes.contains { [.credited, .alreadyCredited, .superseded].contains($0.state) }
        if !outcomes.isEmpty, outcomes.allSatisfy(\.lookup), !settledForUploader {
            // A bare id that is not the uploader's: someone else's, refunded, unknown or a
            // purchase nobody proved yet read alike, so that a lookup tells a stranger nothing
            // about the id and opens no case. Never finishable: the app may hold it unproven.
            return lookupProvesNothing
        }
        if let held = outcomes.first(where: { $0.state == .held }) {
            let reason = held.reason ?? .ownerUnknown
            return UploadVerdict(
                state: .needsReview, reason: reason, message: "purchase \(held.transactionId) is held for review (\(reason))")
        }
        if let missing {
            return standIn(for: missing, original: namedOriginal, in: outcomes).flatMap { standInVerdict(missing, standIn: $0) }
                ?? namedMissingVerdict(missing, revocations: namedRevocations)
        }
        if transactionId == nil, let orderId, let answer = orderVerdict(orderId, order: namedOrder, userId: userId) {
            return answer
        }
        guard !outcomes.isEmpty, !settledForUploader else { return UploadVerdict(state: .credited) }
        return strongestRefusal(outcomes)
    }

    /// A named transaction the receipt lacks that the ledger credited to this user before: the
    /// ledger is the memory, not the receipt (a finished consumable leaves every later receipt).
    static func creditedBefore(_ named: String, state: TransactionCreditState) -> UploadVerdict {
        if state == .revoked {
            return UploadVerdict(
                state: .rejected, reason: .purchaseRevoked,
                message: "transaction \(named) was credited to this user and taken back since")
        }
        if state == .replayedFromOtherUser {
            return UploadVerdict(
                state: .rejected, reason: .replayedFromOtherUser,
                message: "transaction \(named) is not in this receipt; it is credited to another user of the app")
        }
        return UploadVerdict(
            state: .credited, message: "transaction \(named) is not in this receipt; it was credited to this user before")
    }

    /// An order of the uploader's named alone, and no purchase of the upload carries its
    /// token: which transaction the app holds for it only the app knows, so no answer about it
    /// is finishable (never on a match of dates, nor on what other purchases came to). The app
    /// names the transaction it holds to be told to finish. Nil while no purchase pays it yet
    /// (held for review, or a receipt older than its purchase: answered later).
    static func orderNamedAlone(_ orderId: String, order: Order, naming: NamingOutcome) -> UploadVerdict? {
        switch order.state {
        case .created where naming == .orderAmbiguous:
            return UploadVerdict(
                state: .rejected, reason: .nameTheTransaction,
                message: "more than one purchase or order of \(order.productId) could be order \(orderId)'s: "
                    + "upload again naming the transaction the app holds for it")
        case .created:
            return nil
        case .paid:
            // Paid by the purchase made for it (the one that can be its, or one named or
            // carrying its token before).
            return UploadVerdict(
                state: .credited, reason: .nameTheTransaction,
                message: "order \(orderId) is paid by transaction \(order.transactionId ?? "?"): "
                    + "upload again naming the transaction the app holds with the order to be told to finish it")
        case .cancelled, .refunded:
            return UploadVerdict(
                state: .rejected, reason: .nameTheTransaction,
                message: "order \(orderId) is \(order.state.rawValue): upload again naming the transaction the app holds for it")
        }
    }

    /// A named transaction the receipt lacks, settled as the purchase it stands for is; nil
    /// when that one is held (answered as held).
    static func standInVerdict(_ named: String, standIn: PurchaseOutcome) -> UploadVerdict? {
        let what = "transaction \(named) is not in this receipt, but the purchase it stands for (\(standIn.transactionId))"
        switch standIn.state {
        case .credited, .alreadyCredited, .superseded:
            return UploadVerdict(state: .credited, reason: .originalTransactionSettled, message: "\(what) is credited to this user")
        case .replayedFromOtherUser, .ownedByOtherUser:
            return UploadVerdict(state: .rejected, reason: .ownedByOtherUser, message: "\(what) belongs to another user")
        case .revoked, .cancelled:
            return UploadVerdict(state: .rejected, reason: .purchaseRevoked, message: "\(what) was refunded or revoked by Apple")
        case .held:
            return nil
        }
    }

    /// A named transaction the receipt lacks, with nothing standing for it: whatever else the
    /// receipt held is credited; the named purchase is not here.
    static func namedMissingVerdict(_ named: String, revocations: [LedgerFacts.Revocation]) -> UploadVerdict {
        let missing = namedTransactionMissing(revocations: revocations)
        return UploadVerdict(
            state: .rejected, reason: missing,
            message: missing == .purchaseRevoked
                ? "Apple refunded or revoked transaction \(named): it is left out of every receipt"
                : "transaction \(named) is not in this receipt yet: refresh the receipt and upload it again")
    }

    /// An order named alone, after its purchases were settled; nil when the purchases' own
    /// advice answers.
    static func orderVerdict(_ orderId: String, order: Order?, userId: String) -> UploadVerdict? {
        // An order that is not the uploader's says nothing of the purchase the app holds:
        // only each transaction's own advice does.
        guard let order, IAPCore.sameUser(order.userId, userId) else {
            return UploadVerdict(
                state: .rejected, reason: .orderUnknown,
                message: "order \(orderId) is not one of this user's orders: finish each transaction by its own advice")
        }
        if order.state == .created {
            // The order named is still unpaid: the receipt is older than its purchase,
            // whatever else it credited.
            return UploadVerdict(
                state: .rejected, reason: .transactionNotInReceipt,
                message: "no purchase in this receipt pays order \(orderId) yet: refresh the receipt and upload it again")
        }
        // Paid by the purchase made for it, credited to the uploader: what the app holds.
        return order.state == .paid ? UploadVerdict(state: .credited) : nil
    }

    /// Nothing in the upload is (or was) credited to the uploader: the strongest why.
    static func strongestRefusal(_ outcomes: [PurchaseOutcome]) -> UploadVerdict {
        if outcomes.contains(where: { $0.state == .replayedFromOtherUser }) {
            return UploadVerdict(
                state: .rejected, reason: .replayedFromOtherUser, message: "every purchase in this receipt belongs to another user")
        }
        if outcomes.contains(where: { $0.state == .ownedByOtherUser }) {
            return UploadVerdict(
                state: .rejected, reason: .ownedByOtherUser, message: "what this restores belongs to another user of the app")
        }
        return UploadVerdict(state: .rejected, reason: .purchaseRevoked, message: "Apple refunded or revoked this purchase")
    }
}

extension FinishAdvice {
    /// The answer to every bare id that proves nothing, whatever Apple knows of it: the same
    /// state, reason and message, nothing listed, never finishable (`proof_required`).
    public static let lookupProvesNothing = UploadVerdict(
        state: .rejected, reason: .proofRequired,
        message: "a transaction id alone proves nothing: upload the signed transaction or the receipt that holds it",
        listsTransactions: false)

    /// The verdict of an upload Apple's answer (or our check of it) refused: as said, except
    /// that a bare id Apple does not know reads as any lookup that proves nothing, so that it
    /// cannot be told from a stranger's genuine one.
    public static func rejection(_ reason: ReasonCode, message: String, lookup: Bool) -> UploadVerdict {
        if lookup, reason == .transactionNotFound { return lookupProvesNothing }
        return UploadVerdict(state: .rejected, reason: reason, message: message)
    }
}

extension LedgerPolicy {
    /// Whether a finished purchase of `productId` stays in every later receipt: a
    /// non-consumable or a subscription of the catalog. A consumable leaves them, and a product
    /// the catalog does not know is taken for one.
    public func staysInReceipts(_ productId: String) -> Bool {
        catalog?.product(productId).map { $0.type != .consumable } ?? false
    }
}
