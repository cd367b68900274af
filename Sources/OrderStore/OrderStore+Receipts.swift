internal import Foundation
internal import IAPCore
internal import Store

/// How an uploaded app receipt is kept: its bytes (not their base64), in `submission_receipt`,
/// a row of its own that nothing updates.
///
/// Uploads arrive as base64, a third larger than the bytes. In the submission row the receipt
/// made every later update of that row (its state, its attempts) write it again, or, on
/// PostgreSQL, went out of line to a TOAST table in two chunks; in a table of its own it is
/// written once, and the submission row stays a few hundred bytes. PostgreSQL compresses the
/// bytes in their row, as it does any row past 2 KB (a receipt repeats its certificate names
/// and object identifiers); nothing in the order service spends CPU on it (deflating each
/// receipt here cost the order service 12 to 16 % more CPU for the same WAL: docs/benchmarks.md).
///
/// Text under `keptAsBytesFrom` bytes (no real app receipt is that small: its certificate chain
/// alone is larger), text whose bytes would not give back the same base64 (padding or trailing
/// bits written otherwise), and rows written before this table existed stay in
/// `submission.receiptData`; readers take whichever is there.
enum StoredReceipt {
    /// Receipts whose text is at least this long are kept as bytes.
    static let keptAsBytesFrom = 1024

    /// The statements that store `request`'s upload: its submission row, and the receipt's own
    /// row when it is kept as bytes.
    static func statements(for request: VerifyRequest) -> [SQLStatement] {
        guard let bytes = bytes(of: request.receiptData) else {
            return [OrderStore.submissionStatement(request, receiptData: request.receiptData)]
        }
        return [
            OrderStore.submissionStatement(request, receiptData: ""),
            SQLStatement(
                "INSERT INTO submission_receipt (submissionId, receipt) VALUES (?, ?)", [request.submissionId.uuidString, bytes]),
        ]
    }

    /// The bytes `text` is kept as, or nil when it is kept as text.
    static func bytes(of text: String) -> Data? {
        guard text.utf8.count >= keptAsBytesFrom, let bytes = Data(base64Encoded: text),
            bytes.base64EncodedString() == text
        else { return nil }
        return bytes
    }

    /// The receipt of a row read with `columns`, as the app uploaded it (base64).
    static func text(of row: SQLRow) -> String {
        (row["receiptBytes"] as Data?)?.base64EncodedString() ?? row["receiptData"]
    }

    /// The receipt's columns for a query over `source`.
    static let columns = "receiptData, submission_receipt.receipt AS receiptBytes"

    /// `submission` with each row's receipt bytes, if it has them.
    static let source = "submission LEFT JOIN submission_receipt ON submission_receipt.submissionId = submission.id"
}
