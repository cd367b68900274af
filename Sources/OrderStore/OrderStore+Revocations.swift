import Foundation
import IAPCore

extension OrderStore {
    /// Remembers that Apple took back what `key` credits (a refund or revocation, dated `at`),
    /// whether or not anything was credited yet. Returns whether the revocation stands: false
    /// when a reversal later than `at` lifted it already (an answer Apple signed before the
    /// reversal arrived after it).
    static func recordRevocation(
        key: String, transactionId: String, source: String, at revokedAt: Date, now: Date, in db: any SQLConnection
    ) throws -> Bool {
        if let row = try db.cachedRow(sql: "SELECT revokedAt, reversedAt FROM revocation WHERE creditKey = ?", arguments: [key]) {
            if let reversed: Date = row["reversedAt"] {
                guard reversed < revokedAt else { return false }
            } else {
                return true
            }
            try db.executeCached(
                sql: """
                    UPDATE revocation SET transactionId = ?, source = ?, revokedAt = ?, reversedAt = NULL, updatedAt = ?
                    WHERE creditKey = ?
                    """,
                arguments: [transactionId, source, revokedAt, now, key])
        } else {
            try db.executeCached(
                sql: """
                    INSERT INTO revocation (creditKey, transactionId, source, revokedAt, updatedAt)
                    VALUES (?, ?, ?, ?, ?)
                    """,
                arguments: [key, transactionId, source, revokedAt, now])
        }
        return true
    }

    /// Whether Apple's revocation of `key` stands (recorded and not reversed).
    static func revocationStands(key: String, in db: any SQLConnection) throws -> Bool {
        try db.cachedRow(sql: "SELECT 1 FROM revocation WHERE creditKey = ? AND reversedAt IS NULL", arguments: [key]) != nil
    }

    /// Lifts Apple's revocation of `key` (REFUND_REVERSED, signed by Apple at `reversedAt`);
    /// false when none stood. A revocation signed after the reversal stands. With none recorded
    /// (the REFUND it reverses is late), the reversal is remembered, so that a refund Apple
    /// signed before it takes nothing when it arrives (`recordRevocation`).
    static func liftRevocation(
        key: String, transactionId: String, at reversedAt: Date, now: Date, in db: any SQLConnection
    ) throws -> Bool {
        try db.executeCached(
            sql: """
                UPDATE revocation SET reversedAt = ?, updatedAt = ?
                WHERE creditKey = ? AND reversedAt IS NULL AND revokedAt <= ?
                """,
            arguments: [reversedAt, now, key, reversedAt])
        if db.changesCount > 0 { return true }
        try db.executeCached(
            sql: """
                INSERT INTO revocation (creditKey, transactionId, source, revokedAt, reversedAt, updatedAt)
                VALUES (?, ?, 'REFUND_REVERSED', ?, ?, ?) ON CONFLICT (creditKey) DO NOTHING
                """,
            arguments: [key, transactionId, reversedAt, reversedAt, now])
        return false
    }

    /// Revokes the active grant of `key`, if any, as Apple's doing (`grant.revoked`, audited);
    /// says whether there was one.
    @discardableResult
    static func revokeActiveGrant(
        key: String, reason: String, tag: String, policy: CreditPolicy, now: Date, in db: any SQLConnection
    ) throws -> Bool {
        guard let row = try db.cachedRow(sql: "SELECT * FROM grants WHERE creditKey = ? AND state = 'active'", arguments: [key])
        else { return false }
        try revokeGrant(
            row, actor: "apple", reason: reason, eventId: "grant.revoked:\(row["transactionId"] as String):\(tag)",
            policy: policy, now: now, in: db)
        return true
    }

    /// An upload that a standing revocation stopped: kept (held as `revoked`) so that Apple's
    /// reversal of the refund credits its uploader.
    static func recordBlocked(_ purchase: VerifiedPurchase, key: String, upload: Upload, now: Date, in db: any SQLConnection) throws {
        // Whose it is, as crediting would say: the user whose order Apple's token names, else the
        // uploader, when the upload proves it; a lookup claims nothing for a reversal to credit.
        let tokenOwner = try purchase.appAccountToken.flatMap {
            try String.fetchOne(db, sql: "SELECT userId FROM orders WHERE id = lower(?)", arguments: [$0])
        }
        guard tokenOwner != nil || purchase.ownershipEvidence == .signedUpload else { return }
        let owner = tokenOwner ?? upload.userId
        try db.executeCached(
            sql: """
                INSERT INTO purchase (transactionId, originalTransactionId, productId, quantity, environment, bundleId,
                    purchaseDate, userId, submissionId, appAccountToken, heldReason, creditedAt, creditKey,
                    webOrderLineItemId)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'revoked', ?, ?, ?) ON CONFLICT DO NOTHING
                """,
            arguments: [
                purchase.transactionId, purchase.originalTransactionId, purchase.productId, max(purchase.quantity, 1),
                purchase.environment.rawValue, upload.bundleId, purchase.purchaseDate, owner, upload.submissionId,
                purchase.appAccountToken, now, key, purchase.webOrderLineItemId,
            ])
    }

    /// A purchase row as the ledger reads a purchase (what crediting it by hand or by a
    /// reversal needs); `expiresDate` where the row has none.
    static func recordedPurchase(_ row: SQLRow, expiresDate: Date? = nil) -> VerifiedPurchase {
        let recordedEnd: Date? = row["expiresDate"]
        let purchased: Date? = row["purchaseDate"]
        let period: String? = row["webOrderLineItemId"]
        return VerifiedPurchase(
            transactionId: row["transactionId"], originalTransactionId: row["originalTransactionId"],
            productId: row["productId"], quantity: row["quantity"], purchaseDate: purchased,
            environment: AppStoreEnvironment(rawValue: row["environment"]) ?? .production,
            expiresDate: recordedEnd ?? expiresDate, webOrderLineItemId: period)
    }

    /// Records an auto-renewable subscription credited through any route: its owner (the
    /// first one credited), product, expiry and state, unless a newer state is recorded.
    static func recordSubscription(of purchase: VerifiedPurchase, owner: String, now: Date, in db: any SQLConnection) throws {
        let stateDate = purchase.signedDate ?? purchase.purchaseDate ?? now
        let state = (purchase.expiresDate ?? .distantFuture) > now ? "active" : "expired"
        try db.executeCached(
            sql: """
                INSERT INTO subscription (originalTransactionId, userId, productId, environment, state, expiresDate,
                    lastTransactionId, updatedAt, stateDate)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT (originalTransactionId) DO UPDATE SET
                    userId = coalesce(subscription.userId, excluded.userId),
                    productId = CASE WHEN excluded.stateDate >= coalesce(subscription.stateDate, '')
                        THEN excluded.productId ELSE subscription.productId END,
                    state = CASE WHEN excluded.stateDate >= coalesce(subscription.stateDate, '')
                        THEN excluded.state ELSE subscription.state END,
                    expiresDate = CASE WHEN excluded.stateDate >= coalesce(subscription.stateDate, '')
                        THEN coalesce(excluded.expiresDate, subscription.expiresDate) ELSE subscription.expiresDate END,
                    lastTransactionId = CASE WHEN excluded.stateDate >= coalesce(subscription.stateDate, '')
                        THEN excluded.lastTransactionId ELSE subscription.lastTransactionId END,
                    stateDate = CASE WHEN excluded.stateDate IS NULL THEN NULL
                        WHEN excluded.stateDate >= coalesce(subscription.stateDate, '') THEN excluded.stateDate
                        ELSE subscription.stateDate END,
                    updatedAt = excluded.updatedAt
                """,
            arguments: [
                purchase.originalTransactionId, owner, purchase.productId, purchase.environment.rawValue, state,
                purchase.expiresDate, purchase.transactionId, now, stateDate,
            ])
    }
}
