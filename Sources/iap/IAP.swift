import AppStore
import ArgumentParser
import Console
import Crypto
import Finisher
import Foundation
import IAPCore
import Intake
import Logging
import FakeAppStore
import Messaging
import NIOCore
import ServiceLifecycle
import UnixSignals
import Pipeline
import Verifier
import X509
import SwiftASN1

/// Settings read from the environment only (secrets, webhooks), told in `--help`.
enum HelpText {
    static let admin = """
        Customer service's admin routes (/v1/admin/...) need \(Setting.adminToken.variable) (or \(Setting.adminToken.fileVariable)): \
        one or more tokens separated by commas, each at least 32 characters (`openssl rand -hex 16` makes one), sent as Authorization: Bearer <token>; \
        unset, they answer 503. The same tokens sign an operator in to the console at /admin/ (beside the admin routes); \
        with a token set, the admin routes and the console need a listener of their own (\(Setting.adminPort.variable)) unless \
        \(Setting.adminPublic.variable)=1 serves them on the intake's port (the default only for iap dev on loopback); \
        \(Setting.viewerToken.variable) (or \(Setting.viewerToken.fileVariable); same form) signs in read-only support. Console sessions are \
        cookies (HttpOnly, SameSite=Strict, Secure unless \(Setting.adminInsecureCookies.variable)=1, for plain HTTP on loopback; \
        iap dev defaults to 1), last 8 hours and live in memory: a restart signs everyone out.
        App users send Authorization: Bearer <JWT> from the app's login backend (sub is the user id): \
        \(Setting.authHS256Secret.variable) (or \(Setting.authHS256Secret.fileVariable)), at least 32 bytes, or --auth-public-key-path.
        An uploaded receipt whose certificates can lead to no trusted root is refused before it is stored (400 receipt_untrusted): \
        the roots are \(Setting.trustedRoots.variable), else Apple's where \(Setting.appStoreVerifyURL.variable) and \
        \(Setting.appStoreSandboxVerifyURL.variable) (read from the environment, as the verifiers read them) are Apple's own.
        """
    static let broker = """
        The broker URL, amqp://user:password@host:port/vhost, comes from \(Setting.amqpURL.variable) or from the file named by \
        \(Setting.amqpURL.fileVariable), never from a flag (ps shows flags); default \(Setting.amqpURL.defaultText). \
        For a RabbitMQ cluster, give each node's URL, separated by commas: a connection that loses its node moves \
        to the next one. Several URLs make quorum queues the default (\(Setting.queueType.variable)).
        """
    static let reconcile = """
        Reconciliation (\(Setting.reconcileInterval.variable)) asks the App Store Server API with the key of the environment: \
        \(Setting.appStoreKeyPath.variable), \(Setting.appStoreKeyId.variable), \(Setting.appStoreIssuerId.variable) (and \(Setting.appStoreAPIURL.variable), \
        \(Setting.appStoreSandboxAPIURL.variable), \(Setting.appStoreAPIRateShare.variable); see iap verifier --help), with exactly one \
        bundle id in \(Setting.bundleIds.variable); without a key it does not run. `iap admin reconcile` runs it once now.
        """
    static let ledger = """
        Crediting: \(Setting.restore.variable)=\(Setting.restore.defaultText) (the default: a restore uploaded by another user leaves the entitlement with its \
        first owner) or transfer (the entitlement moves to the user who restored it); \(Setting.sandbox.variable) and \
        \(Setting.sandboxAllowlist.variable) (see iap verifier --help) also decide which sandbox notifications grant anything.
        """
    static let alerts = """
        Alerts: \(Setting.alertAfterAttempts.variable) (default \(Setting.alertAfterAttempts.defaultText)) failed attempts, or needs_review, alert once per \
        submission (error log, iap_alerts_total); \(Setting.alertWebhook.variable), when set, receives each as a JSON POST.
        """
}

@main
struct IAP: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "iap",
        abstract: "Verifies App Store purchases and credits each one exactly once.",
        subcommands: [
            IntakeCommand.self, VerifierCommand.self, FinisherCommand.self, OrdersCommand.self,
            FakeAppStoreCommand.self, DevCommand.self, InspectCommand.self, AdminCommand.self, BenchCommand.self,
        ])
}

/// The settings every role shares, with the parts a role does not use left at their defaults.
private func pipelineSettings(
    broker: BrokerOptions, store: StoreOptions? = nil, http: HTTPOptions? = nil, verifier: VerifierOptions? = nil,
    finisherPrefetch: Int? = nil, dev: Bool = false,
    verifyReceipt: VerifyReceiptClient.Settings? = nil
) throws -> PipelineSettings {
    let names = try broker.names()
    var settings = PipelineSettings(
        amqp: try broker.configuration(),
        names: names,
        databasePath: store?.path(dev: dev) ?? SettingReader().string(nil, .databasePath, default: Setting.databasePath.fallback(dev: dev)),
        intake: try http?.settings(names: names, dev: dev) ?? IntakeSettings(names: names),
        verifier: try verifier?.verifierSettings(names: names) ?? VerifierSettings(names: names),
        verifyReceipt: try verifyReceipt ?? verifier?.verifyReceiptSettings()
            ?? VerifyReceiptClient.Settings(endpoints: .apple, bundleIds: []),
        finisher: FinisherSettings(
            names: names,
            prefetch: try SettingReader().int(finisherPrefetch, .finisherPrefetch, in: 1...10_000),
            alerts: try alertSettings(),
            sandboxPolicy: try verifier?.sandboxPolicy() ?? VerifierOptions.sandboxPolicy(),
            restorePolicy: try VerifierOptions.restorePolicy()))
    settings.postgres = try store?.postgres()
    settings.messageEncoding = try broker.encoding()
    settings.verifier.messageEncoding = settings.messageEncoding
    return settings
}

/// The catalog, the admin tokens (IAP_ADMIN_TOKEN or IAP_ADMIN_TOKEN_FILE; never a flag) and,
/// for a process with the intake, how users authenticate.
private func apply(
    catalog: Catalog, http: HTTPOptions? = nil, dev: Bool = false, to settings: inout PipelineSettings
) async throws {
    settings.intake.catalog = catalog
    settings.finisher.catalog = catalog
    if let raw = try SettingReader().secret(.adminToken) {
        let tokens = raw.split(whereSeparator: { $0 == "," || $0.isWhitespace }).map(String.init)
        guard !tokens.isEmpty, tokens.allSatisfy({ $0.utf8.count >= 32 }) else {
            throw ValidationError("\(Setting.adminToken.variable): each token must be at least 32 characters (openssl rand -hex 16 makes one)")
        }
        settings.intake.adminTokens = tokens
    }
    if let raw = try SettingReader().secret(.viewerToken) {
        let tokens = raw.split(whereSeparator: { $0 == "," || $0.isWhitespace }).map(String.init)
        guard !tokens.isEmpty, tokens.allSatisfy({ $0.utf8.count >= 32 }) else {
            throw ValidationError("\(Setting.viewerToken.variable): each token must be at least 32 characters (openssl rand -hex 16 makes one)")
        }
        settings.console.viewerTokens = tokens
    }
    switch SettingReader().string(nil, .adminInsecureCookies, default: Setting.adminInsecureCookies.fallback(dev: dev)) {
    case "1", "true": settings.console.insecureCookies = true
    case "0", "false": settings.console.insecureCookies = false
    case let other: throw ValidationError("\(Setting.adminInsecureCookies.variable) must be 1 or 0, got '\(other)'")
    }
    if let http {
        settings.intake.authentication = try await http.authentication(dev: dev)
        try checkAdminSurface(settings, dev: dev)
        try checkAuthenticationOff(settings)
    }
}

/// Whether `host` is a loopback address (parsed, never a prefix of the text): only this
/// machine reaches a listener there.
private func isLoopback(_ host: String) -> Bool {
    NetworkAddress.isLoopbackHost(host)
}

/// `IAP_AUTH=off` lets every request name its user: it is for a laptop, so a process refuses
/// to start with it unless the public listener (IAP_HTTP_HOST) is a loopback address.
private func checkAuthenticationOff(_ settings: PipelineSettings) throws {
    guard case .off = settings.intake.authentication, !isLoopback(settings.intake.host) else { return }
    throw ValidationError(
        """
        \(Setting.auth.variable)=off lets anyone upload and read as any user, and \(Setting.httpHost.variable) is \(settings.intake.host), not \
        loopback: set \(Setting.auth.variable)=jwt with a key (\(Setting.authHS256Secret.variable) or \(Setting.authPublicKeyPath.variable)), or listen on \
        127.0.0.1 for local development.
        """)
}

/// The admin routes and the console belong on their own listener (IAP_ADMIN_PORT): with
/// admin or viewer tokens and no such listener, a process refuses to start unless
/// IAP_ADMIN_PUBLIC=1 says to serve them on the intake's port (the default only for `iap dev`
/// bound to loopback).
private func checkAdminSurface(_ settings: PipelineSettings, dev: Bool) throws {
    guard settings.intake.adminListener == nil,
        !settings.intake.adminTokens.isEmpty || !settings.console.viewerTokens.isEmpty
    else { return }
    let loopback = isLoopback(settings.intake.host)
    switch SettingReader().string(nil, .adminPublic, default: dev && loopback ? "1" : nil) {
    case "1", "true": return
    case "0", "false":
        throw ValidationError(
            """
            \(Setting.adminToken.variable) is set but \(Setting.adminPort.variable) is not: the admin routes and the console would share the \
            public port. Set \(Setting.adminPort.variable) (a listener of their own, on 127.0.0.1 unless \(Setting.adminHost.variable) says \
            otherwise), or \(Setting.adminPublic.variable)=1 to serve them on the intake's port anyway.
            """)
    case let other: throw ValidationError("\(Setting.adminPublic.variable) must be 1 or 0, got '\(other)'")
    }
}

/// Runs roles until SIGTERM or SIGINT. Metrics are bootstrapped here, before any role exists,
/// because a counter made before the bootstrap would count into nothing.
private func serve(
    _ roles: Set<Role>, settings: PipelineSettings, ops: OpsOptions, log: LogOptions, label: String
) async throws {
    var settings = settings
    settings.ops = try ops.settings()
    let logger = try log.makeLogger(label: label)
    try await Pipeline(roles: roles, settings: settings, logger: logger).run(logger: logger)
}

/// Alerts: after how many failed attempts, and the optional webhook.
private func alertSettings() throws -> AlertSettings {
    let reader = SettingReader()
    let webhook = reader.optionalString(nil, .alertWebhook)
    if let webhook, URL(string: webhook)?.host == nil {
        throw ValidationError("\(Setting.alertWebhook.variable) must be an http(s) URL, got '\(webhook)'")
    }
    return AlertSettings(
        afterAttempts: try reader.int(nil, .alertAfterAttempts, in: 1...10_000), webhookURL: webhook)
}

struct IntakeCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "intake", abstract: "Accept receipt uploads over HTTP and queue them durably (outbox relay included).",
        discussion: HelpText.admin + "\n" + HelpText.broker)

    @OptionGroup var broker: BrokerOptions
    @OptionGroup var store: StoreOptions
    @OptionGroup var http: HTTPOptions
    @OptionGroup var notifications: NotificationOptions
    @OptionGroup var ops: OpsOptions
    @OptionGroup var catalog: CatalogOptions
    @OptionGroup var log: LogOptions

    func run() async throws {
        var settings = try pipelineSettings(broker: broker, store: store, http: http)
        try await apply(catalog: catalog.load(), http: http, to: &settings)
        try notifications.apply(to: &settings)
        // Who finishes (the answers' advice) and the console's look-ups: from the environment only.
        settings.storeKit = try StoreKitOptions.parse([]).settings(
            bundleIds: settings.verifyReceipt.bundleIds, defaults: settings.storeKit)
        try await serve([.intake], settings: settings, ops: ops, log: log, label: "iap.intake")
    }
}

struct VerifierCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "verifier", abstract: "Verify queued uploads with Apple and publish the results. Run as many as needed.",
        discussion: """
            Secrets come from the environment only, never from flags (ps shows flags): \
            \(Setting.appStoreSharedSecret.variable), or \(Setting.appStoreSharedSecret.fileVariable) naming a file that holds it.
            """ + "\n" + HelpText.broker)

    @OptionGroup var broker: BrokerOptions
    @OptionGroup var verifier: VerifierOptions
    @OptionGroup var storeKit: StoreKitOptions
    @OptionGroup var ops: OpsOptions
    @OptionGroup var log: LogOptions

    func run() async throws {
        var settings = try pipelineSettings(broker: broker, verifier: verifier)
        settings.storeKit = try storeKit.settings(bundleIds: settings.verifyReceipt.bundleIds)
        try await serve([.verifier], settings: settings, ops: ops, log: log, label: "iap.verifier")
    }
}

struct FinisherCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "finisher", abstract: "Apply verification results to the order store, crediting each purchase once.",
        discussion: HelpText.ledger + "\n" + HelpText.alerts + "\n" + HelpText.broker)

    @OptionGroup var broker: BrokerOptions
    @OptionGroup var store: StoreOptions
    @Option(name: .long, help: ArgumentHelp(Setting.finisherPrefetch.help))
    var finisherPrefetch: Int?
    @OptionGroup var ops: OpsOptions
    @OptionGroup var catalog: CatalogOptions
    @OptionGroup var log: LogOptions

    func run() async throws {
        var settings = try pipelineSettings(broker: broker, store: store, finisherPrefetch: finisherPrefetch)
        try await apply(catalog: catalog.load(), to: &settings)
        // The Server API key, for Finish Transaction: from the environment only.
        settings.storeKit = try StoreKitOptions.parse([]).settings(
            bundleIds: settings.verifyReceipt.bundleIds, defaults: settings.storeKit)
        try await serve([.finisher], settings: settings, ops: ops, log: log, label: "iap.finisher")
    }
}

struct OrdersCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "orders", abstract: "The order service: intake and finisher in one process, the only writer of the store.",
        discussion: HelpText.admin + "\n" + HelpText.ledger + "\n" + HelpText.alerts + "\n" + HelpText.reconcile + "\n"
            + HelpText.broker)

    @OptionGroup var broker: BrokerOptions
    @OptionGroup var store: StoreOptions
    @OptionGroup var http: HTTPOptions
    @Option(name: .long, help: ArgumentHelp(Setting.finisherPrefetch.help))
    var finisherPrefetch: Int?
    @OptionGroup var notifications: NotificationOptions
    @OptionGroup var reconcile: ReconcileOptions
    @OptionGroup var ops: OpsOptions
    @OptionGroup var catalog: CatalogOptions
    @OptionGroup var log: LogOptions

    func run() async throws {
        var settings = try pipelineSettings(broker: broker, store: store, http: http, finisherPrefetch: finisherPrefetch)
        try await apply(catalog: catalog.load(), http: http, to: &settings)
        try notifications.apply(to: &settings)
        settings.reconciliation = try reconcile.settings()
        // The Server API key (reconciliation, Finish Transaction, the console's look-ups), from
        // the environment only (the verifier's flags would clash here).
        settings.storeKit = try StoreKitOptions.parse([]).settings(
            bundleIds: settings.verifyReceipt.bundleIds, defaults: settings.storeKit)
        try await serve([.intake, .finisher], settings: settings, ops: ops, log: log, label: "iap.orders")
    }
}

struct FakeAppStoreCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "fake-appstore", abstract: "A local stand-in for Apple's verifyReceipt, for tests and demos. Never for production.")

    @OptionGroup var fake: FakeAppStoreOptions
    @OptionGroup var log: LogOptions

    func run() async throws {
        let (host, port) = try fake.address()
        let logger = try log.makeLogger(label: "iap.fake-appstore")
        let application = try FakeAppStore(
            databasePath: fake.databasePath(), apiKey: fake.apiKey(),
            notificationURL: fake.notificationURL()
        ).makeApplication(host: host, port: port, logger: logger)
        let group = ServiceGroup(
            configuration: .init(services: [application], gracefulShutdownSignals: [.sigterm, .sigint], logger: logger))
        try await group.run()
    }
}

struct DevCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "dev",
        abstract: "Everything in one process for a laptop: intake, verifier, finisher and the fake App Store.",
        discussion: """
            The verifier is pointed at the fake App Store of this process; the App Store URL settings are ignored.
            Bundle ids default to com.example.demo. Binds to 127.0.0.1 unless told otherwise.
            User authentication is off unless \(Setting.auth.variable)=jwt (with a key, as for intake): the request then names \
            its user (the body's userId, ?userId= or the path) and gets the same rate limits and ownership rules.
            \(Setting.inlineVerification.variable)=true makes the intake verify inside the HTTP request (the synchronous \
            baseline of iap bench; no queue, no retries; never for production).
            """ + "\n" + HelpText.admin + "\n" + HelpText.broker)

    @OptionGroup var broker: BrokerOptions
    @OptionGroup var store: StoreOptions
    @OptionGroup var http: HTTPOptions
    @OptionGroup var verifier: VerifierOptions
    @OptionGroup var storeKit: StoreKitOptions
    @OptionGroup var fake: FakeAppStoreOptions
    @OptionGroup var reconcile: ReconcileOptions
    @OptionGroup var ops: OpsOptions
    @OptionGroup var catalog: CatalogOptions
    @OptionGroup var log: LogOptions

    func run() async throws {
        let (fakeHost, fakePort) = try fake.address()
        let fakeURL = "http://\(fakeHost == "0.0.0.0" ? "127.0.0.1" : fakeHost):\(fakePort)"
        let verifyReceipt = try verifier.verifyReceiptSettings(
            endpointsOverride: VerifyReceiptEndpoints(
                production: fakeURL + "/verifyReceipt", sandbox: fakeURL + "/sandbox/verifyReceipt"),
            dev: true)
        var settings = try pipelineSettings(
            broker: broker, store: store, http: http, verifier: verifier, dev: true, verifyReceipt: verifyReceipt)
        try await apply(catalog: catalog.load(demoIfUnset: true), http: http, dev: true, to: &settings)
        settings.ops = try ops.settings(dev: true)
        // StoreKit 2 against the fake: a Server API key made for this run, given to both
        // sides; signed data trusted up to the fake's root; notifications to our intake. The
        // fake's file lies beside the order store's.
        let key = P256.Signing.PrivateKey()
        let keyId = "DEVKEY0001"
        let issuerId = UUID().uuidString.lowercased()
        let intakeHost = settings.intake.host == "0.0.0.0" ? "127.0.0.1" : settings.intake.host
        let fakeAppStore = try FakeAppStore(
            databasePath: fake.databasePath(beside: settings.databasePath),
            apiKey: try FakeServerAPIKey(privateKeyPEM: key.pemRepresentation, keyId: keyId, issuerId: issuerId),
            notificationURL: fake.notificationURL() ?? "http://\(intakeHost):\(settings.intake.port)/v1/notifications/appstore")
        let fakeRoot = try fakeAppStore.rootCertificateDER()
        settings.storeKit = try storeKit.settings(
            bundleIds: verifyReceipt.bundleIds,
            defaults: StoreKitSettings(
                trustedRoots: [try Certificate(derEncoded: fakeRoot)], appAppleId: FakeAppStore.defaultAppAppleId,
                serverAPI: AppStoreServerAPIClient.Settings(
                    keyId: keyId, issuerId: issuerId, privateKeyPEM: key.pemRepresentation,
                    bundleId: verifyReceipt.bundleIds.sorted().first ?? "com.example.demo", productionURL: fakeURL,
                    sandboxURL: fakeURL + "/sandbox"),
                receiptsThroughServerAPI: false))
        settings.reconciliation = try reconcile.settings()
        switch SettingReader().string(nil, .inlineVerification) {
        case "true": settings.inlineVerification = true
        case "false": break
        case let other: throw ValidationError("\(Setting.inlineVerification.variable) must be true or false, got '\(other)'")
        }
        let logger = try log.makeLogger(label: "iap.dev")
        let host = settings.intake.host
        let pipeline = try await Pipeline(
            roles: [.intake, .verifier, .finisher], settings: settings, logger: logger,
            onListening: { listener, port in
                logger.notice("listening", metadata: ["role": "\(listener.rawValue)", "url": "http://\(host):\(port)"])
            })
        let fakeApplication = fakeAppStore.makeApplication(
            host: fakeHost, port: fakePort, logger: logger,
            onServerRunning: { channel in
                let url = "http://\(fakeHost):\(channel.localAddress?.port ?? fakePort)"
                logger.notice("listening", metadata: ["role": "fake-appstore", "url": "\(url)"])
            })
        try await pipeline.run(logger: logger, alongside: [fakeApplication])
    }
}
