package import Foundation
package import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import PostgresNIO

/// The PostgreSQL server and database a store connects to.
package struct PostgresServer: Sendable, Equatable, CustomStringConvertible {
    package var host: String
    package var port: Int
    package var user: String
    package var password: String?
    package var database: String

    package init(host: String, port: Int, user: String, password: String?, database: String) {
        self.host = host
        self.port = port
        self.user = user
        self.password = password
        self.database = database
    }

    /// Where, without the password, for logs and errors.
    package var description: String { "postgres://\(user)@\(host):\(port)/\(database)" }
}

/// The backend for teams that outgrow one box: PostgreSQL, shared by any number of order
/// services.
///
/// Connections come from postgres-nio's pooled `PostgresClient`, which reconnects on its own;
/// every wait is bounded (a lease, a statement) and nothing blocks a thread. Writes run
/// `READ COMMITTED`, one at a time per writer (the ledger's, the uploads', the relay's), each
/// kept apart from the writers it could meet by locks rather than by serializability:
/// - the ledger's by transaction-level advisory locks (`ledgerLocks`): work that names its rows
///   (`write(keys:)`) holds one lock per key and the ledger's lock shared, other work holds the
///   ledger's lock alone. Two services crediting the same purchase take the same lock: the
///   second waits for the first's commit and then reads its rows. Work whose keys are apart
///   runs at once, where `SERIALIZABLE` failed it on the pages of an index both had read;
/// - uploads insert only rows of their own; the relay's claims lock their rows (`FOR UPDATE`).
/// A transaction that never reached its commit (a deadlock, a lost connection) is run again on
/// a fresh connection until `patience` runs out.
package final class PostgresDatabase: SQLDatabase {
    package let location: PostgresServer
    private let logger: Logger
    /// The ledger's connections: a commit waits until it is on the server's disk.
    private let client: PostgresClient
    /// The connections of `writeCounters`: what they write is worth seconds, no wait for the disk.
    private let asideClient: PostgresClient
    /// Runs both clients until `close`.
    private let clients: Task<Void, Never>
    private let writerGate = AsyncGate(permits: 1)
    /// The transactions of `acceptUploads`, one at a time beside the writer's.
    private let uploadsGate = AsyncGate(permits: 1)
    /// The transactions of `writeQueues`, one at a time beside the writers'.
    private let lockedGate = AsyncGate(permits: 1)
    private let readerGate: AsyncGate
    /// How long a transaction keeps trying through lost connections and conflicts.
    private let patience: TimeInterval
    /// Until when `writeCounters` fails at once after a failure rather than wait for a connection.
    private let asideDownUntil = NIOLockedValueBox(Date.distantPast)
    private let statementObserver: (@Sendable (String) -> Void)?

    package var dialect: SQLDialect { .postgres }

    /// `statementObserver` hears the SQL text (with `?` marks) of every statement the store runs.
    package init(
        location: PostgresServer, readers: Int = 4, patience: TimeInterval = 30,
        logger: Logger = Logger(label: "iap.orderstore.postgres"), statementObserver: (@Sendable (String) -> Void)? = nil
    ) async throws {
        self.location = location
        self.logger = logger
        self.patience = patience
        self.statementObserver = statementObserver
        readerGate = AsyncGate(permits: max(1, readers))
        // The readers', the two writers' and `writeQueues`'s, and one more for a lease that
        // outlives its transaction's turn (a connection going back to the pool).
        client = PostgresClient(
            configuration: Self.configuration(location, connections: max(1, readers) + 4, synchronousCommit: true),
            eventLoopGroup: Self.eventLoops, backgroundLogger: logger)
        var asideConfiguration = Self.configuration(location, connections: 2, synchronousCommit: false)
        asideConfiguration.options.connectTimeout = .seconds(2)
        asideClient = PostgresClient(
            configuration: asideConfiguration, eventLoopGroup: Self.asideEventLoops, backgroundLogger: logger)
        // Each client says when its `run()` begins: a lease asked before that waits for it (and
        // postgres-nio warns of it), so the first one, the migration's, waits for both.
        let (started, starting) = AsyncStream<Void>.makeStream()
        clients = Task { [client, asideClient] in
            await withDiscardingTaskGroup { group in
                for each in [client, asideClient] {
                    group.addTask {
                        starting.yield()
                        await each.run()
                    }
                }
            }
        }
        var running = 0
        for await _ in started {
            running += 1
            if running == 2 { break }
        }
        await Task.yield()
        do {
            try await withSession(client, leaseTimeout: .seconds(15)) { session in try await PostgresSchema.migrate(session) }
        } catch {
            clients.cancel()
            throw error
        }
    }

    /// The event loops of every PostgreSQL store in the process, apart from the ones that serve
    /// HTTP: a transaction's body runs on its connection's loop (the ledger's work between two
    /// statements included), and must never hold up a request's.
    private static let eventLoops = MultiThreadedEventLoopGroup(numberOfThreads: 2)
    /// The loop of `writeCounters`'s connections, which must answer while a long group commit
    /// holds the ledger's.
    private static let asideEventLoops = MultiThreadedEventLoopGroup(numberOfThreads: 1)

    private static func configuration(_ location: PostgresServer, connections: Int, synchronousCommit: Bool)
        -> PostgresClient.Configuration
    {
        var configuration = PostgresClient.Configuration(
            host: location.host, port: location.port, username: location.user, password: location.password,
            database: location.database, tls: .disable)
        configuration.options.connectTimeout = .seconds(5)
        configuration.options.maximumConnections = connections
        // An answered commit is on the server's disk, whatever the server's default says.
        configuration.options.additionalStartupParameters = [("synchronous_commit", synchronousCommit ? "on" : "off")]
        return configuration
    }

    package func read<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        await readerGate.acquire()
        defer { readerGate.release() }
        return try await transaction(begin: "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", body)
    }

    package func write<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        try await writeLedger(locks: Self.ledgerLocks(nil), body)
    }

    package func write<T: Sendable>(keys: Set<String>, _ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        try await writeLedger(locks: Self.ledgerLocks(keys), body)
    }

    private func writeLedger<T: Sendable>(
        locks: String, _ body: @escaping @Sendable (any SQLConnection) async throws -> T
    ) async throws -> T {
        await writerGate.acquire()
        defer { writerGate.release() }
        return try await transaction(begin: "BEGIN ISOLATION LEVEL READ COMMITTED", locks: locks, body)
    }

    /// The advisory lock every write of the ledger holds: shared by work that names its keys,
    /// alone by work that may touch any row. (`pg_advisory_xact_lock` with one `bigint`; the
    /// sweeper's and the migrations' locks are other numbers.)
    package static let ledgerLock: Int64 = 0x4941_505F_4C45_4447

    /// The statement that takes the ledger's locks for work touching the rows `keys` name (nil:
    /// any row). Every service takes them in one order, the ledger's lock first and then the
    /// keys' by number, so two transactions wait for each other but never deadlock; a key's
    /// number is a 64-bit FNV-1a hash of its name, the same in every service and version.
    package static func ledgerLocks(_ keys: Set<String>?) -> String {
        guard let keys else { return "SELECT pg_advisory_xact_lock(\(ledgerLock))" }
        let numbers = Set(keys.map(lockNumber)).sorted().map(String.init).joined(separator: ",")
        return """
            SELECT count(*) FROM (SELECT pg_advisory_xact_lock_shared(\(ledgerLock)) UNION ALL
            SELECT pg_advisory_xact_lock(key) FROM unnest('{\(numbers)}'::int8[]) AS key) AS held
            """
    }

    /// The lock number of a key's name: FNV-1a, 64 bits.
    package static func lockNumber(_ key: String) -> Int64 {
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325
        for byte in key.utf8 {
            hash ^= UInt64(byte)
            hash &*= 0x0000_0100_0000_01B3
        }
        return Int64(bitPattern: hash)
    }

    @discardableResult
    package func acceptUploads<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        await uploadsGate.acquire()
        defer { uploadsGate.release() }
        return try await transaction(begin: "BEGIN ISOLATION LEVEL READ COMMITTED", body)
    }

    @discardableResult
    package func writeQueues<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        await lockedGate.acquire()
        defer { lockedGate.release() }
        return try await transaction(begin: "BEGIN ISOLATION LEVEL READ COMMITTED", body)
    }

    /// On a connection of its own, in autocommit (each statement its own transaction, READ
    /// COMMITTED: an upsert of one row waits for that row's lock, never for a conflict to
    /// retry). Once it fails, it fails at once for a second rather than queue every caller
    /// behind a connect timeout while the database is away.
    package func writeCounters<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        guard Date() >= asideDownUntil.withLockedValue({ $0 }) else {
            throw SQLError(.connection, "the database did not answer a moment ago")
        }
        do {
            // A statement has 2 s; the lease more, as callers queue for the two connections
            // (a burst of takes at one instant), and connecting has 2 s (`asideConfiguration`).
            return try await withSession(
                asideClient, leaseTimeout: .seconds(5), statementTimeout: .seconds(2), onConnectionsLoop: false
            ) { session in
                let value = try await body(session)
                try await session.flushPendingWrites(last: true)
                return value
            }
        } catch let error as SQLError where error.kind == .connection {
            asideDownUntil.withLockedValue { $0 = Date().addingTimeInterval(1) }
            throw error
        }
    }

    /// Runs a statement outside any transaction (for tests and tools).
    package func executeOutsideTransaction(_ sql: String) async throws {
        try await withSession(client, leaseTimeout: .seconds(15)) { session in _ = try await session.execute(sql: sql) }
    }

    /// Creates the empty database `name` on the server at `server` (for benchmarks and tools).
    package static func createDatabase(_ name: String, on server: PostgresServer) async throws {
        try await withConnection(to: server) { db in _ = try await db.execute(sql: "CREATE DATABASE \(name)", arguments: []) }
    }

    /// Drops the database `name` on the server at `server`, closing its connections.
    package static func dropDatabase(_ name: String, on server: PostgresServer) async throws {
        try await withConnection(to: server) { db in
            _ = try await db.execute(sql: "DROP DATABASE IF EXISTS \(name) WITH (FORCE)", arguments: [])
        }
    }

    /// Runs `body` on one connection of its own to `location`, in autocommit, outside any store
    /// (creating a database, reading the server's catalogue).
    package static func withConnection<T: Sendable>(
        to location: PostgresServer, logger: Logger = Logger(label: "iap.orderstore.postgres"),
        _ body: @Sendable (any SQLConnection) async throws -> T
    ) async throws -> T {
        let configuration = PostgresConnection.Configuration(
            host: location.host, port: location.port, username: location.user, password: location.password,
            database: location.database, tls: .disable)
        let connection: PostgresConnection
        do {
            connection = try await PostgresConnection.connect(
                on: eventLoops.any(), configuration: configuration, id: 0, logger: logger
            ).get()
        } catch {
            throw PostgresSession.translate(error, sql: "(connect to \(location))")
        }
        do {
            let value = try await body(PostgresSession(connection: connection, logger: logger, statementObserver: nil))
            try? await connection.close()
            return value
        } catch {
            try? await connection.close()
            throw error
        }
    }

    package func close() async {
        clients.cancel()
        await clients.value
    }

    deinit {
        clients.cancel()
    }

    /// Runs `body` on a connection leased from `client` within `leaseTimeout`, each of its
    /// statements answered within `statementTimeout` (past it, the connection counts as lost).
    private func withSession<T: Sendable>(
        _ client: PostgresClient, leaseTimeout: Duration, statementTimeout: TimeAmount = PostgresSession.defaultStatementTimeout,
        onConnectionsLoop: Bool = true, _ body: @escaping @Sendable (PostgresSession) async throws -> T
    ) async throws -> T {
        let leased = NIOLockedValueBox(false)
        let (logger, observer, location) = (logger, statementObserver, location)
        return try await withThrowingTaskGroup(of: T?.self) { group in
            group.addTask {
                do {
                    return try await client.withConnection { connection in
                        leased.withLockedValue { $0 = true }
                        let session = PostgresSession(
                            connection: connection, logger: logger, statementObserver: observer, statementTimeout: statementTimeout)
                        // The body runs on the connection's own event loop: each answer resumes
                        // it where it arrived, with no hop to another thread per statement.
                        guard onConnectionsLoop else { return try await body(session) }
                        return try await withTaskExecutorPreference(EventLoopTaskExecutor(connection.eventLoop)) {
                            try await body(session)
                        }
                    }
                } catch {
                    // The body's own errors go as they are; before the lease, the pool's failed.
                    if leased.withLockedValue({ $0 }) || error is SQLError { throw error }
                    throw PostgresSession.translate(error, sql: "(connect to \(location))")
                }
            }
            group.addTask {
                try? await Task.sleep(for: leaseTimeout)
                guard leased.withLockedValue({ $0 }) || Task.isCancelled else {
                    throw SQLError(.connection, "no connection to \(location) within \(leaseTimeout)")
                }
                return nil
            }
            while let outcome = try await group.next() {
                if let value = outcome {
                    group.cancelAll()
                    return value
                }
            }
            throw SQLError(.connection, "no connection to \(location)")
        }
    }

    /// Runs `body` in one transaction, again after a conflict or a connection lost before the
    /// commit was sent, until `patience` runs out.
    private func transaction<T: Sendable>(
        begin: String, locks: String? = nil, _ body: @escaping @Sendable (any SQLConnection) async throws -> T
    ) async throws -> T {
        let deadline = Date().addingTimeInterval(patience)
        var attempt = 0
        while true {
            attempt += 1
            let committing = NIOLockedValueBox(false)
            do {
                return try await withSession(client, leaseTimeout: .seconds(max(1, Int64(deadline.timeIntervalSinceNow)))) { session in
                    try await session.execute(sql: begin)
                    do {
                        if let locks { try await session.execute(sql: locks) }
                        let value = try await body(session)
                        try await session.flushPendingWrites(last: true)
                        if session.mustRetry {
                            throw SQLError(.serializationFailure, "a statement of the transaction conflicted with another writer")
                        }
                        guard session.isInsideTransaction else {
                            throw SQLError(.other, "the transaction was aborted by an error it did not handle")
                        }
                        committing.withLockedValue { $0 = true }
                        try await session.execute(sql: "COMMIT")
                        return value
                    } catch {
                        // Nothing the body wrote stays (a rule of the ledger refused, a conflict),
                        // and the connection goes back to the pool outside any transaction.
                        if (error as? SQLError)?.kind != .connection { _ = try? await session.execute(sql: "ROLLBACK") }
                        throw error
                    }
                }
            } catch let error as SQLError {
                switch error.kind {
                case .serializationFailure where Date() < deadline:
                    // A deadlock (40P01: two relays' claims of outbox rows) or a serialization
                    // failure (40001): back off, exponentially with jitter up to a quarter
                    // second, so that two transactions that keep meeting stop meeting.
                    let limit = min(0.002 * pow(2, Double(min(attempt, 10))), 0.25)
                    try await Task.sleep(for: .seconds(Double.random(in: 0...1) * limit))
                case .connection where !committing.withLockedValue({ $0 }) && Date() < deadline:
                    logger.warning("order store connection lost; trying again", metadata: ["error": "\(error)"])
                    try await Task.sleep(for: .seconds(min(0.05 * Double(attempt), 1)))
                default:
                    throw error
                }
            }
        }
    }
}

/// Runs tasks on one event loop.
package final class EventLoopTaskExecutor: TaskExecutor {
    private let eventLoop: any EventLoop

    init(_ eventLoop: any EventLoop) {
        self.eventLoop = eventLoop
    }

    package func enqueue(_ job: UnownedJob) {
        let executor = asUnownedTaskExecutor()
        eventLoop.execute { job.runSynchronously(on: executor) }
    }
}

/// One leased PostgreSQL connection inside one transaction (or in autocommit).
package final class PostgresSession: SideBySideConnection, @unchecked Sendable {
    // Unchecked: a session is only touched by the one task running its transaction.
    private let connection: PostgresConnection
    private let logger: Logger
    private let statementObserver: (@Sendable (String) -> Void)?
    /// How long one statement may take before the connection counts as lost (a server that
    /// went away without closing the socket must not hold the writer forever).
    private let statementTimeout: TimeAmount
    /// The savepoints of `inSavepoint` open now, innermost last; each is sent only before a
    /// write that may not be its unit's last (a unit whose one write ends it needs none).
    private var savepoints: [(name: String, sent: Bool)] = []
    /// Writes of `executeLater` not sent yet.
    private var pendingWrites: [SQLStatement] = []
    /// The queues writes sent filled, that stayed (not undone with their unit).
    private var sentFills: CommitQueues = []
    package var filled: CommitQueues { pendingWrites.reduce(sentFills) { $0.union($1.fills) } }
    package private(set) var changesCount = 0
    /// A statement outside any savepoint hit a serialization failure or deadlock: the
    /// transaction must run again.
    private(set) var mustRetry = false
    /// False once an error outside a savepoint aborted the transaction.
    package private(set) var isInsideTransaction = true
    private static let placeholders = NIOLockedValueBox([String: String]())
    private static let formats = NIOLockedValueBox([String: String]())

    init(
        connection: PostgresConnection, logger: Logger, statementObserver: (@Sendable (String) -> Void)?,
        statementTimeout: TimeAmount = PostgresSession.defaultStatementTimeout
    ) {
        self.connection = connection
        self.logger = logger
        self.statementObserver = statementObserver
        self.statementTimeout = statementTimeout
    }

    package var dialect: SQLDialect { .postgres }

    static let defaultStatementTimeout: TimeAmount = .seconds(120)

    @discardableResult
    package func execute(sql: String, arguments: SQLArguments) async throws -> Int {
        try await flushPendingWrites(last: false)
        try await sendSavepoints(keepingInnermost: false)
        _ = try await run(sql, arguments)
        return changesCount
    }

    package func rows(sql: String, arguments: SQLArguments) async throws -> [SQLRow] {
        try await flushPendingWrites(last: false)
        return try await run(sql, arguments)
    }

    package func executeBatch(_ statements: [SQLStatement]) async throws {
        try await executeLater(statements)
        try await flushPendingWrites(last: false)
    }

    package func executeLater(_ statements: [SQLStatement]) async throws {
        pendingWrites += statements
    }

    /// One query as it is; more in one call of `iap_read` (one round trip), their rows as JSON.
    package func readBatch(_ queries: [SQLStatement]) async throws -> [[SQLRow]] {
        try await flushPendingWrites(last: false)
        guard queries.count > 1 else {
            var sets: [[SQLRow]] = []
            for query in queries { sets.append(try await run(query.sql, query.arguments)) }
            return sets
        }
        let (texts, arguments) = formattedBatch(queries)
        let rows = try await run("SELECT iap_read(?, ?::jsonb) AS sets", [], binding: { binds in
            binds.append(texts)
            binds.append(arguments)
        })
        guard let answer = rows.first?.values.first, case .text(let json) = answer else {
            throw SQLError(.other, "iap_read answered no rows")
        }
        let sets = try RowSetsJSON.parse(json)
        guard sets.count == queries.count else {
            throw SQLError(.other, "iap_read answered \(sets.count) sets of rows for \(queries.count) queries")
        }
        return sets
    }

    /// Sends the writes of `executeLater`. `last`: nothing follows them in the innermost unit,
    /// whose savepoint then need not be sent (the batch is all or nothing by itself).
    package func flushPendingWrites(last: Bool) async throws {
        guard !pendingWrites.isEmpty else { return }
        let statements = pendingWrites
        pendingWrites = []
        try await sendSavepoints(keepingInnermost: last)
        // A lone statement goes as it is where a failure has a savepoint to return to, or
        // where there is no unit to keep apart (a transaction of its own). Otherwise (several
        // statements, or a unit's last write with no savepoint) in one call of `iap_write`,
        // which undoes them all and answers the failure without aborting the transaction.
        if statements.count == 1, savepoints.last?.sent ?? true {
            let statement = statements[0]
            _ = try await run(statement.sql, statement.arguments)
            if let error = statement.requiresChange, changesCount == 0 { throw error }
            sentFills.formUnion(statement.fills)
            return
        }
        let rows = try await run("SELECT iap_write(?, ?::jsonb, ?) AS counts", [], binding: writeBinding(statements))
        let counts = try Self.writeAnswer(rows.first?.values.first, for: statements).get()
        changesCount = counts.last ?? 0
        for statement in statements { sentFills.formUnion(statement.fills) }
    }

    /// The arguments of one call of `iap_write` running `statements`.
    private func writeBinding(_ statements: [SQLStatement]) -> (inout PostgresBindings) -> Void {
        let (texts, arguments) = formattedBatch(statements)
        let required = statements.map { $0.requiresChange != nil }
        return { binds in
            binds.append(texts)
            binds.append(arguments)
            binds.append(required)
        }
    }

    /// What one call of `iap_write` running `statements` answered: each statement's count of
    /// changed rows, or the error that undid them all.
    private static func writeAnswer(_ answer: SQLValue?, for statements: [SQLStatement]) -> Result<[Int], any Error> {
        guard let answer, case .text(let text) = answer else {
            return .failure(SQLError(.other, "iap_write answered no rows"))
        }
        if text.hasPrefix("failed ") {
            // `failed <statement> <SQLSTATE> <message>`, from 1.
            let parts = text.split(separator: " ", maxSplits: 3).map(String.init)
            let index = parts.count > 1 ? (Int(parts[1]) ?? 0) - 1 : -1
            let state = parts.count > 2 ? parts[2] : ""
            let message = parts.count > 3 ? parts[3] : text
            if state == noRowChanged, statements.indices.contains(index), let error = statements[index].requiresChange {
                return .failure(error)
            }
            let sql = statements.indices.contains(index) ? statements[index].sql : "iap_write"
            return .failure(serverError(state: state, detail: "\(message) [\(state)] (running \(sql.prefix(120)))"))
        }
        return Result {
            let counts = try integers(answer)
            guard counts.count == statements.count else {
                throw SQLError(.other, "iap_write answered \(counts.count) counts for \(statements.count) statements")
            }
            return counts
        }
    }

    /// Every unit's queries in one call of `iap_read`.
    package func readSideBySide(_ units: [[SQLStatement]]) async throws -> [[[SQLRow]]] {
        let sets = try await readBatch(units.flatMap { $0 })
        var answers: [[[SQLRow]]] = []
        answers.reserveCapacity(units.count)
        var start = 0
        for unit in units {
            answers.append(Array(sets[start..<start + unit.count]))
            start += unit.count
        }
        return answers
    }

    /// Every unit's writes in one statement that calls `iap_write` once per unit: each call
    /// undoes its own unit's writes when one fails (its block's subtransaction) and says so.
    package func writeSideBySide(_ units: [[SQLStatement]]) async throws -> [(any Error)?] {
        try await flushPendingWrites(last: false)
        try await sendSavepoints(keepingInnermost: false)
        let written = units.filter { !$0.isEmpty }
        guard !written.isEmpty else { return units.map { _ in nil } }
        let calls = written.indices.map { "iap_write(?, ?::jsonb, ?) AS u\($0)" }.joined(separator: ", ")
        let bindings = written.map(writeBinding)
        let rows = try await run("SELECT " + calls, [], binding: { binds in
            for binding in bindings { binding(&binds) }
        })
        guard let answers = rows.first?.values, answers.count == written.count else {
            throw SQLError(.other, "iap_write answered no row for \(written.count) units")
        }
        var errors: [(any Error)?] = []
        var next = 0
        for unit in units {
            guard !unit.isEmpty else {
                errors.append(nil)
                continue
            }
            switch Self.writeAnswer(answers[next], for: unit) {
            case .success:
                errors.append(nil)
                for statement in unit { sentFills.formUnion(statement.fills) }
            case .failure(let error):
                errors.append(error)
            }
            next += 1
        }
        return errors
    }

    /// The SQLSTATE `iap_write` raises for a statement that `requiresChange` and changed no row.
    package static let noRowChanged = "IAP00"

    /// Sends the savepoints not sent yet, outermost first; `keepingInnermost` leaves the
    /// innermost one unsent.
    private func sendSavepoints(keepingInnermost: Bool) async throws {
        let end = keepingInnermost ? savepoints.count - 1 : savepoints.count
        guard end > 0 else { return }
        for index in 0..<end where !savepoints[index].sent {
            _ = try await run("SAVEPOINT \(savepoints[index].name)", [])
            savepoints[index].sent = true
        }
    }

    /// Each statement as `format` takes it, and all their values as one JSON array of arrays.
    private func formattedBatch(_ statements: [SQLStatement]) -> (texts: [String], arguments: String) {
        if let statementObserver {
            for statement in statements { statementObserver(SQLTrace.inBatch + statement.sql) }
        }
        var texts: [String] = []
        texts.reserveCapacity(statements.count)
        // Built as bytes, made a string once.
        var arguments: [UInt8] = [0x5b]
        arguments.reserveCapacity(1024)
        for (index, statement) in statements.enumerated() {
            texts.append(Self.formatted(statement.sql))
            if index > 0 { arguments.append(0x2c) }
            arguments.append(0x5b)
            for (position, value) in statement.arguments.values.enumerated() {
                if position > 0 { arguments.append(0x2c) }
                Self.appendJSON(value, to: &arguments)
            }
            arguments.append(0x5d)
        }
        arguments.append(0x5d)
        return (texts, String(decoding: arguments, as: UTF8.self))
    }

    package func inSavepoint<T>(_ body: () async throws -> T) async throws -> T {
        // Writes queued before the unit are not the unit's: they go first.
        try await flushPendingWrites(last: false)
        savepoints.append((name: "s\(savepoints.count + 1)", sent: false))
        defer { savepoints.removeLast() }
        let sentBefore = sentFills
        do {
            let value = try await body()
            try await flushPendingWrites(last: true)
            if let innermost = savepoints.last, innermost.sent { _ = try await run("RELEASE SAVEPOINT \(innermost.name)", []) }
            return value
        } catch {
            pendingWrites = []
            sentFills = sentBefore
            if let sqlError = error as? SQLError, sqlError.kind == .connection { throw error }
            // Undo this unit only; the transaction goes on. A unit that met another writer's
            // work (a row it expected to insert found taken, the server's 40001 or 40P01) is
            // run again by its caller, on fresh facts; what the others wrote stays. A unit whose
            // savepoint was never sent wrote nothing that stayed (its one write undid itself).
            if let innermost = savepoints.last, innermost.sent {
                _ = try await run("ROLLBACK TO SAVEPOINT \(innermost.name)", [])
                _ = try await run("RELEASE SAVEPOINT \(innermost.name)", [])
                isInsideTransaction = true
            }
            throw error
        }
    }

    /// Sends one statement (the observer hears each: a batch is one) and waits for its answer.
    private func run(
        _ sql: String, _ arguments: SQLArguments, binding: ((inout PostgresBindings) -> Void)? = nil
    ) async throws -> [SQLRow] {
        statementObserver?(sql)
        var binds = PostgresBindings(capacity: arguments.values.count)
        binding?(&binds)
        for value in arguments.values {
            switch value {
            case .null: binds.appendNull()
            case .integer(let integer): binds.append(integer)
            case .real(let real): binds.append(real)
            case .text(let text): binds.append(text)
            case .blob(let data): binds.append(ByteBuffer(bytes: data))
            }
        }
        let query = PostgresQuery(unsafeSQL: Self.numbered(sql), binds: binds)
        let connection = connection
        let result: PostgresQueryResult
        do {
            // A query written to a connection that has closed meanwhile (the server went away
            // between two statements) is dropped by the driver unanswered: it fails here, at once.
            guard !connection.isClosed else {
                throw SQLError(.connection, "the connection to the database is closed (running \(sql.prefix(120)))")
            }
            // Whichever comes first: the answer, or the timeout, which also closes the
            // connection under the statement. The wait never depends on the driver failing it.
            let statementTimeout = statementTimeout
            result = try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<PostgresQueryResult, any Error>) in
                let answered = NIOLockedValueBox(false)
                let answer: @Sendable (Result<PostgresQueryResult, any Error>) -> Void = { outcome in
                    let first = answered.withLockedValue { answered in
                        defer { answered = true }
                        return !answered
                    }
                    if first { continuation.resume(with: outcome) }
                }
                let timer = connection.eventLoop.scheduleTask(in: statementTimeout) {
                    answer(.failure(SQLError(
                        .connection,
                        "no answer from the database within \(statementTimeout.nanoseconds / 1_000_000_000) s (running \(sql.prefix(120)))")))
                    let closing: EventLoopFuture<Void> = connection.close()
                    _ = closing
                }
                let query: EventLoopFuture<PostgresQueryResult> = connection.query(query, logger: logger)
                query.whenComplete { outcome in
                    timer.cancel()
                    answer(outcome)
                }
            }
        } catch {
            let translated = (error as? SQLError) ?? Self.translate(error, sql: sql)
            // Outside a savepoint a conflict leaves nothing to keep: the transaction runs again.
            if translated.kind == .serializationFailure, !savepoints.contains(where: \.sent) { mustRetry = true }
            isInsideTransaction = false
            throw translated
        }
        changesCount = result.metadata.rows ?? 0
        return try result.rows.map(Self.row)
    }

    private static func row(_ row: PostgresRow) throws -> SQLRow {
        var columns: [String] = []
        var values: [SQLValue] = []
        columns.reserveCapacity(row.count)
        values.reserveCapacity(row.count)
        for cell in row {
            columns.append(cell.columnName)
            values.append(try value(cell))
        }
        return SQLRow(columns: columns, values: values)
    }

    private static func value(_ cell: PostgresCell) throws -> SQLValue {
        guard cell.bytes != nil else { return .null }
        switch cell.dataType {
        case .int2, .int4, .int8, .oid: return .integer(try cell.decode(Int64.self))
        case .float4, .float8: return .real(try cell.decode(Double.self))
        case .bool: return .integer(try cell.decode(Bool.self) ? 1 : 0)
        case .bytea: return .blob(try cell.decode(Data.self))
        case .numeric: return .text("\(try cell.decode(Decimal.self))")
        default: return .text(try cell.decode(String.self))
        }
    }

    /// The statement as `format` takes it: `?` marks become `%L`, and every `%` is doubled.
    package static func formatted(_ sql: String) -> String {
        rewritten(sql, cache: formats, percent: "%%") { _ in "%L" }
    }

    /// `value` as `iap_write` and `iap_read` read it: text in a JSON string, NULL as JSON null,
    /// bytes as PostgreSQL's hex text.
    package static func appendJSON(_ value: SQLValue, to json: inout [UInt8]) {
        switch value {
        case .null:
            json += "null".utf8
        case .integer(let integer):
            json.append(0x22)
            json += String(integer).utf8
            json.append(0x22)
        case .real(let real):
            json.append(0x22)
            json += "\(real)".utf8
            json.append(0x22)
        case .text(let string):
            json.append(0x22)
            var string = string
            string.withUTF8 { bytes in
                for byte in bytes {
                    switch byte {
                    case 0x22: json += [0x5c, 0x22]
                    case 0x5c: json += [0x5c, 0x5c]
                    case 0x0a: json += [0x5c, 0x6e]
                    case 0x0d: json += [0x5c, 0x72]
                    case 0x09: json += [0x5c, 0x74]
                    case 0..<0x20:
                        // \u00XX; every other byte, UTF-8 included, goes as it is.
                        json += [0x5c, 0x75, 0x30, 0x30, hexDigits[Int(byte >> 4)], hexDigits[Int(byte & 0x0f)]]
                    default: json.append(byte)
                    }
                }
            }
            json.append(0x22)
        case .blob(let data):
            json.append(0x22)
            // `\x` (its backslash escaped) and the bytes in hex: PostgreSQL's text form of `bytea`.
            json += [0x5c, 0x5c, 0x78]
            for byte in data {
                json.append(hexDigits[Int(byte >> 4)])
                json.append(hexDigits[Int(byte & 0x0f)])
            }
            json.append(0x22)
        }
    }

    private static let hexDigits = Array("0123456789abcdef".utf8)

    /// A `BIGINT[]` read as text (`{1,0,1}`).
    package static func integers(_ value: SQLValue) throws -> [Int] {
        guard case .text(let text) = value else { throw SQLError(.other, "iap_write answered \(value)") }
        let inner = text.dropFirst().dropLast()
        return inner.isEmpty ? [] : inner.split(separator: ",").compactMap { Int($0) }
    }

    /// The statement with its `?` marks numbered `$1`, `$2`… (marks inside quotes stay).
    package static func numbered(_ sql: String) -> String {
        rewritten(sql, cache: placeholders, percent: nil) { "$\($0)" }
    }

    /// `sql` with each `?` mark outside quotes and `--` comments replaced by `mark(n)` (n from
    /// 1), and, when `percent` is given, every `%` by it; kept in `cache`.
    private static func rewritten(
        _ sql: String, cache: NIOLockedValueBox<[String: String]>, percent: String?, mark: (Int) -> String
    ) -> String {
        if let known = cache.withLockedValue({ $0[sql] }) { return known }
        var output = ""
        output.reserveCapacity(sql.utf8.count + 16)
        var count = 0
        var quote: Character?
        var comment = false
        var previous: Character = " "
        for character in sql {
            defer { previous = character }
            if character == "%", let percent {
                output += percent
            } else if comment {
                // A `--` comment runs to the end of its line: its quotes and marks are text.
                if character == "\n" { comment = false }
                output.append(character)
            } else if quote == nil, character == "-", previous == "-" {
                comment = true
                output.append(character)
            } else if let open = quote {
                if character == open { quote = nil }
                output.append(character)
            } else if character == "'" || character == "\"" {
                quote = character
                output.append(character)
            } else if character == "?" {
                count += 1
                output += mark(count)
            } else {
                output.append(character)
            }
        }
        cache.withLockedValue { known in
            // The store's texts are fixed or built from a bounded set; the bound is a safeguard.
            if known.count >= 4096 { known.removeAll(keepingCapacity: true) }
            known[sql] = output
        }
        return output
    }

    package static func translate(_ error: any Error, sql: String) -> SQLError {
        guard let error = error as? PSQLError else {
            return SQLError(.connection, "\(error) (running \(sql.prefix(120)))")
        }
        let state = error.serverInfo?[.sqlState]
        let message = error.serverInfo?[.message] ?? "\(error.code)"
        let detail = "\(message) [\(state ?? error.code.description)] (running \(sql.prefix(120)))"
        guard error.code == .server else { return SQLError(.connection, detail) }
        return serverError(state: state ?? "", detail: detail)
    }

    /// The server's error `state` (its SQLSTATE) as the store classifies it.
    package static func serverError(state: String, detail: String) -> SQLError {
        switch state {
        case "23505": SQLError(.uniqueViolation, detail)
        case "40001", "40P01": SQLError(.serializationFailure, detail)
        // Shutting down, crash recovery, too many connections: the server is not there for now.
        case "57P01", "57P02", "57P03", "53300": SQLError(.connection, detail)
        default: SQLError(.other, detail)
        }
    }
}
