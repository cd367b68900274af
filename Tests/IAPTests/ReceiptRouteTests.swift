import AppStore
import Crypto
import FakeAppStore
import Foundation
import IAPCore
import OrderStore
import Ledger
import SwiftASN1
import Testing
import TestSupport
@_spi(CMS) import X509

extension BrokerTests {
    /// Every receipt route checks the receipt's PKCS#7 signature before anything it says
    /// counts: a receipt altered by one byte, or re-signed by another key, is never credited,
    /// and with `IAP_RECEIPTS_VIA=local` a genuine one is credited with Apple unreachable.
    @Suite("Receipts proven by their signature, on every route")
    struct ReceiptRouteTests {
        enum Route: String, CaseIterable, CustomStringConvertible {
            case verifyReceipt = "verify-receipt", serverAPI = "server-api", local
            var description: String { rawValue }
        }

        static func start(
            _ route: Route, name: String, xcodeCertificate: Certificate? = nil, otherApps: Set<String> = [],
            on backend: Backend = .sqlite
        ) async throws -> PipelineHarness {
            try await PipelineHarness.start(
                name: name, receiptsThroughServerAPI: route == .serverAPI, localReceipts: route == .local,
                xcodeCertificate: xcodeCertificate, otherApps: otherApps, on: backend)
        }

        /// The minted receipt with one byte of its signed content changed, and the same content
        /// signed by a key and chain of someone else's.
        static func forgeries(of purchase: PipelineHarness.Purchase) throws -> (altered: String, resigned: String) {
            var bytes = [UInt8](try #require(Data(base64Encoded: purchase.receiptData)))
            let id = Array(purchase.transactionId.utf8)
            let at = try #require((0..<(bytes.count - id.count)).first { Array(bytes[$0..<($0 + id.count)]) == id })
            bytes[at + id.count - 1] ^= 0x01
            let payload = ReceiptPayload(
                bundleId: PipelineHarness.bundleId, appVersion: "1", originalAppVersion: "1", opaqueValue: [1, 2, 3, 4],
                sha1Hash: Array(repeating: 7, count: 20), creationDate: Date(),
                inApp: [
                    InAppPurchasePayload(
                        productId: "com.example.coins.60", transactionId: purchase.transactionId, purchaseDate: Date())
                ])
            let stranger = try FakeCertificateAuthority.generate(name: "Not Apple")
            return (Data(bytes).base64EncodedString(), Data(try ReceiptMinter(authority: stranger).mint(payload)).base64EncodedString())
        }

        @Test(arguments: Route.allCases)
        func aReceiptAlteredByOneByteOrReSignedIsNeverCredited(_ route: Route) async throws {
            let pipeline = try await Self.start(route, name: "forged-\(route)")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            let (altered, resigned) = try Self.forgeries(of: purchase)
            // Re-signed by someone else's chain, which leads to no trusted root at any time: no
            // App Store receipt, refused at the door before it is stored (on every route).
            let refused = try await HTTP.post(
                pipeline.intakeURL + "/v1/receipts",
                json: ["userId": "mallory", "receiptData": resigned, "transactionId": purchase.transactionId])
            #expect(refused.status == 400 && refused.errorCode == "receipt_untrusted", "\(route): \(refused.text)")
            for (forged, what) in [(altered, "altered")] {
                let id = try await pipeline.upload(userId: "mallory", receiptData: forged, transactionId: purchase.transactionId)
                let status = try await pipeline.waitForState(id)
                #expect(status["state"] as? String != "credited", "\(route), \(what): \(status)")
                if what == "altered" || route != .verifyReceipt {
                    // Our own check, not Apple's word: the app is never told to finish on it.
                    // (On the verify-receipt route a re-signed receipt goes to Apple, which
                    // does not know it and says it is invalid.)
                    #expect(status["finishTransaction"] as? Bool == false, "\(route), \(what): \(status)")
                }
                if what == "altered" {
                    #expect(status["reason"] as? String == "receipt_signature_invalid", "\(route): \(status)")
                }
            }
            #expect(try await pipeline.store.grants(ofTransaction: purchase.transactionId).isEmpty)
            // The genuine receipt is still credited to its buyer.
            let genuine = try await pipeline.upload(userId: "ana", receiptData: purchase.receiptData, transactionId: purchase.transactionId)
            // On the Server API route too: signed and checked, the receipt proves its purchases
            // (before, what it listed was a lookup, held without a token).
            let answer = try await pipeline.waitForState(genuine)
            #expect(answer["state"] as? String == "credited", "\(route): \(answer)")
        }

        @Test(arguments: TestStore.backends)
        func aReceiptIsCreditedOfflineWithAppleUnreachable(_ backend: Backend) async throws {
            let pipeline = try await Self.start(.local, name: "offline", on: backend)
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            let before = try await HTTP.get(pipeline.fakeURL + "/fake/stats").json
            // Apple answers nothing but 503 from now on.
            try await pipeline.injectFault(["httpStatus": 503, "count": 0])
            let id = try await pipeline.upload(userId: "ana", receiptData: purchase.receiptData, transactionId: purchase.transactionId)
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            #expect(try await pipeline.grantState(of: purchase.transactionId, user: "ana") == "active")
            #expect(try await pipeline.store.grants(ofTransaction: purchase.transactionId).first?.environment == "Production")
            // A sandbox receipt says so (its type, `ProductionSandbox`): a sandbox purchase.
            let sandbox = try await pipeline.mint(environment: "Sandbox")
            let tester = try await pipeline.upload(userId: "tester", receiptData: sandbox.receiptData)
            #expect(try await pipeline.waitForState(tester)["state"] as? String == "credited")
            #expect(try await pipeline.store.grants(ofTransaction: sandbox.transactionId).first?.environment == "Sandbox")
            let after = try await HTTP.get(pipeline.fakeURL + "/fake/stats").json
            #expect(after["verifyReceiptCalls"] as? Int == before["verifyReceiptCalls"] as? Int, "Apple was asked")
        }
    
        /// A team's Xcode: a self-signed certificate marked for code signing (as Xcode's is) and
        /// a receipt of one purchase it signs, `Xcode` as its type.
        struct Xcode {
            let certificate: Certificate
            let key: Certificate.PrivateKey

            init() throws {
                let key = Certificate.PrivateKey(P256.Signing.PrivateKey())
                let name = try DistinguishedName { CommonName("StoreKit Testing in Xcode") }
                certificate = try Certificate(
                    version: .v3, serialNumber: .init(), publicKey: key.publicKey,
                    notValidBefore: Date(timeIntervalSinceNow: -86_400), notValidAfter: Date(timeIntervalSinceNow: 86_400 * 365),
                    issuer: name, subject: name, signatureAlgorithm: .ecdsaWithSHA256,
                    extensions: try Certificate.Extensions {
                        Critical(BasicConstraints.isCertificateAuthority(maxPathLength: nil))
                        Critical(KeyUsage(digitalSignature: true, keyCertSign: true))
                        Critical(try ExtendedKeyUsage([.codeSigning]))
                    },
                    issuerPrivateKey: key)
                self.key = key
            }

            func receipt(transactionId: String) throws -> String {
                let payload = ReceiptPayload(
                    receiptType: "Xcode", bundleId: PipelineHarness.bundleId, creationDate: Date(),
                    inApp: [
                        InAppPurchasePayload(
                            productId: "com.example.coins.60", transactionId: transactionId, purchaseDate: Date())
                    ])
                let signed = try CMS.sign(
                    try payload.derEncoded(), signatureAlgorithm: .ecdsaWithSHA256, certificate: certificate,
                    privateKey: key, signingTime: Date(), detached: false)
                return Data(signed).base64EncodedString()
            }
        }

        @Test(arguments: Route.allCases)
        func xcodesReceiptsAreRefusedInProductionOnEveryRoute(_ route: Route) async throws {
            // Xcode's own receipts (BER, its StoreKit certificate), of the apps they name, and one
            // signed as a team's Xcode does.
            let genuine = try ["xcode-2020.der", "xcode-2023.der"].map { try ReceiptSignatureTests.fixture($0) }
            let apps = try Set(genuine.map { try AppReceiptParser.parse($0).bundleId })
            let pipeline = try await Self.start(route, name: "xcode-\(route)", otherApps: apps)
            Teardown.add { await pipeline.stop() }
            let before = try await HTTP.get(pipeline.fakeURL + "/fake/stats").json
            let receipts = genuine.map { Data($0).base64EncodedString() } + [try Xcode().receipt(transactionId: "0")]
            for receipt in receipts {
                let id = try await pipeline.upload(userId: "dev", receiptData: receipt)
                let status = try await pipeline.waitForState(id)
                #expect(status["state"] as? String == "rejected", "\(route): \(status)")
                #expect(status["reason"] as? String == "xcode_receipt", "\(route): \(status)")
                // Our own check, not Apple's word: the app is not told to finish.
                #expect(status["finishTransaction"] as? Bool == false, "\(route): \(status)")
            }
            let after = try await HTTP.get(pipeline.fakeURL + "/fake/stats").json
            #expect(after["verifyReceiptCalls"] as? Int == before["verifyReceiptCalls"] as? Int, "Apple was asked")
        }

        @Test func withIAPEnvironmentXcodeAReceiptSignedByXcodesCertificateIsCreditedAsSandbox() async throws {
            let xcode = try Xcode()
            let pipeline = try await Self.start(.verifyReceipt, name: "xcode-on", xcodeCertificate: xcode.certificate)
            Teardown.add { await pipeline.stop() }
            let transactionId = "9\(Int.random(in: 100_000_000...999_999_999))"
            let id = try await pipeline.upload(userId: "dev", receiptData: try xcode.receipt(transactionId: transactionId))
            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "credited", "\(status)")
            #expect(try await pipeline.grantState(of: transactionId, user: "dev") == "active")
            let grant = try #require(try await pipeline.store.grants(ofTransaction: transactionId).first)
            #expect(grant.environment == "Sandbox", "an Xcode purchase is no real money")
            // Another machine's Xcode: its certificate is not the one configured.
            let other = try await pipeline.upload(userId: "dev", receiptData: try Xcode().receipt(transactionId: "0"))
            let held = try await pipeline.waitForState(other)
            #expect(held["state"] as? String == "needs_review" && held["reason"] as? String == "receipt_untrusted_chain", "\(held)")
        }
    }
}
