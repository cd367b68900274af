import Foundation
import HTTPTypes
public import Hummingbird
import Logging
import NIOConcurrencyHelpers
import NIOCore
import OrderStore
public import IAPCore

/// A token-bucket rate: `perSecond` requests on average, bursts of up to `burst`.
public struct RateLimit: Sendable, Equatable {
    /// Requests per second, sustained.
    public var perSecond: Int
    /// Requests allowed at once after a quiet spell.
    public var burst: Int

    /// Creates a rate; the burst defaults to two seconds' worth.
    public init(perSecond: Int, burst: Int? = nil) {
        self.perSecond = max(1, perSecond)
        self.burst = max(1, burst ?? 2 * perSecond)
    }
}

/// What the intake allows one client, and itself, at a time.
public struct IntakeLimits: Sendable {
    /// Per authenticated user (the token's `sub`); nil is unlimited.
    public var perUser: RateLimit?
    /// Per client address; nil is unlimited.
    public var perAddress: RateLimit?
    /// Requests handled at once; more get 503 `overloaded` at once instead of queueing.
    public var maxInFlight: Int
    /// Where a client's address comes from: the TCP peer, or the header a trusted reverse
    /// proxy sets (`IAP_CLIENT_IP_HEADER`), believed only from the proxies the operator names
    /// (`IAP_TRUSTED_PROXIES`).
    public var clientAddresses: ClientAddressPolicy
    /// Time allowed to receive a request body.
    public var bodyTimeout: Duration
    /// App Store notifications whose signature verified, for the whole deployment (Apple sends
    /// from many addresses, so per address would not bound them); over it they get 503 with
    /// `Retry-After` (Apple retries), never 429. Nil is unlimited.
    public var notifications: RateLimit?
    /// App Store notifications refused (unreadable, or failing the signature and chain checks)
    /// per client address: charged once the refusal is known, never before the body is read;
    /// past it, a refusal is answered 429 with `Retry-After` instead. A notification that
    /// verifies is never refused for it, whoever shares its address. Nil is unlimited.
    public var notificationFailuresPerAddress: RateLimit?
    /// Requests refused for what they carried (400, 408, 413) per client address, on the
    /// app's routes, Apple's notifications and the admin routes: past it, such a refusal is
    /// answered 429 with `Retry-After` instead. Good requests from the address are never refused
    /// for it (many apps may share a carrier's address; Apple's notifications may share a
    /// proxy's). Nil is unlimited.
    public var refusalsPerAddress: RateLimit?
    /// Failed admin authorizations (bearer tokens on the admin routes, console sign-ins) one
    /// client address may make within five minutes before it is locked to one try every two
    /// seconds. Nil is unlimited: only for API conformance checks that send wrong tokens on
    /// purpose.
    public var failedAdminAttempts: Int?

    /// Creates limits (the defaults are those of `iap`).
    public init(
        perUser: RateLimit? = RateLimit(perSecond: Setting.rateLimitPerUser.defaultInt),
        perAddress: RateLimit? = RateLimit(perSecond: Setting.rateLimitPerIP.defaultInt),
        maxInFlight: Int = Setting.maxInFlightRequests.defaultInt, clientAddresses: ClientAddressPolicy = .peer,
        bodyTimeout: Duration = Setting.bodyTimeoutSeconds.defaultSeconds,
        notifications: RateLimit? = RateLimit(perSecond: Setting.notificationRate.defaultInt),
        notificationFailuresPerAddress: RateLimit? = RateLimit(perSecond: 5, burst: 20),
        refusalsPerAddress: RateLimit? = RateLimit(perSecond: Setting.refusalsPerIP.defaultInt),
        failedAdminAttempts: Int? = Setting.adminFailedAttempts.defaultInt
    ) {
        self.failedAdminAttempts = failedAdminAttempts
        self.notifications = notifications
        self.refusalsPerAddress = refusalsPerAddress
        self.notificationFailuresPerAddress = notificationFailuresPerAddress
        self.perUser = perUser
        self.perAddress = perAddress
        self.maxInFlight = maxInFlight
        self.clientAddresses = clientAddresses
        self.bodyTimeout = bodyTimeout
    }

    /// No rate limits (tests and benchmarks on one address); in-flight work stays bounded.
    public static let unlimited = IntakeLimits(
        perUser: nil, perAddress: nil, notifications: nil, notificationFailuresPerAddress: nil, refusalsPerAddress: nil)

    /// The client's address (see ``ClientAddressPolicy``): canonical address text, never text
    /// the client chose.
    public func clientAddress(of request: Request, peer: SocketAddress?) -> String {
        clientAddresses.clientAddress(of: request, peer: peer)
    }
}

/// Token buckets by key, in memory, with a bounded number of keys.
///
/// Keys are compared by their UTF-8 bytes, never by Swift's `==` (canonical equivalence):
/// two users whose ids only look alike never share a bucket. The clock is read inside the
/// lock, so a request that waited for the lock never refills a bucket with time another
/// request already spent, and elapsed time saturates at zero when the clock seems to go back.
final class TokenBuckets: Sendable {
    private struct Bucket {
        var tokens: Double
        var updated: UInt64
    }

    private let rate: Double
    private let burst: Double
    private let maxKeys: Int
    private let clock: @Sendable () -> UInt64
    private let buckets = NIOLockedValueBox([[UInt8]: Bucket]())

    init(_ limit: RateLimit, maxKeys: Int = 100_000, clock: @escaping @Sendable () -> UInt64 = { DispatchTime.now().uptimeNanoseconds }) {
        rate = Double(limit.perSecond)
        burst = Double(limit.burst)
        self.maxKeys = maxKeys
        self.clock = clock
    }

    /// Takes one token for `key`: nil when allowed, else the whole seconds to wait.
    func take(_ key: String) -> Int? {
        update(key, taking: true)
    }

    /// Whether `key` has a token left, without taking it: nil when it has, else the whole
    /// seconds to wait.
    func peek(_ key: String) -> Int? {
        update(key, taking: false)
    }

    private func update(_ key: String, taking: Bool) -> Int? {
        let bytes = Array(key.utf8)
        return buckets.withLockedValue { buckets in
            let now = clock()
            var bucket = buckets[bytes] ?? Bucket(tokens: burst, updated: now)
            bucket.tokens = min(burst, bucket.tokens + Self.seconds(from: bucket.updated, to: now) * rate)
            bucket.updated = max(bucket.updated, now)
            defer {
                if taking {
                    if buckets[bytes] == nil && buckets.count >= maxKeys { evict(&buckets, now: now) }
                    buckets[bytes] = bucket
                }
            }
            if bucket.tokens >= 1 {
                if taking { bucket.tokens -= 1 }
                return nil
            }
            return max(1, Int(((1 - bucket.tokens) / rate).rounded(.up)))
        }
    }

    /// Seconds from `start` to `end`, zero when `end` is not later (saturating, never wrapping).
    static func seconds(from start: UInt64, to end: UInt64) -> Double {
        end > start ? Double(end - start) / 1e9 : 0
    }

    /// Drops buckets that have refilled (their owners are as good as new); if every key is
    /// busy, starts over rather than grow without bound.
    private func evict(_ buckets: inout [[UInt8]: Bucket], now: UInt64) {
        buckets = buckets.filter { _, bucket in
            bucket.tokens + Self.seconds(from: bucket.updated, to: now) * rate < burst
        }
        if buckets.count >= maxKeys { buckets.removeAll(keepingCapacity: true) }
    }
}

/// One rate limit by key, for the whole deployment: counted in this process's memory and,
/// where several order services share the order store (PostgreSQL), in the store too, so
/// that N services still allow the rate once rather than N times.
///
/// The local count comes first: a key over the rate here is over it everywhere, and is
/// refused without a round trip. If the store cannot be asked (it is away), the local count
/// alone decides: the upload itself then fails with 503 if it cannot be stored either.
final class RateLimiter: Sendable {
    private let limit: RateLimit
    private let local: TokenBuckets
    private let shared: OrderStore?
    /// Prefixes the key in the store, so that limits of different kinds never share a bucket.
    private let scope: String
    private let lastWarning = NIOLockedValueBox(ContinuousClock.now - .seconds(3600))

    init(_ limit: RateLimit, scope: String, store: OrderStore, maxKeys: Int = 100_000) {
        self.limit = limit
        self.scope = scope
        local = TokenBuckets(limit, maxKeys: maxKeys)
        shared = store.sharesRateLimits ? store : nil
    }

    /// Takes one request's turn for `key`: nil when allowed, else the whole seconds to wait.
    func take(_ key: String, logger: Logger) async -> Int? {
        if let wait = local.take(key) { return wait }
        guard let shared else { return nil }
        do {
            guard
                let wait = try await shared.takeRateToken(
                    "\(scope):\(key)", perSecond: Double(limit.perSecond), burst: Double(limit.burst))
            else { return nil }
            return max(1, Int(wait.rounded(.up)))
        } catch {
            let now = ContinuousClock.now
            let warn = lastWarning.withLockedValue { last in
                guard now - last >= .seconds(60) else { return false }
                last = now
                return true
            }
            if warn {
                logger.warning(
                    "shared rate limit unavailable; counting in this process only",
                    metadata: ["iap.rate_limit.scope": "\(scope)", "error": "\(error)"])
            }
            return nil
        }
    }
}

extension APIError {
    static func rateLimited(retryAfter seconds: Int) -> APIError {
        var error = APIError(.rateLimited, "too many requests; retry after \(seconds) s")
        error.headers[.retryAfter] = String(seconds)
        return error
    }
}

/// Makes a request refused for what it carried cost its sender: each such refusal (400, 408,
/// 413) takes a token of the client address's refusal budget
/// (`IntakeLimits.refusalsPerAddress`), and one past it is answered 429 `rate_limited` with
/// `Retry-After` instead, so a client sending junk in a loop is told to back off.
///
/// The budget is spent after the answer is known and never consulted before a request is
/// read: a good request from the same address (an app behind the same carrier, Apple behind
/// the same proxy) is never refused for someone else's junk. The console's pages are left to
/// their own limits (they answer pages, not JSON).
struct RefusalCostMiddleware: RouterMiddleware {
    typealias Context = IntakeContext

    static let refusals: Set<Int> = [400, 408, 413]

    let limits: IntakeLimits
    private let budget: RateLimiter?

    init(limits: IntakeLimits, store: OrderStore) {
        self.limits = limits
        budget = limits.refusalsPerAddress.map { RateLimiter($0, scope: "refusals", store: store) }
    }

    func handle(
        _ request: Request, context: Context, next: (Request, Context) async throws -> Response
    ) async throws -> Response {
        let response = try await next(request, context)
        guard let budget, Self.refusals.contains(response.status.code), !request.uri.path.hasPrefix("/admin/"),
            let wait = await budget.take(limits.clientAddress(of: request, peer: context.remoteAddress), logger: context.logger)
        else { return response }
        return APIError.rateLimited(retryAfter: wait).makeResponse()
    }
}

/// Bounds the requests handled at once and applies the per-address rate limit to every
/// route but `/healthz`, Apple's notifications (a bucket of their own) and the console's
/// pages (a cap of their own). With user tokens, a request on the app-user routes that carries
/// a bearer token is charged to its user instead (``UserAuthMiddleware``), and to its address
/// only when the token is refused: many users behind one carrier's address are never refused
/// for a stranger's token-less requests from that address.
struct AdmissionMiddleware: RouterMiddleware {
    typealias Context = IntakeContext

    let limits: IntakeLimits
    private let inFlight = NIOLockedValueBox(0)
    private let addressLimit: RateLimiter?
    private let usersChargedToThemselves: Bool

    init(limits: IntakeLimits, addressLimit: RateLimiter?, usersChargedToThemselves: Bool) {
        self.limits = limits
        self.addressLimit = addressLimit
        self.usersChargedToThemselves = usersChargedToThemselves
    }

    /// The app-user routes (behind ``UserAuthMiddleware``).
    static func isUserRoute(_ path: String) -> Bool {
        path == "/v1/receipts" || path.hasPrefix("/v1/receipts/") || path == "/v1/orders" || path.hasPrefix("/v1/orders/")
            || path.hasPrefix("/v1/users/")
    }

    /// Whether the address is charged for `request` here, before anything is read of it.
    private func chargesAddress(_ request: Request) -> Bool {
        let path = request.uri.path
        guard path != "/v1/notifications/appstore" else { return false }
        guard usersChargedToThemselves, Self.isUserRoute(path),
            let authorization = request.headers[.authorization], authorization.count > 7,
            authorization.prefix(7).lowercased() == "bearer "
        else { return true }
        return false
    }

    func handle(
        _ request: Request, context: Context, next: (Request, Context) async throws -> Response
    ) async throws -> Response {
        if request.uri.path == "/healthz" { return try await next(request, context) }
        // Apple sends notifications from few addresses, in bursts, and retries only in production.
        if let addressLimit, chargesAddress(request),
            let wait = await addressLimit.take(limits.clientAddress(of: request, peer: context.remoteAddress), logger: context.logger)
        {
            throw APIError.rateLimited(retryAfter: wait)
        }
        // A body no route can read (`Transfer-Encoding: gzip`) is the sender's fault, answered
        // 400 after its address paid for it above; Apple's notifications count it in their own
        // bucket, and the console's forms refuse it themselves.
        if request.uri.path != "/v1/notifications/appstore", !request.uri.path.hasPrefix("/admin/"),
            let coding = IntakeBody.unreadableTransferCoding(request.headers)
        {
            await IntakeBody.discard(request, timeout: limits.bodyTimeout)
            throw APIError(.badRequest, coding)
        }
        // The console's pages count against a cap of their own (where IAP_ADMIN_PUBLIC serves them
        // here): a slow sign-in never holds one of the app's slots.
        if request.uri.path.hasPrefix("/admin/") { return try await next(request, context) }
        let admitted = inFlight.withLockedValue { count in
            guard count < limits.maxInFlight else { return false }
            count += 1
            return true
        }
        guard admitted else {
            var error = APIError(.overloaded, "too many requests in progress; try again")
            error.headers[.retryAfter] = "1"
            throw error
        }
        defer { inFlight.withLockedValue { $0 -= 1 } }
        return try await next(request, context)
    }
}

extension ClientAddressPolicy {
    /// The client's address of `request`, received from `peer`.
    func clientAddress(of request: Request, peer: SocketAddress?) -> String {
        clientAddress(peer: peer?.ipAddress, headerValue: header.flatMap { HTTPField.Name($0) }.flatMap { request.headers[$0] })
    }
}
