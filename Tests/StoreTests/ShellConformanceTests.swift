import Foundation
import IAPCore
import Ledger
@testable import LedgerTestSupport
import Testing
import TestSupport
@testable import OrderStore
@testable import Store

/// The ledger's shell three times over: the tables in memory the model checker runs its
/// sequences through (`MemoryLedger`), and the order store's own shell on SQLite and on
/// PostgreSQL (`OrderStore.facts(for:event:in:)` and `OrderStore.write(_:policy:now:in:)`).
/// A few hundred of the checker's sequences run in memory with a journal; each is replayed on a
/// fresh store of each backend, and at every step the facts the store's queries read must be
/// the facts the memory shell handed the core. The checker's 100,000 sequences a run stand for
/// the store only as far as this holds.
@Suite("The ledger's shell: memory, SQLite and PostgreSQL read the same facts", .timeLimit(.minutes(5)))
struct ShellConformanceTests {
    /// How many sequences: 200 on SQLite (a quarter under `transfer`, half with the steps only
    /// the ground-truth run takes), 40 of them on PostgreSQL, where each statement is a round
    /// trip and each sequence a fresh schema. They run beside the whole suite, within the
    /// suite's time bound, so the count is kept modest.
    static func sequences(on backend: Backend) -> Int { backend == .postgres ? 40 : 200 }

    /// The journal of one checker sequence, run in memory.
    static func journal(index: Int) -> (seed: UInt64, restore: RestorePolicy, truth: Bool, entries: [MemoryLedger.JournalEntry]) {
        let restore: RestorePolicy = index % 4 == 3 ? .transfer : .keep
        let truth = index % 2 == 0
        let seed = ModelRandom.sequenceSeed(base: 0x5_4E11_C0F0_2026, policy: restore, index: index)
        var run = CheckerRun(restore: restore, truth: truth)
        run.ledger.journal = []
        // A sequence the checker finds wrong still journals what the shell did up to there.
        try? run.run(CheckerStep.sequence(seed: seed, count: LedgerChecker.length, truth: truth))
        return (seed, restore, truth, run.ledger.journal ?? [])
    }

    /// The submissions a step's purchases and notifications belong to (the store keeps each
    /// purchase's submission, as the intake accepted it before the ledger saw it).
    static func submission(of event: LedgerEvent) -> (id: String, userId: String)? {
        switch event {
        case .upload(_, let upload): (upload.submissionId, upload.userId)
        case .notification(_, let submissionId): (submissionId, "apple")
        case .manualGrant, .manualRevoke, .bind, .naming: nil
        }
    }

    /// Replays `entries` on `store`; the first step whose facts differ, described.
    static func replay(_ entries: [MemoryLedger.JournalEntry], restore: RestorePolicy, on store: OrderStore) async throws -> String? {
        let policy = CreditPolicy(catalog: CheckerCatalog.catalog, eventsExchange: "iap.events", sandbox: .accept, restore: restore)
        var known: Set<String> = []
        for (number, entry) in entries.enumerated() {
            switch entry {
            case .order(let order):
                _ = try await store.testRows(
                    "INSERT INTO orders (id, userId, productId, state, createdAt, updatedAt) VALUES (?, ?, ?, 'created', ?, ?)",
                    [order.id, order.userId, order.productId, order.createdAt, order.createdAt])
            case .step(let event, let query, let expected, let plan, let now):
                if let (id, user) = submission(of: event), known.insert(id).inserted {
                    _ = try await store.testRows(
                        """
                        INSERT INTO submission (id, userId, receiptData, state, attempts, finishable, acceptedAt, updatedAt)
                        VALUES (?, ?, '', 'pending', 1, 0, ?, ?)
                        """, [id, user, now, now])
                }
                let read = try await store.database.write { db in
                    let facts = try await OrderStore.facts(for: query, event: event, in: db)
                    // Written as the memory shell wrote it: the plan of the facts it read.
                    for change in plan.changes { try await OrderStore.write(change, policy: policy, now: now, in: db) }
                    return facts
                }
                if read != expected {
                    let (store, memory) = (fields(of: read), fields(of: expected))
                    let paths = Set(store.keys).union(memory.keys).filter { store[$0] != memory[$0] }.sorted()
                    return "step \(number) (\(CheckerRun.describe(event))): "
                        + paths.map { "\($0): store \(store[$0] ?? "none"), memory \(memory[$0] ?? "none")" }.joined(separator: "; ")
                }
            }
        }
        return nil
    }

    /// Every leaf of `value` by its path (`grants[1].revokedAt`), for saying what differs.
    static func fields(of value: Any, path: String = "") -> [String: String] {
        let mirror = Mirror(reflecting: value)
        if mirror.displayStyle == .optional {
            guard let inner = mirror.children.first else { return [path: "nil"] }
            return fields(of: inner.value, path: path)
        }
        if mirror.children.isEmpty || mirror.displayStyle == .enum { return [path: "\(value)"] }
        var found: [String: String] = [:]
        for (offset, child) in mirror.children.enumerated() {
            let name = mirror.displayStyle == .collection ? "\(path)[\(offset)]" : (path.isEmpty ? "" : path + ".") + (child.label ?? "\(offset)")
            found.merge(fields(of: child.value, path: name)) { first, _ in first }
        }
        return found
    }

    @Test(arguments: TestStore.backends) func theStoreReadsTheFactsTheMemoryShellReadsAtEveryStep(_ backend: Backend) async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("shell-conformance-\(UUID().uuidString)")
        defer { try? FileManager.default.removeItem(at: folder) }
        var steps = 0
        var differing: [String] = []
        for index in 0..<Self.sequences(on: backend) {
            let (seed, restore, truth, entries) = Self.journal(index: index)
            steps += entries.count
            let store = try await TestStore.open(in: folder, name: "sequence-\(index)", on: backend)
            let difference: String?
            do {
                difference = try await Self.replay(entries, restore: restore, on: store)
            } catch {
                difference = "the store refused a step: \(error)"
            }
            await store.close()
            if let difference {
                differing.append("sequence \(ModelRandom.hex(seed)) (\(restore.rawValue)\(truth ? ", ground truth" : "")): \(difference)")
            }
            if differing.count >= 3 { break }
        }
        // The replay compared something: the sequences hold steps of every kind.
        #expect(steps > Self.sequences(on: backend) * 5, "\(steps) steps in \(Self.sequences(on: backend)) sequences")
        #expect(differing.isEmpty, "\(differing.count) sequences read other facts from the store:\n\(differing.joined(separator: "\n"))")
    }
}
