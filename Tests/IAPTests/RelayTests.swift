import Foundation
import IAPCore
import Logging
import Messaging
import NIOConcurrencyHelpers
@testable import OrderStore
import Relay
import Testing

/// The store announces its own outbox rows, and the relay publishes on the announcement: no
/// writer has to remember to wake it.
@Suite("Outbox relay")
struct RelayTests {
    func makeStore() async throws -> OrderStore {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-relay-\(UUID().uuidString)")
        return try await TestStore.open(in: folder)
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
    @Test func theStoreAnnouncesEachCommitThatQueuedMessages() async throws {
        let store = try await makeStore()
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
    @Test func aRelayPublishesACommitWithoutWaitingForItsPoll() async throws {
        let store = try await makeStore()
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
}
