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

/// The store announces its own outbox rows, and the relay publishes on the announcement: no
/// writer has to remember to wake it.
@Suite("Outbox relay")
struct RelayTests {
    func makeStore(_ backend: Backend) async throws -> OrderStore {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-relay-\(UUID().uuidString)")
        return try await TestStore.open(in: folder, on: backend)
    }

    func request(_ user: String) -> VerifyRequest {
        VerifyRequest(submissionId: UUID(), userId: user, receiptData: "AAAA", acceptedAt: Date())
    }

    func verified(_ request: VerifyRequest, transaction: String) -> VerifyResult {
        let purchase = VerifiedPurchase(
            transactionId: transaction, originalTransactionId: transaction, productId: "p", quantity: 1, purchaseDate: nil,
            environment: .production)
        return VerifyResult(
            submissionId: request.submissionId, userId: request.userId, orderId: nil, attempt: 1,
            outcome: .verified(VerifiedReceipt(bundleId: "b", environment: .production, purchases: [purchase])))
    }

    /// Each commit that queued a message is announced once; a commit that queued none, or a
    /// write that failed, is not.
    @Test(arguments: TestStore.backends) func theStoreAnnouncesEachCommitThatQueuedMessages(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        let signal = store.outboxSignal
        let start = signal.commits

        let upload = request("ana")
        try await store.accept(upload, message: OutboxMessage(routingKey: "verify", body: [1]))
        #expect(signal.commits == start + 1, "an accepted upload queued its verify request")

        await #expect(throws: OrderStoreError.self) {
            try await store.accept(upload, message: OutboxMessage(routingKey: "verify", body: [1]))
        }
        #expect(signal.commits == start + 1, "a refused upload queued nothing")

        try await store.accept(request("ben"), message: nil)
        #expect(signal.commits == start + 1, "an upload verified inline queues no message")

        #expect(try await store.apply(verified(upload, transaction: "t1"), policy: CreditPolicy()) == .credited)
        #expect(signal.commits == start + 1, "a credit with no events exchange queues no event")

        let other = request("cleo")
        try await store.accept(other, message: nil)
        #expect(
            try await store.apply(verified(other, transaction: "t2"), policy: CreditPolicy(eventsExchange: "iap.events"))
                == .credited)
        #expect(signal.commits == start + 2, "a credit queued its grant event")
        #expect(try await store.outboxBacklog() >= 2)
        await store.close()
    }

    /// A relay whose poll is a minute away publishes a new row at once: the commit wakes it.
    @Test(arguments: TestStore.backends) func aRelayPublishesACommitWithoutWaitingForItsPoll(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        let published = NIOLockedValueBox([String]())
        let relay = OutboxRelay(
            store: store,
            publisher: Publishing { message in published.withLockedValue { $0.append(message.routingKey) } },
            pollInterval: .seconds(60), logger: Logger(label: "iap.tests.relay"))
        let running = Task { try await relay.run() }
        // The relay's first batch finds nothing; then it waits for its minute-long poll.
        try await Task.sleep(for: .milliseconds(300))
        try await store.accept(request("ana"), message: OutboxMessage(routingKey: "first", body: [1]))
        #expect(try await eventually(timeout: .seconds(10)) { published.withLockedValue { $0 } == ["first"] })
        try await store.accept(request("ben"), message: OutboxMessage(routingKey: "second", body: [2]))
        #expect(try await eventually(timeout: .seconds(10)) { published.withLockedValue { $0 } == ["first", "second"] })
        #expect(try await eventually(timeout: .seconds(10)) { try await store.outboxBacklog() == 0 })
        running.cancel()
        // Cancelled, the relay stops waiting for its poll at once.
        let stopped = ContinuousClock.now
        _ = try? await running.value
        #expect(ContinuousClock.now - stopped < .seconds(30))
        await store.close()
    }

    /// On PostgreSQL a relay claims each outbox row (an `UPDATE`) before it publishes. The room
    /// kept free on the outbox's pages lets the claims stay on their pages (heap-only updates),
    /// so that no index of the outbox is written for them; packed full, most were not.
    @Test(.needsPostgres) func claimsOnPostgreSQLWriteNoIndexEntries() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-relay-\(UUID().uuidString)")
        let store = try await TestStore.open(in: folder, on: .postgres)
        for index in 0..<300 {
            try await store.accept(request("u\(index)"), message: OutboxMessage(routingKey: "verify", body: Array(repeating: 7, count: 200)))
        }
        let relay = OutboxRelay(store: store, publisher: Publishing { _ in }, batchSize: 50, logger: Logger(label: "iap.tests.relay"))
        var relayed = 0
        for _ in 0..<20 where relayed < 300 { relayed += await relay.relayBatch() }
        #expect(relayed == 300)
        // Each connection's statistics reach the server when it ends.
        await store.close()
        let reader = try await TestStore.open(in: folder, on: .postgres)
        var updates = 0
        var heapOnly = 0
        #expect(
            try await eventually {
                updates = try await reader.testValue("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'outbox'") ?? 0
                heapOnly = try await reader.testValue("SELECT n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'outbox'") ?? 0
                return updates >= 300
            })
        #expect(heapOnly * 10 >= updates * 9, "\(heapOnly) of \(updates) claims were heap-only")
        await reader.close()
    }

    /// `IAP_MESSAGE_ENCODING=identity`: verify messages go out as they are, for verifiers of a
    /// release that does not read deflate.
    @Test func aRelayWithoutAnEncodingPublishesTheBodyAsItIs() async throws {
        let store = try await makeStore(.sqlite)
        let request = VerifyRequest(submissionId: UUID(), userId: "ana", receiptData: "MIIT", acceptedAt: Date())
        try await store.accept(request, message: .verify(request, routingKey: "verify", priority: VerifyPriority.firstAttempt))
        let published = NIOLockedValueBox([OutgoingMessage]())
        let relay = OutboxRelay(
            store: store, publisher: Publishing { message in published.withLockedValue { $0.append(message) } },
            verifyEncoding: nil, logger: Logger(label: "iap.tests.relay"))
        #expect(await relay.relayBatch() == 1)
        let message = try #require(published.withLockedValue { $0 }.first)
        #expect(message.contentEncoding == nil)
        #expect(try MessageCodec().decode(VerifyRequest.self, from: message.body).submissionId == request.submissionId)
        await store.close()
    }

    /// A verify message names its submission and is built from the submission's row when it is
    /// published: the receipt is stored once, and the message carries everything the app sent.
    /// A message whose submission is gone (purged) is dropped, not retried forever.
    @Test(arguments: TestStore.backends) func aVerifyMessageIsBuiltFromItsSubmissionWhenPublished(_ backend: Backend) async throws {
        let store = try await makeStore(backend)
        var request = VerifyRequest(
            submissionId: UUID(), userId: "ana", receiptData: String(repeating: "MIIT", count: 1000), transactionId: "t2",
            orderId: "order-7", acceptedAt: Date())
        request.originalTransactionId = "t1"
        request.productId = "com.example.gems"
        try await store.accept(request, message: .verify(request, routingKey: "verify", priority: VerifyPriority.firstAttempt))
        let stored: Int? = try await store.testValue("SELECT length(body) FROM outbox")
        #expect(stored == 0, "the outbox row holds no copy of the receipt")

        let published = NIOLockedValueBox([OutgoingMessage]())
        let relay = OutboxRelay(
            store: store, publisher: Publishing { message in published.withLockedValue { $0.append(message) } },
            logger: Logger(label: "iap.tests.relay"))
        #expect(await relay.relayBatch() == 1)
        let message = try #require(published.withLockedValue { $0 }.first)
        #expect(message.routingKey == "verify" && message.priority == VerifyPriority.firstAttempt && message.mandatory)
        #expect(message.messageId == request.submissionId.uuidString)
        // Deflated on the wire (the default), as the verifiers read it.
        #expect(message.contentEncoding == "deflate")
        let body = try ContentEncoding.decode(message.body, named: message.contentEncoding)
        #expect(message.body.count < body.count * 2 / 3, "\(message.body.count) of \(body.count) bytes")
        let sent = try MessageCodec().decode(VerifyRequest.self, from: body)
        #expect(sent.submissionId == request.submissionId && sent.userId == "ana" && sent.attempt == 1)
        #expect(sent.receiptData == request.receiptData)
        #expect(sent.transactionId == "t2" && sent.originalTransactionId == "t1" && sent.productId == "com.example.gems")
        #expect(sent.orderId == "order-7")
        #expect(abs(sent.acceptedAt.timeIntervalSince(request.acceptedAt)) < 0.01)

        let gone = VerifyRequest(submissionId: UUID(), userId: "ben", receiptData: "AAAA", acceptedAt: Date())
        try await store.accept(gone, message: .verify(gone, routingKey: "verify", priority: VerifyPriority.firstAttempt))
        _ = try await store.testRows("DELETE FROM submission WHERE id = ?", [gone.submissionId.uuidString])
        #expect(await relay.relayBatch() == 1)
        #expect(published.withLockedValue { $0.count } == 1, "nothing is published for a submission that is gone")
        #expect(try await store.outboxBacklog() == 0)
        await store.close()
    }
}
