import Foundation
import Testing
import TestSupport

@Suite("iap on the command line", .teardown)
struct CommandLineTests {
    struct Run {
        var status: Int32
        var output: String
    }

    func iap(_ arguments: [String], environment: [String: String] = [:]) async throws -> Run {
        guard let binary = ProcessInfo.processInfo.environment["IAP_TEST_IAP_BINARY"], !binary.isEmpty else {
            throw ProcessDrill.MissingBinary()
        }
        let log = FileManager.default.temporaryDirectory.appendingPathComponent("iap-\(UUID().uuidString).out")
        _ = FileManager.default.createFile(atPath: log.path, contents: nil)
        let output = try FileHandle(forWritingTo: log)
        let process = Process()
        process.executableURL = URL(fileURLWithPath: binary)
        process.arguments = arguments
        process.environment = ProcessInfo.processInfo.environment.merging(environment) { $1 }
        process.standardInput = FileHandle.nullDevice
        process.standardOutput = output
        process.standardError = output
        try process.run()
        await process.exited()
        return Run(status: process.terminationStatus, output: (try? String(contentsOf: log, encoding: .utf8)) ?? "")
    }

    @Test func inspectReceiptPrintsEveryPurchaseAndRefusesJunk() async throws {
        let apple = try await VerifyReceiptClientTests.Apple.start()
        Teardown.add { await apple.stop() }
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

        let run = try await iap(["inspect", "receipt", file.path])
        #expect(run.status == 0, "\(run.output)")
        let json = try JSONSerialization.jsonObject(with: Data(run.output.utf8)) as? [String: Any]
        #expect(json?["bundleId"] as? String == PipelineHarness.bundleId)
        let listed = (json?["inApp"] as? [[String: Any]] ?? []).compactMap { $0["transactionId"] as? String }
        #expect(Set(listed) == Set(transactions))

        let junk = FileManager.default.temporaryDirectory.appendingPathComponent("junk-\(UUID().uuidString)")
        try Data("certainly not a receipt".utf8).write(to: junk)
        let refused = try await iap(["inspect", "receipt", junk.path])
        #expect(refused.status != 0)
        #expect(refused.output.contains("error:"))
    }

    @Test func inspectReceiptVerifyPassesGenuineReceiptsAndFailsOthers() async throws {
        let folder = ReceiptSignatureTests.fixtures
        for (name, digest, _) in ReceiptSignatureTests.genuine {
            let run = try await iap(["inspect", "receipt", folder.appendingPathComponent(name).path, "--verify"])
            #expect(run.status == 0, "\(name): \(run.output)")
            #expect(run.output.contains("\"digestAlgorithm\" : \"\(digest)\""), "\(name): \(run.output)")
        }
        let xcode = folder.appendingPathComponent("xcode-2023.der").path
        let untrusted = try await iap(["inspect", "receipt", xcode, "--verify"])
        #expect(untrusted.status == 1 && untrusted.output.contains("\"untrusted\""), "\(untrusted.output)")
        let root = folder.appendingPathComponent("xcode-storekit-testing.der").path
        let valid = try await iap(["inspect", "receipt", xcode, "--verify", "--xcode", root])
        #expect(valid.status == 0, "\(valid.output)")
    }

    @Test func badSettingStopsStartUpNamingTheVariable() async throws {
        let run = try await iap(["verifier", "--bundle-ids", "com.example.demo", "--concurrency", "0"])
        #expect(run.status != 0)
        #expect(run.output.contains("IAP_VERIFIER_CONCURRENCY"), "\(run.output)")
        let missing = try await iap(["verifier"])
        #expect(missing.status != 0)
        #expect(missing.output.contains("IAP_BUNDLE_IDS"), "\(missing.output)")
        let encoding = try await iap(["verifier", "--bundle-ids", "com.example.demo"], environment: ["IAP_MESSAGE_ENCODING": "gzip"])
        #expect(encoding.status != 0)
        #expect(encoding.output.contains("IAP_MESSAGE_ENCODING must be deflate or identity, got 'gzip'"), "\(encoding.output)")
        let xcode = try await iap(["verifier", "--bundle-ids", "com.example.demo"], environment: ["IAP_ENVIRONMENT": "xcode"])
        #expect(xcode.status != 0)
        #expect(xcode.output.contains("IAP_ENVIRONMENT=xcode needs Xcode's certificate in IAP_XCODE_CERTIFICATE"), "\(xcode.output)")
        let staging = try await iap(["verifier", "--bundle-ids", "com.example.demo"], environment: ["IAP_ENVIRONMENT": "staging"])
        #expect(staging.output.contains("IAP_ENVIRONMENT must be production or xcode, got 'staging'"), "\(staging.output)")
    }

    @Test func theIntakeRefusesToStartWithoutAKeyForUserTokens() async throws {
        let catalog = FileManager.default.temporaryDirectory.appendingPathComponent("catalog-\(UUID().uuidString).json")
        try JSONEncoder().encode(PipelineHarness.testCatalog).write(to: catalog)
        // Unroutable settings: a role that got past its checks would fail here, not hang.
        let base = [
            "IAP_CATALOG": catalog.path, "IAP_OPS_PORT": "off", "IAP_AUTH": "", "IAP_AUTH_HS256_SECRET": "",
            "IAP_AUTH_PUBLIC_KEY_PATH": "", "IAP_HTTP_PORT": "1", "IAP_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/",
        ]
        for role in ["intake", "orders"] {
            let run = try await iap([role], environment: base)
            #expect(run.status != 0)
            #expect(run.output.contains("IAP_AUTH_HS256_SECRET") && run.output.contains("IAP_AUTH=off"), "\(run.output)")
        }
        let short = try await iap(["intake"], environment: base.merging(["IAP_AUTH_HS256_SECRET": "short"]) { $1 })
        #expect(short.status != 0 && short.output.contains("at least 32 bytes"), "\(short.output)")
        let unknown = try await iap(["intake"], environment: base.merging(["IAP_AUTH": "maybe"]) { $1 })
        #expect(unknown.status != 0 && unknown.output.contains("IAP_AUTH must be jwt or off"), "\(unknown.output)")
        let keyFile = FileManager.default.temporaryDirectory.appendingPathComponent("key-\(UUID().uuidString).pem")
        try Data("-----BEGIN PUBLIC KEY-----\nnonsense\n-----END PUBLIC KEY-----\n".utf8).write(to: keyFile)
        let badKey = try await iap(["intake", "--auth-public-key-path", keyFile.path], environment: base)
        #expect(badKey.status != 0 && badKey.output.contains("IAP_AUTH_PUBLIC_KEY_PATH"), "\(badKey.output)")
        // The broker password has no flag: ps would show it.
        let flag = try await iap(["verifier", "--amqp-url", "amqp://user:secret@127.0.0.1/"], environment: base)
        #expect(flag.status != 0 && flag.output.contains("--amqp-url"), "\(flag.output)")
    }

    @Test func theIntakeNeedsTheBundleIdsItTakesNotificationsForAndTypedLimits() async throws {
        let catalog = FileManager.default.temporaryDirectory.appendingPathComponent("catalog-\(UUID().uuidString).json")
        try JSONEncoder().encode(PipelineHarness.testCatalog).write(to: catalog)
        let base = [
            "IAP_CATALOG": catalog.path, "IAP_OPS_PORT": "off", "IAP_AUTH": "off", "IAP_BUNDLE_IDS": "",
            "IAP_HTTP_PORT": "1", "IAP_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/", "IAP_HTTP_HOST": "127.0.0.1",
        ]
        for role in ["intake", "orders"] {
            let run = try await iap([role], environment: base)
            #expect(run.status != 0 && run.output.contains("IAP_BUNDLE_IDS"), "\(run.output)")
        }
        for (variable, value) in [("IAP_NOTIFICATION_RATE", "fast"), ("IAP_NOTIFICATION_MAX_BYTES", "10"), ("IAP_RETENTION_DAYS", "-1")] {
            let run = try await iap(["orders"], environment: base.merging(["IAP_BUNDLE_IDS": "com.example.tests", variable: value]) { $1 })
            #expect(run.status != 0 && run.output.contains(variable), "\(run.output)")
        }
    }

    /// `IAP_AUTH=off` lets a request name its user: `iap intake` and `iap orders` refuse it on
    /// any address but loopback, naming both settings; on loopback they start past that check.
    @Test func authenticationOffIsRefusedUnlessTheIntakeListensOnLoopback() async throws {
        let catalog = FileManager.default.temporaryDirectory.appendingPathComponent("catalog-\(UUID().uuidString).json")
        try JSONEncoder().encode(PipelineHarness.testCatalog).write(to: catalog)
        let base = [
            "IAP_CATALOG": catalog.path, "IAP_OPS_PORT": "off", "IAP_AUTH": "off", "IAP_BUNDLE_IDS": "",
            "IAP_HTTP_PORT": "1", "IAP_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/", "IAP_ADMIN_TOKEN": "",
        ]
        for role in ["intake", "orders"] {
            for host in ["0.0.0.0", "192.0.2.10", "::"] {
                let run = try await iap([role], environment: base.merging(["IAP_HTTP_HOST": host]) { $1 })
                #expect(run.status != 0, "\(role) \(host): \(run.output)")
                #expect(run.output.contains("IAP_AUTH=off") && run.output.contains("IAP_HTTP_HOST"), "\(role) \(host): \(run.output)")
            }
            for host in ["127.0.0.1", "localhost", "::1"] {
                let run = try await iap([role], environment: base.merging(["IAP_HTTP_HOST": host]) { $1 })
                #expect(!run.output.contains("IAP_AUTH=off lets"), "\(role) \(host): \(run.output)")
                #expect(run.output.contains("IAP_BUNDLE_IDS"), "\(role) \(host) stopped before the bundle ids: \(run.output)")
            }
        }
    }

    /// Admin and viewer tokens shorter than 32 characters are refused at start, naming the
    /// variable; `scripts/dev up` refuses them too, and its `auto` token is 32 characters.
    @Test func adminTokensShorterThan32CharactersAreRefused() async throws {
        let catalog = FileManager.default.temporaryDirectory.appendingPathComponent("catalog-\(UUID().uuidString).json")
        try JSONEncoder().encode(PipelineHarness.testCatalog).write(to: catalog)
        let base = [
            "IAP_CATALOG": catalog.path, "IAP_OPS_PORT": "off", "IAP_AUTH": "off", "IAP_BUNDLE_IDS": "",
            "IAP_HTTP_PORT": "1", "IAP_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/", "IAP_HTTP_HOST": "127.0.0.1",
            "IAP_ADMIN_PORT": "0",
        ]
        for variable in ["IAP_ADMIN_TOKEN", "IAP_VIEWER_TOKEN"] {
            for tokens in ["sixteen-chars-xx", String(repeating: "a", count: 31), "\(String(repeating: "b", count: 40)),short"] {
                let run = try await iap(["orders"], environment: base.merging([variable: tokens]) { $1 })
                #expect(run.status != 0 && run.output.contains("\(variable): each token must be at least 32 characters"), "\(run.output)")
            }
            let long = try await iap(["orders"], environment: base.merging([variable: String(repeating: "c", count: 32)]) { $1 })
            #expect(!long.output.contains("at least 32 characters"), "\(long.output)")
        }
        let dev = try String(contentsOf: repositoryRoot.appendingPathComponent("scripts/dev"), encoding: .utf8)
        #expect(dev.contains("${#admin_token} -ge 32") && dev.contains("secrets.token_hex(16)"))
    }

    @Test func inspectJWSVerifiesAndPrintsOrSaysWhy() async throws {
        let apple = try await VerifyReceiptClientTests.Apple.start()
        Teardown.add { await apple.stop() }
        let answer = try await HTTP.post(
            apple.url + "/fake/purchases", json: ["bundleId": PipelineHarness.bundleId, "productId": "com.example.coins.60"])
        let jws = try #require(answer.json["signedTransaction"] as? String)
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("jws-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        let file = folder.appendingPathComponent("transaction.jws")
        try jws.write(to: file, atomically: true, encoding: .utf8)
        let root = folder.appendingPathComponent("root.der")
        try (try await HTTP.get(apple.url + "/fake/root-certificate")).body.write(to: root)

        let run = try await iap(["inspect", "jws", "--root", root.path, "--bundle-id", PipelineHarness.bundleId, file.path])
        #expect(run.status == 0, "\(run.output)")
        let json = try JSONSerialization.jsonObject(with: Data(run.output.utf8)) as? [String: Any]
        #expect(json?["transactionId"] as? String == answer.json["transactionId"] as? String, "\(run.output)")
        #expect(json?["type"] as? String == "Consumable")
        // Apple's root by default: the fake's chain is not Apple's.
        let untrusted = try await iap(["inspect", "jws", file.path])
        #expect(untrusted.status != 0 && untrusted.output.contains("jws_untrusted_chain"), "\(untrusted.output)")
        let otherApp = try await iap(["inspect", "jws", "--root", root.path, "--bundle-id", "com.other", file.path])
        #expect(otherApp.status != 0 && otherApp.output.contains("bundle_id_mismatch"), "\(otherApp.output)")
        try "not.a.jws".write(to: file, atomically: true, encoding: .utf8)
        let junk = try await iap(["inspect", "jws", "--root", root.path, file.path])
        #expect(junk.status != 0 && junk.output.contains("jws_malformed"), "\(junk.output)")
    }
}
