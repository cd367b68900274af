import Foundation
import Testing
import TestSupport
@testable import OrderStore
@testable import Store
import Ledger

/// One PostgreSQL connection whose server goes away: what runs on it fails, and fails at once.
@Suite("A PostgreSQL session whose connection closed", .needsPostgres, .timeLimit(.minutes(1)))
struct PostgresSessionTests {
    /// The server ends the session's backend (as a restart does) between two statements: the
    /// next statement fails with a connection error within seconds. The driver drops a query
    /// written to a connection that has closed without ever answering it; a wait on that answer
    /// would last until the time limit ends the test.
    @Test func aStatementAfterTheServerEndedTheSessionFailsAtOnce() async throws {
        let location = try await TestStore.emptyPostgresDatabase()
        try await PostgresDatabase.withConnection(to: location.server) { session in
            let pid = try #require(try await Int.fetchOne(session, sql: "SELECT pg_backend_pid()"))
            try await PostgresDatabase.withConnection(to: location.server) { other in
                _ = try await other.rows(sql: "SELECT pg_terminate_backend(?::integer)", arguments: [pid])
            }
            // The server's goodbye reaches the client, which closes the connection.
            try await Task.sleep(for: .milliseconds(500))
            let started = ContinuousClock.now
            let error = await #expect(throws: SQLError.self) { try await session.rows(sql: "SELECT 1") }
            #expect(error?.kind == .connection)
            #expect(ContinuousClock.now - started < .seconds(5))
        }
    }
}
