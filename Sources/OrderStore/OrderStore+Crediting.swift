import Foundation
import IAPCore
import Ledger

/// What crediting needs beyond the result itself.
public struct CreditPolicy: Sendable {
    /// What each product grants, and its type (which decides what a purchase is credited once
    /// by); nil credits every purchase once per transaction with its quantity only.
    public var catalog: Catalog?
    /// The topic exchange for `grant.created`, `grant.revoked` and `order.paid`; nil publishes none.
    public var eventsExchange: String?
    /// Which sandbox purchases are credited (notifications obey it as uploads do).
    public var sandbox: SandboxPolicy
    /// What a restore uploaded by another user than the owner does.
    public var restore: RestorePolicy

    /// Creates a policy.
    public init(
        catalog: Catalog? = nil, eventsExchange: String? = nil, sandbox: SandboxPolicy = .accept,
        restore: RestorePolicy = .keep
    ) {
        self.catalog = catalog
        self.eventsExchange = eventsExchange
        self.sandbox = sandbox
        self.restore = restore
    }

    /// The key `purchase` is credited once by: per transaction for consumables, per original
    /// transaction for non-consumables and non-renewing subscriptions, per billing period
    /// (web order line item) for auto-renewable subscriptions.
    public func creditKey(of purchase: VerifiedPurchase) -> String {
        typedCreditKey(of: purchase).stored
    }

    /// `creditKey(of:)` as its type.
    public func typedCreditKey(of purchase: VerifiedPurchase) -> CreditKey {
        CreditKey(of: purchase, type: catalog?.product(purchase.productId)?.type)
    }
}

extension ReasonCode {
    /// The product is not in the catalog: nothing to grant until a person decides.
    public static let unknownProduct = ReasonCode("unknown_product")
    /// The purchase names our order, but for another product.
    public static let productMismatch = ReasonCode("product_mismatch")
}

/// The upload a purchase came in, and the grants crediting it revoked (for the metrics).
final class Upload {
    let userId: String
    let submissionId: String
    let orderId: String?
    let transactionId: String?
    let bundleId: String
    /// Grants revoked while applying it (Apple's answer said refunded, or a restore moved one).
    var revocations = 0

    init(userId: String, submissionId: String, orderId: String?, transactionId: String?, bundleId: String) {
        self.userId = userId
        self.submissionId = submissionId
        self.orderId = orderId
        self.transactionId = transactionId
        self.bundleId = bundleId
    }
}

extension OrderStore {
    /// Credits one verified purchase once per credit key (see `CreditPolicy.creditKey`);
    /// binds it to its order; remembers and applies Apple's revocations whatever came first;
    /// holds it for review when it cannot be granted as is. Says what happened.
    static func credit(
        _ purchase: VerifiedPurchase, upload: Upload, policy: CreditPolicy, now: Date, in db: any SQLConnection
    ) throws -> (TransactionCreditState, ReasonCode?) {
        if purchase.isUpgraded == true { return (.superseded, nil) }
        let typedKey = policy.typedCreditKey(of: purchase)
        let key = typedKey.stored
        let evidence = purchase.ownershipEvidence
        // Apple's own answer says it is refunded or revoked: remembered, and applied to a grant.
        if let cancelled = purchase.cancellationDate,
            try recordRevocation(
                key: key, transactionId: purchase.transactionId, source: "apple_answer", at: cancelled, now: now, in: db)
        {
            if try revokeActiveGrant(
                key: key, reason: "revoked in Apple's answer", tag: "answer:\(upload.submissionId)", policy: policy, now: now,
                in: db)
            {
                upload.revocations += 1
            } else {
                // Nothing was credited: kept, so that Apple's reversal credits this upload.
                try recordBlocked(purchase, key: key, upload: upload, now: now, in: db)
            }
            return (.revoked, .purchaseRevoked)
        }
        if try revocationStands(key: key, in: db) {
            try recordBlocked(purchase, key: key, upload: upload, now: now, in: db)
            return (.revoked, .purchaseRevoked)
        }
        let exact = try db.cachedRow(
            sql: "SELECT userId, heldReason FROM purchase WHERE transactionId = ?", arguments: [purchase.transactionId])
        if let active = try db.cachedRow(
            sql: "SELECT * FROM grants WHERE creditKey = ? AND state = 'active'", arguments: [key])
        {
            let owner: String = active["userId"]
            if sameUser(owner, upload.userId) { return (.alreadyCredited, nil) }
            // The very transaction another user was credited with: a replay. Consumables are
            // keyed per transaction, so for them this is always the case.
            if exact.map({ !sameUser($0["userId"], upload.userId) }) ?? false
                || (active["transactionId"] as String) == purchase.transactionId || typedKey.isPerTransaction
            {
                return (.replayedFromOtherUser, nil)
            }
            // Only an upload Apple vouches for moves an entitlement; a lookup never does.
            switch evidence == .signedUpload ? policy.restore : .keep {
            case .keep:
                try audit(
                    actor: "system", action: "restore_kept_by_owner", subject: "transaction:\(purchase.transactionId)",
                    reason: "restored by \(upload.userId); \(key) stays with \(owner)",
                    details: ["owner": owner, "uploader": upload.userId, "creditKey": key], now: now, in: db)
                return (.ownedByOtherUser, nil)
            case .transfer:
                try transfer(active, to: upload, purchase: purchase, key: key, policy: policy, now: now, in: db)
                upload.revocations += 1
                return (.credited, nil)
            }
        }
        // Revoked by customer service (or Apple's revocation that nothing lifted): stays revoked.
        if try db.cachedRow(sql: "SELECT 1 FROM grants WHERE creditKey = ? LIMIT 1", arguments: [key]) != nil {
            return (.revoked, .purchaseRevoked)
        }
        if let exact {
            // Held for a person (whoever uploads it): nobody is credited, nobody may finish it.
            if let held: String = exact["heldReason"], held != "revoked" { return (.held, ReasonCode(held)) }
            if !sameUser(exact["userId"], upload.userId) { return (.replayedFromOtherUser, nil) }
            if let held: String = exact["heldReason"] { return (.held, ReasonCode(held)) }
            // Recorded and credited before, under a key of an older version: nothing new.
            return (.alreadyCredited, nil)
        }
        // Whose it is (Ledger's `Ownership`): the token Apple carries names one of our orders,
        // the subscription it renews has an owner, or the upload itself is Apple's word.
        var order: SQLRow?
        if let token = purchase.appAccountToken {
            order = try db.cachedRow(sql: "SELECT * FROM orders WHERE id = lower(?)", arguments: [token])
        }
        var subscriptionOwner: String?
        if case .billingPeriod = typedKey,
            let subscription = try db.cachedRow(
                sql: "SELECT userId FROM subscription WHERE originalTransactionId = ?", arguments: [purchase.originalTransactionId])
        {
            // NULL while only notifications, no credit, told of it.
            subscriptionOwner = subscription["userId"] as String?
        }
        let facts = Ownership.Facts(
            uploader: upload.userId, evidence: evidence, tokenOrderOwner: order?["userId"], subscriptionOwner: subscriptionOwner)
        let owner: String
        var movesSubscriptionFrom: String?
        switch Ownership.decide(facts, restore: policy.restore) {
        case .held(let reason):
            // Recorded nowhere but in the upload's answer: a lookup that proves nothing must not
            // make the purchase look like the uploader's to a later upload by its owner.
            try audit(
                actor: "system", action: "purchase_held", subject: "transaction:\(purchase.transactionId)",
                reason: reason.rawValue,
                details: [
                    "uploader": upload.userId, "productId": purchase.productId, "submissionId": upload.submissionId,
                    "evidence": evidence.rawValue,
                ],
                now: now, in: db)
            return (.held, reason)
        case .credit(let proven):
            owner = proven
        case .creditMovingSubscription(let from, let to):
            owner = to
            movesSubscriptionFrom = from
        }
        // The upload's own order (the client's word) binds only a purchase credited to the uploader.
        if order == nil, sameUser(owner, upload.userId), let orderId = upload.orderId {
            if upload.transactionId == purchase.transactionId {
                // The upload names both: an explicit binding, checked below like a token.
                order = try db.cachedRow(
                    sql: "SELECT * FROM orders WHERE id = lower(?) AND state = 'created' AND userId = ?",
                    arguments: [orderId, upload.userId])
            } else if upload.transactionId == nil, let purchased = purchase.purchaseDate {
                // Only the order: a receipt may also hold earlier purchases; bind the one made
                // after the order (a few minutes of clock skew allowed).
                order = try db.row(sql: """
                        SELECT * FROM orders WHERE id = lower(?) AND state = 'created' AND userId = ? AND productId = ?
                            AND createdAt <= ?
                        """,
                    arguments: [orderId, upload.userId, purchase.productId, purchased.addingTimeInterval(300)])
            }
        }
        var heldReason: ReasonCode?
        let product = policy.catalog?.product(purchase.productId)
        let unpaidOrder = order.map { ($0["state"] as String) == "created" } == true
        if policy.catalog != nil && product == nil {
            heldReason = .unknownProduct
        } else if let order, unpaidOrder, (order["productId"] as String) != purchase.productId {
            // A paid order's later periods (renewals, a plan change in the group) are not a mismatch.
            heldReason = .productMismatch
        }
        let boundOrder: String? = heldReason == nil && unpaidOrder ? order?["id"] : nil

        try db.executeCached(
            sql: """
                INSERT INTO purchase (transactionId, originalTransactionId, productId, quantity, environment, bundleId,
                    purchaseDate, userId, orderId, submissionId, appAccountToken, heldReason, creditedAt, creditKey,
                    webOrderLineItemId, expiresDate)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT (transactionId) DO NOTHING
                """,
            arguments: [
                purchase.transactionId, purchase.originalTransactionId, purchase.productId, max(purchase.quantity, 1),
                purchase.environment.rawValue, upload.bundleId, purchase.purchaseDate, owner,
                boundOrder, upload.submissionId, purchase.appAccountToken, heldReason?.rawValue, now, key,
                purchase.webOrderLineItemId, purchase.expiresDate,
            ])
        if db.changesCount == 0 {
            // Recorded meanwhile by another order service: the outcome is what that row says,
            // and nothing of this purchase has been written here.
            let recorded = try db.cachedRow(
                sql: "SELECT userId, heldReason FROM purchase WHERE transactionId = ?", arguments: [purchase.transactionId])
            guard let recorded else {
                throw SQLError(.serializationFailure, "purchase \(purchase.transactionId) conflicted but is not there")
            }
            if !sameUser(recorded["userId"], upload.userId) { return (.replayedFromOtherUser, nil) }
            if let held: String = recorded["heldReason"] { return (.held, ReasonCode(held)) }
            return (.alreadyCredited, nil)
        }
        if let heldReason {
            try audit(
                actor: "system", action: "purchase_held", subject: "transaction:\(purchase.transactionId)",
                reason: heldReason.rawValue, details: ["userId": owner, "productId": purchase.productId],
                now: now, in: db)
            // Held for whoever it turns out to be: nobody is credited yet, so nobody may finish it.
            return (.held, heldReason)
        }
        if let boundOrder {
            try db.executeCached(
                sql: "UPDATE orders SET state = 'paid', transactionId = ?, updatedAt = ? WHERE id = ?",
                arguments: [purchase.transactionId, now, boundOrder])
            try event(
                "order.paid",
                [
                    "orderId": .string(boundOrder), "userId": .string(owner), "productId": .string(purchase.productId),
                    "transactionId": .string(purchase.transactionId), "paidAt": .string(iso8601(now)),
                ], id: "order.paid:\(boundOrder)", policy: policy, now: now, in: db)
        }
        try grant(
            transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId,
            creditKey: key, userId: owner, productId: purchase.productId, orderId: boundOrder,
            quantity: max(purchase.quantity, 1), grant: product?.grant(quantity: purchase.quantity) ?? [:],
            environment: purchase.environment, source: "apple",
            expiresAt: product?.type == .autoRenewable ? purchase.expiresDate : nil, policy: policy, now: now, in: db)
        if product?.type == .autoRenewable || (product == nil && purchase.expiresDate != nil) {
            try recordSubscription(of: purchase, owner: owner, now: now, in: db)
        }
        if let from = movesSubscriptionFrom {
            try moveSubscription(purchase.originalTransactionId, from: from, to: owner, now: now, in: db)
        }
        if facts.tokenOrderOwner == nil, let subscriptionOwner, !sameUser(owner, upload.userId) {
            // A billing period of someone else's subscription: theirs, whoever uploads it.
            try audit(
                actor: "system", action: "period_credited_to_subscription_owner",
                subject: "transaction:\(purchase.transactionId)",
                reason: "a billing period of \(subscriptionOwner)'s subscription; uploaded by \(upload.userId)",
                details: ["owner": subscriptionOwner, "uploader": upload.userId, "creditKey": key], now: now, in: db)
            return (.ownedByOtherUser, nil)
        }
        if !sameUser(owner, upload.userId) {
            try audit(
                actor: "system", action: "credited_to_order_owner", subject: "transaction:\(purchase.transactionId)",
                reason: "the purchase names an order of \(owner); uploaded by \(upload.userId)",
                details: ["orderId": boundOrder ?? ""], now: now, in: db)
            return (.replayedFromOtherUser, nil)
        }
        return (.credited, nil)
    }

    /// `IAP_RESTORE=transfer`: the entitlement moves from its owner to the uploader of a
    /// restore: revoked for the one, granted to the other, one audit entry naming both.
    private static func transfer(
        _ active: SQLRow, to upload: Upload, purchase: VerifiedPurchase, key: String, policy: CreditPolicy, now: Date,
        in db: any SQLConnection
    ) throws {
        let previous: String = active["userId"]
        try revokeGrant(
            active, actor: "transfer", reason: "restored by \(upload.userId)",
            eventId: "grant.revoked:\(active["transactionId"] as String):transfer:\(upload.submissionId)", policy: policy,
            now: now, in: db, audited: false)
        if let earlier = try db.row(sql: "SELECT * FROM grants WHERE creditKey = ? AND userId = ?", arguments: [key, upload.userId])
        {
            // Moving back to a user who held it before: that grant is active again.
            try db.execute(
                sql: "UPDATE grants SET state = 'active', revokedAt = NULL, revokedBy = NULL WHERE id = ?",
                arguments: [earlier["id"] as Int64])
            try event(
                "grant.created",
                [
                    "transactionId": .string(earlier["transactionId"]), "originalTransactionId": .string(purchase.originalTransactionId),
                    "userId": .string(upload.userId), "productId": .string(earlier["productId"]), "orderId": .null,
                    "quantity": .int(earlier["quantity"]), "grant": .json(earlier["grantJSON"]),
                    "environment": .string(earlier["environment"]), "source": .string("transfer"),
                    "grantedAt": .string(iso8601(now)),
                ], id: "grant.created:\(earlier["transactionId"] as String):transfer:\(upload.submissionId)", policy: policy,
                now: now, in: db)
        } else {
            let product = policy.catalog?.product(purchase.productId)
            try grant(
                transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId, creditKey: key,
                userId: upload.userId, productId: purchase.productId, orderId: nil, quantity: active["quantity"],
                grant: product?.grant(quantity: active["quantity"]) ?? [:], environment: purchase.environment,
                source: "apple", expiresAt: active["expiresAt"], policy: policy, now: now, in: db)
        }
        // The restore's own transaction, unless it is recorded already.
        try db.execute(
            sql: """
                INSERT INTO purchase (transactionId, originalTransactionId, productId, quantity, environment, bundleId,
                    purchaseDate, userId, submissionId, appAccountToken, creditedAt, creditKey, webOrderLineItemId)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT (transactionId) DO NOTHING
                """,
            arguments: [
                purchase.transactionId, purchase.originalTransactionId, purchase.productId, max(purchase.quantity, 1),
                purchase.environment.rawValue, upload.bundleId, purchase.purchaseDate, upload.userId,
                upload.submissionId, purchase.appAccountToken, now, key, purchase.webOrderLineItemId,
            ])
        try audit(
            actor: "system", action: "grant_transferred", subject: "transaction:\(purchase.transactionId)",
            reason: "restored by \(upload.userId); moved from \(previous)",
            details: ["from": previous, "to": upload.userId, "creditKey": key], now: now, in: db)
        if case .billingPeriod? = CreditKey(stored: key) {
            // The subscription moves with its period, so that its renewals follow the new owner.
            try moveSubscription(purchase.originalTransactionId, from: previous, to: upload.userId, now: now, in: db)
        }
    }

    /// `IAP_RESTORE=transfer`: the subscription's owner becomes `to`, so that every later
    /// billing period is credited to them; audited.
    static func moveSubscription(
        _ originalTransactionId: String, from: String, to: String, now: Date, in db: any SQLConnection
    ) throws {
        try db.execute(
            sql: "UPDATE subscription SET userId = ?, updatedAt = ? WHERE originalTransactionId = ?",
            arguments: [to, now, originalTransactionId])
        try audit(
            actor: "system", action: "subscription_transferred", subject: "subscription:\(originalTransactionId)",
            reason: "restored by \(to); moved from \(from)", details: ["from": from, "to": to], now: now, in: db)
    }

    /// Writes a grant and its `grant.created` event.
    static func grant(
        transactionId: String, originalTransactionId: String, creditKey: String, userId: String, productId: String,
        orderId: String?, quantity: Int, grant: [String: Catalog.GrantValue], environment: AppStoreEnvironment,
        source: String, expiresAt: Date? = nil, policy: CreditPolicy, now: Date, in db: any SQLConnection
    ) throws {
        let grantJSON = String(decoding: try JSONEncoder.sorted.encode(grant), as: UTF8.self)
        try db.executeCached(
            sql: """
                INSERT INTO grants (transactionId, userId, productId, orderId, quantity, grantJSON, environment, source,
                    state, grantedAt, creditKey, originalTransactionId, expiresAt)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'active', ?, ?, ?, ?)
                ON CONFLICT (creditKey) WHERE state = 'active' DO NOTHING
                """,
            arguments: [
                transactionId, userId, productId, orderId, quantity, grantJSON, environment.rawValue, source, now,
                creditKey, originalTransactionId, expiresAt,
            ])
        guard db.changesCount == 1 else {
            // Never credit on an assumption: the credit key has an active grant already.
            // (Another writer's grant this transaction cannot see fails it with 40001 instead,
            // and it runs again.) The unit is undone, as a unique key's refusal would. The
            // conflict target is the index the look-up before read: under SERIALIZABLE no
            // other index is read, so no new conflicts between writers arise from it.
            throw SQLError(.uniqueViolation, "an active grant for \(creditKey) exists already")
        }
        try event(
            "grant.created",
            [
                "transactionId": .string(transactionId), "originalTransactionId": .string(originalTransactionId),
                "userId": .string(userId), "productId": .string(productId), "orderId": orderId.map(EventField.string) ?? .null,
                "quantity": .int(quantity), "grant": .json(grantJSON), "environment": .string(environment.rawValue),
                "source": .string(source), "grantedAt": .string(iso8601(now)),
            ], id: "grant.created:\(transactionId)", policy: policy, now: now, in: db)
    }

    /// Queues an event in the outbox, in the same transaction as the change it reports.
    static func event(
        _ name: String, _ fields: [String: EventField], id: String, policy: CreditPolicy, now: Date, in db: any SQLConnection
    ) throws {
        guard let exchange = policy.eventsExchange else { return }
        var body = fields
        body["event"] = .string(name)
        body["eventId"] = .string(id)
        // Not mandatory: an events exchange with no subscriber yet is fine.
        var message = OutboxMessage(exchange: exchange, routingKey: name, body: EventField.object(body), messageId: id)
        message.mandatory = false
        try insert(message, now: now, in: db)
    }

    /// Appends to the audit log.
    static func audit(
        actor: String, action: String, subject: String, reason: String, details: [String: String], now: Date,
        in db: any SQLConnection
    ) throws {
        let json = String(decoding: try JSONEncoder.sorted.encode(details), as: UTF8.self)
        try db.executeCached(
            sql: "INSERT INTO audit_log (at, actor, action, subject, reason, details) VALUES (?, ?, ?, ?, ?, ?)",
            arguments: [now, actor, action, subject, reason, json])
    }

    static func iso8601(_ date: Date) -> String {
        date.formatted(.iso8601.year().month().day().time(includingFractionalSeconds: true))
    }
}

extension JSONEncoder {
    static var sorted: JSONEncoder {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys]
        return encoder
    }
}

/// A value in an event's JSON body. Events are written by hand, keys sorted: building them
/// through `JSONSerialization` was the largest single cost of crediting a purchase.
enum EventField {
    case string(String)
    case int(Int)
    case null
    /// JSON written already (a grant as stored, by `JSONEncoder.sorted`).
    case json(String)

    /// `fields` as one JSON object, keys in byte order.
    static func object(_ fields: [String: EventField]) -> [UInt8] {
        var out: [UInt8] = [UInt8(ascii: "{")]
        for (index, key) in fields.keys.sorted(by: { $0.utf8.lexicographicallyPrecedes($1.utf8) }).enumerated() {
            if index > 0 { out.append(UInt8(ascii: ",")) }
            appendString(key, to: &out)
            out.append(UInt8(ascii: ":"))
            switch fields[key] ?? .null {
            case .string(let text): appendString(text, to: &out)
            case .int(let number): out.append(contentsOf: String(number).utf8)
            case .null: out.append(contentsOf: "null".utf8)
            case .json(let json): out.append(contentsOf: json.utf8)
            }
        }
        out.append(UInt8(ascii: "}"))
        return out
    }

    /// A JSON string: quotes, backslashes and control characters escaped; the rest as UTF-8.
    private static func appendString(_ text: String, to out: inout [UInt8]) {
        let hex = Array("0123456789abcdef".utf8)
        out.append(UInt8(ascii: "\""))
        for byte in text.utf8 {
            switch byte {
            case UInt8(ascii: "\""), UInt8(ascii: "\\"):
                out.append(UInt8(ascii: "\\"))
                out.append(byte)
            case UInt8(ascii: "\n"): out.append(contentsOf: "\\n".utf8)
            case UInt8(ascii: "\r"): out.append(contentsOf: "\\r".utf8)
            case UInt8(ascii: "\t"): out.append(contentsOf: "\\t".utf8)
            case 0..<0x20:
                out.append(contentsOf: "\\u00".utf8)
                out.append(hex[Int(byte >> 4)])
                out.append(hex[Int(byte & 0x0F)])
            default: out.append(byte)
            }
        }
        out.append(UInt8(ascii: "\""))
    }
}
