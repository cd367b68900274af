import Crypto
public import Foundation
public import SwiftASN1
public import X509

/// A test certificate chain shaped like the one Apple signs receipts with: a root and an
/// intermediate on P-384, a receipt-signing leaf on P-256, key identifiers on all three, and
/// Apple's marker extensions (intermediate `1.2.840.113635.100.6.2.1`, leaf
/// `1.2.840.113635.100.6.11.1`, each non-critical with a DER NULL value).
///
/// A fake keeps its identity across restarts by saving `pemBundle()` and restoring it with
/// `init(pemBundle:)`.
public struct FakeCertificateAuthority: Sendable {
    /// Apple's marker for its WWDR intermediate certificates.
    public static let intermediateMarkerOID: ASN1ObjectIdentifier = [1, 2, 840, 113_635, 100, 6, 2, 1]
    /// Apple's marker for its receipt-signing leaf certificates.
    public static let receiptSigningMarkerOID: ASN1ObjectIdentifier = [1, 2, 840, 113_635, 100, 6, 11, 1]

    /// The self-signed root: the trust anchor a verifier of our receipts needs.
    public let root: Certificate
    /// The intermediate, signed by the root.
    public let intermediate: Certificate
    /// The leaf that signs receipts, signed by the intermediate.
    public let leaf: Certificate
    /// The root's private key (P-384).
    let rootKey: Certificate.PrivateKey
    /// The intermediate's private key (P-384).
    let intermediateKey: Certificate.PrivateKey
    /// The key that signs receipts (P-256).
    let leafKey: Certificate.PrivateKey
    /// The leaf's key, for JWS.
    private let jwsKey: P256.Signing.PrivateKey
    /// The encoded JWS header: ES256 and the chain.
    private let jwsHeader: String

    /// Creates a fresh chain, valid from a day before `now` for `years` (the leaf for a year
    /// less, or until `leafNotAfter`). Tests make broken chains by leaving out a marker.
    public static func generate(
        name: String = "IAP Pipeline Fake App Store", now: Date = Date(), years: Int = 20, leafNotAfter: Date? = nil,
        leafMarker: Bool = true, intermediateMarker: Bool = true
    ) throws(FakeAppStoreError) -> FakeCertificateAuthority {
        let day: TimeInterval = 86_400
        let notBefore = min(now.addingTimeInterval(-day), (leafNotAfter ?? now).addingTimeInterval(-30 * day))
        let notAfter = now.addingTimeInterval(Double(years) * 365 * day)
        let rootKey = Certificate.PrivateKey(P384.Signing.PrivateKey())
        let intermediateKey = Certificate.PrivateKey(P384.Signing.PrivateKey())
        let leafKey = Certificate.PrivateKey(P256.Signing.PrivateKey())
        do {
            let rootName = try DistinguishedName {
                CountryName("US")
                OrganizationName(name)
                CommonName("\(name) Root CA")
            }
            let intermediateName = try DistinguishedName {
                CountryName("US")
                OrganizationName(name)
                OrganizationalUnitName("\(name) Certification Authority")
                CommonName("\(name) Worldwide Developer Relations Certification Authority")
            }
            let leafName = try DistinguishedName {
                CountryName("US")
                OrganizationName(name)
                CommonName("\(name) Receipt Signing")
            }
            let rootIdentifier = SubjectKeyIdentifier(hash: rootKey.publicKey)
            let intermediateIdentifier = SubjectKeyIdentifier(hash: intermediateKey.publicKey)
            let null: ArraySlice<UInt8> = [0x05, 0x00]

            let root = try Certificate(
                version: .v3, serialNumber: .init(), publicKey: rootKey.publicKey,
                notValidBefore: notBefore, notValidAfter: notAfter, issuer: rootName, subject: rootName,
                signatureAlgorithm: .ecdsaWithSHA384,
                extensions: try Certificate.Extensions {
                    Critical(BasicConstraints.isCertificateAuthority(maxPathLength: nil))
                    Critical(KeyUsage(keyCertSign: true, cRLSign: true))
                    rootIdentifier
                },
                issuerPrivateKey: rootKey)
            let intermediate = try Certificate(
                version: .v3, serialNumber: .init(), publicKey: intermediateKey.publicKey,
                notValidBefore: notBefore, notValidAfter: notAfter, issuer: rootName, subject: intermediateName,
                signatureAlgorithm: .ecdsaWithSHA384,
                extensions: try Certificate.Extensions {
                    Critical(BasicConstraints.isCertificateAuthority(maxPathLength: 0))
                    Critical(KeyUsage(keyCertSign: true, cRLSign: true))
                    intermediateIdentifier
                    AuthorityKeyIdentifier(keyIdentifier: rootIdentifier.keyIdentifier)
                    if intermediateMarker {
                        Certificate.Extension(oid: intermediateMarkerOID, critical: false, value: null)
                    }
                },
                issuerPrivateKey: rootKey)
            let leaf = try Certificate(
                version: .v3, serialNumber: .init(), publicKey: leafKey.publicKey,
                notValidBefore: notBefore,
                notValidAfter: leafNotAfter ?? notAfter.addingTimeInterval(-365 * day),
                issuer: intermediateName, subject: leafName,
                signatureAlgorithm: .ecdsaWithSHA384,
                extensions: try Certificate.Extensions {
                    Critical(BasicConstraints.notCertificateAuthority)
                    Critical(KeyUsage(digitalSignature: true))
                    SubjectKeyIdentifier(hash: leafKey.publicKey)
                    AuthorityKeyIdentifier(keyIdentifier: intermediateIdentifier.keyIdentifier)
                    if leafMarker {
                        Certificate.Extension(oid: receiptSigningMarkerOID, critical: false, value: null)
                    }
                },
                issuerPrivateKey: intermediateKey)
            return try FakeCertificateAuthority(
                root: root, rootKey: rootKey, intermediate: intermediate, intermediateKey: intermediateKey,
                leaf: leaf, leafKey: leafKey)
        } catch let error as FakeAppStoreError {
            throw error
        } catch {
            throw .certificate("cannot create the test chain: \(error)")
        }
    }

    /// Restores a chain saved with `pemBundle()`.
    public init(pemBundle: String) throws(FakeAppStoreError) {
        let documents: [PEMDocument]
        do {
            documents = try PEMDocument.parseMultiple(pemString: pemBundle)
        } catch {
            throw .certificate("the PEM bundle cannot be read: \(error)")
        }
        let certificates = documents.filter { $0.discriminator == "CERTIFICATE" }
        let keys = documents.filter { $0.discriminator == "PRIVATE KEY" }
        guard certificates.count == 3, keys.count == 3 else {
            throw .certificate(
                "the PEM bundle must hold 3 certificates and 3 private keys, found \(certificates.count) and \(keys.count)")
        }
        do {
            try self.init(
                root: try Certificate(pemDocument: certificates[0]), rootKey: try .init(pemDocument: keys[0]),
                intermediate: try Certificate(pemDocument: certificates[1]),
                intermediateKey: try .init(pemDocument: keys[1]),
                leaf: try Certificate(pemDocument: certificates[2]), leafKey: try .init(pemDocument: keys[2]))
        } catch let error as FakeAppStoreError {
            throw error
        } catch {
            throw .certificate("the PEM bundle holds an unreadable certificate or key: \(error)")
        }
    }

    private init(
        root: Certificate, rootKey: Certificate.PrivateKey, intermediate: Certificate,
        intermediateKey: Certificate.PrivateKey, leaf: Certificate, leafKey: Certificate.PrivateKey
    ) throws(FakeAppStoreError) {
        guard root.publicKey == rootKey.publicKey, intermediate.publicKey == intermediateKey.publicKey,
            leaf.publicKey == leafKey.publicKey
        else {
            throw .certificate("a private key does not match its certificate")
        }
        self.root = root
        self.rootKey = rootKey
        self.intermediate = intermediate
        self.intermediateKey = intermediateKey
        self.leaf = leaf
        self.leafKey = leafKey
        struct Header: Encodable {
            var alg = "ES256"
            var x5c: [String]
        }
        do {
            jwsKey = try P256.Signing.PrivateKey(pemRepresentation: try leafKey.serializeAsPEM().pemString)
            let chain = try [leaf, intermediate, root].map { certificate in
                var serializer = DER.Serializer()
                try serializer.serialize(certificate)
                return Data(serializer.serializedBytes).base64EncodedString()
            }
            jwsHeader = Self.base64URL(try JSONEncoder().encode(Header(x5c: chain)))
        } catch {
            throw .certificate("the leaf cannot sign JWS: \(error)")
        }
    }

    /// Signs `payload` as Apple signs StoreKit 2 data: a compact JWS with `alg` ES256 and the
    /// chain (leaf, intermediate, root) in `x5c`, signed by the leaf's P-256 key.
    public func signJWS(_ payload: some Encodable) throws(FakeAppStoreError) -> String {
        do {
            let encoder = JSONEncoder()
            encoder.outputFormatting = .sortedKeys
            let signingInput = jwsHeader + "." + Self.base64URL(try encoder.encode(payload))
            let signature = try jwsKey.signature(for: Data(signingInput.utf8))
            return signingInput + "." + Self.base64URL(signature.rawRepresentation)
        } catch {
            throw .certificate("cannot sign: \(error)")
        }
    }

    static func base64URL(_ data: Data) -> String {
        data.base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
            .replacingOccurrences(of: "=", with: "")
    }

    /// The chain and its keys as PEM: root, intermediate and leaf certificates, then their
    /// private keys (PKCS#8) in the same order.
    ///
    /// - Important: The text holds private keys: store it with mode 0600.
    public func pemBundle() throws(FakeAppStoreError) -> String {
        do {
            let documents = [
                try root.serializeAsPEM(), try intermediate.serializeAsPEM(), try leaf.serializeAsPEM(),
                try rootKey.serializeAsPEM(), try intermediateKey.serializeAsPEM(), try leafKey.serializeAsPEM(),
            ]
            return documents.map(\.pemString).joined(separator: "\n") + "\n"
        } catch {
            throw .certificate("cannot write the chain as PEM: \(error)")
        }
    }
}
