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
        guard let url = Bundle.module.url(forResource: "AppleRootCA-G3", withExtension: "der") else {
            throw AppleRootError("AppleRootCA-G3.der is missing from the package's resources")
        }
        let der = try [UInt8](Data(contentsOf: url))
        let fingerprint = SHA256.hash(data: der).map { String(format: "%02x", $0) }.joined()
        guard fingerprint == g3Fingerprint else {
            throw AppleRootError("AppleRootCA-G3.der has SHA-256 \(fingerprint), not Apple's \(g3Fingerprint)")
        }
        return der
    }

    /// Apple Root CA - G3 as a certificate.
    public static func g3() throws -> Certificate {
        try Certificate(derEncoded: try g3DER())
    }
}

/// The shipped root is missing or not Apple's.
public struct AppleRootError: Error, CustomStringConvertible, Sendable {
    public let description: String
    init(_ description: String) { self.description = description }
}
