public import Foundation
import IAPCore
import Ledger
import Store

extension OrderStore {
    /// Gives grants credited before credit keys existed (keyed by their transaction) the key
    /// their product type calls for, so that a restore or a refund of such a purchase finds
    /// it. Runs once per catalog (the catalog decides the types); a grant whose new key is
    /// held by another grant keeps its old one. Returns how many grants were re-keyed.
    public func rekeyEarlierGrants(policy: CreditPolicy, now: Date = Date()) async throws -> Int {
        guard let catalog = policy.catalog else { return 0 }
        let task = "rekey:" + catalog.products.map { "\($0.productId)=\($0.type.rawValue)" }.sorted().joined(separator: ",")
        return try await database.write { db in
            guard try await db.row(sql: "SELECT 1 FROM reconciliation_run WHERE task = ?", arguments: [task]) == nil
            else { return 0 }
            var rekeyed = 0
            let rows = try await db.rows(sql: """
                    SELECT g.id, g.transactionId, g.userId, g.productId, g.state, g.originalTransactionId,
                        p.webOrderLineItemId
                    FROM grants g LEFT JOIN purchase p ON p.transactionId = g.transactionId
                    WHERE g.creditKey = 'txn:' || g.transactionId AND g.source = \(GrantSource.apple.sql)
                    ORDER BY g.id
                    """)
            for row in rows {
                let transactionId: String = row["transactionId"]
                let purchase = VerifiedPurchase(
                    transactionId: transactionId, originalTransactionId: row["originalTransactionId"] ?? transactionId,
                    productId: row["productId"], quantity: 1, purchaseDate: nil, environment: .production,
                    webOrderLineItemId: row["webOrderLineItemId"])
                let key = policy.creditKey(of: purchase)
                guard key != "txn:\(transactionId)" else { continue }
                try await db.execute(
                    sql: """
                        UPDATE grants SET creditKey = ? WHERE id = ? AND NOT EXISTS (
                            SELECT 1 FROM grants other WHERE other.creditKey = ?
                                AND (other.userId = ? OR (other.state = \(GrantState.active.sql) AND ? = \(GrantState.active.sql))))
                        """,
                    arguments: [key, row["id"] as Int64, key, row["userId"] as String, row["state"] as String])
                guard db.changesCount > 0 else { continue }
                try await db.execute(
                    sql: "UPDATE purchase SET creditKey = ? WHERE transactionId = ?", arguments: [key, transactionId])
                rekeyed += 1
            }
            try await db.execute(
                sql: "INSERT INTO reconciliation_run (task, lastRunAt) VALUES (?, ?)", arguments: [task, now])
            if rekeyed > 0 {
                try await Self.audit(
                    actor: "system", action: "grants_rekeyed", subject: "catalog", reason: "credit keys by product type",
                    details: ["count": "\(rekeyed)"], now: now, in: db)
            }
            return rekeyed
        }
    }
}
