import Foundation
import IAPCore
import NIOConcurrencyHelpers
import Pipeline
import Testing
import TestSupport

extension BrokerTests {
    @Suite("Operable: metrics, readiness")
    struct OperationsTests {
        func scrape(_ port: Int) async throws -> MetricsText {
            let answer = try await HTTP.get("http://127.0.0.1:\(port)/metrics")
            #expect(answer.status == 200)
            return MetricsText(answer.text)
        }

        @Test func everyRoleExportsTheRightCountsAfterAnEndToEndRun() async throws {
            let drill = try await ProcessDrill(name: "metrics")
            try drill.start("fake-appstore")
            try await drill.waitHealthy(drill.fakeURL)
            try drill.start("orders")
            try await drill.waitHealthy(drill.intakeURL)
            try drill.start("verifier")
            let purchases = try await drill.mint(20)
            var submissions = try await drill.upload(purchases)
            let refused = try await HTTP.post(drill.intakeURL + "/v1/receipts", raw: Data("not json".utf8))
            #expect(refused.status == 400)
            // purchases[0] again, by someone else: a replay.
            let replay = try await HTTP.post(
                drill.intakeURL + "/v1/receipts", json: ["userId": "thief", "receiptData": purchases[0].receiptData])
            submissions["replay"] = replay.json["submissionId"] as? String
            let outcome = try await drill.settle(submissions)
            #expect(outcome.states["credited"] == 20)
            #expect(outcome.states["rejected"] == 1)

            let ordersPort = try #require(drill.opsPorts["orders"])
            let verifierPort = try #require(drill.opsPorts["verifier"])
            // The samplers run every 5 s.
            var orders = try await scrape(ordersPort)
            _ = try await eventually(timeout: .seconds(15)) {
                orders = try await scrape(ordersPort)
                // A sample holds the store's counts and, once the broker answered, the queues'. One
                // taken while the replay's result or the last grant events were still on their way
                // is not the end state (seen on PostgreSQL under a full run's load).
                return orders.value(MetricNames.submissions, ["state": "credited"]) == 20
                    && orders.value(MetricNames.submissions, ["state": "rejected"]) == 1
                    && orders.value(MetricNames.outboxBacklog) == 0
                    && orders.value(MetricNames.queueConsumers, ["queue": "\(drill.prefix).results"]) == 1
                    && orders.value(MetricNames.queueConsumers, ["queue": "\(drill.prefix).verify"]) == 1
            }
            let verifier = try await scrape(verifierPort)

            #expect(orders.value(MetricNames.uploads, ["result": "accepted"]) == 21)
            #expect(orders.value(MetricNames.uploads, ["result": "refused", "reason": "invalid_json"]) == 1)
            #expect(orders.value(MetricNames.grants) == 20)
            #expect(orders.value(MetricNames.replays) == 1)
            #expect(orders.value(MetricNames.revocations) == 0)
            #expect(orders.value(MetricNames.resultsApplied, ["state": "credited"]) == 20)
            #expect(orders.value(MetricNames.resultsApplied, ["state": "rejected"]) == 1)
            #expect(orders.value(MetricNames.submissions, ["state": "credited"]) == 20)
            #expect(orders.value(MetricNames.submissions, ["state": "rejected"]) == 1)
            #expect(orders.value(MetricNames.outboxBacklog) == 0)
            #expect(orders.value(MetricNames.alerts) == 0)
            #expect(orders.value(MetricNames.queueMessages, ["queue": "\(drill.prefix).verify"]) == 0)
            #expect(orders.value(MetricNames.queueConsumers, ["queue": "\(drill.prefix).verify"]) == 1)
            #expect(orders.value(MetricNames.queueConsumers, ["queue": "\(drill.prefix).results"]) == 1)

            #expect(verifier.value(MetricNames.verifications, ["outcome": "verified"]) == 21)
            #expect(verifier.value(MetricNames.retries) == 0)
            #expect(verifier.value(MetricNames.deadLetters, ["queue": "verify"]) == 0)
            #expect(verifier.value(MetricNames.breakerOpen) == 0)
            #expect(
                verifier.value(
                    MetricNames.appleRequestDuration + "_count", ["endpoint": "production", "status_class": "2xx"]) == 21)

            // Together the roles export every metric the dashboard may name.
            let exported = orders.families.union(verifier.families)
            #expect(Set(MetricNames.all).subtracting(exported).isEmpty, "missing: \(Set(MetricNames.all).subtracting(exported))")
        }

        @Test func readinessFollowsTheBroker() async throws {
            let pipeline = try await PipelineHarness.start(name: "readyz", withOps: true)
            Teardown.add { await pipeline.stop() }
            let url = try #require(pipeline.opsURL) + "/readyz"
            #expect(try await HTTP.get(url).status == 200)
            try await TestBroker.control("stop")
            let notReady = try await eventually(timeout: .seconds(20)) { try await HTTP.get(url).status == 503 }
            let answer = try await HTTP.get(url)
            try await TestBroker.control("start")
            #expect(notReady)
            #expect((answer.json["checks"] as? [String: String])?["broker"] == "not connected")
            #expect((answer.json["checks"] as? [String: String])?["store"] == "ok")
            #expect(try await eventually(timeout: .seconds(30)) { try await HTTP.get(url).status == 200 })
            #expect(try await HTTP.get(try #require(pipeline.opsURL) + "/healthz").status == 200)
        }
    }
}

@Suite("Deployment files match the code", .teardown)
struct DeploymentFileTests {
    /// Every metric a dashboard query names is one the services export.
    @Test func dashboardIsValidAndNamesOnlyExportedMetrics() async throws {
        let url = repositoryRoot.appendingPathComponent("compose/grafana/dashboards/iap-pipeline.json")
        let dashboard = try #require(try JSONSerialization.jsonObject(with: Data(contentsOf: url)) as? [String: Any])
        let panels = try #require(dashboard["panels"] as? [[String: Any]])
        var expressions: [String] = []
        for panel in panels {
            for target in panel["targets"] as? [[String: Any]] ?? [] {
                if let expression = target["expr"] as? String { expressions.append(expression) }
            }
        }
        #expect(expressions.count >= 10)
        let pattern = try NSRegularExpression(pattern: "iap_[a-z_]+")
        var named = Set<String>()
        for expression in expressions {
            let range = NSRange(expression.startIndex..., in: expression)
            for match in pattern.matches(in: expression, range: range) {
                var name = String(expression[Range(match.range, in: expression)!])
                for suffix in ["_bucket", "_count", "_sum"] where name.hasSuffix(suffix) {
                    name = String(name.dropLast(suffix.count))
                }
                named.insert(name)
            }
        }
        #expect(named.subtracting(MetricNames.all).isEmpty, "unknown metrics: \(named.subtracting(MetricNames.all))")
        for wanted in [MetricNames.queueMessages, MetricNames.uploads, MetricNames.appleRequestDuration, MetricNames.retries, MetricNames.grants] {
            #expect(named.contains(wanted), "the dashboard does not show \(wanted)")
        }
    }

    /// Each compose service that runs `iap` names a real subcommand, sets only settings that
    /// subcommand documents, and publishes the ports those settings choose.
    @Test func composeServicesMatchTheExecutablesHelp() async throws {
        let compose = try await composeAsJSON()
        let services = try #require(compose["services"] as? [String: [String: Any]])
        let topHelp = try await CommandLineTests().iap(["--help"]).output
        var checked = 0
        for (name, service) in services where (service["image"] as? String) == "iap-pipeline:local" {
            let command = try #require(service["command"] as? [String], "\(name) has no command")
            let subcommand = try #require(command.first)
            #expect(topHelp.contains("  \(subcommand) "), "\(name): iap has no subcommand \(subcommand)")
            let help = try await CommandLineTests().iap([subcommand, "--help"]).output
            let environment = service["environment"] as? [String: Any] ?? [:]
            for key in environment.keys where key.hasPrefix("IAP_") {
                #expect(help.contains(key), "\(name): `iap \(subcommand) --help` does not document \(key)")
            }
            let ports = (service["ports"] as? [[String: Any]] ?? []).compactMap { $0["target"] as? Int }
            for port in ports {
                let chosen = ["IAP_HTTP_PORT", "IAP_OPS_PORT", "IAP_FAKE_APPSTORE_PORT"].compactMap {
                    (environment[$0] as? String).flatMap(Int.init)
                }
                #expect(chosen.contains(port), "\(name) publishes \(port), which none of its settings chooses")
            }
            checked += 1
        }
        #expect(checked >= 3)
    }

    /// The compose file as `docker-compose config` resolves it, read with Debian's python3
    /// (installed with docker-compose, which brings PyYAML).
    func composeAsJSON() async throws -> [String: Any] {
        let script = "import sys, json, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/bin/sh")
        process.arguments = ["-c", "docker-compose -f compose/docker-compose.yml --profile dev config | /usr/bin/python3 -c '\(script)'"]
        process.currentDirectoryURL = repositoryRoot
        let output = Pipe()
        process.standardOutput = output
        try process.run()
        let data = try await offThePool { output.fileHandleForReading.readDataToEndOfFile() }
        await process.exited()
        #expect(process.terminationStatus == 0)
        return try JSONSerialization.jsonObject(with: data) as? [String: Any] ?? [:]
    }
}
