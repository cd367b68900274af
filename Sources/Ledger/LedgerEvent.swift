import Foundation
public import IAPCore

/// Something that may change what users hold: the input of `Ledger.plan`.
public enum LedgerEvent: Sendable, Equatable {
    /// One purchase of a verified upload (a receipt, a signed transaction, a looked-up id).
    case upload(VerifiedPurchase, Upload)
    /// A verified App Store Server Notification, not applied before (the shell keeps each
    /// `notificationUUID` once).
    case notification(AppStoreNotification, submissionId: String)
    /// Customer service grants by hand: a held purchase to its owner, or goodwill.
    case manualGrant(ManualGrant)
    /// Customer service takes a grant back.
    case manualRevoke(transactionId: String, actor: String, reason: String, eventTag: String)
    /// Customer service binds a subscription to a user (Apple's Set App Account Token names
    /// an order of theirs): from now on its renewals and refunds follow that user.
    case bind(originalTransactionId: String, userId: String, orderId: String, actor: String, reason: String)
    /// What an upload named that its purchases did not settle, after they were credited.
    case naming(Naming)

    /// The upload a purchase came in.
    public struct Upload: Sendable, Equatable {
        /// The user whose upload it is.
        public var userId: String
        public var submissionId: String
        /// The order the upload names (the client's word).
        public var orderId: String?
        /// The transaction the upload names.
        public var transactionId: String?
        public var bundleId: String

        /// Creates an upload.
        public init(userId: String, submissionId: String, orderId: String?, transactionId: String?, bundleId: String) {
            self.userId = userId
            self.submissionId = submissionId
            self.orderId = orderId
            self.transactionId = transactionId
            self.bundleId = bundleId
        }
    }

    /// A grant by hand.
    public struct ManualGrant: Sendable, Equatable {
        public var userId: String
        public var productId: String
        public var quantity: Int
        public var grant: [String: Catalog.GrantValue]
        /// A held purchase to grant; nil for goodwill.
        public var transactionId: String?
        /// Goodwill for this Apple purchase, not uploaded yet: bound to what it credits, so that
        /// its later upload is `already_credited`. Nil for goodwill under `goodwillId`.
        public var appleTransactionId: String?
        /// The id of a goodwill grant (`manual-…`), chosen by the shell.
        public var goodwillId: String
        public var actor: String
        public var reason: String

        /// Creates a grant by hand.
        public init(
            userId: String, productId: String, quantity: Int, grant: [String: Catalog.GrantValue], transactionId: String?,
            goodwillId: String, actor: String, reason: String, appleTransactionId: String? = nil
        ) {
            self.appleTransactionId = appleTransactionId
            self.userId = userId
            self.productId = productId
            self.quantity = quantity
            self.grant = grant
            self.transactionId = transactionId
            self.goodwillId = goodwillId
            self.actor = actor
            self.reason = reason
        }

        /// What Apple's signed answer said of `appleTransactionId`, when it was asked: its
        /// original transaction (a restore's is the purchase it restores) and environment.
        public var appleOriginalTransactionId: String?
        public var appleEnvironment: AppStoreEnvironment?

        /// The Apple purchase a goodwill grant bound to an Apple transaction stands for: its
        /// product, of the original transaction and environment Apple said (when asked; else
        /// bought as the first transaction of its chain, in production).
        public var applePurchase: VerifiedPurchase {
            let id = appleTransactionId ?? transactionId ?? goodwillId
            return VerifiedPurchase(
                transactionId: id, originalTransactionId: appleOriginalTransactionId ?? id, productId: productId,
                quantity: quantity, purchaseDate: nil, environment: appleEnvironment ?? .production)
        }
    }
}

/// What the ledger needs to know beyond the event and the facts.
public struct LedgerPolicy: Sendable {
    /// What each product grants and its type; nil credits every purchase once per
    /// transaction with its quantity only.
    public var catalog: Catalog?
    /// Which sandbox purchases are credited.
    public var sandbox: SandboxPolicy
    /// What a restore uploaded by another user than the owner does.
    public var restore: RestorePolicy

    /// Creates a policy.
    public init(catalog: Catalog? = nil, sandbox: SandboxPolicy = .accept, restore: RestorePolicy = .keep) {
        self.catalog = catalog
        self.sandbox = sandbox
        self.restore = restore
    }

    /// The key `purchase` is credited once by.
    public func creditKey(of purchase: VerifiedPurchase) -> CreditKey {
        CreditKey(of: purchase, type: catalog?.product(purchase.productId)?.type)
    }
}

/// Which rows the facts of an event are: the shell reads exactly these.
public struct LedgerQuery: Sendable, Equatable {
    /// The purchase row, and the grant, of this transaction.
    public var transactionId: String?
    /// The credit key whose grants, revocation and stopped purchases are read.
    public var creditKey: CreditKey?
    /// The chain whose grants, subscription and first credited purchase are read.
    public var originalTransactionId: String?
    /// The order named by an `appAccountToken` (compared in lower case).
    public var tokenOrderId: String?
    /// The order the upload names (compared in lower case).
    public var uploadOrderId: String?
    /// The chain a migrated subscription continues: its owner is read.
    public var previousOriginalTransactionId: String? = nil
    /// Whether the user's open orders of `uploadOrderId`'s product, and their purchases since
    /// it was created, are read (`LedgerFacts.openOrders`, `orderCandidates`).
    public var readsOrderCandidates = false
    /// Whether the subscription of `originalTransactionId` and its chain's grants are read
    /// (not for a one-time purchase of an upload: one statement less on the common path, and
    /// only its credit key's grants).
    public var readsSubscription: Bool

    /// Creates a query.
    public init(
        transactionId: String? = nil, creditKey: CreditKey? = nil, originalTransactionId: String? = nil,
        tokenOrderId: String? = nil, uploadOrderId: String? = nil, readsSubscription: Bool = true
    ) {
        self.transactionId = transactionId
        self.creditKey = creditKey
        self.originalTransactionId = originalTransactionId
        self.tokenOrderId = tokenOrderId
        self.uploadOrderId = uploadOrderId
        self.readsSubscription = readsSubscription
    }
}

/// What a plan concluded, besides its changes.
public enum LedgerOutcome: Sendable, Equatable {
    /// For one purchase of an upload: what became of it, and why when it was not credited.
    case transaction(TransactionCreditState, ReasonCode?)
    /// For a notification: what it did.
    case notification(NotificationOutcome)
    /// For an action by hand: the grant it wrote or took back.
    case grant(transactionId: String)
    /// For a binding by hand: the subscription now the user's.
    case bound(originalTransactionId: String)
    /// For an upload's naming: what it came to.
    case naming(NamingOutcome)
    /// An action by hand that cannot be done as asked; nothing changes.
    case refused(Refusal, String)

    /// Why an action by hand was refused.
    public enum Refusal: Sendable, Equatable {
        case notFound
        case conflict
    }
}

/// What applying one of Apple's notifications did. Its text (`description`) is the one word the
/// store records per notification (`notification.outcome`), the console shows and the
/// reconciliation reports; it is written only at that edge.
public enum NotificationOutcome: Sendable, Equatable, CustomStringConvertible {
    /// Apple's test notification.
    case test
    /// Kept, with nothing to change (consent rescinded, a consumption request, a type the
    /// ledger does not act on).
    case recorded
    /// Apple declined a refund request: nothing changes.
    case declined
    /// A grant was taken back in full.
    case revoked
    /// Units of a grant were taken back (a prorated refund).
    case partlyRevoked
    /// Apple's word was kept; what users hold did not change.
    case unchanged
    /// The refund is recorded before anything of it was credited: it stops the purchase's upload.
    case revocationPending
    /// A reversal of the refund was recorded first: the refund takes nothing.
    case reversedAlready
    /// A grant taken back by Apple is in force again.
    case restored
    /// A recorded refund no longer stands; nothing was granted to give back.
    case revocationLifted
    /// A reversal with no refund of it recorded.
    case nothingRevoked
    /// The purchase was credited to its owner, or not and why: as the owner's upload would be.
    case credit(TransactionCreditState, ReasonCode?)
    /// Kept as Apple signed it for the owner (`owner_unknown`) or buyer (`buyer_unknown`) to come.
    case kept(ReasonCode)
    /// A sandbox purchase for a user the sandbox policy does not allow.
    case sandboxNotAllowed
    /// Apple moved a period's end (`RENEWAL_EXTENDED`): the grant in force lasts as long.
    case extended
    /// The subscription's state recorded: `expired`, `billing_retry` or `grace_period`.
    case subscriptionState(SubscriptionState)
    /// The customer turned auto-renewal on or off.
    case autoRenew(on: Bool)

    public var description: String {
        switch self {
        case .test: "test"
        case .recorded: "recorded"
        case .declined: "declined"
        case .revoked: "revoked"
        case .partlyRevoked: "partly_revoked"
        case .unchanged: "unchanged"
        case .revocationPending: "revocation_pending"
        case .reversedAlready: "reversed_already"
        case .restored: "restored"
        case .revocationLifted: "revocation_lifted"
        case .nothingRevoked: "nothing_revoked"
        case .credit(let state, let reason): reason.map { "\(state.rawValue) (\($0))" } ?? state.rawValue
        case .kept(let reason): reason.rawValue
        case .sandboxNotAllowed: "sandbox_not_allowed"
        case .extended: "extended"
        case .subscriptionState(let state): state.rawValue
        case .autoRenew(let on): on ? "auto_renew_on" : "auto_renew_off"
        }
    }
}

/// A plan: the changes, in order, and what they amount to.
public struct LedgerPlan: Sendable, Equatable {
    public var changes: [LedgerChange]
    public var outcome: LedgerOutcome
    /// Grants the plan took back (for the metrics).
    public var revoked: Int
}

extension ReasonCode {
    /// The product is not in the catalog: nothing to grant until a person decides.
    public static let unknownProduct = ReasonCode("unknown_product")
    /// The purchase names our order, but for another product.
    public static let productMismatch = ReasonCode("product_mismatch")
    /// Why a purchase is recorded but not granted: a refund Apple made stood when it was proven,
    /// so it is kept for the one who proved it, credited should Apple reverse the refund.
    /// Stored as `revoked`.
    public static let stoppedByRefund = ReasonCode("revoked")
}
