public import Foundation
public import IAPCore

/// An auto-renewable subscription (table `subscription`): what the ledger plans with, the store
/// reads its rows into, and the API and the console show.
public struct Subscription: Sendable, Equatable {
    public var originalTransactionId: String
    /// Its owner: every billing period is theirs. Nil while only notifications told of it.
    public var userId: String?
    public var productId: String
    public var environment: String
    public var state: SubscriptionState
    public var expiresDate: Date?
    public var autoRenew: Bool?
    public var gracePeriodExpiresDate: Date?
    public var lastTransactionId: String
    public var updatedAt: Date
    /// Apple's date of the state recorded (`signedDate`); a state signed earlier never replaces it.
    public var stateDate: Date?
    /// Where the owner's stretch of the chain begins: the purchase date of the new purchase
    /// (a resubscription, an upgrade) that made them the owner; nil for the first stretch.
    /// A period bought before it belongs to whoever owns its own stretch.
    public var ownedSince: Date?
    /// What it renews to (price, offer, a price increase's consent), as Apple's renewal
    /// information said last.
    public var renewal: RenewalTerms?

    /// Creates a subscription row.
    public init(
        originalTransactionId: String, userId: String?, productId: String, environment: String, state: SubscriptionState,
        expiresDate: Date?, autoRenew: Bool?, gracePeriodExpiresDate: Date?, lastTransactionId: String, updatedAt: Date,
        stateDate: Date?, ownedSince: Date? = nil, renewal: RenewalTerms? = nil
    ) {
        self.renewal = renewal
        self.ownedSince = ownedSince
        self.originalTransactionId = originalTransactionId
        self.userId = userId
        self.productId = productId
        self.environment = environment
        self.state = state
        self.expiresDate = expiresDate
        self.autoRenew = autoRenew
        self.gracePeriodExpiresDate = gracePeriodExpiresDate
        self.lastTransactionId = lastTransactionId
        self.updatedAt = updatedAt
        self.stateDate = stateDate
    }
}

extension Subscription {
    /// The subscription as of `now`: its state by what is in force then (`InForce`).
    public func asOf(_ now: Date) -> Subscription {
        var subscription = self
        subscription.state = InForce.subscriptionState(
            recorded: state, expiresDate: expiresDate, gracePeriodExpiresDate: gracePeriodExpiresDate, at: now)
        return subscription
    }

    /// Whether it gives access at `now`.
    public func isInForce(at now: Date) -> Bool {
        InForce.subscription(recorded: state, expiresDate: expiresDate, gracePeriodExpiresDate: gracePeriodExpiresDate, at: now)
    }
}

/// A subscription as the app reads it: state, product, expiry, auto-renew status and
/// environment, as the newest of uploads and Apple's notifications left them, and what the
/// next period renews to.
extension Subscription: Encodable {
    private enum Field: String, CodingKey {
        case originalTransactionId, productId, environment, state, expiresDate, autoRenew, gracePeriodExpiresDate
        case updatedAt, renewalProductId, renewalPrice, renewalCurrency, priceIncrease, renewalBillingPlanType
        case commitmentRenewal
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: Field.self)
        try container.encode(originalTransactionId, forKey: .originalTransactionId)
        try container.encode(productId, forKey: .productId)
        try container.encode(environment, forKey: .environment)
        try container.encode(state, forKey: .state)
        try container.encodeIfPresent(expiresDate, forKey: .expiresDate)
        try container.encodeIfPresent(autoRenew, forKey: .autoRenew)
        try container.encodeIfPresent(gracePeriodExpiresDate, forKey: .gracePeriodExpiresDate)
        try container.encode(updatedAt, forKey: .updatedAt)
        try container.encodeIfPresent(renewal?.autoRenewProductId, forKey: .renewalProductId)
        try container.encodeIfPresent(renewal?.renewalPrice, forKey: .renewalPrice)
        try container.encodeIfPresent(renewal?.currency, forKey: .renewalCurrency)
        // `pending` (Apple awaits the customer's consent to a price increase) or `accepted`.
        try container.encodeIfPresent(renewal?.priceIncrease, forKey: .priceIncrease)
        try container.encodeIfPresent(renewal?.billingPlanType, forKey: .renewalBillingPlanType)
        try container.encodeIfPresent(renewal?.commitment, forKey: .commitmentRenewal)
    }
}
