public import IAPCore
public import Messaging

extension Topology {
    /// The queues of the verification pipeline, of the kind `names.queueType` says.
    ///
    /// Messages go through the default exchange, addressed by queue name.
    /// `verify` and `results` dead-letter what a consumer rejects into their `.dead`
    /// queues. Each retry queue holds messages for their own (jittered) expiration, capped
    /// by the queue's TTL, and then dead-letters them back for verification, so a retry
    /// costs no polling.
    ///
    /// - Classic: `verify` is a priority queue (first attempts before retries) and the
    ///   retry queues return into it.
    /// - Quorum: every queue is a quorum queue. Quorum queues have no priorities, so the
    ///   retry queues return into `verifyRetries`, which verifiers serve only when no first
    ///   attempt waits. `verify`, `verifyRetries` and `results` dead-letter a message
    ///   after `deliveryLimit` deliveries (the broker's reason, `delivery_limit`, travels
    ///   in its `x-first-death-reason` header), and all dead-lettering is at-least-once
    ///   (the broker keeps the message until the target queue confirms it; this needs
    ///   `x-overflow: reject-publish`).
    public static func pipeline(_ names: PipelineNames, retrySchedule: RetrySchedule) -> Topology {
        let quorum: [String: ArgumentValue]
        let limited: [String: ArgumentValue]
        let verifyArguments: [String: ArgumentValue]
        switch names.queueType {
        case .classic:
            quorum = [:]
            limited = [:]
            verifyArguments = ["x-max-priority": .int(Int64(VerifyPriority.maximum))]
        case .quorum(let deliveryLimit):
            quorum = [
                "x-queue-type": .string("quorum"),
                "x-overflow": .string("reject-publish"),
                "x-dead-letter-strategy": .string("at-least-once"),
            ]
            limited = ["x-delivery-limit": .int(Int64(max(1, deliveryLimit)))]
            verifyArguments = [:]
        }
        func deadLettering(to target: String) -> [String: ArgumentValue] {
            ["x-dead-letter-exchange": .string(""), "x-dead-letter-routing-key": .string(target)]
        }
        var queues: [Queue] = [
            Queue(name: names.verifyDead, arguments: quorum),
            Queue(name: names.resultsDead, arguments: quorum),
            Queue(
                name: names.verify,
                arguments: quorum.merging(limited) { $1 }.merging(verifyArguments) { $1 }
                    .merging(deadLettering(to: names.verifyDead)) { $1 }),
            Queue(
                name: names.results,
                arguments: quorum.merging(limited) { $1 }.merging(deadLettering(to: names.resultsDead)) { $1 }),
            // The app's consumption reports; what cannot be read goes where unreadable results go.
            Queue(
                name: names.consumption,
                arguments: quorum.merging(limited) { $1 }.merging(deadLettering(to: names.resultsDead)) { $1 }),
        ]
        if names.separatesRetries {
            queues.append(
                Queue(
                    name: names.verifyRetries,
                    arguments: quorum.merging(limited) { $1 }.merging(deadLettering(to: names.verifyDead)) { $1 }))
        }
        for delay in Set(retrySchedule.delaysSeconds).sorted() {
            var arguments = quorum.merging(deadLettering(to: names.verifyQueue(priority: VerifyPriority.retry))) { $1 }
            arguments["x-message-ttl"] = .int(Int64(delay) * 1250)
            queues.append(Queue(name: names.verifyRetry(delaySeconds: delay), arguments: arguments))
        }
        return Topology(exchanges: [Exchange(name: names.events, type: "topic")], queues: queues)
    }
}
