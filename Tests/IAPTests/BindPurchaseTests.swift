import AppStore
import AsyncHTTPClient
import FakeAppStore
import Foundation
import NIOHTTP1
import IAPCore
import OrderStore
import Ledger
import Testing
import TestSupport

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

extension BrokerTests {
    /// Set App Account Token takes any original transaction: a one-time purchase nobody could
    /// be credited with (an offer code redeemed outside the app: Apple told of it with no
    /// token) is bound to the customer customer service found paid for it, and the pipeline
    /// credits it to them through the new token's order.
    @Suite("Customer service binds a one-time purchase")
    struct BindOneTimePurchaseTests {
        @Test(arguments: TestStore.backends)
        func aOneTimePurchaseToldWithNoTokenIsBoundAndCreditedThroughItsNewOrder(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "bind-once", on: backend)
            Teardown.add { await pipeline.stop() }
            let bought = try await pipeline.mintStoreKit2(productId: "com.example.premium", type: "non_consumable")
            let told = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(bought.transactionId)/notify", json: ["notificationType": "ONE_TIME_CHARGE"])
            #expect(told.status == 200, "\(told.text)")
            #expect(try await pipeline.store.purchase(bought.transactionId)?.grant == nil, "credited with no owner")

            let bind = "/v1/admin/subscriptions/\(bought.transactionId)/bind"
            let bound = try await pipeline.admin(.POST, bind, ["userId": "bea", "reason": "offer code redeemed in the App Store (ticket 88)"])
            #expect(bound.status == 200, "\(bound.text)")
            let token = try #require(bound.json["appAccountToken"] as? String)
            let submission = try #require(bound.json["submissionId"] as? String)
            #expect(try await pipeline.waitForState(submission)["state"] as? String == "credited")
            #expect(try await pipeline.grantState(of: bought.transactionId, user: "bea") == "active")
            #expect(try await pipeline.store.order(token).map { $0.userId == "bea" && $0.state != .created } == true, "the order is not paid")
            let audit = try await pipeline.store.auditLog(limit: 100).filter { $0.action == "purchase_bound" }
            #expect(audit.map(\.subject) == ["transaction:\(bought.transactionId)"])

            // Bound already: to her, nothing to do; to another user, refused until revoked.
            #expect(try await pipeline.admin(.POST, bind, ["userId": "bea", "reason": "x"]).errorCode == "conflict")
            #expect(try await pipeline.admin(.POST, bind, ["userId": "cy", "reason": "x"]).errorCode == "conflict")
            // Apple knows no such purchase.
            #expect(
                try await pipeline.admin(.POST, "/v1/admin/subscriptions/2000000000000001/bind", ["userId": "cy", "reason": "x"])
                    .errorCode == "purchase_not_found")
            // A later transaction of a chain is not what Apple binds.
            let chain = try await pipeline.mintStoreKit2(productId: "com.example.vip.month", type: "auto_renewable")
            let renewal = try await HTTP.post(pipeline.fakeURL + "/fake/subscriptions/\(chain.originalTransactionId)/renew", json: [String: String]())
            let renewed = try #require(renewal.json["transactionId"] as? String)
            #expect(
                try await pipeline.admin(.POST, "/v1/admin/subscriptions/\(renewed)/bind", ["userId": "cy", "reason": "x"]).errorCode
                    == "invalid_field")
        }
    }
}

extension BrokerTests {
    /// Multiseat subscriptions (App Store Server API 1.22): a seat an organization assigned is
    /// access for the user its token proves, not a payment: it pays no order, and Apple's
    /// ASSIGNMENT_REVOKE takes it back with no order refunded.
    @Suite("Multiseat: an assigned seat")
    struct AssignedSeatTests {
        struct SeatMint: Encodable {
            var bundleId = PipelineHarness.bundleId
            var productId = "com.example.vip.month"
            var type = "auto_renewable"
            var inAppOwnershipType = "ASSIGNED"
            var quantity = 5
            var appAccountToken: String
        }

        @Test(arguments: TestStore.backends)
        func anAssignedSeatIsGrantedAndRevokedByAssignmentRevokeWithNoOrderRefunded(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "multiseat", on: backend)
            Teardown.add { await pipeline.stop() }
            let created = try await HTTP.post(pipeline.intakeURL + "/v1/orders", json: ["userId": "sam", "productId": "com.example.vip.month"])
            let orderId = try #require(created.json["orderId"] as? String)
            let minted = try await HTTP.post(pipeline.fakeURL + "/fake/purchases", json: SeatMint(appAccountToken: orderId))
            #expect(minted.status == 201, "\(minted.text)")
            let seat = try #require(minted.json["transactionId"] as? String)
            let signed = try #require(minted.json["signedTransaction"] as? String)
            #expect(jwsPayload(signed)?["inAppOwnershipType"] as? String == "ASSIGNED")
            let id = try await pipeline.upload(["userId": "sam", "signedTransaction": signed])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            let grants = try await pipeline.store.grants(ofTransaction: seat)
            #expect(grants.map(\.userId) == ["sam"] && grants.first?.quantity == 5, "the seats are kept: \(grants)")
            #expect(try await pipeline.store.order(orderId)?.state == .created, "an assigned seat pays no order")
            // Kept with the credit for the console: access, not a payment.
            let customer = try await pipeline.store.consoleCustomer("sam")
            #expect(customer.grants.first { $0.grant.transactionId == seat }?.terms?.ownershipType == "ASSIGNED", "\(customer.grants)")

            // Only an assigned seat is taken back with ASSIGNMENT_REVOKE; it is never refunded.
            let refund = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(seat)/refund", json: [String: String]())
            #expect(refund.status == 409, "\(refund.text)")
            let revoke = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(seat)/refund", json: ["revocationType": "ASSIGNMENT_REVOKE"])
            #expect(revoke.status == 200 && revoke.json["notificationType"] as? String == "REVOKE", "\(revoke.text)")
            let revoked = try await eventually(timeout: .seconds(30)) {
                try await pipeline.grantState(of: seat, user: "sam") == "revoked"
            }
            #expect(revoked)
            #expect(try await pipeline.store.order(orderId)?.state == .created, "nothing was refunded")

            // Apple refuses Set App Account Token for an assigned seat (4000227): nothing is bound.
            let bind = try await pipeline.admin(
                .POST, "/v1/admin/subscriptions/\(seat)/bind", ["userId": "tom", "reason": "moved by the organization"])
            #expect(bind.status == 409 && bind.errorCode == "apple_refused" && bind.text.contains("4000227"), "\(bind.text)")
        }
    }
}

extension BrokerTests.BindPurchaseTests {
    /// Customer service asks Apple whose download of the app a transaction belongs to (Get App
    /// Transaction Info), verified; an id Apple does not know is 404.
    @Test func customerServiceReadsTheCustomersAppTransaction() async throws {
        let pipeline = try await PipelineHarness.start(name: "app-transaction")
        Teardown.add { await pipeline.stop() }
        let bought = try await pipeline.mintStoreKit2()
        let signed = try #require(bought.signedTransaction)
        let expected = try #require(jwsPayload(signed)?["appTransactionId"] as? String)
        let answer = try await pipeline.admin(.GET, "/v1/admin/app-transactions/\(bought.transactionId)")
        #expect(answer.status == 200, "\(answer.text)")
        #expect(answer.json["appTransactionId"] as? String == expected && answer.json["bundleId"] as? String == PipelineHarness.bundleId)
        let unknown = try await pipeline.admin(.GET, "/v1/admin/app-transactions/2000000000000001")
        #expect(unknown.status == 404 && unknown.errorCode == "purchase_not_found", "\(unknown.text)")
    }
}

extension BrokerTests.BindPurchaseTests {
    /// An upload may carry the customer's signed `AppTransaction`: verified at the intake and
    /// recorded for the user; one that does not verify is dropped, never the purchase with it.
    @Test func anUploadedAppTransactionIsRecordedForTheUser() async throws {
        let pipeline = try await PipelineHarness.start(name: "uploaded-app-transaction")
        Teardown.add { await pipeline.stop() }
        let bought = try await pipeline.mintStoreKit2()
        let client = try AppStoreServerAPIClient(
            settings: ServerAPIKey.settings(fakeURL: pipeline.fakeURL), httpClient: .shared, logger: TestBroker.logger)
        let app = try await client.appTransactionInfo(bought.transactionId, in: .production)
        let expected = try #require(jwsPayload(app)?["appTransactionId"] as? String)
        let signed = try #require(bought.signedTransaction)

        let malformed = try await HTTP.post(
            pipeline.intakeURL + "/v1/receipts", json: ["userId": "ana", "signedTransaction": signed, "signedAppTransaction": "x"])
        #expect(malformed.status == 400 && malformed.errorCode == "jws_malformed", "\(malformed.text)")
        // Signed by someone else: the purchase is still taken, the app transaction is not.
        let forged = try FakeCertificateAuthority.generate().signJWS(
            AppTransactionDecodedPayload(
                appTransactionId: "700000000000000001", bundleId: PipelineHarness.bundleId, appAppleId: nil,
                receiptType: "Production", originalPurchaseDate: nil, signedDate: nil))
        let first = try await pipeline.upload(["userId": "ana", "signedTransaction": signed, "signedAppTransaction": forged])
        #expect(try await pipeline.waitForState(first)["state"] as? String == "credited")
        // Ana's credited purchase names her download; the forged one is nowhere.
        #expect(try await pipeline.store.consoleCustomer("ana").appTransactionIds == [expected])

        // Bo's upload proves no purchase (a bare id), but the download it carries is recorded for bo.
        let second = try await pipeline.upload(["userId": "bo", "transactionId": bought.transactionId, "signedAppTransaction": app])
        _ = try await pipeline.waitForState(second)
        #expect(try await pipeline.grants(of: "bo").isEmpty)
        #expect(try await pipeline.store.consoleCustomer("bo").appTransactionIds == [expected])
    }
}
