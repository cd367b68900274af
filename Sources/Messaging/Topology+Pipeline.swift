import IAPCore

extension Topology {
    /// The queues of the verification pipeline.
    ///
    /// Messages go through the default exchange, addressed by queue name.
    /// `verify` and `results` dead-letter what a consumer rejects into their `.dead`
    /// queues; `verify` is a priority queue (first attempts before retries). Each retry
    /// queue holds messages for their own (jittered) expiration, capped by the queue's TTL,
    /// and then dead-letters them back into `verify`, so a retry costs no polling.
    public static func pipeline(_ names: PipelineNames, retrySchedule: RetrySchedule) -> Topology {
        var queues: [Queue] = [
            Queue(name: names.verifyDead),
            Queue(name: names.resultsDead),
            Queue(
                name: names.verify,
                arguments: [
                    "x-dead-letter-exchange": .string(""),
                    "x-dead-letter-routing-key": .string(names.verifyDead),
                    "x-max-priority": .int(Int64(VerifyPriority.maximum)),
                ]),
            Queue(
                name: names.results,
                arguments: [
                    "x-dead-letter-exchange": .string(""),
                    "x-dead-letter-routing-key": .string(names.resultsDead),
                ]),
        ]
        for delay in Set(retrySchedule.delaysSeconds).sorted() {
            queues.append(
                Queue(
                    name: names.verifyRetry(delaySeconds: delay),
                    arguments: [
                        "x-message-ttl": .int(Int64(delay) * 1250),
                        "x-dead-letter-exchange": .string(""),
                        "x-dead-letter-routing-key": .string(names.verify),
                    ]))
        }
        return Topology(exchanges: [Exchange(name: names.events, type: "topic")], queues: queues)
    }
}
