import Foundation
import IAPCore
import Messaging
import Relay
import Testing
import TestSupport

extension BrokerTests {
    @Suite("First attempts before retries")
    struct PriorityTests {
        /// Classic queues on the single node: `verify` is a priority queue.
        @Test func newUploadIsVerifiedAheadOfTenThousandWaitingRetries() async throws {
            try await newUploadGoesFirst(onCluster: false)
        }

        func newUploadGoesFirst(onCluster: Bool) async throws {
            let pipeline = try await PipelineHarness.start(name: "priority", verifierConcurrency: 8, onCluster: onCluster)
            Teardown.add { await pipeline.stop() }
            // Apple at 20 ms: the backlog alone takes 10,000 / (8 / 0.02 s) = 25 s to drain.
            #expect(try await HTTP.post(pipeline.fakeURL + "/fake/config", json: ["latencyMs": 20]).status == 204)

            let connection = AMQPConnection(
                configuration: try onCluster ? TestCluster.configuration() : TestBroker.configuration(),
                topology: .pipeline(pipeline.names, retrySchedule: RetrySchedule(delaysSeconds: [1])),
                logger: TestBroker.logger)
            #expect(await connection.waitUntilConnected(timeout: .seconds(15)))
            let codec = MessageCodec()
            let unknownReceipt = Data("not a receipt the fake minted".utf8).base64EncodedString()
            // Where the verifier's own retries go: `verify` (classic) or `verify.retries` (quorum).
            let retryQueue = pipeline.names.verifyQueue(priority: VerifyPriority.retry)
            #expect(retryQueue == (onCluster ? pipeline.names.verifyRetries : pipeline.names.verify))
            try await withThrowingTaskGroup(of: Void.self) { group in
                for _ in 0..<10_000 {
                    let retry = VerifyRequest(
                        submissionId: UUID(), userId: "backlog", receiptData: unknownReceipt, attempt: 2,
                        acceptedAt: Date())
                    let body = try codec.encode(retry)
                    group.addTask {
                        try await connection.publish(
                            OutgoingMessage(routingKey: retryQueue, body: body, priority: VerifyPriority.retry))
                    }
                }
                try await group.waitForAll()
            }

            let purchase = try await pipeline.mint()
            let started = ContinuousClock.now
            let id = try await pipeline.upload(userId: "newcomer", receiptData: purchase.receiptData)
            let status = try await pipeline.waitForState(id, timeout: .seconds(20))
            let elapsed = ContinuousClock.now - started
            let stillWaiting = try await connection.queueStatus(retryQueue).messageCount
            #expect(status["state"] as? String == "credited")
            // Order, not speed, is the promise (a clock would flake on a loaded machine): the
            // backlog takes 25 s to drain, and most of it still waits.
            #expect(stillWaiting > 5_000, "the backlog drained first: \(stillWaiting) left after \(elapsed)")
            print(
                "priority (\(onCluster ? "quorum, cluster" : "classic")): new upload credited in \(elapsed) with \(stillWaiting) retries still waiting"
            )
            await connection.close()
        }
    }
}

extension ClusterDrills {
    @Suite("First attempts before retries, on quorum queues")
    struct PriorityOnClusterTests {
        /// Quorum queues on the cluster have no priorities: retries wait in a queue of their
        /// own, which verifiers serve only when no first attempt waits. With the cluster's other
        /// tests, which kill and cut off its nodes.
        @Test(.enabled(if: TestCluster.isAvailable, Comment(rawValue: TestCluster.missing)))
        func onQuorumQueues_newUploadIsVerifiedAheadOfTenThousandWaitingRetries() async throws {
            try await BrokerTests.PriorityTests().newUploadGoesFirst(onCluster: true)
        }
    }
}
