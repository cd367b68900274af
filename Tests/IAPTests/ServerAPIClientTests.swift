@testable import AppStore
import AsyncHTTPClient
import Crypto
import Foundation
import IAPCore
import NIOHTTP1
import Testing
import TestSupport

/// The App Store Server API client against the fake: Apple's answers and errors, the bearer
/// token, and the pacing that keeps us under Apple's rate limits.
@Suite("App Store Server API client", .teardown)
struct ServerAPIClientTests {
    func client(_ apple: VerifyReceiptClientTests.Apple, key: P256.Signing.PrivateKey = ServerAPIKey.privateKey, rateShare: Double = 1)
        throws -> AppStoreServerAPIClient
    {
        var settings = ServerAPIKey.settings(fakeURL: apple.url)
        settings.privateKeyPEM = key.pemRepresentation
        settings.rateShare = rateShare
        return try AppStoreServerAPIClient(settings: settings, httpClient: .shared, logger: TestBroker.logger)
    }

    func mint(_ apple: VerifyReceiptClientTests.Apple, environment: String = "Production", device: String? = nil) async throws
        -> (transactionId: String, orderId: String)
    {
        var body = ["bundleId": PipelineHarness.bundleId, "productId": "com.example.coins.60", "environment": environment]
        body["deviceId"] = device
        let answer = try await HTTP.post(apple.url + "/fake/purchases", json: body)
        return (try #require(answer.json["transactionId"] as? String), try #require(answer.json["orderId"] as? String))
    }

    /// The fake App Store, stopped at teardown, and a client of it.
    func started() async throws -> (VerifyReceiptClientTests.Apple, AppStoreServerAPIClient) {
        let apple = try await VerifyReceiptClientTests.Apple.start()
        Teardown.add { await apple.stop() }
        return (apple, try client(apple))
    }

    /// The error `call` throws, nil when it succeeds or throws something else.
    func failure(_ call: () async throws -> Void) async -> ServerAPIError? {
        do {
            try await call()
            return nil
        } catch let error as ServerAPIError {
            return error
        } catch {
            return nil
        }
    }

    func kind(_ call: () async throws -> Void) async -> ServerAPIError.Kind? {
        await failure(call)?.kind
    }

    @Test func callsAnswerInApplesShapesAndErrorsAreTyped() async throws {
        let (apple, api) = try await started()
        let device = UUID().uuidString
        let first = try await mint(apple, device: device)
        _ = try await mint(apple, device: device)
        let sandbox = try await mint(apple, environment: "Sandbox")

        #expect(try await api.transactionInfo(first.transactionId, in: .production).split(separator: ".").count == 3)
        let history = try await api.transactionHistory(first.transactionId, revision: nil, in: .production)
        #expect(history.signedTransactions?.count == 2 && history.hasMore == false)
        let order = try await api.lookUpOrder(first.orderId, in: .production)
        #expect(order.valid && order.signedTransactions.count == 1)
        #expect(try await api.lookUpOrder("NOSUCHORDER", in: .production).valid == false)
        #expect(try await api.requestTestNotification(in: .production).isEmpty == false)

        // Not in production (4040010): the caller asks the sandbox, which knows it.
        #expect(await kind { _ = try await api.transactionInfo(sandbox.transactionId, in: .production) } == .notFound)
        #expect(try await api.transactionInfo(sandbox.transactionId, in: .sandbox).isEmpty == false)
        // Apple failing is transient; an id Apple never issues never leaves this process.
        _ = try await HTTP.post(apple.url + "/fake/faults", json: ["httpStatus": 503, "count": 1])
        #expect(await kind { _ = try await api.transactionInfo(first.transactionId, in: .production) } == .transient)
        #expect(await kind { _ = try await api.transactionInfo("../../etc/passwd", in: .production) } == .invalid)
        // A token signed with another key is refused: 401.
        let stranger = try client(apple, key: P256.Signing.PrivateKey())
        #expect(await kind { _ = try await stranger.transactionInfo(first.transactionId, in: .production) } == .unauthorized)

        // Refund history lists what Apple refunded; consumption information is accepted (202).
        _ = try await HTTP.post(apple.url + "/fake/purchases/\(first.transactionId)/cancel", json: [String: String]())
        let refunds = try await api.refundHistory(first.transactionId, revision: nil, in: .production)
        #expect(refunds.signedTransactions?.count == 1)
        try await api.sendConsumptionInformation(
            first.transactionId,
            .init(customerConsented: true, deliveryStatus: "DELIVERED", sampleContentProvided: false, consumptionPercentage: 100_000, refundPreference: "DECLINE"),
            in: .production)
        let sent = try await HTTP.get(apple.url + "/fake/consumption/\(first.transactionId)")
        #expect(sent.json["deliveryStatus"] as? String == "DELIVERED", "\(sent.text)")
    }

    @Test func callsArePacedBelowApplesLimitsAndWaitOutA429() async throws {
        let apple = try await VerifyReceiptClientTests.Apple.start()
        Teardown.add { await apple.stop() }
        let id = try await mint(apple, environment: "Sandbox").transactionId
        // Sandbox transaction info: 10 % of 50/s, times a share of 0.2: 1 request per second,
        // after a burst of one.
        let api = try client(apple, rateShare: 0.2)
        let clock = ContinuousClock()
        let start = clock.now
        for _ in 0..<4 { _ = try await api.transactionInfo(id, in: .sandbox) }
        let paced = clock.now - start
        // What pacing guarantees is the floor; how soon a loaded machine serves past it is not
        // the client's to promise, so no ceiling is asserted.
        #expect(paced >= .milliseconds(2900), "4 calls at 1/s took \(paced)")

        // After a 429, the next call waits for Apple's Retry-After (the fake says: in one second).
        let fast = try client(apple)
        _ = try await HTTP.post(apple.url + "/fake/faults", json: ["httpStatus": 429, "count": 1])
        // Timed from before the refused call: the fake dates its Retry-After when it answers,
        // at least a second after this (a loaded machine may take a while to hand the 429 back).
        let before = clock.now
        #expect(await kind { _ = try await fast.transactionInfo(id, in: .sandbox) } == .transient)
        _ = try await fast.transactionInfo(id, in: .sandbox)
        #expect(clock.now - before >= .milliseconds(950), "the call after a 429 went out after \(clock.now - before)")
    }

    /// Finish Transaction (API 1.20) sets the state the app's `finishTransaction` sets: the
    /// finished consumable leaves the device's refreshed receipt, the other purchase stays.
    /// Finishing again is no error; an id the environment never issued is `notFound`.
    @Test func finishTransactionTakesAFinishedConsumableOffLaterReceipts() async throws {
        let (apple, api) = try await started()
        let device = UUID().uuidString
        let finished = try await mint(apple, device: device).transactionId
        let kept = try await mint(apple, device: device).transactionId
        func onTheReceipt() async throws -> Set<String> {
            let refreshed = try await HTTP.post(apple.url + "/fake/devices/\(device)/receipt", json: [String: String]())
            let receipt = try AppReceiptParser.parse(base64: try #require(refreshed.json["receiptData"] as? String))
            return Set(receipt.inApp.map(\.transactionId))
        }
        #expect(try await onTheReceipt() == [finished, kept])

        try await api.finishTransaction(finished, in: .production)
        #expect(try await onTheReceipt() == [kept])
        try await api.finishTransaction(finished, in: .production)

        let sandbox = try await mint(apple, environment: "Sandbox").transactionId
        #expect(await kind { try await api.finishTransaction(sandbox, in: .production) } == .notFound)
        try await api.finishTransaction(sandbox, in: .sandbox)
        #expect(await kind { try await api.finishTransaction("2000000000000001", in: .production) } == .notFound)
        #expect(await kind { try await api.finishTransaction("../1/finish", in: .production) } == .invalid)
    }

    /// Set App Account Token (API 1.16) binds a purchase to another account token: Get
    /// Transaction Info and the next renewal carry it. Apple refuses a renewal's id (not an
    /// original transaction id: 4000187), a Family Sharing purchase (4000185) and a token that
    /// is no UUID (4000183).
    @Test func setAppAccountTokenRebindsAPurchaseAndItsRenewals() async throws {
        let (apple, api) = try await started()
        let minted = try await HTTP.post(
            apple.url + "/fake/purchases",
            json: [
                "bundleId": PipelineHarness.bundleId, "productId": "com.example.vip.month", "type": "auto_renewable",
                "appAccountToken": "11111111-2222-4333-8444-555555555555",
            ])
        let original = try #require(minted.json["originalTransactionId"] as? String)
        func token(_ transactionId: String) async throws -> String? {
            jwsPayload(try await api.transactionInfo(transactionId, in: .production))?["appAccountToken"] as? String
        }
        #expect(try await token(original) == "11111111-2222-4333-8444-555555555555")

        let rebound = try #require(UUID(uuidString: "A1B2C3D4-E5F6-4A7B-8C9D-0E1F2A3B4C5D"))
        try await api.setAppAccountToken(rebound, originalTransactionId: original, in: .production)
        #expect(try await token(original) == "a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d")
        let renewal = try await HTTP.post(apple.url + "/fake/subscriptions/\(original)/renew", json: [String: String]())
        let renewed = try #require(renewal.json["transactionId"] as? String)
        #expect(try await token(renewed) == "a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d")

        func refusal(_ call: () async throws -> Void) async -> Int? {
            await failure(call).flatMap { $0.kind == .invalid ? $0.errorCode : nil }
        }
        #expect(await refusal { try await api.setAppAccountToken(rebound, originalTransactionId: renewed, in: .production) } == 4_000_187)
        let family = try await HTTP.post(
            apple.url + "/fake/purchases",
            raw: Data(
                #"{"bundleId": "\#(PipelineHarness.bundleId)", "productId": "com.example.premium", "type": "non_consumable", "familyShared": true}"#
                    .utf8))
        let shared = try #require(family.json["originalTransactionId"] as? String)
        #expect(await refusal { try await api.setAppAccountToken(rebound, originalTransactionId: shared, in: .production) } == 4_000_185)
        let notAUUID = try await HTTP.send(
            apple.url + "/inApps/v1/transactions/\(original)/appAccountToken", method: .PUT,
            body: Data(#"{"appAccountToken": "not-a-uuid"}"#.utf8), headers: ["Authorization": "Bearer \(try await api.bearerToken())"])
        #expect(notAUUID.status == 400 && notAUUID.json["errorCode"] as? Int == 4_000_183, "\(notAUUID.text)")
        #expect(await kind { try await api.setAppAccountToken(rebound, originalTransactionId: "2000000000000001", in: .production) } == .notFound)
    }

    /// Extend a Subscription Renewal Date (API 1.1) and for every active subscriber (1.7):
    /// Apple's answer read (the period's new end), the same request identifier extending
    /// once, Apple's refusals by kind, a mass extension's status polled until complete, and
    /// an unknown mass request `notFound` (4040009).
    @Test func renewalDatesAreExtendedOneAtATimeAndForEverySubscriber() async throws {
        let (apple, api) = try await started()
        func subscribe(_ extra: String = "") async throws -> String {
            let minted = try await HTTP.post(
                apple.url + "/fake/purchases",
                raw: Data(
                    #"{"bundleId": "\#(PipelineHarness.bundleId)", "productId": "com.example.vip.month", "type": "auto_renewable"\#(extra)}"#
                        .utf8))
            return try #require(minted.json["originalTransactionId"] as? String, "\(minted.text)")
        }
        let original = try await subscribe()
        let before = try #require(jwsPayload(try await api.transactionInfo(original, in: .production))?["expiresDate"] as? Double)
        let first = try await api.extendRenewalDate(
            originalTransactionId: original, days: 4, reasonCode: 3, requestIdentifier: "r-1", in: .production)
        #expect(first.success == true && first.originalTransactionId == original && first.webOrderLineItemId != nil)
        let effective = try #require(first.effectiveDate)
        #expect(abs(effective.timeIntervalSince1970 * 1000 - (before + 4 * 86_400_000)) < 1)
        let again = try await api.extendRenewalDate(
            originalTransactionId: original, days: 4, reasonCode: 3, requestIdentifier: "r-1", in: .production)
        #expect(again.effectiveDate == effective, "the same request extended twice")

        func refusal(_ original: String, days: Int = 1, reasonCode: Int = 1, request: String = "r-x") async -> Int? {
            await failure {
                _ = try await api.extendRenewalDate(
                    originalTransactionId: original, days: days, reasonCode: reasonCode, requestIdentifier: request, in: .production)
            }.flatMap { $0.kind == .invalid ? $0.errorCode : nil }
        }
        #expect(await refusal(original, days: 0) == 4_000_009)
        #expect(await refusal(original, reasonCode: 4) == 4_000_010)
        #expect(await refusal(original, request: "") == 4_000_011)
        #expect(await refusal(try await subscribe(#", "familyShared": true"#)) == 4_030_007)
        #expect(await refusal(try await subscribe(#", "inAppOwnershipType": "ASSIGNED", "quantity": 2"#)) == 4_030_028)
        #expect(await refusal(try await subscribe(#", "offerType": 1, "offerDiscountType": "FREE_TRIAL", "price": 0"#)) == 4_030_004)
        _ = try await api.extendRenewalDate(originalTransactionId: original, days: 1, reasonCode: 1, requestIdentifier: "r-2", in: .production)
        #expect(await refusal(original, request: "r-3") == 4_030_005, "a third extension within 365 days")
        let unknown = await failure {
            _ = try await api.extendRenewalDate(
                originalTransactionId: "2000000000000001", days: 1, reasonCode: 1, requestIdentifier: "r-4", in: .production)
        }
        #expect(unknown?.kind == .notFound && unknown?.errorCode == 4_040_005)

        let other = try await subscribe()
        let request = UUID().uuidString.lowercased()
        let echoed = try await api.massExtendRenewalDate(
            productId: "com.example.vip.month", days: 2, reasonCode: 3, requestIdentifier: request, storefrontCountryCodes: ["USA"],
            in: .production)
        #expect(echoed == request)
        var status: AppStoreServerAPIClient.MassExtensionStatus?
        let complete = try await eventually(timeout: .seconds(20)) {
            status = try await api.massExtensionStatus(productId: "com.example.vip.month", requestIdentifier: request, in: .production)
            return status?.complete == true
        }
        #expect(complete && status?.completeDate != nil, "\(String(describing: status))")
        // `other` extended; `original` (twice this year) and the free trial refused; a family
        // member's access and an assigned seat are no purchases of their own.
        #expect(status?.succeededCount == 1 && status?.failedCount == 2, "\(String(describing: status))")
        let extended = try #require(jwsPayload(try await api.transactionInfo(other, in: .production))?["expiresDate"] as? Double)
        #expect(extended > Date().timeIntervalSince1970 * 1000 + 31 * 86_400_000)
        let missing = await failure {
            _ = try await api.massExtensionStatus(productId: "com.example.vip.year", requestIdentifier: request, in: .production)
        }
        #expect(missing?.kind == .notFound && missing?.errorCode == 4_040_009)
        #expect(await kind { _ = try await api.massExtensionStatus(productId: "../x", requestIdentifier: request, in: .production) } == .invalid)
    }

    /// Every transaction names its customer's app transaction (API 1.15), and Get App
    /// Transaction Info (1.17) answers it, signed, for any of the customer's transaction ids or
    /// the app transaction id itself: one per account (the fake's device).
    @Test func appTransactionInfoNamesTheCustomersDownload() async throws {
        let (apple, api) = try await started()
        let device = UUID().uuidString
        let first = try await mint(apple, device: device).transactionId
        let second = try await mint(apple, device: device).transactionId
        let stranger = try await mint(apple).transactionId
        func appTransactionId(ofTransaction id: String) async throws -> String? {
            jwsPayload(try await api.transactionInfo(id, in: .production))?["appTransactionId"] as? String
        }
        let customer = try #require(try await appTransactionId(ofTransaction: first))
        #expect(try await appTransactionId(ofTransaction: second) == customer)
        #expect(try await appTransactionId(ofTransaction: stranger) != customer)

        for id in [second, customer] {
            let download = try #require(jwsPayload(try await api.appTransactionInfo(id, in: .production)))
            #expect(download["appTransactionId"] as? String == customer)
            #expect(download["bundleId"] as? String == PipelineHarness.bundleId)
            #expect(download["receiptType"] as? String == "Production")
        }
        #expect(await kind { _ = try await api.appTransactionInfo("2000000000000001", in: .production) } == .notFound)
        #expect(await kind { _ = try await api.appTransactionInfo(first, in: .sandbox) } == .notFound)
    }
}
