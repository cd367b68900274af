public import AppStore
import Foundation
public import IAPCore
public import Logging
import Metrics
public import Messaging
public import ServiceLifecycle

/// How a verifier runs.
public struct VerifierSettings: Sendable {
    /// Queue names.
    public var names: PipelineNames
    /// Verifications in flight at once (the consumer's prefetch).
    public var concurrency: Int
    /// Delays between attempts.
    public var retrySchedule: RetrySchedule
    /// Age of an upload after which transient failures stop being retried (it then needs review).
    public var maxRetryAge: Duration
    /// Whether sandbox purchases (free to make) are credited.
    public var sandboxPolicy: SandboxPolicy
    /// When to stop calling Apple during an outage.
    public var circuitBreaker: CircuitBreaker.Settings
    /// How the retries and results this verifier publishes are encoded (nil: as they are).
    public var messageEncoding: ContentEncoding? = .deflate

    /// Creates settings.
    public init(
        names: PipelineNames = .init(), concurrency: Int = Setting.verifierConcurrency.defaultInt, retrySchedule: RetrySchedule = .init(),
        maxRetryAge: Duration = .seconds(Setting.maxRetryAgeHours.defaultInt * 3600), sandboxPolicy: SandboxPolicy = .accept,
        circuitBreaker: CircuitBreaker.Settings = .init()
    ) {
        self.circuitBreaker = circuitBreaker
        self.names = names
        self.concurrency = concurrency
        self.retrySchedule = retrySchedule
        self.maxRetryAge = maxRetryAge
        self.sandboxPolicy = sandboxPolicy
    }
}

/// Consumes uploads, verifies each with Apple and publishes the result.
///
/// - Important: An upload is acked only after its result (and, for a transient failure,
///   its next attempt) is confirmed by the broker, so a crash at any point leaves the
///   upload on the queue. Stateless: run as many as needed.
public final class VerifierService: Service, Sendable {
    private let settings: VerifierSettings
    private let consumer: AMQPConnection
    private let connection: AMQPConnection
    private let verifier: any ReceiptVerifying
    private let logger: Logger
    private let codec = MessageCodec()
    private let breaker: CircuitBreaker

    /// Creates a verifier that consumes and acks through `consumer`, publishes through
    /// `publisher`, and asks `verifier`.
    public init(
        settings: VerifierSettings, consumer: AMQPConnection, publisher: AMQPConnection, verifier: any ReceiptVerifying,
        logger: Logger
    ) {
        self.settings = settings
        self.consumer = consumer
        self.connection = publisher
        self.verifier = verifier
        self.logger = logger
        self.breaker = CircuitBreaker(settings: settings.circuitBreaker)
        // Exported from the start, so dashboards show 0 rather than nothing.
        Counter(label: MetricNames.retries).increment(by: 0)
        Counter(label: MetricNames.deadLetters, dimensions: [("queue", "verify")]).increment(by: 0)
        Gauge(label: MetricNames.breakerOpen).record(0)
    }

    public func run() async throws {
        let prefetch = UInt16(clamping: max(1, settings.concurrency))
        guard settings.names.separatesRetries else {
            // Classic: one priority queue; the broker serves first attempts first.
            let consumer = self.consumer.consume(queue: settings.names.verify, prefetch: prefetch)
            // The prefetch bounds the tasks: each holds one unacked delivery.
            await withDiscardingTaskGroup { group in
                for await delivery in consumer.cancelOnGracefulShutdown() {
                    group.addTask { await self.handle(delivery) }
                }
                await consumer.cancel()
            }
            return
        }
        // Quorum: first attempts and due retries wait in two queues; `concurrency` workers
        // each take a first attempt whenever one waits, and a retry only otherwise.
        let deliveries = PreferringDeliveries(
            preferred: self.consumer.consume(queue: settings.names.verify, prefetch: prefetch),
            other: self.consumer.consume(queue: settings.names.verifyRetries, prefetch: prefetch))
        // Graceful shutdown (or cancellation) stops taking work and cancels both consumers;
        // the work in hand is finished.
        let stop: @Sendable () -> Void = { Task { await deliveries.close() } }
        await withTaskCancellationHandler {
            await withGracefulShutdownHandler {
                await withDiscardingTaskGroup { group in
                    group.addTask { await deliveries.run() }
                    for _ in 0..<max(1, settings.concurrency) {
                        group.addTask {
                            while let delivery = await deliveries.next() {
                                await self.handle(delivery)
                            }
                        }
                    }
                }
            } onGracefulShutdown: {
                stop()
            }
        } onCancel: {
            stop()
        }
    }

    private static func count(outcome: String) {
        Counter(label: MetricNames.verifications, dimensions: [("outcome", outcome)]).increment()
    }

    /// While the breaker is open: back to the shortest delay queue with the same attempt
    /// number, so the outage does not count against the upload's retries. The status says
    /// `retrying` with the next attempt's time, so the sweeper knows it is not stuck.
    @inline(never)
    private func postponement(of request: VerifyRequest) throws -> [OutgoingMessage] {
        let level = settings.retrySchedule.delaysSeconds[0]
        let wait = settings.retrySchedule.jitteredDelayMilliseconds(level: level)
        let result = VerifyResult(
            submissionId: request.submissionId, userId: request.userId, orderId: request.orderId,
            attempt: request.attempt, outcome: .retryLater(.appleUnavailable, message: "Apple is failing; verification paused"),
            nextAttemptAt: Date().addingTimeInterval(TimeInterval(wait) / 1000))
        return [
            try message(
                settings.names.verifyRetry(delaySeconds: level), request, messageId: request.submissionId.uuidString,
                priority: VerifyPriority.retry, expiration: .milliseconds(wait)),
            try message(settings.names.results, result, messageId: request.submissionId.uuidString),
        ]
    }

    // The work of one delivery is split so that only what waits (Apple, the broker) runs in
    // async code. An async function's locals, and those of everything inlined into it, live
    // in its task's frame for the whole call; with thousands of verifications in flight those
    // frames were the largest part of the verifier's memory. Synchronous helpers that are
    // never inlined keep their locals on the thread's stack instead.

    func handle(_ delivery: AMQPDelivery) async {
        let request: VerifyRequest
        switch decodeRequest(delivery) {
        case .success(let decoded):
            request = decoded
        case .failure(let undecodable):
            await connection.deadLetter(delivery, to: settings.names.verifyDead, reason: undecodable.reason)
            return
        }
        do {
            let messages: [OutgoingMessage]
            if breaker.permit() == .wait {
                Self.count(outcome: "postponed")
                messages = try postponement(of: request)
            } else {
                let outcome = await verifier.verify(request)
                messages = try answer(request, outcome: outcome)
            }
            for message in messages { try await connection.publish(message) }
            try await delivery.ack()
        } catch {
            await requeue(delivery, request: request, error: error)
        }
    }

    /// The upload, or why it can never be read (logged and counted here).
    @inline(never)
    private func decodeRequest(_ delivery: AMQPDelivery) -> Result<VerifyRequest, UndecodableRequest> {
        do {
            // Deflated or not (`content-encoding`), as the relay published it.
            return .success(try codec.decodeRequest(from: try delivery.decodedBody()))
        } catch {
            logger.error(
                "undecodable verify message sent to the dead-letter queue",
                metadata: ["amqp.queue": "\(settings.names.verify)", "error": "\(error)"])
            Counter(label: MetricNames.deadLetters, dimensions: [("queue", "verify")]).increment()
            return .failure(UndecodableRequest(reason: "undecodable verify request: \(error)"))
        }
    }

    /// What to publish for Apple's answer, in order: the next attempt (for a transient
    /// failure that is retried), then the result.
    @inline(never)
    private func answer(_ request: VerifyRequest, outcome verified: VerificationOutcome) throws -> [OutgoingMessage] {
        var outcome = verified
        let transient: Bool
        if case .retryLater = outcome { transient = true } else { transient = false }
        if breaker.record(transientFailure: transient) {
            logger.error(
                "Apple keeps failing: verification paused",
                metadata: ["iap.breaker.open_seconds": "\(settings.circuitBreaker.openDuration.components.seconds)"])
        }
        Gauge(label: MetricNames.breakerOpen).record(breaker.isOpen ? 1 : 0)
        if case .verified(let receipt) = outcome, receipt.environment == .sandbox,
            !settings.sandboxPolicy.allows(userId: request.userId)
        {
            outcome = .rejected(.sandboxNotAllowed, message: "sandbox purchases are not credited for this user")
        }
        switch outcome {
        case .verified: Self.count(outcome: "verified")
        case .notification: Self.count(outcome: "notification")
        case .rejected: Self.count(outcome: "rejected")
        case .retryLater: Self.count(outcome: "retry_later")
        case .needsReview: Self.count(outcome: "needs_review")
        }
        var result = VerifyResult(
            submissionId: request.submissionId, userId: request.userId, orderId: request.orderId,
            attempt: request.attempt, outcome: outcome)
        var messages: [OutgoingMessage] = []
        if case .retryLater(let reason, _) = outcome {
            let metadata: Logger.Metadata = [
                "iap.submission.id": "\(request.submissionId)", "iap.attempt": "\(request.attempt)",
                "iap.reason": "\(reason)",
            ]
            let now = Date()
            if Duration.seconds(now.timeIntervalSince(request.acceptedAt)) >= settings.maxRetryAge {
                result.gaveUp = true
                logger.error("verification retries exhausted", metadata: metadata)
            } else {
                let level = settings.retrySchedule.delaySeconds(afterAttempt: request.attempt)
                let wait = settings.retrySchedule.jitteredDelayMilliseconds(level: level)
                var next = request
                next.attempt += 1
                if reason == .appleMalformed { next.malformedAnswers = (request.malformedAnswers ?? 0) + 1 }
                messages.append(
                    try message(
                        settings.names.verifyRetry(delaySeconds: level), next, messageId: request.submissionId.uuidString,
                        priority: VerifyPriority.retry, expiration: .milliseconds(wait)))
                result.nextAttemptAt = now.addingTimeInterval(TimeInterval(wait) / 1000)
                Counter(label: MetricNames.retries).increment()
                logger.info("verification will be retried", metadata: metadata)
            }
        }
        messages.append(try message(settings.names.results, result, messageId: request.submissionId.uuidString))
        return messages
    }

    /// `value` as a message to `routingKey`, in the settings' encoding.
    private func message(
        _ routingKey: String, _ value: some Encodable, messageId: String, priority: UInt8? = nil, expiration: Duration? = nil
    ) throws -> OutgoingMessage {
        var body = try codec.encode(value)
        if let encoding = settings.messageEncoding { body = try encoding.encode(body) }
        var message = OutgoingMessage(
            routingKey: routingKey, body: body, messageId: messageId, priority: priority, expiration: expiration)
        message.contentEncoding = settings.messageEncoding?.rawValue
        return message
    }

    /// Gives the upload back to the queue after a failed publish or ack (or, should it ever
    /// happen, a message of ours that cannot be encoded).
    private func requeue(_ delivery: AMQPDelivery, request: VerifyRequest, error: any Error) async {
        logger.warning(
            "verification result not delivered; the upload will be redelivered",
            metadata: [
                "iap.submission.id": "\(request.submissionId)", "iap.attempt": "\(request.attempt)",
                "error": "\(error)",
            ])
        // Not at once: a broker that refuses the publish would otherwise make us call Apple in a loop.
        try? await Task.sleep(for: .seconds(1))
        try? await delivery.reject(requeue: true)
    }
}

/// Why a verify message could not be read.
private struct UndecodableRequest: Error {
    var reason: String
}
