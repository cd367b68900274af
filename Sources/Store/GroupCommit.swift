import Foundation
import NIOConcurrencyHelpers

/// Group commit: writes that arrive while a commit is on disk wait for the next one and share
/// it, each in its own savepoint.
///
/// Every caller still gets its own all-or-nothing unit of work, and its call returns only
/// after the commit that holds it is durable, exactly as with a transaction of its own. What
/// changes is the cost: one `fsync` and one turn of the writer per batch instead of per
/// write, which is what bounds an order store taking thousands of uploads and results a
/// second. A lone write is committed at once: nothing waits for a batch to fill.
///
/// On PostgreSQL the units that name their `keys` go side by side (`SideBySideRound`): a
/// batch's reads in one round trip and its writes in another, rather than two round trips per
/// unit in turn. Units whose keys meet go in later rounds of the same transaction, in the
/// order they came, each seeing what the ones before it wrote.
package final class GroupCommit: Sendable {
    /// What became of one unit in a batch.
    private enum Outcome: Sendable {
        case done
        case failed(any Error)
        /// It met another writer's work (PostgreSQL's 40001, or a row it expected to insert
        /// found taken): its savepoint is undone, the others stay, and it runs again in the next
        /// batch on fresh facts.
        case conflicted(any Error)
    }

    /// One caller's unit of work and how to answer it.
    private struct Pending: Sendable {
        /// The rows it reads and writes, by name (nil: any row); see `write(keys:_:)`.
        let keys: Set<String>?
        /// Runs the work on the connection given and keeps its value.
        let perform: @Sendable (any SQLConnection) async throws -> Void
        /// Keeps the error the work ended with, for `resume`.
        let fail: @Sendable (any Error) -> Void
        /// After the commit: answers with the kept outcome, or with the commit's own error.
        let resume: @Sendable ((any Error)?) -> Void
        /// Batches it conflicted in so far.
        var conflicts = 0

        /// Runs the work alone, in a savepoint of the shared transaction.
        func runAlone(on db: any SQLConnection) async -> Outcome {
            await outcome(on: db) { try await db.inSavepoint { try await perform(db) } }
        }

        /// What running `body` on `db` came to.
        func outcome(on db: any SQLConnection, _ body: () async throws -> Void) async -> Outcome {
            do {
                try await body()
                return .done
            } catch let error as SQLError where error.kind == .serializationFailure && db.isInsideTransaction {
                return .conflicted(error)
            } catch {
                fail(error)
                return .failed(error)
            }
        }
    }

    private struct State {
        var pending: [Pending] = []
        var draining = false
        var batches = 0
        var together = 0
        var alone = 0
    }

    /// Which of the database's writers a batch goes to.
    package enum Writer: Sendable {
        /// `write`: the ledger's.
        case ledger
        /// `acceptUploads`.
        case uploads
    }

    private let database: any SQLDatabase
    private let writer: Writer
    private let maxBatch: Int
    /// The most keys a batch locks (see `batchSize`).
    private let maxKeys: Int
    private let state = NIOLockedValueBox(State())

    package init(database: any SQLDatabase, writer: Writer = .ledger, maxBatch: Int = 512, maxKeys: Int = 512) {
        self.database = database
        self.writer = writer
        self.maxBatch = maxBatch
        self.maxKeys = maxKeys
    }

    /// Runs `work` in a savepoint of the next group commit and returns its value once that
    /// commit is durable. An error thrown by `work` rolls back its own savepoint only.
    ///
    /// `keys` name every row the work may read or write (a purchase's transaction id, its
    /// credit key, a submission's id...): two units whose keys are apart touch no row in
    /// common, and may go side by side. Work that names them reads once, first, and queues its
    /// writes (`executeLater`), or else runs again alone (see `SideBySideRound`). Nil: the
    /// work runs alone, between the units before it and the ones after.
    package func write<T: Sendable>(
        keys: Set<String>? = nil, _ work: @escaping @Sendable (any SQLConnection) async throws -> T
    ) async throws -> T {
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<T, any Error>) in
            // Written while the batch runs, read after the commit: never at the same time.
            let outcome = NIOLockedValueBox<Result<T, any Error>?>(nil)
            let pending = Pending(
                keys: keys,
                perform: { db in
                    let value = try await work(db)
                    outcome.withLockedValue { $0 = .success(value) }
                },
                fail: { error in outcome.withLockedValue { $0 = .failure(error) } },
                resume: { commitError in
                    if let commitError {
                        continuation.resume(throwing: commitError)
                    } else if let result = outcome.withLockedValue({ $0 }) {
                        continuation.resume(with: result)
                    } else {
                        continuation.resume(throwing: SQLError(.other, "the group commit ran no outcome for this write"))
                    }
                })
            let startDrain = state.withLockedValue { state in
                state.pending.append(pending)
                guard !state.draining else { return false }
                state.draining = true
                return true
            }
            if startDrain {
                Task { await self.drain() }
            }
        }
    }

    /// Batches begun so far (each one transaction).
    package var batches: Int { state.withLockedValue { $0.batches } }

    /// Writes queued for the next batch (not counting the one being committed).
    package var waiting: Int { state.withLockedValue { $0.pending.count } }

    /// Commits batches until nobody waits.
    private func drain() async {
        var backoff = 0
        while true {
            if backoff > 0 {
                // Units that conflicted run again after a pause that grows with their conflicts,
                // jittered, so that two order services whose units keep meeting stop meeting.
                let limit = min(0.002 * pow(2, Double(min(backoff, 10))), 0.25)
                try? await Task.sleep(for: .seconds(Double.random(in: 0...1) * limit))
            }
            let batch = state.withLockedValue { state -> [Pending] in
                guard !state.pending.isEmpty else {
                    state.draining = false
                    return []
                }
                state.batches += 1
                let count = Self.batchSize(state.pending.prefix(maxBatch).map(\.keys), maxKeys: maxKeys)
                let batch = Array(state.pending.prefix(count))
                state.pending.removeFirst(count)
                return batch
            }
            if batch.isEmpty { return }
            do {
                let conflicted = try await commit(keys: Self.keys(of: batch.map(\.keys))) { db -> [Int: any Error] in
                    var conflicted: [Int: any Error] = [:]
                    for round in Self.rounds(batch.map(\.keys)) {
                        let outcomes: [(Int, Outcome)]
                        if round.count > 1, let connection = db as? any SideBySideConnection {
                            outcomes = await self.sideBySide(round.map { batch[$0] }, on: connection)
                                .enumerated().map { (round[$0.offset], $0.element) }
                        } else {
                            var alone: [(Int, Outcome)] = []
                            for index in round { alone.append((index, await batch[index].runAlone(on: db))) }
                            outcomes = alone
                        }
                        for (index, outcome) in outcomes {
                            switch outcome {
                            case .done:
                                break
                            case .conflicted(let error):
                                conflicted[index] = error
                            case .failed(let error):
                                // Some errors (disk full, I/O, a lost connection) roll back the whole
                                // transaction, taking the writes before them with it: fail the batch
                                // rather than commit what follows and report the lost ones as stored.
                                // (On PostgreSQL a lost connection runs the batch again.)
                                guard db.isInsideTransaction else {
                                    throw (error as? SQLError) ?? SQLError(.other, "the group commit's transaction was rolled back")
                                }
                            }
                        }
                    }
                    return conflicted
                }
                var again: [Pending] = []
                for (index, pending) in batch.enumerated() {
                    guard let error = conflicted[index] else {
                        pending.resume(nil)
                        continue
                    }
                    var retried = pending
                    retried.conflicts += 1
                    if retried.conflicts > Self.maxConflicts {
                        retried.resume(error)
                    } else {
                        again.append(retried)
                    }
                }
                backoff = again.map(\.conflicts).max() ?? 0
                if !again.isEmpty {
                    state.withLockedValue { $0.pending.insert(contentsOf: again, at: 0) }
                }
            } catch {
                // The commit failed, or the transaction was rolled back under it (disk full, I/O
                // error): nothing of the batch is stored, and every caller hears so.
                for pending in batch { pending.resume(error) }
                backoff = 0
            }
        }
    }

    /// Runs a batch's transaction on its writer, holding the locks of `keys` (nil: of every row).
    private func commit<T: Sendable>(
        keys: Set<String>?, _ body: @escaping @Sendable (any SQLConnection) async throws -> T
    ) async throws -> T {
        switch (writer, keys) {
        case (.ledger, let keys?): try await database.write(keys: keys, body)
        case (.ledger, nil): try await database.write(body)
        case (.uploads, _): try await database.acceptUploads(body)
        }
    }

    /// How many of the units waiting (by their keys, at most a batch's worth) the next batch
    /// takes: all of them, unless their keys together would pass `maxKeys`; then those before,
    /// and always at least one. A unit without keys counts none: its batch locks the whole
    /// ledger. (On PostgreSQL each key is a lock held to the commit, in a lock table the server
    /// sizes for about 64 per connection: a bound per batch keeps services × `maxKeys` in it.)
    package static func batchSize(_ keys: [Set<String>?], maxKeys: Int) -> Int {
        var union = Set<String>()
        for (index, unitKeys) in keys.enumerated() {
            guard let unitKeys else { continue }
            union.formUnion(unitKeys)
            if union.count > maxKeys, index > 0 { return index }
        }
        return keys.count
    }

    /// The keys a batch's transaction locks: every unit's, or nil (every row) when one of them
    /// names none.
    package static func keys(of units: [Set<String>?]) -> Set<String>? {
        var union = Set<String>()
        for unitKeys in units {
            guard let unitKeys else { return nil }
            union.formUnion(unitKeys)
        }
        return union
    }

    /// Batches a unit may conflict in before its caller hears of the conflict.
    package static let maxConflicts = 64

    /// Units run side by side so far, and those of them that then ran again alone.
    package var sideBySideUnits: (together: Int, alone: Int) { state.withLockedValue { ($0.together, $0.alone) } }

    /// The batch's units (by their keys) as rounds, in order: a round holds units whose keys
    /// are apart from each other's and from those of every unit left for a later round before
    /// them, so units that meet keep their order. A unit without keys is a round of its own.
    package static func rounds(_ keys: [Set<String>?]) -> [[Int]] {
        var rounds: [[Int]] = []
        var remaining = Array(keys.indices)
        while !remaining.isEmpty {
            var round: [Int] = []
            var later: [Int] = []
            var taken = Set<String>()
            var waiting = Set<String>()
            var closed = false
            for index in remaining {
                if closed {
                    later.append(index)
                } else if let unitKeys = keys[index] {
                    if unitKeys.isDisjoint(with: taken), unitKeys.isDisjoint(with: waiting) {
                        round.append(index)
                        taken.formUnion(unitKeys)
                    } else {
                        later.append(index)
                        waiting.formUnion(unitKeys)
                    }
                } else {
                    // Alone, and nothing after it goes before it.
                    closed = true
                    if round.isEmpty, later.isEmpty { round.append(index) } else { later.append(index) }
                }
            }
            rounds.append(round)
            remaining = later
        }
        return rounds
    }

    /// Runs `units` as one round side by side, then the ones that could not go side by side
    /// alone, in their order; answers each unit's outcome.
    private func sideBySide(_ units: [Pending], on connection: any SideBySideConnection) async -> [Outcome] {
        let round = SideBySideRound(units: units.count, on: connection)
        var outcomes: [Outcome?] = await withTaskGroup(of: (Int, Outcome?).self) { group in
            for (index, pending) in units.enumerated() {
                group.addTask {
                    let unit = round.unit(index)
                    defer { round.ended() }
                    var goesAlone = false
                    let outcome = await pending.outcome(on: connection) {
                        do {
                            try await pending.perform(unit)
                            try await unit.close()
                        } catch is SideBySideRound.GoesAlone {
                            goesAlone = true
                        }
                    }
                    return (index, goesAlone ? nil : outcome)
                }
            }
            group.addTask {
                await round.serve()
                return (-1, nil)
            }
            var outcomes = [Outcome?](repeating: nil, count: units.count)
            for await (index, outcome) in group where index >= 0 { outcomes[index] = outcome }
            return outcomes
        }
        var alone = 0
        for index in units.indices where outcomes[index] == nil {
            alone += 1
            outcomes[index] = await units[index].runAlone(on: connection)
        }
        state.withLockedValue { [alone] in
            $0.together += units.count
            $0.alone += alone
        }
        return outcomes.map { $0 ?? .done }
    }
}
