import Foundation
import IAPCore
package import Store

/// Where the order store lives: one SQLite file (the embedded default) or a PostgreSQL
/// database shared by several order services.
public enum StoreLocation: Sendable, Equatable, CustomStringConvertible {
    case sqlite(path: String)
    case postgres(PostgresLocation)

    /// `IAP_DATABASE_URL` when given (PostgreSQL), else the SQLite file at `path`.
    public static func from(url: String?, passwordFile: String? = nil, path: String) throws(OrderStoreError) -> StoreLocation {
        guard let url, !url.isEmpty else { return .sqlite(path: path) }
        return .postgres(try PostgresLocation(url: url, passwordFile: passwordFile))
    }

    public var description: String {
        switch self {
        case .sqlite(let path): "sqlite:\(path)"
        case .postgres(let location): location.description
        }
    }
}

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

    /// The server the store's connections go to.
    package var server: PostgresServer {
        PostgresServer(host: host, port: port, user: user, password: password, database: database)
    }
}

/// The order store: submissions, purchases, grants, orders and the outbox, in one SQLite file
/// or in PostgreSQL. One set of operations runs on both.
///
/// Every write method is one all-or-nothing unit, durable when it returns: its own
/// transaction, or, for the hot paths (accepting an upload, applying a result), its own
/// savepoint in a group commit shared with the writes that arrived meanwhile. The schema
/// itself enforces the invariants (a purchase row per Apple transaction id, a grant per
/// credit key), so that several order services on one PostgreSQL cannot credit twice either.
public final class OrderStore: Sendable {
    let database: any SQLDatabase
    /// Where results (and reconciliation's changes) are written: each in its own savepoint of
    /// a shared commit.
    let groupCommit: GroupCommit
    /// Where accepted uploads are written, in commits of their own: an upload only inserts
    /// (its submission and its outbox message), so on PostgreSQL a commit of uploads never
    /// meets a serialization failure, where one shared with results was rolled back with them
    /// whenever two order services' results collided, and the uploads in it answered 503 until
    /// the collisions stopped.
    let acceptCommit: GroupCommit
    /// Where this store lives.
    public let location: StoreLocation
    /// Raised after each commit that queued messages in the outbox (what a relay waits for).
    public let outboxSignal = CommitSignal()
    /// Raised after each commit that queued calls to Apple: a settled transaction to finish, a
    /// consumption request to answer (what the Apple-calls workers wait for).
    public let appleCallSignal = CommitSignal()

    /// Opens (creating if needed) the SQLite store at `path` and migrates it.
    /// `statementObserver`, for tests, hears the SQL text of every statement the store runs.
    public convenience init(path: String, statementObserver: (@Sendable (String) -> Void)? = nil) async throws(OrderStoreError) {
        try await self.init(location: .sqlite(path: path), statementObserver: statementObserver)
    }

    /// Opens the store at `location` and migrates it to the current schema (on PostgreSQL
    /// under an advisory lock: the first service to start migrates, the others wait).
    /// `statementObserver`, for tests, hears the SQL text of every statement the store sends (on
    /// PostgreSQL a batch of writes is one: each call is one round trip).
    public init(location: StoreLocation, statementObserver: (@Sendable (String) -> Void)? = nil) async throws(OrderStoreError) {
        self.location = location
        do {
            let backend: any SQLDatabase
            switch location {
            case .sqlite(let path):
                backend = try SQLiteDatabase(path: path, statementObserver: statementObserver)
            case .postgres(let postgres):
                backend = try await PostgresDatabase(location: postgres.server, statementObserver: statementObserver)
            }
            database = AnnouncingDatabase(inner: backend, signals: [(.outbox, outboxSignal), (.appleCalls, appleCallSignal)])
        } catch let error as OrderStoreError {
            throw error
        } catch {
            throw OrderStoreError(.unavailable, "cannot open the order store at \(location): \(error)")
        }
        groupCommit = GroupCommit(database: database)
        acceptCommit = GroupCommit(database: database, writer: .uploads)
    }

    /// Which backend runs this store.
    package var dialect: SQLDialect { database.dialect }

    /// Closes the store's connections; the store is not used afterwards.
    public func close() async {
        await database.close()
    }

    /// The settings an answered commit's durability rests on: on SQLite the writer's
    /// `synchronous` (2 is FULL) and `journal_mode`, and beside them its `temp_store` (2 is
    /// MEMORY: a savepoint's journal is never written to disk); on PostgreSQL `fsync`,
    /// `synchronous_commit` and `full_page_writes`.
    public func durability() async throws -> [String: String] {
        try await database.write { db in
            switch db.dialect {
            case .sqlite:
                await [
                    "synchronous": String(try Int.fetchOne(db, sql: "PRAGMA synchronous") ?? -1),
                    "journal_mode": try String.fetchOne(db, sql: "PRAGMA journal_mode") ?? "",
                    "temp_store": String(try Int.fetchOne(db, sql: "PRAGMA temp_store") ?? -1),
                ]
            case .postgres:
                await [
                    "fsync": try String.fetchOne(db, sql: "SHOW fsync") ?? "",
                    "synchronous_commit": try String.fetchOne(db, sql: "SHOW synchronous_commit") ?? "",
                    "full_page_writes": try String.fetchOne(db, sql: "SHOW full_page_writes") ?? "",
                ]
            }
        }
    }

    /// Whether a write transaction can be started now (for readiness checks). It names no
    /// rows, so on PostgreSQL it waits for no write of the ledger that names its own.
    public func isWritable() async -> Bool {
        do {
            try await database.write(keys: []) { db in try await db.execute(sql: "SELECT 1") }
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
