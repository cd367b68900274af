import AppStore
import Crypto
import FakeAppStore
import Foundation
import Testing
import X509

@Suite("StoreKit 2 signed data")
struct SignedDataTests {
    static let authority = try! FakeCertificateAuthority.generate()

    static func transaction(
        bundleId: String = PipelineHarness.bundleId, environment: String = "Production", signedAt: Date = Date()
    ) -> JWSTransactionDecodedPayload {
        JWSTransactionDecodedPayload(
            transactionId: "2000000000000001", originalTransactionId: "2000000000000001", bundleId: bundleId,
            productId: "com.example.coins.60", environment: environment, purchaseDate: signedAt.appleMilliseconds,
            quantity: 1, type: "Consumable", signedDate: signedAt.appleMilliseconds)
    }

    static func verifier(trusting root: Certificate = authority.root) -> SignedDataVerifier {
        SignedDataVerifier(settings: .init(trustedRoots: [root], bundleIds: [PipelineHarness.bundleId]))
    }

    func code(_ verifier: SignedDataVerifier, _ jws: String) async -> JWSVerificationError.Code? {
        do {
            _ = try await verifier.verifyTransaction(jws)
            return nil
        } catch {
            return error.code
        }
    }

    @Test func aTransactionSignedLikeApplesVerifiesAndDecodes() async throws {
        let jws = try Self.authority.signJWS(Self.transaction())
        let verifier = Self.verifier()
        let payload = try await verifier.verifyTransaction(jws)
        #expect(payload == Self.transaction(signedAt: Date(appleMilliseconds: payload.signedDate!)))
        #expect(payload.transactionId == "2000000000000001")
        // Again, from the chain cache: the same answer, and the signature is still checked.
        #expect(try await verifier.verifyTransaction(jws).productId == "com.example.coins.60")
        let parts = jws.split(separator: ".")
        let otherSignature = try Self.authority.signJWS(Self.transaction(bundleId: PipelineHarness.bundleId, signedAt: Date(timeIntervalSince1970: 1_800_000_000)))
            .split(separator: ".")[2]
        #expect(await code(verifier, "\(parts[0]).\(parts[1]).\(otherSignature)") == .invalidSignature)
    }

    @Test func eachForgeryIsRefusedWithItsOwnCode() async throws {
        let verifier = Self.verifier()
        let good = try Self.authority.signJWS(Self.transaction()).split(separator: ".").map(String.init)

        // A tampered payload under the original signature.
        var tampered = Self.transaction()
        tampered.productId = "com.example.coins.300"
        let tamperedPayload = try Base64URL.encode(JSONEncoder().encode(tampered))
        #expect(await code(verifier, [good[0], tamperedPayload, good[2]].joined(separator: ".")) == .invalidSignature)

        // alg none, and HS256 keyed with anything, keeping Apple's chain in x5c.
        let headerBytes = try #require(Base64URL.decode(good[0].utf8))
        let header = try #require(try JSONSerialization.jsonObject(with: headerBytes) as? [String: Any])
        for alg in ["none", "HS256", "ES384"] {
            var forged = header
            forged["alg"] = alg
            let encoded = Base64URL.encode(try JSONSerialization.data(withJSONObject: forged))
            let mac = HMAC<SHA256>.authenticationCode(for: Data("\(encoded).\(good[1])".utf8), using: SymmetricKey(size: .bits256))
            #expect(await code(verifier, "\(encoded).\(good[1]).\(Base64URL.encode(Data(mac)))") == .unsupportedAlgorithm, "\(alg)")
            #expect(await code(verifier, "\(encoded).\(good[1]).") != nil, "\(alg)")
        }

        // A chain that leads to another root.
        let stranger = try FakeCertificateAuthority.generate(name: "Somebody Else")
        #expect(await code(verifier, try stranger.signJWS(Self.transaction())) == .untrustedChain)
        // The right names but without Apple's marker extensions.
        let noLeafMarker = try FakeCertificateAuthority.generate(leafMarker: false)
        #expect(await code(Self.verifier(trusting: noLeafMarker.root), try noLeafMarker.signJWS(Self.transaction())) == .missingAppleExtension)
        let noIntermediateMarker = try FakeCertificateAuthority.generate(intermediateMarker: false)
        #expect(
            await code(Self.verifier(trusting: noIntermediateMarker.root), try noIntermediateMarker.signJWS(Self.transaction()))
                == .missingAppleExtension)
        // A leaf that had expired when the payload was signed.
        let expired = try FakeCertificateAuthority.generate(leafNotAfter: Date().addingTimeInterval(-86_400))
        #expect(await code(Self.verifier(trusting: expired.root), try expired.signJWS(Self.transaction())) == .certificateExpired)
        // ...while one signed when the leaf was valid still verifies (validation at signedDate).
        let signedBefore = Self.transaction(signedAt: Date().addingTimeInterval(-2 * 86_400 + 3600))
        #expect(await code(Self.verifier(trusting: expired.root), try expired.signJWS(signedBefore)) == nil)
        // Signed for another app, or for Xcode's local testing.
        #expect(await code(verifier, try Self.authority.signJWS(Self.transaction(bundleId: "com.other.app"))) == .bundleIdMismatch)
        #expect(await code(verifier, try Self.authority.signJWS(Self.transaction(environment: "Xcode"))) == .environmentMismatch)
        // Not a JWS at all; a chain of two.
        for junk in ["", "a.b", "a.b.c", "...", String(repeating: "x", count: 5000)] {
            #expect(await code(verifier, junk) == .malformed, "\(junk.prefix(10))")
        }
        var short = header
        short["x5c"] = Array((header["x5c"] as? [String] ?? []).prefix(2))
        let shortHeader = Base64URL.encode(try JSONSerialization.data(withJSONObject: short))
        #expect(await code(verifier, "\(shortHeader).\(good[1]).\(good[2])") == .invalidChainLength)
    }

    /// A notification about the app rather than a purchase (`RESCIND_CONSENT`) names the app in
    /// `appData`, with the customer's signed `AppTransaction`; one that names no app at all is
    /// refused, as Apple's library refuses it.
    @Test func aNotificationNamesItsAppInDataOrAppData() async throws {
        let verifier = Self.verifier()
        let now = Date().appleMilliseconds
        func app(bundleId: String, receiptType: String = "Production") throws -> String {
            try Self.authority.signJWS(
                AppTransactionDecodedPayload(
                    appTransactionId: "704289572311258430", bundleId: bundleId, appAppleId: nil, receiptType: receiptType,
                    originalPurchaseDate: now - 86_400_000, signedDate: now))
        }
        func notification(_ appData: ResponseBodyV2DecodedPayload.AppData?) throws -> String {
            try Self.authority.signJWS(
                ResponseBodyV2DecodedPayload(
                    notificationType: "RESCIND_CONSENT", subtype: nil, notificationUUID: UUID().uuidString, data: nil,
                    signedDate: now, appData: appData))
        }
        let ours = ResponseBodyV2DecodedPayload.AppData(
            appAppleId: nil, bundleId: PipelineHarness.bundleId, environment: "Production",
            signedAppTransactionInfo: try app(bundleId: PipelineHarness.bundleId))
        let decoded = try await verifier.verifyNotification(try notification(ours))
        #expect(decoded.appData?.bundleId == PipelineHarness.bundleId && decoded.data == nil)
        let transaction = try await verifier.verifyAppTransaction(try #require(decoded.appData?.signedAppTransactionInfo))
        #expect(transaction.appTransactionId == "704289572311258430")
        func refusal(_ jws: String) async -> JWSVerificationError.Code? {
            do {
                _ = try await verifier.verifyNotification(jws)
                return nil
            } catch {
                return error.code
            }
        }
        #expect(await refusal(try notification(nil)) == .bundleIdMismatch)
        var otherApp = ours
        otherApp.bundleId = "com.other.app"
        #expect(await refusal(try notification(otherApp)) == .bundleIdMismatch)
        var noEnvironment = ours
        noEnvironment.environment = nil
        #expect(await refusal(try notification(noEnvironment)) == .environmentMismatch)
        let xcode = try app(bundleId: PipelineHarness.bundleId, receiptType: "Xcode")
        do {
            _ = try await verifier.verifyAppTransaction(xcode)
            Issue.record("an AppTransaction for Xcode's environment verified")
        } catch {
            #expect(error.code == .environmentMismatch)
        }
    }

    @Test func appleRootCAG3ShipsWithItsPublishedFingerprint() async throws {
        let der = try AppleRoot.g3DER()
        #expect(SHA256.hash(data: der).map { String(format: "%02X", $0) }.joined(separator: ":")
            == "63:34:3A:BF:B8:9A:6A:03:EB:B5:7E:9B:3F:5F:A7:BE:7C:4F:5C:75:6F:30:17:B3:A8:C4:88:C3:65:3E:91:79")
        let root = try AppleRoot.g3()
        #expect(root.subject.description.contains("Apple Root CA - G3"))
        #expect(root.subject == root.issuer)
        // A chain of ours is not Apple's.
        let verifier = SignedDataVerifier(settings: .init(trustedRoots: [root], bundleIds: [PipelineHarness.bundleId]))
        #expect(await code(verifier, try Self.authority.signJWS(Self.transaction())) == .untrustedChain)
    }
}

extension SignedDataTests {
    /// Apple's real StoreKit signing chain (the WWDR G6 intermediate and a production signing
    /// leaf, public certificates found in any App Store JWS) validates up to the shipped root,
    /// at a time both were valid: the markers and key types we check are Apple's own.
    @Test func applesRealChainValidatesUpToAppleRootCAG3() async throws {
        let fixtures = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Fixtures")
        let leaf = try String(contentsOf: fixtures.appendingPathComponent("apple-signing-leaf.b64"), encoding: .utf8)
        let intermediate = try String(contentsOf: fixtures.appendingPathComponent("apple-wwdr-g6.b64"), encoding: .utf8)
        let root = Data(try AppleRoot.g3DER()).base64EncodedString()
        let x5c = [leaf, intermediate].map { $0.trimmingCharacters(in: .whitespacesAndNewlines) } + [root]
        let verifier = SignedDataVerifier(settings: .init(trustedRoots: [try AppleRoot.g3()], bundleIds: []))
        let october2025 = Date(timeIntervalSince1970: 1_761_962_975)
        let chain = try await verifier.validateChain(x5c, at: october2025)
        #expect(chain.notAfter == Date(timeIntervalSince1970: 1823449643))  // the leaf's end, 2027-10-13
        // Outside the leaf's validity, and against another root, it fails with its own code.
        await #expect(throws: JWSVerificationError(.certificateExpired, "")) {
            _ = try await verifier.validateChain(x5c, at: Date(timeIntervalSince1970: 1_900_000_000))
        }
        let ours = SignedDataVerifier(settings: .init(trustedRoots: [Self.authority.root], bundleIds: []))
        await #expect(throws: JWSVerificationError(.untrustedChain, "")) {
            _ = try await ours.validateChain(x5c, at: october2025)
        }
    }
}
