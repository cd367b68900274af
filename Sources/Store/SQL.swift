public import Foundation
import IAPCore

/// A value as the order store writes and reads it: the same five kinds on SQLite and
/// PostgreSQL, so that one set of store operations runs on either.
package enum SQLValue: Sendable, Equatable {
    case null
    case integer(Int64)
    case real(Double)
    case text(String)
    case blob(Data)
}

/// A Swift value the store binds as an argument and reads back from a column.
package protocol SQLValueConvertible: Sendable {
    /// The value to bind.
    var sqlValue: SQLValue { get }
    /// The Swift value of a column, or nil when the column holds something else.
    static func fromSQL(_ value: SQLValue) -> Self?
}

extension String: SQLValueConvertible {
    package var sqlValue: SQLValue { .text(self) }
    package static func fromSQL(_ value: SQLValue) -> String? {
        switch value {
        case .text(let text): text
        case .integer(let integer): String(integer)
        case .real(let real): String(real)
        case .blob(let data): String(decoding: data, as: UTF8.self)
        case .null: nil
        }
    }
}

/// A value of a string-backed vocabulary (states, reasons) is kept as its raw value.
extension SQLValueConvertible where Self: RawRepresentable, RawValue == String {
    package var sqlValue: SQLValue { .text(rawValue) }
    package static func fromSQL(_ value: SQLValue) -> Self? { String.fromSQL(value).flatMap(Self.init(rawValue:)) }
}

extension RawRepresentable where RawValue == String {
    /// The value as an SQL string literal, for a query whose text names a state (as a partial
    /// index's predicate does): meant for the project's own vocabulary, and quoted as SQL quotes
    /// (a `'` doubled), so that even a value built from input stays one literal.
    package var sql: String { "'" + rawValue.replacingOccurrences(of: "'", with: "''") + "'" }
}

extension Int64: SQLValueConvertible {
    package var sqlValue: SQLValue { .integer(self) }
    package static func fromSQL(_ value: SQLValue) -> Int64? {
        switch value {
        case .integer(let integer): integer
        case .real(let real): Int64(exactly: real.rounded(.towardZero))
        // PostgreSQL answers SUM and AVG of integers as numeric, read as text.
        case .text(let text): Int64(text) ?? Double(text).flatMap { Int64(exactly: $0.rounded(.towardZero)) }
        case .blob, .null: nil
        }
    }
}

extension Int: SQLValueConvertible {
    package var sqlValue: SQLValue { .integer(Int64(self)) }
    package static func fromSQL(_ value: SQLValue) -> Int? { Int64.fromSQL(value).map { Int($0) } }
}

extension Double: SQLValueConvertible {
    package var sqlValue: SQLValue { .real(self) }
    package static func fromSQL(_ value: SQLValue) -> Double? {
        switch value {
        case .real(let real): real
        case .integer(let integer): Double(integer)
        case .text(let text): Double(text)
        case .blob, .null: nil
        }
    }
}

extension Bool: SQLValueConvertible {
    /// Booleans are integers 0 and 1 on both backends, as SQLite has always stored them.
    package var sqlValue: SQLValue { .integer(self ? 1 : 0) }
    package static func fromSQL(_ value: SQLValue) -> Bool? { Int64.fromSQL(value).map { $0 != 0 } }
}

extension Data: SQLValueConvertible {
    package var sqlValue: SQLValue { .blob(self) }
    package static func fromSQL(_ value: SQLValue) -> Data? {
        switch value {
        case .blob(let data): data
        case .text(let text): Data(text.utf8)
        case .integer, .real, .null: nil
        }
    }
}

extension Date: SQLValueConvertible {
    /// Dates are text `yyyy-MM-dd HH:mm:ss.SSS` in UTC on both backends: the format SQLite
    /// files of this store have always held, which sorts and compares as the dates do.
    package var sqlValue: SQLValue { .text(SQLDate.format(self)) }
    package static func fromSQL(_ value: SQLValue) -> Date? {
        switch value {
        case .text(let text): SQLDate.parse(text)
        case .integer(let seconds): Date(timeIntervalSince1970: TimeInterval(seconds))
        case .real(let seconds): Date(timeIntervalSince1970: seconds)
        case .blob, .null: nil
        }
    }
}

/// The text form of dates in the store, written and read without a `DateFormatter` (the hot
/// paths write several dates per purchase).
package enum SQLDate {
    package static func format(_ date: Date) -> String {
        // Milliseconds, rounded down, as the store has always kept them.
        DateText.format(date, separator: " ", zone: "")
    }

    /// Reads `yyyy-MM-dd`, optionally followed by ` HH:mm`, `:ss`, `.SSS…` (a `T` also separates
    /// date and time) and `Z`: UTC.
    package static func parse(_ text: String) -> Date? {
        let bytes = Array(text.utf8)
        var index = 0
        func number(_ width: Int) -> Int64? {
            guard index + width <= bytes.count else { return nil }
            var value: Int64 = 0
            for byte in bytes[index..<index + width] {
                guard byte >= 48, byte <= 57 else { return nil }
                value = value * 10 + Int64(byte - 48)
            }
            index += width
            return value
        }
        func expect(_ byte: UInt8) -> Bool {
            guard index < bytes.count, bytes[index] == byte else { return false }
            index += 1
            return true
        }
        guard let year = number(4), expect(45), let month = number(2), expect(45), let day = number(2),
            (1...12).contains(month), (1...31).contains(day)
        else { return nil }
        var hour: Int64 = 0
        var minute: Int64 = 0
        var second: Int64 = 0
        var fraction = 0.0
        if index < bytes.count, bytes[index] == 32 || bytes[index] == 84 {
            index += 1
            guard let h = number(2), expect(58), let m = number(2) else { return nil }
            hour = h
            minute = m
            if expect(58) {
                guard let s = number(2) else { return nil }
                second = s
                if expect(46) {
                    var scale = 0.1
                    while index < bytes.count, bytes[index] >= 48, bytes[index] <= 57 {
                        fraction += Double(bytes[index] - 48) * scale
                        scale /= 10
                        index += 1
                    }
                }
            }
        }
        _ = expect(90)
        guard index == bytes.count else { return nil }
        // Days since 1970-01-01 from the civil date (the inverse of `format`).
        let y = month <= 2 ? year - 1 : year
        let era = (y >= 0 ? y : y - 399) / 400
        let yearOfEra = y - era * 400
        let dayOfYear = (153 * (month > 2 ? month - 3 : month + 9) + 2) / 5 + day - 1
        let dayOfEra = yearOfEra * 365 + yearOfEra / 4 - yearOfEra / 100 + dayOfYear
        let days = era * 146_097 + dayOfEra - 719_468
        let seconds = days * 86_400 + hour * 3600 + minute * 60 + second
        return Date(timeIntervalSince1970: TimeInterval(seconds) + fraction)
    }
}

/// The arguments of one statement, in the order of its `?` marks.
package struct SQLArguments: Sendable, ExpressibleByArrayLiteral {
    package var values: [SQLValue]

    package init(arrayLiteral elements: (any SQLValueConvertible)?...) {
        values = elements.map { $0?.sqlValue ?? .null }
    }

    package init(_ elements: [some SQLValueConvertible]) {
        // A closure, not `\.sqlValue`: a key path through a generic type is built at run time.
        values = elements.map { $0.sqlValue }
    }

    package init(values: [SQLValue]) {
        self.values = values
    }
}

/// One statement of a batch, and the error it fails with when it must change a row and
/// changes none (a row another writer took, a key already granted).
package struct SQLStatement: Sendable {
    package var sql: String
    package var arguments: SQLArguments
    /// Thrown, and the whole batch undone, when the statement changes no row; nil: any count.
    package var requiresChange: SQLError?
    /// The queues it fills: the commit that holds it wakes their workers (`CommitQueues`).
    package var fills: CommitQueues

    package init(_ sql: String, _ arguments: SQLArguments = [], requiresChange: SQLError? = nil, fills: CommitQueues = []) {
        self.sql = sql
        self.arguments = arguments
        self.requiresChange = requiresChange
        self.fills = fills
    }
}

/// The store's queues that a commit may fill, each with a signal of its own
/// (`OrderStore.outboxSignal`, `OrderStore.appleCallSignal`): a commit that fills one wakes
/// the workers that drain it at once, rather than at their next poll.
package struct CommitQueues: OptionSet, Sendable {
    package let rawValue: UInt8
    package init(rawValue: UInt8) { self.rawValue = rawValue }

    /// The outbox of messages for the broker, drained by the relay.
    package static let outbox = CommitQueues(rawValue: 1)
    /// The calls to Apple (finishes, consumption answers), drained by the Apple-calls workers.
    package static let appleCalls = CommitQueues(rawValue: 2)
}

/// What a store's statement observer hears besides the statements it sends.
package enum SQLTrace {
    /// Leads the text of each statement run inside a batch (`iap_write`, `iap_read` on
    /// PostgreSQL), heard along with the batch's own statement: counting round trips skips them.
    package static let inBatch = "/* in a batch */ "
}

/// One row of a result, its columns found by name whatever their case (PostgreSQL folds
/// unquoted names to lower case; SQLite keeps them as written).
package struct SQLRow: Sendable {
    package let columns: [String]
    package let values: [SQLValue]

    package init(columns: [String], values: [SQLValue]) {
        self.columns = columns
        self.values = values
    }

    package func index(of column: String) -> Int? {
        if let exact = columns.firstIndex(of: column) { return exact }
        let folded = column.lowercased()
        return columns.firstIndex { $0.lowercased() == folded }
    }

    /// The raw value of `column`, `.null` when there is no such column.
    package func value(_ column: String) -> SQLValue {
        index(of: column).map { values[$0] } ?? .null
    }

    /// The value of `column`; stops the program when it is missing, NULL or of another kind, as
    /// reading a NOT NULL column the schema guarantees should never fail.
    package subscript<T: SQLValueConvertible>(_ column: String) -> T {
        guard let index = index(of: column) else { fatalError("no column \(column) in \(columns)") }
        guard let value = T.fromSQL(values[index]) else {
            fatalError("column \(column) holds \(values[index]), not \(T.self)")
        }
        return value
    }

    /// The value of `column`, nil when NULL or missing.
    package subscript<T: SQLValueConvertible>(_ column: String) -> T? {
        guard let index = index(of: column) else { return nil }
        return T.fromSQL(values[index])
    }

    /// The value of the column at `position`.
    package subscript<T: SQLValueConvertible>(_ position: Int) -> T {
        guard let value = T.fromSQL(values[position]) else {
            fatalError("column \(position) holds \(values[position]), not \(T.self)")
        }
        return value
    }

    /// Whether `column` is in the row and not NULL.
    package func hasValue(_ column: String) -> Bool {
        if case .null = value(column) { return false }
        return index(of: column) != nil
    }
}

/// Which SQL the connection speaks, where the two differ.
package enum SQLDialect: String, Sendable {
    case sqlite
    case postgres
}

/// One connection inside one transaction: what every store operation is written against.
///
/// Statements use `?` marks; the PostgreSQL connection numbers them. Both backends accept the
/// SQL the store writes (`INSERT … ON CONFLICT`, `RETURNING`, `excluded.`); where they differ
/// the store asks `dialect`. A connection belongs to the one task running its transaction.
package protocol SQLConnection: AnyObject {
    var dialect: SQLDialect { get }
    /// Runs one statement and returns how many rows it changed.
    @discardableResult
    func execute(sql: String, arguments: SQLArguments) async throws -> Int
    /// Runs one query and returns all its rows.
    func rows(sql: String, arguments: SQLArguments) async throws -> [SQLRow]
    /// Runs `body` in a savepoint: its changes stay if it returns, vanish if it throws.
    func inSavepoint<T>(_ body: () async throws -> T) async throws -> T
    /// Runs `statements` in order, all or nothing: a statement that fails, or changes no row
    /// where it `requiresChange`, throws and undoes the batch (the transaction goes on). On
    /// PostgreSQL one round trip; on SQLite one statement at a time in a savepoint.
    func executeBatch(_ statements: [SQLStatement]) async throws
    /// `executeBatch`, sent with the next thing this connection sends: before the next
    /// statement, or at the end of the unit (`inSavepoint`) or transaction. On PostgreSQL the
    /// writes queued by the time a unit ends go as its one write, needing no savepoint; a
    /// failure is thrown where they are sent. On SQLite, at once.
    func executeLater(_ statements: [SQLStatement]) async throws
    /// Runs independent queries and returns each one's rows, in order: on PostgreSQL in one
    /// round trip (their rows come back as JSON, so no column may hold bytes); on SQLite one
    /// after the other.
    func readBatch(_ queries: [SQLStatement]) async throws -> [[SQLRow]]
    /// Rows changed by the last statement.
    var changesCount: Int { get }
    /// False once the backend has rolled the transaction back under the caller (disk full,
    /// a serialization failure): nothing more may be written in it.
    var isInsideTransaction: Bool { get }
    /// The queues this transaction's statements sent or queued so far fill (`SQLStatement.fills`).
    var filled: CommitQueues { get }
}

/// A connection on which a group commit's units go side by side (PostgreSQL): the reads of
/// many units in one round trip, then the writes of many units in one more, each unit's writes
/// all or nothing on their own, the transaction going on whatever one unit's did. Sendable:
/// a round's units hold it in tasks of their own, but only the round (`SideBySideRound`)
/// sends on it, and only while every unit waits.
package protocol SideBySideConnection: SQLConnection, Sendable {
    /// Runs each unit's queries, all in one round trip; answers each unit's sets of rows.
    func readSideBySide(_ units: [[SQLStatement]]) async throws -> [[[SQLRow]]]
    /// Runs each unit's writes, all in one round trip, each unit's undone alone when one of
    /// them fails; answers each unit's error, or nil where its writes stayed. A throw: the
    /// round trip itself failed, and no unit's writes are known to have stayed.
    func writeSideBySide(_ units: [[SQLStatement]]) async throws -> [(any Error)?]
}

extension SQLConnection {
    @discardableResult
    package func execute(sql: String) async throws -> Int { try await execute(sql: sql, arguments: []) }

    /// Runs one statement whose text is fixed (the backends keep it prepared).
    package func executeCached(sql: String, arguments: SQLArguments = []) async throws {
        try await execute(sql: sql, arguments: arguments)
    }

    /// The first row of a query.
    package func row(sql: String, arguments: SQLArguments = []) async throws -> SQLRow? {
        try await rows(sql: sql, arguments: arguments).first
    }

    /// The first row of a fixed query.
    package func cachedRow(sql: String, arguments: SQLArguments = []) async throws -> SQLRow? {
        try await row(sql: sql, arguments: arguments)
    }

    package func rows(sql: String) async throws -> [SQLRow] { try await rows(sql: sql, arguments: []) }

    /// Whether this transaction is the only one doing `task` now, across every order service
    /// sharing the store (a PostgreSQL advisory lock held until the transaction ends). On
    /// SQLite, whose one writer runs one transaction at a time, always true.
    package func takeExclusive(_ task: String) async throws -> Bool {
        guard dialect == .postgres else { return true }
        return try await Bool.fetchOne(self, sql: "SELECT pg_try_advisory_xact_lock(hashtext(?))", arguments: ["iap:" + task]) ?? false
    }
}

extension SQLValueConvertible {
    /// The first column of the first row, nil when there is no row or it is NULL.
    package static func fetchOne(_ db: any SQLConnection, sql: String, arguments: SQLArguments = []) async throws -> Self? {
        guard let row = try await db.row(sql: sql, arguments: arguments), let first = row.values.first else { return nil }
        return fromSQL(first)
    }

    /// The first column of every row (NULLs left out).
    package static func fetchAll(_ db: any SQLConnection, sql: String, arguments: SQLArguments = []) async throws -> [Self] {
        try await db.rows(sql: sql, arguments: arguments).compactMap { $0.values.first.flatMap(fromSQL) }
    }
}

/// A failure of the database under the store, classified the same on both backends.
package struct SQLError: Error, Sendable, CustomStringConvertible {
    package enum Kind: Sendable {
        /// A unique or primary key refused the row.
        case uniqueViolation
        /// Another writer's transaction conflicts (PostgreSQL 40001, 40P01): run it again.
        case serializationFailure
        /// The server cannot be reached or the connection broke.
        case connection
        /// Anything else (a constraint, a trigger, a full disk, a bug).
        case other
    }

    package var kind: Kind
    package var message: String

    package init(_ kind: Kind, _ message: String) {
        self.kind = kind
        self.message = message
    }

    package var description: String { message }
}

/// What the store runs transactions on: SQLite on its own connections, or PostgreSQL through `PostgresClient`.
package protocol SQLDatabase: Sendable {
    var dialect: SQLDialect { get }
    /// Runs `body` in a read-only transaction that sees one consistent state.
    func read<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T
    /// Runs `body` in a write transaction of the ledger and commits it, kept apart from every
    /// other write of the ledger (of this service or another one sharing the store): `body`
    /// sees the ledger as if it ran alone, beside only uploads' inserts and the relay's claims.
    /// On PostgreSQL a deadlock or a lost connection runs `body` again, so `body` must only
    /// change the database and its own locals.
    @discardableResult
    func write<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T
    /// `write`, for work that touches only the rows `keys` name (see `GroupCommit.write(keys:_:)`):
    /// kept apart only from transactions whose keys meet these, and from those of `write`. On
    /// PostgreSQL each key is a transaction-level advisory lock, taken in one order by every
    /// service; on SQLite as `write` (one writer).
    @discardableResult
    func write<T: Sendable>(keys: Set<String>, _ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T
    /// Counts: runs one short, self-contained statement's worth of work that must not wait
    /// behind the ledger's writes (the shared rate-limit buckets): on PostgreSQL on a connection of its
    /// own in autocommit, failing at once while the database is away; on SQLite as `write`.
    func writeCounters<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T
    /// Accepts uploads: runs `body` in a write transaction that only inserts rows of its own (a
    /// new submission and its message; a unique key keeps each once): on PostgreSQL on a writer
    /// of their own, `READ COMMITTED` with no lock of the ledger's, so uploads never wait for a
    /// batch of results; on SQLite as `write` (one writer).
    @discardableResult
    func acceptUploads<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T
    /// Works a queue (the outbox, the calls to Apple): runs `body` in a write transaction kept
    /// apart from other writers by the row locks it takes (`FOR UPDATE`), not by the ledger's
    /// locks: a relay's or a worker's claims and deletes.
    /// On PostgreSQL `READ COMMITTED`, beside the ledger's writer rather than behind it, so that
    /// it never waits for a group commit; on SQLite as `write`.
    @discardableResult
    func writeQueues<T: Sendable>(_ body: @escaping @Sendable (any SQLConnection) async throws -> T) async throws -> T
    /// Closes the connections.
    func close() async
}

/// `?,?,?`: the marks of an `IN (…)` list of `count` arguments.
package func sqlMarks(_ count: Int) -> String {
    Array(repeating: "?", count: count).joined(separator: ",")
}
