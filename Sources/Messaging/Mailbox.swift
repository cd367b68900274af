import Foundation
import NIOConcurrencyHelpers

/// How a consumer settles a delivery.
enum Settlement: Sendable {
    case ack
    case requeue
    case deadLetter
}

/// What a caller hands to the connection's thread.
enum Command: Sendable {
    case publish(PendingPublish)
    case cancelPublish(id: UInt64)
    case consume(ConsumerRegistration)
    case cancelConsumer(id: Int, done: CheckedContinuation<Void, Never>)
    case settle(
        Settlement, channel: UInt16, generation: UInt64, channelEpoch: UInt64, deliveryTag: UInt64,
        done: CheckedContinuation<Result<Void, AMQPError>, Never>)
    case queueStatus(String, done: CheckedContinuation<Result<QueueStatus, AMQPError>, Never>)
    case get(String, done: CheckedContinuation<Result<AMQPDelivery?, AMQPError>, Never>)
    case shutdown(done: CheckedContinuation<Void, Never>)
}

/// A publish waiting for its confirm; the thread resumes `done` exactly once.
struct PendingPublish: Sendable {
    var id: UInt64
    var message: OutgoingMessage
    var done: CheckedContinuation<Result<Void, AMQPError>, Never>
}

/// A consumer as the thread keeps it across reconnections.
struct ConsumerRegistration: Sendable {
    var id: Int
    var queue: String
    var prefetch: UInt16
    var deliveries: AsyncStream<AMQPDelivery>.Continuation
}

/// The message count and consumer count of a queue, as a passive declare reports them.
public struct QueueStatus: Sendable, Equatable {
    /// Messages ready for delivery (not counting unacked ones).
    public var messageCount: Int
    /// Consumers attached to the queue.
    public var consumerCount: Int
}

/// The only door into a connection's thread: a locked command list and a wake-up pipe
/// the thread polls next to its socket.
final class Mailbox: Sendable {
    private struct State {
        var commands: [Command] = []
        var closed = false
        var connected = false
        var connectedNode: String?
        var nextId: UInt64 = 1
    }

    private let state = NIOLockedValueBox(State())
    let wakeReadFD: Int32
    private let wakeWriteFD: Int32

    init() {
        var fds: [Int32] = [0, 0]
        let rc = pipe(&fds)
        precondition(rc == 0, "pipe() failed: \(errno)")
        for fd in fds {
            _ = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK)
            _ = fcntl(fd, F_SETFD, FD_CLOEXEC)
        }
        wakeReadFD = fds[0]
        wakeWriteFD = fds[1]
    }

    deinit {
        close(wakeReadFD)
        close(wakeWriteFD)
    }

    /// Queues a command for the thread; false when the connection is shut down.
    func post(_ command: Command) -> Bool {
        let accepted = state.withLockedValue { state -> Bool in
            guard !state.closed else { return false }
            if case .shutdown = command { state.closed = true }
            state.commands.append(command)
            return true
        }
        if accepted {
            var byte: UInt8 = 1
            _ = write(wakeWriteFD, &byte, 1)
        }
        return accepted
    }

    /// Takes every queued command, oldest first.
    func takeAll() -> [Command] {
        var drain = [UInt8](repeating: 0, count: 256)
        while read(wakeReadFD, &drain, drain.count) > 0 {}
        return state.withLockedValue { state in
            defer { state.commands.removeAll(keepingCapacity: true) }
            return state.commands
        }
    }

    func nextId() -> UInt64 {
        state.withLockedValue { state in
            defer { state.nextId += 1 }
            return state.nextId
        }
    }

    var isConnected: Bool {
        get { state.withLockedValue { $0.connected } }
        set { state.withLockedValue { $0.connected = newValue } }
    }

    /// The node connected to (its redacted URL), nil while disconnected.
    var connectedNode: String? {
        get { state.withLockedValue { $0.connectedNode } }
        set { state.withLockedValue { $0.connectedNode = newValue } }
    }

    func settle(_ settlement: Settlement, delivery: AMQPDelivery) async throws(AMQPError) {
        let result = await withCheckedContinuation { done in
            let command = Command.settle(
                settlement, channel: delivery.channel, generation: delivery.generation,
                channelEpoch: delivery.channelEpoch, deliveryTag: delivery.deliveryTag, done: done)
            if !post(command) {
                done.resume(returning: .failure(AMQPError(.shutdown, "the connection is closed")))
            }
        }
        try result.get()
    }
}
