import AppStore
import FakeAppStore
import Foundation
import SwiftASN1
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

    /// The intermediates that issue receipt-signing certificates issue every developer's
    /// code-signing certificate too: only a leaf with Apple's receipt-signing marker, under
    /// intermediates with Apple's intermediate marker, signs a receipt.
    @Test func aCertificateOfTheRightChainThatIsNoReceiptSignerIsNotTrusted() async throws {
        for (leafMarker, intermediateMarker) in [(false, true), (true, false)] {
            let authority = try FakeCertificateAuthority.generate(leafMarker: leafMarker, intermediateMarker: intermediateMarker)
            let forged = try ReceiptMinter(authority: authority).mint(AppReceiptTests.payload)
            let verdict = await ReceiptSignature(roots: [authority.root]).check(forged)
            #expect(verdict.result == "untrusted", "leaf marker \(leafMarker), intermediate marker \(intermediateMarker): \(verdict.result) \(verdict.reason ?? "")")
        }
    }

    /// A known signer is checked by its key alone only inside the window its chain is valid
    /// in: a receipt made after its leaf expired is judged the whole way, and not trusted.
    @Test func aKnownSignerIsTrustedOnlyInsideItsChainsWindow() async throws {
        let authority = try FakeCertificateAuthority.generate(leafNotAfter: Date(timeIntervalSinceNow: 86_400))
        let checker = ReceiptSignature(roots: [authority.root])
        var payload = AppReceiptTests.payload
        payload.creationDate = Date()
        #expect(await checker.check(try ReceiptMinter(authority: authority).mint(payload)).isValid)
        payload.creationDate = Date(timeIntervalSinceNow: 3 * 86_400)
        let late = await checker.check(try ReceiptMinter(authority: authority).mint(payload))
        #expect(late.result == "untrusted", "\(late.result) \(late.reason ?? "")")
    }

    @Test func aReceiptReSignedByAnotherKeyOrAgainstAppleIsNotTrusted() async throws {
        let stranger = try FakeCertificateAuthority.generate(name: "Not Apple")
        let resigned = try ReceiptMinter(authority: stranger).mint(AppReceiptTests.payload)
        let checker = ReceiptSignature(roots: [authority.root])
        let verdict = await checker.check(resigned)
        #expect(verdict.result == "untrusted", "\(verdict.result) \(verdict.reason ?? "")")
        // Certificates that name no trusted root are told from their names, before (and
        // without) a validation of the chain for each receipt: a verifier that sees many
        // such receipts pays a hash for each, not two P-384 checks.
        #expect(verdict.reason == "the receipt's certificates lead to no trusted receipt root", "\(verdict.reason ?? "")")
        #expect(await checker.check(resigned).reason == verdict.reason)
        // Apple's roots, shipped: the fake's own chain is no Apple chain.
        let apple = try ReceiptSignature()
        #expect(await apple.check(receipt).result == "untrusted")
        // A chain judged at the receipt's creation date: one made after its leaf expired fails
        // (its names lead to the trusted root: validated, and refused by the validation).
        let expired = try FakeCertificateAuthority.generate(leafNotAfter: Date(timeIntervalSinceNow: -86_400 * 400))
        let late = await ReceiptSignature(roots: [expired.root]).check(try ReceiptMinter(authority: expired).mint(AppReceiptTests.payload))
        #expect(late.result == "untrusted" && late.reason?.hasPrefix("the signer's chain ends in no trusted receipt chain") == true, "\(late.reason ?? "")")
    }
}

/// Receipts the App Store really signed, and Xcode's, as published by open-source receipt
/// readers (`Fixtures/receipts`, its README says where each comes from): the shapes our own
/// fake does not make (certificates out of DER's order, `rsaEncryption`, SHA-1 chains, BER).
extension ReceiptSignatureTests {
    static let fixtures = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Fixtures/receipts")

    static func fixture(_ name: String) throws -> [UInt8] {
        [UInt8](try Data(contentsOf: fixtures.appendingPathComponent(name)))
    }

    /// Each genuine receipt with its digest algorithm and its type (attribute 0).
    static let genuine: [(String, String, String)] = [
        ("production-2015-sha1.der", "SHA-1", "Production"),
        ("sandbox-2020-sha1.der", "SHA-1", "ProductionSandbox"),
        ("sandbox-2023-sha1-g7.der", "SHA-1", "ProductionSandbox"),
        ("production-2024-sha256.der", "SHA-256", "Production"),
        ("sandbox-2025-sha256.der", "SHA-256", "ProductionSandbox"),
    ]

    /// The same bytes with one byte of the bundle id changed.
    static func altered(_ bytes: [UInt8], bundleId: String) throws -> [UInt8] {
        let id = Array(bundleId.utf8)
        let at = try #require((0..<(bytes.count - id.count)).first { Array(bytes[$0..<($0 + id.count)]) == id })
        var altered = bytes
        altered[at + 1] ^= 0x01
        return altered
    }

    @Test(arguments: genuine)
    func aGenuineReceiptIsValidUpToAppleIncRootAtItsCreationDate(_ name: String, _ digest: String, _ type: String) async throws {
        let bytes = try Self.fixture(name)
        let receipt = try AppReceiptParser.parse(bytes)
        #expect(receipt.receiptType == type)
        let checker = try ReceiptSignature()
        let verdict = await checker.check(bytes)
        #expect(verdict.result == "valid", "\(name): \(verdict.reason ?? "")")
        #expect(verdict.digestAlgorithm == digest)
        #expect(verdict.judgedAt == receipt.creationDate)
        #expect(verdict.chain.count == 3)
        #expect(verdict.chain.last?.subject.contains("CN=Apple Root CA,") == true, "\(verdict.chain.map(\.subject))")
        // Known now: the signer's key alone checks the next one, and still catches a change.
        #expect(await checker.check(bytes).isValid)
        let altered = try Self.altered(bytes, bundleId: receipt.bundleId)
        #expect(await checker.check(altered).result == "invalid", "\(name)")
        #expect(await (try ReceiptSignature()).check(altered).result == "invalid", "\(name), the whole way")
        // Apple Root CA - G3 did not sign the receipt chain.
        #expect(await ReceiptSignature(roots: [try AppleRoot.g3()]).check(bytes).result == "untrusted")
    }

    @Test(arguments: ["xcode-2020.der", "xcode-2023.der"])
    func xcodesReceiptIsSignedByXcodesCertificateAndByNoAppleRoot(_ name: String) async throws {
        let bytes = try Self.fixture(name)
        let receipt = try AppReceiptParser.parse(bytes)
        #expect(receipt.isXcode && !receipt.isSandbox)
        let apple = await (try ReceiptSignature()).check(bytes)
        #expect(apple.result == "untrusted", "\(apple.reason ?? "")")
        let xcode = ReceiptSignature(xcodeCertificate: try Certificate(derEncoded: try Self.fixture("xcode-storekit-testing.der")))
        let verdict = await xcode.check(bytes)
        #expect(verdict.result == "valid", "\(verdict.reason ?? "")")
        #expect(await xcode.check(try Self.altered(bytes, bundleId: receipt.bundleId)).result == "invalid")
    }
}
