import ArgumentParser
import Foundation
import IAPCore
import OrderStore

/// `iap admin migrate-store`: a SQLite deployment's ledger into PostgreSQL, verified.
struct MigrateStoreCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "migrate-store",
        abstract: "Copy a SQLite order store into an empty PostgreSQL database and verify the copy.",
        discussion: """
            Stop the order services that write the SQLite file first. Copies every ledger table (submissions, \
            purchases, grants, orders, the audit log, the outbox, notifications, subscriptions, revocations and the \
            reconciliation's records) in one transaction, then counts and checksums every table on both sides. \
            Prints one JSON object with each table's rows and checksums; exits 0 only when all of them match, 1 \
            otherwise (the target then holds the copy for inspection: drop and recreate the database before trying \
            again). The target database must exist and hold no ledger rows; its schema is created as the order \
            service creates it. Then point \(Setting.databaseURL.variable) at it and start the order services.
            """)

    @Option(name: .long, help: "The SQLite file of the order store to copy.")
    var from: String

    @Option(name: .long, help: "The PostgreSQL database to copy into: postgres://USER:PASSWORD@HOST:PORT/DB.")
    var to: String

    @Option(name: .long, help: ArgumentHelp(Setting.databasePasswordFile.help))
    var databasePasswordFile: String?

    func run() async throws {
        guard FileManager.default.fileExists(atPath: from) else {
            throw ValidationError("--from: no SQLite file at \(from)")
        }
        let target: PostgresLocation
        do {
            target = try PostgresLocation(
                url: to, passwordFile: SettingReader().optionalString(databasePasswordFile, .databasePasswordFile))
        } catch {
            throw ValidationError("--to: \(error.message)")
        }
        let source = try await OrderStore(location: .sqlite(path: from))
        let destination = try await OrderStore(location: .postgres(target))
        let report = try await source.copy(into: destination)
        await destination.close()
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys]
        print(String(decoding: try encoder.encode(report), as: UTF8.self))
        guard report.verified else {
            FileHandle.standardError.write(Data("the copy does not match the source: see the tables whose checksums differ\n".utf8))
            throw ExitCode(1)
        }
        FileHandle.standardError.write(
            Data("copied and verified \(report.tables.reduce(0) { $0 + $1.rows }) rows into \(target)\n".utf8))
    }
}
