import Foundation
import IAPCore
import Ledger

extension OrderStore {
    /// Applies a verified App Store Server Notification, once per `notificationUUID`:
    /// refunds and revocations revoke the grant, a reversed refund restores it, renewals are
    /// credited to the subscription's owner, and the subscription's state and expiry follow
    /// Apple's word. Consumption requests are recorded for the app to answer.
    static func apply(
        _ notification: AppStoreNotification, submissionId: String, policy: CreditPolicy, now: Date, in db: any SQLConnection
    ) throws -> (state: SubmissionState, message: String, revoked: Int) {
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
            return (.credited, "notification \(notification.notificationUUID) was applied before", 0)
        }
        let outcome = try outcome(of: notification, submissionId: submissionId, policy: policy, now: now, in: db)
        try db.execute(
            sql: "UPDATE notification SET outcome = ? WHERE notificationUUID = ?",
            arguments: [outcome, notification.notificationUUID])
        return (.credited, "\(notification.notificationType): \(outcome)", outcome == "revoked" ? 1 : 0)
    }

    private static func outcome(
        of notification: AppStoreNotification, submissionId: String, policy: CreditPolicy, now: Date, in db: any SQLConnection
    ) throws -> String {
        guard let purchase = notification.purchase else {
            switch notification.notificationType {
            case "TEST": return "test"
            case "RESCIND_CONSENT":
                try consentRescinded(notification, policy: policy, now: now, in: db)
                return "recorded"
            default: return "recorded"
            }
        }
        let key = policy.creditKey(of: purchase)
        let owner = try owner(of: purchase, key: key, in: db)
        let tag = "\(notification.notificationType):\(notification.notificationUUID)"
        switch notification.notificationType {
        case "REFUND", "REVOKE":
            // Per billing period: the subscription is revoked only when its newest period is;
            // a refund of an earlier one leaves the paid current period, its state and expiry.
            if try isNewestPeriod(purchase, in: db) {
                try updateSubscription(notification, owner: owner, state: "revoked", now: now, in: db)
            }
            let at = purchase.cancellationDate ?? notification.signedDate ?? now
            guard
                try recordRevocation(
                    key: key, transactionId: purchase.transactionId, source: notification.notificationType, at: at, now: now,
                    in: db)
            else { return "reversed_already" }
            guard let grant = try db.cachedRow(sql: "SELECT * FROM grants WHERE creditKey = ? AND state = 'active'", arguments: [key])
            else { return "revocation_pending" }
            try revokeGrant(
                grant, actor: "apple", reason: notification.notificationType,
                eventId: "grant.revoked:\(grant["transactionId"] as String):\(tag)", policy: policy, now: now, in: db)
            return "revoked"
        case "REFUND_REVERSED":
            let lifted = try liftRevocation(
                key: key, transactionId: purchase.transactionId, at: notification.signedDate ?? now, now: now, in: db)
            if let grant = try db.row(sql: """
                    SELECT * FROM grants WHERE creditKey = ? AND state = 'revoked' AND revokedBy = 'apple'
                    ORDER BY revokedAt DESC LIMIT 1
                    """, arguments: [key]),
                try db.cachedRow(sql: "SELECT 1 FROM grants WHERE creditKey = ? AND state = 'active'", arguments: [key]) == nil
            {
                try restoreGrant(grant, tag: "\(grant["transactionId"] as String):\(tag)", policy: policy, now: now, in: db)
                try updateSubscription(notification, owner: owner, state: "active", now: now, in: db)
                return "restored"
            }
            // Only what the refund stopped, and only if nothing else holds it or took it back since.
            if lifted,
                try db.cachedRow(sql: "SELECT 1 FROM grants WHERE creditKey = ? LIMIT 1", arguments: [key]) == nil,
                let blocked = try db.row(sql: "SELECT * FROM purchase WHERE creditKey = ? AND heldReason = 'revoked' ORDER BY creditedAt, rowid LIMIT 1",
                arguments: [key])
            {
                // An upload the refund stopped: what the refund took is given back to its uploader.
                try creditBlocked(blocked, key: key, purchase: purchase, policy: policy, now: now, in: db)
                return "credited"
            }
            return lifted ? "revocation_lifted" : "nothing_revoked"
        case "SUBSCRIBED", "DID_RENEW", "OFFER_REDEEMED", "DID_CHANGE_RENEWAL_PREF", "RENEWAL_EXTENDED", "ONE_TIME_CHARGE":
            guard notification.environment == .production || policy.sandbox.allows(userId: owner ?? "") else {
                return "sandbox_not_allowed"
            }
            try updateSubscription(notification, owner: owner, state: nil, now: now, in: db)
            let credited = try credit(
                purchase, owner: owner, submissionId: submissionId, bundleId: notification.bundleId, policy: policy, now: now,
                in: db)
            if notification.notificationType == "RENEWAL_EXTENDED", let expires = purchase.expiresDate {
                // Apple moved the period's end: the grant in force lasts as long.
                try db.execute(
                    sql: """
                        UPDATE grants SET expiresAt = ?
                        WHERE creditKey = ? AND state = 'active' AND expiresAt IS NOT NULL AND expiresAt < ?
                        """,
                    arguments: [expires, key, expires])
                if db.changesCount > 0 { return "extended" }
            }
            return credited
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

    /// A customer (or their parent or guardian) withdrew the consent the app's use rests on:
    /// nothing in the ledger changes, and the app's own services must act, so it is audited and
    /// published as `consent.rescinded` with the customer's `appTransactionId`.
    private static func consentRescinded(
        _ notification: AppStoreNotification, policy: CreditPolicy, now: Date, in db: any SQLConnection
    ) throws {
        let app = notification.bundleId ?? ""
        var details = ["notificationUUID": notification.notificationUUID, "environment": notification.environment.rawValue]
        details["appTransactionId"] = notification.appTransactionId
        try audit(
            actor: "apple", action: "consent_rescinded", subject: "app:\(app)", reason: "RESCIND_CONSENT", details: details,
            now: now, in: db)
        try event(
            "consent.rescinded",
            [
                "bundleId": .string(app), "environment": .string(notification.environment.rawValue),
                "appTransactionId": notification.appTransactionId.map(EventField.string) ?? .null,
                "notificationUUID": .string(notification.notificationUUID),
                "signedDate": notification.signedDate.map { .string(iso8601($0)) } ?? .null, "receivedAt": .string(iso8601(now)),
            ], id: "consent.rescinded:\(notification.notificationUUID)", policy: policy, now: now, in: db)
    }

    /// Whether `purchase` is its subscription's newest known period (or nothing says otherwise):
    /// a period that ends before the one recorded as current is an earlier one.
    private static func isNewestPeriod(_ purchase: VerifiedPurchase, in db: any SQLConnection) throws -> Bool {
        guard let expires = purchase.expiresDate,
            let row = try db.cachedRow(
                sql: "SELECT expiresDate FROM subscription WHERE originalTransactionId = ?",
                arguments: [purchase.originalTransactionId])
        else { return true }
        let current: Date? = row["expiresDate"]
        return current.map { expires >= $0 } ?? true
    }

    /// Whose purchase this is: the owner of its active grant, else its subscription's owner,
    /// else whoever it or its chain was credited to, else the order its `appAccountToken`
    /// names; nil when nothing of it was credited yet (an upload a refund stopped or a person
    /// holds does not make its uploader the owner).
    private static func owner(of purchase: VerifiedPurchase, key: String, in db: any SQLConnection) throws -> String? {
        if let user = try String.fetchOne(
            db, sql: "SELECT userId FROM grants WHERE creditKey = ? AND state = 'active'", arguments: [key])
        {
            return user
        }
        if let user = try String.fetchOne(
            db, sql: "SELECT userId FROM subscription WHERE originalTransactionId = ?", arguments: [purchase.originalTransactionId])
        {
            return user
        }
        if let user = try String.fetchOne(
            db,
            sql: """
                SELECT userId FROM purchase WHERE transactionId = ? AND heldReason IS NULL
                UNION ALL SELECT userId FROM purchase WHERE originalTransactionId = ? AND heldReason IS NULL LIMIT 1
                """,
            arguments: [purchase.transactionId, purchase.originalTransactionId])
        {
            return user
        }
        if let token = purchase.appAccountToken,
            let user = try String.fetchOne(db, sql: "SELECT userId FROM orders WHERE id = lower(?)", arguments: [token])
        {
            return user
        }
        return nil
    }

    /// Credits a purchase Apple told us about to its owner, as an upload of it would.
    private static func credit(
        _ purchase: VerifiedPurchase, owner: String?, submissionId: String, bundleId: String?, policy: CreditPolicy, now: Date,
        in db: any SQLConnection
    ) throws -> String {
        guard let owner else { return "owner_unknown" }
        let upload = Upload(userId: owner, submissionId: submissionId, orderId: nil, transactionId: nil, bundleId: bundleId ?? "")
        let (state, reason) = try Self.credit(purchase, upload: upload, policy: policy, now: now, in: db)
        return reason.map { "\(state.rawValue) (\($0))" } ?? state.rawValue
    }

    /// Grants a purchase whose upload a refund stopped, now that Apple reversed the refund.
    private static func creditBlocked(
        _ row: SQLRow, key: String, purchase: VerifiedPurchase, policy: CreditPolicy, now: Date, in db: any SQLConnection
    ) throws {
        let transactionId: String = row["transactionId"]
        let productId: String = row["productId"]
        let quantity: Int = row["quantity"]
        try db.execute(sql: "UPDATE purchase SET heldReason = NULL WHERE transactionId = ?", arguments: [transactionId])
        try grant(
            transactionId: transactionId, originalTransactionId: row["originalTransactionId"], creditKey: key,
            userId: row["userId"], productId: productId, orderId: nil, quantity: quantity,
            grant: policy.catalog?.product(productId)?.grant(quantity: quantity) ?? [:],
            environment: AppStoreEnvironment(rawValue: row["environment"]) ?? purchase.environment, source: "apple",
            expiresAt: policy.catalog?.product(productId)?.type == .autoRenewable ? purchase.expiresDate : nil,
            policy: policy, now: now, in: db)
        if case .billingPeriod? = CreditKey(stored: key) {
            // Credited now: its subscription has an owner, whose every later period is theirs.
            try recordSubscription(of: recordedPurchase(row, expiresDate: purchase.expiresDate), owner: row["userId"], now: now, in: db)
        }
        try audit(
            actor: "apple", action: "grant_restored", subject: "transaction:\(transactionId)", reason: "REFUND_REVERSED",
            details: ["userId": row["userId"] as String], now: now, in: db)
    }

    /// Undoes a revocation: the grant is active again, its order paid, and `grant.restored` published.
    private static func restoreGrant(_ row: SQLRow, tag: String, policy: CreditPolicy, now: Date, in db: any SQLConnection) throws {
        let transactionId: String = row["transactionId"]
        try db.execute(
            sql: "UPDATE grants SET state = 'active', revokedAt = NULL, revokedBy = NULL WHERE transactionId = ?",
            arguments: [transactionId])
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
        _ notification: AppStoreNotification, owner: String?, state: String?, now: Date, in db: any SQLConnection
    ) throws {
        guard let purchase = notification.purchase, purchase.expiresDate != nil || notification.subscriptionStatus != nil
        else { return }
        if let grace = notification.gracePeriodExpiresDate {
            // The newest period's grant lasts into Apple's billing grace period.
            try db.execute(
                sql: """
                    UPDATE grants SET gracePeriodExpiresAt = ?
                    WHERE id = (
                        SELECT id FROM grants WHERE originalTransactionId = ? AND state = 'active'
                        ORDER BY expiresAt DESC NULLS LAST, id DESC LIMIT 1)
                    """,
                arguments: [grace, purchase.originalTransactionId])
        }
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
                    autoRenew, gracePeriodExpiresDate, lastTransactionId, updatedAt, stateDate)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT (originalTransactionId) DO UPDATE SET
                    userId = coalesce(subscription.userId, excluded.userId),
                    productId = CASE WHEN newer THEN excluded.productId ELSE subscription.productId END,
                    state = CASE WHEN newer THEN excluded.state ELSE subscription.state END,
                    expiresDate = CASE WHEN newer THEN coalesce(excluded.expiresDate, subscription.expiresDate)
                        ELSE subscription.expiresDate END,
                    autoRenew = CASE WHEN newer THEN coalesce(excluded.autoRenew, subscription.autoRenew)
                        ELSE subscription.autoRenew END,
                    gracePeriodExpiresDate = CASE WHEN newer THEN excluded.gracePeriodExpiresDate
                        ELSE subscription.gracePeriodExpiresDate END,
                    lastTransactionId = CASE WHEN newer THEN excluded.lastTransactionId ELSE subscription.lastTransactionId END,
                    stateDate = CASE WHEN excluded.stateDate IS NULL THEN NULL
                        WHEN excluded.stateDate >= coalesce(subscription.stateDate, '') THEN excluded.stateDate
                        ELSE subscription.stateDate END,
                    updatedAt = excluded.updatedAt
                """.replacingOccurrences(of: "newer", with: "excluded.stateDate >= coalesce(subscription.stateDate, '')"),
            arguments: [
                purchase.originalTransactionId, owner, purchase.productId, notification.environment.rawValue,
                state ?? fromStatus ?? "active", purchase.expiresDate, notification.autoRenewStatus.map { $0 == 1 },
                notification.gracePeriodExpiresDate, purchase.transactionId, now, notification.signedDate ?? now,
            ])
    }

    /// The subscriptions of a user, as the notifications left them.
    public func subscriptions(ofUser userId: String) async throws -> [SubscriptionRecord] {
        try await database.read { db in
            try db.rows(sql: "SELECT * FROM subscription WHERE userId = ? ORDER BY updatedAt DESC", arguments: [userId]).map {
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
            try db.rows(sql: "SELECT * FROM consumption_request ORDER BY receivedAt DESC LIMIT ?", arguments: [limit]).map {
                ConsumptionRequestRecord(
                    notificationUUID: $0["notificationUUID"], transactionId: $0["transactionId"], userId: $0["userId"],
                    reason: $0["reason"], environment: $0["environment"], receivedAt: $0["receivedAt"])
            }
        }
    }

    /// The notifications applied about a transaction, oldest first.
    public func notifications(ofTransaction transactionId: String) async throws -> [(type: String, outcome: String)] {
        try await database.read { db in
            try db.rows(sql: "SELECT notificationType, outcome FROM notification WHERE transactionId = ? ORDER BY appliedAt, rowid",
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
