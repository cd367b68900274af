public import Foundation
public import IAPCore

/// What the order store holds about the keys one event names: the only input of
/// `Ledger.plan` besides the event itself.
///
/// The shell reads these rows in the transaction that will write the plan, so the plan is
/// decided on exactly what it changes.
public struct LedgerFacts: Sendable, Equatable {
    /// The purchase row of the event's transaction, if recorded.
    public var purchase: Purchase?
    /// Every grant of the event's credit key and of its original transaction (subscription
    /// periods, restores), active and revoked, oldest first.
    public var grants: [Grant]
    /// Apple's remembered revocation (or reversal) of the credit key.
    public var revocation: Revocation?
    /// The subscription of the event's original transaction.
    public var subscription: Subscription?
    /// Purchases of the credit key that a standing revocation stopped, oldest first.
    public var blocked: [Purchase]
    /// Whoever a purchase of the transaction or its chain was credited to (not held).
    public var chainCreditedUser: String?
    /// The owner of the chain a migrated subscription continues (`previousOriginalTransactionId`).
    public var previousChainOwner: String?
    /// The order the purchase's `appAccountToken` names.
    public var tokenOrder: Order?
    /// The order the upload names (the client's word).
    public var uploadOrder: Order?
    /// Periods of the subscription Apple told of before anyone owned it (held
    /// `owner_unknown`), oldest first: read while the subscription has no owner.
    public var unownedPeriods: [Purchase]
    /// Apple's revocations of those periods' credit keys.
    public var unownedRevocations: [Revocation]
    /// New purchases in the subscription's chain proven by their buyer's upload after a refund
    /// had stopped them (held `revoked`, `beginsStretch`), oldest first, read along with
    /// `unownedPeriods`: each still tells whose stretch of the chain its renewals are, as it
    /// would had it been credited before the refund.
    public var refundedPeriods: [Purchase] = []
    /// For an upload naming an order alone (`LedgerEvent.Naming`): the user's open orders of
    /// its product, oldest first.
    public var openOrders: [Order] = []
    /// For the same: the user's purchases of the order's product bought since it was created
    /// (less `LedgerPolicy.clockSkewAllowed`), oldest first, each with whether it is granted.
    public var orderCandidates: [OrderCandidate] = []

    /// Creates facts; everything absent unless given.
    public init(
        purchase: Purchase? = nil, grants: [Grant] = [], revocation: Revocation? = nil, subscription: Subscription? = nil,
        blocked: [Purchase] = [], chainCreditedUser: String? = nil, tokenOrder: Order? = nil, uploadOrder: Order? = nil,
        unownedPeriods: [Purchase] = [], unownedRevocations: [Revocation] = [], openOrders: [Order] = [],
        orderCandidates: [OrderCandidate] = []
    ) {
        self.openOrders = openOrders
        self.orderCandidates = orderCandidates
        self.unownedPeriods = unownedPeriods
        self.unownedRevocations = unownedRevocations
        self.purchase = purchase
        self.grants = grants
        self.revocation = revocation
        self.subscription = subscription
        self.blocked = blocked
        self.chainCreditedUser = chainCreditedUser
        self.tokenOrder = tokenOrder
        self.uploadOrder = uploadOrder
    }

    /// One Apple transaction as recorded (table `purchase`).
    public struct Purchase: Sendable, Equatable {
        /// Kept while nobody owns it: a period Apple told of before its subscription had an owner
        /// (`owner_unknown`), or a new purchase in the chain awaiting its buyer (`buyer_unknown`).
        public var isUnowned: Bool {
            heldReason == .ownerUnknown || heldReason == .buyerUnknown
        }
        /// A new purchase in the chain awaiting its buyer's proof.
        public var awaitsBuyer: Bool { heldReason == .buyerUnknown }

        public var transactionId: String
        public var originalTransactionId: String
        public var productId: String
        public var quantity: Int
        public var environment: AppStoreEnvironment
        public var bundleId: String
        public var purchaseDate: Date?
        /// The user it is recorded for (its owner, or the one it is held for).
        public var userId: String
        public var orderId: String?
        public var submissionId: String
        public var appAccountToken: String?
        /// Why it is not granted (`revoked` when a refund stopped its upload); nil when granted.
        public var heldReason: ReasonCode?
        public var creditedAt: Date
        /// Its credit key; nil in rows of the first schema.
        public var creditKey: CreditKey?
        public var webOrderLineItemId: String?
        public var expiresDate: Date?
        /// Apple's `ownershipType` (`FAMILY_SHARED`, `ASSIGNED`: access someone else paid for);
        /// nil where Apple's answer did not say (and in rows written before it was kept).
        public var ownershipType: String?
        /// A new purchase in its subscription's chain (a resubscription, an upgrade) kept after
        /// a refund stopped it: it begins its buyer's stretch of the chain.
        public var beginsStretch = false

        /// Creates a purchase row.
        public init(
            transactionId: String, originalTransactionId: String, productId: String, quantity: Int,
            environment: AppStoreEnvironment, bundleId: String, purchaseDate: Date?, userId: String, orderId: String?,
            submissionId: String, appAccountToken: String?, heldReason: ReasonCode?, creditedAt: Date, creditKey: CreditKey?,
            webOrderLineItemId: String?, expiresDate: Date?, ownershipType: String? = nil
        ) {
            self.ownershipType = ownershipType
            self.transactionId = transactionId
            self.originalTransactionId = originalTransactionId
            self.productId = productId
            self.quantity = quantity
            self.environment = environment
            self.bundleId = bundleId
            self.purchaseDate = purchaseDate
            self.userId = userId
            self.orderId = orderId
            self.submissionId = submissionId
            self.appAccountToken = appAccountToken
            self.heldReason = heldReason
            self.creditedAt = creditedAt
            self.creditKey = creditKey
            self.webOrderLineItemId = webOrderLineItemId
            self.expiresDate = expiresDate
        }
    }


    /// Apple's word that a credit key was taken back, and whether Apple reversed it (table
    /// `revocation`). Dates are Apple's; each is the latest of its kind, so the row says the
    /// same whatever order Apple's notifications arrived in.
    public struct Revocation: Sendable, Equatable {
        public var creditKey: CreditKey
        public var transactionId: String
        /// REFUND, REVOKE, REFUND_REVERSED (a reversal that arrived first) or `apple_answer`.
        public var source: String
        /// Apple's latest refund or revocation of any kind.
        public var revokedAt: Date
        /// Apple's latest reversal.
        public var reversedAt: Date?
        /// Apple's latest full refund or revocation; nil when there was none (rows written
        /// before prorated refunds were kept apart read `revokedAt` here).
        public var fullyRevokedAt: Date?
        /// Apple's latest prorated refund of a consumable, and how many units it took back.
        public var partlyRevokedAt: Date?
        public var revokedUnits: Int?

        /// Creates a revocation row.
        public init(
            creditKey: CreditKey, transactionId: String, source: String, revokedAt: Date, reversedAt: Date?,
            fullyRevokedAt: Date? = nil, partlyRevokedAt: Date? = nil, revokedUnits: Int? = nil
        ) {
            self.creditKey = creditKey
            self.transactionId = transactionId
            self.source = source
            self.revokedAt = revokedAt
            self.reversedAt = reversedAt
            self.fullyRevokedAt = fullyRevokedAt
            self.partlyRevokedAt = partlyRevokedAt
            self.revokedUnits = revokedUnits
        }

        /// Whether Apple took the whole purchase back: a full refund later than every reversal
        /// (a reversal wins a tie).
        public var standsFully: Bool {
            guard let full = fullyRevokedAt else { return false }
            return reversedAt.map { $0 < full } ?? true
        }

        /// The units a prorated refund later than every reversal took back; 0 when none.
        public var standingUnits: Int {
            guard let partly = partlyRevokedAt, let units = revokedUnits, reversedAt.map({ $0 < partly }) ?? true else { return 0 }
            return units
        }

        /// Whether it takes anything back now.
        public var stands: Bool { standsFully || standingUnits > 0 }
    }


    /// A purchase of the user's that may be what an order was placed for.
    public struct OrderCandidate: Sendable, Equatable {
        public var transactionId: String
        public var originalTransactionId: String
        public var productId: String
        public var purchaseDate: Date?
        /// The order it pays already, if any.
        public var orderId: String?
        /// Credited to the user and in force (not held, not taken back).
        public var granted: Bool
        /// Apple's `ownershipType` (`ASSIGNED` for a seat an organization assigned).
        public var ownershipType: String?

        /// Creates a candidate.
        public init(
            transactionId: String, originalTransactionId: String, productId: String, purchaseDate: Date?, orderId: String?,
            granted: Bool, ownershipType: String?
        ) {
            self.transactionId = transactionId
            self.originalTransactionId = originalTransactionId
            self.productId = productId
            self.purchaseDate = purchaseDate
            self.orderId = orderId
            self.granted = granted
            self.ownershipType = ownershipType
        }
    }
}

extension LedgerFacts {
    /// The grants of `key`.
    func grants(of key: CreditKey) -> [Grant] { grants.filter { $0.creditKey == key } }

    /// The active grant of `key` (at most one: the store's unique index).
    func activeGrant(of key: CreditKey) -> Grant? { grants.first { $0.creditKey == key && $0.isActive } }

    /// The grant of one transaction.
    func grant(ofTransaction transactionId: String) -> Grant? { grants.first { $0.transactionId == transactionId } }

    /// These facts after `change`: what the rest of one plan reads.
    public mutating func apply(_ change: LedgerChange) {
        switch change {
        case .recordPurchase, .releasePurchase, .claimPurchase:
            applyToPurchases(change)
        case .grant, .revokeGrant, .reactivateGrant, .reduceGrant, .extendGrant, .endGrant, .setGracePeriod:
            applyToGrants(change)
        case .bindOrder, .attachOrder, .setOrderState:
            applyToOrders(change)
        case .putRevocation(let row):
            revocation = row
        case .putSubscription(let row):
            subscription = row
        case .recordConsumptionRequest, .recordTerms, .audit, .publish:
            break
        }
    }

    private mutating func applyToPurchases(_ change: LedgerChange) {
        switch change {
        case .recordPurchase(let row, _):
            if purchase == nil {
                purchase = row
                if row.heldReason == .stoppedByRefund { blocked.append(row) }
            }
        case .releasePurchase(let transactionId):
            if purchase?.transactionId == transactionId { purchase?.heldReason = nil }
            blocked.removeAll { $0.transactionId == transactionId }
        case .claimPurchase(let row):
            if purchase?.transactionId == row.transactionId { purchase = row }
            unownedPeriods.removeAll { $0.transactionId == row.transactionId }
        default:
            break
        }
    }

    private mutating func applyToGrants(_ change: LedgerChange) {
        switch change {
        case .grant(let row):
            var row = row
            row.id = (grants.map(\.id).max() ?? 0) + 1
            grants.append(row)
        case .revokeGrant(let transactionId, let by, let at):
            updateGrant(transactionId) {
                $0.isActive = false
                $0.revokedAt = at
                $0.revokedBy = by
            }
        case .reactivateGrant(let transactionId):
            updateGrant(transactionId) {
                $0.isActive = true
                $0.revokedAt = nil
                $0.revokedBy = nil
            }
        case .reduceGrant(let transactionId, let quantity, let grantJSON):
            updateGrant(transactionId) {
                $0.quantity = quantity
                $0.grantJSON = grantJSON
            }
        case .extendGrant(let transactionId, let until):
            updateGrant(transactionId) { $0.expiresAt = until }
        case .endGrant(let transactionId, let at):
            updateGrant(transactionId) { $0.expiresAt = at }
        case .setGracePeriod(let transactionId, let until):
            updateGrant(transactionId) { $0.gracePeriodExpiresAt = until }
        default:
            break
        }
    }

    private mutating func applyToOrders(_ change: LedgerChange) {
        switch change {
        case .bindOrder(let orderId, let transactionId, let at):
            for path in [\LedgerFacts.tokenOrder, \LedgerFacts.uploadOrder] where self[keyPath: path]?.id == orderId {
                self[keyPath: path]?.state = .paid
                self[keyPath: path]?.transactionId = transactionId
                self[keyPath: path]?.updatedAt = at
            }
            openOrders.removeAll { $0.id == orderId }
        case .attachOrder(let orderId, let transactionId):
            if purchase?.transactionId == transactionId { purchase?.orderId = orderId }
            updateGrant(transactionId) { $0.orderId = orderId }
            for index in orderCandidates.indices where orderCandidates[index].transactionId == transactionId {
                orderCandidates[index].orderId = orderId
            }
        case .setOrderState(let orderId, let transactionId, let state, let at):
            for path in [\LedgerFacts.tokenOrder, \LedgerFacts.uploadOrder]
            where self[keyPath: path]?.id == orderId && self[keyPath: path]?.transactionId == transactionId {
                self[keyPath: path]?.state = state
                self[keyPath: path]?.updatedAt = at
            }
        default:
            break
        }
    }

    private mutating func updateGrant(_ transactionId: String, _ body: (inout Grant) -> Void) {
        if let index = grants.firstIndex(where: { $0.transactionId == transactionId }) { body(&grants[index]) }
    }
}
