import AppStore
import Crypto
import X509
import FakeAppStore
import Foundation
import IAPCore
import Messaging
import NIOConcurrencyHelpers
import OrderStore
import Store

struct MicrobenchError: Error {
    var what: String
    init(_ what: String) { self.what = what }
}

/// `#require` for a benchmark: the value, or an error naming it.
func require<T>(_ value: T?, _ what: String = "a value") throws -> T {
    guard let value else { throw MicrobenchError(what) }
    return value
}

/// Micro-benchmarks of the hot paths, one core, printed as operations per second. Build in
/// release mode: `swift run -c release iap-microbench [jws|receipt|codec|finisher|all] [--seconds S]`.
@main
struct Microbench {
    static func main() async throws {
        var arguments = Array(CommandLine.arguments.dropFirst())
        var seconds = 3.0
        if let index = arguments.firstIndex(of: "--seconds"), index + 1 < arguments.count {
            seconds = Double(arguments[index + 1]) ?? seconds
            arguments.removeSubrange(index...index + 1)
        }
        var databaseURL: String?
        if let index = arguments.firstIndex(of: "--database-url"), index + 1 < arguments.count {
            databaseURL = arguments[index + 1]
            arguments.removeSubrange(index...index + 1)
        }
        let which = Set(arguments.isEmpty ? ["all"] : arguments)
        let all = which.contains("all")
        print("iap-microbench: \(ProcessInfo.processInfo.activeProcessorCount) cores, \(seconds) s per figure, one task")
        if all || which.contains("jws") { try await jws(seconds: seconds) }
        if all || which.contains("receipt") {
            try receipt(seconds: seconds)
            try await receiptSignature(seconds: seconds)
        }
        if all || which.contains("codec") { try codec(seconds: seconds) }
        if all || which.contains("finisher") { try await finisher(seconds: seconds, databaseURL: databaseURL) }
    }

    /// Runs `body` for about `seconds`; prints and returns operations per second.
    @discardableResult
    static func measure(_ name: String, seconds: Double, _ body: () async throws -> Void) async rethrows -> Double {
        for _ in 0..<50 { try await body() }  // warm-up
        let clock = ContinuousClock()
        let start = clock.now
        let deadline = start + .seconds(seconds)
        var count = 0
        while clock.now < deadline {
            for _ in 0..<20 { try await body() }
            count += 20
        }
        let elapsed = clock.now - start
        let perSecond = Double(count) / (Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18)
        print(name.padding(toLength: 44, withPad: " ", startingAt: 0) + String(format: "%10.0f /s  (%.1f µs each)", perSecond, 1e6 / perSecond))
        return perSecond
    }

    static func transaction(_ id: Int) -> JWSTransactionDecodedPayload {
        let now = Date().appleMilliseconds
        return JWSTransactionDecodedPayload(
            transactionId: String(2_000_000_000_000_000 + id), originalTransactionId: String(2_000_000_000_000_000 + id),
            bundleId: "com.example.demo", productId: "com.example.coins.60", environment: "Production", purchaseDate: now,
            quantity: 1, type: "Consumable", signedDate: now)
    }

    static func jws(seconds: Double) async throws {
        let authority = try FakeCertificateAuthority.generate()
        let signed = try authority.signJWS(transaction(1))
        let settings = SignedDataVerifier.Settings(trustedRoots: [authority.root], bundleIds: ["com.example.demo"])
        let warm = SignedDataVerifier(settings: settings)
        try await measure("JWS verify, chain cache warm", seconds: seconds) {
            _ = try await warm.verifyTransaction(signed)
        }
        try await measure("JWS verify, chain cache cold", seconds: seconds) {
            _ = try await SignedDataVerifier(settings: settings).verifyTransaction(signed)
        }
        // Where the warm time goes: its parts alone.
        let parts = signed.split(separator: ".").map(String.init)
        let key = try require(P256.Signing.PublicKey(authority.leaf.publicKey))
        let signature = try P256.Signing.ECDSASignature(rawRepresentation: try require(Base64URL.decode(parts[2].utf8)))
        let signingInput = Data("\(parts[0]).\(parts[1])".utf8)
        let payload = try require(Base64URL.decode(parts[1].utf8))
        try measureSync("  part: P-256 signature check (\(signingInput.count) B)", seconds: seconds) {
            guard key.isValidSignature(signature, for: signingInput) else { throw MicrobenchError("signature") }
        }
        try measureSync("  part: payload JSON decode", seconds: seconds) {
            _ = try JSONDecoder().decode(JWSTransactionDecodedPayload.self, from: payload)
        }
        try measureSync("  part: base64url decode of the payload", seconds: seconds) {
            _ = Base64URL.decode(parts[1].utf8)
        }
    }

    static func receipt(seconds: Double) throws {
        let minter = ReceiptMinter(authority: try FakeCertificateAuthority.generate())
        let bytes = try minter.mint(
            ReceiptPayload(
                bundleId: "com.example.demo",
                inApp: (0..<3).map {
                    InAppPurchasePayload(productId: "com.example.coins.60", transactionId: String(2_000_000_000_000_000 + $0), purchaseDate: Date())
                }))
        let base64 = Data(bytes).base64EncodedString()
        try measureSync("receipt parse (3 purchases, base64)", seconds: seconds) {
            _ = try AppReceiptParser.parse(base64: base64)
        }
    }

    /// A receipt's PKCS#7 signature and chain checked offline: the chain known (the signature
    /// alone), and a chain judged for the first time (a new checker each time).
    static func receiptSignature(seconds: Double) async throws {
        let authority = try FakeCertificateAuthority.generate()
        let bytes = try ReceiptMinter(authority: authority).mint(
            ReceiptPayload(
                bundleId: "com.example.demo",
                inApp: (0..<3).map {
                    InAppPurchasePayload(productId: "com.example.coins.60", transactionId: String(2_000_000_000_000_000 + $0), purchaseDate: Date())
                }))
        let warm = ReceiptSignature(roots: [authority.root])
        try await measure("receipt signature, chain cached", seconds: seconds) {
            guard await warm.check(bytes).isValid else { throw MicrobenchError("the receipt did not verify") }
        }
        try await measure("receipt signature, chain judged each time", seconds: seconds) {
            guard await ReceiptSignature(roots: [authority.root]).check(bytes).isValid else {
                throw MicrobenchError("the receipt did not verify")
            }
        }
    }

    static func codec(seconds: Double) throws {
        let codec = MessageCodec()
        let request = VerifyRequest(
            submissionId: UUID(), userId: "user-1", receiptData: String(repeating: "A", count: 4000), transactionId: "2000000000000001",
            attempt: 1, acceptedAt: Date())
        let bytes = try codec.encode(request)
        try measureSync("verify request encode (4 KB receipt)", seconds: seconds) { _ = try codec.encode(request) }
        try measureSync("verify request decode (4 KB receipt)", seconds: seconds) {
            _ = try codec.decode(VerifyRequest.self, from: bytes)
        }
        // A minted receipt (the fake's, as in the benchmarks): what the relay deflates and a
        // verifier inflates for each upload.
        let minted = try ReceiptMinter(authority: try FakeCertificateAuthority.generate()).mint(
            ReceiptPayload(
                bundleId: "com.example.demo",
                inApp: [InAppPurchasePayload(productId: "com.example.coins.60", transactionId: "2000000000000001", purchaseDate: Date())]))
        let message = try codec.encode(
            VerifyRequest(
                submissionId: UUID(), userId: "user-1", receiptData: Data(minted).base64EncodedString(), transactionId: "2000000000000001",
                attempt: 1, acceptedAt: Date()))
        let deflated = try ContentEncoding.deflate.encode(message)
        print("verify message: \(message.count) bytes, \(deflated.count) deflated")
        try measureSync("verify message deflate (minted receipt)", seconds: seconds) { _ = try ContentEncoding.deflate.encode(message) }
        try measureSync("verify message inflate (minted receipt)", seconds: seconds) { _ = try ContentEncoding.deflate.decode(deflated) }
    }

    /// With `databaseURL` (`postgres://…/DB`), both stores are fresh databases on that server
    /// (`DB_microbench_…`, dropped at the end) rather than SQLite files.
    static func finisher(seconds: Double, databaseURL: String?) async throws {
        let statements = NIOLockedValueBox(0)
        // The texts of the last upload's statements, one line each, printed after the count.
        let lastTexts = NIOLockedValueBox([String]())
        let observe: @Sendable (String) -> Void = { text in
            // Each round trip once: the statements inside a batch are listed, not counted.
            if !text.hasPrefix(SQLTrace.inBatch) { statements.withLockedValue { $0 += 1 } }
            lastTexts.withLockedValue {
                $0.append(text.split(whereSeparator: \.isNewline).map { $0.trimmingCharacters(in: .whitespaces) }.joined(separator: " "))
            }
        }
        let store: OrderStore
        // A second store whose every statement is counted (apart, so that counting costs the
        // timed one nothing): the SQL cost of one credited purchase.
        let counting: OrderStore
        var cleanUp: [@Sendable () async -> Void] = []
        if let databaseURL {
            let server = try PostgresLocation(url: databaseURL)
            let suffix = UUID().uuidString.prefix(8).lowercased()
            var timed = server
            timed.database = "\(server.database)_microbench_\(suffix)"
            var counted = timed
            counted.database += "_counted"
            for database in [timed.database, counted.database] {
                try await PostgresDatabase.createDatabase(database, on: server.server)
                cleanUp.append { try? await PostgresDatabase.dropDatabase(database, on: server.server) }
            }
            store = try await OrderStore(location: .postgres(timed))
            counting = try await OrderStore(
                location: .postgres(counted), statementObserver: observe)
        } else {
            let path = FileManager.default.temporaryDirectory.appendingPathComponent("microbench-\(UUID().uuidString).sqlite").path
            let countedPath = path + "-counted"
            cleanUp.append {
                for file in [path, countedPath] {
                    for suffix in ["", "-wal", "-shm"] { try? FileManager.default.removeItem(atPath: file + suffix) }
                }
            }
            store = try await OrderStore(path: path)
            counting = try await OrderStore(path: countedPath, statementObserver: observe)
        }
        do {
            try await creditingFigures(
                store: store, counting: counting, statements: statements, lastTexts: lastTexts, seconds: seconds)
        } catch {
            for store in [store, counting] { await store.close() }
            for step in cleanUp { await step() }
            throw error
        }
        for store in [store, counting] { await store.close() }
        for step in cleanUp { await step() }
    }

    static func creditingFigures(
        store: OrderStore, counting: OrderStore, statements: NIOLockedValueBox<Int>,
        lastTexts: NIOLockedValueBox<[String]>, seconds: Double
    ) async throws {
        let next = NIOLockedValueBox(0)
        let policy = CreditPolicy(eventsExchange: "iap.events")
        // One upload accepted, then its verified result applied (one credit and its event).
        @Sendable func acceptAndCredit(into store: OrderStore) async throws {
            let number = next.withLockedValue { value -> Int in
                value += 1
                return value
            }
            let id = UUID()
            let request = VerifyRequest(
                submissionId: id, userId: "user-\(number % 1000)", receiptData: "AAAA", attempt: 1, acceptedAt: Date())
            try await store.accept(request, message: OutboxMessage(routingKey: "bench", body: [1], messageId: id.uuidString))
            let purchase = VerifiedPurchase(
                transactionId: String(3_000_000_000_000_000 + number), originalTransactionId: String(3_000_000_000_000_000 + number),
                productId: "com.example.coins.60", quantity: 1, purchaseDate: Date(), environment: .production)
            _ = try await store.apply(
                VerifyResult(
                    submissionId: id, userId: request.userId, orderId: nil, attempt: 1,
                    outcome: .verified(VerifiedReceipt(bundleId: "com.example.demo", environment: .production, purchases: [purchase]))),
                policy: policy)
        }
        let before = statements.withLockedValue { $0 }
        for _ in 0..<99 { try await acceptAndCredit(into: counting) }
        lastTexts.withLockedValue { $0 = [] }
        try await acceptAndCredit(into: counting)
        let counted = Double(statements.withLockedValue { $0 } - before) / 100
        print("round trips per upload (accept + credit)".padding(toLength: 44, withPad: " ", startingAt: 0) + String(format: "%10.1f", counted))
        for text in lastTexts.withLockedValue({ $0 }) {
            let batched = text.hasPrefix(SQLTrace.inBatch)
            print((batched ? "        " : "    ") + String(text.dropFirst(batched ? SQLTrace.inBatch.count : 0).prefix(106)))
        }
        // From before `measure`'s 50 warm-up runs, which the count below adds.
        let cpuBefore = processCPU()
        let oneAtATime = try await measure("finisher transaction (accept + credit one)", seconds: seconds) {
            try await acceptAndCredit(into: store)
        }
        let cpuSeconds = processCPU() - cpuBefore
        print(
            "  process CPU per transaction".padding(toLength: 44, withPad: " ", startingAt: 0)
                + String(format: "%10.1f µs", cpuSeconds / (oneAtATime * seconds + 50) * 1e6))
        // 64 at once, as under load: the order store's group commit shares each commit.
        let perSecond = try await measure("  64 at once (group commit), per 64", seconds: seconds) {
            try await withThrowingTaskGroup(of: Void.self) { group in
                for _ in 0..<64 { group.addTask { try await acceptAndCredit(into: store) } }
                try await group.waitForAll()
            }
        }
        print("  64 at once, per upload".padding(toLength: 44, withPad: " ", startingAt: 0) + String(format: "%10.0f /s  (%.1f µs each)", perSecond * 64, 1e6 / (perSecond * 64)))
        // The same on the counting store: what a group commit's units cost in round trips.
        let beforeGroup = statements.withLockedValue { $0 }
        for _ in 0..<10 {
            try await withThrowingTaskGroup(of: Void.self) { group in
                for _ in 0..<64 { group.addTask { try await acceptAndCredit(into: counting) } }
                try await group.waitForAll()
            }
        }
        let perUpload = Double(statements.withLockedValue { $0 } - beforeGroup) / 640
        print("  64 at once, round trips per upload".padding(toLength: 44, withPad: " ", startingAt: 0) + String(format: "%10.1f", perUpload))
    }

    static func measureSync(_ name: String, seconds: Double, _ body: () throws -> Void) throws {
        for _ in 0..<50 { try body() }
        let clock = ContinuousClock()
        let start = clock.now
        let deadline = start + .seconds(seconds)
        var count = 0
        while clock.now < deadline {
            for _ in 0..<50 { try body() }
            count += 50
        }
        let elapsed = clock.now - start
        let perSecond = Double(count) / (Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18)
        print(name.padding(toLength: 44, withPad: " ", startingAt: 0) + String(format: "%10.0f /s  (%.1f µs each)", perSecond, 1e6 / perSecond))
    }
}

/// User and system CPU seconds of this process so far.
func processCPU() -> Double {
    var usage = rusage()
    getrusage(__rusage_who_t(RUSAGE_SELF.rawValue), &usage)
    return Double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) + Double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6
}
