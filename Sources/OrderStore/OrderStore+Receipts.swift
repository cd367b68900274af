internal import Compressing
internal import Foundation
internal import IAPCore

/// How an uploaded app receipt is kept: its DER bytes deflated, in `submission_receipt`, a row
/// of its own that nothing updates.
///
/// Uploads arrive as base64 (a third larger than the bytes) of a structure that repeats its
/// certificate names and object identifiers: deflated, a receipt keeps about 40 % of its text.
/// In the submission row it made every later update of that row (its state, its attempts)
/// write the receipt again, or, on PostgreSQL, go out of line to a TOAST table in two chunks;
/// in a table of its own it is written once, the submission row stays a few hundred bytes, and
/// neither is read where the other is not needed.
///
/// Text under `deflatedFrom` bytes (nothing a real app receipt is that small: its certificate
/// chain alone is larger) and text that is not base64 stay in `submission.receiptData` as they
/// came, as do rows written before this table existed; readers take whichever is there.
enum StoredReceipt {
    /// Receipts whose text is at least this long are stored deflated.
    static let deflatedFrom = 1024

    /// The largest receipt a stored one may unfold to: far above any upload the intake takes.
    static let largestReceipt = 8 << 20

    /// The statements that store `request`'s upload: its submission row, and the receipt's own
    /// row when it is kept deflated.
    static func statements(for request: VerifyRequest) -> [SQLStatement] {
        guard let deflated = deflated(request.receiptData) else {
            return [OrderStore.submissionStatement(request, receiptData: request.receiptData)]
        }
        return [
            OrderStore.submissionStatement(request, receiptData: ""),
            SQLStatement(
                "INSERT INTO submission_receipt (submissionId, deflated) VALUES (?, ?)",
                [request.submissionId.uuidString, Data(deflated)]),
        ]
    }

    /// `text` as it is kept when deflated, or nil when it is kept as text.
    static func deflated(_ text: String) -> [UInt8]? {
        guard text.utf8.count >= deflatedFrom, let bytes = Data(base64Encoded: text) else { return nil }
        return try? Deflate.compress([UInt8](bytes))
    }

    /// The receipt of a row read with `columns` (`receiptData` and `deflatedReceipt`), as the
    /// app uploaded it (base64).
    static func text(of row: SQLRow) throws -> String {
        guard let deflated = row["deflatedReceipt"] as Data? else { return row["receiptData"] }
        do {
            return Data(try Deflate.decompress([UInt8](deflated), limit: largestReceipt)).base64EncodedString()
        } catch {
            throw OrderStoreError(.unavailable, "the stored receipt of submission \(row["id"] as String) is unreadable: \(error)")
        }
    }

    /// The receipt's columns for a query over `source`.
    static let columns = "receiptData, submission_receipt.deflated AS deflatedReceipt"

    /// `submission` with each row's deflated receipt, if it has one.
    static let source = "submission LEFT JOIN submission_receipt ON submission_receipt.submissionId = submission.id"
}
