public import Foundation
public import IAPCore
public import Logging
import Metrics
public import OrderStore
public import ServiceLifecycle

/// How often and after how long the sweeper re-queues stuck submissions.
public struct SweeperSettings: Sendable {
    /// Time between sweeps.
    public var interval: Duration
    /// A `pending` submission untouched for this long is queued again.
    public var pendingAfter: Duration
    /// A `retrying` submission whose attempt is this late is queued again.
    public var retryGrace: Duration
    /// Rejected submissions and what they carried are deleted this long after they were
    /// rejected; nil keeps them.
    public var retention: Duration?
    /// Time between retention purges (the first runs at start).
    public var retentionInterval: Duration

    /// Creates settings.
    public init(
        interval: Duration = Setting.sweepIntervalSeconds.defaultSeconds,
        pendingAfter: Duration = Setting.sweepPendingAfterSeconds.defaultSeconds,
        retryGrace: Duration = Setting.sweepRetryGraceSeconds.defaultSeconds,
        retention: Duration? = .seconds(Setting.retentionDays.defaultInt * 86_400), retentionInterval: Duration = .seconds(3600)
    ) {
        self.interval = interval
        self.pendingAfter = pendingAfter
        self.retryGrace = retryGrace
        self.retention = retention
        self.retentionInterval = retentionInterval
    }
}

/// Lost-message recovery in the order service: submissions accepted but making no progress
/// (their message was lost with a broker, purged, or stuck in a dead-letter queue) are
/// queued again through the outbox. Duplicates are harmless: the finisher is idempotent.
/// It also purges rejected submissions past their retention, at start and then periodically.
public final class SubmissionSweeper: Service, Sendable {
    private let settings: SweeperSettings
    private let names: PipelineNames
    private let store: OrderStore
    private let logger: Logger
    private let purged = Counter(label: MetricNames.retentionPurged)

    /// Creates a sweeper.
    public init(settings: SweeperSettings, names: PipelineNames, store: OrderStore, logger: Logger) {
        self.settings = settings
        self.names = names
        self.store = store
        self.logger = logger
    }

    public func run() async throws {
        var nextPurge = ContinuousClock.now
        while !Task.isShuttingDownGracefully && !Task.isCancelled {
            if settings.retention != nil, ContinuousClock.now >= nextPurge {
                await purgeExpired()
                nextPurge = ContinuousClock.now + settings.retentionInterval
            }
            let interval = settings.interval
            do {
                try await cancelWhenGracefulShutdown { try await Task.sleep(for: interval) }
            } catch {
                return
            }
            if Task.isShuttingDownGracefully { return }
            await sweep()
            await purgeIdleRateBuckets()
        }
    }

    /// Deletes rejected submissions, and the audit entries about no money, older than the
    /// retention period; returns how many submissions.
    @discardableResult
    public func purgeExpired(now: Date = Date()) async -> Int {
        guard let retention = settings.retention else { return 0 }
        do {
            let cutoff = now.addingTimeInterval(-Self.seconds(retention))
            let count = try await store.purgeRejected(olderThan: cutoff, now: now)
            if count > 0 {
                purged.increment(by: count)
                logger.info("rejected submissions purged", metadata: ["iap.count": "\(count)"])
            }
            let entries = try await store.purgeAuditEntries(olderThan: cutoff)
            if entries > 0 { logger.info("audit entries about no money purged", metadata: ["iap.count": "\(entries)"]) }
            return count
        } catch {
            logger.error("retention purge failed", metadata: ["error": "\(error)"])
            return 0
        }
    }

    /// Deletes the shared rate-limit buckets nobody used lately (full again, so nothing is
    /// forgotten); only where the store counts rate limits.
    func purgeIdleRateBuckets() async {
        guard store.sharesRateLimits else { return }
        do {
            try await store.purgeIdleRateBuckets()
        } catch {
            logger.debug("idle rate-limit buckets not purged", metadata: ["error": "\(error)"])
        }
    }

    /// One sweep; returns how many submissions were queued again.
    @discardableResult
    public func sweep(now: Date = Date()) async -> Int {
        let names = self.names
        do {
            let requests = try await store.requeueStuck(
                pendingBefore: now.addingTimeInterval(-Self.seconds(settings.pendingAfter)),
                retryDueBefore: now.addingTimeInterval(-Self.seconds(settings.retryGrace)), limit: 1000, now: now
            ) { request in
                .verify(request, routingKey: names.verifyQueue(priority: VerifyPriority.retry), priority: VerifyPriority.retry)
            }
            if !requests.isEmpty {
                logger.warning(
                    "stuck submissions queued again",
                    metadata: ["iap.count": "\(requests.count)", "iap.submission.id": "\(requests[0].submissionId)"])
            }
            return requests.count
        } catch {
            logger.error("sweep failed", metadata: ["error": "\(error)"])
            return 0
        }
    }

    private static func seconds(_ duration: Duration) -> TimeInterval {
        TimeInterval(duration.components.seconds) + TimeInterval(duration.components.attoseconds) / 1e18
    }
}
