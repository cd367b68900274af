import Foundation
import IAPCore
import Logging
import Messaging
import NIOConcurrencyHelpers
@testable import OrderStore
@testable import Store
import Ledger
import Relay
import Testing
import TestSupport

/// Several order services on one PostgreSQL store: each store object here is one service's,
/// with its own connections, all racing for the same rows.
@Suite("Order services sharing one PostgreSQL store", .needsPostgres)
struct SharedStoreTests {
    let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-shared-\(UUID().uuidString)")

    func services(_ count: Int) async throws -> [OrderStore] {
        // Opened at once: the first migrates under the advisory lock, the others wait for it.
        try await withThrowingTaskGroup(of: OrderStore.self) { group in
            for _ in 0..<count { group.addTask { try await TestStore.open(in: folder, on: .postgres) } }
            var stores: [OrderStore] = []
            for try await store in group { stores.append(store) }
            return stores
        }
    }

    /// Transactions of this test's database waiting on an advisory lock.
    static let waitingOnLocks = """
        SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
            AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
        """

    func upload(_ user: String, _ transactionId: String, to store: OrderStore) async throws -> VerifyResult {
        let request = VerifyRequest(submissionId: UUID(), userId: user, receiptData: "AAAA", acceptedAt: Date())
        try await store.accept(request, message: OutboxMessage(routingKey: "q", body: [1]))
        let purchase = VerifiedPurchase(
            transactionId: transactionId, originalTransactionId: transactionId, productId: "com.example.coins.60",
            quantity: 1, purchaseDate: nil, environment: .production)
        return VerifyResult(
            submissionId: request.submissionId, userId: user, orderId: nil, attempt: 1,
            outcome: .verified(VerifiedReceipt(bundleId: "b", environment: .production, purchases: [purchase])))
    }

    @Test func servicesStartingTogetherMigrateOnce() async throws {
        let stores = try await services(4)
        let applied: Int? = try await stores[0].testValue("SELECT COUNT(*) FROM iap_schema_migration")
        #expect(applied == SchemaHistory.postgresMigrations.count)
        for store in stores { await store.close() }
    }

    /// Two services apply results for the same purchases at the same moment (a result
    /// redelivered to the other finisher, two users replaying one transaction): one grant each.
    @Test func twoServicesCreditingTheSamePurchasesCreditEachOnce() async throws {
        let stores = try await services(2)
        let policy = CreditPolicy(catalog: TestCatalog.catalog)
        let count = 150
        try await withThrowingTaskGroup(of: Void.self) { group in
            for index in 0..<count {
                let transactionId = "shared-\(index)"
                // The same upload's result at both services, and another user's replay.
                let mine = try await upload("ana-\(index % 7)", transactionId, to: stores[index % 2])
                let replay = try await upload("eve", transactionId, to: stores[(index + 1) % 2])
                group.addTask { _ = try await stores[0].apply(mine, policy: policy) }
                group.addTask { _ = try await stores[1].apply(mine, policy: policy) }
                group.addTask { _ = try await stores[index % 2].apply(replay, policy: policy) }
            }
            try await group.waitForAll()
        }
        let grants: Int? = try await stores[0].testValue("SELECT COUNT(*) FROM grants WHERE transactionId LIKE 'shared-%'")
        let distinct: Int? = try await stores[0].testValue(
            "SELECT COUNT(DISTINCT transactionId) FROM grants WHERE transactionId LIKE 'shared-%'")
        #expect(grants == count && distinct == count)
        // Whoever won a race owns the purchase, and only they hold its grant.
        let mismatched: Int? = try await stores[1].testValue(
            "SELECT COUNT(*) FROM grants g JOIN purchase p ON p.transactionId = g.transactionId WHERE p.userId <> g.userId")
        #expect(mismatched == 0)
        let settled = try await stores[0].submissionCounts()
        #expect((settled[.credited] ?? 0) >= count, "\(settled)")
        for store in stores { await store.close() }
    }

    /// Writes of the ledger on three services: one holds keys a and b and waits inside its
    /// transaction. A write naming key c, a readiness check and a new order go on meanwhile;
    /// a write naming b, and one naming no keys (any row), wait for the holder's commit, and
    /// then read what it wrote.
    @Test func writesWhoseKeysMeetWaitForEachOtherAndOthersGoOn() async throws {
        let stores = try await services(3)
        let (entered, enter) = AsyncStream.makeStream(of: Void.self)
        let (released, release) = AsyncStream.makeStream(of: Void.self)
        let mark = "INSERT INTO reconciliation_run (task, lastRunAt) VALUES (?, ?)"
        let holder = Task {
            try await stores[0].database.write(keys: ["k:a", "k:b"]) { db in
                try await db.execute(sql: mark, arguments: ["locks-holder", Date()])
                enter.yield()
                for await _ in released { break }
            }
        }
        for await _ in entered { break }

        // Apart: commits while the holder waits (were it kept waiting too, this never ends).
        try await stores[1].database.write(keys: ["k:c"]) { db in
            try await db.execute(sql: mark, arguments: ["locks-apart", Date()])
        }

        // A readiness check and a new order name no rows the holder has: they do not wait either
        // (bounded: 200 looks, 20 s).
        let ready = NIOLockedValueBox<Bool?>(nil)
        let readiness = Task {
            let writable = await stores[1].isWritable()
            let order = try? await stores[1].createOrder(userId: "ana", productId: "com.example.coins.60")
            ready.withLockedValue { $0 = writable && order != nil }
        }
        for _ in 0..<200 where ready.withLockedValue({ $0 }) == nil { try await Task.sleep(for: .milliseconds(100)) }
        #expect(ready.withLockedValue { $0 } == true, "a readiness check or a new order waited for the holder")

        let seen = NIOLockedValueBox([String: Int]())
        func waiter(_ store: OrderStore, keys: Set<String>?, name: String) -> Task<Void, any Error> {
            Task {
                let body: @Sendable (any SQLConnection) async throws -> Void = { db in
                    let held = try await Int.fetchOne(
                        db, sql: "SELECT COUNT(*) FROM reconciliation_run WHERE task = 'locks-holder'") ?? 0
                    seen.withLockedValue { $0[name] = held }
                }
                if let keys { try await store.database.write(keys: keys, body) } else { try await store.database.write(body) }
            }
        }
        let meeting = waiter(stores[1], keys: ["k:b", "k:d"], name: "meeting")
        let everything = waiter(stores[2], keys: nil, name: "everything")
        // Both wait on an advisory lock the holder has (bounded: 200 looks, 20 s).
        var waiting = 0
        for _ in 0..<200 where waiting < 2 {
            try await Task.sleep(for: .milliseconds(100))
            waiting = try await stores[0].testValue(Self.waitingOnLocks) ?? 0
        }
        #expect(waiting == 2)
        #expect(seen.withLockedValue { $0 }.isEmpty)

        release.yield()
        try await holder.value
        await readiness.value
        try await meeting.value
        try await everything.value
        #expect(seen.withLockedValue { $0 } == ["meeting": 1, "everything": 1])
        for store in stores { await store.close() }
    }

    /// Two services see the same submissions fail at the same moment (a result redelivered to
    /// the other finisher): each submission alerts once, from whichever service claims it first.
    @Test func twoServicesAlertingForTheSameSubmissionsAlertOnceEach() async throws {
        let stores = try await services(2)
        var ids: [SubmissionID] = []
        for index in 0..<100 {
            ids.append(try await upload("ana-\(index % 7)", "alert-\(index)", to: stores[index % 2]).submissionId)
        }
        let claims = try await withThrowingTaskGroup(of: Bool.self) { group in
            for id in ids {
                group.addTask { try await stores[0].claimAlert(for: id) }
                group.addTask { try await stores[1].claimAlert(for: id) }
            }
            return try await group.reduce(into: 0) { count, claimed in count += claimed ? 1 : 0 }
        }
        #expect(claims == ids.count)
        let alerted: Int? = try await stores[0].testValue("SELECT COUNT(*) FROM submission WHERE alertedAt IS NOT NULL")
        #expect(alerted == ids.count)
        for store in stores { await store.close() }
    }

    /// A write the store refuses (a grant by hand for a purchase it does not know) leaves no
    /// transaction open: the service's next write sees what another service committed since.
    @Test func aRefusedWriteLeavesNoTransactionOpen() async throws {
        let stores = try await services(2)
        let policy = CreditPolicy(catalog: TestCatalog.catalog)
        await #expect(throws: OrderStoreError.self) {
            try await stores[0].grantManually(
                userId: "ana", productId: "com.example.coins.60", quantity: 1, grant: [:], transactionId: "nowhere",
                actor: "cs", reason: "test", policy: policy)
        }
        let result = try await upload("ana", "after-refusal", to: stores[1])
        #expect(try await stores[0].apply(result, policy: policy) == .credited)
        let grants: Int? = try await stores[1].testValue("SELECT COUNT(*) FROM grants WHERE transactionId = 'after-refusal'")
        #expect(grants == 1)
        for store in stores { await store.close() }
    }

    /// A transaction the server fails with a serialization failure (40001) or a deadlock
    /// (40P01) runs again from the start, and what it writes is committed once; so does a
    /// group commit whose unit met one inside its savepoint.
    @Test(arguments: ["serialization_failure", "deadlock_detected"])
    func conflictsAreRunAgainAndCommittedOnce(_ condition: String) async throws {
        let stores = try await services(1)
        let store = stores[0]
        let attempts = NIOLockedValueBox(0)
        let raise = "DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '\(condition)'; END $$"
        let key = "conflict-\(condition)"
        try await store.database.write { db in
            let attempt = attempts.withLockedValue { count in
                count += 1
                return count
            }
            try await db.execute(sql: "INSERT INTO reconciliation_run (task, lastRunAt) VALUES (?, ?)", arguments: [key, Date()])
            if attempt == 1 { try await db.execute(sql: raise) }
        }
        #expect(attempts.withLockedValue { $0 } == 2)
        let rows: Int? = try await store.testValue("SELECT COUNT(*) FROM reconciliation_run WHERE task = ?", [key])
        #expect(rows == 1)

        attempts.withLockedValue { $0 = 0 }
        try await store.groupCommit.write { db in
            let attempt = attempts.withLockedValue { count in
                count += 1
                return count
            }
            try await db.execute(sql: "INSERT INTO reconciliation_run (task, lastRunAt) VALUES (?, ?)", arguments: [key + "-unit", Date()])
            if attempt == 1 { try await db.execute(sql: raise) }
        }
        #expect(attempts.withLockedValue { $0 } == 2)
        let unitRows: Int? = try await store.testValue("SELECT COUNT(*) FROM reconciliation_run WHERE task = ?", [key + "-unit"])
        #expect(unitRows == 1)
        await store.close()
    }

    /// Two relays publish one outbox at once: every message once, events in commit order.
    @Test func twoRelaysPublishEachMessageOnceAndEventsInOrder() async throws {
        let stores = try await services(2)
        let count = 120
        for index in 0..<count {
            _ = try await upload("u\(index)", "relay-\(index)", to: stores[index % 2])
            if index.isMultiple(of: 3) {
                try await stores[index % 2].groupCommit.write { db in
                    var event = OutboxMessage(exchange: "events", routingKey: "grant.created", body: Array("\(index)".utf8))
                    event.mandatory = false
                    try await OrderStore.insert(event, now: Date(), in: db)
                }
            }
        }
        let published = NIOLockedValueBox([Int64]())
        let events = NIOLockedValueBox([Int64]())
        try await withThrowingTaskGroup(of: Void.self) { group in
            for (index, store) in stores.enumerated() {
                group.addTask {
                    while true {
                        let batch = try await store.claimUnpublished(limit: 7, relay: "relay-\(index)")
                        if batch.isEmpty { return }
                        for message in batch {
                            published.withLockedValue { $0.append(message.id!) }
                            if !message.mandatory { events.withLockedValue { $0.append(message.id!) } }
                        }
                        try await store.markPublished(batch.compactMap(\.id))
                    }
                }
            }
            try await group.waitForAll()
        }
        let ids = published.withLockedValue { $0 }
        #expect(ids.count == count + count / 3, "every message once: \(ids.count)")
        #expect(Set(ids).count == ids.count, "no message twice")
        let eventOrder = events.withLockedValue { $0 }
        #expect(eventOrder == eventOrder.sorted(), "events leave in commit order")
        #expect(try await stores[0].outboxBacklog() == 0)
        for store in stores { await store.close() }
    }

    /// Writes `events` events and `work` work messages into the outbox of `store`.
    func fillOutbox(_ store: OrderStore, events: Int, work: Int) async throws {
        try await store.groupCommit.write { db in
            for index in 0..<max(events, work) {
                if index < work {
                    try await OrderStore.insert(OutboxMessage(routingKey: "verify", body: Array("w\(index)".utf8)), now: Date(), in: db)
                }
                if index < events {
                    var event = OutboxMessage(exchange: "events", routingKey: "grant.created", body: Array("e\(index)".utf8))
                    event.mandatory = false
                    try await OrderStore.insert(event, now: Date(), in: db)
                }
            }
        }
    }

    /// A relay whose publish waits for the broker longer than a lease keeps its claims: the
    /// other relay takes none of its rows meanwhile, and every message leaves once, events in
    /// commit order, each deleted only after its publish returned (the broker confirmed it).
    @Test func aRelayWaitingForTheBrokerKeepsItsClaims() async throws {
        let stores = try await services(2)
        try await fillOutbox(stores[0], events: 10, work: 5)
        let logger = Logger(label: "iap.tests.relay")
        let released = NIOLockedValueBox(false)
        let waiting = NIOLockedValueBox(false)
        let first = NIOLockedValueBox([String]())
        let second = NIOLockedValueBox([String]())
        let lease = Duration.seconds(2)
        let slow = OutboxRelay(store: stores[0], publisher: Publishing { message in
            // The broker holds the first relay's events (a confirm that does not come).
            while !message.mandatory && !released.withLockedValue({ $0 }) {
                waiting.withLockedValue { $0 = true }
                try await Task.sleep(for: .milliseconds(20))
            }
            first.withLockedValue { $0.append(String(decoding: message.body, as: UTF8.self)) }
        }, lease: lease, logger: logger)
        let other = OutboxRelay(store: stores[1], publisher: Publishing { message in
            second.withLockedValue { $0.append(String(decoding: message.body, as: UTF8.self)) }
        }, lease: lease, logger: logger)
        let slowBatch = Task { await slow.relayBatch() }
        // From the moment the slow relay holds its claims and waits for the broker (on a loaded
        // machine its claim can take a while), three leases and a half.
        #expect(try await eventually(timeout: .seconds(30), interval: .milliseconds(20)) { waiting.withLockedValue { $0 } })
        try await Task.sleep(for: lease * 3.5)
        #expect(await other.relayBatch() == 0, "three leases later the rows are still claimed")
        #expect(try await stores[1].outboxBacklog() == 15, "nothing is deleted before its publish returns")
        released.withLockedValue { $0 = true }
        #expect(await slowBatch.value == 15)
        #expect(await other.relayBatch() == 0)
        #expect(second.withLockedValue { $0 }.isEmpty, "\(second.withLockedValue { $0 })")
        let sent = first.withLockedValue { $0 }
        #expect(sent.filter { $0.hasPrefix("e") } == (0..<10).map { "e\($0)" }, "\(sent)")
        #expect(Set(sent.filter { $0.hasPrefix("w") }) == Set((0..<5).map { "w\($0)" }))
        #expect(try await stores[0].outboxBacklog() == 0)
        for store in stores { await store.close() }
    }

    /// A relay whose publishes fail keeps every row (counted as attempts) for the next round,
    /// which another relay then publishes.
    @Test func failedPublishesStayInTheOutbox() async throws {
        let stores = try await services(2)
        try await fillOutbox(stores[0], events: 3, work: 4)
        let logger = Logger(label: "iap.tests.relay")
        struct BrokerAway: Error {}
        let failing = OutboxRelay(store: stores[0], publisher: Publishing { _ in throw BrokerAway() }, logger: logger)
        #expect(await failing.relayBatch() == 0)
        #expect(try await stores[0].outboxBacklog() == 7)
        let attempts: Int? = try await stores[0].testValue("SELECT SUM(attempts) FROM outbox")
        // Every work message was tried; the events stopped at the first failure, keeping their order.
        #expect(attempts == 5, "\(String(describing: attempts))")
        let sent = NIOLockedValueBox([String]())
        let working = OutboxRelay(store: stores[1], publisher: Publishing { message in
            sent.withLockedValue { $0.append(String(decoding: message.body, as: UTF8.self)) }
        }, logger: logger)
        #expect(await working.relayBatch() == 7)
        #expect(sent.withLockedValue { $0 }.filter { $0.hasPrefix("e") } == ["e0", "e1", "e2"])
        #expect(try await stores[0].outboxBacklog() == 0)
        for store in stores { await store.close() }
    }

    /// A relay that died holding claims: another takes its rows once the claims lapse.
    @Test func claimsOfADeadRelayLapse() async throws {
        let stores = try await services(2)
        _ = try await upload("u1", "lapse-1", to: stores[0])
        let now = Date()
        let taken = try await stores[0].claimUnpublished(limit: 10, relay: "dead", lease: 30, now: now)
        #expect(taken.count == 1)
        #expect(try await stores[1].claimUnpublished(limit: 10, relay: "alive", now: now.addingTimeInterval(5)).isEmpty)
        let later = try await stores[1].claimUnpublished(limit: 10, relay: "alive", now: now.addingTimeInterval(31))
        #expect(later.map(\.id) == taken.map(\.id))
        for store in stores { await store.close() }
    }

    /// While one order service sweeps (holding the ledger's lock alone, and the sweeper's), a
    /// sweep of another one waits for it, then finds what the first left and requeues it once.
    @Test func oneSweeperAtATime() async throws {
        let stores = try await services(2)
        let request = VerifyRequest(submissionId: UUID(), userId: "ana", receiptData: "AAAA", acceptedAt: Date())
        try await stores[0].accept(request, message: OutboxMessage(routingKey: "q", body: [1]))
        // Its queue message was lost (published, then purged with a broker): only a sweep finds it.
        _ = try await stores[0].testRows("DELETE FROM outbox")
        let later = Date().addingTimeInterval(3600)
        func sweep(_ store: OrderStore) async throws -> Int {
            try await store.requeueStuck(pendingBefore: later, retryDueBefore: later, limit: 10, now: later) { request in
                OutboxMessage(routingKey: "q", body: Array(request.submissionId.uuidString.utf8))
            }.count
        }
        let (entered, enter) = AsyncStream.makeStream(of: Void.self)
        let (released, release) = AsyncStream.makeStream(of: Void.self)
        // Never leave the writer holding, whatever fails below.
        defer { release.yield() }
        let leader = Task {
            try await stores[0].database.write { db in
                let took = try await db.takeExclusive("sweeper")
                enter.yield()
                for await _ in released { break }
                return took
            }
        }
        for await _ in entered { break }
        let second = Task { try await sweep(stores[1]) }
        // The second sweep waits on the ledger's lock (bounded: 200 looks, 20 s).
        var waiting = 0
        for _ in 0..<200 where waiting < 1 {
            try await Task.sleep(for: .milliseconds(100))
            waiting = try await stores[0].testValue(Self.waitingOnLocks) ?? 0
        }
        #expect(waiting == 1, "a second sweeper ran while the first held the lock")
        release.yield()
        #expect(try await leader.value)
        #expect(try await second.value == 1)
        #expect(try await sweep(stores[0]) == 0)
        let queued: Int? = try await stores[0].testValue("SELECT COUNT(*) FROM outbox")
        #expect(queued == 1)
        for store in stores { await store.close() }
    }

    @Test func oneServiceAtATimeHoldsALease() async throws {
        let stores = try await services(2)
        let now = Date()
        #expect(try await stores[0].takeLease("reconciliation", until: now.addingTimeInterval(60), now: now))
        #expect(try await !stores[1].takeLease("reconciliation", until: now.addingTimeInterval(70), now: now.addingTimeInterval(10)))
        #expect(try await stores[1].takeLease("reconciliation", until: now.addingTimeInterval(130), now: now.addingTimeInterval(61)))
        for store in stores { await store.close() }
    }
}
