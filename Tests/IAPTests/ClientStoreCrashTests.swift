import Foundation
import IAPClient
import Testing

/// The client's file store against kill -9: a child process (`iap-app queue-writer`) writes and
/// removes entries, saying `acked` after each write returned and `removed` after each removal;
/// it is killed at a seeded moment, hundreds of times, and the folder is read back each time.
@Suite("Client file store killed -9 mid-write", .timeLimit(.minutes(5)))
struct ClientStoreCrashTests {
    /// The simulated app beside the `iap` the suite was given (`scripts/dev test` builds both).
    static func appBinary() throws -> URL {
        guard let iap = ProcessInfo.processInfo.environment["IAP_TEST_IAP_BINARY"], !iap.isEmpty else {
            throw ProcessDrill.MissingBinary()
        }
        let app = URL(fileURLWithPath: iap).deletingLastPathComponent().appendingPathComponent("iap-app")
        try #require(FileManager.default.isExecutableFile(atPath: app.path), "\(app.path) was not built")
        return app
    }

    @Test func everyAcknowledgedEntryIsReadBackWholeAndNoTornEntryIsEverRead() async throws {
        let binary = try Self.appBinary()
        let root = FileManager.default.temporaryDirectory.appendingPathComponent("iap-client-crash-\(UUID().uuidString)")
        defer { try? FileManager.default.removeItem(at: root) }
        var random = SeededGenerator(seed: 0xC0FF_EE15)
        var killedInsideAWrite = 0
        var acknowledged = 0
        let rounds = 200
        for round in 0..<rounds {
            let folder = root.appendingPathComponent("round-\(round)")
            let store = folder.appendingPathComponent("queue")
            let acks = folder.appendingPathComponent("acks.txt")
            try FileManager.default.createDirectory(at: store, withIntermediateDirectories: true)
            _ = FileManager.default.createFile(atPath: acks.path, contents: nil)
            let child = Process()
            child.executableURL = binary
            child.arguments = ["queue-writer", "--dir", store.path, "--seed", String(round + 1), "--count", "1000000"]
            child.standardOutput = try FileHandle(forWritingTo: acks)
            try child.run()
            // A seeded point: after 1 to 40 acknowledgements, at once (most of a write is its
            // fsync, so the kill usually lands inside one; the count below proves some did).
            let wanted = 1 + Int(random.next() % 40)
            var polls = 0
            while Self.lines(acks).count < wanted {
                polls += 1
                try #require(polls < 30_000 && child.isRunning, "the writer stopped before \(wanted) acknowledgements")
                try await Task.sleep(for: .milliseconds(1))
            }
            kill(child.processIdentifier, SIGKILL)
            await child.exited()
            // The fault landed: the writer was killed, it did not end by itself.
            #expect(child.terminationReason == .uncaughtSignal && child.terminationStatus == SIGKILL)
            let names = try FileManager.default.contentsOfDirectory(atPath: store.path)
            if names.contains(where: { $0.contains(".part-") }) { killedInsideAWrite += 1 }

            let said = Self.lines(acks)
            let entries = try FileTransactionStore(directory: store).entries()
            try Self.check(entries, against: said, round: round)
            acknowledged += said.filter { $0.hasPrefix("acked ") }.count
        }
        #expect(killedInsideAWrite > 0, "no kill landed inside a write: the test proved nothing")
        #expect(acknowledged >= rounds)
    }

    /// Every acknowledged entry that was not removed is there, whole; every removed one is
    /// gone; at most the entry being written or removed at the kill is either.
    static func check(_ entries: [QueueEntry], against said: [String], round: Int) throws {
        var acked: [String: String] = [:]
        var removed: Set<String> = []
        var order: [String] = []
        for line in said {
            let words = line.split(separator: " ").map(String.init)
            guard words.count == 3 else { continue }
            if words[0] == "acked" {
                acked[words[2]] = words[1]
                order.append(words[2])
            } else if words[0] == "removed" {
                removed.insert(words[2])
            }
        }
        let present = Dictionary(entries.map { ($0.transactionId, $0) }, uniquingKeysWith: { first, _ in first })
        #expect(present.count == entries.count, "round \(round): one entry per transaction")
        for entry in entries {
            // Whole: the writer's signed transaction is "<n>.<2048 x>.<n>".
            let parts = (entry.transaction.signedTransaction ?? "").split(separator: ".", omittingEmptySubsequences: false)
            #expect(parts.count == 3 && parts[0] == parts[2] && parts[1].count == 2048, "round \(round): a torn entry")
            #expect(entry.transaction.productId == "com.example.coins.60")
        }
        let last = order.last
        for id in order where !removed.contains(id) {
            // The last one may have been mid-removal at the kill.
            if id == last, present[id] == nil { continue }
            #expect(present[id]?.userId == acked[id], "round \(round): acknowledged \(id) was lost")
        }
        for id in removed {
            #expect(present[id] == nil, "round \(round): removed \(id) came back")
        }
        // The entry written when the kill came may be there unacknowledged: one at most.
        #expect(entries.filter { acked[$0.transactionId] == nil }.count <= 1, "round \(round): entries nobody wrote")
    }

    /// The complete lines of the file (a line cut by the kill is not one).
    static func lines(_ file: URL) -> [String] {
        guard let data = try? Data(contentsOf: file) else { return [] }
        var text = String(decoding: data, as: UTF8.self)
        if !text.hasSuffix("\n"), let end = text.lastIndex(of: "\n") { text = String(text[...end]) } else if !text.hasSuffix("\n") { return [] }
        return text.split(separator: "\n").map(String.init)
    }
}
