import Crypto
package import Foundation
import Logging
package import Testing
@testable package import OrderStore
@testable package import Store

/// The order store a test runs on. Store tests take it as their argument
/// (`@Test(arguments: TestStore.backends)`), so one `swift test` pass runs them on both; the rest
/// of the suite runs on SQLite, and the suites about several order services on one PostgreSQL
/// store run there alone.
package enum Backend: String, Sendable, CaseIterable, CustomTestStringConvertible {
    case sqlite, postgres

    package var testDescription: String { self == .sqlite ? "SQLite" : "PostgreSQL" }
}

extension StoreLocation {
    package var backend: Backend {
        switch self {
        case .sqlite: .sqlite
        case .postgres: .postgres
        }
    }
}

/// The order stores of the tests: SQLite files, or a database of its own per store on the
/// private PostgreSQL server at `IAP_TEST_DATABASE_URL` (`scripts/dev test` starts it).
package enum TestStore {
    /// Whether this run has a PostgreSQL server to test on.
    package static var hasPostgres: Bool { ProcessInfo.processInfo.environment["IAP_TEST_DATABASE_URL"].map { !$0.isEmpty } ?? false }

    /// The backends a store test runs on: SQLite, and PostgreSQL when the run has its server
    /// (`swift test` alone tests SQLite; `scripts/dev test` both).
    package static var backends: [Backend] { hasPostgres ? [.sqlite, .postgres] : [.sqlite] }

    package struct MissingServer: Error, CustomStringConvertible {
        package var description: String {
            "a test on PostgreSQL needs IAP_TEST_DATABASE_URL: run the suite with `scripts/dev test`, which starts PostgreSQL"
        }
    }

    /// The store of `name` in `folder` on `backend`: the same location each time it is asked
    /// for (a test reopens a store after a crash), a new one for each folder.
    package static func location(in folder: URL, name: String = "orders", on backend: Backend = .sqlite) async throws
        -> StoreLocation
    {
        let path = folder.appendingPathComponent("\(name).sqlite").path
        guard backend == .postgres else { return .sqlite(path: path) }
        let digest = SHA256.hash(data: Data(path.utf8)).prefix(12).map { String(format: "%02x", $0) }.joined()
        return .postgres(try await postgresDatabase(named: "iap_test_\(digest)"))
    }

    /// An empty database of its own on the test server (no schema yet).
    package static func emptyPostgresDatabase() async throws -> PostgresLocation {
        try await postgresDatabase(named: "iap_empty_\(UUID().uuidString.lowercased().replacingOccurrences(of: "-", with: ""))")
    }

    /// The database `name` on the test server, created if it is not there.
    package static func postgresDatabase(named name: String) async throws -> PostgresLocation {
        guard let url = ProcessInfo.processInfo.environment["IAP_TEST_DATABASE_URL"] else { throw MissingServer() }
        let admin = try PostgresLocation(url: url)
        var location = admin
        location.database = name
        let name = location.database
        try await PostgresDatabase.withConnection(to: admin.server) { session in
            let exists =
                try await Int.fetchOne(session, sql: "SELECT 1 FROM pg_database WHERE datname = ?", arguments: [name])
                != nil
            if !exists {
                do {
                    try await session.execute(sql: "CREATE DATABASE \(name)")
                } catch {
                    // Created meanwhile by another test asking for the same folder, or a real failure.
                    guard
                        try await Int.fetchOne(
                            session, sql: "SELECT 1 FROM pg_database WHERE datname = ?", arguments: [name]) != nil
                    else { throw error }
                }
            }
        }
        return location
    }

    /// A store at `location(in:name:on:)`.
    package static func open(
        in folder: URL, name: String = "orders", on backend: Backend = .sqlite,
        statementObserver: (@Sendable (String) -> Void)? = nil
    ) async throws -> OrderStore {
        let location = try await location(in: folder, name: name, on: backend)
        // The shared test server may be slow to hand out a first connection while fifty suites
        // start at once: a store that could not connect is opened again (its schema is
        // migrated on open, so nothing is half done), a few times, before the test fails.
        var last = OrderStoreError(.unavailable, "the store was not opened")
        for _ in 0..<3 {
            do {
                return try await OrderStore(location: location, statementObserver: statementObserver)
            } catch {
                guard error.code == .unavailable else { throw error }
                last = error
                try await Task.sleep(for: .seconds(1))
            }
        }
        throw last
    }

    /// The environment that points an `iap` process at `location`.
    package static func environment(for location: StoreLocation) -> [String: String] {
        switch location {
        case .sqlite(let path): ["IAP_DATABASE_PATH": path, "IAP_DATABASE_URL": ""]
        case .postgres(let postgres): ["IAP_DATABASE_URL": postgres.url]
        }
    }
}

extension OrderStore {
    /// Runs `sql` in a write transaction of this store and returns its rows (tests only: they
    /// look at and damage what the store holds, on either backend). On PostgreSQL it takes none
    /// of the ledger's locks, so a test can look while a write of the ledger holds them.
    package func testRows(_ sql: String, _ arguments: SQLArguments = []) async throws -> [SQLRow] {
        try await database.writeQueues { db in try await db.rows(sql: sql, arguments: arguments) }
    }

    /// PostgreSQL: the plan the server uses for `sql` (a store statement, `?` marks) whatever its
    /// arguments: prepared as a generic plan, with sequential scans priced out
    /// (`enable_seqscan = off`), so a `Seq Scan` left in it is a table no index serves.
    package func testGenericPlan(_ sql: String) async throws -> [String] {
        let marks = sql.filter { $0 == "?" }.count
        var numbered = ""
        var mark = 0
        for character in sql {
            if character == "?" {
                mark += 1
                numbered += "$\(mark)"
            } else {
                numbered.append(character)
            }
        }
        let statement = numbered
        return try await database.write { db in
            try await db.execute(sql: "SET LOCAL enable_seqscan = off", arguments: [])
            try await db.execute(sql: "SET LOCAL plan_cache_mode = force_generic_plan", arguments: [])
            try await db.execute(sql: "PREPARE iap_test_plan AS " + statement, arguments: [])
            let nulls = Array(repeating: "NULL", count: marks).joined(separator: ", ")
            let plan = try await db.rows(sql: "EXPLAIN EXECUTE iap_test_plan" + (marks > 0 ? "(\(nulls))" : ""), arguments: [])
                .compactMap { $0.values.first.flatMap(String.fromSQL) }
            try await db.execute(sql: "DEALLOCATE iap_test_plan", arguments: [])
            return plan
        }
    }

    /// The first column of the first row of `sql`.
    package func testValue<T: SQLValueConvertible>(_ sql: String, _ arguments: SQLArguments = []) async throws -> T? {
        try await testRows(sql, arguments).first.flatMap { $0.values.first.flatMap(T.fromSQL) }
    }
}

extension Trait where Self == ConditionTrait {
    /// For a suite or test about PostgreSQL alone (several order services on one store, its
    /// drills): it runs when the run has the server.
    package static var needsPostgres: Self {
        .enabled(if: TestStore.hasPostgres, "needs the PostgreSQL server of `scripts/dev test` (IAP_TEST_DATABASE_URL)")
    }
}
