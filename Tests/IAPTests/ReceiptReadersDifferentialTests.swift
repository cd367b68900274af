import AppStore
import FakeAppStore
import Foundation
@testable import LedgerTestSupport
import Testing

/// A receipt is read twice: the signature check verifies the content SwiftASN1's BER reader finds
/// signed (`ReceiptSignature.signedContent`), and the purchases are read from the content our
/// own reader finds (`AppReceiptParser.signedContent`). Were the two ever to see different
/// content in one input, a genuine signature over one would vouch for the other's purchases.
/// Differential fuzzing: genuine receipts (the App Store's, and the fake's) re-encoded in every
/// way BER allows (long-form and non-minimal lengths, indefinite lengths, OCTET STRINGs cut into
/// nested chunks) and then changed at random bytes; wherever both readers read content they
/// must agree, and a receipt whose readers disagree is never valid. No broker, store or Apple.
@Suite("The two receipt readers agree on what is signed")
struct ReceiptReadersDifferentialTests {
    /// One BER element as read: its identifier octets, and its content octets or its children;
    /// `raw`, its bytes as read.
    indirect enum Element {
        case primitive(identifier: [UInt8], content: [UInt8], raw: [UInt8])
        case constructed(identifier: [UInt8], children: [Element], raw: [UInt8])

        var raw: [UInt8] {
            switch self {
            case .primitive(_, _, let raw), .constructed(_, _, let raw): raw
            }
        }
    }

    /// Reads `bytes[at...]` as one element (definite or indefinite length); nil where it is no BER.
    static func read(_ bytes: [UInt8], at start: Int) -> (Element, end: Int)? {
        var at = start
        guard at < bytes.count else { return nil }
        var identifier = [bytes[at]]
        let constructed = bytes[at] & 0x20 != 0
        if bytes[at] & 0x1F == 0x1F {
            repeat {
                at += 1
                guard at < bytes.count, identifier.count < 6 else { return nil }
                identifier.append(bytes[at])
            } while bytes[at] & 0x80 != 0
        }
        at += 1
        guard at < bytes.count else { return nil }
        let first = bytes[at]
        at += 1
        var length: Int?
        if first & 0x80 == 0 {
            length = Int(first)
        } else if first != 0x80 {
            let count = Int(first & 0x7F)
            guard count <= 4, at + count <= bytes.count else { return nil }
            length = bytes[at..<(at + count)].reduce(0) { $0 << 8 | Int($1) }
            at += count
        }
        if let length {
            guard at + length <= bytes.count else { return nil }
            guard constructed else {
                return (.primitive(identifier: identifier, content: Array(bytes[at..<(at + length)]), raw: Array(bytes[start..<(at + length)])), at + length)
            }
            var children: [Element] = []
            var next = at
            while next < at + length {
                guard let (child, end) = read(bytes, at: next), end <= at + length else { return nil }
                children.append(child)
                next = end
            }
            return (.constructed(identifier: identifier, children: children, raw: Array(bytes[start..<(at + length)])), at + length)
        }
        guard constructed else { return nil }
        var children: [Element] = []
        var next = at
        while true {
            guard next + 1 < bytes.count else { return nil }
            if bytes[next] == 0, bytes[next + 1] == 0 {
                return (.constructed(identifier: identifier, children: children, raw: Array(bytes[start..<(next + 2)])), next + 2)
            }
            guard let (child, end) = read(bytes, at: next) else { return nil }
            children.append(child)
            next = end
        }
    }

    /// Writes `element` back, each choice BER allows drawn from `random`; at `depth` 2 (the
    /// SignedData) the certificates and signer infos stay as they were (they are signed as DER).
    static func write(_ element: Element, _ random: inout ModelRandom, into out: inout [UInt8], depth: Int = 0) {
        func length(_ count: Int) {
            // DER's length, or the long form where DER takes the short one, with a leading zero
            // octet now and then (BER allows both).
            let minimal = TestDER.length(count)
            guard random.below(4) == 0 || random.below(3) == 0 else {
                out.append(contentsOf: minimal)
                return
            }
            var octets = count < 0x80 ? minimal : Array(minimal.dropFirst())
            if random.below(3) == 0 { octets.insert(0, at: 0) }
            out.append(0x80 | UInt8(octets.count))
            out.append(contentsOf: octets)
        }
        switch element {
        case .primitive(let identifier, let content, _):
            // An OCTET STRING may be cut into chunks: a constructed OCTET STRING of them.
            if identifier == [0x04], content.count > 1, random.below(3) == 0 {
                let cut = 1 + random.below(content.count - 1)
                let chunks: [Element] = [
                    .primitive(identifier: [0x04], content: Array(content[..<cut]), raw: []),
                    .primitive(identifier: [0x04], content: Array(content[cut...]), raw: []),
                ]
                write(.constructed(identifier: [0x24], children: chunks, raw: []), &random, into: &out, depth: depth)
                return
            }
            out.append(contentsOf: identifier)
            length(content.count)
            out.append(contentsOf: content)
        case .constructed(let identifier, let children, _):
            out.append(contentsOf: identifier)
            var inner: [UInt8] = []
            for (index, child) in children.enumerated() {
                if depth == 2, index >= 3 {
                    inner.append(contentsOf: child.raw)
                } else {
                    write(child, &random, into: &inner, depth: depth + 1)
                }
            }
            if random.below(4) == 0 {
                out.append(0x80)
                out.append(contentsOf: inner)
                out.append(contentsOf: [0, 0])
            } else {
                length(inner.count)
                out.append(contentsOf: inner)
            }
        }
    }

    /// What the fuzzing saw.
    struct Tally {
        var variants = 0
        var bothRead = 0
        var valid = 0
        var disagreements = 0
    }

    /// `variants` re-encodings of `receipt` (every third changed at a random byte besides),
    /// checked by `checker`.
    static func fuzz(_ receipt: [UInt8], variants: Int, seed: UInt64, checker: ReceiptSignature) async throws -> Tally {
        let (tree, end) = try #require(read(receipt, at: 0), "the receipt is no BER")
        #expect(end == receipt.count)
        var random = ModelRandom(seed: seed)
        var tally = Tally()
        for index in 0..<variants {
            var variant: [UInt8] = []
            write(tree, &random, into: &variant)
            if index % 3 == 2 { variant[random.below(variant.count)] ^= UInt8(1 + random.below(255)) }
            tally.variants += 1
            let ours = try? AppReceiptParser.signedContent(variant)
            let signed = ReceiptSignature.signedContent(variant)
            let verdict = await checker.check(variant)
            if let ours, let signed {
                tally.bothRead += 1
                if ours != signed {
                    tally.disagreements += 1
                    #expect(!verdict.isValid, "variant \(index) of seed \(seed): the readers disagree and the receipt is still valid")
                }
            }
            if verdict.isValid {
                tally.valid += 1
                #expect(ours != nil && ours == signed, "variant \(index) of seed \(seed) is valid, but the readers do not agree")
                let receipt = try? AppReceiptParser.parse(variant)
                #expect(receipt.map { $0.inApp.map(\.transactionId) } == verdict.transactionIds)
            }
        }
        return tally
    }

    @Test func theFakesReceiptsReEncodedAreReadAlikeOrRefused() async throws {
        let authority = try FakeCertificateAuthority.generate()
        let receipt = try ReceiptMinter(authority: authority).mint(AppReceiptTests.payload)
        let tally = try await Self.fuzz(receipt, variants: 600, seed: 0xD1FF, checker: ReceiptSignature(roots: [authority.root]))
        print("receipt readers, the fake's receipt: \(tally)")
        // Re-encodings that keep the content are still signed by it: the fuzzing reaches them.
        #expect(tally.valid > 50 && tally.bothRead > tally.valid, "\(tally)")
    }

    @Test(arguments: ReceiptSignatureTests.genuine.map(\.0))
    func theAppStoresReceiptsReEncodedAreReadAlikeOrRefused(_ name: String) async throws {
        let receipt = try ReceiptSignatureTests.fixture(name)
        let tally = try await Self.fuzz(receipt, variants: 150, seed: 0xD1FF ^ UInt64(name.utf8.count), checker: try ReceiptSignature())
        print("receipt readers, \(name): \(tally)")
        #expect(tally.valid > 10 && tally.bothRead > tally.valid, "\(name): \(tally)")
    }
}
