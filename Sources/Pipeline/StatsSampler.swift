import Foundation
import IAPCore
import Logging
import Messaging
import Metrics
import OrderStore
import ServiceLifecycle

/// Samples what no event reports: submissions by state, the outbox backlog, and the depth
/// and consumers of every queue (passive declares), every few seconds.
final class StatsSampler: Service, Sendable {
    private let store: OrderStore?
    private let connection: AMQPConnection?
    private let names: PipelineNames
    private let interval: Duration
    private let logger: Logger

    init(store: OrderStore?, connection: AMQPConnection?, names: PipelineNames, interval: Duration, logger: Logger) {
        self.store = store
        self.connection = connection
        self.names = names
        self.interval = interval
        self.logger = logger
    }

    func run() async throws {
        while !Task.isShuttingDownGracefully && !Task.isCancelled {
            await sample()
            let interval = self.interval
            do {
                try await cancelWhenGracefulShutdown { try await Task.sleep(for: interval) }
            } catch {
                return
            }
        }
    }

    func sample() async {
        if let store {
            if let counts = try? await store.submissionCounts() {
                for state in SubmissionState.allCases {
                    Gauge(label: MetricNames.submissions, dimensions: [("state", state.rawValue)])
                        .record(counts[state] ?? 0)
                }
            }
            if let backlog = try? await store.outboxBacklog() {
                Gauge(label: MetricNames.outboxBacklog).record(backlog)
            }
            if let finishes = try? await store.queuedFinishes() {
                Gauge(label: MetricNames.appleFinishBacklog).record(finishes.count)
            }
        }
        if let connection, connection.isConnected {
            for queue in names.verifyQueues + [names.results, names.verifyDead, names.resultsDead] {
                guard let status = try? await connection.queueStatus(queue) else { continue }
                Gauge(label: MetricNames.queueMessages, dimensions: [("queue", queue)]).record(status.messageCount)
                Gauge(label: MetricNames.queueConsumers, dimensions: [("queue", queue)]).record(status.consumerCount)
            }
        }
    }
}
