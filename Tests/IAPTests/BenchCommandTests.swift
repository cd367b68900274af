import Foundation
import Testing

extension BrokerTests {
    @Suite("iap bench")
    struct BenchCommandTests {
        /// A small run of the load generator end to end, in both modes: its JSON report holds
        /// every field scripts read, and every purchase is credited exactly once.
        @Test(arguments: ["queue", "inline"])
        func aSmallRunReportsEveryFigureAndNothingLost(mode: String) throws {
            let run = try CommandLineTests().iap(
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
    }
}
