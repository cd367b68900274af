import AsyncHTTPClient
import FakeAppStore
import Foundation
import Intake
import Pipeline
import NIOCore
import NIOHTTP1
import OrderStore
import Ledger
@testable import LedgerTestSupport
import Testing
import TestSupport

/// Bodies nobody should send: each kind is one way a client (or an attacker) gets it wrong.
struct HostileBodies {
    var random: SplitMix64

    static let fields = ["userId", "receiptData", "orderId", "transactionId", "productId"]
    static let kinds = [
        "wrong types", "huge numbers", "deep nesting", "invalid UTF-8", "invalid base64", "truncated JWS",
        "random receipt bytes", "random body bytes", "oversized ids", "odd JSON",
    ]

    mutating func bytes(_ count: Int) -> [UInt8] {
        (0..<count).map { _ in UInt8.random(in: 0...255, using: &random) }
    }

    mutating func json(_ object: [String: Any]) -> Data {
        (try? JSONSerialization.data(withJSONObject: object)) ?? Data("{}".utf8)
    }

    /// The `index`-th body: its kind and its bytes.
    mutating func body(_ index: Int) -> (kind: String, body: Data) {
        let kind = Self.kinds[index % Self.kinds.count]
        let field = Self.fields.randomElement(using: &random)!
        switch kind {
        case "wrong types":
            let values: [Any] = [42, true, [1, 2], ["nested": "object"], 3.25, NSNull(), [[String: Any]]()]
            var object: [String: Any] = ["receiptData": values.randomElement(using: &random)!]
            object[field] = values.randomElement(using: &random)!
            if object["receiptData"] is NSNull { object["receiptData"] = 7 }
            return (kind, json(object))
        case "huge numbers":
            let number = ["1e999999", "-1e400", "123456789012345678901234567890123456789", "1" + String(repeating: "0", count: 5000)]
                .randomElement(using: &random)!
            return (kind, Data(#"{"receiptData": \#(number), "\#(field)": \#(number)}"#.utf8))
        case "deep nesting":
            let depth = Int.random(in: 100...20_000, using: &random)
            let open = Bool.random(using: &random) ? "[" : "{\"a\":"
            let close = open == "[" ? "]" : "}"
            return (kind, Data((#"{"receiptData": "# + String(repeating: open, count: depth) + "1"
                + String(repeating: close, count: depth) + "}").utf8))
        case "invalid UTF-8":
            var body = Data(#"{"receiptData": "MIIB"#.utf8)
            body.append(contentsOf: [0xC3, 0x28, 0xFF, 0xFE, 0xED, 0xA0, 0x80])
            body.append(contentsOf: Data(#"", "\#(field)": "\#u{0}x"}"#.utf8))
            return (kind, body)
        case "invalid base64":
            let junk = String((0..<Int.random(in: 1...400, using: &random)).map { _ in
                Array("!@#$%^&*()<>?\\~` abcXYZ=").randomElement(using: &random)!
            })
            return (kind, json(["receiptData": "%" + junk]))
        case "truncated JWS":
            let jws = "eyJhbGciOiJFUzI1NiIsIng1YyI6WyJNSUlF" + String(repeating: "QUJD", count: Int.random(in: 1...50, using: &random))
            let cut = String(jws.prefix(Int.random(in: 1...jws.count, using: &random)))
            return (kind, json(["signedTransaction": cut, "receiptData": cut + "."]))
        case "random receipt bytes":
            return (kind, json(["receiptData": Data(bytes(Int.random(in: 1...4000, using: &random))).base64EncodedString()]))
        case "random body bytes":
            return (kind, Data(bytes(Int.random(in: 0...2000, using: &random))))
        case "oversized ids":
            let long = String(repeating: "x", count: Int.random(in: 257...100_000, using: &random))
            return (kind, json(["receiptData": "MIIB", field == "receiptData" ? "orderId" : field: long]))
        default:
            let odd = ["", "null", "true", "\"a string\"", "[]", "{", "{}", "{\"receiptData\": }", "{\"receiptData\" \"x\"}",
                "{\"receiptData\": \"AAAA\",}", String(repeating: "{\"k\":1,", count: 3000)]
            return (kind, Data(odd.randomElement(using: &random)!.utf8))
        }
    }
}

/// Hostile input the intake refuses by itself: its listeners over a store of their own, no
/// broker and no verifier, every harness stopped before the test returns.
@Suite("Hostile input at the intake", .teardown)
struct HostileIntakeInputTests {
    /// A NUL character (U+0000) in any text field is refused with 400 `invalid_field` on
    /// both stores (PostgreSQL cannot store one: it answered 503 before).
    @Test func aNULCharacterInATextFieldIsRefused() async throws {
        try await EdgeHarness.with { edge in
            let bodies: [(String, String)] = [
                ("/v1/receipts", #"{"userId": "ana", "receiptData": "AAAA\u0000"}"#),
                ("/v1/receipts", #"{"userId": "a\u0000na", "transactionId": "1"}"#),
                ("/v1/orders", #"{"userId": "ana", "productId": "com.example.coins.60\u0000"}"#),
                ("/v1/admin/grants", #"{"userId": "ana", "productId": "com.example.coins.60", "reason": "good\u0000will"}"#),
            ]
            for (path, body) in bodies {
                let answer = try await HTTP.send(
                    edge.intakeURL + path, method: .POST, body: Data(body.utf8),
                    headers: ["Authorization": "Bearer \(PipelineHarness.adminToken)", "Content-Type": "application/json"])
                #expect(answer.status == 400 && answer.errorCode == "invalid_field", "\(path) \(body): \(answer.status) \(answer.text)")
            }
            // Nor in a path or query, where an id is a look-up key (PostgreSQL answered 503).
            let targets = [
                "/v1/users/a%00na/grants", "/v1/users/ana/entitlements?userId=a%00na", "/v1/orders/%00",
                "/v1/admin/purchases/1%00", "/v1/admin/audit?limit=1%00",
            ]
            for target in targets {
                let answer = try await HTTP.send(
                    edge.intakeURL + target, method: .GET, body: nil,
                    headers: ["Authorization": "Bearer \(PipelineHarness.adminToken)"])
                #expect(answer.status == 400 && answer.errorCode == "invalid_field", "\(target): \(answer.status) \(answer.text)")
            }
            #expect(try await edge.store.submissionCounts().values.reduce(0, +) == 0)
            // A percent sign that is not %00 is still only a character of the id.
            let plain = try await HTTP.send(edge.intakeURL + "/v1/users/a%2500/grants", method: .GET, body: nil)
            #expect(plain.status == 200, "\(plain.status) \(plain.text)")
        }
    }

    /// An id the client percent-encoded in the path is the id itself: a user whose `sub` is
    /// `ana b@example.com` reads `/v1/users/ana%20b%40example.com/grants`.
    @Test func percentEncodedIdsInThePathAreDecoded() async throws {
        try await EdgeHarness.with(authentication: .jwt(try await UserTokenVerifier(key: .hs256(secret: TestTokens.secret)))) { edge in
            let token = try await TestTokens.hs256(.init("ana b@example.com"))
            for route in ["grants", "subscriptions", "entitlements"] {
                let answer = try await HTTP.send(
                    edge.intakeURL + "/v1/users/ana%20b%40example.com/" + route, method: .GET, body: nil,
                    headers: ["Authorization": "Bearer \(token)"])
                #expect(answer.status == 200, "\(route): \(answer.status) \(answer.text)")
            }
        }
    }

    /// Lengths count characters (Unicode code points), as the OpenAPI document's
    /// `maxLength` does: 256 three-byte characters are an id, 257 are not.
    @Test func idLengthsCountCharactersAsTheOpenAPIDocumentDoes() async throws {
        try await EdgeHarness.with { edge in
            for (count, status) in [(256, 202), (257, 400)] {
                let userId = String(repeating: "\u{20AC}", count: count)
                let body = try JSONSerialization.data(withJSONObject: ["userId": userId, "transactionId": "2000000000000001"])
                let answer = try await HTTP.send(edge.intakeURL + "/v1/receipts", method: .POST, body: body)
                #expect(answer.status == status, "\(count) characters: \(answer.status) \(answer.text)")
            }
        }
    }

    /// A receipt larger than any Apple issues (a PKCS#7 shell padded with a 300 KB opaque
    /// value, as a cheat would send to fill the disk) is refused with 400 before anything
    /// is stored; a real one of ordinary size still goes through.
    @Test func aPaddedReceiptShellIsRefusedBeforeStoring() async throws {
        try await EdgeHarness.with { edge in
            var payload = AppReceiptTests.payload
            payload.opaqueValue = [UInt8](repeating: 7, count: 300 * 1024)
            let shell = try ReceiptMinter(authority: try FakeCertificateAuthority.generate(name: "Shell")).mint(payload)
            let answer = try await HTTP.post(
                edge.intakeURL + "/v1/receipts",
                json: ["userId": "mallory", "receiptData": Data(shell).base64EncodedString()])
            #expect(answer.status == 400 && answer.errorCode == "invalid_field", "\(answer.status) \(answer.text)")
            // Within the size: a container whose signed content is no receipt payload (no bundle
            // id), and the receipt of another app.
            let noReceipt = TestDER.signedData(content: TestDER.set([TestDER.attribute(3, TestDER.utf8("1"))]))
            let shellAnswer = try await HTTP.post(
                edge.intakeURL + "/v1/receipts",
                json: ["userId": "mallory", "receiptData": Data(noReceipt).base64EncodedString()])
            #expect(shellAnswer.status == 400 && shellAnswer.errorCode == "receipt_malformed", "\(shellAnswer.text)")
            let otherApp = try ReceiptMinter(authority: try FakeCertificateAuthority.generate(name: "Shell")).mint(AppReceiptTests.payload)
            let otherAnswer = try await HTTP.post(
                edge.intakeURL + "/v1/receipts",
                json: ["userId": "mallory", "receiptData": Data(otherApp).base64EncodedString()])
            #expect(otherAnswer.status == 400 && otherAnswer.errorCode == "receipt_other_app", "\(otherAnswer.text)")
            #expect(try await edge.store.submissionCounts().values.reduce(0, +) == 0)
            var ours = AppReceiptTests.payload
            ours.bundleId = PipelineHarness.bundleId
            let ordinary = try ReceiptMinter(authority: try FakeCertificateAuthority.generate(name: "Shell")).mint(ours)
            let taken = try await HTTP.post(
                edge.intakeURL + "/v1/receipts",
                json: ["userId": "mallory", "receiptData": Data(ordinary).base64EncodedString()])
            #expect(taken.status == 202, "\(taken.text)")
        }
    }

    /// A chunked body (no `Content-Length`) found too large while it arrives gets 413
    /// `body_too_large`, as one announced too large does: not 500 and an error log line.
    @Test func aChunkedBodyOverTheLimitGets413() async throws {
        try await EdgeHarness.with { edge in
            for (path, size) in [("/v1/receipts", 1_100_000), ("/v1/notifications/appstore", 80_000), ("/v1/orders", 20_000)] {
                var request = HTTPClientRequest(url: edge.intakeURL + path)
                request.method = .POST
                request.headers.add(name: "Content-Type", value: "application/json")
                let chunk = ByteBuffer(repeating: UInt8(ascii: "a"), count: 8 * 1024)
                let stream = AsyncStream<ByteBuffer> { continuation in
                    for _ in 0...(size / chunk.readableBytes) { continuation.yield(chunk) }
                    continuation.finish()
                }
                request.body = .stream(stream, length: .unknown)
                let response = try await HTTPClient.shared.execute(request, timeout: .seconds(30))
                let body = try await response.body.collect(upTo: 1 << 20)
                let text = String(buffer: body)
                #expect(response.status.code == 413 && text.contains("body_too_large"), "\(path): \(response.status) \(text)")
            }
            #expect(try await HTTP.get(edge.intakeURL + "/healthz").status == 200)
        }
    }
}

extension BrokerTests {
    @Suite("Hostile input")
    struct HostileInputTests {
        @Test func everyHostileBodyGetsA4xxWithACodeAndTheIntakeKeepsServing() async throws {
            let pipeline = try await PipelineHarness.startAuthenticated(name: "hostile")
            Teardown.add { await pipeline.stop() }
            let token = try await TestTokens.hs256(.init("mallory"))
            let count = 3000
            var generator = HostileBodies(random: SplitMix64(seed: 0x1A9_2026))
            let bodies = (0..<count).map { generator.body($0) }
            // Hostile headers too: tokens cut short, and tokens that are not tokens.
            let tokens = [token, String(token.dropLast(5)), String(token.prefix(20)), "x", token + "."]

            let failures = try await withThrowingTaskGroup(of: String?.self) { group in
                var failures: [String] = []
                var next = 0
                func add(_ index: Int) {
                    group.addTask {
                        let (kind, body) = bodies[index]
                        let bearer = tokens[index % 7 == 0 ? index % tokens.count : 0]
                        let path = index % 11 == 0 ? "/v1/orders" : "/v1/receipts"
                        let answer = try await HTTP.send(
                            pipeline.intakeURL + path, method: .POST, body: body, headers: ["Authorization": "Bearer \(bearer)"])
                        guard (400..<500).contains(answer.status), let code = answer.errorCode, !code.isEmpty else {
                            return "#\(index) \(kind) \(path): \(answer.status) \(answer.text.prefix(200))"
                        }
                        return nil
                    }
                }
                for _ in 0..<16 {
                    add(next)
                    next += 1
                }
                while let result = try await group.next() {
                    if let result { failures.append(result) }
                    if next < count {
                        add(next)
                        next += 1
                    }
                }
                return failures
            }
            #expect(failures.isEmpty, "\(failures.count) of \(count) bodies were not refused with a 4xx and a code: \(failures.prefix(10))")

            #expect(try await HTTP.get(pipeline.intakeURL + "/healthz").status == 200)
            // Nothing hostile was accepted, and real work still goes through.
            #expect(try await pipeline.store.submissionCounts().values.reduce(0, +) == 0)
            let purchase = try await pipeline.mint()
            let upload = try await UserHTTP.send(
                .POST, pipeline.intakeURL + "/v1/receipts", token: token, json: ["receiptData": purchase.receiptData])
            let id = try #require(upload.json["submissionId"] as? String, "\(upload.text)")
            #expect(try await pipeline.waitForState(id, token: token)["state"] as? String == "credited")
        }
    }
}
