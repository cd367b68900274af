import Foundation
import NIOHTTP1
import Testing

extension DisruptiveTests {
    /// Each drill pushes real uploads through real `iap` processes (`DrillTraffic`: phones
    /// that buy and upload until the fault has landed and 300 uploads more), breaks something
    /// once a hundred uploads are through, and then checks the three promises: every accepted
    /// upload reaches a terminal state, one grant per purchase, and no transient failure became
    /// a rejection. Figures print as `drill[...]` lines (see docs/reliability.md).
    @Suite("Fault drills", .timeLimit(.minutes(4)))
    struct FaultDrillTests {

        /// Fake App Store, order service and one verifier, each its own process, on the node the
        /// run starts for the drills (the ordinary tests stop and start the test broker).
        func startStandardDrill(_ name: String, environment: [String: String] = [:]) async throws -> ProcessDrill {
            var environment = environment
            if environment["IAP_AMQP_URL"] == nil { environment["IAP_AMQP_URL"] = try TestBroker.drillNodeURL() }
            let drill = try await ProcessDrill(name: name, environment: environment)
            try drill.start("fake-appstore")
            try await drill.waitHealthy(drill.fakeURL)
            try drill.start("orders")
            try await drill.waitHealthy(drill.intakeURL)
            try drill.start("verifier")
            // Running, not starting: uploads are accepted without a verifier, and a signal sent
            // before its handlers are installed ends it as the default action does.
            try await drill.waitHealthy(drill.opsURL("verifier"))
            return drill
        }

        func check(_ outcome: ProcessDrill.Outcome, purchases: Int, drill: ProcessDrill, name: String, recovery: Duration) {
            drill.check(outcome, purchases: purchases, name: name, recovery: recovery)
        }

        @Test func verifierKilledMidStream() async throws {
            let drill = try await startStandardDrill("kill-verifier")
            let traffic = DrillTraffic(drill)
            for _ in 0..<2 {
                try await traffic.waitForMore(100)
                drill.kill9("verifier")
                try await Task.sleep(for: .milliseconds(500))
                try drill.start("verifier")
            }
            traffic.faultLanded()
            let submissions = try await traffic.finish()
            let recovered = ContinuousClock.now
            let outcome = try await drill.settle(submissions)
            check(outcome, purchases: submissions.count, drill: drill, name: "kill -9 verifier ×2", recovery: .now - recovered)
        }

        @Test func orderServiceKilledMidStream() async throws {
            let drill = try await startStandardDrill("kill-orders")
            let traffic = DrillTraffic(drill)
            try await traffic.waitForMore(100)
            drill.kill9("orders")
            traffic.faultLanded()
            try await Task.sleep(for: .seconds(1))
            try drill.start("orders")
            let recovered = ContinuousClock.now
            let submissions = try await traffic.finish()
            let outcome = try await drill.settle(submissions)
            check(outcome, purchases: submissions.count, drill: drill, name: "kill -9 orders", recovery: .now - recovered)
        }

        @Test func brokerStoppedForTenSecondsWhileUploadsKeepComing() async throws {
            let drill = try await startStandardDrill("broker-down")
            let traffic = DrillTraffic(drill, concurrency: 8)
            try await traffic.waitForMore(100)
            try await TestBroker.controlDrillNode("stop")
            traffic.faultLanded()
            // The intake keeps answering 202 while the broker is away: a phone sends its
            // purchase again.
            let first = try #require(traffic.purchases.first)
            let duringOutage = try await HTTP.post(
                drill.intakeURL + "/v1/receipts", json: ["userId": first.userId, "receiptData": first.purchase.receiptData])
            try await Task.sleep(for: .seconds(10))
            try await TestBroker.controlDrillNode("start")
            let recovered = ContinuousClock.now
            #expect(duringOutage.status == 202)
            var submissions = try await traffic.finish()
            let purchases = submissions.count
            // A new submission, unless the first one was credited already and this repeats it
            // (then its answer is that submission: the owner's repeat within the hour).
            let extra = duringOutage.json["submissionId"] as? String
            let repeated = extra.map { Set(submissions.values).contains($0) } ?? false
            if let extra, !repeated { submissions["outage"] = extra }
            let expected = repeated ? purchases : purchases + 1
            let outcome = try await drill.settle(submissions)
            print("drill[broker stopped 10 s]: purchases \(purchases), \(outcome), settled \(ContinuousClock.now - recovered) after the broker returned")
            #expect(outcome.accepted == expected)
            #expect(outcome.states["credited"] ?? 0 >= expected, "\(outcome)")
            #expect(outcome.states.values.reduce(0, +) == outcome.states["credited"], "\(outcome)")
            // The extra upload repeats the first purchase: still one grant.
            #expect(outcome.grants == purchases)
            #expect(outcome.transactionsWithTwoGrants == 0)
        }

        @Test func appleFailsThenRecovers() async throws {
            // The client gives Apple its 5 s (ProcessDrill), so that the fake's 6 s answers below
            // are timeouts while its ordinary ones, slow on two loaded cores, are not.
            let drill = try await startStandardDrill("apple-down")
            // 503s, then 21005, then answers slower than the client's 1 s timeout; then healthy.
            let traffic = DrillTraffic(drill)
            try await traffic.waitForMore(100)
            #expect(try await HTTP.post(drill.fakeURL + "/fake/faults", json: ["httpStatus": 503, "count": 0]).status == 204)
            try await Task.sleep(for: .seconds(3))
            _ = try await HTTP.send(drill.fakeURL + "/fake/faults", method: .DELETE, body: nil)
            #expect(try await HTTP.post(drill.fakeURL + "/fake/faults", json: ["status": 21005, "count": 0]).status == 204)
            try await Task.sleep(for: .seconds(3))
            _ = try await HTTP.send(drill.fakeURL + "/fake/faults", method: .DELETE, body: nil)
            #expect(try await HTTP.post(drill.fakeURL + "/fake/faults", json: ["delayMs": 6000, "count": 0]).status == 204)
            traffic.faultLanded()
            try await Task.sleep(for: .seconds(3))
            _ = try await HTTP.send(drill.fakeURL + "/fake/faults", method: .DELETE, body: nil)
            let recovered = ContinuousClock.now
            let submissions = try await traffic.finish()
            let outcome = try await drill.settle(submissions)
            check(outcome, purchases: submissions.count, drill: drill, name: "Apple 503 / 21005 / hanging for 9 s", recovery: .now - recovered)
        }

        @Test func everyRoleStopsCleanlyOnSIGTERMMidStream() async throws {
            let drill = try await startStandardDrill("sigterm")
            let traffic = DrillTraffic(drill, after: 100)
            try await traffic.waitForMore(50)
            let started = ContinuousClock.now
            let verifierStatus = await drill.terminate("verifier")
            let ordersStatus = await drill.terminate("orders")
            let stopping = ContinuousClock.now - started
            #expect(verifierStatus == 0, "\(drill.logTail("verifier"))")
            #expect(ordersStatus == 0, "\(drill.logTail("orders"))")
            #expect(stopping < .seconds(20))
            traffic.faultLanded()
            try drill.start("orders")
            try drill.start("verifier")
            let submissions = try await traffic.finish()
            let outcome = try await drill.settle(submissions)
            print("drill[SIGTERM verifier and orders]: purchases \(submissions.count), \(outcome), both stopped in \(stopping)")
            #expect(outcome.states.values.reduce(0, +) == outcome.states["credited"], "\(outcome)")
            #expect(outcome.grants == submissions.count)
            #expect(outcome.transactionsWithTwoGrants == 0)
        }

        @Test func resultsRedeliveredAfterFinisherCrashesCreditOnce() async throws {
            let drill = try await ProcessDrill(name: "redeliver", environment: ["IAP_FINISHER_PREFETCH": "500"])
            try drill.start("fake-appstore")
            try await drill.waitHealthy(drill.fakeURL)
            try drill.start("intake")
            try await drill.waitHealthy(drill.intakeURL)
            try drill.start("verifier")
            try drill.start("finisher")
            let traffic = DrillTraffic(drill)
            // Each kill drops up to 500 unacked results, some already committed: the broker
            // delivers them again to the next finisher.
            for _ in 0..<3 {
                try await traffic.waitForMore(100)
                drill.kill9("finisher")
                try drill.start("finisher")
            }
            traffic.faultLanded()
            let recovered = ContinuousClock.now
            let submissions = try await traffic.finish()
            let outcome = try await drill.settle(submissions)
            check(outcome, purchases: submissions.count, drill: drill, name: "kill -9 finisher ×3 (redeliveries)", recovery: .now - recovered)
        }
    }
}
