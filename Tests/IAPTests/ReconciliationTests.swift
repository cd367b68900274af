import AppStore
import AsyncHTTPClient
import FakeAppStore
import Foundation
import Hummingbird
import ServiceLifecycle
import IAPCore
import OrderStore
import Ledger
import AppleCalls
import Pipeline
import SwiftASN1
import Testing
import TestSupport
import X509

extension BrokerTests {
    @Suite("Reconciliation finds what notifications missed")
    struct ReconciliationTests {
        /// A subscription bought at the fake App Store: a month that ends within the hour.
        struct SubscriptionMint: Encodable {
            var bundleId = PipelineHarness.bundleId
            var productId = "com.example.vip.month"
            var type = "auto_renewable"
            var expiresInSeconds = 3600
        }

        /// The reconciliation the order service runs, against the harness's store and fake App Store.
        static func reconciliation(
            _ pipeline: PipelineHarness, settings: ReconciliationSettings = .init()
        ) async throws -> Reconciliation {
            let root = try await HTTP.get(pipeline.fakeURL + "/fake/root-certificate")
            let verifier = SignedDataVerifier(
                settings: .init(
                    trustedRoots: [try Certificate(derEncoded: [UInt8](root.body))], bundleIds: [PipelineHarness.bundleId],
                    appAppleId: FakeAppStore.defaultAppAppleId))
            return Reconciliation(
                store: pipeline.store,
                reader: SubscriptionStatusReader(
                    client: try AppStoreServerAPIClient(
                        settings: ServerAPIKey.settings(fakeURL: pipeline.fakeURL), httpClient: .shared, logger: TestBroker.logger),
                    verifier: verifier),
                policy: CreditPolicy(catalog: PipelineHarness.testCatalog, eventsExchange: pipeline.names.events),
                verifyQueue: pipeline.names.verify, settings: settings, logger: TestBroker.logger)
        }

        /// Apple's notifications stop reaching the intake (the fake records them as failed).
        static func stopNotifications(_ pipeline: PipelineHarness) async throws {
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/config", json: ["notificationURL": ""]).status == 204)
        }

        static func reconciliationAudit(_ store: OrderStore) async throws -> [AuditEntry] {
            try await store.auditLog(limit: 1000).filter { $0.actor == "reconciliation" }
        }

        /// Scheduled every hour or less, each run falls due where the lease of the run before
        /// ends (an interval after it began): the lease is given back when a run ends, so no run
        /// is turned away as if another service held it; a lease still held turns one away.
        @Test(arguments: TestStore.backends)
        func aRunDueWhereTheLastRunsLeaseEndsIsNotSkipped(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "reconcile-lease", on: backend)
            Teardown.add { await pipeline.stop() }
            let reconciliation = try await Self.reconciliation(pipeline)
            let start = Date()
            for round in 0..<3 {
                let due = start.addingTimeInterval(Double(round) * 60)
                let report = try await reconciliation.runIfNoOtherIs(lease: .seconds(60), now: due)
                #expect(report != nil, "the run due at +\(round * 60) s was skipped")
            }
            // Another service holding the lease still keeps a run out.
            let later = start.addingTimeInterval(600)
            #expect(try await pipeline.store.takeLease("reconciliation", until: later.addingTimeInterval(60), now: later))
            #expect(try await reconciliation.runIfNoOtherIs(lease: .seconds(60), now: later.addingTimeInterval(1)) == nil)
        }

        /// A period whose notification was lost, found by the history pass after a later period
        /// arrived, is credited, and is dated when Apple renewed it (its purchase date), not when
        /// Apple answered the read: the subscription keeps the later period's expiry and state.
        @Test(arguments: TestStore.backends)
        func aPeriodFoundLateIsCreditedAndNeverReplacesTheSubscriptionsNewerState(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "reconcile-late-period", on: backend)
            Teardown.add { await pipeline.stop() }
            let minted = try await HTTP.post(pipeline.fakeURL + "/fake/purchases", json: SubscriptionMint())
            let signed = try #require(minted.json["signedTransaction"] as? String, "\(minted.text)")
            let original = try #require(minted.json["originalTransactionId"] as? String)
            let id = try await pipeline.upload(["userId": "ana", "signedTransaction": signed])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            func renew() async throws -> String {
                let renewal = try await HTTP.post(pipeline.fakeURL + "/fake/subscriptions/\(original)/renew", json: [String: String]())
                return try #require(renewal.json["transactionId"] as? String, "\(renewal.text)")
            }
            try await Self.stopNotifications(pipeline)
            let lost = try await renew()
            let intake = pipeline.intakeURL + "/v1/notifications/appstore"
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/config", json: ["notificationURL": intake]).status == 204)
            let delivered = try await renew()
            #expect(try await eventually { try await pipeline.grantState(of: delivered, user: "ana") == "active" })
            let before = try #require(try await pipeline.store.subscriptions(ofUser: "ana").first)
            #expect(try await pipeline.grantState(of: lost, user: "ana") == nil)

            // The notification window starts now: only the history pass finds the lost period.
            let report = await (try await Self.reconciliation(pipeline, settings: .init(firstLookback: .zero))).run()
            #expect(report.errors.isEmpty, "\(report.errors)")
            #expect(try await pipeline.grantState(of: lost, user: "ana") == "active")
            let after = try #require(try await pipeline.store.subscriptions(ofUser: "ana").first)
            #expect(after.state == .active && after.expiresDate == before.expiresDate, "before \(before), after \(after)")
        }

        @Test func aMissedRenewalIsCreditedAndAMissedRefundRevokedOnce() async throws {
            let pipeline = try await PipelineHarness.start(name: "reconcilesub")
            Teardown.add { await pipeline.stop() }
            let minted = try await HTTP.post(pipeline.fakeURL + "/fake/purchases", json: SubscriptionMint())
            #expect(minted.status == 201, "\(minted.text)")
            let first = try #require(minted.json["transactionId"] as? String)
            let original = try #require(minted.json["originalTransactionId"] as? String)
            let submission = try await pipeline.upload(
                userId: "ana", receiptData: try #require(minted.json["receiptData"] as? String))
            #expect(try await pipeline.waitForState(submission)["state"] as? String == "credited")
            #expect(try await pipeline.store.grants(ofUser: "ana").map(\.state) == [.active])

            // Apple renews the subscription and refunds its first month; neither notification arrives.
            try await Self.stopNotifications(pipeline)
            let renewed = try await HTTP.post(
                pipeline.fakeURL + "/fake/subscriptions/\(original)/renew", json: [String: String]())
            #expect(renewed.status == 201, "\(renewed.text)")
            let second = try #require(renewed.json["transactionId"] as? String)
            let refund = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(first)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            #expect(try await pipeline.store.grants(ofUser: "ana").map(\.transactionId) == [first])

            let reconciliation = try await Self.reconciliation(pipeline)
            let report = await reconciliation.run()
            #expect(report.errors.isEmpty, "\(report.errors)")
            #expect(report.subscriptionsChecked == 1)
            #expect(
                report.corrections.map { "\($0.notificationType) \($0.transactionId) \($0.outcome)" }
                    == ["REFUND \(first) revoked", "DID_RENEW \(second) credited"], "\(report.corrections)")
            #expect(report.corrections.allSatisfy { $0.userId == "ana" && $0.originalTransactionId == original })
            let grants = try await pipeline.store.grants(ofUser: "ana")
            #expect(grants.map { "\($0.transactionId) \($0.state)" } == ["\(first) revoked", "\(second) active"])
            let subscription = try #require(try await pipeline.store.subscriptions(ofUser: "ana").first)
            #expect(subscription.state == .active && (subscription.expiresDate ?? .distantPast) > Date().addingTimeInterval(3600))
            let audited = try await Self.reconciliationAudit(pipeline.store)
            #expect(audited.count == 2 && audited.allSatisfy { $0.subject == "subscription:\(original)" }, "\(audited)")
            #expect(audited.contains { $0.reason.contains("DID_RENEW: credited") && $0.details?.contains(second) == true })
            #expect(audited.contains { $0.reason.contains("REFUND: revoked") && $0.details?.contains(first) == true })
            // The two notifications Apple could not deliver are queued again too; they change nothing more.
            #expect(report.failedNotificationsFound == 2 && report.notificationsRedelivered == 2)
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    let renewals = try await pipeline.store.notifications(ofTransaction: second).map(\.type)
                    let refunds = try await pipeline.store.notifications(ofTransaction: first).map(\.type)
                    return renewals.count == 2 && refunds.count == 2
                })

            // A second run finds Apple saying the same: nothing is applied twice.
            let again = await reconciliation.run()
            #expect(again.errors.isEmpty, "\(again.errors)")
            #expect(again.subscriptionsChecked == 1 && again.notificationsApplied == 0 && again.corrections.isEmpty)
            #expect(again.notificationsRedelivered == 0)
            #expect(try await pipeline.store.grants(ofUser: "ana") == grants)
            #expect(try await Self.reconciliationAudit(pipeline.store).count == 2)
            #expect(try await pipeline.store.subscriptions(ofUser: "ana").first?.state == .active)
        }

        @Test func notificationsAppleCouldNotDeliverAreRedeliveredAndAppliedOnce() async throws {
            let pipeline = try await PipelineHarness.start(name: "reconcilenote")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            let submission = try await pipeline.upload(userId: "ben", receiptData: purchase.receiptData)
            #expect(try await pipeline.waitForState(submission)["state"] as? String == "credited")

            try await Self.stopNotifications(pipeline)
            let refund = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            #expect(try await pipeline.store.grants(ofTransaction: purchase.transactionId).map(\.state) == [.active])

            let reconciliation = try await Self.reconciliation(pipeline)
            let report = await reconciliation.run()
            #expect(report.errors.isEmpty, "\(report.errors)")
            #expect(report.failedNotificationsFound == 1 && report.notificationsRedelivered == 1)
            #expect(report.subscriptionsChecked == 0)
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.grants(ofTransaction: purchase.transactionId).map(\.state) == [.revoked]
                })

            // Apple still lists it as undelivered (the run looks back a little before its last
            // one): it is not queued again.
            let again = await reconciliation.run()
            #expect(again.errors.isEmpty, "\(again.errors)")
            #expect(again.failedNotificationsFound == 1 && again.notificationsRedelivered == 0)
            try await Task.sleep(for: .seconds(2))
            // Two records of the refund: what the run read in the customer's transaction history
            // (it revoked the grant), and Apple's own notification, redelivered once (it found the
            // grant revoked already).
            // (Its ONE_TIME_CHARGE, delivered when it was bought, came first.)
            let applied = try await pipeline.store.notifications(ofTransaction: purchase.transactionId)
            #expect(applied.map(\.type) == ["ONE_TIME_CHARGE", "REFUND", "REFUND"], "\(applied)")
            #expect(applied.filter { $0.outcome == "revoked" }.count == 1, "\(applied)")
            #expect(try await pipeline.store.grants(ofTransaction: purchase.transactionId).map(\.state) == [.revoked])
        }
    
        /// Every notification lost for a run of purchases, renewals, refunds and a reversed
        /// refund (lost on our side: Apple's notification history does not list them as failed),
        /// and one reconciliation reads each customer's history since its revision and brings
        /// every grant to what the notifications would have made; the next run reads only what
        /// changed since.
        @Test(arguments: TestStore.backends)
        func oneRunByRevisionBringsEveryGrantWhereTheLostNotificationsWould(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "reconcile-revision", on: backend)
            Teardown.add { await pipeline.stop() }
            struct Mint: Encodable {
                var bundleId = PipelineHarness.bundleId
                var productId: String
                var type: String
                var deviceId: String
                var appAccountToken: String? = nil
            }
            func mint(_ product: String, _ type: String, device: String, token: String? = nil) async throws -> [String: Any] {
                let answer = try await HTTP.post(
                    pipeline.fakeURL + "/fake/purchases",
                    json: Mint(productId: product, type: type, deviceId: device, appAccountToken: token))
                #expect(answer.status == 201, "\(answer.text)")
                return answer.json
            }
            func uploadCredited(_ minted: [String: Any], by user: String) async throws -> String {
                guard let signed = minted["signedTransaction"] as? String, let transactionId = minted["transactionId"] as? String
                else { throw HarnessError("the fake minted no transaction: \(minted)") }
                let id = try await pipeline.upload(["userId": user, "signedTransaction": signed])
                #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
                return transactionId
            }
            let run = UUID().uuidString.prefix(8)
            let sub = try await mint("com.example.vip.month", "auto_renewable", device: "ana-\(run)")
            let firstPeriod = try await uploadCredited(sub, by: "ana")
            let coins = try await uploadCredited(try await mint("com.example.coins.60", "consumable", device: "ben-\(run)"), by: "ben")
            let premium = try await uploadCredited(
                try await mint("com.example.premium", "non_consumable", device: "cat-\(run)"), by: "cat")
            let reversed = try await uploadCredited(try await mint("com.example.coins.60", "consumable", device: "dan-\(run)"), by: "dan")
            // dan's refund arrives; everything after it is lost.
            _ = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(reversed)/refund", json: [String: String]())
            #expect(try await eventually { try await pipeline.grantState(of: reversed, user: "dan") == "revoked" })
            let sink = Router(context: BasicRequestContext.self)
            sink.post("/lost") { _, _ in HTTPResponse.Status.ok }
            let lost = try await LoopbackServer.start(sink, name: "lost-notifications")
            Teardown.add { await lost.group.triggerGracefulShutdown() }
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/config", json: ["notificationURL": lost.base + "/lost"]).status == 204)

            let original = try #require(sub["originalTransactionId"] as? String)
            var renewals: [String] = []
            for _ in 0..<2 {
                let renewal = try await HTTP.post(pipeline.fakeURL + "/fake/subscriptions/\(original)/renew", json: [String: String]())
                renewals.append(try #require(renewal.json["transactionId"] as? String, "\(renewal.text)"))
            }
            let order = try await HTTP.post(pipeline.intakeURL + "/v1/orders", json: ["userId": "ben", "productId": "com.example.coins.120"])
            let orderId = try #require(order.json["orderId"] as? String)
            let paid = try #require(
                try await mint("com.example.coins.120", "consumable", device: "ben-\(run)", token: orderId)["transactionId"] as? String)
            _ = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(premium)/refund", json: [String: String]())
            _ = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(reversed)/notify", json: ["notificationType": "REFUND_REVERSED"])
            #expect(try await pipeline.grantState(of: premium, user: "cat") == "active", "a notification got through")

            // Only the history pass can know: the notification window starts now.
            let reconciliation = try await Self.reconciliation(pipeline, settings: .init(firstLookback: .zero))
            let report = await reconciliation.run()
            #expect(report.errors.isEmpty, "\(report.errors)")
            #expect(report.historiesRead == 4, "one read per customer: \(report.historiesRead)")
            for (user, transactionId, state) in [
                ("ana", firstPeriod, "active"), ("ana", renewals[0], "active"), ("ana", renewals[1], "active"),
                ("ben", coins, "active"), ("ben", paid, "active"), ("cat", premium, "revoked"), ("dan", reversed, "active"),
            ] {
                #expect(try await pipeline.grantState(of: transactionId, user: user) == state, "\(user) \(transactionId)")
            }
            #expect(try await pipeline.store.order(orderId)?.state == .paid)

            // The next run reads only what changed since: nothing, then one refund.
            let quiet = await reconciliation.run()
            #expect(quiet.transactionsChanged == 0 && quiet.notificationsApplied == 0, "\(quiet)")
            _ = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(coins)/refund", json: [String: String]())
            let later = await reconciliation.run()
            #expect(later.transactionsChanged == 1, "\(later.transactionsChanged) changed")
            #expect(try await pipeline.grantState(of: coins, user: "ben") == "revoked")
        }
    }
}

@Suite("Reconciliation speaks Apple's subscription statuses as notifications", .teardown)
struct ReconciliationNotificationTests {
    @Test func eachStatusBecomesTheNotificationAppleSendsForIt() throws {
        var transaction = JWSTransactionDecodedPayload(
            transactionId: "2000000000000042", originalTransactionId: "2000000000000007", bundleId: "com.example.tests",
            productId: "com.example.vip.month", environment: "Sandbox", purchaseDate: 1_700_000_000_000, quantity: 1,
            type: "Auto-Renewable Subscription", signedDate: 1_700_000_100_000)
        transaction.webOrderLineItemId = "2000000000000043"
        var renewal = JWSRenewalInfoDecodedPayload(
            originalTransactionId: "2000000000000007", productId: "com.example.vip.month", autoRenewStatus: 1,
            environment: "Sandbox", signedDate: 1_700_000_100_000)
        renewal.gracePeriodExpiresDate = 1_700_000_200_000
        let expected: [Int: String] = [
            1: "DID_RENEW", 2: "EXPIRED", 3: "DID_FAIL_TO_RENEW", 4: "DID_FAIL_TO_RENEW/GRACE_PERIOD", 5: "REVOKE",
        ]
        for (status, type) in expected {
            let notification = try #require(
                SubscriptionStatusReader.notification(status: status, transaction: transaction, renewal: renewal))
            #expect(notification.notificationType + (notification.subtype.map { "/\($0)" } ?? "") == type)
            #expect(notification.notificationUUID == "reconcile:2000000000000007:2000000000000042:\(status)")
            #expect(notification.signedDate == Date(appleMilliseconds: 1_700_000_100_000))
            #expect(notification.environment == .sandbox && notification.subscriptionStatus == status)
            #expect(notification.purchase?.webOrderLineItemId == "2000000000000043")
            #expect(notification.gracePeriodExpiresDate == Date(appleMilliseconds: 1_700_000_200_000))
        }
        #expect(SubscriptionStatusReader.notification(status: 9, transaction: transaction, renewal: renewal) == nil)

        // What Transaction History shows is dated when it happened: the read's date is later
        // than everything recorded. A seat or a family member's access taken back is a REVOKE.
        let renewed = SubscriptionStatusReader.notification(history: transaction, refundStands: false)
        #expect(renewed.notificationType == "DID_RENEW" && renewed.signedDate == Date(appleMilliseconds: 1_700_000_000_000))
        var revoked = transaction
        revoked.revocationDate = 1_700_000_050_000
        for (revocationType, type) in [("REFUND_FULL", "REFUND"), ("FAMILY_REVOKE", "REVOKE"), ("ASSIGNMENT_REVOKE", "REVOKE")] {
            revoked.revocationType = revocationType
            let notification = SubscriptionStatusReader.notification(history: revoked, refundStands: false)
            #expect(notification.notificationType == type, "\(revocationType)")
            #expect(notification.signedDate == Date(appleMilliseconds: 1_700_000_050_000))
        }
        #expect(SubscriptionStatusReader.refund(revoked).signedDate == Date(appleMilliseconds: 1_700_000_050_000))
        // A refund after a reversed one is another refund: its own notification.
        #expect(
            SubscriptionStatusReader.refund(revoked).notificationUUID
                == "reconcile:2000000000000007:2000000000000042:refund:1700000050000")
        #expect(SubscriptionStatusReader.refund(transaction).notificationUUID == "reconcile:2000000000000007:2000000000000042:refund:0")
    }

    @Test func aSubscriptionInBillingRetryIsCorrectedOnceAndAudited() async throws {
        let store = try await TestStore.open(
            in: FileManager.default.temporaryDirectory.appendingPathComponent("iap-reconcile-\(UUID().uuidString)"))
        let policy = CreditPolicy(catalog: PipelineHarness.testCatalog)
        let now = Date()
        let bought = VerifiedPurchase(
            transactionId: "2000000000000100", originalTransactionId: "2000000000000100", productId: "com.example.vip.month",
            quantity: 1, purchaseDate: now.addingTimeInterval(-3600), environment: .production,
            expiresDate: now.addingTimeInterval(600), webOrderLineItemId: "2000000000000101",
            signedDate: now.addingTimeInterval(-3600))
        let subscribed = AppStoreNotification(
            notificationUUID: UUID().uuidString, notificationType: "SUBSCRIBED", subtype: nil, environment: .production,
            bundleId: "com.example.tests", signedDate: now.addingTimeInterval(-3600), purchase: bought, subscriptionStatus: 1)
        _ = try #require(try await store.applyReconciliation(subscribed, signedTransaction: nil, policy: policy))
        // Nobody uploaded it: the owner is unknown and nothing is granted, but its state is kept.
        #expect(try await store.subscriptionsDue(before: now.addingTimeInterval(86_400)).map(\.state) == [.active])

        var retrying = bought
        retrying.signedDate = now
        let failed = AppStoreNotification(
            notificationUUID: "reconcile:2000000000000100:2000000000000100:3", notificationType: "DID_FAIL_TO_RENEW", subtype: nil,
            environment: .production, bundleId: "com.example.tests", signedDate: now, purchase: retrying, subscriptionStatus: 3)
        let change = try #require(try await store.applyReconciliation(failed, signedTransaction: nil, policy: policy))
        #expect(change.corrected && change.stateBefore == "active" && change.stateAfter == "billing_retry")
        #expect(change.outcome == "billing_retry")
        #expect(try await store.applyReconciliation(failed, signedTransaction: nil, policy: policy) == nil)
        let audit = try await store.auditLog(limit: 10).filter { $0.actor == "reconciliation" }
        #expect(audit.map(\.subject) == ["subscription:2000000000000100", "subscription:2000000000000100"])
        #expect(audit.first?.reason == "Apple's answer applied as DID_FAIL_TO_RENEW: billing_retry")
        #expect(try await store.subscriptionsDue(before: now).map(\.state) == [.billingRetry])
    }

    @Test func aRenewalNobodyOwnsNeverHidesItsSubscriptionFromReconciliation() async throws {
        let store = try await TestStore.open(
            in: FileManager.default.temporaryDirectory.appendingPathComponent("iap-reconcile-\(UUID().uuidString)"))
        let policy = CreditPolicy(catalog: PipelineHarness.testCatalog)
        let now = Date()
        // The first period ends in an hour; Apple's renewal, told before the app's first upload and
        // so held for the owner to come, moved the recorded end a month on.
        let first = VerifiedPurchase(
            transactionId: "2000000000000200", originalTransactionId: "2000000000000200", productId: "com.example.vip.month",
            quantity: 1, purchaseDate: now.addingTimeInterval(-30 * 86_400), environment: .production,
            expiresDate: now.addingTimeInterval(3_600), webOrderLineItemId: "2000000000000201",
            signedDate: now.addingTimeInterval(-30 * 86_400))
        var renewal = first
        renewal.transactionId = "2000000000000202"
        renewal.webOrderLineItemId = "2000000000000203"
        renewal.purchaseDate = now.addingTimeInterval(3_600)
        renewal.expiresDate = now.addingTimeInterval(31 * 86_400)
        renewal.signedDate = now
        let renewed = AppStoreNotification(
            notificationUUID: UUID().uuidString, notificationType: "DID_RENEW", subtype: nil, environment: .production,
            bundleId: "com.example.tests", signedDate: now, purchase: renewal, subscriptionStatus: 1)
        _ = try #require(try await store.applyReconciliation(renewed, signedTransaction: nil, policy: policy))
        let due = try await store.subscriptionsDue(before: now.addingTimeInterval(86_400))
        #expect(due.map(\.originalTransactionId) == ["2000000000000200"])
        #expect(due.first?.expiresDate.map { $0 > now.addingTimeInterval(30 * 86_400) } == true)
    }
}
