import Foundation
import NIOHTTP1
import IAPCore
import OrderStore
import Testing

extension BrokerTests {
    /// Customer service binds a subscription to another user (Apple's Set App Account Token
    /// names an order of theirs): its next renewal goes to that user, through the real pipeline.
    @Suite("Customer service binds a purchase")
    struct BindPurchaseTests {
        @Test(arguments: TestStore.backends)
        func aBoundSubscriptionsNextRenewalGoesToTheBoundUser(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "bind", on: backend)
            Teardown.add { await pipeline.stop() }
            let bought = try await pipeline.mintStoreKit2(productId: "com.example.vip.month", type: "auto_renewable")
            let id = try await pipeline.upload(["userId": "ana", "signedTransaction": try #require(bought.signedTransaction)])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            let original = bought.originalTransactionId

            let bind = "/v1/admin/subscriptions/\(original)/bind"
            #expect(
                try await pipeline.admin(.POST, "/v1/admin/subscriptions/2000000000000001/bind", ["userId": "bea", "reason": "x"])
                    .errorCode == "purchase_not_found")
            #expect(try await pipeline.admin(.POST, bind, ["userId": "bea"]).errorCode == "missing_field", "a reason is required")
            #expect(try await pipeline.admin(.POST, bind, ["userId": "ana", "reason": "x"]).errorCode == "conflict")
            let bound = try await pipeline.admin(.POST, bind, ["userId": "bea", "reason": "bought as a gift for bea"])
            #expect(bound.status == 200, "\(bound.text)")
            let token = try #require(bound.json["appAccountToken"] as? String)
            #expect(try await pipeline.store.order(token)?.userId == "bea")

            // Apple holds the new token: the next period carries it, and is bea's.
            let renewal = try await HTTP.post(pipeline.fakeURL + "/fake/subscriptions/\(original)/renew", json: [String: String]())
            let renewed = try #require(renewal.json["transactionId"] as? String, "\(renewal.text)")
            let signed = try #require(renewal.json["signedTransaction"] as? String)
            let payload = try #require(jwsPayload(signed))
            #expect(payload["appAccountToken"] as? String == token)
            let credited = try await eventually(timeout: .seconds(30)) {
                try await pipeline.grantState(of: renewed, user: "bea") == "active"
            }
            #expect(credited, "the renewal did not go to the bound user")
            #expect(try await pipeline.grantState(of: renewed, user: "ana") == nil)
            #expect(try await pipeline.grantState(of: bought.transactionId, user: "ana") == "active", "the period paid before stays")
            let audit = try await pipeline.store.auditLog(limit: 100).filter { $0.action == "purchase_bound" }
            #expect(audit.map(\.subject) == ["subscription:\(original)"] && audit.first?.actor == "admin")
        }
    }
}
