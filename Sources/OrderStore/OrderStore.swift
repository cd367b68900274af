import Foundation
import GRDB
import IAPCore

/// The order store: submissions, purchases, grants, orders and the outbox, in one SQLite file.
///
/// Every write method is one all-or-nothing unit, durable when it returns: its own
/// transaction, or, for the hot paths (accepting an upload, applying a result), its own
/// savepoint in a group commit shared with the writes that arrived meanwhile. The schema
/// itself enforces the invariants (a purchase row per Apple transaction id, a grant per purchase).
public final class OrderStore: Sendable {
    let database: DatabasePool
    /// Where uploads and results are written: each in its own savepoint of a shared commit.
    let groupCommit: GroupCommit

    /// Opens (creating if needed) the store at `path` and migrates it to the current schema.
    /// `statementObserver`, for tests, hears the SQL text of every statement the store runs.
    public init(path: String, statementObserver: (@Sendable (String) -> Void)? = nil) throws(OrderStoreError) {
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
        do {
            let directory = URL(fileURLWithPath: path).deletingLastPathComponent()
            try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
            // Receipts and user ids live here: readable by the service's user only.
            if !FileManager.default.fileExists(atPath: path),
                !FileManager.default.createFile(atPath: path, contents: nil, attributes: [.posixPermissions: 0o600])
            {
                throw OrderStoreError(.unavailable, "cannot create \(path)")
            }
            // SQLite creates its -wal and -shm files with the database file's mode.
            database = try DatabasePool(path: path, configuration: configuration)
            // The pool sets NORMAL on its writer while it sets WAL up, after `prepareDatabase`.
            try database.writeWithoutTransaction { db in try db.execute(sql: "PRAGMA synchronous = FULL") }
            try Self.migrator.migrate(database)
            groupCommit = GroupCommit(database: database)
        } catch {
            throw OrderStoreError(.unavailable, "cannot open the order store at \(path): \(error)")
        }
    }

    /// How the writer's connection syncs commits (`PRAGMA synchronous`: 2 is FULL) and its
    /// journal mode: what "an answered commit is on disk" rests on.
    public func durability() async throws -> (synchronous: Int, journalMode: String) {
        try await database.write { db in
            (try Int.fetchOne(db, sql: "PRAGMA synchronous") ?? -1, try String.fetchOne(db, sql: "PRAGMA journal_mode") ?? "")
        }
    }

    /// Whether a write transaction can be started now (for readiness checks).
    public func isWritable() async -> Bool {
        do {
            try await database.write { db in try db.execute(sql: "SELECT 1") }
            return true
        } catch {
            return false
        }
    }
}

/// The one error type of the order store.
public struct OrderStoreError: Error, Sendable, CustomStringConvertible {
    /// What went wrong, stable enough to switch on.
    public enum Code: String, Sendable {
        /// The database file cannot be opened or written.
        case unavailable
        /// A result names a submission this store never accepted.
        case unknownSubmission = "unknown_submission"
        /// A submission with this id exists already.
        case duplicateSubmission = "duplicate_submission"
        /// The thing asked for does not exist.
        case notFound = "not_found"
        /// The change contradicts what the store holds (granted already, another user's).
        case conflict
    }

    /// What went wrong.
    public var code: Code
    /// A human-readable detail.
    public var message: String

    /// Creates an error.
    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }

    public var description: String { "OrderStoreError(\(code.rawValue)): \(message)" }
}

extension Database {
    /// Runs one statement, compiled once per connection and kept: the hot paths (accepting an
    /// upload, crediting) would otherwise spend more time preparing SQL than running it.
    /// Only for fixed SQL text; each distinct text stays in the cache.
    func executeCached(sql: String, arguments: StatementArguments = []) throws {
        try cachedStatement(sql: sql).execute(arguments: arguments)
    }

    /// The first row of a fixed query, compiled once per connection (see `executeCached`).
    func cachedRow(sql: String, arguments: StatementArguments = []) throws -> Row? {
        try Row.fetchOne(cachedStatement(sql: sql), arguments: arguments)
    }
}
