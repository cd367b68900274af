public import Foundation
public import IAPCore
import Store

extension OrderStore {
    /// Finds submissions that made no progress and queues them again, in one transaction:
    /// `pending` ones untouched since `pendingBefore`, and `retrying` ones whose next attempt
    /// was due before `retryDueBefore` (their message was lost with a broker, or purged).
    /// Safe because applying a result twice changes nothing. Returns the re-queued requests.
    public func requeueStuck(
        pendingBefore: Date, retryDueBefore: Date, limit: Int, now: Date = Date(),
        message: @escaping @Sendable (VerifyRequest) throws -> OutboxMessage
    ) async throws -> [VerifyRequest] {
        try await database.write { db in
            // One sweeper at a time among the order services sharing the store.
            guard try await db.takeExclusive("sweeper") else { return [] }
            let rows = try await db.rows(sql: """
                    SELECT \(Self.submissionColumns) FROM \(StoredReceipt.source)
                    WHERE ((state = \(SubmissionState.pending.sql) AND updatedAt < ?) OR (state = \(SubmissionState.retrying.sql) AND nextAttemptAt < ?))
                        -- Still waiting in the outbox (broker away): not lost, do not copy it.
                        AND NOT EXISTS (SELECT 1 FROM outbox WHERE outbox.messageId = submission.id)
                    ORDER BY updatedAt LIMIT ?
                    """,
                arguments: [pendingBefore, retryDueBefore, limit])
            var requeued: [VerifyRequest] = []
            for row in rows {
                guard let id = UUID(uuidString: row["id"]) else { continue }
                let request = Self.nextAttempt(of: row, id: id)
                try await Self.insert(try message(request), now: now, in: db)
                try await db.execute(
                    sql: """
                        UPDATE submission SET updatedAt = ?,
                            nextAttemptAt = CASE WHEN state = \(SubmissionState.retrying.sql) THEN ? ELSE nextAttemptAt END
                        WHERE id = ?
                        """,
                    arguments: [now, now, id.uuidString])
                requeued.append(request)
            }
            return requeued
        }
    }

    /// Marks that an alert went out for a submission; true only the first time, so each
    /// submission alerts once.
    public func claimAlert(for id: SubmissionID, now: Date = Date()) async throws -> Bool {
        try await database.write { db in
            try await db.execute(
                sql: "UPDATE submission SET alertedAt = ? WHERE id = ? AND alertedAt IS NULL",
                arguments: [now, id.uuidString])
            return db.changesCount > 0
        }
    }
}

extension OrderStore {
    /// The columns of `submission` (read from `StoredReceipt.source`) that `nextAttempt(of:id:)` reads.
    static let submissionColumns = """
        id, userId, orderId, transactionId, originalTransactionId, productId, \(StoredReceipt.columns), signedTransaction,
        signedPayload, attempts, acceptedAt
        """

    /// The verify request for the next attempt at a stored submission (a row of `submission`
    /// with `submissionColumns`): everything the app uploaded, with the number of its attempt.
    static func nextAttempt(of row: SQLRow, id: SubmissionID) -> VerifyRequest {
        var request = VerifyRequest(
            submissionId: id, userId: row["userId"], receiptData: StoredReceipt.text(of: row),
            transactionId: row["transactionId"], orderId: row["orderId"],
            attempt: (row["attempts"] as Int) + 1, acceptedAt: row["acceptedAt"])
        request.signedTransaction = row["signedTransaction"]
        request.signedPayload = row["signedPayload"]
        request.originalTransactionId = row["originalTransactionId"]
        request.productId = row["productId"]
        return request
    }
}
