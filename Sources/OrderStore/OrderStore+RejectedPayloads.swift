public import Foundation
public import IAPCore
import Store

extension OrderStore {
    /// Keeps only a digest of what a rejected submission was sent with (its receipt, signed
    /// transaction or signed payload): Apple declared it invalid, and nothing reads it again, so
    /// a padded upload that passed the intake's first look keeps less than 1 KB on disk, not
    /// its bytes for `IAP_RETENTION_DAYS`. `digest` names the bytes (`sha256:<hex>:<bytes>`).
    /// Nothing happens to a submission that is not rejected.
    public func keepOnlyDigests(ofRejected id: SubmissionID, digest: @escaping @Sendable (String) -> String)
        async throws(OrderStoreError)
    {
        do {
            try await database.write { db in
                guard
                    let row = try await db.row(
                        sql: """
                            SELECT id, \(StoredReceipt.columns), signedTransaction, signedPayload FROM \(StoredReceipt.source)
                            WHERE id = ? AND state = \(SubmissionState.rejected.sql)
                            """,
                        arguments: [id.uuidString])
                else { return }
                let receipt = StoredReceipt.text(of: row)
                let transaction: String? = row["signedTransaction"]
                let payload: String? = row["signedPayload"]
                let shorten = { (text: String) in text.utf8.count > 1024 ? digest(text) : text }
                try await db.execute(
                    sql: "UPDATE submission SET receiptData = ?, signedTransaction = ?, signedPayload = ? WHERE id = ? AND state = \(SubmissionState.rejected.sql)",
                    arguments: [shorten(receipt), transaction.map(shorten), payload.map(shorten), id.uuidString])
                try await db.execute(sql: "DELETE FROM submission_receipt WHERE submissionId = ?", arguments: [id.uuidString])
            }
        } catch let error as OrderStoreError {
            throw error
        } catch {
            throw OrderStoreError(.unavailable, "\(error)")
        }
    }
}
