@testable import AppStore
import AsyncHTTPClient
import Crypto
import Foundation
import IAPCore
@testable import FakeAppStore
import Logging
import NIOConcurrencyHelpers
import NIOCore
import ServiceLifecycle
import Testing
import TestSupport

/// The `verifyReceipt` client against the fake App Store over real HTTP, one Apple answer at a time.
@Suite("verifyReceipt statuses, classified", .teardown)
struct VerifyReceiptClientTests {
    /// A fake App Store on a free port, and a client pointed at it.
    struct Apple {
        let url: String
        let group: ServiceGroup
        let task: Task<Void, any Error>

        static func start() async throws -> Apple {
            let port = NIOLockedValueBox(0)
            let apiKey = try FakeServerAPIKey(
                privateKeyPEM: ServerAPIKey.privateKey.pemRepresentation, keyId: ServerAPIKey.keyId,
                issuerId: ServerAPIKey.issuerId)
            let application = try FakeAppStore(apiKey: apiKey).makeApplication(
                host: "127.0.0.1", port: 0, logger: TestBroker.logger,
                onServerRunning: { channel in port.withLockedValue { $0 = channel.localAddress?.port ?? 0 } })
            let group = ServiceGroup(
                configuration: .init(services: [application], gracefulShutdownSignals: [], logger: TestBroker.logger))
            let task = Task { try await group.run() }
            // Generous: at the start of a run every suite starts its servers at once on 2 cores.
            guard try await eventually(timeout: .seconds(30), { port.withLockedValue { $0 } != 0 }) else {
                throw HarnessError("the fake App Store did not start")
            }
            return Apple(url: "http://127.0.0.1:\(port.withLockedValue { $0 })", group: group, task: task)
        }

        func stop() async {
            await group.triggerGracefulShutdown()
            _ = try? await task.value
        }

        /// A client of this fake. Its default timeout is generous: these tests classify Apple's
        /// answers, and at the start of a run, with every suite starting at once on two cores,
        /// the fake's first answer took longer than 2 s (a timeout, classified transient). The
        /// test of slow answers sets its own.
        func client(bundleIds: Set<String> = [PipelineHarness.bundleId], timeout: Duration = .seconds(20))
            -> VerifyReceiptClient
        {
            VerifyReceiptClient(
                settings: .init(
                    endpoints: .init(production: url + "/verifyReceipt", sandbox: url + "/sandbox/verifyReceipt"),
                    bundleIds: bundleIds, timeout: timeout),
                httpClient: HTTPClient.shared, logger: TestBroker.logger)
        }

        func mint(environment: String = "Production") async throws -> String {
            let answer = try await HTTP.post(
                url + "/fake/purchases",
                json: ["bundleId": PipelineHarness.bundleId, "productId": "com.example.coins.60", "environment": environment])
            return try #require(answer.json["receiptData"] as? String)
        }

        func fault(_ fault: [String: Int]) async throws {
            #expect(try await HTTP.post(url + "/fake/faults", json: fault).status == 204)
        }
    }

    func request(_ receiptData: String, attempt: Int = 1) -> VerifyRequest {
        VerifyRequest(submissionId: UUID(), userId: "u", receiptData: receiptData, attempt: attempt, acceptedAt: Date())
    }

    enum Class: Equatable { case verified, rejected(String), retryLater(String), needsReview(String) }

    func classify(_ outcome: VerificationOutcome) -> Class {
        switch outcome {
        case .verified, .notification: .verified
        case .rejected(let reason, _): .rejected(reason.rawValue)
        case .retryLater(let reason, _): .retryLater(reason.rawValue)
        case .needsReview(let reason, _): .needsReview(reason.rawValue)
        }
    }

    @Test(arguments: [
        // Our request was malformed: our fault, retried (and alerted), never the user's rejection.
        (21000, Class.retryLater("apple_bad_request")),
        (21003, Class.rejected("invalid_receipt")),
        (21010, Class.rejected("invalid_receipt")),
        (21002, Class.retryLater("apple_malformed")),
        (21004, Class.retryLater("shared_secret_mismatch")),
        (21005, Class.retryLater("apple_unavailable")),
        (21009, Class.retryLater("apple_unavailable")),
        (21100, Class.retryLater("apple_retryable")),
        (21199, Class.retryLater("apple_retryable")),
        (29999, Class.retryLater("unexpected_apple_response")),
    ])
    func appleStatusIsClassified(status: Int, expected: Class) async throws {
        let apple = try await Apple.start()
        Teardown.add { await apple.stop() }
        let receipt = try await apple.mint()
        try await apple.fault(["status": status, "count": 1])
        #expect(classify(await apple.client().verify(request(receipt))) == expected)
        // The fault was for one call only: the same receipt now verifies.
        #expect(classify(await apple.client().verify(request(receipt))) == .verified)
    }

    /// The fake answers in Apple's own shape: every date twice, as `yyyy-MM-dd HH:mm:ss Etc/GMT`
    /// and as milliseconds in a string, and the two agree.
    @Test func answerDatesAreWrittenAsAppleWritesThem() async throws {
        let apple = try await Apple.start()
        Teardown.add { await apple.stop() }
        let receipt = try await apple.mint()
        let answer = try await HTTP.post(apple.url + "/verifyReceipt", json: ["receipt-data": receipt])
        let inApp = try #require((answer.json["receipt"] as? [String: Any])?["in_app"] as? [[String: Any]])
        let purchase = try #require(inApp.first)
        let text = try #require(purchase["purchase_date"] as? String)
        let milliseconds = try #require((purchase["purchase_date_ms"] as? String).flatMap(Int64.init))
        let formatter = DateFormatter()
        formatter.locale = Locale(identifier: "en_US_POSIX")
        formatter.timeZone = TimeZone(identifier: "UTC")
        formatter.dateFormat = "yyyy-MM-dd HH:mm:ss 'Etc/GMT'"
        let parsed = try #require(formatter.date(from: text), "not Apple's date format: \(text)")
        #expect(Int64(parsed.timeIntervalSince1970) == milliseconds / 1000)
        #expect(text.utf8.count == "2026-01-02 03:04:05 Etc/GMT".utf8.count)
        #expect(AppleVerifyReceiptAnswer.appleDate(Date(timeIntervalSince1970: 0)) == "1970-01-01 00:00:00 Etc/GMT")
        #expect(AppleVerifyReceiptAnswer.appleDate(Date(timeIntervalSince1970: 1_700_000_000.999)) == "2023-11-14 22:13:20 Etc/GMT")
        #expect(AppleVerifyReceiptAnswer.appleDate(Date(timeIntervalSince1970: 4_102_444_799)) == "2099-12-31 23:59:59 Etc/GMT")
    }

    @Test func internalAppleErrorFollowsTheRetryFlag() async throws {
        let apple = try await Apple.start()
        Teardown.add { await apple.stop() }
        let receipt = try await apple.mint()
        let flagged = try await HTTP.post(apple.url + "/fake/faults", json: FaultWithFlag(status: 21150, retryable: false))
        #expect(flagged.status == 204)
        #expect(classify(await apple.client().verify(request(receipt))) == .needsReview("apple_unresolvable"))
        _ = try await HTTP.post(apple.url + "/fake/faults", json: FaultWithFlag(status: 21150, retryable: true))
        #expect(classify(await apple.client().verify(request(receipt))) == .retryLater("apple_retryable"))
    }

    struct FaultWithFlag: Encodable {
        var status: Int
        var retryable: Bool
    }

    @Test(arguments: [
        (#"{"status": 21101, "is_retryable": 1}"#, true),
        (#"{"status": 21101, "is_retryable": 0}"#, false),
        (#"{"status": 21101, "is_retryable": true}"#, true),
        (#"{"status": 21101, "is_retryable": false}"#, false),
        (#"{"status": "21101", "is-retryable": "1"}"#, true),
        (#"{"status": 21101, "is-retryable": false}"#, false),
        (#"{"status": 21101}"#, nil),
    ])
    func everySpellingOfTheRetryFlagIsRead(json: String, expected: Bool?) throws {
        let response = try JSONDecoder().decode(VerifyReceiptResponse.self, from: Data(json.utf8))
        #expect(response.retryable == expected)
        #expect(Int(response.status.value) == 21101)
    }

    @Test func productionReceiptSentBackFromTheSandboxIsVerifiedInProduction() async throws {
        let apple = try await Apple.start()
        Teardown.add { await apple.stop() }
        let receipt = try await apple.mint()
        // Production wrongly says "sandbox receipt"; the sandbox answers 21008; back in production it verifies.
        try await apple.fault(["status": 21007, "count": 1])
        let outcome = await apple.client().verify(request(receipt))
        guard case .verified(let verified) = outcome else {
            Issue.record("expected verified, got \(outcome)")
            return
        }
        #expect(verified.environment == .production)
    }

    @Test(arguments: [500, 502, 503, 429])
    func httpErrorIsTransient(httpStatus: Int) async throws {
        let apple = try await Apple.start()
        Teardown.add { await apple.stop() }
        try await apple.fault(["httpStatus": httpStatus, "count": 1])
        #expect(classify(await apple.client().verify(request(try await apple.mint()))) == .retryLater("apple_unavailable"))
    }

    @Test func slowAppleIsTransient() async throws {
        let apple = try await Apple.start()
        Teardown.add { await apple.stop() }
        let receipt = try await apple.mint()
        try await apple.fault(["delayMs": 1500, "count": 1])
        let outcome = await apple.client(timeout: .milliseconds(300)).verify(request(receipt))
        #expect(classify(outcome) == .retryLater("apple_unavailable"))
    }

    @Test func unreachableAppleIsTransient() async throws {
        let client = VerifyReceiptClient(
            settings: .init(
                endpoints: .init(production: "http://127.0.0.1:9/verifyReceipt", sandbox: "http://127.0.0.1:9/sandbox"),
                bundleIds: [PipelineHarness.bundleId], timeout: .seconds(2)),
            httpClient: HTTPClient.shared, logger: TestBroker.logger)
        #expect(classify(await client.verify(request("AAAA"))) == .retryLater("apple_unavailable"))
    }

    @Test func repeated21002NeedsAPersonAfterTheLimitButOtherFailuresDoNotCount() async throws {
        let apple = try await Apple.start()
        Teardown.add { await apple.stop() }
        let receipt = try await apple.mint()
        // Attempt 5 after four timeouts: the first 21002 is still retried.
        try await apple.fault(["status": 21002, "count": 1])
        #expect(classify(await apple.client().verify(request(receipt, attempt: 5))) == .retryLater("apple_malformed"))
        var third = request(receipt, attempt: 3)
        third.malformedAnswers = 2
        try await apple.fault(["status": 21002, "count": 1])
        // Apple cannot say whether the receipt or Apple is at fault: a person looks; never rejected.
        #expect(classify(await apple.client().verify(third)) == .needsReview("apple_malformed"))
    }

    @Test func sandboxReceiptFallsBackAndProductionOnlyBundlesAreChecked() async throws {
        let apple = try await Apple.start()
        Teardown.add { await apple.stop() }
        let outcome = await apple.client().verify(request(try await apple.mint(environment: "Sandbox")))
        guard case .verified(let receipt) = outcome else {
            Issue.record("expected verified, got \(outcome)")
            return
        }
        #expect(receipt.environment == .sandbox)
        #expect(receipt.purchases.first?.environment == .sandbox)
        #expect(receipt.purchases.first?.quantity == 1)

        let wrongApp = await apple.client(bundleIds: ["com.example.other"]).verify(request(try await apple.mint()))
        #expect(classify(wrongApp) == .rejected("bundle_id_mismatch"))
    }

    @Test func unknownReceiptIsInvalid() async throws {
        let apple = try await Apple.start()
        Teardown.add { await apple.stop() }
        let unknown = Data("FAKE-RECEIPT-V1:no-such-receipt".utf8).base64EncodedString()
        #expect(classify(await apple.client().verify(request(unknown))) == .rejected("invalid_receipt"))
    }
}
