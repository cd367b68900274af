import Foundation
public import IAPCore
public import Ledger
import Store

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
    /// Whether each settled transaction is queued to be finished at Apple in the commit that
    /// settled it (`FinishMode.serverFinishes`).
    public var finishAtApple: Bool

    /// Creates a policy.
    public init(
        catalog: Catalog? = nil, eventsExchange: String? = nil, sandbox: SandboxPolicy = .accept,
        restore: RestorePolicy = .keep, finishAtApple: Bool = false
    ) {
        self.finishAtApple = finishAtApple
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

extension OrderStore {
    /// Queues an event in the outbox, in the same transaction as the change it reports.
    static func event(
        _ name: String, _ fields: [String: EventField], id: String, policy: CreditPolicy, now: Date, in db: any SQLConnection
    ) async throws {
        guard let statement = eventStatement(name, fields, id: id, policy: policy, now: now) else { return }
        try await db.executeLater([statement])
    }

    /// The outbox row of an event; nil when the policy publishes none.
    static func eventStatement(_ name: String, _ fields: [String: EventField], id: String, policy: CreditPolicy, now: Date)
        -> SQLStatement?
    {
        guard let exchange = policy.eventsExchange else { return nil }
        var body = fields
        body["event"] = .string(name)
        body["eventId"] = .string(id)
        // Not mandatory: an events exchange with no subscriber yet is fine.
        var message = OutboxMessage(exchange: exchange, routingKey: name, body: EventField.object(body), messageId: id)
        message.mandatory = false
        return insertStatement(message, now: now)
    }

    /// Appends to the audit log.
    static func audit(
        actor: String, action: String, subject: String, reason: String, details: [String: String], now: Date,
        in db: any SQLConnection
    ) async throws {
        try await db.executeLater([
            auditStatement(actor: actor, action: action, subject: subject, reason: reason, details: details, now: now)
        ])
    }

    /// The audit log's new entry.
    static func auditStatement(
        actor: String, action: String, subject: String, reason: String, details: [String: String], now: Date
    ) -> SQLStatement {
        // Encoding a dictionary of strings cannot fail.
        let json = (try? JSONEncoder.sorted.encode(details)).map { String(decoding: $0, as: UTF8.self) } ?? "{}"
        return SQLStatement(
            "INSERT INTO audit_log (at, actor, action, subject, reason, details) VALUES (?, ?, ?, ?, ?, ?)",
            [now, actor, action, subject, reason, json])
    }

    static func iso8601(_ date: Date) -> String { Ledger.iso8601(date) }
}

extension JSONEncoder {
    static var sorted: JSONEncoder {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys]
        return encoder
    }
}
