import Foundation
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import PostgresNIO

/// Where a PostgreSQL order store lives: `postgres://USER:PASSWORD@HOST:PORT/DB`.
public struct PostgresLocation: Sendable, Equatable, CustomStringConvertible {
    public var host: String
    public var port: Int
    public var user: String
    public var password: String?
    public var database: String

    public init(host: String, port: Int = 5432, user: String, password: String?, database: String) {
        self.host = host
        self.port = port
        self.user = user
        self.password = password
        self.database = database
    }

    /// Parses a `postgres://` or `postgresql://` URL; `passwordFile` (its first line) supplies a
    /// password the URL leaves out.
    public init(url text: String, passwordFile: String? = nil) throws(OrderStoreError) {
        guard let components = URLComponents(string: text),
            components.scheme == "postgres" || components.scheme == "postgresql",
            let host = components.host, !host.isEmpty
        else {
            throw OrderStoreError(.unavailable, "not a postgres://USER:PASSWORD@HOST:PORT/DB URL: \(Self.redacted(text))")
        }
        guard let user = components.percentEncodedUser?.removingPercentEncoding, !user.isEmpty else {
            throw OrderStoreError(.unavailable, "the database URL names no user: \(Self.redacted(text))")
        }
        let database = String(components.path.drop { $0 == "/" })
        guard !database.isEmpty else {
            throw OrderStoreError(.unavailable, "the database URL names no database: \(Self.redacted(text))")
        }
        var password = components.percentEncodedPassword?.removingPercentEncoding
        if password == nil, let passwordFile {
            guard let contents = try? String(contentsOfFile: passwordFile, encoding: .utf8) else {
                throw OrderStoreError(.unavailable, "cannot read the database password file \(passwordFile)")
            }
            password = contents.split(whereSeparator: \.isNewline).first.map(String.init) ?? ""
        }
        self.init(host: host, port: components.port ?? 5432, user: user, password: password, database: database)
    }

    /// The URL without its password, for logs and errors.
    public var description: String { "postgres://\(user)@\(host):\(port)/\(database)" }

    /// The URL with its password (for handing to another process of ours).
    public var url: String {
        var components = URLComponents()
        components.scheme = "postgres"
        components.user = user
        components.password = password
        components.host = host
        components.port = port
        components.path = "/" + database
        return components.string ?? description
    }

    static func redacted(_ text: String) -> String {
        guard var components = URLComponents(string: text) else { return "(unparsable)" }
        if components.password != nil { components.password = "***" }
        return components.string ?? "(unparsable)"
    }
}

/// The backend for teams that outgrow one box: PostgreSQL, shared by any number of order
/// services.
///
/// The store's operations are synchronous functions of one connection (as SQLite runs them),
/// so each connection here is used from one thread at a time, off the event loops and off the
/// cooperative pool, and waits for its answers. Writes run `SERIALIZABLE`: two services
/// crediting the same purchase cannot both succeed, and the loser runs again (SQLSTATE 40001,
/// 40P01) and sees the winner's row. A connection the server dropped (a restart, a failover)
/// is opened again, and a transaction that never reached its commit is run again on it.
final class PostgresDatabase: SQLDatabase {
    let location: PostgresLocation
    private let logger: Logger
    /// The writer: one at a time per process, as SQLite's single writer; others queue.
    private let writer: PostgresSession
    private let writerQueue = DispatchQueue(label: "iap.orderstore.postgres.writer")
    /// Readers, each used by one read at a time.
    private let readers: NIOLockedValueBox<[PostgresSession]>
    private let readerSlots: DispatchSemaphore
    private let readerQueue = DispatchQueue(label: "iap.orderstore.postgres.readers", attributes: .concurrent)
    /// How long a transaction keeps trying through lost connections and conflicts.
    private let patience: TimeInterval
    /// The connection of `writeAside`, and until when it is not tried again after a failure.
    private let aside: PostgresSession
    private let asideQueue = DispatchQueue(label: "iap.orderstore.postgres.aside")
    private let asideDownUntil = NIOLockedValueBox(Date.distantPast)

    var dialect: SQLDialect { .postgres }

    /// `statementObserver` hears the SQL text (with `?` marks) of every statement the store runs.
    init(
        location: PostgresLocation, readers: Int = 4, patience: TimeInterval = 30,
        logger: Logger = Logger(label: "iap.orderstore.postgres"), statementObserver: (@Sendable (String) -> Void)? = nil
    ) throws {
        self.location = location
        self.logger = logger
        self.patience = patience
        writer = PostgresSession(location: location, logger: logger, statementObserver: statementObserver)
        self.readers = NIOLockedValueBox(
            (0..<max(1, readers)).map { _ in
                PostgresSession(location: location, logger: logger, statementObserver: statementObserver)
            })
        readerSlots = DispatchSemaphore(value: max(1, readers))
        // What it writes is worth seconds (rate-limit buckets, unlogged): no wait for the disk.
        aside = PostgresSession(
            location: location, logger: logger, statementObserver: statementObserver,
            connectTimeout: .seconds(2), statementTimeout: .seconds(2), synchronousCommit: false)
        try writer.connect()
        try PostgresSchema.migrate(writer)
    }

    func read<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { continuation in
            readerQueue.async {
                self.readerSlots.wait()
                let session = self.readers.withLockedValue { $0.removeLast() }
                defer {
                    self.readers.withLockedValue { $0.append(session) }
                    self.readerSlots.signal()
                }
                continuation.resume(
                    with: Result {
                        try self.transaction(on: session, begin: "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", body)
                    })
            }
        }
    }

    func write<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { continuation in
            writerQueue.async {
                continuation.resume(
                    with: Result { try self.transaction(on: self.writer, begin: "BEGIN ISOLATION LEVEL SERIALIZABLE", body) })
            }
        }
    }

    /// On the aside connection, in autocommit (each statement its own transaction, READ
    /// COMMITTED: an upsert of one row waits for that row's lock, never for a conflict to
    /// retry). Once it fails, it fails at once for a second rather than queue every caller
    /// behind a connect timeout while the database is away.
    func writeAside<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { continuation in
            asideQueue.async {
                continuation.resume(
                    with: Result {
                        guard Date() >= self.asideDownUntil.withLockedValue({ $0 }) else {
                            throw SQLError(.connection, "the database did not answer a moment ago")
                        }
                        do {
                            try self.aside.ensureConnected()
                            self.aside.beginTransaction()
                            return try body(self.aside)
                        } catch let error as SQLError where error.kind == .connection {
                            self.aside.closeSoon()
                            self.asideDownUntil.withLockedValue { $0 = Date().addingTimeInterval(1) }
                            throw error
                        }
                    })
            }
        }
    }

    /// Runs a statement outside any transaction, on the writer (for tests and tools).
    func executeOutsideTransaction(_ sql: String) async throws {
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
            writerQueue.async {
                continuation.resume(with: Result<Void, any Error> { _ = try self.writer.withReconnect { try $0.execute(sql: sql) } })
            }
        }
    }

    func close() async {
        writerQueue.sync { writer.close() }
        asideQueue.sync { aside.close() }
        for reader in readers.withLockedValue({ $0 }) { reader.close() }
    }

    deinit {
        writer.closeSoon()
        aside.closeSoon()
        for reader in readers.withLockedValue({ $0 }) { reader.closeSoon() }
    }

    /// Runs `body` in one transaction on `session`, again after a conflict or a connection
    /// lost before the commit was sent, until `patience` runs out.
    private func transaction<T>(on session: PostgresSession, begin: String, _ body: (any SQLConnection) throws -> T) throws -> T {
        let deadline = Date().addingTimeInterval(patience)
        var attempt = 0
        while true {
            attempt += 1
            var committing = false
            do {
                try session.ensureConnected()
                session.beginTransaction()
                try session.execute(sql: begin)
                let value = try body(session)
                if session.mustRetry {
                    throw SQLError(.serializationFailure, "a statement of the transaction conflicted with another writer")
                }
                guard session.isInsideTransaction else {
                    throw SQLError(.other, "the transaction was aborted by an error it did not handle")
                }
                committing = true
                try session.execute(sql: "COMMIT")
                session.endTransaction()
                return value
            } catch let error as SQLError {
                session.endTransaction()
                switch error.kind {
                case .serializationFailure where Date() < deadline:
                    try? session.execute(sql: "ROLLBACK")
                    // Back off, exponentially with jitter up to a quarter second, so that two
                    // order services whose batches keep meeting stop meeting (a fixed few ms
                    // let two large group commits abort each other for the whole patience).
                    Thread.sleep(forTimeInterval: Double.random(in: 0...1) * min(0.002 * pow(2, Double(min(attempt, 10))), 0.25))
                case .connection where !committing && Date() < deadline:
                    session.close()
                    logger.warning("order store connection lost; reconnecting", metadata: ["error": "\(error)"])
                    Thread.sleep(forTimeInterval: min(0.05 * Double(attempt), 1))
                default:
                    if error.kind != .connection { try? session.execute(sql: "ROLLBACK") } else { session.close() }
                    throw error
                }
            } catch {
                // The body refused (a rule of the ledger: not found, a conflict): nothing it
                // wrote stays, and the session leaves the transaction, or the next BEGIN would
                // be ignored and run on this one's snapshot (and commit what this one wrote).
                session.endTransaction()
                try? session.execute(sql: "ROLLBACK")
                throw error
            }
        }
    }
}

/// One PostgreSQL connection, used synchronously from one thread at a time.
final class PostgresSession: SQLConnection, @unchecked Sendable {
    // Unchecked: a session is only touched by the one queue or reader slot that holds it.
    private let location: PostgresLocation
    private let logger: Logger
    private var connection: PostgresConnection?
    private var savepoints = 0
    private(set) var changesCount = 0
    /// A statement hit a serialization failure or deadlock: the transaction must run again.
    private(set) var mustRetry = false
    /// False once an error outside a savepoint aborted the transaction.
    private(set) var isInsideTransaction = true
    private static let nextId = NIOLockedValueBox(0)
    private static let placeholders = NIOLockedValueBox([String: String]())

    private let statementObserver: (@Sendable (String) -> Void)?
    /// How long connecting, and then one statement, may take before the connection counts as lost.
    private let connectTimeout: TimeAmount
    private let statementTimeout: TimeAmount
    /// Whether a commit waits until it is on the server's disk (every ledger connection does).
    private let synchronousCommit: Bool

    init(
        location: PostgresLocation, logger: Logger, statementObserver: (@Sendable (String) -> Void)? = nil,
        connectTimeout: TimeAmount = .seconds(15), statementTimeout: TimeAmount = PostgresSession.defaultStatementTimeout,
        synchronousCommit: Bool = true
    ) {
        self.location = location
        self.logger = logger
        self.statementObserver = statementObserver
        self.connectTimeout = connectTimeout
        self.statementTimeout = statementTimeout
        self.synchronousCommit = synchronousCommit
    }

    var dialect: SQLDialect { .postgres }

    func connect() throws {
        let id = Self.nextId.withLockedValue { id in
            id += 1
            return id
        }
        var configuration = PostgresConnection.Configuration(
            host: location.host, port: location.port, username: location.user, password: location.password,
            database: location.database, tls: .disable)
        configuration.options.connectTimeout = min(.seconds(5), connectTimeout)
        do {
            connection = try Self.wait(
                for: PostgresConnection.connect(
                    on: MultiThreadedEventLoopGroup.singleton.any(), configuration: configuration, id: id, logger: logger),
                atMost: connectTimeout, doing: "connecting")
        } catch {
            throw Self.translate(error, sql: "(connect to \(location))")
        }
        // An answered commit is on the server's disk, whatever the server's default says.
        try execute(sql: synchronousCommit ? "SET synchronous_commit = on" : "SET synchronous_commit = off")
    }

    func ensureConnected() throws {
        if connection == nil || connection?.isClosed == true {
            closeSoon()
            try connect()
        }
    }

    /// Runs `body` on a live connection, reconnecting once if the first attempt finds it dead.
    func withReconnect<T>(_ body: (PostgresSession) throws -> T) throws -> T {
        try ensureConnected()
        do {
            return try body(self)
        } catch let error as SQLError where error.kind == .connection {
            close()
            try connect()
            return try body(self)
        }
    }

    func close() {
        if let connection {
            let closing: EventLoopFuture<Void> = connection.close()
            _ = try? Self.wait(for: closing, atMost: .seconds(5), doing: "closing")
        }
        connection = nil
    }

    /// Closes without waiting (from a deinit, which may run on an event loop).
    func closeSoon() {
        if let connection {
            let closing: EventLoopFuture<Void> = connection.close()
            // Kept alive until closed: a connection must not be freed while it closes.
            closing.whenComplete { _ in withExtendedLifetime(connection) {} }
        }
        connection = nil
    }

    func beginTransaction() {
        savepoints = 0
        mustRetry = false
        isInsideTransaction = true
    }

    func endTransaction() {
        savepoints = 0
    }

    @discardableResult
    func execute(sql: String, arguments: SQLArguments) throws -> Int {
        _ = try run(sql, arguments)
        return changesCount
    }

    func rows(sql: String, arguments: SQLArguments) throws -> [SQLRow] {
        try run(sql, arguments)
    }

    func inSavepoint<T>(_ body: () throws -> T) throws -> T {
        savepoints += 1
        let name = "s\(savepoints)"
        try execute(sql: "SAVEPOINT \(name)")
        do {
            let value = try body()
            try execute(sql: "RELEASE SAVEPOINT \(name)")
            return value
        } catch {
            if let sqlError = error as? SQLError, sqlError.kind == .connection { throw error }
            // A unit that met another writer's work (the server's 40001, or a row it expected
            // to insert found taken) makes the whole transaction run again from the start.
            if let sqlError = error as? SQLError, sqlError.kind == .serializationFailure { mustRetry = true }
            // Undo this unit only; the transaction goes on (unless it must run again anyway).
            try execute(sql: "ROLLBACK TO SAVEPOINT \(name)")
            try execute(sql: "RELEASE SAVEPOINT \(name)")
            isInsideTransaction = true
            throw error
        }
    }

    private func run(_ sql: String, _ arguments: SQLArguments) throws -> [SQLRow] {
        guard let connection else { throw SQLError(.connection, "not connected to \(location)") }
        statementObserver?(sql)
        var binds = PostgresBindings(capacity: arguments.values.count)
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
        let result: PostgresQueryResult
        do {
            result = try Self.wait(for: connection.query(query, logger: logger), atMost: statementTimeout, doing: "waiting for an answer")
        } catch {
            let translated = Self.translate(error, sql: sql)
            switch translated.kind {
            case .serializationFailure: mustRetry = true
            case .connection: closeSoon()
            case .uniqueViolation, .other: break
            }
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

    /// How long one statement may take before its connection counts as lost (a server that
    /// went away without closing the socket must not hold the writer forever).
    static let defaultStatementTimeout: TimeAmount = .seconds(120)

    /// Waits for `future` at most `limit`; past it, a `.connection` failure.
    static func wait<T>(for future: EventLoopFuture<T>, atMost limit: TimeAmount, doing what: String) throws -> T {
        let promise = future.eventLoop.makePromise(of: T.self)
        let settled = NIOLockedValueBox(false)
        func settleOnce() -> Bool {
            settled.withLockedValue { done in
                defer { done = true }
                return !done
            }
        }
        let timer = future.eventLoop.scheduleTask(in: limit) {
            guard settleOnce() else { return }
            promise.fail(SQLError(.connection, "no answer from the database within \(limit.nanoseconds / 1_000_000_000) s (\(what))"))
        }
        future.whenComplete { result in
            timer.cancel()
            guard settleOnce() else { return }
            promise.completeWith(result)
        }
        return try promise.futureResult.wait()
    }

    /// The statement with its `?` marks numbered `$1`, `$2`… (marks inside quotes stay).
    static func numbered(_ sql: String) -> String {
        if let known = placeholders.withLockedValue({ $0[sql] }) { return known }
        var output = ""
        output.reserveCapacity(sql.utf8.count + 16)
        var count = 0
        var quote: Character?
        var comment = false
        var previous: Character = " "
        for character in sql {
            defer { previous = character }
            if comment {
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
                output += "$\(count)"
            } else {
                output.append(character)
            }
        }
        placeholders.withLockedValue { known in
            // The store's texts are fixed or built from a bounded set; the bound is a safeguard.
            if known.count >= 4096 { known.removeAll(keepingCapacity: true) }
            known[sql] = output
        }
        return output
    }

    static func translate(_ error: any Error, sql: String) -> SQLError {
        guard let error = error as? PSQLError else {
            return SQLError(.connection, "\(error) (running \(sql.prefix(120)))")
        }
        let state = error.serverInfo?[.sqlState]
        let message = error.serverInfo?[.message] ?? "\(error.code)"
        let detail = "\(message) [\(state ?? error.code.description)] (running \(sql.prefix(120)))"
        switch (error.code, state) {
        case (.server, "23505"?): return SQLError(.uniqueViolation, detail)
        case (.server, "40001"?), (.server, "40P01"?): return SQLError(.serializationFailure, detail)
        // Shutting down, crash recovery, too many connections: the server is not there for now.
        case (.server, "57P01"?), (.server, "57P02"?), (.server, "57P03"?), (.server, "53300"?):
            return SQLError(.connection, detail)
        case (.server, _): return SQLError(.other, detail)
        default: return SQLError(.connection, detail)
        }
    }
}
