import ArgumentParser
import Foundation
import IAPCore
import Logging
import Messaging

struct AdminCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "admin", abstract: "Operator tools.", subcommands: [DeadLettersCommand.self])
}

struct DeadLettersCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "dead-letters",
        abstract: "Show or re-queue messages that could not be processed.",
        discussion: """
            list: prints one JSON object per dead message (submission id, reason, origin; never the receipt).
            redrive: moves dead messages back to the queue they came from, each acked only once re-published.
            """ + "\n" + HelpText.broker)

    enum Action: String, ExpressibleByArgument, CaseIterable {
        case list, redrive
    }

    enum Which: String, ExpressibleByArgument, CaseIterable {
        case verify, results
    }

    @Argument(help: "list or redrive")
    var action: Action

    @Option(help: "Which dead-letter queue: verify or results.")
    var queue: Which = .verify

    @Option(help: "At most this many messages.")
    var limit: Int = 100

    @OptionGroup var broker: BrokerOptions
    @OptionGroup var log: LogOptions

    func run() async throws {
        let logger = try log.makeLogger(label: "iap.admin")
        let names = try broker.names()
        let connection = AMQPConnection(
            configuration: try broker.configuration(), topology: .pipeline(names, retrySchedule: RetrySchedule()),
            logger: logger)
        guard await connection.waitUntilConnected(timeout: .seconds(15)) else {
            throw ValidationError("cannot reach the broker at IAP_AMQP_URL")
        }
        let dead = queue == .verify ? names.verifyDead : names.resultsDead
        let home = queue == .verify ? names.verify : names.results
        let deadLetters = DeadLetters(connection: connection)
        switch action {
        case .list:
            for entry in try await deadLetters.list(dead, limit: max(1, limit)) {
                print(Self.describe(entry, queue: dead))
            }
        case .redrive:
            let moved = try await deadLetters.redrive(
                dead, fallback: home, limit: max(1, limit), priority: queue == .verify ? VerifyPriority.retry : nil)
            print("re-queued \(moved) message(s) from \(dead)")
        }
        await connection.close()
    }

    /// One JSON line per message: ids and reasons, never the receipt.
    static func describe(_ entry: DeadLetters.Entry, queue: String) -> String {
        var fields: [String: String] = ["queue": queue, "bytes": String(entry.body.count)]
        fields["reason"] = entry.reason
        fields["from"] = entry.from
        fields["messageId"] = entry.messageId
        let codec = MessageCodec()
        if let request = try? codec.decode(VerifyRequest.self, from: entry.body) {
            fields["submissionId"] = request.submissionId.uuidString
            fields["userId"] = request.userId
            fields["attempt"] = String(request.attempt)
        } else if let result = try? codec.decode(VerifyResult.self, from: entry.body) {
            fields["submissionId"] = result.submissionId.uuidString
            fields["attempt"] = String(result.attempt)
        } else {
            fields["preview"] = String(String(decoding: entry.body.prefix(120), as: UTF8.self))
        }
        let data = (try? JSONSerialization.data(withJSONObject: fields, options: [.sortedKeys])) ?? Data()
        return String(decoding: data, as: UTF8.self)
    }
}
