import Crypto
import Foundation
import Store

/// What copying one store into another did, table by table.
public struct StoreCopyReport: Sendable, Codable, Equatable {
    /// One table: rows read from the source, rows found in the target, and the SHA-256 of
    /// every row's values (in primary key order) on both sides.
    public struct Table: Sendable, Codable, Equatable {
        public var table: String
        public var rows: Int
        public var targetRows: Int
        public var checksum: String
        public var targetChecksum: String
        /// Count and checksum agree.
        public var matches: Bool

        init(table: String, rows: Int, targetRows: Int, checksum: String, targetChecksum: String) {
            self.table = table
            self.rows = rows
            self.targetRows = targetRows
            self.checksum = checksum
            self.targetChecksum = targetChecksum
            matches = rows == targetRows && checksum == targetChecksum
        }
    }

    public var tables: [Table] { didSet { verified = tables.allSatisfy(\.matches) } }
    /// True when every table's count and checksum match.
    public private(set) var verified: Bool

    init(tables: [Table]) {
        self.tables = tables
        verified = tables.allSatisfy(\.matches)
    }
}

extension OrderStore {
    /// The ledger's tables in an order their foreign keys accept, each with the columns that
    /// name a row (its primary key) for ordering.
    static let ledgerTables: [(name: String, key: String)] = [
        ("submission", "id"),
        ("submission_receipt", "submissionId"),
        ("orders", "id"),
        ("purchase", "transactionId"),
        ("grants", "id"),
        ("submission_transaction", "submissionId, transactionId"),
        ("audit_log", "id"),
        ("outbox", "id"),
        ("notification", "notificationUUID"),
        ("subscription", "originalTransactionId"),
        ("consumption_request", "notificationUUID"),
        ("revocation", "creditKey"),
        ("reconciliation_run", "task"),
        ("redelivered_notification", "notificationUUID"),
        ("apple_finish", "transactionId"),
        ("consumption_report", "transactionId"),
        ("consumption_consent", "userId"),
        ("history_revision", "anchor"),
        ("purchase_terms", "transactionId"),
        ("user_app_transaction", "userId, appTransactionId"),
    ]

    /// Copies this SQLite store's whole ledger into `target`, a PostgreSQL store that holds
    /// nothing yet, in one transaction (all of it or none), then reads both back and compares
    /// every table's row count and checksum.
    ///
    /// - Important: Stop the order services that write this store first: what they write
    ///   after the copy began is not in the target.
    public func copy(into target: OrderStore, batchSize: Int = 1000) async throws -> StoreCopyReport {
        guard dialect == .sqlite else {
            throw OrderStoreError(.conflict, "the source must be a SQLite store (\(location))")
        }
        guard target.dialect == .postgres else {
            throw OrderStoreError(.conflict, "the target must be a PostgreSQL store (\(target.location))")
        }
        let source = database
        try await target.database.write { db in
            for table in Self.ledgerTables {
                let existing = try await Int.fetchOne(db, sql: "SELECT COUNT(*) FROM \(table.name)") ?? 0
                guard existing == 0 else {
                    throw OrderStoreError(
                        .conflict, "the target is not empty: \(table.name) holds \(existing) rows; copy into an empty database")
                }
            }
            for table in Self.ledgerTables {
                // SQLite's rowid goes along where the PostgreSQL table keeps one (insertion order).
                let keepsRowid = try await Bool.fetchOne(
                    db,
                    sql: "SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_name = ? AND column_name = 'rowid')",
                    arguments: [table.name]) ?? false
                var after: Int64 = .min
                while true {
                    let from = after
                    let rows = try await source.read { source in
                        try await source.rows(
                            sql: "SELECT rowid AS sqlite_rowid, * FROM \(table.name) WHERE rowid > ? ORDER BY rowid LIMIT ?",
                            arguments: [from, batchSize])
                    }
                    guard let last = rows.last else { break }
                    after = last["sqlite_rowid"]
                    try await Self.insert(rows, into: table.name, keepingRowid: keepsRowid, in: db)
                }
                // Identity columns go on after the highest id copied.
                let identities = try await String.fetchAll(
                    db, sql: "SELECT column_name FROM information_schema.columns WHERE table_name = ? AND is_identity = 'YES'",
                    arguments: [table.name])
                for column in identities {
                    try await db.execute(
                        sql: """
                            SELECT setval(pg_get_serial_sequence(?, ?)::regclass,
                                (SELECT COALESCE(MAX(\(column)), 0) + 1 FROM \(table.name)), false)
                            """,
                        arguments: [table.name, column])
                }
            }
        }
        var report = StoreCopyReport(tables: [])
        for table in Self.ledgerTables {
            let columns = try await database.read { db in
                try await db.rows(sql: "SELECT name FROM pragma_table_info('\(table.name)') ORDER BY cid").map { $0["name"] as String }
            }
            let (rows, checksum) = try await checksum(of: table.name, columns: columns, key: table.key)
            let (targetRows, targetChecksum) = try await target.checksum(of: table.name, columns: columns, key: table.key)
            report.tables.append(
                .init(table: table.name, rows: rows, targetRows: targetRows, checksum: checksum, targetChecksum: targetChecksum))
        }
        return report
    }

    /// Inserts rows read from SQLite, as they are, into the same columns.
    private static func insert(_ rows: [SQLRow], into table: String, keepingRowid: Bool, in db: any SQLConnection) async throws {
        guard let first = rows.first else { return }
        var columns = first.columns.filter { $0 != "sqlite_rowid" }
        if keepingRowid { columns.append("rowid") }
        // At most 65,535 arguments per statement on PostgreSQL.
        let perStatement = max(1, 60_000 / columns.count)
        for start in stride(from: 0, to: rows.count, by: perStatement) {
            let chunk = rows[start..<min(start + perStatement, rows.count)]
            let tuple = "(" + sqlMarks(columns.count) + ")"
            var values: [SQLValue] = []
            values.reserveCapacity(chunk.count * columns.count)
            for row in chunk {
                for column in columns { values.append(row.value(column == "rowid" ? "sqlite_rowid" : column)) }
            }
            try await db.execute(
                sql: "INSERT INTO \(table) (\(columns.joined(separator: ", "))) VALUES "
                    + Array(repeating: tuple, count: chunk.count).joined(separator: ", "),
                arguments: SQLArguments(values: values))
        }
    }

    /// The number of rows of `table` and the SHA-256 of their `columns`, in `key` order: the
    /// same on both backends for the same ledger.
    func checksum(of table: String, columns: [String], key: String) async throws -> (Int, String) {
        try await database.read { db in
            var hash = SHA256()
            var count = 0
            var offset = 0
            let page = 2000
            while true {
                let rows = try await db.rows(
                    sql: "SELECT \(columns.joined(separator: ", ")) FROM \(table) ORDER BY \(key) LIMIT ? OFFSET ?",
                    arguments: [page, offset])
                for row in rows {
                    for value in row.values { hash.update(data: Self.canonical(value)) }
                    count += 1
                }
                if rows.count < page { break }
                offset += page
            }
            return (count, hash.finalize().map { String(format: "%02x", $0) }.joined())
        }
    }

    /// A value as bytes that do not depend on the backend it was read from.
    private static func canonical(_ value: SQLValue) -> Data {
        switch value {
        case .null: Data("N;".utf8)
        case .integer(let integer): Data("I\(integer);".utf8)
        case .real(let real): Data("R\(real);".utf8)
        case .text(let text): Data("T\(text.utf8.count):\(text);".utf8)
        case .blob(let data): Data("B\(data.count):".utf8) + data
        }
    }
}
