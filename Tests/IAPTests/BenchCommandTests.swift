import Foundation
import Testing

extension BrokerTests {
    @Suite("iap bench")
    struct BenchCommandTests {
        /// A small run of the load generator end to end, in both modes: its JSON report holds
        /// every field scripts read, and every purchase is credited exactly once.
        @Test(arguments: ["queue", "inline"])
        func aSmallRunReportsEveryFigureAndNothingLost(mode: String) async throws {
            let run = try await CommandLineTests().iap(
                ["bench", "--start-dev", "--purchases", "40", "--concurrency", "8", "--mode", mode, "--json",
                    "--settle-timeout", "60"],
                environment: ["IAP_AMQP_URL": try TestBroker.url()])
            #expect(run.status == 0, "\(run.output.suffix(2000))")
            let line = try #require(run.output.split(separator: "\n").last { $0.hasPrefix("{") }, "\(run.output.suffix(2000))")
            let report = try #require(try JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any])
            for key in ["mode", "purchases", "uploadsPerSecond", "intakeLatencyMs", "endToEndMs", "verificationsPerSecond",
                "credited", "lost", "duplicated"] {
                #expect(report[key] != nil, "no \(key) in \(line)")
            }
            #expect(report["mode"] as? String == mode)
            #expect(report["credited"] as? Int == 40 && report["lost"] as? Int == 0 && report["duplicated"] as? Int == 0, "\(line)")
            let latency = report["intakeLatencyMs"] as? [String: Any]
            #expect((latency?["p99"] as? Double ?? 0) > 0 && latency?["p999"] != nil, "\(line)")
        }

        /// Holding the verifiers back only means something for a cluster bench starts itself.
        @Test(arguments: [["--verify-after-upload"], ["--start-dev", "--mode", "inline", "--verify-after-upload"]])
        func verifyAfterUploadNeedsItsOwnQueueCluster(arguments: [String]) async throws {
            let run = try await CommandLineTests().iap(["bench"] + arguments, environment: ["IAP_AMQP_URL": try TestBroker.url()])
            #expect(run.status != 0 && run.output.contains("--verify-after-upload needs --start-dev and --mode queue"), "\(run.output)")
        }

        /// Capping the order services means something only for processes bench starts itself.
        @Test func ordersCPUNeedsItsOwnQueueCluster() async throws {
            let run = try await CommandLineTests().iap(["bench", "--orders-cpu", "0.5"], environment: ["IAP_AMQP_URL": try TestBroker.url()])
            #expect(run.status != 0 && run.output.contains("--orders-cpu needs --start-dev and --mode queue"), "\(run.output)")
        }

        /// `--orders-cpu`: the order service runs in a control group of its own, held at its
        /// quota (a twentieth of a core cannot start a service without being held back), and
        /// the report says so; the group is gone afterwards.
        @Test(.enabled(if: BenchCommandTests.canCapCPU, "needs root and a cgroup cpu controller"))
        func theOrderServiceRunsAtItsCap() async throws {
            let run = try await CommandLineTests().iap(
                ["bench", "--start-dev", "--purchases", "20", "--concurrency", "4", "--orders-cpu", "0.05", "--json",
                    "--settle-timeout", "120"],
                environment: ["IAP_AMQP_URL": try TestBroker.url()])
            #expect(run.status == 0, "\(run.output.suffix(2000))")
            let line = try #require(run.output.split(separator: "\n").last { $0.hasPrefix("{") }, "\(run.output.suffix(2000))")
            let report = try #require(try JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any])
            #expect(report["credited"] as? Int == 20 && report["lost"] as? Int == 0 && report["duplicated"] as? Int == 0, "\(line)")
            #expect(report["ordersCPU"] as? Double == 0.05, "\(line)")
            let throttled = try #require(report["throttledPeriods"] as? [String: Int], "\(line)")
            #expect(Set(throttled.keys) == ["orders"] && (throttled["orders"] ?? 0) > 0, "\(line)")
            let groups = ["/sys/fs/cgroup", "/sys/fs/cgroup/cpu"].flatMap { (try? FileManager.default.contentsOfDirectory(atPath: $0)) ?? [] }
            #expect(!groups.contains { $0.hasPrefix("iap-bench-") && $0.hasSuffix("-orders") }, "\(groups)")
        }

        static var canCapCPU: Bool {
            getuid() == 0
                && (FileManager.default.fileExists(atPath: "/sys/fs/cgroup/cgroup.controllers")
                    || FileManager.default.fileExists(atPath: "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"))
        }

        /// The production shape, verifiers held back until every upload is in: each process
        /// is reported by role (CPU per phase, peak RSS), the verifiers used no CPU while the
        /// intake was measured alone, and nothing is lost.
        @Test func verifiersStartedAfterTheUploadsDrainTheQueue() async throws {
            let run = try await CommandLineTests().iap(
                ["bench", "--start-dev", "--purchases", "60", "--concurrency", "8", "--verifiers", "2",
                    "--verify-after-upload", "--json", "--settle-timeout", "60"],
                environment: ["IAP_AMQP_URL": try TestBroker.url()])
            #expect(run.status == 0, "\(run.output.suffix(2000))")
            let line = try #require(run.output.split(separator: "\n").last { $0.hasPrefix("{") }, "\(run.output.suffix(2000))")
            let report = try #require(try JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any])
            #expect(report["credited"] as? Int == 60 && report["lost"] as? Int == 0 && report["duplicated"] as? Int == 0, "\(line)")
            let rss = try #require(report["peakRSSMB"] as? [String: Double], "\(line)")
            #expect(Set(rss.keys) == ["fake-appstore", "orders", "verifier-1", "verifier-2"] && rss.values.allSatisfy { $0 > 1 })
            let cpu = try #require(report["cpuSeconds"] as? [String: [String: Double]], "\(line)")
            #expect(cpu["upload"]?["verifier-1"] == nil && (cpu["upload"]?["orders"] ?? 0) > 0, "\(line)")
            #expect((cpu["settle"]?["verifier-1"] ?? 0) > 0 && (cpu["settle"]?["verifier-2"] ?? 0) > 0, "\(line)")
        }
    }
}
