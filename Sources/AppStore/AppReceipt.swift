public import Foundation

/// What an app receipt says, read locally with `AppReceiptParser`.
///
/// - Important: Reading a receipt does not verify its signature: use it to find transaction
///   ids and to turn junk away early, never to credit anything. Only Apple's answer credits.
public struct AppReceipt: Sendable, Equatable, Codable {
    /// Where the receipt was issued (attribute 0), as Apple spells it: `Production`,
    /// `ProductionSandbox` (the VPP variants `ProductionVPP`, `ProductionVPPSandbox`), or
    /// `Xcode` for StoreKit testing in Xcode; nil when the receipt names none.
    public var receiptType: String?
    /// The app's bundle identifier (attribute 2).
    public var bundleId: String
    /// The app version that the receipt was issued to (attribute 3).
    public var appVersion: String?
    /// The version of the app first purchased (attribute 19); absent from Xcode's receipts.
    public var originalAppVersion: String?
    /// When the receipt was created (attribute 12).
    public var creationDate: Date?
    /// Size in bytes of the opaque value (attribute 4), which feeds the device hash.
    public var opaqueValueByteCount: Int
    /// Size in bytes of the SHA-1 device hash (attribute 5).
    public var sha1HashByteCount: Int
    /// The in-app purchases (attribute 17), in the receipt's order.
    public var inApp: [InAppPurchase]

    /// One in-app purchase of the receipt.
    public struct InAppPurchase: Sendable, Equatable, Codable {
        /// Number of items purchased (attribute 1701).
        public var quantity: Int?
        /// The product identifier (attribute 1702).
        public var productId: String
        /// Apple's transaction identifier (attribute 1703).
        public var transactionId: String
        /// The transaction identifier of the original purchase (attribute 1705).
        public var originalTransactionId: String?
        /// When the purchase was made (attribute 1704).
        public var purchaseDate: Date?
        /// When the original purchase was made (attribute 1706).
        public var originalPurchaseDate: Date?
        /// When a subscription expires (attribute 1708).
        public var expiresDate: Date?
        /// The subscription purchase's web order line item id (attribute 1711).
        public var webOrderLineItemId: Int64?
        /// When Apple support cancelled (refunded) the purchase (attribute 1712).
        public var cancellationDate: Date?

        /// Creates a purchase.
        public init(
            quantity: Int?, productId: String, transactionId: String, originalTransactionId: String?,
            purchaseDate: Date?, originalPurchaseDate: Date?, expiresDate: Date? = nil,
            webOrderLineItemId: Int64? = nil, cancellationDate: Date? = nil
        ) {
            self.quantity = quantity
            self.productId = productId
            self.transactionId = transactionId
            self.originalTransactionId = originalTransactionId
            self.purchaseDate = purchaseDate
            self.originalPurchaseDate = originalPurchaseDate
            self.expiresDate = expiresDate
            self.webOrderLineItemId = webOrderLineItemId
            self.cancellationDate = cancellationDate
        }
    }

    /// Creates a receipt.
    public init(
        receiptType: String? = nil, bundleId: String, appVersion: String?, originalAppVersion: String?, creationDate: Date?,
        opaqueValueByteCount: Int, sha1HashByteCount: Int, inApp: [InAppPurchase]
    ) {
        self.receiptType = receiptType
        self.bundleId = bundleId
        self.appVersion = appVersion
        self.originalAppVersion = originalAppVersion
        self.creationDate = creationDate
        self.opaqueValueByteCount = opaqueValueByteCount
        self.sha1HashByteCount = sha1HashByteCount
        self.inApp = inApp
    }

    /// Whether Xcode's StoreKit testing issued the receipt: nobody paid for what it lists.
    public var isXcode: Bool { receiptType == "Xcode" }

    /// Whether the receipt was issued in the sandbox (TestFlight, App Review, sandbox testers).
    public var isSandbox: Bool { receiptType?.hasSuffix("Sandbox") == true }
}
