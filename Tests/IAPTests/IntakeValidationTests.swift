import Foundation
import NIOHTTP1
import OrderStore
import Testing

extension BrokerTests {
    @Suite("Intake refuses bad input with a code and keeps serving")
    struct IntakeValidationTests {
        @Test func malformedBodiesGetClearErrorsAndTheIntakeKeepsServing() async throws {
            let pipeline = try await PipelineHarness.start(name: "badinput")
            defer { Task { await pipeline.stop() } }
            let url = pipeline.intakeURL + "/v1/receipts"
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

            let unknown = try await HTTP.get(pipeline.intakeURL + "/v1/receipts/not-a-submission?userId=u")
            #expect(unknown.status == 404)
            #expect(unknown.errorCode == "submission_not_found")

            let health = try await HTTP.get(pipeline.intakeURL + "/healthz")
            #expect(health.status == 200)
            // Still accepting real work after all that.
            let purchase = try await pipeline.mint()
            let id = try await pipeline.upload(userId: "u1", receiptData: purchase.receiptData)
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            #expect(try await pipeline.store.submissionCounts().values.reduce(0, +) == 1)
        }
    }
}

extension BrokerTests.IntakeValidationTests {
    @Test func bytesThatAreNotAReceiptAreRefusedAtTheDoor() async throws {
        let pipeline = try await PipelineHarness.start(name: "notreceipt")
        defer { Task { await pipeline.stop() } }
        var generator = SystemRandomNumberGenerator()
        for length in [1, 16, 300, 5000] {
            let junk = Data((0..<length).map { _ in UInt8.random(in: 0...255, using: &generator) })
            let answer = try await HTTP.post(
                pipeline.intakeURL + "/v1/receipts", json: ["userId": "u1", "receiptData": junk.base64EncodedString()])
            #expect(answer.status == 400, "\(answer.text)")
            #expect(answer.errorCode == "receipt_malformed", "\(answer.text)")
        }
        #expect(try await pipeline.store.submissionCounts().isEmpty)
    }
}

extension BrokerTests.IntakeValidationTests {
    @Test func wrongMethodsAndOutOfRangeParametersAreRefused() async throws {
        let pipeline = try await PipelineHarness.start(name: "methods")
        defer { Task { await pipeline.stop() } }
        let wrongMethod = try await HTTP.send(pipeline.intakeURL + "/v1/orders", method: .DELETE, body: nil)
        #expect(wrongMethod.status == 405 && wrongMethod.errorCode == "method_not_allowed", "\(wrongMethod.text)")
        #expect(wrongMethod.headers.first(name: "Allow") == "POST")
        let onTemplate = try await HTTP.send(pipeline.intakeURL + "/v1/receipts/\(UUID())", method: .PUT, body: nil)
        #expect(onTemplate.status == 405 && onTemplate.headers.first(name: "Allow") == "GET", "\(onTemplate.text)")
        let nowhere = try await HTTP.get(pipeline.intakeURL + "/v1/nowhere")
        #expect(nowhere.status == 404 && nowhere.errorCode == "not_found")

        for limit in ["0", "1001", "-5", "abc", "1.5"] {
            let answer = try await pipeline.admin(.GET, "/v1/admin/audit?limit=\(limit)")
            #expect(answer.status == 400 && answer.errorCode == "invalid_field", "limit=\(limit): \(answer.text)")
        }
        #expect(try await pipeline.admin(.GET, "/v1/admin/audit?limit=1000").status == 200)
        let boolean = try await HTTP.send(
            pipeline.intakeURL + "/v1/admin/grants", method: .POST,
            body: Data(#"{"userId": "u1", "productId": "com.example.coins.60", "quantity": true, "reason": "goodwill"}"#.utf8),
            headers: ["Authorization": "Bearer \(PipelineHarness.adminToken)"])
        #expect(boolean.status == 400 && boolean.errorCode == "invalid_field", "\(boolean.text)")
    }
}
