import Foundation
import IAPCore
import NIOConcurrencyHelpers
import OrderStore
import Testing
import TestSupport

/// A fault drill: the real `iap` executable run as child processes (fake App Store, order
/// service, verifier) against the test broker, on free loopback ports, with queues and
/// files of their own, driven by a load of real uploads.
final class ProcessDrill: Sendable {
    let prefix: String
    let folder: URL
    let intakePort: Int
    let fakePort: Int
    private let binary: String
    private let children = NIOLockedValueBox([String: Process]())
    /// The operators' port of each role (`/metrics`, `/readyz`), fixed across restarts.
    let opsPorts: [String: Int]
    private let catalogPath: String
    private let extraEnvironment: [String: String]

    var intakeURL: String { "http://127.0.0.1:\(intakePort)" }
    /// The operators' endpoint of `role` (`/healthz` answers once the process runs its
    /// services, its signal handlers installed).
    func opsURL(_ role: String) -> String { "http://127.0.0.1:\(opsPorts[role] ?? 0)" }
    var fakeURL: String { "http://127.0.0.1:\(fakePort)" }
    var databasePath: String { folder.appendingPathComponent("orders.sqlite").path }

    struct MissingBinary: Error, CustomStringConvertible {
        var description: String {
            "IAP_TEST_IAP_BINARY is not set: run the suite with `scripts/dev test`, which builds `iap` for the drills"
        }
    }

    init(name: String, on backend: Backend = .sqlite, environment: [String: String] = [:]) async throws {
        guard let binary = ProcessInfo.processInfo.environment["IAP_TEST_IAP_BINARY"], !binary.isEmpty,
            FileManager.default.isExecutableFile(atPath: binary)
        else { throw MissingBinary() }
        self.binary = binary
        prefix = TestBroker.uniquePrefix(name)
        folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-drill-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        let catalog = folder.appendingPathComponent("catalog.json")
        try JSONEncoder().encode(PipelineHarness.testCatalog).write(to: catalog)
        catalogPath = catalog.path
        intakePort = try Self.freePort()
        fakePort = try Self.freePort()
        var opsPorts: [String: Int] = [:]
        for role in ["orders", "intake", "finisher", "verifier"] { opsPorts[role] = try Self.freePort() }
        self.opsPorts = opsPorts
        extraEnvironment = environment
        storeLocation = try await TestStore.location(in: folder, on: backend)
        // Whatever happens to the test (a start that fails included), its processes stop.
        Teardown.add { [self] in _ = try? await offThePool { self.stopAll() } }
    }

    /// The store the test asked for (a PostgreSQL database of this drill's own, or the file).
    let storeLocation: StoreLocation

    private var environment: [String: String] {
        var environment = ProcessInfo.processInfo.environment
        environment.merge(
            [
                "IAP_AMQP_URL": (try? TestBroker.url()) ?? "",
                "IAP_QUEUE_PREFIX": prefix,
                "IAP_DATABASE_PATH": databasePath,
                "IAP_HTTP_HOST": "127.0.0.1",
                "IAP_HTTP_PORT": String(intakePort),
                "IAP_FAKE_APPSTORE_HOST": "127.0.0.1",
                "IAP_FAKE_APPSTORE_PORT": String(fakePort),
                "IAP_FAKE_DATABASE_PATH": folder.appendingPathComponent("fake.sqlite").path,
                "IAP_BUNDLE_IDS": PipelineHarness.bundleId,
                "IAP_APPSTORE_VERIFY_URL": "http://127.0.0.1:\(fakePort)/verifyReceipt",
                "IAP_APPSTORE_SANDBOX_VERIFY_URL": "http://127.0.0.1:\(fakePort)/sandbox/verifyReceipt",
                // Apple is not what most drills break: on two loaded cores the fake's answers
                // took over a second (the breaker opened four times in a partition drill and
                // left 410 purchases waiting on their retries). The Apple drill sets 1 s itself.
                "IAP_APPSTORE_TIMEOUT_SECONDS": "5",
                "IAP_RETRY_DELAYS": "1,2",
                "IAP_AMQP_HEARTBEAT_SECONDS": "5",
                "IAP_LOG_LEVEL": "warning",
                "IAP_CATALOG": catalogPath,
                // The drills upload in bursts from one address and name users in bodies.
                "IAP_AUTH": "off",
                "IAP_RATE_LIMIT_PER_IP": "0",
                "IAP_RATE_LIMIT_PER_USER": "0",
                // The drills call the admin routes on the intake's port.
                "IAP_ADMIN_PUBLIC": "1",
            ]
        ) { $1 }
        // The store the test asked for (a PostgreSQL database of this drill's own, or the file).
        environment.merge(TestStore.environment(for: storeLocation)) { $1 }
        environment.merge(extraEnvironment) { $1 }
        return environment
    }

    /// Starts `iap <role>` as `name` (a second order service, say), with `extra` settings; its
    /// output goes to a log file in the drill's folder.
    func start(_ role: String, as name: String? = nil, environment extra: [String: String] = [:]) throws {
        let name = name ?? role
        let process = Process()
        process.executableURL = URL(fileURLWithPath: binary)
        process.arguments = [role]
        var environment = self.environment
        environment["IAP_OPS_HOST"] = "127.0.0.1"
        environment["IAP_OPS_PORT"] = opsPorts[name].map(String.init) ?? "off"
        environment.merge(extra) { $1 }
        process.environment = environment
        let logPath = folder.appendingPathComponent("\(name).log").path
        if !FileManager.default.fileExists(atPath: logPath) {
            _ = FileManager.default.createFile(atPath: logPath, contents: nil)
        }
        let log = try FileHandle(forWritingTo: URL(fileURLWithPath: logPath))
        log.seekToEndOfFile()
        process.standardOutput = log
        process.standardError = log
        process.standardInput = FileHandle.nullDevice
        try process.run()
        children.withLockedValue { $0[name] = process }
    }

    /// Kills a role at once, as a crash would.
    func kill9(_ role: String) {
        guard let process = children.withLockedValue({ $0.removeValue(forKey: role) }) else { return }
        kill(process.processIdentifier, SIGKILL)
        process.waitUntilExit()
    }

    /// Asks a role to shut down gracefully (SIGTERM) and waits for it; returns its exit status.
    @discardableResult
    func terminate(_ role: String) async -> Int32? {
        guard let process = children.withLockedValue({ $0.removeValue(forKey: role) }) else { return nil }
        process.terminate()
        await process.exited()
        return process.terminationStatus
    }

    /// Stops every child; kills what does not stop within a few seconds.
    func stopAll() {
        let all = children.withLockedValue { children -> [Process] in
            defer { children.removeAll() }
            return Array(children.values)
        }
        for process in all where process.isRunning { process.terminate() }
        let deadline = Date().addingTimeInterval(10)
        for process in all {
            while process.isRunning && Date() < deadline { usleep(50_000) }
            if process.isRunning { kill(process.processIdentifier, SIGKILL) }
        }
    }

    /// The tail of a role's log, for failure messages (`.max` lines: all of it).
    func logTail(_ role: String, lines: Int = 20) -> String {
        let text = (try? String(contentsOf: folder.appendingPathComponent("\(role).log"), encoding: .utf8)) ?? ""
        return text.split(separator: "\n").suffix(lines).joined(separator: "\n")
    }

    /// Waits until `url` answers `/healthz`: within the bound a harness has to start (a process
    /// started while fifty suites start at once on two cores took more than 30 s).
    func waitHealthy(_ url: String, timeout: Duration = PipelineHarness.startLimit) async throws {
        let ok = try await eventually(timeout: timeout, interval: .milliseconds(100)) {
            (try? await HTTP.get(url + "/healthz").status) == 200
        }
        guard ok else {
            // Every process's last lines: which one failed to start, and why, is in one of them.
            let roles = children.withLockedValue { $0.keys.sorted() }
            let tails = roles.map { "--- \($0).log\n\(logTail($0))" }.joined(separator: "\n")
            throw HarnessError("\(url) did not become healthy within \(timeout)\n\(tails)")
        }
    }

    // MARK: - Load

    /// Mints `count` purchases at the fake App Store, before any timing starts.
    func mint(_ count: Int) async throws -> [PipelineHarness.Purchase] {
        try await withThrowingTaskGroup(of: [PipelineHarness.Purchase].self) { group in
            let workers = 8
            for worker in 0..<workers {
                group.addTask {
                    var minted: [PipelineHarness.Purchase] = []
                    for _ in stride(from: worker, to: count, by: workers) { minted.append(try await self.mintOne()) }
                    return minted
                }
            }
            return try await group.reduce(into: []) { $0 += $1 }
        }
    }

    /// One purchase made at the fake App Store (a consumable of the test catalog).
    func mintOne() async throws -> PipelineHarness.Purchase {
        let answer = try await HTTP.post(
            fakeURL + "/fake/purchases", json: ["bundleId": PipelineHarness.bundleId, "productId": "com.example.coins.60"])
        return try JSONDecoder().decode(PipelineHarness.Purchase.self, from: answer.body)
    }

    /// Uploads every purchase like a phone would: retrying until the intake answers 202.
    /// Returns the submission ids by transaction id.
    /// With several `intakes` (order services behind a balancer), each phone starts at one and
    /// goes to the next when an upload fails.
    func upload(
        _ purchases: [PipelineHarness.Purchase], concurrency: Int = 16, deadline: Duration = .seconds(120),
        intakes: [String]? = nil
    ) async throws -> [String: String] {
        let intakes = intakes ?? [intakeURL]
        let end = ContinuousClock.now + deadline
        return try await withThrowingTaskGroup(of: [String: String].self) { group in
            for worker in 0..<concurrency {
                group.addTask {
                    var accepted: [String: String] = [:]
                    for index in stride(from: worker, to: purchases.count, by: concurrency) {
                        let purchase = purchases[index]
                        var target = index
                        while true {
                            defer { target += 1 }
                            if let answer = try? await HTTP.post(
                                intakes[target % intakes.count] + "/v1/receipts",
                                json: ["userId": "user-\(index)", "receiptData": purchase.receiptData]),
                                answer.status == 202, let id = answer.json["submissionId"] as? String
                            {
                                accepted[purchase.transactionId] = id
                                break
                            }
                            guard ContinuousClock.now < end else { throw HarnessError("uploads did not get through") }
                            try await Task.sleep(for: .milliseconds(100))
                        }
                    }
                    return accepted
                }
            }
            return try await group.reduce(into: [:]) { $0.merge($1) { first, _ in first } }
        }
    }

    /// Prints the drill's line and checks the promises: every purchase accepted, every
    /// submission credited (a phone that lost the 202 of a committed upload sends it again: one
    /// more submission, `already_credited`, also `credited`), nothing rejected, one grant each.
    /// `logs`: the roles whose log tails explain a miss.
    func check(_ outcome: Outcome, purchases: Int, name: String, recovery: Duration, logs: [String] = ["orders"]) {
        print("drill[\(name)]: purchases \(purchases), \(outcome), settled \(recovery) after the fault ended")
        #expect(outcome.accepted == purchases, "\(logs.map { logTail($0) }.joined(separator: "\n"))")
        #expect(outcome.states["credited"] ?? 0 >= purchases, "\(outcome)")
        #expect(outcome.states.values.reduce(0, +) == outcome.states["credited"], "\(outcome)")
        #expect(outcome.states["rejected"] == nil, "a transient failure became a rejection: \(outcome)")
        #expect(outcome.grants == purchases)
        #expect(outcome.transactionsWithTwoGrants == 0)
    }

    /// What the drill ended with, read from the order store itself.
    struct Outcome: CustomStringConvertible {
        var accepted: Int
        var states: [String: Int]
        var grants: Int
        var transactionsWithTwoGrants: Int
        var description: String {
            "accepted \(accepted), states \(states), grants \(grants), double-granted \(transactionsWithTwoGrants)"
        }
    }

    /// Waits until every accepted submission is terminal (or the timeout passes) and reports.
    /// `store`: where the drill's services keep it, when not the test store of its folder.
    func settle(_ submissions: [String: String], timeout: Duration = .seconds(120), store location: StoreLocation? = nil)
        async throws -> Outcome
    {
        let store = try await OrderStore(location: location ?? storeLocation)
        let ids = Set(submissions.values.compactMap(UUID.init(uuidString:)))
        _ = try await eventually(timeout: timeout, interval: .milliseconds(250)) {
            // Every accepted submission, the ones a phone sent again after a lost 202 included.
            let counts = try await store.submissionCounts()
            return counts.filter { $0.key.isTerminal }.values.reduce(0, +) >= ids.count
                && counts.filter { !$0.key.isTerminal }.values.reduce(0, +) == 0
        }
        var states: [String: Int] = [:]
        for (state, count) in try await store.submissionCounts() { states[state.rawValue] = count }
        var grants = 0
        var doubled = 0
        for transactionId in submissions.keys {
            let count = try await store.grants(ofTransaction: transactionId).count
            grants += count
            if count > 1 { doubled += 1 }
        }
        await store.close()
        return Outcome(accepted: ids.count, states: states, grants: grants, transactionsWithTwoGrants: doubled)
    }

    static func freePort() throws -> Int {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        guard fd >= 0 else { throw HarnessError("socket() failed") }
        defer { close(fd) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = 0
        let bound = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard bound == 0 else { throw HarnessError("bind() failed") }
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        _ = withUnsafeMutablePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
        }
        return Int(UInt16(bigEndian: address.sin_port))
    }
}

/// A drill's traffic: phones that each buy at the fake App Store and upload what they bought,
/// retrying until the intake answers 202, one purchase after another, until the drill says its
/// fault has landed (`faultLanded()`) and `after` more uploads were started. The fault always
/// lands mid-stream, however fast or slow the machine; bounded by `limit` purchases and by
/// `deadline` (traffic that reaches its limit before the fault landed fails the drill).
final class DrillTraffic: Sendable {
    private struct State {
        var purchases: [(purchase: PipelineHarness.Purchase, userId: String)] = []
        var accepted: [String: String] = [:]
        var started = 0
        var startedAtFault: Int?
        var ended = false
    }

    let after: Int
    let limit: Int
    private let state: NIOLockedValueBox<State>
    private let task: Task<Void, any Error>

    init(
        _ drill: ProcessDrill, intakes: [String]? = nil, concurrency: Int = 16, after: Int = 300, limit: Int = 3_000,
        deadline: Duration = .seconds(200)
    ) {
        let state = NIOLockedValueBox(State())
        let intakes = intakes ?? [drill.intakeURL]
        let end = ContinuousClock.now + deadline
        self.state = state
        self.after = after
        self.limit = limit
        task = Task {
            defer { state.withLockedValue { $0.ended = true } }
            try await withThrowingTaskGroup(of: Void.self) { group in
                for _ in 0..<concurrency {
                    group.addTask {
                        while true {
                            let index = state.withLockedValue { state -> Int? in
                                let bound = state.startedAtFault.map { min($0 + after, limit) } ?? limit
                                guard state.started < bound else { return nil }
                                state.started += 1
                                return state.started - 1
                            }
                            guard let index else { return }
                            let purchase = try await drill.mintOne()
                            let userId = "user-\(index)"
                            state.withLockedValue { $0.purchases.append((purchase, userId)) }
                            var target = index
                            while true {
                                defer { target += 1 }
                                let intake = intakes[target % intakes.count]
                                let failure: String
                                do {
                                    let answer = try await HTTP.post(
                                        intake + "/v1/receipts", json: ["userId": userId, "receiptData": purchase.receiptData])
                                    if answer.status == 202, let id = answer.json["submissionId"] as? String {
                                        state.withLockedValue { $0.accepted[purchase.transactionId] = id }
                                        break
                                    }
                                    failure = "\(answer.status) \(answer.text.prefix(300))"
                                } catch {
                                    failure = "\(error)"
                                }
                                guard ContinuousClock.now < end else {
                                    throw HarnessError("uploads did not get through; the last answer, from \(intake): \(failure)")
                                }
                                try await Task.sleep(for: .milliseconds(100))
                            }
                        }
                    }
                }
                try await group.waitForAll()
            }
        }
    }

    /// Uploads accepted so far.
    var accepted: Int { state.withLockedValue { $0.accepted.count } }

    /// The purchases bought so far, each with the user whose phone uploads it.
    var purchases: [(purchase: PipelineHarness.Purchase, userId: String)] { state.withLockedValue { $0.purchases } }

    /// Waits until `more` uploads beyond those accepted now are accepted (the stream is flowing).
    func waitForMore(_ more: Int, timeout: Duration = .seconds(60)) async throws {
        let target = accepted + more
        guard try await eventually(timeout: timeout, interval: .milliseconds(20), { self.accepted >= target }) else {
            throw HarnessError("the drill's traffic did not reach \(target) accepted uploads (\(accepted))")
        }
    }

    /// The drill's fault has landed: `after` more uploads, then the traffic ends.
    func faultLanded() {
        let ended = state.withLockedValue { state -> Bool in
            if state.startedAtFault == nil { state.startedAtFault = state.started }
            return state.ended || state.started >= limit
        }
        if ended {
            Issue.record("the drill's traffic had ended (its bound of \(limit) purchases) before the fault landed")
        }
    }

    /// Every upload accepted, by transaction id, once the traffic has ended.
    func finish() async throws -> [String: String] {
        try await task.value
        return state.withLockedValue { $0.accepted }
    }
}
