import ArgumentParser
import AsyncHTTPClient
import Foundation
import Histogram
import IAPCore
import NIOConcurrencyHelpers
import NIOCore
import NIOFoundationCompat
import NIOHTTP1
import OrderStore

/// `iap bench`: a load generator. Mints purchases at the fake App Store ahead of time, uploads
/// them to a running intake (queue mode) or to one that verifies inside the request (inline
/// mode), follows every submission to its final state, and checks each purchase was
/// credited exactly once.
struct BenchCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "bench",
        abstract: "Load-test the pipeline: uploads/s, intake latency, end-to-end time, verifications/s, nothing lost or doubled.",
        discussion: """
            With --start-dev it runs its own `iap dev` (and --verifiers - 1 more `iap verifier` processes) on free \
            127.0.0.1 ports against the broker of \(Setting.amqpURL.variable), with queues and files of its own; else it drives \
            --intake-url and --fake-url and follows submissions in --database-path. Build in release mode for figures.
            """)

    enum Mode: String, ExpressibleByArgument, CaseIterable {
        case queue, inline
    }

    @Option(help: "Purchases to mint and upload.")
    var purchases: Int = 10_000

    @Option(help: "Concurrent upload connections (closed loop). Default 64 unless --rate is given.")
    var concurrency: Int?

    @Option(help: "Uploads per second (open loop; latency counted from when each upload was due).")
    var rate: Double?

    @Option(help: "queue: the pipeline; inline: the intake asks Apple inside the request (the synchronous baseline).")
    var mode: Mode = .queue

    @Option(help: "Latency of the fake App Store's answers, in milliseconds.")
    var appleLatencyMs: Int = 0

    @Option(help: "Share of the fake App Store's answers that are HTTP 503, 0 to 1.")
    var appleErrorRate: Double = 0

    @Flag(help: "Start an `iap dev` of its own (broker from \(Setting.amqpURL.variable)).")
    var startDev = false

    @Option(help: "With --start-dev: verifier processes.")
    var verifiers: Int = 1

    @Flag(help: "With --start-dev: start the verifiers only once every upload is accepted, to measure the intake alone and then the verifiers draining the queue.")
    var verifyAfterUpload = false

    @Option(help: "With --start-dev: verifications in flight per verifier process.")
    var verifierConcurrency: Int = 512

    @Option(help: "The intake, without --start-dev.")
    var intakeURL: String = "http://127.0.0.1:8080"

    @Option(help: "The fake App Store, without --start-dev.")
    var fakeURL: String = "http://127.0.0.1:8090"

    @Option(help: "The order store to follow submissions in, without --start-dev.")
    var databasePath: String = "iap-dev.sqlite"

    @Option(help: "A PostgreSQL order store (postgres://USER:PASSWORD@HOST:PORT/DB) instead of SQLite: with --start-dev the order services use it and it must hold no submissions yet; without, submissions are followed there.")
    var databaseURL: String?

    @Option(help: "With --start-dev: the brokers, comma-separated amqp:// URLs (the services go to the next when one is lost); default \(Setting.amqpURL.variable).")
    var amqpURL: String?

    @Option(help: "With --start-dev: order services (`iap orders`), each with its own intake; uploads go round-robin. More than one needs --database-url.")
    var orders: Int = 1

    @Option(help: "With --start-dev: cap each order service at this many cores (a Linux control group of its own, as root), as if each ran on a machine of that size.")
    var ordersCPU: Double?

    @Option(help: "Seconds to wait for every submission to settle.")
    var settleTimeout: Int = 600

    @Flag(help: "Print one JSON object instead of text.")
    var json = false

    func validate() throws {
        guard (1...2_000_000).contains(purchases) else { throw ValidationError("--purchases must be 1 to 2000000") }
        guard concurrency == nil || rate == nil else { throw ValidationError("give --concurrency or --rate, not both") }
        guard (concurrency ?? 1) >= 1, (rate ?? 1) > 0 else { throw ValidationError("--concurrency and --rate must be positive") }
        guard (0...1).contains(appleErrorRate) else { throw ValidationError("--apple-error-rate must be 0 to 1") }
        guard (1...16).contains(verifiers) else { throw ValidationError("--verifiers must be 1 to 16") }
        guard (1...8).contains(orders) else { throw ValidationError("--orders must be 1 to 8") }
        guard orders == 1 || (databaseURL != nil && startDev && mode == .queue) else {
            throw ValidationError("several --orders share one store: they need --database-url, --start-dev and --mode queue")
        }
        if let ordersCPU {
            guard startDev && mode == .queue else { throw ValidationError("--orders-cpu needs --start-dev and --mode queue") }
            guard (0.01...64).contains(ordersCPU) else { throw ValidationError("--orders-cpu must be 0.01 to 64 cores") }
        }
        guard !verifyAfterUpload || (startDev && mode == .queue) else {
            throw ValidationError("--verify-after-upload needs --start-dev and --mode queue")
        }
    }

    func run() async throws {
        var cluster: BenchCluster?
        if startDev {
            cluster = try await BenchCluster.start(
                inline: mode == .inline, verifiers: verifiers, verifierConcurrency: verifierConcurrency,
                verifiersLater: verifyAfterUpload, orders: orders, ordersCPU: ordersCPU, databaseURL: databaseURL, amqpURL: amqpURL)
        }
        // The cluster's files (stores, logs) are kept only when the run failed, to be read.
        var succeeded = false
        defer { cluster?.stop(removingFiles: succeeded) }
        let connections = concurrency ?? (rate == nil ? 64 : 1024)
        var configuration = HTTPClient.Configuration()
        configuration.timeout = .init(connect: .seconds(5), read: .seconds(120))
        configuration.connectionPool = .init(idleTimeout: .seconds(60), concurrentHTTP1ConnectionsPerHostSoftLimit: connections)
        let client = HTTPClient(eventLoopGroupProvider: .singleton, configuration: configuration)
        let http = BenchHTTP(client: client)
        do {
            try await measure(http: http, cluster: cluster, connections: connections)
            try await client.shutdown()
            succeeded = true
        } catch {
            try? await client.shutdown()
            throw error
        }
    }

    private func measure(http: BenchHTTP, cluster: BenchCluster?, connections: Int) async throws {
        let intakes = cluster?.intakeURLs ?? [intakeURL]
        let intake = intakes.joined(separator: ", ")
        let fake = cluster?.fakeURL ?? fakeURL

        guard try await http.post(fake + "/fake/config", ["latencyMs": appleLatencyMs, "errorRate": appleErrorRate] as [String: Any]).status == 204
        else { throw ValidationError("the fake App Store at \(fake) refused its configuration") }
        say("minting \(purchases) purchases at \(fake)")
        let minted = try await mint(purchases, at: fake, http: http)
        let statsBefore = try await http.getJSON(fake + "/fake/stats")

        let cpuAtStart = cluster?.cpuSeconds() ?? [:]
        say("uploading to \(intake) (\(mode.rawValue) mode, \(rate.map { "\($0)/s" } ?? "\(connections) connections"))")
        let upload = try await uploadAll(minted, to: intakes, http: http, connections: connections)
        say("accepted \(upload.accepted) of \(purchases) in \(String(format: "%.1f", upload.seconds)) s; waiting for them to settle")
        let cpuAtUploaded = cluster?.cpuSeconds() ?? [:]
        var verifiersStarted: Date?
        if verifyAfterUpload, mode == .queue, let cluster {
            say("starting \(verifiers) verifier process(es)")
            verifiersStarted = Date()
            try await cluster.startVerifiers(verifiers)
        }

        let store = try await OrderStore(
            location: try databaseURL.map { .postgres(try PostgresLocation(url: $0)) }
                ?? .sqlite(path: cluster?.databasePath ?? databasePath))
        let deadline = ContinuousClock.now + .seconds(settleTimeout)
        while ContinuousClock.now < deadline {
            let counts = try await store.submissionCounts()
            let settled = (counts[.credited] ?? 0) + (counts[.rejected] ?? 0) + (counts[.needsReview] ?? 0)
            if settled >= upload.accepted { break }
            try await Task.sleep(for: .milliseconds(200))
        }
        let cpuAtSettled = cluster?.cpuSeconds() ?? [:]
        let times = try await store.settlementTimes()
        let coverage = try await store.grantCoverage(of: minted.map(\.transactionId))
        let statsAfter = try await http.getJSON(fake + "/fake/stats")
        let calls = ["verifyReceiptCalls", "serverAPICalls"].reduce(0) { sum, key in
            sum + (statsAfter[key] as? Int ?? 0) - (statsBefore[key] as? Int ?? 0)
        }

        var endToEnd = Histogram<UInt64>(highestTrackableValue: 3_600_000, numberOfSignificantValueDigits: .three)
        var first = verifiersStarted ?? Date.distantFuture
        var last = Date.distantPast
        for time in times where time.state == .credited {
            _ = endToEnd.record(UInt64(max(0, time.settledAt.timeIntervalSince(time.acceptedAt)) * 1000))
            if verifiersStarted == nil { first = min(first, time.acceptedAt) }
            last = max(last, time.settledAt)
        }
        let span = max(0.001, last.timeIntervalSince(first))
        let report = BenchReport(
            mode: mode.rawValue, purchases: purchases, uploadsPerSecond: Double(upload.accepted) / upload.seconds,
            intakeLatencyMs: .init(
                p50: Double(upload.latency.valueAtPercentile(50)) / 1000, p99: Double(upload.latency.valueAtPercentile(99)) / 1000,
                p999: Double(upload.latency.valueAtPercentile(99.9)) / 1000),
            endToEndMs: .init(p50: Double(endToEnd.valueAtPercentile(50)), p99: Double(endToEnd.valueAtPercentile(99))),
            verificationsPerSecond: Double(calls) / span, credited: coverage.granted, lost: purchases - coverage.granted,
            duplicated: coverage.grants - coverage.granted, refused: purchases - upload.accepted,
            secondsToCreditAll: span, appleCalls: calls, peakRSSMB: cluster?.peakRSSMegabytes() ?? [:],
            cpuSeconds: .init(
                upload: Self.used(from: cpuAtStart, to: cpuAtUploaded), settle: Self.used(from: cpuAtUploaded, to: cpuAtSettled)),
            ordersCPU: ordersCPU, throttledPeriods: cluster?.throttledPeriods() ?? [:])
        if json {
            let encoder = JSONEncoder()
            encoder.outputFormatting = [.sortedKeys]
            print(String(decoding: try encoder.encode(report), as: UTF8.self))
        } else {
            print(report.text)
        }
        if report.lost > 0 || report.duplicated > 0 { throw ExitCode.failure }
    }

    /// CPU seconds used between two readings, by role (a process started in between counts from 0).
    private static func used(from start: [String: Double], to end: [String: Double]) -> [String: Double] {
        end.reduce(into: [:]) { used, entry in used[entry.key] = entry.value - (start[entry.key] ?? 0) }
    }

    private func say(_ text: String) {
        FileHandle.standardError.write(Data("==> \(text)\n".utf8))
    }

    struct Minted: Sendable {
        var transactionId: String
        /// The upload's JSON body, built before the timed phase.
        var body: ByteBuffer
    }

    /// Purchases minted before any timing starts, 16 at a time.
    private func mint(_ count: Int, at fake: String, http: BenchHTTP) async throws -> [Minted] {
        try await withThrowingTaskGroup(of: [Minted].self) { group in
            let workers = 16
            for worker in 0..<workers {
                group.addTask {
                    var minted: [Minted] = []
                    for _ in stride(from: worker, to: count, by: workers) {
                        let answer = try await http.post(
                            fake + "/fake/purchases",
                            ["bundleId": "com.example.demo", "productId": "com.example.coins.60"] as [String: Any])
                        let object = try JSONSerialization.jsonObject(with: answer.body) as? [String: Any]
                        guard answer.status == 201, let id = object?["transactionId"] as? String,
                            let receipt = object?["receiptData"] as? String
                        else { throw ValidationError("the fake App Store could not mint: \(answer.status)") }
                        // As an app uploads: the receipt and the StoreKit transaction it is about to finish.
                        let upload = [
                            "userId": "bench-\(minted.count % 10_000)-\(worker)", "receiptData": receipt, "transactionId": id,
                        ]
                        minted.append(Minted(transactionId: id, body: ByteBuffer(data: try JSONSerialization.data(withJSONObject: upload))))
                    }
                    return minted
                }
            }
            var all: [Minted] = []
            for try await part in group { all.append(contentsOf: part) }
            return all
        }
    }

    struct UploadResult {
        var accepted: Int
        var seconds: Double
        var latency: Histogram<UInt64>
    }

    /// Uploads every purchase: `connections` workers in a closed loop, or at `rate` per second
    /// with latency counted from when each upload was due.
    private func uploadAll(_ minted: [Minted], to intakes: [String], http: BenchHTTP, connections: Int) async throws
        -> UploadResult
    {
        let start = ContinuousClock.now
        let next = NIOLockedValueBox(0)
        let results = try await withThrowingTaskGroup(of: [(UInt64, Bool)].self) { group in
            let workers = rate == nil ? connections : min(connections, minted.count)
            let interval = rate.map { Duration.seconds(1 / $0) }
            for _ in 0..<workers {
                group.addTask {
                    var mine: [(UInt64, Bool)] = []
                    while true {
                        let index = next.withLockedValue { value -> Int in
                            defer { value += 1 }
                            return value
                        }
                        guard index < minted.count else { break }
                        var due = ContinuousClock.now
                        if let interval {
                            due = start + interval * index
                            if due > .now { try await Task.sleep(until: due, clock: .continuous) }
                        }
                        let answer = try? await http.post(intakes[index % intakes.count] + "/v1/receipts", body: minted[index].body)
                        let elapsed = ContinuousClock.now - due
                        let micros = UInt64(elapsed.components.seconds) * 1_000_000 + UInt64(elapsed.components.attoseconds / 1_000_000_000_000)
                        let ok = answer.map { mode == .queue ? $0.status == 202 : $0.status == 200 } ?? false
                        mine.append((micros, ok))
                    }
                    return mine
                }
            }
            var all: [(UInt64, Bool)] = []
            for try await part in group { all.append(contentsOf: part) }
            return all
        }
        let elapsed = ContinuousClock.now - start
        var latency = Histogram<UInt64>(highestTrackableValue: 600_000_000, numberOfSignificantValueDigits: .three)
        for (micros, _) in results { _ = latency.record(max(1, micros)) }
        return UploadResult(
            accepted: results.filter(\.1).count,
            seconds: Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18, latency: latency)
    }
}

/// What `iap bench --json` prints.
struct BenchReport: Encodable {
    struct Latency: Encodable {
        var p50: Double
        var p99: Double
        var p999: Double?
    }

    var mode: String
    var purchases: Int
    var uploadsPerSecond: Double
    var intakeLatencyMs: Latency
    var endToEndMs: Latency
    var verificationsPerSecond: Double
    var credited: Int
    var lost: Int
    var duplicated: Int
    var refused: Int
    var secondsToCreditAll: Double
    var appleCalls: Int
    /// Peak resident memory of each process `--start-dev` ran, by role.
    var peakRSSMB: [String: Double]
    /// CPU seconds each process used while uploading and while the rest settled, by role.
    var cpuSeconds: CPU
    /// `--orders-cpu`: the cores each order service was capped at.
    var ordersCPU: Double?
    /// With `--orders-cpu`: the 100 ms periods each order service was held at its cap, by role.
    var throttledPeriods: [String: Int]

    struct CPU: Encodable {
        var upload: [String: Double]
        var settle: [String: Double]
    }

    var text: String {
        func f(_ value: Double) -> String { String(format: "%.1f", value) }
        return """
            mode                      \(mode)
            purchases                 \(purchases) (refused at upload: \(refused))
            uploads accepted/s        \(f(uploadsPerSecond))
            intake latency ms         p50 \(f(intakeLatencyMs.p50))  p99 \(f(intakeLatencyMs.p99))  p999 \(f(intakeLatencyMs.p999 ?? 0))
            end to end ms             p50 \(f(endToEndMs.p50))  p99 \(f(endToEndMs.p99))
            verifications/s           \(f(verificationsPerSecond)) (\(appleCalls) calls to Apple)
            all credited after        \(f(secondsToCreditAll)) s
            credited once             \(credited)   lost \(lost)   duplicated \(duplicated)
            CPU s while uploading     \(Self.byRole(cpuSeconds.upload, f))
            CPU s while settling      \(Self.byRole(cpuSeconds.settle, f))
            peak RSS MB               \(Self.byRole(peakRSSMB, f))
            """ + (ordersCPU.map { cores in
                "\norder services capped at  \(String(format: "%.2f", cores)) cores each; periods held at the cap: "
                    + Self.byRole(throttledPeriods.mapValues(Double.init)) { String(Int($0)) }
            } ?? "")
    }
}

extension BenchReport {
    static func byRole(_ values: [String: Double], _ format: (Double) -> String) -> String {
        values.isEmpty ? "n/a" : values.sorted { $0.key < $1.key }.map { "\($0.key) \(format($0.value))" }.joined(separator: "  ")
    }
}

/// JSON over HTTP for the load generator.
struct BenchHTTP: Sendable {
    let client: HTTPClient

    struct Answer {
        var status: Int
        var body: Data
    }

    func post(_ url: String, _ object: Any) async throws -> Answer {
        try await post(url, body: ByteBuffer(data: try JSONSerialization.data(withJSONObject: object)))
    }

    func post(_ url: String, body: ByteBuffer) async throws -> Answer {
        var request = HTTPClientRequest(url: url)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/json")
        request.body = .bytes(body)
        let response = try await client.execute(request, timeout: .seconds(120))
        return Answer(status: Int(response.status.code), body: Data(buffer: try await response.body.collect(upTo: 1 << 22)))
    }

    func getJSON(_ url: String) async throws -> [String: Any] {
        let response = try await client.execute(HTTPClientRequest(url: url), timeout: .seconds(30))
        let body = try await response.body.collect(upTo: 1 << 22)
        return (try JSONSerialization.jsonObject(with: Data(buffer: body)) as? [String: Any]) ?? [:]
    }
}

/// The processes `iap bench --start-dev` runs. Queue mode has the production shape: the fake
/// App Store, one `iap orders` (intake, relay, finisher: the store's one writer) and
/// `--verifiers` `iap verifier` processes. Inline mode is one `iap dev` whose intake asks
/// Apple inside the request.
final class BenchCluster: @unchecked Sendable {
    let intakeURLs: [String]
    let fakeURL: String
    let databasePath: String
    private let folder: URL
    private let environment: [String: String]
    /// Settings learnt once the fake App Store runs (its root), given to the roles started after it.
    private var learnt: [String: String] = [:]
    private let lock = NSLock()
    private var processes: [(role: String, process: Process)]
    /// `--orders-cpu`: each order service's control group, by role.
    private var caps: [(role: String, cap: BenchCPUCap)] = []
    private let ordersCPU: Double?

    private init(
        intakeURLs: [String], fakeURL: String, databasePath: String, folder: URL, environment: [String: String], ordersCPU: Double?
    ) {
        self.ordersCPU = ordersCPU
        self.intakeURLs = intakeURLs
        self.fakeURL = fakeURL
        self.databasePath = databasePath
        self.folder = folder
        self.environment = environment
        self.processes = []
    }

    /// Starts the cluster; verifiers too unless `verifiersLater` (then `startVerifiers`).
    static func start(
        inline: Bool, verifiers: Int, verifierConcurrency: Int, verifiersLater: Bool, orders: Int = 1, ordersCPU: Double? = nil,
        databaseURL: String? = nil, amqpURL: String? = nil
    ) async throws -> BenchCluster {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-bench-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        let httpPorts = try (0..<orders).map { _ in try freePort() }
        let httpPort = httpPorts[0]
        let fakePort = try freePort()
        let fakeURL = "http://127.0.0.1:\(fakePort)"
        let databasePath = folder.appendingPathComponent("orders.sqlite").path
        let catalogPath = folder.appendingPathComponent("catalog.json")
        try Data(DemoCatalog.json.utf8).write(to: catalogPath)
        var environment = ProcessInfo.processInfo.environment
        environment.merge(
            [
                Setting.httpHost.variable: "127.0.0.1", Setting.httpPort.variable: String(httpPort), Setting.fakeAppStoreHost.variable: "127.0.0.1",
                Setting.fakeAppStorePort.variable: String(fakePort), Setting.opsPort.variable: "off", Setting.databasePath.variable: databasePath,
                Setting.fakeDatabasePath.variable: folder.appendingPathComponent("fake.sqlite").path,
                Setting.queuePrefix.variable: "bench-\(ProcessInfo.processInfo.processIdentifier)-\(Int(Date().timeIntervalSince1970))",
                Setting.logLevel.variable: "warning", Setting.auth.variable: "off", Setting.rateLimitPerIP.variable: "0", Setting.rateLimitPerUser.variable: "0",
                Setting.maxInFlightRequests.variable: "100000", Setting.verifierConcurrency.variable: String(verifierConcurrency),
                Setting.finisherPrefetch.variable: "512", Setting.retryDelays.variable: "1,2", Setting.inlineVerification.variable: inline ? "true" : "false",
                Setting.bundleIds.variable: "com.example.demo", Setting.appStoreTimeoutSeconds.variable: "30", Setting.catalog.variable: catalogPath.path,
                Setting.appStoreVerifyURL.variable: fakeURL + "/verifyReceipt",
                Setting.appStoreSandboxVerifyURL.variable: fakeURL + "/sandbox/verifyReceipt",
                // verifyReceipt: the Server API route is paced at Apple's 50 lookups/s per app.
                Setting.receiptsVia.variable: "verify-receipt",
                // No reconciliation calls to the fake while it is measured.
                Setting.reconcileInterval.variable: "0",
            ]
        ) { $1 }
        if let databaseURL {
            environment[Setting.databaseURL.variable] = databaseURL
            let location = try PostgresLocation(url: databaseURL)
            let store = try await OrderStore(location: .postgres(location))
            let held = try await store.submissionCounts().values.reduce(0, +)
            await store.close()
            guard held == 0 else {
                throw ValidationError("--database-url: \(location) holds \(held) submissions; give the benchmark an empty database")
            }
        }
        if let amqpURL { environment[Setting.amqpURL.variable] = amqpURL }
        let intakeURLs = httpPorts.map { "http://127.0.0.1:\($0)" }
        let cluster = BenchCluster(
            intakeURLs: intakeURLs, fakeURL: fakeURL, databasePath: databasePath, folder: folder, environment: environment,
            ordersCPU: ordersCPU)
        do {
            if inline {
                try cluster.launch("dev", role: "dev")
            } else {
                try cluster.launch("fake-appstore", role: "fake-appstore")
                try await cluster.trustFakeRoot()
                for (index, port) in httpPorts.enumerated() {
                    try cluster.launch(
                        "orders", role: orders == 1 ? "orders" : "orders-\(index + 1)", extra: [Setting.httpPort.variable: String(port)])
                }
            }
            for intakeURL in intakeURLs {
                guard try await cluster.waitHealthy(intakeURL) else {
                    throw ValidationError("the pipeline did not start; see the logs in \(folder.path)")
                }
            }
            guard try await cluster.waitHealthy(fakeURL) else {
                throw ValidationError("the pipeline did not start; see the logs in \(folder.path)")
            }
            if !inline && !verifiersLater {
                try await cluster.startVerifiers(verifiers)
            }
        } catch {
            cluster.stop()
            throw error
        }
        return cluster
    }

    /// Starts `count` verifier processes and gives them 2 s to connect and start consuming.
    func startVerifiers(_ count: Int) async throws {
        for index in 1...count {
            try launch("verifier", role: "verifier-\(index)")
        }
        try await Task.sleep(for: .seconds(2))
    }

    /// CPU seconds (user and system) each process has used so far, by role.
    func cpuSeconds() -> [String: Double] {
        let running = lock.withLock { processes }
        let ticks = Double(sysconf(Int32(_SC_CLK_TCK)))
        var seconds: [String: Double] = [:]
        for (role, process) in running {
            // Fields after the command name, which is in parentheses: utime and stime are the 12th and 13th.
            guard let stat = try? String(contentsOfFile: "/proc/\(process.processIdentifier)/stat", encoding: .utf8),
                let close = stat.lastIndex(of: ")")
            else { continue }
            let fields = stat[stat.index(after: close)...].split(separator: " ")
            guard fields.count > 12, let user = Double(fields[11]), let system = Double(fields[12]) else { continue }
            seconds[role] = (user + system) / ticks
        }
        return seconds
    }

    /// Each process's peak resident memory (VmHWM) in MB, by role.
    func peakRSSMegabytes() -> [String: Double] {
        let running = lock.withLock { processes }
        var peaks: [String: Double] = [:]
        for (role, process) in running {
            guard let status = try? String(contentsOfFile: "/proc/\(process.processIdentifier)/status", encoding: .utf8),
                let line = status.split(separator: "\n").first(where: { $0.hasPrefix("VmHWM:") }),
                let kilobytes = Double(line.split(separator: " ").dropFirst().first ?? "")
            else { continue }
            peaks[role] = kilobytes / 1024
        }
        return peaks
    }

    func stop(removingFiles: Bool = false) {
        let running = lock.withLock { processes }
        let alive = running.map(\.process).filter(\.isRunning)
        for process in alive { process.terminate() }
        for process in alive { process.waitUntilExit() }
        for (_, cap) in lock.withLock({ caps }) { cap.remove() }
        if removingFiles {
            try? FileManager.default.removeItem(at: folder)
        } else {
            FileHandle.standardError.write(Data("==> the cluster's stores and logs are kept in \(folder.path)\n".utf8))
        }
    }

    /// The production shape trusts Apple's roots; here the fake App Store stands for Apple, so its
    /// root is the one the order service and the verifiers trust, as a deployment trusts Apple's:
    /// every receipt's chain is then judged once and its signer known after, as Apple's are.
    private func trustFakeRoot() async throws {
        guard try await waitHealthy(fakeURL) else {
            throw ValidationError("the fake App Store did not start; see the logs in \(folder.path)")
        }
        let response = try await HTTPClient.shared.execute(HTTPClientRequest(url: fakeURL + "/fake/root-certificate"), timeout: .seconds(10))
        guard response.status == .ok else { throw ValidationError("the fake App Store answered \(response.status) for its root certificate") }
        let root = folder.appendingPathComponent("fake-root.der")
        try Data(buffer: try await response.body.collect(upTo: 1 << 20)).write(to: root)
        lock.withLock { learnt[Setting.trustedRoots.variable] = root.path }
    }

    private func launch(_ command: String, role: String, extra: [String: String] = [:]) throws {
        let settings = environment.merging(lock.withLock { learnt }) { $1 }.merging(extra) { $1 }
        let process = try Self.launch([command], environment: settings, log: folder.appendingPathComponent("\(role).log"))
        lock.withLock { processes.append((role, process)) }
        if command == "orders", let ordersCPU {
            let cap = try BenchCPUCap(name: "iap-bench-\(ProcessInfo.processInfo.processIdentifier)-\(role)", cores: ordersCPU)
            lock.withLock { caps.append((role, cap)) }
            try cap.add(process.processIdentifier)
        }
    }

    /// With `--orders-cpu`: the periods each order service was held at its cap so far, by role.
    func throttledPeriods() -> [String: Int] {
        lock.withLock { caps }.reduce(into: [:]) { periods, entry in periods[entry.role] = entry.cap.throttledPeriods() }
    }

    private static func launch(_ arguments: [String], environment: [String: String], log: URL) throws -> Process {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: Bundle.main.executablePath ?? CommandLine.arguments[0])
        process.arguments = arguments
        process.environment = environment
        _ = FileManager.default.createFile(atPath: log.path, contents: nil)
        let handle = try FileHandle(forWritingTo: log)
        process.standardOutput = handle
        process.standardError = handle
        process.standardInput = FileHandle.nullDevice
        try process.run()
        return process
    }

    /// Whether `url` answers `/healthz` within 30 s; throws at once if a process of the cluster died.
    private func waitHealthy(_ url: String) async throws -> Bool {
        for _ in 0..<300 {
            if let dead = lock.withLock({ processes.first { !$0.process.isRunning } }) {
                throw ValidationError("`iap \(dead.role)` exited; see \(folder.appendingPathComponent("\(dead.role).log").path)")
            }
            if let response = try? await HTTPClient.shared.execute(HTTPClientRequest(url: url + "/healthz"), timeout: .seconds(2)),
                response.status == .ok
            {
                return true
            }
            try await Task.sleep(for: .milliseconds(100))
        }
        return false
    }

    private static func freePort() throws -> Int {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        defer { close(fd) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = 0
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let bound = withUnsafeMutablePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                bind(fd, $0, length) == 0 && getsockname(fd, $0, &length) == 0
            }
        }
        guard bound else { throw ValidationError("no free port on 127.0.0.1") }
        return Int(UInt16(bigEndian: address.sin_port))
    }
}
