import Foundation
import IAPCore
import Ledger
import Store

extension OrderStore {
    /// Apple's refund or revocation of `key` as recorded, nil when there is none: whether it
    /// stands is the ledger's rule (`LedgerFacts.Revocation.stands`), never a query's.
    static func revocation(key: String, in db: any SQLConnection) async throws -> LedgerFacts.Revocation? {
        try await db.cachedRow(sql: "SELECT * FROM revocation WHERE creditKey = ?", arguments: [key]).map(revocationFact)
    }
}
