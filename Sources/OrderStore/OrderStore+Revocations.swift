import Foundation
import IAPCore

extension OrderStore {
    /// Whether Apple's revocation of `key` stands (recorded and not reversed).
    static func revocationStands(key: String, in db: any SQLConnection) async throws -> Bool {
        try await db.cachedRow(sql: "SELECT 1 FROM revocation WHERE creditKey = ? AND (reversedAt IS NULL OR reversedAt < revokedAt)", arguments: [key]) != nil
    }
}
