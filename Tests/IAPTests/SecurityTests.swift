import Foundation
import Intake
import NIOHTTP1
import OrderStore
import Ledger
import Testing
import TestSupport

#if canImport(Glibc)
    import Glibc
#endif

extension PipelineHarness {
    /// Starts a pipeline whose intake checks HS256 user tokens.
    static func startAuthenticated(name: String, limits: IntakeLimits = .unlimited, separateAdmin: Bool = false)
        async throws -> PipelineHarness
    {
        try await start(
            name: name,
            authentication: .jwt(try await UserTokenVerifier(key: .hs256(secret: TestTokens.secret))), limits: limits,
            separateAdmin: separateAdmin)
    }
}

/// HTTP calls as a signed-in app user.
enum UserHTTP {
    static func send(_ method: HTTPMethod, _ url: String, token: String?, json: [String: String]? = nil) async throws
        -> HTTP.Answer
    {
        var headers: [String: String] = [:]
        if let token { headers["Authorization"] = "Bearer \(token)" }
        return try await HTTP.send(
            url, method: method, body: try json.map { try JSONEncoder().encode($0) }, headers: headers)
    }
}

extension BrokerTests {
    @Suite("Authentication, ownership and limits")
    struct SecurityTests {
        @Test func userRoutesNeedAValidToken() async throws {
            let pipeline = try await PipelineHarness.startAuthenticated(name: "authn")
            Teardown.add { await pipeline.stop() }
            let base = pipeline.intakeURL
            let expired = try await TestTokens.hs256(.init("ana", expiresIn: -600))
            let forged = try await TestTokens.hs256(.init("ana"), secret: String(repeating: "f", count: 48))
            let unsigned = try TestTokens.handmade(header: ["alg": "none"], claims: .init("ana"))
            let routes: [(HTTPMethod, String, [String: String]?)] = [
                (.POST, "/v1/receipts", ["receiptData": "AAAA"]), (.GET, "/v1/receipts/\(UUID())", nil),
                (.POST, "/v1/orders", ["productId": "com.example.coins.60"]), (.GET, "/v1/orders/o-1", nil),
                (.GET, "/v1/users/ana/grants", nil),
            ]
            for (method, path, body) in routes {
                for (token, code) in [(nil, "unauthenticated"), (expired, "token_expired"), (forged, "token_signature_invalid"),
                    (unsigned, "token_algorithm_refused"), ("not.a.token", "token_malformed")] as [(String?, String)]
                {
                    let answer = try await UserHTTP.send(method, base + path, token: token, json: body)
                    #expect(answer.status == 401, "\(method) \(path) \(code): \(answer.text)")
                    #expect(answer.errorCode == code, "\(method) \(path): \(answer.text)")
                    #expect(answer.headers.first(name: "WWW-Authenticate")?.hasPrefix("Bearer") == true)
                }
            }
            let basic = try await HTTP.send(
                base + "/v1/users/ana/grants", method: .GET, body: nil, headers: ["Authorization": "Basic YW5hOnB3"])
            #expect(basic.status == 401 && basic.errorCode == "unauthenticated")
            // Public routes stay public.
            #expect(try await HTTP.get(base + "/healthz").status == 200)
            #expect(try await HTTP.get(base + "/v1/products").status == 200)
        }

        @Test func usersReadOnlyTheirOwnSubmissionsOrdersAndGrants() async throws {
            let pipeline = try await PipelineHarness.startAuthenticated(name: "owner")
            Teardown.add { await pipeline.stop() }
            let base = pipeline.intakeURL
            let ana = try await TestTokens.hs256(.init("ana"))
            let bob = try await TestTokens.hs256(.init("bob"))

            // The user comes from the token; a body naming someone else is refused.
            let purchase = try await pipeline.mint()
            let mismatch = try await UserHTTP.send(
                .POST, base + "/v1/receipts", token: ana, json: ["userId": "bob", "receiptData": purchase.receiptData])
            #expect(mismatch.status == 403 && mismatch.errorCode == "user_mismatch", "\(mismatch.text)")
            let upload = try await UserHTTP.send(.POST, base + "/v1/receipts", token: ana, json: ["receiptData": purchase.receiptData])
            #expect(upload.status == 202, "\(upload.text)")
            let submissionId = try #require(upload.json["submissionId"] as? String)
            #expect(try await pipeline.waitForState(submissionId, token: ana)["state"] as? String == "credited")
            #expect(try await pipeline.store.status(of: try #require(UUID(uuidString: submissionId)))?.userId == "ana")

            let mine = try await UserHTTP.send(.GET, base + "/v1/receipts/\(submissionId)", token: ana)
            #expect(mine.status == 200 && mine.json["state"] as? String == "credited")
            let theirs = try await UserHTTP.send(.GET, base + "/v1/receipts/\(submissionId)", token: bob)
            #expect(theirs.status == 404 && theirs.errorCode == "submission_not_found", "\(theirs.text)")

            let order = try await UserHTTP.send(.POST, base + "/v1/orders", token: ana, json: ["productId": "com.example.coins.60"])
            #expect(order.status == 201 && order.json["userId"] as? String == "ana", "\(order.text)")
            let orderId = try #require(order.json["orderId"] as? String)
            #expect(try await UserHTTP.send(.GET, base + "/v1/orders/\(orderId)", token: ana).status == 200)
            let otherOrder = try await UserHTTP.send(.GET, base + "/v1/orders/\(orderId)", token: bob)
            #expect(otherOrder.status == 404 && otherOrder.errorCode == "order_not_found")

            let grants = try await UserHTTP.send(.GET, base + "/v1/users/ana/grants", token: ana)
            #expect((grants.json["grants"] as? [Any])?.count == 1, "\(grants.text)")
            let otherGrants = try await UserHTTP.send(.GET, base + "/v1/users/ana/grants", token: bob)
            #expect(otherGrants.status == 404, "\(otherGrants.text)")

            // A user's token opens no admin route; the admin token does.
            let asUser = try await UserHTTP.send(.GET, base + "/v1/admin/audit", token: ana)
            #expect(asUser.status == 403 && asUser.errorCode == "forbidden", "\(asUser.text)")
            #expect(try await UserHTTP.send(.GET, base + "/v1/admin/audit", token: nil).status == 401)
            #expect(try await UserHTTP.send(.GET, base + "/v1/admin/audit", token: PipelineHarness.adminToken).status == 200)
        }

        @Test func adminRoutesCanListenOnTheirOwnPort() async throws {
            let pipeline = try await PipelineHarness.startAuthenticated(name: "adminport", separateAdmin: true)
            Teardown.add { await pipeline.stop() }
            let adminURL = try #require(pipeline.adminURL)
            let onAppPort = try await UserHTTP.send(.GET, pipeline.intakeURL + "/v1/admin/audit", token: PipelineHarness.adminToken)
            #expect(onAppPort.status == 404, "\(onAppPort.text)")
            let onAdminPort = try await UserHTTP.send(.GET, adminURL + "/v1/admin/audit", token: PipelineHarness.adminToken)
            #expect(onAdminPort.status == 200, "\(onAdminPort.text)")
            let userToken = try await TestTokens.hs256(.init("ana"))
            #expect(try await UserHTTP.send(.GET, adminURL + "/v1/admin/audit", token: userToken).status == 403)
            #expect(try await UserHTTP.send(.GET, adminURL + "/v1/receipts/\(UUID())", token: userToken).status == 404)
        }

        @Test func usersAndAddressesAreRateLimited() async throws {
            let perUser = try await PipelineHarness.startAuthenticated(
                name: "ratelimituser", limits: IntakeLimits(perUser: RateLimit(perSecond: 1, burst: 3), perAddress: nil))
            Teardown.add { await perUser.stop() }
            let ana = try await TestTokens.hs256(.init("ana"))
            let bob = try await TestTokens.hs256(.init("bob"))
            var statuses: [Int] = []
            for _ in 0..<4 {
                statuses.append(try await UserHTTP.send(.GET, perUser.intakeURL + "/v1/users/ana/grants", token: ana).status)
            }
            #expect(statuses == [200, 200, 200, 429])
            let limited = try await UserHTTP.send(.GET, perUser.intakeURL + "/v1/users/ana/grants", token: ana)
            #expect(limited.status == 429 && limited.errorCode == "rate_limited")
            #expect(Int(limited.headers.first(name: "Retry-After") ?? "") ?? 0 >= 1, "\(limited.headers)")
            // Another user is not held back by ana.
            #expect(try await UserHTTP.send(.GET, perUser.intakeURL + "/v1/users/bob/grants", token: bob).status == 200)

            let perAddress = try await PipelineHarness.start(
                name: "ratelimitip", limits: IntakeLimits(perUser: nil, perAddress: RateLimit(perSecond: 1, burst: 5)))
            Teardown.add { await perAddress.stop() }
            var addressStatuses: [Int] = []
            for _ in 0..<6 { addressStatuses.append(try await HTTP.get(perAddress.intakeURL + "/v1/products").status) }
            #expect(addressStatuses == [200, 200, 200, 200, 200, 429])
            let blocked = try await HTTP.get(perAddress.intakeURL + "/v1/receipts/\(UUID())?userId=ana")
            #expect(blocked.status == 429 && blocked.headers.first(name: "Retry-After") != nil)
            // Health checks are never limited.
            #expect(try await HTTP.get(perAddress.intakeURL + "/healthz").status == 200)
        }

        @Test func slowBodiesTimeOutAndInFlightWorkIsBounded() async throws {
            let pipeline = try await PipelineHarness.start(
                name: "inflight", limits: IntakeLimits(perUser: nil, perAddress: nil, maxInFlight: 1, bodyTimeout: .seconds(1)))
            Teardown.add { await pipeline.stop() }
            let port = try #require(URLComponents(string: pipeline.intakeURL)?.port)
            // A client that announces 100 bytes and sends 10 holds the one slot... (once it has
            // it: a request that ended a moment before may still hold it, and then the slow one
            // is the one turned away; it tries again, five times at most.)
            var slow = try RawHTTPClient(port: port)
            var overloaded: HTTP.Answer?
            for _ in 0..<5 where overloaded == nil {
                slow = try RawHTTPClient(port: port)
                try slow.send("POST /v1/receipts HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"userId\":")
                for _ in 0..<50 {
                    let answer = try await HTTP.get(pipeline.intakeURL + "/v1/products")
                    if answer.status == 503 {
                        overloaded = answer
                        break
                    }
                    try await Task.sleep(for: .milliseconds(10))
                }
            }
            // ...so others are turned away at once rather than queued,
            #expect(overloaded?.errorCode == "overloaded", "\(overloaded?.text ?? "never overloaded")")
            #expect(overloaded?.headers.first(name: "Retry-After") == "1")
            // ...until the body timeout ends it with 408 and frees the slot.
            let reply = try await slow.receiveOffThePool(timeout: 10)
            #expect(reply.hasPrefix("HTTP/1.1 408"), "\(reply)")
            #expect(reply.contains("request_timeout"), "\(reply)")
            #expect(try await HTTP.get(pipeline.intakeURL + "/v1/products").status == 200)
        }
    }
}

/// A blocking HTTP/1.1 client on a raw socket, for requests no well-behaved client sends.
final class RawHTTPClient: Sendable {
    private let socket: Int32

    init(port: Int) throws {
        socket = Glibc.socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = in_port_t(UInt16(port).bigEndian)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        let connected = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                connect(socket, $0, socklen_t(MemoryLayout<sockaddr_in>.size))
            }
        }
        guard connected == 0 else { throw HarnessError("connect to 127.0.0.1:\(port) failed: errno \(errno)") }
    }

    deinit { close(socket) }

    func send(_ text: String) throws {
        let bytes = Array(text.utf8)
        guard Glibc.send(socket, bytes, bytes.count, Int32(MSG_NOSIGNAL)) == bytes.count else {
            throw HarnessError("send failed: errno \(errno)")
        }
    }

    /// What arrives until the peer closes, a full response is in, or `timeout` seconds pass.
    func receive(timeout: Int) throws -> String {
        var tv = timeval(tv_sec: timeout, tv_usec: 0)
        setsockopt(socket, SOL_SOCKET, SO_RCVTIMEO, &tv, socklen_t(MemoryLayout<timeval>.size))
        var received: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 4096)
        while true {
            let count = recv(socket, &buffer, buffer.count, 0)
            if count <= 0 { break }
            received.append(contentsOf: buffer[0..<count])
            let text = String(decoding: received, as: UTF8.self)
            if let end = text.range(of: "\r\n\r\n"), let length = Self.contentLength(text[..<end.lowerBound]),
                received.count >= text.utf8.distance(from: text.startIndex, to: end.upperBound) + length
            {
                break
            }
        }
        return String(decoding: received, as: UTF8.self)
    }

    /// `receive` on a thread of its own: a test waiting here must not hold one of the 2
    /// cooperative threads that the server under test needs to time the body out.
    func receiveOffThePool(timeout: Int) async throws -> String {
        try await withCheckedThrowingContinuation { continuation in
            Thread { continuation.resume(with: Result { try self.receive(timeout: timeout) }) }.start()
        }
    }

    private static func contentLength(_ head: Substring) -> Int? {
        head.split(separator: "\r\n").first { $0.lowercased().hasPrefix("content-length:") }
            .flatMap { Int($0.split(separator: ":")[1].trimmingCharacters(in: .whitespaces)) }
    }
}

extension BrokerTests.SecurityTests {
    /// The real processes at trace level, a purchase, an admin call and refused tokens: no
    /// secret, token or receipt may show up in any log line.
    @Test func noSecretReachesTheLogs() async throws {
        let sharedSecret = "apple-shared-secret-\(UUID().uuidString)"
        let adminToken = "admin-token-\(UUID().uuidString)"
        let authSecret = "login-backend-secret-\(UUID().uuidString)"
        let brokerURL = try TestBroker.url()
        let urlFile = FileManager.default.temporaryDirectory.appendingPathComponent("amqp-\(UUID().uuidString)")
        try Data(brokerURL.utf8).write(to: urlFile)
        let drill = try await ProcessDrill(
            name: "secrets",
            environment: [
                "IAP_LOG_LEVEL": "trace", "IAP_AUTH": "jwt", "IAP_AUTH_HS256_SECRET": authSecret,
                "IAP_ADMIN_TOKEN": adminToken, "IAP_APPSTORE_SHARED_SECRET": sharedSecret,
                "IAP_AMQP_URL": "", "IAP_AMQP_URL_FILE": urlFile.path,
            ])
        try drill.start("fake-appstore")
        try await drill.waitHealthy(drill.fakeURL)
        try drill.start("orders")
        try await drill.waitHealthy(drill.intakeURL)
        try drill.start("verifier")

        let token = try await TestTokens.hs256(.init("ana"), secret: authSecret)
        let purchase = try #require(try await drill.mint(1).first)
        let upload = try await UserHTTP.send(
            .POST, drill.intakeURL + "/v1/receipts", token: token, json: ["receiptData": purchase.receiptData])
        let id = try #require(upload.json["submissionId"] as? String, "\(upload.text)")
        let credited = try await eventually(timeout: .seconds(30), interval: .milliseconds(100)) {
            try await UserHTTP.send(.GET, drill.intakeURL + "/v1/receipts/\(id)", token: token).json["state"] as? String
                == "credited"
        }
        #expect(credited, "\(drill.logTail("verifier"))")
        #expect(try await UserHTTP.send(.GET, drill.intakeURL + "/v1/admin/audit", token: adminToken).status == 200)
        let forged = try await TestTokens.hs256(.init("ana"), secret: authSecret + "-not")
        #expect(try await UserHTTP.send(.GET, drill.intakeURL + "/v1/receipts/\(id)", token: forged).status == 401)
        #expect(try await UserHTTP.send(.GET, drill.intakeURL + "/v1/admin/audit", token: token).status == 403)
        drill.stopAll()

        let logs = ["fake-appstore", "orders", "verifier"].map { drill.logTail($0, lines: .max) }
        let brokerPassword = try #require(URLComponents(string: brokerURL)?.password)
        let secrets = [
            ("Apple shared secret", sharedSecret), ("admin token", adminToken), ("HS256 secret", authSecret),
            ("user token", token), ("forged token", forged), ("receipt", String(purchase.receiptData.prefix(64))),
            ("broker password", ":\(brokerPassword)@"),
        ]
        for (role, log) in zip(["fake-appstore", "orders", "verifier"], logs) {
            #expect(log.count > 1000, "\(role) logged almost nothing at trace level: \(log)")
            for (name, secret) in secrets {
                #expect(!log.contains(secret), "\(role)'s log holds the \(name)")
            }
        }
        // The logs do carry the ids needed to follow the purchase.
        #expect(logs[2].contains(id) || logs[1].contains(id), "no log line names submission \(id)")
    }
}
