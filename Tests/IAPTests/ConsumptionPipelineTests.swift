import Foundation
import IAPCore
import Ledger
import Messaging
import OrderStore
import Relay
import Testing
import TestSupport

extension BrokerTests {
    /// Apple's refund requests (CONSUMPTION_REQUEST) through the real pipeline: answered once
    /// with the ledger's facts when the customer consented, never without.
    @Suite("Refund requests answered through the pipeline")
    struct ConsumptionPipelineTests {
        @Test(arguments: TestStore.backends)
        func aSpentConsumableIsAnsweredOnceWithTheLedgersFactsAndNotAtAllWithoutConsent(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(
                name: "consumption", consumption: .init(consent: .perUser, refundPreference: "DECLINE"), on: backend)
            Teardown.add { await pipeline.stop() }
            var purchases: [String: PipelineHarness.Purchase] = [:]
            for user in ["ana", "bob"] {
                let purchase = try await pipeline.mintStoreKit2()
                let id = try await pipeline.upload(["userId": user, "signedTransaction": try #require(purchase.signedTransaction)])
                #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
                purchases[user] = purchase
            }
            let ana = try #require(purchases["ana"]), bob = try #require(purchases["bob"])
            // The app says ana spent all of hers and consented; bob said nothing.
            let report = try await HTTP.post(
                pipeline.intakeURL + "/v1/users/ana/consumption",
                json: RouteReport(transactionId: ana.transactionId, consumptionPercentage: 100_000, customerConsented: true))
            #expect(report.status == 204, "\(report.text)")
            // Bad reports are refused and change nothing: a share past all of it, another user's purchase.
            let tooMuch = try await HTTP.post(
                pipeline.intakeURL + "/v1/users/ana/consumption",
                json: RouteReport(transactionId: ana.transactionId, consumptionPercentage: 100_001))
            #expect(tooMuch.status == 400 && tooMuch.errorCode == "invalid_field")
            let notHers = try await HTTP.post(
                pipeline.intakeURL + "/v1/users/ana/consumption",
                json: RouteReport(transactionId: bob.transactionId, consumptionPercentage: 0))
            #expect(notHers.status == 404 && notHers.errorCode == "purchase_not_found")

            for purchase in [ana, bob] {
                let asked = try await HTTP.post(
                    pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/notify",
                    json: ["notificationType": "CONSUMPTION_REQUEST", "consumptionRequestReason": "UNINTENDED_PURCHASE"])
                #expect(asked.status == 200, "\(asked.text)")
            }
            let answered = try await eventually(timeout: .seconds(30)) {
                try await HTTP.get(pipeline.fakeURL + "/fake/consumption/\(ana.transactionId)").status == 200
            }
            #expect(answered, "Apple never heard about ana's refund request")
            let settled = try await eventually(timeout: .seconds(30)) {
                try await pipeline.store.consumptionRequests(limit: 10).filter { $0.answer != "queued" }.count == 2
            }
            #expect(settled)
            try await Task.sleep(for: .seconds(2))
            let bodies = try await HTTP.get(pipeline.fakeURL + "/fake/consumption/\(ana.transactionId)?all=true")
            let sent = try #require(try JSONSerialization.jsonObject(with: bodies.body) as? [[String: Any]])
            #expect(sent.count == 1, "answered more than once: \(bodies.text)")
            #expect(sent.first?["customerConsented"] as? Bool == true)
            #expect(sent.first?["deliveryStatus"] as? String == "DELIVERED")
            #expect(sent.first?["consumptionPercentage"] as? Int == 100_000)
            #expect(sent.first?["refundPreference"] as? String == "DECLINE")
            #expect(sent.first?["sampleContentProvided"] as? Bool == false)
            #expect(try await HTTP.get(pipeline.fakeURL + "/fake/consumption/\(bob.transactionId)").status == 404)

            let requests = try await pipeline.store.consumptionRequests(limit: 10)
            let anas = try #require(requests.first { $0.transactionId == ana.transactionId })
            let bobs = try #require(requests.first { $0.transactionId == bob.transactionId })
            #expect(anas.answer == "sent" && anas.answeredAt != nil && anas.answerJSON?.contains("DELIVERED") == true)
            #expect(bobs.answer == "skipped" && bobs.answerReason == ConsumptionAnswer.noConsent)
            let deadline = try #require(anas.deadline)
            #expect(abs(deadline.timeIntervalSince(anas.receivedAt) - 12 * 3600) < 60, "Apple gives 12 hours")
            let audited = try await pipeline.store.auditLog(limit: 100).filter { $0.action == "consumption_answer" }
            #expect(Set(audited.map(\.subject)) == ["transaction:\(ana.transactionId)", "transaction:\(bob.transactionId)"])
        }
    }
}

extension BrokerTests.ConsumptionPipelineTests {
    /// What the answer says is checked against the ledger, by what the purchase is credited
    /// once by: a non-consumable the user holds through a restore (credited under another
    /// transaction of its original) is delivered, and the app may report its share by the
    /// original; a share never goes down (a buyer who asked Apple for a refund cannot take back
    /// what the app reported used); an auto-renewable subscription's answer carries no share
    /// (Apple refuses one), and a prorated refund preference is said only with a share.
    @Test(arguments: TestStore.backends)
    func theAnswerFollowsTheCreditKeyAndAShareNeverGoesDown(_ backend: Backend) async throws {
        let pipeline = try await PipelineHarness.start(
            name: "consumption-keys", consumption: .init(consent: .all, refundPreference: "GRANT_PRORATED"), on: backend)
        Teardown.add { await pipeline.stop() }
        func ask(_ transactionId: String) async throws -> [String: Any] {
            let answer = try await pipeline.askForRefund(transactionId)
            #expect(answer != nil, "Apple never heard about the refund request of \(transactionId)")
            return answer ?? [:]
        }
        // A non-consumable bought on one device, credited through its restore on another.
        let premium = try await pipeline.mintStoreKit2(productId: "com.example.premium", type: "non_consumable")
        let restore = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(premium.transactionId)/restore", json: ["deviceId": "ipad-2"])
        #expect(restore.status == 201, "\(restore.text)")
        let restored = try JSONDecoder().decode(PipelineHarness.Purchase.self, from: restore.body)
        #expect(restored.transactionId != premium.transactionId)
        let credited = try await pipeline.upload(["userId": "ida", "signedTransaction": try #require(restored.signedTransaction)])
        #expect(try await pipeline.waitForState(credited)["state"] as? String == "credited")
        // The app reports by the original, which only the restore's row names.
        let byOriginal = try await HTTP.post(
            pipeline.intakeURL + "/v1/users/ida/consumption",
            json: RouteReport(transactionId: premium.transactionId, consumptionPercentage: 40_000))
        #expect(byOriginal.status == 204, "\(byOriginal.text)")
        let premiumAnswer = try await ask(premium.transactionId)
        #expect(premiumAnswer["deliveryStatus"] as? String == "DELIVERED", "\(premiumAnswer)")
        #expect(premiumAnswer["consumptionPercentage"] as? Int == 40_000 && premiumAnswer["refundPreference"] as? String == "GRANT_PRORATED")

        // A consumable spent in full, then "nothing used" once its buyer asked for a refund.
        let coins = try await pipeline.mintStoreKit2()
        let bought = try await pipeline.upload(["userId": "ida", "signedTransaction": try #require(coins.signedTransaction)])
        #expect(try await pipeline.waitForState(bought)["state"] as? String == "credited")
        for share in [100_000, 0] {
            let report = try await HTTP.post(
                pipeline.intakeURL + "/v1/users/ida/consumption", json: RouteReport(transactionId: coins.transactionId, consumptionPercentage: share))
            #expect(report.status == 204, "\(report.text)")
        }
        let coinsAnswer = try await ask(coins.transactionId)
        #expect(coinsAnswer["consumptionPercentage"] as? Int == 100_000, "\(coinsAnswer)")

        // A subscription: no share, so no prorated preference either.
        let month = try await pipeline.mintStoreKit2(productId: "com.example.vip.month", type: "auto_renewable")
        let subscribed = try await pipeline.upload(["userId": "ida", "signedTransaction": try #require(month.signedTransaction)])
        #expect(try await pipeline.waitForState(subscribed)["state"] as? String == "credited")
        let monthAnswer = try await ask(month.transactionId)
        #expect(monthAnswer["deliveryStatus"] as? String == "DELIVERED", "\(monthAnswer)")
        #expect(monthAnswer["consumptionPercentage"] == nil && monthAnswer["refundPreference"] == nil, "\(monthAnswer)")
    }

    /// The app's services may publish the same reports to `<prefix>.consumption`: recorded as
    /// the route records them; a wrong one, or one for another user's purchase, goes to the
    /// dead letters with the reason and the queue keeps flowing.
    @Test func aReportPublishedOnTheQueueIsRecordedAndABadOneDeadLettered() async throws {
        let pipeline = try await PipelineHarness.start(
            name: "consumption-amqp", consumption: .init(consent: .perUser))
        Teardown.add { await pipeline.stop() }
        let purchase = try await pipeline.mintStoreKit2()
        let id = try await pipeline.upload(["userId": "cyd", "signedTransaction": try #require(purchase.signedTransaction)])
        #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
        let names = pipeline.names
        let connection = AMQPConnection(
            configuration: try TestBroker.configuration(),
            topology: .pipeline(names, retrySchedule: RetrySchedule(delaysSeconds: [1])), logger: TestBroker.logger)
        #expect(await connection.waitUntilConnected(timeout: .seconds(15)))
        func publish(_ report: ConsumptionReport) async throws {
            try await connection.publish(OutgoingMessage(routingKey: names.consumption, body: Array(try JSONEncoder().encode(report))))
        }
        try await publish(.init(userId: "dan", transactionId: purchase.transactionId, consumptionPercentage: 0, customerConsented: nil))
        try await publish(.init(userId: "cyd", transactionId: nil, consumptionPercentage: nil, customerConsented: nil))
        try await connection.publish(OutgoingMessage(routingKey: names.consumption, body: Array("{not json".utf8)))
        try await publish(
            .init(userId: "cyd", transactionId: purchase.transactionId, consumptionPercentage: 25_000, customerConsented: true))
        #expect(try await eventually { try await connection.queueStatus(names.resultsDead).messageCount == 3 })
        let reasons = try await DeadLetters(connection: connection).list(names.resultsDead, limit: 10).compactMap(\.reason)
        #expect(reasons.contains { $0.contains("no purchase of this user") }, "\(reasons)")
        #expect(reasons.contains { $0.contains("unreadable consumption report") }, "\(reasons)")

        // Apple asks: answered with what the queue said.
        let sent = try #require(try await pipeline.askForRefund(purchase.transactionId), "Apple never heard the answer")
        #expect(sent["consumptionPercentage"] as? Int == 25_000 && sent["deliveryStatus"] as? String == "DELIVERED")
        await connection.close()
    }
}

private struct RouteReport: Encodable {
    var transactionId: String?
    var consumptionPercentage: Int?
    var customerConsented: Bool?
}

extension BrokerTests {
    /// Apple's ONE_TIME_CHARGE (a consumable, non-consumable or non-renewing subscription
    /// bought): with a token naming one of our orders it credits that order's user with no
    /// upload; without one it is recorded and the purchase waits for the app's upload.
    @Suite("ONE_TIME_CHARGE credits without an upload")
    struct OneTimeChargeTests {
        @Test(arguments: TestStore.backends)
        func aOneTimeChargeWithAnOrdersTokenCreditsThatOrdersUser(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "one-time-charge", on: backend)
            Teardown.add { await pipeline.stop() }
            let created = try await HTTP.post(
                pipeline.intakeURL + "/v1/orders", json: ["userId": "olga", "productId": "com.example.premium"])
            let orderId = try #require(created.json["orderId"] as? String, "\(created.text)")
            let bought = try await pipeline.mintStoreKit2(
                productId: "com.example.premium", type: "non_consumable", appAccountToken: orderId)
            let credited = try await eventually(timeout: .seconds(30)) {
                try await pipeline.grantState(of: bought.transactionId, user: "olga") == "active"
            }
            #expect(credited, "the order's user was not credited from ONE_TIME_CHARGE")
            let order = try await pipeline.store.order(orderId)
            #expect(order?.state == .paid && order?.transactionId == bought.transactionId)
            #expect(try await pipeline.store.notifications(ofTransaction: bought.transactionId).map(\.type) == ["ONE_TIME_CHARGE"])

            // No token: recorded, nobody credited, and the buyer's upload credits the buyer.
            let anonymous = try await pipeline.mintStoreKit2()
            let recorded = try await eventually(timeout: .seconds(30)) {
                try await !pipeline.store.notifications(ofTransaction: anonymous.transactionId).isEmpty
            }
            #expect(recorded)
            #expect(try await pipeline.store.grants(ofTransaction: anonymous.transactionId).isEmpty)
            let upload = try await pipeline.upload(
                ["userId": "pat", "signedTransaction": try #require(anonymous.signedTransaction)])
            #expect(try await pipeline.waitForState(upload)["state"] as? String == "credited")
            #expect(try await pipeline.grantState(of: anonymous.transactionId, user: "pat") == "active")
        }
    }
}

extension PipelineHarness {
    /// Apple asks about a refund of `transactionId` (the fake sends CONSUMPTION_REQUEST) and
    /// the answer the order service sent it, once one arrived within 30 s; nil when none did.
    func askForRefund(_ transactionId: String, reason: String = "OTHER") async throws -> [String: Any]? {
        let asked = try await HTTP.post(
            fakeURL + "/fake/purchases/\(transactionId)/notify",
            json: ["notificationType": "CONSUMPTION_REQUEST", "consumptionRequestReason": reason])
        #expect(asked.status == 200, "\(asked.text)")
        let answered = try await eventually(timeout: .seconds(30)) {
            try await HTTP.get(self.fakeURL + "/fake/consumption/\(transactionId)").status == 200
        }
        guard answered else { return nil }
        return try await HTTP.get(fakeURL + "/fake/consumption/\(transactionId)").json
    }
}
