import AppSimulator
import ArgumentParser
import Foundation
import IAPClient

/// `iap-app`: the simulated app on `IAPClient`.
@main
struct IAPApp: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "iap-app",
        abstract: "A simulated app on IAPClient: devices that buy from the fake App Store and retry as apps do.",
        subcommands: [Simulate.self, QueueWriter.self])
}

/// `iap-app simulate`.
struct Simulate: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Run devices buying through the client library; resume a queue folder; print who really got what.",
        discussion: """
            Each device is its own user and fake App Store device, with its own queue under --queue. \
            Started again on the same --queue, it resumes what the folder holds and buys only what is left of \
            --purchases. The summary (JSON; the last line with --json) counts from the fake App Store's purchases \
            and the service's grants: minted, credited, finishedBeforeCredited, finishedNever, lost (minted, never \
            credited, not in a queue), doubled, queueLeft, uploads, retries. It exits 1 when anything was lost, \
            doubled or finished before it was credited.
            """)

    @Option(help: "The order service's URL (scripts/dev up: http://127.0.0.1:8080).") var intake: String
    @Option(help: "The fake App Store's URL (scripts/dev up: http://127.0.0.1:8090).") var fake: String
    @Option(name: .customLong("bundle-id"), help: "The app's bundle id, one of those the service accepts.") var bundleId: String
    @Option(help: "The folder of the devices' queues.") var queue: String
    @Option(help: "Devices (each its own user).") var devices: Int = 10
    @Option(help: "Purchases in all, shared among the devices.") var purchases: Int = 100
    @Option(help: "Chooses users, products and jitter (decimal or 0x hex).") var seed: String = "1"
    @Option(help: "Append one JSON line per purchase minted and settled to this file.") var report: String?
    @Flag(help: "Print the summary as the last line, JSON only.") var json = false
    @Option(name: .customLong("retry-initial-ms"), help: "The first retry's delay.") var retryInitialMs: Int = 2000
    @Option(name: .customLong("retry-max-ms"), help: "The longest retry delay.") var retryMaxMs: Int = 600_000
    @Option(name: .customLong("status-poll-ms"), help: "The first wait before reading a pending upload's status again.")
    var statusPollMs: Int = 2000
    @Option(name: .customLong("drain-timeout"), help: "Seconds to wait for the queues to empty.") var drainTimeout: Int = 600
    @Option(
        name: .customLong("auth-secret-file"),
        help: "A file holding the service's HS256 secret, to sign the devices' user tokens (scripts/dev up --auth: .run/dev/auth-secret).")
    var authSecretFile: String?

    func validate() throws {
        guard (1...10_000).contains(devices) else { throw ValidationError("--devices must be 1 to 10000") }
        guard (0...1_000_000).contains(purchases) else { throw ValidationError("--purchases must be 0 to 1000000") }
        guard (1...3_600_000).contains(retryInitialMs), (retryInitialMs...3_600_000).contains(retryMaxMs) else {
            throw ValidationError("--retry-initial-ms must be 1 to 3600000 and --retry-max-ms at least that")
        }
        guard (1...600_000).contains(statusPollMs) else { throw ValidationError("--status-poll-ms must be 1 to 600000") }
        guard (1...86_400).contains(drainTimeout) else { throw ValidationError("--drain-timeout must be 1 to 86400") }
        guard parsedSeed != nil else { throw ValidationError("--seed must be a number (decimal or 0x hex)") }
        for (name, value) in [("--intake", intake), ("--fake", fake)] where URL(string: value)?.host == nil {
            throw ValidationError("\(name) must be a URL such as http://127.0.0.1:8080")
        }
    }

    /// The service's HS256 secret, from `--auth-secret-file`, to sign the devices' user tokens.
    private func authSecret() throws -> String? {
        guard let authSecretFile else { return nil }
        do {
            let secret = try String(contentsOfFile: authSecretFile, encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)
            guard !secret.isEmpty else { throw ValidationError("\(authSecretFile) is empty") }
            return secret
        } catch let error as ValidationError {
            throw error
        } catch {
            throw ValidationError("cannot read --auth-secret-file \(authSecretFile): \(error)")
        }
    }

    private var parsedSeed: UInt64? {
        seed.lowercased().hasPrefix("0x") ? UInt64(seed.dropFirst(2), radix: 16) : UInt64(seed)
    }

    func run() async throws {
        guard let intakeURL = URL(string: intake), let fakeURL = URL(string: fake) else {
            throw ValidationError("--intake and --fake must be URLs")
        }
        let settings = Simulation.Settings(
            intakeURL: intakeURL, fakeURL: fakeURL, bundleId: bundleId,
            queueDirectory: URL(fileURLWithPath: queue), devices: devices, purchases: purchases, seed: parsedSeed ?? 1,
            reportFile: report.map { URL(fileURLWithPath: $0) },
            authSecret: try authSecret(),
            retry: RetryPolicy(
                initialDelay: Double(retryInitialMs) / 1000, maximumDelay: Double(retryMaxMs) / 1000,
                statusPollDelay: Double(statusPollMs) / 1000),
            drainTimeout: .seconds(drainTimeout))
        let summary = try await Simulation(settings: settings).run()
        let encoder = JSONEncoder()
        encoder.outputFormatting = json ? [.sortedKeys] : [.sortedKeys, .prettyPrinted]
        print(String(decoding: try encoder.encode(summary), as: UTF8.self))
        if summary.lost > 0 || summary.doubled > 0 || summary.finishedBeforeCredited > 0 {
            throw ExitCode(1)
        }
    }
}

/// `iap-app queue-writer`: the crash test's child. Writes entries to a file store one by one
/// and prints `acked <userId> <transactionId>` after each write returned; the test kills it -9
/// at a random moment and reads the folder back.
struct QueueWriter: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "queue-writer", abstract: "Write queue entries and acknowledge each (the store's crash test).",
        shouldDisplay: false)

    @Option(help: "The store's folder.") var dir: String
    @Option(help: "Entries to write.") var count: Int = 1000
    @Option(help: "Chooses users, sizes and removals.") var seed: UInt64 = 1

    func run() async throws {
        let store = try FileTransactionStore(directory: URL(fileURLWithPath: dir))
        var random = SeededGenerator(seed: seed)
        // Large enough that a write takes a while (a kill lands inside one often), as a signed
        // transaction does.
        let filler = String(repeating: "x", count: 2048)
        for number in 0..<max(0, count) {
            let userId = "user-\(random.next() % 3)"
            let transaction = StoreTransaction(
                transactionId: "\(seed)\(number)", originalTransactionId: "\(seed)\(number)", productId: "com.example.coins.60",
                appAccountToken: nil, purchaseDate: Date(), signedTransaction: "\(number).\(filler).\(number)")
            try store.put(QueueEntry(userId: userId, transaction: transaction, orderId: nil, addedAt: Date()))
            say("acked \(userId) \(transaction.transactionId)")
            // Some entries leave again (a finished purchase): removals are writes a kill can cut too.
            if random.next() % 4 == 0 {
                try store.remove(userId: userId, transactionId: transaction.transactionId)
                say("removed \(userId) \(transaction.transactionId)")
            }
        }
    }

    /// One line straight to standard output (no buffer a kill could lose).
    private func say(_ line: String) {
        FileHandle.standardOutput.write(Data((line + "\n").utf8))
    }
}
