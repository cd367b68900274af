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
/// not verify with the key of the certificate it names) is `invalid`; a sound signature by a
/// certificate that is no App Store receipt signer, or by a chain that ends in no trusted root
/// (re-signed with another key, a developer's code-signing certificate, Xcode's StoreKit testing
/// certificate), is `untrusted`; signed data this reader cannot check (a structure or an
/// algorithm it does not take, a signer it does not carry) is `unchecked`, which proves nothing
/// either way. Signers whose chains validated are kept by their own bytes (at most 64), with
/// their key and the window every certificate of their chain is valid in: a receipt of a known
/// signer made inside that window costs one signature check.
///
/// The SignedData is read here (SwiftASN1's BER reader), not by a CMS library, because real
/// receipts are not what a strict one takes: the App Store lists the certificates leaf first
/// (out of DER's SET OF order) and names its signature `rsaEncryption` with the digest apart,
/// SHA-1 until 2023; Xcode writes BER. The signer's chain is validated with swift-certificates'
/// RFC 5280 policy and Apple's receipt-chain markers (`AppleReceiptChainPolicy`).
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
    /// Xcode's certificate, when this checks Xcode's receipts: the signer must be it.
    private let pinned: Certificate?
    /// Signers whose chains validated, by the SHA-256 of the signer certificate's bytes: its
    /// key, its issuer and serial number (the signature must name them), the window every
    /// certificate of its chain is valid in, and the chain as the verdict lists it. At most
    /// `knownChainLimit` of them: the App Store has a handful of receipt signers at a time.
    private let validated = NIOLockedValueBox([SHA256Digest: KnownChain]())
    private static let knownChainLimit = 64
    /// What ``leadsToNoTrustedRoot(_:)`` found, by the SHA-256 of the certificates a receipt
    /// carries: a shell sent again costs a hash. At most `rootlessLimit` entries.
    private let rootless = NIOLockedValueBox([SHA256Digest: Bool]())
    private static let rootlessLimit = 1024

    private struct KnownChain: Sendable {
        var signerKey: Certificate.PublicKey
        var issuer: DistinguishedName
        var serial: ArraySlice<UInt8>
        var validFrom: Date
        var validUntil: Date
        var chain: [CertificateSummary]
    }

    /// Checks App Store receipts against `roots`: the signer must be a receipt-signing
    /// certificate (Apple's marker, OID 1.2.840.113635.100.6.11.1) issued under intermediates
    /// that carry Apple's intermediate marker (1.2.840.113635.100.6.2.1), up to one of `roots`.
    /// Apple's other certificates under the same intermediates (every developer's code-signing
    /// certificate) sign no receipt.
    public init(roots: [Certificate]) {
        self.roots = roots
        self.store = CertificateStore(roots)
        self.pinned = nil
    }

    /// Checks receipts of Xcode's StoreKit testing: signed by `xcodeCertificate` itself (Xcode
    /// signs with one self-signed certificate, marked for code signing), at their creation date.
    public init(xcodeCertificate: Certificate) {
        self.roots = [xcodeCertificate]
        self.store = CertificateStore([xcodeCertificate])
        self.pinned = xcodeCertificate
    }

    /// The content the signature reader (SwiftASN1's BER reader) finds signed in `bytes`, nil
    /// when it cannot read them: `check` verifies the signature over this.
    public static func signedContent(_ bytes: [UInt8]) -> [UInt8]? {
        SignedParts(bytes)?.content
    }

    /// Checks against Apple's receipt roots, shipped with the package.
    public convenience init() throws {
        self.init(roots: try AppleRoot.receiptRoots())
    }

    /// The verdict on `bytes` (DER/BER, not base64).
    public func check(_ bytes: [UInt8]) async -> Verdict {
        var verdict = Verdict(result: "invalid", chain: [], transactionIds: [])
        let receipt: AppReceipt
        let readContent: [UInt8]
        do {
            (receipt, readContent) = try AppReceiptParser.parseSigned(bytes)
        } catch {
            verdict.result = "unchecked"
            verdict.reason = "not read as an app receipt here: \(error.code.rawValue)"
            return verdict
        }
        verdict.bundleId = receipt.bundleId
        verdict.transactionIds = receipt.inApp.map(\.transactionId)
        verdict.judgedAt = receipt.creationDate
        let at = receipt.creationDate ?? Date()
        // Read with SwiftASN1's BER reader: the App Store lists its certificates leaf first (out
        // of DER's SET OF order) and Xcode writes BER, which a strict CMS reader refuses.
        guard let parts = SignedParts(bytes) else {
            verdict.result = "unchecked"
            verdict.reason = "the signed data cannot be read here"
            return verdict
        }
        // Two readers, one content: the purchases are read from what the receipt reader finds,
        // the signature is checked over what SignedParts finds. Were they ever to differ, a
        // signature over one content would vouch for another's purchases: refused.
        guard readContent == parts.content else {
            verdict.reason = "the signed content the signature covers is not the content the receipt is read from"
            return verdict
        }
        verdict.digestAlgorithm = Self.digestName(parts.digestAlgorithm)
        if let known = knownSigner(of: parts), known.validFrom <= at, at <= known.validUntil, parts.contentMatchesSignedDigest,
            parts.isSigned(by: known.signerKey)
        {
            // A signer whose chain validated, valid at this receipt's time too: its one
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
        let certificates: [Certificate]
        do {
            certificates = try parts.certificateList.map { try Certificate(derEncoded: $0) }
        } catch {
            verdict.result = "unchecked"
            verdict.reason = "a certificate cannot be read here: \(error)"
            return verdict
        }
        // The signer is the certificate the signature names (issuer and serial number, or key
        // identifier); one it names and does not carry cannot be checked here.
        guard let signer = certificates.first(where: parts.names) else {
            verdict.result = "unchecked"
            verdict.reason = "the certificate the signature names is not among those the receipt carries"
            return verdict
        }
        let chain = Self.ordered(certificates, from: signer)
        verdict.chain = chain.map(Self.summary)
        guard parts.signedAttributes == nil || parts.messageDigest != nil else {
            verdict.result = "unchecked"
            verdict.reason = "the signed attributes carry no message digest"
            return verdict
        }
        // Only now is a wrong verdict proof: the content's digest differs from the one signed,
        // or the named signer's key did not make the signature (over signed attributes carried
        // in DER, as they are signed).
        guard parts.contentMatchesSignedDigest else {
            verdict.reason = "the content's digest differs from the one the signer signed"
            return verdict
        }
        guard parts.isSigned(by: signer.publicKey) else {
            if let attributes = parts.signedAttributes, (try? DER.parse(attributes)) == nil {
                verdict.result = "unchecked"
                verdict.reason = "the signed attributes are not carried in DER, as they are signed"
            } else {
                verdict.reason = "the signature does not verify with the key of the certificate it names"
            }
            return verdict
        }
        if let pinned {
            guard signer == pinned, pinned.notValidBefore <= at, at <= pinned.notValidAfter else {
                verdict.result = "untrusted"
                verdict.reason = signer == pinned
                    ? "Xcode's certificate was not valid at \(Self.iso(at))" : "not signed by the Xcode certificate configured"
                return verdict
            }
            verdict.result = "valid"
            return verdict
        }
        // Certificates that lead to no trusted root at any time (a chain of someone else's, or
        // a stand-in's whose root is not trusted here) are untrusted whatever the time: told
        // from their names, cached by their bytes, with no chain validation for each receipt.
        if leadsToNoTrustedRoot(parts, certificates: certificates) {
            verdict.result = "untrusted"
            verdict.reason = "the receipt's certificates lead to no trusted receipt root"
            return verdict
        }
        var verifier = Verifier(rootCertificates: store) {
            RFC5280Policy(fixedExpiryValidationTime: at)
            AppleReceiptChainPolicy()
        }
        switch await verifier.validate(leaf: signer, intermediates: CertificateStore(certificates)) {
        case .validCertificate(let trusted):
            verdict.result = "valid"
            remember(signer, chain: Array(trusted), summaries: verdict.chain, bytes: parts.certificateList, at: at)
        case .couldNotValidate(let failures):
            verdict.result = "untrusted"
            verdict.reason =
                failures.isEmpty
                ? "the signer's certificate has a critical extension no check here takes (no receipt signer's has)"
                : "the signer's chain ends in no trusted receipt chain at \(Self.iso(at)): "
                    + failures.map { "\($0.policyFailureReason)" }.joined(separator: "; ")
        }
        return verdict
    }

    /// Whether the certificates `bytes` carries can never lead to one of the trusted roots, at
    /// any time: none of them is a trusted root, and none names one as its issuer (a self-signed
    /// shell, a chain of someone else's). Decided on the certificates' names alone, cached by
    /// their bytes; what cannot be read here, or names a root (judged in full by ``check(_:)``),
    /// is false. For the door: such a receipt is refused before it is stored.
    public func leadsToNoTrustedRoot(_ bytes: [UInt8]) -> Bool {
        guard let parts = SignedParts(bytes) else { return false }
        return leadsToNoTrustedRoot(parts, certificates: nil)
    }

    /// ``leadsToNoTrustedRoot(_:)`` of read parts (and their certificates, when read already).
    private func leadsToNoTrustedRoot(_ parts: SignedParts, certificates read: [Certificate]?) -> Bool {
        guard !parts.certificateList.isEmpty else { return false }
        let key = SHA256.hash(data: parts.certificates)
        if let known = rootless.withLockedValue({ $0[key] }) { return known }
        guard let certificates = read ?? (try? parts.certificateList.map({ try Certificate(derEncoded: $0) })) else { return false }
        let rootNames = Set(roots.map(\.subject))
        let leads = certificates.contains { certificate in roots.contains(certificate) || rootNames.contains(certificate.issuer) }
        rootless.withLockedValue { entries in
            if entries.count >= Self.rootlessLimit { entries.removeAll() }
            entries[key] = !leads
        }
        return !leads
    }

    /// The known signer among the certificates `parts` carries, if the signature names it.
    private func knownSigner(of parts: SignedParts) -> KnownChain? {
        guard pinned == nil else { return nil }
        for raw in parts.certificateList.prefix(8) {
            if let known = validated.withLockedValue({ $0[SHA256.hash(data: raw)] }), parts.names(issuer: known.issuer, serial: known.serial) {
                return known
            }
        }
        return nil
    }

    /// Keeps a signer whose chain validated (a bounded number of them).
    private func remember(_ signer: Certificate, chain: [Certificate], summaries: [CertificateSummary], bytes: [ArraySlice<UInt8>], at: Date) {
        guard let raw = bytes.first(where: { (try? Certificate(derEncoded: $0)) == signer }) else { return }
        let known = KnownChain(
            signerKey: signer.publicKey, issuer: signer.issuer, serial: signer.serialNumber.bytes,
            validFrom: chain.map(\.notValidBefore).max() ?? at, validUntil: chain.map(\.notValidAfter).min() ?? at,
            chain: summaries)
        validated.withLockedValue { known_ in
            if known_.count >= Self.knownChainLimit { known_.removeAll() }
            known_[SHA256.hash(data: raw)] = known
        }
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
    /// Whom the signature names as its signer: an issuer and serial number, or a key identifier.
    var signerIssuer: ArraySlice<UInt8>?
    var signerSerial: ArraySlice<UInt8>?
    var signerKeyIdentifier: ArraySlice<UInt8>?

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
        let sid = info[1]
        if sid.identifier == .sequence {
            let parts = children(sid)
            guard parts.count == 2, case .primitive(let serial) = parts[1].content else { return nil }
            signerIssuer = parts[0].encodedBytes
            signerSerial = serial
        } else if case .primitive(let identifier) = sid.content {
            signerKeyIdentifier = identifier  // [0] IMPLICIT SubjectKeyIdentifier
        } else {
            return nil
        }
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

    /// Whether the signature names `certificate` as its signer.
    func names(_ certificate: Certificate) -> Bool {
        if let identifier = signerKeyIdentifier {
            return (try? certificate.extensions.subjectKeyIdentifier)??.keyIdentifier.elementsEqual(identifier) == true
        }
        guard let issuerBytes = signerIssuer, let issuer = try? DistinguishedName(derEncoded: DER.parse(issuerBytes)) else { return false }
        return names(issuer: issuer, serial: certificate.serialNumber.bytes) && certificate.issuer == issuer
    }

    /// Whether the signature names the certificate of `issuer` and `serial`.
    func names(issuer: DistinguishedName, serial: ArraySlice<UInt8>) -> Bool {
        guard let signerSerial, let issuerBytes = signerIssuer, let named = try? DistinguishedName(derEncoded: DER.parse(issuerBytes)),
            named == issuer
        else { return false }
        return signerSerial.drop { $0 == 0 }.elementsEqual(serial.drop { $0 == 0 })
    }

    /// Whether this reader takes the digest and signature algorithms.
    var isCheckable: Bool { digest([]) != nil && signature(for: digestAlgorithm) != nil }

    /// Whether the content's digest is the one the signed attributes carry (true when the
    /// content is signed itself, or no digest is carried: the signature decides then).
    var contentMatchesSignedDigest: Bool {
        guard signedAttributes != nil, let messageDigest else { return true }
        return digest(content) == messageDigest
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

/// Apple's receipt chain: the signer carries Apple's receipt-signing marker (OID
/// 1.2.840.113635.100.6.11.1) and every certificate between it and the root Apple's
/// intermediate marker (1.2.840.113635.100.6.2.1), as every App Store receipt's chain since 2008
/// does. The same intermediates issue every developer's code-signing certificate, which signs
/// no receipt.
struct AppleReceiptChainPolicy: VerifierPolicy {
    static let receiptSigningMarker: ASN1ObjectIdentifier = [1, 2, 840, 113_635, 100, 6, 11, 1]
    static let intermediateMarker: ASN1ObjectIdentifier = [1, 2, 840, 113_635, 100, 6, 2, 1]

    let verifyingCriticalExtensions: [ASN1ObjectIdentifier] = []

    func chainMeetsPolicyRequirements(chain: UnverifiedCertificateChain) async -> PolicyEvaluationResult {
        let certificates = Array(chain)
        guard certificates.count >= 2, certificates[0].extensions[oid: Self.receiptSigningMarker] != nil else {
            return .failsToMeetPolicy(reason: "the signer is no App Store receipt-signing certificate (no marker 1.2.840.113635.100.6.11.1)")
        }
        for intermediate in certificates.dropFirst().dropLast() where intermediate.extensions[oid: Self.intermediateMarker] == nil {
            return .failsToMeetPolicy(reason: "\(intermediate.subject) is no Apple intermediate (no marker 1.2.840.113635.100.6.2.1)")
        }
        return .meetsPolicy
    }
}
