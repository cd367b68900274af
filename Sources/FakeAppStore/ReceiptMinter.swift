@_spi(CMS) import X509

/// Mints app receipts as Apple does: the DER receipt payload inside a DER PKCS#7 `SignedData`
/// (content embedded), signed with ECDSA-SHA256 by the authority's leaf, with the leaf,
/// intermediate and root certificates included.
public struct ReceiptMinter: Sendable {
    /// Whose certificates sign the receipts.
    public let authority: FakeCertificateAuthority

    /// Creates a minter that signs with `authority`'s leaf.
    public init(authority: FakeCertificateAuthority) {
        self.authority = authority
    }

    /// The signed receipt, DER bytes (base64 them for `receipt-data`).
    public func mint(_ payload: ReceiptPayload) throws(FakeAppStoreError) -> [UInt8] {
        let content: [UInt8]
        do {
            content = try payload.derEncoded()
        } catch {
            throw .receipt("cannot encode the receipt payload: \(error)")
        }
        do {
            return try CMS.sign(
                content, signatureAlgorithm: .ecdsaWithSHA256,
                additionalIntermediateCertificates: [authority.intermediate, authority.root],
                certificate: authority.leaf, privateKey: authority.leafKey, signingTime: payload.creationDate,
                detached: false)
        } catch {
            throw .receipt("cannot sign the receipt: \(error)")
        }
    }
}
