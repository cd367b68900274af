public import Foundation
import NIOConcurrencyHelpers
import SwiftASN1
@_spi(CMS) @_spi(FixedExpiryValidationTime) public import X509

/// Checks an app receipt's PKCS#7 signature offline, before anything it says counts as proof:
/// the signed content's digest and the signature over it, and the signer's chain up to one of
/// the trusted roots (Apple Inc. Root and Apple Root CA - G3 by default), judged at the
/// receipt's creation date (a receipt outlives its signing leaf: every genuine receipt fails
/// a check at "now").
///
/// A signature that provably does not cover the content (a byte changed, another key's
/// signature over Apple's certificates) is `invalid`; a sound signature by a chain that ends in
/// no trusted root (re-signed with another key and its own chain, Xcode's StoreKit testing
/// certificate) is `untrusted`. Chains that validated are kept, by the certificates and the
/// time judged at, so a receipt of a known chain costs one signature check.
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
        /// `valid`, `invalid` or `untrusted`.
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
    private let validated = NIOLockedDictionary()

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
            verdict.reason = "not an app receipt: \(error.code.rawValue)"
            return verdict
        }
        verdict.bundleId = receipt.bundleId
        verdict.transactionIds = receipt.inApp.map(\.transactionId)
        verdict.judgedAt = receipt.creationDate
        verdict.digestAlgorithm = Self.digestAlgorithm(bytes)
        let certificates: [Certificate]
        let signer: Certificate?
        do {
            let signature = try CMSSignature(berEncoded: ArraySlice(bytes))
            certificates = signature.certificates
            signer = try signature.signers.first?.certificate
        } catch {
            verdict.reason = "the signed data cannot be read: \(error)"
            return verdict
        }
        verdict.chain = Self.ordered(certificates, from: signer).map(Self.summary)
        let at = receipt.creationDate ?? Date()
        let key = Self.cacheKey(certificates, at: at)
        let known = validated.contains(key)
        // A known chain: its signer alone is trusted, so no chain is built again.
        let trusted = known ? CertificateStore(signer.map { [$0] } ?? certificates) : store
        let result = await CMS.isValidAttachedSignature(signatureBytes: bytes, trustRoots: trusted) {
            if known {
                // The chain validated before at this time: only the signature is checked now.
                AnyPolicy()
            } else {
                RFC5280Policy(fixedExpiryValidationTime: at)
            }
        }
        switch result {
        case .success:
            if !known { validated.insert(key) }
            verdict.result = "valid"
        case .failure(.invalidCMSBlock(let block)):
            verdict.reason = block.reason
        case .failure(.unableToValidateSigner(let failure)):
            verdict.result = "untrusted"
            verdict.reason = "the signer's chain ends in no trusted root at \(Self.iso(at)): "
                + failure.policyFailures.map { "\($0.policyFailureReason)" }.joined(separator: "; ")
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

    private static func cacheKey(_ certificates: [Certificate], at: Date) -> String {
        // Judged at another time, a chain is judged again unless every certificate was valid then too.
        let window = certificates.map { "\($0.notValidBefore.timeIntervalSince1970)-\($0.notValidAfter.timeIntervalSince1970)" }
        let inside = certificates.allSatisfy { $0.notValidBefore <= at && at <= $0.notValidAfter }
        return certificates.map { "\($0.serialNumber)/\($0.issuer)" }.joined(separator: "|") + "|" + window.joined(separator: ",")
            + (inside ? "" : "@\(at.timeIntervalSince1970)")
    }

    /// The `digestAlgorithms` the SignedData declares, read from its DER: ContentInfo
    /// SEQUENCE { contentType, [0] { SignedData SEQUENCE { version, digestAlgorithms SET … } } }.
    static func digestAlgorithm(_ bytes: [UInt8]) -> String? {
        func children(_ node: ASN1Node) -> [ASN1Node] {
            guard case .constructed(let nodes) = node.content else { return [] }
            return Array(nodes)
        }
        guard let root = try? BER.parse(bytes) else { return nil }
        let info = children(root)
        guard info.count > 1, let signedData = children(info[1]).first else { return nil }
        let fields = children(signedData)
        guard fields.count > 1, let identifier = children(fields[1]).first, let oidNode = children(identifier).first,
            let oid = try? ASN1ObjectIdentifier(derEncoded: oidNode)
        else { return nil }
        switch oid.description {
        case "1.3.14.3.2.26": return "SHA-1"
        case "2.16.840.1.101.3.4.2.1": return "SHA-256"
        case "2.16.840.1.101.3.4.2.2": return "SHA-384"
        case "2.16.840.1.101.3.4.2.3": return "SHA-512"
        default: return oid.description
        }
    }

    private static func iso(_ date: Date) -> String { ISO8601DateFormatter().string(from: date) }
}

/// A policy that accepts any chain: for a chain validated before, the signature alone is checked.
struct AnyPolicy: VerifierPolicy {
    // The critical extensions a receipt chain carries were checked when it validated.
    let verifyingCriticalExtensions: [ASN1ObjectIdentifier] = [
        .X509ExtensionID.basicConstraints, .X509ExtensionID.keyUsage, .X509ExtensionID.extendedKeyUsage,
        .X509ExtensionID.nameConstraints, .X509ExtensionID.subjectAlternativeName,
    ]
    func chainMeetsPolicyRequirements(chain: UnverifiedCertificateChain) async -> PolicyEvaluationResult { .meetsPolicy }
}

/// A set of strings behind a lock.
final class NIOLockedDictionary: Sendable {
    private let box = NIOLockedValueBox(Set<String>())
    func contains(_ key: String) -> Bool { box.withLockedValue { $0.contains(key) } }
    func insert(_ key: String) { _ = box.withLockedValue { $0.insert(key) } }
}
