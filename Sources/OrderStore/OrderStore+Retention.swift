public import Foundation
import IAPCore
import Store

extension OrderStore {
    /// Rejected submissions deleted per transaction: a large purge takes the writer in short turns.
    static let retentionBatchSize = 500

    /// Deletes rejected submissions (uploads and notifications) last changed before
    /// `olderThan`, with what they carried (receipt, signed transaction, signed payload) and
    /// their per-transaction rows; returns how many were deleted. A submission that a purchase
    /// row or an applied notification names is kept, as is everything not `rejected`. One
    /// audit entry (actor `system`, action `retention_purge`) records each purge that deleted
    /// something; the audit log's own entries go by `purgeAuditEntries(olderThan:)`.
    public func purgeRejected(olderThan cutoff: Date, now: Date) async throws -> Int {
        var purged = 0
        while true {
            let deleted = try await database.write { db in
                // One purge at a time among the order services sharing the store.
                guard try await db.takeExclusive("retention") else { return 0 }
                let ids = try await String.fetchAll(
                    db,
                    sql: """
                        SELECT id FROM submission
                        WHERE state = \(SubmissionState.rejected.sql) AND updatedAt < ?
                            AND NOT EXISTS (SELECT 1 FROM purchase WHERE purchase.submissionId = submission.id)
                            AND NOT EXISTS (SELECT 1 FROM notification WHERE notification.submissionId = submission.id)
                        ORDER BY updatedAt LIMIT ?
                        """,
                    arguments: [cutoff, Self.retentionBatchSize])
                guard !ids.isEmpty else { return 0 }
                let list = sqlMarks(ids.count)
                try await db.execute(
                    sql: "DELETE FROM submission_transaction WHERE submissionId IN (\(list))", arguments: SQLArguments(ids))
                try await db.execute(
                    sql: "DELETE FROM submission_receipt WHERE submissionId IN (\(list))", arguments: SQLArguments(ids))
                try await db.execute(sql: "DELETE FROM submission WHERE id IN (\(list))", arguments: SQLArguments(ids))
                return db.changesCount
            }
            purged += deleted
            if deleted < Self.retentionBatchSize { break }
        }
        if purged > 0 {
            let count = purged
            try await database.write { db in
                try await Self.audit(
                    actor: "system", action: "retention_purge", subject: "submissions",
                    reason: "rejected submissions older than the retention period",
                    details: ["count": String(count), "olderThan": Self.iso8601(cutoff)], now: now, in: db)
            }
        }
        return purged
    }

    /// The audit entries that are about no money: consent reports, replays refused, purges,
    /// sign-outs. They may be deleted once older than the retention period (the schema's trigger
    /// refuses to delete any other entry); everything about money stays for ever.
    public static let auditActionsKeptForRetention = [
        "consumption_consent_given", "consumption_consent_withdrawn", "replay_refused", "retention_purge", "logout",
    ]

    /// Deletes the audit entries of ``auditActionsKeptForRetention`` older than `olderThan`;
    /// returns how many. No entry about money is ever touched.
    public func purgeAuditEntries(olderThan cutoff: Date) async throws -> Int {
        var purged = 0
        while true {
            let deleted = try await database.write { db in
                guard try await db.takeExclusive("retention") else { return 0 }
                let actions = Self.auditActionsKeptForRetention
                let ids: [Int64] = try await db.rows(
                    sql: """
                        SELECT id FROM audit_log WHERE at < ? AND action IN (\(sqlMarks(actions.count)))
                        ORDER BY id LIMIT ?
                        """, arguments: SQLArguments(values: [cutoff.sqlValue] + actions.map(\.sqlValue) + [Self.retentionBatchSize.sqlValue])
                ).map { $0["id"] }
                guard !ids.isEmpty else { return 0 }
                return try await db.execute(sql: "DELETE FROM audit_log WHERE id IN (\(sqlMarks(ids.count)))", arguments: SQLArguments(ids))
            }
            purged += deleted
            if deleted < Self.retentionBatchSize { break }
        }
        return purged
    }
}
