import Foundation
import IAPClient

#if canImport(Glibc)
    import Glibc
#elseif canImport(Darwin)
    import Darwin
#endif

/// One simulated phone: a user, a fake App Store device, a queue folder, an `IAPClient`.
struct SimulatedDevice: Sendable {
    let index: Int
    let userId: String
    let deviceId: String
    let folder: URL
    /// Purchases this device makes in all (across restarts).
    let purchases: Int
    let settings: Simulation.Settings

    func source(transport: any HTTPTransport, catalog: [String: String]) -> FakeStorePurchaseSource {
        FakeStorePurchaseSource(
            fakeURL: settings.fakeURL, bundleId: settings.bundleId, deviceId: deviceId, transport: transport,
            productTypes: { catalog[$0] ?? "consumable" })
    }

    /// Buys what is left of this device's share, then waits for its queue to empty.
    func run(catalog: [String: String], transport: any HTTPTransport, report: ReportFile?) async throws {
        let source = source(transport: transport, catalog: catalog)
        let store = try FileTransactionStore(directory: folder)
        let client = IAPClient(
            configuration: .init(serverURL: settings.intakeURL, retry: settings.retry, cacheDirectory: folder),
            store: store, source: source, transport: transport, seed: settings.seed &+ UInt64(index))
        let secret = settings.authSecret
        try await client.signIn(userId: userId, token: { [userId] in secret.map { Simulation.token(userId: userId, secret: $0) } })
        let events = Task { await follow(client.events, report: report) }
        // At launch StoreKit redelivers what the app did not finish: a kill between a purchase
        // and the queue's write loses nothing.
        try await client.start()
        // What Apple charged this device for is what it has bought: the plan resumes there.
        let done = try await source.deviceTransactions().count
        for number in done..<max(done, purchases) {
            let productId = plannedProduct(number, catalog: catalog)
            let entry = try await buy(productId, with: client)
            report?.append(
                ["event": "minted", "userId": userId, "transactionId": entry.transactionId, "productId": productId,
                 "orderId": entry.orderId ?? "", "state": "minted"])
        }
        try await drain(client)
        await client.stop()
        await events.value
    }

    /// Buys one product, asking again while the service cannot create the order (a real app's
    /// user taps again); a purchase the store completed is queued by the client before this returns.
    private func buy(_ productId: String, with client: IAPClient) async throws -> QueueEntry {
        var failures = 0
        var random = SeededGenerator(seed: settings.seed &+ UInt64(index))
        while true {
            do {
                switch try await client.purchase(productId: productId) {
                case .purchased(let entry): return entry
                case .userCancelled, .pending:
                    throw Simulation.Failure(description: "the fake App Store does not cancel or defer purchases")
                }
            } catch let error as IAPClientError where error.isTransient {
                failures += 1
                guard failures < 1000 else { throw error }
                let wait = settings.retry.delay(afterFailures: failures, retryAfter: error.retryAfter, using: &random)
                try await Task.sleep(for: .milliseconds(Int64(min(wait, 2) * 1000)))
            }
        }
    }

    /// Waits until nothing in the queue is still being retried (a stopped entry waits for
    /// customer service, not for time), bounded by the drain timeout.
    private func drain(_ client: IAPClient) async throws {
        let deadline = ContinuousClock.now + settings.drainTimeout
        while ContinuousClock.now < deadline {
            let left = try await client.queued().filter { $0.userId == userId && $0.stopped == nil }
            if left.isEmpty { return }
            try await Task.sleep(for: .milliseconds(100))
        }
    }

    private func follow(_ events: AsyncStream<IAPClient.Event>, report: ReportFile?) async {
        for await event in events {
            switch event {
            case .finished(let entry):
                addStats(uploads: entry.uploads, retries: entry.retries)
                report?.append(
                    ["event": "settled", "userId": entry.userId, "transactionId": entry.transactionId,
                     "productId": entry.transaction.productId, "state": "finished"])
            case .stopped(let entry):
                report?.append(
                    ["event": "settled", "userId": entry.userId, "transactionId": entry.transactionId,
                     "productId": entry.transaction.productId, "state": "stopped",
                     "reason": entry.stopped?.reason ?? entry.stopped?.state ?? ""])
            case .alert(let entry):
                report?.append(
                    ["event": "alert", "userId": entry.userId, "transactionId": entry.transactionId,
                     "productId": entry.transaction.productId, "state": "failing", "reason": entry.lastError ?? ""])
            }
        }
    }

    /// The product of this device's `number`th purchase, the same on every run of the seed: a
    /// subscription first on every fourth device, a non-consumable second on every sixth, else a
    /// consumable (bought again and again, as coins are).
    func plannedProduct(_ number: Int, catalog: [String: String]) -> String {
        let byType = Dictionary(grouping: catalog.keys.sorted(), by: { catalog[$0] ?? "" })
        if number == 0, index % 4 == 0, let subscription = byType["auto_renewable"]?.first { return subscription }
        if number == 1, index % 6 == 1, let once = byType["non_consumable"]?.first { return once }
        let consumables = byType["consumable"] ?? catalog.keys.sorted()
        var random = SeededGenerator(seed: settings.seed ^ UInt64(index &* 1_000_003 &+ number))
        return consumables[Int(random.next() % UInt64(consumables.count))]
    }

    /// The user's grants at the service, asked until answered.
    func grants(_ transport: any HTTPTransport) async throws -> [Grant] {
        struct Answer: Decodable { var grants: [Grant] }
        let url = settings.intakeURL.appendingPathComponent("v1/users").appendingPathComponent(userId).appendingPathComponent("grants")
        let token = settings.authSecret.map { Simulation.token(userId: userId, secret: $0) }
        return try JSONDecoder().decode(Answer.self, from: try await Simulation.getUntilAnswered(url, token: token, transport)).grants
    }

    /// A grant as the service lists it.
    struct Grant: Decodable {
        var transactionId: String
        var grantedAt: String
    }

    // MARK: - Counters kept beside the queue

    struct Stats: Codable {
        var uploads = 0
        var retries = 0
    }

    private var statsFile: URL { folder.appendingPathComponent("stats.json") }

    func readStats() -> Stats {
        (try? Data(contentsOf: statsFile)).flatMap { try? JSONDecoder().decode(Stats.self, from: $0) } ?? Stats()
    }

    /// Counts a finished purchase's uploads and retries (a kill may lose the last few: these are
    /// figures about the load, not about money).
    private func addStats(uploads: Int, retries: Int) {
        var stats = readStats()
        stats.uploads += uploads
        stats.retries += retries
        if let data = try? JSONEncoder().encode(stats) { try? data.write(to: statsFile, options: .atomic) }
    }
}

/// The report: one JSON line per event, each appended with one `write` to a file opened with
/// `O_APPEND`, so that lines from several devices never interleave; kept across restarts.
final class ReportFile: Sendable {
    private let descriptor: Int32

    init(url: URL) throws {
        descriptor = open(url.path, O_WRONLY | O_CREAT | O_APPEND, 0o644)
        guard descriptor >= 0 else { throw Simulation.Failure(description: "cannot open \(url.path)") }
    }

    deinit {
        close(descriptor)
    }

    func append(_ fields: [String: String]) {
        guard var line = try? JSONSerialization.data(withJSONObject: fields, options: [.sortedKeys]) else { return }
        line.append(0x0A)
        _ = line.withUnsafeBytes { write(descriptor, $0.baseAddress, $0.count) }
    }
}
