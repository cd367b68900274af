import AppStore
import FakeAppStore
import Foundation
@testable import LedgerTestSupport
import Testing
@_spi(CMS) import X509

/// Receipts minted by the fake App Store, read back by the local parser: DER as the App Store
/// sends them, BER as Xcode does, and junk of every shape, which must fail with a typed error.
@Suite("App receipts: minting and local parsing")
struct AppReceiptTests {
    static let bundleId = "com.example.receipts"
    static let authority: FakeCertificateAuthority = {
        do {
            return try FakeCertificateAuthority.generate()
        } catch {
            fatalError("cannot create the test chain: \(error)")
        }
    }()

    /// 2026-11-23T01:02:03Z and friends, in whole seconds as receipts carry them.
    static func date(_ text: String) -> Date {
        guard let date = try? Date(text, strategy: .iso8601) else { fatalError("bad test date \(text)") }
        return date
    }

    /// A receipt with three purchases: one consumable, one cancelled, one subscription.
    static let payload = ReceiptPayload(
        bundleId: bundleId, appVersion: "2.3", originalAppVersion: "1.0",
        opaqueValue: [0xD1, 0xBC, 0xFE, 0xCF, 0x04, 0x00, 0x00, 0x00], sha1Hash: Array(repeating: 0xAB, count: 20),
        creationDate: date("2026-11-23T01:02:03Z"),
        inApp: [
            InAppPurchasePayload(
                quantity: 3, productId: "com.example.coins.60", transactionId: "2000000000000001",
                purchaseDate: date("2026-11-20T10:00:00Z")),
            InAppPurchasePayload(
                productId: "com.example.sword", transactionId: "2000000000000002",
                purchaseDate: date("2026-11-21T11:30:00Z"), cancellationDate: date("2026-11-22T09:15:00Z")),
            InAppPurchasePayload(
                productId: "com.example.pro.monthly", transactionId: "2000000000000003",
                originalTransactionId: "2000000000000000", purchaseDate: date("2026-11-22T12:00:00Z"),
                originalPurchaseDate: date("2026-10-22T12:00:00Z"), expiresDate: date("2026-12-22T12:00:00Z"),
                webOrderLineItemId: 2_000_000_123_456_789),
        ])

    static let minted: [UInt8] = {
        do {
            return try ReceiptMinter(authority: authority).mint(payload)
        } catch {
            fatalError("cannot mint the test receipt: \(error)")
        }
    }()

    /// What `payload` must read back as.
    static let expected = AppReceipt(
        receiptType: "Production", bundleId: bundleId, appVersion: "2.3", originalAppVersion: "1.0", creationDate: date("2026-11-23T01:02:03Z"),
        opaqueValueByteCount: 8, sha1HashByteCount: 20,
        inApp: [
            .init(
                quantity: 3, productId: "com.example.coins.60", transactionId: "2000000000000001",
                originalTransactionId: "2000000000000001", purchaseDate: date("2026-11-20T10:00:00Z"),
                originalPurchaseDate: date("2026-11-20T10:00:00Z")),
            .init(
                quantity: 1, productId: "com.example.sword", transactionId: "2000000000000002",
                originalTransactionId: "2000000000000002", purchaseDate: date("2026-11-21T11:30:00Z"),
                originalPurchaseDate: date("2026-11-21T11:30:00Z"), cancellationDate: date("2026-11-22T09:15:00Z")),
            .init(
                quantity: 1, productId: "com.example.pro.monthly", transactionId: "2000000000000003",
                originalTransactionId: "2000000000000000", purchaseDate: date("2026-11-22T12:00:00Z"),
                originalPurchaseDate: date("2026-10-22T12:00:00Z"), expiresDate: date("2026-12-22T12:00:00Z"),
                webOrderLineItemId: 2_000_000_123_456_789),
        ])

    // MARK: - Round trips

    @Test func mintedReceipt_readsBackFieldByField() throws {
        let receipt = try AppReceiptParser.parse(Self.minted)
        #expect(receipt.bundleId == Self.bundleId)
        #expect(receipt.appVersion == "2.3")
        #expect(receipt.originalAppVersion == "1.0")
        #expect(receipt.creationDate == Self.date("2026-11-23T01:02:03Z"))
        #expect(receipt.opaqueValueByteCount == 8)
        #expect(receipt.sha1HashByteCount == 20)
        // The payload is a DER SET OF, so purchases come back in encoding order: find them by id.
        #expect(receipt.inApp.count == 3)
        for purchase in Self.expected.inApp {
            #expect(receipt.inApp.first { $0.transactionId == purchase.transactionId } == purchase)
        }
        let cancelled = receipt.inApp.filter { $0.cancellationDate != nil }.map(\.transactionId)
        #expect(cancelled == ["2000000000000002"])
        let subscription = receipt.inApp.first { $0.expiresDate != nil }
        #expect(subscription?.webOrderLineItemId == 2_000_000_123_456_789)
        #expect(subscription?.originalTransactionId == "2000000000000000")
        #expect(Self.sorted(receipt) == Self.expected)
    }

    @Test func base64Text_withLineBreaks_readsTheSame() throws {
        let text = Data(Self.minted).base64EncodedString(options: [.lineLength64Characters, .endLineWithLineFeed])
        #expect(try Self.sorted(AppReceiptParser.parse(base64: text + "\n")) == Self.expected)
        #expect(throws: AppReceiptError(.notBase64, "the receipt is not valid base64")) {
            try AppReceiptParser.parse(base64: "not*base64")
        }
    }

    @Test func berWithIndefiniteLengths_andWrappedContent_readsTheSame() throws {
        let ber = BERTranscoder.reencode(Self.minted)
        #expect(ber != Self.minted)
        #expect(ber.contains(0x80), "indefinite lengths are used")
        #expect(try Self.sorted(AppReceiptParser.parse(ber)) == Self.expected)
    }

    @Test func unknownAttributes_areSkipped_andOffsetDatesAreRead() throws {
        // An attribute type Apple may add, with a value whose tag has the long form, an empty
        // expiry (Apple's "none") and a date with an offset, as Xcode writes them.
        let purchase = TestDER.set([
            TestDER.attribute(1702, TestDER.utf8("com.example.gem")),
            TestDER.attribute(1703, TestDER.utf8("1000000000000042")),
            TestDER.attribute(1704, TestDER.ia5("2020-07-22T18:33:14+0100")),
            TestDER.attribute(1708, TestDER.ia5("")),
            TestDER.attribute(1799, [0x5F, 0x81, 0x48, 0x01, 0x00]),
        ])
        let payload = TestDER.set([
            TestDER.attribute(0, TestDER.utf8("Xcode")),
            TestDER.attribute(2, TestDER.utf8(Self.bundleId)),
            TestDER.attribute(17, purchase),
            TestDER.attribute(21, TestDER.ia5("4001-01-01T00:00:00Z")),
            TestDER.attribute(99_999, [0x01, 0x02, 0x03]),
        ])
        let receipt = try AppReceiptParser.parse(TestDER.signedData(content: payload))
        #expect(receipt.bundleId == Self.bundleId)
        #expect(receipt.appVersion == nil)
        #expect(receipt.inApp.count == 1)
        #expect(receipt.inApp.first?.transactionId == "1000000000000042")
        #expect(receipt.inApp.first?.purchaseDate == Self.date("2020-07-22T17:33:14Z"))
        #expect(receipt.inApp.first?.expiresDate == nil)
    }

    // MARK: - Junk

    @Test func structuralJunk_hasStableCodes() {
        func code(_ bytes: [UInt8]) -> AppReceiptError.Code? { Self.code(of: bytes) }
        #expect(code([]) == .empty)
        #expect(code(Array("hello".utf8)) == .notPKCS7)
        #expect(code([0x30, 0x03, 0x02, 0x01]) == .truncated)
        #expect(code([0x30, 0x00, 0x00]) == .invalidLength)
        #expect(code([0x30, 0x03, 0x06, 0x01, 0x00]) == .notPKCS7)
        #expect(code([0x30, 0x04, 0x04, 0x80, 0x00, 0x00]) == .invalidLength)
        #expect(code([0x30, 0x05, 0x5F, 0x81, 0x48, 0x01, 0x00]) == .notPKCS7, "a long-form tag is read")
        #expect(code([0x30, 0x04, 0x5F, 0x1E, 0x01, 0x00]) == .invalidTag, "tag 30 must use the short form")
        #expect(code([0x30, 0x84, 0x00, 0x00, 0x00, 0x02, 0x05, 0x00]) == .notPKCS7, "a long-form length is read")
        #expect(code(TestDER.signedData(content: TestDER.set([TestDER.attribute(3, TestDER.utf8("1"))]))) == .notAReceipt)
        #expect(code(TestDER.signedData(content: TestDER.utf8("a string"))) == .notAReceipt)
        let twice = TestDER.set([TestDER.attribute(2, TestDER.utf8("a")), TestDER.attribute(2, TestDER.utf8("b"))])
        #expect(code(TestDER.signedData(content: twice)) == .invalidField)
        let notAString = TestDER.set([TestDER.attribute(2, [0x02, 0x01, 0x05])])
        #expect(code(TestDER.signedData(content: notAString)) == .invalidField)
        let badDate = TestDER.set([TestDER.attribute(2, TestDER.utf8("a")), TestDER.attribute(12, TestDER.ia5("2026-02-30T00:00:00Z"))])
        #expect(code(TestDER.signedData(content: badDate)) == .invalidField)
        let noTransaction = TestDER.set([
            TestDER.attribute(2, TestDER.utf8("a")), TestDER.attribute(17, TestDER.set([TestDER.attribute(1702, TestDER.utf8("p"))])),
        ])
        #expect(code(TestDER.signedData(content: noTransaction)) == .invalidField)
    }

    @Test func everyTruncation_throwsATypedError_inBoundedTime() {
        let clock = ContinuousClock()
        let elapsed = clock.measure {
            for length in 0..<Self.minted.count {
                #expect(throws: AppReceiptError.self) { try AppReceiptParser.parse(Array(Self.minted[..<length])) }
            }
            let ber = BERTranscoder.reencode(Self.minted)
            for length in stride(from: 0, to: ber.count, by: 7) {
                #expect(throws: AppReceiptError.self) { try AppReceiptParser.parse(Array(ber[..<length])) }
            }
        }
        #expect(elapsed < .seconds(60))
    }

    @Test func bitFlipsAndRandomBytes_parseOrThrowATypedError() {
        var random = SplitMix64(seed: 0x1AB_5EED)
        let ber = BERTranscoder.reencode(Self.minted)
        let clock = ContinuousClock()
        var parsed = 0
        var failed = 0
        let elapsed = clock.measure {
            for round in 0..<4000 {
                var bytes = round.isMultiple(of: 2) ? Self.minted : ber
                let bit = Int(random.next() % UInt64(bytes.count * 8))
                bytes[bit / 8] ^= UInt8(1 << (bit % 8))
                // Typed throws: anything that comes out is an AppReceiptError.
                do throws(AppReceiptError) {
                    _ = try AppReceiptParser.parse(bytes)
                    parsed += 1
                } catch {
                    failed += 1
                    #expect(!error.code.rawValue.isEmpty)
                }
            }
            for round in 0..<3000 {
                let length = Int(random.next() % 600)
                var bytes = (0..<length).map { _ in UInt8(truncatingIfNeeded: random.next()) }
                // Half of them look like a receipt at first glance, to get past the first check.
                if round.isMultiple(of: 2), !bytes.isEmpty { bytes[0] = 0x30 }
                do {
                    _ = try AppReceiptParser.parse(bytes)
                    parsed += 1
                } catch {
                    failed += 1
                }
            }
        }
        #expect(parsed + failed == 7000)
        #expect(parsed > 0, "flips in signatures and certificates leave the receipt readable")
        #expect(elapsed < .seconds(60))
    }

    @Test func deepNesting_throwsTooDeep() {
        let indefinite: [UInt8] = (0..<20_000).map { $0.isMultiple(of: 2) ? 0x30 : 0x80 }
        #expect(Self.code(of: indefinite) == .tooDeep)

        // 10,000 SEQUENCE headers with definite lengths around a NULL, outermost first.
        var lengths = [2]
        for _ in 0..<10_000 {
            lengths.append(1 + TestDER.length(lengths[lengths.count - 1]).count + lengths[lengths.count - 1])
        }
        var definite: [UInt8] = []
        for length in lengths.dropLast().reversed() {
            definite += [0x30] + TestDER.length(length)
        }
        definite += [0x05, 0x00]
        #expect(Self.code(of: definite) == .tooDeep)

        // Deep nesting inside the payload is caught there too.
        var deepValue: [UInt8] = [0x05, 0x00]
        for _ in 0..<100 {
            deepValue = [0x31] + TestDER.length(deepValue.count) + deepValue
        }
        let payload = TestDER.set([TestDER.attribute(2, TestDER.utf8("a")), TestDER.attribute(17, deepValue)])
        #expect(Self.code(of: TestDER.signedData(content: payload)) == .tooDeep)
    }

    @Test func oversizedInput_throwsTooLarge() {
        let limit = AppReceiptParser.Limits.standard.maxInputBytes
        #expect(Self.code(of: [UInt8](repeating: 0x30, count: limit + 1)) == .tooLarge)
        let small = AppReceiptParser.Limits(maxInputBytes: 1000, maxDepth: 32, maxElements: 1000)
        #expect(Self.code(of: Self.minted, limits: small) == .tooLarge)
        let text = String(repeating: "A", count: (limit / 3 + 2) * 4)
        #expect(Self.code(ofBase64: text) == .tooLarge)
    }

    @Test func manySiblings_throwTooManyElements() {
        // A SET with a million empty elements, well under the size limit.
        let content: [UInt8] = (0..<2_000_000).map { $0.isMultiple(of: 2) ? 0x05 : 0x00 }
        let bytes: [UInt8] = [0x30, 0x80, 0x31] + TestDER.length(content.count) + content + [0x00, 0x00]
        #expect(Self.code(of: bytes) == .tooManyElements)
    }

    // MARK: - The fake's certificates

    @Test func certificateChain_isShapedLikeApples_andValidates() async throws {
        let authority = Self.authority
        let intermediateMarker = authority.intermediate.extensions[oid: FakeCertificateAuthority.intermediateMarkerOID]
        let leafMarker = authority.leaf.extensions[oid: FakeCertificateAuthority.receiptSigningMarkerOID]
        #expect(intermediateMarker?.critical == false)
        #expect(intermediateMarker?.value == [0x05, 0x00])
        #expect(leafMarker?.critical == false)
        #expect(leafMarker?.value == [0x05, 0x00])
        #expect(authority.leaf.extensions[oid: FakeCertificateAuthority.intermediateMarkerOID] == nil)
        #expect(try authority.leaf.extensions.subjectKeyIdentifier != nil)
        #expect(
            try authority.leaf.extensions.authorityKeyIdentifier?.keyIdentifier
                == authority.intermediate.extensions.subjectKeyIdentifier?.keyIdentifier)
        #expect(
            try authority.intermediate.extensions.authorityKeyIdentifier?.keyIdentifier
                == authority.root.extensions.subjectKeyIdentifier?.keyIdentifier)

        var verifier = Verifier(rootCertificates: CertificateStore([authority.root])) { RFC5280Policy() }
        let result = await verifier.validate(
            leaf: authority.leaf, intermediates: CertificateStore([authority.intermediate]))
        guard case .validCertificate(let chain) = result else {
            Issue.record("the chain does not validate: \(result)")
            return
        }
        #expect(chain.count == 3)
    }

    @Test func mintedReceipt_carriesAValidSignature_andARestoredAuthorityKeepsItsIdentity() async throws {
        let restored = try FakeCertificateAuthority(pemBundle: Self.authority.pemBundle())
        #expect(restored.root == Self.authority.root)
        #expect(restored.leaf == Self.authority.leaf)
        let receipt = try ReceiptMinter(authority: restored).mint(Self.payload)
        #expect(try Self.sorted(AppReceiptParser.parse(receipt)) == Self.expected)
        let result = await CMS.isValidAttachedSignature(
            signatureBytes: receipt, trustRoots: CertificateStore([Self.authority.root])
        ) { RFC5280Policy() }
        guard case .success = result else {
            Issue.record("the minted receipt's signature does not verify: \(result)")
            return
        }
        #expect(throws: FakeAppStoreError.self) { try FakeCertificateAuthority(pemBundle: "junk") }
    }

    // MARK: - Helpers

    /// The error code a parse ends with, or `nil` when it succeeds.
    static func code(of bytes: [UInt8], limits: AppReceiptParser.Limits = .standard) -> AppReceiptError.Code? {
        do {
            _ = try AppReceiptParser.parse(bytes, limits: limits)
            return nil
        } catch {
            return error.code
        }
    }

    /// The error code a parse of base64 text ends with, or `nil` when it succeeds.
    static func code(ofBase64 text: String) -> AppReceiptError.Code? {
        do {
            _ = try AppReceiptParser.parse(base64: text)
            return nil
        } catch {
            return error.code
        }
    }

    /// The receipt with its purchases in `expected`'s order (by transaction id).
    static func sorted(_ receipt: AppReceipt) -> AppReceipt {
        var receipt = receipt
        receipt.inApp.sort { $0.transactionId < $1.transactionId }
        return receipt
    }
}

/// Rewrites DER as Xcode writes BER: every constructed element with an indefinite length,
/// every OCTET STRING constructed from small chunks, and the signed content wrapped in a
/// second OCTET STRING.
enum BERTranscoder {
    static func reencode(_ der: [UInt8]) -> [UInt8] {
        reencodeElements(der[...], outermost: true)
    }

    private static func reencodeElements(_ der: ArraySlice<UInt8>, outermost: Bool) -> [UInt8] {
        var output: [UInt8] = []
        var position = der.startIndex
        while position < der.endIndex {
            let tag = der[position]
            var lengthEnd = position + 2
            var length = Int(der[position + 1])
            if length >= 0x80 {
                let count = length & 0x7F
                length = der[(position + 2)..<(position + 2 + count)].reduce(0) { $0 << 8 | Int($1) }
                lengthEnd += count
            }
            let content = der[lengthEnd..<(lengthEnd + length)]
            if tag & 0x20 != 0 {
                output += [tag, 0x80] + reencodeElements(content, outermost: outermost) + [0x00, 0x00]
            } else if tag == 0x04 && content.first == 0x31 && isOneElement(content) {
                // A nested payload (the signed content, an in-app purchase): BER inside too.
                var inner = reencodeElements(content, outermost: false)
                if outermost { inner = chunked(inner) }
                output += chunked(inner)
            } else if tag == 0x04 && content.count > 16 {
                output += chunked(Array(content))
            } else {
                output += der[position..<(lengthEnd + length)]
            }
            position = lengthEnd + length
        }
        return output
    }

    private static func isOneElement(_ bytes: ArraySlice<UInt8>) -> Bool {
        guard bytes.count >= 2 else { return false }
        var length = Int(bytes[bytes.startIndex + 1])
        var header = 2
        if length >= 0x80 {
            let count = length & 0x7F
            guard count <= 4, bytes.count >= 2 + count else { return false }
            length = bytes[(bytes.startIndex + 2)..<(bytes.startIndex + 2 + count)].reduce(0) { $0 << 8 | Int($1) }
            header += count
        }
        return header + length == bytes.count
    }

    private static func chunked(_ bytes: [UInt8]) -> [UInt8] {
        var output: [UInt8] = [0x24, 0x80]
        for start in stride(from: 0, to: bytes.count, by: 100) {
            let chunk = bytes[start..<min(start + 100, bytes.count)]
            output += [0x04] + TestDER.length(chunk.count) + chunk
        }
        return output + [0x00, 0x00]
    }
}

/// Hand-made DER for inputs the minter would never write.
enum TestDER {
    static func length(_ count: Int) -> [UInt8] {
        if count < 0x80 { return [UInt8(count)] }
        var bytes: [UInt8] = []
        var rest = count
        while rest > 0 {
            bytes.insert(UInt8(rest & 0xFF), at: 0)
            rest >>= 8
        }
        return [0x80 | UInt8(bytes.count)] + bytes
    }

    static func element(_ tag: UInt8, _ content: [UInt8]) -> [UInt8] {
        [tag] + length(content.count) + content
    }

    static func integer(_ value: Int) -> [UInt8] {
        var bytes: [UInt8] = []
        var rest = value
        repeat {
            bytes.insert(UInt8(rest & 0xFF), at: 0)
            rest >>= 8
        } while rest > 0
        if bytes[0] >= 0x80 { bytes.insert(0, at: 0) }
        return element(0x02, bytes)
    }

    static func utf8(_ text: String) -> [UInt8] { element(0x0C, Array(text.utf8)) }
    static func ia5(_ text: String) -> [UInt8] { element(0x16, Array(text.utf8)) }
    static func set(_ elements: [[UInt8]]) -> [UInt8] { element(0x31, elements.flatMap { $0 }) }

    static func attribute(_ type: Int, _ value: [UInt8]) -> [UInt8] {
        element(0x30, integer(type) + integer(1) + element(0x04, value))
    }

    /// A PKCS#7 SignedData around `content`, with no certificates and no signers.
    static func signedData(content: [UInt8]) -> [UInt8] {
        let pkcs7: [UInt8] = [0x2A, 0x86, 0x48, 0x86, 0xF7, 0x0D, 0x01, 0x07]
        let encapsulated = element(0x30, element(0x06, pkcs7 + [0x01]) + element(0xA0, element(0x04, content)))
        let signed = element(0x30, integer(1) + element(0x31, []) + encapsulated + element(0x31, []))
        return element(0x30, element(0x06, pkcs7 + [0x02]) + element(0xA0, signed))
    }
}
