import Foundation
import IAPCore
import Ledger
@testable import LedgerTestSupport
import Testing

@Suite("Ledger core: a model checker of the planner against a reference model")
struct LedgerCheckerTests {
    /// Checks sequences `worker`, `worker + workers`, … until `total` or the time bound,
    /// yielding its thread every few dozen sequences to whatever else runs beside it.
    static func check(worker: Int, workers: Int, total: Int, base: UInt64, start: ContinuousClock.Instant) async
        -> (checked: Int, truth: Int, failures: [Failed])
    {
        var checked = 0
        var truthChecked = 0
        var failures: [Failed] = []
        for index in stride(from: worker, to: total, by: workers) {
            if ContinuousClock.now - start > LedgerChecker.timeBound { break }
            if index % (32 * workers) == worker { await Task.yield() }
            // Every one against who really paid, with the steps the reference does not know; one
            // in five also against the reference model; a quarter of each under `transfer`.
            let restore: RestorePolicy = index % 4 == 3 ? .transfer : .keep
            for truth in index % 5 == 0 ? [true, false] : [true] {
                let seed = ModelRandom.sequenceSeed(base: base, policy: restore, index: index * 2 + (truth ? 1 : 0))
                let steps = CheckerStep.sequence(seed: seed, count: LedgerChecker.length, truth: truth)
                if let failure = LedgerChecker.failure(of: steps, restore: restore, truth: truth) {
                    failures.append(Failed(seed: seed, restore: restore, truth: truth, failure: failure))
                }
                if truth { truthChecked += 1 } else { checked += 1 }
            }
            if failures.count >= 3 { break }
        }
        // `checked`: the sequences checked against the reference model too.
        return (checked, truthChecked, failures)
    }

    /// A sequence that failed: its seed, policy and mode.
    struct Failed: Sendable {
        var seed: UInt64
        var restore: RestorePolicy
        var truth: Bool
        var failure: CheckerFailure
    }

    @Test(.timeLimit(.minutes(3)))
    func randomSequencesKeepEveryRule() async throws {
        let total = LedgerChecker.sequences
        let base = ModelRandom.base
        let clock = ContinuousClock()
        let start = clock.now
        let workers = 2
        let results = await withTaskGroup(of: (checked: Int, truth: Int, failures: [Failed]).self) { group in
            for worker in 0..<workers {
                group.addTask { await Self.check(worker: worker, workers: workers, total: total, base: base, start: start) }
            }
            var checked = 0
            var truth = 0
            var failures: [Failed] = []
            for await result in group {
                checked += result.checked
                truth += result.truth
                failures += result.failures
            }
            return (checked, truth, failures)
        }
        let elapsed = clock.now - start
        print(
            "ledger checker: \(results.1) sequences of \(LedgerChecker.length) steps against who really paid, \(results.0) more against the reference model, in \(elapsed) (base seed \(ModelRandom.hex(base)))"
        )
        for failed in results.2.prefix(6) {
            let (seed, restore, truth) = (failed.seed, failed.restore, failed.truth)
            let all = CheckerStep.sequence(seed: seed, count: LedgerChecker.length, truth: truth)
            let kept = LedgerChecker.shrink(Array(all.indices), of: all, restore: restore, truth: truth)
            let failure = LedgerChecker.failure(of: kept.map { all[$0] }, restore: restore, truth: truth, tracing: true)
            let mode = restore.rawValue + (truth ? "+truth" : "")
            Issue.record(
                """
                sequence \(ModelRandom.hex(seed)) (\(mode)) fails; shrunk to \(kept.count) steps:
                  \(kept.map { "\($0): \(all[$0])" }.joined(separator: "\n  "))
                \(failure.map(\.description) ?? "(the shrunk sequence passes)")
                what happened:
                \(failure?.log.joined(separator: "\n") ?? "")
                keep it in Tests/LedgerTests/Fixtures/ledger-checker-regressions.txt as:
                \(ModelRandom.hex(seed)) \(mode) \(kept.map(String.init).joined(separator: ","))
                """)
        }
        #expect(results.2.isEmpty)
        // Bounded in time, never silently short: the run must reach its count within the bound.
        #expect(
            results.1 >= total || !results.2.isEmpty,
            "checked \(results.1) of \(total) sequences against who really paid within \(LedgerChecker.timeBound)")
    }

    @Test func theKeptRegressionsPass() throws {
        let cases = try LedgerChecker.regressions()
        #expect(!cases.isEmpty)
        for regression in cases {
            let failure = LedgerChecker.failure(of: regression.steps, restore: regression.restore, truth: regression.truth)
            #expect(failure == nil, "regression \(ModelRandom.hex(regression.seed)) \(regression.restore.rawValue): \(failure?.description ?? "")")
        }
    }

    /// The checker catches what it is for: a planner that forgets a rule fails it. Here the
    /// reference is told a refund that the ledger never heard of; the run must fail.
    @Test func aLedgerThatMissesARefundIsCaught() throws {
        var run = CheckerRun(restore: .keep)
        try run.perform(.buy(user: 0, product: 0, quantity: 1, token: 0))
        try run.perform(.upload(transaction: 0, stranger: 0, route: 0))
        try run.check()
        run.reference.refunded(run.key(run.transactions[0]), at: run.clock, units: nil)
        #expect(throws: CheckerFailure.self) { try run.check() }
    }
}
