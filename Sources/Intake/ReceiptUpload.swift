import AppStore
import Foundation
import Hummingbird
import IAPCore

/// A validated `POST /v1/receipts` body: a StoreKit 1 app receipt (`receiptData`), a
/// StoreKit 2 signed transaction (`signedTransaction`), or a transaction id alone.
struct ReceiptUpload: Equatable {
    /// The request's user (`IntakeContext.resolveUser`): the token's, else the body's `userId`.
    var userId: String
    var orderId: String?
    var transactionId: String?
    /// What the named StoreKit 1 transaction stands for (`SKPaymentTransaction.original` of a
    /// restore, and its product): only with `transactionId`.
    var originalTransactionId: String?
    var productId: String?
    /// The base64 receipt, or empty.
    var receiptData: String
    var signedTransaction: String?
    /// StoreKit 2's `AppTransaction.shared.jwsRepresentation`: the customer's download of the app.
    var signedAppTransaction: String?

    static let maxIdLength = 256
    /// StoreKit 2 JWS are a few KB (three certificates and the payload).
    static let maxJWSLength = 64 * 1024
    /// The largest app receipt taken, in decoded bytes. Apple's are a few KB plus a few hundred
    /// bytes per in-app purchase they list; a larger "receipt" is a shell padded to fill disks.
    static let maxReceiptBytes = 256 * 1024

    /// Reads and checks a body; every fault is an `APIError` with its own code. A body's
    /// `userId` that differs from the request's established user is refused; a receipt of an
    /// app not in `bundleIds` (when it is not empty) too.
    init(
        json data: Data, context: IntakeContext, bundleIds: Set<String> = [], receiptRoots: ReceiptSignature? = nil
    ) async throws(APIError) {
        let object: Any
        do {
            object = try JSONSerialization.jsonObject(with: data, options: [.fragmentsAllowed])
        } catch {
            throw .invalidJSON("the body is not valid JSON")
        }
        guard let fields = object as? [String: Any] else {
            throw .invalidJSON("the body must be a JSON object")
        }
        let body = JSONFields(fields: fields)
        let userId = try await context.resolveUser(named: try body.id("userId", maxLength: Self.maxIdLength))
        let receipt = try body.string("receiptData", maxLength: .max)
        let signed = try body.string("signedTransaction", maxLength: Self.maxJWSLength)
        let transactionId = try body.string("transactionId", maxLength: Self.maxIdLength)
        guard receipt != nil || signed != nil || transactionId != nil else {
            throw APIError(.missingField, "one of 'receiptData', 'signedTransaction' or 'transactionId' is required")
        }
        self.userId = userId
        self.orderId = try body.id("orderId", maxLength: Self.maxIdLength)
        let originalTransactionId = try body.string("originalTransactionId", maxLength: Self.maxIdLength)
        for (name, id) in [("transactionId", transactionId), ("originalTransactionId", originalTransactionId)] {
            if let id, !Self.isAppleTransactionId(id) {
                throw .invalidField(name, "must be Apple's numeric transaction id")
            }
        }
        let productId = try body.id("productId", maxLength: Self.maxIdLength)
        if originalTransactionId != nil, transactionId == nil {
            throw .invalidField("originalTransactionId", "says what 'transactionId' stands for: send 'transactionId' too")
        }
        if productId != nil, originalTransactionId == nil {
            throw .invalidField("productId", "goes with 'originalTransactionId': send both")
        }
        self.transactionId = transactionId
        self.originalTransactionId = originalTransactionId
        self.productId = productId
        if let signed {
            try Self.checkJWSShape(signed)
        }
        self.signedTransaction = signed
        let app = try body.string("signedAppTransaction", maxLength: Self.maxJWSLength)
        if let app { try Self.checkJWSShape(app, field: "signedAppTransaction") }
        self.signedAppTransaction = app
        guard let receipt else {
            self.receiptData = ""
            return
        }
        // Apps sometimes send base64 wrapped in lines; the bytes are what counts. Done on the
        // UTF-8 bytes: walking Characters cost a fifth of the intake's CPU.
        let compact = Self.withoutASCIIWhitespace(receipt)
        guard let bytes = Base64URL.decodeStandard(compact.utf8), compact.utf8.count % 4 == 0 else {
            throw APIError(.receiptNotBase64, "'receiptData' is not valid base64")
        }
        guard !bytes.isEmpty else {
            throw APIError(.receiptEmpty, "'receiptData' holds no bytes")
        }
        guard bytes.count <= Self.maxReceiptBytes else {
            throw .invalidField("receiptData", "decodes to more than \(Self.maxReceiptBytes) bytes, more than any app receipt")
        }
        try Self.checkShape(bytes, bundleIds: bundleIds, receiptRoots: receiptRoots)
        self.receiptData = compact
    }

    /// Whether `id` has the shape of Apple's transaction ids: 1 to 32 ASCII digits.
    static func isAppleTransactionId(_ id: String) -> Bool {
        !id.isEmpty && id.utf8.count <= 32 && id.utf8.allSatisfy { $0 >= 0x30 && $0 <= 0x39 }
    }

    /// `text` without spaces, tabs and line breaks (a copy only when it has some).
    static func withoutASCIIWhitespace(_ text: String) -> String {
        var text = text
        text.makeContiguousUTF8()
        let isSpace = { (byte: UInt8) in byte == 0x20 || byte == 0x0A || byte == 0x0D || byte == 0x09 }
        let hasSpace = text.utf8.withContiguousStorageIfAvailable { $0.contains(where: isSpace) } ?? true
        guard hasSpace else { return text }
        return String(decoding: text.utf8.filter { !isSpace($0) }, as: UTF8.self)
    }

    /// Refuses what cannot be a compact JWS: three base64url parts with a JSON header. The
    /// signature and chain are the verifier's to check.
    static func checkJWSShape(_ jws: String, field: String = "signedTransaction") throws(APIError) {
        let parts = jws.utf8.split(separator: UInt8(ascii: "."), omittingEmptySubsequences: false)
        let base64URL = { (byte: UInt8) in
            (byte >= 0x30 && byte <= 0x39) || (byte >= 0x41 && byte <= 0x5A) || (byte >= 0x61 && byte <= 0x7A) || byte == 0x2D
                || byte == 0x5F
        }
        guard parts.count == 3, parts.allSatisfy({ !$0.isEmpty && $0.allSatisfy(base64URL) }),
            let header = Base64URL.decode(parts[0]),
            (try? JSONSerialization.jsonObject(with: header)) is [String: Any]
        else {
            throw APIError(.jwsMalformed, "'\(field)' is not a compact JWS")
        }
    }

    /// Refuses what cannot be one of this app's receipts before anything is stored: bytes that
    /// are no PKCS#7 container, a container whose signed content is no receipt payload (a shell
    /// carrying filler), and a receipt that names another app's bundle id (`bundleIds`, when
    /// set). Every receipt Apple issues passes: a field the local parse reads more strictly than
    /// Apple does (`invalidField`) goes on to Apple, which has the last word. Nothing here is
    /// trusted to credit: the signature is not checked, so it can only turn junk away, and so
    /// can the look at the certificates' names (`receiptRoots`): a receipt whose certificates can
    /// never lead to a trusted root is no App Store receipt, whatever Apple would say.
    private static func checkShape(_ bytes: [UInt8], bundleIds: Set<String>, receiptRoots: ReceiptSignature?) throws(APIError) {
        let receipt: AppReceipt
        do {
            // Apple's receipts carry certificates and a signer: a shell without them, or padded
            // with filler attributes, is refused before it is stored.
            receipt = try AppReceiptParser.parse(bytes, limits: .intake)
        } catch {
            if error.code == .invalidField { return }
            throw APIError(.receiptMalformed, "'receiptData' is not an app receipt (\(error.code))")
        }
        if !bundleIds.isEmpty, !bundleIds.contains(receipt.bundleId) {
            throw APIError(.receiptOtherApp, "'receiptData' is a receipt of another app, not of \(bundleIds.sorted().joined(separator: ", "))")
        }
        if let receiptRoots, !receipt.isXcode, receiptRoots.leadsToNoTrustedRoot(bytes) {
            throw APIError(.receiptUntrusted, "'receiptData' is signed by certificates that lead to no trusted root")
        }
    }
}
