import AppStore
import FakeAppStore
import Foundation
import GRDB
import Hummingbird
import IAPCore
import Intake
import Logging
import Messaging
import NIOConcurrencyHelpers
import NIOFoundationCompat
import NIOHTTP1
import Pipeline
@testable import OrderStore
@testable import Store
import Ledger
import ServiceLifecycle
import Testing
import TestSupport

/// Notifications signed by a chain that is not the App Store's (the fake's) but otherwise
/// well formed: what an attacker can make.
enum ForgedNotification {
    static func make(signer: FakeCertificateAuthority, padding: Int = 0) throws -> String {
        let now = Date().appleMilliseconds
        let transaction = try signer.signJWS(
            JWSTransactionDecodedPayload(
                transactionId: "2999999999999999", originalTransactionId: "2999999999999999",
                bundleId: PipelineHarness.bundleId, productId: "com.example.coins.300", environment: "Production",
                purchaseDate: now, quantity: 1, type: "Consumable", signedDate: now))
        var payload = ResponseBodyV2DecodedPayload(
            notificationType: "REFUND", subtype: nil, notificationUUID: UUID().uuidString,
            data: .init(
                appAppleId: FakeAppStore.defaultAppAppleId, bundleId: PipelineHarness.bundleId, environment: "Production",
                signedTransactionInfo: transaction),
            signedDate: now)
        payload.subtype = padding > 0 ? String(repeating: "A", count: padding) : nil
        return try signer.signJWS(payload)
    }
}

extension BrokerTests {
    @Suite("The App Store notification endpoint checks before it stores")
    struct NotificationEndpointTests {
        /// Ready messages on a queue of the pipeline, seen from a connection of the test's own.
        func readyMessages(_ queue: String) async throws -> Int {
            let connection = AMQPConnection(
                configuration: try TestBroker.configuration(), topology: Topology(queues: []), logger: TestBroker.logger)
            do {
                #expect(await connection.waitUntilConnected(timeout: .seconds(15)))
                let count = Int(try await connection.queueStatus(queue).messageCount)
                await connection.close()
                return count
            } catch {
                await connection.close()
                throw error
            }
        }

        func storedSubmissions(_ pipeline: PipelineHarness) async throws -> Int {
            try await pipeline.store.submissionCounts().values.reduce(0, +)
        }

        @Test func forgedNotificationsAreRefusedAndNothingIsStoredOrQueued() async throws {
            // The intake alone: whatever it queues stays on the verify queue to be counted.
            let pipeline = try await PipelineHarness.start(name: "notifyforged", roles: [.intake])
            Teardown.add { await pipeline.stop() }
            let url = pipeline.intakeURL + "/v1/notifications/appstore"
            let stranger = try FakeCertificateAuthority.generate(name: "Not Apple")

            let forged = try await HTTP.post(url, json: ["signedPayload": try ForgedNotification.make(signer: stranger)])
            #expect(forged.status == 403 && forged.errorCode == "jws_untrusted_chain", "\(forged.text)")
            // A chain without Apple's marker on the leaf, and a payload that is no notification.
            let unmarked = try FakeCertificateAuthority.generate(name: "Almost Apple", leafMarker: false)
            let noMarker = try await HTTP.post(url, json: ["signedPayload": try ForgedNotification.make(signer: unmarked)])
            #expect(noMarker.status == 403 && noMarker.errorCode == "jws_missing_apple_extension", "\(noMarker.text)")
            let junk = try await HTTP.post(
                url, json: ["signedPayload": "eyJhbGciOiJFUzI1NiJ9.eyJub3RpZmljYXRpb25UeXBlIjoiVEVTVCJ9.c2lnbmF0dXJl"])
            #expect(junk.status == 400 && junk.errorCode == "jws_malformed", "\(junk.text)")
            // Signed by the App Store (the fake) for another app: refused for its bundle id.
            let otherApp = try await pipeline.mint(bundleId: "com.example.someone-else")
            _ = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(otherApp.transactionId)/refund", json: [String: String]())

            #expect(try await storedSubmissions(pipeline) == 0)
            #expect(try await pipeline.store.outboxBacklog() == 0)
            #expect(try await readyMessages(pipeline.names.verify) == 0)

            // The same path takes the App Store's own: stored and queued once.
            let purchase = try await pipeline.mint()
            let refund = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            // Its ONE_TIME_CHARGE, then its REFUND.
            #expect(try await storedSubmissions(pipeline) == 2)
            #expect(try await eventually(timeout: .seconds(10)) { try await readyMessages(pipeline.names.verify) == 2 })
        }

        /// A StoreKit 2 purchase credited to `user`, then refunded at the fake (which sends REFUND).
        func creditedThenRefunded(_ pipeline: PipelineHarness, user: String) async throws -> PipelineHarness.Purchase {
            let purchase = try await pipeline.mintStoreKit2()
            let id = try await pipeline.upload(["userId": user, "signedTransaction": try #require(purchase.signedTransaction)])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            let refund = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            return purchase
        }

        @Test func aGenuineRefundStillRevokesTheGrant() async throws {
            let pipeline = try await PipelineHarness.start(name: "notifygenuine")
            Teardown.add { await pipeline.stop() }
            let purchase = try await creditedThenRefunded(pipeline, user: "nina")
            let revoked = try await eventually(timeout: .seconds(20)) {
                try await pipeline.grantState(of: purchase.transactionId, user: "nina") == "revoked"
            }
            #expect(revoked)
            #expect(try await pipeline.store.notifications(ofTransaction: purchase.transactionId).map(\.type) == ["ONE_TIME_CHARGE", "REFUND"])
        }

        @Test func aNotificationAppliedAlreadyIsAnsweredButNeverStoredAgain() async throws {
            let pipeline = try await PipelineHarness.start(name: "notifyreplay")
            Teardown.add { await pipeline.stop() }
            let purchase = try await creditedThenRefunded(pipeline, user: "nina")
            // Both of Apple's notifications applied (the purchase's ONE_TIME_CHARGE, then its
            // REFUND): counted before, one could still be on its way and be stored after.
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.notifications(ofTransaction: purchase.transactionId).map(\.type)
                        == ["ONE_TIME_CHARGE", "REFUND"]
                })
            let stored = try await storedSubmissions(pipeline)
            // Apple's retry of it and a third party's replay: the same bytes, answered 200 each
            // time (Apple stops retrying only on a 200) and stored no more.
            for _ in 0..<3 {
                let again = try await HTTP.post(
                    pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/notify-again", json: ["notificationType": "REFUND"])
                #expect(again.status == 200 && again.json["sendAttempt"] as? String == "SUCCESS", "\(again.text)")
            }
            #expect(try await storedSubmissions(pipeline) == stored)
            #expect(try await pipeline.store.outboxBacklog() == 0)
            #expect(try await pipeline.store.notifications(ofTransaction: purchase.transactionId).map(\.type) == ["ONE_TIME_CHARGE", "REFUND"])
            #expect(try await pipeline.grantState(of: purchase.transactionId, user: "nina") == "revoked")
        }

        /// Apple refunds one of three packs of a consumable (REFUND_PRORATED, 33,333 milli-units of
        /// 100 %): the grant keeps two, and `grant.revoked` says one was taken. A larger prorated
        /// refund leaves one; Apple's reversal gives all three back. A family member's access
        /// revoked (REVOKE, FAMILY_REVOKE) takes the whole purchase back.
        @Test func aProratedRefundTakesBackItsShareOfTheUnits() async throws {
            struct Mint: Encodable {
                var bundleId = PipelineHarness.bundleId
                var productId = "com.example.coins.60"
                var quantity = 3
            }
            struct Refund: Encodable {
                var revocationType: String
                var revocationPercentage: Int?
            }
            let pipeline = try await PipelineHarness.start(name: "prorated")
            Teardown.add { await pipeline.stop() }
            let minted = try await HTTP.post(pipeline.fakeURL + "/fake/purchases", json: Mint())
            #expect(minted.status == 201, "\(minted.text)")
            let purchase = try JSONDecoder().decode(PipelineHarness.Purchase.self, from: minted.body)
            let id = try await pipeline.upload(["userId": "nina", "signedTransaction": try #require(purchase.signedTransaction)])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            func units() async throws -> Int? {
                try await pipeline.store.grants(ofTransaction: purchase.transactionId).first.flatMap { $0.state == .active ? $0.quantity : nil }
            }
            #expect(try await units() == 3)
            let refundURL = pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/refund"

            let one = try await HTTP.post(refundURL, json: Refund(revocationType: "REFUND_PRORATED", revocationPercentage: 33_333))
            #expect(one.status == 200 && one.json["revocationPercentage"] as? Int == 33_333, "\(one.text)")
            #expect(try await eventually(timeout: .seconds(20)) { try await units() == 2 })
            let grant = try #require(try await pipeline.store.grants(ofTransaction: purchase.transactionId).first)
            #expect(grant.grantJSON == #"{"coins":120}"#)

            let two = try await HTTP.post(refundURL, json: Refund(revocationType: "REFUND_PRORATED", revocationPercentage: 66_667))
            #expect(two.status == 200, "\(two.text)")
            #expect(try await eventually(timeout: .seconds(20)) { try await units() == 1 })
            let outcomes = try await pipeline.store.notifications(ofTransaction: purchase.transactionId)
            // Apple's ONE_TIME_CHARGE of the purchase came first (recorded: it named no order).
            let refunds = outcomes.filter { $0.type == "REFUND" }
            #expect(outcomes.first?.type == "ONE_TIME_CHARGE" && outcomes.count == 3, "\(outcomes)")
            #expect(refunds.count == 2 && refunds.allSatisfy { $0.outcome == "partly_revoked" }, "\(outcomes)")

            let reversed = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/notify", json: ["notificationType": "REFUND_REVERSED"])
            #expect(reversed.status == 200, "\(reversed.text)")
            #expect(try await eventually(timeout: .seconds(20)) { try await units() == 3 })

            // Nonsense is refused by the fake as Apple would never send it.
            let bad = try await HTTP.post(refundURL, json: Refund(revocationType: "REFUND_PRORATED", revocationPercentage: nil))
            #expect(bad.status == 400, "\(bad.text)")
            let family = try await HTTP.post(refundURL, json: Refund(revocationType: "FAMILY_REVOKE"))
            #expect(family.status == 200 && family.json["notificationType"] as? String == "REVOKE", "\(family.text)")
            #expect(try await eventually(timeout: .seconds(20)) { try await units() == nil })
            #expect(try await pipeline.grantState(of: purchase.transactionId, user: "nina") == "revoked")
        }

        /// Apple declined a refund the customer asked for: recorded, and the grant stays.
        @Test func aDeclinedRefundIsRecordedAndTheGrantStays() async throws {
            let pipeline = try await PipelineHarness.start(name: "declined")
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mintStoreKit2()
            // Apple's ONE_TIME_CHARGE for the purchase, applied before the app's upload (the two
            // race through the pipeline otherwise): it names no order, so it is kept for its buyer.
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.testRows(
                        "SELECT outcome FROM notification WHERE transactionId = ? AND outcome IS NOT NULL", [purchase.transactionId]
                    ).count == 1
                })
            let id = try await pipeline.upload(["userId": "nina", "signedTransaction": try #require(purchase.signedTransaction)])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            let declined = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/decline-refund", json: [String: String]())
            #expect(declined.status == 200, "\(declined.text)")
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.notifications(ofTransaction: purchase.transactionId).map(\.type)
                        == ["ONE_TIME_CHARGE", "REFUND_DECLINED"]
                })
            #expect(try await pipeline.grantState(of: purchase.transactionId, user: "nina") == "active")
            let rows = try await pipeline.store.testRows(
                "SELECT outcome FROM notification WHERE transactionId = ?", [purchase.transactionId])
            // The purchase's ONE_TIME_CHARGE named no order (owner_unknown: kept for its buyer's upload).
            #expect(rows.map { $0["outcome"] as String }.sorted() == ["declined", "owner_unknown"])
        }

        /// `RESCIND_CONSENT` names the app, not a purchase (`appData`, no `data`): answered 200,
        /// recorded, audited, and published as `consent.rescinded` with the customer's
        /// `appTransactionId`, for the app's own services to act on.
        @Test func aConsentRescindedIsRecordedAuditedAndPublished() async throws {
            let pipeline = try await PipelineHarness.start(name: "rescind")
            Teardown.add { await pipeline.stop() }
            let (listener, queue) = try TestBroker.eventListener(pipeline.names, name: "consent", routingKey: "consent.*")
            Teardown.add { await listener.close() }
            #expect(await listener.waitUntilConnected(timeout: .seconds(15)))

            let rescind = try await HTTP.post(pipeline.fakeURL + "/fake/rescind-consent", json: ["bundleId": PipelineHarness.bundleId])
            #expect(rescind.status == 200, "\(rescind.text)")
            let uuid = try #require(rescind.json["notificationUUID"] as? String)
            let appTransactionId = try #require(rescind.json["appTransactionId"] as? String)
            var event: [String: Any]?
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    if let delivery = try await listener.get(queue) {
                        event = (try? JSONSerialization.jsonObject(with: Data(delivery.body))) as? [String: Any]
                        try await delivery.ack()
                    }
                    return event != nil
                })
            #expect(event?["event"] as? String == "consent.rescinded")
            #expect(event?["eventId"] as? String == "consent.rescinded:\(uuid)")
            #expect(event?["appTransactionId"] as? String == appTransactionId)
            #expect(event?["bundleId"] as? String == PipelineHarness.bundleId)
            let rows = try await pipeline.store.testRows(
                "SELECT outcome FROM notification WHERE notificationUUID = ?", [uuid])
            #expect(rows.map { $0["outcome"] as String } == ["recorded"])
            let entries = try await pipeline.store.auditLog(limit: 20)
            #expect(entries.contains { $0.action == "consent_rescinded" && $0.actor == "apple" && $0.subject == "app:\(PipelineHarness.bundleId)" })
        }

        /// Apple's EXTERNAL_PURCHASE_TOKEN (a purchase made outside the App Store, its token
        /// never reported) is about no App Store purchase: verified by the token's app and the
        /// environment its id says, recorded, and nothing is credited; another app's is refused.
        @Test func anExternalPurchaseTokenIsRecordedAndCreditsNothing() async throws {
            let pipeline = try await PipelineHarness.start(name: "external-token")
            Teardown.add { await pipeline.stop() }
            let before = try await pipeline.store.testRows("SELECT id FROM grants")
            for environment in ["Production", "Sandbox"] {
                let sent = try await HTTP.post(
                    pipeline.fakeURL + "/fake/external-purchase-tokens",
                    json: ["bundleId": PipelineHarness.bundleId, "environment": environment, "tokenType": "CORE_TECHNOLOGY"])
                #expect(sent.status == 200, "\(sent.text)")
                let uuid = try #require(sent.json["notificationUUID"] as? String)
                var rows: [SQLRow] = []
                let recorded = try await eventually(timeout: .seconds(20)) {
                    rows = try await pipeline.store.testRows(
                        "SELECT notificationType, subtype, environment, outcome FROM notification WHERE notificationUUID = ?", [uuid])
                    return !rows.isEmpty
                }
                #expect(recorded, "\(environment): the token was not recorded")
                #expect(rows.first?["notificationType"] as String? == "EXTERNAL_PURCHASE_TOKEN")
                #expect(rows.first?["subtype"] as String? == "UNREPORTED")
                #expect(rows.first?["environment"] as String? == environment)
                #expect(rows.first?["outcome"] as String? == "recorded")
            }
            #expect(try await pipeline.store.testRows("SELECT id FROM grants").count == before.count)
            // Signed by the App Store for another app: refused at the door.
            let other = try await HTTP.post(
                pipeline.fakeURL + "/fake/external-purchase-tokens", json: ["bundleId": "com.example.someone-else"])
            let payload = try #require(other.json["signedPayload"] as? String)
            let refused = try await HTTP.post(pipeline.intakeURL + "/v1/notifications/appstore", json: ["signedPayload": payload])
            #expect(refused.status == 403 && refused.errorCode == "bundle_id_mismatch", "\(refused.text)")
        }

        @Test func anOversizedNotificationGets413AndABurstOfForgeriesGets429WhileTheServiceKeepsServing() async throws {
            let pipeline = try await PipelineHarness.start(
                name: "notifylimits", roles: [.intake],
                limits: IntakeLimits(
                    perUser: nil, perAddress: nil, notifications: nil,
                    notificationFailuresPerAddress: RateLimit(perSecond: 2, burst: 4)))
            Teardown.add { await pipeline.stop() }
            let url = pipeline.intakeURL + "/v1/notifications/appstore"
            let stranger = try FakeCertificateAuthority.generate(name: "Not Apple")

            // Apple's notifications are a few KB; 208 KB is the size of the measured attack.
            let large = try await HTTP.post(
                url, json: ["signedPayload": try ForgedNotification.make(signer: stranger, padding: 152 * 1024)])
            #expect(large.status == 413 && large.errorCode == "body_too_large", "\(large.text)")

            let payload = try ForgedNotification.make(signer: stranger)
            var statuses: [Int] = []
            var retryAfter: String?
            for _ in 0..<12 {
                let answer = try await HTTP.post(url, json: ["signedPayload": payload])
                statuses.append(answer.status)
                if answer.status == 429 {
                    #expect(answer.errorCode == "rate_limited", "\(answer.text)")
                    retryAfter = answer.headers.first(name: "Retry-After")
                }
            }
            #expect(statuses.contains(429) && Set(statuses).isSubset(of: [403, 429]), "\(statuses)")
            #expect(Int(retryAfter ?? "") ?? 0 >= 1, "Retry-After: \(retryAfter ?? "missing")")
            // Uploads are not held back by the notifications' bucket, and the endpoint recovers.
            let unknown = try await HTTP.get(pipeline.intakeURL + "/v1/receipts/\(UUID().uuidString)?userId=nina")
            #expect(unknown.status == 404 && unknown.errorCode == "submission_not_found", "\(unknown.text)")
            let recovered = try await eventually(timeout: .seconds(5), interval: .milliseconds(250)) {
                try await HTTP.post(url, json: ["signedPayload": payload]).status == 403
            }
            #expect(recovered)
            #expect(try await storedSubmissions(pipeline) == 0)
        }

        /// The attack of one address against Apple's notifications: while it floods the
        /// endpoint with body-less posts and forged notifications from many connections, the
        /// App Store (the fake, from another address) refunds a purchase, and its REFUND is
        /// taken and applied. The flood spends its own address's budget (429), never Apple's.
        @Test func aFloodOfForgedAndBodylessNotificationsNeverKeepsAGenuineRefundOut() async throws {
            let pipeline = try await PipelineHarness.start(
                name: "notifystarve",
                limits: IntakeLimits(
                    perUser: nil, perAddress: nil, clientAddresses: EdgeHarness.behindLocalProxy,
                    notifications: RateLimit(perSecond: 2, burst: 4),
                    notificationFailuresPerAddress: RateLimit(perSecond: 2, burst: 4)))
            Teardown.add { await pipeline.stop() }
            let url = pipeline.intakeURL + "/v1/notifications/appstore"
            let purchase = try await pipeline.mintStoreKit2()
            let id = try await pipeline.upload(["userId": "nina", "signedTransaction": try #require(purchase.signedTransaction)])
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")

            let forged = try ForgedNotification.make(signer: try FakeCertificateAuthority.generate(name: "Not Apple"))
            let attacker = ["X-Real-IP": "203.0.113.7"]
            let flooding = NIOLockedValueBox(true)
            let sent = NIOLockedValueBox(0)
            let flood = Task {
                try await withThrowingTaskGroup(of: [Int: Int].self) { group in
                    for connection in 0..<16 {
                        group.addTask {
                            var statuses: [Int: Int] = [:]
                            var index = connection
                            while flooding.withLockedValue({ $0 }) {
                                let body = index.isMultiple(of: 2) ? nil : try JSONEncoder().encode(["signedPayload": forged])
                                let answer = try await HTTP.send(url, method: .POST, body: body, headers: attacker)
                                statuses[answer.status, default: 0] += 1
                                sent.withLockedValue { $0 += 1 }
                                index += 1
                            }
                            return statuses
                        }
                    }
                    var all: [Int: Int] = [:]
                    for try await statuses in group { all.merge(statuses, uniquingKeysWith: +) }
                    return all
                }
            }
            // Apple's refund comes once the flood is in full swing (a hundred requests in, however
            // long a loaded machine takes to send them), and the flood goes on until it is applied.
            #expect(try await eventually(timeout: .seconds(20), interval: .milliseconds(20)) { sent.withLockedValue { $0 } > 100 })
            let refund = try await HTTP.post(
                pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            let revoked = try await eventually(timeout: .seconds(20)) {
                try await pipeline.grantState(of: purchase.transactionId, user: "nina") == "revoked"
            }
            flooding.withLockedValue { $0 = false }
            let statuses = try await flood.value
            #expect(revoked, "the genuine REFUND was not applied during the flood: \(statuses)")
            #expect(try await pipeline.store.notifications(ofTransaction: purchase.transactionId).map(\.type) == ["ONE_TIME_CHARGE", "REFUND"])
            // The flood was refused by its own address's bucket, and never stored.
            #expect(statuses[429, default: 0] > 0 && Set(statuses.keys).isSubset(of: [400, 403, 429]), "\(statuses)")
            #expect(statuses.values.reduce(0, +) > 100, "the flood was too thin to mean anything: \(statuses)")
        }

        /// Points the fake App Store's notifications at a catcher of their own: what it sends,
        /// kept for the test to deliver when it chooses.
        static func catchNotifications(of pipeline: PipelineHarness) async throws -> NIOLockedValueBox<[Data]> {
            let caught = NIOLockedValueBox([Data]())
            let router = Router()
            router.post("/notifications") { request, _ -> Response in
                let body = Data(buffer: try await request.body.collect(upTo: 1 << 20))
                caught.withLockedValue { $0.append(body) }
                return Response(status: .ok)
            }
            let catcher = try await LoopbackServer.start(router, name: "the notification catcher")
            Teardown.add { await catcher.group.triggerGracefulShutdown() }
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/config", json: ["notificationURL": catcher.base + "/notifications"]).status == 204)
            return caught
        }

        /// The flood drill, from Apple's own address (every request from one client, no proxy):
        /// 2,000 forged, junk and transfer-coded notifications as fast as 16 connections send
        /// them, with the production defaults' limits, and 20 genuine REFUNDs interleaved. Every
        /// genuine one is answered 200 on its first delivery (Apple may never retry a refused
        /// one) and applied; nothing is answered 5xx; nothing is logged at error. The flood must
        /// have landed: its own refusals reached 429.
        @Test func twoThousandJunkNotificationsNeverKeepTwentyGenuineOnesOut() async throws {
            let errorLines = NIOLockedValueBox([String]())
            let pipeline = try await PipelineHarness.start(
                name: "notifydrill", limits: IntakeLimits(perUser: nil),
                logger: Logger(label: "iap.tests.drill") { _ in ErrorRecorder(lines: errorLines) })
            Teardown.add { await pipeline.stop() }
            let url = pipeline.intakeURL + "/v1/notifications/appstore"
            // Twenty credited purchases, and Apple's REFUND of each, caught on its way.
            var purchases: [PipelineHarness.Purchase] = []
            for index in 0..<20 {
                let purchase = try await pipeline.mint(deviceId: "drill-\(index)")
                let id = try await pipeline.upload(userId: "user-\(index)", receiptData: purchase.receiptData, transactionId: purchase.transactionId)
                #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
                purchases.append(purchase)
            }
            let caught = try await Self.catchNotifications(of: pipeline)
            for purchase in purchases {
                #expect(try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/refund", json: [String: String]()).status == 200)
            }
            let genuine = caught.withLockedValue { $0 }
            try #require(genuine.count == 20, "caught \(genuine.count) of Apple's REFUNDs")

            let forged = try JSONEncoder().encode(["signedPayload": try ForgedNotification.make(signer: try FakeCertificateAuthority.generate(name: "Not Apple"))])
            let port = EdgeHarness.port(pipeline.intakeURL)
            let statuses = NIOLockedValueBox([Int: Int]())
            let genuineStatuses = NIOLockedValueBox([Int]())
            let next = NIOLockedValueBox(0)
            try await withThrowingTaskGroup(of: Void.self) { group in
                for _ in 0..<16 {
                    group.addTask {
                        while true {
                            let index = next.withLockedValue { value in defer { value += 1 }; return value }
                            guard index < 2_020 else { return }
                            if index % 101 == 50 {
                                let answer = try await HTTP.post(url, raw: genuine[index / 101])
                                genuineStatuses.withLockedValue { $0.append(answer.status) }
                                continue
                            }
                            let status: Int
                            switch index % 4 {
                            case 0: status = try await HTTP.send(url, method: .POST, body: forged).status
                            case 1: status = try await HTTP.send(url, method: .POST, body: nil).status
                            case 2: status = try await HTTP.send(url, method: .POST, body: Data("{\"signedPayload\": \"eyJ.x.y\"}".utf8)).status
                            default:
                                let client = try RawHTTPClient(port: port)
                                try client.send(
                                    "POST /v1/notifications/appstore HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                        + "Transfer-Encoding: gzip\r\n\r\n{}")
                                let reply = try await client.receiveOffThePool(timeout: 10)
                                status = reply.split(separator: " ", maxSplits: 2).dropFirst().first.flatMap { Int($0) } ?? 0
                            }
                            statuses.withLockedValue { $0[status, default: 0] += 1 }
                        }
                    }
                }
                try await group.waitForAll()
            }
            let flood = statuses.withLockedValue { $0 }
            #expect(genuineStatuses.withLockedValue { $0 } == Array(repeating: 200, count: 20), "\(genuineStatuses.withLockedValue { $0 })")
            #expect(flood.values.reduce(0, +) == 2_000, "\(flood)")
            #expect(Set(flood.keys).isSubset(of: [400, 403, 429]) && flood[429, default: 0] > 0, "\(flood)")
            var revoked = 0
            for (index, purchase) in purchases.enumerated()
            where try await pipeline.grantState(of: purchase.transactionId, user: "user-\(index)") == "revoked" {
                revoked += 1
            }
            if revoked < 20 {
                _ = try await eventually(timeout: .seconds(30)) {
                    var count = 0
                    for (index, purchase) in purchases.enumerated()
                    where try await pipeline.grantState(of: purchase.transactionId, user: "user-\(index)") == "revoked" {
                        count += 1
                    }
                    revoked = count
                    return count == 20
                }
            }
            #expect(revoked == 20, "\(revoked) of the 20 genuine REFUNDs applied")
            #expect(errorLines.withLockedValue { $0 }.isEmpty, "\(errorLines.withLockedValue { $0 })")
            print("notification flood drill: 2,000 junk \(flood), 20 genuine all 200 and applied")
        }

        /// Verified notifications over the deployment's budget are Apple's: 503 with
        /// `Retry-After` (Apple retries), never 429, and the forged ones beside them are still
        /// told apart (403).
        @Test func aVerifiedNotificationOverTheBudgetGets503WithRetryAfterNever429() async throws {
            let pipeline = try await PipelineHarness.start(
                name: "notifybudget", roles: [.intake],
                limits: IntakeLimits(
                    perUser: nil, perAddress: nil, notifications: RateLimit(perSecond: 1, burst: 2),
                    notificationFailuresPerAddress: RateLimit(perSecond: 100, burst: 100)))
            Teardown.add { await pipeline.stop() }
            let url = pipeline.intakeURL + "/v1/notifications/appstore"
            // The fake's genuine REFUND, caught on its way to the intake.
            let caught = try await Self.catchNotifications(of: pipeline)
            let purchase = try await pipeline.mint()
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(purchase.transactionId)/refund", json: [String: String]()).status == 200)
            let genuine = try #require(caught.withLockedValue { $0.first })

            var answers: [HTTP.Answer] = []
            for _ in 0..<3 { answers.append(try await HTTP.post(url, raw: genuine)) }
            #expect(answers.map(\.status) == [200, 200, 503], "\(answers.map(\.text))")
            #expect(answers[2].errorCode == "notifications_busy", "\(answers[2].text)")
            #expect(Int(answers[2].headers.first(name: "Retry-After") ?? "") ?? 0 >= 1, "\(answers[2].headers)")
            let stranger = try FakeCertificateAuthority.generate(name: "Not Apple")
            let forged = try await HTTP.post(url, json: ["signedPayload": try ForgedNotification.make(signer: stranger)])
            #expect(forged.status == 403, "\(forged.text)")
            #expect(try await storedSubmissions(pipeline) == 2)
            // Once the budget refills, Apple's retry is taken.
            let retried = try await eventually(timeout: .seconds(5), interval: .milliseconds(250)) {
                try await HTTP.post(url, raw: genuine).status == 200
            }
            #expect(retried)
        }

        /// The measured attack, bounded: 400 forged notifications from one loopback client, half
        /// of them 208 KB (as measured when the endpoint stored whatever had a JWS shape), half
        /// just under the body limit, with no rate limit so every one reaches the checks. The
        /// figure goes to docs/security.md.
        @Test func aFloodOfForgedNotificationsDoesNotGrowTheStore() async throws {
            let pipeline = try await PipelineHarness.start(name: "notifyflood", roles: [.intake])
            Teardown.add { await pipeline.stop() }
            let url = pipeline.intakeURL + "/v1/notifications/appstore"
            let stranger = try FakeCertificateAuthority.generate(name: "Not Apple")
            let large = try ForgedNotification.make(signer: stranger, padding: 152 * 1024)
            let small = try ForgedNotification.make(signer: stranger, padding: 40 * 1024)
            try #require(small.utf8.count < 65_536 - 64, "the small ones must pass the body limit")
            let before = try await pipeline.storeBytes()
            let started = ContinuousClock.now
            let statuses = try await withThrowingTaskGroup(of: Int.self) { group in
                var statuses: [Int: Int] = [:]
                for index in 0..<400 {
                    if index >= 8, let status = try await group.next() { statuses[status, default: 0] += 1 }
                    group.addTask {
                        try await HTTP.post(url, json: ["signedPayload": index.isMultiple(of: 2) ? large : small]).status
                    }
                }
                for try await status in group { statuses[status, default: 0] += 1 }
                return statuses
            }
            let elapsed = ContinuousClock.now - started
            let grown = try await pipeline.storeBytes() - before
            print("forged notifications: 400 (\(large.utf8.count / 1024) KB and \(small.utf8.count / 1024) KB) in \(elapsed): \(statuses); the store grew by \(grown) bytes")
            #expect(statuses == [413: 200, 403: 200], "\(statuses)")
            #expect(grown == 0, "the store grew by \(grown) bytes")
            #expect(try await storedSubmissions(pipeline) == 0)
            #expect(try await readyMessages(pipeline.names.verify) == 0)
        }
    }
}

@Suite("Retention of rejected submissions", .teardown)
struct RetentionTests {
    @Test func thePurgeRemovesOldRejectedSubmissionsAndKeepsEverythingElse() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-retention-\(UUID().uuidString)")
        let store = try await TestStore.open(in: folder)
        let now = Date(timeIntervalSince1970: 1_800_000_000)
        let old = now.addingTimeInterval(-40 * 86_400)
        let recent = now.addingTimeInterval(-2 * 86_400)

        func accept(_ user: String, at date: Date, signedPayload: String? = nil) async throws -> VerifyRequest {
            var request = VerifyRequest(
                submissionId: UUID(), userId: user, receiptData: signedPayload == nil ? "AAAA" : "", acceptedAt: date)
            request.signedPayload = signedPayload
            try await store.accept(request, message: nil)
            return request
        }
        func reject(_ request: VerifyRequest, at date: Date) async throws {
            _ = try await store.apply(
                VerifyResult(
                    submissionId: request.submissionId, userId: request.userId, orderId: nil, attempt: 1,
                    outcome: .rejected(.invalidReceipt, message: "not a receipt")),
                now: date)
        }

        // Old and rejected: an upload and a forged notification, gone after the purge.
        var purgeable: [VerifyRequest] = []
        for index in 0..<3 {
            let request = try await accept("u\(index)", at: old)
            try await reject(request, at: old)
            purgeable.append(request)
        }
        let notification = try await accept("", at: old, signedPayload: "a.b.c")
        try await reject(notification, at: old)
        purgeable.append(notification)
        // Kept: rejected recently; credited long ago; rejected long ago but a purchase names it.
        let recentlyRejected = try await accept("u9", at: recent)
        try await reject(recentlyRejected, at: recent)
        let credited = try await accept("owner", at: old)
        _ = try await store.apply(
            VerifyResult(
                submissionId: credited.submissionId, userId: "owner", orderId: nil, attempt: 1,
                outcome: .verified(
                    VerifiedReceipt(
                        bundleId: "b", environment: .production,
                        purchases: [
                            VerifiedPurchase(
                                transactionId: "t-credited", originalTransactionId: "t-credited", productId: "p", quantity: 1,
                                purchaseDate: nil, environment: .production)
                        ]))),
            now: old)
        let referenced = try await accept("holder", at: old)
        _ = try await store.apply(
            VerifyResult(
                submissionId: referenced.submissionId, userId: "holder", orderId: nil, attempt: 1,
                outcome: .verified(
                    VerifiedReceipt(
                        bundleId: "b", environment: .production,
                        purchases: [
                            VerifiedPurchase(
                                transactionId: "t-referenced", originalTransactionId: "t-referenced", productId: "p",
                                quantity: 1, purchaseDate: nil, environment: .production)
                        ]))),
            now: old)
        // However it came to be rejected later, its purchase row keeps it.
        try await store.database.write { db in
            try await db.execute(
                sql: "UPDATE submission SET state = 'rejected', updatedAt = ? WHERE id = ?",
                arguments: [old, referenced.submissionId.uuidString])
        }
        let auditBefore = try await store.auditLog(limit: 1000).count

        #expect(try await store.purgeRejected(olderThan: now.addingTimeInterval(-30 * 86_400), now: now) == purgeable.count)

        for request in purgeable { #expect(try await store.status(of: request.submissionId) == nil) }
        #expect(try await store.status(of: recentlyRejected.submissionId)?.state == .rejected)
        #expect(try await store.status(of: credited.submissionId)?.state == .credited)
        #expect(try await store.status(of: referenced.submissionId) != nil)
        #expect(try await store.purchase("t-referenced")?.submissionId == referenced.submissionId.uuidString)
        let leftovers = try await store.database.read { db in
            try await Int.fetchOne(
                db, sql: "SELECT COUNT(*) FROM submission WHERE receiptData = 'AAAA' AND state = 'rejected' AND updatedAt < ?",
                arguments: [now.addingTimeInterval(-30 * 86_400)]) ?? -1
        }
        #expect(leftovers == 1, "only the one a purchase names")
        // The audit log keeps everything it had, and says what the purge did.
        let audit = try await store.auditLog(limit: 1000)
        #expect(audit.count == auditBefore + 1)
        let entry = try #require(audit.first)
        #expect(entry.actor == "system" && entry.action == "retention_purge", "\(entry)")
        #expect(entry.details?.contains("\"count\":\"\(purgeable.count)\"") == true, "\(entry.details ?? "")")

        // Nothing left to purge: nothing deleted, nothing audited.
        #expect(try await store.purgeRejected(olderThan: now.addingTimeInterval(-30 * 86_400), now: now) == 0)
        #expect(try await store.auditLog(limit: 1000).count == auditBefore + 1)
    }

    @Test func aLargePurgeRunsInBatches() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-retention-\(UUID().uuidString)")
        let store = try await TestStore.open(in: folder)
        let now = Date()
        let old = now.addingTimeInterval(-40 * 86_400)
        let count = OrderStore.retentionBatchSize * 2 + 7
        try await store.database.write { db in
            for index in 0..<count {
                try await db.execute(
                    sql: """
                        INSERT INTO submission (id, userId, receiptData, state, reason, acceptedAt, updatedAt)
                        VALUES (?, ?, 'AAAA', 'rejected', 'invalid_receipt', ?, ?)
                        """,
                    arguments: [UUID().uuidString, "u\(index)", old, old])
            }
        }
        #expect(try await store.purgeRejected(olderThan: now.addingTimeInterval(-86_400), now: now) == count)
        #expect(try await store.submissionCounts()[.rejected] ?? 0 == 0)
    }
}
