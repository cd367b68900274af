import Foundation
import IAPCore
import Messaging
import Relay
import OrderStore
import Ledger
import Testing
import TestSupport

extension BrokerTests {
    /// Customer service's console in a real browser (headless Chromium through Selenium):
    /// a viewer finds a held purchase by Apple's order id and may not grant it, an operator
    /// grants it and the app sees the grant, a form without its CSRF token is refused, a dead
    /// letter is redriven and credited.
    @Suite("Customer service console in a browser")
    struct ConsoleBrowserTests {
        @Test func consoleDrivenInHeadlessChromium() async throws {
            let python = try #require(
                ProcessInfo.processInfo.environment["IAP_TEST_CONSOLE_PYTHON"].flatMap { $0.isEmpty ? nil : $0 },
                """
                IAP_TEST_CONSOLE_PYTHON must name a Python with Selenium, and Debian's chromium and chromium-driver \
                must be installed: `scripts/dev test` makes both (.run/venv-console); by hand: \
                apt-get install chromium chromium-driver && python3 -m venv .run/venv-console && \
                .run/venv-console/bin/pip install selenium, then IAP_TEST_CONSOLE_PYTHON=.run/venv-console/bin/python
                """)
            let pipeline = try await PipelineHarness.start(name: "console", separateAdmin: true)
            Teardown.add { await pipeline.stop() }
            let adminURL = try #require(pipeline.adminURL)

            // A purchase of a product the catalog lacks: held (unknown_product), the upload needs review.
            let held = try await pipeline.mint(productId: "com.example.gems.legacy")
            let heldUpload = try await pipeline.upload(userId: "carol@example.com", receiptData: held.receiptData)
            #expect(try await pipeline.waitForState(heldUpload)["state"] as? String == "needs_review")
            let orderId = try #require(held.orderId)

            // An accepted upload whose message ended up dead (as after an operator's purge or a bug).
            let (request, connection) = try await pipeline.parkedUpload(by: "dave")
            #expect(try await eventually { try await connection.queueStatus(pipeline.names.verifyDead).messageCount == 1 })
            await connection.close()

            // A user whose id, and a product whose id (minted at the fake, as a cheat could name
            // one), would close an attribute or open a tag if escaped per Character: the user
            // owns a credited purchase (a revoke form on their page) and a held one (the front
            // page's queue shows both ids).
            let hostileUser = "\"\u{301}><button form=note-form formaction=/admin/actions/revoke id=injected>Save</button>"
            let hostileProduct = "com.example.\u{600}<b id=injected-product>x</b>\">\u{301}"
            let credited = try await pipeline.mint()
            let creditedUpload = try await pipeline.upload(userId: hostileUser, receiptData: credited.receiptData)
            #expect(try await pipeline.waitForState(creditedUpload)["state"] as? String == "credited")
            let hostileHeld = try await pipeline.mint(productId: hostileProduct)
            let hostileUpload = try await pipeline.upload(userId: hostileUser, receiptData: hostileHeld.receiptData)
            #expect(try await pipeline.waitForState(hostileUpload)["state"] as? String == "needs_review")

            // A subscriber, whose renewal date the operator extends at Apple (the fake).
            let subscribed = try await pipeline.mintStoreKit2(productId: "com.example.vip.month", type: "auto_renewable")
            let subscriberUpload = try await pipeline.upload(["userId": "sue", "signedTransaction": try #require(subscribed.signedTransaction)])
            #expect(try await pipeline.waitForState(subscriberUpload)["state"] as? String == "credited")

            let out = repositoryRoot.appendingPathComponent(".run/console")
            let (status, text) = try await runPythonScript(python, "scripts/lib/console_check.py", [
                "--admin-url", adminURL, "--intake-url", pipeline.intakeURL,
                "--operator-token", PipelineHarness.adminToken, "--viewer-token", PipelineHarness.viewerToken,
                "--order-id", orderId, "--held-user", "carol@example.com", "--held-transaction", held.transactionId,
                "--product", "com.example.coins.60", "--dead-user", "dave",
                "--dead-submission", request.submissionId.uuidString, "--out", out.path,
                "--hostile-user", hostileUser, "--hostile-product", hostileProduct,
                "--hostile-transaction", credited.transactionId,
                "--subscriber", "sue", "--subscription", subscribed.originalTransactionId,
                "--subscription-product", "com.example.vip.month",
            ])
            #expect(status == 0, "the console failed in the browser:\n\(text)")
            #expect(!text.contains("\"ok\": false"), "\(text)")

            // What the browser did, as the ledger and the audit log hold it.
            let grants = try await pipeline.store.grants(ofTransaction: held.transactionId)
            #expect(grants.map(\.userId) == ["carol@example.com"])
            #expect(grants.map(\.state) == [.active])
            let audit = try await pipeline.store.auditLog(limit: 100)
            #expect(audit.contains { $0.action == "grant_manual" && $0.actor == "Olga (operator)" && $0.reason.contains("ticket 4711") })
            #expect(audit.contains { $0.action == "note" && $0.subject == "user:carol@example.com" })
            #expect(!audit.contains { $0.reason.contains("must not be stored") })
            #expect(audit.contains { $0.action == "dead_letters_redriven" && $0.details?.contains("\"count\":\"1\"") == true })
            #expect(try await pipeline.status(request.submissionId.uuidString)["state"] as? String == "credited")
            // The note form's token, posted to the revoke action, revoked nothing.
            #expect(try await pipeline.store.grants(ofTransaction: credited.transactionId).map(\.state) == [.active])
            #expect(!audit.contains { $0.action == "grant_revoked" })
            #expect(
                audit.contains {
                    $0.action == "renewal_date_extended" && $0.subject == "subscription:\(subscribed.originalTransactionId)"
                        && $0.actor == "Olga (operator)"
                })
            #expect(audit.contains { $0.action == "renewal_extension_requested" && $0.reason.contains("every subscriber") })
            for name in [
                "console-hostile-text", "console-viewer-refused", "console-customer", "console-mass-extend", "console-csrf-refused",
                "console-redriven",
            ] {
                #expect(FileManager.default.fileExists(atPath: out.appendingPathComponent(name + ".png").path), "\(name).png")
            }
        }
    }
}
