import Foundation
public import Logging
public import ServiceLifecycle

/// A self-healing AMQP 0-9-1 connection with publisher confirms and manual-ack consumers.
///
/// ## Threading model
/// rabbitmq-c connections are not thread-safe and block. Each `AMQPConnection` owns one
/// `Thread` on which the C connection is created, used and destroyed; nothing else ever
/// sees it. Callers talk to that thread through a `Mailbox` (a locked command list plus a
/// wake-up pipe the thread polls beside its socket), and the thread answers by resuming
/// continuations (publish confirms, acks) or yielding into a consumer's `AsyncStream`.
/// No blocking call ever runs on the cooperative pool.
///
/// ## Failures
/// When the socket or the broker fails, the thread reconnects with a growing delay,
/// declares the topology again, restarts every consumer and re-sends every publish that
/// was not confirmed yet (so a publish may arrive twice; consumers are idempotent).
/// Given the nodes of a cluster, it moves to the next node at once when its node is lost
/// and tries them round-robin, the delay growing after each round in which all failed.
/// Deliveries from a lost connection cannot be acked (`staleDelivery`); the broker
/// delivers them again.
public final class AMQPConnection: Sendable {
    private let mailbox = Mailbox()
    private let logger: Logger

    /// Starts connecting in the background; publishes made before the connection is up wait for it.
    public init(configuration: AMQPConfiguration, topology: Topology, logger: Logger) {
        self.logger = logger
        let mailbox = self.mailbox
        let thread = Thread {
            let worker = ConnectionWorker(
                configuration: configuration, topology: topology, mailbox: mailbox, logger: logger)
            worker.run()
        }
        thread.name = "amqp \(configuration.host):\(configuration.port)"
        thread.start()
    }

    /// Whether the connection is up and its topology declared.
    public var isConnected: Bool { mailbox.isConnected }

    /// The node connected to, as its URL without the password; nil while disconnected.
    public var connectedNode: String? { mailbox.connectedNode }

    /// Waits until the connection is up, at most `timeout`; returns whether it is.
    public func waitUntilConnected(timeout: Duration) async -> Bool {
        let deadline = ContinuousClock.now + timeout
        while !isConnected {
            if ContinuousClock.now >= deadline { return false }
            try? await Task.sleep(for: .milliseconds(20))
        }
        return true
    }

    /// Publishes a persistent, mandatory message and returns once the broker confirms it.
    ///
    /// Waits through reconnections: a publish is re-sent until confirmed, refused
    /// (`nacked`, `unroutable`, `channelClosed`) or the connection shuts down.
    /// Cancelling the calling task withdraws a publish that is still waiting for a
    /// connection (`cancelled`); one already sent waits for its confirm.
    public func publish(_ message: OutgoingMessage) async throws(AMQPError) {
        let id = mailbox.nextId()
        let mailbox = self.mailbox
        let result = await withTaskCancellationHandler {
            await withCheckedContinuation { (done: CheckedContinuation<Result<Void, AMQPError>, Never>) in
                if Task.isCancelled {
                    done.resume(returning: .failure(AMQPError(.cancelled, "cancelled before it was sent")))
                } else if !mailbox.post(.publish(PendingPublish(id: id, message: message, done: done))) {
                    done.resume(returning: .failure(AMQPError(.shutdown, "the connection is closed")))
                }
            }
        } onCancel: {
            _ = mailbox.post(.cancelPublish(id: id))
        }
        try result.get()
    }

    /// Starts consuming `queue` with at most `prefetch` unacked deliveries; survives reconnections.
    public func consume(queue: String, prefetch: UInt16) -> AMQPConsumer {
        let id = Int(mailbox.nextId())
        let (stream, continuation) = AsyncStream.makeStream(of: AMQPDelivery.self)
        if !mailbox.post(.consume(ConsumerRegistration(id: id, queue: queue, prefetch: prefetch, deliveries: continuation))) {
            continuation.finish()
        }
        return AMQPConsumer(id: id, deliveries: stream, mailbox: mailbox)
    }

    /// Counts the ready messages and consumers of a queue (a passive declare).
    public func queueStatus(_ queue: String) async throws(AMQPError) -> QueueStatus {
        let result = await withCheckedContinuation { done in
            if !mailbox.post(.queueStatus(queue, done: done)) {
                done.resume(returning: .failure(AMQPError(.shutdown, "the connection is closed")))
            }
        }
        return try result.get()
    }

    /// Takes one message from `queue` without a consumer (`basic.get`); nil when the queue is
    /// empty. Settle it like any delivery.
    public func get(_ queue: String) async throws(AMQPError) -> AMQPDelivery? {
        let result = await withCheckedContinuation { done in
            if !mailbox.post(.get(queue, done: done)) {
                done.resume(returning: .failure(AMQPError(.shutdown, "the connection is closed")))
            }
        }
        return try result.get()
    }

    /// Moves a delivery to a dead-letter queue with the reason in its headers
    /// (`x-iap-dead-reason`, `x-iap-dead-from`), then acks it. If that publish fails, the
    /// delivery is rejected without requeue, so the queue's own dead-lettering takes it.
    public func deadLetter(_ delivery: AMQPDelivery, to queue: String, reason: String) async {
        var headers = delivery.headers
        headers["x-iap-dead-reason"] = String(reason.prefix(500))
        headers["x-iap-dead-from"] = delivery.routingKey
        var message = OutgoingMessage(routingKey: queue, body: delivery.body, headers: headers, messageId: delivery.messageId)
        message.contentEncoding = delivery.contentEncoding
        do {
            try await publish(message)
            try await delivery.ack()
        } catch {
            try? await delivery.reject(requeue: false)
        }
    }

    /// Cancels consumers, waits briefly for outstanding confirms, closes the connection
    /// and ends its thread. Idempotent.
    public func close() async {
        await withCheckedContinuation { (done: CheckedContinuation<Void, Never>) in
            if !mailbox.post(.shutdown(done: done)) {
                done.resume()
            }
        }
    }
}

extension AMQPConnection: Service {
    /// Holds the connection open until graceful shutdown, then closes it.
    ///
    /// - Important: Put this service before its users in a `ServiceGroup`, so it is
    ///   shut down after them and their last acks and publishes still go out.
    public func run() async throws {
        try? await gracefulShutdown()
        await close()
    }
}

/// The deliveries of one consumer, in order. Ends when the consumer is cancelled or
/// the connection closes.
public struct AMQPConsumer: AsyncSequence, Sendable {
    public typealias Element = AMQPDelivery

    let id: Int
    let deliveries: AsyncStream<AMQPDelivery>
    let mailbox: Mailbox

    public func makeAsyncIterator() -> AsyncStream<AMQPDelivery>.Iterator {
        deliveries.makeAsyncIterator()
    }

    /// Stops deliveries (`basic.cancel`); unacked deliveries can still be settled.
    public func cancel() async {
        await withCheckedContinuation { (done: CheckedContinuation<Void, Never>) in
            if !mailbox.post(.cancelConsumer(id: id, done: done)) {
                done.resume()
            }
        }
    }
}
