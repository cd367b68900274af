import Foundation
import GRDB

/// The embedded backend: one SQLite file in WAL mode through a GRDB pool (one writer,
/// concurrent readers).
final class SQLiteDatabase: SQLDatabase {
    let pool: DatabasePool
    var dialect: SQLDialect { .sqlite }

    /// Opens (creating with mode 0600 if needed) the file at `path`, commits synced to disk
    /// (`synchronous = FULL`), and migrates it. `statementObserver` hears every statement.
    init(path: String, statementObserver: (@Sendable (String) -> Void)?) throws {
        var configuration = Configuration()
        configuration.busyMode = .timeout(10)
        configuration.foreignKeysEnabled = true
        // An answered commit must survive a power cut, not only a crash: in WAL mode NORMAL
        // (what the pool sets up) may lose the last commits; FULL syncs the log on every commit.
        configuration.prepareDatabase { db in
            try db.execute(sql: "PRAGMA synchronous = FULL")
            if let statementObserver {
                db.trace(options: .statement) { event in
                    if case .statement(let statement) = event { statementObserver(statement.sql) }
                }
            }
        }
        let directory = URL(fileURLWithPath: path).deletingLastPathComponent()
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        // Receipts and user ids live here: readable by the service's user only.
        if !FileManager.default.fileExists(atPath: path),
            !FileManager.default.createFile(atPath: path, contents: nil, attributes: [.posixPermissions: 0o600])
        {
            throw OrderStoreError(.unavailable, "cannot create \(path)")
        }
        // SQLite creates its -wal and -shm files with the database file's mode.
        pool = try DatabasePool(path: path, configuration: configuration)
        // The pool sets NORMAL on its writer while it sets WAL up, after `prepareDatabase`.
        try pool.writeWithoutTransaction { db in try db.execute(sql: "PRAGMA synchronous = FULL") }
        try SchemaHistory.sqliteMigrator.migrate(pool)
    }

    func read<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) throws -> T) async throws -> T {
        try await Self.translatingErrors { try await pool.read { db in try body(SQLiteConnection(db)) } }
    }

    func write<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) throws -> T) async throws -> T {
        try await Self.translatingErrors { try await pool.write { db in try body(SQLiteConnection(db)) } }
    }

    func writeAside<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) throws -> T) async throws -> T {
        // One process writes the file: there is no other queue to stay out of.
        try await write(body)
    }

    func close() async {
        try? pool.close()
    }

    private static func translatingErrors<T>(_ body: () async throws -> T) async throws -> T {
        do {
            return try await body()
        } catch let error as DatabaseError {
            throw SQLiteConnection.translate(error)
        }
    }
}

/// A GRDB connection inside one of its transactions.
final class SQLiteConnection: SQLConnection {
    let db: Database

    init(_ db: Database) {
        self.db = db
    }

    var dialect: SQLDialect { .sqlite }
    var changesCount: Int { db.changesCount }
    var isInsideTransaction: Bool { db.isInsideTransaction }

    @discardableResult
    func execute(sql: String, arguments: SQLArguments) throws -> Int {
        do {
            try statement(sql).execute(arguments: Self.arguments(arguments))
            return db.changesCount
        } catch let error as DatabaseError {
            throw Self.translate(error)
        }
    }

    func rows(sql: String, arguments: SQLArguments) throws -> [SQLRow] {
        do {
            // Each row read once, straight from the statement (a cursor's rows are views on it,
            // not copies), into the values the store reads.
            let statement = try statement(sql)
            let columns = statement.columnNames
            let cursor = try Row.fetchCursor(statement, arguments: Self.arguments(arguments))
            var rows: [SQLRow] = []
            while let row = try cursor.next() {
                var values: [SQLValue] = []
                values.reserveCapacity(columns.count)
                for value in row.databaseValues { values.append(Self.value(value)) }
                rows.append(SQLRow(columns: columns, values: values))
            }
            return rows
        } catch let error as DatabaseError {
            throw Self.translate(error)
        }
    }

    func inSavepoint<T>(_ body: () throws -> T) throws -> T {
        var value: T?
        do {
            try db.inSavepoint {
                value = try body()
                return .commit
            }
        } catch let error as DatabaseError {
            throw Self.translate(error)
        }
        return value!
    }

    /// Every text stays compiled in the connection's cache: the store's texts are fixed, or
    /// built from a bounded set (an `IN` list of at most a batch's length).
    private func statement(_ sql: String) throws -> Statement {
        try db.cachedStatement(sql: sql)
    }

    /// GRDB's arguments for ours. Built from optional existentials on purpose: GRDB's
    /// initializer for a sequence of one concrete type maps through a key path that is
    /// instantiated at run time on every call (about 6 % of a crediting transaction's CPU).
    private static func arguments(_ arguments: SQLArguments) -> StatementArguments {
        var values: [(any DatabaseValueConvertible)?] = []
        values.reserveCapacity(arguments.values.count)
        for value in arguments.values {
            switch value {
            case .null: values.append(nil)
            case .integer(let integer): values.append(integer)
            case .real(let real): values.append(real)
            case .text(let text): values.append(text)
            case .blob(let data): values.append(data)
            }
        }
        return StatementArguments(values)
    }

    static func value(_ value: DatabaseValue) -> SQLValue {
        switch value.storage {
        case .null: .null
        case .int64(let integer): .integer(integer)
        case .double(let real): .real(real)
        case .string(let text): .text(text)
        case .blob(let data): .blob(data)
        }
    }

    static func translate(_ error: DatabaseError) -> SQLError {
        let kind: SQLError.Kind =
            switch error.extendedResultCode {
            case .SQLITE_CONSTRAINT_PRIMARYKEY, .SQLITE_CONSTRAINT_UNIQUE: .uniqueViolation
            default: .other
            }
        return SQLError(kind, "\(error)")
    }
}
