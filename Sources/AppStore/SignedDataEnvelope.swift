/// Re-encodes a receipt's PKCS#7 envelope as DER, so that a strict DER reader can check the
/// signature of what the App Store and Xcode actually send:
///
/// - the App Store lists the certificates leaf first, not in the order DER sorts a SET OF;
/// - Xcode's StoreKit testing writes BER: indefinite lengths, and the signed content as an
///   OCTET STRING cut into chunks.
///
/// Nothing signed changes: the signed content is an OCTET STRING, whose octets are kept as they
/// are (chunks joined, never re-encoded inside), and DER certificates and signed attributes are
/// their own DER encoding. Only lengths, chunking and the order of SET OF members do.
enum SignedDataEnvelope {
    /// The DER encoding of `bytes`, or nil when they are not one BER element this reader takes
    /// (within the parser's limits).
    static func canonical(_ bytes: [UInt8], limits: AppReceiptParser.Limits = .standard) -> [UInt8]? {
        let reader = BERReader(bytes: bytes, budget: BERWorkBudget(limit: limits.maxElements), maxDepth: limits.maxDepth)
        do throws(AppReceiptError) {
            var output: [UInt8] = []
            output.reserveCapacity(bytes.count)
            try encode(try reader.root(depth: 0), reader: reader, depth: 0, into: &output)
            return output
        } catch {
            return nil
        }
    }

    private static func encode(
        _ element: BERElement, reader: BERReader, depth: Int, into output: inout [UInt8]
    ) throws(AppReceiptError) {
        if element.tag.tagClass == .universal, element.tag.number == BERTag.octetString {
            // Signed content and extension values: the octets, never what they might encode.
            try append(tag: element.tag, constructed: false, content: reader.stringContent(of: element, depth: depth), to: &output)
            return
        }
        guard element.tag.isConstructed else {
            try append(tag: element.tag, constructed: false, content: reader.primitiveContent(of: element), to: &output)
            return
        }
        var children: [[UInt8]] = []
        for child in try reader.children(of: element, depth: depth) {
            var encoded: [UInt8] = []
            try encode(child, reader: reader, depth: depth + 1, into: &encoded)
            children.append(encoded)
        }
        // A SET OF, or an implicitly tagged one (CMS's certificates and signed attributes): DER
        // orders the members by their encodings. An explicit tag holds one element, unchanged.
        if element.tag.isUniversal(BERTag.set) || element.tag.tagClass == .contextSpecific {
            children.sort { $0.lexicographicallyPrecedes($1) }
        }
        try append(tag: element.tag, constructed: true, content: children.joined(), to: &output)
    }

    private static func append(
        tag: BERTag, constructed: Bool, content: some Collection<UInt8>, to output: inout [UInt8]
    ) throws(AppReceiptError) {
        guard tag.number < 0x1F else { throw AppReceiptError(.invalidTag, "a long-form tag in the signed data") }
        output.append(tag.tagClass.rawValue << 6 | (constructed ? 0x20 : 0) | UInt8(tag.number))
        let count = content.count
        if count < 0x80 {
            output.append(UInt8(count))
        } else {
            let octets = (0..<8).reversed().map { UInt8(truncatingIfNeeded: count >> ($0 * 8)) }.drop { $0 == 0 }
            output.append(0x80 | UInt8(octets.count))
            output.append(contentsOf: octets)
        }
        output.append(contentsOf: content)
    }
}
