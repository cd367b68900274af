public import Foundation
public import IAPCore
import Ledger
import Store

/// A transaction the order service is to finish at Apple (Finish Transaction), queued in the
/// commit that settled it: a crash after that commit cannot skip it, and the row keeps it once.
public struct AppleFinish: Sendable, Equatable {
    /// Apple's transaction id.
    public var transactionId: String
    /// Where Apple issued it.
    public var environment: AppStoreEnvironment
    /// Calls made for it so far.
    public var attempts: Int

    /// Creates one.
    public init(transactionId: String, environment: AppStoreEnvironment, attempts: Int) {
        self.transactionId = transactionId
        self.environment = environment
        self.attempts = attempts
    }
}

/// Where a transaction's finish at Apple stands, for the status answer and the console.
public struct AppleFinishState: Sendable, Equatable {
    /// `queued`, `finished` or `refused`.
    public var state: String
    /// When Apple confirmed it.
    public var finishedAt: Date?
    /// Who finished it: `server` (Apple confirmed the order service's call) or `app` (the app
    /// reported it called `finish()`).
    public var finishedBy: String?
    /// Calls made so far.
    public var attempts: Int
    /// When the next call is due, while queued.
    public var dueAt: Date?
    /// Apple's last refusal or failure.
    public var lastError: String?
}

/// What the store made of the app's report that it finished a transaction.
public enum AppFinishReport: Sendable, Equatable {
    /// Recorded as finished by the app.
    case recorded
    /// Finished before (by the server or an earlier report): kept as it was.
    case alreadyFinished(by: String?)
    /// The app finished a transaction that is held (`reason`), not credited, which customer
    /// service has to settle by hand; `recorded` when it is a purchase recorded for the user
    /// (marked finished by the app), false when the user's upload carried it but proved no owner.
    case heldWhenFinished(reason: String, recorded: Bool)
}

/// The app reported finishing a transaction that is no purchase of the user's.
public struct AppFinishReportError: Error, Equatable, Sendable {}

/// What one Finish Transaction call came to.
public enum AppleFinishOutcome: Sendable, Equatable {
    /// Apple confirmed it: the transaction is finished.
    case finished
    /// Apple refused it for good (an id it does not know there); never asked again.
    case refused(String)
    /// Apple could not answer now: asked again at `at`.
    case retry(at: Date, error: String)
}

extension OrderStore {
    /// The statement that queues `transactionId` to be finished at Apple, once: a transaction
    /// queued (or finished) before stays as it is. Written in the commit that settled it.
    static func queueAppleFinish(_ transactionId: String, environment: String, now: Date) -> SQLStatement {
        SQLStatement(
            """
            INSERT INTO apple_finish (transactionId, environment, state, queuedAt, dueAt, attempts)
            VALUES (?, ?, 'queued', ?, ?, 0) ON CONFLICT (transactionId) DO NOTHING
            """,
            [transactionId, environment, now, now], fills: .appleCalls)
    }

    /// The statement that queues `transactionId` to be finished at Apple only if it is a
    /// purchase Apple verified here (a row in `purchase`): for a grant by hand, which may name
    /// an Apple transaction id nobody checked (goodwill for a purchase that has not reached us,
    /// on the customer's word). Finishing such an id could finish another customer's consumable,
    /// which then leaves their receipts for good; a held purchase granted by hand was verified.
    static func queueAppleFinishOfVerifiedPurchase(_ transactionId: String, environment: String, now: Date) -> SQLStatement {
        SQLStatement(
            """
            INSERT INTO apple_finish (transactionId, environment, state, queuedAt, dueAt, attempts)
            SELECT ?, ?, 'queued', ?, ?, 0 WHERE EXISTS (SELECT 1 FROM purchase WHERE transactionId = ?)
            ON CONFLICT (transactionId) DO NOTHING
            """,
            [transactionId, environment, now, now, transactionId], fills: .appleCalls)
    }

    /// The queued finishes that are due, at most `limit`, oldest due first, claimed for
    /// `worker` until `lease` has passed: several order services share a PostgreSQL store, and
    /// a row another one holds is skipped (`FOR UPDATE SKIP LOCKED`); a worker that died lets
    /// its claims lapse.
    public func claimDueFinishes(
        limit: Int, worker: String, lease: TimeInterval = 60, now: Date = Date()
    ) async throws -> [AppleFinish] {
        try await claimDue(
            from: "apple_finish", key: "transactionId", columns: "transactionId, environment, attempts",
            queued: "state = 'queued'", limit: limit, worker: worker, lease: lease, now: now
        ).map { row in
            AppleFinish(
                transactionId: row["transactionId"],
                environment: AppStoreEnvironment(rawValue: row["environment"]) ?? .production, attempts: row["attempts"])
        }
    }

    /// The rows of `table` that are `queued` and due, at most `limit`, oldest due first, claimed
    /// for `worker` until `lease` has passed (by `key`): what the workers that call Apple take
    /// from their queues. On PostgreSQL a row another worker holds is skipped (`FOR UPDATE SKIP
    /// LOCKED`); a worker that died lets its claims lapse.
    func claimDue(
        from table: String, key: String, columns: String, queued: String, limit: Int, worker: String, lease: TimeInterval,
        now: Date
    ) async throws -> [SQLRow] {
        let lock = database.dialect == .postgres ? " FOR UPDATE OF \(table) SKIP LOCKED" : ""
        return try await database.writeQueues { db in
            let rows = try await db.rows(
                sql: """
                    SELECT \(columns) FROM \(table)
                    WHERE \(queued) AND dueAt <= ? AND (claimedUntil IS NULL OR claimedUntil < ? OR claimedBy = ?)
                    ORDER BY dueAt LIMIT ?\(lock)
                    """,
                arguments: [now, now, worker, limit])
            guard !rows.isEmpty else { return [] }
            let ids = rows.map { $0[key] as String }
            try await db.execute(
                sql: "UPDATE \(table) SET claimedBy = ?, claimedUntil = ? WHERE \(key) IN (\(sqlMarks(ids.count)))",
                arguments: SQLArguments(values: [worker.sqlValue, now.addingTimeInterval(lease).sqlValue] + ids.map(\.sqlValue)))
            return rows
        }
    }

    /// Records what Apple answered for `transactionId`'s finish, and lets go of the claim.
    public func recordFinish(_ transactionId: String, _ outcome: AppleFinishOutcome, now: Date = Date()) async throws {
        let statement: SQLStatement
        switch outcome {
        case .finished:
            statement = SQLStatement(
                """
                UPDATE apple_finish SET state = 'finished', finishedAt = ?, finishedBy = 'server', attempts = attempts + 1,
                    lastError = NULL, claimedBy = NULL, claimedUntil = NULL
                WHERE transactionId = ? AND state = 'queued'
                """, [now, transactionId])
        case .refused(let error):
            statement = SQLStatement(
                """
                UPDATE apple_finish SET state = 'refused', attempts = attempts + 1, lastError = ?, claimedBy = NULL,
                    claimedUntil = NULL
                WHERE transactionId = ? AND state = 'queued'
                """, [error, transactionId])
        case .retry(let at, let error):
            statement = SQLStatement(
                """
                UPDATE apple_finish SET dueAt = ?, attempts = attempts + 1, lastError = ?, claimedBy = NULL,
                    claimedUntil = NULL
                WHERE transactionId = ? AND state = 'queued'
                """, [at, error, transactionId])
        }
        try await database.writeQueues { db in try await db.executeBatch([statement]) }
    }

    /// Records that `userId`'s app finished `transactionId` (StoreKit's `finish()`): a queued
    /// server finish is no longer called, and the status answer and the console say `app`. A
    /// transaction finished before keeps who finished it first. Only a purchase recorded for
    /// `userId` is marked; a transaction id is a lookup, so anyone else's, or an unknown one, is
    /// `AppFinishReportError`. A held transaction the user's own upload carried, recorded for
    /// nobody (the upload proved no owner), is audited and reported, and marks nothing.
    public func reportAppFinish(userId: String, transactionId: String, now: Date = Date()) async throws -> AppFinishReport {
        try await database.write { db in
            guard
                let purchase = try await db.row(
                    sql: "SELECT userId, environment, heldReason FROM purchase WHERE transactionId = ?", arguments: [transactionId])
            else {
                let carried = try await db.row(
                    sql: """
                        SELECT submission_transaction.submissionId AS submissionId, submission_transaction.reason AS reason
                        FROM submission_transaction JOIN submission ON submission.id = submission_transaction.submissionId
                        WHERE submission_transaction.transactionId = ? AND submission.userId = ?
                            AND submission_transaction.state = 'held'
                        LIMIT 1
                        """, arguments: [transactionId, userId])
                guard let carried else { throw AppFinishReportError() }
                // Reported once is enough: the same report again writes nothing (a user cannot
                // grow the audit log by repeating it).
                if try await db.row(
                    sql: """
                        SELECT 1 FROM audit_log WHERE subject = ? AND action = 'transaction_finished_by_app' AND actor = ? LIMIT 1
                        """, arguments: ["transaction:\(transactionId)", "user:\(userId)"]) != nil
                {
                    return .alreadyFinished(by: "app")
                }
                let reason: String = carried["reason"] ?? "held"
                try await db.executeLater([
                    Self.auditStatement(
                        actor: "user:\(userId)", action: "transaction_finished_by_app", subject: "transaction:\(transactionId)",
                        reason: "reported by the app while held (\(reason))",
                        details: ["submissionId": carried["submissionId"] as String], now: now)
                ])
                return .heldWhenFinished(reason: reason, recorded: false)
            }
            guard sameUser(purchase["userId"], userId) else { throw AppFinishReportError() }
            if let finished = try await db.row(
                sql: "SELECT finishedBy FROM apple_finish WHERE transactionId = ? AND state = 'finished'", arguments: [transactionId])
            {
                return .alreadyFinished(by: finished["finishedBy"])
            }
            // Refunded before its upload: Apple said the purchase itself is void, so finishing it
            // loses nothing and is what the answer advised.
            let heldReason = (purchase["heldReason"] as String?).flatMap { $0 == ReasonCode.stoppedByRefund.rawValue ? nil : $0 }
            try await db.executeLater([
                // A server finish Apple confirmed meanwhile stays the server's.
                SQLStatement(
                    """
                    INSERT INTO apple_finish (transactionId, environment, state, queuedAt, dueAt, attempts, finishedAt, finishedBy)
                    VALUES (?, ?, 'finished', ?, ?, 0, ?, 'app')
                    ON CONFLICT (transactionId) DO UPDATE SET state = 'finished', finishedAt = excluded.finishedAt,
                        finishedBy = 'app', lastError = NULL, claimedBy = NULL, claimedUntil = NULL
                    WHERE apple_finish.state <> 'finished'
                    """, [transactionId, purchase["environment"] as String, now, now, now]),
                Self.auditStatement(
                    actor: "user:\(userId)", action: "transaction_finished_by_app", subject: "transaction:\(transactionId)",
                    reason: heldReason.map { "reported by the app while held (\($0))" } ?? "reported by the app", details: [:],
                    now: now),
            ])
            return heldReason.map { .heldWhenFinished(reason: $0, recorded: true) } ?? .recorded
        }
    }

    /// Where the finishes of `transactionIds` stand, by transaction id (absent: never queued).
    public func finishStates(of transactionIds: [String]) async throws -> [String: AppleFinishState] {
        guard !transactionIds.isEmpty else { return [:] }
        return try await database.read { db in try await Self.finishStates(of: transactionIds, in: db) }
    }

    static func finishStates(of transactionIds: [String], in db: any SQLConnection) async throws -> [String: AppleFinishState] {
        guard !transactionIds.isEmpty else { return [:] }
        var states: [String: AppleFinishState] = [:]
        for row in try await db.rows(
            sql: "SELECT * FROM apple_finish WHERE transactionId IN (\(sqlMarks(transactionIds.count)))",
            arguments: SQLArguments(transactionIds))
        {
            let queued = (row["state"] as String) == "queued"
            states[row["transactionId"]] = AppleFinishState(
                state: row["state"], finishedAt: row["finishedAt"], finishedBy: row["finishedBy"], attempts: row["attempts"],
                dueAt: queued ? row["dueAt"] : nil, lastError: row["lastError"])
        }
        return states
    }

    /// How many finishes are queued, and when the oldest of them was queued: the operators'
    /// gauge of how far the server's finishing lags.
    public func queuedFinishes() async throws -> (count: Int, oldest: Date?) {
        try await database.read { db in
            let row = try await db.row(sql: "SELECT count(*) AS n, min(queuedAt) AS oldest FROM apple_finish WHERE state = 'queued'")
            return (row.map { $0["n"] as Int } ?? 0, row.flatMap { $0["oldest"] as Date? })
        }
    }
}
