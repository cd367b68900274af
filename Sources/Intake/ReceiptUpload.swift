import AppStore
import Foundation
import Hummingbird
import IAPCore

/// A validated `POST /v1/receipts` body.
struct ReceiptUpload: Equatable {
    /// The token's user; with authentication off, the body's `userId` (then required).
    var userId: String
    var orderId: String?
    var transactionId: String?
    var receiptData: String

    static let maxIdLength = 256

    /// Reads and checks a body; every fault is an `APIError` with its own code. A body's
    /// `userId` that differs from `tokenUser` is refused.
    init(json data: Data, tokenUser: String?) throws(APIError) {
        let object: Any
        do {
            object = try JSONSerialization.jsonObject(with: data, options: [.fragmentsAllowed])
        } catch {
            throw .invalidJSON("the body is not valid JSON")
        }
        guard let fields = object as? [String: Any] else {
            throw .invalidJSON("the body must be a JSON object")
        }
        let userId = try RequestUser.resolve(
            token: tokenUser, named: try Self.string(fields, "userId", maxLength: Self.maxIdLength))
        guard let receipt = try Self.string(fields, "receiptData", maxLength: .max) else {
            throw .missingField("receiptData")
        }
        self.userId = userId
        self.orderId = try Self.string(fields, "orderId", maxLength: Self.maxIdLength)
        self.transactionId = try Self.string(fields, "transactionId", maxLength: Self.maxIdLength)
        // Apps sometimes send base64 wrapped in lines; the bytes are what counts.
        let compact = receipt.filter { !$0.isWhitespace }
        guard let bytes = Data(base64Encoded: compact) else {
            throw APIError(.badRequest, code: "receipt_not_base64", message: "'receiptData' is not valid base64")
        }
        guard !bytes.isEmpty else {
            throw APIError(.badRequest, code: "receipt_empty", message: "'receiptData' holds no bytes")
        }
        try Self.checkShape([UInt8](bytes))
        self.receiptData = compact
    }

    /// Refuses bytes that are not even a PKCS#7 container. Receipts whose content merely looks
    /// unusual go on to Apple, which has the last word: the local parse trusts nothing and
    /// must never turn away a real purchase.
    private static func checkShape(_ bytes: [UInt8]) throws(APIError) {
        do {
            _ = try AppReceiptParser.parse(bytes)
        } catch {
            switch error.code {
            case .notAReceipt, .invalidField:
                return
            default:
                throw APIError(
                    .badRequest, code: "receipt_malformed", message: "'receiptData' is not an app receipt (\(error.code))")
            }
        }
    }

    /// A string field: nil when absent or null (or empty), an error when of another type or too long.
    private static func string(_ fields: [String: Any], _ name: String, maxLength: Int) throws(APIError) -> String? {
        guard let value = fields[name], !(value is NSNull) else { return nil }
        guard let string = value as? String else {
            throw .invalidField(name, "must be a string")
        }
        if string.isEmpty { return nil }
        guard string.utf8.count <= maxLength else {
            throw .invalidField(name, "is longer than \(maxLength) bytes")
        }
        return string
    }
}
