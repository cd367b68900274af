import Foundation
import IAPCore
public import Logging
public import Messaging
public import OrderStore
public import ServiceLifecycle

/// Publishes outbox rows to the broker and deletes each once the broker confirmed it.
///
/// A row written with an accepted upload reaches the broker even when the broker was
/// down at that moment: the relay waits for it (the connection retries by itself) and
/// the row stays in the store until confirmed, across crashes and restarts. It wakes at each
/// commit that queued messages (the store's `outboxSignal`), and polls besides, for rows
/// another order service wrote or a relay that died left behind.
public final class OutboxRelay: Service, Sendable {
    private let store: OrderStore
    private let publisher: any MessagePublisher
    private let codec = MessageCodec()
    private let logger: Logger
    private let batchSize: Int
    private let pollInterval: Duration
    /// How long a claim on rows lasts unless renewed (several relays share a PostgreSQL outbox).
    private let lease: Duration
    /// How verify messages are encoded on the wire (`content-encoding`), nil for as they are.
    private let verifyEncoding: ContentEncoding?
    /// This relay's name in the rows it claims.
    private let relayId = "relay-\(ProcessInfo.processInfo.processIdentifier)-\(UUID().uuidString.prefix(8))"

    /// Creates a relay from `store` to `publisher` (the process's publishing broker connection);
    /// verify messages go out in `verifyEncoding`.
    public init(
        store: OrderStore, publisher: any MessagePublisher, batchSize: Int = 500, pollInterval: Duration = .seconds(1),
        lease: Duration = .seconds(30), verifyEncoding: ContentEncoding? = .deflate, logger: Logger
    ) {
        self.store = store
        self.verifyEncoding = verifyEncoding
        self.lease = lease
        self.publisher = publisher
        self.logger = logger
        self.batchSize = batchSize
        self.pollInterval = pollInterval
    }

    public func run() async throws {
        let signal = store.outboxSignal
        await withGracefulShutdownHandler {
            while !Task.isShuttingDownGracefully && !Task.isCancelled {
                // What was committed before the batch is read is in it: only later commits wake it.
                let announced = signal.commits
                let published = await relayBatch()
                if published < batchSize {
                    _ = await signal.wait(after: announced, timeout: pollInterval)
                }
            }
        } onGracefulShutdown: {
            signal.announce()
        }
        // Last flush, bounded: what is left stays in the outbox for the next start.
        await withTaskGroup(of: Void.self) { group in
            group.addTask { _ = await self.relayBatch() }
            group.addTask { try? await Task.sleep(for: .seconds(5)) }
            await group.next()
            group.cancelAll()
        }
    }

    private func send(_ message: OutboxMessage) async -> (Int64, String?)? {
        guard let id = message.id else { return nil }
        var body = message.body
        var contentEncoding: String?
        if message.submissionId != nil {
            // Built now from the submission's row; a submission gone (purged) leaves nothing to verify.
            guard let request = message.request else {
                logger.warning("outbox message of a submission that is gone dropped", metadata: ["iap.outbox.id": "\(id)"])
                return (id, nil)
            }
            do {
                body = try codec.encode(request)
                // The receipt is most of it: deflated, about half the bytes to store and deliver.
                if let verifyEncoding {
                    body = try verifyEncoding.encode(body)
                    contentEncoding = verifyEncoding.rawValue
                }
            } catch {
                return (id, String(describing: error))
            }
        }
        var outgoing = OutgoingMessage(
            exchange: message.exchange, routingKey: message.routingKey, body: body, messageId: message.messageId,
            priority: message.priority)
        outgoing.mandatory = message.mandatory
        outgoing.contentEncoding = contentEncoding
        do {
            try await publisher.publish(outgoing)
            return (id, nil)
        } catch {
            return (id, String(describing: error))
        }
    }

    /// Publishes one batch; returns how many rows were confirmed.
    @discardableResult
    public func relayBatch() async -> Int {
        let batch: [OutboxMessage]
        do {
            batch = try await store.claimUnpublished(limit: batchSize, relay: relayId, lease: Self.seconds(lease))
        } catch {
            logger.error("outbox read failed", metadata: ["error": "\(error)"])
            return 0
        }
        guard !batch.isEmpty else { return 0 }
        // The claims last while this relay publishes, however long the broker makes it wait.
        let renewal = store.claimsLapse ? keepClaimed(batch.compactMap(\.id)) : nil
        defer { renewal?.cancel() }
        // Work messages go out together (confirms batch themselves); events go out one after
        // another in commit order, so no consumer sees `grant.revoked` before `grant.created`.
        let events = batch.filter { !$0.mandatory }
        let outcomes = await withTaskGroup(of: [(Int64, String?)].self) { group in
            for message in batch where message.mandatory {
                group.addTask { [await self.send(message)].compactMap { $0 } }
            }
            group.addTask {
                var outcomes: [(Int64, String?)] = []
                for message in events {
                    guard let outcome = await self.send(message) else { continue }
                    outcomes.append(outcome)
                    if outcome.1 != nil { break }
                }
                return outcomes
            }
            var outcomes: [(Int64, String?)] = []
            for await part in group { outcomes += part }
            return outcomes
        }
        let confirmed = outcomes.filter { $0.1 == nil }.map(\.0)
        do {
            try await store.markPublished(confirmed)
            for (id, error) in outcomes {
                guard let error else { continue }
                logger.warning("outbox publish failed", metadata: ["iap.outbox.id": "\(id)", "error": "\(error)"])
                try await store.markPublishFailed(id, error: error)
            }
            // Events after a failed one were not tried: any relay may take them now, in order.
            let tried = Set(outcomes.map(\.0))
            try await store.releaseClaims(batch.compactMap(\.id).filter { !tried.contains($0) }, relay: relayId)
        } catch {
            // The rows stay and go out again (consumers are idempotent); pause rather than
            // republish the same batch in a tight loop while the file is unwritable.
            logger.error("outbox update failed", metadata: ["error": "\(error)"])
            try? await Task.sleep(for: .seconds(1))
            return 0
        }
        return confirmed.count
    }

    /// Renews the claims on `ids` every third of a lease until cancelled.
    private func keepClaimed(_ ids: [Int64]) -> Task<Void, Never> {
        let (store, relayId, lease, logger) = (self.store, self.relayId, self.lease, self.logger)
        return Task {
            while !Task.isCancelled {
                guard (try? await Task.sleep(for: lease / 3)) != nil, !Task.isCancelled else { return }
                do {
                    try await store.renewClaims(ids, relay: relayId, lease: Self.seconds(lease))
                } catch {
                    logger.warning("outbox claims not renewed", metadata: ["error": "\(error)"])
                }
            }
        }
    }

    private static func seconds(_ duration: Duration) -> TimeInterval {
        TimeInterval(duration.components.seconds) + TimeInterval(duration.components.attoseconds) / 1e18
    }
}
