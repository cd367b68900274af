public import Foundation
public import IAPCore
public import Ledger
import Store

/// One line of the append-only audit log.
public struct AuditEntry: Sendable, Equatable, Encodable {
    /// The entry's place in the log: later entries have larger ids.
    public var id: Int64
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

/// What the store knows of one Apple transaction, as customer service reads it (the admin
/// API, the console's work queue and customer page).
public struct PurchaseRecord: Sendable, Equatable, Encodable {
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
    /// When it was recorded.
    public var recordedAt: Date
    /// Its grant, if any (read for one purchase, not for lists).
    public var grant: Grant?

    private enum CodingKeys: String, CodingKey {
        case transactionId, originalTransactionId, productId, quantity, environment, userId, orderId, submissionId
        case heldReason, grant
    }
}

extension OrderStore {
    /// Creates an order for `userId`.
    public func createOrder(userId: String, productId: String, now: Date = Date()) async throws -> Order {
        let order = Order(
            id: UUID().uuidString.lowercased(), userId: userId, productId: productId, state: .created,
            transactionId: nil, createdAt: now)
        // A new row of its own: it waits for no other write of the ledger, and none for it.
        try await database.write(keys: ["order:" + order.id]) { db in
            try await db.execute(
                sql: "INSERT INTO orders (id, userId, productId, state, createdAt, updatedAt) VALUES (?, ?, ?, \(OrderState.created.sql), ?, ?)",
                arguments: [order.id, userId, productId, now, now])
        }
        return order
    }

    /// One order, or nil.
    public func order(_ orderId: String) async throws -> Order? {
        try await database.read { db in
            try await db.row(sql: "SELECT * FROM orders WHERE id = lower(?)", arguments: [orderId]).map(Order.init(row:))
        }
    }

    /// What the store knows of one Apple transaction.
    public func purchase(_ transactionId: String) async throws -> PurchaseRecord? {
        try await database.read { db in
            guard let row = try await db.row(sql: "SELECT * FROM purchase WHERE transactionId = ?", arguments: [transactionId])
            else { return nil }
            let grant = try await db.row(sql: "SELECT * FROM grants WHERE transactionId = ?", arguments: [transactionId])
                .map(Grant.init(row:))
            return PurchaseRecord(row: row, grant: grant)
        }
    }

    /// Grants by hand. With `transactionId` of a held purchase, grants that purchase to its
    /// owner; with `appleTransactionId` of an Apple purchase not uploaded yet, goodwill bound to
    /// what that purchase credits (its later upload is `already_credited`), keyed by the
    /// original transaction and environment Apple said (`appleSaid`) when it was asked; with neither, a
    /// goodwill grant under a new `manual-…` id. Audited.
    public func grantManually(
        userId: String, productId: String, quantity: Int, grant: [String: Catalog.GrantValue], transactionId: String?,
        appleTransactionId: String? = nil, appleSaid: (originalTransactionId: String, environment: AppStoreEnvironment)? = nil,
        actor: String, reason: String, policy: CreditPolicy, now: Date = Date()
    ) async throws(OrderStoreError) -> Grant {
        do {
            return try await database.write { db throws -> Grant in
                var request = LedgerEvent.ManualGrant(
                    userId: userId, productId: productId, quantity: quantity, grant: grant, transactionId: transactionId,
                    goodwillId: "manual-\(UUID().uuidString.lowercased())", actor: actor, reason: reason,
                    appleTransactionId: appleTransactionId)
                request.appleOriginalTransactionId = appleSaid?.originalTransactionId
                request.appleEnvironment = appleSaid?.environment
                return try await Self.grantByLedger(.manualGrant(request), policy: policy, now: now, in: db)
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
                let event = LedgerEvent.manualRevoke(
                    transactionId: transactionId, actor: actor, reason: reason, eventTag: UUID().uuidString.lowercased())
                return try await Self.grantByLedger(event, policy: policy, now: now, in: db)
            }
        } catch let error as OrderStoreError {
            throw error
        } catch {
            throw OrderStoreError(.unavailable, "\(error)")
        }
    }

    /// Lets the app finish a stuck submission's transactions (customer service settled it). Audited.
    /// With `finishAtApple` (the server finishes) what the upload named or carried, which the
    /// answer now lets the app finish, is queued to be finished at Apple too, but only what is
    /// a purchase recorded for the uploader: an id the upload merely named is a lookup, and the
    /// server's call, unlike the app's `finish()`, reaches any transaction of the app.
    public func markFinishable(_ id: SubmissionID, actor: String, reason: String, finishAtApple: Bool = false, now: Date = Date())
        async throws(OrderStoreError)
    {
        do {
            try await database.write { db in
                try await db.execute(sql: "UPDATE submission SET finishable = 1, updatedAt = ? WHERE id = ?", arguments: [now, id.uuidString])
                guard db.changesCount > 0 else { throw OrderStoreError(.notFound, "no submission \(id)") }
                if finishAtApple {
                    // What the upload named or carried, where it is the uploader's purchase.
                    let own = try await db.rows(
                        sql: """
                            SELECT purchase.transactionId AS transactionId, purchase.environment AS environment
                            FROM submission JOIN purchase ON purchase.userId = submission.userId
                            WHERE submission.id = ? AND (purchase.transactionId = submission.transactionId
                                OR purchase.transactionId IN (
                                    SELECT transactionId FROM submission_transaction WHERE submissionId = submission.id))
                            """, arguments: [id.uuidString])
                    try await db.executeLater(
                        own.map { Self.queueAppleFinish($0["transactionId"], environment: $0["environment"], now: now) })
                }
                try await Self.audit(
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
    public func auditLog(limit: Int, before: Int64? = nil) async throws -> [AuditEntry] {
        try await database.read { db in
            try await db.rows(
                sql: "SELECT * FROM audit_log WHERE id < ? ORDER BY id DESC LIMIT ?", arguments: [before ?? Int64.max, limit]
            ).map {
                AuditEntry(
                    id: $0["id"], at: $0["at"], actor: $0["actor"], action: $0["action"], subject: $0["subject"], reason: $0["reason"],
                    details: $0["details"])
            }
        }
    }
}

extension OrderStore {
    /// Applies customer service's grant or revocation through the ledger; the grant it wrote
    /// or took back, or the refusal as an `OrderStoreError`.
    static func grantByLedger(_ event: LedgerEvent, policy: CreditPolicy, now: Date, in db: any SQLConnection) async throws -> Grant {
        let plan = try await applyLedger(event, policy: policy, now: now, in: db)
        switch plan.outcome {
        case .grant(let transactionId):
            return try await Grant(row: db.row(sql: "SELECT * FROM grants WHERE transactionId = ?", arguments: [transactionId])!)
        case .refused(.notFound, let message):
            throw OrderStoreError(.notFound, message)
        case .refused(.conflict, let message):
            throw OrderStoreError(.conflict, message)
        case .transaction, .notification, .bound, .naming:
            preconditionFailure("the ledger answered an action by hand with \(plan.outcome)")
        }
    }

    /// Binds the subscription `originalTransactionId` to `userId`, whose order `orderId` is the
    /// token Apple now holds for it (Set App Account Token): its next renewals, restores and
    /// refunds follow them. Audited (`purchase_bound`).
    public func bindSubscription(
        _ originalTransactionId: String, to userId: String, orderId: String, actor: String, reason: String,
        policy: CreditPolicy, now: Date = Date()
    ) async throws(OrderStoreError) {
        do {
            try await database.write { db in
                let event = LedgerEvent.bind(
                    originalTransactionId: originalTransactionId, userId: userId, orderId: orderId, actor: actor, reason: reason)
                let plan = try await Self.applyLedger(event, policy: policy, now: now, in: db)
                switch plan.outcome {
                case .refused(.notFound, let message): throw OrderStoreError(.notFound, message)
                case .refused(.conflict, let message): throw OrderStoreError(.conflict, message)
                default: break
                }
            }
        } catch let error as OrderStoreError {
            throw error
        } catch {
            throw OrderStoreError(.unavailable, "\(error)")
        }
    }

    /// Customer service binds the subscription `originalTransactionId` to `userId`: a new order
    /// of theirs for its product, whose id `setToken` gives Apple as the purchase's
    /// `appAccountToken` (Set App Account Token), then the binding in the ledger
    /// (`bindSubscription`). Nothing is bound when Apple refuses (its error is thrown as it
    /// came); asking again after a failure in between binds it.
    public func bindPurchase(
        _ originalTransactionId: String, to userId: String, actor: String, reason: String, policy: CreditPolicy,
        setToken: (UUID, AppStoreEnvironment) async throws -> Void
    ) async throws -> Order {
        guard let subscription = try await subscription(originalTransactionId) else {
            throw OrderStoreError(.notFound, "no subscription \(originalTransactionId) in this store")
        }
        if let owner = subscription.userId, sameUser(owner, userId) {
            throw OrderStoreError(.conflict, "subscription \(originalTransactionId) is \(userId)'s already")
        }
        let order = try await createOrder(userId: userId, productId: subscription.productId)
        guard let token = UUID(uuidString: order.id) else {
            throw OrderStoreError(.unavailable, "order \(order.id) is no UUID")
        }
        try await setToken(token, AppStoreEnvironment(rawValue: subscription.environment) ?? .production)
        try await bindSubscription(originalTransactionId, to: userId, orderId: order.id, actor: actor, reason: reason, policy: policy)
        return order
    }

    /// The subscription of `originalTransactionId`: its product, environment and owner; nil when
    /// the store has none.
    public func subscription(_ originalTransactionId: String) async throws -> (productId: String, environment: String, userId: String?)? {
        try await database.read { db in
            try await db.row(
                sql: "SELECT productId, environment, userId FROM subscription WHERE originalTransactionId = ?",
                arguments: [originalTransactionId]
            ).map { ($0["productId"], $0["environment"], $0["userId"]) }
        }
    }
}
