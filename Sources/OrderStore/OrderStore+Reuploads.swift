public import Foundation
import Crypto
public import IAPCore
import Ledger
import Store

extension OrderStore {
    /// How long an upload credited before answers the same upload again by its owner: within
    /// it, the repeat is neither stored nor verified again (Apple is not asked again). A renewal
    /// that comes meanwhile reaches the ledger by Apple's notification and reconciliation.
    public static let reuploadWindow: TimeInterval = 3600

    /// A digest of everything an upload names and carries (user, order, transaction ids, product,
    /// receipt, signed transaction): two uploads with one digest ask the same question. Nil for
    /// a notification.
    static func uploadDigest(of request: VerifyRequest) -> String? {
        guard request.signedPayload == nil else { return nil }
        var hash = SHA256()
        for field in [
            request.userId, request.orderId ?? "", request.transactionId ?? "", request.originalTransactionId ?? "",
            request.productId ?? "", request.receiptData, request.signedTransaction ?? "",
        ] {
            // Each field with its length first: no two different uploads run together the same.
            // Hashed where the string keeps its bytes: no copy of a 4 KB receipt, twice an upload.
            var field = field
            field.withUTF8 { bytes in
                withUnsafeBytes(of: UInt64(bytes.count).littleEndian) { hash.update(bufferPointer: $0) }
                hash.update(bufferPointer: UnsafeRawBufferPointer(bytes))
            }
        }
        return Self.hex(hash.finalize())
    }

    /// Lower-case hexadecimal of `bytes`.
    static func hex<Bytes: Sequence<UInt8>>(_ bytes: Bytes) -> String {
        let digits = Array("0123456789abcdef".utf8)
        var text: [UInt8] = []
        text.reserveCapacity(64)
        for byte in bytes {
            text.append(digits[Int(byte >> 4)])
            text.append(digits[Int(byte & 0x0f)])
        }
        return String(decoding: text, as: UTF8.self)
    }

    /// The submission `request` repeats, when its owner's same upload was accepted within
    /// ``reuploadWindow`` before `now`, is credited, lists no period of an auto-renewable
    /// subscription, and everything it lists is still in force for this user (the ledger would
    /// answer the repeat the same way): the repeat is answered with it (its status follows every
    /// later event), and nothing is stored or verified again. Nil otherwise: a purchase refunded,
    /// moved to another user or held since is asked again as a new upload, and so is a receipt
    /// with a subscription, to which Apple's answer grows with every renewal.
    public func creditedUpload(repeatedBy request: VerifyRequest, now: Date) async throws -> SubmissionID? {
        guard let digest = Self.uploadDigest(of: request) else { return nil }
        return try await database.read { db in
            try await db.cachedRow(
                sql: """
                    SELECT id FROM submission
                    WHERE userId = ? AND uploadDigest = ? AND state = \(SubmissionState.credited.sql) AND acceptedAt >= ?
                        AND EXISTS (SELECT 1 FROM submission_transaction WHERE submissionId = submission.id)
                        AND NOT EXISTS (
                            SELECT 1 FROM submission_transaction
                            WHERE submissionId = submission.id AND creditKey LIKE 'wol:%')
                        AND NOT EXISTS (
                            SELECT 1 FROM submission_transaction
                            WHERE submission_transaction.submissionId = submission.id
                                AND NOT EXISTS (
                                    SELECT 1 FROM grants WHERE grants.creditKey = submission_transaction.creditKey
                                        AND grants.userId = submission.userId AND grants.state = \(GrantState.active.sql)))
                    ORDER BY acceptedAt DESC LIMIT 1
                    """, arguments: [request.userId, digest, now.addingTimeInterval(-Self.reuploadWindow)]
            ).flatMap { UUID(uuidString: $0["id"]) }
        }
    }
}
