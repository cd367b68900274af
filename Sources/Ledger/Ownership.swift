public import IAPCore

/// Whose a purchase is, decided before anything of it is credited.
///
/// Ownership is proved, never claimed. The proofs, strongest first: an `appAccountToken`
/// (signed by Apple into the purchase) naming one of our orders makes the purchase that
/// order's owner's, whoever uploads it; a billing period of a subscription that already has an
/// owner is that owner's; otherwise only an upload Apple vouches for (a verified signed
/// transaction, Apple's answer about the uploaded receipt) makes it the uploader's. A lookup (a
/// bare transaction id, a receipt read without its signature checked) proves nothing: the
/// purchase is held for customer service. A new purchase in a chain (a resubscription, an
/// upgrade) is not a renewal: it is the uploader's when their upload proves it.
public enum Ownership {
    /// The facts one decision reads, from the purchase, the upload and the store.
    public struct Facts: Sendable, Equatable {
        /// The user whose upload carried the purchase.
        public var uploader: String
        /// What the upload proves about the purchase.
        public var evidence: OwnershipEvidence
        /// The owner of the order the purchase's `appAccountToken` names, if it names one.
        public var tokenOrderOwner: String?
        /// For a billing period of an auto-renewable subscription: the subscription's owner,
        /// when any route credited it before.
        public var subscriptionOwner: String?
        /// The period is a new purchase in its chain (a resubscription, an upgrade, a
        /// crossgrade: Apple's `transactionReason` PURCHASE on a later transaction), not a
        /// renewal or a restore of one.
        public var newPurchaseInChain: Bool

        /// Creates the facts of one decision.
        public init(
            uploader: String, evidence: OwnershipEvidence, tokenOrderOwner: String? = nil, subscriptionOwner: String? = nil,
            newPurchaseInChain: Bool = false
        ) {
            self.uploader = uploader
            self.evidence = evidence
            self.tokenOrderOwner = tokenOrderOwner
            self.subscriptionOwner = subscriptionOwner
            self.newPurchaseInChain = newPurchaseInChain
        }
    }

    /// What to do with a purchase that nobody holds a grant of yet.
    public enum Decision: Sendable, Equatable {
        /// Credit it to `owner` (the uploader, or the proven owner when that is someone else).
        case credit(owner: String)
        /// The uploader proved they hold a period of another owner's subscription: a new
        /// purchase they made in its chain (a resubscription, an upgrade), or, under
        /// `IAP_RESTORE=transfer`, any period. The period is credited to them and the
        /// subscription, with its later renewals, moves with it; earlier periods stay.
        case creditMovingSubscription(from: String, to: String)
        /// Nothing proves whose it is: held for customer service, not finishable.
        case held(ReasonCode)
    }

    /// Decides whose a purchase is; see the type's comment for the rules.
    public static func decide(_ facts: Facts, restore: RestorePolicy) -> Decision {
        if let owner = facts.tokenOrderOwner { return .credit(owner: owner) }
        if let owner = facts.subscriptionOwner {
            if facts.newPurchaseInChain {
                // A new purchase is its buyer's, who need not be the subscription's owner (the
                // same Apple ID may serve several accounts of the app): only Apple's word about
                // the upload says who that is; a bare id is held like any lookup.
                guard facts.evidence == .signedUpload else { return .held(.ownerUnknown) }
                if IAPCore.sameUser(owner, facts.uploader) { return .credit(owner: owner) }
                return .creditMovingSubscription(from: owner, to: facts.uploader)
            }
            if IAPCore.sameUser(owner, facts.uploader) { return .credit(owner: owner) }
            // Renewals and restores follow the owner, unless `transfer` moves them to whoever
            // proves they hold one.
            if restore == .transfer, facts.evidence == .signedUpload {
                return .creditMovingSubscription(from: owner, to: facts.uploader)
            }
            // Every billing period belongs to the subscription's owner, whoever uploads it.
            return .credit(owner: owner)
        }
        guard facts.evidence == .signedUpload else { return .held(.ownerUnknown) }
        return .credit(owner: facts.uploader)
    }
}

extension VerifiedPurchase {
    /// A later transaction of its chain that the customer bought (Apple's `transactionReason`
    /// PURCHASE: a resubscription after the chain lapsed, an upgrade, a crossgrade), not a
    /// renewal, nor a restore of the chain's first purchase (a restore keeps its period's
    /// purchase date, which for the first period is the chain's original purchase date).
    /// Unknown where Apple's answer does not say (`verifyReceipt`): false.
    public var isNewPurchaseInChain: Bool {
        guard transactionId != originalTransactionId, transactionReason == "PURCHASE" else { return false }
        guard let original = originalPurchaseDate, let bought = purchaseDate else { return true }
        return bought > original
    }
}
