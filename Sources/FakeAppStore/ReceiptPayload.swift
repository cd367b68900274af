public import Foundation

/// The content of an app receipt the fake App Store mints, field for field as Apple's.
///
/// Dates are written in whole seconds (RFC 3339, `2026-11-23T01:02:03Z`): fractions are dropped.
public struct ReceiptPayload: Sendable, Equatable {
    /// Where the receipt was issued (attribute 0): `Production`, `ProductionSandbox`, or
    /// `Xcode` for StoreKit testing in Xcode.
    public var receiptType: String
    /// The app's bundle identifier (attribute 2).
    public var bundleId: String
    /// The app version the receipt is issued to (attribute 3).
    public var appVersion: String
    /// The version of the app first purchased (attribute 19).
    public var originalAppVersion: String
    /// The opaque value that feeds the device hash (attribute 4).
    public var opaqueValue: [UInt8]
    /// The SHA-1 device hash (attribute 5).
    public var sha1Hash: [UInt8]
    /// When the receipt was created (attribute 12).
    public var creationDate: Date
    /// The in-app purchases (attribute 17, one per purchase).
    public var inApp: [InAppPurchasePayload]

    /// Creates a payload; the opaque value and hash default to random bytes of Apple's sizes.
    public init(
        receiptType: String = "Production", bundleId: String, appVersion: String = "1", originalAppVersion: String = "1.0",
        opaqueValue: [UInt8] = ReceiptPayload.randomBytes(8), sha1Hash: [UInt8] = ReceiptPayload.randomBytes(20),
        creationDate: Date = Date(), inApp: [InAppPurchasePayload] = []
    ) {
        self.receiptType = receiptType
        self.bundleId = bundleId
        self.appVersion = appVersion
        self.originalAppVersion = originalAppVersion
        self.opaqueValue = opaqueValue
        self.sha1Hash = sha1Hash
        self.creationDate = creationDate
        self.inApp = inApp
    }

    /// `count` bytes from the system's random number generator.
    public static func randomBytes(_ count: Int) -> [UInt8] {
        var generator = SystemRandomNumberGenerator()
        return (0..<count).map { _ in UInt8.random(in: .min ... .max, using: &generator) }
    }
}

/// One in-app purchase inside a `ReceiptPayload`.
public struct InAppPurchasePayload: Sendable, Equatable {
    /// Number of items purchased (attribute 1701).
    public var quantity: Int
    /// The product identifier (attribute 1702).
    public var productId: String
    /// Apple's transaction identifier (attribute 1703).
    public var transactionId: String
    /// The transaction identifier of the original purchase (attribute 1705).
    public var originalTransactionId: String
    /// When the purchase was made (attribute 1704).
    public var purchaseDate: Date
    /// When the original purchase was made (attribute 1706).
    public var originalPurchaseDate: Date
    /// When a subscription expires (attribute 1708); only subscriptions have one.
    public var expiresDate: Date?
    /// The subscription's web order line item id (attribute 1711).
    public var webOrderLineItemId: Int64?
    /// When Apple support cancelled (refunded) the purchase (attribute 1712).
    public var cancellationDate: Date?

    /// Creates a purchase; the original transaction and date default to this purchase's own.
    public init(
        quantity: Int = 1, productId: String, transactionId: String, originalTransactionId: String? = nil,
        purchaseDate: Date, originalPurchaseDate: Date? = nil, expiresDate: Date? = nil,
        webOrderLineItemId: Int64? = nil, cancellationDate: Date? = nil
    ) {
        self.quantity = quantity
        self.productId = productId
        self.transactionId = transactionId
        self.originalTransactionId = originalTransactionId ?? transactionId
        self.purchaseDate = purchaseDate
        self.originalPurchaseDate = originalPurchaseDate ?? purchaseDate
        self.expiresDate = expiresDate
        self.webOrderLineItemId = webOrderLineItemId
        self.cancellationDate = cancellationDate
    }
}
