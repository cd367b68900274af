import IAPCore

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
        case .credited: return true
        case .rejected: return reason.map(ReasonCode.finishableRejections.contains) ?? false
        case .pending, .retrying, .needsReview: return false
        }
    }
}
