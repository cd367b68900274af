import AppStore
import FakeAppStore
import Finisher
import Foundation
import IAPCore
import Intake
import NIOHTTP1
@testable import OrderStore
@testable import Store
import Ledger
import NIOConcurrencyHelpers
import Testing
import TestSupport

/// Requests no well-behaved client sends, as raw bytes on loopback, against the intake's
/// listeners alone (no broker): each class is answered with a 4xx that costs its sender,
/// never a 5xx or an error-level log line.
@Suite("Hostile input at the edges", .serialized, .timeLimit(.minutes(3)))
struct HostileInputEdgeTests {
    /// Transfer codings the intake does not read: llhttp refuses a request whose final coding is
    /// not `chunked`; `gzip, chunked` parses, and its bytes are still no JSON or form.
    static let unknownTransferCodings = ["gzip", "xchunked", "chunked, gzip", "gzip, chunked", "identity", "chunked, chunked"]

    /// One raw request on a connection of its own: the status and the whole answer.
    static func raw(
        _ url: String, _ method: String, _ path: String, headers: [String] = [], body: String = ""
    ) async throws -> (status: Int, text: String) {
        let client = try RawHTTPClient(port: EdgeHarness.port(url))
        let head = (["\(method) \(path) HTTP/1.1", "Host: 127.0.0.1"] + headers).joined(separator: "\r\n")
        try client.send(head + "\r\n\r\n" + body)
        let reply = try await client.receiveOffThePool(timeout: 10)
        let status = reply.split(separator: " ", maxSplits: 2).dropFirst().first.flatMap { Int($0) } ?? 0
        return (status, reply)
    }

    /// A chunked body of `text` in one chunk.
    static func chunked(_ text: String) -> String {
        String(text.utf8.count, radix: 16) + "\r\n" + text + "\r\n0\r\n\r\n"
    }

    // MARK: - Unknown transfer codings

    /// Every listener (the app's routes, Apple's notifications, the admin routes on their own
    /// port, the console's forms) answers an unknown `Transfer-Encoding` with a 4xx, never a
    /// 500 and never an error-level log line; where a route reads the body, with 400 `bad_request`.
    @Test func anUnknownTransferCodingIsA400OnEveryListener() async throws {
        try await EdgeHarness.with(separateAdmin: true) { edge in
            let admin = try #require(edge.adminURL)
            let token = "Authorization: Bearer \(EdgeHarness.adminToken)"
            let targets: [(url: String, path: String, headers: [String], expected: Set<Int>)] = [
                (edge.intakeURL, "/v1/receipts", ["Content-Type: application/json"], [400]),
                (edge.intakeURL, "/v1/orders", ["Content-Type: application/json"], [400]),
                (edge.intakeURL, "/v1/notifications/appstore", ["Content-Type: application/json"], [400]),
                (admin, "/v1/admin/grants", ["Content-Type: application/json", token], [400]),
                // A stranger without the token is refused by the authorization first, and counted there.
                (admin, "/v1/admin/grants", ["Content-Type: application/json"], [401, 429]),
                (admin, "/admin/login", ["Content-Type: application/x-www-form-urlencoded"], [400, 429]),
            ]
            for coding in Self.unknownTransferCodings {
                for target in targets {
                    let body = coding.hasSuffix("chunked") ? Self.chunked("{\"userId\":\"ana\"}") : "{\"userId\":\"ana\"}"
                    let answer = try await Self.raw(
                        target.url, "POST", target.path, headers: target.headers + ["Transfer-Encoding: \(coding)"], body: body)
                    // NIO's parser refuses some codings (`chunked, gzip`) with the head itself: a bare
                    // 400 that closes the connection before any route sees the request.
                    let refusedByTheParser = answer.status == 400 && answer.text.contains("Connection: close")
                        && answer.text.hasSuffix("Content-Length: 0\r\n\r\n")
                    #expect(
                        target.expected.contains(answer.status) || refusedByTheParser,
                        "\(coding) \(target.path): \(answer.text.prefix(300))")
                    if answer.status == 400 && !target.path.hasPrefix("/admin/") && !refusedByTheParser {
                        #expect(answer.text.contains("\"bad_request\""), "\(coding) \(target.path): \(answer.text.prefix(300))")
                    }
                    #expect(answer.status < 500, "\(coding) \(target.path): \(answer.text.prefix(300))")
                }
            }
            #expect(edge.errorLines.withLockedValue { $0 }.isEmpty, "\(edge.errorLines.withLockedValue { $0 })")
            #expect(try await HTTP.get(edge.intakeURL + "/healthz").status == 200)
        }
    }

    /// Unknown transfer codings from one address spend that address's budget: past the
    /// notification failures' burst they are answered 429 before their bodies are read, and
    /// past the per-address burst on the app's routes too; 400 of each (eight times the larger
    /// burst, few enough to finish within the bound beside the whole suite), no 5xx.
    @Test func unknownTransferCodingsFromOneAddressReach429WithinTheirBurst() async throws {
        let limits = IntakeLimits(
            perUser: nil, perAddress: RateLimit(perSecond: 1, burst: 50), clientAddresses: EdgeHarness.behindLocalProxy,
            notifications: nil, notificationFailuresPerAddress: RateLimit(perSecond: 1, burst: 20))
        try await EdgeHarness.with(limits: limits) { edge in
            for (path, burst) in [("/v1/notifications/appstore", 20), ("/v1/receipts", 50)] {
                var statuses: [Int: Int] = [:]
                var first429: (index: Int, after: Duration)?
                let began = ContinuousClock.now
                for index in 0..<400 {
                    let answer = try await Self.raw(
                        edge.intakeURL, "POST", path,
                        headers: ["Content-Type: application/json", "X-Real-IP: 198.51.100.9", "Transfer-Encoding: gzip"],
                        body: "{}")
                    statuses[answer.status, default: 0] += 1
                    if answer.status == 429, first429 == nil { first429 = (index, ContinuousClock.now - began) }
                }
                #expect(Set(statuses.keys).isSubset(of: [400, 429]), "\(path): \(statuses)")
                // The burst, plus what the rate (one a second) refilled before the first 429.
                let allowed = first429.map { burst + Int($0.after.components.seconds) + 1 } ?? 0
                #expect(
                    first429.map { $0.index <= allowed } ?? false,
                    "\(path): first 429 at \(String(describing: first429)), \(allowed) allowed: \(statuses)")
            }
            #expect(edge.errorLines.withLockedValue { $0 }.isEmpty, "\(edge.errorLines.withLockedValue { $0 })")
        }
    }

    /// Every class of refused request of the third round, 100 from one address each (its own
    /// `X-Real-IP`): an unknown transfer coding to `/v1/receipts`, unsigned containers, body-less
    /// notifications and confusable actors from the admin, on the admin listener. Each is a 400
    /// until the address's refusal budget (burst 20 here, and what the rate of one a second
    /// refilled meanwhile) is spent, then 429 with `Retry-After`; no 5xx. Afterwards a good
    /// request from the same address is served as if nothing happened: an upload, Apple's
    /// notification, the admin's grant.
    @Test func everyRefusedClassFromOneAddressReaches429WithinTheRefusalBudget() async throws {
        let limits = IntakeLimits(
            perUser: nil, perAddress: nil, clientAddresses: EdgeHarness.behindLocalProxy, notifications: nil,
            notificationFailuresPerAddress: nil, refusalsPerAddress: RateLimit(perSecond: 1, burst: 20))
        try await EdgeHarness.with(limits: limits, separateAdmin: true) { edge in
            let adminURL = try #require(edge.adminURL)
            let shell = Data(TestDER.signedData(content: Self.payload())).base64EncodedString()
            let admin = "Authorization: Bearer \(EdgeHarness.adminToken)"
            let classes: [(name: String, url: String, path: String, headers: [String], body: String)] = [
                ("unknown transfer coding", edge.intakeURL, "/v1/receipts", ["Content-Type: application/json", "Transfer-Encoding: xchunked"], "{}"),
                ("unsigned containers", edge.intakeURL, "/v1/receipts", ["Content-Type: application/json"],
                    #"{"userId": "mallory", "receiptData": "\#(shell)"}"#),
                ("body-less notifications", edge.intakeURL, "/v1/notifications/appstore", ["Content-Type: application/json", "Content-Length: 0"], ""),
                ("confusable actors", adminURL, "/v1/admin/grants", ["Content-Type: application/json", admin],
                    #"{"userId": "ana", "productId": "com.example.coins.60", "reason": "r", "actor": "\#u{0430}pple"}"#),
            ]
            for (number, kind) in classes.enumerated() {
                let address = "X-Real-IP: 198.51.100.\(number + 20)"
                var headers = kind.headers + [address]
                if !kind.body.isEmpty, !headers.contains(where: { $0.hasPrefix("Transfer-Encoding") }) {
                    headers.append("Content-Length: \(kind.body.utf8.count)")
                }
                var statuses: [Int: Int] = [:]
                var first429: (index: Int, after: Duration, text: String)?
                let began = ContinuousClock.now
                for index in 0..<100 {
                    let answer = try await Self.raw(kind.url, "POST", kind.path, headers: headers, body: kind.body)
                    statuses[answer.status, default: 0] += 1
                    if answer.status == 429, first429 == nil { first429 = (index, ContinuousClock.now - began, answer.text) }
                }
                #expect(Set(statuses.keys).isSubset(of: [400, 429]), "\(kind.name): \(statuses)")
                let allowed = first429.map { 20 + Int($0.after.components.seconds) + 1 } ?? 0
                #expect(
                    first429.map { $0.index <= allowed } ?? false,
                    "\(kind.name): first 429 at \(String(describing: first429?.index)), \(allowed) allowed: \(statuses)")
                #expect(
                    first429.map { $0.text.contains("rate_limited") && $0.text.contains("Retry-After") } ?? false,
                    "\(kind.name): \(first429?.text ?? "")")
            }
            // Good requests from those addresses are served.
            var ours = AppReceiptTests.payload
            ours.bundleId = PipelineHarness.bundleId
            let minted = try ReceiptMinter(authority: try FakeCertificateAuthority.generate(name: "Door")).mint(ours)
            let upload = try await HTTP.send(
                edge.intakeURL + "/v1/receipts", method: .POST,
                body: try JSONEncoder().encode(["userId": "mallory", "receiptData": Data(minted).base64EncodedString()]),
                headers: ["Content-Type": "application/json", "X-Real-IP": "198.51.100.20"])
            #expect(upload.status == 202, "\(upload.text)")
            let genuine = try await HTTP.send(
                edge.intakeURL + "/v1/notifications/appstore", method: .POST,
                body: try JSONEncoder().encode(["signedPayload": try ForgedNotification.make(signer: edge.apple)]),
                headers: ["Content-Type": "application/json", "X-Real-IP": "198.51.100.22"])
            #expect(genuine.status == 200, "\(genuine.text)")
            let grant = try await HTTP.send(
                adminURL + "/v1/admin/grants", method: .POST,
                body: try JSONEncoder().encode(["userId": "ana", "productId": "com.example.coins.60", "reason": "r", "actor": "sam"]),
                headers: ["Authorization": "Bearer \(EdgeHarness.adminToken)", "Content-Type": "application/json", "X-Real-IP": "198.51.100.23"])
            #expect(grant.status == 201, "\(grant.text)")
            #expect(edge.errorLines.withLockedValue { $0 }.isEmpty, "\(edge.errorLines.withLockedValue { $0 })")
        }
    }

    // MARK: - Unsigned and padded containers

    /// A receipt payload of this app (`PipelineHarness.bundleId`) with `extra` attributes.
    static func payload(_ extra: [[UInt8]] = []) -> [UInt8] {
        TestDER.set(
            [TestDER.attribute(2, TestDER.utf8(PipelineHarness.bundleId)), TestDER.attribute(3, TestDER.utf8("1"))] + extra)
    }

    /// A SignedData around `content` with stand-ins for the certificates and the signer (the
    /// intake does not check the signature: Apple does).
    static func signedShell(content: [UInt8], certificates: [UInt8] = TestDER.element(0x30, [0x05, 0x00])) -> [UInt8] {
        let pkcs7: [UInt8] = [0x2A, 0x86, 0x48, 0x86, 0xF7, 0x0D, 0x01, 0x07]
        let sha256 = TestDER.element(0x30, TestDER.element(0x06, [0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x02, 0x01]))
        let encapsulated = TestDER.element(
            0x30, TestDER.element(0x06, pkcs7 + [0x01]) + TestDER.element(0xA0, TestDER.element(0x04, content)))
        let signer = TestDER.element(0x30, TestDER.integer(1))
        let signed = TestDER.element(
            0x30,
            TestDER.integer(1) + TestDER.element(0x31, sha256) + encapsulated + TestDER.element(0xA0, certificates)
                + TestDER.element(0x31, signer))
        return TestDER.element(0x30, TestDER.element(0x06, pkcs7 + [0x02]) + TestDER.element(0xA0, signed))
    }

    /// PKCS#7 shells are refused at the door with 400 `receipt_malformed` and nothing is stored:
    /// one with no certificates and no signer (Apple's always carry both) around a payload of
    /// this app, padded to 250 KB or not, and signed-looking ones padded with a filler attribute,
    /// a filler purchase or filler certificates. Receipts minted as Apple does, DER or BER, pass.
    @Test func unsignedAndPaddedContainersAreRefusedAtTheDoor() async throws {
        try await EdgeHarness.with { edge in
            let filler = [TestDER.attribute(9999, [UInt8](repeating: 0x41, count: 250_000))]
            let shells: [(String, [UInt8])] = [
                ("unsigned", TestDER.signedData(content: Self.payload())),
                ("unsigned, padded", TestDER.signedData(content: Self.payload(filler))),
                ("signed-looking, a filler attribute", Self.signedShell(content: Self.payload(filler))),
                ("signed-looking, many small fillers",
                    Self.signedShell(content: Self.payload((0..<100).map { TestDER.attribute(9000 + $0, [1, 2, 3]) }))),
                ("signed-looking, a filler purchase",
                    Self.signedShell(content: Self.payload([TestDER.attribute(17, [UInt8](repeating: 0x30, count: 100_000))]))),
                ("signed-looking, filler certificates",
                    Self.signedShell(content: Self.payload(), certificates: TestDER.element(0x30, TestDER.element(0x04, [UInt8](repeating: 0, count: 100_000))))),
            ]
            for (kind, shell) in shells {
                let answer = try await HTTP.post(
                    edge.intakeURL + "/v1/receipts", json: ["userId": "mallory", "receiptData": Data(shell).base64EncodedString()])
                #expect(answer.status == 400 && answer.errorCode == "receipt_malformed", "\(kind): \(answer.status) \(answer.text)")
            }
            #expect(try await edge.store.submissionCounts().values.reduce(0, +) == 0)
            // What Apple issues (here: minted the same way, DER, and BER as Xcode writes it) passes.
            var ours = AppReceiptTests.payload
            ours.bundleId = PipelineHarness.bundleId
            let minted = try ReceiptMinter(authority: try FakeCertificateAuthority.generate(name: "Door")).mint(ours)
            for receipt in [minted, BERTranscoder.reencode(minted)] {
                #expect(throws: Never.self) { try AppReceiptParser.parse(receipt, limits: .intake) }
                let taken = try await HTTP.post(
                    edge.intakeURL + "/v1/receipts", json: ["userId": "mallory", "receiptData": Data(receipt).base64EncodedString()])
                #expect(taken.status == 202, "\(taken.text)")
            }
            // The parser's own reading (the verifier's, `iap inspect`) is unchanged: it reads an unsigned container.
            #expect(try AppReceiptParser.parse(TestDER.signedData(content: Self.payload())).bundleId == PipelineHarness.bundleId)
        }
    }

    /// A receipt that passes the first look and that Apple then rejects keeps less than 1 KB:
    /// the finisher replaces what the upload carried by its digest, on either store; a
    /// submission still pending keeps its receipt.
    @Test func aRejectedUploadKeepsOnlyADigest() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-digest-\(UUID().uuidString)")
        let store = try await TestStore.open(in: folder)
        let padded = String(repeating: "QUJD", count: 60_000)
        var rejected = VerifyRequest(submissionId: UUID(), userId: "mallory", receiptData: padded, acceptedAt: Date())
        rejected.signedTransaction = String(repeating: "a", count: 50_000) + ".b.c"
        let pending = VerifyRequest(submissionId: UUID(), userId: "mallory", receiptData: padded, acceptedAt: Date())
        try await store.accept(rejected, message: nil)
        try await store.accept(pending, message: nil)
        _ = try await store.apply(
            VerifyResult(
                submissionId: rejected.submissionId, userId: "mallory", orderId: nil, attempt: 1,
                outcome: .rejected(.invalidReceipt, message: "Apple: 21002")))
        for id in [rejected.submissionId, pending.submissionId] {
            try await store.keepOnlyDigests(ofRejected: id, digest: FinisherService.digest)
        }
        func kept(_ id: SubmissionID) async throws -> Int {
            let rows = try await store.testRows(
                """
                SELECT receiptData, signedTransaction, signedPayload, submission_receipt.receipt FROM submission
                LEFT JOIN submission_receipt ON submission_receipt.submissionId = submission.id WHERE id = ?
                """, [id.uuidString])
            let row = try #require(rows.first)
            let texts: [String?] = [row["receiptData"], row["signedTransaction"], row["signedPayload"]]
            return texts.compactMap { $0?.utf8.count }.reduce(0, +) + ((row["receipt"] as Data?)?.count ?? 0)
        }
        #expect(try await kept(rejected.submissionId) < 1024)
        // The pending one keeps its receipt (as bytes), and a retry sends it as it came.
        #expect(try await kept(pending.submissionId) > 0)
        let requeued = try await store.requeueStuck(pendingBefore: Date().addingTimeInterval(60), retryDueBefore: Date(), limit: 10) {
            .verify($0, routingKey: "q", priority: 0)
        }
        #expect(requeued.map(\.receiptData) == [padded])
        #expect(FinisherService.digest(padded).hasPrefix("sha256:") && FinisherService.digest(padded).hasSuffix(":240000"))
    }

    // MARK: - Confusable names

    /// Names that look like Apple's or a service's, or mix scripts.
    static let confusableActors = [
        "\u{0430}pple", "appl\u{0435}", "\u{0410}PPLE", "\u{FF41}\u{FF50}\u{FF50}\u{FF4C}\u{FF45}", "Apple Inc.", "APPLE",
        " apple ", "AppIe", "app1e", "Apple Computer, Inc.", "App Store", "iTunes", "\u{0430}\u{0440}\u{0440}\u{04CF}\u{0435}",
        "\u{03B1}pple", "\u{0455}ystem", "syst\u{0435}m", "recon\u{0441}iliation", "s\u{0443}stem", "\u{1D00}pple",
        "sa\u{0301}m\u{0430}", "jos\u{00E9}\u{0441}", "m\u{0430}ria",
    ]

    /// An admin action's `actor` that looks like Apple or a service (a Cyrillic `а`, full-width
    /// letters, `Apple Inc.`) or mixes scripts is refused with 400 `invalid_field`; plain names
    /// in any one script are taken.
    @Test func confusableActorsAreRefused() async throws {
        for name in Self.confusableActors {
            #expect(IdentifierText.actorProblem(name) != nil, "\(name.unicodeScalars.map { String($0.value, radix: 16) })")
        }
        for name in ["sam", "Samantha Appleton", "Jos\u{00E9}", "\u{041C}\u{0430}\u{0440}\u{0438}\u{044F}", "\u{5C71}\u{7530}", "admin", "cs-team-2", "\u{03A3}\u{03BF}\u{03C6}\u{03AF}\u{03B1}"] {
            #expect(IdentifierText.actorProblem(name) == nil, "\(name)")
        }
        try await EdgeHarness.with { edge in
            let admin = ["Authorization": "Bearer \(EdgeHarness.adminToken)"]
            for name in Self.confusableActors {
                let answer = try await HTTP.send(
                    edge.intakeURL + "/v1/admin/grants", method: .POST,
                    body: try JSONEncoder().encode(["userId": "ana", "productId": "com.example.coins.60", "reason": "r", "actor": name]),
                    headers: admin)
                #expect(answer.status == 400 && answer.errorCode == "invalid_field", "\(name): \(answer.text)")
            }
            let plain = try await HTTP.send(
                edge.intakeURL + "/v1/admin/grants", method: .POST,
                body: try JSONEncoder().encode(["userId": "ana", "productId": "com.example.coins.60", "reason": "r", "actor": "sam"]),
                headers: admin)
            #expect(plain.status == 201, "\(plain.text)")
        }
    }
}
