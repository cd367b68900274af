import NIOConcurrencyHelpers

/// The deliveries of two consumers as one line, where a delivery of the preferred consumer
/// is always taken before one of the other: the shape of "first attempts before retries"
/// on queues without priorities (quorum queues).
///
/// Each consumer's prefetch bounds what waits here unsettled. `next()` takes from the
/// preferred consumer whenever it has a delivery waiting, so how fast the other is served
/// depends only on how often the preferred one is idle.
///
/// - Important: Call `run()` (it moves deliveries in until both consumers end) beside the
///   callers of `next()`. After `close()`, `next()` returns nil and what waited here is
///   left unsettled: the broker delivers it again once the consumers' connection closes.
public final class PreferringDeliveries: Sendable {
    private struct State {
        var preferred: [AMQPDelivery] = []
        var other: [AMQPDelivery] = []
        var waiters: [CheckedContinuation<AMQPDelivery?, Never>] = []
        var running = 2
        var closed = false
    }

    private let state = NIOLockedValueBox(State())
    private let preferred: AMQPConsumer
    private let other: AMQPConsumer

    /// Serves `preferred` before `other`.
    public init(preferred: AMQPConsumer, other: AMQPConsumer) {
        self.preferred = preferred
        self.other = other
    }

    /// Moves deliveries in from both consumers until both end (cancelled, or their
    /// connection closed).
    public func run() async {
        await withDiscardingTaskGroup { group in
            group.addTask { await self.feed(from: self.preferred, preferred: true) }
            group.addTask { await self.feed(from: self.other, preferred: false) }
        }
    }

    /// The next delivery, the preferred consumer's first; nil once closed, or once both
    /// consumers ended and nothing waits.
    public func next() async -> AMQPDelivery? {
        await withCheckedContinuation { (done: CheckedContinuation<AMQPDelivery?, Never>) in
            let ready: AMQPDelivery?? = state.withLockedValue { state in
                if state.closed { return .some(nil) }
                if !state.preferred.isEmpty { return state.preferred.removeFirst() }
                if !state.other.isEmpty { return state.other.removeFirst() }
                if state.running == 0 { return .some(nil) }
                state.waiters.append(done)
                return .none
            }
            if let ready { done.resume(returning: ready) }
        }
    }

    /// Stops handing out deliveries and cancels both consumers.
    public func close() async {
        let waiters = state.withLockedValue { state in
            state.closed = true
            defer { state.waiters.removeAll() }
            return state.waiters
        }
        for waiter in waiters { waiter.resume(returning: nil) }
        await preferred.cancel()
        await other.cancel()
    }

    private func feed(from consumer: AMQPConsumer, preferred: Bool) async {
        for await delivery in consumer {
            // A waiter exists only while nothing is buffered, so handing over keeps the preference.
            let waiter = state.withLockedValue { state -> CheckedContinuation<AMQPDelivery?, Never>? in
                if state.closed { return nil }
                if !state.waiters.isEmpty { return state.waiters.removeFirst() }
                if preferred { state.preferred.append(delivery) } else { state.other.append(delivery) }
                return nil
            }
            waiter?.resume(returning: delivery)
        }
        let waiters = state.withLockedValue { state in
            state.running -= 1
            guard state.running == 0, state.preferred.isEmpty, state.other.isEmpty else {
                return [CheckedContinuation<AMQPDelivery?, Never>]()
            }
            defer { state.waiters.removeAll() }
            return state.waiters
        }
        for waiter in waiters { waiter.resume(returning: nil) }
    }
}
