import Foundation
import IAPCore
import Messaging
import Relay
import Testing

/// What several broker URLs and the queue type change, read without a broker.
@Suite("Cluster settings: broker URLs and queue types")
struct ClusterSettingsTests {
    @Test func oneURLReadsAsBefore() async throws {
        let configuration = try AMQPConfiguration(url: "amqp://user:pa%40ss@broker.example:5673/vh", heartbeatSeconds: 10)
        #expect(configuration.nodes.count == 1)
        #expect(configuration.host == "broker.example" && configuration.port == 5673)
        #expect(configuration.nodes[0].user == "user" && configuration.nodes[0].password == "pa@ss")
        #expect(configuration.nodes[0].virtualHost == "vh")
        #expect(configuration.redactedURL == "amqp://user@broker.example:5673/vh")
        #expect(try AMQPConfiguration(url: "amqp://localhost", heartbeatSeconds: 10).nodes[0].virtualHost == "/")
        #expect(throws: AMQPError.self) { try AMQPConfiguration(url: "http://localhost/", heartbeatSeconds: 10) }
    }

    @Test func severalURLsAreTheNodesInOrder() async throws {
        let configuration = try AMQPConfiguration(
            url: "amqp://u:secret@rabbit-1:5672/, amqp://u:secret@rabbit-2:5673/ ,amqp://u:secret@rabbit-3/", heartbeatSeconds: 10)
        #expect(configuration.nodes.map(\.host) == ["rabbit-1", "rabbit-2", "rabbit-3"])
        #expect(configuration.nodes.map(\.port) == [5672, 5673, 5672])
        #expect(!configuration.redactedURL.contains("secret"))
        #expect(configuration.redactedURL.split(separator: ",").count == 3)
        do {
            _ = try AMQPConfiguration(url: "amqp://rabbit-1/,rabbit-2:5672,amqp://rabbit-3/", heartbeatSeconds: 10)
            Issue.record("a bad second URL was accepted")
        } catch {
            #expect(error.code == .invalidURL)
            #expect(error.message.contains("URL 2 of 3"), "\(error.message)")
        }
        #expect(throws: AMQPError.self) { try AMQPConfiguration(url: "amqp://rabbit-1/,", heartbeatSeconds: 10) }
    }

    @Test func classicQueuesAreDeclaredAsBefore() {
        let names = PipelineNames(prefix: "p")
        let topology = Topology.pipeline(names, retrySchedule: RetrySchedule(delaysSeconds: [5, 30]))
        let queues = Dictionary(uniqueKeysWithValues: topology.queues.map { ($0.name, $0.arguments) })
        #expect(
            Set(queues.keys) == [
                "p.verify", "p.results", "p.verify.dead", "p.results.dead", "p.verify.retry.5s", "p.verify.retry.30s",
                "p.consumption",
            ])
        #expect(queues["p.consumption"] == queues["p.results"], "the app's consumption reports dead-letter as results do")
        #expect(
            queues["p.verify"] == [
                "x-dead-letter-exchange": .string(""), "x-dead-letter-routing-key": .string("p.verify.dead"),
                "x-max-priority": .int(2),
            ])
        #expect(queues["p.results"] == ["x-dead-letter-exchange": .string(""), "x-dead-letter-routing-key": .string("p.results.dead")])
        #expect(queues["p.verify.dead"] == [:] && queues["p.results.dead"] == [:])
        #expect(
            queues["p.verify.retry.5s"] == [
                "x-message-ttl": .int(6250), "x-dead-letter-exchange": .string(""),
                "x-dead-letter-routing-key": .string("p.verify"),
            ])
        #expect(names.verifyQueue(priority: VerifyPriority.retry) == "p.verify")
        #expect(names.verifyQueue(priority: VerifyPriority.firstAttempt) == "p.verify")
        #expect(names.verifyQueues == ["p.verify"])
    }

    @Test func quorumQueuesHaveADeliveryLimitAndAQueueForRetries() {
        let names = PipelineNames(prefix: "p", queueType: .quorum(deliveryLimit: 7))
        let topology = Topology.pipeline(names, retrySchedule: RetrySchedule(delaysSeconds: [5]))
        let queues = Dictionary(uniqueKeysWithValues: topology.queues.map { ($0.name, $0.arguments) })
        #expect(
            Set(queues.keys) == [
                "p.verify", "p.verify.retries", "p.results", "p.verify.dead", "p.results.dead", "p.verify.retry.5s",
                "p.consumption",
            ])
        for (name, arguments) in queues {
            #expect(arguments["x-queue-type"] == .string("quorum"), "\(name)")
            #expect(arguments["x-max-priority"] == nil, "\(name): quorum queues have no priorities")
            #expect(arguments["x-dead-letter-strategy"] == .string("at-least-once"), "\(name)")
            #expect(arguments["x-overflow"] == .string("reject-publish"), "\(name)")
        }
        for (queue, dead) in [("p.verify", "p.verify.dead"), ("p.verify.retries", "p.verify.dead"), ("p.results", "p.results.dead")] {
            #expect(queues[queue]?["x-delivery-limit"] == .int(7), "\(queue)")
            #expect(queues[queue]?["x-dead-letter-exchange"] == .string(""), "\(queue)")
            #expect(queues[queue]?["x-dead-letter-routing-key"] == .string(dead), "\(queue)")
        }
        // Due retries come back into their own queue, not among first attempts.
        #expect(queues["p.verify.retry.5s"]?["x-dead-letter-routing-key"] == .string("p.verify.retries"))
        #expect(queues["p.verify.retry.5s"]?["x-message-ttl"] == .int(6250))
        #expect(names.verifyQueue(priority: VerifyPriority.retry) == "p.verify.retries")
        #expect(names.verifyQueue(priority: VerifyPriority.firstAttempt) == "p.verify")
        #expect(names.verifyQueues == ["p.verify", "p.verify.retries"])
    }

    @Test func badQueueSettingsStopStartUpNamingTheVariable() async throws {
        let cli = CommandLineTests()
        let base = ["IAP_OPS_PORT": "off", "IAP_BUNDLE_IDS": "com.example.tests"]
        let type = try await cli.iap(["verifier"], environment: base.merging(["IAP_QUEUE_TYPE": "mirrored"]) { $1 })
        #expect(type.status != 0 && type.output.contains("IAP_QUEUE_TYPE"), "\(type.output)")
        let limit = try await cli.iap(["verifier"], environment: base.merging(["IAP_QUEUE_DELIVERY_LIMIT": "0"]) { $1 })
        #expect(limit.status != 0 && limit.output.contains("IAP_QUEUE_DELIVERY_LIMIT"), "\(limit.output)")
        let url = try await cli.iap(
            ["verifier"], environment: base.merging(["IAP_AMQP_URL": "amqp://127.0.0.1:1/,127.0.0.1:2"]) { $1 })
        #expect(url.status != 0 && url.output.contains("IAP_AMQP_URL") && url.output.contains("URL 2 of 2"), "\(url.output)")
    }
}
