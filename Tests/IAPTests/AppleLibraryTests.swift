import Crypto
import FakeAppStore
import Foundation
import Testing
import TestSupport

extension BrokerTests {
    /// Apple's own App Store Server Library for Python, unmodified, is the referee: everything
    /// it sends the fake accepts, everything the fake answers it accepts.
    @Suite("Apple's App Store Server Library against the fake App Store")
    struct AppleLibraryTests {
        @Test func appleServerLibraryAcceptsTheFakeAppStore() async throws {
            let python = try #require(
                ProcessInfo.processInfo.environment["IAP_TEST_APPLE_PYTHON"].flatMap { $0.isEmpty ? nil : $0 },
                """
                IAP_TEST_APPLE_PYTHON must name a Python with Apple's library: `scripts/dev test` makes one \
                (.run/venv-apple); by hand: python3 -m venv .run/venv-apple && \
                .run/venv-apple/bin/pip install app-store-server-library, then \
                IAP_TEST_APPLE_PYTHON=.run/venv-apple/bin/python
                """)
            let pipeline = try await PipelineHarness.start(name: "applelib", roles: [])
            Teardown.add { await pipeline.stop() }

            let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-apple-\(UUID().uuidString)")
            try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
            defer { try? FileManager.default.removeItem(at: folder) }
            let key = folder.appendingPathComponent("key.pem")
            try Data(ServerAPIKey.privateKey.pemRepresentation.utf8).write(to: key)
            let root = folder.appendingPathComponent("root.der")
            try await HTTP.get(pipeline.fakeURL + "/fake/root-certificate").body.write(to: root)

            let (status, text) = try await runPythonScript(python, "scripts/lib/apple_library_check.py", [
                "--url", pipeline.fakeURL, "--key", key.path, "--key-id", ServerAPIKey.keyId,
                "--issuer-id", ServerAPIKey.issuerId, "--bundle-id", PipelineHarness.bundleId,
                "--app-apple-id", String(FakeAppStore.defaultAppAppleId), "--root", root.path,
            ])
            #expect(status == 0, "Apple's library refused the fake:\n\(text)")
            #expect(text.contains("\"check\": \"request_test_notification\", \"ok\": true"), "\(text)")
            for check in [
                "finish_transaction", "set_app_account_token", "get_app_transaction_info", "get_transaction_history with revision",
                "send_consumption_information", "multiseat through raw fields", "multiseat groups with the library's token",
                "external purchase token", "extend renewal dates: one, and every active subscriber", "commitment plan",
            ] {
                let passed = text.split(separator: "\n").contains {
                    $0.contains("\"check\": \"\(check)\"") && $0.contains("\"ok\": true")
                }
                #expect(passed, "\(check): \(text)")
            }
        }
    }
}
