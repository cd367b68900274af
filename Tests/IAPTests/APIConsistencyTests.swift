import Foundation
import IAPCore
import Intake
import NIOHTTP1
import OrderStore
import Ledger
import Testing
import TestSupport

extension BrokerTests {
    /// The same situation answers the same code on every route; dev mode (authentication off)
    /// has production's rules but for the login; subscriptions and entitlements are visible
    /// from the first upload; the polled status follows what happens to the purchase.
    @Suite("API consistency")
    struct APIConsistencyTests {
        static let admin = ["Authorization": "Bearer \(PipelineHarness.adminToken)"]

        /// The statuses of `count` requests sent at once, in ascending order.
        static func atOnce(_ count: Int, _ request: @escaping @Sendable () async throws -> Int) async throws -> [Int] {
            try await withThrowingTaskGroup(of: Int.self) { group in
                for _ in 0..<count { group.addTask { try await request() } }
                return try await group.reduce(into: []) { $0.append($1) }.sorted()
            }
        }

        @Test func theSameSituationAnswersTheSameCodeOnEveryRoute() async throws {
            let pipeline = try await PipelineHarness.startAuthenticated(name: "samecode")
            Teardown.add { await pipeline.stop() }
            let base = pipeline.intakeURL
            let unknownTransaction = "2999999999999999"
            let unknownSubmission = UUID().uuidString

            // An unknown transaction: purchase_not_found on every admin route that names one.
            let lookups: [(HTTPMethod, String, [String: String]?)] = [
                (.GET, "/v1/admin/purchases/\(unknownTransaction)", nil),
                (.POST, "/v1/admin/grants", ["userId": "ana", "transactionId": unknownTransaction, "productId": "com.example.coins.60", "reason": "test"]),
                (.POST, "/v1/admin/grants/\(unknownTransaction)/revoke", ["reason": "test"]),
            ]
            for (method, path, body) in lookups {
                let answer = try await HTTP.send(
                    base + path, method: method, body: try body.map { try JSONEncoder().encode($0) }, headers: Self.admin)
                #expect(answer.status == 404 && answer.errorCode == "purchase_not_found", "\(method) \(path): \(answer.text)")
            }
            // An unknown submission: submission_not_found for the app and for customer service.
            let ana = try await TestTokens.hs256(.init("ana"))
            let status = try await UserHTTP.send(.GET, base + "/v1/receipts/\(unknownSubmission)", token: ana)
            #expect(status.status == 404 && status.errorCode == "submission_not_found", "\(status.text)")
            for id in [unknownSubmission, "not-a-uuid"] {
                let finishable = try await HTTP.send(
                    base + "/v1/admin/submissions/\(id)/finishable", method: .POST,
                    body: try JSONEncoder().encode(["reason": "test"]), headers: Self.admin)
                #expect(finishable.status == 404 && finishable.errorCode == "submission_not_found", "\(finishable.text)")
            }
            // No token: unauthenticated on user and admin routes alike, with WWW-Authenticate.
            for path in ["/v1/users/ana/grants", "/v1/receipts/\(unknownSubmission)", "/v1/admin/audit", "/v1/admin/purchases/1"] {
                let answer = try await HTTP.get(base + path)
                #expect(answer.status == 401 && answer.errorCode == "unauthenticated", "\(path): \(answer.text)")
                #expect(answer.headers.first(name: "WWW-Authenticate")?.hasPrefix("Bearer") == true, "\(path)")
            }
            // Another user's data: 404 user_not_found, as if it did not exist.
            let bob = try await TestTokens.hs256(.init("bob"))
            for route in ["grants", "subscriptions", "entitlements"] {
                let answer = try await UserHTTP.send(.GET, base + "/v1/users/ana/\(route)", token: bob)
                #expect(answer.status == 404 && answer.errorCode == "user_not_found", "\(route): \(answer.text)")
                #expect(try await UserHTTP.send(.GET, base + "/v1/users/ana/\(route)", token: ana).status == 200)
            }
        }

        @Test func devModeHasProductionsRulesButTheLogin() async throws {
            let pipeline = try await PipelineHarness.start(
                name: "devparity", limits: IntakeLimits(perUser: RateLimit(perSecond: 1, burst: 3), perAddress: nil))
            Teardown.add { await pipeline.stop() }
            let base = pipeline.intakeURL
            let purchase = try await pipeline.mint()
            let id = try await pipeline.upload(userId: "ana", receiptData: purchase.receiptData)
            // Waited for in the store: polling the status as ana would spend her bucket (1/s,
            // burst 3) for as long as the credit takes.
            let credited = try await eventually(timeout: .seconds(30)) {
                try await pipeline.store.status(of: try #require(UUID(uuidString: id)))?.state.isTerminal == true
            }
            #expect(credited)
            // The upload took from ana's bucket: let it fill again.
            try await Task.sleep(for: .seconds(3.2))

            // Ownership: the user the request names reads only their own.
            #expect(try await HTTP.get(base + "/v1/receipts/\(id)?userId=ana").status == 200)
            // A read that names no user is refused as production refuses one without a token.
            let nobody = try await HTTP.get(base + "/v1/receipts/\(id)")
            #expect(nobody.status == 401 && nobody.errorCode == "unauthenticated", "\(nobody.text)")
            let theirs = try await HTTP.get(base + "/v1/receipts/\(id)?userId=bob")
            #expect(theirs.status == 404 && theirs.errorCode == "submission_not_found", "\(theirs.text)")
            let grants = try await HTTP.get(base + "/v1/users/ana/grants?userId=bob")
            #expect(grants.status == 404 && grants.errorCode == "user_not_found", "\(grants.text)")
            let order = try await HTTP.post(base + "/v1/orders", json: ["userId": "ana", "productId": "com.example.coins.60"])
            let orderId = try #require(order.json["orderId"] as? String, "\(order.text)")
            let otherOrder = try await HTTP.get(base + "/v1/orders/\(orderId)?userId=bob")
            #expect(otherOrder.status == 404 && otherOrder.errorCode == "order_not_found", "\(otherOrder.text)")
            let mismatch = try await HTTP.post(
                base + "/v1/orders?userId=frank", json: ["userId": "ana", "productId": "com.example.coins.60"])
            #expect(mismatch.status == 403 && mismatch.errorCode == "user_mismatch", "\(mismatch.text)")

            // The per-user rate limit: carol's burst of 3 on GETs, then 429; dave is not held back.
            // Four requests at once, so that all of them meet the bucket within its second
            // however long each takes to answer on a loaded machine.
            let statuses = try await Self.atOnce(4) { try await HTTP.get(base + "/v1/users/carol/grants").status }
            #expect(statuses == [200, 200, 200, 429])
            #expect(try await HTTP.get(base + "/v1/users/dave/entitlements").status == 200)
            // ...and on bodies that name the user.
            let posts = try await Self.atOnce(4) {
                try await HTTP.post(base + "/v1/orders", json: ["userId": "erin", "productId": "com.example.coins.60"]).status
            }
            #expect(posts == [201, 201, 201, 429])
        }

        @Test func aSubscriptionShowsFromItsFirstUploadAndFollowsRenewals() async throws {
            let pipeline = try await PipelineHarness.start(name: "entitlements")
            Teardown.add { await pipeline.stop() }
            let base = pipeline.intakeURL
            let minted = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases",
                json: ["bundleId": PipelineHarness.bundleId, "productId": "com.example.vip.month", "type": "auto_renewable"])
            #expect(minted.status == 201, "\(minted.text)")
            let original = try #require(minted.json["originalTransactionId"] as? String)
            let id = try await pipeline.upload(userId: "sam", receiptData: try #require(minted.json["receiptData"] as? String))
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            // Coins too, for a balance.
            for _ in 0..<2 {
                let coins = try await pipeline.mint(productId: "com.example.coins.60")
                _ = try await pipeline.waitForState(try await pipeline.upload(userId: "sam", receiptData: coins.receiptData))
            }

            func subscription() async throws -> [String: Any] {
                let answer = try await HTTP.get(base + "/v1/users/sam/subscriptions")
                return (answer.json["subscriptions"] as? [[String: Any]])?.first { $0["originalTransactionId"] as? String == original } ?? [:]
            }
            let first = try await subscription()
            #expect(first["state"] as? String == "active", "\(first)")
            #expect(first["productId"] as? String == "com.example.vip.month")
            #expect(first["environment"] as? String == "Production")
            let firstExpiry = try #require(first["expiresDate"] as? String, "no expiry without a notification: \(first)")

            let entitlements = try await HTTP.get(base + "/v1/users/sam/entitlements").json
            #expect((entitlements["balances"] as? [String: Int])?["coins"] == 120, "\(entitlements)")
            let grants = entitlements["grants"] as? [[String: Any]] ?? []
            let vip = grants.first { $0["productId"] as? String == "com.example.vip.month" }
            #expect(vip?["expiresAt"] as? String != nil, "\(grants)")
            #expect((entitlements["subscriptions"] as? [[String: Any]])?.count == 1, "\(entitlements)")

            // A renewal at the fake (DID_RENEW to the intake) moves the expiry on.
            let renewal = try await HTTP.post(pipeline.fakeURL + "/fake/subscriptions/\(original)/renew", json: [String: String]())
            #expect(renewal.status == 201, "\(renewal.text)")
            var renewed: [String: Any] = [:]
            #expect(try await eventually(timeout: .seconds(20)) {
                renewed = try await subscription()
                return (renewed["expiresDate"] as? String ?? "") > firstExpiry
            }, "the expiry stayed \(firstExpiry): \(renewed)")
            let after = try await HTTP.get(base + "/v1/users/sam/entitlements").json
            let periods = (after["grants"] as? [[String: Any]] ?? []).filter { $0["productId"] as? String == "com.example.vip.month" }
            #expect(periods.count >= 1, "\(after)")
        }

        @Test func aHeldPurchaseGrantedByCustomerServiceReadsCreditedInThePoll() async throws {
            let pipeline = try await PipelineHarness.start(name: "heldpoll")
            Teardown.add { await pipeline.stop() }
            let base = pipeline.intakeURL
            let unknown = try await pipeline.mint(productId: "com.example.not-in-catalog")
            let id = try await pipeline.upload(userId: "hana", receiptData: unknown.receiptData)
            let held = try await pipeline.waitForState(id)
            #expect(held["state"] as? String == "needs_review", "\(held)")
            #expect((held["transactions"] as? [[String: Any]])?.first?["state"] as? String == "held")

            let grant = try await HTTP.send(
                base + "/v1/admin/grants", method: .POST,
                body: try JSONEncoder().encode([
                    "userId": "hana", "transactionId": unknown.transactionId, "productId": "com.example.coins.60",
                    "reason": "sold before the catalog listed it", "actor": "cs-olga",
                ]), headers: Self.admin)
            #expect(grant.status == 201, "\(grant.text)")
            let polled = try await pipeline.status(id)
            let transaction = (polled["transactions"] as? [[String: Any]])?.first
            #expect(transaction?["state"] as? String == "credited", "\(polled)")
            #expect(transaction?["grantedBy"] as? String == "cs-olga", "\(polled)")
        }
    }
}
