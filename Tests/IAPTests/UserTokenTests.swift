import Crypto
import Foundation
import Intake
import JWTKit
import Testing

/// The claims a login backend puts in a user token.
struct TestUserClaims: JWTPayload {
    var sub: SubjectClaim
    var exp: ExpirationClaim
    var nbf: NotBeforeClaim?
    var iss: IssuerClaim?
    var aud: AudienceClaim?

    init(_ user: String, expiresIn: TimeInterval = 3600, notBefore: Date? = nil, issuer: String? = nil, audience: String? = nil) {
        sub = .init(value: user)
        exp = .init(value: Date().addingTimeInterval(expiresIn))
        nbf = notBefore.map { .init(value: $0) }
        iss = issuer.map { .init(value: $0) }
        aud = audience.map { .init(value: [$0]) }
    }

    func verify(using algorithm: some JWTAlgorithm) async throws {}
}

/// Tokens as a login backend (or an attacker) would make them.
enum TestTokens {
    static let secret = "the-login-backend-shares-this-secret-0123456789"

    static func hs256(_ claims: TestUserClaims, secret: String = secret) async throws -> String {
        let keys = JWTKeyCollection()
        await keys.add(hmac: HMACKey(from: secret), digestAlgorithm: .sha256)
        return try await keys.sign(claims)
    }

    static func es256(_ claims: TestUserClaims, key: ES256PrivateKey, kid: String? = nil) async throws -> String {
        let keys = JWTKeyCollection()
        await keys.add(ecdsa: key, kid: kid.map { JWKIdentifier(string: $0) })
        return try await keys.sign(claims, kid: kid.map { JWKIdentifier(string: $0) })
    }

    /// A compact JWS with any header, signed (or not) by HMAC-SHA256 with `hmacKey`, its
    /// claims without the one named `dropping`.
    static func handmade(header: [String: String], claims: TestUserClaims, hmacKey: Data? = nil, dropping: String? = nil)
        throws -> String
    {
        let encoder = JSONEncoder()
        var payload = try encoder.encode(claims)
        if let dropping, var object = try JSONSerialization.jsonObject(with: payload) as? [String: Any] {
            object[dropping] = nil
            payload = try JSONSerialization.data(withJSONObject: object)
        }
        let signingInput = try base64URL(encoder.encode(header)) + "." + base64URL(payload)
        guard let hmacKey else { return signingInput + "." }
        let mac = HMAC<SHA256>.authenticationCode(for: Data(signingInput.utf8), using: SymmetricKey(data: hmacKey))
        return signingInput + "." + base64URL(Data(mac))
    }

    static func base64URL(_ data: Data) -> String {
        data.base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }
}

@Suite("User tokens")
struct UserTokenTests {
    func failure(_ verifier: UserTokenVerifier, _ token: String) async -> AuthenticationFailure.Reason? {
        do {
            _ = try await verifier.userId(from: token)
            return nil
        } catch {
            return error.reason
        }
    }

    @Test func hs256TokensNameTheirUserAndExpire() async throws {
        let verifier = try await UserTokenVerifier(key: .hs256(secret: TestTokens.secret))
        #expect(try await verifier.userId(from: TestTokens.hs256(.init("ana"))) == "ana")
        #expect(await failure(verifier, try await TestTokens.hs256(.init("ana", expiresIn: -120))) == .expired)
        // Within the 30 s clock-skew leeway an expiry is still accepted.
        #expect(try await verifier.userId(from: TestTokens.hs256(.init("ana", expiresIn: -5))) == "ana")
        // Each refusal says which check failed: a clock problem is not a key problem.
        #expect(await failure(verifier, try await TestTokens.hs256(.init("ana"), secret: String(repeating: "x", count: 40))) == .signatureInvalid)
        #expect(await failure(verifier, try await TestTokens.hs256(.init("ana", notBefore: Date().addingTimeInterval(600)))) == .notYetValid)
        #expect(await failure(verifier, try await TestTokens.hs256(.init(""))) == .malformed)
        #expect(await failure(verifier, try await TestTokens.hs256(.init(String(repeating: "u", count: 257)))) == .malformed)
        #expect(await failure(verifier, try await TestTokens.hs256(.init("a\u{0}na"))) == .malformed)
        // No exp at all: not a token this intake takes.
        let noExpiry = try TestTokens.handmade(
            header: ["alg": "HS256", "typ": "JWT"], claims: .init("ana"), hmacKey: Data(TestTokens.secret.utf8), dropping: "exp")
        #expect(await failure(verifier, noExpiry) == .malformed)
        // alg none, and garbage.
        #expect(await failure(verifier, try TestTokens.handmade(header: ["alg": "none"], claims: .init("ana"))) == .algorithmRefused)
        for junk in ["", "a.b.c", "...", "eyJhbGciOiJIUzI1NiJ9", String(repeating: "A", count: 20_000)] {
            #expect(await failure(verifier, junk) == .malformed, "\(junk.prefix(20))")
        }
        // A tampered payload: another user's claims under the first token's signature.
        let good = try await TestTokens.hs256(.init("ana")).split(separator: ".")
        let other = try await TestTokens.hs256(.init("bob")).split(separator: ".")
        #expect(await failure(verifier, [good[0], other[1], good[2]].joined(separator: ".")) == .signatureInvalid)
    }

    /// An HS256 token of any header and payload, signed with the test secret.
    static func signed(header: [String: Any], payload: [String: Any]) throws -> String {
        let input = try TestTokens.base64URL(JSONSerialization.data(withJSONObject: header)) + "."
            + TestTokens.base64URL(JSONSerialization.data(withJSONObject: payload))
        let mac = HMAC<SHA256>.authenticationCode(for: Data(input.utf8), using: SymmetricKey(data: Data(TestTokens.secret.utf8)))
        return input + "." + TestTokens.base64URL(Data(mac))
    }

    /// A `crit` header is refused (this intake understands no extension), so is an `iat` that is
    /// no number or lies ahead, and a token living longer than `IAP_AUTH_MAX_LIFETIME` (24 h by
    /// default), counted from `iat`, or from now without one.
    @Test func critHeadersMalformedIatAndOverlongLifetimesAreRefused() async throws {
        let verifier = try await UserTokenVerifier(key: .hs256(secret: TestTokens.secret))
        let now = Int(Date().timeIntervalSince1970)
        let header: [String: Any] = ["alg": "HS256", "typ": "JWT"]
        let fine = try Self.signed(header: header, payload: ["sub": "ana", "iat": now, "exp": now + 3600])
        #expect(try await verifier.userId(from: fine) == "ana")
        var critical = header
        critical["crit"] = ["exp"]
        #expect(await failure(verifier, try Self.signed(header: critical, payload: ["sub": "ana", "exp": now + 3600, "exp2": 1])) == .malformed)
        critical["crit"] = ["urn:example:unknown"]
        #expect(await failure(verifier, try Self.signed(header: critical, payload: ["sub": "ana", "exp": now + 3600])) == .malformed)
        for iat: Any in ["x", true, [now], ["n": now]] {
            #expect(
                await failure(verifier, try Self.signed(header: header, payload: ["sub": "ana", "iat": iat, "exp": now + 3600])) == .malformed,
                "\(iat)")
        }
        #expect(await failure(verifier, try Self.signed(header: header, payload: ["sub": "ana", "iat": now + 600, "exp": now + 3600])) == .notYetValid)
        // Year 9999, with and without iat; and a day and an hour after iat.
        let farFuture = 253_402_300_799
        #expect(await failure(verifier, try Self.signed(header: header, payload: ["sub": "ana", "exp": farFuture])) == .malformed)
        #expect(await failure(verifier, try Self.signed(header: header, payload: ["sub": "ana", "iat": now, "exp": farFuture])) == .malformed)
        #expect(await failure(verifier, try Self.signed(header: header, payload: ["sub": "ana", "iat": now, "exp": now + 25 * 3600])) == .malformed)
        #expect(try await verifier.userId(from: Self.signed(header: header, payload: ["sub": "ana", "exp": now + 23 * 3600])) == "ana")
        // A deployment's own ceiling.
        let strict = try await UserTokenVerifier(key: .hs256(secret: TestTokens.secret), maxLifetime: 600)
        #expect(await failure(strict, fine) == .malformed)
        #expect(try await strict.userId(from: Self.signed(header: header, payload: ["sub": "ana", "iat": now, "exp": now + 300])) == "ana")
    }

    /// Every NumericDate claim at ±1e19, ±1e20 and ±1e300 (and the valid claims beside it), in a
    /// token the key verifies: refused as malformed, never a trap, and the verifier keeps serving.
    @Test func outOfRangeNumericDatesAreRefusedNeverTrapped() async throws {
        let verifier = try await UserTokenVerifier(key: .hs256(secret: TestTokens.secret))
        let now = Int(Date().timeIntervalSince1970)
        let header: [String: Any] = ["alg": "HS256", "typ": "JWT"]
        let valid: [String: Any] = ["sub": "ana", "iat": now, "nbf": now, "exp": now + 3600]
        for claim in ["exp", "iat", "nbf"] {
            for value in [1e19, -1e19, 1e20, -1e20, 1e300, -1e300, -1.0] {
                var payload = valid
                payload[claim] = value
                #expect(await failure(verifier, try Self.signed(header: header, payload: payload)) == .malformed, "\(claim) \(value)")
                // Without iat, `exp - now` is the lifetime: the same bound holds.
                payload["iat"] = nil
                if claim != "iat" {
                    #expect(await failure(verifier, try Self.signed(header: header, payload: payload)) == .malformed, "\(claim) \(value), no iat")
                }
            }
        }
        #expect(try await verifier.userId(from: Self.signed(header: header, payload: valid)) == "ana")
    }

    @Test func shortSecretsAndUnusableKeysAreRefused() async throws {
        await #expect(throws: UserTokenVerifierError.self) { try await UserTokenVerifier(key: .hs256(secret: "too-short")) }
        await #expect(throws: UserTokenVerifierError.self) { try await UserTokenVerifier(key: .publicKey("not a key")) }
    }

    @Test func es256PublicKeysRefuseOtherAlgorithms() async throws {
        let key = ES256PrivateKey()
        let pem = key.publicKey.pemRepresentation
        let verifier = try await UserTokenVerifier(key: .publicKey(pem))
        #expect(try await verifier.userId(from: TestTokens.es256(.init("ana"), key: key)) == "ana")
        #expect(await failure(verifier, try await TestTokens.es256(.init("ana"), key: ES256PrivateKey())) == .signatureInvalid)
        // The classic confusion: HS256 "signed" with the public key as the HMAC secret.
        let confused = try TestTokens.handmade(header: ["alg": "HS256", "typ": "JWT"], claims: .init("ana"), hmacKey: Data(pem.utf8))
        #expect(await failure(verifier, confused) == .algorithmRefused)
        #expect(await failure(verifier, try TestTokens.handmade(header: ["alg": "none"], claims: .init("ana"))) == .algorithmRefused)
    }

    @Test func jwksDocumentsAndAudienceAndIssuerChecks() async throws {
        let key = ES256PrivateKey()
        let point = try #require(key.publicKey.parameters)
        let jwks = """
            {"keys": [{"kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig", "kid": "login-1",
              "x": "\(point.x)", "y": "\(point.y)"}]}
            """
        let verifier = try await UserTokenVerifier(key: .publicKey(jwks), audience: "our-app", issuer: "https://login.example.com")
        let good = TestUserClaims("ana", issuer: "https://login.example.com", audience: "our-app")
        #expect(try await verifier.userId(from: TestTokens.es256(good, key: key, kid: "login-1")) == "ana")
        var wrongAudience = good
        wrongAudience.aud = .init(value: ["another-app"])
        #expect(await failure(verifier, try await TestTokens.es256(wrongAudience, key: key, kid: "login-1")) == .audienceMismatch)
        var noIssuer = good
        noIssuer.iss = nil
        #expect(await failure(verifier, try await TestTokens.es256(noIssuer, key: key, kid: "login-1")) == .issuerMismatch)
        // Signed by a key the JWKS does not hold: a key problem, not a clock problem.
        #expect(await failure(verifier, try await TestTokens.es256(good, key: ES256PrivateKey(), kid: "login-2")) == .signatureInvalid)
    }

    /// With a JWKS, a token names its key: an unknown `kid` is refused even when the token is
    /// signed by a key the document holds (it is never tried against a default key), and the
    /// header's `alg` must be the named key's (EC signs ES256, RSA RS256).
    @Test func aJWKSRefusesAnUnknownKidAndAnAlgorithmOfAnotherKeyType() async throws {
        let key = ES256PrivateKey()
        let point = try #require(key.publicKey.parameters)
        let jwks = """
            {"keys": [{"kty": "EC", "crv": "P-256", "use": "sig", "kid": "login-1", "x": "\(point.x)", "y": "\(point.y)"}]}
            """
        let verifier = try await UserTokenVerifier(key: .publicKey(jwks))
        #expect(try await verifier.userId(from: TestTokens.es256(.init("ana"), key: key, kid: "login-1")) == "ana")
        #expect(await failure(verifier, try await TestTokens.es256(.init("ana"), key: key, kid: "login-9")) == .signatureInvalid)
        let rs256 = try TestTokens.handmade(header: ["alg": "RS256", "kid": "login-1"], claims: .init("ana"))
        #expect(await failure(verifier, rs256 + "c2lnbmF0dXJl") == .algorithmRefused)
    }
}
