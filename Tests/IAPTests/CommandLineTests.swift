import Foundation
import Testing

@Suite("iap on the command line")
struct CommandLineTests {
    struct Run {
        var status: Int32
        var output: String
    }

    func iap(_ arguments: [String]) throws -> Run {
        guard let binary = ProcessInfo.processInfo.environment["IAP_TEST_IAP_BINARY"], !binary.isEmpty else {
            throw ProcessDrill.MissingBinary()
        }
        let log = FileManager.default.temporaryDirectory.appendingPathComponent("iap-\(UUID().uuidString).out")
        FileManager.default.createFile(atPath: log.path, contents: nil)
        let output = try FileHandle(forWritingTo: log)
        let process = Process()
        process.executableURL = URL(fileURLWithPath: binary)
        process.arguments = arguments
        process.standardInput = FileHandle.nullDevice
        process.standardOutput = output
        process.standardError = output
        try process.run()
        process.waitUntilExit()
        return Run(status: process.terminationStatus, output: (try? String(contentsOf: log, encoding: .utf8)) ?? "")
    }

    @Test func inspectReceiptPrintsEveryPurchaseAndRefusesJunk() async throws {
        let apple = try await VerifyReceiptClientTests.Apple.start()
        defer { Task { await apple.stop() } }
        let device = UUID().uuidString
        var transactions: [String] = []
        var receipt = ""
        for product in ["com.example.coins.60", "com.example.coins.120"] {
            let answer = try await HTTP.post(
                apple.url + "/fake/purchases",
                json: ["bundleId": PipelineHarness.bundleId, "productId": product, "deviceId": device])
            transactions.append(try #require(answer.json["transactionId"] as? String))
            receipt = try #require(answer.json["receiptData"] as? String)
        }
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("receipt-\(UUID().uuidString).b64")
        try receipt.write(to: file, atomically: true, encoding: .utf8)

        let run = try iap(["inspect", "receipt", file.path])
        #expect(run.status == 0, "\(run.output)")
        let json = try JSONSerialization.jsonObject(with: Data(run.output.utf8)) as? [String: Any]
        #expect(json?["bundleId"] as? String == PipelineHarness.bundleId)
        let listed = (json?["inApp"] as? [[String: Any]] ?? []).compactMap { $0["transactionId"] as? String }
        #expect(Set(listed) == Set(transactions))

        let junk = FileManager.default.temporaryDirectory.appendingPathComponent("junk-\(UUID().uuidString)")
        try Data("certainly not a receipt".utf8).write(to: junk)
        let refused = try iap(["inspect", "receipt", junk.path])
        #expect(refused.status != 0)
        #expect(refused.output.contains("error:"))
    }

    @Test func badSettingStopsStartUpNamingTheVariable() throws {
        let run = try iap(["verifier", "--bundle-ids", "com.example.demo", "--concurrency", "0"])
        #expect(run.status != 0)
        #expect(run.output.contains("IAP_VERIFIER_CONCURRENCY"), "\(run.output)")
        let missing = try iap(["verifier"])
        #expect(missing.status != 0)
        #expect(missing.output.contains("IAP_BUNDLE_IDS"), "\(missing.output)")
    }
}
