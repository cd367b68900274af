import Foundation

/// A transaction as the store hands it to the app: what the queue keeps and the uploader
/// names to the order service.
public struct StoreTransaction: Codable, Sendable, Hashable {
    /// Apple's transaction id (StoreKit 2's `Transaction.id`, StoreKit 1's
    /// `transactionIdentifier`), in decimal.
    public var transactionId: String
    /// The original transaction it belongs to (a subscription's chain, a restore's purchase).
    public var originalTransactionId: String
    /// The App Store product id.
    public var productId: String
    /// The token the purchase was made with (`appAccountToken`): the order it pays, when the
    /// app bought it through `IAPClient.purchase(productId:)`.
    public var appAccountToken: UUID?
    /// When Apple says it was bought.
    public var purchaseDate: Date
    /// StoreKit 2's signed transaction (`VerificationResult.jwsRepresentation`); nil for a
    /// StoreKit 1 transaction, uploaded with the app receipt instead.
    public var signedTransaction: String?

    /// A transaction the store reported.
    public init(
        transactionId: String, originalTransactionId: String, productId: String, appAccountToken: UUID?,
        purchaseDate: Date, signedTransaction: String?
    ) {
        self.transactionId = transactionId
        self.originalTransactionId = originalTransactionId
        self.productId = productId
        self.appAccountToken = appAccountToken
        self.purchaseDate = purchaseDate
        self.signedTransaction = signedTransaction
    }
}

/// What a purchase sheet ended in.
public enum StorePurchaseResult: Sendable, Equatable {
    /// Apple charged the user: the transaction to hand to the order service.
    case purchased(StoreTransaction)
    /// The user closed the sheet; nothing was bought.
    case userCancelled
    /// Waiting for someone (Ask to Buy, a bank's approval): the transaction, if it comes,
    /// arrives later through `transactionUpdates()`.
    case pending
}

/// The store the app buys from: StoreKit in an app (`StoreKitPurchaseSource`), the fake App
/// Store in tests. The queue and the uploader talk only to this.
public protocol PurchaseSource: Sendable {
    /// Shows the purchase sheet for `productId`, the purchase bound to `appAccountToken`.
    func purchase(productId: String, appAccountToken: UUID) async throws -> StorePurchaseResult
    /// Every transaction the store has not seen finished (StoreKit 2's `Transaction.unfinished`):
    /// what a kill before the queue's write would otherwise lose.
    func unfinishedTransactions() async throws -> [StoreTransaction]
    /// Transactions that arrive outside a purchase sheet (StoreKit 2's `Transaction.updates`:
    /// renewals, Ask to Buy, purchases on another device, promoted purchases). The stream ends
    /// when the source is done.
    func transactionUpdates() -> AsyncStream<StoreTransaction>
    /// Finishes the transaction (StoreKit's `finish()`); one already finished or unknown to
    /// the store is not an error. Final: a finished consumable leaves every later receipt.
    func finish(transactionId: String) async throws
    /// The app receipt, base64 (StoreKit 1); nil when the device has none.
    func appReceipt() async throws -> String?
}
