import Foundation
import IAPCore
import Ledger

/// Our order: what a user meant to buy, before Apple's transaction pays it.
public struct Order: Sendable, Equatable {
    /// A UUID, so it fits StoreKit 1's `applicationUsername` and StoreKit 2's `appAccountToken`.
    public var orderId: String
    /// Who ordered.
    public var userId: String
    /// The product ordered.
    public var productId: String
    /// `created`, `paid`, `cancelled` or `refunded`.
    public var state: String
    /// The Apple transaction that paid it.
    public var transactionId: String?
    /// When it was created.
    public var createdAt: Date
    /// When it last changed.
    public var updatedAt: Date
}

/// One line of the append-only audit log.
public struct AuditEntry: Sendable, Equatable {
    /// When.
    public var at: Date
    /// Who (an admin's name, or `system`).
    public var actor: String
    /// What (`grant_manual`, `grant_revoked`, `submission_finishable`, `replay_refused`, `purchase_held`).
    public var action: String
    /// On what (`transaction:…`, `submission:…`, `user:…`).
    public var subject: String
    /// Why.
    public var reason: String
    /// Details, as JSON.
    public var details: String?
}

/// What the store knows of one Apple transaction, for customer service.
public struct PurchaseRecord: Sendable, Equatable {
    /// Apple's transaction id.
    public var transactionId: String
    /// The first transaction of its chain.
    public var originalTransactionId: String
    /// The product.
    public var productId: String
    /// Units bought.
    public var quantity: Int
    /// Production or Sandbox.
    public var environment: String
    /// The user it belongs to.
    public var userId: String
    /// Our order it paid, if any.
    public var orderId: String?
    /// The upload that brought it.
    public var submissionId: String
    /// Why it is held, if it is.
    public var heldReason: String?
    /// Its grant, if any.
    public var grant: Grant?
}

extension OrderStore {
    /// Creates an order for `userId`.
    public func createOrder(userId: String, productId: String, now: Date = Date()) async throws -> Order {
        let order = Order(
            orderId: UUID().uuidString.lowercased(), userId: userId, productId: productId, state: "created",
            transactionId: nil, createdAt: now, updatedAt: now)
        try await database.write { db in
            try db.execute(
                sql: "INSERT INTO orders (id, userId, productId, state, createdAt, updatedAt) VALUES (?, ?, ?, 'created', ?, ?)",
                arguments: [order.orderId, userId, productId, now, now])
        }
        return order
    }

    /// One order, or nil.
    public func order(_ orderId: String) async throws -> Order? {
        try await database.read { db in
            try db.row(sql: "SELECT * FROM orders WHERE id = lower(?)", arguments: [orderId]).map {
                Order(
                    orderId: $0["id"], userId: $0["userId"], productId: $0["productId"], state: $0["state"],
                    transactionId: $0["transactionId"], createdAt: $0["createdAt"], updatedAt: $0["updatedAt"])
            }
        }
    }

    /// What the store knows of one Apple transaction.
    public func purchase(_ transactionId: String) async throws -> PurchaseRecord? {
        try await database.read { db in
            guard let row = try db.row(sql: "SELECT * FROM purchase WHERE transactionId = ?", arguments: [transactionId])
            else { return nil }
            let grant = try db.row(sql: "SELECT * FROM grants WHERE transactionId = ?", arguments: [transactionId])
                .map(Grant.init(row:))
            return PurchaseRecord(
                transactionId: row["transactionId"], originalTransactionId: row["originalTransactionId"],
                productId: row["productId"], quantity: row["quantity"], environment: row["environment"],
                userId: row["userId"], orderId: row["orderId"], submissionId: row["submissionId"],
                heldReason: row["heldReason"], grant: grant)
        }
    }

    /// Grants by hand. With `transactionId` of a held purchase, grants that purchase to its
    /// owner; without one, a goodwill grant under a new `manual-…` id. Audited.
    public func grantManually(
        userId: String, productId: String, quantity: Int, grant: [String: Catalog.GrantValue], transactionId: String?,
        actor: String, reason: String, policy: CreditPolicy, now: Date = Date()
    ) async throws(OrderStoreError) -> Grant {
        do {
            return try await database.write { db throws -> Grant in
                var id = "manual-\(UUID().uuidString.lowercased())"
                var environment = AppStoreEnvironment.production
                var original = id
                var creditKey = "txn:\(id)"
                var orderId: String?
                var expiresAt: Date?
                if let transactionId {
                    guard
                        let purchase = try db.row(sql: "SELECT * FROM purchase WHERE transactionId = ?", arguments: [transactionId])
                    else { throw OrderStoreError(.notFound, "no purchase \(transactionId)") }
                    guard (purchase["userId"] as String) == userId else {
                        throw OrderStoreError(.conflict, "purchase \(transactionId) belongs to another user")
                    }
                    guard try Int.fetchOne(db, sql: "SELECT COUNT(*) FROM grants WHERE transactionId = ?", arguments: [transactionId]) == 0
                    else { throw OrderStoreError(.conflict, "purchase \(transactionId) is granted already") }
                    id = transactionId
                    creditKey = purchase["creditKey"] ?? "txn:\(transactionId)"
                    guard try !Self.revocationStands(key: creditKey, in: db) else {
                        throw OrderStoreError(.conflict, "Apple refunded or revoked purchase \(transactionId)")
                    }
                    guard try db.row(sql: "SELECT 1 FROM grants WHERE creditKey = ? AND state = 'active'", arguments: [creditKey]) == nil
                    else { throw OrderStoreError(.conflict, "what purchase \(transactionId) buys is granted already") }
                    original = purchase["originalTransactionId"]
                    environment = AppStoreEnvironment(rawValue: purchase["environment"]) ?? .production
                    orderId = purchase["orderId"]
                    if case .billingPeriod? = CreditKey(stored: creditKey) {
                        // A subscription period granted by hand ends with the period Apple sold,
                        // and makes its subscription the user's (if nobody owned it yet).
                        expiresAt = purchase["expiresDate"]
                        try Self.recordSubscription(of: Self.recordedPurchase(purchase), owner: userId, now: now, in: db)
                    }
                    try db.execute(sql: "UPDATE purchase SET heldReason = NULL WHERE transactionId = ?", arguments: [transactionId])
                }
                try Self.grant(
                    transactionId: id, originalTransactionId: original, creditKey: creditKey, userId: userId,
                    productId: productId,
                    orderId: orderId, quantity: max(1, quantity), grant: grant, environment: environment, source: "manual",
                    expiresAt: expiresAt, policy: policy, now: now, in: db)
                try Self.audit(
                    actor: actor, action: "grant_manual", subject: "transaction:\(id)", reason: reason,
                    details: ["userId": userId, "productId": productId, "quantity": "\(max(1, quantity))"], now: now, in: db)
                return try Grant(row: db.row(sql: "SELECT * FROM grants WHERE transactionId = ?", arguments: [id])!)
            }
        } catch let error as OrderStoreError {
            throw error
        } catch {
            throw OrderStoreError(.unavailable, "\(error)")
        }
    }

    /// Revokes an active grant (refund, fraud), refunds its order, publishes `grant.revoked`. Audited.
    public func revoke(transactionId: String, actor: String, reason: String, policy: CreditPolicy, now: Date = Date())
        async throws(OrderStoreError) -> Grant
    {
        do {
            return try await database.write { db throws -> Grant in
                guard let row = try db.row(sql: "SELECT * FROM grants WHERE transactionId = ?", arguments: [transactionId])
                else { throw OrderStoreError(.notFound, "no grant for \(transactionId)") }
                guard (row["state"] as String) == "active" else {
                    throw OrderStoreError(.conflict, "the grant for \(transactionId) is revoked already")
                }
                try Self.revokeGrant(
                    row, actor: Self.reservedActors.contains(actor) ? "admin:\(actor)" : actor, reason: reason,
                    eventId: "grant.revoked:\(transactionId):admin:\(UUID().uuidString.lowercased())", policy: policy, now: now,
                    in: db)
                return try Grant(row: db.row(sql: "SELECT * FROM grants WHERE transactionId = ?", arguments: [transactionId])!)
            }
        } catch let error as OrderStoreError {
            throw error
        } catch {
            throw OrderStoreError(.unavailable, "\(error)")
        }
    }

    /// Lets the app finish a stuck submission's transactions (customer service settled it). Audited.
    public func markFinishable(_ id: SubmissionID, actor: String, reason: String, now: Date = Date())
        async throws(OrderStoreError)
    {
        do {
            try await database.write { db in
                try db.execute(sql: "UPDATE submission SET finishable = 1, updatedAt = ? WHERE id = ?", arguments: [now, id.uuidString])
                guard db.changesCount > 0 else { throw OrderStoreError(.notFound, "no submission \(id)") }
                try Self.audit(
                    actor: actor, action: "submission_finishable", subject: "submission:\(id.uuidString)", reason: reason,
                    details: [:], now: now, in: db)
            }
        } catch let error as OrderStoreError {
            throw error
        } catch {
            throw OrderStoreError(.unavailable, "\(error)")
        }
    }

    /// The newest audit entries first.
    public func auditLog(limit: Int) async throws -> [AuditEntry] {
        try await database.read { db in
            try db.rows(sql: "SELECT * FROM audit_log ORDER BY id DESC LIMIT ?", arguments: [limit]).map {
                AuditEntry(
                    at: $0["at"], actor: $0["actor"], action: $0["action"], subject: $0["subject"], reason: $0["reason"],
                    details: $0["details"])
            }
        }
    }
}

extension OrderStore {
    /// Actor names that stand for the ledger's own doings; a person's name never takes them.
    static let reservedActors: Set<String> = ["apple", "transfer", "system", "reconciliation"]

    /// Revokes an active grant (row of `grants`): its order becomes refunded, `grant.revoked`
    /// is published, and the audit log says who and why.
    static func revokeGrant(
        _ row: SQLRow, actor: String, reason: String, eventId: String, policy: CreditPolicy, now: Date, in db: any SQLConnection,
        audited: Bool = true
    ) throws {
        let transactionId: String = row["transactionId"]
        // What took it back, not who typed it: only Apple's revocations are undone by Apple's reversal.
        let revokedBy = ["apple", "transfer"].contains(actor) ? actor : "admin"
        try db.execute(
            sql: "UPDATE grants SET state = 'revoked', revokedAt = ?, revokedBy = ? WHERE transactionId = ?",
            arguments: [now, revokedBy, transactionId])
        if let orderId: String = row["orderId"] {
            try db.execute(
                sql: "UPDATE orders SET state = 'refunded', updatedAt = ? WHERE id = ? AND transactionId = ?",
                arguments: [now, orderId, transactionId])
        }
        try Self.event(
            "grant.revoked",
            [
                "transactionId": .string(transactionId), "userId": .string(row["userId"]),
                "productId": .string(row["productId"]), "quantity": .int(row["quantity"]),
                "grant": .json(row["grantJSON"]), "reason": .string(reason), "revokedAt": .string(Self.iso8601(now)),
            ], id: eventId, policy: policy, now: now, in: db)
        guard audited else { return }
        try Self.audit(
            actor: actor, action: "grant_revoked", subject: "transaction:\(transactionId)", reason: reason,
            details: ["userId": row["userId"] as String], now: now, in: db)
    }
}
