import AppStore
import ArgumentParser
import AsyncHTTPClient
import Foundation
import IAPCore
import Logging
import Messaging
import Relay
import AppleCalls
import Pipeline
import NIOCore
import OrderStore
import NIOFoundationCompat
import NIOHTTP1

struct AdminCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "admin", abstract: "Operator tools.",
        subcommands: [DeadLettersCommand.self, ReconcileCommand.self, ReconcileNotificationsCommand.self, MigrateStoreCommand.self])
}

struct DeadLettersCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "dead-letters",
        abstract: "Show or re-queue messages that could not be processed.",
        discussion: """
            list: prints one JSON object per dead message (submission id, reason, origin; never the receipt), \
            and says so on standard error when there is none.
            redrive: moves dead messages back to the queue they came from, each acked only once re-published.
            Against `scripts/dev up`: load its settings first, set -a; . .run/dev/env; set +a.
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
            throw ValidationError("cannot reach the broker at \(Setting.amqpURL.variable)")
        }
        let dead = queue == .verify ? names.verifyDead : names.resultsDead
        let home = queue == .verify ? names.verifyQueue(priority: VerifyPriority.retry) : names.results
        let deadLetters = DeadLetters(connection: connection)
        switch action {
        case .list:
            let entries = try await deadLetters.list(dead, limit: max(1, limit))
            for entry in entries {
                print(Self.describe(entry, queue: dead))
            }
            if entries.isEmpty {
                // On standard error: standard output stays one JSON object per message.
                FileHandle.standardError.write(Data("no dead letters in \(dead)\n".utf8))
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
        let body = (try? entry.decodedBody()) ?? entry.body
        if let request = try? codec.decode(VerifyRequest.self, from: body) {
            fields["submissionId"] = request.submissionId.uuidString
            fields["userId"] = request.userId
            fields["attempt"] = String(request.attempt)
        } else if let result = try? codec.decode(VerifyResult.self, from: body) {
            fields["submissionId"] = result.submissionId.uuidString
            fields["attempt"] = String(result.attempt)
        } else {
            fields["preview"] = String(String(decoding: body.prefix(120), as: UTF8.self))
        }
        let data = (try? JSONSerialization.data(withJSONObject: fields, options: [.sortedKeys])) ?? Data()
        return String(decoding: data, as: UTF8.self)
    }
}

/// `iap admin reconcile`: the order service's scheduled reconciliation, once now, against the
/// store file; what it queues (re-delivered notifications, events) waits in the outbox for the
/// order service's relay.
struct ReconcileCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "reconcile",
        abstract: "Reconcile with Apple once now: the order service's scheduled run (\(Setting.reconcileInterval.variable)); prints what it did.",
        discussion: """
            Asks Get Refund History and Get All Subscription Statuses about every subscription in the order store \
            that is due to renew (active and ending within a day, or ended), in billing retry or in a grace period, \
            and applies what Apple says as the notification Apple would have sent (each once); reads what changed in \
            each customer's Transaction History since the revision kept from the last read, and applies it the same way; \
            then re-delivers \
            the notifications Apple could not send since the last run (Get Notification History, onlyFailures) \
            through the notification path. Every change is audited (actor reconciliation). When the server finishes \
            (\(Setting.finishTransactions.variable) server or both), what it credits is queued to be finished at Apple, \
            as the order service's run does; the order service makes the calls. Needs the App Store \
            Server API key (\(Setting.appStoreKeyPath.variable), \(Setting.appStoreKeyId.variable), \(Setting.appStoreIssuerId.variable)), one bundle id \
            (\(Setting.bundleIds.variable)), the catalog and the order store the order service uses; the order service's relay \
            publishes what this queues. Prints one JSON object; exits 1 when part of it failed.
            """)

    @Option(help: ArgumentHelp(Setting.bundleIds.help))
    var bundleIds: String?

    @OptionGroup var store: StoreOptions
    @OptionGroup var catalog: CatalogOptions
    @OptionGroup var broker: BrokerOptions
    @OptionGroup var storeKit: StoreKitOptions
    @OptionGroup var log: LogOptions

    func run() async throws {
        let logger = try log.makeLogger(label: "iap.admin")
        let ids = Set(
            (SettingReader().optionalString(bundleIds, .bundleIds) ?? "").split(separator: ",")
                .map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty })
        let settings = try storeKit.settings(bundleIds: ids)
        guard let serverAPI = settings.serverAPI else {
            throw ValidationError("reconciling needs the App Store Server API key: \(Setting.appStoreKeyPath.variable)")
        }
        let names = try broker.names()
        let orders = try await OrderStore(location: store.location())
        let verifier = SignedDataVerifier(
            settings: .init(
                trustedRoots: try settings.trustedRoots ?? [AppleRoot.g3()], bundleIds: ids, appAppleId: settings.appAppleId,
                validationTime: settings.validationTime))
        let reconciliation = Reconciliation(
            store: orders,
            reader: SubscriptionStatusReader(
                client: try AppStoreServerAPIClient(settings: serverAPI, httpClient: .shared, logger: logger), verifier: verifier),
            policy: CreditPolicy(
                catalog: try catalog.load(), eventsExchange: names.events, sandbox: try VerifierOptions.sandboxPolicy(),
                restore: try VerifierOptions.restorePolicy(),
                // What it credits is queued to be finished at Apple as the order service's run
                // would; the order service's worker makes the calls.
                finishAtApple: settings.finishTransactions.serverFinishes),
            verifyQueue: names.verify, logger: logger)
        let report = await reconciliation.run()
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys]
        print(String(decoding: try encoder.encode(report), as: UTF8.self))
        if !report.errors.isEmpty { throw ExitCode(1) }
    }
}

/// `iap admin reconcile-notifications`: asks Apple which notifications did not reach us and
/// hands each to our own notification endpoint. Applying one twice is harmless (each
/// `notificationUUID` applies once), so it can run on a schedule.
struct ReconcileNotificationsCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "reconcile-notifications",
        abstract: "Re-deliver the App Store notifications Apple could not send us (Get Notification History, onlyFailures).",
        discussion: """
            Needs the App Store Server API key (\(Setting.appStoreKeyPath.variable), \(Setting.appStoreKeyId.variable), \(Setting.appStoreIssuerId.variable)) \
            and one bundle id (\(Setting.bundleIds.variable)). Prints one JSON line per environment with what was found and re-delivered.
            """)

    @Option(help: "How far back to look, in hours (Apple keeps 180 days).")
    var hours: Int = 24

    @Option(help: "The intake's notification endpoint, e.g. http://127.0.0.1:8080/v1/notifications/appstore.")
    var notificationURL: String

    @Option(help: ArgumentHelp(Setting.bundleIds.help))
    var bundleIds: String?

    @OptionGroup var storeKit: StoreKitOptions
    @OptionGroup var log: LogOptions

    func run() async throws {
        let logger = try log.makeLogger(label: "iap.admin")
        guard (1...(180 * 24)).contains(hours) else { throw ValidationError("--hours must be 1 to 4320") }
        let ids = Set(
            (SettingReader().optionalString(bundleIds, .bundleIds) ?? "").split(separator: ",")
                .map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty })
        guard let settings = try storeKit.settings(bundleIds: ids).serverAPI else {
            throw ValidationError("reconciling needs the App Store Server API key: \(Setting.appStoreKeyPath.variable)")
        }
        let client = try AppStoreServerAPIClient(settings: settings, httpClient: .shared, logger: logger)
        for environment in ServerAPIEnvironment.allCases {
            let payloads = try await client.failedNotifications(
                from: Date().addingTimeInterval(-Double(hours) * 3600), to: Date(), in: environment)
            var delivered = 0
            for payload in payloads {
                var request = HTTPClientRequest(url: notificationURL)
                request.method = .POST
                request.headers.add(name: "Content-Type", value: "application/json")
                request.body = .bytes(ByteBuffer(data: try JSONEncoder().encode(["signedPayload": payload])))
                let response = try await HTTPClient.shared.execute(request, timeout: .seconds(10))
                _ = try? await response.body.collect(upTo: 1 << 16)
                if response.status.code == 200 { delivered += 1 }
            }
            print(#"{"environment": "\#(environment.rawValue)", "failedNotifications": \#(payloads.count), "redelivered": \#(delivered)}"#)
        }
    }
}
