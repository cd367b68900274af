import Foundation

/// Reads Apple's app receipts locally: the PKCS#7 container, then the ASN.1 receipt payload.
///
/// Accepts DER (the App Store's receipts, our fake's) and BER (Xcode's StoreKit-testing
/// receipts: indefinite lengths, constructed strings, the payload wrapped in a second
/// OCTET STRING). Every malformed input throws `AppReceiptError`; work and memory are bounded
/// by `Limits`.
///
/// - Important: The signature is not checked. Use the result to find transaction ids and to
///   turn junk away early, never to credit a purchase.
public enum AppReceiptParser {
    /// Bounds on what one parse may read.
    public struct Limits: Sendable, Equatable {
        /// Largest receipt accepted, in bytes (after base64 decoding).
        public var maxInputBytes: Int
        /// Deepest nesting of ASN.1 elements, counted through every layer of the receipt.
        public var maxDepth: Int
        /// Most element headers one parse may decode (indefinite lengths re-read some).
        public var maxElements: Int
        /// Whether the container must carry what Apple's always do: certificates and at least one
        /// `SignerInfo` (not checked: the signature is Apple's to vouch for). A shell without them
        /// is refused with `unsigned`.
        public var requireSigners = false
        /// Largest certificates and signerInfos of the container, in bytes each (Apple's chain
        /// is a few KB).
        public var maxSignatureBytes = Int.max
        /// Largest value of an attribute type this parser does not read, and most such
        /// attributes in one set; a receipt over either is `notAReceipt` (a filler attribute).
        public var maxUnknownAttributeBytes = Int.max
        /// Most attributes of types this parser does not read in one set.
        public var maxUnknownAttributes = Int.max
        /// Largest in-app purchase attribute, in bytes (Apple's are a few hundred).
        public var maxPurchaseBytes = Int.max

        /// Creates limits.
        public init(maxInputBytes: Int, maxDepth: Int, maxElements: Int) {
            self.maxInputBytes = maxInputBytes
            self.maxDepth = maxDepth
            self.maxElements = maxElements
        }

        /// 4 MiB, 32 levels, a million elements: far above any receipt Apple issues.
        public static let standard = Limits(maxInputBytes: 4 * 1024 * 1024, maxDepth: 32, maxElements: 1_000_000)

        /// The intake's first look, before anything is stored: `standard`, and the container must
        /// carry certificates (32 KiB at most) and signerInfos (8 KiB at most), unknown attributes
        /// hold 4 KiB at most, 64 to a set, and an in-app purchase 16 KiB at most.
        public static let intake: Limits = {
            var limits = standard
            limits.requireSigners = true
            limits.maxSignatureBytes = 32 * 1024
            limits.maxUnknownAttributeBytes = 4 * 1024
            limits.maxUnknownAttributes = 64
            limits.maxPurchaseBytes = 16 * 1024
            return limits
        }()
    }

    /// Parses a receipt from its raw bytes (DER or BER).
    public static func parse(_ bytes: [UInt8], limits: Limits = .standard) throws(AppReceiptError) -> AppReceipt {
        try parseSigned(bytes, limits: limits).receipt
    }

    /// Parses a receipt from its raw bytes, with the signed content it was read from (what
    /// `signedContent` returns): the signature check compares that content with its own.
    public static func parseSigned(
        _ bytes: [UInt8], limits: Limits = .standard
    ) throws(AppReceiptError) -> (receipt: AppReceipt, content: [UInt8]) {
        let (payload, depth, budget) = try signedPayload(bytes, limits: limits)
        return (try receipt(fromPayload: payload, depth: depth, budget: budget, limits: limits), payload)
    }

    /// The signed content (the receipt payload's bytes) as this reader finds it in `bytes`:
    /// what `parse` reads its purchases from, whether or not they are a payload it can read.
    public static func signedContent(_ bytes: [UInt8], limits: Limits = .standard) throws(AppReceiptError) -> [UInt8] {
        try signedPayload(bytes, limits: limits).payload
    }

    /// The outer PKCS#7 read and checked, and the signed content found in it, with its depth and
    /// the work budget the payload's reading goes on with.
    private static func signedPayload(
        _ bytes: [UInt8], limits: Limits
    ) throws(AppReceiptError) -> (payload: [UInt8], depth: Int, budget: BERWorkBudget) {
        guard !bytes.isEmpty else { throw AppReceiptError(.empty, "the receipt is empty") }
        guard bytes.count <= limits.maxInputBytes else {
            throw AppReceiptError(.tooLarge, "the receipt has \(bytes.count) bytes, more than \(limits.maxInputBytes)")
        }
        guard bytes[0] == 0x30 else {
            throw AppReceiptError(.notPKCS7, "the receipt does not start with a SEQUENCE")
        }
        let budget = BERWorkBudget(limit: limits.maxElements)
        let outer = BERReader(bytes: bytes, budget: budget, maxDepth: limits.maxDepth)
        let contentInfo = try outer.root(depth: 0)
        try outer.validateTree(contentInfo, depth: 0)
        let (payload, depth) = try signedContent(of: contentInfo, in: outer, limits: limits)
        return (payload, depth, budget)
    }

    /// Parses a receipt from base64 text (whitespace and line breaks are ignored).
    public static func parse(base64 text: String, limits: Limits = .standard) throws(AppReceiptError) -> AppReceipt {
        // A generous bound before looking at the text, a tight one once whitespace is gone.
        let maxEncoded = (limits.maxInputBytes / 3 + 1) * 4
        guard text.utf8.count <= maxEncoded * 2 else {
            throw AppReceiptError(.tooLarge, "the base64 text is longer than \(maxEncoded * 2) bytes")
        }
        var compact: [UInt8] = []
        compact.reserveCapacity(text.utf8.count)
        for byte in text.utf8 where !(byte == 0x20 || byte == 0x0A || byte == 0x0D || byte == 0x09) {
            compact.append(byte)
        }
        guard !compact.isEmpty else { throw AppReceiptError(.empty, "the receipt is empty") }
        guard compact.count <= maxEncoded else {
            throw AppReceiptError(.tooLarge, "the base64 text decodes to more than \(limits.maxInputBytes) bytes")
        }
        guard let data = Data(base64Encoded: Data(compact)) else {
            throw AppReceiptError(.notBase64, "the receipt is not valid base64")
        }
        return try parse([UInt8](data), limits: limits)
    }

    // MARK: - PKCS#7

    /// id-signedData, 1.2.840.113549.1.7.2.
    static let signedDataOID: [UInt8] = [0x2A, 0x86, 0x48, 0x86, 0xF7, 0x0D, 0x01, 0x07, 0x02]
    /// id-data, 1.2.840.113549.1.7.1.
    static let dataOID: [UInt8] = [0x2A, 0x86, 0x48, 0x86, 0xF7, 0x0D, 0x01, 0x07, 0x01]

    /// Walks ContentInfo → SignedData → encapContentInfo → eContent and returns the content
    /// octets, with the nesting depth they were found at.
    private static func signedContent(
        of contentInfo: BERElement, in reader: BERReader, limits: Limits
    ) throws(AppReceiptError) -> ([UInt8], Int) {
        let notPKCS7 = { (message: String) in AppReceiptError(.notPKCS7, message) }
        guard contentInfo.tag.isUniversalConstructed(BERTag.sequence) else { throw notPKCS7("not a SEQUENCE") }
        let info = try reader.children(of: contentInfo, depth: 0)
        guard info.count == 2, try isOID(info[0], signedDataOID, in: reader) else {
            throw notPKCS7("not a ContentInfo of type signedData")
        }
        guard info[1].tag.isContextConstructed(0) else { throw notPKCS7("the signedData content is missing") }
        let explicit = try reader.children(of: info[1], depth: 1)
        guard explicit.count == 1, explicit[0].tag.isUniversalConstructed(BERTag.sequence) else {
            throw notPKCS7("the signedData content is not a SEQUENCE")
        }
        let signedData = try reader.children(of: explicit[0], depth: 2)
        guard signedData.count >= 4,
            signedData[0].tag.isUniversal(BERTag.integer),
            signedData[1].tag.isUniversalConstructed(BERTag.set),
            signedData[2].tag.isUniversalConstructed(BERTag.sequence),
            signedData[signedData.count - 1].tag.isUniversalConstructed(BERTag.set)
        else {
            throw notPKCS7("SignedData does not have version, digestAlgorithms, encapContentInfo and signerInfos")
        }
        if limits.requireSigners { try checkSigners(signedData, in: reader, limits: limits) }
        let encapsulated = try reader.children(of: signedData[2], depth: 3)
        guard let contentType = encapsulated.first, try isOID(contentType, nil, in: reader) else {
            throw notPKCS7("encapContentInfo has no content type")
        }
        guard try isOID(contentType, dataOID, in: reader) else {
            throw AppReceiptError(.notAReceipt, "the signed content is not of type data")
        }
        guard encapsulated.count == 2, encapsulated[1].tag.isContextConstructed(0) else {
            throw AppReceiptError(.notAReceipt, "the signed content is detached or missing")
        }
        let eContent = try reader.children(of: encapsulated[1], depth: 4)
        guard eContent.count == 1, eContent[0].tag.isUniversal(BERTag.octetString) else {
            throw AppReceiptError(.notAReceipt, "the signed content is not an OCTET STRING")
        }
        return (try reader.stringContent(of: eContent[0], depth: 5), 6)
    }

    /// Apple's receipts carry their certificates (`[0]`) and a `SignerInfo`; a shell without
    /// them is `unsigned`, and ones larger than `maxSignatureBytes` are filler.
    private static func checkSigners(
        _ signedData: [BERElement], in reader: BERReader, limits: Limits
    ) throws(AppReceiptError) {
        guard try !reader.children(of: signedData[1], depth: 3).isEmpty else {
            throw AppReceiptError(.unsigned, "SignedData names no digest algorithm")
        }
        guard let certificates = signedData[3..<(signedData.count - 1)].first(where: { $0.tag.isContextConstructed(0) })
        else { throw AppReceiptError(.unsigned, "SignedData carries no certificates") }
        let signers = signedData[signedData.count - 1]
        for (name, element) in [("certificates", certificates), ("signerInfos", signers)] {
            let children = try reader.children(of: element, depth: 3)
            guard !children.isEmpty, children.allSatisfy({ $0.tag.isUniversalConstructed(BERTag.sequence) }) else {
                throw AppReceiptError(.unsigned, "SignedData's \(name) are empty or not SEQUENCEs")
            }
            guard element.end - element.start <= limits.maxSignatureBytes else {
                throw AppReceiptError(.unsigned, "SignedData's \(name) hold \(element.end - element.start) bytes, more than \(limits.maxSignatureBytes)")
            }
        }
    }

    /// Refuses an attribute of a type this parser does not read when it is larger than, or one
    /// more than, `limits` allow (a filler attribute of a padded shell).
    private static func checkUnknown(
        _ attribute: RawAttribute, count: inout Int, limits: Limits
    ) throws(AppReceiptError) {
        count += 1
        let size = attribute.value.end - attribute.value.start
        guard size <= limits.maxUnknownAttributeBytes, count <= limits.maxUnknownAttributes else {
            throw AppReceiptError(
                .notAReceipt,
                "attribute \(attribute.type) of an unknown type holds \(size) bytes (the \(count)th such attribute of its set)")
        }
    }

    /// Whether `element` is an OBJECT IDENTIFIER (equal to `expected` when given).
    private static func isOID(
        _ element: BERElement, _ expected: [UInt8]?, in reader: BERReader
    ) throws(AppReceiptError) -> Bool {
        guard element.tag.isUniversal(BERTag.objectIdentifier), !element.tag.isConstructed else { return false }
        guard let expected else { return true }
        return try reader.primitiveContent(of: element).elementsEqual(expected)
    }

    // MARK: - Receipt payload

    /// Receipt attribute types this parser reads; all others are skipped.
    enum ReceiptField: Int64 {
        case receiptType = 0, bundleId = 2, appVersion = 3, opaqueValue = 4, sha1Hash = 5, creationDate = 12
        case inAppPurchase = 17, originalAppVersion = 19
    }

    /// In-app purchase attribute types this parser reads; all others are skipped.
    enum PurchaseField: Int64 {
        case quantity = 1701, productId = 1702, transactionId = 1703, purchaseDate = 1704
        case originalTransactionId = 1705, originalPurchaseDate = 1706, expiresDate = 1708
        case webOrderLineItemId = 1711, cancellationDate = 1712
    }

    private static func receipt(
        fromPayload payload: [UInt8], depth: Int, budget: BERWorkBudget, limits: Limits
    ) throws(AppReceiptError) -> AppReceipt {
        let (reader, set, setDepth) = try attributeSet(payload, depth: depth, budget: budget, limits: limits) {
            AppReceiptError(.notAReceipt, "the signed content is not a receipt payload (\($0))")
        }
        var receiptType: String?
        var bundleId: String?
        var appVersion: String?
        var originalAppVersion: String?
        var creationDate: Date?
        var opaqueCount: Int?
        var hashCount: Int?
        var purchases: [AppReceipt.InAppPurchase] = []
        var seen: Set<Int64> = []
        var unknown = 0
        for attribute in try attributes(of: set, in: reader, depth: setDepth) {
            guard let field = ReceiptField(rawValue: attribute.type) else {
                try checkUnknown(attribute, count: &unknown, limits: limits)
                continue
            }
            if field == .inAppPurchase, attribute.value.end - attribute.value.start > limits.maxPurchaseBytes {
                throw AppReceiptError(
                    .notAReceipt, "an in-app purchase holds \(attribute.value.end - attribute.value.start) bytes, more than \(limits.maxPurchaseBytes)")
            }
            if field != .inAppPurchase {
                guard seen.insert(attribute.type).inserted else {
                    throw AppReceiptError(.invalidField, "receipt attribute \(attribute.type) appears twice")
                }
            }
            let value = FieldValue(
                type: attribute.type, bytes: try reader.stringContent(of: attribute.value, depth: setDepth + 2),
                depth: setDepth + 3, budget: budget, limits: limits)
            switch field {
            case .receiptType: receiptType = try value.string()
            case .bundleId: bundleId = try value.string()
            case .appVersion: appVersion = try value.string()
            case .originalAppVersion: originalAppVersion = try value.string()
            case .creationDate: creationDate = try value.date()
            case .opaqueValue: opaqueCount = value.bytes.count
            case .sha1Hash: hashCount = value.bytes.count
            case .inAppPurchase: purchases.append(try purchase(value))
            }
        }
        guard let bundleId, !bundleId.isEmpty else {
            throw AppReceiptError(.notAReceipt, "the receipt payload has no bundle id")
        }
        return AppReceipt(
            receiptType: receiptType, bundleId: bundleId, appVersion: appVersion, originalAppVersion: originalAppVersion,
            creationDate: creationDate, opaqueValueByteCount: opaqueCount ?? 0, sha1HashByteCount: hashCount ?? 0,
            inApp: purchases)
    }

    private static func purchase(_ value: FieldValue) throws(AppReceiptError) -> AppReceipt.InAppPurchase {
        let (reader, set, setDepth) = try attributeSet(
            value.bytes, depth: value.depth, budget: value.budget, limits: value.limits
        ) { AppReceiptError(.invalidField, "an in-app purchase is not a SET of attributes (\($0))") }
        var quantity: Int?
        var productId: String?
        var transactionId: String?
        var originalTransactionId: String?
        var purchaseDate: Date?
        var originalPurchaseDate: Date?
        var expiresDate: Date?
        var webOrderLineItemId: Int64?
        var cancellationDate: Date?
        var seen: Set<Int64> = []
        var unknown = 0
        for attribute in try attributes(of: set, in: reader, depth: setDepth) {
            guard let field = PurchaseField(rawValue: attribute.type) else {
                try checkUnknown(attribute, count: &unknown, limits: value.limits)
                continue
            }
            guard seen.insert(attribute.type).inserted else {
                throw AppReceiptError(.invalidField, "in-app attribute \(attribute.type) appears twice")
            }
            let value = FieldValue(
                type: attribute.type, bytes: try reader.stringContent(of: attribute.value, depth: setDepth + 2),
                depth: setDepth + 3, budget: value.budget, limits: value.limits)
            switch field {
            case .quantity:
                let count = try value.integer()
                guard count >= 0, count <= Int64(Int32.max) else {
                    throw AppReceiptError(.invalidField, "quantity \(count) is out of range")
                }
                quantity = Int(count)
            case .productId: productId = try value.string()
            case .transactionId: transactionId = try value.string()
            case .originalTransactionId: originalTransactionId = try value.string()
            case .purchaseDate: purchaseDate = try value.date()
            case .originalPurchaseDate: originalPurchaseDate = try value.date()
            case .expiresDate: expiresDate = try value.date()
            case .webOrderLineItemId: webOrderLineItemId = try value.integer()
            case .cancellationDate: cancellationDate = try value.date()
            }
        }
        guard let productId, !productId.isEmpty else {
            throw AppReceiptError(.invalidField, "an in-app purchase has no product id")
        }
        guard let transactionId, !transactionId.isEmpty else {
            throw AppReceiptError(.invalidField, "an in-app purchase has no transaction id")
        }
        return AppReceipt.InAppPurchase(
            quantity: quantity, productId: productId, transactionId: transactionId,
            originalTransactionId: originalTransactionId, purchaseDate: purchaseDate,
            originalPurchaseDate: originalPurchaseDate, expiresDate: expiresDate,
            webOrderLineItemId: webOrderLineItemId, cancellationDate: cancellationDate)
    }

    /// The SET of attributes that fills `bytes`, after unwrapping any OCTET STRINGs around it
    /// (Xcode's receipts wrap the payload once more).
    private static func attributeSet(
        _ bytes: [UInt8], depth: Int, budget: BERWorkBudget, limits: Limits,
        wrongShape: (String) -> AppReceiptError
    ) throws(AppReceiptError) -> (BERReader, BERElement, Int) {
        var reader = BERReader(bytes: bytes, budget: budget, maxDepth: limits.maxDepth)
        var depth = depth
        var root = try reader.root(depth: depth)
        while root.tag.isUniversal(BERTag.octetString) {
            let inner = try reader.stringContent(of: root, depth: depth)
            depth += 1
            reader = BERReader(bytes: inner, budget: budget, maxDepth: limits.maxDepth)
            root = try reader.root(depth: depth)
        }
        guard root.tag.isUniversalConstructed(BERTag.set) else { throw wrongShape("found \(root.tag)") }
        try reader.validateTree(root, depth: depth)
        return (reader, root, depth)
    }

    /// One `ReceiptAttribute ::= SEQUENCE { type INTEGER, version INTEGER, value OCTET STRING }`.
    private struct RawAttribute {
        var type: Int64
        var value: BERElement
    }

    private static func attributes(
        of set: BERElement, in reader: BERReader, depth: Int
    ) throws(AppReceiptError) -> [RawAttribute] {
        var result: [RawAttribute] = []
        for element in try reader.children(of: set, depth: depth) {
            guard element.tag.isUniversalConstructed(BERTag.sequence) else {
                throw AppReceiptError(.invalidField, "an attribute is \(element.tag), not a SEQUENCE")
            }
            let parts = try reader.children(of: element, depth: depth + 1)
            guard parts.count == 3, parts[2].tag.isUniversal(BERTag.octetString) else {
                throw AppReceiptError(.invalidField, "an attribute is not (type, version, value)")
            }
            let type = try reader.integer(parts[0])
            _ = try reader.integer(parts[1])
            result.append(RawAttribute(type: type, value: parts[2]))
        }
        return result
    }

    /// The DER (or BER) of one attribute's value, decoded on demand as the field requires.
    private struct FieldValue {
        var type: Int64
        var bytes: [UInt8]
        var depth: Int
        var budget: BERWorkBudget
        var limits: Limits

        private func single() throws(AppReceiptError) -> (BERReader, BERElement) {
            let reader = BERReader(bytes: bytes, budget: budget, maxDepth: limits.maxDepth)
            do throws(AppReceiptError) {
                let element = try reader.root(depth: depth)
                try reader.validateTree(element, depth: depth)
                return (reader, element)
            } catch {
                throw AppReceiptError(error.code, "attribute \(type): \(error.message)")
            }
        }

        func string() throws(AppReceiptError) -> String {
            let (reader, element) = try single()
            let tag = element.tag
            guard tag.tagClass == .universal,
                [BERTag.utf8String, BERTag.ia5String, BERTag.printableString, BERTag.visibleString]
                    .contains(tag.number)
            else {
                throw AppReceiptError(.invalidField, "attribute \(type) is \(tag), not a string")
            }
            let content = try reader.stringContent(of: element, depth: depth)
            if tag.number != BERTag.utf8String, content.contains(where: { $0 >= 0x80 }) {
                throw AppReceiptError(.invalidField, "attribute \(type) has non-ASCII bytes in an ASCII string")
            }
            guard let text = String(validating: content, as: UTF8.self) else {
                throw AppReceiptError(.invalidField, "attribute \(type) is not valid UTF-8")
            }
            return text
        }

        func integer() throws(AppReceiptError) -> Int64 {
            let (reader, element) = try single()
            do throws(AppReceiptError) {
                return try reader.integer(element)
            } catch {
                throw AppReceiptError(error.code, "attribute \(type): \(error.message)")
            }
        }

        /// An RFC 3339 date; an empty string (Apple's way of saying "none") is `nil`.
        func date() throws(AppReceiptError) -> Date? {
            let text = try string()
            if text.isEmpty { return nil }
            guard let date = RFC3339Date.parse(Array(text.utf8)) else {
                throw AppReceiptError(.invalidField, "attribute \(type) is not an RFC 3339 date")
            }
            return date
        }
    }
}

/// A strict reader of the RFC 3339 dates in receipts: `2023-10-19T01:18:54Z`, with optional
/// fractional seconds and a `Z`, `±hh:mm` or `±hhmm` offset.
enum RFC3339Date {
    /// The date `text` names, or `nil` when it is not a valid RFC 3339 date-time within
    /// 1970…9999 once its offset is applied (`DateText.acceptedMilliseconds`): a self-made
    /// receipt dated `9999-12-31T23:59:59-23:59` (the year 10000) is refused here, before any
    /// certificate check turns the date into a time that cannot hold it.
    static func parse(_ text: [UInt8]) -> Date? {
        var position = 0
        func digits(_ count: Int) -> Int? {
            guard count <= text.count - position else { return nil }
            var value = 0
            for _ in 0..<count {
                let byte = text[position]
                guard byte >= 0x30, byte <= 0x39 else { return nil }
                value = value * 10 + Int(byte - 0x30)
                position += 1
            }
            return value
        }
        func expect(_ byte: UInt8) -> Bool {
            guard position < text.count, text[position] == byte else { return false }
            position += 1
            return true
        }
        guard let year = digits(4), expect(0x2D), let month = digits(2), expect(0x2D), let day = digits(2),
            expect(0x54) || expect(0x74), let hour = digits(2), expect(0x3A), let minute = digits(2),
            expect(0x3A), let second = digits(2)
        else { return nil }
        var fraction = 0.0
        if expect(0x2E) {
            var scale = 0.1
            var count = 0
            while position < text.count, text[position] >= 0x30, text[position] <= 0x39 {
                count += 1
                guard count <= 9 else { return nil }
                fraction += Double(text[position] - 0x30) * scale
                scale /= 10
                position += 1
            }
            guard count > 0 else { return nil }
        }
        var offsetSeconds = 0
        if expect(0x5A) || expect(0x7A) {
            offsetSeconds = 0
        } else if position < text.count, text[position] == 0x2B || text[position] == 0x2D {
            let sign = text[position] == 0x2D ? -1 : 1
            position += 1
            guard let offsetHours = digits(2) else { return nil }
            _ = expect(0x3A)
            guard let offsetMinutes = digits(2), offsetHours <= 23, offsetMinutes <= 59 else { return nil }
            offsetSeconds = sign * (offsetHours * 3600 + offsetMinutes * 60)
        } else {
            return nil
        }
        guard position == text.count else { return nil }
        guard (1...12).contains(month), day >= 1, day <= daysIn(month: month, year: year), hour <= 23,
            minute <= 59, second <= 60
        else { return nil }
        let days = daysSinceEpoch(year: year, month: month, day: day)
        let seconds = days * 86_400 + hour * 3600 + minute * 60 + second - offsetSeconds
        // The range `DateText.acceptedMilliseconds` holds (the parser builds alone, for fuzzing).
        guard seconds >= 0, Double(seconds) + fraction < 253_402_300_800 else { return nil }
        return Date(timeIntervalSince1970: Double(seconds) + fraction)
    }

    /// Days in `month` (1–12) of `year`, leap years included.
    static func daysIn(month: Int, year: Int) -> Int {
        switch month {
        case 2: return (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 ? 29 : 28
        case 4, 6, 9, 11: return 30
        default: return 31
        }
    }

    /// Days from 1970-01-01 to the given proleptic Gregorian date.
    static func daysSinceEpoch(year: Int, month: Int, day: Int) -> Int {
        let shiftedYear = month <= 2 ? year - 1 : year
        let era = (shiftedYear >= 0 ? shiftedYear : shiftedYear - 399) / 400
        let yearOfEra = shiftedYear - era * 400
        let dayOfYear = (153 * ((month + 9) % 12) + 2) / 5 + day - 1
        let dayOfEra = yearOfEra * 365 + yearOfEra / 4 - yearOfEra / 100 + dayOfYear
        return era * 146_097 + dayOfEra - 719_468
    }
}
