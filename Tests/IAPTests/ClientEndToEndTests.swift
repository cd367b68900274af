import AppSimulator
import Foundation
import IAPClient
import NIOConcurrencyHelpers
import NIOHTTP1
import OrderStore
import Ledger
import Testing
import TestSupport

/// The app side's drills: one at a time, and `scripts/dev test` runs them after the rest, alone
/// (among the other suites they took four times as long and pushed others past their bounds).
/// Ten minutes a test: each pushes 500 purchases a store through a pipeline, a proxy and four
/// runs of the simulated app.
@Suite(.serialized, .timeLimit(.minutes(10)), .teardown)
struct AppSideDrills {}

extension AppSideDrills {
    /// The app side end to end: the real client (in `iap-app`, or in this process) against the
    /// real intake, broker, verifier and finisher on both stores, the fake App Store standing in
    /// for Apple, and a proxy between the app and the intake that drops, cuts, refuses and delays
    /// connections. Counted against who really paid: the fake App Store's purchases and the
    /// service's grants.
    @Suite("The app side end to end: a flaky network, a killed app")
    struct ClientEndToEndTests {
        static let faults = ChaosProxy.Faults.harsh

        @Test(arguments: TestStore.backends)
        func fiveHundredPurchasesOnFiftyDevicesThroughAFlakyNetworkAndThreeKillsDropNothing(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "client-e2e", on: backend)
            Teardown.add { await pipeline.stop() }
            let proxy = try await ChaosProxy.start(upstreamPort: try Self.port(of: pipeline), seed: 0xC11E_0047, faults: Self.faults)
            Teardown.add { try? await proxy.stop() }
            let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-client-e2e-\(UUID().uuidString)")
            try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
            defer { try? FileManager.default.removeItem(at: folder) }
            let report = folder.appendingPathComponent("report.jsonl")
            let arguments = [
                "simulate", "--intake", proxy.url, "--fake", pipeline.fakeURL, "--bundle-id", PipelineHarness.bundleId,
                "--queue", folder.appendingPathComponent("queue").path, "--devices", "50", "--purchases", "500",
                "--seed", "0x5151", "--report", report.path, "--json", "--retry-initial-ms", "50", "--retry-max-ms", "1000",
                "--status-poll-ms", "100", "--drain-timeout", "150",
            ]
            // Three runs killed -9 mid-run, each once it minted more than the one before.
            for round in 1...3 {
                let child = try Self.start(arguments, output: folder.appendingPathComponent("run-\(round).out"))
                var polls = 0
                while Self.mintedCount(report) < 120 * round {
                    polls += 1
                    if !child.isRunning || polls >= 6_000 {
                        let printed = (try? Data(contentsOf: folder.appendingPathComponent("run-\(round).out"))) ?? Data()
                        Issue.record("run \(round) ended before it minted \(120 * round): \(String(decoding: printed, as: UTF8.self))")
                        return
                    }
                    try await Task.sleep(for: .milliseconds(20))
                }
                kill(child.processIdentifier, SIGKILL)
                await child.exited()
                // The fault landed: the app was killed, it did not end by itself.
                #expect(child.terminationReason == .uncaughtSignal, "run \(round)")
            }
            // Started again on the same queue folder: it resumes and buys what is left.
            let output = folder.appendingPathComponent("final.out")
            let last = try Self.start(arguments, output: output)
            await last.exited()
            let printed = String(decoding: try Data(contentsOf: output), as: UTF8.self)
            #expect(last.terminationStatus == 0, "\(printed)")
            let line = try #require(printed.split(separator: "\n").last)
            let summary = try JSONDecoder().decode(Simulation.Summary.self, from: Data(line.utf8))
            #expect(summary.minted == 500, "\(summary)")
            #expect(summary.credited == 500, "\(summary)")
            #expect(summary.lost == 0 && summary.doubled == 0 && summary.finishedBeforeCredited == 0, "\(summary)")
            #expect(summary.finishedNever == 0 && summary.queueLeft == 0, "\(summary)")

            // The network was as bad as promised.
            let counters = proxy.counters
            #expect(Double(counters.faulted) >= 0.2 * Double(counters.connections), "\(counters)")
            #expect(counters.lostAnswers > 0 && counters.cut > 0 && counters.dropped > 0, "\(counters)")

            // Every purchase was bought for an order, and paid it; subscriptions among them.
            let minted = Self.minted(report)
            for purchase in minted {
                let order = try await pipeline.store.order(purchase["orderId"] ?? "")
                #expect(order?.state == .paid, "\(purchase)")
            }
            #expect(minted.contains { $0["productId"] == "com.example.vip.month" })
            #expect(minted.contains { $0["productId"] == "com.example.premium" })
        }

        @Test(arguments: TestStore.backends)
        func aHeldPurchaseCustomerServiceMarksFinishableIsFinishedByTheClientAtItsNextWake(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "client-held", on: backend)
            Teardown.add { await pipeline.stop() }
            let proxy = try await ChaosProxy.start(upstreamPort: try Self.port(of: pipeline), seed: 0x4E1D, faults: Self.faults)
            Teardown.add { try? await proxy.stop() }
            let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-client-held-\(UUID().uuidString)")
            defer { try? FileManager.default.removeItem(at: folder) }
            let transport = AsyncHTTPClientTransport(timeout: .seconds(5))
            let source = FakeStorePurchaseSource(
                fakeURL: try #require(URL(string: pipeline.fakeURL)), bundleId: PipelineHarness.bundleId, deviceId: "held-phone",
                transport: transport, productTypes: { _ in "consumable" })
            let client = IAPClient(
                configuration: .init(
                    serverURL: try #require(URL(string: proxy.url)),
                    retry: RetryPolicy(initialDelay: 0.05, maximumDelay: 1, statusPollDelay: 0.1)),
                store: try FileTransactionStore(directory: folder), source: source, transport: transport, seed: 9)
            try await client.signIn(userId: "hana", token: { nil })
            try await client.start()
            var events = client.events.makeAsyncIterator()

            // A purchase of a product the catalog does not sell reaches the app outside a
            // purchase sheet (bought on another device): Apple charged for it, the service holds it.
            let minted = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases",
                json: ["bundleId": PipelineHarness.bundleId, "productId": "com.example.gems.unlisted", "deviceId": "held-phone"])
            let signed = try #require(minted.json["signedTransaction"] as? String)
            let transaction = try #require(FakeStorePurchaseSource.transaction(signed: signed))
            source.deliver(transaction)
            guard case .stopped(let held)? = await events.next() else { Issue.record("no stop"); return }
            #expect(held.stopped?.state == "needs_review" && held.stopped?.reason == "unknown_product", "\(held)")
            #expect(try await Self.finishedAtTheFake(transaction.transactionId, pipeline) == false, "never finished while held")

            // Customer service settles it by hand and marks the upload finishable.
            let submission = try #require(held.submissionId)
            let marked = try await pipeline.admin(
                .POST, "/v1/admin/submissions/\(submission)/finishable", ["reason": "refunded by hand, ticket 12", "actor": "sam"])
            #expect(marked.status == 200, "\(marked.text)")
            await client.wake()
            guard case .finished(let finished)? = await events.next() else { Issue.record("not finished"); return }
            #expect(finished.transactionId == transaction.transactionId)
            #expect(try await Self.finishedAtTheFake(transaction.transactionId, pipeline) == true)
            #expect(try await client.queued().isEmpty)
            await client.stop()
        }

        // MARK: - Helpers

        static func port(of pipeline: PipelineHarness) throws -> Int {
            try #require(pipeline.intakeURL.split(separator: ":").last.flatMap { Int($0) })
        }

        static func start(_ arguments: [String], output: URL) throws -> Process {
            _ = FileManager.default.createFile(atPath: output.path, contents: nil)
            let child = Process()
            child.executableURL = try ClientStoreCrashTests.appBinary()
            child.arguments = arguments
            child.standardOutput = try FileHandle(forWritingTo: output)
            child.standardError = try FileHandle(forWritingTo: output)
            try child.run()
            Teardown.add { if child.isRunning { kill(child.processIdentifier, SIGKILL) } }
            return child
        }

        /// How many `minted` lines the report has: counted on the bytes, not parsed, since the
        /// drill asks fifty times a second while the app writes it.
        static func mintedCount(_ report: URL) -> Int {
            guard let data = try? Data(contentsOf: report) else { return 0 }
            let prefix = Array(#"{"event":"minted""#.utf8)
            return data.split(separator: UInt8(ascii: "\n")).filter { $0.starts(with: prefix) }.count
        }

        /// The report's `minted` lines (complete ones).
        static func minted(_ report: URL) -> [[String: String]] {
            ClientStoreCrashTests.lines(report).compactMap { line in
                (try? JSONSerialization.jsonObject(with: Data(line.utf8))) as? [String: String]
            }.filter { $0["event"] == "minted" }
        }

        static func finishedAtTheFake(_ transactionId: String, _ pipeline: PipelineHarness) async throws -> Bool {
            let record = try await HTTP.get(pipeline.fakeURL + "/fake/purchases/\(transactionId)/finish")
            return record.json["finishedDateMs"] is String
        }
    }
}
