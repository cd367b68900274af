import Foundation
import HummingbirdTesting
import Hummingbird
import IAPCore
import Intake
import JWTKit
import NIOCore
import OrderStore
import Testing

/// The edge alone: every route the API documents (docs/openapi.yaml), through the router the
/// intake's role builds (`makeIntakeRouter`), in process (`app.test(.router)`): no socket, no
/// broker, no PostgreSQL (an SQLite store of its own). Each route asks for its token: an app
/// route for a user's, an admin route for an admin's (a user's is refused there); a user route
/// answers only its own user; a body that is not JSON is a 400 with a code, never a 5xx.
@Suite("The edge: every route's authentication and validation, through the router")
struct EdgeTests {
    static let adminToken = "edge-admin-token-0123456789abcdef"
    static let secret = "the-edge-tests-login-backend-secret-0123456789"
    static let document = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().appendingPathComponent("docs/openapi.yaml")

    /// One documented operation, its path's parameters filled with `value`.
    struct Operation: CustomStringConvertible, Sendable {
        var method: HTTPRequest.Method
        var path: String
        /// Whether the document says it needs no token (`security: []`).
        var isPublic: Bool

        var description: String { "\(method) \(path)" }
        var isAdmin: Bool { path.hasPrefix("/v1/admin/") }
        var actsForUser: Bool { path.hasPrefix("/v1/users/{userId}") }

        func uri(_ value: String = "x1", userId: String = "ana") -> String {
            path.replacingOccurrences(of: "{userId}", with: userId)
                .replacingOccurrences(of: #"\{[A-Za-z]+\}"#, with: value, options: .regularExpression)
        }
    }

    /// Every operation under `paths:`, with whether it is public.
    static func operations() throws -> [Operation] {
        let yaml = try String(contentsOf: document, encoding: .utf8)
        var operations: [Operation] = []
        var (inPaths, path) = (false, String?.none)
        for line in yaml.split(separator: "\n", omittingEmptySubsequences: false) {
            if line.hasPrefix("paths:") {
                inPaths = true
                continue
            }
            guard inPaths else { continue }
            if let first = line.first, !first.isWhitespace, first != "#" { break }
            let trimmed = line.trimmingCharacters(in: .whitespaces)
            let indent = line.prefix { $0 == " " }.count
            if indent == 2, trimmed.hasPrefix("/"), trimmed.hasSuffix(":") {
                path = String(trimmed.dropLast())
            } else if indent == 4, let path, trimmed.hasSuffix(":"), let method = HTTPRequest.Method(trimmed.dropLast().uppercased()) {
                operations.append(Operation(method: method, path: path, isPublic: false))
            } else if indent == 6, trimmed == "security: []", !operations.isEmpty {
                operations[operations.count - 1].isPublic = true
            }
        }
        return operations
    }

    /// A user's token from the login backend.
    static func token(_ user: String) async throws -> String {
        struct Claims: JWTPayload {
            var sub: SubjectClaim
            var exp: ExpirationClaim
            func verify(using algorithm: some JWTAlgorithm) async throws { try exp.verifyNotExpired() }
        }
        let keys = JWTKeyCollection()
        await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
        return try await keys.sign(Claims(sub: .init(value: user), exp: .init(value: Date().addingTimeInterval(600))))
    }

    /// The intake's application over a store of its own, as the role builds its router.
    static func application() async throws -> some ApplicationProtocol {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-edge-router-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
        let store = try await OrderStore(path: folder.appendingPathComponent("orders.sqlite").path)
        let catalog = Catalog(products: [.init(productId: "coins", type: .consumable, grant: ["coins": .number(10)])])
        // No rate limits and no lockout after failed admin tokens: every request here comes from
        // one (absent) address, and this suite sends many refused tokens on purpose.
        var limits = IntakeLimits.unlimited
        limits.failedAdminAttempts = nil
        var settings = IntakeSettings(
            host: "127.0.0.1", port: 0, catalog: catalog,
            authentication: .jwt(try await UserTokenVerifier(key: .hs256(secret: secret))), limits: limits,
            adminTokens: [adminToken])
        settings.bundleIds = ["com.example.edge"]
        return Application(router: makeIntakeRouter(settings: settings, store: store))
    }

    /// The status and error code of one request.
    static func send(
        _ client: some TestClientProtocol, _ operation: Operation, uri: String? = nil, token: String?, body: String? = nil
    ) async throws -> (status: HTTPResponse.Status, code: String?) {
        var headers = HTTPFields()
        if let token { headers[.authorization] = "Bearer \(token)" }
        if body != nil { headers[.contentType] = "application/json" }
        return try await client.execute(
            uri: uri ?? operation.uri(), method: operation.method, headers: headers,
            body: body.map { ByteBuffer(string: $0) }
        ) { response in
            let code = (try? JSONSerialization.jsonObject(with: Data(response.body.readableBytesView)) as? [String: Any])
                .flatMap { $0["error"] as? [String: Any] }?["code"] as? String
            return (response.status, code)
        }
    }

    @Test func theDocumentListsEveryKindOfRoute() throws {
        let operations = try Self.operations()
        #expect(operations.count >= 25, "\(operations)")
        #expect(operations.contains { $0.isAdmin } && operations.contains { $0.actsForUser } && operations.contains { $0.isPublic })
    }

    @Test func everyRouteAsksForItsOwnKindOfToken() async throws {
        let operations = try Self.operations()
        let user = try await Self.token("ana")
        try await Self.application().test(.router) { client in
            for operation in operations where !operation.isPublic {
                let bare = try await Self.send(client, operation, token: nil)
                #expect(bare.status == .unauthorized && bare.code == "unauthenticated", "\(operation) without a token: \(bare)")
                let forged = try await Self.send(client, operation, token: user + "x")
                #expect(forged.status == .unauthorized || forged.status == .forbidden, "\(operation) with a forged token: \(forged)")
                if operation.isAdmin {
                    // A user's token is no admin token; an admin token passes the door.
                    let asUser = try await Self.send(client, operation, token: user)
                    #expect(asUser.status == .forbidden && asUser.code == "forbidden", "\(operation) with a user's token: \(asUser)")
                    let asAdmin = try await Self.send(client, operation, token: Self.adminToken)
                    #expect(![.unauthorized, .forbidden].contains(asAdmin.status), "\(operation) with the admin token: \(asAdmin)")
                } else {
                    // The admin token is no user's.
                    let asAdmin = try await Self.send(client, operation, token: Self.adminToken)
                    #expect(asAdmin.status == .unauthorized, "\(operation) with the admin token: \(asAdmin)")
                    let asUser = try await Self.send(client, operation, token: user)
                    #expect(![.unauthorized, .forbidden].contains(asUser.status) && asUser.status.code < 500, "\(operation) as ana: \(asUser)")
                }
            }
        }
    }

    @Test func aUserRouteAnswersOnlyItsOwnUserAndAnyoneElseIsAsUnknownAsNobody() async throws {
        let operations = try Self.operations().filter(\.actsForUser)
        #expect(!operations.isEmpty)
        let ana = try await Self.token("ana")
        try await Self.application().test(.router) { client in
            for operation in operations {
                let other = try await Self.send(client, operation, uri: operation.uri(userId: "bob"), token: ana, body: "{}")
                #expect(other.status == .notFound && other.code == "user_not_found", "\(operation) for bob as ana: \(other)")
                // Case and width do not make another user the same one, nor the same one another.
                let own = try await Self.send(client, operation, uri: operation.uri(userId: "ana"), token: ana, body: "{}")
                #expect(own.code != "user_not_found", "\(operation) for ana as ana: \(own)")
                let invalid = try await Self.send(client, operation, uri: operation.uri(userId: "a%00b"), token: ana, body: "{}")
                #expect(invalid.status == .badRequest && invalid.code == "invalid_field", "\(operation) for a NUL id: \(invalid)")
            }
        }
    }

    @Test func aBodyThatIsNotJSONIsA400WithACodeOnEveryRouteThatTakesOne() async throws {
        let operations = try Self.operations().filter { $0.method == .post }
        #expect(operations.count >= 10)
        let user = try await Self.token("ana")
        try await Self.application().test(.router) { client in
            for operation in operations {
                let token = operation.isAdmin ? Self.adminToken : operation.isPublic ? nil : user
                for body in ["{", "[1,2", "\u{7F}not json", "null"] {
                    let answer = try await Self.send(client, operation, token: token, body: body)
                    #expect(answer.status.code >= 400 && answer.status.code < 500 && answer.code != nil, "\(operation) with \(body.debugDescription): \(answer)")
                }
            }
            // And the process keeps serving.
            let health = try await Self.send(client, Operation(method: .get, path: "/healthz", isPublic: true), token: nil)
            #expect(health.status == .ok)
        }
    }
}
