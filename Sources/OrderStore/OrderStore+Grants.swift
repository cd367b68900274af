public import Foundation
public import IAPCore
public import Ledger
import Store

extension OrderStore {
    /// Every grant of a user, oldest first.
    public func grants(ofUser userId: String) async throws -> [Grant] {
        try await database.read { db in
            try await db.rows(sql: "SELECT * FROM grants WHERE userId = ? ORDER BY id", arguments: [userId]
            ).map(Grant.init(row:))
        }
    }

    /// What `userId` may use at `now`: grants in force, live subscriptions, and consumable
    /// balances (numeric grant values of active consumable grants, summed; `catalog` says
    /// which products are consumable, and without one every grant without an expiry counts).
    public func entitlements(ofUser userId: String, catalog: Catalog?, now: Date = Date()) async throws -> Entitlements {
        try await Entitlements(
            grants: grants(ofUser: userId), subscriptions: subscriptions(ofUser: userId, now: now), catalog: catalog, at: now)
    }

    /// The grants for one Apple transaction: zero or one, by construction.
    public func grants(ofTransaction transactionId: String) async throws -> [Grant] {
        try await database.read { db in
            try await db.rows(sql: "SELECT * FROM grants WHERE transactionId = ?", arguments: [transactionId]
            ).map(Grant.init(row:))
        }
    }

    /// Counts submissions by state.
    public func submissionCounts() async throws -> [SubmissionState: Int] {
        try await database.read { db in
            var counts: [SubmissionState: Int] = [:]
            for row in try await db.rows(sql: "SELECT state, COUNT(*) AS n FROM submission GROUP BY state") {
                if let state = SubmissionState(rawValue: row["state"]) { counts[state] = row["n"] }
            }
            return counts
        }
    }

    /// For benchmarks: when each settled submission was accepted and settled, and its state.
    public func settlementTimes() async throws -> [(acceptedAt: Date, settledAt: Date, state: SubmissionState)] {
        try await database.read { db in
            try await db.rows(sql: "SELECT acceptedAt, updatedAt, state FROM submission WHERE state IN (\(SubmissionState.credited.sql), \(SubmissionState.rejected.sql), \(SubmissionState.needsReview.sql))"
            ).compactMap { row in
                SubmissionState(rawValue: row["state"]).map { (row["acceptedAt"], row["updatedAt"], $0) }
            }
        }
    }

    /// For the loss and duplicate check: of these transactions, how many have a grant, and
    /// how many grants they have in all (equal when nothing was credited twice).
    public func grantCoverage(of transactionIds: [String]) async throws -> (granted: Int, grants: Int) {
        try await database.read { db in
            var granted = 0
            var grants = 0
            for start in stride(from: 0, to: transactionIds.count, by: 500) {
                let chunk = Array(transactionIds[start..<min(start + 500, transactionIds.count)])
                let marks = sqlMarks(chunk.count)
                let row = try await db.row(sql: "SELECT COUNT(DISTINCT transactionId) AS d, COUNT(*) AS n FROM grants WHERE transactionId IN (\(marks))",
                    arguments: SQLArguments(chunk))!
                granted += row["d"] as Int
                grants += row["n"] as Int
            }
            return (granted, grants)
        }
    }
}

extension Grant {
    /// A `grants` row (with its purchase's `periodStart` when the query joined it).
    init(row: SQLRow) {
        self.init(
            id: row["id"], transactionId: row["transactionId"], userId: row["userId"], productId: row["productId"],
            orderId: row["orderId"], quantity: row["quantity"], grantJSON: row["grantJSON"], environment: row["environment"],
            source: row["source"], isActive: row["state"] == GrantState.active, grantedAt: row["grantedAt"],
            revokedAt: row["revokedAt"], revokedBy: row["revokedBy"], creditKey: row["creditKey"],
            originalTransactionId: row["originalTransactionId"], expiresAt: row["expiresAt"],
            gracePeriodExpiresAt: row["gracePeriodExpiresAt"], periodStart: row["periodStart"])
    }
}
