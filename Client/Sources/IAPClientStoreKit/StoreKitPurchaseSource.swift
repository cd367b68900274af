import Foundation
import IAPClient
#if canImport(StoreKit)
import StoreKit
#else
// Linux (CI): the declared subset of StoreKit, so that this file is type-checked there too.
import StoreKitSurface
#endif

/// `PurchaseSource` over StoreKit 2: what an app passes to `IAPClient`.
public struct StoreKitPurchaseSource: PurchaseSource {
    /// Why a purchase could not start.
    public enum Failure: Error, Equatable {
        /// The App Store has no product with this id (wrong id, or not cleared for sale).
        case productNotFound(String)
    }

    /// A source over the device's App Store account.
    public init() {}

    /// Shows the purchase sheet for `productId`, the purchase bound to `appAccountToken`.
    public func purchase(productId: String, appAccountToken: UUID) async throws -> StorePurchaseResult {
        guard let product = try await Product.products(for: [productId]).first else {
            throw Failure.productNotFound(productId)
        }
        switch try await product.purchase(options: [.appAccountToken(appAccountToken)]) {
        case .success(let verification):
            return .purchased(Self.storeTransaction(verification))
        case .userCancelled:
            return .userCancelled
        case .pending:
            return .pending
        #if canImport(StoreKit)
        // A result this code does not know: nothing was charged that we know of, and if it was,
        // the transaction arrives through `Transaction.updates` like any Ask to Buy approval.
        // (Only on Apple platforms: against the surface's closed enum it is dead code, a warning.)
        @unknown default:
            return .pending
        #endif
        }
    }

    /// Every transaction StoreKit has not seen finished.
    public func unfinishedTransactions() async throws -> [StoreTransaction] {
        var transactions: [StoreTransaction] = []
        for await result in Transaction.unfinished {
            transactions.append(Self.storeTransaction(result))
        }
        return transactions
    }

    /// Transactions from `Transaction.updates`, until the stream's consumer stops listening.
    public func transactionUpdates() -> AsyncStream<StoreTransaction> {
        AsyncStream { continuation in
            let task = Task {
                for await result in Transaction.updates {
                    continuation.yield(Self.storeTransaction(result))
                }
                continuation.finish()
            }
            // `Transaction.updates` never ends by itself: cancelling is what stops the listener.
            continuation.onTermination = { _ in task.cancel() }
        }
    }

    /// Finishes the unfinished transaction with this id; none such means already finished.
    public func finish(transactionId: String) async throws {
        // StoreKit 2 finishes a `Transaction` value, not an id: find it among the unfinished.
        for await result in Transaction.unfinished {
            let transaction = result.unsafePayloadValue
            if String(transaction.id) == transactionId {
                await transaction.finish()
                return
            }
        }
    }

    /// The app receipt, base64; nil when the device has none.
    public func appReceipt() async throws -> String? {
        #if canImport(StoreKit)
        // A missing receipt is normal (sandbox before a purchase, StoreKit testing); an
        // unreadable one is an error worth surfacing.
        guard let url = Bundle.main.appStoreReceiptURL, FileManager.default.fileExists(atPath: url.path) else {
            return nil
        }
        return try Data(contentsOf: url).base64EncodedString()
        #else
        // `appStoreReceiptURL` is Apple's Foundation, not StoreKit; Linux has no receipt.
        return nil
        #endif
    }

    // The fields come from the unverified payload on purpose: the order service verifies the
    // signed transaction itself, and one StoreKit could not verify must still reach it (to be
    // rejected there) rather than be dropped here and sit unfinished forever.
    private static func storeTransaction(_ result: VerificationResult<Transaction>) -> StoreTransaction {
        let payload = result.unsafePayloadValue
        return StoreTransaction(
            transactionId: String(payload.id), originalTransactionId: String(payload.originalID),
            productId: payload.productID, appAccountToken: payload.appAccountToken,
            purchaseDate: payload.purchaseDate, signedTransaction: result.jwsRepresentation
        )
    }
}
