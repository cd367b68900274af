public import Foundation

/// One of our orders (table `orders`): what a user meant to buy, before the purchase made for
/// it pays it. What the ledger plans with, the store reads its rows into, and the app reads.
public struct Order: Sendable, Equatable, Identifiable {
    /// A UUID, so it fits StoreKit 1's `applicationUsername` and StoreKit 2's `appAccountToken`.
    public var id: String
    /// Who ordered.
    public var userId: String
    /// The product ordered.
    public var productId: String
    public var state: OrderState
    /// The Apple transaction that paid it.
    public var transactionId: String?
    public var createdAt: Date
    /// When it last changed.
    public var updatedAt: Date

    /// Creates an order row; `updatedAt` is `createdAt` unless given.
    public init(
        id: String, userId: String, productId: String, state: OrderState, transactionId: String?, createdAt: Date,
        updatedAt: Date? = nil
    ) {
        self.id = id
        self.userId = userId
        self.productId = productId
        self.state = state
        self.transactionId = transactionId
        self.createdAt = createdAt
        self.updatedAt = updatedAt ?? createdAt
    }
}

/// An order as the app reads it.
extension Order: Encodable {
    private enum Field: String, CodingKey {
        case id = "orderId"
        case userId, productId, state, transactionId, createdAt, updatedAt
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: Field.self)
        try container.encode(id, forKey: .id)
        try container.encode(userId, forKey: .userId)
        try container.encode(productId, forKey: .productId)
        try container.encode(state, forKey: .state)
        try container.encodeIfPresent(transactionId, forKey: .transactionId)
        try container.encode(createdAt, forKey: .createdAt)
        try container.encode(updatedAt, forKey: .updatedAt)
    }
}
