import AppStore
import Console
import Crypto
import AsyncHTTPClient
import FakeAppStore
import Finisher
import Foundation
import GRDB
import IAPCore
import Intake
import Ledger
import Logging
import Messaging
import NIOConcurrencyHelpers
import NIOCore
import NIOFoundationCompat
import NIOHTTP1
import OrderStore
@testable import Store
import Pipeline
import Relay
import ServiceLifecycle
import Testing
import TestSupport
import Verifier
import X509
import SwiftASN1

/// A whole pipeline (fake App Store, intake, verifier, finisher) started in this process
/// against the test broker, on free loopback ports, with queues of its own.
final class PipelineHarness: Sendable {
    let names: PipelineNames
    let databasePath: String
    /// The store's backend (a harness `sharing` another uses the other's store).
    let backend: Backend
    let intakeURL: String
    let fakeURL: String
    let store: OrderStore
    /// The operators' endpoint, when started with `withOps`.
    let opsURL: String?
    /// The admin routes' own listener, when started with `separateAdmin`.
    let adminURL: String?
    private let groups: [ServiceGroup]
    private let tasks: [Task<Void, any Error>]
    private let pipelines: [Pipeline]

    static let bundleId = "com.example.tests"
    /// How long a harness may take to start its servers and reach the broker: a bound that
    /// catches a start that hangs, not a measure of a start. At the beginning of a run some fifty
    /// suites start at once on two cores, and a 10 s bound failed there (the fake App Store's
    /// port had not been reported yet).
    static let startLimit: Duration = .seconds(60)
    static let adminToken = "test-admin-token-0123456789abcdefghij"
    /// Signs read-only support in to the console.
    static let viewerToken = "test-viewer-token-0123456789abcdefghij"

    /// What the tests' app sells.
    static let testCatalog = TestCatalog.catalog

    static func start(
        name: String, roles: Set<Role> = [.intake, .verifier, .finisher], retryDelays: [Int] = [1],
        appleTimeout: Duration = .seconds(2), sandboxPolicy: SandboxPolicy = .accept, verifierConcurrency: Int = 32,
        circuitBreaker: CircuitBreaker.Settings = .init(), sweeper: SweeperSettings = .init(),
        alerts: AlertSettings = .init(), withOps: Bool = false, authentication: UserAuthentication = .off,
        limits: IntakeLimits = .unlimited, separateAdmin: Bool = false, receiptsThroughServerAPI: Bool = false,
        localReceipts: Bool = false, xcodeCertificate: Certificate? = nil, otherApps: Set<String> = [],
        confirmWithAPI: Bool = false, restorePolicy: RestorePolicy = .keep, finishTransactions: FinishMode = .app,
        consumption: ConsumptionAnswer.Settings = .init(), oneTimeCharge: Bool = true,
        onCluster: Bool = false, logger: Logger = TestBroker.logger,
        sharing shared: PipelineHarness? = nil, store chosenStore: StoreLocation? = nil, on backend: Backend = .sqlite
    ) async throws -> PipelineHarness {
        // On the three-node cluster: all its URLs, quorum queues.
        let names =
            shared?.names
            ?? (onCluster ? TestCluster.names(name) : PipelineNames(prefix: TestBroker.uniquePrefix(name)))
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-tests-\(UUID().uuidString)")
        var databasePath = shared?.databasePath ?? folder.appendingPathComponent("orders.sqlite").path
        if case .sqlite(let path)? = chosenStore { databasePath = path }
        let location: StoreLocation
        if let chosenStore {
            location = chosenStore
        } else {
            location = try await TestStore.location(
                in: URL(fileURLWithPath: databasePath).deletingLastPathComponent(), on: shared?.backend ?? backend)
        }
        var settings = PipelineSettings(
            amqp: try onCluster ? TestCluster.configuration() : TestBroker.configuration(), names: names,
            databasePath: databasePath,
            intake: IntakeSettings(
                host: "127.0.0.1", port: 0, names: names, sweeper: sweeper, catalog: testCatalog,
                authentication: authentication, limits: limits, adminTokens: [adminToken],
                adminListener: separateAdmin ? ("127.0.0.1", 0) : nil),
            verifier: VerifierSettings(
                names: names, concurrency: verifierConcurrency, retrySchedule: RetrySchedule(delaysSeconds: retryDelays),
                sandboxPolicy: sandboxPolicy, circuitBreaker: circuitBreaker),
            verifyReceipt: VerifyReceiptClient.Settings(
                endpoints: .apple, bundleIds: otherApps.union([bundleId]), timeout: appleTimeout),
            finisher: FinisherSettings(
                names: names, alerts: alerts, catalog: testCatalog, sandboxPolicy: sandboxPolicy, restorePolicy: restorePolicy),
            ops: withOps ? OpsSettings(host: "127.0.0.1", port: 0) : nil)
        if case .postgres(let postgres) = location { settings.postgres = postgres }
        settings.console = ConsoleSettings(viewerTokens: [viewerToken], insecureCookies: true)
        let ports = NIOLockedValueBox([Listener: Int]())
        let report: @Sendable (Listener, Int) async -> Void = { listener, port in ports.withLockedValue { $0[listener] = port } }

        // A harness sharing another's store and queues uses that one's fake App Store.
        let fakePort = NIOLockedValueBox<Int?>(nil)
        var fakeServices: [any Service] = []
        if shared == nil {
            fakeServices.append(
                try FakeAppStore(
                    apiKey: try FakeServerAPIKey(
                        privateKeyPEM: ServerAPIKey.privateKey.pemRepresentation, keyId: ServerAPIKey.keyId,
                        issuerId: ServerAPIKey.issuerId)
                ).makeApplication(
                    host: "127.0.0.1", port: 0, logger: logger,
                    onServerRunning: { channel in fakePort.withLockedValue { $0 = channel.localAddress?.port } }))
        }
        let fakeGroup = ServiceGroup(
            configuration: .init(services: fakeServices, gracefulShutdownSignals: [], logger: logger))
        let fakeTask = Task { try await fakeGroup.run() }
        if shared == nil {
            guard try await eventually(timeout: Self.startLimit, { fakePort.withLockedValue { $0 } != nil }) else {
                throw HarnessError("the fake App Store did not start")
            }
        }
        let fakeURL = shared?.fakeURL ?? "http://127.0.0.1:\(fakePort.withLockedValue { $0! })"
        settings.verifyReceipt.endpoints = VerifyReceiptEndpoints(
            production: fakeURL + "/verifyReceipt", sandbox: fakeURL + "/sandbox/verifyReceipt")
        // StoreKit 2 against the fake: its root, its Server API, our test key.
        let root = try await HTTP.get(fakeURL + "/fake/root-certificate")
        settings.storeKit = StoreKitSettings(
            trustedRoots: [try Certificate(derEncoded: [UInt8](root.body))], appAppleId: FakeAppStore.defaultAppAppleId,
            serverAPI: ServerAPIKey.settings(fakeURL: fakeURL), confirmWithAPI: confirmWithAPI,
            receiptsThroughServerAPI: receiptsThroughServerAPI)
        settings.storeKit.finishTransactions = finishTransactions
        settings.storeKit.localReceipts = localReceipts
        settings.storeKit.xcodeCertificate = xcodeCertificate
        settings.storeKit.consumption = consumption

        let pipeline = try await Pipeline(roles: roles, settings: settings, logger: logger, onListening: report)
        let group = pipeline.makeServiceGroup(gracefulShutdownSignals: [], logger: logger)
        let task = Task { try await group.run() }
        if roles.contains(.intake) {
            guard
                try await eventually(
                    timeout: Self.startLimit,
                    { ports.withLockedValue { $0[.intake] != nil && (!separateAdmin || $0[.admin] != nil) } })
            else {
                throw HarnessError("the intake did not start")
            }
        }
        guard await pipeline.connection?.waitUntilConnected(timeout: Self.startLimit) ?? true,
            await pipeline.consumerConnection?.waitUntilConnected(timeout: Self.startLimit) ?? true
        else {
            throw HarnessError("no connection to the test broker at \(try onCluster ? TestCluster.urls() : TestBroker.url())")
        }
        if withOps {
            guard try await eventually(timeout: Self.startLimit, { ports.withLockedValue { $0[.ops] } != nil }) else {
                throw HarnessError("the operators' endpoint did not start")
            }
        }
        if roles.contains(.intake) {
            // The fake sends its notifications to this intake.
            let url = "http://127.0.0.1:\(ports.withLockedValue { $0[.intake] ?? 0 })/v1/notifications/appstore"
            _ = try await HTTP.post(fakeURL + "/fake/config", json: ["notificationURL": url])
        }
        if shared == nil {
            // Apple's ONE_TIME_CHARGE for each one-time purchase, as Apple sends it (off only where
            // a test counts what uploads alone produce).
            _ = try await HTTP.post(fakeURL + "/fake/config", json: ["oneTimeCharge": oneTimeCharge])
        }
        let store: OrderStore
        if let running = pipeline.store { store = running } else { store = try await OrderStore(location: location) }
        return PipelineHarness(
            names: names, databasePath: databasePath, backend: location.backend,
            intakeURL: "http://127.0.0.1:\(ports.withLockedValue { $0[.intake] ?? 0 })", fakeURL: fakeURL,
            store: store, opsURL: ports.withLockedValue { $0[.ops] }.map { "http://127.0.0.1:\($0)" },
            adminURL: ports.withLockedValue { $0[.admin] }.map { "http://127.0.0.1:\($0)" }, groups: [fakeGroup, group], tasks: [fakeTask, task], pipelines: [pipeline])
    }

    private init(
        names: PipelineNames, databasePath: String, backend: Backend, intakeURL: String, fakeURL: String, store: OrderStore,
        opsURL: String?, adminURL: String?, groups: [ServiceGroup], tasks: [Task<Void, any Error>], pipelines: [Pipeline]
    ) {
        self.opsURL = opsURL
        self.adminURL = adminURL
        self.names = names
        self.databasePath = databasePath
        self.backend = backend
        self.intakeURL = intakeURL
        self.fakeURL = fakeURL
        self.store = store
        self.groups = groups
        self.tasks = tasks
        self.pipelines = pipelines
    }

    /// Shuts everything down gracefully, newest first.
    func stop() async {
        for (group, task) in zip(groups, tasks).reversed() {
            await group.triggerGracefulShutdown()
            _ = try? await task.value
        }
        for pipeline in pipelines { try? await pipeline.shutdownClients() }
    }

    // MARK: - Driving it

    struct Purchase: Decodable {
        var transactionId: String
        var originalTransactionId: String
        var receiptData: String
        var signedTransaction: String?
        var orderId: String?
    }

    /// Mints a purchase at the fake App Store.
    func mint(
        productId: String = "com.example.coins.60", environment: String = "Production", bundleId: String = bundleId,
        deviceId: String? = nil
    ) async throws -> Purchase {
        var body: [String: String] = ["bundleId": bundleId, "productId": productId, "environment": environment]
        body["deviceId"] = deviceId
        let response = try await HTTP.post(fakeURL + "/fake/purchases", json: body)
        #expect(response.status == 201)
        return try JSONDecoder().decode(Purchase.self, from: response.body)
    }

    /// Refunds a purchase at the fake App Store.
    func cancel(_ transactionId: String) async throws {
        let response = try await HTTP.post(fakeURL + "/fake/purchases/\(transactionId)/cancel", json: [String: String]())
        #expect(response.status == 200)
    }

    /// Tells the fake App Store to misbehave for the next calls.
    /// A fault for the calls about one transaction only.
    struct ScopedFault: Encodable {
        var status: Int?
        var httpStatus: Int?
        var count: Int?
        var transactionId: String
    }

    func injectFault(_ fault: ScopedFault) async throws {
        let response = try await HTTP.post(fakeURL + "/fake/faults", json: fault)
        #expect(response.status == 204)
    }

    func injectFault(_ fault: [String: Int]) async throws {
        let response = try await HTTP.post(fakeURL + "/fake/faults", json: fault)
        #expect(response.status == 204)
    }

    /// Uploads a receipt; returns the submission id of a 202.
    func upload(userId: String, receiptData: String, transactionId: String? = nil) async throws -> String {
        var body = ["userId": userId, "receiptData": receiptData]
        body["transactionId"] = transactionId
        let response = try await HTTP.post(intakeURL + "/v1/receipts", json: body)
        #expect(response.status == 202)
        let accepted = try JSONSerialization.jsonObject(with: response.body) as? [String: Any]
        // `credited` when it repeats the owner's upload credited within the hour (that one's id).
        #expect(["pending", "credited"].contains(accepted?["state"] as? String))
        guard let id = accepted?["submissionId"] as? String else {
            throw HarnessError("upload answered \(response.status): \(String(decoding: response.body, as: UTF8.self))")
        }
        return id
    }

    /// The status answer of a submission, asked as its uploader: the user of `token` when the
    /// intake checks tokens, else `?userId=` (what the app names with authentication off).
    func status(_ submissionId: String, token: String? = nil) async throws -> [String: Any] {
        var query = ""
        if token == nil, let id = UUID(uuidString: submissionId), let stored = try await store.status(of: id) {
            // A notification belongs to no app user: no route shows it; read where the finisher left it.
            if stored.userId.isEmpty {
                return ["submissionId": submissionId, "state": stored.state.rawValue, "reason": stored.reason?.rawValue as Any,
                    "message": stored.reasonMessage as Any]
            }
            query = "?userId=" + (stored.userId.addingPercentEncoding(withAllowedCharacters: .alphanumerics) ?? stored.userId)
        }
        let response = try await HTTP.send(
            intakeURL + "/v1/receipts/\(submissionId)" + query, method: .GET, body: nil,
            headers: token.map { ["Authorization": "Bearer \($0)"] } ?? [:])
        #expect(response.status == 200)
        return try JSONSerialization.jsonObject(with: response.body) as? [String: Any] ?? [:]
    }

    /// Polls the status until its state is one of `states`, at most `timeout`.
    func waitForState(
        _ submissionId: String, _ states: Set<String> = ["credited", "rejected", "needs_review"],
        timeout: Duration = .seconds(30), token: String? = nil
    ) async throws -> [String: Any] {
        var last: [String: Any] = [:]
        _ = try await eventually(timeout: timeout, interval: .milliseconds(50)) {
            last = try await status(submissionId, token: token)
            return states.contains(last["state"] as? String ?? "")
        }
        return last
    }
}

/// The App Store Server API key of the tests: the fake checks tokens against it, the
/// verifier signs with it.
enum ServerAPIKey {
    static let privateKey = P256.Signing.PrivateKey()
    static let keyId = "TESTKEY123"
    static let issuerId = "57246542-96fe-1a63-e053-0824d011072a"

    static func settings(fakeURL: String) -> AppStoreServerAPIClient.Settings {
        AppStoreServerAPIClient.Settings(
            keyId: keyId, issuerId: issuerId, privateKeyPEM: privateKey.pemRepresentation, bundleId: PipelineHarness.bundleId,
            productionURL: fakeURL, sandboxURL: fakeURL + "/sandbox", timeout: .seconds(5))
    }
}

struct HarnessError: Error, CustomStringConvertible {
    var description: String
    init(_ description: String) { self.description = description }
}

/// Plain HTTP calls over real sockets.
enum HTTP {
    struct Answer {
        var status: Int
        var body: Data
        var headers: HTTPHeaders = [:]
        var text: String { String(decoding: body, as: UTF8.self) }
        var json: [String: Any] { (try? JSONSerialization.jsonObject(with: body)) as? [String: Any] ?? [:] }
        var errorCode: String? { (json["error"] as? [String: Any])?["code"] as? String }
    }

    static func post(_ url: String, json: some Encodable) async throws -> Answer {
        try await send(url, method: .POST, body: try JSONEncoder().encode(json))
    }

    static func post(_ url: String, raw: Data, contentType: String = "application/json") async throws -> Answer {
        try await send(url, method: .POST, body: raw, contentType: contentType)
    }

    static func get(_ url: String) async throws -> Answer {
        try await send(url, method: .GET, body: nil)
    }

    static func send(
        _ url: String, method: HTTPMethod, body: Data?, contentType: String = "application/json",
        headers: [String: String] = [:]
    ) async throws -> Answer {
        var request = HTTPClientRequest(url: url)
        request.method = method
        for (name, value) in headers where name != "Content-Type" { request.headers.add(name: name, value: value) }
        if let body {
            request.headers.add(name: "Content-Type", value: contentType)
            request.body = .bytes(ByteBuffer(data: body))
        }
        let response = try await HTTPClient.shared.execute(request, timeout: .seconds(30))
        let bytes = try await response.body.collect(upTo: 64 * 1024 * 1024)
        return Answer(status: Int(response.status.code), body: Data(buffer: bytes), headers: response.headers)
    }
}

extension PipelineHarness {
    /// An upload accepted with its message parked in the verify dead letters (as after an
    /// operator's purge or a bug), and a connection to this pipeline's queues.
    func parkedUpload(by user: String) async throws -> (VerifyRequest, AMQPConnection) {
        let purchase = try await mint()
        let request = VerifyRequest(submissionId: UUID(), userId: user, receiptData: purchase.receiptData, acceptedAt: Date())
        try await store.accept(request, message: OutboxMessage(routingKey: names.verifyDead, body: try MessageCodec().encode(request)))
        let connection = AMQPConnection(
            configuration: try TestBroker.configuration(),
            topology: .pipeline(names, retrySchedule: RetrySchedule(delaysSeconds: [1])), logger: TestBroker.logger)
        #expect(await connection.waitUntilConnected(timeout: .seconds(15)))
        return (request, connection)
    }
}

extension PipelineHarness {
    /// The store's size on disk: the SQLite file and its WAL, or PostgreSQL's tables as the
    /// server counts them.
    func storeBytes() async throws -> Int {
        if store.dialect == .postgres {
            return try await store.testValue(
                """
                SELECT sum(pg_total_relation_size(c.oid))::BIGINT FROM pg_class c
                JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r'
                """) ?? -1
        }
        return ["", "-wal"].reduce(0) { total, suffix in
            let attributes = try? FileManager.default.attributesOfItem(atPath: databasePath + suffix)
            return total + ((attributes?[.size] as? Int) ?? 0)
        }
    }

    /// `storeBytes` once SQLite's WAL is checkpointed into the file and emptied: what the
    /// store keeps, apart from the WAL, which SQLite bounds itself and reuses.
    func keptBytes() async throws -> Int {
        if store.dialect == .sqlite {
            let queue = try DatabaseQueue(path: databasePath)
            try await queue.writeWithoutTransaction { db in try db.execute(sql: "PRAGMA wal_checkpoint(TRUNCATE)") }
            try queue.close()
        }
        return try await storeBytes()
    }
}
