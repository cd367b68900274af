import Crypto
import Foundation
import NIOConcurrencyHelpers
import SwiftASN1
import X509

/// Why a signed App Store payload was refused. Each case has its own stable code.
public struct JWSVerificationError: Error, Equatable, CustomStringConvertible, Sendable {
    public enum Code: String, Sendable {
        /// Not three base64url parts, or a header or payload that is not the expected JSON.
        case malformed = "jws_malformed"
        /// `alg` is not ES256 (`none` and HMAC included).
        case unsupportedAlgorithm = "jws_unsupported_algorithm"
        /// `x5c` does not hold exactly leaf, intermediate and root.
        case invalidChainLength = "jws_invalid_chain_length"
        /// A certificate of `x5c` cannot be read.
        case invalidCertificate = "jws_invalid_certificate"
        /// The leaf or the intermediate lacks Apple's marker extension.
        case missingAppleExtension = "jws_missing_apple_extension"
        /// A certificate was not valid at the time the payload was signed.
        case certificateExpired = "jws_certificate_expired"
        /// The chain does not lead to a trusted root (or its signatures do not verify).
        case untrustedChain = "jws_untrusted_chain"
        /// The signature does not match the header and payload.
        case invalidSignature = "jws_invalid_signature"
        /// Signed for another app.
        case bundleIdMismatch = "bundle_id_mismatch"
        /// Signed for an environment this deployment does not take.
        case environmentMismatch = "environment_mismatch"
        /// A production notification for another App Store app id.
        case appAppleIdMismatch = "app_apple_id_mismatch"
    }

    public var code: Code
    public var message: String
    public var description: String { "\(code.rawValue): \(message)" }

    /// Errors are equal when their codes are: the message is for people.
    public static func == (lhs: Self, rhs: Self) -> Bool { lhs.code == rhs.code }

    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }
}

/// Verifies what Apple signs with JWS (StoreKit 2 transactions, renewal information, App
/// Store Server Notifications V2) the way Apple's own library does: `alg` must be ES256; the
/// `x5c` chain (leaf, intermediate, root) must be valid at the payload's `signedDate` up to a
/// trusted root, with Apple's marker extensions on the intermediate and the leaf; then the
/// leaf's key must verify the signature over `header.payload`. Bundle id and environment are
/// checked against the configuration.
///
/// Validated chains are cached by their certificates (with the window in which all of them
/// are valid); signatures are always checked.
public final class SignedDataVerifier: Sendable {
    /// Which time certificates are checked at.
    public enum ValidationTime: Sendable {
        /// The payload's `signedDate`, as Apple's library does (so a payload signed while its
        /// certificate was valid stays verifiable).
        case signedDate
        /// The current time.
        case now
    }

    /// What a deployment accepts.
    public struct Settings: Sendable {
        /// The roots a chain must lead to (Apple Root CA - G3 in production).
        public var trustedRoots: [Certificate]
        /// The apps this deployment serves.
        public var bundleIds: Set<String>
        /// The environments accepted ("Production", "Sandbox"); others are refused.
        public var environments: Set<String>
        /// The App Store's id of the app: production notifications must name it; nil skips the check.
        public var appAppleId: Int64?
        /// Which time certificates are checked at.
        public var validationTime: ValidationTime

        /// Creates settings.
        public init(
            trustedRoots: [Certificate], bundleIds: Set<String>, environments: Set<String> = ["Production", "Sandbox"],
            appAppleId: Int64? = nil, validationTime: ValidationTime = .signedDate
        ) {
            self.trustedRoots = trustedRoots
            self.bundleIds = bundleIds
            self.environments = environments
            self.appAppleId = appAppleId
            self.validationTime = validationTime
        }
    }

    /// Apple's marker on its WWDR intermediates.
    public static let intermediateMarkerOID: ASN1ObjectIdentifier = [1, 2, 840, 113_635, 100, 6, 2, 1]
    /// Apple's marker on its App Store signing leaves.
    public static let leafMarkerOID: ASN1ObjectIdentifier = [1, 2, 840, 113_635, 100, 6, 11, 1]

    /// A chain that validated: its leaf's key, and when all its certificates are valid.
    private typealias ValidatedChain = (key: P256.Signing.PublicKey, notBefore: Date, notAfter: Date)

    public let settings: Settings
    private let cache = NIOLockedValueBox([String: ValidatedChain]())
    private static let maxCachedChains = 64

    /// Creates a verifier.
    public init(settings: Settings) {
        self.settings = settings
    }

    /// Verifies a signed transaction (`signedTransaction`, `signedTransactionInfo`).
    public func verifyTransaction(_ jws: String) async throws(JWSVerificationError) -> JWSTransactionDecodedPayload {
        let payload = try await verify(jws, as: JWSTransactionDecodedPayload.self)
        try check(bundleId: payload.bundleId, environment: payload.environment)
        return payload
    }

    /// Verifies signed renewal information (`signedRenewalInfo`).
    public func verifyRenewalInfo(_ jws: String) async throws(JWSVerificationError) -> JWSRenewalInfoDecodedPayload {
        let payload = try await verify(jws, as: JWSRenewalInfoDecodedPayload.self)
        try check(bundleId: nil, environment: payload.environment)
        return payload
    }

    /// Verifies an App Store Server Notification V2 (`signedPayload`). Its signed transaction
    /// and renewal information are verified by the caller with the methods above.
    public func verifyNotification(_ jws: String) async throws(JWSVerificationError) -> ResponseBodyV2DecodedPayload {
        let payload = try await verify(jws, as: ResponseBodyV2DecodedPayload.self)
        try check(bundleId: payload.bundleId, environment: payload.environment)
        if payload.environment == "Production", let expected = settings.appAppleId, payload.appAppleId != expected {
            throw JWSVerificationError(
                .appAppleIdMismatch, "signed for app id \(payload.appAppleId.map(String.init) ?? "none"), not \(expected)")
        }
        return payload
    }

    private func check(bundleId: String?, environment: String?) throws(JWSVerificationError) {
        if let bundleId, !settings.bundleIds.contains(bundleId) {
            throw JWSVerificationError(.bundleIdMismatch, "signed for \(bundleId)")
        }
        guard let environment, settings.environments.contains(environment) else {
            throw JWSVerificationError(.environmentMismatch, "signed for environment \(environment ?? "none")")
        }
    }

    // MARK: - The JWS itself

    private struct Header: Decodable {
        var alg: String?
        var x5c: [String]?
    }

    private struct SignedDate: Decodable {
        var signedDate: Int64?
    }

    /// Verifies the signature and chain of `jws` and decodes its payload.
    public func verify<Payload: SignedAppStorePayload>(_ jws: String, as type: Payload.Type) async throws(JWSVerificationError)
        -> Payload
    {
        let parts = jws.utf8.split(separator: UInt8(ascii: "."), omittingEmptySubsequences: false)
        guard parts.count == 3, let payloadBytes = Base64URL.decode(parts[1]), let signature = Base64URL.decode(parts[2])
        else {
            throw JWSVerificationError(.malformed, "not a compact JWS")
        }
        let decoder = JSONDecoder()
        let signedDate: Date?
        do {
            signedDate = try decoder.decode(SignedDate.self, from: payloadBytes).signedDate.map(Date.init(appleMilliseconds:))
        } catch {
            throw JWSVerificationError(.malformed, "the payload is not JSON")
        }
        let time = settings.validationTime == .now ? Date() : (signedDate ?? Date())
        let key = try await chainKey(header: String(decoding: parts[0], as: UTF8.self), at: time)

        guard let ecdsa = try? P256.Signing.ECDSASignature(rawRepresentation: signature) else {
            throw JWSVerificationError(.invalidSignature, "the signature is not a P-256 signature")
        }
        // The signing input is the header and payload exactly as sent.
        let signingInput = jws.utf8.prefix(parts[0].count + 1 + parts[1].count)
        guard key.isValidSignature(ecdsa, for: Data(signingInput)) else {
            throw JWSVerificationError(.invalidSignature, "the signature does not verify")
        }
        do {
            return try decoder.decode(Payload.self, from: payloadBytes)
        } catch {
            throw JWSVerificationError(.malformed, "the payload is not a \(Payload.self): \(error)")
        }
    }

    /// The leaf key of the header's chain, valid at `time`: from the cache (keyed by the
    /// encoded header, which holds `alg` and `x5c`), or checked now.
    private func chainKey(header encoded: String, at time: Date) async throws(JWSVerificationError) -> P256.Signing.PublicKey {
        if let cached = cache.withLockedValue({ $0[encoded] }) {
            guard time >= cached.notBefore, time <= cached.notAfter else {
                throw JWSVerificationError(.certificateExpired, "a certificate of the chain was not valid at \(time)")
            }
            return cached.key
        }
        guard let headerBytes = Base64URL.decode(encoded.utf8[...]),
            let header = try? JSONDecoder().decode(Header.self, from: headerBytes)
        else {
            throw JWSVerificationError(.malformed, "the header is not JSON")
        }
        guard header.alg == "ES256" else {
            throw JWSVerificationError(.unsupportedAlgorithm, "alg \(header.alg ?? "missing") is not ES256")
        }
        guard let x5c = header.x5c, x5c.count == 3 else {
            throw JWSVerificationError(.invalidChainLength, "x5c holds \(header.x5c?.count ?? 0) certificates, not 3")
        }
        let entry = try await validateChain(x5c, at: time)
        cache.withLockedValue { cache in
            if cache.count >= Self.maxCachedChains { cache.removeAll() }
            cache[encoded] = entry
        }
        return entry.key
    }

    /// Checks a chain (leaf, intermediate and root, base64 DER as in `x5c`) as `verify` does,
    /// at `time`: Apple's markers, each certificate's validity, the signatures up to a
    /// trusted root. Returns the leaf's key and the window in which the whole chain is valid.
    public func validateChain(_ x5c: [String], at time: Date) async throws(JWSVerificationError)
        -> (key: P256.Signing.PublicKey, notBefore: Date, notAfter: Date)
    {
        let chain = try readChain(x5c, at: time)
        var verifier = Verifier(rootCertificates: CertificateStore(settings.trustedRoots)) {
            RFC5280Policy(validationTime: time)
        }
        let result = await verifier.validate(leaf: chain[0], intermediates: CertificateStore([chain[1]]))
        guard case .validCertificate = result else {
            throw JWSVerificationError(.untrustedChain, "the chain does not lead to a trusted root")
        }
        guard let key = P256.Signing.PublicKey(chain[0].publicKey) else {
            throw JWSVerificationError(.invalidCertificate, "the leaf's key is not on P-256")
        }
        return (key, chain.map(\.notValidBefore).max()!, chain.map(\.notValidAfter).min()!)
    }

    /// Reads the chain and checks what the generic validation does not: Apple's markers,
    /// and (for a distinct answer) each certificate's validity at `time`.
    private func readChain(_ x5c: [String], at time: Date) throws(JWSVerificationError) -> [Certificate] {
        var certificates: [Certificate] = []
        for encoded in x5c {
            guard let der = Data(base64Encoded: encoded), let certificate = try? Certificate(derEncoded: Array(der)) else {
                throw JWSVerificationError(.invalidCertificate, "x5c[\(certificates.count)] is not a DER certificate")
            }
            certificates.append(certificate)
        }
        let (leaf, intermediate, root) = (certificates[0], certificates[1], certificates[2])
        guard leaf.extensions[oid: Self.leafMarkerOID] != nil else {
            throw JWSVerificationError(.missingAppleExtension, "the leaf lacks 1.2.840.113635.100.6.11.1")
        }
        guard intermediate.extensions[oid: Self.intermediateMarkerOID] != nil else {
            throw JWSVerificationError(.missingAppleExtension, "the intermediate lacks 1.2.840.113635.100.6.2.1")
        }
        for (name, certificate) in [("leaf", leaf), ("intermediate", intermediate), ("root", root)]
        where time < certificate.notValidBefore || time > certificate.notValidAfter {
            throw JWSVerificationError(
                .certificateExpired,
                "the \(name) is valid \(certificate.notValidBefore) to \(certificate.notValidAfter), not at \(time)")
        }
        return certificates
    }
}

/// Base64url without padding, as JOSE writes it.
public enum Base64URL {
    /// The bytes of base64url text (padding optional); nil when it is not base64url.
    public static func decode(_ text: some Collection<UInt8>) -> Data? {
        var base64 = [UInt8]()
        base64.reserveCapacity(text.count + 3)
        for byte in text {
            switch byte {
            case UInt8(ascii: "-"): base64.append(UInt8(ascii: "+"))
            case UInt8(ascii: "_"): base64.append(UInt8(ascii: "/"))
            case UInt8(ascii: "+"), UInt8(ascii: "/"): return nil
            default: base64.append(byte)
            }
        }
        switch base64.count % 4 {
        case 0: break
        case 2: base64.append(contentsOf: [UInt8(ascii: "="), UInt8(ascii: "=")])
        case 3: base64.append(UInt8(ascii: "="))
        default: return nil
        }
        return Data(base64Encoded: Data(base64))
    }

    /// Base64url text of `data`, without padding.
    public static func encode(_ data: some DataProtocol) -> String {
        Data(data).base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }
}
