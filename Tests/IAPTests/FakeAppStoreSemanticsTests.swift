import AppStore
import Crypto
import FakeAppStore
import Foundation
import NIOHTTP1
import ServiceLifecycle
import Testing
import TestSupport

/// Talks to a running fake App Store over HTTP: its `/fake/` routes, `verifyReceipt` and the
/// Server API with bearer tokens signed here (not by the verifier's client, so the fake's checks
/// are tested on their own).
private struct FakeStore {
    let url: String

    /// Runs `body` against a fake App Store of its own, in memory and in this process, on a
    /// free loopback port (no broker, no order store), and awaits its shutdown.
    static func withFake<T>(_ body: (FakeStore) async throws -> T) async throws -> T {
        let key = try FakeServerAPIKey(
            privateKeyPEM: ServerAPIKey.privateKey.pemRepresentation, keyId: ServerAPIKey.keyId, issuerId: ServerAPIKey.issuerId)
        let server = try await LoopbackServer.start(try FakeAppStore(apiKey: key).makeRouter(), name: "the fake App Store")
        let result: Result<T, any Error>
        do { result = .success(try await body(FakeStore(url: server.base))) } catch { result = .failure(error) }
        await server.group.triggerGracefulShutdown()
        _ = try? await server.task.value
        return try result.get()
    }

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
        try #require(jwsPayload(jws))
    }

    /// The notifications the fake sent, oldest first: type, subtype, status and the decoded
    /// transaction and renewal info.
    func notifications() async throws -> [Notification] {
        let history = try await api("/inApps/v1/notifications/history", method: .POST, body: Data("{}".utf8))
        #expect(history.status == 200, "\(history.text)")
        return try (history.json["notificationHistory"] as? [[String: Any]] ?? []).map { item in
            let payload = try Self.payload(try #require(item["signedPayload"] as? String))
            let data = payload["data"] as? [String: Any] ?? [:]
            return Notification(
                type: payload["notificationType"] as? String ?? "", subtype: payload["subtype"] as? String,
                status: (data["status"] as? NSNumber)?.intValue,
                transaction: try (data["signedTransactionInfo"] as? String).map(Self.payload) ?? [:],
                renewalInfo: try (data["signedRenewalInfo"] as? String).map(Self.payload) ?? [:])
        }
    }

    struct Notification {
        var type: String
        var subtype: String?
        var status: Int?
        var transaction: [String: Any]
        var renewalInfo: [String: Any]
    }

    /// Get All Subscription Statuses for `transactionId`'s chain: its status, latest
    /// transaction and renewal info.
    func subscriptionStatus(_ transactionId: String) async throws -> (status: Int?, transaction: [String: Any], renewalInfo: [String: Any]) {
        let answer = try await api("/inApps/v1/subscriptions/\(transactionId)")
        #expect(answer.status == 200, "\(answer.text)")
        let last = try #require(((answer.json["data"] as? [[String: Any]])?.first?["lastTransactions"] as? [[String: Any]])?.first)
        return (
            (last["status"] as? NSNumber)?.intValue, try Self.payload(try #require(last["signedTransactionInfo"] as? String)),
            try Self.payload(try #require(last["signedRenewalInfo"] as? String))
        )
    }

    /// `verifyReceipt`'s answer for base64 receipt data.
    func verifyReceipt(_ receiptData: Any?) async throws -> [String: Any] {
        let answer = try await HTTP.post(url + "/verifyReceipt", json: ["receipt-data": try #require(receiptData as? String)])
        #expect(answer.json["status"] as? Int == 0, "\(answer.text)")
        return answer.json
    }

    /// The transaction ids of `in_app` in a `verifyReceipt` answer.
    static func inApp(_ answer: [String: Any]) -> [String] {
        ((answer["receipt"] as? [String: Any])?["in_app"] as? [[String: Any]] ?? []).compactMap { $0["transaction_id"] as? String }
    }

    /// The transaction ids the receipt itself (the PKCS#7 payload) holds.
    static func receiptHolds(_ receiptData: Any?) throws -> [String] {
        try AppReceiptParser.parse(base64: try #require(receiptData as? String)).inApp.map(\.transactionId)
    }
}

extension BrokerTests {
    @Suite("The fake App Store keeps Apple's id semantics")
    struct FakeAppStoreSemanticsTests {
        @Test func aRestoreKeepsTheOriginalIdAndBillingPeriodUnderANewTransactionId() async throws {
            let pipeline = try await PipelineHarness.start(name: "fakerestore", roles: [])
            Teardown.add { await pipeline.stop() }
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
            Teardown.add { await pipeline.stop() }
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
            Teardown.add { await pipeline.stop() }
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
            Teardown.add { await pipeline.stop() }
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
            Teardown.add { await pipeline.stop() }
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

        /// The app's finishTransaction: a finished consumable leaves every receipt the device is
        /// issued afterwards, in its PKCS#7 payload and in verifyReceipt's answer; a receipt
        /// issued before still holds it; non-consumables and subscriptions stay.
        @Test func aFinishedConsumableLeavesTheDevicesLaterReceipts() async throws {
            try await FakeStore.withFake { fake in
                let device = UUID().uuidString
                let month = try await fake.mint(type: "auto_renewable", productId: "com.example.vip.month", extra: ["deviceId": device])
                let premium = try await fake.mint(type: "non_consumable", extra: ["deviceId": device])
                let coins = try await fake.mint(type: "consumable", productId: "com.example.coins.60", extra: ["deviceId": device])
                let ids = [month, premium, coins].map { $0["transactionId"] as? String ?? "" }
                #expect(try FakeStore.receiptHolds(coins["receiptData"]).sorted() == ids.sorted())

                for id in ids {
                    let finished = try await fake.post("/fake/purchases/\(id)/finish", status: 200)
                    #expect(finished["leavesReceipt"] as? Bool == (id == ids[2]), "\(finished)")
                }
                // Finishing again changes nothing; an unknown id is not found.
                let again = try await fake.post("/fake/purchases/\(ids[2])/finish", status: 200)
                #expect(again["finishedDateMs"] as? String != nil)
                _ = try await fake.post("/fake/purchases/2000000000000001/finish", status: 404)

                // The refreshed receipt, and the receipt of the device's next purchase, lack the coins.
                let refreshed = try await fake.post("/fake/devices/\(device)/receipt", status: 200)
                #expect(try FakeStore.receiptHolds(refreshed["receiptData"]).sorted() == [ids[0], ids[1]].sorted())
                #expect(FakeStore.inApp(try await fake.verifyReceipt(refreshed["receiptData"])).sorted() == [ids[0], ids[1]].sorted())
                let more = try await fake.mint(type: "consumable", productId: "com.example.coins.60", extra: ["deviceId": device])
                let next = try #require(more["transactionId"] as? String)
                #expect(try FakeStore.receiptHolds(more["receiptData"]).sorted() == [ids[0], ids[1], next].sorted())
                #expect(FakeStore.inApp(try await fake.verifyReceipt(more["receiptData"])).sorted() == [ids[0], ids[1], next].sorted())
                // The receipt issued before the finish is what it was.
                #expect(FakeStore.inApp(try await fake.verifyReceipt(coins["receiptData"])).sorted() == ids.sorted())
                // Apple's history still lists the finished consumable.
                #expect(try await fake.transaction(ids[2])["transactionId"] as? String == ids[2])
            }
        }

        /// A lapsed chain bought again: a new period from now in the same chain, a new purchase
        /// (transactionReason PURCHASE), SUBSCRIBED (RESUBSCRIBE); another device of the same
        /// Apple ID may buy it, with a token of its own. An upgrade carries its own token.
        @Test func aResubscriptionIsANewPurchaseInTheLapsedChain() async throws {
            try await FakeStore.withFake { fake in
                let month = try await fake.mint(
                    type: "auto_renewable", productId: "com.example.vip.month",
                    extra: ["expiresInSeconds": 3600, "appAccountToken": "9F1C2D3E-4B5A-4C6D-8E7F-0A1B2C3D4E5F"])
                let original = try #require(month["originalTransactionId"] as? String)
                #expect(try FakeStore.payload(try #require(month["signedTransaction"] as? String))["transactionReason"] as? String == "PURCHASE")

                // While the period is in force there is nothing to buy again.
                _ = try await fake.post("/fake/subscriptions/\(original)/resubscribe", status: 409)
                let expired = try await fake.post("/fake/subscriptions/\(original)/expire", status: 200)
                #expect(expired["subtype"] as? String == "VOLUNTARY" && expired["status"] as? Int == 2, "\(expired)")
                // Lapsed: no renewal brings it back.
                _ = try await fake.post("/fake/subscriptions/\(original)/renew", status: 409)

                let token = "0E1D2C3B-4A59-4687-9A0B-1C2D3E4F5A6B"
                let before = Date()
                let again = try await fake.post(
                    "/fake/subscriptions/\(original)/resubscribe", ["deviceId": "other-account", "appAccountToken": token])
                let id = try #require(again["transactionId"] as? String)
                #expect(again["originalTransactionId"] as? String == original && id != month["transactionId"] as? String)
                #expect(again["webOrderLineItemId"] as? String != month["webOrderLineItemId"] as? String)
                #expect(again["deviceId"] as? String == "other-account")
                let signed = try FakeStore.payload(try #require(again["signedTransaction"] as? String))
                #expect(signed["transactionReason"] as? String == "PURCHASE", "\(signed)")
                #expect(signed["appAccountToken"] as? String == token.lowercased(), "\(signed)")
                #expect(signed["productId"] as? String == "com.example.vip.month")
                // A period of the chain's length (an hour) from now.
                let purchased = try #require((signed["purchaseDate"] as? NSNumber)?.int64Value)
                let expires = try #require((signed["expiresDate"] as? NSNumber)?.int64Value)
                #expect(purchased >= Int64(before.timeIntervalSince1970 * 1000) - 1 && abs(expires - purchased - 3_600_000) <= 1, "\(signed)")
                // The buying device's receipt holds the chain; the status is the new period's.
                #expect(try FakeStore.receiptHolds(again["receiptData"]).contains(id))
                let status = try await fake.subscriptionStatus(try #require(month["transactionId"] as? String))
                #expect(status.status == 1 && status.transaction["transactionId"] as? String == id, "\(status)")

                let sent = try await fake.notifications().filter { $0.transaction["transactionId"] as? String == id }
                #expect(sent.map { "\($0.type) \($0.subtype ?? "")" } == ["SUBSCRIBED RESUBSCRIBE"])
                #expect(sent.first?.status == 1)

                // In force again: no second resubscription; unknown chains and one-time purchases refused.
                _ = try await fake.post("/fake/subscriptions/\(original)/resubscribe", status: 409)
                _ = try await fake.post("/fake/subscriptions/2000000000000001/resubscribe", status: 404)
                let premium = try #require(try await fake.mint(type: "non_consumable")["transactionId"] as? String)
                _ = try await fake.post("/fake/subscriptions/\(premium)/resubscribe", status: 409)
                _ = try await fake.post("/fake/subscriptions/\(original)/resubscribe", ["appAccountToken": "order-7"], status: 400)

                // An upgrade is bought with a token of its own, or none.
                let upgrade = try await fake.post(
                    "/fake/subscriptions/\(original)/upgrade", ["productId": "com.example.vip.year", "appAccountToken": token])
                let upgraded = try FakeStore.payload(try #require(upgrade["signedTransaction"] as? String))
                #expect(upgraded["appAccountToken"] as? String == token.lowercased() && upgraded["transactionReason"] as? String == "PURCHASE")
                let plain = try await fake.mint(
                    type: "auto_renewable", productId: "com.example.vip.month", extra: ["appAccountToken": token])
                let bare = try await fake.post(
                    "/fake/subscriptions/\(plain["originalTransactionId"] as? String ?? "")/upgrade", ["productId": "com.example.vip.year"])
                #expect(try FakeStore.payload(try #require(bare["signedTransaction"] as? String))["appAccountToken"] == nil)
            }
        }

        /// Apple cannot charge a renewal: DID_FAIL_TO_RENEW (GRACE_PERIOD with a grace period),
        /// status 4 in grace and 3 in billing retry, said alike by the renewal info and
        /// verifyReceipt's pending_renewal_info; a renewal then is a BILLING_RECOVERY; EXPIRED
        /// (BILLING_RETRY) when Apple gives up.
        @Test func aFailedRenewalIsRetriedThenRecoversOrExpires() async throws {
            try await FakeStore.withFake { fake in

                // With a grace period of an hour, then recovered.
                let graced = try await fake.mint(type: "auto_renewable", productId: "com.example.vip.month", extra: ["expiresInSeconds": 3600])
                let gracedId = try #require(graced["originalTransactionId"] as? String)
                let failed = try await fake.post("/fake/subscriptions/\(gracedId)/fail-renewal", ["gracePeriodSeconds": 3600], status: 200)
                #expect(failed["subtype"] as? String == "GRACE_PERIOD" && failed["status"] as? Int == 4, "\(failed)")
                let graceEnd = try #require((failed["gracePeriodExpiresDateMs"] as? String).flatMap { Int64($0) })
                let inGrace = try await fake.subscriptionStatus(gracedId)
                #expect(inGrace.status == 4, "\(inGrace)")
                #expect(inGrace.renewalInfo["isInBillingRetryPeriod"] as? Bool == true, "\(inGrace.renewalInfo)")
                #expect((inGrace.renewalInfo["gracePeriodExpiresDate"] as? NSNumber)?.int64Value == graceEnd)
                #expect((inGrace.renewalInfo["expirationIntent"] as? NSNumber)?.intValue == 2)
                // The period ended when the renewal failed.
                #expect(((inGrace.transaction["expiresDate"] as? NSNumber)?.int64Value ?? .max) <= Int64(Date().timeIntervalSince1970 * 1000))
                let pending = try #require(
                    (try await fake.verifyReceipt(graced["receiptData"])["pending_renewal_info"] as? [[String: Any]])?.first)
                #expect(pending["is_in_billing_retry_period"] as? String == "1", "\(pending)")
                #expect(pending["grace_period_expires_date_ms"] as? String == String(graceEnd), "\(pending)")
                #expect(pending["expiration_intent"] as? String == "2", "\(pending)")
                // One failure at a time.
                _ = try await fake.post("/fake/subscriptions/\(gracedId)/fail-renewal", status: 409)

                let recovered = try await fake.post("/fake/subscriptions/\(gracedId)/renew")
                let recoveredId = try #require(recovered["transactionId"] as? String)
                let renewal = try FakeStore.payload(try #require(recovered["signedTransaction"] as? String))
                #expect(renewal["transactionReason"] as? String == "RENEWAL")
                #expect(((renewal["expiresDate"] as? NSNumber)?.int64Value ?? 0) > Int64(Date().timeIntervalSince1970 * 1000))
                let healthy = try await fake.subscriptionStatus(gracedId)
                #expect(healthy.status == 1 && healthy.renewalInfo["isInBillingRetryPeriod"] == nil, "\(healthy)")
                #expect(healthy.renewalInfo["gracePeriodExpiresDate"] == nil && healthy.renewalInfo["expirationIntent"] == nil)
                let pendingAfter = try #require(
                    (try await fake.verifyReceipt(recovered["receiptData"])["pending_renewal_info"] as? [[String: Any]])?.first)
                #expect(pendingAfter["is_in_billing_retry_period"] == nil && pendingAfter["expiration_intent"] == nil, "\(pendingAfter)")

                // Without a grace period: billing retry (status 3), then Apple gives up.
                let retried = try await fake.mint(type: "auto_renewable", productId: "com.example.vip.month")
                let retriedId = try #require(retried["originalTransactionId"] as? String)
                let failing = try await fake.post("/fake/subscriptions/\(retriedId)/fail-renewal", status: 200)
                #expect(failing["subtype"] == nil && failing["status"] as? Int == 3, "\(failing)")
                let retry = try await fake.subscriptionStatus(retriedId)
                #expect(retry.status == 3 && retry.renewalInfo["isInBillingRetryPeriod"] as? Bool == true, "\(retry)")
                #expect(retry.renewalInfo["gracePeriodExpiresDate"] == nil)
                let pendingRetry = try #require(
                    (try await fake.verifyReceipt(retried["receiptData"])["pending_renewal_info"] as? [[String: Any]])?.first)
                #expect(pendingRetry["is_in_billing_retry_period"] as? String == "1" && pendingRetry["grace_period_expires_date"] == nil)
                // Resubscribing is not for a renewal Apple still retries.
                _ = try await fake.post("/fake/subscriptions/\(retriedId)/resubscribe", status: 409)
                let expired = try await fake.post("/fake/subscriptions/\(retriedId)/expire", status: 200)
                #expect(expired["subtype"] as? String == "BILLING_RETRY" && expired["status"] as? Int == 2, "\(expired)")
                _ = try await fake.post("/fake/subscriptions/\(retriedId)/expire", status: 409)
                _ = try await fake.post("/fake/subscriptions/\(retriedId)/renew", status: 409)
                _ = try await fake.post("/fake/subscriptions/\(retriedId)/fail-renewal", status: 409)
                let over = try await fake.subscriptionStatus(retriedId)
                #expect(over.status == 2 && over.renewalInfo["isInBillingRetryPeriod"] as? Bool == false, "\(over)")
                #expect((over.renewalInfo["expirationIntent"] as? NSNumber)?.intValue == 2)
                _ = try await fake.post("/fake/subscriptions/2000000000000001/fail-renewal", status: 404)
                _ = try await fake.post("/fake/subscriptions/2000000000000001/expire", status: 404)

                let sent = try await fake.notifications().map { "\($0.type) \($0.subtype ?? "") \($0.status ?? 0)" }
                #expect(
                    sent == [
                        "DID_FAIL_TO_RENEW GRACE_PERIOD 4", "DID_RENEW BILLING_RECOVERY 1", "DID_FAIL_TO_RENEW  3",
                        "EXPIRED BILLING_RETRY 2",
                    ], "\(sent)")
                let recovery = try await fake.notifications().first { $0.subtype == "BILLING_RECOVERY" }
                #expect(recovery?.transaction["transactionId"] as? String == recoveredId)
                let graceNotice = try await fake.notifications().first { $0.subtype == "GRACE_PERIOD" }
                #expect((graceNotice?.renewalInfo["gracePeriodExpiresDate"] as? NSNumber)?.int64Value == graceEnd)
            }
        }

        /// StoreKit 1 may hand the app a restore's transaction id that no receipt holds: the
        /// device's receipt lists the original transaction only.
        @Test func aRestoreMayNameATransactionTheReceiptDoesNotHold() async throws {
            try await FakeStore.withFake { fake in
                let premium = try await fake.mint(type: "non_consumable")
                let original = try #require(premium["transactionId"] as? String)
                let device = UUID().uuidString
                let restore = try await fake.post("/fake/purchases/\(original)/restore", ["deviceId": device, "inReceipt": false])
                let restored = try #require(restore["transactionId"] as? String)
                #expect(restored != original && restore["originalTransactionId"] as? String == original)
                #expect(try FakeStore.receiptHolds(restore["receiptData"]) == [original])
                #expect(FakeStore.inApp(try await fake.verifyReceipt(restore["receiptData"])) == [original])
                let refreshed = try await fake.post("/fake/devices/\(device)/receipt", status: 200)
                #expect(try FakeStore.receiptHolds(refreshed["receiptData"]) == [original])

                // A subscription restored so: latest_receipt_info lists the chain's own transactions.
                let month = try await fake.mint(type: "auto_renewable", productId: "com.example.vip.month")
                let first = try #require(month["transactionId"] as? String)
                let hidden = try await fake.post("/fake/purchases/\(first)/restore", ["inReceipt": false])
                let answer = try await fake.verifyReceipt(hidden["receiptData"])
                #expect(FakeStore.inApp(answer) == [first])
                let latest = (answer["latest_receipt_info"] as? [[String: Any]] ?? []).compactMap { $0["transaction_id"] as? String }
                #expect(latest == [first], "\(answer)")
                // The default keeps Apple's usual restore, which the receipt holds.
                let plain = try await fake.post("/fake/purchases/\(original)/restore", ["deviceId": device])
                #expect(try FakeStore.receiptHolds(plain["receiptData"]).sorted() == [original, plain["transactionId"] as? String ?? ""].sorted())
            }
        }
    }
}
