import Foundation
import IAPCore
import Logging
import Messaging
import Testing

/// The private RabbitMQ node that `scripts/dev test` starts for this run.
///
/// Tests never skip when it is missing: they fail and say how to get one.
enum TestBroker {
    struct Missing: Error, CustomStringConvertible {
        var description: String {
            "IAP_TEST_AMQP_URL is not set: run the suite with `scripts/dev test`, which starts a private RabbitMQ node"
        }
    }

    static func url() throws -> String {
        guard let url = ProcessInfo.processInfo.environment["IAP_TEST_AMQP_URL"], !url.isEmpty else {
            throw Missing()
        }
        return url
    }

    /// The node's configuration (or that of `urls`, comma-separated), quick to reconnect.
    static func configuration(urls: String? = nil) throws -> AMQPConfiguration {
        var configuration = try AMQPConfiguration(url: try urls ?? url(), heartbeatSeconds: 5)
        configuration.maximumReconnectDelay = .milliseconds(500)
        return configuration
    }

    /// The node `scripts/dev test` starts for the fault drills (one of which stops it): no other
    /// test uses it, so the drills and the tests that stop the test broker never meet.
    static func drillNodeURL() throws -> String {
        guard let url = ProcessInfo.processInfo.environment["IAP_TEST_DRILL_AMQP_URL"], !url.isEmpty else {
            throw Missing()
        }
        return url
    }

    /// Stops or starts the node through the command `scripts/dev test` exports.
    static func control(_ action: String) async throws {
        try await run(action, through: "IAP_TEST_BROKER_CTL")
    }

    /// Stops or starts the drills' own node (`drillNodeURL()`) through the command
    /// `scripts/dev test` exports.
    static func controlDrillNode(_ action: String) async throws {
        try await run(action, through: "IAP_TEST_DRILL_BROKER_CTL")
    }

    private static func run(_ action: String, through variable: String) async throws {
        guard let command = ProcessInfo.processInfo.environment[variable], !command.isEmpty else {
            throw Missing()
        }
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/bin/sh")
        process.arguments = ["-c", "\(command) \(action)"]
        process.standardInput = FileHandle.nullDevice
        try process.run()
        await process.exited()
        guard process.terminationStatus == 0 else {
            throw BrokerControlFailed(action: action, status: process.terminationStatus)
        }
    }

    struct BrokerControlFailed: Error, CustomStringConvertible {
        var action: String
        var status: Int32
        var description: String { "broker control '\(action)' exited with \(status)" }
    }

    static var logger: Logger {
        var logger = Logger(label: "iap.tests")
        logger.logLevel = ProcessInfo.processInfo.environment["IAP_TEST_LOG_LEVEL"].flatMap { Logger.Level(rawValue: $0) } ?? .error
        return logger
    }

    /// A queue prefix no other test uses.
    static func uniquePrefix(_ name: String) -> String {
        "test.\(name).\(UUID().uuidString.prefix(8).lowercased())"
    }
}

/// The repository's root folder, found from this file's place in it.
let repositoryRoot: URL = URL(fileURLWithPath: #filePath)
    .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

extension TestBroker {
    /// A connection of the test's own with a queue `<prefix>.test-<name>` bound to the
    /// pipeline's events exchange for `routingKey` (`grant.*`, `consent.*`): what the app's own
    /// services would read.
    static func eventListener(_ names: PipelineNames, name: String, routingKey: String) throws -> (AMQPConnection, queue: String) {
        let queue = names.prefix + ".test-" + name
        let connection = AMQPConnection(
            configuration: try configuration(),
            topology: Topology(
                exchanges: [.init(name: names.events, type: "topic")], queues: [.init(name: queue)],
                bindings: [.init(queue: queue, exchange: names.events, routingKey: routingKey)]),
            logger: logger)
        return (connection, queue)
    }
}
