import AppStore
import FakeAppStore
import Foundation
import Testing
import X509

/// An app receipt's PKCS#7 signature checked offline: no broker, no store, no Apple.
@Suite("Receipts checked by their signature")
struct ReceiptSignatureTests {
    let authority: FakeCertificateAuthority
    let receipt: [UInt8]

    init() throws {
        authority = try FakeCertificateAuthority.generate()
        receipt = try ReceiptMinter(authority: authority).mint(AppReceiptTests.payload)
    }

    @Test func aReceiptSignedUnderATrustedChainIsValidAndSaysWhatItHolds() async throws {
        let verdict = await ReceiptSignature(roots: [authority.root]).check(receipt)
        #expect(verdict.isValid, "\(verdict.reason ?? "")")
        #expect(verdict.digestAlgorithm == "SHA-256")
        #expect(verdict.bundleId == AppReceiptTests.payload.bundleId)
        #expect(verdict.transactionIds.first == "2000000000000001")
        #expect(verdict.judgedAt == AppReceiptTests.payload.creationDate)
        #expect(verdict.chain.count == 3 && verdict.chain.first?.subject.contains("Receipt Signing") == true)
        // Again, and another receipt of the same chain: the chain known, the signature alone is
        // checked, with the same verdict; a changed byte is still caught.
        let checker = ReceiptSignature(roots: [authority.root])
        var other = AppReceiptTests.payload
        other.inApp = Array(other.inApp.prefix(1))
        let second = try ReceiptMinter(authority: authority).mint(other)
        for bytes in [receipt, receipt, second] {
            let again = await checker.check(bytes)
            #expect(again.isValid, "\(again.reason ?? "")")
        }
        var altered = second
        altered[altered.count - 1] ^= 0x01
        #expect(await checker.check(altered).result == "invalid")
    }

    @Test func oneByteChangedAnywhereIsRefused() async throws {
        let signature = ReceiptSignature(roots: [authority.root])
        // In the signed content (the bundle id), and in the signature itself (the last byte).
        let bundle = Array(AppReceiptTests.payload.bundleId.utf8)
        let at = try #require((0..<(receipt.count - bundle.count)).first { Array(receipt[$0..<($0 + bundle.count)]) == bundle })
        for index in [at + 2, receipt.count - 1] {
            var altered = receipt
            altered[index] ^= 0x01
            let verdict = await signature.check(altered)
            #expect(verdict.result == "invalid", "byte \(index): \(verdict.result) \(verdict.reason ?? "")")
        }
        #expect(await signature.check(receipt).isValid, "the genuine one still passes after the cache saw forgeries")
    }

    @Test func whatThisReaderCannotCheckProvesNothingEitherWay() async throws {
        // Cut short, or not a receipt at all: unchecked, never "invalid" (which would reject a
        // purchase on our reader's word); the routes send such a receipt to Apple or to a person.
        let signature = ReceiptSignature(roots: [authority.root])
        for bytes in [Array(receipt.prefix(receipt.count / 2)), [0x30, 0x03, 0x02, 0x01, 0x00]] {
            let verdict = await signature.check(bytes)
            #expect(verdict.result == "unchecked", "\(verdict.result) \(verdict.reason ?? "")")
        }
    }

    @Test func aReceiptReSignedByAnotherKeyOrAgainstAppleIsNotTrusted() async throws {
        let stranger = try FakeCertificateAuthority.generate(name: "Not Apple")
        let resigned = try ReceiptMinter(authority: stranger).mint(AppReceiptTests.payload)
        let verdict = await ReceiptSignature(roots: [authority.root]).check(resigned)
        #expect(verdict.result == "untrusted", "\(verdict.result) \(verdict.reason ?? "")")
        // Apple's roots, shipped: the fake's own chain is no Apple chain.
        let apple = try ReceiptSignature()
        #expect(await apple.check(receipt).result == "untrusted")
        // A chain judged at the receipt's creation date: one made after its leaf expired fails.
        let expired = try FakeCertificateAuthority.generate(leafNotAfter: Date(timeIntervalSinceNow: -86_400 * 400))
        let late = try ReceiptMinter(authority: expired).mint(AppReceiptTests.payload)
        #expect(await ReceiptSignature(roots: [expired.root]).check(late).result == "untrusted")
    }
}
