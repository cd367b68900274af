import AsyncHTTPClient
import Foundation
import NIOHTTP1
import OrderStore
import Ledger
import Testing
import TestSupport

extension PipelineHarness {
    /// An admin call with a JSON body of any values (numbers, lists).
    func admin(_ method: HTTPMethod, _ path: String, json: [String: Any]) async throws -> HTTP.Answer {
        try await HTTP.send(
            intakeURL + path, method: method, body: try JSONSerialization.data(withJSONObject: json),
            headers: ["Authorization": "Bearer \(Self.adminToken)"])
    }

    /// A subscription to `productId` minted and uploaded by `user` (credited); its original id
    /// and the period's end as Apple signed it.
    func subscribe(_ user: String, productId: String = "com.example.vip.month", extra: [String: Any] = [:]) async throws
        -> (original: String, expires: Date)
    {
        var body: [String: Any] = ["bundleId": Self.bundleId, "productId": productId, "type": "auto_renewable"]
        body.merge(extra) { $1 }
        let minted = try await HTTP.post(fakeURL + "/fake/purchases", raw: try JSONSerialization.data(withJSONObject: body))
        #expect(minted.status == 201, "\(minted.text)")
        let signed = try #require(minted.json["signedTransaction"] as? String)
        let id = try await upload(["userId": user, "signedTransaction": signed])
        let state = try await waitForState(id)["state"] as? String
        // A family member's access is credited as access; a purchase as a purchase.
        #expect(state == "credited", "\(String(describing: state))")
        let expires = try #require(jwsPayload(signed)?["expiresDate"] as? Double)
        return (try #require(minted.json["originalTransactionId"] as? String), Date(timeIntervalSince1970: expires / 1000))
    }

    /// The end of the grant of `original`'s period in force, as the ledger holds it.
    func grantEnd(of original: String) async throws -> Date? {
        try await store.grants(ofTransaction: original).first?.expiresAt
    }
}

extension BrokerTests {
    /// Customer service extends renewal dates at Apple (Extend a Subscription Renewal Date, and
    /// for every active subscriber of a product), audited; Apple's RENEWAL_EXTENDED moves the
    /// grant's end, its RENEWAL_EXTENSION FAILURE and SUMMARY are audited.
    @Suite("Customer service extends renewal dates")
    struct RenewalExtensionTests {
        @Test(arguments: TestStore.backends)
        func aSubscriptionIsExtendedOnceARequestAndAtMostTwiceAYear(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "extend", on: backend)
            Teardown.add { await pipeline.stop() }
            let (original, expires) = try await pipeline.subscribe("ana")
            let path = "/v1/admin/subscriptions/\(original)/extend"
            let good: [String: Any] = ["days": 10, "reasonCode": 3, "reason": "outage on 28 November"]

            // Refused before Apple is asked: each field, and a subscription this store does not hold.
            #expect(try await pipeline.admin(.POST, path, json: ["reasonCode": 3, "reason": "x"]).errorCode == "missing_field")
            #expect(try await pipeline.admin(.POST, path, json: good.merging(["days": 91]) { $1 }).errorCode == "invalid_field")
            #expect(try await pipeline.admin(.POST, path, json: good.merging(["days": true]) { $1 }).errorCode == "invalid_field")
            #expect(try await pipeline.admin(.POST, path, json: good.merging(["reasonCode": 4]) { $1 }).errorCode == "invalid_field")
            #expect(
                try await pipeline.admin(.POST, path, json: good.merging(["requestIdentifier": "not-a-uuid"]) { $1 }).errorCode
                    == "invalid_field")
            #expect(try await pipeline.admin(.POST, path, json: ["days": 10, "reasonCode": 3]).errorCode == "missing_field")
            #expect(
                try await pipeline.admin(.POST, "/v1/admin/subscriptions/2000000000000001/extend", json: good).errorCode
                    == "purchase_not_found")

            let request = UUID().uuidString.lowercased()
            let first = try await pipeline.admin(.POST, path, json: good.merging(["requestIdentifier": request]) { $1 })
            #expect(first.status == 200, "\(first.text)")
            let effective = try #require(first.json["effectiveDate"] as? String)
            let parser = ISO8601DateFormatter()
            parser.formatOptions = [.withInternetDateTime, .withFractionalSeconds]
            let extended = try #require(parser.date(from: effective))
            #expect(abs(extended.timeIntervalSince(expires) - 10 * 86_400) < 2, "\(effective) is not 10 days after \(expires)")
            #expect(first.json["userId"] as? String == "ana" && first.json["requestIdentifier"] as? String == request)
            // Apple's RENEWAL_EXTENDED moves the grant's end.
            let moved = try await eventually(timeout: .seconds(30)) {
                try await pipeline.grantEnd(of: original).map { abs($0.timeIntervalSince(extended)) < 2 } ?? false
            }
            let end = try await pipeline.grantEnd(of: original)
            #expect(moved, "the grant still ends \(String(describing: end))")

            // The same request again is the same extension at Apple.
            let again = try await pipeline.admin(.POST, path, json: good.merging(["requestIdentifier": request]) { $1 })
            #expect(again.status == 200 && again.json["effectiveDate"] as? String == effective, "\(again.text)")
            // A second extension within the year is Apple's to make; a third is refused.
            let second = try await pipeline.admin(.POST, path, json: good.merging(["days": 5]) { $1 })
            #expect(second.status == 200, "\(second.text)")
            let third = try await pipeline.admin(.POST, path, json: good)
            #expect(third.errorCode == "apple_refused" && third.text.contains("4030005"), "\(third.text)")

            let audited = try await pipeline.store.auditLog(limit: 100).filter { $0.action == "renewal_date_extended" }
            #expect(audited.count == 3 && audited.allSatisfy { $0.subject == "subscription:\(original)" && $0.actor == "admin" })
        }

        @Test(arguments: TestStore.backends)
        func appleRefusesWhatItCannotExtend(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "extend-refused", on: backend)
            Teardown.add { await pipeline.stop() }
            let good: [String: Any] = ["days": 3, "reasonCode": 1, "reason": "goodwill"]
            func refusal(_ original: String) async throws -> String {
                let answer = try await pipeline.admin(.POST, "/v1/admin/subscriptions/\(original)/extend", json: good)
                #expect(answer.errorCode == "apple_refused", "\(answer.text)")
                return answer.text
            }
            // A free trial, a family member's access, an expired subscription.
            let trial = try await pipeline.subscribe("tia", extra: ["offerType": 1, "offerDiscountType": "FREE_TRIAL", "price": 0])
            #expect(try await refusal(trial.original).contains("4030004"))
            let shared = try await pipeline.subscribe("fay", extra: ["familyShared": true])
            #expect(try await refusal(shared.original).contains("4030007"))
            let lapsed = try await pipeline.subscribe("lou")
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/subscriptions/\(lapsed.original)/expire", json: [String: String]()).status == 200)
            #expect(try await refusal(lapsed.original).contains("4030004"))
            #expect(try await pipeline.store.auditLog(limit: 100).allSatisfy { $0.action != "renewal_date_extended" }, "nothing changed, nothing audited")
        }

        @Test(arguments: TestStore.backends)
        func everyActiveSubscriberIsExtendedAndApplesSummaryIsAudited(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "mass-extend", on: backend)
            Teardown.add { await pipeline.stop() }
            let ana = try await pipeline.subscribe("ana")
            let bea = try await pipeline.subscribe("bea")
            let cy = try await pipeline.subscribe("cy")
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/subscriptions/\(cy.original)/expire", json: [String: String]()).status == 200)
            let other = try await pipeline.subscribe("dan", productId: "com.example.vip.year")

            #expect(
                try await pipeline.admin(
                    .POST, "/v1/admin/renewal-extensions",
                    json: ["productId": "com.example.coins.60", "days": 7, "reasonCode": 3, "reason": "x"]
                ).errorCode == "invalid_field", "a consumable has no renewal date")
            #expect(
                try await pipeline.admin(
                    .POST, "/v1/admin/renewal-extensions",
                    json: ["productId": "com.example.vip.month", "days": 7, "reasonCode": 3, "reason": "x", "storefrontCountryCodes": ["us"]]
                ).errorCode == "invalid_field")
            let asked = try await pipeline.admin(
                .POST, "/v1/admin/renewal-extensions",
                json: ["productId": "com.example.vip.month", "days": 7, "reasonCode": 3, "reason": "outage", "storefrontCountryCodes": ["USA"]])
            #expect(asked.status == 202, "\(asked.text)")
            let request = try #require(asked.json["requestIdentifier"] as? String)

            // Apple works through it later: polled until complete (bounded).
            let statusPath = "/v1/admin/renewal-extensions/com.example.vip.month/\(request)"
            var status: [String: Any] = [:]
            let complete = try await eventually(timeout: .seconds(30)) {
                status = try await pipeline.admin(.GET, statusPath).json
                return status["complete"] as? Bool == true
            }
            #expect(complete, "\(status)")
            #expect(status["succeededCount"] as? Int == 2 && status["failedCount"] as? Int == 1, "\(status)")
            #expect(
                try await pipeline.admin(.GET, "/v1/admin/renewal-extensions/com.example.vip.year/\(request)").errorCode
                    == "extension_not_found")

            // Each active subscriber's grant runs 7 days longer; the lapsed one's and the other product's do not.
            for subscriber in [ana, bea] {
                let moved = try await eventually(timeout: .seconds(30)) {
                    try await pipeline.grantEnd(of: subscriber.original).map { $0.timeIntervalSince(subscriber.expires) > 7 * 86_400 - 2 } ?? false
                }
                #expect(moved, "\(subscriber.original)")
            }
            #expect(try await pipeline.grantEnd(of: other.original).map { abs($0.timeIntervalSince(other.expires)) < 2 } == true)

            // The request, Apple's failure for the lapsed subscription and its summary are audited.
            let audited = try await eventually(timeout: .seconds(30)) {
                let actions = Set(try await pipeline.store.auditLog(limit: 200).map(\.action))
                return actions.isSuperset(of: ["renewal_extension_requested", "renewal_extension_failed", "renewal_extension_completed"])
            }
            #expect(audited)
            let log = try await pipeline.store.auditLog(limit: 200)
            let summary = try #require(log.first { $0.action == "renewal_extension_completed" })
            #expect(summary.subject == "renewal_extension:\(request)" && summary.actor == "apple")
            let details = try #require(
                try JSONSerialization.jsonObject(with: Data((summary.details ?? "{}").utf8)) as? [String: String])
            #expect(details["succeededCount"] == "2" && details["failedCount"] == "1", "\(details)")
            #expect(log.first { $0.action == "renewal_extension_failed" }?.subject == "subscription:\(cy.original)")
        }
    }
}
