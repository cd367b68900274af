public import Foundation
public import IAPCore

/// One credit of one transaction to one user (table `grants`): what the ledger plans with, the
/// store reads its rows into, and the API and the console show.
public struct Grant: Sendable, Equatable {
    /// The store's row id (the order grants were written in); 0 for a grant this plan adds.
    public var id: Int64
    public var transactionId: String
    public var userId: String
    public var productId: String
    public var orderId: String?
    public var quantity: Int
    /// What it grants, as JSON with sorted keys.
    public var grantJSON: String
    public var environment: String
    public var source: GrantSource
    public var isActive: Bool
    public var grantedAt: Date
    public var revokedAt: Date?
    public var revokedBy: GrantRevoker?
    public var creditKey: CreditKey?
    public var originalTransactionId: String?
    public var expiresAt: Date?
    public var gracePeriodExpiresAt: Date?
    /// When the purchase it credits began (its period's start); read from the purchase row.
    public var periodStart: Date?

    /// Creates a grant row.
    public init(
        id: Int64, transactionId: String, userId: String, productId: String, orderId: String?, quantity: Int,
        grantJSON: String, environment: String, source: GrantSource, isActive: Bool, grantedAt: Date, revokedAt: Date?,
        revokedBy: GrantRevoker?, creditKey: CreditKey?, originalTransactionId: String?, expiresAt: Date?,
        gracePeriodExpiresAt: Date?, periodStart: Date? = nil
    ) {
        self.periodStart = periodStart
        self.id = id
        self.transactionId = transactionId
        self.userId = userId
        self.productId = productId
        self.orderId = orderId
        self.quantity = quantity
        self.grantJSON = grantJSON
        self.environment = environment
        self.source = source
        self.isActive = isActive
        self.grantedAt = grantedAt
        self.revokedAt = revokedAt
        self.revokedBy = revokedBy
        self.creditKey = creditKey
        self.originalTransactionId = originalTransactionId
        self.expiresAt = expiresAt
        self.gracePeriodExpiresAt = gracePeriodExpiresAt
    }
}

extension Grant {
    /// `active` or `revoked`.
    public var state: GrantState { isActive ? .active : .revoked }

    /// What it grants (quantity × the catalog's grant); empty when its JSON says nothing readable.
    public var grantValues: [String: Catalog.GrantValue] {
        (try? JSONDecoder().decode([String: Catalog.GrantValue].self, from: Data(grantJSON.utf8))) ?? [:]
    }

    /// Whether the user may use it at `now` (`InForce.grant`: active, and not past its period
    /// or grace).
    public func isInForce(at now: Date) -> Bool {
        InForce.grant(isActive: isActive, expiresAt: expiresAt, gracePeriodExpiresAt: gracePeriodExpiresAt, at: now)
    }
}

/// A grant as the app and customer service read it.
extension Grant: Encodable {
    private enum Field: String, CodingKey {
        case transactionId, productId, orderId, quantity, grant, state, environment, source, grantedAt, expiresAt
        case gracePeriodExpiresAt
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: Field.self)
        try container.encode(transactionId, forKey: .transactionId)
        try container.encode(productId, forKey: .productId)
        try container.encodeIfPresent(orderId, forKey: .orderId)
        try container.encode(quantity, forKey: .quantity)
        try container.encode(grantValues, forKey: .grant)
        try container.encode(state, forKey: .state)
        try container.encode(environment, forKey: .environment)
        try container.encode(source, forKey: .source)
        try container.encode(grantedAt, forKey: .grantedAt)
        try container.encodeIfPresent(expiresAt, forKey: .expiresAt)
        try container.encodeIfPresent(gracePeriodExpiresAt, forKey: .gracePeriodExpiresAt)
    }
}
