import Crypto
public import Foundation
import NIOConcurrencyHelpers
import SwiftASN1
@_spi(FixedExpiryValidationTime) public import X509

/// Checks an app receipt's PKCS#7 signature offline, before anything it says counts as proof:
/// the signed content's digest and the signature over it, and the signer's chain up to one of
/// the trusted roots (Apple Inc. Root and Apple Root CA - G3 by default), judged at the
/// receipt's creation date (a receipt outlives its signing leaf: every genuine receipt fails
/// a check at "now").
///
/// A signature that provably does not cover the content (its digest differs, the signature does
/// not verify) is `invalid`; a sound signature by a chain that ends in no trusted root
/// (re-signed with another key and its own chain, Xcode's StoreKit testing certificate) is
/// `untrusted`; signed data this reader cannot check (a structure or an algorithm it does not
/// take) is `unchecked`, which proves nothing either way. Chains that validated are kept by the
/// SHA-256 of the certificates' bytes, with the signer's key and the window every certificate
/// is valid in: a receipt of a known chain made inside that window costs one signature check.
///
/// The SignedData is read here (SwiftASN1), not by a CMS library, because real receipts are not
/// what a strict one takes: the App Store lists the certificates leaf first (out of DER's SET OF
/// order) and names its signature `rsaEncryption` with the digest apart, SHA-1 until 2023;
/// Xcode writes BER. A receipt that is not DER is re-encoded as DER first
/// (`SignedDataEnvelope`); nothing signed changes. The signer is the certificate whose key made
/// the signature, and its chain is validated with swift-certificates' RFC 5280 policy.
public final class ReceiptSignature: Sendable {
    /// One certificate of the signer's chain, as `iap inspect receipt --verify` prints it.
    public struct CertificateSummary: Sendable, Encodable, Equatable {
        public var subject: String
        public var issuer: String
        public var notBefore: Date
        public var notAfter: Date
        public var signatureAlgorithm: String
    }

    /// What the check found.
    public struct Verdict: Sendable, Encodable {
        /// `valid`; `invalid` (the signature provably does not cover the content); `untrusted`
        /// (a sound signature by a chain that ends in no trusted root); or `unchecked` (the
        /// signed data could not be checked here: a structure or an algorithm this reader does
        /// not take, which proves nothing either way).
        public var result: String
        /// Why, when it is not valid.
        public var reason: String?
        /// The certificates the receipt carries, signer first.
        public var chain: [CertificateSummary]
        /// The digest algorithm the signer declared (`SHA-1`, `SHA-256`, or its OID).
        public var digestAlgorithm: String?
        /// The time the chain was judged at: the receipt's creation date.
        public var judgedAt: Date?
        public var bundleId: String?
        public var transactionIds: [String]

        public var isValid: Bool { result == "valid" }
    }

    private let roots: [Certificate]
    private let store: CertificateStore
    /// Chains that validated, by the SHA-256 of the certificates' bytes as the receipt carries
    /// them: the signer's key, the window every certificate of the chain is valid in, and the
    /// chain as the verdict lists it.
    private let validated = NIOLockedValueBox([SHA256Digest: KnownChain]())

    private struct KnownChain: Sendable {
        var signerKey: Certificate.PublicKey
        var validFrom: Date
        var validUntil: Date
        var chain: [CertificateSummary]
    }

    /// Checks against `roots`.
    public init(roots: [Certificate]) {
        self.roots = roots
        self.store = CertificateStore(roots)
    }

    /// Checks against Apple's receipt roots, shipped with the package.
    public convenience init() throws {
        self.init(roots: try AppleRoot.receiptRoots())
    }

    /// The verdict on `bytes` (DER/BER, not base64).
    public func check(_ bytes: [UInt8]) async -> Verdict {
        var verdict = Verdict(result: "invalid", chain: [], transactionIds: [])
        let receipt: AppReceipt
        do {
            receipt = try AppReceiptParser.parse(bytes)
        } catch {
            verdict.result = "unchecked"
            verdict.reason = "not read as an app receipt here: \(error.code.rawValue)"
            return verdict
        }
        verdict.bundleId = receipt.bundleId
        verdict.transactionIds = receipt.inApp.map(\.transactionId)
        verdict.judgedAt = receipt.creationDate
        let at = receipt.creationDate ?? Date()
        // As sent, else re-encoded as DER (the App Store lists its certificates out of DER's
        // order, Xcode writes BER): nothing signed changes.
        guard let parts = SignedParts(bytes) ?? SignedDataEnvelope.canonical(bytes).flatMap(SignedParts.init) else {
            verdict.result = "unchecked"
            verdict.reason = "the signed data cannot be read here"
            return verdict
        }
        verdict.digestAlgorithm = Self.digestName(parts.digestAlgorithm)
        let chainKey = SHA256.hash(data: parts.certificates)
        if let known = validated.withLockedValue({ $0[chainKey] }), known.validFrom <= at, at <= known.validUntil,
            parts.isSigned(by: known.signerKey)
        {
            // A chain that validated, valid at this receipt's time too: its signer's one
            // signature over this content is all that is left to check.
            verdict.chain = known.chain
            verdict.result = "valid"
            return verdict
        }
        guard parts.isCheckable else {
            verdict.result = "unchecked"
            verdict.reason = "the digest (\(parts.digestAlgorithm)) or signature (\(parts.signatureAlgorithm)) algorithm is not one this reader takes"
            return verdict
        }
        guard parts.contentMatchesSignedDigest else {
            verdict.reason = "the content's digest differs from the one the signer signed"
            return verdict
        }
        let certificates: [Certificate]
        do {
            certificates = try parts.certificateList.map { try Certificate(derEncoded: $0) }
        } catch {
            verdict.result = "unchecked"
            verdict.reason = "a certificate cannot be read here: \(error)"
            return verdict
        }
        // The signer is the certificate whose key made the signature; when the receipt carries
        // certificates and none did, the signature is not what it claims.
        guard let signer = certificates.first(where: { parts.isSigned(by: $0.publicKey) }) else {
            if certificates.isEmpty {
                verdict.result = "unchecked"
                verdict.reason = "the signed data carries no certificate"
            } else {
                verdict.reason = "the signature was made by none of the certificates the receipt carries"
            }
            return verdict
        }
        let chain = Self.ordered(certificates, from: signer)
        verdict.chain = chain.map(Self.summary)
        var verifier = Verifier(rootCertificates: store) {
            RFC5280Policy(fixedExpiryValidationTime: at)
            SignerKeyUsagePolicy()
        }
        switch await verifier.validate(leaf: signer, intermediates: CertificateStore(certificates)) {
        case .validCertificate(let trusted):
            verdict.result = "valid"
            let known = KnownChain(
                signerKey: signer.publicKey, validFrom: trusted.map(\.notValidBefore).max() ?? at,
                validUntil: trusted.map(\.notValidAfter).min() ?? at, chain: verdict.chain)
            validated.withLockedValue { $0[chainKey] = known }
        case .couldNotValidate(let failures):
            verdict.result = "untrusted"
            verdict.reason =
                failures.isEmpty
                ? "the signer's certificate has a critical extension no check here takes"
                : "the signer's chain ends in no trusted root at \(Self.iso(at)): "
                    + failures.map { "\($0.policyFailureReason)" }.joined(separator: "; ")
        }
        return verdict
    }

    /// The certificates from the signer up, each followed by its issuer; the rest after.
    private static func ordered(_ certificates: [Certificate], from signer: Certificate?) -> [Certificate] {
        guard var current = signer else { return certificates }
        var chain = [current]
        while current.issuer != current.subject,
            let issuer = certificates.first(where: { $0.subject == current.issuer && !chain.contains($0) })
        {
            chain.append(issuer)
            current = issuer
        }
        return chain + certificates.filter { !chain.contains($0) }
    }

    private static func summary(_ certificate: Certificate) -> CertificateSummary {
        CertificateSummary(
            subject: certificate.subject.description, issuer: certificate.issuer.description,
            notBefore: certificate.notValidBefore, notAfter: certificate.notValidAfter,
            signatureAlgorithm: certificate.signatureAlgorithm.description)
    }

    /// The name of a digest algorithm: `SHA-1`, `SHA-256`, …, or its OID.
    static func digestName(_ oid: ASN1ObjectIdentifier) -> String {
        switch oid.description {
        case "1.3.14.3.2.26": "SHA-1"
        case "2.16.840.1.101.3.4.2.1": "SHA-256"
        case "2.16.840.1.101.3.4.2.2": "SHA-384"
        case "2.16.840.1.101.3.4.2.3": "SHA-512"
        default: oid.description
        }
    }

    private static func iso(_ date: Date) -> String { ISO8601DateFormatter().string(from: date) }
}

/// The parts of a PKCS#7 SignedData a signature check needs, read once with SwiftASN1: the
/// signed content, the certificates as the receipt carries them, and the one signer's digest
/// algorithm, signed attributes, signature algorithm and signature.
struct SignedParts {
    var content: [UInt8]
    var certificates: [UInt8]
    var digestAlgorithm: ASN1ObjectIdentifier
    /// The signed attributes as they are signed (a DER SET), nil when the content is signed itself.
    var signedAttributes: [UInt8]?
    var messageDigest: [UInt8]?
    var signatureAlgorithm: ASN1ObjectIdentifier
    var signature: [UInt8]
    /// Each certificate the receipt carries, as it carries it.
    var certificateList: [ArraySlice<UInt8>]

    init?(_ bytes: [UInt8]) {
        func children(_ node: ASN1Node) -> [ASN1Node] {
            guard case .constructed(let nodes) = node.content else { return [] }
            return Array(nodes)
        }
        func octets(_ node: ASN1Node) -> [UInt8] {
            switch node.content {
            case .primitive(let bytes): return Array(bytes)
            case .constructed(let parts): return parts.flatMap { octets($0) }  // BER's chunked OCTET STRING
            }
        }
        func oid(_ node: ASN1Node?) -> ASN1ObjectIdentifier? {
            node.flatMap { try? ASN1ObjectIdentifier(derEncoded: $0) }
        }
        guard let root = try? BER.parse(bytes), let explicit = children(root).dropFirst().first,
            let signedData = children(explicit).first
        else { return nil }
        let fields = children(signedData)
        guard fields.count >= 4, let encap = fields.first(where: { $0.identifier == .sequence }),
            let wrapped = children(encap).dropFirst().first, let content = children(wrapped).first,
            let certificates = fields.first(where: { $0.identifier == ASN1Identifier(tagWithNumber: 0, tagClass: .contextSpecific) }),
            let signerInfos = fields.last, let signer = children(signerInfos).first
        else { return nil }
        self.content = octets(content)
        self.certificates = Array(certificates.encodedBytes)
        certificateList = children(certificates).map(\.encodedBytes)
        let info = children(signer)
        guard info.count >= 5, let digest = oid(children(info[2]).first) else { return nil }
        digestAlgorithm = digest
        var rest = Array(info.dropFirst(3))
        if let attributes = rest.first, attributes.identifier == ASN1Identifier(tagWithNumber: 0, tagClass: .contextSpecific) {
            var signed = Array(attributes.encodedBytes)
            signed[0] = 0x31  // signed as a SET OF, not as the [0] it is carried in
            signedAttributes = signed
            for attribute in children(attributes) {
                let parts = children(attribute)
                if oid(parts.first)?.description == "1.2.840.113549.1.9.4", let values = parts.dropFirst().first,
                    let value = children(values).first
                {
                    messageDigest = octets(value)
                }
            }
            rest.removeFirst()
        }
        guard rest.count >= 2, let algorithm = oid(children(rest[0]).first), case .primitive(let signature) = rest[1].content
        else { return nil }
        signatureAlgorithm = algorithm
        self.signature = Array(signature)
    }

    /// Whether this reader takes the digest and signature algorithms.
    var isCheckable: Bool { digest([]) != nil && signature(for: digestAlgorithm) != nil }

    /// Whether the content's digest is the one the signed attributes carry (true when the
    /// content is signed itself: its signature covers it).
    var contentMatchesSignedDigest: Bool {
        guard signedAttributes != nil else { return true }
        return messageDigest != nil && digest(content) == messageDigest
    }

    /// Whether `key` signed this content: the content's digest is the one the signed attributes
    /// carry, and the signature over them (or over the content) is `key`'s.
    func isSigned(by key: Certificate.PublicKey) -> Bool {
        guard let algorithm = signature(for: digestAlgorithm) else { return false }
        if let signedAttributes {
            guard let messageDigest, digest(content) == messageDigest else { return false }
            return key.isValidSignature(signature, for: signedAttributes, signatureAlgorithm: algorithm)
        }
        return key.isValidSignature(signature, for: content, signatureAlgorithm: algorithm)
    }

    private func digest(_ bytes: [UInt8]) -> [UInt8]? {
        switch digestAlgorithm.description {
        case "1.3.14.3.2.26": Array(Insecure.SHA1.hash(data: bytes))
        case "2.16.840.1.101.3.4.2.1": Array(SHA256.hash(data: bytes))
        case "2.16.840.1.101.3.4.2.2": Array(SHA384.hash(data: bytes))
        case "2.16.840.1.101.3.4.2.3": Array(SHA512.hash(data: bytes))
        default: nil
        }
    }

    /// The signature algorithm the signer used, by its OID, or by the digest for a bare
    /// `rsaEncryption` (older receipts) or `ecPublicKey`.
    private func signature(for digest: ASN1ObjectIdentifier) -> Certificate.SignatureAlgorithm? {
        let digestName = ReceiptSignature.digestName(digest)
        switch signatureAlgorithm.description {
        case "1.2.840.10045.4.3.2": return .ecdsaWithSHA256
        case "1.2.840.10045.4.3.3": return .ecdsaWithSHA384
        case "1.2.840.10045.4.3.4": return .ecdsaWithSHA512
        case "1.2.840.113549.1.1.5": return .sha1WithRSAEncryption
        case "1.2.840.113549.1.1.11": return .sha256WithRSAEncryption
        case "1.2.840.113549.1.1.12": return .sha384WithRSAEncryption
        case "1.2.840.113549.1.1.13": return .sha512WithRSAEncryption
        case "1.2.840.113549.1.1.1":
            return ["SHA-1": .sha1WithRSAEncryption, "SHA-256": .sha256WithRSAEncryption, "SHA-384": .sha384WithRSAEncryption][digestName]
        case "1.2.840.10045.2.1":
            return ["SHA-256": .ecdsaWithSHA256, "SHA-384": .ecdsaWithSHA384][digestName]
        default: return nil
        }
    }
}

/// The signer's extended key usage, where a certificate marks it critical (Xcode's StoreKit
/// testing certificate does, for code signing): receipts are signed code-signing style, so the
/// leaf must allow code signing or any use.
struct SignerKeyUsagePolicy: VerifierPolicy {
    let verifyingCriticalExtensions: [ASN1ObjectIdentifier] = [.X509ExtensionID.extendedKeyUsage]

    func chainMeetsPolicyRequirements(chain: UnverifiedCertificateChain) async -> PolicyEvaluationResult {
        let found: ExtendedKeyUsage?
        do {
            found = try chain.leaf.extensions.extendedKeyUsage
        } catch {
            return .failsToMeetPolicy(reason: "the signer's extended key usage cannot be read")
        }
        guard let usage = found else { return .meetsPolicy }
        if usage.contains(.codeSigning) || usage.contains(.any) { return .meetsPolicy }
        return .failsToMeetPolicy(reason: "the signer's extended key usage allows no code signing")
    }
}
