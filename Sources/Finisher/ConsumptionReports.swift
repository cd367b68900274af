import Foundation
public import IAPCore
public import Logging
public import Messaging
import Metrics
public import OrderStore
public import ServiceLifecycle

/// Records the app's consumption reports published to `<prefix>.consumption` (JSON:
/// `{"userId", "transactionId"?, "consumptionPercentage"?, "customerConsented"?}`), as
/// `POST /v1/users/{userId}/consumption` does: acked once stored; a report that cannot be read,
/// is wrong, or names a purchase that is not the user's goes to `<prefix>.results.dead` with
/// the reason; one the store could not take now is delivered again.
public final class ConsumptionReports: Service, Sendable {
    private let names: PipelineNames
    private let consumer: AMQPConnection
    private let publisher: AMQPConnection
    private let store: OrderStore
    private let logger: Logger

    /// Creates the service.
    public init(names: PipelineNames, consumer: AMQPConnection, publisher: AMQPConnection, store: OrderStore, logger: Logger) {
        self.names = names
        self.consumer = consumer
        self.publisher = publisher
        self.store = store
        self.logger = logger
    }

    public func run() async throws {
        let deliveries = consumer.consume(queue: names.consumption, prefetch: 16)
        for await delivery in deliveries.cancelOnGracefulShutdown() {
            await handle(delivery)
        }
        await deliveries.cancel()
    }

    func handle(_ delivery: AMQPDelivery) async {
        let report: ConsumptionReport
        do {
            report = try JSONDecoder().decode(ConsumptionReport.self, from: Data(try delivery.decodedBody()))
        } catch {
            return await refuse(delivery, "unreadable consumption report: \(error)")
        }
        if let problem = report.problem {
            return await refuse(delivery, "consumption report refused: \(problem.field) \(problem.why)")
        }
        do {
            try await store.reportConsumption(report)
        } catch is ConsumptionReportError {
            return await refuse(delivery, "consumption report refused: no purchase of this user has this transaction id")
        } catch {
            logger.error("consumption report not recorded; it will be redelivered", metadata: ["error": "\(error)"])
            try? await Task.sleep(for: .seconds(1))
            try? await delivery.reject(requeue: true)
            return
        }
        try? await delivery.ack()
    }

    private func refuse(_ delivery: AMQPDelivery, _ reason: String) async {
        logger.warning("consumption report sent to the dead-letter queue", metadata: ["error": "\(reason)"])
        await publisher.deadLetter(delivery, to: names.resultsDead, reason: reason)
        Counter(label: MetricNames.deadLetters, dimensions: [("queue", "consumption")]).increment()
    }
}
