import Foundation
import GRDB
import IAPCore

extension OrderStore {
    /// Applies a verified App Store Server Notification, once per `notificationUUID`:
    /// refunds and revocations revoke the grant, a reversed refund restores it, renewals are
    /// credited to the subscription's owner, and the subscription's state and expiry follow
    /// Apple's word. Consumption requests are recorded for the app to answer.
    static func apply(
        _ notification: AppStoreNotification, submissionId: String, policy: CreditPolicy, now: Date, in db: Database
    ) throws -> (state: SubmissionState, message: String) {
        let purchase = notification.purchase
        try db.execute(
            sql: """
                INSERT INTO notification (notificationUUID, notificationType, subtype, environment, transactionId,
                    submissionId, outcome, signedDate, appliedAt)
                VALUES (?, ?, ?, ?, ?, ?, 'applying', ?, ?) ON CONFLICT DO NOTHING
                """,
            arguments: [
                notification.notificationUUID, notification.notificationType, notification.subtype,
                notification.environment.rawValue, purchase?.transactionId, submissionId, notification.signedDate, now,
            ])
        guard db.changesCount > 0 else {
            return (.credited, "notification \(notification.notificationUUID) was applied before")
        }
        let outcome = try outcome(of: notification, submissionId: submissionId, policy: policy, now: now, in: db)
        try db.execute(
            sql: "UPDATE notification SET outcome = ? WHERE notificationUUID = ?",
            arguments: [outcome, notification.notificationUUID])
        return (.credited, "\(notification.notificationType): \(outcome)")
    }

    private static func outcome(
        of notification: AppStoreNotification, submissionId: String, policy: CreditPolicy, now: Date, in db: Database
    ) throws -> String {
        guard let purchase = notification.purchase else { return notification.notificationType == "TEST" ? "test" : "recorded" }
        let owner = try owner(of: purchase, in: db)
        let tag = "\(notification.notificationType):\(notification.notificationUUID)"
        switch notification.notificationType {
        case "REFUND", "REVOKE":
            try updateSubscription(notification, owner: owner, state: "revoked", now: now, in: db)
            guard let grant = try Row.fetchOne(db, sql: "SELECT * FROM grants WHERE transactionId = ?", arguments: [purchase.transactionId])
            else { return "no_grant" }
            guard (grant["state"] as String) == "active" else { return "already_revoked" }
            try revokeGrant(
                grant, actor: "apple", reason: notification.notificationType, eventId: "grant.revoked:\(purchase.transactionId):\(tag)", policy: policy,
                now: now, in: db)
            return "revoked"
        case "REFUND_REVERSED":
            guard let grant = try Row.fetchOne(db, sql: "SELECT * FROM grants WHERE transactionId = ?", arguments: [purchase.transactionId])
            else {
                return try credit(purchase, owner: owner, submissionId: submissionId, bundleId: notification.bundleId, policy: policy, now: now, in: db)
            }
            guard (grant["state"] as String) == "revoked" else { return "already_active" }
            try restoreGrant(grant, tag: "\(purchase.transactionId):\(tag)", policy: policy, now: now, in: db)
            try updateSubscription(notification, owner: owner, state: "active", now: now, in: db)
            return "restored"
        case "SUBSCRIBED", "DID_RENEW", "OFFER_REDEEMED", "DID_CHANGE_RENEWAL_PREF", "RENEWAL_EXTENDED", "ONE_TIME_CHARGE":
            try updateSubscription(notification, owner: owner, state: nil, now: now, in: db)
            return try credit(purchase, owner: owner, submissionId: submissionId, bundleId: notification.bundleId, policy: policy, now: now, in: db)
        case "EXPIRED", "GRACE_PERIOD_EXPIRED":
            try updateSubscription(notification, owner: owner, state: "expired", now: now, in: db)
            return "expired"
        case "DID_FAIL_TO_RENEW":
            let state = notification.subtype == "GRACE_PERIOD" ? "grace_period" : "billing_retry"
            try updateSubscription(notification, owner: owner, state: state, now: now, in: db)
            return state
        case "DID_CHANGE_RENEWAL_STATUS":
            try updateSubscription(notification, owner: owner, state: nil, now: now, in: db)
            return notification.subtype == "AUTO_RENEW_DISABLED" ? "auto_renew_off" : "auto_renew_on"
        case "CONSUMPTION_REQUEST":
            try db.execute(
                sql: """
                    INSERT INTO consumption_request (notificationUUID, transactionId, userId, reason, environment, receivedAt)
                    VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING
                    """,
                arguments: [
                    notification.notificationUUID, purchase.transactionId, owner, notification.consumptionRequestReason,
                    notification.environment.rawValue, now,
                ])
            return "recorded"
        default:
            return "recorded"
        }
    }

    /// Whose purchase this is: its own record, else its subscription's first purchase, else
    /// the order its `appAccountToken` names, else the subscription record; nil when nobody
    /// has uploaded anything of it yet.
    private static func owner(of purchase: VerifiedPurchase, in db: Database) throws -> String? {
        if let user = try String.fetchOne(
            db, sql: "SELECT userId FROM purchase WHERE transactionId = ? OR originalTransactionId = ? LIMIT 1",
            arguments: [purchase.transactionId, purchase.originalTransactionId])
        {
            return user
        }
        if let token = purchase.appAccountToken,
            let user = try String.fetchOne(db, sql: "SELECT userId FROM orders WHERE id = lower(?)", arguments: [token])
        {
            return user
        }
        return try String.fetchOne(
            db, sql: "SELECT userId FROM subscription WHERE originalTransactionId = ?", arguments: [purchase.originalTransactionId])
    }

    /// Credits a purchase Apple told us about to its owner, as an upload of it would.
    private static func credit(
        _ purchase: VerifiedPurchase, owner: String?, submissionId: String, bundleId: String?, policy: CreditPolicy, now: Date,
        in db: Database
    ) throws -> String {
        guard let owner else { return "owner_unknown" }
        guard purchase.cancellationDate == nil else { return "cancelled" }
        let upload = Upload(userId: owner, submissionId: submissionId, orderId: nil, transactionId: nil, bundleId: bundleId ?? "")
        let (state, reason) = try Self.credit(purchase, upload: upload, policy: policy, now: now, in: db)
        return reason.map { "\(state.rawValue) (\($0))" } ?? state.rawValue
    }

    /// Undoes a revocation: the grant is active again, its order paid, and `grant.restored` published.
    private static func restoreGrant(_ row: Row, tag: String, policy: CreditPolicy, now: Date, in db: Database) throws {
        let transactionId: String = row["transactionId"]
        try db.execute(
            sql: "UPDATE grants SET state = 'active', revokedAt = NULL WHERE transactionId = ?", arguments: [transactionId])
        if let orderId: String = row["orderId"] {
            try db.execute(
                sql: "UPDATE orders SET state = 'paid', updatedAt = ? WHERE id = ? AND transactionId = ?",
                arguments: [now, orderId, transactionId])
        }
        try event(
            "grant.restored",
            [
                "transactionId": .string(transactionId), "userId": .string(row["userId"]),
                "productId": .string(row["productId"]), "quantity": .int(row["quantity"]),
                "grant": .json(row["grantJSON"]), "restoredAt": .string(iso8601(now)),
            ], id: "grant.restored:\(tag)", policy: policy, now: now, in: db)
        try audit(
            actor: "apple", action: "grant_restored", subject: "transaction:\(transactionId)", reason: "REFUND_REVERSED",
            details: ["userId": row["userId"] as String], now: now, in: db)
    }

    /// Records a subscription's state and expiry: `state`, else Apple's status, else active.
    private static func updateSubscription(
        _ notification: AppStoreNotification, owner: String?, state: String?, now: Date, in db: Database
    ) throws {
        guard let purchase = notification.purchase, purchase.expiresDate != nil || notification.subscriptionStatus != nil
        else { return }
        let fromStatus: String? =
            switch notification.subscriptionStatus {
            case 1: "active"
            case 2: "expired"
            case 3: "billing_retry"
            case 4: "grace_period"
            case 5: "revoked"
            default: nil
            }
        try db.execute(
            sql: """
                INSERT INTO subscription (originalTransactionId, userId, productId, environment, state, expiresDate,
                    autoRenew, gracePeriodExpiresDate, lastTransactionId, updatedAt)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT (originalTransactionId) DO UPDATE SET
                    userId = coalesce(subscription.userId, excluded.userId), productId = excluded.productId,
                    state = excluded.state, expiresDate = coalesce(excluded.expiresDate, subscription.expiresDate),
                    autoRenew = coalesce(excluded.autoRenew, subscription.autoRenew),
                    gracePeriodExpiresDate = excluded.gracePeriodExpiresDate,
                    lastTransactionId = excluded.lastTransactionId, updatedAt = excluded.updatedAt
                """,
            arguments: [
                purchase.originalTransactionId, owner, purchase.productId, notification.environment.rawValue,
                state ?? fromStatus ?? "active", purchase.expiresDate, notification.autoRenewStatus.map { $0 == 1 },
                notification.gracePeriodExpiresDate, purchase.transactionId, now,
            ])
    }

    /// The subscriptions of a user, as the notifications left them.
    public func subscriptions(ofUser userId: String) async throws -> [SubscriptionRecord] {
        try await database.read { db in
            try Row.fetchAll(db, sql: "SELECT * FROM subscription WHERE userId = ? ORDER BY updatedAt DESC", arguments: [userId]).map {
                SubscriptionRecord(
                    originalTransactionId: $0["originalTransactionId"], productId: $0["productId"], environment: $0["environment"],
                    state: $0["state"], expiresDate: $0["expiresDate"], autoRenew: $0["autoRenew"],
                    gracePeriodExpiresDate: $0["gracePeriodExpiresDate"], updatedAt: $0["updatedAt"])
            }
        }
    }

    /// Apple's consumption requests (a customer asked for a refund), newest first.
    public func consumptionRequests(limit: Int) async throws -> [ConsumptionRequestRecord] {
        try await database.read { db in
            try Row.fetchAll(db, sql: "SELECT * FROM consumption_request ORDER BY receivedAt DESC LIMIT ?", arguments: [limit]).map {
                ConsumptionRequestRecord(
                    notificationUUID: $0["notificationUUID"], transactionId: $0["transactionId"], userId: $0["userId"],
                    reason: $0["reason"], environment: $0["environment"], receivedAt: $0["receivedAt"])
            }
        }
    }

    /// The notifications applied about a transaction, oldest first.
    public func notifications(ofTransaction transactionId: String) async throws -> [(type: String, outcome: String)] {
        try await database.read { db in
            try Row.fetchAll(
                db, sql: "SELECT notificationType, outcome FROM notification WHERE transactionId = ? ORDER BY appliedAt, rowid",
                arguments: [transactionId]
            ).map { ($0["notificationType"], $0["outcome"]) }
        }
    }
}

/// A subscription as the app reads it.
public struct SubscriptionRecord: Sendable, Equatable {
    public var originalTransactionId: String
    public var productId: String
    public var environment: String
    /// active, expired, billing_retry, grace_period or revoked.
    public var state: String
    public var expiresDate: Date?
    public var autoRenew: Bool?
    public var gracePeriodExpiresDate: Date?
    public var updatedAt: Date
}

/// A consumption request Apple sent, for customer service to answer within 12 hours.
public struct ConsumptionRequestRecord: Sendable, Equatable {
    public var notificationUUID: String
    public var transactionId: String
    public var userId: String?
    /// UNINTENDED_PURCHASE, FULFILLMENT_ISSUE, UNSATISFIED_WITH_PURCHASE, LEGAL or OTHER.
    public var reason: String?
    public var environment: String
    public var receivedAt: Date
}
