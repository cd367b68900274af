import Foundation
import GRDB
import GRDBSQLite
import NIOConcurrencyHelpers

/// The embedded backend: one SQLite file in WAL mode, one writer connection and a few readers.
///
/// The store's operations are async functions of one connection. SQLite answers in the
/// calling thread, so each transaction runs on a thread of its own connection's queue (a
/// task executor), never on the cooperative pool that serves HTTP and the broker: a commit
/// waits for the disk there, and a statement never suspends.
package final class SQLiteDatabase: SQLDatabase {
    package var dialect: SQLDialect { .sqlite }
    private let writer: SQLiteConnection
    private let writerGate = AsyncGate(permits: 1)
    private let writerExecutor = QueueExecutor(label: "iap.orderstore.sqlite.writer")
    private let readers: NIOLockedValueBox<[SQLiteConnection]>
    private let readerGate: AsyncGate
    private let readerExecutor = QueueExecutor(label: "iap.orderstore.sqlite.readers", concurrent: true)

    /// Opens (creating with mode 0600 if needed) the file at `path`, migrates it, and opens its
    /// connections: commits synced to disk (`synchronous = FULL`), foreign keys enforced.
    /// `statementObserver` hears every statement.
    package init(path: String, readers readerCount: Int = 4, statementObserver: (@Sendable (String) -> Void)?) throws {
        let directory = URL(fileURLWithPath: path).deletingLastPathComponent()
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        // Receipts and user ids live here: readable by the service's user only.
        if !FileManager.default.fileExists(atPath: path),
            !FileManager.default.createFile(atPath: path, contents: nil, attributes: [.posixPermissions: 0o600])
        {
            throw SQLError(.other, "cannot create \(path)")
        }
        // The schema history runs through GRDB's migrator (the names it records are the file's
        // history); the pool turns WAL on. SQLite creates -wal and -shm with the file's mode.
        do {
            var configuration = Configuration()
            configuration.busyMode = .timeout(10)
            let pool = try DatabasePool(path: path, configuration: configuration)
            try SchemaHistory.sqliteMigrator.migrate(pool)
            try pool.close()
        } catch let error as DatabaseError {
            throw SQLiteConnection.translate(code: error.extendedResultCode.rawValue, message: "\(error)")
        }
        writer = try SQLiteConnection(path: path, readOnly: false, statementObserver: statementObserver)
        // An answered commit must survive a power cut, not only a crash: in WAL mode NORMAL
        // may lose the last commits; FULL syncs the log on every commit.
        try writer.run("PRAGMA synchronous = FULL")
        try writer.run("PRAGMA foreign_keys = ON")
        // A group commit runs each unit in a savepoint, and SQLite keeps what a savepoint would
        // roll back (the first image of every page it changes) in a statement journal. On file
        // that journal spills past 64 KiB: about 90 KB written per upload, more than the log
        // and the database together. It is never needed after a crash (the transaction is
        // gone), so it stays in memory: at most the pages one transaction changes.
        try writer.run("PRAGMA temp_store = MEMORY")
        let count = max(1, readerCount)
        readers = NIOLockedValueBox(
            try (0..<count).map { _ in try SQLiteConnection(path: path, readOnly: true, statementObserver: statementObserver) })
        readerGate = AsyncGate(permits: count)
    }

    package func read<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        await readerGate.acquire()
        defer { readerGate.release() }
        let connection = readers.withLockedValue { $0.removeLast() }
        defer { readers.withLockedValue { $0.append(connection) } }
        return try await withTaskExecutorPreference(readerExecutor) {
            try await connection.transaction(begin: "BEGIN DEFERRED") { try await body(connection) }
        }
    }

    package func write<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        await writerGate.acquire()
        defer { writerGate.release() }
        let writer = writer
        return try await withTaskExecutorPreference(writerExecutor) {
            try await writer.transaction(begin: "BEGIN IMMEDIATE") { try await body(writer) }
        }
    }

    package func write<T: Sendable>(keys: Set<String>, _ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        try await write(body)
    }

    package func writeCounters<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        // One process writes the file: there is no other queue to stay out of.
        try await write(body)
    }

    @discardableResult
    package func acceptUploads<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        try await write(body)
    }

    @discardableResult
    package func writeQueues<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T {
        // One writer: nothing to keep apart.
        try await write(body)
    }

    package func close() async {
        await writerGate.acquire()
        writer.close()
        for reader in readers.withLockedValue({ $0 }) { reader.close() }
        writerGate.release()
    }
}

/// One SQLite connection, used by one transaction at a time, its statements kept compiled.
package final class SQLiteConnection: SQLConnection, @unchecked Sendable {
    // Unchecked: a connection is only touched by the one transaction that holds its gate.
    private var handle: OpaquePointer?
    private var statements: [String: OpaquePointer] = [:]
    private let statementObserver: (@Sendable (String) -> Void)?
    private var savepoints = 0
    package private(set) var filled: CommitQueues = []

    package init(path: String, readOnly: Bool, statementObserver: (@Sendable (String) -> Void)?) throws {
        self.statementObserver = statementObserver
        let flags = (readOnly ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) | SQLITE_OPEN_NOMUTEX
        var handle: OpaquePointer?
        let code = sqlite3_open_v2(path, &handle, flags, nil)
        guard code == SQLITE_OK, let handle else {
            let message = handle.map { String(cString: sqlite3_errmsg($0)) } ?? "out of memory"
            sqlite3_close_v2(handle)
            throw SQLError(.other, "cannot open \(path): \(message)")
        }
        self.handle = handle
        sqlite3_extended_result_codes(handle, 1)
        // Another process of ours (an admin command) may hold the write lock for a moment.
        sqlite3_busy_timeout(handle, 10_000)
    }

    package var dialect: SQLDialect { .sqlite }
    package var changesCount: Int { handle.map { Int(sqlite3_changes($0)) } ?? 0 }
    package var isInsideTransaction: Bool { handle.map { sqlite3_get_autocommit($0) == 0 } ?? false }

    package func close() {
        for statement in statements.values { sqlite3_finalize(statement) }
        statements.removeAll()
        sqlite3_close_v2(handle)
        handle = nil
    }

    deinit {
        close()
    }

    /// Runs `body` in one transaction opened with `begin`: committed if it returns, rolled
    /// back if it throws.
    package func transaction<T>(begin: String, _ body: () async throws -> T) async throws -> T {
        savepoints = 0
        filled = []
        try run(begin)
        do {
            let value = try await body()
            guard isInsideTransaction else {
                throw SQLError(.other, "the transaction was rolled back under the store (disk full, I/O error)")
            }
            try run("COMMIT")
            return value
        } catch {
            if isInsideTransaction { try? run("ROLLBACK") }
            throw error
        }
    }

    @discardableResult
    package func execute(sql: String, arguments: SQLArguments) async throws -> Int {
        try run(sql, arguments)
        return changesCount
    }

    package func executeBatch(_ statements: [SQLStatement]) async throws {
        guard statements.count > 1 else {
            for statement in statements { try runChecked(statement) }
            return
        }
        // All or nothing, as on PostgreSQL: a savepoint costs SQLite no round trip.
        let filledBefore = filled
        try run("SAVEPOINT batch")
        do {
            for statement in statements { try runChecked(statement) }
            try run("RELEASE SAVEPOINT batch")
        } catch {
            filled = filledBefore
            if isInsideTransaction {
                try run("ROLLBACK TO SAVEPOINT batch")
                try run("RELEASE SAVEPOINT batch")
            }
            throw error
        }
    }

    private func runChecked(_ statement: SQLStatement) throws {
        try run(statement.sql, statement.arguments)
        if let error = statement.requiresChange, changesCount == 0 { throw error }
        filled.formUnion(statement.fills)
    }

    package func executeLater(_ statements: [SQLStatement]) async throws {
        try await executeBatch(statements)
    }

    package func readBatch(_ queries: [SQLStatement]) async throws -> [[SQLRow]] {
        var sets: [[SQLRow]] = []
        sets.reserveCapacity(queries.count)
        for query in queries { sets.append(try await rows(sql: query.sql, arguments: query.arguments)) }
        return sets
    }

    package func rows(sql: String, arguments: SQLArguments) async throws -> [SQLRow] {
        var rows: [SQLRow] = []
        try run(sql, arguments) { statement, columns in
            let count = columns.count
            var values: [SQLValue] = []
            values.reserveCapacity(count)
            for index in 0..<Int32(count) { values.append(Self.value(statement, index)) }
            rows.append(SQLRow(columns: columns, values: values))
        }
        return rows
    }

    package func inSavepoint<T>(_ body: () async throws -> T) async throws -> T {
        savepoints += 1
        let name = "s\(savepoints)"
        defer { savepoints -= 1 }
        let filledBefore = filled
        try run("SAVEPOINT \(name)")
        do {
            let value = try await body()
            try run("RELEASE SAVEPOINT \(name)")
            return value
        } catch {
            // Undo this unit only; unless SQLite already rolled the whole transaction back.
            filled = filledBefore
            if isInsideTransaction {
                try run("ROLLBACK TO SAVEPOINT \(name)")
                try run("RELEASE SAVEPOINT \(name)")
            }
            throw error
        }
    }

    /// Runs `sql` with `arguments`, handing each row to `row` (with the column names).
    package func run(_ sql: String, _ arguments: SQLArguments = [], row: ((OpaquePointer, [String]) -> Void)? = nil) throws {
        guard let handle else { throw SQLError(.other, "the order store is closed") }
        statementObserver?(sql)
        let statement = try prepared(sql, on: handle)
        defer {
            sqlite3_reset(statement)
            sqlite3_clear_bindings(statement)
        }
        for (offset, value) in arguments.values.enumerated() {
            let index = Int32(offset + 1)
            let code: Int32 =
                switch value {
                case .null: sqlite3_bind_null(statement, index)
                case .integer(let integer): sqlite3_bind_int64(statement, index, integer)
                case .real(let real): sqlite3_bind_double(statement, index, real)
                case .text(let text): sqlite3_bind_text(statement, index, text, -1, Self.transient)
                case .blob(let data):
                    data.withUnsafeBytes { bytes in
                        sqlite3_bind_blob(statement, index, bytes.baseAddress ?? UnsafeRawPointer(bitPattern: 1), Int32(bytes.count), Self.transient)
                    }
                }
            guard code == SQLITE_OK else { throw error(handle, sql) }
        }
        var columns: [String]?
        while true {
            switch sqlite3_step(statement) {
            case SQLITE_ROW:
                guard let row else { continue }
                if columns == nil {
                    columns = (0..<sqlite3_column_count(statement)).map { String(cString: sqlite3_column_name(statement, $0)) }
                }
                row(statement, columns!)
            case SQLITE_DONE:
                return
            default:
                throw error(handle, sql)
            }
        }
    }

    private func prepared(_ sql: String, on handle: OpaquePointer) throws -> OpaquePointer {
        if let statement = statements[sql] { return statement }
        var statement: OpaquePointer?
        guard sqlite3_prepare_v2(handle, sql, -1, &statement, nil) == SQLITE_OK, let statement else {
            throw error(handle, sql)
        }
        // Every text stays compiled: the store's texts are fixed, or built from a bounded set
        // (an `IN` list of at most a batch's length); the bound is a safeguard.
        if statements.count >= 2048 {
            for old in statements.values { sqlite3_finalize(old) }
            statements.removeAll()
        }
        statements[sql] = statement
        return statement
    }

    private func error(_ handle: OpaquePointer, _ sql: String) -> SQLError {
        Self.translate(
            code: sqlite3_extended_errcode(handle),
            message: "\(String(cString: sqlite3_errmsg(handle))) (running \(sql.prefix(120)))")
    }

    private static let transient = unsafeBitCast(-1, to: sqlite3_destructor_type.self)

    private static func value(_ statement: OpaquePointer, _ index: Int32) -> SQLValue {
        switch sqlite3_column_type(statement, index) {
        case SQLITE_NULL: return .null
        case SQLITE_INTEGER: return .integer(sqlite3_column_int64(statement, index))
        case SQLITE_FLOAT: return .real(sqlite3_column_double(statement, index))
        case SQLITE_BLOB:
            let count = Int(sqlite3_column_bytes(statement, index))
            guard count > 0, let bytes = sqlite3_column_blob(statement, index) else { return .blob(Data()) }
            return .blob(Data(bytes: bytes, count: count))
        default:
            guard let text = sqlite3_column_text(statement, index) else { return .text("") }
            let count = Int(sqlite3_column_bytes(statement, index))
            return .text(String(decoding: UnsafeBufferPointer(start: text, count: count), as: UTF8.self))
        }
    }

    package static func translate(code: Int32, message: String) -> SQLError {
        switch code {
        case 1555, 2067: SQLError(.uniqueViolation, message)  // SQLITE_CONSTRAINT_PRIMARYKEY, _UNIQUE
        default: SQLError(.other, message)
        }
    }
}

/// A task executor on a dispatch queue: work that blocks its thread (a commit waiting for the
/// disk) runs there rather than on the cooperative pool.
package final class QueueExecutor: TaskExecutor {
    private let queue: DispatchQueue

    package init(label: String, concurrent: Bool = false) {
        queue = DispatchQueue(label: label, attributes: concurrent ? [.concurrent] : [])
    }

    package func enqueue(_ job: UnownedJob) {
        let executor = asUnownedTaskExecutor()
        queue.async { job.runSynchronously(on: executor) }
    }
}

/// Up to `permits` holders at a time; the others wait, in order, without blocking a thread.
package final class AsyncGate: Sendable {
    private struct State {
        var available: Int
        var waiters: [CheckedContinuation<Void, Never>] = []
    }

    private let state: NIOLockedValueBox<State>

    package init(permits: Int) {
        state = NIOLockedValueBox(State(available: permits))
    }

    package func acquire() async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let granted = state.withLockedValue { state in
                if state.available > 0 {
                    state.available -= 1
                    return true
                }
                state.waiters.append(continuation)
                return false
            }
            if granted { continuation.resume() }
        }
    }

    package func release() {
        let next = state.withLockedValue { state -> CheckedContinuation<Void, Never>? in
            if state.waiters.isEmpty {
                state.available += 1
                return nil
            }
            return state.waiters.removeFirst()
        }
        next?.resume()
    }
}
