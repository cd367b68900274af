import NIOConcurrencyHelpers
import Store

/// Announces each commit that filled one of the store's queues (`CommitQueues`), whoever wrote
/// it: for the outbox, an accepted upload, a result's events, a requeue by the sweeper,
/// customer service or reconciliation, so that a relay publishes them at once rather than at
/// its next poll; for the calls to Apple, a settled transaction to finish or a consumption
/// request to answer.
///
/// The store raises it itself after such a commit; writers never call it. Each listener keeps
/// the count it has seen and waits for a higher one, so any number of listeners hear every
/// commit, and a commit that lands while a listener is busy is not missed.
public final class CommitSignal: Sendable {
    private struct State {
        var commits: UInt64 = 0
        var waiters: [UInt64: CheckedContinuation<UInt64, Never>] = [:]
        /// Waits begun and not yet returned.
        var active: Set<UInt64> = []
        /// Waits whose time ran out before they were registered.
        var expired: Set<UInt64> = []
        var nextWaiter: UInt64 = 0
    }

    private let state = NIOLockedValueBox(State())

    public init() {}

    /// Commits announced so far.
    public var commits: UInt64 { state.withLockedValue { $0.commits } }

    /// Announces a commit that filled the queue. A worker that is stopping calls it too, to end
    /// its own wait at once: every listener then looks at the queue one more time, which costs
    /// a read and loses nothing.
    public func announce() {
        let (waiters, commits) = state.withLockedValue { state in
            state.commits += 1
            let waiters = Array(state.waiters.values)
            state.waiters.removeAll()
            return (waiters, state.commits)
        }
        for waiter in waiters { waiter.resume(returning: commits) }
    }

    /// Returns the count of commits once it is above `seen` (at once if it already is), or
    /// after `timeout` or when the task is cancelled (the count then, which may equal `seen`).
    public func wait(after seen: UInt64, timeout: Duration) async -> UInt64 {
        let id = state.withLockedValue { state -> UInt64 in
            state.nextWaiter += 1
            state.active.insert(state.nextWaiter)
            return state.nextWaiter
        }
        let timer = Task { [weak self] in
            guard (try? await Task.sleep(for: timeout)) != nil else { return }
            self?.resume(id)
        }
        defer {
            timer.cancel()
            state.withLockedValue { state in
                state.active.remove(id)
                state.expired.remove(id)
            }
        }
        return await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<UInt64, Never>) in
                let now = state.withLockedValue { state -> UInt64? in
                    guard state.commits <= seen, state.expired.remove(id) == nil else { return state.commits }
                    state.waiters[id] = continuation
                    return nil
                }
                if let now { continuation.resume(returning: now) }
            }
        } onCancel: {
            resume(id)
        }
    }

    /// Wakes one waiter whose time is up or whose task was cancelled.
    private func resume(_ id: UInt64) {
        let found = state.withLockedValue { state -> (CheckedContinuation<UInt64, Never>, UInt64)? in
            guard let waiter = state.waiters.removeValue(forKey: id) else {
                if state.active.contains(id) { state.expired.insert(id) }
                return nil
            }
            return (waiter, state.commits)
        }
        if let (waiter, commits) = found { waiter.resume(returning: commits) }
    }
}

/// A database whose write transactions announce, when they commit, on the signal of each queue
/// they filled.
struct AnnouncingDatabase: SQLDatabase {
    let inner: any SQLDatabase
    /// Each queue's signal.
    let signals: [(queue: CommitQueues, signal: CommitSignal)]

    var dialect: SQLDialect { inner.dialect }

    func read<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        try await inner.read(body)
    }

    /// A commit announces the queues it filled; a transaction that failed filled nothing.
    @discardableResult
    func write<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        let (value, filled) = try await inner.write { db in (try await body(db), db.filled) }
        announce(filled)
        return value
    }

    @discardableResult
    func write<T: Sendable>(keys: Set<String>, _ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        let (value, filled) = try await inner.write(keys: keys) { db in (try await body(db), db.filled) }
        announce(filled)
        return value
    }

    func writeCounters<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        let (value, filled) = try await inner.writeCounters { db in (try await body(db), db.filled) }
        announce(filled)
        return value
    }

    @discardableResult
    func acceptUploads<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        let (value, filled) = try await inner.acceptUploads { db in (try await body(db), db.filled) }
        announce(filled)
        return value
    }

    @discardableResult
    func writeQueues<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        let (value, filled) = try await inner.writeQueues { db in (try await body(db), db.filled) }
        announce(filled)
        return value
    }

    func close() async {
        await inner.close()
    }

    private func announce(_ filled: CommitQueues) {
        for (queue, signal) in signals where filled.contains(queue) { signal.announce() }
    }
}
