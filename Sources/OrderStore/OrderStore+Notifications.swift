public import Foundation
import IAPCore
public import Ledger
import Store

extension OrderStore {
    /// Applies a verified App Store Server Notification, once per `notificationUUID`:
    /// refunds and revocations revoke the grant, a reversed refund restores it, renewals are
    /// credited to the subscription's owner, and the subscription's state and expiry follow
    /// Apple's word. Consumption requests are recorded for the app to answer.
    static func apply(
        _ notification: AppStoreNotification, submissionId: String, policy: CreditPolicy, now: Date, in db: any SQLConnection
    ) async throws -> (state: SubmissionState, message: String, revoked: Int) {
        let purchase = notification.purchase
        try await db.execute(
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
        let plan = try await applyLedger(.notification(notification, submissionId: submissionId), policy: policy, now: now, in: db)
        guard case .notification(let outcome) = plan.outcome else {
            preconditionFailure("the ledger answered a notification with \(plan.outcome)")
        }
        try await db.execute(
            sql: "UPDATE notification SET outcome = ? WHERE notificationUUID = ?",
            arguments: [outcome.description, notification.notificationUUID])
        return (.credited, "\(notification.notificationType): \(outcome)", plan.revoked)
    }

    /// The subscriptions of a user, as Apple's word left them, each in its state as of `now`
    /// (`InForce.subscriptionState`: never `active` past its period's end and grace).
    public func subscriptions(ofUser userId: String, now: Date = Date()) async throws -> [Subscription] {
        try await database.read { db in
            try await db.rows(sql: "SELECT * FROM subscription WHERE userId = ? ORDER BY updatedAt DESC", arguments: [userId]).map {
                Subscription(row: $0).asOf(now)
            }
        }
    }

    /// Apple's consumption requests (a customer asked for a refund), newest first.
    public func consumptionRequests(limit: Int) async throws -> [ConsumptionRequestRecord] {
        try await database.read { db in
            try await db.rows(sql: "SELECT * FROM consumption_request ORDER BY receivedAt DESC LIMIT ?", arguments: [limit]).map {
                ConsumptionRequestRecord(
                    notificationUUID: $0["notificationUUID"], transactionId: $0["transactionId"], userId: $0["userId"],
                    reason: $0["reason"], environment: $0["environment"], receivedAt: $0["receivedAt"],
                    ownershipType: $0["ownershipType"], deadline: $0["deadline"], answer: $0["answer"],
                    answerReason: $0["answerReason"], answerJSON: $0["answerJSON"], answeredAt: $0["answeredAt"],
                    attempts: $0["attempts"])
            }
        }
    }

    /// The notifications applied about a transaction, oldest first.
    public func notifications(ofTransaction transactionId: String) async throws -> [(type: String, outcome: String)] {
        try await database.read { db in
            try await db.rows(sql: "SELECT notificationType, outcome FROM notification WHERE transactionId = ? ORDER BY appliedAt, rowid",
                arguments: [transactionId]
            ).map { ($0["notificationType"], $0["outcome"]) }
        }
    }
}

/// A consumption request Apple sent, for customer service to answer within 12 hours.
public struct ConsumptionRequestRecord: Sendable, Equatable, Encodable {
    public var notificationUUID: String
    public var transactionId: String
    public var userId: String?
    /// UNINTENDED_PURCHASE, FULFILLMENT_ISSUE, UNSATISFIED_WITH_PURCHASE, LEGAL or OTHER.
    public var reason: String?
    public var environment: String
    public var receivedAt: Date
    /// `PURCHASED`, `FAMILY_SHARED` or `ASSIGNED`.
    public var ownershipType: String? = nil
    /// When Apple stops waiting for the answer.
    public var deadline: Date? = nil
    /// `queued`, `sent`, `skipped`, `refused` or `expired`; nil for requests recorded before
    /// answers were sent.
    public var answer: String? = nil
    /// Why it was skipped or refused, or the last failure while queued.
    public var answerReason: String? = nil
    /// The body sent to Apple.
    public var answerJSON: String? = nil
    public var answeredAt: Date? = nil
    public var attempts: Int = 0
}
