import AppStore
import Crypto
public import Foundation
import IAPCore
import Hummingbird
import JWTKit
import Logging
import OrderStore

/// How app users prove who they are to the intake.
public enum UserAuthentication: Sendable {
    /// `Authorization: Bearer <JWT>` issued by the app's own login backend; `sub` is the user id.
    case jwt(UserTokenVerifier)
    /// No authentication: the user id comes from the request. For local development only.
    case off
}

/// Checks the JWTs the app's login backend issues: the algorithm is the configured key's,
/// the header names no `crit` extension (this intake understands none; RFC 7515 §4.1.11),
/// the signature verifies, `exp` has not passed (and `nbf` has), `iat` when present is a
/// number not ahead of now, the token lives no longer than `maxLifetime`, and `aud` / `iss`
/// match when configured. The token's `sub` is the user id.
public struct UserTokenVerifier: Sendable {
    /// Where the verification key comes from.
    public enum Key: Sendable {
        /// HS256 with a secret shared with the login backend (at least 32 bytes).
        case hs256(secret: String)
        /// A PEM public key (`-----BEGIN PUBLIC KEY-----`): P-256 for ES256, or RSA (2048 bits
        /// or more) for RS256; or a JWKS document (`{"keys": [...]}`) of such keys.
        case publicKey(String)
    }

    private let keys: JWTKeyCollection
    private let algorithms: Set<String>
    /// With a JWKS: each key's `kid` and the one algorithm its type signs with (EC: ES256,
    /// RSA: RS256). A token must name one of these kids, with that kid's algorithm.
    private let keyAlgorithms: [String: String]?
    private let audience: String?
    private let issuer: String?
    /// Clock skew tolerated on `exp`, `nbf` and `iat`.
    private let leeway: TimeInterval = 30
    /// The longest a token may live: `exp - iat`, or `exp - now` without `iat`
    /// (`IAP_AUTH_MAX_LIFETIME`), so a token stolen once is not good until the year 9999.
    private let maxLifetime: TimeInterval

    /// `IAP_AUTH_MAX_LIFETIME`'s default: a day.
    public static let defaultMaxLifetime = TimeInterval(Setting.authMaxLifetime.defaultDuration.components.seconds)

    /// The longest user id a token may carry, as for ids in bodies.
    static let maxSubjectLength = 256

    /// Builds a verifier; throws a message fit for a start-up error when the key is unusable.
    public init(
        key: Key, audience: String? = nil, issuer: String? = nil, maxLifetime: TimeInterval = defaultMaxLifetime
    ) async throws(UserTokenVerifierError) {
        guard maxLifetime > 0 else { throw UserTokenVerifierError("the longest token lifetime must be more than 0 seconds") }
        self.maxLifetime = maxLifetime
        let keys = JWTKeyCollection()
        switch key {
        case .hs256(let secret):
            guard secret.utf8.count >= 32 else {
                throw UserTokenVerifierError("the HS256 secret must be at least 32 bytes")
            }
            await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
            algorithms = ["HS256"]
            keyAlgorithms = nil
        case .publicKey(let text):
            let trimmed = text.trimmingCharacters(in: .whitespacesAndNewlines)
            if trimmed.hasPrefix("{") {
                do {
                    try await keys.add(jwksJSON: trimmed)
                } catch {
                    throw UserTokenVerifierError("the JWKS document is not usable: \(error)")
                }
                // Asymmetric algorithms only: a JWKS is public, so a symmetric key in it would be no secret.
                algorithms = ["ES256", "RS256"]
                keyAlgorithms = try Self.keyAlgorithms(ofJWKS: trimmed)
            } else if let key = try? ES256PublicKey(pem: trimmed) {
                keyAlgorithms = nil
                await keys.add(ecdsa: key)
                algorithms = ["ES256"]
            } else if let key = try? Insecure.RSA.PublicKey(pem: trimmed) {
                keyAlgorithms = nil
                await keys.add(rsa: key, digestAlgorithm: .sha256)
                algorithms = ["RS256"]
            } else {
                throw UserTokenVerifierError(
                    "the public key is neither a P-256 nor an RSA (2048 bits or more) PEM public key, nor a JWKS document")
            }
        }
        self.keys = keys
        self.audience = audience
        self.issuer = issuer
    }

    /// The user id of a valid token; a refusal says which check failed.
    public func userId(from token: String, now: Date = Date()) async throws(AuthenticationFailure) -> String {
        guard token.utf8.count <= 16 * 1024 else { throw .init(.malformed, "longer than 16 KiB") }
        guard let (algorithm, kid, critical) = Self.header(of: token) else { throw .init(.malformed, "no readable JWS header") }
        // RFC 7515 §4.1.11: extensions named in `crit` must be understood, and this intake understands none.
        guard !critical else { throw .init(.malformed, "the header names crit extensions, which this intake does not understand") }
        // Only the configured key's algorithm: `none`, or HS256 signed with a public key, never verify.
        guard algorithms.contains(algorithm) else {
            throw .init(
                .algorithmRefused,
                "alg \(algorithm.prefix(20).debugDescription) is not \(algorithms.sorted().joined(separator: " or "))")
        }
        if let keyAlgorithms {
            // A JWKS: the token names its key, and signs with that key's own algorithm; an unknown
            // kid is refused, never tried against some other key.
            let named = kid ?? (keyAlgorithms.count == 1 ? keyAlgorithms.keys.first : nil)
            guard let named, let expected = keyAlgorithms[named] else {
                throw .init(.signatureInvalid, "kid \((kid ?? "none").prefix(40).debugDescription) is no configured key's")
            }
            guard algorithm == expected else {
                throw .init(.algorithmRefused, "alg \(algorithm) is not the algorithm of key \(named.prefix(40).debugDescription)")
            }
        }
        // Every NumericDate is read and bounded before any arithmetic or conversion touches it:
        // a token may say `"exp": 1e300`, and no claim from outside may trap the process.
        let dates = try Self.numericDates(of: token)
        let claims: UserClaims
        do {
            claims = try await keys.verify(token, as: UserClaims.self)
        } catch let error as JWTError {
            switch error.errorType {
            case .malformedToken, .invalidHeaderField, .invalidBool:
                throw .init(.malformed, error.reason ?? "\(error.errorType)")
            case .unsupportedAlgorithm:
                throw .init(.algorithmRefused, "\(error.errorType)")
            default:
                // A bad signature, or a `kid` no configured key has.
                throw .init(.signatureInvalid, "\(error.errorType)")
            }
        } catch {
            throw .init(.signatureInvalid, "\(type(of: error))")
        }
        guard let expires = dates.exp else { throw .init(.malformed, "exp is missing") }
        guard expires + leeway > now.timeIntervalSince1970 else {
            throw .init(.expired, "exp \(Int64(expires)) is past")
        }
        if let issuedAt = dates.iat, issuedAt - leeway > now.timeIntervalSince1970 {
            throw .init(.notYetValid, "iat \(Int64(issuedAt)) is ahead")
        }
        let lifetime = expires - (dates.iat ?? now.timeIntervalSince1970)
        guard lifetime <= maxLifetime + leeway else {
            throw .init(.malformed, "lives \(Int64(lifetime)) s, longer than \(Setting.authMaxLifetime.variable) (\(Int64(maxLifetime)) s)")
        }
        if let notBefore = dates.nbf, notBefore - leeway > now.timeIntervalSince1970 {
            throw .init(.notYetValid, "nbf \(Int64(notBefore)) is ahead")
        }
        if let audience, !(claims.aud?.value.contains(audience) ?? false) {
            throw .init(.audienceMismatch, "aud lacks the configured audience")
        }
        if let issuer, claims.iss?.value != issuer { throw .init(.issuerMismatch, "iss is not the configured issuer") }
        let subject = claims.sub.value
        guard !subject.isEmpty, subject.utf8.count <= Self.maxSubjectLength else {
            throw .init(.malformed, "sub is empty or longer than \(Self.maxSubjectLength) bytes")
        }
        guard !subject.utf8.contains(0) else { throw .init(.malformed, "sub holds a NUL character") }
        // Two spellings of one name are never two users: a sub must be NFC, and free of what
        // would join the text around it where it is shown.
        if let problem = IdentifierText.problem(subject, requireNFC: true) { throw .init(.malformed, "sub \(problem)") }
        return subject
    }

    /// The `alg` and `kid` of a compact JWS header, and whether it has a `crit` member, or nil
    /// when the header is not readable.
    private static func header(of token: String) -> (algorithm: String, kid: String?, critical: Bool)? {
        guard let dot = token.firstIndex(of: "."), let header = Base64URL.decode(token.utf8[..<dot]),
            let object = try? JSONSerialization.jsonObject(with: header) as? [String: Any],
            let algorithm = object["alg"] as? String
        else { return nil }
        return (algorithm, object["kid"] as? String, object["crit"] != nil)
    }

    /// The latest NumericDate a token may carry: the last second of the year 9999.
    static let latestNumericDate: Double = 253_402_300_799

    /// The payload's `exp`, `iat` and `nbf` in seconds since 1970, each nil when absent. Each
    /// present one must be a finite number in 0...``latestNumericDate`` (RFC 7519 §2), else the
    /// token is malformed: every value returned converts to an integer and subtracts safely.
    static func numericDates(of token: String) throws(AuthenticationFailure) -> (exp: Double?, iat: Double?, nbf: Double?) {
        struct Dates: Decodable {
            var exp: Double?
            var iat: Double?
            var nbf: Double?
        }
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let payload = Base64URL.decode(parts[1].utf8) else {
            throw .init(.malformed, "no readable payload")
        }
        // JSONDecoder takes no string or boolean for a Double, and no number beyond a Double's range.
        guard let decoded = try? JSONDecoder().decode(Dates.self, from: Data(payload)) else {
            throw .init(.malformed, "exp, iat or nbf is not a number")
        }
        for (name, value) in [("exp", decoded.exp), ("iat", decoded.iat), ("nbf", decoded.nbf)] {
            guard let value else { continue }
            guard value.isFinite, value >= 0, value <= latestNumericDate else {
                throw .init(.malformed, "\(name) is not a NumericDate between 1970 and 9999")
            }
        }
        return (decoded.exp, decoded.iat, decoded.nbf)
    }

    /// Each key of a JWKS document by `kid`, with the algorithm its type signs with.
    private static func keyAlgorithms(ofJWKS text: String) throws(UserTokenVerifierError) -> [String: String] {
        guard let object = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any],
            let keys = object["keys"] as? [[String: Any]], !keys.isEmpty
        else { throw UserTokenVerifierError("the JWKS document has no keys") }
        var algorithms: [String: String] = [:]
        for (index, key) in keys.enumerated() {
            let kid = key["kid"] as? String ?? ""
            guard !kid.isEmpty || keys.count == 1 else {
                throw UserTokenVerifierError("key \(index) of the JWKS document has no kid (every key of several needs one)")
            }
            switch key["kty"] as? String {
            case "EC": algorithms[kid] = "ES256"
            case "RSA": algorithms[kid] = "RS256"
            default: throw UserTokenVerifierError("key \(kid.isEmpty ? String(index) : kid) of the JWKS document is neither EC nor RSA")
            }
            if let declared = key["alg"] as? String, declared != algorithms[kid] {
                throw UserTokenVerifierError("key \(kid) of the JWKS document declares alg \(declared), not \(algorithms[kid] ?? "")")
            }
        }
        return algorithms
    }
}

/// Why a token was refused (the answer is 401 either way, with the reason's own code), and
/// the detail logged at info. Never the token itself.
public struct AuthenticationFailure: Error, Sendable, Equatable {
    /// Which check failed.
    public enum Reason: Sendable, Equatable {
        case expired, notYetValid, signatureInvalid, malformed, algorithmRefused, audienceMismatch, issuerMismatch
    }

    /// Which check failed.
    public var reason: Reason
    /// What exactly, for the log.
    public var detail: String

    init(_ reason: Reason, _ detail: String) {
        self.reason = reason
        self.detail = detail
    }

    /// The answer's error code.
    public var code: APIErrorCode {
        switch reason {
        case .expired: .tokenExpired
        case .notYetValid: .tokenNotYetValid
        case .signatureInvalid: .tokenSignatureInvalid
        case .malformed: .tokenMalformed
        case .algorithmRefused: .tokenAlgorithmRefused
        case .audienceMismatch: .tokenAudienceMismatch
        case .issuerMismatch: .tokenIssuerMismatch
        }
    }

    /// Failures are equal when their reasons are: the detail is for people.
    public static func == (lhs: Self, rhs: Self) -> Bool { lhs.reason == rhs.reason }
}

/// A verification key that cannot be used.
public struct UserTokenVerifierError: Error, CustomStringConvertible, Sendable {
    public let description: String

    init(_ description: String) {
        self.description = description
    }
}

/// The claims the intake reads. Expiry is checked by `UserTokenVerifier`, with leeway.
struct UserClaims: JWTPayload {
    var sub: SubjectClaim
    var exp: ExpirationClaim
    var nbf: NotBeforeClaim?
    var iss: IssuerClaim?
    var aud: AudienceClaim?

    func verify(using algorithm: some JWTAlgorithm) async throws {}
}

/// Establishes the user of the app-user routes and applies the per-user rate limit. With a
/// token, the user is its `sub`. With authentication off (development), the user is the one
/// the request names, `?userId=` or the path's `/v1/users/{userId}/…` (a body's `userId` is
/// admitted by the handler that reads it): the rate limit and the ownership rules are then the
/// same as with tokens; only the source of the user id differs.
struct UserAuthMiddleware: RouterMiddleware {
    typealias Context = IntakeContext

    let authentication: UserAuthentication
    private let userLimit: RateLimiter?
    /// The per-address limit, charged here for a token that is refused (a verified one is
    /// charged to its user alone; see ``AdmissionMiddleware``).
    private let addressLimit: RateLimiter?
    private let limits: IntakeLimits

    init(authentication: UserAuthentication, limit: RateLimit?, addressLimit: RateLimiter?, limits: IntakeLimits, store: OrderStore) {
        self.authentication = authentication
        self.addressLimit = addressLimit
        self.limits = limits
        userLimit = limit.map { RateLimiter($0, scope: "user", store: store) }
    }

    func handle(
        _ request: Request, context: Context, next: (Request, Context) async throws -> Response
    ) async throws -> Response {
        var context = context
        switch authentication {
        case .jwt(let verifier):
            guard let header = request.headers[.authorization], header.count > 7,
                header.prefix(7).lowercased() == "bearer "
            else {
                throw APIError.unauthenticated(nil)
            }
            let userId: String
            do {
                userId = try await verifier.userId(from: String(header.dropFirst(7)).trimmingCharacters(in: .whitespaces))
            } catch {
                // The cause tells a clock problem from a key problem; the token itself is never logged.
                context.logger.info(
                    "user token refused",
                    metadata: ["iap.error.code": "\(error.code.rawValue)", "iap.error.cause": "\(error.detail)"])
                if let addressLimit,
                    let wait = await addressLimit.take(limits.clientAddress(of: request, peer: context.remoteAddress), logger: context.logger)
                {
                    throw APIError.rateLimited(retryAfter: wait)
                }
                throw APIError.unauthenticated(error)
            }
            try await admit(userId, context: context)
            context.userId = userId
        case .off:
            if let named = try Self.namedUser(request) {
                try await admit(named, context: context)
                context.userId = named
            } else if request.method == .get {
                // A read acts for a user as in production; only the source of the id changes.
                throw APIError(.unauthenticated, "with \(Setting.auth.variable)=off, name the user with ?userId=")
            } else {
                context.pendingUserLimit = userLimit
            }
        }
        return try await next(request, context)
    }

    private func admit(_ userId: String, context: Context) async throws(APIError) {
        if let userLimit, let wait = await userLimit.take(userId, logger: context.logger) {
            throw APIError.rateLimited(retryAfter: wait)
        }
    }

    /// With authentication off: `?userId=`, else the user of a `/v1/users/{userId}/…` path.
    static func namedUser(_ request: Request) throws(APIError) -> String? {
        if let query = request.uri.queryParameters.get("userId"), !query.isEmpty {
            guard query.utf8.count <= UserTokenVerifier.maxSubjectLength else {
                throw APIError.invalidField("userId", "is longer than \(UserTokenVerifier.maxSubjectLength) bytes")
            }
            if let problem = IdentifierText.problem(query) { throw APIError.invalidField("userId", problem) }
            return query
        }
        let segments = request.uri.path.split(separator: "/")
        guard segments.count >= 3, segments[0] == "v1", segments[1] == "users" else { return nil }
        let named = String(segments[2]).removingPercentEncoding ?? String(segments[2])
        if let problem = IdentifierText.problem(named) { throw APIError.invalidField("userId", problem) }
        return named
    }
}

extension IntakeContext {
    /// The user a request acts for: the established one (token, or with authentication off
    /// `?userId=` or the path), else the one the body names, which then takes its turn of the
    /// per-user rate limit. A body naming another user than the established one is refused.
    func resolveUser(named: String?) async throws(APIError) -> String {
        if let userId {
            if let named, !sameUser(named, userId) {
                throw APIError(.userMismatch, "'userId' differs from the user of the token (or of ?userId=)")
            }
            return userId
        }
        guard let named else { throw APIError.missingField("userId") }
        if let pendingUserLimit, let wait = await pendingUserLimit.take(named, logger: logger) {
            throw APIError.rateLimited(retryAfter: wait)
        }
        return named
    }
}
