// A small, strict BER/DER reader: just enough ASN.1 to walk an app receipt. It depends on the
// standard library only, so that the fuzz build (scripts/fuzz-receipt-parser) can compile the
// parser on its own.

/// The identifier octets of a BER element.
struct BERTag: Equatable, Sendable, CustomStringConvertible {
    /// The two class bits.
    enum TagClass: UInt8, Sendable {
        case universal = 0, application = 1, contextSpecific = 2, `private` = 3
    }

    /// The tag's class.
    var tagClass: TagClass
    /// Whether the content is a series of elements rather than raw bytes.
    var isConstructed: Bool
    /// The tag number (below 2^28 here).
    var number: UInt32

    /// Universal tag numbers the receipt parser uses.
    static let integer: UInt32 = 2
    /// OCTET STRING.
    static let octetString: UInt32 = 4
    /// OBJECT IDENTIFIER.
    static let objectIdentifier: UInt32 = 6
    /// UTF8String.
    static let utf8String: UInt32 = 12
    /// SEQUENCE and SEQUENCE OF.
    static let sequence: UInt32 = 16
    /// SET and SET OF.
    static let set: UInt32 = 17
    /// PrintableString.
    static let printableString: UInt32 = 19
    /// IA5String (ASCII).
    static let ia5String: UInt32 = 22
    /// VisibleString.
    static let visibleString: UInt32 = 26

    /// Whether this is the universal tag `number`, primitive or constructed.
    func isUniversal(_ number: UInt32) -> Bool {
        tagClass == .universal && self.number == number
    }

    /// Whether this is the universal constructed tag `number` (SEQUENCE, SET).
    func isUniversalConstructed(_ number: UInt32) -> Bool {
        tagClass == .universal && isConstructed && self.number == number
    }

    /// Whether this is the context-specific constructed tag `[number]`.
    func isContextConstructed(_ number: UInt32) -> Bool {
        tagClass == .contextSpecific && isConstructed && self.number == number
    }

    var description: String {
        "\(tagClass)\(isConstructed ? " constructed" : "") \(number)"
    }
}

/// One element found in a buffer: where its content starts and where it ends.
struct BERElement: Sendable {
    /// The element's tag.
    var tag: BERTag
    /// Offset of the first identifier octet.
    var start: Int
    /// Offset of the first content octet.
    var contentStart: Int
    /// Offset just past the content (for an indefinite length: where end-of-contents starts).
    var contentEnd: Int
    /// Offset just past the whole element, end-of-contents octets included.
    var end: Int
}

/// Counts element headers decoded during one parse, so that no input makes the reader work
/// without bound. Shared by every reader of one parse; never crosses tasks.
final class BERWorkBudget {
    /// Headers that may still be decoded.
    private(set) var remaining: Int
    /// Headers allowed in all.
    let limit: Int

    /// Creates a budget of `limit` element headers.
    init(limit: Int) {
        self.limit = limit
        self.remaining = limit
    }

    /// Takes one header from the budget, or throws `too_many_elements` when none is left.
    func spend() throws(AppReceiptError) {
        guard remaining > 0 else {
            throw AppReceiptError(.tooManyElements, "more than \(limit) ASN.1 elements")
        }
        remaining -= 1
    }
}

/// Reads BER (definite and indefinite lengths, constructed strings, long-form tags and lengths)
/// and therefore DER, from one buffer. Every offset is checked against the bytes that remain
/// before it is used, and nothing is allocated from a length that has not been checked.
struct BERReader {
    /// The buffer.
    let bytes: [UInt8]
    /// Work allowed for the whole parse.
    let budget: BERWorkBudget
    /// Deepest nesting allowed; `depth` arguments count from the outermost buffer.
    let maxDepth: Int

    /// The single element that fills the whole buffer: trailing bytes are an error.
    func root(depth: Int) throws(AppReceiptError) -> BERElement {
        guard !bytes.isEmpty else { throw AppReceiptError(.truncated, "no ASN.1 element") }
        let element = try element(at: 0, limit: bytes.count, depth: depth)
        guard element.end == bytes.count else {
            throw AppReceiptError(.invalidLength, "\(bytes.count - element.end) bytes after the last element")
        }
        return element
    }

    /// Reads the element at `offset` that must end by `limit`. For an indefinite length the
    /// children are walked to find the end-of-contents octets.
    func element(at offset: Int, limit: Int, depth: Int) throws(AppReceiptError) -> BERElement {
        guard depth <= maxDepth else {
            throw AppReceiptError(.tooDeep, "elements nest deeper than \(maxDepth) levels")
        }
        try budget.spend()
        var position = offset
        let tag = try readTag(&position, limit: limit)
        guard position < limit else { throw cut(limit, "a length is missing") }
        let first = bytes[position]
        position += 1

        if first == 0x80 {
            guard tag.isConstructed else {
                throw AppReceiptError(.invalidLength, "indefinite length on a primitive element")
            }
            let contentStart = position
            while true {
                guard position < limit else { throw cut(limit, "end-of-contents is missing") }
                if bytes[position] == 0 {
                    guard position + 1 < limit else { throw cut(limit, "end-of-contents is cut") }
                    guard bytes[position + 1] == 0 else {
                        throw AppReceiptError(.invalidTag, "end-of-contents with a non-zero length")
                    }
                    return BERElement(
                        tag: tag, start: offset, contentStart: contentStart, contentEnd: position, end: position + 2)
                }
                position = try element(at: position, limit: limit, depth: depth + 1).end
            }
        }

        let length: Int
        if first < 0x80 {
            length = Int(first)
        } else {
            let count = Int(first & 0x7F)
            guard count <= 8, first != 0xFF else {
                throw AppReceiptError(.invalidLength, "a length of \(count) octets")
            }
            guard count <= limit - position else { throw cut(limit, "a long-form length is cut") }
            var value = 0
            for _ in 0..<count {
                guard value <= (Int.max >> 8) else { throw AppReceiptError(.invalidLength, "a length overflows") }
                value = (value << 8) | Int(bytes[position])
                position += 1
            }
            length = value
        }
        guard length <= limit - position else {
            throw cut(limit, "a length of \(length) exceeds the \(limit - position) bytes that remain")
        }
        return BERElement(
            tag: tag, start: offset, contentStart: position, contentEnd: position + length, end: position + length)
    }

    /// The children of a constructed element, in order. Definite-length children must exactly
    /// fill their parent.
    func children(of parent: BERElement, depth: Int) throws(AppReceiptError) -> [BERElement] {
        guard parent.tag.isConstructed else {
            throw AppReceiptError(.invalidTag, "expected a constructed element, found \(parent.tag)")
        }
        var result: [BERElement] = []
        var position = parent.contentStart
        while position < parent.contentEnd {
            let child = try element(at: position, limit: parent.contentEnd, depth: depth + 1)
            result.append(child)
            position = child.end
        }
        return result
    }

    /// Walks every element below `element`, so that junk anywhere in the buffer is found now.
    func validateTree(_ element: BERElement, depth: Int) throws(AppReceiptError) {
        guard element.tag.isConstructed else { return }
        for child in try children(of: element, depth: depth) {
            try validateTree(child, depth: depth + 1)
        }
    }

    /// The content octets of a string type: a primitive element's content, or the
    /// concatenated chunks of a constructed one.
    func stringContent(of element: BERElement, depth: Int) throws(AppReceiptError) -> [UInt8] {
        if !element.tag.isConstructed {
            return Array(bytes[element.contentStart..<element.contentEnd])
        }
        var result: [UInt8] = []
        // The chunks are never longer than the content that holds them.
        result.reserveCapacity(element.contentEnd - element.contentStart)
        try appendChunks(of: element, to: &result, depth: depth)
        return result
    }

    private func appendChunks(of element: BERElement, to result: inout [UInt8], depth: Int) throws(AppReceiptError) {
        for chunk in try children(of: element, depth: depth) {
            guard chunk.tag.tagClass == .universal,
                chunk.tag.number == BERTag.octetString || chunk.tag.number == element.tag.number
            else {
                throw AppReceiptError(.invalidTag, "a constructed string holds \(chunk.tag)")
            }
            if chunk.tag.isConstructed {
                try appendChunks(of: chunk, to: &result, depth: depth + 1)
            } else {
                result.append(contentsOf: bytes[chunk.contentStart..<chunk.contentEnd])
            }
        }
    }

    /// A primitive element's content octets, in place.
    func primitiveContent(of element: BERElement) throws(AppReceiptError) -> ArraySlice<UInt8> {
        guard !element.tag.isConstructed else {
            throw AppReceiptError(.invalidTag, "expected a primitive element, found \(element.tag)")
        }
        return bytes[element.contentStart..<element.contentEnd]
    }

    /// An INTEGER that fits in 64 bits.
    func integer(_ element: BERElement) throws(AppReceiptError) -> Int64 {
        guard element.tag.isUniversal(BERTag.integer) else {
            throw AppReceiptError(.invalidField, "expected an INTEGER, found \(element.tag)")
        }
        let content = try primitiveContent(of: element)
        guard let first = content.first else { throw AppReceiptError(.invalidField, "an empty INTEGER") }
        guard content.count <= 8 else { throw AppReceiptError(.invalidField, "an INTEGER wider than 64 bits") }
        var value: Int64 = first >= 0x80 ? -1 : 0
        for byte in content {
            value = (value << 8) | Int64(byte)
        }
        return value
    }

    private func readTag(_ position: inout Int, limit: Int) throws(AppReceiptError) -> BERTag {
        guard position < limit else { throw cut(limit, "a tag is missing") }
        let first = bytes[position]
        position += 1
        let tagClass = BERTag.TagClass(rawValue: first >> 6) ?? .private
        let isConstructed = first & 0x20 != 0
        var number = UInt32(first & 0x1F)
        if number == 0x1F {
            number = 0
            var octets = 0
            while true {
                guard position < limit else { throw cut(limit, "a long-form tag is cut") }
                let byte = bytes[position]
                position += 1
                octets += 1
                guard octets <= 4, !(octets == 1 && byte == 0x80) else {
                    throw AppReceiptError(.invalidTag, "a long-form tag is too long or not minimal")
                }
                number = (number << 7) | UInt32(byte & 0x7F)
                if byte & 0x80 == 0 { break }
            }
            guard number >= 0x1F else {
                throw AppReceiptError(.invalidTag, "tag \(number) in long form")
            }
        } else if number == 0 && tagClass == .universal {
            throw AppReceiptError(.invalidTag, "end-of-contents where an element was expected")
        }
        return BERTag(tagClass: tagClass, isConstructed: isConstructed, number: number)
    }

    /// `truncated` when the input itself ends too soon, `invalid_length` when an inner length
    /// runs past its parent.
    private func cut(_ limit: Int, _ message: String) -> AppReceiptError {
        AppReceiptError(limit == bytes.count ? .truncated : .invalidLength, message)
    }
}
