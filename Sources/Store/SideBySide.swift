import NIOConcurrencyHelpers

/// One round of a group commit's units run side by side on a `SideBySideConnection`: each
/// unit runs as a task of its own until it waits for the database; once every unit waits (or
/// has ended), the reads they wait for go in one round trip, or else their writes in one.
///
/// A unit takes part as long as it reads once, first, and writes at its end (`executeLater`):
/// the ledger's shape, an upload's facts read up front and its plan written in one go. Any
/// other call (a second read, a read after a write, a statement run at once) throws
/// `GoesAlone`: nothing it did stayed (its one read changed nothing, its writes were queued
/// here only), and the group commit runs it again, alone, once the round has ended. The
/// units of a round touch no row another of them reads (`GroupCommit.rounds`): what each one
/// read is still true when its writes go, whichever unit's writes go first.
package final class SideBySideRound: Sendable {
    private enum Request {
        case read([SQLStatement], CheckedContinuation<[[SQLRow]], any Error>)
        case write([SQLStatement], CheckedContinuation<Void, any Error>)
    }

    private struct State {
        /// Units neither waiting for the database nor ended.
        var running: Int
        var requests: [Int: Request] = [:]
        var idle: CheckedContinuation<Void, Never>?

        /// One unit less runs; the continuation to resume when that leaves none.
        mutating func stopped() -> CheckedContinuation<Void, Never>? {
            running -= 1
            guard running == 0, let idle else { return nil }
            self.idle = nil
            return idle
        }
    }

    /// A unit called what a round cannot run side by side.
    package struct GoesAlone: Error {}

    package let connection: any SideBySideConnection
    private let state: NIOLockedValueBox<State>

    package init(units: Int, on connection: any SideBySideConnection) {
        self.connection = connection
        state = NIOLockedValueBox(State(running: units))
    }

    /// The connection unit `index` runs on in this round.
    package func unit(_ index: Int) -> Unit { Unit(round: self, index: index) }

    /// Unit `index` has ended (its work returned or threw).
    package func ended() {
        state.withLockedValue { $0.stopped() }?.resume()
    }

    fileprivate func read(_ queries: [SQLStatement], unit: Int) async throws -> [[SQLRow]] {
        try await withCheckedThrowingContinuation { continuation in
            state.withLockedValue { state in
                state.requests[unit] = .read(queries, continuation)
                return state.stopped()
            }?.resume()
        }
    }

    fileprivate func write(_ statements: [SQLStatement], unit: Int) async throws {
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
            state.withLockedValue { state in
                state.requests[unit] = .write(statements, continuation)
                return state.stopped()
            }?.resume()
        }
    }

    private func untilIdle() async {
        await withCheckedContinuation { continuation in
            let idle = state.withLockedValue { state in
                guard state.running > 0 else { return true }
                state.idle = continuation
                return false
            }
            if idle { continuation.resume() }
        }
    }

    /// Answers the units' reads and writes until every unit has ended. Reads go first: the
    /// units whose writes wait meanwhile go with the ones still reading.
    package func serve() async {
        while true {
            await untilIdle()
            let (reads, writes) = state.withLockedValue { state in
                var reads: [(Int, [SQLStatement], CheckedContinuation<[[SQLRow]], any Error>)] = []
                var writes: [(Int, [SQLStatement], CheckedContinuation<Void, any Error>)] = []
                for (index, request) in state.requests {
                    switch request {
                    case .read(let queries, let continuation): reads.append((index, queries, continuation))
                    case .write(let statements, let continuation): writes.append((index, statements, continuation))
                    }
                }
                reads.sort { $0.0 < $1.0 }
                writes.sort { $0.0 < $1.0 }
                if !reads.isEmpty { writes = [] }
                for (index, _, _) in reads { state.requests[index] = nil }
                for (index, _, _) in writes { state.requests[index] = nil }
                state.running += reads.count + writes.count
                return (reads, writes)
            }
            if !reads.isEmpty {
                do {
                    let sets = try await connection.readSideBySide(reads.map(\.1))
                    for (read, rows) in zip(reads, sets) { read.2.resume(returning: rows) }
                } catch {
                    for read in reads { read.2.resume(throwing: error) }
                }
            } else if !writes.isEmpty {
                do {
                    let errors = try await connection.writeSideBySide(writes.map(\.1))
                    for (write, error) in zip(writes, errors) {
                        if let error { write.2.resume(throwing: error) } else { write.2.resume() }
                    }
                } catch {
                    for write in writes { write.2.resume(throwing: error) }
                }
            } else {
                return
            }
        }
    }

    /// What one unit of the round runs on: its first read and its closing writes go with the
    /// other units'; anything else throws `GoesAlone`.
    package final class Unit: SQLConnection, @unchecked Sendable {
        // Unchecked: only the unit's own task touches it.
        private let round: SideBySideRound
        private let index: Int
        private var hasRead = false
        private var pending: [SQLStatement] = []

        fileprivate init(round: SideBySideRound, index: Int) {
            self.round = round
            self.index = index
        }

        package var dialect: SQLDialect { round.connection.dialect }
        package var changesCount: Int { 0 }
        package var isInsideTransaction: Bool { round.connection.isInsideTransaction }
        package var filled: CommitQueues { pending.reduce(round.connection.filled) { $0.union($1.fills) } }

        package func readBatch(_ queries: [SQLStatement]) async throws -> [[SQLRow]] {
            guard !hasRead, pending.isEmpty else { throw GoesAlone() }
            hasRead = true
            return try await round.read(queries, unit: index)
        }

        package func executeLater(_ statements: [SQLStatement]) async throws {
            pending += statements
        }

        /// Sends the unit's queued writes with the other units'; its error if they were undone.
        func close() async throws {
            guard !pending.isEmpty else { return }
            let statements = pending
            pending = []
            try await round.write(statements, unit: index)
        }

        package func execute(sql: String, arguments: SQLArguments) async throws -> Int { throw GoesAlone() }
        package func rows(sql: String, arguments: SQLArguments) async throws -> [SQLRow] { throw GoesAlone() }
        package func executeBatch(_ statements: [SQLStatement]) async throws { throw GoesAlone() }
        package func inSavepoint<T>(_ body: () async throws -> T) async throws -> T { throw GoesAlone() }
    }
}
