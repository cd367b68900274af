import Foundation
import Hummingbird
import IAPCore
import NIOConcurrencyHelpers
import ServiceLifecycle
import Testing
import TestSupport

extension BrokerTests {
    /// What docs/operations.md promises operators, checked on the real executable after a run
    /// that exercises it: every documented metric is exported (and counts what happened), and
    /// every documented field of the alert webhook is filled, `reason` and `message` included.
    @Suite("Operations output as documented", .timeLimit(.minutes(3)))
    struct OperationsOutputTests {
        static var operationsDoc: String {
            get throws { try String(contentsOf: repositoryRoot.appendingPathComponent("docs/operations.md"), encoding: .utf8) }
        }

        /// The metric names in the table of docs/operations.md (labels stripped).
        static func documentedMetrics() throws -> Set<String> {
            var names: Set<String> = []
            for line in try operationsDoc.split(separator: "\n") where line.hasPrefix("| `iap_") {
                let firstCell = line.split(separator: "|")[0]
                for part in firstCell.split(separator: "`") where part.hasPrefix("iap_") {
                    names.insert(String(part.prefix { $0 != "{" }))
                }
            }
            return names
        }

        /// The keys of the webhook body as docs/operations.md lists them (`{"kind", …}`).
        static func documentedWebhookFields() throws -> [String] {
            let text = try operationsDoc
            guard let start = text.range(of: "POST to `IAP_ALERT_WEBHOOK`"),
                let open = text.range(of: "(`{", range: start.upperBound..<text.endIndex),
                let close = text.range(of: "}`)", range: open.upperBound..<text.endIndex)
            else { return [] }
            return text[open.upperBound..<close.lowerBound].split(separator: ",").map {
                $0.trimmingCharacters(in: .whitespacesAndNewlines).trimmingCharacters(in: CharacterSet(charactersIn: "\""))
            }
        }

        @Test func theMetricsTableIsTheCodesList() async throws {
            let documented = try Self.documentedMetrics()
            #expect(documented.subtracting(MetricNames.all).isEmpty, "documented, not exported: \(documented.subtracting(MetricNames.all).sorted())")
            #expect(Set(MetricNames.all).subtracting(documented).isEmpty, "exported, not documented: \(Set(MetricNames.all).subtracting(documented).sorted())")
        }

        @Test func anEmptyDeadLetterListingSaysSo() async throws {
            let prefix = TestBroker.uniquePrefix("deadempty")
            let run = try await CommandLineTests().iap(
                ["admin", "dead-letters", "list", "--queue", "results"],
                environment: ["IAP_AMQP_URL": try TestBroker.url(), "IAP_QUEUE_PREFIX": prefix, "IAP_LOG_LEVEL": "error"])
            #expect(run.status == 0, "\(run.output)")
            #expect(run.output.contains("no dead letters in \(prefix).results.dead"), "\(run.output)")
        }

        @Test func everyDocumentedMetricAndWebhookFieldShowsAfterARunThatExercisesIt() async throws {
            let fields = try Self.documentedWebhookFields()
            #expect(fields.contains("reason") && fields.contains("message") && fields.count >= 6, "\(fields)")
            let webhook = try await RawWebhook.start()
            Teardown.add { await webhook.stop() }
            let root = FileManager.default.temporaryDirectory.appendingPathComponent("fake-root-\(UUID().uuidString).der")
            let drill = try await ProcessDrill(
                name: "opsoutput",
                environment: [
                    "IAP_ALERT_WEBHOOK": webhook.url, "IAP_ADMIN_TOKEN": PipelineHarness.adminToken,
                    "IAP_TRUSTED_ROOTS": root.path, "IAP_APP_APPLE_ID": "1234567890", "IAP_LOG_LEVEL": "info",
                ])
            try drill.start("fake-appstore")
            try await drill.waitHealthy(drill.fakeURL)
            try await HTTP.get(drill.fakeURL + "/fake/root-certificate").body.write(to: root)
            try drill.start("orders")
            try await drill.waitHealthy(drill.intakeURL)
            try drill.start("verifier")
            _ = try await HTTP.post(drill.fakeURL + "/fake/config", json: ["notificationURL": drill.intakeURL + "/v1/notifications/appstore"])

            // Three purchases credited, one replayed by another user, one refused upload,
            // one held (a product the catalog lacks), then Apple refunds one.
            let purchases = try await drill.mint(3)
            var submissions = try await drill.upload(purchases)
            #expect(try await HTTP.post(drill.intakeURL + "/v1/receipts", raw: Data("{".utf8)).status == 400)
            let replay = try await HTTP.post(
                drill.intakeURL + "/v1/receipts", json: ["userId": "thief", "receiptData": purchases[0].receiptData])
            submissions["replay"] = replay.json["submissionId"] as? String
            let unknown = try await HTTP.post(
                drill.fakeURL + "/fake/purchases", json: ["bundleId": PipelineHarness.bundleId, "productId": "com.example.unlisted"])
            let held = try await HTTP.post(
                drill.intakeURL + "/v1/receipts",
                json: ["userId": "olga", "receiptData": unknown.json["receiptData"] as? String ?? ""])
            let heldId = try #require(held.json["submissionId"] as? String, "\(held.text)")
            submissions["held"] = heldId
            let outcome = try await drill.settle(submissions)
            #expect(outcome.states["needs_review"] == 1, "\(outcome)")
            let refund = try await HTTP.post(drill.fakeURL + "/fake/purchases/\(purchases[1].transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")

            let ordersPort = try #require(drill.opsPorts["orders"])
            let verifierPort = try #require(drill.opsPorts["verifier"])
            var orders = MetricsText("")
            let counted = try await eventually(timeout: .seconds(30)) {
                orders = MetricsText(try await HTTP.get("http://127.0.0.1:\(ordersPort)/metrics").text)
                return (orders.value(MetricNames.revocations) ?? 0) >= 1 && (orders.value(MetricNames.submissions, ["state": "credited"]) ?? 0) >= 3
            }
            #expect(counted, "iap_revocations_total stayed \(orders.value(MetricNames.revocations) ?? -1) after a REFUND\n\(drill.logTail("orders"))")
            let verifier = MetricsText(try await HTTP.get("http://127.0.0.1:\(verifierPort)/metrics").text)

            // Every documented metric is exported by the roles together...
            let exported = orders.families.union(verifier.families)
            let documented = try Self.documentedMetrics()
            #expect(documented.subtracting(exported).isEmpty, "documented but not exported: \(documented.subtracting(exported).sorted())")
            // ...and the ones this run exercised counted it.
            let exercised: [(MetricsText, String, [String: String])] = [
                (orders, MetricNames.uploads, ["result": "accepted"]), (orders, MetricNames.uploads, ["result": "refused"]),
                (orders, MetricNames.resultsApplied, ["state": "credited"]), (orders, MetricNames.resultsApplied, ["state": "needs_review"]),
                (orders, MetricNames.grants, [:]), (orders, MetricNames.revocations, [:]), (orders, MetricNames.replays, [:]),
                (orders, MetricNames.alerts, [:]), (orders, MetricNames.notifications, [:]),
                (orders, MetricNames.submissions, ["state": "credited"]), (orders, MetricNames.submissions, ["state": "needs_review"]),
                (verifier, MetricNames.verifications, ["outcome": "verified"]),
                (verifier, MetricNames.appleRequestDuration + "_count", [:]),
            ]
            for (scrape, name, labels) in exercised {
                #expect((scrape.value(name, labels) ?? 0) > 0, "\(name)\(labels) did not count this run")
            }

            // The alert: every documented field of the webhook body, filled.
            #expect(try await eventually(timeout: .seconds(10)) { !webhook.bodies.isEmpty })
            let bodies = webhook.bodies
            let alert = try #require(bodies.first { $0["submissionId"] as? String == heldId }, "\(bodies)")
            for field in fields {
                let value = alert[field]
                #expect(value != nil && !(value is NSNull) && (value as? String)?.isEmpty != true, "webhook field \(field) is empty: \(alert)")
            }
            #expect(alert["kind"] as? String == "needs_review")
            #expect(alert["reason"] as? String == "unknown_product", "\(alert)")
            // The log line says the same.
            let log = drill.logTail("orders", lines: .max)
            let line = log.split(separator: "\n").first { $0.contains("submission needs attention") && $0.contains(heldId) }
            #expect(line?.contains("unknown_product") == true, "\(line ?? "no alert log line")")
        }
    }

    /// A webhook receiver on loopback that keeps the JSON objects it was sent.
    struct RawWebhook {
        let url: String
        let received: NIOLockedValueBox<[Data]>
        let group: ServiceGroup
        let task: Task<Void, any Error>

        static func start() async throws -> RawWebhook {
            let received = NIOLockedValueBox([Data]())
            let router = Router()
            router.post("/alerts") { request, _ in
                var request = request
                let buffer = try await request.collectBody(upTo: 64 * 1024)
                received.withLockedValue { $0.append(Data(buffer.readableBytesView)) }
                return HTTPResponse.Status.noContent
            }
            let server = try await LoopbackServer.start(router, name: "the webhook receiver")
            return RawWebhook(url: server.base + "/alerts", received: received, group: server.group, task: server.task)
        }

        /// Each body received, as a JSON object.
        var bodies: [[String: Any]] {
            received.withLockedValue { $0 }.map { (try? JSONSerialization.jsonObject(with: $0)) as? [String: Any] ?? [:] }
        }

        func stop() async {
            await group.triggerGracefulShutdown()
            _ = try? await task.value
        }
    }
}
