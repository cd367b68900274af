import AppStore
import Crypto
import Foundation
import Hummingbird
import JWTKit

/// How app users prove who they are to the intake.
public enum UserAuthentication: Sendable {
    /// `Authorization: Bearer <JWT>` issued by the app's own login backend; `sub` is the user id.
    case jwt(UserTokenVerifier)
    /// No authentication: the user id comes from the request. For local development only.
    case off
}

/// Checks the JWTs the app's login backend issues: the algorithm is the configured key's,
/// the signature verifies, `exp` has not passed (and `nbf` has), and `aud` / `iss` match
/// when configured. The token's `sub` is the user id.
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
    private let audience: String?
    private let issuer: String?
    /// Clock skew tolerated on `exp` and `nbf`.
    private let leeway: TimeInterval = 30

    /// The longest user id a token may carry, as for ids in bodies.
    static let maxSubjectLength = 256

    /// Builds a verifier; throws a message fit for a start-up error when the key is unusable.
    public init(key: Key, audience: String? = nil, issuer: String? = nil) async throws(UserTokenVerifierError) {
        let keys = JWTKeyCollection()
        switch key {
        case .hs256(let secret):
            guard secret.utf8.count >= 32 else {
                throw UserTokenVerifierError("the HS256 secret must be at least 32 bytes")
            }
            await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
            algorithms = ["HS256"]
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
            } else if let key = try? ES256PublicKey(pem: trimmed) {
                await keys.add(ecdsa: key)
                algorithms = ["ES256"]
            } else if let key = try? Insecure.RSA.PublicKey(pem: trimmed) {
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

    /// The user id of a valid token.
    public func userId(from token: String, now: Date = Date()) async throws(AuthenticationFailure) -> String {
        guard token.utf8.count <= 16 * 1024, let algorithm = Self.algorithm(of: token) else {
            throw .invalid
        }
        // Only the configured key's algorithm: `none`, or HS256 signed with a public key, never verify.
        guard algorithms.contains(algorithm) else { throw .invalid }
        let claims: UserClaims
        do {
            claims = try await keys.verify(token, as: UserClaims.self)
        } catch {
            throw .invalid
        }
        guard claims.exp.value.addingTimeInterval(leeway) > now else { throw .expired }
        if let notBefore = claims.nbf?.value, notBefore.addingTimeInterval(-leeway) > now { throw .invalid }
        if let audience, !(claims.aud?.value.contains(audience) ?? false) { throw .invalid }
        if let issuer, claims.iss?.value != issuer { throw .invalid }
        let subject = claims.sub.value
        guard !subject.isEmpty, subject.utf8.count <= Self.maxSubjectLength else { throw .invalid }
        return subject
    }

    /// The `alg` of a compact JWS header, or nil when the header is not readable.
    private static func algorithm(of token: String) -> String? {
        guard let dot = token.firstIndex(of: "."), let header = Base64URL.decode(token.utf8[..<dot]),
            let object = try? JSONSerialization.jsonObject(with: header) as? [String: Any]
        else { return nil }
        return object["alg"] as? String
    }
}

/// Why a token was refused; the answer is 401 either way.
public enum AuthenticationFailure: Error, Sendable {
    case missing
    case invalid
    case expired
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

/// Authenticates the app-user routes: sets `context.userId` from the bearer token and applies
/// the per-user rate limit. With authentication off it lets requests through as they are.
struct UserAuthMiddleware: RouterMiddleware {
    typealias Context = IntakeContext

    let authentication: UserAuthentication
    private let userBuckets: TokenBuckets?

    init(authentication: UserAuthentication, limit: RateLimit?) {
        self.authentication = authentication
        userBuckets = limit.map { TokenBuckets($0) }
    }

    func handle(
        _ request: Request, context: Context, next: (Request, Context) async throws -> Response
    ) async throws -> Response {
        guard case .jwt(let verifier) = authentication else { return try await next(request, context) }
        guard let header = request.headers[.authorization], header.count > 7,
            header.prefix(7).lowercased() == "bearer "
        else {
            throw APIError.unauthenticated(.missing)
        }
        let userId: String
        do {
            userId = try await verifier.userId(from: String(header.dropFirst(7)).trimmingCharacters(in: .whitespaces))
        } catch {
            throw APIError.unauthenticated(error)
        }
        if let userBuckets, let wait = userBuckets.take(userId) {
            throw APIError.rateLimited(retryAfter: wait)
        }
        var context = context
        context.userId = userId
        return try await next(request, context)
    }
}

/// The user a request acts for: the token's subject, else (authentication off) what the
/// request names. A named user that differs from the token's is refused.
enum RequestUser {
    static func resolve(token: String?, named: String?) throws(APIError) -> String {
        if let token {
            if let named, named != token {
                throw APIError(.forbidden, code: "user_mismatch", message: "'userId' differs from the token's user")
            }
            return token
        }
        guard let named else { throw APIError.missingField("userId") }
        return named
    }
}
