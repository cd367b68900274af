public import AppStore
public import AppleCalls
import AsyncHTTPClient
public import Console
import Hummingbird
public import Finisher
import Foundation
public import IAPCore
public import Intake
public import Ledger
public import Logging
public import Messaging
public import OrderStore
import Relay
import NIOCore
public import ServiceLifecycle
public import UnixSignals
public import Verifier
public import X509

/// The parts of the system one process can run. (The fake App Store is not one: `iap dev` and
/// the tests run it beside a pipeline, never in it.)
public enum Role: String, Sendable, CaseIterable {
    /// HTTP uploads and status.
    case intake
    /// Verification with Apple.
    case verifier
    /// Crediting results into the order store.
    case finisher
}

/// The HTTP listeners a pipeline reports once bound (useful with port 0).
public enum Listener: String, Sendable, CaseIterable {
    /// The app's API.
    case intake
    /// The admin routes and the console on a listener of their own (`IAP_ADMIN_PORT`).
    case admin
    /// The operators' endpoint (`/metrics`, `/healthz`, `/readyz`).
    case ops
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
    /// Where `/metrics`, `/healthz` and `/readyz` are served; nil serves none.
    public var ops: OpsSettings?
    /// StoreKit 2: signed data, the App Store Server API, notifications.
    public var storeKit: StoreKitSettings = .init()
    /// Benchmarks only: the intake verifies inside the HTTP request (see `IntakeSettings.inlineVerifier`).
    public var inlineVerification = false
    /// How the outbox relay encodes verify messages (nil: as they are); the verifier's own
    /// messages follow `verifier.messageEncoding`.
    public var messageEncoding: ContentEncoding? = .deflate
    /// Customer service's console (`/admin/`, beside the admin routes): viewer tokens, cookies, sessions.
    public var console = ConsoleSettings()
    /// Scheduled reconciliation with Apple in the process that runs the finisher, when the
    /// Server API is configured too; nil runs none.
    public var reconciliation: ReconciliationSettings?

    /// Creates settings.
    public init(
        amqp: AMQPConfiguration, names: PipelineNames, databasePath: String, intake: IntakeSettings,
        verifier: VerifierSettings, verifyReceipt: VerifyReceiptClient.Settings, finisher: FinisherSettings,
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
    /// `IAP_RECEIPTS_VIA=local`: receipts are proven by their signature alone, offline.
    public var localReceipts = false
    /// `IAP_ENVIRONMENT=xcode`: the certificate Xcode's StoreKit testing signs its receipts
    /// with; nil (production): Xcode's receipts are refused.
    public var xcodeCertificate: Certificate?
    /// Who finishes a settled transaction at Apple; `server` and `both` need `serverAPI`.
    public var finishTransactions: FinishMode = .app
    /// How Apple's refund requests are answered (with `serverAPI`; without it none is).
    public var consumption = ConsumptionAnswer.Settings()

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

/// A role that cannot start because something it needs is not configured.
public struct PipelineStartError: Error, CustomStringConvertible {
    public let description: String
}

/// What several roles of one process share, built once: the broker connections (publishing and
/// consuming apart: under a broker resource alarm the broker stops reading a publishing
/// connection, and acks must still get through), the order store (opened and migrated before
/// any role starts), one HTTP client for Apple and webhooks, and what checks Apple's signed data.
private struct SharedDependencies {
    let publisher: AMQPConnection?
    let consumer: AMQPConnection?
    let store: OrderStore?
    let httpClient: HTTPClient?
    let signedData: SignedDataVerifier?

    init(roles: Set<Role>, settings: PipelineSettings, reconciles: Bool, consoleAsksApple: Bool, logger: Logger) async throws {
        let topology = Topology.pipeline(settings.names, retrySchedule: settings.verifier.retrySchedule)
        var publishing = settings.amqp
        publishing.connectionName += " publish"
        var consuming = settings.amqp
        consuming.connectionName += " consume"
        consumer = roles.isDisjoint(with: [.verifier, .finisher])
            ? nil : AMQPConnection(configuration: consuming, topology: topology, logger: logger)
        publisher = roles.isDisjoint(with: [.intake, .verifier, .finisher])
            ? nil : AMQPConnection(configuration: publishing, topology: topology, logger: logger)
        store = roles.isDisjoint(with: [.intake, .finisher]) ? nil : try await OrderStore(location: settings.storeLocation)
        if roles.contains(.verifier) || settings.inlineVerification || reconciles || consoleAsksApple
            || (roles.contains(.finisher) && settings.storeKit.serverAPI != nil)
            || (roles.contains(.finisher) && settings.finisher.alerts.webhookURL != nil)
        {
            var configuration = HTTPClient.Configuration()
            configuration.timeout = .init(connect: .seconds(5))
            configuration.connectionPool = .init(
                idleTimeout: .seconds(60),
                concurrentHTTP1ConnectionsPerHostSoftLimit: max(8, settings.verifier.concurrency))
            httpClient = HTTPClient(eventLoopGroupProvider: .singleton, configuration: configuration)
        } else {
            httpClient = nil
        }
        // The verifier's, and the intake's check of each notification before it is stored (the
        // same roots, bundle ids and app id).
        if !roles.isDisjoint(with: [.intake, .verifier]) || settings.inlineVerification || reconciles {
            signedData = SignedDataVerifier(
                settings: .init(
                    trustedRoots: try settings.storeKit.trustedRoots ?? [AppleRoot.g3()],
                    bundleIds: settings.verifyReceipt.bundleIds, appAppleId: settings.storeKit.appAppleId,
                    validationTime: settings.storeKit.validationTime))
        } else {
            signedData = nil
        }
    }

    /// `value`, or a start-up error saying which role needed what.
    func require<T>(_ value: T?, _ what: String, for role: Role) throws -> T {
        guard let value else { throw PipelineStartError(description: "the \(role.rawValue) role needs \(what), which this process did not build") }
        return value
    }

    /// A Server API client, when its key is configured.
    func serverAPI(_ settings: PipelineSettings, logger: Logger) throws -> AppStoreServerAPIClient? {
        guard let serverAPI = settings.storeKit.serverAPI, let httpClient else { return nil }
        return try AppStoreServerAPIClient(settings: serverAPI, httpClient: httpClient, logger: logger)
    }

    /// What asks Apple: for the verifier role, and for the inline baseline of the benchmarks.
    func appStoreVerifier(_ settings: PipelineSettings, for role: Role, logger: Logger) throws -> AppStoreVerifier {
        let client = try require(httpClient, "an HTTP client", for: role)
        if settings.storeKit.xcodeCertificate != nil {
            logger.warning(
                "\(Setting.environment.variable)=xcode: receipts of Xcode's StoreKit testing are credited (as sandbox purchases); never on a deployment that serves real customers")
        }
        return AppStoreVerifier(
            signed: try require(signedData, "a signed-data verifier", for: role),
            serverAPI: try serverAPI(settings, logger: logger),
            legacy: VerifyReceiptClient(settings: settings.verifyReceipt, httpClient: client, logger: logger),
            confirmWithAPI: settings.storeKit.confirmWithAPI,
            receiptsThroughServerAPI: settings.storeKit.receiptsThroughServerAPI,
            // The roots receipts must chain to: the configured ones (the fake's, in tests and
            // the dev stack), else Apple's receipt roots, shipped.
            receiptSignature: ReceiptSignature(roots: try settings.storeKit.trustedRoots ?? AppleRoot.receiptRoots()),
            localReceipts: settings.storeKit.localReceipts,
            xcodeReceipts: settings.storeKit.xcodeCertificate.map { ReceiptSignature(xcodeCertificate: $0) })
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

    /// Builds the roles of one process: what they share first (the store opened and migrated,
    /// the broker connections), then each role's services. `onListening` reports each
    /// listener's bound port.
    public init(
        roles: Set<Role>, settings: PipelineSettings, logger: Logger,
        onListening: @escaping @Sendable (Listener, Int) async -> Void = { _, _ in }
    ) async throws {
        // The order service asks Apple itself only to reconcile, and for the console's look-ups.
        let reconciles = roles.contains(.finisher) && settings.reconciliation != nil && settings.storeKit.serverAPI != nil
        let consoleAsksApple = roles.contains(.intake) && !settings.intake.adminTokens.isEmpty && settings.storeKit.serverAPI != nil
        let shared = try await SharedDependencies(
            roles: roles, settings: settings, reconciles: reconciles, consoleAsksApple: consoleAsksApple, logger: logger)
        do {
            services = try Self.services(
                roles: roles, settings: settings, shared: shared, reconciles: reconciles, logger: logger, onListening: onListening)
        } catch {
            // An HTTP client must be shut down before it goes.
            try? await shared.httpClient?.shutdown()
            throw error
        }
        self.store = shared.store
        self.connection = shared.publisher
        self.consumerConnection = shared.consumer
        self.httpClient = shared.httpClient
    }

    /// Each role's services over what they share, in start order.
    private static func services(
        roles: Set<Role>, settings: PipelineSettings, shared: SharedDependencies, reconciles: Bool, logger: Logger,
        onListening: @escaping @Sendable (Listener, Int) async -> Void
    ) throws -> [any Service] {
        var first: [any Service] = [shared.consumer, shared.publisher].compactMap { $0 }
        var middle: [any Service] = []
        var last: [any Service] = []
        // One outbox relay per process that writes the store: uploads (intake) and events (finisher).
        if let store = shared.store, let publisher = shared.publisher {
            middle.append(
                OutboxRelay(store: store, publisher: publisher, verifyEncoding: settings.messageEncoding, logger: logger))
        }
        if roles.contains(.intake) {
            let services = try intakeServices(settings: settings, shared: shared, logger: logger, onListening: onListening)
            middle.append(contentsOf: services.dropLast())
            last.append(contentsOf: services.suffix(1))
        }
        if roles.contains(.finisher) {
            var finisher = settings.finisher
            finisher.finishAtApple = settings.storeKit.finishTransactions.serverFinishes
            middle.append(
                FinisherService(
                    settings: finisher, consumer: try shared.require(shared.consumer, "a consuming connection", for: .finisher),
                    publisher: try shared.require(shared.publisher, "a publishing connection", for: .finisher),
                    store: try shared.require(shared.store, "the order store", for: .finisher), httpClient: shared.httpClient,
                    logger: logger))
            Reconciliation.exportMetrics()
            AppleFinishing.exportMetrics()
            middle.append(
                ConsumptionReports(
                    names: settings.names, consumer: try shared.require(shared.consumer, "a consuming connection", for: .finisher),
                    publisher: try shared.require(shared.publisher, "a publishing connection", for: .finisher),
                    store: try shared.require(shared.store, "the order store", for: .finisher), logger: logger))
            ConsumptionAnswering.exportMetrics()
            if let client = try shared.serverAPI(settings, logger: logger) {
                let store = try shared.require(shared.store, "the order store", for: .finisher)
                if finisher.finishAtApple { middle.append(AppleFinishing(store: store, client: client, logger: logger)) }
                middle.append(
                    ConsumptionAnswering(store: store, client: client, settings: settings.storeKit.consumption, logger: logger))
            }
            if reconciles, let schedule = settings.reconciliation {
                middle.append(try reconciliation(settings: settings, schedule: schedule, shared: shared, logger: logger))
            }
        }
        if roles.contains(.verifier) {
            middle.append(
                VerifierService(
                    settings: settings.verifier, consumer: try shared.require(shared.consumer, "a consuming connection", for: .verifier),
                    publisher: try shared.require(shared.publisher, "a publishing connection", for: .verifier),
                    verifier: try shared.appStoreVerifier(settings, for: .verifier, logger: logger), logger: logger))
        }
        if let ops = settings.ops {
            first.append(opsServer(ops, shared: shared, logger: logger, onListening: onListening))
            if ops.exposition != nil && (shared.store != nil || shared.publisher != nil) {
                middle.append(
                    StatsSampler(
                        store: shared.store, connection: shared.publisher, names: settings.names, interval: .seconds(5),
                        logger: logger))
            }
        }
        return first + middle + last
    }

    /// The intake's services (its HTTP server last), with the console on its admin listener
    /// when admin tokens are set.
    private static func intakeServices(
        settings: PipelineSettings, shared: SharedDependencies, logger: Logger,
        onListening: @escaping @Sendable (Listener, Int) async -> Void
    ) throws -> [any Service] {
        let store = try shared.require(shared.store, "the order store", for: .intake)
        var intake = settings.intake
        intake.finishTransactions = settings.storeKit.finishTransactions
        if !intake.adminTokens.isEmpty { intake.appStore = try shared.serverAPI(settings, logger: logger) }
        if settings.inlineVerification { intake.inlineVerifier = try shared.appStoreVerifier(settings, for: .intake, logger: logger) }
        if intake.notificationVerifier == nil { intake.notificationVerifier = shared.signedData }
        if intake.bundleIds.isEmpty { intake.bundleIds = settings.verifyReceipt.bundleIds }
        // The roots the verifiers check receipts against: a receipt whose certificates lead to
        // none of them is refused at the door, before it is stored or queued. Where they are
        // Apple's by default and `verifyReceipt` is not Apple's (a stand-in such as the fake App
        // Store, which signs under roots of its own), that stand-in is left to decide.
        if intake.receiptRoots == nil, settings.storeKit.trustedRoots != nil || settings.verifyReceipt.endpoints == .apple {
            intake.receiptRoots = ReceiptSignature(roots: try settings.storeKit.trustedRoots ?? AppleRoot.receiptRoots())
        }
        if !intake.adminTokens.isEmpty {
            let console = try Console(
                settings: ConsoleSettings(
                    operatorTokens: intake.adminTokens, viewerTokens: settings.console.viewerTokens,
                    insecureCookies: settings.console.insecureCookies, sessionLifetime: settings.console.sessionLifetime,
                    clientAddresses: intake.limits.clientAddresses, bodyTimeout: intake.limits.bodyTimeout,
                    maxInFlight: settings.console.maxInFlight, maxInFlightPerSession: settings.console.maxInFlightPerSession,
                    maxSignInsInFlight: settings.console.maxSignInsInFlight,
                    signInBodyTimeout: min(settings.console.signInBodyTimeout, intake.limits.bodyTimeout),
                    failedSignIns: intake.limits.failedAdminAttempts),
                dependencies: ConsoleDependencies(
                    store: store, catalog: intake.catalog, names: settings.names, broker: shared.publisher,
                    appStore: try shared.serverAPI(settings, logger: logger), signedData: shared.signedData,
                    finishAtApple: settings.storeKit.finishTransactions.serverFinishes),
                logger: logger)
            intake.adminPages = { router in console.addRoutes(to: router) }
        }
        return makeIntakeServices(
            settings: intake, store: store, logger: logger,
            onServerRunning: { port in await onListening(.intake, port) },
            onAdminServerRunning: { port in await onListening(.admin, port) })
    }

    /// Scheduled reconciliation with Apple, in the process that runs the finisher.
    private static func reconciliation(
        settings: PipelineSettings, schedule: ReconciliationSettings, shared: SharedDependencies, logger: Logger
    ) throws -> any Service {
        let client = try shared.require(try shared.serverAPI(settings, logger: logger), "a Server API client", for: .finisher)
        let reconciliation = Reconciliation(
            store: try shared.require(shared.store, "the order store", for: .finisher),
            reader: SubscriptionStatusReader(
                client: client, verifier: try shared.require(shared.signedData, "a signed-data verifier", for: .finisher)),
            policy: CreditPolicy(
                catalog: settings.finisher.catalog, eventsExchange: settings.names.events,
                sandbox: settings.finisher.sandboxPolicy, restore: settings.finisher.restorePolicy,
                finishAtApple: settings.storeKit.finishTransactions.serverFinishes),
            verifyQueue: settings.names.verify, settings: schedule, logger: logger)
        return ReconciliationService(reconciliation: reconciliation, interval: schedule.interval, logger: logger)
    }

    /// `/metrics`, `/healthz`, `/readyz`. Writing the store needs no broker (the outbox holds
    /// uploads and events meanwhile); consuming does, and so does a verifier's publishing.
    private static func opsServer(
        _ ops: OpsSettings, shared: SharedDependencies, logger: Logger, onListening: @escaping @Sendable (Listener, Int) async -> Void
    ) -> any Service {
        let readiness = Readiness(
            store: shared.store,
            connections: [shared.consumer, shared.store == nil ? shared.publisher : nil].compactMap { $0 })
        return Application(
            router: makeOpsRouter(readiness: readiness, exposition: ops.exposition),
            configuration: .init(address: .hostname(ops.host, port: ops.port), serverName: "iap-ops"),
            onServerRunning: { channel in await onListening(.ops, channel.localAddress?.port ?? ops.port) },
            logger: logger)
    }

    /// A graceful shutdown that takes longer than 30 s (a broker that stays away while
    /// publishes wait for it) turns into cancellation: what was not confirmed stays in the
    /// outbox or on the queue for the next start.
    /// A service group over these services; `alongside` (the fake App Store of `iap dev` and
    /// the tests) start before them and stop after them.
    public func makeServiceGroup(
        gracefulShutdownSignals: [UnixSignal], logger: Logger, alongside: [any Service] = []
    ) -> ServiceGroup {
        var configuration = ServiceGroupConfiguration(
            services: alongside + services, gracefulShutdownSignals: gracefulShutdownSignals, logger: logger)
        configuration.maximumGracefulShutdownDuration = .seconds(30)
        configuration.maximumCancellationDuration = .seconds(10)
        return ServiceGroup(configuration: configuration)
    }

    /// Runs until a signal (SIGTERM, SIGINT) asks for a graceful shutdown, then releases clients.
    public func run(logger: Logger, alongside: [any Service] = []) async throws {
        let group = makeServiceGroup(gracefulShutdownSignals: [.sigterm, .sigint], logger: logger, alongside: alongside)
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
