import Foundation
import IAPCore
import NIOConcurrencyHelpers
@testable import OrderStore
@testable import Store
import Ledger
import Testing
import TestSupport

/// The order store's group commit: writes that arrive together share one commit, and each
/// caller still hears only about its own unit of work, after it is durable.
@Suite("Group commit")
struct GroupCommitTests {
    func makeStore(_ backend: Backend) async throws -> (OrderStore, String) {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-group-\(UUID().uuidString)")
        let path = folder.appendingPathComponent("orders.sqlite").path
        return await (try TestStore.open(in: folder, on: backend), path)
    }

    func request(_ id: UUID = UUID()) -> VerifyRequest {
        VerifyRequest(submissionId: id, userId: "u", receiptData: "AAAA", acceptedAt: Date())
    }

    /// 400 uploads at once, 40 of them reusing an id already stored: exactly those 40 fail,
    /// the other 360 are stored with their messages, in far fewer commits than uploads.
    @Test(arguments: TestStore.backends) func concurrentUploadsShareCommitsAndFailAlone(_ backend: Backend) async throws {
        let (store, path) = try await makeStore(backend)
        let taken = (0..<40).map { _ in UUID() }
        for id in taken { try await store.accept(request(id), message: nil) }
        let before = store.acceptCommit.batches

        let outcomes = await withTaskGroup(of: (UUID, OrderStoreError.Code?).self) { group in
            for index in 0..<400 {
                let id = index % 10 == 0 ? taken[index / 10] : UUID()
                group.addTask {
                    do {
                        try await store.accept(self.request(id), message: OutboxMessage(routingKey: "q", body: [1]))
                        return (id, nil)
                    } catch let error as OrderStoreError {
                        return (id, error.code)
                    } catch {
                        return (id, .unavailable)
                    }
                }
            }
            var all: [(UUID, OrderStoreError.Code?)] = []
            for await outcome in group { all.append(outcome) }
            return all
        }
        let failed = outcomes.filter { $0.1 != nil }
        #expect(failed.count == 40 && failed.allSatisfy { $0.1 == .duplicateSubmission && taken.contains($0.0) })
        let batches = store.acceptCommit.batches - before
        #expect(batches >= 1 && batches < 200, "400 uploads took \(batches) commits")

        // Read back through a connection of its own: what the callers heard is what is on disk.
        let reopened = try await TestStore.open(in: URL(fileURLWithPath: path).deletingLastPathComponent(), on: backend)
        let stored: (Int?, Int?) = (
            try await reopened.testValue("SELECT COUNT(*) FROM submission"), try await reopened.testValue("SELECT COUNT(*) FROM outbox")
        )
        #expect(stored.0 == 40 + 360 && stored.1 == 360)
    }

    /// A commit that fails fails everyone in it: no caller hears "stored" for a write that is
    /// not on disk. (A deferred foreign key makes the shared COMMIT itself fail.)
    @Test(arguments: TestStore.backends) func failedCommitFailsEveryWriteOfTheBatchAndStoresNone(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        if store.dialect == .postgres {
            // PostgreSQL's foreign keys here are not deferrable: a deferred constraint trigger
            // that refuses every row of a table of the test's own fails the COMMIT instead.
            _ = try await store.testRows("CREATE TABLE fails_at_commit (x BIGINT)")
            _ = try await store.testRows(
                """
                CREATE FUNCTION refuse_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN RAISE EXCEPTION 'refused at commit'; END; $$
                """)
            _ = try await store.testRows(
                """
                CREATE CONSTRAINT TRIGGER refuse AFTER INSERT ON fails_at_commit DEFERRABLE INITIALLY DEFERRED
                    FOR EACH ROW EXECUTE FUNCTION refuse_at_commit()
                """)
        }
        // Holds the writer, so that the next two writes wait and share the following commit.
        let writer = try await HeldWriter(store.acceptCommit)
        let good = request()
        async let first: Void = store.accept(good, message: nil)
        try await writer.waitUntilQueued(1)
        async let second: Void = store.acceptCommit.write { db in
            if db.dialect == .postgres {
                try await db.execute(sql: "INSERT INTO fails_at_commit (x) VALUES (1)")
                return
            }
            try await db.execute(sql: "PRAGMA defer_foreign_keys = ON")
            try await db.execute(
                sql: """
                    INSERT INTO submission_transaction (submissionId, transactionId, originalTransactionId, productId,
                        environment, state) VALUES ('nobody', '1', '1', 'p', 'Production', 'credited')
                    """)
        }
        try await writer.waitUntilQueued(2)
        try await writer.release()
        let firstFailed = await (try? first) == nil
        let secondFailed = await (try? second) == nil
        #expect(firstFailed && secondFailed)
        #expect(try await store.status(of: good.submissionId) == nil)
        // The store goes on: the next upload is stored.
        let next = request()
        try await store.accept(next, message: nil)
        #expect(try await store.status(of: next.submissionId) != nil)
    }

    /// A write whose error rolls back the whole transaction (SQLite does so for a full disk or
    /// an I/O error; an explicit ROLLBACK stands in for it) ends the batch there: every caller
    /// of the batch hears the failure, and nothing of it is on disk, neither the writes the
    /// rollback undid nor the ones queued after it.
    @Test(arguments: TestStore.backends) func aRollbackInsideTheBatchFailsTheWholeBatch(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let writer = try await HeldWriter(store.acceptCommit)
        let before = request()
        let after = request()
        async let first: Void = store.accept(before, message: nil)
        try await writer.waitUntilQueued(1)
        async let rollback: Void = store.acceptCommit.write { db in try await db.execute(sql: "ROLLBACK") }
        try await writer.waitUntilQueued(2)
        async let last: Void = store.accept(after, message: nil)
        try await writer.waitUntilQueued(3)
        try await writer.release()
        let firstStored = await (try? first) != nil
        let lastStored = await (try? last) != nil
        _ = await (try? rollback)
        let beforeOnDisk = try await store.status(of: before.submissionId) != nil
        let afterOnDisk = try await store.status(of: after.submissionId) != nil
        // What each caller heard is what is on disk, and this batch stored nothing.
        #expect(firstStored == beforeOnDisk && lastStored == afterOnDisk)
        #expect(!beforeOnDisk && !afterOnDisk)
    }
}

extension GroupCommitTests {
    /// Uploads are committed apart from results: a batch of results that fails (on PostgreSQL,
    /// results of two order services conflict and a batch is rolled back) takes no upload
    /// with it. An upload that arrives while a batch of results is being written waits for the
    /// writer, then commits in a batch of uploads.
    @Test(arguments: TestStore.backends) func aFailedBatchOfResultsTakesNoUploadWithIt(_ backend: Backend) async throws {
        let (store, _) = try await makeStore(backend)
        let writer = try await HeldWriter(store.groupCommit)
        let upload = request()
        let uploadsBefore = store.acceptCommit.batches
        async let accepted: Void = store.accept(upload, message: OutboxMessage(routingKey: "q", body: [1]))
        async let failing: Void = store.groupCommit.write { db in try await db.execute(sql: "ROLLBACK") }
        // Both wait for the writer: the failing write in the results' next batch, the upload in
        // a batch of uploads (were uploads committed with results, it would wait beside the
        // failing write, counted among the results' waiting writes).
        let deadline = ContinuousClock.now + HeldWriter.limit
        while store.groupCommit.waiting + (store.acceptCommit.batches - uploadsBefore) < 2 {
            guard ContinuousClock.now < deadline else {
                try await writer.release()
                throw HeldWriterTimeout(what: "the upload and the failing write never queued")
            }
            try await Task.sleep(for: .milliseconds(2))
        }
        try await writer.release()
        let uploadStored = await (try? accepted) != nil
        let resultsFailed = await (try? failing) == nil
        #expect(uploadStored && resultsFailed)
        #expect(try await store.status(of: upload.submissionId)?.state == .pending)
    }
}

extension GroupCommitTests {
    /// A batch's units as rounds: apart keys together, meeting keys later and in order, a unit
    /// without keys alone with nothing after it going first.
    @Test func roundsKeepUnitsThatMeetApartAndInOrder() {
        // No keys at all (8) meets nothing.
        let keys: [Set<String>?] = [["a"], ["b"], ["a"], ["c"], nil, ["d"], ["c", "e"], ["e"], []]
        #expect(GroupCommit.rounds(keys) == [[0, 1, 3], [2], [4], [5, 6, 8], [7]])
        #expect(GroupCommit.rounds([["a"], ["b", "a"], ["b"], ["c"]]) == [[0, 3], [1], [2]])
        #expect(GroupCommit.rounds([]) == [])
    }

    /// A batch takes the units waiting until their keys together would pass the bound (always
    /// one at least; a unit without keys counts none) and locks the union of their keys, or
    /// the whole ledger when one of them names none.
    @Test func aBatchLocksItsUnitsKeysAndNoMoreThanTheBound() {
        #expect(GroupCommit.batchSize([["a", "b"], ["b", "c"], ["d"], ["e"]], maxKeys: 3) == 2)
        #expect(GroupCommit.batchSize([["a", "b", "c", "d"], ["e"]], maxKeys: 3) == 1)
        #expect(GroupCommit.batchSize([["a"], nil, ["a"], ["b"]], maxKeys: 2) == 4)
        #expect(GroupCommit.batchSize([], maxKeys: 2) == 0)
        #expect(GroupCommit.keys(of: [["a"], ["b", "a"]]) == ["a", "b"])
        #expect(GroupCommit.keys(of: [["a"], nil]) == nil)

        // Every service takes the locks in one order: the ledger's first (shared), then the
        // keys' by number, each once.
        let statement = PostgresDatabase.ledgerLocks(["order:o1", "transaction:7", "order:o1", "chain:7"])
        let numbers = ["order:o1", "transaction:7", "chain:7"].map(PostgresDatabase.lockNumber).sorted()
        #expect(statement.contains("pg_advisory_xact_lock_shared(\(PostgresDatabase.ledgerLock))"))
        #expect(statement.contains("'{\(numbers.map(String.init).joined(separator: ","))}'::int8[]"))
        #expect(PostgresDatabase.ledgerLocks(nil) == "SELECT pg_advisory_xact_lock(\(PostgresDatabase.ledgerLock))")
        // A key's number is the same in every service and version (FNV-1a, 64 bits).
        #expect(PostgresDatabase.lockNumber("") == Int64(bitPattern: 0xcbf2_9ce4_8422_2325))
        #expect(PostgresDatabase.lockNumber("a") == Int64(bitPattern: 0xaf63_dc4c_8601_ec8c))
    }

    /// On PostgreSQL a batch's keyed units go side by side: every unit's read in one round trip,
    /// every unit's writes in one more (two for all sixteen counters here, where one after the
    /// other they take two each). A unit whose key another one before it names waits for a later
    /// round and sees what that one wrote; a unit that reads twice runs again alone; a unit whose
    /// write fails is undone alone. On SQLite the same units run one after the other, to the
    /// same values.
    @Test(arguments: TestStore.backends) func keyedUnitsGoSideBySideAndThoseThatMeetKeepTheirOrder(_ backend: Backend) async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-group-\(UUID().uuidString)")
        let sent = NIOLockedValueBox([String]())
        let store = try await TestStore.open(in: folder, on: backend) { sql in sent.withLockedValue { $0.append(sql) } }
        try await store.database.write { db in
            try await db.execute(sql: "CREATE TABLE counter (k TEXT PRIMARY KEY, n INTEGER NOT NULL)")
        }
        let groupCommit = store.groupCommit
        // Adds one to counter `key`: read first, written at the unit's end.
        @Sendable func increment(_ key: String, readingTwice: Bool = false) async throws -> Int {
            try await groupCommit.write(keys: [key]) { db in
                let query = SQLStatement("SELECT n FROM counter WHERE k = ?", [key])
                var value: Int = try await db.readBatch([query])[0].first?["n"] ?? 0
                if readingTwice { value = try await db.readBatch([query])[0].first?["n"] ?? 0 }
                try await db.executeLater([
                    SQLStatement(
                        "INSERT INTO counter (k, n) VALUES (?, ?) ON CONFLICT (k) DO UPDATE SET n = excluded.n", [key, value + 1])
                ])
                return value + 1
            }
        }
        let held = try await HeldWriter(groupCommit)
        var units: [(key: String, task: Task<Int, any Error>)] = []
        func queue(_ key: String, _ task: Task<Int, any Error>) async throws {
            units.append((key, task))
            try await held.waitUntilQueued(units.count)
        }
        for index in 0..<16 { try await queue("k\(index)", Task { try await increment("k\(index)") }) }
        try await queue("k0", Task { try await increment("k0") })
        try await queue("twice", Task { try await increment("twice", readingTwice: true) })
        try await queue(
            "missing",
            Task {
                try await groupCommit.write(keys: ["missing"]) { db in
                    try await db.executeLater([
                        SQLStatement(
                            "UPDATE counter SET n = 1 WHERE k = 'missing'", requiresChange: SQLError(.other, "no such counter"))
                    ])
                    return 0
                }
            })
        let before = sent.withLockedValue { $0.count }
        let (togetherBefore, aloneBefore) = groupCommit.sideBySideUnits
        try await held.release()
        var values: [String: [Int]] = [:]
        for unit in units.dropLast() { values[unit.key, default: []].append(try await unit.task.value) }
        await #expect(throws: SQLError.self) { try await units.last!.task.value }
        let roundTrips = sent.withLockedValue { $0[before...].filter { !$0.hasPrefix(SQLTrace.inBatch) } }

        #expect(values["k0"] == [1, 2], "the unit that met k0's first did not see its write")
        #expect((1..<16).allSatisfy { values["k\($0)"] == [1] })
        #expect(values["twice"] == [1])
        let stored: Int? = try await store.testValue("SELECT SUM(n) FROM counter")
        #expect(stored == 2 + 15 + 1)
        #expect(try await store.testValue("SELECT COUNT(*) FROM counter WHERE k = 'missing'") == 0)

        let (together, alone) = groupCommit.sideBySideUnits
        if backend == .postgres {
            // The 16 counters, the unit reading twice and the failing one in one round; k0's
            // second unit in a round of its own.
            #expect(together - togetherBefore == 18 && alone - aloneBefore == 1)
            // The holder's COMMIT; BEGIN, the ledger's locks, the round's read and its write; the
            // unit reading twice alone (two reads, one write); k0's second unit (one read, one
            // write); COMMIT.
            #expect(roundTrips.count == 11, "\(roundTrips.count) round trips: \(roundTrips.joined(separator: "\n"))")
        } else {
            #expect(together == 0 && alone == 0)
        }
    }
}

/// Keeps the group commit's writer busy until released, so that the writes queued meanwhile
/// are known to share the next batch, in the order they were queued.
private struct HeldWriter {
    /// A bound against a hang, not a measure: at the start of a run, with some fifty suites
    /// starting on two cores, 10 s was not always enough for the holder to reach the writer.
    static let limit: Duration = .seconds(60)

    let groupCommit: GroupCommit
    let released = NIOLockedValueBox(false)
    /// Set once the holder's body runs: its transaction has begun and taken its lock, so none of
    /// the holder's statements is still to be sent when a test starts counting.
    let running = NIOLockedValueBox(false)
    let holder: Task<Void, any Error>

    init(_ groupCommit: GroupCommit) async throws {
        self.groupCommit = groupCommit
        let released = released
        let running = running
        // Waits without blocking a thread: on PostgreSQL the body runs on an event loop the
        // store shares with every other transaction in the process.
        holder = Task {
            try await groupCommit.write { _ in
                running.withLockedValue { $0 = true }
                let deadline = ContinuousClock.now + Self.limit
                while !released.withLockedValue({ $0 }), ContinuousClock.now < deadline {
                    try await Task.sleep(for: .milliseconds(2))
                }
            }
        }
        // A batch that has begun may not have sent its BEGIN and lock yet: wait for the body.
        let deadline = ContinuousClock.now + Self.limit
        while !running.withLockedValue({ $0 }) || groupCommit.waiting > 0 {
            guard ContinuousClock.now < deadline else { throw HeldWriterTimeout(what: "the holder never began") }
            try await Task.sleep(for: .milliseconds(2))
        }
    }

    /// Returns once `count` writes wait for the next batch.
    func waitUntilQueued(_ count: Int) async throws {
        let deadline = ContinuousClock.now + Self.limit
        while groupCommit.waiting < count {
            guard ContinuousClock.now < deadline else { throw HeldWriterTimeout(what: "\(count) writes never queued") }
            try await Task.sleep(for: .milliseconds(2))
        }
    }

    func release() async throws {
        released.withLockedValue { $0 = true }
        try await holder.value
    }
}

private struct HeldWriterTimeout: Error {
    var what: String
}
