import AppStore
import Console
import FakeAppStore
import Foundation
import IAPCore
import Intake
import Logging
import NIOConcurrencyHelpers
import OrderStore
import TestSupport
import ServiceLifecycle
import X509

/// The intake's listeners alone (app routes, admin routes, the console) on free loopback
/// ports over a store of their own, with no broker: what a stranger on the network reaches.
/// Accepted uploads stay in the outbox; nothing relays them.
final class EdgeHarness: Sendable {
    /// `http://127.0.0.1:<port>` of the app's routes.
    let intakeURL: String
    /// The admin listener's, when started with `separateAdmin`.
    let adminURL: String?
    let store: OrderStore
    /// Signs notifications the intake takes for Apple's.
    let apple: FakeCertificateAuthority
    /// Every line logged at error or above, for tests that no stranger reaches the error log.
    let errorLines: NIOLockedValueBox<[String]>
    private let group: ServiceGroup
    private let task: Task<Void, any Error>

    static let adminToken = PipelineHarness.adminToken
    /// `X-Real-IP` believed from this machine, the tests' stand-in for a reverse proxy.
    static let behindLocalProxy = ClientAddressPolicy(header: "X-Real-IP", trustedProxies: [NetworkBlock("127.0.0.0/8")!])

    static func start(
        limits: IntakeLimits = .unlimited, authentication: UserAuthentication = .off, adminTokens: [String] = [adminToken],
        separateAdmin: Bool = false, console: ConsoleSettings? = ConsoleSettings(insecureCookies: true)
    ) async throws -> EdgeHarness {
        let errorLines = NIOLockedValueBox([String]())
        let logger = Logger(label: "iap.tests.edge") { _ in ErrorRecorder(lines: errorLines) }
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-edge-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        let store = try await TestStore.open(in: folder)
        let apple = try FakeCertificateAuthority.generate(name: "Edge Apple")
        var settings = IntakeSettings(
            host: "127.0.0.1", port: 0, catalog: PipelineHarness.testCatalog, authentication: authentication,
            limits: limits, adminTokens: adminTokens, adminListener: separateAdmin ? ("127.0.0.1", 0) : nil,
            notificationVerifier: SignedDataVerifier(
                settings: .init(
                    trustedRoots: [apple.root], bundleIds: [PipelineHarness.bundleId],
                    appAppleId: FakeAppStore.defaultAppAppleId)))
        settings.bundleIds = [PipelineHarness.bundleId]
        if var consoleSettings = console, !adminTokens.isEmpty {
            consoleSettings.operatorTokens = adminTokens
            consoleSettings.clientAddresses = limits.clientAddresses
            let console = try Console(
                settings: consoleSettings,
                dependencies: ConsoleDependencies(
                    store: store, catalog: PipelineHarness.testCatalog, names: settings.names, broker: nil, appStore: nil,
                    signedData: nil),
                logger: logger)
            settings.adminPages = { router in console.addRoutes(to: router) }
        }
        let ports = NIOLockedValueBox((intake: 0, admin: 0))
        let services = makeIntakeServices(
            settings: settings, store: store, logger: logger,
            onServerRunning: { port in ports.withLockedValue { $0.intake = port } },
            onAdminServerRunning: { port in ports.withLockedValue { $0.admin = port } })
        let group = ServiceGroup(configuration: .init(services: services, gracefulShutdownSignals: [], logger: logger))
        let task = Task { try await group.run() }
        guard
            try await eventually(
                timeout: PipelineHarness.startLimit,
                { ports.withLockedValue { $0.intake != 0 && (!separateAdmin || $0.admin != 0) } })
        else { throw HarnessError("the intake's listeners did not start") }
        let (intake, admin) = ports.withLockedValue { ($0.intake, $0.admin) }
        return EdgeHarness(
            intakeURL: "http://127.0.0.1:\(intake)", adminURL: separateAdmin ? "http://127.0.0.1:\(admin)" : nil,
            store: store, apple: apple, errorLines: errorLines, group: group, task: task)
    }

    private init(
        intakeURL: String, adminURL: String?, store: OrderStore, apple: FakeCertificateAuthority,
        errorLines: NIOLockedValueBox<[String]>, group: ServiceGroup, task: Task<Void, any Error>
    ) {
        self.errorLines = errorLines
        self.intakeURL = intakeURL
        self.adminURL = adminURL
        self.store = store
        self.apple = apple
        self.group = group
        self.task = task
    }

    /// The port of a `http://127.0.0.1:<port>` URL.
    static func port(_ url: String) -> Int { Int(url.split(separator: ":").last ?? "") ?? 0 }

    /// Runs `body` with a started harness and stops it whatever happens.
    static func with<T>(
        limits: IntakeLimits = .unlimited, authentication: UserAuthentication = .off, adminTokens: [String] = [adminToken],
        separateAdmin: Bool = false, console: ConsoleSettings? = ConsoleSettings(insecureCookies: true),
        _ body: (EdgeHarness) async throws -> T
    ) async throws -> T {
        let harness = try await start(
            limits: limits, authentication: authentication, adminTokens: adminTokens, separateAdmin: separateAdmin,
            console: console)
        do {
            let result = try await body(harness)
            await harness.stop()
            return result
        } catch {
            await harness.stop()
            throw error
        }
    }

    func stop() async {
        await group.triggerGracefulShutdown()
        _ = try? await task.value
    }
}

/// Keeps the messages logged at error or above.
struct ErrorRecorder: LogHandler {
    let lines: NIOLockedValueBox<[String]>
    var metadata: Logger.Metadata = [:]
    var logLevel: Logger.Level = .error

    subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }

    func log(event: LogEvent) {
        guard event.level >= .error else { return }
        lines.withLockedValue { $0.append("\(event.message) \(event.metadata ?? [:])") }
    }
}
