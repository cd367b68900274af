import Foundation
import IAPCore
import Messaging
import NIOConcurrencyHelpers
import NIOHTTP1
import OrderStore
import Ledger
import Pipeline
import ServiceLifecycle
import Testing
import TestSupport

extension PipelineHarness {
    /// Creates one of our orders over HTTP.
    func createOrder(userId: String, productId: String) async throws -> String {
        let answer = try await HTTP.post(intakeURL + "/v1/orders", json: ["userId": userId, "productId": productId])
        #expect(answer.status == 201, "\(answer.text)")
        return try #require(answer.json["orderId"] as? String)
    }

    /// An order as its owner reads it (`?userId=`, as the app names its user with authentication off).
    func order(_ orderId: String) async throws -> [String: Any] {
        let owner = try await store.order(orderId)?.userId ?? ""
        return try await HTTP.get(intakeURL + "/v1/orders/\(orderId)?userId=\(owner)").json
    }

    func grants(of userId: String) async throws -> [[String: Any]] {
        try await HTTP.get(intakeURL + "/v1/users/\(userId)/grants").json["grants"] as? [[String: Any]] ?? []
    }

    func mint(productId: String, token: (field: String, value: String)?, deviceId: String? = nil) async throws -> Purchase {
        var body = ["bundleId": Self.bundleId, "productId": productId]
        if let token { body[token.field] = token.value }
        body["deviceId"] = deviceId
        let answer = try await HTTP.post(fakeURL + "/fake/purchases", json: body)
        return try JSONDecoder().decode(Purchase.self, from: answer.body)
    }

    func admin(_ method: HTTPMethod, _ path: String, _ body: [String: String]? = nil, token: String? = adminToken)
        async throws -> HTTP.Answer
    {
        var headers = ["Content-Type": "application/json"]
        if let token { headers["Authorization"] = "Bearer \(token)" }
        return try await HTTP.send(
            intakeURL + path, method: method, body: try body.map { try JSONEncoder().encode($0) }, headers: headers)
    }
}

extension BrokerTests {
    @Suite("Orders, grants, events, customer service")
    struct OrdersTests {
        @Test(arguments: ["applicationUsername", "appAccountToken", "uploadOrderId"])
        func purchaseIsBoundToItsOrder(binding: String) async throws {
            let pipeline = try await PipelineHarness.start(name: "bind")
            Teardown.add { await pipeline.stop() }
            let orderId = try await pipeline.createOrder(userId: "lena", productId: "com.example.coins.120")
            #expect(try await pipeline.order(orderId)["state"] as? String == "created")
            let token = binding == "uploadOrderId" ? nil : (field: binding, value: orderId.uppercased())
            let purchase = try await pipeline.mint(productId: "com.example.coins.120", token: token)
            let answer = try await HTTP.post(
                pipeline.intakeURL + "/v1/receipts",
                json: ["userId": "lena", "receiptData": purchase.receiptData, "orderId": binding == "uploadOrderId" ? orderId : ""])
            let id = try #require(answer.json["submissionId"] as? String)
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")

            let order = try await pipeline.order(orderId)
            #expect(order["state"] as? String == "paid")
            #expect(order["transactionId"] as? String == purchase.transactionId)
            let grants = try await pipeline.grants(of: "lena")
            #expect(grants.count == 1)
            #expect(grants.first?["orderId"] as? String == orderId)
            #expect((grants.first?["grant"] as? [String: Any])?["coins"] as? Int == 120)
            #expect(grants.first?["state"] as? String == "active")
            #expect(grants.first?["quantity"] as? Int == 1)
            #expect(grants.first?["environment"] as? String == "Production")
        }

        @Test func uploadOrderIdBindsThePurchaseItFitsAmongEarlierOnes() async throws {
            let pipeline = try await PipelineHarness.start(name: "bindfit")
            Teardown.add { await pipeline.stop() }
            // An earlier purchase whose upload was lost, then the one the order is for.
            let earlier = try await pipeline.mint(productId: "com.example.coins.60", token: nil, deviceId: "phone-7")
            let orderId = try await pipeline.createOrder(userId: "uma", productId: "com.example.coins.120")
            let current = try await pipeline.mint(productId: "com.example.coins.120", token: nil, deviceId: "phone-7")
            let answer = try await HTTP.post(
                pipeline.intakeURL + "/v1/receipts",
                json: ["userId": "uma", "receiptData": current.receiptData, "orderId": orderId])
            let id = try #require(answer.json["submissionId"] as? String)
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            #expect(try await pipeline.order(orderId)["transactionId"] as? String == current.transactionId)
            let grants = try await pipeline.grants(of: "uma")
            #expect(Set(grants.compactMap { $0["transactionId"] as? String }) == [earlier.transactionId, current.transactionId])
            #expect(grants.first { $0["transactionId"] as? String == earlier.transactionId }?["orderId"] == nil)
        }

        @Test func purchaseOfAnotherProductThanItsOrderIsHeldForReview() async throws {
            let pipeline = try await PipelineHarness.start(name: "mismatch")
            Teardown.add { await pipeline.stop() }
            let orderId = try await pipeline.createOrder(userId: "max", productId: "com.example.coins.300")
            let purchase = try await pipeline.mint(productId: "com.example.coins.60", token: ("appAccountToken", orderId))
            let id = try await pipeline.upload(userId: "max", receiptData: purchase.receiptData)
            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "needs_review")
            #expect(status["reason"] as? String == "product_mismatch")
            let transaction = (status["transactions"] as? [[String: Any]])?.first
            #expect(transaction?["state"] as? String == "held")
            #expect(try await pipeline.grants(of: "max").isEmpty)
            #expect(try await pipeline.order(orderId)["state"] as? String == "created")
            // Uploaded by someone else, whose token names max's order: held for them too, never finishable.
            let other = try await pipeline.waitForState(
                try await pipeline.upload(userId: "nils", receiptData: purchase.receiptData, transactionId: purchase.transactionId))
            #expect(other["state"] as? String == "needs_review" && other["finishTransaction"] as? Bool == false, "\(other)")
            #expect((other["transactions"] as? [[String: Any]])?.first?["state"] as? String == "held", "\(other)")
        }

        @Test func purchaseOfAProductNotInTheCatalogIsHeldForReview() async throws {
            let pipeline = try await PipelineHarness.start(name: "unknown")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint(productId: "com.example.mystery", token: nil)
            let id = try await pipeline.upload(userId: "nina", receiptData: purchase.receiptData)
            let status = try await pipeline.waitForState(id)
            #expect(status["state"] as? String == "needs_review")
            #expect(status["reason"] as? String == "unknown_product")
            #expect(try await pipeline.grants(of: "nina").isEmpty)

            // Customer service grants the held purchase by hand.
            let granted = try await pipeline.admin(
                .POST, "/v1/admin/grants",
                ["userId": "nina", "productId": "com.example.coins.60", "transactionId": purchase.transactionId,
                 "reason": "ticket 4711: sold under an old product id", "actor": "olga"])
            #expect(granted.status == 201, "\(granted.text)")
            #expect(try await pipeline.grants(of: "nina").map { $0["transactionId"] as? String } == [purchase.transactionId])
        }

        @Test func purchaseNamingAnotherUsersOrderBelongsToThatUserWhoeverUploadsFirst() async throws {
            let pipeline = try await PipelineHarness.start(name: "owner")
            Teardown.add { await pipeline.stop() }
            let orderId = try await pipeline.createOrder(userId: "vera", productId: "com.example.coins.60")
            let purchase = try await pipeline.mint(productId: "com.example.coins.60", token: ("appAccountToken", orderId))
            // Someone else signed in on Vera's phone uploads first.
            let stranger = try await pipeline.upload(userId: "walt", receiptData: purchase.receiptData)
            let refused = try await pipeline.waitForState(stranger)
            #expect(refused["reason"] as? String == "replayed_from_other_user")
            #expect(try await pipeline.grants(of: "walt").isEmpty)
            #expect(try await pipeline.grants(of: "vera").map { $0["orderId"] as? String } == [orderId])
            #expect(try await pipeline.order(orderId)["state"] as? String == "paid")

            let own = try await pipeline.upload(userId: "vera", receiptData: purchase.receiptData)
            let status = try await pipeline.waitForState(own)
            #expect(status["state"] as? String == "credited")
            #expect((status["transactions"] as? [[String: Any]])?.first?["state"] as? String == "already_credited")
        }

        @Test func productsAreServedAndUnknownOnesCannotBeOrdered() async throws {
            let pipeline = try await PipelineHarness.start(name: "products")
            Teardown.add { await pipeline.stop() }
            let products = try await HTTP.get(pipeline.intakeURL + "/v1/products").json["products"] as? [[String: Any]]
            #expect(products?.count == PipelineHarness.testCatalog.products.count)
            let refused = try await HTTP.post(
                pipeline.intakeURL + "/v1/orders", json: ["userId": "u", "productId": "com.example.nothing"])
            #expect(refused.status == 400)
            #expect(refused.errorCode == "unknown_product")
            let missing = try await HTTP.get(pipeline.intakeURL + "/v1/orders/\(UUID().uuidString)?userId=u")
            #expect(missing.status == 404)
        }

        @Test func fiftyConcurrentUploadsOfOnePurchaseGiveOneGrant() async throws {
            let pipeline = try await PipelineHarness.start(name: "fifty")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            let ids = try await withThrowingTaskGroup(of: String.self) { group in
                for _ in 0..<50 {
                    group.addTask {
                        try await pipeline.upload(userId: "omar", receiptData: purchase.receiptData, transactionId: purchase.transactionId)
                    }
                }
                return try await group.reduce(into: []) { $0.append($1) }
            }
            for id in ids {
                let status = try await pipeline.waitForState(id)
                #expect(status["state"] as? String == "credited")
                #expect(status["finishTransaction"] as? Bool == true)
            }
            #expect(try await pipeline.grants(of: "omar").count == 1)
        }

        @Test func replayByASecondUserIsAudited() async throws {
            let pipeline = try await PipelineHarness.start(name: "replayaudit")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            #expect(
                try await pipeline.waitForState(try await pipeline.upload(userId: "pia", receiptData: purchase.receiptData))[
                    "state"] as? String == "credited")
            let replay = try await pipeline.upload(userId: "quinn", receiptData: purchase.receiptData)
            #expect(try await pipeline.waitForState(replay)["reason"] as? String == "replayed_from_other_user")
            let audit = try await pipeline.admin(.GET, "/v1/admin/audit").json["entries"] as? [[String: Any]] ?? []
            #expect(audit.contains { $0["action"] as? String == "replay_refused" && ($0["subject"] as? String)?.contains(replay) == true })
        }

        @Test func manualGrantAndRevokeLandInTheAuditLogAndAdminRoutesNeedTheToken() async throws {
            let pipeline = try await PipelineHarness.start(name: "admin")
            Teardown.add { await pipeline.stop() }
            #expect(try await pipeline.admin(.GET, "/v1/admin/audit", token: nil).status == 401)
            #expect(try await pipeline.admin(.GET, "/v1/admin/audit", token: "a-user-token-not-admin").status == 403)

            let purchase = try await pipeline.mint()
            let id = try await pipeline.upload(userId: "rita", receiptData: purchase.receiptData)
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            let lookup = try await pipeline.admin(.GET, "/v1/admin/purchases/\(purchase.transactionId)")
            #expect(lookup.json["userId"] as? String == "rita")

            let goodwill = try await pipeline.admin(
                .POST, "/v1/admin/grants",
                ["userId": "rita", "productId": "com.example.coins.300", "reason": "outage compensation", "actor": "sam"])
            #expect(goodwill.status == 201, "\(goodwill.text)")
            let revoked = try await pipeline.admin(
                .POST, "/v1/admin/grants/\(purchase.transactionId)/revoke", ["reason": "chargeback", "actor": "sam"])
            #expect(revoked.status == 200, "\(revoked.text)")
            #expect(revoked.json["state"] as? String == "revoked")
            let again = try await pipeline.admin(
                .POST, "/v1/admin/grants/\(purchase.transactionId)/revoke", ["reason": "chargeback", "actor": "sam"])
            #expect(again.status == 409)
            let finishable = try await pipeline.admin(
                .POST, "/v1/admin/submissions/\(id)/finishable", ["reason": "settled by phone", "actor": "sam"])
            #expect(finishable.json["finishTransaction"] as? Bool == true)

            let entries = try await pipeline.admin(.GET, "/v1/admin/audit").json["entries"] as? [[String: Any]] ?? []
            let actions = entries.map { "\($0["actor"] as? String ?? "") \($0["action"] as? String ?? "") \($0["reason"] as? String ?? "")" }
            #expect(actions.contains("sam grant_manual outage compensation"))
            #expect(actions.contains("sam grant_revoked chargeback"))
            #expect(actions.contains("sam submission_finishable settled by phone"))
            let states = try await pipeline.grants(of: "rita").map { $0["state"] as? String ?? "" }.sorted()
            #expect(states == ["active", "revoked"])
        }

        @Test func grantCreatedIsPublishedOncePerGrantEvenWhenTheFinisherDiesAfterItsCommit() async throws {
            // Intake and verifier only: results wait on their queue.
            let pipeline = try await PipelineHarness.start(
                // The results counted are the uploads': no ONE_TIME_CHARGE results beside them.
                name: "events", roles: [.intake, .verifier], oneTimeCharge: false)
            Teardown.add { await pipeline.stop() }
            let names = pipeline.names
            let (listener, listenerQueue) = try TestBroker.eventListener(names, name: "wallet", routingKey: "grant.*")
            #expect(await listener.waitUntilConnected(timeout: .seconds(15)))
            let received = NIOLockedValueBox([Data]())
            let consumer = listener.consume(queue: listenerQueue, prefetch: 50)
            let listening = Task {
                for await delivery in consumer {
                    received.withLockedValue { $0.append(Data(delivery.body)) }
                    try? await delivery.ack()
                }
            }

            var purchases: [PipelineHarness.Purchase] = []
            for index in 0..<5 {
                let purchase = try await pipeline.mint()
                purchases.append(purchase)
                _ = try await pipeline.upload(userId: "wallet-\(index)", receiptData: purchase.receiptData)
            }
            #expect(try await eventually { try await listener.queueStatus(names.results).messageCount == 5 })

            // A finisher that commits each result and dies before its ack: the results go back.
            let policy = CreditPolicy(catalog: PipelineHarness.testCatalog, eventsExchange: names.events)
            var held: [AMQPDelivery] = []
            while let delivery = try await listener.get(names.results) {
                _ = try await pipeline.store.applyCounting(
                    try MessageCodec().decode(VerifyResult.self, from: try delivery.decodedBody()), policy: policy)
                held.append(delivery)
            }
            #expect(held.count == 5)
            // The events of those commits leave through this pipeline's relay first. The next
            // finisher runs a relay of its own on the same store, which a deployment never does
            // on SQLite (one order service, one relay, no claims): two relays there would both
            // publish what neither had deleted yet.
            #expect(try await eventually { try await pipeline.store.outboxBacklog() == 0 })
            for delivery in held { try await delivery.reject(requeue: true) }

            // The next finisher gets them all again.
            let finisher = try await PipelineHarness.start(name: "events-finisher", roles: [.finisher], sharing: pipeline)
            Teardown.add { await finisher.stop() }
            #expect(try await eventually { try await listener.queueStatus(names.results).messageCount == 0 })
            #expect(try await eventually { received.withLockedValue { $0.count } >= 5 })
            try await Task.sleep(for: .seconds(1))

            let events = received.withLockedValue { $0 }.compactMap {
                (try? JSONSerialization.jsonObject(with: $0)) as? [String: Any]
            }
            let created = events.filter { $0["event"] as? String == "grant.created" }
            #expect(created.count == 5, "\(events)")
            #expect(Set(created.compactMap { $0["transactionId"] as? String }) == Set(purchases.map(\.transactionId)))
            #expect(created.allSatisfy { $0["eventId"] as? String == "grant.created:\($0["transactionId"] as? String ?? "")" })
            #expect(created.allSatisfy { ($0["grant"] as? [String: Any])?["coins"] as? Int == 60 })
            await consumer.cancel()
            listening.cancel()
            await listener.close()
        }
    }
}
