public import Foundation
public import IAPCore

/// The money rules: an event and the facts the store holds for its keys become a plan of
/// typed changes. No I/O, no clock (`now` is given), no database; each rule lives here once.
/// docs/ledger.md states the same rules in prose.
public enum Ledger {
    /// The rows whose facts `plan` needs for `event`. `recorded` is the purchase row of the
    /// transaction a manual grant names (its credit key is the stored one).
    public static func query(for event: LedgerEvent, policy: LedgerPolicy, recorded: LedgerFacts.Purchase? = nil)
        -> LedgerQuery
    {
        switch event {
        case .upload(let purchase, let upload):
            return query(forUploadOf: purchase, orderId: upload.orderId, policy: policy)
        case .notification(let notification, _):
            guard let purchase = notification.purchase else { return LedgerQuery() }
            var query = LedgerQuery(
                transactionId: purchase.transactionId, creditKey: policy.creditKey(of: purchase),
                originalTransactionId: purchase.originalTransactionId, tokenOrderId: purchase.appAccountToken)
            query.previousOriginalTransactionId = purchase.previousOriginalTransactionId
            return query
        case .manualGrant(let grant):
            if grant.transactionId == nil, let apple = grant.appleTransactionId {
                // Goodwill for an Apple purchase not uploaded yet: bound to the key it will have.
                return LedgerQuery(transactionId: apple, creditKey: policy.creditKey(of: grant.applePurchase))
            }
            guard let transactionId = grant.transactionId else { return LedgerQuery(transactionId: grant.goodwillId) }
            return LedgerQuery(
                transactionId: transactionId, creditKey: recorded.map { $0.creditKey ?? .transaction(transactionId) },
                originalTransactionId: recorded?.originalTransactionId)
        case .manualRevoke(let transactionId, _, _, _):
            return LedgerQuery(transactionId: transactionId)
        case .bind(let originalTransactionId, _, _, _, _):
            return LedgerQuery(originalTransactionId: originalTransactionId)
        case .naming(let naming):
            var query = LedgerQuery(
                transactionId: naming.missingTransactionId, uploadOrderId: naming.orderId, readsSubscription: false)
            query.readsOrderCandidates = naming.missingTransactionId == nil && naming.orderId != nil
            return query
        }
    }

    /// What crediting `purchase` from an upload that names `orderId` reads: known from the
    /// result alone, so a shell may read it along with the upload's own row.
    public static func query(forUploadOf purchase: VerifiedPurchase, orderId: String?, policy: LedgerPolicy) -> LedgerQuery {
        // Crediting reads a subscription only for what may be one (`credit`).
        let type = policy.catalog?.product(purchase.productId)?.type
        let key = policy.creditKey(of: purchase)
        var billingPeriod = false
        if case .billingPeriod = key { billingPeriod = true }
        var query = LedgerQuery(
            transactionId: purchase.transactionId, creditKey: key,
            originalTransactionId: purchase.originalTransactionId, tokenOrderId: purchase.appAccountToken,
            uploadOrderId: orderId,
            readsSubscription: billingPeriod || type == .autoRenewable || (type == nil && purchase.expiresDate != nil))
        query.previousOriginalTransactionId = purchase.previousOriginalTransactionId
        return query
    }

    /// The plan for `event` on `facts`: what to write, in order, and what it amounts to.
    public static func plan(_ event: LedgerEvent, facts: LedgerFacts, policy: LedgerPolicy, now: Date) -> LedgerPlan {
        var planner = Planner(facts: facts, policy: policy, now: now)
        let outcome: LedgerOutcome
        switch event {
        case .upload(let purchase, let upload):
            let (state, reason) = planner.credit(purchase, upload: upload)
            outcome = .transaction(state, reason)
        case .notification(let notification, let submissionId):
            outcome = .notification(planner.apply(notification, submissionId: submissionId))
        case .manualGrant(let grant):
            outcome = planner.grantByHand(grant)
        case .manualRevoke(let transactionId, let actor, let reason, let tag):
            outcome = planner.revokeByHand(transactionId, actor: actor, reason: reason, tag: tag)
        case .bind(let originalTransactionId, let userId, let orderId, let actor, let reason):
            outcome = planner.bindByHand(originalTransactionId, to: userId, orderId: orderId, actor: actor, reason: reason)
        case .naming(let naming):
            outcome = .naming(planner.plan(naming))
        }
        if case .refused = outcome { return LedgerPlan(changes: [], outcome: outcome, revoked: 0) }
        return LedgerPlan(changes: planner.changes, outcome: outcome, revoked: planner.revoked)
    }

    /// Whether Apple's `ownershipType` says someone else paid: a seat an organization assigned
    /// (`ASSIGNED`) or a family member's shared access (`FAMILY_SHARED`). Such access pays no
    /// order.
    public static func accessPaidByOthers(_ ownershipType: String?) -> Bool {
        ownershipType == "ASSIGNED" || ownershipType == "FAMILY_SHARED"
    }

    /// Actor names that stand for the ledger's own doings; a person's name never takes them.
    public static let reservedActors: Set<String> = ["apple", "transfer", "system", "reconciliation"]

    /// ISO 8601 with milliseconds, as events carry dates.
    public static func iso8601(_ date: Date) -> String { DateText.format(date) }

    /// A grant's JSON as stored: keys sorted.
    public static func grantJSON(_ grant: [String: Catalog.GrantValue]) -> String {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys]
        return (try? encoder.encode(grant)).map { String(decoding: $0, as: UTF8.self) } ?? "{}"
    }

    /// How many of `quantity` units a prorated refund of `percentage` (Apple's milli-units of
    /// 100 %, 100,000 for all) took back: rounded to the nearest unit, at least one.
    public static func refundedUnits(of quantity: Int, percentage: Int) -> Int {
        // Apple's share is 0…100,000; anything else from outside is taken as its nearest bound.
        let share = Int64(min(max(percentage, 0), 100_000))
        let units = (Int64(min(max(quantity, 0), VerifiedPurchase.maxQuantity)) * share + 50_000) / 100_000
        return Int(min(max(units, 1), Int64(quantity)))
    }
}

/// One plan in the making: the facts as the changes so far left them.
struct Planner {
    var facts: LedgerFacts
    let policy: LedgerPolicy
    let now: Date
    var changes: [LedgerChange] = []
    var revoked = 0
    /// `now` as events carry it, formatted once a plan.
    let nowText: String

    init(facts: LedgerFacts, policy: LedgerPolicy, now: Date) {
        self.facts = facts
        self.policy = policy
        self.now = now
        nowText = Ledger.iso8601(now)
    }

    mutating func emit(_ change: LedgerChange) {
        changes.append(change)
        facts.apply(change)
    }

    mutating func audit(actor: String, action: String, subject: String, reason: String, details: [String: String] = [:]) {
        emit(.audit(.init(actor: actor, action: action, subject: subject, reason: reason, details: details, at: now)))
    }

    mutating func publish(_ name: String, _ fields: [String: EventField], id: String) {
        emit(.publish(.init(name: name, fields: fields, id: id)))
    }

    func product(_ id: String) -> Catalog.Product? { policy.catalog?.product(id) }
}

// MARK: - Revocations

extension Planner {
    /// Remembers that Apple took back what `key` credits (dated `at`; `units` of it for a
    /// prorated refund of a consumable), whether or not anything was credited yet. Each date
    /// is the latest of its kind, so the row is the same whatever order Apple's word arrived in.
    @discardableResult
    mutating func recordRevocation(key: CreditKey, transactionId: String, source: String, at revokedAt: Date, units: Int?) -> Bool {
        var row =
            facts.revocation?.creditKey == key
            ? facts.revocation!
            : LedgerFacts.Revocation(creditKey: key, transactionId: transactionId, source: source, revokedAt: revokedAt, reversedAt: nil)
        let before = facts.revocation?.creditKey == key ? facts.revocation : nil
        // A refund Apple reversed later takes nothing: the caller says `reversed_already`.
        if let reversed = before?.reversedAt, revokedAt <= reversed {
            return false
        }
        if revokedAt >= row.revokedAt || before == nil {
            row.revokedAt = revokedAt
            row.transactionId = transactionId
            row.source = source
        }
        if let units {
            if revokedAt > (row.partlyRevokedAt ?? .distantPast) {
                row.partlyRevokedAt = revokedAt
                row.revokedUnits = units
            } else if revokedAt == row.partlyRevokedAt {
                row.revokedUnits = max(row.revokedUnits ?? 0, units)
            }
        } else {
            row.fullyRevokedAt = max(row.fullyRevokedAt ?? revokedAt, revokedAt)
        }
        if row != before { emit(.putRevocation(row)) }
        return true
    }

    /// Remembers Apple's reversal of a refund of `key` (REFUND_REVERSED, signed at
    /// `reversedAt`); a refund signed after it still stands. With nothing recorded (the REFUND
    /// it reverses is late), the reversal alone is kept, so that a refund Apple signed no later
    /// than it takes nothing when it arrives.
    mutating func recordReversal(key: CreditKey, transactionId: String, at reversedAt: Date) {
        guard var row = facts.revocation, row.creditKey == key else {
            emit(
                .putRevocation(
                    .init(
                        creditKey: key, transactionId: transactionId, source: "REFUND_REVERSED", revokedAt: reversedAt,
                        reversedAt: reversedAt)))
            return
        }
        guard reversedAt > (row.reversedAt ?? .distantPast) else { return }
        row.reversedAt = reversedAt
        emit(.putRevocation(row))
    }

    /// Brings what `key` grants in line with Apple's word as recorded: revoked while a full
    /// refund stands; else in force (restored, or credited to the upload a refund stopped) with
    /// the units no prorated refund took. Says whether it took a grant back. Whatever order
    /// refunds and reversals arrive in, the grant ends as Apple's latest word says.
    @discardableResult
    mutating func settle(key: CreditKey, quantity: Int, reason: String, tag: String, purchase: VerifiedPurchase? = nil) -> Bool {
        let row = facts.revocation?.creditKey == key ? facts.revocation : nil
        if row?.standsFully == true {
            return revokeActiveGrant(key: key, reason: reason, tag: tag)
        }
        if facts.activeGrant(of: key) == nil {
            if let grant = facts.grants(of: key).filter({ !$0.isActive && $0.revokedBy == .apple })
                .max(by: { ($0.revokedAt ?? .distantPast, $0.id) < ($1.revokedAt ?? .distantPast, $1.id) })
            {
                restoreGrant(grant, tag: "\(grant.transactionId):\(tag)")
            } else if facts.grants(of: key).isEmpty, let blocked = facts.blocked.first, let purchase {
                // An upload a refund stopped: what the refund took is given back to its owner.
                creditBlocked(blocked, key: key, purchase: purchase)
            }
        }
        guard let active = facts.activeGrant(of: key) else { return false }
        let full = max(facts.purchase?.quantity ?? quantity, 1)
        let units = max(full - (row?.standingUnits ?? 0), 1)
        if units < active.quantity {
            reduce(active, toUnits: units, reason: reason, tag: tag)
        } else if units > active.quantity {
            // A prorated refund reversed: the grant is whole again.
            emit(
                .reduceGrant(
                    transactionId: active.transactionId, quantity: units,
                    grantJSON: Ledger.grantJSON(product(active.productId)?.grant(quantity: units) ?? [:])))
            audit(
                actor: "apple", action: "grant_restored", subject: "transaction:\(active.transactionId)", reason: "REFUND_REVERSED",
                details: ["userId": active.userId, "quantity": "\(units)"])
        }
        return false
    }

    /// Revokes the active grant of `key`, if any, as Apple's doing; says whether there was one.
    mutating func revokeActiveGrant(key: CreditKey, reason: String, tag: String) -> Bool {
        guard let grant = facts.activeGrant(of: key) else { return false }
        revokeGrant(grant, actor: "apple", reason: reason, eventId: "grant.revoked:\(grant.transactionId):\(tag)")
        return true
    }

    /// A prorated refund: the grant keeps `units` of its purchase; `grant.revoked` says how
    /// many were taken back.
    mutating func reduce(_ grant: Grant, toUnits units: Int, reason: String, tag: String) {
        guard units < grant.quantity else { return }
        let taken = grant.quantity - units
        let json = Ledger.grantJSON(product(grant.productId)?.grant(quantity: units) ?? [:])
        emit(.reduceGrant(transactionId: grant.transactionId, quantity: units, grantJSON: json))
        publish(
            "grant.revoked",
            [
                "transactionId": .string(grant.transactionId), "userId": .string(grant.userId),
                "productId": .string(grant.productId), "quantity": .int(taken),
                "grant": .json(Ledger.grantJSON(product(grant.productId)?.grant(quantity: taken) ?? [:])),
                "reason": .string(reason), "partial": .string("true"), "remainingQuantity": .int(units),
                "revokedAt": .string(nowText),
            ], id: "grant.revoked:\(grant.transactionId):\(tag)")
        audit(
            actor: "apple", action: "grant_reduced", subject: "transaction:\(grant.transactionId)", reason: reason,
            details: ["userId": grant.userId, "refundedUnits": "\(taken)", "remainingUnits": "\(units)"])
        revoked += 1
    }

    /// Revokes a grant: its order becomes refunded, `grant.revoked` is published, and the
    /// audit log says who and why.
    mutating func revokeGrant(_ grant: Grant, actor: String, reason: String, eventId: String, audited: Bool = true) {
        // What took it back, not who typed it: only Apple's revocations are undone by Apple's reversal.
        emit(.revokeGrant(transactionId: grant.transactionId, by: GrantRevoker(actor: actor), at: now))
        if let orderId = grant.orderId {
            emit(.setOrderState(orderId: orderId, transactionId: grant.transactionId, state: .refunded, at: now))
        }
        publish(
            "grant.revoked",
            [
                "transactionId": .string(grant.transactionId), "userId": .string(grant.userId),
                "productId": .string(grant.productId), "quantity": .int(grant.quantity), "grant": .json(grant.grantJSON),
                "reason": .string(reason), "revokedAt": .string(nowText),
            ], id: eventId)
        guard audited else { return }
        audit(
            actor: actor, action: "grant_revoked", subject: "transaction:\(grant.transactionId)", reason: reason,
            details: ["userId": grant.userId])
    }

    /// An upload that a standing revocation stopped: kept (held as `revoked`) so that Apple's
    /// reversal of the refund credits its owner. Whose it is, as crediting would say: the user
    /// whose order Apple's token names, else the uploader when the upload proves it; a lookup
    /// claims nothing for a reversal to credit.
    mutating func recordBlocked(_ purchase: VerifiedPurchase, key: CreditKey, upload: LedgerEvent.Upload) {
        let tokenOwner = purchase.appAccountToken != nil ? facts.tokenOrder?.userId : nil
        // Recorded only as a period Apple told of before anyone owned it: this proof claims it.
        let unowned = facts.purchase?.isUnowned == true
        guard tokenOwner != nil || purchase.ownershipEvidence == .signedUpload, facts.purchase == nil || unowned else { return }
        // A renewal after a new purchase nobody proved yet proves nothing of whose it is: it
        // stays kept for that purchase's buyer, as it would had it not been refunded.
        if case .billingPeriod = key, tokenOwner == nil, !purchase.isNewPurchaseInChain, stretchOwner(of: purchase) == .awaitsBuyer {
            return
        }
        // Named by a token for another product: held for a person, as it would be had it arrived
        // before the refund (a reversal never credits it).
        let mismatch = purchase.appAccountToken != nil && facts.tokenOrder.map { pays($0, purchase) && $0.productId != purchase.productId } == true
        var row = LedgerFacts.Purchase(
            transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId,
            productId: purchase.productId, quantity: max(purchase.quantity, 1), environment: purchase.environment,
            bundleId: upload.bundleId, purchaseDate: purchase.purchaseDate, userId: tokenOwner ?? upload.userId, orderId: nil,
            submissionId: upload.submissionId, appAccountToken: purchase.appAccountToken,
            heldReason: mismatch ? .productMismatch : .stoppedByRefund, creditedAt: now, creditKey: key,
            webOrderLineItemId: purchase.webOrderLineItemId, expiresDate: mismatch ? purchase.expiresDate : nil,
            ownershipType: purchase.ownershipType)
        if case .billingPeriod = key, !mismatch, purchase.isNewPurchaseInChain { row.beginsStretch = true }
        emit(unowned ? .claimPurchase(row) : .recordPurchase(row, ifAbsent: true))
        if case .billingPeriod = key {
            // Proven, though refunded: the subscription is theirs, as it would be had the period
            // been credited before the refund arrived.
            // A new purchase in the chain makes it theirs from it on only (`ownedSince`).
            let ownedSince = purchase.isNewPurchaseInChain ? purchase.purchaseDate : nil
            if var subscription = facts.subscription, subscription.originalTransactionId == purchase.originalTransactionId {
                if subscription.userId == nil {
                    subscription.userId = row.userId
                    subscription.ownedSince = ownedSince
                    emit(.putSubscription(subscription))
                } else if let ownedSince, let current = subscription.userId, ownedSince > (subscription.ownedSince ?? .distantPast) {
                    // A later new purchase, theirs: its renewals are theirs too.
                    moveSubscription(purchase.originalTransactionId, from: current, to: row.userId, boughtAt: ownedSince)
                }
            } else {
                recordSubscription(of: purchase, owner: row.userId)
                if let ownedSince, var subscription = facts.subscription {
                    subscription.ownedSince = ownedSince
                    emit(.putSubscription(subscription))
                }
            }
        }
    }
}
