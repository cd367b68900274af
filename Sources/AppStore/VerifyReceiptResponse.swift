import Foundation
import IAPCore

/// Apple's `verifyReceipt` answer, read leniently: Apple sends most numbers as strings,
/// sometimes as numbers, and some flags as 0/1 or booleans.
struct VerifyReceiptResponse: Decodable {
    struct Receipt: Decodable {
        var bundleId: String?
        var inApp: [InApp]?

        enum CodingKeys: String, CodingKey {
            case bundleId = "bundle_id"
            case inApp = "in_app"
        }
    }

    struct InApp: Decodable {
        var transactionId: LenientString?
        var originalTransactionId: LenientString?
        var productId: LenientString?
        var quantity: LenientString?
        var purchaseDateMs: LenientString?
        var cancellationDateMs: LenientString?
        var expiresDateMs: LenientString?
        var appAccountToken: LenientString?
        var webOrderLineItemId: LenientString?
        var inAppOwnershipType: LenientString?
        var isUpgraded: LenientString?

        enum CodingKeys: String, CodingKey {
            case transactionId = "transaction_id"
            case originalTransactionId = "original_transaction_id"
            case productId = "product_id"
            case quantity
            case purchaseDateMs = "purchase_date_ms"
            case cancellationDateMs = "cancellation_date_ms"
            case expiresDateMs = "expires_date_ms"
            case appAccountToken = "app_account_token"
            case webOrderLineItemId = "web_order_line_item_id"
            case inAppOwnershipType = "in_app_ownership_type"
            case isUpgraded = "is_upgraded"
        }
    }

    var status: LenientString
    var environment: String?
    var receipt: Receipt?
    var latestReceiptInfo: [InApp]?
    var isRetryable: LenientString?
    var isRetryableDocumented: LenientString?

    enum CodingKeys: String, CodingKey {
        case status, environment, receipt
        case latestReceiptInfo = "latest_receipt_info"
        case isRetryable = "is_retryable"
        case isRetryableDocumented = "is-retryable"
    }

    /// Apple's retry flag: documented as `is-retryable`, sent as `is_retryable`, as 0/1 or a
    /// boolean. Nil when Apple sent neither.
    var retryable: Bool? {
        let values = [isRetryable, isRetryableDocumented].compactMap { $0?.value.lowercased() }
        guard !values.isEmpty else { return nil }
        return values.contains { $0 == "1" || $0 == "true" }
    }
}

/// A JSON scalar read as text, whether Apple sent a string, a number or a boolean.
struct LenientString: Decodable, Equatable {
    var value: String

    init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        if let string = try? container.decode(String.self) {
            value = string
        } else if let integer = try? container.decode(Int64.self) {
            value = String(integer)
        } else if let double = try? container.decode(Double.self) {
            value = String(double)
        } else if let bool = try? container.decode(Bool.self) {
            value = bool ? "true" : "false"
        } else {
            throw DecodingError.dataCorruptedError(in: container, debugDescription: "expected a scalar")
        }
    }
}
