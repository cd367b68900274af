public import Foundation
public import IAPCore
import Ledger

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
    /// For a subscription period: when it ends (Apple's `expiresDate`); nil for what never ends.
    public var expiresAt: Date? = nil
    /// For a subscription period in Apple's billing grace period: when the grace ends.
    public var gracePeriodExpiresAt: Date? = nil

    /// Whether the user may use it at `now` (`InForce.grant`: active, and not past its period
    /// or grace).
    public func isInForce(at now: Date) -> Bool {
        InForce.grant(isActive: state == "active", expiresAt: expiresAt, gracePeriodExpiresAt: gracePeriodExpiresAt, at: now)
    }
}

/// What a user may use right now: the one answer most apps need.
public struct Entitlements: Sendable, Equatable {
    /// Active grants, not past their period.
    public var grants: [Grant]
    /// Subscriptions not expired (active, in grace period or in billing retry before expiry).
    public var subscriptions: [SubscriptionRecord]
    /// Consumables credited, summed by what they grant (e.g. `["coins": 180]`).
    public var balances: [String: Int]
}

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
        let grants = try await grants(ofUser: userId).filter { $0.isInForce(at: now) }
        let subscriptions = try await subscriptions(ofUser: userId, now: now).filter { subscription in
            InForce.subscription(
                recorded: subscription.state, expiresDate: subscription.expiresDate,
                gracePeriodExpiresDate: subscription.gracePeriodExpiresDate, at: now)
        }
        var balances: [String: Int] = [:]
        for grant in grants {
            let type = catalog?.product(grant.productId)?.type
            guard type == .consumable || (catalog == nil && grant.expiresAt == nil) else { continue }
            guard let values = try? JSONDecoder().decode([String: Catalog.GrantValue].self, from: Data(grant.grantJSON.utf8))
            else { continue }
            for case let (name, .number(amount)) in values {
                let (sum, overflow) = balances[name, default: 0].addingReportingOverflow(amount)
                balances[name] = overflow ? (amount < 0 ? Int.min : Int.max) : sum
            }
        }
        return Entitlements(grants: grants, subscriptions: subscriptions, balances: balances)
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
            try await db.rows(sql: "SELECT acceptedAt, updatedAt, state FROM submission WHERE state IN ('credited', 'rejected', 'needs_review')"
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
    init(row: SQLRow) {
        self.init(
            transactionId: row["transactionId"], userId: row["userId"], productId: row["productId"],
            quantity: row["quantity"], state: row["state"], grantedAt: row["grantedAt"], orderId: row["orderId"],
            grantJSON: row["grantJSON"], environment: row["environment"], source: row["source"],
            expiresAt: row["expiresAt"], gracePeriodExpiresAt: row["gracePeriodExpiresAt"])
    }
}
