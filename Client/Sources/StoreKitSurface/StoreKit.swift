#if os(Linux)
// The StoreKit 2 declarations `IAPClientStoreKit` uses, and nothing more, with the names and
// signatures Apple documents (https://developer.apple.com/documentation/storekit), so that the
// adapter is type-checked on Linux in CI. Nothing on Linux can buy: there is no App Store,
// `Product.products(for:)` finds nothing, the transaction sequences are empty, and `Product` and
// `Transaction` hold a `Never`, so no value of either can exist. Bodies that would need one are
// `switch never {}`, which the compiler proves unreachable; none is a stand-in for behaviour.
// On Apple platforms this file is empty and the adapter imports the real StoreKit.
import Foundation

/// https://developer.apple.com/documentation/storekit/product
public struct Product: Sendable {
    fileprivate let never: Never

    /// https://developer.apple.com/documentation/storekit/product/products(for:)
    public static func products<Identifiers>(for identifiers: Identifiers) async throws -> [Product]
    where Identifiers: Collection, Identifiers.Element == String {
        []  // No App Store on Linux: no identifier names a product.
    }

    /// https://developer.apple.com/documentation/storekit/product/purchase(options:)
    @MainActor
    public func purchase(options: Set<Product.PurchaseOption> = []) async throws -> Product.PurchaseResult {
        switch never {}
    }

    /// https://developer.apple.com/documentation/storekit/product/purchaseoption
    public struct PurchaseOption: Hashable, Sendable {
        fileprivate let token: UUID

        /// https://developer.apple.com/documentation/storekit/product/purchaseoption/appaccounttoken(_:)
        public static func appAccountToken(_ token: UUID) -> Product.PurchaseOption {
            PurchaseOption(token: token)
        }
    }

    /// https://developer.apple.com/documentation/storekit/product/purchaseresult
    public enum PurchaseResult: Sendable {
        /// https://developer.apple.com/documentation/storekit/product/purchaseresult/success(_:)
        case success(VerificationResult<Transaction>)
        /// https://developer.apple.com/documentation/storekit/product/purchaseresult/usercancelled
        case userCancelled
        /// https://developer.apple.com/documentation/storekit/product/purchaseresult/pending
        case pending
    }
}

/// https://developer.apple.com/documentation/storekit/transaction
public struct Transaction: Sendable {
    /// https://developer.apple.com/documentation/storekit/transaction/id
    public let id: UInt64
    /// https://developer.apple.com/documentation/storekit/transaction/originalid
    public let originalID: UInt64
    /// https://developer.apple.com/documentation/storekit/transaction/productid
    public let productID: String
    /// https://developer.apple.com/documentation/storekit/transaction/appaccounttoken
    public let appAccountToken: UUID?
    /// https://developer.apple.com/documentation/storekit/transaction/purchasedate
    public let purchaseDate: Date
    fileprivate let never: Never

    /// https://developer.apple.com/documentation/storekit/transaction/finish()
    public func finish() async {
        switch never {}
    }

    /// https://developer.apple.com/documentation/storekit/transaction/updates
    public static var updates: Transaction.Transactions { Transactions() }

    /// https://developer.apple.com/documentation/storekit/transaction/unfinished
    public static var unfinished: Transaction.Transactions { Transactions() }

    /// https://developer.apple.com/documentation/storekit/transaction/transactions
    public struct Transactions: AsyncSequence, Sendable {
        /// https://developer.apple.com/documentation/storekit/transaction/transactions (Element)
        public typealias Element = VerificationResult<Transaction>

        /// https://developer.apple.com/documentation/storekit/transaction/transactions (AsyncIterator)
        public struct AsyncIterator: AsyncIteratorProtocol {
            /// Ends at once: Linux has no transactions.
            public mutating func next() async -> VerificationResult<Transaction>? { nil }
        }

        /// https://developer.apple.com/documentation/storekit/transaction/transactions (makeAsyncIterator())
        public func makeAsyncIterator() -> Transaction.Transactions.AsyncIterator { AsyncIterator() }
    }
}

/// https://developer.apple.com/documentation/storekit/verificationresult
@frozen
public enum VerificationResult<SignedType> {
    /// https://developer.apple.com/documentation/storekit/verificationresult/unverified(_:_:)
    case unverified(SignedType, VerificationResult<SignedType>.VerificationError)
    /// https://developer.apple.com/documentation/storekit/verificationresult/verified(_:)
    case verified(SignedType)

    /// https://developer.apple.com/documentation/storekit/verificationresult/unsafepayloadvalue
    public var unsafePayloadValue: SignedType {
        switch self {
        case .unverified(let value, _), .verified(let value): value
        }
    }

    /// https://developer.apple.com/documentation/storekit/verificationresult/verificationerror
    public enum VerificationError: Error {}  // Apple's cases left out: the adapter names none.
}

/// Sendable for a Sendable signed type: the adapter passes results between the main actor and tasks.
extension VerificationResult: Sendable where SignedType: Sendable {}

extension VerificationResult where SignedType == Transaction {
    /// https://developer.apple.com/documentation/storekit/verificationresult/jwsrepresentation-21vgo
    public var jwsRepresentation: String {
        switch unsafePayloadValue.never {}
    }
}
#endif
