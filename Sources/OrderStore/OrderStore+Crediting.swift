import Foundation
import GRDB
import IAPCore

/// What crediting needs beyond the result itself.
public struct CreditPolicy: Sendable {
    /// What each product grants; nil credits every purchase with its quantity only (no catalog).
    public var catalog: Catalog?
    /// The topic exchange for `grant.created`, `grant.revoked` and `order.paid`; nil publishes none.
    public var eventsExchange: String?

    /// Creates a policy.
    public init(catalog: Catalog? = nil, eventsExchange: String? = nil) {
        self.catalog = catalog
        self.eventsExchange = eventsExchange
    }
}

extension ReasonCode {
    /// The product is not in the catalog: nothing to grant until a person decides.
    public static let unknownProduct = ReasonCode("unknown_product")
    /// The purchase names our order, but for another product.
    public static let productMismatch = ReasonCode("product_mismatch")
}

/// The upload a purchase came in.
struct Upload {
    var userId: String
    var submissionId: String
    var orderId: String?
    var transactionId: String?
    var bundleId: String
}

extension OrderStore {
    /// Credits one verified purchase unless it was credited before; binds it to its order;
    /// holds it for review when it cannot be granted as is. Says what happened.
    static func credit(
        _ purchase: VerifiedPurchase, upload: Upload, policy: CreditPolicy, now: Date, in db: Database
    ) throws -> (TransactionCreditState, ReasonCode?) {
        if let owner = try db.cachedRow(
            sql: "SELECT userId, submissionId, heldReason FROM purchase WHERE transactionId = ?",
            arguments: [purchase.transactionId])
        {
            if (owner["userId"] as String) != upload.userId { return (.replayedFromOtherUser, nil) }
            if let held: String = owner["heldReason"] { return (.held, ReasonCode(held)) }
            return ((owner["submissionId"] as String) == upload.submissionId ? .credited : .alreadyCredited, nil)
        }

        // Which of our orders it pays for: the token Apple carries (signed into the receipt),
        // else the upload's order (the client's word: only for the uploader's own orders).
        var order: Row?
        var owner = upload.userId
        if let token = purchase.appAccountToken {
            order = try db.cachedRow(sql: "SELECT * FROM orders WHERE id = lower(?)", arguments: [token])
            if let order {
                // Apple says whose order this paid: the purchase is theirs, whoever uploads it.
                owner = order["userId"]
            }
        }
        if order == nil, let orderId = upload.orderId {
            if upload.transactionId == purchase.transactionId {
                // The upload names both: an explicit binding, checked below like a token.
                order = try db.cachedRow(
                    sql: "SELECT * FROM orders WHERE id = lower(?) AND state = 'created' AND userId = ?",
                    arguments: [orderId, upload.userId])
            } else if upload.transactionId == nil, let purchased = purchase.purchaseDate {
                // Only the order: a receipt may also hold earlier purchases; bind the one made
                // after the order (a few minutes of clock skew allowed).
                order = try Row.fetchOne(
                    db,
                    sql: """
                        SELECT * FROM orders WHERE id = lower(?) AND state = 'created' AND userId = ? AND productId = ?
                            AND createdAt <= ?
                        """,
                    arguments: [orderId, upload.userId, purchase.productId, purchased.addingTimeInterval(300)])
            }
        }

        var heldReason: ReasonCode?
        let product = policy.catalog?.product(purchase.productId)
        if policy.catalog != nil && product == nil {
            heldReason = .unknownProduct
        } else if let order, (order["productId"] as String) != purchase.productId {
            heldReason = .productMismatch
        }
        let boundOrder: String? =
            heldReason == nil && order.map { ($0["state"] as String) == "created" } == true ? order?["id"] : nil

        try db.executeCached(
            sql: """
                INSERT INTO purchase (transactionId, originalTransactionId, productId, quantity, environment, bundleId,
                    purchaseDate, userId, orderId, submissionId, appAccountToken, heldReason, creditedAt)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """,
            arguments: [
                purchase.transactionId, purchase.originalTransactionId, purchase.productId, max(purchase.quantity, 1),
                purchase.environment.rawValue, upload.bundleId, purchase.purchaseDate, owner,
                boundOrder, upload.submissionId, purchase.appAccountToken, heldReason?.rawValue, now,
            ])
        if let heldReason {
            try audit(
                actor: "system", action: "purchase_held", subject: "transaction:\(purchase.transactionId)",
                reason: heldReason.rawValue, details: ["userId": owner, "productId": purchase.productId],
                now: now, in: db)
            return (owner == upload.userId ? .held : .replayedFromOtherUser, heldReason)
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
            userId: owner, productId: purchase.productId, orderId: boundOrder,
            quantity: max(purchase.quantity, 1), grant: product?.grant(quantity: purchase.quantity) ?? [:],
            environment: purchase.environment, source: "apple", policy: policy, now: now, in: db)
        if owner != upload.userId {
            try audit(
                actor: "system", action: "credited_to_order_owner", subject: "transaction:\(purchase.transactionId)",
                reason: "the purchase names an order of \(owner); uploaded by \(upload.userId)",
                details: ["orderId": boundOrder ?? ""], now: now, in: db)
            return (.replayedFromOtherUser, nil)
        }
        return (.credited, nil)
    }

    /// Writes a grant and its `grant.created` event.
    static func grant(
        transactionId: String, originalTransactionId: String, userId: String, productId: String, orderId: String?,
        quantity: Int, grant: [String: Catalog.GrantValue], environment: AppStoreEnvironment, source: String,
        policy: CreditPolicy, now: Date, in db: Database
    ) throws {
        let grantJSON = String(decoding: try JSONEncoder.sorted.encode(grant), as: UTF8.self)
        try db.executeCached(
            sql: """
                INSERT INTO grants (transactionId, userId, productId, orderId, quantity, grantJSON, environment, source,
                    state, grantedAt)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'active', ?)
                """,
            arguments: [
                transactionId, userId, productId, orderId, quantity, grantJSON, environment.rawValue, source, now,
            ])
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
        _ name: String, _ fields: [String: EventField], id: String, policy: CreditPolicy, now: Date, in db: Database
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
        in db: Database
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
