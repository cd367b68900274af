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
    /// One caller's unit of work and how to answer it.
    private struct Pending: Sendable {
        /// Runs the work in a savepoint of the shared transaction and keeps its outcome.
        /// Runs the work in a savepoint of the shared transaction, keeps its outcome, and
        /// returns its error if it failed.
        let run: @Sendable (any SQLConnection) -> (any Error)?
        /// After the commit: answers with the kept outcome, or with the commit's own error.
        let resume: @Sendable ((any Error)?) -> Void
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
    func write<T: Sendable>(_ work: @escaping @Sendable (any SQLConnection) throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<T, any Error>) in
            // Written on the writer's queue, read after the commit: never at the same time.
            let outcome = NIOLockedValueBox<Result<T, any Error>?>(nil)
            let pending = Pending(
                run: { db in
                    do {
                        let value = try db.inSavepoint { try work(db) }
                        outcome.withLockedValue { $0 = .success(value) }
                        return nil
                    } catch {
                        outcome.withLockedValue { $0 = .failure(error) }
                        return error
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
        while true {
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
                try await database.write { db in
                    for pending in batch {
                        let error = pending.run(db)
                        // Some errors (disk full, I/O, a lost connection) roll back the whole
                        // transaction, taking the writes before them with it: fail the batch
                        // rather than commit what follows and report the lost ones as stored.
                        // (On PostgreSQL a lost connection or a conflict runs the batch again.)
                        guard db.isInsideTransaction else {
                            throw (error as? SQLError) ?? SQLError(.other, "the group commit's transaction was rolled back")
                        }
                    }
                }
                for pending in batch { pending.resume(nil) }
            } catch {
                // The commit failed, or the transaction was rolled back under it (disk full, I/O
                // error): nothing of the batch is stored, and every caller hears so.
                for pending in batch { pending.resume(error) }
            }
        }
    }
}
