import Foundation
import IAPCore
import Messaging
import NIOConcurrencyHelpers
import OrderStore
import Ledger
import Testing
import TestSupport

extension BrokerTests {
    /// What a purchase cost and under which offer (Apple's `price` in milli-units, `currency`,
    /// `offerType`, `offerDiscountType`, `offerPeriod`, `billingPlanType`): decoded, kept, and
    /// carried in `grant.created` for the app's revenue, through the real pipeline.
    @Suite("What a purchase cost travels with its grant")
    struct PurchaseTermsTests {
        struct OfferMint: Encodable {
            var bundleId = PipelineHarness.bundleId
            var productId = "com.example.vip.month"
            var type = "auto_renewable"
            var price: Int64 = 4_990
            var currency = "EUR"
            var offerType = 1
            var offerIdentifier = "first-week"
            var offerDiscountType = "FREE_TRIAL"
            var offerPeriod = "P1W"
            var billingPlanType = "MONTHLY"
        }

        @Test(arguments: TestStore.backends)
        func priceAndOfferAreKeptAndCarriedInGrantCreated(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "terms", on: backend)
            Teardown.add { await pipeline.stop() }
            let events = try await GrantCreatedEvents.listen(pipeline, name: "revenue")
            let minted = try await HTTP.post(pipeline.fakeURL + "/fake/purchases", json: OfferMint())
            #expect(minted.status == 201, "\(minted.text)")
            let transactionId = try #require(minted.json["transactionId"] as? String)
            let id = try await pipeline.upload(
                ["userId": "ana", "signedTransaction": try #require(minted.json["signedTransaction"] as? String)])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            let event = try await events.first()
            #expect(event["price"] as? Int == 4_990 && event["currency"] as? String == "EUR", "\(event)")
            #expect(event["offerType"] as? Int == 1 && event["offerIdentifier"] as? String == "first-week", "\(event)")
            #expect(event["offerDiscountType"] as? String == "FREE_TRIAL" && event["offerPeriod"] as? String == "P1W", "\(event)")
            #expect(event["billingPlanType"] as? String == "MONTHLY", "\(event)")
            let kept = try #require(try await pipeline.store.purchaseTerms([transactionId])[transactionId])
            #expect(kept.price == 4_990 && kept.offerDiscountType == "FREE_TRIAL" && kept.appTransactionId != nil)
            await events.close()
        }
    }
}

/// The pipeline's `grant.created` events, as an app's revenue service would bind a queue to them.
struct GrantCreatedEvents {
    let listener: AMQPConnection
    let consumer: AMQPConsumer
    let listening: Task<Void, Never>
    let received: NIOLockedValueBox<[Data]>

    static func listen(_ pipeline: PipelineHarness, name: String) async throws -> GrantCreatedEvents {
        let (listener, queue) = try TestBroker.eventListener(pipeline.names, name: name, routingKey: "grant.created")
        #expect(await listener.waitUntilConnected(timeout: .seconds(15)))
        let received = NIOLockedValueBox([Data]())
        let consumer = listener.consume(queue: queue, prefetch: 10)
        let listening = Task {
            for await delivery in consumer {
                received.withLockedValue { $0.append(Data(delivery.body)) }
                try? await delivery.ack()
            }
        }
        return GrantCreatedEvents(listener: listener, consumer: consumer, listening: listening, received: received)
    }

    /// The first event, decoded (waits for it, bounded).
    func first() async throws -> [String: Any] {
        #expect(try await eventually { received.withLockedValue { $0.count } >= 1 })
        let body = try #require(received.withLockedValue { $0.first })
        return try #require((try JSONSerialization.jsonObject(with: body)) as? [String: Any])
    }

    func close() async {
        await consumer.cancel()
        listening.cancel()
        await listener.close()
    }
}

extension BrokerTests.PurchaseTermsTests {
    struct CommitmentMint: Encodable {
        var bundleId = PipelineHarness.bundleId
        var productId = "com.example.vip.month"
        var type = "auto_renewable"
        var price: Int64 = 4_990
        var billingPlanType = "MONTHLY"
        var commitmentTotalPeriods = 12
        var commitmentBillingPeriod = 1
        var commitmentPrice: Int64 = 59_880
    }

    /// A commitment plan (API 1.21): the transaction's `commitmentInfo` is kept with the credit
    /// and carried in `grant.created`; the renewal information's (what the commitment renews
    /// to) and its billing plan are kept on the subscription.
    @Test(arguments: TestStore.backends)
    func aCommitmentPlanIsKeptCarriedAndShown(_ backend: Backend) async throws {
        let pipeline = try await PipelineHarness.start(name: "commitment", on: backend)
        Teardown.add { await pipeline.stop() }
        let events = try await GrantCreatedEvents.listen(pipeline, name: "commitment")
        // The fake refuses a commitment no number can trap on: 1 to 1,000 periods, prices bounded.
        for refused in [CommitmentMint(commitmentTotalPeriods: 0), CommitmentMint(commitmentTotalPeriods: 1_001),
            CommitmentMint(commitmentBillingPeriod: 13), CommitmentMint(price: 2_000_000_000_000)] {
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/purchases", json: refused).status == 400)
        }
        let minted = try await HTTP.post(pipeline.fakeURL + "/fake/purchases", json: CommitmentMint())
        #expect(minted.status == 201, "\(minted.text)")
        let transactionId = try #require(minted.json["transactionId"] as? String)
        let signed = try #require(minted.json["signedTransaction"] as? String)
        let id = try await pipeline.upload(["userId": "ana", "signedTransaction": signed])
        #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
        let event = try await events.first()
        #expect(event["commitmentBillingPeriod"] as? Int == 1 && event["commitmentTotalPeriods"] as? Int == 12, "\(event)")
        #expect(event["commitmentPrice"] as? Int == 59_880 && event["commitmentExpiresDate"] is String, "\(event)")
        let kept = try #require(try await pipeline.store.purchaseTerms([transactionId])[transactionId]?.commitment)
        #expect(kept.billingPeriodNumber == 1 && kept.totalBillingPeriods == 12 && kept.commitmentPrice == 59_880)
        let expires = try #require(jwsPayload(signed)?["expiresDate"] as? Double)
        let ends = try #require(kept.commitmentExpiresDate)
        #expect(ends.timeIntervalSince1970 * 1000 > expires, "the commitment ends with its first period")

        // Apple's renewal information (a notification) says what the commitment renews to.
        let told = try await HTTP.post(
            pipeline.fakeURL + "/fake/purchases/\(transactionId)/notify",
            json: ["notificationType": "DID_CHANGE_RENEWAL_STATUS", "subtype": "AUTO_RENEW_ENABLED"])
        #expect(told.status == 200, "\(told.text)")
        var renewal: RenewalTerms?
        let kept2 = try await eventually(timeout: .seconds(20)) {
            renewal = try await pipeline.store.subscriptions(ofUser: "ana").first?.renewal
            return renewal?.commitment != nil
        }
        #expect(kept2, "\(String(describing: renewal))")
        #expect(renewal?.billingPlanType == "MONTHLY")
        #expect(renewal?.commitment?.autoRenewStatus == 1 && renewal?.commitment?.renewalPrice == 59_880)
        #expect(renewal?.commitment?.autoRenewProductId == "com.example.vip.month" && renewal?.commitment?.renewalDate == ends)
        await events.close()
    }

    struct MigratedMint: Encodable {
        var bundleId = PipelineHarness.bundleId
        var productId = "com.example.vip.year"
        var type = "auto_renewable"
        var previousOriginalTransactionId: String
    }

    /// A migrated subscription starts a new original transaction that names the chain it
    /// continues (`previousOriginalTransactionId`): it is its old chain's owner's, whoever uploads it.
    @Test(arguments: TestStore.backends)
    func aMigratedSubscriptionContinuesItsOldChainsOwner(_ backend: Backend) async throws {
        let pipeline = try await PipelineHarness.start(name: "migrated", on: backend)
        Teardown.add { await pipeline.stop() }
        let old = try await pipeline.mintStoreKit2(productId: "com.example.vip.month", type: "auto_renewable")
        let first = try await pipeline.upload(["userId": "ana", "signedTransaction": try #require(old.signedTransaction)])
        #expect(try await pipeline.waitForState(first)["state"] as? String == "credited")
        let minted = try await HTTP.post(
            pipeline.fakeURL + "/fake/purchases", json: MigratedMint(previousOriginalTransactionId: old.originalTransactionId))
        #expect(minted.status == 201, "\(minted.text)")
        let migrated = try #require(minted.json["transactionId"] as? String)
        let signed = try #require(minted.json["signedTransaction"] as? String)
        #expect(jwsPayload(signed)?["previousOriginalTransactionId"] as? String == old.originalTransactionId)
        // Another account uploads it first: the period is the old chain's owner's.
        let stranger = try await pipeline.waitForState(try await pipeline.upload(["userId": "sam", "signedTransaction": signed]))
        #expect(try await pipeline.grantState(of: migrated, user: "ana") == "active", "\(stranger)")
        #expect(try await pipeline.grantState(of: migrated, user: "sam") == nil)
        // Apple's MIGRATION about it is applied as what it is: the new chain is ana's, audited.
        let told = try await eventually(timeout: .seconds(20)) {
            try await pipeline.store.auditLog(limit: 100).contains {
                $0.action == "subscription_migrated" && $0.subject == "subscription:\(migrated)"
                    && ($0.details ?? "").contains(old.originalTransactionId)
            }
        }
        #expect(told, "no MIGRATION applied")

        // Apple tells of the new chain (its MIGRATION, a renewal preference) before its first
        // period is uploaded: the period still goes to the old chain's owner, whoever uploads it.
        let bens = try await pipeline.mintStoreKit2(productId: "com.example.vip.month", type: "auto_renewable")
        let his = try await pipeline.upload(["userId": "ben", "signedTransaction": try #require(bens.signedTransaction)])
        #expect(try await pipeline.waitForState(his)["state"] as? String == "credited")
        #expect(try await HTTP.post(pipeline.fakeURL + "/fake/notifications/hold", json: [String: String]()).status == 204)
        let moved = try await HTTP.post(
            pipeline.fakeURL + "/fake/purchases", json: MigratedMint(previousOriginalTransactionId: bens.originalTransactionId))
        let movedId = try #require(moved.json["transactionId"] as? String, "\(moved.text)")
        let preference = try await HTTP.post(
            pipeline.fakeURL + "/fake/purchases/\(movedId)/notify",
            json: ["notificationType": "DID_CHANGE_RENEWAL_STATUS", "subtype": "AUTO_RENEW_DISABLED"])
        #expect(preference.status == 200, "\(preference.text)")
        let released = try await HTTP.post(pipeline.fakeURL + "/fake/notifications/release", json: [String: String]())
        #expect(released.status == 200, "\(released.text)")
        #expect(
            try await eventually(timeout: .seconds(20)) {
                Set(try await pipeline.store.notifications(ofTransaction: movedId).map(\.type)) == ["MIGRATION", "DID_CHANGE_RENEWAL_STATUS"]
            })
        let movedSigned = try #require(moved.json["signedTransaction"] as? String)
        let other = try await pipeline.waitForState(try await pipeline.upload(["userId": "sam", "signedTransaction": movedSigned]))
        #expect(try await pipeline.grantState(of: movedId, user: "ben") == "active", "\(other)")
        #expect(try await pipeline.grantState(of: movedId, user: "sam") == nil)
    }
}
