import FakeAppStore
import Foundation
import IAPCore
import NIOHTTP1
import OrderStore
import Ledger
import Testing

/// The intake's answers to bad input, over HTTP on a store of its own: no broker, no verifier
/// (what is accepted waits in the outbox), every harness stopped before the test returns.
@Suite("Intake refuses bad input with a code and keeps serving")
struct IntakeValidationTests {
    @Test func malformedBodiesGetClearErrorsAndTheIntakeKeepsServing() async throws {
        try await EdgeHarness.with { edge in
            let url = edge.intakeURL + "/v1/receipts"
            let cases: [(body: Data, status: Int, code: String)] = [
                (Data("this is not json".utf8), 400, "invalid_json"),
                (Data("[1, 2, 3]".utf8), 400, "invalid_json"),
                (Data(#"{"userId": "u1"}"#.utf8), 400, "missing_field"),
                (Data(#"{"receiptData": "AAAA"}"#.utf8), 400, "missing_field"),
                (Data(#"{"userId": "u1", "receiptData": "%%% not base64 %%%"}"#.utf8), 400, "receipt_not_base64"),
                (Data(#"{"userId": 42, "receiptData": "AAAA"}"#.utf8), 400, "invalid_field"),
                (Data(#"{"userId": "u1", "receiptData": ""}"#.utf8), 400, "missing_field"),
                (Data(#"{"userId": "u1", "receiptData": "AAAA", "orderId": ["x"]}"#.utf8), 400, "invalid_field"),
                // What a named StoreKit 1 transaction stands for goes with the transaction named.
                (Data(#"{"userId": "u1", "transactionId": "1", "productId": "p"}"#.utf8), 400, "invalid_field"),
                (Data(#"{"userId": "u1", "receiptData": "AAAA", "originalTransactionId": "1"}"#.utf8), 400, "invalid_field"),
                (Data(#"{"userId": "u1", "transactionId": "1", "originalTransactionId": "x1"}"#.utf8), 400, "invalid_field"),
            ]
            for testCase in cases {
                let answer = try await HTTP.post(url, raw: testCase.body)
                #expect(answer.status == testCase.status, "\(testCase.code): \(answer.text)")
                #expect(answer.errorCode == testCase.code, "\(answer.text)")
                #expect((answer.json["error"] as? [String: Any])?["message"] is String)
            }

            let huge = Data(#"{"userId": "u1", "receiptData": ""#.utf8) + Data(repeating: UInt8(ascii: "A"), count: 10 << 20)
                + Data(#""}"#.utf8)
            let tooLarge = try await HTTP.post(url, raw: huge)
            #expect(tooLarge.status == 413)
            #expect(tooLarge.errorCode == "body_too_large")

            let unknown = try await HTTP.get(edge.intakeURL + "/v1/receipts/not-a-submission?userId=u")
            #expect(unknown.status == 404)
            #expect(unknown.errorCode == "submission_not_found")

            let health = try await HTTP.get(edge.intakeURL + "/healthz")
            #expect(health.status == 200)
            // Still accepting real work after all that: stored with its verify message, once.
            var payload = AppReceiptTests.payload
            payload.bundleId = PipelineHarness.bundleId
            let receipt = try ReceiptMinter(authority: try FakeCertificateAuthority.generate(name: "Door")).mint(payload)
            let upload = try await HTTP.post(url, json: ["userId": "u1", "receiptData": Data(receipt).base64EncodedString()])
            #expect(upload.status == 202, "\(upload.text)")
            let id = try #require((upload.json["submissionId"] as? String).flatMap(UUID.init(uuidString:)))
            #expect(try await edge.store.status(of: id)?.state == .pending)
            #expect(try await edge.store.submissionCounts().values.reduce(0, +) == 1)
            #expect(try await edge.store.outboxBacklog() == 1)
        }
    }

    @Test func bytesThatAreNotAReceiptAreRefusedAtTheDoor() async throws {
        try await EdgeHarness.with { edge in
            var generator = SystemRandomNumberGenerator()
            for length in [1, 16, 300, 5000] {
                let junk = Data((0..<length).map { _ in UInt8.random(in: 0...255, using: &generator) })
                let answer = try await HTTP.post(
                    edge.intakeURL + "/v1/receipts", json: ["userId": "u1", "receiptData": junk.base64EncodedString()])
                #expect(answer.status == 400, "\(answer.text)")
                #expect(answer.errorCode == "receipt_malformed", "\(answer.text)")
            }
            #expect(try await edge.store.submissionCounts().isEmpty)
        }
    }

    @Test func wrongMethodsAndOutOfRangeParametersAreRefused() async throws {
        try await EdgeHarness.with { edge in
            let admin = { (path: String) in
                try await HTTP.send(
                    edge.intakeURL + path, method: .GET, body: nil, headers: ["Authorization": "Bearer \(EdgeHarness.adminToken)"])
            }
            let wrongMethod = try await HTTP.send(edge.intakeURL + "/v1/orders", method: .DELETE, body: nil)
            #expect(wrongMethod.status == 405 && wrongMethod.errorCode == "method_not_allowed", "\(wrongMethod.text)")
            #expect(wrongMethod.headers.first(name: "Allow") == "POST")
            let onTemplate = try await HTTP.send(edge.intakeURL + "/v1/receipts/\(UUID())", method: .PUT, body: nil)
            #expect(onTemplate.status == 405 && onTemplate.headers.first(name: "Allow") == "GET", "\(onTemplate.text)")
            let nowhere = try await HTTP.get(edge.intakeURL + "/v1/nowhere")
            #expect(nowhere.status == 404 && nowhere.errorCode == "not_found")

            for limit in ["0", "1001", "-5", "abc", "1.5"] {
                let answer = try await admin("/v1/admin/audit?limit=\(limit)")
                #expect(answer.status == 400 && answer.errorCode == "invalid_field", "limit=\(limit): \(answer.text)")
            }
            #expect(try await admin("/v1/admin/audit?limit=1000").status == 200)
            for before in ["0", "-1", "abc", "9223372036854775808", "1e3"] {
                let answer = try await admin("/v1/admin/audit?before=\(before)")
                #expect(answer.status == 400 && answer.errorCode == "invalid_field", "before=\(before): \(answer.text)")
            }
            // The log pages: however many entries users made, staff can walk back to every one.
            for index in 0..<5 {
                try await edge.store.reportConsumption(
                    .init(userId: "pager-\(index)", transactionId: nil, consumptionPercentage: nil, customerConsented: true))
            }
            var seen: [Int64] = []
            var next: String? = "/v1/admin/audit?limit=2"
            while let path = next {
                let page = try await admin(path)
                let entries = page.json["entries"] as? [[String: Any]] ?? []
                seen += entries.compactMap { ($0["id"] as? NSNumber)?.int64Value }
                next = (page.json["nextBefore"] as? NSNumber).map { "/v1/admin/audit?limit=2&before=\($0.int64Value)" }
            }
            #expect(seen.count == 5 && seen == seen.sorted(by: >) && Set(seen).count == 5, "\(seen)")
            let boolean = try await HTTP.send(
                edge.intakeURL + "/v1/admin/grants", method: .POST,
                body: Data(#"{"userId": "u1", "productId": "com.example.coins.60", "quantity": true, "reason": "goodwill"}"#.utf8),
                headers: ["Authorization": "Bearer \(PipelineHarness.adminToken)"])
            #expect(boolean.status == 400 && boolean.errorCode == "invalid_field", "\(boolean.text)")
        }
    }
}
