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
final class GroupCommit: Sendable {
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
        /// Runs the work in a savepoint of the shared transaction and keeps its value.
        let run: @Sendable (any SQLConnection) async -> Outcome
        /// After the commit: answers with the kept outcome, or with the commit's own error.
        let resume: @Sendable ((any Error)?) -> Void
        /// Batches it conflicted in so far.
        var conflicts = 0
    }

    private struct State {
        var pending: [Pending] = []
        var draining = false
        var batches = 0
    }

    private let database: any SQLDatabase
    private let maxBatch: Int
    private let state = NIOLockedValueBox(State())

    init(database: any SQLDatabase, maxBatch: Int = 512) {
        self.database = database
        self.maxBatch = maxBatch
    }

    /// Runs `work` in a savepoint of the next group commit and returns its value once that
    /// commit is durable. An error thrown by `work` rolls back its own savepoint only.
    func write<T: Sendable>(_ work: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<T, any Error>) in
            // Written on the writer's queue, read after the commit: never at the same time.
            let outcome = NIOLockedValueBox<Result<T, any Error>?>(nil)
            let pending = Pending(
                run: { db in
                    do {
                        let value = try await db.inSavepoint { try await work(db) }
                        outcome.withLockedValue { $0 = .success(value) }
                        return .done
                    } catch let error as SQLError where error.kind == .serializationFailure && db.isInsideTransaction {
                        return .conflicted(error)
                    } catch {
                        outcome.withLockedValue { $0 = .failure(error) }
                        return .failed(error)
                    }
                },
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
    var batches: Int { state.withLockedValue { $0.batches } }

    /// Writes queued for the next batch (not counting the one being committed).
    var waiting: Int { state.withLockedValue { $0.pending.count } }

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
                let count = min(maxBatch, state.pending.count)
                let batch = Array(state.pending.prefix(count))
                state.pending.removeFirst(count)
                return batch
            }
            if batch.isEmpty { return }
            do {
                let conflicted = try await database.write { db -> [Int: any Error] in
                    var conflicted: [Int: any Error] = [:]
                    for (index, pending) in batch.enumerated() {
                        switch await pending.run(db) {
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

    /// Batches a unit may conflict in before its caller hears of the conflict.
    static let maxConflicts = 64
}
