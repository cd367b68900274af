public import AsyncHTTPClient
import Crypto
import Foundation
public import IAPCore
public import Logging
import Metrics
public import Messaging
public import OrderStore
public import ServiceLifecycle

/// How a finisher runs.
public struct FinisherSettings: Sendable {
    /// Queue names.
    public var names: PipelineNames
    /// Results fetched and applied at once (sharing the order store's group commits).
    public var prefetch: Int
    /// When and where to alert.
    public var alerts: AlertSettings
    /// What each product grants; nil credits purchases with their quantity only.
    public var catalog: Catalog?

    /// Which sandbox purchases notifications may credit (uploads are checked by the verifier).
    public var sandboxPolicy: SandboxPolicy
    /// What a restore uploaded by another user than the owner does.
    public var restorePolicy: RestorePolicy
    /// Whether each settled transaction is queued to be finished at Apple (set from
    /// `IAP_FINISH_TRANSACTIONS` by the pipeline).
    public var finishAtApple = false

    /// Creates settings.
    public init(
        names: PipelineNames = .init(), prefetch: Int = Setting.finisherPrefetch.defaultInt, alerts: AlertSettings = .init(), catalog: Catalog? = nil,
        sandboxPolicy: SandboxPolicy = .accept, restorePolicy: RestorePolicy = .keep
    ) {
        self.sandboxPolicy = sandboxPolicy
        self.restorePolicy = restorePolicy
        self.names = names
        self.prefetch = prefetch
        self.alerts = alerts
        self.catalog = catalog
    }
}

/// Applies verification results to the order store: each message all or nothing (its own
/// savepoint of a group commit), acked only after the commit, idempotent under redelivery.
public final class FinisherService: Service, Sendable {
    private let settings: FinisherSettings
    private let consumer: AMQPConnection
    private let publisher: AMQPConnection
    private let store: OrderStore
    private let logger: Logger
    private let codec = MessageCodec()
    private let alerts: AlertSender
    private let policy: CreditPolicy

    /// Creates a finisher that consumes and acks through `consumer`, dead-letters through
    /// `publisher`; `httpClient` carries webhook alerts, when configured.
    public init(
        settings: FinisherSettings, consumer: AMQPConnection, publisher: AMQPConnection, store: OrderStore,
        httpClient: HTTPClient?, logger: Logger
    ) {
        self.policy = CreditPolicy(
            catalog: settings.catalog, eventsExchange: settings.names.events, sandbox: settings.sandboxPolicy,
            restore: settings.restorePolicy, finishAtApple: settings.finishAtApple)
        self.settings = settings
        self.consumer = consumer
        self.publisher = publisher
        self.store = store
        self.logger = logger
        self.alerts = AlertSender(settings: settings.alerts, httpClient: httpClient, logger: logger)
        // Exported from the start, so dashboards show 0 rather than nothing.
        Counter(label: MetricNames.grants).increment(by: 0)
        Counter(label: MetricNames.replays).increment(by: 0)
        Counter(label: MetricNames.revocations).increment(by: 0)
        Counter(label: MetricNames.deadLetters, dimensions: [("queue", "results")]).increment(by: 0)
    }

    /// Handles up to `prefetch` results at once: each is still applied all or nothing, and the
    /// ones applied at the same time share the order store's group commit.
    public func run() async throws {
        // Grants from before credit keys: keyed by product type before the first result applies.
        do {
            let rekeyed = try await store.rekeyEarlierGrants(policy: policy)
            if rekeyed > 0 { logger.info("earlier grants re-keyed by product type", metadata: ["iap.count": "\(rekeyed)"]) }
        } catch {
            logger.error("earlier grants not re-keyed", metadata: ["error": "\(error)"])
        }
        let limit = max(1, settings.prefetch)
        let consumer = self.consumer.consume(queue: settings.names.results, prefetch: UInt16(clamping: limit))
        await withTaskGroup(of: Void.self) { group in
            var running = 0
            for await delivery in consumer.cancelOnGracefulShutdown() {
                if running == limit {
                    await group.next()
                    running -= 1
                }
                group.addTask { await self.handle(delivery) }
                running += 1
            }
        }
        await consumer.cancel()
    }

    /// Alerting never holds up crediting: a failure here is logged and the result still acked.
    private func alertIfNeeded(_ result: VerifyResult, state: SubmissionState) async {
        guard var alert = alerts.alert(for: result, state: state) else { return }
        do {
            guard try await store.claimAlert(for: result.submissionId) else { return }
            // A verified answer with held purchases carries no reason of its own: the stored
            // status says why (the submission's reason, else the first held transaction's).
            if alert.reason == nil, let status = try await store.status(of: result.submissionId) {
                alert.fill(from: status)
            }
        } catch {
            logger.error("alert not recorded", metadata: ["iap.submission.id": "\(result.submissionId)", "error": "\(error)"])
            return
        }
        let alerts = self.alerts
        Task { await alerts.send(alert) }
    }

    /// What is kept of a rejected upload's receipt or signed data: `sha256:<hex>:<bytes>`.
    public static func digest(_ text: String) -> String {
        let hex = SHA256.hash(data: Data(text.utf8)).map { String(format: "%02x", $0) }.joined()
        return "sha256:\(hex):\(text.utf8.count)"
    }

    func handle(_ delivery: AMQPDelivery) async {
        let result: VerifyResult
        do {
            // Deflated or not (`content-encoding`), as the verifier published it.
            result = try codec.decodeResult(from: try delivery.decodedBody())
        } catch {
            logger.error(
                "undecodable result sent to the dead-letter queue",
                metadata: ["amqp.queue": "\(settings.names.results)", "error": "\(error)"])
            await publisher.deadLetter(delivery, to: settings.names.resultsDead, reason: "undecodable result: \(error)")
            Counter(label: MetricNames.deadLetters, dimensions: [("queue", "results")]).increment()
            return
        }
        let metadata: Logger.Metadata = [
            "iap.submission.id": "\(result.submissionId)", "iap.attempt": "\(result.attempt)",
        ]
        do {
            let applied = try await store.applyCounting(result, policy: policy)
            let state = applied.state
            Counter(label: MetricNames.resultsApplied, dimensions: [("state", state.rawValue)]).increment()
            Counter(label: MetricNames.grants).increment(by: applied.credited)
            Counter(label: MetricNames.replays).increment(by: applied.replayed)
            Counter(label: MetricNames.revocations).increment(by: applied.revoked)
            if applied.replayed > 0 {
                logger.warning(
                    "purchase uploaded by another user than its owner",
                    metadata: metadata.merging(["iap.count": "\(applied.replayed)"]) { $1 })
            }
            logger.debug("result applied", metadata: metadata.merging(["iap.state": "\(state.rawValue)"]) { $1 })
            if state == .rejected {
                // Apple declared it invalid: a digest is all that is kept of what it was sent with.
                do {
                    try await store.keepOnlyDigests(ofRejected: result.submissionId, digest: Self.digest)
                } catch {
                    logger.warning("rejected upload kept whole until retention", metadata: metadata.merging(["error": "\(error)"]) { $1 })
                }
            }
            await alertIfNeeded(result, state: state)
        } catch let error as OrderStoreError where error.code == .unknownSubmission {
            logger.warning("result for an unknown submission sent to the dead-letter queue", metadata: metadata)
            await publisher.deadLetter(
                delivery, to: settings.names.resultsDead, reason: "no submission \(result.submissionId) in this store")
            Counter(label: MetricNames.deadLetters, dimensions: [("queue", "results")]).increment()
            return
        } catch {
            logger.error(
                "result not applied; it will be redelivered",
                metadata: metadata.merging(["error": "\(error)"]) { $1 })
            try? await Task.sleep(for: .seconds(1))
            try? await delivery.reject(requeue: true)
            return
        }
        do {
            try await delivery.ack()
        } catch {
            // The broker delivers it again; applying it again changes nothing.
            logger.debug("ack failed after commit", metadata: metadata)
        }
    }
}
