import Foundation

/// Runs the schema history's PostgreSQL steps (`SchemaHistory`): the same tables, columns, keys
/// and indexes as on SQLite, in PostgreSQL's types.
///
/// Text columns sort byte-wise (`COLLATE "C"`), as SQLite's do; dates are text in the store's
/// one format; booleans are 0 and 1; `rowid` columns keep insertion order where the store reads it.
package enum PostgresSchema {
    /// A key only this store's migrations take (`pg_advisory_lock`), so that the first
    /// instance to start migrates and the others wait, then find nothing to do.
    package static let migrationLock: Int64 = 0x1A9_5702_E001

    /// Applies the migrations not yet applied, one transaction each, under the advisory lock.
    package static func migrate(_ session: PostgresSession) async throws {
        try await session.execute(sql: "SELECT pg_advisory_lock(\(migrationLock))")
        do {
            try await session.execute(
                sql: """
                    CREATE TABLE IF NOT EXISTS iap_schema_migration (
                        version BIGINT PRIMARY KEY, name TEXT NOT NULL, appliedAt TEXT NOT NULL)
                    """)
            let applied = Set(try await Int.fetchAll(session, sql: "SELECT version FROM iap_schema_migration"))
            for migration in SchemaHistory.postgresMigrations where !applied.contains(migration.recordedAs) {
                try await session.execute(sql: "BEGIN")
                do {
                    for statement in statements(migration.sql) { try await session.execute(sql: statement) }
                    try await session.execute(
                        sql: "INSERT INTO iap_schema_migration (version, name, appliedAt) VALUES (?, ?, ?)",
                        arguments: [migration.recordedAs, migration.name, Date()])
                    try await session.execute(sql: "COMMIT")
                } catch {
                    _ = try? await session.execute(sql: "ROLLBACK")
                    throw error
                }
            }
        } catch {
            _ = try? await session.execute(sql: "SELECT pg_advisory_unlock(\(migrationLock))")
            throw error
        }
        try await session.execute(sql: "SELECT pg_advisory_unlock(\(migrationLock))")
    }

    /// The statements of a script, split at `;` outside quotes, `$$` bodies and `--` comments.
    package static func statements(_ script: String) -> [String] {
        var statements: [String] = []
        var current = ""
        var inQuote = false
        var inBody = false
        var inComment = false
        var previous: Character = " "
        for character in script {
            if inComment {
                if character == "\n" { inComment = false }
                previous = character
                continue
            }
            if character == "-" && previous == "-" && !inQuote && !inBody {
                // A `--` comment runs to the end of its line: its quotes and semicolons are text.
                current.removeLast()
                inComment = true
                previous = " "
                continue
            }
            if character == "'" && !inBody { inQuote.toggle() }
            if character == "$" && previous == "$" && !inQuote { inBody.toggle() }
            if character == ";" && !inQuote && !inBody {
                let statement = current.trimmingCharacters(in: .whitespacesAndNewlines)
                if !statement.isEmpty { statements.append(statement) }
                current = ""
            } else {
                current.append(character)
            }
            previous = character
        }
        let last = current.trimmingCharacters(in: .whitespacesAndNewlines)
        if !last.isEmpty { statements.append(last) }
        return statements
    }
}
