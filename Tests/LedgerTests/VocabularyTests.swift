import Foundation
import IAPCore
import Ledger
import Testing

/// The ledger's one vocabulary: the states it records, the shapes the store reads rows into and
/// the API encodes, and the answers that follow a grant after its upload was answered.
@Suite("Vocabulary")
struct VocabularyTests {
    static let t0 = Date(timeIntervalSince1970: 1_800_000_000)

    func grant(active: Bool = true, source: GrantSource = .apple, revokedBy: GrantRevoker? = nil) -> Grant {
        Grant(
            id: 7, transactionId: "t1", userId: "ana", productId: "coins", orderId: "o1", quantity: 2,
            grantJSON: #"{"coins":120}"#, environment: "Production", source: source, isActive: active, grantedAt: Self.t0,
            revokedAt: active ? nil : Self.t0 + 60, revokedBy: revokedBy, creditKey: .transaction("t1"),
            originalTransactionId: "t1", expiresAt: nil, gracePeriodExpiresAt: nil)
    }

    func json(_ value: some Encodable) throws -> [String: Any] {
        let encoder = JSONEncoder()
        encoder.dateEncodingStrategy = .iso8601
        return try #require(JSONSerialization.jsonObject(with: encoder.encode(value)) as? [String: Any])
    }

    @Test func theStatesAreTheirStoredAndShownRawValues() {
        #expect(SubscriptionState.allCases.map(\.rawValue) == ["active", "expired", "billing_retry", "grace_period", "revoked"])
        #expect(OrderState.allCases.map(\.rawValue) == ["created", "paid", "cancelled", "refunded"])
        #expect("\(SubscriptionState.billingRetry) \(GrantRevoker.transfer)" == "billing_retry transfer")
        #expect((1...5).compactMap(SubscriptionState.init(appleStatus:)) == SubscriptionState.allCases)
        #expect(SubscriptionState(appleStatus: 0) == nil && SubscriptionState(appleStatus: 6) == nil)
        // Only Apple and a restore stand for themselves; every admin's name is `admin`.
        #expect(GrantRevoker(actor: "apple") == .apple && GrantRevoker(actor: "transfer") == .transfer)
        #expect(GrantRevoker(actor: "Olga (operator)") == .admin)
    }

    @Test func aGrantIsEncodedAsTheAppReadsIt() throws {
        let body = try json(grant())
        #expect(Set(body.keys) == ["transactionId", "productId", "orderId", "quantity", "grant", "state", "environment", "source", "grantedAt"])
        #expect(body["state"] as? String == "active" && body["source"] as? String == "apple")
        #expect((body["grant"] as? [String: Any])?["coins"] as? Int == 120)
        #expect(try json(grant(active: false, revokedBy: .admin))["state"] as? String == "revoked")
    }

    @Test func anOrderIsEncodedUnderItsOrderId() throws {
        let order = Order(id: "o1", userId: "ana", productId: "coins", state: .paid, transactionId: "t1", createdAt: Self.t0)
        let body = try json(order)
        #expect(body["orderId"] as? String == "o1" && body["id"] == nil && body["state"] as? String == "paid")
        #expect(body["updatedAt"] as? String == body["createdAt"] as? String)
    }

    @Test func entitlementsHoldWhatIsInForceAndSumConsumablesWithoutOverflow() {
        var month = grant()
        month.transactionId = "t2"
        month.productId = "month"
        month.expiresAt = Self.t0 - 1
        var big = grant()
        big.grantJSON = #"{"coins":\#(Int.max)}"#
        let catalog = Catalog(products: [
            .init(productId: "coins", type: .consumable, grant: ["coins": .number(60)]),
            .init(productId: "month", type: .autoRenewable, grant: ["tier": .name("premium")]),
        ])
        let entitlements = Entitlements(
            grants: [grant(), big, month, grant(active: false)], subscriptions: [], catalog: catalog, at: Self.t0)
        #expect(entitlements.grants.map(\.transactionId) == ["t1", "t1"])
        #expect(entitlements.balances == ["coins": Int.max])
    }

    @Test func anAnswerFollowsItsGrantAfterTheUploadWasAnswered() {
        // Held, then granted by customer service or restored by Apple's reversal.
        #expect(LaterEvents.answer(.held, grant: grant(source: .manual)) == .credited(by: .manual))
        #expect(LaterEvents.answer(.revoked, grant: grant()) == .credited(by: .apple))
        // Credited, then taken back: by Apple, or by customer service or a restore elsewhere.
        #expect(LaterEvents.answer(.credited, grant: grant(active: false, revokedBy: .apple)) == .revoked(.purchaseRevoked))
        #expect(LaterEvents.answer(.alreadyCredited, grant: grant(active: false, revokedBy: .transfer)) == .revoked(.revokedByCustomerService))
        // Answers that stand.
        #expect(LaterEvents.answer(.credited, grant: grant()) == nil)
        #expect(LaterEvents.answer(.held, grant: grant(active: false)) == nil)
        #expect(LaterEvents.answer(.ownedByOtherUser, grant: grant()) == nil)
    }

    @Test func reconciliationCorrectedWhatItCreditedRevokedRestoredOrMoved() {
        for outcome in ["credited", "revoked", "restored"] {
            #expect(ReconciliationChoice.corrected(outcome: outcome, subscriptionChanged: false), "\(outcome)")
        }
        for outcome in ["unchanged", "already_credited", "credited (owner_unknown)", "", "billing_retry"] {
            #expect(!ReconciliationChoice.corrected(outcome: outcome, subscriptionChanged: false), "\(outcome)")
        }
        #expect(ReconciliationChoice.corrected(outcome: "unchanged", subscriptionChanged: true))
    }
}
