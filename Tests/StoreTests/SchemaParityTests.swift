import Foundation
import Testing
import TestSupport
@testable import OrderStore
@testable import Store
import Ledger

/// The order store's two live schemas after the whole history (`SchemaHistory`), read back from
/// each database's own catalogue and compared: the same tables, columns (kind, nullability, byte
/// order of text), primary and foreign keys, indexes (unique, partial and their predicates),
/// checks, and an audit log that refuses changes on both. A step written for one backend only
/// fails here.
@Suite("One schema on both backends", .needsPostgres)
struct SchemaParityTests {
    /// A table as both catalogues can describe it, in lower case (PostgreSQL folds names).
    struct Table: Equatable {
        var columns: [String: Column] = [:]
        var primaryKey: [String] = []
        var foreignKeys: Set<String> = []
        /// Every index but the primary key's: "unique? (columns) where predicate".
        var indexes: Set<String> = []
        /// Indexes created by name (not by a UNIQUE or PRIMARY KEY constraint).
        var namedIndexes: Set<String> = []
        var checks: Set<String> = []
    }

    struct Column: Equatable {
        /// integer, boolean, real, text, date, blob: what the column holds.
        var kind: String
        var notNull: Bool
        /// PostgreSQL: whether a text column compares bytes (`COLLATE "C"`), as SQLite's do.
        var bytewise: Bool = true
    }

    /// The kind of SQLite's declared type.
    static func sqliteKind(_ declared: String) -> String {
        switch declared.uppercased() {
        case "INTEGER": "integer"
        case "BOOLEAN": "boolean"
        case "REAL": "real"
        case "TEXT": "text"
        case "DATETIME": "date"
        case "BLOB": "blob"
        default: "unknown \(declared)"
        }
    }

    /// The kind of PostgreSQL's type, as the store maps it: the frozen prefix keeps dates as
    /// text in the store's one format and booleans as 0 and 1.
    static func postgresKind(_ type: String, column: String, sqliteKind: String?) -> String {
        switch type {
        case "bigint", "integer", "smallint": sqliteKind == "boolean" ? "boolean" : "integer"
        case "boolean": "boolean"
        case "double precision", "real": "real"
        case "text": sqliteKind == "date" ? "date" : "text"
        case "timestamp with time zone": "date"
        case "bytea": "blob"
        default: "unknown \(type)"
        }
    }

    /// What a CHECK or an index predicate says, whatever the dialect wrote: its names, literals,
    /// numbers and order comparisons (PostgreSQL rewrites `IN (…)` as `= ANY (ARRAY[…])` and adds
    /// casts and parentheses).
    static func signature(_ expression: String) -> String {
        let text = expression.lowercased().replacingOccurrences(
            of: "::[a-z_ ]+(\\[\\])?", with: "", options: .regularExpression)
        var tokens: [String] = []
        let pattern = try! NSRegularExpression(pattern: "'[^']*'|[a-z_][a-z0-9_]*|[0-9]+|<=|>=|<>|!=|<|>")
        for match in pattern.matches(in: text, range: NSRange(text.startIndex..., in: text)) {
            let token = String(text[Range(match.range, in: text)!])
            if ["check", "in", "any", "array", "and", "or", "is", "not", "null", "where"].contains(token) { continue }
            tokens.append(token)
        }
        return tokens.sorted().joined(separator: " ")
    }

    /// Every `CHECK (…)` of a CREATE TABLE text, its parentheses balanced.
    static func checks(inCreateTable sql: String) -> [String] {
        var found: [String] = []
        let characters = Array(sql)
        let upper = Array(sql.uppercased())
        var index = 0
        while index + 5 <= upper.count {
            guard String(upper[index..<index + 5]) == "CHECK" else {
                index += 1
                continue
            }
            var cursor = index + 5
            // A column named check… (checkedAt) is no CHECK: the word goes on, or no ( follows.
            while cursor < characters.count, characters[cursor] == " " { cursor += 1 }
            guard cursor < characters.count, characters[cursor] == "(" else {
                index += 5
                continue
            }
            let start = cursor
            var depth = 0
            repeat {
                if characters[cursor] == "(" { depth += 1 }
                if characters[cursor] == ")" { depth -= 1 }
                cursor += 1
            } while depth > 0 && cursor < characters.count
            found.append(String(characters[start..<cursor]))
            index = cursor
        }
        return found
    }

    static func sqliteSchema(_ store: OrderStore) async throws -> [String: Table] {
        var tables: [String: Table] = [:]
        let rows = try await store.testRows(
            "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' AND name <> 'grdb_migrations'")
        for row in rows {
            let name: String = row["name"]
            var table = Table()
            var primary: [(Int, String)] = []
            for column in try await store.testRows("SELECT name, type, \"notnull\", pk FROM pragma_table_info(?)", [name]) {
                let columnName = (column["name"] as String).lowercased()
                let pk: Int = column["pk"]
                // A primary key column holds no NULL (an INTEGER PRIMARY KEY is the rowid).
                table.columns[columnName] = Column(
                    kind: sqliteKind(column["type"]), notNull: (column["notnull"] as Int) != 0 || pk > 0)
                if pk > 0 { primary.append((pk, columnName)) }
            }
            table.primaryKey = primary.sorted { $0.0 < $1.0 }.map(\.1)
            for key in try await store.testRows("SELECT \"from\", \"table\", \"to\" FROM pragma_foreign_key_list(?)", [name]) {
                table.foreignKeys.insert(
                    "(\((key["from"] as String).lowercased())) → \((key["table"] as String).lowercased())(\((key["to"] as String).lowercased()))")
            }
            for index in try await store.testRows("SELECT name, \"unique\", origin, partial FROM pragma_index_list(?)", [name]) {
                let indexName: String = index["name"]
                let origin: String = index["origin"]
                if origin == "pk" { continue }
                let columns = try await store.testRows("SELECT name FROM pragma_index_info(?) ORDER BY seqno", [indexName])
                    .map { ($0["name"] as String).lowercased() }
                var predicate = ""
                if (index["partial"] as Int) != 0, let sql: String = try await store.testValue(
                    "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = ?", [indexName]),
                    let whereRange = sql.range(of: " WHERE ", options: .caseInsensitive)
                {
                    predicate = " where " + signature(String(sql[whereRange.upperBound...]))
                }
                table.indexes.insert(((index["unique"] as Int) != 0 ? "unique " : "") + "(\(columns.joined(separator: ",")))" + predicate)
                if origin == "c" { table.namedIndexes.insert(indexName.lowercased()) }
            }
            table.checks = Set(checks(inCreateTable: row["sql"]).map(signature))
            tables[name.lowercased()] = table
        }
        return tables
    }

    static func postgresSchema(_ store: OrderStore, sqlite: [String: Table]) async throws -> [String: Table] {
        var tables: [String: Table] = [:]
        for row in try await store.testRows(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' AND table_type = 'BASE TABLE' AND table_name <> 'iap_schema_migration'")
        {
            let name: String = row["table_name"]
            var table = Table()
            for column in try await store.testRows(
                """
                SELECT column_name, data_type, is_nullable, collation_name FROM information_schema.columns
                WHERE table_schema = 'public' AND table_name = ?
                """, [name])
            {
                let columnName: String = column["column_name"]
                // The rows SQLite numbers itself (its rowid), numbered here by a column of their own.
                if columnName == "rowid" { continue }
                let type: String = column["data_type"]
                let kind = postgresKind(type, column: columnName, sqliteKind: sqlite[name]?.columns[columnName]?.kind)
                table.columns[columnName] = Column(
                    kind: kind, notNull: (column["is_nullable"] as String) == "NO",
                    bytewise: type != "text" || (column["collation_name"] as String?) == "C")
            }
            table.primaryKey = try await store.testRows(
                """
                SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid
                JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, position) ON a.attnum = k.attnum
                WHERE i.indrelid = ?::regclass AND i.indisprimary ORDER BY k.position
                """, [name]
            ).map { $0["attname"] as String }
            for key in try await store.testRows(
                "SELECT pg_get_constraintdef(oid) AS definition FROM pg_constraint WHERE conrelid = ?::regclass AND contype = 'f'", [name])
            {
                // FOREIGN KEY (submissionid) REFERENCES submission(id)
                let definition = (key["definition"] as String).lowercased()
                let parts = definition.replacingOccurrences(of: "foreign key ", with: "").components(separatedBy: " references ")
                table.foreignKeys.insert("\(parts[0]) → \(parts.count > 1 ? parts[1] : "?")")
            }
            for index in try await store.testRows(
                """
                SELECT c.relname AS name, i.indisunique AS isunique,
                    pg_get_expr(i.indpred, i.indrelid) AS predicate,
                    EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = i.indexrelid) AS byconstraint,
                    ARRAY(SELECT a.attname FROM unnest(i.indkey) WITH ORDINALITY AS k(attnum, position)
                        JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum ORDER BY k.position)::text AS columns
                FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                WHERE i.indrelid = ?::regclass AND NOT i.indisprimary
                """, [name])
            {
                let columns = (index["columns"] as String).trimmingCharacters(in: CharacterSet(charactersIn: "{}"))
                if columns == "rowid" { continue }
                let predicate = (index["predicate"] as String?).map { " where " + signature($0) } ?? ""
                table.indexes.insert(((index["isunique"] as Bool) ? "unique " : "") + "(\(columns))" + predicate)
                if !(index["byconstraint"] as Bool) { table.namedIndexes.insert(index["name"] as String) }
            }
            table.checks = Set(
                try await store.testRows(
                    "SELECT pg_get_constraintdef(oid) AS definition FROM pg_constraint WHERE conrelid = ?::regclass AND contype = 'c'",
                    [name]
                ).map { signature($0["definition"] as String) })
            tables[name] = table
        }
        return tables
    }

    /// Every way the two schemas differ, a line each.
    static func differences(sqlite: [String: Table], postgres: [String: Table]) -> [String] {
        var found: [String] = []
        for name in Set(sqlite.keys).union(postgres.keys).sorted() {
            guard let left = sqlite[name], let right = postgres[name] else {
                found.append("table \(name): only on \(sqlite[name] == nil ? "PostgreSQL" : "SQLite")")
                continue
            }
            for column in Set(left.columns.keys).union(right.columns.keys).sorted() {
                let a = left.columns[column]
                let b = right.columns[column]
                if a != b {
                    found.append("\(name).\(column): SQLite \(a.map { "\($0)" } ?? "none"), PostgreSQL \(b.map { "\($0)" } ?? "none")")
                }
            }
            func compare<T: Equatable>(_ what: String, _ a: T, _ b: T) {
                if a != b { found.append("\(name) \(what): SQLite \(a), PostgreSQL \(b)") }
            }
            compare("primary key", left.primaryKey, right.primaryKey)
            compare("foreign keys", left.foreignKeys.sorted(), right.foreignKeys.sorted())
            compare("indexes", left.indexes.sorted(), right.indexes.sorted())
            compare("named indexes", left.namedIndexes.sorted(), right.namedIndexes.sorted())
            compare("checks", left.checks.sorted(), right.checks.sorted())
        }
        return found
    }

    @Test func bothBackendsHoldTheSameSchemaAfterTheWholeHistory() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("schema-parity-\(UUID().uuidString)")
        defer { try? FileManager.default.removeItem(at: folder) }
        let sqliteStore = try await OrderStore(path: folder.appendingPathComponent("orders.sqlite").path)
        let postgresStore = try await OrderStore(location: .postgres(try TestStore.emptyPostgresDatabase()))
        let sqlite = try await Self.sqliteSchema(sqliteStore)
        let postgres = try await Self.postgresSchema(postgresStore, sqlite: sqlite)
        await sqliteStore.close()
        await postgresStore.close()
        // The comparison reads something: the ledger's tables, with their keys and checks.
        #expect(sqlite.count >= 14, "tables read from SQLite: \(sqlite.keys.sorted())")
        #expect(sqlite["grants"]?.indexes.contains("unique (creditkey) where 'active' state") == true, "\(sqlite["grants"]?.indexes.sorted() ?? [])")
        #expect(sqlite["purchase"]?.checks.isEmpty == false)
        let differences = Self.differences(sqlite: sqlite, postgres: postgres)
        #expect(differences.isEmpty, "the schemas differ:\n\(differences.joined(separator: "\n"))")
    }

    @Test func theAuditLogRefusesChangesOnBothBackends() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("schema-parity-\(UUID().uuidString)")
        defer { try? FileManager.default.removeItem(at: folder) }
        for store in await [
            try OrderStore(path: folder.appendingPathComponent("orders.sqlite").path),
            try OrderStore(location: .postgres(try TestStore.emptyPostgresDatabase())),
        ] {
            let backend = store.database.dialect
            _ = try await store.testRows(
                "INSERT INTO audit_log (id, at, actor, action, subject, reason) VALUES (1, ?, 'cs:ana', 'grant', 'user:u1', 'test')",
                [Date()])
            for change in [
                "UPDATE audit_log SET reason = 'edited'",
                "DELETE FROM audit_log",
                "INSERT INTO audit_log (id, at, actor, action, subject, reason) VALUES (1, '2026-01-01', 'x', 'x', 'x', 'x')",
            ] + (backend == .postgres ? ["TRUNCATE audit_log"] : ["INSERT OR REPLACE INTO audit_log (id, at, actor, action, subject, reason) VALUES (1, '2026-01-01', 'x', 'x', 'x', 'x')"]) {
                await #expect(throws: (any Error).self, "\(backend): \(change)") { _ = try await store.testRows(change) }
            }
            let reason: String? = try await store.testValue("SELECT reason FROM audit_log WHERE id = 1")
            #expect(reason == "test", "\(backend): the entry is as written")
            await store.close()
        }
    }

    @Test func theHistoryNumbersEachStepOnceAndGivesEveryNewStepBothTexts() {
        let steps = SchemaHistory.steps
        #expect(steps.map(\.version) == Array(1...steps.count))
        // The frozen prefix: PostgreSQL's own numbers 1 to 6 for steps 6 to 11.
        #expect(steps.filter { $0.postgres == nil }.map(\.version) == [1, 2, 3, 4, 5])
        #expect(steps.filter { $0.version <= 11 && $0.postgres != nil }.map(\.postgresRecordedAs) == [1, 2, 3, 4, 5, 6])
        for step in steps where step.version > 11 {
            #expect(step.postgres != nil && step.postgresRecordedAs == step.version, "step \(step.version) has both texts, one number")
        }
        #expect(Set(SchemaHistory.postgresMigrations.map(\.recordedAs)).count == SchemaHistory.postgresMigrations.count)
    }
}
