import Foundation
import IAPCore
import Messaging
import Testing

/// The private three-node RabbitMQ cluster that `scripts/dev test` starts beside the single
/// node (IAP_TEST_CLUSTER_AMQP_URLS, IAP_TEST_CLUSTER_CTL).
///
/// Unlike the single node, its absence skips the tests that need it (a targeted run, or
/// `IAP_TEST_CLUSTER=off`): `scripts/dev test` always sets it, or fails to start.
enum TestCluster {
    /// Why the cluster tests are skipped when they are.
    static let missing =
        "IAP_TEST_CLUSTER_AMQP_URLS is not set: run with `scripts/dev test`, which starts a private three-node RabbitMQ cluster"

    struct Missing: Error, CustomStringConvertible {
        var description: String { TestCluster.missing }
    }

    /// Whether this run has a cluster.
    static var isAvailable: Bool { !(ProcessInfo.processInfo.environment["IAP_TEST_CLUSTER_AMQP_URLS"] ?? "").isEmpty }

    /// The nodes' URLs, comma-separated, in the order `scripts/dev` started them.
    static func urls() throws -> String {
        guard let urls = ProcessInfo.processInfo.environment["IAP_TEST_CLUSTER_AMQP_URLS"], !urls.isEmpty else {
            throw Missing()
        }
        return urls
    }

    /// A configuration naming all three nodes, quick to reconnect.
    static func configuration() throws -> AMQPConfiguration {
        try TestBroker.configuration(urls: try urls())
    }

    /// Quorum queues with the default delivery limit, under a prefix no other test uses.
    static func names(_ name: String) -> PipelineNames {
        PipelineNames(
            prefix: TestBroker.uniquePrefix(name), queueType: .quorum(deliveryLimit: QueueType.defaultDeliveryLimit))
    }

    /// The AMQP port in a node's (redacted) URL.
    static func port(of url: String) -> Int? {
        URLComponents(string: url)?.port
    }

    /// Runs `scripts/dev cluster <arguments>` (kill N, start-node N, status), N a node's AMQP port.
    static func control(_ arguments: String) async throws {
        guard let command = ProcessInfo.processInfo.environment["IAP_TEST_CLUSTER_CTL"], !command.isEmpty else {
            throw Missing()
        }
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/bin/sh")
        process.arguments = ["-c", "\(command) \(arguments)"]
        process.standardInput = FileHandle.nullDevice
        try process.run()
        await process.exited()
        guard process.terminationStatus == 0 else {
            throw TestBroker.BrokerControlFailed(action: "cluster \(arguments)", status: process.terminationStatus)
        }
    }
}

extension TestCluster {
    /// Runs `body`, which kills the node with AMQP port `port`, then starts that node again
    /// whether the body threw or not (a restart from `defer` could not wait off the pool).
    static func restartingNode<T>(_ port: Int, _ body: () async throws -> T) async throws -> T {
        let result: Result<T, any Error>
        do { result = .success(try await body()) } catch { result = .failure(error) }
        do { try await control("start-node \(port)") } catch {
            Issue.record("could not restart the killed node: \(error)")
        }
        return try result.get()
    }

    /// How many client connections the node with AMQP port `port` holds.
    static func clientConnections(onNodeWithPort port: Int) async throws -> Int {
        guard let command = ProcessInfo.processInfo.environment["IAP_TEST_CLUSTER_CTL"], !command.isEmpty else {
            throw Missing()
        }
        let run = try await runProgram("/bin/sh", ["-c", "\(command) connections \(port)"])
        guard run.status == 0 else {
            throw TestBroker.BrokerControlFailed(action: "cluster connections \(port)", status: run.status)
        }
        return Int(run.output.trimmingCharacters(in: .whitespacesAndNewlines)) ?? 0
    }
}

/// The consumer's next delivery, or nil when none comes within `timeout`.
func nextDelivery(_ consumer: AMQPConsumer, within timeout: Duration) async -> AMQPDelivery? {
    await withTaskGroup(of: AMQPDelivery?.self) { group in
        group.addTask {
            var iterator = consumer.makeAsyncIterator()
            return await iterator.next()
        }
        group.addTask {
            try? await Task.sleep(for: timeout)
            return nil
        }
        let first = await group.next() ?? nil
        group.cancelAll()
        return first
    }
}
