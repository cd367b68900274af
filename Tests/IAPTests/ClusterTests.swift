import Foundation
import IAPCore
import Messaging
import Relay
import NIOConcurrencyHelpers
import OrderStore
import Ledger
import Testing
import TestSupport

extension ClusterDrills {
    /// Against the private three-node cluster (quorum queues), never a fake.
    @Suite(
        "RabbitMQ cluster: failover and quorum queues",
        .enabled(if: TestCluster.isAvailable, Comment(rawValue: TestCluster.missing)))
    struct ClusterTests {
        /// `iap` given several broker URLs and no IAP_QUEUE_TYPE declares quorum queues: the
        /// queue it declared takes a quorum declaration with the default delivery limit and
        /// refuses a classic one (406).
        @Test func severalBrokerURLsMeanQuorumQueuesByDefault() async throws {
            let drill = try await ProcessDrill(name: "default-type", environment: ["IAP_AMQP_URL": try TestCluster.urls()])
            try drill.start("verifier")
            let names = PipelineNames(prefix: drill.prefix)
            let probe = AMQPConnection(configuration: try TestCluster.configuration(), topology: Topology(), logger: TestBroker.logger)
            Teardown.add { await probe.close() }
            let declared = try await eventually(timeout: .seconds(30), interval: .milliseconds(200)) {
                (try? await probe.queueStatus(names.verify)) != nil
            }
            #expect(declared, "the verifier declared no \(names.verify): \(drill.logTail("verifier"))")
            func declaring(_ type: QueueType) async throws -> Bool {
                let typed = PipelineNames(prefix: drill.prefix, queueType: type)
                let queue = try #require(
                    Topology.pipeline(typed, retrySchedule: RetrySchedule(delaysSeconds: [1])).queues.first { $0.name == typed.verify })
                let connection = AMQPConnection(
                    configuration: try TestCluster.configuration(), topology: Topology(queues: [queue]), logger: TestBroker.logger)
                let connected = await connection.waitUntilConnected(timeout: .seconds(5))
                await connection.close()
                return connected
            }
            let quorumAccepted = try await declaring(.quorum(deliveryLimit: QueueType.defaultDeliveryLimit))
            let classicAccepted = try await declaring(.classic)
            #expect(quorumAccepted, "not a quorum queue with the default delivery limit")
            #expect(!classicAccepted, "a classic declaration was accepted")
        }

        @Test func whenItsNodeIsKilled_aClientMovesOnAndEveryConfirmedMessageIsDelivered() async throws {
            let names = TestCluster.names("failover")
            let queue = names.results
            let connection = AMQPConnection(
                configuration: try TestCluster.configuration(),
                topology: .pipeline(names, retrySchedule: RetrySchedule(delaysSeconds: [1])), logger: TestBroker.logger)
            let urls = try TestCluster.urls()
            #expect(await connection.waitUntilConnected(timeout: .seconds(15)), "cannot reach \(urls)")
            let first = try #require(connection.connectedNode)
            let firstPort = try #require(TestCluster.port(of: first))

            // Everything delivered, by message number; acked at once (an ack that finds its
            // connection gone fails, and the broker delivers the message again).
            let delivered = NIOLockedValueBox([Int: Int]())
            let consumer = connection.consume(queue: queue, prefetch: 100)
            let consuming = Task {
                for await delivery in consumer {
                    if let number = delivery.messageId.flatMap(Int.init) {
                        delivered.withLockedValue { $0[number, default: 0] += 1 }
                    }
                    try? await delivery.ack()
                }
            }

            let total = 3_000
            let confirmed = NIOLockedValueBox(Set<Int>())
            let failed = NIOLockedValueBox([Int: AMQPError]())
            let killed = NIOLockedValueBox<ContinuousClock.Instant?>(nil)
            var killError: (any Error)?
            // Refusals (nacks) are retried as the outbox relay does, for at most 45 s; when
            // each happened, after the kill.
            let refusals = NIOLockedValueBox([(after: Duration, code: AMQPError.Code)]())
            let giveUp = ContinuousClock.now + .seconds(45)
            // Fifty publishes in flight at a time; the node dies once 500 are confirmed.
            try await withThrowingTaskGroup(of: Void.self) { group in
                for number in 0..<total {
                    if number >= 50 { try await group.next() }
                    if killed.withLockedValue({ $0 }) == nil, confirmed.withLockedValue({ $0.count }) >= 500 {
                        killed.withLockedValue { $0 = .now }
                        do { try await TestCluster.control("kill \(firstPort)") } catch { killError = error }
                    }
                    group.addTask {
                        let message = OutgoingMessage(
                            routingKey: queue, body: Array("message \(number)".utf8), messageId: String(number))
                        while true {
                            do throws(AMQPError) {
                                try await connection.publish(message)
                                confirmed.withLockedValue { _ = $0.insert(number) }
                                failed.withLockedValue { $0[number] = nil }
                                return
                            } catch {
                                failed.withLockedValue { $0[number] = error }
                                let since = killed.withLockedValue { $0.map { ContinuousClock.now - $0 } } ?? .zero
                                refusals.withLockedValue { $0.append((since, error.code)) }
                                guard ContinuousClock.now < giveUp else { return }
                                try? await Task.sleep(for: .milliseconds(100))
                            }
                        }
                    }
                }
                try await group.waitForAll()
            }
            // The next tests want all three nodes again; the node keeps its data and rejoins.
            try await TestCluster.restartingNode(firstPort) {
                #expect(killError == nil, "kill -9 of the node failed: \(String(describing: killError))")
                #expect(killed.withLockedValue { $0 } != nil, "the node was never killed")

                let confirmedNumbers = confirmed.withLockedValue { $0 }
                let allDelivered = try await eventually(timeout: .seconds(60), interval: .milliseconds(200)) {
                    let seen = delivered.withLockedValue { Set($0.keys) }
                    return confirmedNumbers.isSubset(of: seen)
                }
                let seen = delivered.withLockedValue { $0 }
                let missing = confirmedNumbers.subtracting(seen.keys).sorted()
                let twice = seen.values.filter { $0 > 1 }.count
                let failures = failed.withLockedValue { $0 }
                let now = try #require(connection.connectedNode, "not connected again after the kill")
                let refused = refusals.withLockedValue { $0 }
                let times = refused.map(\.after)
                let window = times.isEmpty ? "none" : "\(times.min()!) to \(times.max()!) after the kill"
                print(
                    "failover: \(confirmedNumbers.count) of \(total) confirmed, \(refused.count) refusals retried (\(window)), \(failures.count) never confirmed, \(seen.count) delivered (\(twice) more than once); moved from \(first) to \(now)"
                )
                #expect(allDelivered, "\(missing.count) confirmed messages never delivered, e.g. \(missing.prefix(10))")
                #expect(TestCluster.port(of: now) != firstPort, "still on the killed node \(first)")
                // Publishes waiting for a confirm are sent again on the next node; a refusal must
                // say so (and leaves the message to the caller), never vanish.
                #expect(confirmedNumbers.count == total, "never confirmed: \(failures.values.prefix(5))")
                #expect(
                    refused.allSatisfy { [.nacked, .channelClosed, .timedOut].contains($0.code) },
                    "unexpected refusals: \(Set(refused.map(\.code)))")

                await consumer.cancel()
                consuming.cancel()
                await connection.close()
            }
        }

        /// The whole pipeline on quorum queues (intake, verifier, finisher; all their
        /// connections start on node 1): uploads go on while node 1 is killed, and every
        /// upload answered 202 is credited.
        @Test func whenANodeIsKilledUnderUploads_everyAcceptedUploadIsCredited() async throws {
            let pipeline = try await PipelineHarness.start(name: "cluster-drill", onCluster: true)
            Teardown.add { await pipeline.stop() }
            let firstPort = try #require(TestCluster.port(of: try TestCluster.urls().split(separator: ",")[0].description))
            let total = 120
            var purchases: [PipelineHarness.Purchase] = []
            for _ in 0..<total { purchases.append(try await pipeline.mint()) }
            var ids: [String] = []
            var refused = 0
            // The next tests want all three nodes again; the node keeps its data and rejoins.
            try await TestCluster.restartingNode(firstPort) {
                for (index, purchase) in purchases.enumerated() {
                    if index == 40 { try await TestCluster.control("kill \(firstPort)") }
                    do {
                        ids.append(try await pipeline.upload(userId: "u\(index)", receiptData: purchase.receiptData))
                    } catch {
                        refused += 1
                    }
                }
                var credited = 0
                for id in ids where try await pipeline.waitForState(id, timeout: .seconds(60))["state"] as? String == "credited" {
                    credited += 1
                }
                print("cluster drill: \(ids.count) of \(total) uploads accepted, \(refused) refused, \(credited) credited")
                #expect(refused == 0, "the intake writes to its store first: a broker node's death refuses no upload")
                #expect(credited == ids.count)
                #expect(try await eventually { try await pipeline.store.outboxBacklog() == 0 })
            }
        }

        /// The whole pipeline on quorum queues: a retry waits in its delay queue, comes back
        /// through `verify.retries` and is credited.
        @Test func onQuorumQueues_aTransientAppleFailureIsRetriedAndCredited() async throws {
            let pipeline = try await PipelineHarness.start(name: "quorum-retry", retryDelays: [1], onCluster: true)
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            try await pipeline.injectFault(["httpStatus": 503, "count": 1])
            try await pipeline.injectFault(["status": 21005, "count": 1])
            let id = try await pipeline.upload(userId: "carol", receiptData: purchase.receiptData)
            let retrying = try await pipeline.waitForState(id, ["retrying", "credited", "rejected"])
            #expect(retrying["state"] as? String == "retrying")
            let status = try await pipeline.waitForState(id, timeout: .seconds(30))
            #expect(status["state"] as? String == "credited")
            #expect(status["attempts"] as? Int == 3)
        }

        @Test func aMessageItsConsumersKeepGivingBackIsDeadLetteredAfterTheDeliveryLimitWithItsReason() async throws {
            let names = TestCluster.names("delivery-limit")
            let topology = Topology.pipeline(names, retrySchedule: RetrySchedule(delaysSeconds: [1]))
            let publisher = AMQPConnection(
                configuration: try TestCluster.configuration(), topology: topology, logger: TestBroker.logger)
            #expect(await publisher.waitUntilConnected(timeout: .seconds(15)))
            try await publisher.publish(
                OutgoingMessage(routingKey: names.verify, body: Array("poison".utf8), messageId: "poison-1"))

            // Each round is a verifier that takes the message and fails: every other one gives
            // it back (requeue), the others die holding it (the connection closes unsettled).
            var deliveries = 0
            var deliveryCounts: [String] = []
            for round in 0..<(QueueType.defaultDeliveryLimit + 3) {
                let verifier = AMQPConnection(
                    configuration: try TestCluster.configuration(), topology: topology, logger: TestBroker.logger)
                let consumer = verifier.consume(queue: names.verify, prefetch: 1)
                guard let delivery = await nextDelivery(consumer, within: .seconds(5)) else {
                    await verifier.close()
                    break
                }
                deliveries += 1
                deliveryCounts.append(delivery.headers["x-delivery-count"] ?? "-")
                if round.isMultiple(of: 2) {
                    // Cancelled first, so the broker cannot hand it straight back to this consumer.
                    await consumer.cancel()
                    try await delivery.reject(requeue: true)
                }
                await verifier.close()
            }

            var dead: [DeadLetters.Entry] = []
            let landed = try await eventually(timeout: .seconds(20), interval: .milliseconds(100)) {
                dead = try await DeadLetters(connection: publisher).list(names.verifyDead, limit: 10)
                return !dead.isEmpty
            }
            print("delivery limit: \(deliveries) deliveries (x-delivery-count \(deliveryCounts)), then dead: \(dead.map { ($0.reason ?? "-", $0.from ?? "-") })")
            #expect(landed, "the message never reached \(names.verifyDead)")
            #expect(dead.count == 1)
            #expect(dead.first?.messageId == "poison-1")
            #expect(dead.first?.reason == "delivery_limit")
            #expect(dead.first?.from == names.verify)
            #expect(String(decoding: dead.first?.body ?? [], as: UTF8.self) == "poison")
            // Given back at most the limit allows, and no more after it died.
            #expect((QueueType.defaultDeliveryLimit...QueueType.defaultDeliveryLimit + 1).contains(deliveries))
            #expect(try await publisher.queueStatus(names.verify).messageCount == 0)
            await publisher.close()
        }
    }
}
