import Foundation
import IAPCore
public import Ledger
import Store

extension CreditPolicy {
    /// What the ledger's rules read of the policy.
    public var ledger: LedgerPolicy { LedgerPolicy(catalog: catalog, sandbox: sandbox, restore: restore) }
}

extension OrderStore {
    /// The ledger's shell: reads the facts `event` needs (unless the caller read them along
    /// with its own, `facts`), asks `Ledger.plan` what to do, and queues the plan's writes, all
    /// in the caller's transaction.
    ///
    /// - Important: the facts are read in the transaction that writes the plan. A row found
    ///   where the facts said none was (another order service's commit this transaction could
    ///   not see) throws `serializationFailure`, and the unit runs again on fresh facts.
    static func applyLedger(
        _ event: LedgerEvent, policy: CreditPolicy, now: Date, facts known: LedgerFacts? = nil, in db: any SQLConnection
    ) async throws -> LedgerPlan {
        let rules = policy.ledger
        let facts: LedgerFacts
        if let known {
            facts = known
        } else {
            var recorded: LedgerFacts.Purchase?
            if case .manualGrant(let grant) = event, let transactionId = grant.transactionId {
                recorded = try await db.cachedRow(sql: "SELECT * FROM purchase WHERE transactionId = ?", arguments: [transactionId])
                    .map(purchaseFact)
            }
            facts = try await Self.facts(for: Ledger.query(for: event, policy: rules, recorded: recorded), event: event, in: db)
        }
        let plan = Ledger.plan(event, facts: facts, policy: rules, now: now)
        // The whole plan in one batch, sent with what the unit sends next (on PostgreSQL, with
        // the rest of the unit's writes when nothing is read in between: one round trip).
        try await db.executeLater(plan.changes.flatMap { statements(for: $0, policy: policy, now: now) })
        return plan
    }

    /// The rows `query` names, read in one batch.
    static func facts(for query: LedgerQuery, event: LedgerEvent, in db: any SQLConnection) async throws -> LedgerFacts {
        var forNotification = false
        if case .notification = event { forNotification = true }
        let read = FactsRead(query, forNotification: forNotification)
        return read.facts(from: try await db.readBatch(read.queries))
    }

    /// The queries that read the rows a `LedgerQuery` names, sent as one batch (one round trip
    /// on PostgreSQL), and the facts made of their rows.
    struct FactsRead {
        private(set) var queries: [SQLStatement] = []
        private var purchase: Int?
        private var grants = 0
        private var revocation: Int?
        private var subscription: Int?
        private var unownedPeriods: Int?
        private var unownedRevocations: Int?
        private var blocked: Int?
        private var chainCreditedUser: Int?
        private var tokenOrder: Int?
        private var uploadOrder: Int?
        private var previousChain: Int?
        private var openOrders: Int?
        private var orderCandidates: Int?
        /// The upload names the order its token names: one read for both.
        private var uploadOrderIsTokenOrder = false

        /// `forNotification`: what applying a notification reads besides (revoked purchases of
        /// its key, whom the chain is credited to).
        init(_ query: LedgerQuery, forNotification: Bool) {
            func add(_ sql: String, _ arguments: SQLArguments) -> Int {
                queries.append(SQLStatement(sql, arguments))
                return queries.count - 1
            }
            if let transactionId = query.transactionId {
                purchase = add("SELECT * FROM purchase WHERE transactionId = ?", [transactionId])
            }
            if query.readsSubscription, query.originalTransactionId != nil {
                // A subscription's whole chain, with each period's start (upgrades, grace periods).
                grants = add(
                    """
                    SELECT grants.*, purchase.purchaseDate AS periodStart FROM grants
                        LEFT JOIN purchase ON purchase.transactionId = grants.transactionId
                    WHERE grants.creditKey = ? OR grants.originalTransactionId = ? OR grants.transactionId = ?
                    ORDER BY grants.id
                    """,
                    [query.creditKey, query.originalTransactionId, query.transactionId])
            } else {
                // A one-time purchase: its key's grants only. Fewer index ranges read, so fewer
                // conflicts between order services crediting at once on PostgreSQL.
                grants = add(
                    "SELECT * FROM grants WHERE creditKey = ? OR transactionId = ? ORDER BY id",
                    [query.creditKey, query.transactionId])
            }
            if let key = query.creditKey {
                revocation = add("SELECT * FROM revocation WHERE creditKey = ?", [key])
            }
            if let original = query.originalTransactionId, query.readsSubscription {
                subscription = add("SELECT * FROM subscription WHERE originalTransactionId = ?", [original])
            }
            if let original = query.originalTransactionId, query.readsSubscription {
                // The periods Apple told of while nobody owned their stretch of the chain, for the
                // credit that gives it an owner (and for whose stretch a period is), and the new
                // purchases in it that their buyer proved after a refund had stopped them: facts
                // only where the subscription is known, read along in case it is.
                unownedPeriods = add(
                    """
                    SELECT * FROM purchase WHERE originalTransactionId = ?
                        AND heldReason IN (\(ReasonCode.ownerUnknown.sql), \(ReasonCode.buyerUnknown.sql), \(ReasonCode.stoppedByRefund.sql))
                        AND EXISTS (SELECT 1 FROM subscription WHERE originalTransactionId = ?)
                    ORDER BY purchaseDate, transactionId
                    """,
                    [original, original])
                unownedRevocations = add(
                    """
                    SELECT * FROM revocation WHERE creditKey IN
                        (SELECT creditKey FROM purchase WHERE originalTransactionId = ?
                            AND heldReason IN (\(ReasonCode.ownerUnknown.sql), \(ReasonCode.buyerUnknown.sql)))
                        AND EXISTS (SELECT 1 FROM subscription WHERE originalTransactionId = ?)
                    """,
                    [original, original])
            }
            if forNotification, let key = query.creditKey, let original = query.originalTransactionId {
                blocked = add(
                    "SELECT * FROM purchase WHERE creditKey = ? AND heldReason = \(ReasonCode.stoppedByRefund.sql) ORDER BY creditedAt, rowid",
                    [key])
                chainCreditedUser = add(
                    """
                    SELECT userId FROM purchase WHERE transactionId = ? AND heldReason IS NULL
                    UNION ALL SELECT userId FROM purchase WHERE originalTransactionId = ? AND heldReason IS NULL LIMIT 1
                    """,
                    [query.transactionId, original])
            }
            if let token = query.tokenOrderId {
                tokenOrder = add(OrderStore.orderQuery, [token])
            }
            if let previous = query.previousOriginalTransactionId {
                previousChain = add("SELECT userId FROM subscription WHERE originalTransactionId = ?", [previous])
            }
            if query.readsOrderCandidates, let named = query.uploadOrderId {
                // The uploader's open orders of the named order's product, and their purchases
                // of it that pay no order yet and carry no token (a token names the order a
                // purchase was made for), newest first: those bought since the order was
                // placed are the newest (`Ledger.orderPurchase` keeps them), and a few are
                // enough to tell one from several.
                openOrders = add(
                    """
                    SELECT orders.* FROM orders JOIN orders AS named ON named.id = lower(?)
                    WHERE orders.userId = named.userId AND orders.productId = named.productId AND orders.state = \(OrderState.created.sql)
                    ORDER BY orders.createdAt, orders.id LIMIT 16
                    """,
                    [named])
                orderCandidates = add(
                    """
                    SELECT purchase.transactionId, purchase.originalTransactionId, purchase.productId, purchase.purchaseDate,
                        purchase.orderId, purchase.ownershipType,
                        EXISTS (SELECT 1 FROM grants WHERE grants.transactionId = purchase.transactionId
                            AND grants.userId = purchase.userId AND grants.state = \(GrantState.active.sql)) AS granted
                    FROM purchase JOIN orders AS named ON named.id = lower(?)
                    WHERE purchase.userId = named.userId AND purchase.productId = named.productId
                        AND purchase.orderId IS NULL AND purchase.heldReason IS NULL AND purchase.purchaseDate IS NOT NULL
                        AND purchase.appAccountToken IS NULL
                    ORDER BY purchase.purchaseDate DESC, purchase.transactionId LIMIT 16
                    """,
                    [named])
            }
            if let named = query.uploadOrderId {
                if named.lowercased() == query.tokenOrderId?.lowercased() {
                    uploadOrderIsTokenOrder = true
                } else {
                    uploadOrder = add(OrderStore.orderQuery, [named])
                }
            }
        }

        /// The facts, from the rows of `queries` (in their order).
        func facts(from sets: [[SQLRow]]) -> LedgerFacts {
            var facts = LedgerFacts()
            facts.purchase = purchase.flatMap { sets[$0].first }.map(OrderStore.purchaseFact)
            facts.grants = sets[grants].map(Grant.init(row:))
            facts.revocation = revocation.flatMap { sets[$0].first }.map(OrderStore.revocationFact)
            facts.subscription = subscription.flatMap { sets[$0].first }.map(Subscription.init(row:))
            if facts.subscription != nil {
                let periods = unownedPeriods.map { sets[$0].map(OrderStore.purchaseFact) } ?? []
                facts.unownedPeriods = periods.filter(\.isUnowned)
                facts.refundedPeriods = periods.filter { $0.heldReason == .stoppedByRefund && $0.beginsStretch }
                if !facts.unownedPeriods.isEmpty {
                    facts.unownedRevocations = unownedRevocations.map { sets[$0].map(OrderStore.revocationFact) } ?? []
                }
            }
            if let blocked { facts.blocked = sets[blocked].map(OrderStore.purchaseFact) }
            if let chainCreditedUser { facts.chainCreditedUser = sets[chainCreditedUser].first.flatMap { $0["userId"] } }
            facts.tokenOrder = tokenOrder.flatMap { sets[$0].first }.map(Order.init(row:))
            facts.previousChainOwner = previousChain.flatMap { sets[$0].first }.flatMap { $0["userId"] as String? }
            facts.uploadOrder =
                uploadOrderIsTokenOrder ? facts.tokenOrder : uploadOrder.flatMap { sets[$0].first }.map(Order.init(row:))
            if let openOrders { facts.openOrders = sets[openOrders].map(Order.init(row:)) }
            if let orderCandidates {
                facts.orderCandidates = sets[orderCandidates].map { row in
                    LedgerFacts.OrderCandidate(
                        transactionId: row["transactionId"], originalTransactionId: row["originalTransactionId"],
                        productId: row["productId"], purchaseDate: row["purchaseDate"], orderId: row["orderId"],
                        granted: row["granted"], ownershipType: row["ownershipType"])
                }
            }
            return facts
        }
    }

    static let orderQuery = "SELECT * FROM orders WHERE id = lower(?)"

    static func order(_ id: String, in db: any SQLConnection) async throws -> Order? {
        try await db.cachedRow(sql: orderQuery, arguments: [id]).map(Order.init(row:))
    }

    static func purchaseFact(_ row: SQLRow) -> LedgerFacts.Purchase {
        var purchase = LedgerFacts.Purchase(
            transactionId: row["transactionId"], originalTransactionId: row["originalTransactionId"],
            productId: row["productId"], quantity: row["quantity"],
            environment: AppStoreEnvironment(rawValue: row["environment"]) ?? .production, bundleId: row["bundleId"],
            purchaseDate: row["purchaseDate"], userId: row["userId"], orderId: row["orderId"],
            submissionId: row["submissionId"], appAccountToken: row["appAccountToken"], heldReason: row["heldReason"],
            creditedAt: row["creditedAt"], creditKey: row["creditKey"], webOrderLineItemId: row["webOrderLineItemId"],
            expiresDate: row["expiresDate"], ownershipType: row["ownershipType"])
        purchase.beginsStretch = row["beginsStretch"] ?? false
        return purchase
    }

    static func revocationFact(_ row: SQLRow) -> LedgerFacts.Revocation {
        LedgerFacts.Revocation(
            creditKey: row["creditKey"], transactionId: row["transactionId"], source: row["source"],
            revokedAt: row["revokedAt"], reversedAt: row["reversedAt"], fullyRevokedAt: row["fullyRevokedAt"],
            partlyRevokedAt: row["partlyRevokedAt"], revokedUnits: row["revokedUnits"])
    }
}

extension Order {
    /// An `orders` row.
    init(row: SQLRow) {
        self.init(
            id: row["id"], userId: row["userId"], productId: row["productId"], state: row["state"],
            transactionId: row["transactionId"], createdAt: row["createdAt"], updatedAt: row["updatedAt"])
    }
}

extension Subscription {
    /// A `subscription` row, its state as recorded.
    init(row: SQLRow) {
        self.init(
            originalTransactionId: row["originalTransactionId"], userId: row["userId"], productId: row["productId"],
            environment: row["environment"], state: row["state"], expiresDate: row["expiresDate"], autoRenew: row["autoRenew"],
            gracePeriodExpiresDate: row["gracePeriodExpiresDate"], lastTransactionId: row["lastTransactionId"],
            updatedAt: row["updatedAt"], stateDate: row["stateDate"], ownedSince: row["ownedSince"],
            renewal: OrderStore.renewalTerms(row))
    }
}

extension OrderStore {

    /// A subscription row's renewal terms; nil when Apple's renewal information never said any.
    static func renewalTerms(_ row: SQLRow) -> RenewalTerms? {
        var terms = RenewalTerms(
            autoRenewProductId: row["renewalProductId"], renewalPrice: row["renewalPrice"], currency: row["renewalCurrency"],
            offerType: row["renewalOfferType"], offerIdentifier: row["renewalOfferIdentifier"],
            offerDiscountType: row["renewalOfferDiscountType"], offerPeriod: row["renewalOfferPeriod"],
            priceIncreaseStatus: row["priceIncreaseStatus"])
        terms.billingPlanType = row["renewalBillingPlanType"]
        let commitment = CommitmentRenewal(
            autoRenewProductId: row["commitmentRenewalProductId"], autoRenewStatus: row["commitmentAutoRenewStatus"],
            billingPlanType: row["commitmentRenewalBillingPlanType"], renewalDate: row["commitmentRenewalDate"],
            renewalPrice: row["commitmentRenewalPrice"])
        terms.commitment = commitment == CommitmentRenewal() ? nil : commitment
        return terms == RenewalTerms() ? nil : terms
    }

    /// Writes one change of a plan.
    static func write(_ change: LedgerChange, policy: CreditPolicy, now: Date, in db: any SQLConnection) async throws {
        try await db.executeLater(statements(for: change, policy: policy, now: now))
    }

    /// The statements that write one change of a plan.
    static func statements(for change: LedgerChange, policy: CreditPolicy, now: Date) -> [SQLStatement] {
        switch change {
        case .recordPurchase(let row, let ifAbsent):
            let transactionId = row.transactionId
            return [
                SQLStatement(
                    """
                    INSERT INTO purchase (transactionId, originalTransactionId, productId, quantity, environment, bundleId,
                        purchaseDate, userId, orderId, submissionId, appAccountToken, heldReason, creditedAt, creditKey,
                        webOrderLineItemId, expiresDate, ownershipType, beginsStretch)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (transactionId) DO NOTHING
                    """,
                    [
                        row.transactionId, row.originalTransactionId, row.productId, row.quantity, row.environment.rawValue,
                        row.bundleId, row.purchaseDate, row.userId, row.orderId, row.submissionId, row.appAccountToken,
                        row.heldReason, row.creditedAt, row.creditKey, row.webOrderLineItemId, row.expiresDate, row.ownershipType,
                        row.beginsStretch,
                    ],
                    requiresChange: ifAbsent
                        ? nil : SQLError(.serializationFailure, "purchase \(transactionId) was recorded by another writer"))
            ]
        case .releasePurchase(let transactionId):
            return [SQLStatement("UPDATE purchase SET heldReason = NULL WHERE transactionId = ?", [transactionId])]
        case .claimPurchase(let row):
            let transactionId = row.transactionId
            return [
                SQLStatement(
                    """
                    UPDATE purchase SET userId = ?, orderId = ?, submissionId = ?, appAccountToken = ?, heldReason = ?,
                        creditedAt = ?, creditKey = ?, quantity = ?, purchaseDate = ?, expiresDate = ?, ownershipType = ?,
                        beginsStretch = ?
                    WHERE transactionId = ? AND heldReason IN (\(ReasonCode.ownerUnknown.sql), \(ReasonCode.buyerUnknown.sql))
                    """,
                    [
                        row.userId, row.orderId, row.submissionId, row.appAccountToken, row.heldReason, row.creditedAt,
                        row.creditKey, row.quantity, row.purchaseDate, row.expiresDate, row.ownershipType, row.beginsStretch,
                        row.transactionId,
                    ],
                    requiresChange: SQLError(.serializationFailure, "purchase \(transactionId) was claimed by another writer"))
            ]
        case .grant(let grant):
            let key = grant.creditKey?.stored ?? grant.transactionId
            // A credit settles its transaction: finished at Apple after this commit, when the
            // server finishes. A grant by hand only when Apple verified its purchase.
            let finish: [SQLStatement]
            if !policy.finishAtApple {
                finish = []
            } else if grant.source == .manual {
                finish = [queueAppleFinishOfVerifiedPurchase(grant.transactionId, environment: grant.environment, now: now)]
            } else {
                finish = [queueAppleFinish(grant.transactionId, environment: grant.environment, now: now)]
            }
            return [
                SQLStatement(
                    """
                    INSERT INTO grants (transactionId, userId, productId, orderId, quantity, grantJSON, environment, source,
                        state, grantedAt, creditKey, originalTransactionId, expiresAt)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, \(GrantState.active.sql), ?, ?, ?, ?)
                    ON CONFLICT (creditKey) WHERE state = \(GrantState.active.sql) DO NOTHING
                    """,
                    [
                        grant.transactionId, grant.userId, grant.productId, grant.orderId, grant.quantity, grant.grantJSON,
                        grant.environment, grant.source, grant.grantedAt, grant.creditKey, grant.originalTransactionId,
                        grant.expiresAt,
                    ],
                    // Never credit on an assumption: the credit key has an active grant already.
                    // The unit is undone, as a unique key's refusal would. (Two writers of one
                    // credit key hold its lock one after the other, so the second has read the
                    // first's grant: this guards the rule should a unit ever miss a key.)
                    requiresChange: SQLError(.uniqueViolation, "an active grant for \(key) exists already"))
            ] + finish
        case .revokeGrant(let transactionId, let by, let at):
            return [SQLStatement("UPDATE grants SET state = \(GrantState.revoked.sql), revokedAt = ?, revokedBy = ? WHERE transactionId = ?",
                [at, by, transactionId])]
        case .reactivateGrant(let transactionId):
            return [SQLStatement("UPDATE grants SET state = \(GrantState.active.sql), revokedAt = NULL, revokedBy = NULL WHERE transactionId = ?",
                [transactionId])]
        case .reduceGrant(let transactionId, let quantity, let grantJSON):
            return [SQLStatement("UPDATE grants SET quantity = ?, grantJSON = ? WHERE transactionId = ?",
                [quantity, grantJSON, transactionId])]
        case .extendGrant(let transactionId, let date), .endGrant(let transactionId, let date):
            return [SQLStatement("UPDATE grants SET expiresAt = ? WHERE transactionId = ?", [date, transactionId])]
        case .setGracePeriod(let transactionId, let until):
            return [SQLStatement("UPDATE grants SET gracePeriodExpiresAt = ? WHERE transactionId = ?", [until, transactionId])]
        case .bindOrder(let orderId, let transactionId, let at):
            return [SQLStatement("UPDATE orders SET state = \(OrderState.paid.sql), transactionId = ?, updatedAt = ? WHERE id = ?",
                [transactionId, at, orderId])]
        case .attachOrder(let orderId, let transactionId):
            return [
                SQLStatement("UPDATE purchase SET orderId = ? WHERE transactionId = ? AND orderId IS NULL", [orderId, transactionId]),
                SQLStatement("UPDATE grants SET orderId = ? WHERE transactionId = ? AND orderId IS NULL", [orderId, transactionId]),
            ]
        case .setOrderState(let orderId, let transactionId, let state, let at):
            return [SQLStatement("UPDATE orders SET state = ?, updatedAt = ? WHERE id = ? AND transactionId = ?",
                [state, at, orderId, transactionId])]
        case .putRevocation(let row):
            return [SQLStatement("""
                    INSERT INTO revocation (creditKey, transactionId, source, revokedAt, reversedAt, fullyRevokedAt,
                        partlyRevokedAt, revokedUnits, updatedAt)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (creditKey) DO UPDATE SET transactionId = excluded.transactionId, source = excluded.source,
                        revokedAt = excluded.revokedAt, reversedAt = excluded.reversedAt,
                        fullyRevokedAt = excluded.fullyRevokedAt, partlyRevokedAt = excluded.partlyRevokedAt,
                        revokedUnits = excluded.revokedUnits, updatedAt = excluded.updatedAt
                    """,
                [
                    row.creditKey, row.transactionId, row.source, row.revokedAt, row.reversedAt, row.fullyRevokedAt,
                    row.partlyRevokedAt, row.revokedUnits, now,
                ])]
        case .putSubscription(let row):
            return [SQLStatement("""
                    INSERT INTO subscription (originalTransactionId, userId, productId, environment, state, expiresDate,
                        autoRenew, gracePeriodExpiresDate, lastTransactionId, updatedAt, stateDate, ownedSince,
                        renewalProductId, renewalPrice, renewalCurrency, renewalOfferType, renewalOfferIdentifier,
                        renewalOfferDiscountType, renewalOfferPeriod, priceIncreaseStatus, renewalBillingPlanType,
                        commitmentRenewalProductId, commitmentAutoRenewStatus, commitmentRenewalBillingPlanType,
                        commitmentRenewalDate, commitmentRenewalPrice)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (originalTransactionId) DO UPDATE SET userId = excluded.userId,
                        productId = excluded.productId, environment = excluded.environment, state = excluded.state,
                        expiresDate = excluded.expiresDate, autoRenew = excluded.autoRenew,
                        gracePeriodExpiresDate = excluded.gracePeriodExpiresDate,
                        lastTransactionId = excluded.lastTransactionId, updatedAt = excluded.updatedAt,
                        stateDate = excluded.stateDate, ownedSince = excluded.ownedSince,
                        renewalProductId = excluded.renewalProductId, renewalPrice = excluded.renewalPrice,
                        renewalCurrency = excluded.renewalCurrency, renewalOfferType = excluded.renewalOfferType,
                        renewalOfferIdentifier = excluded.renewalOfferIdentifier,
                        renewalOfferDiscountType = excluded.renewalOfferDiscountType,
                        renewalOfferPeriod = excluded.renewalOfferPeriod, priceIncreaseStatus = excluded.priceIncreaseStatus,
                        renewalBillingPlanType = excluded.renewalBillingPlanType,
                        commitmentRenewalProductId = excluded.commitmentRenewalProductId,
                        commitmentAutoRenewStatus = excluded.commitmentAutoRenewStatus,
                        commitmentRenewalBillingPlanType = excluded.commitmentRenewalBillingPlanType,
                        commitmentRenewalDate = excluded.commitmentRenewalDate,
                        commitmentRenewalPrice = excluded.commitmentRenewalPrice
                    """,
                [
                    row.originalTransactionId, row.userId, row.productId, row.environment, row.state, row.expiresDate,
                    row.autoRenew, row.gracePeriodExpiresDate, row.lastTransactionId, row.updatedAt, row.stateDate,
                    row.ownedSince, row.renewal?.autoRenewProductId, row.renewal?.renewalPrice, row.renewal?.currency,
                    row.renewal?.offerType, row.renewal?.offerIdentifier, row.renewal?.offerDiscountType,
                    row.renewal?.offerPeriod, row.renewal?.priceIncreaseStatus, row.renewal?.billingPlanType,
                    row.renewal?.commitment?.autoRenewProductId, row.renewal?.commitment?.autoRenewStatus,
                    row.renewal?.commitment?.billingPlanType, row.renewal?.commitment?.renewalDate,
                    row.renewal?.commitment?.renewalPrice,
                ])]
        case .recordTerms(let transactionId, let terms):
            return [
                SQLStatement(
                    """
                    INSERT INTO purchase_terms (transactionId, price, currency, offerType, offerIdentifier, offerDiscountType,
                        offerPeriod, billingPlanType, appTransactionId, ownershipType, commitmentBillingPeriod,
                        commitmentTotalPeriods, commitmentExpiresDate, commitmentPrice)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (transactionId) DO NOTHING
                    """,
                    [
                        transactionId, terms.price, terms.currency, terms.offerType, terms.offerIdentifier, terms.offerDiscountType,
                        terms.offerPeriod, terms.billingPlanType, terms.appTransactionId, terms.ownershipType,
                        terms.commitment?.billingPeriodNumber, terms.commitment?.totalBillingPeriods,
                        terms.commitment?.commitmentExpiresDate, terms.commitment?.commitmentPrice,
                    ])
            ]
        case .recordConsumptionRequest(let request):
            return [SQLStatement("""
                    INSERT INTO consumption_request (notificationUUID, transactionId, userId, reason, environment, receivedAt,
                        ownershipType, deadline, answer, dueAt, attempts, creditKey, productType)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'queued', ?, 0, ?, ?) ON CONFLICT DO NOTHING
                    """,
                [
                    request.notificationUUID, request.transactionId, request.userId, request.reason, request.environment,
                    request.receivedAt, request.ownershipType, request.deadline, request.receivedAt, request.creditKey,
                    request.productType,
                ], fills: .appleCalls)]
        case .audit(let entry):
            return [
                auditStatement(
                    actor: entry.actor, action: entry.action, subject: entry.subject, reason: entry.reason,
                    details: entry.details, now: entry.at)
            ]
        case .publish(let message):
            return eventStatement(message.name, message.fields, id: message.id, policy: policy, now: now).map { [$0] } ?? []
        }
    }
}
