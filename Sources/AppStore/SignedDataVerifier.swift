public import Crypto
public import Foundation
#if canImport(Glibc)
import Glibc
#endif
import NIOConcurrencyHelpers
public import SwiftASN1
@_spi(FixedExpiryValidationTime) public import X509

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
    /// One decoder for every payload (decoding does not change it).
    private let decoder = JSONDecoder()
    /// Validated chains by their encoded header; a handful at most (Apple signs with one leaf at a time).
    private let cache = NIOLockedValueBox([(header: [UInt8], chain: ValidatedChain)]())
    private static let maxCachedChains = 16

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

    /// Verifies a signed `AppTransaction` (`signedAppTransactionInfo`): Apple's chain, and the
    /// app's bundle id, environment (`receiptType`) and, in production, App Store id.
    public func verifyAppTransaction(_ jws: String) async throws(JWSVerificationError) -> AppTransactionDecodedPayload {
        let payload = try await verify(jws, as: AppTransactionDecodedPayload.self)
        guard payload.bundleId != nil else { throw JWSVerificationError(.bundleIdMismatch, "names no app (no bundle id)") }
        try check(bundleId: payload.bundleId, environment: payload.receiptType)
        if payload.receiptType == "Production", let expected = settings.appAppleId, payload.appAppleId != expected {
            throw JWSVerificationError(
                .appAppleIdMismatch, "signed for app id \(payload.appAppleId.map(String.init) ?? "none"), not \(expected)")
        }
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
        // A notification names its app (Apple's library refuses one that does not).
        guard payload.bundleId != nil else { throw JWSVerificationError(.bundleIdMismatch, "names no app (no bundle id)") }
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

    /// Verifies the signature and chain of `jws` and decodes its payload.
    public func verify<Payload: SignedAppStorePayload>(_ jws: String, as type: Payload.Type) async throws(JWSVerificationError)
        -> Payload
    {
        var jws = jws
        jws.makeContiguousUTF8()
        // The two dots, found in the raw bytes (iterating a String's UTF-8 view byte by byte
        // costs more than the rest of the parsing).
        let dots = jws.utf8.withContiguousStorageIfAvailable { bytes -> (Int, Int)? in
            guard let first = bytes.firstIndex(of: UInt8(ascii: ".")),
                let second = bytes[(first + 1)...].firstIndex(of: UInt8(ascii: ".")),
                bytes[(second + 1)...].firstIndex(of: UInt8(ascii: ".")) == nil
            else { return nil }
            return (first, second)
        } ?? nil
        guard let (firstDot, secondDot) = dots else { throw JWSVerificationError(.malformed, "not a compact JWS") }
        let decoded = jws.utf8.withContiguousStorageIfAvailable { bytes in
            (Base64URL.decodeBytes(UnsafeBufferPointer(rebasing: bytes[(firstDot + 1)..<secondDot])),
             Base64URL.decodeBytes(UnsafeBufferPointer(rebasing: bytes[(secondDot + 1)...])))
        }
        guard let decoded, let payloadBytes = decoded.0.map({ Data($0) }), let signature = decoded.1, firstDot > 0 else {
            throw JWSVerificationError(.malformed, "not a compact JWS")
        }
        // Decoded once, before the signature is checked: its signedDate picks the time the
        // chain is validated at. Nothing of it is trusted until the signature verifies.
        let payload: Payload
        do {
            payload = try decoder.decode(Payload.self, from: payloadBytes)
        } catch {
            throw JWSVerificationError(.malformed, "the payload is not a \(Payload.self): \(error)")
        }
        let time =
            settings.validationTime == .now ? Date() : (payload.signedDate.map(Date.init(appleMilliseconds:)) ?? Date())
        let key = try await chainKey(jws, headerCount: firstDot, at: time)
        guard let ecdsa = try? P256.Signing.ECDSASignature(rawRepresentation: signature) else {
            throw JWSVerificationError(.invalidSignature, "the signature is not a P-256 signature")
        }
        // The signing input is the header and payload exactly as sent.
        let valid = jws.utf8.withContiguousStorageIfAvailable { bytes in
            key.isValidSignature(ecdsa, for: UnsafeRawBufferPointer(rebasing: UnsafeRawBufferPointer(bytes)[0..<secondDot]))
        } ?? key.isValidSignature(ecdsa, for: Data(jws.utf8.prefix(secondDot)))
        guard valid else {
            throw JWSVerificationError(.invalidSignature, "the signature does not verify")
        }
        return payload
    }

    /// The leaf key of the chain in the header (the first `headerCount` bytes of `jws`), valid
    /// at `time`: from the cache (the encoded header, which holds `alg` and `x5c`, compared
    /// byte for byte), or checked now.
    private func chainKey(_ jws: String, headerCount: Int, at time: Date) async throws(JWSVerificationError)
        -> P256.Signing.PublicKey
    {
        let cached = jws.utf8.withContiguousStorageIfAvailable { bytes -> ValidatedChain? in
            let header = UnsafeRawBufferPointer(rebasing: UnsafeRawBufferPointer(bytes)[0..<headerCount])
            return cache.withLockedValue { entries in
                entries.first { entry in
                    entry.header.count == headerCount
                        && entry.header.withUnsafeBytes { memcmp($0.baseAddress!, header.baseAddress!, headerCount) == 0 }
                }?.chain
            }
        } ?? nil
        if let cached {
            guard time >= cached.notBefore, time <= cached.notAfter else {
                throw JWSVerificationError(.certificateExpired, "a certificate of the chain was not valid at \(time)")
            }
            return cached.key
        }
        let encoded = Array(jws.utf8.prefix(headerCount))
        guard let headerBytes = Base64URL.decode(encoded),
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
        cache.withLockedValue { entries in
            if entries.count >= Self.maxCachedChains { entries.removeAll() }
            entries.append((encoded, entry))
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
            RFC5280Policy(fixedExpiryValidationTime: time)
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
        decodeBytes(text).map { Data($0) }
    }

    /// The bytes of base64url text (padding optional), without Foundation: the hot path of
    /// every JWS verification decodes the payload and the signature.
    public static func decodeBytes(_ text: some Collection<UInt8>) -> [UInt8]? {
        if let decoded = text.withContiguousStorageIfAvailable({ decode($0, table: table) }) { return decoded }
        return Array(text).withUnsafeBufferPointer { decode($0, table: table) }
    }

    /// Standard base64 (`+`, `/`, padding optional), with the same decoder: Foundation's
    /// costs about 12 µs per KB, and every upload carries a receipt of several KB.
    public static func decodeStandard(_ text: some Collection<UInt8>) -> [UInt8]? {
        if let decoded = text.withContiguousStorageIfAvailable({ decode($0, table: standardTable) }) { return decoded }
        return Array(text).withUnsafeBufferPointer { decode($0, table: standardTable) }
    }

    private static func decode(_ text: UnsafeBufferPointer<UInt8>, table: [UInt8]) -> [UInt8]? {
        var count = text.count
        // Padding is optional; at most two trailing '='.
        while count > 0, text.count - count < 2, text[count - 1] == UInt8(ascii: "=") { count -= 1 }
        guard count % 4 != 1 else { return nil }
        return table.withUnsafeBufferPointer { table -> [UInt8]? in
            var output = [UInt8]()
            output.reserveCapacity(count * 3 / 4)
            var accumulator: UInt32 = 0
            var bits: UInt32 = 0
            for index in 0..<count {
                let value = table[Int(text[index])]
                guard value < 64 else { return nil }
                accumulator = (accumulator << 6) | UInt32(value)
                bits += 6
                if bits >= 8 {
                    bits -= 8
                    output.append(UInt8(truncatingIfNeeded: accumulator >> bits))
                }
            }
            return output
        }
    }

    /// The value of each base64url character; 255 for anything else.
    private static let table = makeTable("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    /// The value of each base64 character.
    private static let standardTable = makeTable("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")

    private static func makeTable(_ alphabet: String) -> [UInt8] {
        var table = [UInt8](repeating: 255, count: 256)
        for (index, character) in alphabet.utf8.enumerated() { table[Int(character)] = UInt8(index) }
        return table
    }

    /// Base64url text of `data`, without padding.
    public static func encode(_ data: some DataProtocol) -> String {
        Data(data).base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }
}
