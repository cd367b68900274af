public import Foundation
public import IAPCore
public import Ledger
import Store

/// A subscription the reconciliation asks Apple about: due to renew, or in billing retry or
/// a grace period.
public struct DueSubscription: Sendable, Equatable {
    /// The subscription's chain.
    public var originalTransactionId: String
    /// Its newest transaction the store knows.
    public var lastTransactionId: String
    /// Where it was bought.
    public var environment: AppStoreEnvironment
    /// active, billing retry or grace period.
    public var state: SubscriptionState
    /// The end of its current period, as the store knows it.
    public var expiresDate: Date?
    /// Its owner, when known.
    public var userId: String?
}

/// What applying one notification the reconciliation built from Apple's answer did.
public struct ReconciliationChange: Sendable, Equatable, Encodable {
    /// The subscription's chain.
    public var originalTransactionId: String
    /// The transaction Apple's answer was about.
    public var transactionId: String
    /// The notification it was applied as (DID_RENEW, EXPIRED, DID_FAIL_TO_RENEW, REVOKE, REFUND).
    public var notificationType: String
    /// GRACE_PERIOD for a subscription in its grace period.
    public var subtype: String?
    /// What the notification path did: credited, already_credited, revoked, expired, ….
    public var outcome: String
    /// The subscription's state before and after.
    public var stateBefore: String?
    /// The subscription's state after the correction.
    public var stateAfter: String?
    /// The subscription's owner, when known.
    public var userId: String?
    /// Whether it changed the ledger (a grant credited, revoked or restored) or the
    /// subscription's state, expiry or last transaction: a correction, audited.
    public var corrected: Bool
}

extension OrderStore {
    /// The reconciliation's tasks, each with its own last run.
    public enum ReconciliationTask: String, Sendable {
        /// Subscription statuses and refunds asked of Apple.
        case subscriptions
        /// Notifications Apple could not deliver, re-delivered.
        case notifications
    }

    /// Subscriptions to ask Apple about, as `ReconciliationChoice` chooses them: the store
    /// reads every subscription in a state that can be due, with whether it holds periods nobody
    /// owns yet, and the core picks and orders them.
    public func subscriptionsDue(before horizon: Date) async throws -> [DueSubscription] {
        let states = ReconciliationChoice.candidateStates.map { "'\($0.rawValue)'" }.joined(separator: ", ")
        let candidates = try await database.read { db in
            try await db.rows(
                sql: """
                    SELECT subscription.*, CASE WHEN EXISTS (
                            SELECT 1 FROM purchase WHERE purchase.originalTransactionId = subscription.originalTransactionId
                                AND purchase.heldReason IN (\(ReasonCode.ownerUnknown.sql), \(ReasonCode.buyerUnknown.sql))
                        ) THEN 1 ELSE 0 END AS holdsUnowned
                    FROM subscription WHERE state IN (\(states))
                    """
            ).map { row in
                (
                    due: DueSubscription(
                        originalTransactionId: row["originalTransactionId"], lastTransactionId: row["lastTransactionId"],
                        environment: AppStoreEnvironment(rawValue: row["environment"]) ?? .production, state: row["state"],
                        expiresDate: row["expiresDate"], userId: row["userId"]),
                    candidate: ReconciliationChoice.Candidate(
                        originalTransactionId: row["originalTransactionId"], state: row["state"], expiresDate: row["expiresDate"],
                        gracePeriodExpiresDate: row["gracePeriodExpiresDate"], holdsUnownedPeriods: (row["holdsUnowned"] as Int) != 0)
                )
            }
        }
        return ReconciliationChoice.due(candidates, horizon: horizon, by: \.candidate).map(\.due)
    }

    /// Applies a notification built from Apple's answer (not sent by Apple) exactly as the
    /// notification path applies one: a submission records it, then the notification is applied,
    /// all in one transaction. Returns nil when there is nothing to do: its `notificationUUID`
    /// was applied before, or it is a refund or revocation the store already holds. A change to
    /// the ledger or to the subscription's state is audited (actor `reconciliation`).
    public func applyReconciliation(
        _ notification: AppStoreNotification, signedTransaction: String?, policy: CreditPolicy = .init(), now: Date = Date()
    ) async throws -> ReconciliationChange? {
        try await groupCommit.write { db -> ReconciliationChange? in
            guard let purchase = notification.purchase,
                try await db.cachedRow(
                    sql: "SELECT 1 FROM notification WHERE notificationUUID = ?", arguments: [notification.notificationUUID]) == nil
            else { return nil }
            let key = policy.creditKey(of: purchase)
            // A refund or revocation the store holds already, standing, with nothing granted under
            // its key: nothing to do (the core's rule; the rows are read only for such a one).
            if [.refund, .revoke].contains(NotificationType(notification.notificationType)) {
                let revocation = try await Self.revocation(key: key, in: db)
                let granted =
                    try await db.cachedRow(sql: "SELECT 1 FROM grants WHERE creditKey = ? AND state = \(GrantState.active.sql)", arguments: [key]) != nil
                guard ReconciliationChoice.isNews(notification.notificationType, revocation: revocation, grantedUnderKey: granted)
                else { return nil }
            }
            let subscriptionSQL = "SELECT state, expiresDate, lastTransactionId, userId FROM subscription WHERE originalTransactionId = ?"
            let before = try await db.row(sql: subscriptionSQL, arguments: [purchase.originalTransactionId])
            let submissionId = UUID().uuidString
            try await db.execute(
                sql: """
                    INSERT INTO submission (id, userId, receiptData, signedTransaction, state, acceptedAt, updatedAt)
                    VALUES (?, '', '', ?, \(SubmissionState.pending.sql), ?, ?)
                    """,
                arguments: [submissionId, signedTransaction, now, now])
            let applied = try await Self.apply(notification, submissionId: submissionId, policy: policy, now: now, in: db)
            try await db.execute(
                sql: """
                    UPDATE submission SET state = ?, reasonMessage = ?, attempts = 1, environment = ?, updatedAt = ?
                    WHERE id = ?
                    """,
                arguments: [applied.state.rawValue, applied.message, notification.environment.rawValue, now, submissionId])
            let outcome =
                try await String.fetchOne(
                    db, sql: "SELECT outcome FROM notification WHERE notificationUUID = ?", arguments: [notification.notificationUUID])
                ?? ""
            let after = try await db.row(sql: subscriptionSQL, arguments: [purchase.originalTransactionId])
            let subscriptionChanged =
                before?["state"] as String? != after?["state"] as String?
                || before?["expiresDate"] as Date? != after?["expiresDate"] as Date?
                || before?["lastTransactionId"] as String? != after?["lastTransactionId"] as String?
            var owner = after?["userId"] as String?
            if owner == nil {
                owner = try await String.fetchOne(
                    db, sql: "SELECT userId FROM grants WHERE creditKey = ? ORDER BY id DESC LIMIT 1", arguments: [key])
            }
            let change = ReconciliationChange(
                originalTransactionId: purchase.originalTransactionId, transactionId: purchase.transactionId,
                notificationType: notification.notificationType, subtype: notification.subtype, outcome: outcome,
                stateBefore: before?["state"], stateAfter: after?["state"], userId: owner,
                corrected: ReconciliationChoice.corrected(outcome: outcome, subscriptionChanged: subscriptionChanged))
            if change.corrected {
                var details = ["transactionId": purchase.transactionId, "outcome": outcome]
                details["userId"] = owner
                details["stateBefore"] = change.stateBefore
                details["stateAfter"] = change.stateAfter
                details["expiresBefore"] = (before?["expiresDate"] as Date?).map(Self.iso8601)
                details["expiresAfter"] = (after?["expiresDate"] as Date?).map(Self.iso8601)
                let type = notification.notificationType + (notification.subtype.map { "/\($0)" } ?? "")
                try await Self.audit(
                    actor: "reconciliation", action: "subscription_reconciled",
                    subject: "subscription:\(purchase.originalTransactionId)",
                    reason: "Apple's answer applied as \(type): \(outcome)", details: details, now: now, in: db)
            }
            return change
        }
    }

    /// When `task` last ran to its end, nil if never.
    public func lastReconciliation(_ task: ReconciliationTask) async throws -> Date? {
        try await database.read { db in
            try await Date.fetchOne(db, sql: "SELECT lastRunAt FROM reconciliation_run WHERE task = ?", arguments: [task.rawValue])
        }
    }

    /// Takes the lease on `name` until `until`, if nobody holds it now: how one of several order
    /// services sharing the store becomes the one that runs a scheduled task. True when taken.
    public func takeLease(_ name: String, until: Date, now: Date = Date()) async throws -> Bool {
        try await database.write { db in
            try await db.execute(
                sql: """
                    INSERT INTO reconciliation_run (task, lastRunAt) VALUES (?, ?)
                    ON CONFLICT (task) DO UPDATE SET lastRunAt = excluded.lastRunAt WHERE reconciliation_run.lastRunAt < ?
                    """,
                arguments: ["lease:" + name, until, now]) > 0
        }
    }

    /// Gives back the lease on `name` taken until `until`, as of `at` (when it was taken): the
    /// next run may start as soon as it falls due, however close to the lease's end that is. A
    /// lease another service took since is left alone.
    public func releaseLease(_ name: String, takenUntil until: Date, at: Date) async throws {
        try await database.write { db in
            try await db.execute(
                sql: "UPDATE reconciliation_run SET lastRunAt = ? WHERE task = ? AND lastRunAt = ?",
                arguments: [at, "lease:" + name, until])
        }
    }

    /// Records that `task` ran to its end at `date`.
    public func recordReconciliation(_ task: ReconciliationTask, at date: Date) async throws {
        try await database.write { db in
            try await db.execute(
                sql: """
                    INSERT INTO reconciliation_run (task, lastRunAt) VALUES (?, ?)
                    ON CONFLICT (task) DO UPDATE SET lastRunAt = CASE WHEN excluded.lastRunAt > reconciliation_run.lastRunAt
                        THEN excluded.lastRunAt ELSE reconciliation_run.lastRunAt END
                    """,
                arguments: [task.rawValue, date])
        }
    }

    /// The upload a notification was applied as, or nil when no notification with this
    /// `notificationUUID` was applied yet: the intake answers a duplicate with it and stores
    /// nothing again. A store it cannot read is `unavailable` (the intake answers 503, which
    /// Apple retries).
    public func appliedNotification(_ notificationUUID: String) async throws(OrderStoreError) -> UUID? {
        do {
            return try await database.read { db in
                try await String.fetchOne(
                    db, sql: "SELECT submissionId FROM notification WHERE notificationUUID = ?", arguments: [notificationUUID])
            }.flatMap(UUID.init(uuidString:))
        } catch {
            throw OrderStoreError(.unavailable, "cannot read the applied notifications: \(error)")
        }
    }

    /// Whether a notification was applied already or re-delivered already.
    public func knowsNotification(_ notificationUUID: String) async throws -> Bool {
        try await database.read { db in
            try await Bool.fetchOne(
                db,
                sql: """
                    SELECT EXISTS (SELECT 1 FROM notification WHERE notificationUUID = ?)
                        OR EXISTS (SELECT 1 FROM redelivered_notification WHERE notificationUUID = ?)
                    """,
                arguments: [notificationUUID, notificationUUID]) ?? false
        }
    }

    /// Queues a notification from Apple's history exactly as the intake's notification route
    /// does (a submission carrying the signed payload, and its message to the verify queue, in
    /// one transaction), then remembers its `notificationUUID` so it is re-delivered once. A
    /// crash between the two re-delivers it again at worst: each notification applies once.
    public func acceptRedelivered(
        signedPayload: String, notificationUUID: String, now: Date = Date(),
        message: (VerifyRequest) throws -> OutboxMessage
    ) async throws -> SubmissionID {
        var request = VerifyRequest(submissionId: UUID(), userId: "", receiptData: "", attempt: 1, acceptedAt: now)
        request.signedPayload = signedPayload
        try await accept(request, message: try message(request))
        let submissionId = request.submissionId
        try await database.write { db in
            try await db.execute(
                sql: """
                    INSERT INTO redelivered_notification (notificationUUID, submissionId, redeliveredAt) VALUES (?, ?, ?)
                    ON CONFLICT DO NOTHING
                    """,
                arguments: [notificationUUID, submissionId.uuidString, now])
        }
        return submissionId
    }
}

/// A transaction the reconciliation asks Apple's transaction history with, standing for its
/// customer, and how far that history was read.
public struct HistoryAnchor: Sendable, Equatable {
    /// An original transaction id of the customer's.
    public var transactionId: String
    public var environment: AppStoreEnvironment
    /// Apple's revision from the last read; nil: never read.
    public var revision: String?
    /// The customer (Apple's appTransactionId) its history was found to be, once read.
    public var customer: String?

    /// Creates an anchor.
    public init(transactionId: String, environment: AppStoreEnvironment, revision: String?, customer: String? = nil) {
        self.transactionId = transactionId
        self.environment = environment
        self.revision = revision
        self.customer = customer
    }
}

extension OrderStore {
    /// The transactions to read Apple's history with: every subscription's chain, and every
    /// purchase with an open question (held for a person, or credited since `openSince`, while
    /// Apple may still refund it), one per original transaction, with the revision last kept.
    public func historyAnchors(openSince: Date) async throws -> [HistoryAnchor] {
        try await database.read { db in
            try await db.rows(
                sql: """
                    SELECT anchor.transactionId, anchor.environment, history_revision.revision, history_revision.customer
                    FROM (
                        SELECT originalTransactionId AS transactionId, environment FROM subscription
                        UNION
                        SELECT originalTransactionId AS transactionId, environment FROM purchase
                        WHERE heldReason IS NOT NULL OR creditedAt >= ?
                    ) AS anchor
                    LEFT JOIN history_revision ON history_revision.anchor = anchor.transactionId
                    ORDER BY anchor.transactionId
                    """,
                arguments: [openSince]
            ).map {
                HistoryAnchor(
                    transactionId: $0["transactionId"], environment: AppStoreEnvironment(rawValue: $0["environment"]) ?? .production,
                    revision: $0["revision"], customer: $0["customer"])
            }
        }
    }

    /// Keeps Apple's revision of a customer's history, read with `anchor`, for it and for every
    /// other original transaction the read listed (`also`): any of them asks for the same
    /// history next time, from there.
    public func recordHistoryRevision(
        _ anchor: HistoryAnchor, revision: String, customer: String?, also others: Set<String> = [], now: Date = Date()
    ) async throws {
        let statements = ([anchor.transactionId] + others.subtracting([anchor.transactionId]).sorted()).map { id in
            SQLStatement(
                """
                INSERT INTO history_revision (anchor, environment, revision, customer, readAt) VALUES (?, ?, ?, ?, ?)
                ON CONFLICT (anchor) DO UPDATE SET revision = excluded.revision,
                    customer = coalesce(excluded.customer, history_revision.customer), readAt = excluded.readAt
                """, [id, anchor.environment.rawValue, revision, customer, now])
        }
        try await database.writeQueues { db in try await db.executeBatch(statements) }
    }

    /// Whether the store has a row of the transaction `transactionId` (credited, or held).
    public func knowsPurchase(_ transactionId: String) async throws -> Bool {
        try await database.read { db in
            try await db.cachedRow(sql: "SELECT 1 FROM purchase WHERE transactionId = ?", arguments: [transactionId]) != nil
        }
    }

    /// Apple's refund or revocation of `purchase` as the store holds it; nil when there is none.
    public func revocation(of purchase: VerifiedPurchase, policy: CreditPolicy) async throws -> LedgerFacts.Revocation? {
        let key = policy.creditKey(of: purchase)
        return try await database.read { db in try await Self.revocation(key: key, in: db) }
    }
}
