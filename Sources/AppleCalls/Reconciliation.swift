public import AppStore
public import Foundation
public import IAPCore
import Ledger
public import Logging
import Metrics
public import OrderStore
public import ServiceLifecycle

/// When and how far the order service reconciles its subscriptions with Apple.
public struct ReconciliationSettings: Sendable {
    /// Time between runs, counted from the last run recorded in the store.
    public var interval: Duration
    /// An active subscription whose period ends within this is due to be asked about.
    public var horizon: Duration
    /// How far back the first run looks for notifications Apple could not deliver.
    public var firstLookback: Duration
    /// How far each later run looks back before the previous one's end (Apple may record a
    /// failed delivery late); a notification is re-delivered once all the same.
    public var overlap: Duration
    /// How long after its credit a purchase's history is still read: Apple may refund it.
    public var openWindow: Duration

    /// Creates settings.
    public init(
        interval: Duration = Setting.reconcileInterval.defaultDuration, horizon: Duration = .seconds(86_400),
        firstLookback: Duration = .seconds(7 * 86_400), overlap: Duration = .seconds(300),
        openWindow: Duration = .seconds(90 * 86_400)
    ) {
        self.openWindow = openWindow
        self.interval = interval
        self.horizon = horizon
        self.firstLookback = firstLookback
        self.overlap = overlap
    }
}

/// What one reconciliation run did.
public struct ReconciliationReport: Sendable, Encodable {
    /// Subscriptions asked about (due to renew, in billing retry or a grace period).
    public var subscriptionsChecked = 0
    /// Notifications built from Apple's answers and applied for the first time.
    public var notificationsApplied = 0
    /// Those of them that changed something (each audited).
    public var corrections: [ReconciliationChange] = []
    /// Customers whose transaction history was read (one per customer: a history read covers
    /// every transaction it lists).
    public var historiesRead = 0
    /// Transactions those histories listed as new or changed since the last read.
    public var transactionsChanged = 0
    /// Notifications Apple lists as not delivered since the last run.
    public var failedNotificationsFound = 0
    /// Those of them queued again (the rest were applied or re-delivered before).
    public var notificationsRedelivered = 0
    /// What failed (a call to Apple, an answer that did not verify); the rest was applied.
    public var errors: [String] = []

    /// Creates an empty report.
    public init() {}
}

/// Subscription truth without notifications: asks Apple about every subscription that is due
/// to renew, in billing retry or in a grace period, and applies what it finds exactly as the
/// notification would have been applied; then re-delivers the notifications Apple could not
/// send us. Every change is audited (actor `reconciliation`) and counted.
public final class Reconciliation: Sendable {
    private let store: OrderStore
    private let reader: SubscriptionStatusReader
    private let policy: CreditPolicy
    private let verifyQueue: String
    private let settings: ReconciliationSettings
    private let logger: Logger

    /// Creates a reconciliation over `store`; re-delivered notifications go to `verifyQueue`
    /// through the outbox (the store wakes the relay).
    public init(
        store: OrderStore, reader: SubscriptionStatusReader, policy: CreditPolicy, verifyQueue: String,
        settings: ReconciliationSettings = .init(), logger: Logger
    ) {
        self.store = store
        self.reader = reader
        self.policy = policy
        self.verifyQueue = verifyQueue
        self.settings = settings
        self.logger = logger
    }

    /// The reconciliation's metrics, exported at 0 by every order service (also when it is off).
    public static func exportMetrics() {
        Counter(label: MetricNames.reconciliationRuns, dimensions: [("result", "ok")]).increment(by: 0)
        Counter(label: MetricNames.reconciliationRuns, dimensions: [("result", "failed")]).increment(by: 0)
        Counter(label: MetricNames.reconciliationCorrections).increment(by: 0)
        Counter(label: MetricNames.reconciliationRedelivered).increment(by: 0)
    }

    /// Runs once now; what could be applied is applied even when some of it failed.
    public func run(now: Date = Date()) async -> ReconciliationReport {
        var report = ReconciliationReport()
        await reconcileSubscriptions(now: now, into: &report)
        await reconcileHistories(now: now, into: &report)
        await redeliverFailedNotifications(now: now, into: &report)
        Counter(label: MetricNames.reconciliationRuns, dimensions: [("result", report.errors.isEmpty ? "ok" : "failed")])
            .increment()
        let metadata: Logger.Metadata = [
            "iap.count": "\(report.subscriptionsChecked)", "iap.corrections": "\(report.corrections.count)",
            "iap.redelivered": "\(report.notificationsRedelivered)",
        ]
        if report.errors.isEmpty {
            logger.info("reconciliation done", metadata: metadata)
        } else {
            logger.error("reconciliation incomplete", metadata: metadata.merging(["error": "\(report.errors[0])"]) { $1 })
        }
        return report
    }

    /// Runs once now if no other order service sharing the store is running one (a lease held
    /// for at most `lease`, given back when the run ends); nil when another one is.
    public func runIfNoOtherIs(lease: Duration, now: Date = Date()) async throws -> ReconciliationReport? {
        let until = now.addingTimeInterval(Self.seconds(lease))
        guard try await store.takeLease("reconciliation", until: until, now: now) else {
            logger.info("reconciliation skipped: another order service is running it")
            return nil
        }
        let report = await run(now: now)
        // The next run falls due an interval after this one began, which is where a lease of
        // one interval ends: held to its end, it would turn that run away.
        do {
            try await store.releaseLease("reconciliation", takenUntil: until, at: now)
        } catch {
            logger.warning("reconciliation lease not given back; it ends by itself", metadata: ["error": "\(error)"])
        }
        return report
    }

    /// When the last run ended, nil if none did.
    public func lastRun() async throws -> Date? {
        try await store.lastReconciliation(.subscriptions)
    }

    /// (a) Asks Apple about each due subscription and applies its refunds and status.
    private func reconcileSubscriptions(now: Date, into report: inout ReconciliationReport) async {
        let due: [DueSubscription]
        do {
            due = try await store.subscriptionsDue(before: now.addingTimeInterval(Self.seconds(settings.horizon)))
        } catch {
            report.errors.append("cannot read the subscriptions: \(error)")
            return
        }
        for subscription in due {
            report.subscriptionsChecked += 1
            do {
                let findings = try await reader.notifications(
                    originalTransactionId: subscription.originalTransactionId, transactionId: subscription.lastTransactionId,
                    in: ServerAPIEnvironment(rawValue: subscription.environment.rawValue) ?? .production)
                for finding in findings {
                    try await apply(
                        finding.notification, signedTransaction: finding.signedTransaction, into: &report,
                        saying: "subscription corrected from Apple's answer")
                }
            } catch {
                logger.warning(
                    "subscription not reconciled",
                    metadata: ["iap.subscription.id": "\(subscription.originalTransactionId)", "error": "\(error)"])
                report.errors.append("subscription \(subscription.originalTransactionId): \(error)")
            }
        }
        do {
            try await store.recordReconciliation(.subscriptions, at: now)
        } catch {
            report.errors.append("cannot record the run: \(error)")
        }
    }

    /// (b) Reads, for every customer with a subscription or a purchase with an open question
    /// (held, or credited within `openWindow`, while Apple may refund it), what changed in
    /// their purchases since the revision kept from the last read (Transaction History v2),
    /// and applies each change as the notification Apple sends for it: a purchase or renewal
    /// nobody told us of, a refund, a reversed refund. A deployment that missed every
    /// notification for a while converges in one run; the next reads only what changed since.
    private func reconcileHistories(now: Date, into report: inout ReconciliationReport) async {
        let anchors: [HistoryAnchor]
        do {
            anchors = try await store.historyAnchors(openSince: now.addingTimeInterval(-Self.seconds(settings.openWindow)))
        } catch {
            report.errors.append("cannot read the customers to reconcile: \(error)")
            return
        }
        // A history lists every transaction of its customer: an anchor it listed, or one of a
        // customer read already, is read already.
        var covered = Set<String>()
        var customersRead = Set<String>()
        for anchor in anchors where !covered.contains(anchor.transactionId) {
            if let customer = anchor.customer, customersRead.contains(customer) { continue }
            do {
                let changes = try await reader.changes(
                    of: anchor.transactionId, since: anchor.revision,
                    in: ServerAPIEnvironment(rawValue: anchor.environment.rawValue) ?? .production)
                report.historiesRead += 1
                report.transactionsChanged += changes.transactions.count
                for (transaction, signed) in changes.transactions {
                    covered.insert(transaction.originalTransactionId)
                    var notification = SubscriptionStatusReader.notification(history: transaction, refundStands: false)
                    if transaction.revocationDate == nil, let purchase = notification.purchase {
                        if try await store.revocation(of: purchase, policy: policy)?.stands == true {
                            notification = SubscriptionStatusReader.notification(history: transaction, refundStands: true)
                        } else if try await store.knowsPurchase(transaction.transactionId) {
                            // Known, and nothing Apple says of it is news: no notification to apply.
                            continue
                        }
                    }
                    try await apply(
                        notification, signedTransaction: signed, into: &report,
                        saying: "purchase corrected from Apple's transaction history")
                }
                let customer = changes.transactions.lazy.compactMap(\.transaction.appTransactionId).first ?? anchor.customer
                if let customer { customersRead.insert(customer) }
                if let revision = changes.revision {
                    try await store.recordHistoryRevision(
                        anchor, revision: revision, customer: customer,
                        also: Set(changes.transactions.map(\.transaction.originalTransactionId)))
                }
            } catch {
                logger.warning(
                    "transaction history not reconciled", metadata: ["iap.transaction.id": "\(anchor.transactionId)", "error": "\(error)"])
                report.errors.append("history of \(anchor.transactionId): \(error)")
            }
        }
    }

    /// (c) Re-delivers what Get Notification History (onlyFailures) lists since the last run,
    /// through the notification path (a submission and its message to the verify queue).
    private func redeliverFailedNotifications(now: Date, into report: inout ReconciliationReport) async {
        let start: Date
        do {
            start =
                try await store.lastReconciliation(.notifications)?.addingTimeInterval(-Self.seconds(settings.overlap))
                ?? now.addingTimeInterval(-Self.seconds(settings.firstLookback))
        } catch {
            report.errors.append("cannot read the last run: \(error)")
            return
        }
        var complete = true
        let verifyQueue = self.verifyQueue
        for environment in ServerAPIEnvironment.allCases {
            do {
                let payloads = try await reader.client.failedNotifications(from: start, to: now, in: environment)
                report.failedNotificationsFound += payloads.count
                for payload in payloads {
                    let notification: ResponseBodyV2DecodedPayload
                    do {
                        notification = try await reader.verifier.verifyNotification(payload)
                    } catch {
                        // It will not verify next time either: reported, and the window moves on.
                        report.errors.append("a notification in Apple's history does not verify: \(error)")
                        continue
                    }
                    guard try await !store.knowsNotification(notification.notificationUUID) else { continue }
                    let submission = try await store.acceptRedelivered(
                        signedPayload: payload, notificationUUID: notification.notificationUUID, now: Date()
                    ) { request in
                        .verify(request, routingKey: verifyQueue, priority: VerifyPriority.firstAttempt)
                    }
                    report.notificationsRedelivered += 1
                    Counter(label: MetricNames.reconciliationRedelivered).increment()
                    logger.notice(
                        "undelivered App Store notification queued again",
                        metadata: [
                            "iap.submission.id": "\(submission)", "iap.notification.type": "\(notification.notificationType)",
                        ])
                }
            } catch {
                complete = false
                report.errors.append("notification history (\(environment.rawValue)): \(error)")
            }
        }
        // The next run asks from here only once this window was read in full.
        if complete {
            do {
                try await store.recordReconciliation(.notifications, at: now)
            } catch {
                report.errors.append("cannot record the run: \(error)")
            }
        }
    }

    /// Applies a notification built from Apple's answer through the notification path, and
    /// counts, logs and reports what it changed.
    private func apply(
        _ notification: AppStoreNotification, signedTransaction: String, into report: inout ReconciliationReport,
        saying message: Logger.Message
    ) async throws {
        guard let change = try await store.applyReconciliation(notification, signedTransaction: signedTransaction, policy: policy)
        else { return }
        report.notificationsApplied += 1
        guard change.corrected else { return }
        report.corrections.append(change)
        Counter(label: MetricNames.reconciliationCorrections).increment()
        logger.notice(
            message,
            metadata: [
                "iap.subscription.id": "\(change.originalTransactionId)", "iap.transaction.id": "\(change.transactionId)",
                "iap.notification.type": "\(change.notificationType)", "iap.outcome": "\(change.outcome)",
            ])
    }

    static func seconds(_ duration: Duration) -> TimeInterval {
        TimeInterval(duration.components.seconds) + TimeInterval(duration.components.attoseconds) / 1e18
    }
}

/// Runs the reconciliation every `interval`, counted from the last run recorded in the store
/// (so a restart neither skips nor repeats one); a run that failed is tried again within an hour.
public final class ReconciliationService: Service, Sendable {
    private let reconciliation: Reconciliation
    private let interval: Duration
    private let logger: Logger

    /// Creates the service.
    public init(reconciliation: Reconciliation, interval: Duration, logger: Logger) {
        self.reconciliation = reconciliation
        self.interval = interval
        self.logger = logger
    }

    /// Runs a reconciliation whenever one is due, until graceful shutdown.
    public func run() async throws {
        var retryAfter: Duration? = nil
        while !Task.isShuttingDownGracefully && !Task.isCancelled {
            var wait = interval
            if let retryAfter {
                wait = min(interval, retryAfter)
            } else if let last = try? await reconciliation.lastRun() {
                let due = last.addingTimeInterval(Reconciliation.seconds(interval)).timeIntervalSinceNow
                wait = .milliseconds(Int64(max(0, due) * 1000))
            } else {
                wait = .zero
            }
            // A few seconds after start at the soonest: the rest of the process comes up first.
            let delay = max(wait, .seconds(10))
            do {
                try await cancelWhenGracefulShutdown { try await Task.sleep(for: delay) }
            } catch {
                return
            }
            if Task.isShuttingDownGracefully { return }
            guard let report = try? await reconciliation.runIfNoOtherIs(lease: min(interval, .seconds(3600))) else {
                // Another order service runs it (or the store is away): look again later.
                retryAfter = min(interval, .seconds(3600))
                continue
            }
            retryAfter = report.errors.isEmpty ? nil : .seconds(3600)
        }
    }
}
