import AppStore
import AsyncHTTPClient
import FakeAppStore
import Crypto
import Foundation
import IAPCore
import NIOHTTP1
import OrderStore
import Ledger
import Testing
import TestSupport

extension PipelineHarness {
    /// Mints a purchase and returns the fake's whole answer (receipt, signed transaction, order id).
    func mintStoreKit2(
        productId: String = "com.example.coins.60", environment: String = "Production", type: String? = nil,
        appAccountToken: String? = nil
    ) async throws -> Purchase {
        var body = ["bundleId": Self.bundleId, "productId": productId, "environment": environment]
        body["type"] = type
        body["appAccountToken"] = appAccountToken
        let answer = try await HTTP.post(fakeURL + "/fake/purchases", json: body)
        #expect(answer.status == 201, "\(answer.text)")
        return try JSONDecoder().decode(Purchase.self, from: answer.body)
    }

    /// Uploads any body; returns the submission id of a 202.
    func upload(_ body: [String: String]) async throws -> String {
        let answer = try await HTTP.post(intakeURL + "/v1/receipts", json: body)
        #expect(answer.status == 202, "\(answer.text)")
        return try #require(answer.json["submissionId"] as? String, "\(answer.text)")
    }

    func grantState(of transactionId: String, user: String) async throws -> String? {
        try await grants(of: user).first { $0["transactionId"] as? String == transactionId }?["state"] as? String
    }
}

extension BrokerTests {
    @Suite("StoreKit 2: signed transactions, the Server API, notifications")
    struct StoreKit2Tests {
        @Test func aSignedTransactionIsVerifiedLocallyAndCredited() async throws {
            let pipeline = try await PipelineHarness.start(name: "sk2jws")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mintStoreKit2()
            let id = try await pipeline.upload(["userId": "sofia", "signedTransaction": try #require(purchase.signedTransaction)])
            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "credited", "\(status)")
            #expect((status["transactions"] as? [[String: Any]])?.first?["transactionId"] as? String == purchase.transactionId)
            #expect(try await pipeline.grantState(of: purchase.transactionId, user: "sofia") == "active")
            // Verified locally: Apple (the fake) was not asked.
            let stats = try await HTTP.get(pipeline.fakeURL + "/fake/stats").json
            #expect(stats["serverAPICalls"] as? Int == 0 && stats["verifyReceiptCalls"] as? Int == 0, "\(stats)")

            // Signed by anyone but Apple: refused, with the reason.
            let stranger = try FakeCertificateAuthority.generate(name: "Not Apple")
            let forged = try stranger.signJWS(
                JWSTransactionDecodedPayload(
                    transactionId: "2999999999999999", originalTransactionId: "2999999999999999",
                    bundleId: PipelineHarness.bundleId, productId: "com.example.coins.300", environment: "Production",
                    purchaseDate: Date().appleMilliseconds, quantity: 1, type: "Consumable", signedDate: Date().appleMilliseconds))
            let refused = try await pipeline.waitForState(try await pipeline.upload(["userId": "sofia", "signedTransaction": forged]))
            #expect(refused["state"] as? String == "rejected" && refused["reason"] as? String == "jws_untrusted_chain", "\(refused)")
            let malformed = try await HTTP.post(
                pipeline.intakeURL + "/v1/receipts", json: ["userId": "sofia", "signedTransaction": "abc.def"])
            #expect(malformed.status == 400 && malformed.errorCode == "jws_malformed", "\(malformed.text)")
        }

        @Test func aTransactionIdAloneIsLookedUpWithTheServerAPI() async throws {
            let pipeline = try await PipelineHarness.start(name: "sk2txid")
            Teardown.add { await pipeline.stop() }
            // An id is a lookup: what proves these purchases tom's is their token naming his orders.
            let production = try await pipeline.mintStoreKit2(
                appAccountToken: try await pipeline.createOrder(userId: "tom", productId: "com.example.coins.60"))
            let sandbox = try await pipeline.mintStoreKit2(
                productId: "com.example.coins.120", environment: "Sandbox",
                appAccountToken: try await pipeline.createOrder(userId: "tom", productId: "com.example.coins.120"))
            let first = try await pipeline.waitForState(try await pipeline.upload(["userId": "tom", "transactionId": production.transactionId]))
            #expect(first["state"] as? String == "credited", "\(first)")
            // Production does not know a sandbox id (4040010): asked again in the sandbox.
            let second = try await pipeline.waitForState(try await pipeline.upload(["userId": "tom", "transactionId": sandbox.transactionId]))
            #expect(second["state"] as? String == "credited" && second["environment"] as? String == "Sandbox", "\(second)")
            let unknown = try await pipeline.waitForState(try await pipeline.upload(["userId": "tom", "transactionId": "2000000000000042"]))
            #expect(unknown["state"] as? String == "rejected" && unknown["reason"] as? String == "proof_required", "\(unknown)")
            #expect(try await pipeline.grants(of: "tom").count == 2)

            // Apple down (503) is transient, never a rejection.
            let later = try await pipeline.mintStoreKit2(
                appAccountToken: try await pipeline.createOrder(userId: "tom", productId: "com.example.coins.60"))
            try await pipeline.injectFault(["httpStatus": 503, "count": 2])
            let retried = try await pipeline.waitForState(
                try await pipeline.upload(["userId": "tom", "transactionId": later.transactionId]), timeout: .seconds(30))
            #expect(retried["state"] as? String == "credited" && (retried["attempts"] as? Int ?? 0) >= 2, "\(retried)")
        }

        @Test func aReceiptIsVerifiedThroughTheServerAPI() async throws {
            let pipeline = try await PipelineHarness.start(name: "sk2receipt", receiptsThroughServerAPI: true)
            Teardown.add { await pipeline.stop() }
            let device = UUID().uuidString
            // The receipt's signature is not checked on this route: its purchases are the uploader's
            // by their tokens (applicationUsername naming her orders), not by the receipt's word.
            _ = try await pipeline.mint(
                productId: "com.example.coins.60",
                token: ("applicationUsername", try await pipeline.createOrder(userId: "uma", productId: "com.example.coins.60")),
                deviceId: device)
            let second = try await pipeline.mint(
                productId: "com.example.coins.120",
                token: ("applicationUsername", try await pipeline.createOrder(userId: "uma", productId: "com.example.coins.120")),
                deviceId: device)
            let status = try await pipeline.waitForState(try await pipeline.upload(userId: "uma", receiptData: second.receiptData))
            #expect(status["state"] as? String == "credited", "\(status)")
            #expect((status["transactions"] as? [Any])?.count == 2, "\(status)")
            // The Server API answered, not verifyReceipt.
            let stats = try await HTTP.get(pipeline.fakeURL + "/fake/stats").json
            #expect(stats["verifyReceiptCalls"] as? Int == 0 && (stats["serverAPICalls"] as? Int ?? 0) >= 1, "\(stats)")
            #expect(try await pipeline.grants(of: "uma").count == 2)
        }

        @Test func aRefundNotificationRevokesTheGrantAndAReversalRestoresIt() async throws {
            let pipeline = try await PipelineHarness.start(name: "sk2refund")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mintStoreKit2()
            let id = try await pipeline.upload(["userId": "vera", "signedTransaction": try #require(purchase.signedTransaction)])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")

            // Apple refunds: the fake signs a REFUND notification and POSTs it to the intake.
            let refund = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            let revoked = try await eventually(timeout: .seconds(20)) {
                try await pipeline.grantState(of: purchase.transactionId, user: "vera") == "revoked"
            }
            let seen = try await pipeline.grantState(of: purchase.transactionId, user: "vera")
            #expect(revoked, "the app still sees the grant as \(seen ?? "missing")")

            // The same notification delivered again (Apple retries) applies once.
            let client = try AppStoreServerAPIClient(
                settings: ServerAPIKey.settings(fakeURL: pipeline.fakeURL), httpClient: .shared, logger: TestBroker.logger)
            let history = try await client.notificationHistory(
                from: Date().addingTimeInterval(-3600), to: Date().addingTimeInterval(60), onlyFailures: false,
                paginationToken: nil, in: .production)
            let payload = try #require(history.notificationHistory?.last?.signedPayload)
            for _ in 0..<2 {
                let again = try await HTTP.post(pipeline.intakeURL + "/v1/notifications/appstore", json: ["signedPayload": payload])
                #expect(again.status == 200, "\(again.text)")
            }
            let reversed = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/notify", json: ["notificationType": "REFUND_REVERSED"])
            #expect(reversed.status == 200, "\(reversed.text)")
            let restored = try await eventually(timeout: .seconds(20)) {
                try await pipeline.grantState(of: purchase.transactionId, user: "vera") == "active"
            }
            #expect(restored)
            let applied = try await eventually(timeout: .seconds(20)) {
                try await pipeline.store.notifications(ofTransaction: purchase.transactionId).count == 3
            }
            // First Apple's ONE_TIME_CHARGE of the purchase, which named no order: kept for its
            // buyer's upload, which came next.
            let notifications = try await pipeline.store.notifications(ofTransaction: purchase.transactionId)
            #expect(applied && notifications.map(\.type) == ["ONE_TIME_CHARGE", "REFUND", "REFUND_REVERSED"], "\(notifications)")
            #expect(notifications.map(\.outcome) == ["owner_unknown", "revoked", "restored"], "\(notifications)")

            // A notification that is not Apple's is refused at the intake, never stored.
            let junk = try await HTTP.post(pipeline.intakeURL + "/v1/notifications/appstore", json: ["signedPayload": "x"])
            #expect(junk.status == 400 && junk.errorCode == "jws_malformed", "\(junk.text)")
        }

        @Test func subscriptionNotificationsKeepItsStateAndRenewalsAreCredited() async throws {
            let pipeline = try await PipelineHarness.start(name: "sk2subs")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mintStoreKit2(productId: "com.example.vip.month", type: "auto_renewable")
            let id = try await pipeline.upload(["userId": "walt", "signedTransaction": try #require(purchase.signedTransaction)])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            for (type, subtype, expected) in [
                ("DID_FAIL_TO_RENEW", "GRACE_PERIOD", "grace_period"), ("EXPIRED", "VOLUNTARY", "expired"),
                ("SUBSCRIBED", "RESUBSCRIBE", "active"),
            ] {
                let sent = try await HTTP.post(
                    pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/notify",
                    json: ["notificationType": type, "subtype": subtype])
                #expect(sent.status == 200, "\(sent.text)")
                let reached = try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.subscriptions(ofUser: "walt").first?.state.rawValue == expected
                }
                let subscriptions = try await pipeline.store.subscriptions(ofUser: "walt")
                #expect(reached, "\(type): \(subscriptions)")
            }
            let answer = try await HTTP.get(pipeline.intakeURL + "/v1/users/walt/subscriptions")
            let subscriptions = answer.json["subscriptions"] as? [[String: Any]]
            #expect(subscriptions?.first?["state"] as? String == "active", "\(answer.text)")
            #expect(subscriptions?.first?["originalTransactionId"] as? String == purchase.originalTransactionId)
        }
    }
}

extension BrokerTests.StoreKit2Tests {
    /// A notification Apple could not deliver (our endpoint was down) is found with Get
    /// Notification History and re-delivered by `iap admin reconcile-notifications`.
    @Test func missedNotificationsAreReconciledFromApplesHistory() async throws {
        let pipeline = try await PipelineHarness.start(name: "sk2reconcile")
        Teardown.add { await pipeline.stop() }
        let purchase = try await pipeline.mintStoreKit2()
        let id = try await pipeline.upload(["userId": "xena", "signedTransaction": try #require(purchase.signedTransaction)])
        #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
        // Our endpoint "down": the refund notification fails to arrive.
        _ = try await HTTP.post(pipeline.fakeURL + "/fake/config", json: ["notificationURL": "http://127.0.0.1:1/down"])
        _ = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/refund", json: [String: String]())
        #expect(try await pipeline.grantState(of: purchase.transactionId, user: "xena") == "active")

        let binary = try #require(ProcessInfo.processInfo.environment["IAP_TEST_IAP_BINARY"])
        let keyFile = FileManager.default.temporaryDirectory.appendingPathComponent("key-\(UUID().uuidString).p8")
        try ServerAPIKey.privateKey.pemRepresentation.write(to: keyFile, atomically: true, encoding: .utf8)
        let run = try await CommandLineTests().iap(
            ["admin", "reconcile-notifications", "--notification-url", pipeline.intakeURL + "/v1/notifications/appstore"],
            environment: [
                "IAP_APPSTORE_KEY_PATH": keyFile.path, "IAP_APPSTORE_KEY_ID": ServerAPIKey.keyId,
                "IAP_APPSTORE_ISSUER_ID": ServerAPIKey.issuerId, "IAP_APPSTORE_API_URL": pipeline.fakeURL,
                "IAP_APPSTORE_SANDBOX_API_URL": pipeline.fakeURL + "/sandbox", "IAP_BUNDLE_IDS": PipelineHarness.bundleId,
            ])
        _ = binary
        #expect(run.status == 0, "\(run.output)")
        #expect(run.output.contains(#""environment": "Production", "failedNotifications": 1, "redelivered": 1"#), "\(run.output)")
        let revoked = try await eventually(timeout: .seconds(20)) {
            try await pipeline.grantState(of: purchase.transactionId, user: "xena") == "revoked"
        }
        #expect(revoked)
    }
}
