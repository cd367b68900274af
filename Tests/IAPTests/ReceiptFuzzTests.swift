import Foundation
import Testing

@Suite("Receipt parser fuzzing", .timeLimit(.minutes(4)))
struct ReceiptFuzzTests {
    /// A short libFuzzer run (address sanitizer on) over the local receipt parser: 10,000 inputs,
    /// within 90 s (a loaded machine runs a few hundred a second; an idle one, thousands).
    /// Compiling the fuzzer takes most of the test's time. Longer runs:
    /// `scripts/fuzz-receipt-parser 600`.
    @Test func parserSurvivesABoundedFuzzRun() async throws {
        let log = FileManager.default.temporaryDirectory.appendingPathComponent("fuzz-\(UUID().uuidString).log")
        _ = FileManager.default.createFile(atPath: log.path, contents: nil)
        let output = try FileHandle(forWritingTo: log)
        let process = Process()
        process.executableURL = repositoryRoot.appendingPathComponent("scripts/fuzz-receipt-parser")
        process.arguments = ["90"]
        process.environment = ProcessInfo.processInfo.environment.merging(["FUZZ_RUNS": "10000"]) { $1 }
        process.currentDirectoryURL = repositoryRoot
        process.standardInput = FileHandle.nullDevice
        process.standardOutput = output
        process.standardError = output
        try process.run()
        await process.exited()
        let text = (try? String(contentsOf: log, encoding: .utf8)) ?? ""
        #expect(process.terminationStatus == 0, "\(text.split(separator: "\n").suffix(30).joined(separator: "\n"))")
        let executed = text.split(separator: "\n").first { $0.hasPrefix("stat::number_of_executed_units:") }
        let runs = executed.flatMap { Int($0.split(separator: ":").last?.trimmingCharacters(in: .whitespaces) ?? "") } ?? 0
        #expect(runs >= 10_000, "the fuzzer ran only \(runs) of 10,000 inputs in 90 s")
    }
}
