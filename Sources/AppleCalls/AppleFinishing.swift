public import AppStore
public import Foundation
import IAPCore
public import Logging
import Metrics
public import OrderStore
public import ServiceLifecycle

/// Finishes at Apple each transaction the order store settled (App Store Server API 1.20,
/// Finish Transaction), so that a purchase is finished even when the app never comes back.
///
/// The commit that credited or settled a transaction queued it (`apple_finish`); this service
/// reads the due rows after each commit that queued calls to Apple and at least every second, claims
/// them for a while (several order services may share a PostgreSQL store) and calls Apple once
/// per transaction. Apple's transient answers (5xx, 429, a timeout) are asked again later, the
/// waits growing from 2 s to an hour; an id Apple does not know there is refused for good. The
/// client paces the calls within Apple's rate limit for the endpoint. A transaction that is
/// not settled is never queued, so never finished here.
public final class AppleFinishing: Service, Sendable {
    private let store: OrderStore
    private let client: AppStoreServerAPIClient
    private let batchSize: Int
    private let pollInterval: Duration
    private let logger: Logger
    private let worker = AppleCallQueue.workerName("finish")

    /// Creates the service.
    public init(
        store: OrderStore, client: AppStoreServerAPIClient, batchSize: Int = 50, pollInterval: Duration = .seconds(1),
        logger: Logger
    ) {
        self.store = store
        self.client = client
        self.batchSize = batchSize
        self.pollInterval = pollInterval
        self.logger = logger
    }

    /// The service's metrics, exported at 0 from the start.
    public static func exportMetrics() {
        for result in ["finished", "retry", "refused"] {
            Counter(label: MetricNames.appleFinishes, dimensions: [("result", result)]).increment(by: 0)
        }
        Gauge(label: MetricNames.appleFinishBacklog).record(0)
    }

    public func run() async throws {
        await AppleCallQueue.drain(store: store, batchSize: batchSize, pollInterval: pollInterval) { await self.finishBatch() }
    }

    /// Calls Apple for one batch of due transactions; returns how many were claimed.
    @discardableResult
    public func finishBatch(now: Date = Date()) async -> Int {
        let due: [AppleFinish]
        do {
            due = try await store.claimDueFinishes(limit: batchSize, worker: worker, now: now)
        } catch {
            logger.error("finish queue read failed", metadata: ["error": "\(error)"])
            return 0
        }
        await withTaskGroup(of: Void.self) { group in
            for finish in due {
                group.addTask { await self.finish(finish) }
            }
        }
        return due.count
    }

    private func finish(_ finish: AppleFinish) async {
        let outcome: AppleFinishOutcome
        do {
            try await client.finishTransaction(
                finish.transactionId, in: finish.environment == .sandbox ? .sandbox : .production)
            outcome = .finished
        } catch {
            outcome = Self.outcome(of: error, attempts: finish.attempts + 1, now: Date())
        }
        let result: String
        switch outcome {
        case .finished: result = "finished"
        case .retry: result = "retry"
        case .refused(let why):
            result = "refused"
            logger.error(
                "Apple refused to finish a settled transaction",
                metadata: ["iap.transaction.id": "\(finish.transactionId)", "error": "\(why)"])
        }
        Counter(label: MetricNames.appleFinishes, dimensions: [("result", result)]).increment()
        do {
            try await store.recordFinish(finish.transactionId, outcome)
        } catch {
            // The claim lapses and the call is made again: Apple takes a repeated finish.
            logger.error(
                "cannot record a finish", metadata: ["iap.transaction.id": "\(finish.transactionId)", "error": "\(error)"])
        }
    }

    /// What a failed call comes to after `attempts` calls: asked again later unless Apple
    /// said the id is not its (`notFound`) or the request is wrong (`invalid`). A refused
    /// bearer token is the deployment's key, which an operator fixes: asked again later.
    static func outcome(of error: ServerAPIError, attempts: Int, now: Date) -> AppleFinishOutcome {
        switch error.kind {
        case .notFound, .invalid:
            return .refused(error.description)
        case .transient, .unauthorized:
            return .retry(at: AppleCallQueue.nextAttempt(after: error, attempts: attempts, now: now), error: error.description)
        }
    }
}

/// What the order service's queues of calls to Apple (finishes, consumption answers) share:
/// rows queued in the commit that made them due, read after each commit that queued calls to
/// Apple (the store's `appleCallSignal`) and at least every `pollInterval`, and retried with
/// growing waits.
enum AppleCallQueue {
    /// Runs `batch` until graceful shutdown: again at once after a full batch, else after the
    /// next commit or `pollInterval`.
    static func drain(
        store: OrderStore, batchSize: Int, pollInterval: Duration, _ batch: @escaping @Sendable () async -> Int
    ) async {
        let signal = store.appleCallSignal
        await withGracefulShutdownHandler {
            while !Task.isShuttingDownGracefully && !Task.isCancelled {
                let announced = signal.commits
                if await batch() < batchSize {
                    _ = await signal.wait(after: announced, timeout: pollInterval)
                }
            }
        } onGracefulShutdown: {
            signal.announce()
        }
    }

    /// A worker's name for its claims: the kind of calls, the host, the process, a random part.
    static func workerName(_ kind: String) -> String {
        "\(kind)-\(ProcessInfo.processInfo.hostName)-\(ProcessInfo.processInfo.processIdentifier)-\(UUID().uuidString.prefix(8))"
    }

    /// When to call again after `attempts` failed calls: 2 s after the first, doubling, at most
    /// an hour, and never before Apple's `Retry-After`, which is believed up to a day ahead (a
    /// header saying the year 9999 leaves no call undue for ever).
    static func nextAttempt(after error: ServerAPIError, attempts: Int, now: Date) -> Date {
        var at = now.addingTimeInterval(min(3600, 2 * pow(2, Double(min(max(attempts - 1, 0), 12)))))
        if let retryAfter = error.retryAfter, retryAfter > at { at = min(retryAfter, now.addingTimeInterval(86_400)) }
        return at
    }
}
