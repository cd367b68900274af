public import IAPCore

/// What a purchase is credited once by: the unit of "exactly once".
///
/// A consumable is credited per transaction, a non-consumable (and a non-renewing
/// subscription) per original transaction, so that its restores credit nothing new, and an
/// auto-renewable subscription per billing period (Apple's web order line item), so that every
/// renewal is credited once and a restore of a period is not.
public enum CreditKey: Hashable, Sendable, CustomStringConvertible {
    /// One transaction: consumables, products not in the catalog, subscriptions without a period id.
    case transaction(String)
    /// One original transaction and all its restores: non-consumables, non-renewing subscriptions.
    case originalTransaction(String)
    /// One billing period of an auto-renewable subscription, whichever transaction carries it.
    case billingPeriod(String)

    /// The key `purchase` is credited once by, as the catalog types its product.
    public init(of purchase: VerifiedPurchase, type: Catalog.ProductType?) {
        switch type {
        case .nonConsumable?, .nonRenewing?:
            self = .originalTransaction(purchase.originalTransactionId)
        case .autoRenewable?:
            self = purchase.webOrderLineItemId.map(CreditKey.billingPeriod) ?? .transaction(purchase.transactionId)
        case .consumable?, nil:
            self = .transaction(purchase.transactionId)
        }
    }

    /// The form the order store keeps (`txn:`, `otx:` or `wol:` and the id), unchanged since
    /// the first schema so that stored keys and new ones compare equal.
    public var stored: String {
        switch self {
        case .transaction(let id): "txn:\(id)"
        case .originalTransaction(let id): "otx:\(id)"
        case .billingPeriod(let id): "wol:\(id)"
        }
    }

    /// Reads a stored key; nil for anything else.
    public init?(stored: String) {
        let id = String(stored.dropFirst(4))
        switch stored.prefix(4) {
        case "txn:": self = .transaction(id)
        case "otx:": self = .originalTransaction(id)
        case "wol:": self = .billingPeriod(id)
        default: return nil
        }
    }

    /// Whether the key is one transaction: a grant of it can never move to another user (the
    /// same transaction uploaded by someone else is a replay, not a restore).
    public var isPerTransaction: Bool {
        if case .transaction = self { return true }
        return false
    }

    public var description: String { stored }
}
