import Crypto
import FakeAppStore
import Foundation
import NIOHTTP1
import Testing

/// Talks to a running fake App Store over HTTP: its `/fake/` routes, `verifyReceipt` and the
/// Server API with bearer tokens signed here (not by the verifier's client, so the fake's checks
/// are tested on their own).
private struct FakeStore {
    let url: String

    /// Mints, restores or renews at the fake and returns its 201 answer.
    func post(_ path: String, _ body: [String: any Sendable]? = nil, status: Int = 201) async throws -> [String: Any] {
        let answer = try await HTTP.send(
            url + path, method: .POST, body: try body.map { try JSONSerialization.data(withJSONObject: $0) })
        #expect(answer.status == status, "POST \(path): \(answer.status) \(answer.text)")
        return answer.json
    }

    func mint(type: String, productId: String = "com.example.premium", extra: [String: any Sendable] = [:]) async throws
        -> [String: Any]
    {
        try await post(
            "/fake/purchases",
            ["bundleId": PipelineHarness.bundleId, "productId": productId, "type": type].merging(extra) { $1 })
    }

    /// A Server API call with `token` (a valid one by default).
    func api(_ path: String, method: HTTPMethod = .GET, body: Data? = nil, token: String? = nil) async throws -> HTTP.Answer {
        try await HTTP.send(
            url + path, method: method, body: body,
            headers: ["Authorization": "Bearer \(try token ?? Self.token())"])
    }

    /// The transaction as Get Transaction Info decodes it (the JWS payload, unverified: the
    /// fake's signatures are tested elsewhere).
    func transaction(_ transactionId: String) async throws -> [String: Any] {
        let answer = try await api("/inApps/v1/transactions/\(transactionId)")
        #expect(answer.status == 200, "\(answer.text)")
        return try Self.payload(try #require(answer.json["signedTransactionInfo"] as? String))
    }

    /// A bearer token like Apple's libraries make: ES256, `kid`, `typ` JWT, `bid`, `iss`, `aud`,
    /// `exp`; `iat` only when given.
    static func token(
        key: P256.Signing.PrivateKey = ServerAPIKey.privateKey, issuedAt: Date? = nil, expires: Date = Date() + 300
    ) throws -> String {
        var claims: [String: Any] = [
            "bid": PipelineHarness.bundleId, "iss": ServerAPIKey.issuerId, "aud": "appstoreconnect-v1",
            "exp": Int(expires.timeIntervalSince1970),
        ]
        if let issuedAt { claims["iat"] = Int(issuedAt.timeIntervalSince1970) }
        let header = base64URL(try JSONSerialization.data(withJSONObject: ["alg": "ES256", "kid": ServerAPIKey.keyId, "typ": "JWT"]))
        let input = header + "." + base64URL(try JSONSerialization.data(withJSONObject: claims))
        return input + "." + base64URL(try key.signature(for: Data(input.utf8)).rawRepresentation)
    }

    static func base64URL(_ data: Data) -> String {
        data.base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }

    /// The payload of a compact JWS.
    static func payload(_ jws: String) throws -> [String: Any] {
        var part = String(jws.split(separator: ".")[1]).replacingOccurrences(of: "-", with: "+")
            .replacingOccurrences(of: "_", with: "/")
        while part.count % 4 != 0 { part += "=" }
        let data = try #require(Data(base64Encoded: part))
        return try #require(try JSONSerialization.jsonObject(with: data) as? [String: Any])
    }
}

extension BrokerTests {
    @Suite("The fake App Store keeps Apple's id semantics")
    struct FakeAppStoreSemanticsTests {
        @Test func aRestoreKeepsTheOriginalIdAndBillingPeriodUnderANewTransactionId() async throws {
            let pipeline = try await PipelineHarness.start(name: "fakerestore", roles: [])
            defer { Task { await pipeline.stop() } }
            let fake = FakeStore(url: pipeline.fakeURL)

            let premium = try await fake.mint(type: "non_consumable")
            let restore = try await fake.post("/fake/purchases/\(premium["transactionId"] as? String ?? "")/restore", ["deviceId": "ipad-2"])
            #expect(restore["transactionId"] as? String != premium["transactionId"] as? String)
            #expect(restore["originalTransactionId"] as? String == premium["transactionId"] as? String)
            #expect(restore["deviceId"] as? String == "ipad-2")
            // The new device's receipt holds the restored transaction, as Apple's verifyReceipt says.
            let verified = try await HTTP.post(
                pipeline.fakeURL + "/verifyReceipt", json: ["receipt-data": try #require(restore["receiptData"] as? String)])
            let inApp = (verified.json["receipt"] as? [String: Any])?["in_app"] as? [[String: Any]] ?? []
            #expect(inApp.map { $0["transaction_id"] as? String } == [restore["transactionId"] as? String], "\(verified.text)")
            #expect(inApp.first?["original_transaction_id"] as? String == premium["transactionId"] as? String)

            // A subscription period restored keeps that period's webOrderLineItemId.
            let month = try await fake.mint(type: "auto_renewable", productId: "com.example.vip.month")
            let restoredMonth = try await fake.post("/fake/purchases/\(month["transactionId"] as? String ?? "")/restore")
            #expect(restoredMonth["webOrderLineItemId"] as? String == month["webOrderLineItemId"] as? String)
            #expect(month["webOrderLineItemId"] as? String != nil)
            #expect(restoredMonth["originalTransactionId"] as? String == month["transactionId"] as? String)
            let signed = try FakeStore.payload(try #require(restoredMonth["signedTransaction"] as? String))
            #expect(signed["webOrderLineItemId"] as? String == month["webOrderLineItemId"] as? String)
            #expect(signed["transactionReason"] as? String == "PURCHASE" && signed["expiresDate"] != nil, "\(signed)")

            // Apple restores no consumable; an unknown id is not found.
            let coins = try await fake.mint(type: "consumable", productId: "com.example.coins.60")
            let refused = try await fake.post("/fake/purchases/\(coins["transactionId"] as? String ?? "")/restore", status: 409)
            #expect(((refused["error"] as? [String: Any])?["message"] as? String)?.contains("consumable") == true, "\(refused)")
            _ = try await fake.post("/fake/purchases/2000000000000001/restore", status: 404)
        }

        @Test func aRenewalIsANewBillingPeriodAndSendsDidRenew() async throws {
            let pipeline = try await PipelineHarness.start(name: "fakerenew", roles: [])
            defer { Task { await pipeline.stop() } }
            let fake = FakeStore(url: pipeline.fakeURL)
            let month = try await fake.mint(
                type: "auto_renewable", productId: "com.example.vip.month", extra: ["expiresInSeconds": 3600])
            let original = try #require(month["originalTransactionId"] as? String)
            let first = try FakeStore.payload(try #require(month["signedTransaction"] as? String))

            let renewal = try await fake.post("/fake/subscriptions/\(original)/renew")
            #expect(renewal["originalTransactionId"] as? String == original)
            #expect(renewal["transactionId"] as? String != month["transactionId"] as? String)
            #expect(renewal["webOrderLineItemId"] as? String != month["webOrderLineItemId"] as? String)
            #expect(renewal["deviceId"] as? String == month["deviceId"] as? String)
            let signed = try FakeStore.payload(try #require(renewal["signedTransaction"] as? String))
            #expect(signed["transactionReason"] as? String == "RENEWAL", "\(signed)")
            // One more period of the same length (an hour) after the last one (dates are kept
            // to the millisecond, so allow for rounding).
            let firstExpiry = try #require((first["expiresDate"] as? NSNumber)?.int64Value)
            let nextExpiry = try #require((signed["expiresDate"] as? NSNumber)?.int64Value)
            #expect(abs(nextExpiry - (firstExpiry + 3_600_000)) <= 2, "\(firstExpiry) → \(nextExpiry)")
            // The device's receipt holds the whole chain.
            let verified = try await HTTP.post(
                pipeline.fakeURL + "/verifyReceipt", json: ["receipt-data": try #require(renewal["receiptData"] as? String)])
            let inApp = (verified.json["receipt"] as? [String: Any])?["in_app"] as? [[String: Any]] ?? []
            #expect(
                inApp.compactMap { $0["transaction_id"] as? String }
                    == [month["transactionId"] as? String, renewal["transactionId"] as? String].compactMap { $0 },
                "\(verified.text)")

            // DID_RENEW about the new period was sent (Get Notification History lists every attempt).
            let history = try await fake.api(
                "/inApps/v1/notifications/history", method: .POST, body: Data(#"{"notificationType": "DID_RENEW"}"#.utf8))
            let payloads = try (history.json["notificationHistory"] as? [[String: Any]] ?? []).map {
                try FakeStore.payload(try #require($0["signedPayload"] as? String))
            }
            let renewed = try payloads.map { notification in
                let data = notification["data"] as? [String: Any] ?? [:]
                return try FakeStore.payload(try #require(data["signedTransactionInfo"] as? String))["transactionId"] as? String
            }
            #expect(payloads.map { $0["notificationType"] as? String } == ["DID_RENEW"], "\(history.text)")
            #expect(renewed == [renewal["transactionId"] as? String])

            // Only auto-renewable chains renew.
            let premium = try await fake.mint(type: "non_consumable")
            _ = try await fake.post("/fake/subscriptions/\(premium["transactionId"] as? String ?? "")/renew", status: 409)
            _ = try await fake.post("/fake/subscriptions/2000000000000001/renew", status: 404)
        }

        @Test func aRefundRevokesWhatAppleRevokesAndAReversalRestoresIt() async throws {
            let pipeline = try await PipelineHarness.start(name: "fakerefund", roles: [])
            defer { Task { await pipeline.stop() } }
            let fake = FakeStore(url: pipeline.fakeURL)

            // A non-consumable: the purchase and every restore of it.
            let premium = try #require(try await fake.mint(type: "non_consumable")["transactionId"] as? String)
            let restore = try #require(try await fake.post("/fake/purchases/\(premium)/restore")["transactionId"] as? String)
            let again = try #require(try await fake.post("/fake/purchases/\(premium)/restore")["transactionId"] as? String)
            let refund = try await fake.post("/fake/purchases/\(restore)/refund", status: 200)
            #expect(refund["revokedTransactionIds"] as? [String] == [premium, restore, again], "\(refund)")
            for id in [premium, restore, again] {
                #expect(try await fake.transaction(id)["revocationDate"] != nil, "\(id) not revoked")
            }
            _ = try await fake.post("/fake/purchases/\(again)/notify", ["notificationType": "REFUND_REVERSED"], status: 200)
            for id in [premium, restore, again] {
                #expect(try await fake.transaction(id)["revocationDate"] == nil, "\(id) still revoked")
            }

            // A subscription: the refunded billing period (with its restore), not the next one.
            let month = try await fake.mint(type: "auto_renewable", productId: "com.example.vip.month")
            let first = try #require(month["transactionId"] as? String)
            let restoredFirst = try #require(try await fake.post("/fake/purchases/\(first)/restore")["transactionId"] as? String)
            let next = try #require(try await fake.post("/fake/subscriptions/\(first)/renew")["transactionId"] as? String)
            let cancelled = try await fake.post("/fake/purchases/\(first)/cancel", status: 200)
            #expect(cancelled["revokedTransactionIds"] as? [String] == [first, restoredFirst], "\(cancelled)")
            #expect(try await fake.transaction(next)["revocationDate"] == nil)

            // A consumable: itself only.
            let device = UUID().uuidString
            let coins = try #require(
                try await fake.mint(type: "consumable", productId: "com.example.coins.60", extra: ["deviceId": device])["transactionId"]
                    as? String)
            let more = try #require(
                try await fake.mint(type: "consumable", productId: "com.example.coins.60", extra: ["deviceId": device])["transactionId"]
                    as? String)
            let coinRefund = try await fake.post("/fake/purchases/\(coins)/cancel", status: 200)
            #expect(coinRefund["revokedTransactionIds"] as? [String] == [coins])
            #expect(try await fake.transaction(more)["revocationDate"] == nil)
        }

        @Test func aFamilySharedPurchaseSaysSoInItsJWSAndInVerifyReceipt() async throws {
            let pipeline = try await PipelineHarness.start(name: "fakefamily", roles: [])
            defer { Task { await pipeline.stop() } }
            let fake = FakeStore(url: pipeline.fakeURL)
            let shared = try await fake.mint(type: "non_consumable", extra: ["familyShared": true])
            let own = try await fake.mint(type: "non_consumable")
            #expect(shared["originalTransactionId"] as? String == shared["transactionId"] as? String)
            #expect(shared["transactionId"] as? String != own["transactionId"] as? String)
            let signed = try FakeStore.payload(try #require(shared["signedTransaction"] as? String))
            #expect(signed["inAppOwnershipType"] as? String == "FAMILY_SHARED", "\(signed)")
            #expect(try FakeStore.payload(try #require(own["signedTransaction"] as? String))["inAppOwnershipType"] as? String == "PURCHASED")
            let verified = try await HTTP.post(
                pipeline.fakeURL + "/verifyReceipt", json: ["receipt-data": try #require(shared["receiptData"] as? String)])
            let inApp = (verified.json["receipt"] as? [String: Any])?["in_app"] as? [[String: Any]] ?? []
            #expect(inApp.first?["in_app_ownership_type"] as? String == "FAMILY_SHARED", "\(verified.text)")

            // Apple shares only non-consumables and subscriptions; an appAccountToken is a UUID,
            // lowercased in the JWS.
            _ = try await fake.post(
                "/fake/purchases",
                ["bundleId": PipelineHarness.bundleId, "productId": "com.example.coins.60", "familyShared": true], status: 400)
            let badToken = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases",
                json: ["bundleId": PipelineHarness.bundleId, "productId": "com.example.coins.60", "appAccountToken": "order-42"])
            #expect(badToken.status == 400, "\(badToken.text)")
            let token = try await fake.mint(
                type: "auto_renewable", productId: "com.example.vip.month",
                extra: ["appAccountToken": "9F1C2D3E-4B5A-4C6D-8E7F-0A1B2C3D4E5F", "familyShared": true])
            let tokenJWS = try FakeStore.payload(try #require(token["signedTransaction"] as? String))
            #expect(tokenJWS["appAccountToken"] as? String == "9f1c2d3e-4b5a-4c6d-8e7f-0a1b2c3d4e5f", "\(tokenJWS)")
        }

        @Test func aBearerTokenWithoutIatIsAcceptedAndABadOneRefused() async throws {
            let pipeline = try await PipelineHarness.start(name: "faketoken", roles: [])
            defer { Task { await pipeline.stop() } }
            let fake = FakeStore(url: pipeline.fakeURL)
            let id = try #require(try await fake.mint(type: "consumable", productId: "com.example.coins.60")["transactionId"] as? String)
            let path = "/inApps/v1/transactions/\(id)"
            // Apple's own libraries send no iat.
            #expect(try await fake.api(path, token: try FakeStore.token()).status == 200)
            #expect(try await fake.api(path, token: try FakeStore.token(issuedAt: Date())).status == 200)
            // Another key, an expired token, one living over an hour, an iat in the future: 401.
            for token in [
                try FakeStore.token(key: P256.Signing.PrivateKey()),
                try FakeStore.token(issuedAt: Date() - 600, expires: Date() - 60),
                try FakeStore.token(issuedAt: Date(), expires: Date() + 7200),
                try FakeStore.token(expires: Date() + 7200),
                try FakeStore.token(issuedAt: Date() + 600, expires: Date() + 900),
                "not-a-token",
            ] {
                #expect(try await fake.api(path, token: token).status == 401, "\(token)")
            }
        }
    }
}
