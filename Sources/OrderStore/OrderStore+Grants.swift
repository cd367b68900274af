import Foundation
import GRDB
import IAPCore

/// One credit of one Apple transaction to one user.
public struct Grant: Sendable, Equatable {
    /// Apple's transaction id (unique among grants).
    public var transactionId: String
    /// The user credited.
    public var userId: String
    /// The product bought.
    public var productId: String
    /// Units bought.
    public var quantity: Int
    /// `active` or `revoked`.
    public var state: String
    /// When it was credited.
    public var grantedAt: Date
    /// Our order it paid, if it was bound to one.
    public var orderId: String?
    /// What it grants (quantity × the catalog's grant), as JSON.
    public var grantJSON: String
    /// Production or Sandbox.
    public var environment: String
    /// `apple` or `manual`.
    public var source: String
}

extension OrderStore {
    /// Every grant of a user, oldest first.
    public func grants(ofUser userId: String) async throws -> [Grant] {
        try await database.read { db in
            try Row.fetchAll(
                db, sql: "SELECT * FROM grants WHERE userId = ? ORDER BY id", arguments: [userId]
            ).map(Grant.init(row:))
        }
    }

    /// The grants for one Apple transaction: zero or one, by construction.
    public func grants(ofTransaction transactionId: String) async throws -> [Grant] {
        try await database.read { db in
            try Row.fetchAll(
                db, sql: "SELECT * FROM grants WHERE transactionId = ?", arguments: [transactionId]
            ).map(Grant.init(row:))
        }
    }

    /// Counts submissions by state.
    public func submissionCounts() async throws -> [SubmissionState: Int] {
        try await database.read { db in
            var counts: [SubmissionState: Int] = [:]
            for row in try Row.fetchAll(db, sql: "SELECT state, COUNT(*) AS n FROM submission GROUP BY state") {
                if let state = SubmissionState(rawValue: row["state"]) { counts[state] = row["n"] }
            }
            return counts
        }
    }
}

extension Grant {
    init(row: Row) {
        self.init(
            transactionId: row["transactionId"], userId: row["userId"], productId: row["productId"],
            quantity: row["quantity"], state: row["state"], grantedAt: row["grantedAt"], orderId: row["orderId"],
            grantJSON: row["grantJSON"], environment: row["environment"], source: row["source"])
    }
}
