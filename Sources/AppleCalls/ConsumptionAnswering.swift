public import AppStore
public import Foundation
import IAPCore
public import Ledger
public import Logging
import Metrics
public import OrderStore
public import ServiceLifecycle

/// Answers Apple's refund requests (`CONSUMPTION_REQUEST`) with Send Consumption Information v2
/// (App Store Server API 1.19), from the ledger's facts, once each, before Apple's deadline.
///
/// The finisher records each request queued; this service claims the due ones with the facts
/// its answer is decided from (`ConsumptionAnswer.decide`): nothing without the customer's
/// consent, nothing for an assigned transaction. Apple's transient answers are tried again with
/// growing waits until the deadline (12 hours after Apple signed the request), then the request
/// expires. Every outcome but a retry is final and audited.
public final class ConsumptionAnswering: Service, Sendable {
    private let store: OrderStore
    private let client: AppStoreServerAPIClient
    private let settings: ConsumptionAnswer.Settings
    private let batchSize: Int
    private let pollInterval: Duration
    private let logger: Logger
    private let worker = AppleCallQueue.workerName("consumption")

    /// Creates the service.
    public init(
        store: OrderStore, client: AppStoreServerAPIClient, settings: ConsumptionAnswer.Settings, batchSize: Int = 20,
        pollInterval: Duration = .seconds(1), logger: Logger
    ) {
        self.store = store
        self.client = client
        self.settings = settings
        self.batchSize = batchSize
        self.pollInterval = pollInterval
        self.logger = logger
    }

    /// The service's metrics, exported at 0 from the start.
    public static func exportMetrics() {
        for result in ["sent", "skipped", "refused", "expired", "retry"] {
            Counter(label: MetricNames.consumptionAnswers, dimensions: [("result", result)]).increment(by: 0)
        }
    }

    public func run() async throws {
        await AppleCallQueue.drain(store: store, batchSize: batchSize, pollInterval: pollInterval) { await self.answerBatch() }
    }

    /// Answers one batch of due requests; returns how many were claimed.
    @discardableResult
    public func answerBatch(now: Date = Date()) async -> Int {
        let due: [DueConsumptionRequest]
        do {
            due = try await store.claimDueConsumptionRequests(limit: batchSize, worker: worker, now: now)
        } catch {
            logger.error("consumption request queue read failed", metadata: ["error": "\(error)"])
            return 0
        }
        await withTaskGroup(of: Void.self) { group in
            for request in due {
                group.addTask { await self.answer(request) }
            }
        }
        return due.count
    }

    private func answer(_ request: DueConsumptionRequest) async {
        let outcome = await outcome(of: request, now: Date())
        let result: String
        switch outcome {
        case .sent: result = "sent"
        case .skipped: result = "skipped"
        case .refused(let why), .expired(let why):
            result = if case .refused = outcome { "refused" } else { "expired" }
            logger.error(
                "a refund request was not answered", metadata: ["iap.transaction.id": "\(request.transactionId)", "error": "\(why)"])
        case .retry: result = "retry"
        }
        Counter(label: MetricNames.consumptionAnswers, dimensions: [("result", result)]).increment()
        do {
            try await store.recordConsumptionAnswer(request, outcome)
        } catch {
            // The claim lapses and the answer is sent again: Apple keeps the latest.
            logger.error(
                "cannot record a consumption answer",
                metadata: ["iap.transaction.id": "\(request.transactionId)", "error": "\(error)"])
        }
    }

    private func outcome(of request: DueConsumptionRequest, now: Date) async -> ConsumptionAnswerOutcome {
        let body: ConsumptionAnswer.Body
        switch ConsumptionAnswer.decide(request.facts, settings: settings) {
        case .skip(let reason): return .skipped(reason: reason)
        case .send(let decided): body = decided
        }
        guard now < request.deadline else { return .expired("Apple's deadline passed before the answer was sent") }
        do {
            try await client.sendConsumptionInformation(
                request.transactionId, body, in: request.environment == .sandbox ? .sandbox : .production)
            return .sent(body: Self.json(body))
        } catch {
            switch error.kind {
            case .notFound, .invalid: return .refused(error.description)
            case .transient, .unauthorized:
                let at = AppleCallQueue.nextAttempt(after: error, attempts: request.attempts + 1, now: now)
                guard at < request.deadline else { return .expired(error.description) }
                return .retry(at: at, error: error.description)
            }
        }
    }

    /// The body as sent, keys sorted.
    static func json(_ body: ConsumptionAnswer.Body) -> String {
        let encoder = JSONEncoder()
        encoder.outputFormatting = .sortedKeys
        return (try? encoder.encode(body)).map { String(decoding: $0, as: UTF8.self) } ?? "{}"
    }
}
