import Foundation
import IAPCore
import Ledger

extension CreditPolicy {
    /// What the ledger's rules read of the policy.
    public var ledger: LedgerPolicy { LedgerPolicy(catalog: catalog, sandbox: sandbox, restore: restore) }
}

extension OrderStore {
    /// The ledger's shell: reads the facts `event` needs, asks `Ledger.plan` what to do, and
    /// writes the plan, all in the caller's transaction.
    ///
    /// - Important: the facts are read in the transaction that writes the plan. A row found
    ///   where the facts said none was (another order service's commit this transaction could
    ///   not see) throws `serializationFailure`, and the unit runs again on fresh facts.
    static func applyLedger(_ event: LedgerEvent, policy: CreditPolicy, now: Date, in db: any SQLConnection) throws
        -> LedgerPlan
    {
        let rules = policy.ledger
        var recorded: LedgerFacts.Purchase?
        if case .manualGrant(let grant) = event, let transactionId = grant.transactionId {
            recorded = try db.cachedRow(sql: "SELECT * FROM purchase WHERE transactionId = ?", arguments: [transactionId])
                .map(purchaseFact)
        }
        let query = Ledger.query(for: event, policy: rules, recorded: recorded)
        let facts = try facts(for: query, event: event, in: db)
        let plan = Ledger.plan(event, facts: facts, policy: rules, now: now)
        for change in plan.changes {
            try write(change, policy: policy, now: now, in: db)
        }
        return plan
    }

    /// The rows `query` names.
    static func facts(for query: LedgerQuery, event: LedgerEvent, in db: any SQLConnection) throws -> LedgerFacts {
        var facts = LedgerFacts()
        if let transactionId = query.transactionId {
            facts.purchase = try db.cachedRow(sql: "SELECT * FROM purchase WHERE transactionId = ?", arguments: [transactionId])
                .map(purchaseFact)
        }
        if query.readsSubscription, query.originalTransactionId != nil {
            // A subscription's whole chain, with each period's start (upgrades, grace periods).
            facts.grants = try db.rows(
                sql: """
                    SELECT grants.*, purchase.purchaseDate AS periodStart FROM grants
                        LEFT JOIN purchase ON purchase.transactionId = grants.transactionId
                    WHERE grants.creditKey = ? OR grants.originalTransactionId = ? OR grants.transactionId = ?
                    ORDER BY grants.id
                    """,
                arguments: [query.creditKey, query.originalTransactionId, query.transactionId]
            ).map(grantFact)
        } else {
            // A one-time purchase: its key's grants only. Fewer index ranges read, so fewer
            // conflicts between order services crediting at once on PostgreSQL.
            facts.grants = try db.rows(
                sql: "SELECT * FROM grants WHERE creditKey = ? OR transactionId = ? ORDER BY id",
                arguments: [query.creditKey, query.transactionId]
            ).map(grantFact)
        }
        if let key = query.creditKey {
            facts.revocation = try db.cachedRow(sql: "SELECT * FROM revocation WHERE creditKey = ?", arguments: [key]).map(
                revocationFact)
        }
        if let original = query.originalTransactionId, query.readsSubscription {
            facts.subscription = try db.cachedRow(
                sql: "SELECT * FROM subscription WHERE originalTransactionId = ?", arguments: [original]
            ).map(subscriptionFact)
        }
        if let original = query.originalTransactionId, facts.subscription != nil {
            // The periods Apple told of while nobody owned their stretch of the chain, for the
            // credit that gives it an owner (and for whose stretch a period is).
            facts.unownedPeriods = try db.rows(
                sql: """
                    SELECT * FROM purchase WHERE originalTransactionId = ? AND heldReason IN ('owner_unknown', 'buyer_unknown')
                    ORDER BY purchaseDate, transactionId
                    """,
                arguments: [original]
            ).map(purchaseFact)
            if !facts.unownedPeriods.isEmpty {
                facts.unownedRevocations = try db.rows(
                    sql: """
                        SELECT * FROM revocation WHERE creditKey IN
                            (SELECT creditKey FROM purchase WHERE originalTransactionId = ?
                                AND heldReason IN ('owner_unknown', 'buyer_unknown'))
                        """,
                    arguments: [original]
                ).map(revocationFact)
            }
        }
        if case .notification = event, let key = query.creditKey, let original = query.originalTransactionId {
            facts.blocked = try db.rows(
                sql: "SELECT * FROM purchase WHERE creditKey = ? AND heldReason = 'revoked' ORDER BY creditedAt, rowid",
                arguments: [key]
            ).map(purchaseFact)
            facts.chainCreditedUser = try String.fetchOne(
                db,
                sql: """
                    SELECT userId FROM purchase WHERE transactionId = ? AND heldReason IS NULL
                    UNION ALL SELECT userId FROM purchase WHERE originalTransactionId = ? AND heldReason IS NULL LIMIT 1
                    """,
                arguments: [query.transactionId, original])
        }
        if let token = query.tokenOrderId {
            facts.tokenOrder = try order(token, in: db)
        }
        if let named = query.uploadOrderId {
            facts.uploadOrder = named.lowercased() == query.tokenOrderId?.lowercased() ? facts.tokenOrder : try order(named, in: db)
        }
        return facts
    }

    static func order(_ id: String, in db: any SQLConnection) throws -> LedgerFacts.Order? {
        try db.cachedRow(sql: "SELECT * FROM orders WHERE id = lower(?)", arguments: [id]).map {
            LedgerFacts.Order(
                id: $0["id"], userId: $0["userId"], productId: $0["productId"], state: $0["state"],
                transactionId: $0["transactionId"], createdAt: $0["createdAt"])
        }
    }

    static func purchaseFact(_ row: SQLRow) -> LedgerFacts.Purchase {
        LedgerFacts.Purchase(
            transactionId: row["transactionId"], originalTransactionId: row["originalTransactionId"],
            productId: row["productId"], quantity: row["quantity"],
            environment: AppStoreEnvironment(rawValue: row["environment"]) ?? .production, bundleId: row["bundleId"],
            purchaseDate: row["purchaseDate"], userId: row["userId"], orderId: row["orderId"],
            submissionId: row["submissionId"], appAccountToken: row["appAccountToken"], heldReason: row["heldReason"],
            creditedAt: row["creditedAt"], creditKey: row["creditKey"], webOrderLineItemId: row["webOrderLineItemId"],
            expiresDate: row["expiresDate"])
    }

    static func revocationFact(_ row: SQLRow) -> LedgerFacts.Revocation {
        LedgerFacts.Revocation(
            creditKey: row["creditKey"], transactionId: row["transactionId"], source: row["source"],
            revokedAt: row["revokedAt"], reversedAt: row["reversedAt"], fullyRevokedAt: row["fullyRevokedAt"],
            partlyRevokedAt: row["partlyRevokedAt"], revokedUnits: row["revokedUnits"])
    }

    static func grantFact(_ row: SQLRow) -> LedgerFacts.Grant {
        LedgerFacts.Grant(
            id: row["id"], transactionId: row["transactionId"], userId: row["userId"], productId: row["productId"],
            orderId: row["orderId"], quantity: row["quantity"], grantJSON: row["grantJSON"], environment: row["environment"],
            source: row["source"], isActive: (row["state"] as String) == "active", grantedAt: row["grantedAt"],
            revokedAt: row["revokedAt"], revokedBy: row["revokedBy"], creditKey: row["creditKey"],
            originalTransactionId: row["originalTransactionId"], expiresAt: row["expiresAt"],
            gracePeriodExpiresAt: row["gracePeriodExpiresAt"], periodStart: row["periodStart"])
    }

    static func subscriptionFact(_ row: SQLRow) -> LedgerFacts.Subscription {
        LedgerFacts.Subscription(
            originalTransactionId: row["originalTransactionId"], userId: row["userId"], productId: row["productId"],
            environment: row["environment"], state: row["state"], expiresDate: row["expiresDate"], autoRenew: row["autoRenew"],
            gracePeriodExpiresDate: row["gracePeriodExpiresDate"], lastTransactionId: row["lastTransactionId"],
            updatedAt: row["updatedAt"], stateDate: row["stateDate"], ownedSince: row["ownedSince"])
    }

    /// Writes one change of a plan.
    static func write(_ change: LedgerChange, policy: CreditPolicy, now: Date, in db: any SQLConnection) throws {
        switch change {
        case .recordPurchase(let row, let ifAbsent):
            try db.executeCached(
                sql: """
                    INSERT INTO purchase (transactionId, originalTransactionId, productId, quantity, environment, bundleId,
                        purchaseDate, userId, orderId, submissionId, appAccountToken, heldReason, creditedAt, creditKey,
                        webOrderLineItemId, expiresDate)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (transactionId) DO NOTHING
                    """,
                arguments: [
                    row.transactionId, row.originalTransactionId, row.productId, row.quantity, row.environment.rawValue,
                    row.bundleId, row.purchaseDate, row.userId, row.orderId, row.submissionId, row.appAccountToken,
                    row.heldReason, row.creditedAt, row.creditKey, row.webOrderLineItemId, row.expiresDate,
                ])
            if db.changesCount == 0, !ifAbsent {
                throw SQLError(.serializationFailure, "purchase \(row.transactionId) was recorded by another writer")
            }
        case .releasePurchase(let transactionId):
            try db.executeCached(sql: "UPDATE purchase SET heldReason = NULL WHERE transactionId = ?", arguments: [transactionId])
        case .claimPurchase(let row):
            try db.executeCached(
                sql: """
                    UPDATE purchase SET userId = ?, orderId = ?, submissionId = ?, appAccountToken = ?, heldReason = ?,
                        creditedAt = ?, creditKey = ?, quantity = ?, purchaseDate = ?, expiresDate = ?
                    WHERE transactionId = ? AND heldReason IN ('owner_unknown', 'buyer_unknown')
                    """,
                arguments: [
                    row.userId, row.orderId, row.submissionId, row.appAccountToken, row.heldReason, row.creditedAt,
                    row.creditKey, row.quantity, row.purchaseDate, row.expiresDate, row.transactionId,
                ])
            if db.changesCount == 0 {
                throw SQLError(.serializationFailure, "purchase \(row.transactionId) was claimed by another writer")
            }
        case .grant(let grant):
            try db.executeCached(
                sql: """
                    INSERT INTO grants (transactionId, userId, productId, orderId, quantity, grantJSON, environment, source,
                        state, grantedAt, creditKey, originalTransactionId, expiresAt)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'active', ?, ?, ?, ?)
                    ON CONFLICT (creditKey) WHERE state = 'active' DO NOTHING
                    """,
                arguments: [
                    grant.transactionId, grant.userId, grant.productId, grant.orderId, grant.quantity, grant.grantJSON,
                    grant.environment, grant.source, grant.grantedAt, grant.creditKey, grant.originalTransactionId,
                    grant.expiresAt,
                ])
            guard db.changesCount == 1 else {
                // Never credit on an assumption: the credit key has an active grant already.
                // (Another writer's grant this transaction cannot see fails it with 40001
                // instead, and it runs again.) The unit is undone, as a unique key's refusal
                // would. The conflict target is the index the facts were read by: under
                // SERIALIZABLE no other index is read, so no new conflicts between writers arise.
                throw SQLError(.uniqueViolation, "an active grant for \(grant.creditKey?.stored ?? grant.transactionId) exists already")
            }
        case .revokeGrant(let transactionId, let by, let at):
            try db.executeCached(
                sql: "UPDATE grants SET state = 'revoked', revokedAt = ?, revokedBy = ? WHERE transactionId = ?",
                arguments: [at, by, transactionId])
        case .reactivateGrant(let transactionId):
            try db.executeCached(
                sql: "UPDATE grants SET state = 'active', revokedAt = NULL, revokedBy = NULL WHERE transactionId = ?",
                arguments: [transactionId])
        case .reduceGrant(let transactionId, let quantity, let grantJSON):
            try db.executeCached(
                sql: "UPDATE grants SET quantity = ?, grantJSON = ? WHERE transactionId = ?",
                arguments: [quantity, grantJSON, transactionId])
        case .extendGrant(let transactionId, let date), .endGrant(let transactionId, let date):
            try db.executeCached(sql: "UPDATE grants SET expiresAt = ? WHERE transactionId = ?", arguments: [date, transactionId])
        case .setGracePeriod(let transactionId, let until):
            try db.executeCached(
                sql: "UPDATE grants SET gracePeriodExpiresAt = ? WHERE transactionId = ?", arguments: [until, transactionId])
        case .bindOrder(let orderId, let transactionId, let at):
            try db.executeCached(
                sql: "UPDATE orders SET state = 'paid', transactionId = ?, updatedAt = ? WHERE id = ?",
                arguments: [transactionId, at, orderId])
        case .attachOrder(let orderId, let transactionId):
            try db.executeCached(
                sql: "UPDATE purchase SET orderId = ? WHERE transactionId = ? AND orderId IS NULL", arguments: [orderId, transactionId])
            try db.executeCached(
                sql: "UPDATE grants SET orderId = ? WHERE transactionId = ? AND orderId IS NULL", arguments: [orderId, transactionId])
        case .setOrderState(let orderId, let transactionId, let state, let at):
            try db.executeCached(
                sql: "UPDATE orders SET state = ?, updatedAt = ? WHERE id = ? AND transactionId = ?",
                arguments: [state, at, orderId, transactionId])
        case .putRevocation(let row):
            try db.executeCached(
                sql: """
                    INSERT INTO revocation (creditKey, transactionId, source, revokedAt, reversedAt, fullyRevokedAt,
                        partlyRevokedAt, revokedUnits, updatedAt)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (creditKey) DO UPDATE SET transactionId = excluded.transactionId, source = excluded.source,
                        revokedAt = excluded.revokedAt, reversedAt = excluded.reversedAt,
                        fullyRevokedAt = excluded.fullyRevokedAt, partlyRevokedAt = excluded.partlyRevokedAt,
                        revokedUnits = excluded.revokedUnits, updatedAt = excluded.updatedAt
                    """,
                arguments: [
                    row.creditKey, row.transactionId, row.source, row.revokedAt, row.reversedAt, row.fullyRevokedAt,
                    row.partlyRevokedAt, row.revokedUnits, now,
                ])
        case .putSubscription(let row):
            try db.executeCached(
                sql: """
                    INSERT INTO subscription (originalTransactionId, userId, productId, environment, state, expiresDate,
                        autoRenew, gracePeriodExpiresDate, lastTransactionId, updatedAt, stateDate, ownedSince)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (originalTransactionId) DO UPDATE SET userId = excluded.userId,
                        productId = excluded.productId, environment = excluded.environment, state = excluded.state,
                        expiresDate = excluded.expiresDate, autoRenew = excluded.autoRenew,
                        gracePeriodExpiresDate = excluded.gracePeriodExpiresDate,
                        lastTransactionId = excluded.lastTransactionId, updatedAt = excluded.updatedAt,
                        stateDate = excluded.stateDate, ownedSince = excluded.ownedSince
                    """,
                arguments: [
                    row.originalTransactionId, row.userId, row.productId, row.environment, row.state, row.expiresDate,
                    row.autoRenew, row.gracePeriodExpiresDate, row.lastTransactionId, row.updatedAt, row.stateDate,
                    row.ownedSince,
                ])
        case .recordConsumptionRequest(let request):
            try db.executeCached(
                sql: """
                    INSERT INTO consumption_request (notificationUUID, transactionId, userId, reason, environment, receivedAt)
                    VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING
                    """,
                arguments: [
                    request.notificationUUID, request.transactionId, request.userId, request.reason, request.environment,
                    request.receivedAt,
                ])
        case .audit(let entry):
            try audit(
                actor: entry.actor, action: entry.action, subject: entry.subject, reason: entry.reason,
                details: entry.details, now: entry.at, in: db)
        case .publish(let message):
            try event(message.name, message.fields, id: message.id, policy: policy, now: now, in: db)
        }
    }
}

/// A credit key is kept in its stored form (`txn:`, `otx:` or `wol:` and the id): the one place
/// where it becomes text and is read back.
extension CreditKey: SQLValueConvertible {
    package var sqlValue: SQLValue { .text(stored) }
    package static func fromSQL(_ value: SQLValue) -> CreditKey? { String.fromSQL(value).flatMap(CreditKey.init(stored:)) }
}

/// A reason is kept as its word (`owner_unknown`, `revoked`, …), as the error catalogue names it.
extension ReasonCode: SQLValueConvertible {
    package var sqlValue: SQLValue { .text(rawValue) }
    package static func fromSQL(_ value: SQLValue) -> ReasonCode? { String.fromSQL(value).map(ReasonCode.init(rawValue:)) }
}
