import AppStore
import AsyncHTTPClient
import Console
import FakeAppStore
import Hummingbird
import Finisher
import Foundation
import IAPCore
import Intake
import Logging
import Messaging
import OrderStore
import Relay
import NIOCore
import ServiceLifecycle
import UnixSignals
import Verifier
import X509

/// The parts of the system one process can run.
public enum Role: String, Sendable, CaseIterable {
    /// HTTP uploads and status, with the outbox relay.
    case intake
    /// Verification with Apple.
    case verifier
    /// Crediting results into the order store.
    case finisher
    /// The local Apple stand-in.
    case fakeAppStore = "fake-appstore"
    /// The operators' endpoint (`/metrics`, `/healthz`, `/readyz`); reported, not chosen.
    case ops
    /// The admin routes on a listener of their own (`IAP_ADMIN_PORT`); reported, not chosen.
    case admin
}

/// Everything a process needs to know to run its roles; built by `iap` from flags and
/// environment, or by tests directly.
public struct PipelineSettings: Sendable {
    /// The broker.
    public var amqp: AMQPConfiguration
    /// Queue names.
    public var names: PipelineNames
    /// The SQLite file of the order store (intake and finisher), unless `postgres` is set.
    public var databasePath: String
    /// The PostgreSQL order store, shared by several order services; nil uses `databasePath`.
    public var postgres: PostgresLocation?
    /// Where the order store lives.
    public var storeLocation: StoreLocation { postgres.map { .postgres($0) } ?? .sqlite(path: databasePath) }
    /// The intake's HTTP settings.
    public var intake: IntakeSettings
    /// The verifier's consumption and retry settings.
    public var verifier: VerifierSettings
    /// How the verifier talks to Apple; its bundle ids are also the apps whose notifications
    /// the intake takes.
    public var verifyReceipt: VerifyReceiptClient.Settings
    /// The finisher's consumption settings.
    public var finisher: FinisherSettings
    /// Where the fake App Store listens, when this process runs it.
    public var fakeAppStoreHost: String
    /// The fake App Store's port.
    public var fakeAppStorePort: Int
    /// The fake App Store's own SQLite file (in memory when nil).
    public var fakeAppStoreDatabasePath: String?
    /// Where `/metrics`, `/healthz` and `/readyz` are served; nil serves none.
    public var ops: OpsSettings?
    /// StoreKit 2: signed data, the App Store Server API, notifications.
    public var storeKit: StoreKitSettings = .init()
    /// The fake App Store's Server API key and where it sends notifications (tests, dev).
    public var fakeAppStoreAPIKey: FakeServerAPIKey?
    public var fakeAppStoreNotificationURL: String?
    /// Benchmarks only: the intake verifies inside the HTTP request (see `IntakeSettings.inlineVerifier`).
    public var inlineVerification = false
    /// Customer service's console (`/admin/`, beside the admin routes): viewer tokens, cookies, sessions.
    public var console = ConsoleSettings()
    /// Scheduled reconciliation with Apple in the process that runs the finisher, when the
    /// Server API is configured too; nil runs none.
    public var reconciliation: ReconciliationSettings?

    /// Creates settings.
    public init(
        amqp: AMQPConfiguration, names: PipelineNames, databasePath: String, intake: IntakeSettings,
        verifier: VerifierSettings, verifyReceipt: VerifyReceiptClient.Settings, finisher: FinisherSettings,
        fakeAppStoreHost: String = Setting.fakeAppStoreHost.defaultText, fakeAppStorePort: Int = Setting.fakeAppStorePort.defaultInt, fakeAppStoreDatabasePath: String? = nil,
        ops: OpsSettings? = nil
    ) {
        self.ops = ops
        self.amqp = amqp
        self.names = names
        self.databasePath = databasePath
        self.intake = intake
        self.verifier = verifier
        self.verifyReceipt = verifyReceipt
        self.finisher = finisher
        self.fakeAppStoreHost = fakeAppStoreHost
        self.fakeAppStorePort = fakeAppStorePort
        self.fakeAppStoreDatabasePath = fakeAppStoreDatabasePath
    }
}

/// How the verifier reads StoreKit 2 data and talks to the App Store Server API (the roots
/// and app id also check notifications at the intake).
public struct StoreKitSettings: Sendable {
    /// The roots signed data must chain to; nil is Apple Root CA - G3 (shipped).
    public var trustedRoots: [Certificate]?
    /// The App Store's id of the app: production notifications must name it.
    public var appAppleId: Int64?
    /// The Server API key and hosts; nil: no Server API (transaction-id uploads cannot be verified).
    public var serverAPI: AppStoreServerAPIClient.Settings?
    /// Confirm locally verified signed transactions with Get Transaction Info.
    public var confirmWithAPI: Bool
    /// Check certificates at the payload's `signedDate` (as Apple's library) or now.
    public var validationTime: SignedDataVerifier.ValidationTime
    /// With a Server API key, verify app receipts through it (transaction ids read locally,
    /// then Get Transaction History) instead of `verifyReceipt`. What it finds is a lookup,
    /// not a proof of ownership (see docs/ledger.md).
    public var receiptsThroughServerAPI: Bool

    /// Creates settings.
    public init(
        trustedRoots: [Certificate]? = nil, appAppleId: Int64? = nil, serverAPI: AppStoreServerAPIClient.Settings? = nil,
        confirmWithAPI: Bool = false, validationTime: SignedDataVerifier.ValidationTime = .signedDate,
        receiptsThroughServerAPI: Bool = false
    ) {
        self.receiptsThroughServerAPI = receiptsThroughServerAPI
        self.trustedRoots = trustedRoots
        self.appAppleId = appAppleId
        self.serverAPI = serverAPI
        self.confirmWithAPI = confirmWithAPI
        self.validationTime = validationTime
    }
}

/// The services of one process, in start order; they shut down in reverse order, so the
/// HTTP server stops taking uploads first and the broker connection closes last.
public struct Pipeline: Sendable {
    /// The services, in start order.
    public let services: [any Service]
    /// The order store, when a role of this process uses it.
    public let store: OrderStore?
    /// The broker connection that publishes, when a role of this process uses the broker.
    public let connection: AMQPConnection?
    /// The broker connection that consumes and acks, when a role of this process consumes.
    public let consumerConnection: AMQPConnection?
    private let httpClient: HTTPClient?

    /// Builds the roles of one process. `onListening` reports each HTTP role's bound port.
    public init(
        roles: Set<Role>, settings: PipelineSettings, logger: Logger,
        onListening: @escaping @Sendable (Role, Int) async -> Void = { _, _ in }
    ) async throws {
        var first: [any Service] = []
        var middle: [any Service] = []
        var last: [any Service] = []

        // Publishing and consuming use separate connections: under a broker resource alarm
        // the broker stops reading a publishing connection, and acks must still get through.
        let topology = Topology.pipeline(settings.names, retrySchedule: settings.verifier.retrySchedule)
        let needsBroker = !roles.isDisjoint(with: [.intake, .verifier, .finisher])
        let consumes = !roles.isDisjoint(with: [.verifier, .finisher])
        var publishing = settings.amqp
        publishing.connectionName += " publish"
        var consuming = settings.amqp
        consuming.connectionName += " consume"
        let consumerConnection =
            consumes ? AMQPConnection(configuration: consuming, topology: topology, logger: logger) : nil
        let connection = needsBroker ? AMQPConnection(configuration: publishing, topology: topology, logger: logger) : nil
        if let consumerConnection { first.append(consumerConnection) }
        if let connection { first.append(connection) }

        let needsStore = !roles.isDisjoint(with: [.intake, .finisher])
        let store = needsStore ? try await OrderStore(location: settings.storeLocation) : nil

        if roles.contains(.fakeAppStore) {
            first.append(
                try FakeAppStore(
                    databasePath: settings.fakeAppStoreDatabasePath, apiKey: settings.fakeAppStoreAPIKey,
                    notificationURL: settings.fakeAppStoreNotificationURL
                ).makeApplication(
                    host: settings.fakeAppStoreHost, port: settings.fakeAppStorePort, logger: logger,
                    onServerRunning: { channel in
                        await onListening(.fakeAppStore, channel.localAddress?.port ?? settings.fakeAppStorePort)
                    }))
        }
        // One outbox relay per process that writes the store: uploads (intake) and events (finisher).
        if let store, let connection {
            middle.append(OutboxRelay(store: store, publisher: connection, logger: logger))
        }
        // The order service asks Apple itself only to reconcile.
        let reconciles = roles.contains(.finisher) && settings.reconciliation != nil && settings.storeKit.serverAPI != nil
        // One HTTP client per process, for Apple and for alert webhooks.
        var httpClient: HTTPClient?
        // The console looks Apple's order ids up (when the intake has the admin tokens and a Server API key).
        let consoleAsksApple = roles.contains(.intake) && !settings.intake.adminTokens.isEmpty && settings.storeKit.serverAPI != nil
        if roles.contains(.verifier) || settings.inlineVerification || reconciles || consoleAsksApple
            || (roles.contains(.finisher) && settings.finisher.alerts.webhookURL != nil) {
            var configuration = HTTPClient.Configuration()
            configuration.timeout = .init(connect: .seconds(5))
            configuration.connectionPool = .init(
                idleTimeout: .seconds(60),
                concurrentHTTP1ConnectionsPerHostSoftLimit: max(8, settings.verifier.concurrency))
            httpClient = HTTPClient(eventLoopGroupProvider: .singleton, configuration: configuration)
        }
        // What checks Apple's signed data: the verifier's, and the intake's check of each
        // notification before it is stored (the same roots, bundle ids and app id).
        var signedData: SignedDataVerifier?
        if !roles.isDisjoint(with: [.intake, .verifier]) || settings.inlineVerification || reconciles {
            signedData = SignedDataVerifier(
                settings: .init(
                    trustedRoots: try settings.storeKit.trustedRoots ?? [AppleRoot.g3()],
                    bundleIds: settings.verifyReceipt.bundleIds, appAppleId: settings.storeKit.appAppleId,
                    validationTime: settings.storeKit.validationTime))
        }
        // What asks Apple: for the verifier role, and for the inline baseline of the benchmarks.
        var appStoreVerifier: AppStoreVerifier?
        if roles.contains(.verifier) || settings.inlineVerification, let client = httpClient, let signed = signedData {
            let legacy = VerifyReceiptClient(settings: settings.verifyReceipt, httpClient: client, logger: logger)
            appStoreVerifier = AppStoreVerifier(
                signed: signed,
                serverAPI: try settings.storeKit.serverAPI.map {
                    try AppStoreServerAPIClient(settings: $0, httpClient: client, logger: logger)
                },
                legacy: legacy, confirmWithAPI: settings.storeKit.confirmWithAPI,
                receiptsThroughServerAPI: settings.storeKit.receiptsThroughServerAPI)
        }
        if roles.contains(.intake), let store {
            var intake = settings.intake
            if settings.inlineVerification { intake.inlineVerifier = appStoreVerifier }
            if intake.notificationVerifier == nil { intake.notificationVerifier = signedData }
            if intake.bundleIds.isEmpty { intake.bundleIds = settings.verifyReceipt.bundleIds }
            if !intake.adminTokens.isEmpty {
                let console = try Console(
                    settings: ConsoleSettings(
                        operatorTokens: intake.adminTokens, viewerTokens: settings.console.viewerTokens,
                        insecureCookies: settings.console.insecureCookies, sessionLifetime: settings.console.sessionLifetime,
                        clientAddressHeader: intake.limits.clientAddressHeader, bodyTimeout: intake.limits.bodyTimeout,
                        maxInFlight: settings.console.maxInFlight, maxInFlightPerSession: settings.console.maxInFlightPerSession,
                        maxSignInsInFlight: settings.console.maxSignInsInFlight,
                        signInBodyTimeout: min(settings.console.signInBodyTimeout, intake.limits.bodyTimeout),
                        failedSignIns: intake.limits.failedAdminAttempts),
                    dependencies: ConsoleDependencies(
                        store: store, catalog: intake.catalog, names: settings.names, broker: connection,
                        appStore: try settings.storeKit.serverAPI.flatMap { serverAPI in
                            try httpClient.map { try AppStoreServerAPIClient(settings: serverAPI, httpClient: $0, logger: logger) }
                        },
                        signedData: signedData),
                    logger: logger)
                intake.adminPages = { router in console.addRoutes(to: router) }
            }
            let services = makeIntakeServices(
                settings: intake, store: store, logger: logger,
                onServerRunning: { port in await onListening(.intake, port) },
                onAdminServerRunning: { port in await onListening(.admin, port) })
            middle.append(contentsOf: services.dropLast())
            last.append(contentsOf: services.suffix(1))
        }
        if roles.contains(.finisher), let store, let connection, let consumerConnection {
            middle.append(
                FinisherService(
                    settings: settings.finisher, consumer: consumerConnection, publisher: connection, store: store,
                    httpClient: httpClient, logger: logger))
            Reconciliation.exportMetrics()
        }
        if reconciles, let store, let client = httpClient, let signed = signedData,
            let serverAPI = settings.storeKit.serverAPI, let schedule = settings.reconciliation
        {
            let reconciliation = Reconciliation(
                store: store,
                reader: SubscriptionStatusReader(
                    client: try AppStoreServerAPIClient(settings: serverAPI, httpClient: client, logger: logger), verifier: signed),
                policy: CreditPolicy(
                    catalog: settings.finisher.catalog, eventsExchange: settings.names.events,
                    sandbox: settings.finisher.sandboxPolicy, restore: settings.finisher.restorePolicy),
                verifyQueue: settings.names.verify, settings: schedule, logger: logger)
            middle.append(ReconciliationService(reconciliation: reconciliation, interval: schedule.interval, logger: logger))
        }
        if roles.contains(.verifier), let connection, let consumerConnection, let verifier = appStoreVerifier {
            middle.append(
                VerifierService(
                    settings: settings.verifier, consumer: consumerConnection, publisher: connection, verifier: verifier,
                    logger: logger))
        }
        if let ops = settings.ops {
            // Writing the store needs no broker (the outbox holds uploads and events meanwhile);
            // consuming does, and so does a verifier's publishing.
            let readiness = Readiness(
                store: store, connections: [consumerConnection, store == nil ? connection : nil].compactMap { $0 })
            first.append(
                Application(
                    router: makeOpsRouter(readiness: readiness, exposition: ops.exposition),
                    configuration: .init(address: .hostname(ops.host, port: ops.port), serverName: "iap-ops"),
                    onServerRunning: { channel in await onListening(.ops, channel.localAddress?.port ?? ops.port) },
                    logger: logger))
            if ops.exposition != nil && (store != nil || connection != nil) {
                middle.append(
                    StatsSampler(
                        store: store, connection: connection, names: settings.names, interval: .seconds(5), logger: logger))
            }
        }
        self.services = first + middle + last
        self.store = store
        self.connection = connection
        self.consumerConnection = consumerConnection
        self.httpClient = httpClient
    }

    /// A service group over these services.
    ///
    /// A graceful shutdown that takes longer than 30 s (a broker that stays away while
    /// publishes wait for it) turns into cancellation: what was not confirmed stays in the
    /// outbox or on the queue for the next start.
    public func makeServiceGroup(gracefulShutdownSignals: [UnixSignal], logger: Logger) -> ServiceGroup {
        var configuration = ServiceGroupConfiguration(
            services: services, gracefulShutdownSignals: gracefulShutdownSignals, logger: logger)
        configuration.maximumGracefulShutdownDuration = .seconds(30)
        configuration.maximumCancellationDuration = .seconds(10)
        return ServiceGroup(configuration: configuration)
    }

    /// Runs until a signal (SIGTERM, SIGINT) asks for a graceful shutdown, then releases clients.
    public func run(logger: Logger) async throws {
        let group = makeServiceGroup(gracefulShutdownSignals: [.sigterm, .sigint], logger: logger)
        do {
            try await group.run()
        } catch {
            try? await shutdownClients()
            throw error
        }
        try await shutdownClients()
    }

    /// Releases the HTTP client; call after the service group has ended.
    public func shutdownClients() async throws {
        try await httpClient?.shutdown()
    }
}
