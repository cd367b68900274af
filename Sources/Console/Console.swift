public import AppStore
import Foundation
import HTTPTypes
public import Hummingbird
public import IAPCore
public import Logging
public import Messaging
import Mustache
import NIOConcurrencyHelpers
import NIOCore
public import OrderStore

/// How customer service's console runs.
public struct ConsoleSettings: Sendable {
    /// Tokens that sign an operator in (reads and acts); none disables the console.
    public var operatorTokens: [String]
    /// Tokens that sign read-only support in.
    public var viewerTokens: [String]
    /// Session cookies without `Secure`, for plain HTTP on loopback (`iap dev`, tests).
    public var insecureCookies: Bool
    /// How long a sign-in lasts.
    public var sessionLifetime: Duration
    /// Where a client's address comes from (the intake's `IAP_CLIENT_IP_HEADER`, believed from
    /// `IAP_TRUSTED_PROXIES` only). Failed sign-ins are counted per address.
    public var clientAddresses: ClientAddressPolicy
    /// Time allowed to receive a form body (the intake's `IAP_BODY_TIMEOUT_SECONDS`).
    public var bodyTimeout: Duration
    /// Signed-in people's form posts handled at once; more get 503 at once. The console's own
    /// count, apart from the app's in-flight slots and from strangers' sign-ins.
    public var maxInFlight: Int
    /// Form posts of one session handled at once; more get 503 at once.
    public var maxInFlightPerSession: Int
    /// Sign-ins handled at once, a cap of their own: when all are taken, the oldest one still
    /// waiting for its body gives way to the newcomer, so half-sent sign-ins never keep an
    /// operator out.
    public var maxSignInsInFlight: Int
    /// Time allowed to receive a sign-in form (about 100 bytes).
    public var signInBodyTimeout: Duration
    /// Failed sign-ins one address may make within five minutes before it is locked to one
    /// try every two seconds (the intake's `IntakeLimits.failedAdminAttempts`); nil is unlimited.
    public var failedSignIns: Int?

    /// Creates settings.
    public init(
        operatorTokens: [String] = [], viewerTokens: [String] = [], insecureCookies: Bool = false,
        sessionLifetime: Duration = .seconds(8 * 3600), clientAddresses: ClientAddressPolicy = .peer,
        bodyTimeout: Duration = Setting.bodyTimeoutSeconds.defaultSeconds, maxInFlight: Int = 64, maxInFlightPerSession: Int = 4,
        maxSignInsInFlight: Int = 16, signInBodyTimeout: Duration = .seconds(3),
        failedSignIns: Int? = Setting.adminFailedAttempts.defaultInt
    ) {
        self.failedSignIns = failedSignIns
        self.maxInFlightPerSession = maxInFlightPerSession
        self.maxSignInsInFlight = maxSignInsInFlight
        self.signInBodyTimeout = signInBodyTimeout
        self.clientAddresses = clientAddresses
        self.bodyTimeout = bodyTimeout
        self.maxInFlight = maxInFlight
        self.operatorTokens = operatorTokens
        self.viewerTokens = viewerTokens
        self.insecureCookies = insecureCookies
        self.sessionLifetime = sessionLifetime
    }
}

/// What the console reaches besides the order store; each part may be missing (then the page
/// says so instead of failing).
public struct ConsoleDependencies: Sendable {
    /// The order store.
    public var store: OrderStore
    /// What the app sells (products offered when granting).
    public var catalog: Catalog?
    /// Queue and exchange names.
    public var names: PipelineNames
    /// The broker connection for dead letters; nil: dead letters are not shown.
    public var broker: AMQPConnection?
    /// The App Store Server API (Look Up Order ID); nil: order ids cannot be looked up.
    public var appStore: AppStoreServerAPIClient?
    /// Checks what the Server API answers.
    public var signedData: SignedDataVerifier?
    /// Whether what customer service settles is queued to be finished at Apple.
    public var finishAtApple: Bool

    /// Creates the dependencies.
    public init(
        store: OrderStore, catalog: Catalog?, names: PipelineNames, broker: AMQPConnection?,
        appStore: AppStoreServerAPIClient?, signedData: SignedDataVerifier?, finishAtApple: Bool = false
    ) {
        self.finishAtApple = finishAtApple
        self.store = store
        self.catalog = catalog
        self.names = names
        self.broker = broker
        self.appStore = appStore
        self.signedData = signedData
    }
}

/// Customer service's console: server-rendered pages under `/admin/` on the admin listener.
/// Sign-in with a token sets a session cookie; every change form carries the session's CSRF
/// token and a one-time key, asks for a reason and lands in the audit log.
public final class Console: Sendable {
    let settings: ConsoleSettings
    let deps: ConsoleDependencies
    let logger: Logger
    let templates: MustacheLibrary
    let stylesheet: String
    let sessions: ConsoleSessions
    /// Failed sign-ins per address (`ConsoleSettings.failedSignIns` in five minutes, then one
    /// try every two seconds).
    let limiter: FailedAttempts
    let keys = IdempotencyKeys()
    /// Signed-in people's form posts in progress: all of them, and by session.
    let inFlight = NIOLockedValueBox((all: 0, bySession: [String: Int]()))
    let signIns: SignInSlots

    static let cookieName = "iap_console"

    /// Loads the templates shipped with the module.
    public init(settings: ConsoleSettings, dependencies: ConsoleDependencies, logger: Logger) throws {
        self.settings = settings
        self.deps = dependencies
        self.logger = logger
        guard let templatesURL = Bundle.module.url(forResource: "Templates", withExtension: nil),
            let cssURL = Bundle.module.url(forResource: "Static/console", withExtension: "css")
                ?? Bundle.module.resourceURL?.appendingPathComponent("Static/console.css")
        else { throw ConsoleError("the console's templates are missing from the bundle") }
        templates = try Self.loadTemplates(from: templatesURL)
        stylesheet = try String(contentsOf: cssURL, encoding: .utf8)
        let lifetime = settings.sessionLifetime.components
        sessions = ConsoleSessions(lifetime: TimeInterval(lifetime.seconds))
        limiter = FailedAttempts(limit: settings.failedSignIns ?? .max)
        signIns = SignInSlots(capacity: settings.maxSignInsInFlight)
    }

    /// The templates in `folder`, each escaping with `ConsoleHTML`: one without its pragma is
    /// refused, so no page or partial can fall back to swift-mustache's own escaping.
    static func loadTemplates(from folder: URL) throws -> MustacheLibrary {
        ConsoleHTML.register()
        var library = MustacheLibrary()
        let files = try FileManager.default.contentsOfDirectory(atPath: folder.path).filter { $0.hasSuffix(".mustache") }
        for file in files {
            let text = try String(contentsOf: folder.appendingPathComponent(file), encoding: .utf8)
            guard text.hasPrefix(ConsoleHTML.pragma) else {
                throw ConsoleError("the template \(file) does not start with \(ConsoleHTML.pragma)")
            }
            try library.register(text, named: String(file.dropLast(".mustache".count)))
        }
        return library
    }

    /// Adds the console's routes (`/admin/…`) to a router.
    public func addRoutes<Context: RemoteAddressRequestContext>(to router: Router<Context>) {
        router.get("/admin/static/console.css") { _, _ in
            var headers = HTTPFields()
            headers[.contentType] = "text/css; charset=utf-8"
            headers[.cacheControl] = "max-age=300"
            return Response(status: .ok, headers: headers, body: .init(byteBuffer: ByteBuffer(string: self.stylesheet)))
        }
        router.get("/admin/login") { request, _ in
            if self.session(of: request) != nil { return Self.redirect("/admin/") }
            let next = request.uri.queryParameters.get("next").flatMap { Self.consolePath(String($0)) } ?? ""
            return self.page("login", title: "Sign in", session: nil, ["next": next])
        }
        router.post("/admin/login") { request, context in
            await self.signIn(request, address: self.address(of: request, context))
        }
        router.post("/admin/logout") { request, _ in
            await self.guarded(request, action: "logout", change: false) { session, _ in
                self.sessions.end(session.id)
                self.logger.info("console sign-out", metadata: ["iap.actor": "\(session.actor)"])
                var response = Self.redirect("/admin/login")
                response.headers[.setCookie] = self.cookie(value: "", maxAge: 0)
                return response
            }
        }
        router.get("/admin/") { request, _ in
            await self.reading(request) { session in await self.home(request, session: session) }
        }
        router.get("/admin/users/{userId}") { request, context in
            let userId = context.parameters.get("userId").map { $0.removingPercentEncoding ?? $0 } ?? ""
            return await self.reading(request) { session in
                if let refusal = self.refusal(ofId: userId, named: "user ID", session: session) { return refusal }
                return await self.customer(userId, session: session)
            }
        }
        router.get("/admin/users/{userId}/groups") { request, context in
            let userId = context.parameters.get("userId").map { $0.removingPercentEncoding ?? $0 } ?? ""
            return await self.reading(request) { session in
                if let refusal = self.refusal(ofId: userId, named: "user ID", session: session) { return refusal }
                return await self.customerGroups(userId, session: session)
            }
        }
        router.get("/admin/groups/{groupId}") { request, context in
            let groupId = context.parameters.get("groupId") ?? ""
            let query = request.uri.queryParameters
            return await self.reading(request) { session in
                await self.groupMembers(
                    groupId, environment: query.get("environment"), paginationToken: query.get("page"), session: session)
            }
        }
        router.get("/admin/apple-orders/{orderId}") { request, context in
            let orderId = context.parameters.get("orderId").map { $0.removingPercentEncoding ?? $0 } ?? ""
            return await self.reading(request) { session in
                if let refusal = self.refusal(ofId: orderId, named: "order ID", session: session) { return refusal }
                return await self.appleOrder(orderId, session: session)
            }
        }
        for action in ConsoleAction.allCases {
            router.post("/admin/actions/\(action.rawValue)") { request, _ in
                await self.guarded(request, action: action.rawValue, change: true) { session, form in
                    await self.perform(action, form: form, session: session)
                }
            }
        }
    }

    // MARK: - Sign-in

    private func signIn(_ request: Request, address: String) async -> Response {
        // The attempt is counted before its body is read: held-back guesses count too. A try a
        // locked address still has (one every two seconds) is answered 429 unless it is right.
        let locked = limiter.isLocked(address)
        let attempt: UInt64
        switch limiter.reserve(address) {
        case .refused(let wait): return tooManySignIns(wait)
        case .attempt(let id): attempt = id
        }
        // A slot of the sign-ins' own cap; a stranger's sign-in still waiting for its body gives
        // way to this one when they are all taken.
        guard let slot = signIns.acquire() else {
            var response = message(
                status: .serviceUnavailable, title: "Busy", text: "The console is busy. Try again in a moment.", session: nil)
            response.headers[.retryAfter] = "1"
            return response
        }
        defer { signIns.release(slot.id) }
        guard let form = await form(request, limit: 4096, timeout: settings.signInBodyTimeout, givingWayTo: slot.evicted)
        else {
            return message(
                status: .badRequest, title: "Sign-in refused",
                text: "The sign-in form was too large or too slow to arrive. Try again.", session: nil)
        }
        signIns.bodyArrived(slot.id)
        let token = form["token"] ?? ""
        let role: ConsoleRole?
        if !token.isEmpty, settings.operatorTokens.contains(where: { ConsoleSessions.constantTimeEqual($0, token) }) {
            role = .operator_
        } else if !token.isEmpty, settings.viewerTokens.contains(where: { ConsoleSessions.constantTimeEqual($0, token) }) {
            role = .viewer
        } else {
            role = nil
        }
        guard let role else {
            // Never the token itself.
            logger.warning("console sign-in failed", metadata: ["iap.address": "\(address)"])
            if locked { return tooManySignIns(Int(limiter.lockedInterval)) }
            var context = ["error": "That token is not valid. Check it and try again."]
            if settings.operatorTokens.isEmpty && settings.viewerTokens.isEmpty {
                context["error"] = "The console is disabled: \(Setting.adminToken.variable) is not set."
            }
            return page("login", title: "Sign in", status: .unauthorized, session: nil, context)
        }
        limiter.release(attempt)
        var name = String((form["name"] ?? "").trimmingCharacters(in: .whitespacesAndNewlines).prefix(80))
        // A person never signs the audit log as one of the services, nor with text that joins the page around it.
        if IdentifierText.actorProblem(name) != nil || IdentifierText.problem(name) != nil { name = "" }
        let session = sessions.create(role: role, actor: name.isEmpty ? role.rawValue : name)
        logger.info(
            "console sign-in", metadata: ["iap.actor": "\(session.actor)", "iap.role": "\(role.rawValue)", "iap.address": "\(address)"])
        var response = Self.redirect(form["next"].flatMap(Self.consolePath) ?? "/admin/")
        response.headers[.setCookie] = cookie(value: session.id, maxAge: Int(sessions.lifetime))
        return response
    }

    private func tooManySignIns(_ wait: Int) -> Response {
        var response = message(
            status: .tooManyRequests, title: "Too many failed sign-ins",
            text: "Too many failed sign-ins from this address. Try again in \(wait) seconds.", session: nil)
        response.headers[.retryAfter] = String(wait)
        return response
    }

    /// `text` when it is a path of the console (`/admin/…`) in plain ASCII without spaces,
    /// backslashes or `//`: the only places a sign-in or an action may send the browser back to.
    static func consolePath(_ text: String) -> String? {
        guard text.hasPrefix("/admin/"), !text.contains("//"), !text.contains("\\"),
            text.unicodeScalars.allSatisfy({ $0.value > 0x20 && $0.value < 0x7F })
        else { return nil }
        return text
    }

    private func cookie(value: String, maxAge: Int) -> String {
        var cookie = "\(Self.cookieName)=\(value); Path=/admin; Max-Age=\(maxAge); HttpOnly; SameSite=Strict"
        if !settings.insecureCookies { cookie += "; Secure" }
        return cookie
    }

    func session(of request: Request) -> ConsoleSession? {
        sessions.session(request.cookies[Self.cookieName]?.value)
    }

    /// A page that needs a signed-in person.
    private func reading(_ request: Request, _ body: (ConsoleSession) async -> Response) async -> Response {
        guard let session = session(of: request) else {
            let next = request.uri.path + (request.uri.query.map { "?" + $0 } ?? "")
            return Self.redirect("/admin/login?next=" + (next.addingPercentEncoding(withAllowedCharacters: .alphanumerics) ?? ""))
        }
        return await body(session)
    }

    /// A form post: a session, its CSRF token, and for changes the operator role.
    ///
    /// Each action has a CSRF token of its own (`ConsoleSession.csrfToken(for:)`), so a field
    /// or button from outside a form (an injected `formaction`) cannot post that form's
    /// token to another action.
    private func guarded(
        _ request: Request, action: String, change: Bool, _ body: (ConsoleSession, [String: String]) async -> Response
    ) async -> Response {
        guard let session = session(of: request) else {
            return message(
                status: .unauthorized, title: "Signed out", text: "Your session has ended. Sign in again.", session: nil)
        }
        if change && session.role != .operator_ {
            logger.warning("console change refused to a viewer", metadata: ["iap.actor": "\(session.actor)"])
            return message(
                status: .forbidden, title: "403 Forbidden: read-only",
                text: "You are signed in as read-only support; only an operator can change anything. Nothing was changed.",
                session: session)
        }
        // Strangers were turned away above, before their bodies were read; a signed-in person's
        // posts count against caps of their own.
        guard let done = admit(session) else {
            var response = message(
                status: .serviceUnavailable, title: "Busy", text: "The console is busy. Try again in a moment.", session: session)
            response.headers[.retryAfter] = "1"
            return response
        }
        defer { done() }
        guard let form = await form(request, limit: 64 * 1024) else {
            return message(
                status: .badRequest, title: "Form refused",
                text: "The form was too large or too slow to arrive, so nothing was changed. Try again.", session: session)
        }
        guard let given = form["csrf"], ConsoleSessions.constantTimeEqual(given, session.csrfToken(for: action)) else {
            logger.warning("console form without a valid CSRF token", metadata: ["iap.actor": "\(session.actor)"])
            return message(
                status: .forbidden, title: "403 Forbidden: form refused",
                text: "This form did not carry this session's CSRF token, so nothing was changed. Reload the page and try again.",
                session: session)
        }
        return await body(session, form)
    }

    // MARK: - Rendering

    func page(
        _ template: String, title: String, status: HTTPResponse.Status = .ok, session: ConsoleSession?,
        _ context: [String: Any]
    ) -> Response {
        let html = render(template, title: title, session: session, context)
        var headers = HTTPFields()
        headers[.contentType] = "text/html; charset=utf-8"
        headers[.cacheControl] = "no-store"
        headers[.contentSecurityPolicy] =
            "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
        headers[HTTPField.Name("X-Frame-Options")!] = "DENY"
        headers[HTTPField.Name("Referrer-Policy")!] = "no-referrer"
        headers[HTTPField.Name("X-Content-Type-Options")!] = "nosniff"
        return Response(status: status, headers: headers, body: .init(byteBuffer: ByteBuffer(string: html)))
    }

    /// The HTML of a page: `template` with `context`, the title, and the session's name, role,
    /// per-action CSRF tokens and flash message.
    func render(_ template: String, title: String, session: ConsoleSession?, _ context: [String: Any]) -> String {
        var context = context
        context["title"] = title
        if let session {
            let actions = ConsoleAction.allCases.map { ($0.formKey, $0.rawValue) } + [("logout", "logout")]
            context["session"] = [
                "actor": session.actor, "role": session.role.rawValue,
                "csrf": Dictionary(uniqueKeysWithValues: actions.map { ($0.0, session.csrfToken(for: $0.1)) }),
                "isOperator": session.role == .operator_,
            ] as [String: Any]
            if let flash = sessions.takeFlash(session.id) {
                context["flash"] = ["kind": flash.kind, "text": flash.text]
            }
        }
        return templates.render(context, withTemplate: template) ?? "<!doctype html><title>Error</title><p>template \(template) missing"
    }

    func message(status: HTTPResponse.Status, title: String, text: String, session: ConsoleSession?) -> Response {
        page("message", title: title, status: status, session: session, ["heading": title, "text": text])
    }

    static func redirect(_ location: String) -> Response {
        var headers = HTTPFields()
        headers[.location] = location
        return Response(status: .seeOther, headers: headers)
    }

    /// The client's address, as the intake takes it (see ``ClientAddressPolicy``).
    func address(of request: Request, _ context: some RemoteAddressRequestContext) -> String {
        let header = settings.clientAddresses.header.flatMap { HTTPField.Name($0) }.flatMap { request.headers[$0] }
        return settings.clientAddresses.clientAddress(peer: context.remoteAddress?.ipAddress, headerValue: header)
    }

    /// A place among the form posts in progress for `session` (the console's cap and the
    /// session's own); the closure gives it back. Nil when either is full.
    func admit(_ session: ConsoleSession) -> (@Sendable () -> Void)? {
        let id = session.id
        let admitted = inFlight.withLockedValue { state in
            guard state.all < settings.maxInFlight, state.bySession[id, default: 0] < settings.maxInFlightPerSession else {
                return false
            }
            state.all += 1
            state.bySession[id, default: 0] += 1
            return true
        }
        guard admitted else { return nil }
        return { [inFlight] in
            inFlight.withLockedValue { state in
                state.all -= 1
                let left = state.bySession[id, default: 1] - 1
                state.bySession[id] = left > 0 ? left : nil
            }
        }
    }

    /// A page refusing an id no user or order can have (`IdentifierText`), or nil when it is fine.
    func refusal(ofId id: String, named name: String, session: ConsoleSession) -> Response? {
        guard let problem = IdentifierText.problem(id) else { return nil }
        return message(status: .badRequest, title: "Not a valid \(name)", text: "That \(name) \(problem).", session: session)
    }

    /// An `application/x-www-form-urlencoded` body of at most `limit` bytes, read within
    /// `timeout` (the body timeout unless told) and before `givingWayTo` yields; nil when it is
    /// larger, slower, cut off, given way, or in a transfer coding other than `chunked` alone.
    func form(
        _ request: Request, limit: Int, timeout: Duration? = nil, givingWayTo evicted: AsyncStream<Void>? = nil
    ) async -> [String: String]? {
        if let length = request.headers[.contentLength].flatMap(Int.init), length > limit { return nil }
        let timeout = timeout ?? settings.bodyTimeout
        let buffer: ByteBuffer?? = try? await withThrowingTaskGroup(of: ByteBuffer?.self) { group in
            group.addTask { try await request.body.collect(upTo: limit) }
            group.addTask {
                try await Task.sleep(for: timeout)
                return nil
            }
            if let evicted {
                group.addTask {
                    for await _ in evicted { break }
                    return nil
                }
            }
            defer { group.cancelAll() }
            return try await group.next() ?? nil
        }
        guard let buffer = buffer ?? nil, Self.readableTransferCoding(request.headers) else { return nil }
        return Self.parseForm(String(buffer: buffer))
    }

    /// Whether a request has no `Transfer-Encoding` or `chunked` alone: a form in any other
    /// coding (`gzip`, `xchunked`) is not read as one.
    static func readableTransferCoding(_ headers: HTTPFields) -> Bool {
        let values = headers[values: .transferEncoding]
        return values.isEmpty
            || values.flatMap { $0.split(separator: ",") }.map { $0.trimmingCharacters(in: .whitespaces).lowercased() } == ["chunked"]
    }

    static func parseForm(_ text: String) -> [String: String] {
        var fields: [String: String] = [:]
        for pair in text.split(separator: "&") {
            let parts = pair.split(separator: "=", maxSplits: 1, omittingEmptySubsequences: false)
            let decode = { (part: Substring) in
                String(part).replacingOccurrences(of: "+", with: " ").removingPercentEncoding ?? ""
            }
            guard let name = parts.first.map(decode), !name.isEmpty else { continue }
            fields[name] = parts.count > 1 ? decode(parts[1]) : ""
        }
        return fields
    }
}

struct ConsoleError: Error, CustomStringConvertible {
    var description: String
    init(_ description: String) { self.description = description }
}
