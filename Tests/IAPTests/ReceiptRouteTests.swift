import AppStore
import FakeAppStore
import Foundation
import IAPCore
import OrderStore
import Testing

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

        static func start(_ route: Route, name: String, on backend: Backend = .sqlite) async throws -> PipelineHarness {
            try await PipelineHarness.start(
                name: name, receiptsThroughServerAPI: route == .serverAPI, localReceipts: route == .local, on: backend)
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
            for (forged, what) in [(altered, "altered"), (resigned, "re-signed")] {
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
            let after = try await HTTP.get(pipeline.fakeURL + "/fake/stats").json
            #expect(after["verifyReceiptCalls"] as? Int == before["verifyReceiptCalls"] as? Int, "Apple was asked")
        }
    }
}
