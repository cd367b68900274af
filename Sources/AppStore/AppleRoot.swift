import Crypto
import Foundation
import SwiftASN1
public import X509

/// Apple Root CA - G3, the root every App Store JWS chain ends in, shipped with the
/// package and checked by its SHA-256 fingerprint before it is trusted.
public enum AppleRoot {
    /// SHA-256 of the DER certificate, as Apple publishes it.
    public static let g3Fingerprint = "63343abfb89a6a03ebb57e9b3f5fa7be7c4f5c756f3017b3a8c488c3653e9179"

    /// The DER bytes of Apple Root CA - G3.
    public static func g3DER() throws -> [UInt8] {
        try shipped("AppleRootCA-G3", fingerprint: g3Fingerprint)
    }

    /// A root shipped with the package, `name`.der, checked against Apple's SHA-256 `fingerprint`.
    static func shipped(_ name: String, fingerprint expected: String) throws -> [UInt8] {
        guard let url = Bundle.module.url(forResource: name, withExtension: "der") else {
            throw AppleRootError("\(name).der is missing from the package's resources")
        }
        let der = try [UInt8](Data(contentsOf: url))
        let fingerprint = SHA256.hash(data: der).map { String(format: "%02x", $0) }.joined()
        guard fingerprint == expected else {
            throw AppleRootError("\(name).der has SHA-256 \(fingerprint), not Apple's \(expected)")
        }
        return der
    }

    /// Apple Root CA - G3 as a certificate.
    public static func g3() throws -> Certificate {
        try Certificate(derEncoded: try g3DER())
    }

    /// SHA-256 of Apple Inc. Root (CN=Apple Root CA, RSA 2048), the root legacy app receipts
    /// chain to, as Apple publishes it.
    public static let incFingerprint = "b0b1730ecbc7ff4505142c49f1295e6eda6bcaed7e2c68c5be91b5a11001f024"

    /// Apple Inc. Root as a certificate, shipped with the package and checked by its fingerprint.
    public static func inc() throws -> Certificate {
        try Certificate(derEncoded: try shipped("AppleIncRootCertificate", fingerprint: incFingerprint))
    }

    /// The roots an app receipt's chain may end in: Apple Inc. Root (receipts' chain since
    /// 2011, SHA-1 and SHA-256 intermediates) and Apple Root CA - G3.
    public static func receiptRoots() throws -> [Certificate] {
        [try inc(), try g3()]
    }
}

/// The shipped root is missing or not Apple's.
public struct AppleRootError: Error, CustomStringConvertible, Sendable {
    public let description: String
    init(_ description: String) { self.description = description }
}
