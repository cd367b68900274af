import Foundation
import NIOHTTP1
import Testing
import TestSupport
import Verifier

@Suite("Circuit breaker toward Apple", .teardown)
struct CircuitBreakerTests {
    @Test func opensAfterTheThresholdWaitsThenProbesAndCloses() {
        let breaker = CircuitBreaker(settings: .init(failureThreshold: 3, openDuration: .seconds(10)))
        let start = ContinuousClock.now
        #expect(breaker.permit(now: start) == .call)
        #expect(!breaker.record(transientFailure: true, now: start))
        #expect(!breaker.record(transientFailure: true, now: start))
        #expect(breaker.record(transientFailure: true, now: start))
        #expect(breaker.isOpen)
        #expect(breaker.permit(now: start + .seconds(5)) == .wait)
        // After the open period exactly one probe goes through.
        #expect(breaker.permit(now: start + .seconds(11)) == .probe)
        #expect(breaker.permit(now: start + .seconds(11)) == .wait)
        #expect(!breaker.record(transientFailure: false, now: start + .seconds(12)))
        #expect(!breaker.isOpen)
        #expect(breaker.permit(now: start + .seconds(12)) == .call)
    }

    @Test func failedProbeOpensAgainAndSuccessesResetTheCount() {
        let breaker = CircuitBreaker(settings: .init(failureThreshold: 2, openDuration: .seconds(10)))
        let start = ContinuousClock.now
        breaker.record(transientFailure: true, now: start)
        breaker.record(transientFailure: false, now: start)
        #expect(!breaker.record(transientFailure: true, now: start))
        #expect(breaker.record(transientFailure: true, now: start))
        #expect(breaker.permit(now: start + .seconds(10)) == .probe)
        #expect(breaker.record(transientFailure: true, now: start + .seconds(10)))
        #expect(breaker.permit(now: start + .seconds(15)) == .wait)
        #expect(breaker.permit(now: start + .seconds(21)) == .probe)
    }
}

extension BrokerTests {
    @Suite("An Apple outage does not burn the retries")
    struct CircuitBreakerPipelineTests {
        @Test func openBreakerHoldsCallsBackAndEverythingIsCreditedAfterTheOutage() async throws {
            let pipeline = try await PipelineHarness.start(
                name: "breaker", retryDelays: [1], circuitBreaker: .init(failureThreshold: 5, openDuration: .seconds(2)))
            Teardown.add { await pipeline.stop() }
            let purchases = try await withThrowingTaskGroup(of: PipelineHarness.Purchase.self) { group in
                for _ in 0..<40 { group.addTask { try await pipeline.mint() } }
                return try await group.reduce(into: []) { $0.append($1) }
            }
            try await pipeline.injectFault(["httpStatus": 503, "count": 0])
            let outageBegan = ContinuousClock.now
            var ids: [String] = []
            for (index, purchase) in purchases.enumerated() {
                ids.append(try await pipeline.upload(userId: "u\(index)", receiptData: purchase.receiptData))
            }
            try await Task.sleep(for: .seconds(5))
            let callsDuringOutage = try await HTTP.get(pipeline.fakeURL + "/fake/stats").json["verifyReceiptCalls"] as? Int ?? 0
            // Without the breaker: 40 first attempts plus a retry of each every second.
            #expect(callsDuringOutage < 40, "Apple was called \(callsDuringOutage) times during the outage")

            _ = try await HTTP.send(pipeline.fakeURL + "/fake/faults", method: .DELETE, body: nil)
            let outage = ContinuousClock.now - outageBegan
            var attempts: [Int] = []
            for id in ids {
                let status = try await pipeline.waitForState(id, timeout: .seconds(40))
                #expect(status["state"] as? String == "credited")
                attempts.append(status["attempts"] as? Int ?? 0)
            }
            // With the breaker an upload is tried once before it opens, at most once per probe
            // while Apple is down (one probe each open period, 2 s), and once more to succeed:
            // 2 + ⌈outage / 2 s⌉ in all, however long a loaded machine stretched the outage.
            // Without it, every second of the outage is a retry of every upload.
            let probes = Int((outage / .seconds(2)).rounded(.up))
            print("breaker: \(callsDuringOutage) calls to Apple in \(outage) of outage for 40 uploads; attempts max \(attempts.max() ?? 0)")
            #expect((attempts.max() ?? 0) <= 2 + probes, "an upload was tried \(attempts.max() ?? 0) times in \(outage) of outage")
        }
    }
}
