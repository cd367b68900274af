import Foundation
import IAPCore
import Intake
import Messaging
import Relay
import OrderStore
import Ledger
import Testing
import TestSupport

extension BrokerTests {
    @Suite("Nothing accepted is lost")
    struct ResilienceTests {
        @Test func uploadAcceptedWhileTheBrokerIsDownIsCreditedWhenItReturns() async throws {
            let pipeline = try await PipelineHarness.start(name: "outbox")
            Teardown.add { await pipeline.stop() }
            let purchases = [try await pipeline.mint(), try await pipeline.mint()]

            try await TestBroker.control("stop")
            var ids: [String] = []
            do {
                // The intake keeps answering 202: the upload is in the store and its outbox.
                for (index, purchase) in purchases.enumerated() {
                    ids.append(try await pipeline.upload(userId: "u\(index)", receiptData: purchase.receiptData))
                }
                #expect(try await pipeline.store.outboxBacklog() == 2)
                for id in ids { #expect(try await pipeline.status(id)["state"] as? String == "pending") }
            } catch {
                try await TestBroker.control("start")
                throw error
            }
            try await TestBroker.control("start")

            for id in ids {
                #expect(try await pipeline.waitForState(id, timeout: .seconds(60))["state"] as? String == "credited")
            }
            // The credit's own event goes out after the credit: the outbox empties a moment later.
            #expect(try await eventually { try await pipeline.store.outboxBacklog() == 0 })
        }

        @Test func undecodableMessageIsDeadLetteredAndTheRestKeepsFlowing() async throws {
            let pipeline = try await PipelineHarness.start(name: "poison")
            Teardown.add { await pipeline.stop() }
            let names = pipeline.names
            let connection = AMQPConnection(
                configuration: try TestBroker.configuration(),
                topology: .pipeline(names, retrySchedule: RetrySchedule(delaysSeconds: [1])), logger: TestBroker.logger)
            #expect(await connection.waitUntilConnected(timeout: .seconds(15)))
            try await connection.publish(OutgoingMessage(routingKey: names.verify, body: Array("{not an envelope".utf8)))
            try await connection.publish(OutgoingMessage(routingKey: names.results, body: Array("[]".utf8)))

            let purchase = try await pipeline.mint()
            let id = try await pipeline.upload(userId: "u1", receiptData: purchase.receiptData)
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            #expect(try await eventually { try await connection.queueStatus(names.verifyDead).messageCount == 1 })
            #expect(try await eventually { try await connection.queueStatus(names.resultsDead).messageCount == 1 })

            // The operator sees why, and listing leaves the messages in place.
            let listed = try await DeadLetters(connection: connection).list(names.verifyDead, limit: 10)
            #expect(listed.count == 1)
            #expect(listed.first?.reason?.hasPrefix("undecodable verify request") == true)
            #expect(listed.first?.from == names.verify)
            #expect(try await eventually { try await connection.queueStatus(names.verifyDead).messageCount == 1 })
            await connection.close()
        }

        /// A verify message deflated by its publisher (AMQP's `content-encoding`) is read and
        /// credited; one in an encoding no verifier reads is dead-lettered saying so, listed
        /// with its encoding and its body as it came.
        @Test func aDeflatedVerifyMessageIsCreditedAndAnUnknownEncodingIsDeadLettered() async throws {
            let pipeline = try await PipelineHarness.start(name: "encoding")
            Teardown.add { await pipeline.stop() }
            let names = pipeline.names
            // The upload's own message is parked; a deflated copy goes to the verifiers.
            let (request, connection) = try await pipeline.parkedUpload(by: "olga")
            Teardown.add { await connection.close() }
            let plain = try MessageCodec().encode(request)
            var deflated = OutgoingMessage(routingKey: names.verify, body: try ContentEncoding.deflate.encode(plain))
            deflated.contentEncoding = ContentEncoding.deflate.rawValue
            #expect(deflated.body.count < plain.count * 2 / 3, "\(deflated.body.count) of \(plain.count) bytes")
            try await connection.publish(deflated)
            let status = try await pipeline.waitForState(request.submissionId.uuidString, timeout: .seconds(30))
            #expect(status["state"] as? String == "credited")

            var unknown = OutgoingMessage(routingKey: names.verify, body: plain)
            unknown.contentEncoding = "br"
            try await connection.publish(unknown)
            #expect(try await eventually { try await connection.queueStatus(names.verifyDead).messageCount == 2 })
            let listed = try await DeadLetters(connection: connection).list(names.verifyDead, limit: 10)
            let refused = try #require(listed.first { $0.contentEncoding == "br" }, "\(listed.map(\.reason))")
            #expect(refused.reason?.contains("content-encoding 'br'") == true, "\(refused.reason ?? "")")
            #expect(refused.body == plain)
        }

        @Test func lostMessageIsRecoveredByTheSweeper() async throws {
            let pipeline = try await PipelineHarness.start(
                name: "sweeper",
                sweeper: SweeperSettings(interval: .milliseconds(300), pendingAfter: .seconds(1), retryGrace: .seconds(1)))
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            // Accepted, but its message went where no verifier looks (as if lost with a broker).
            let request = VerifyRequest(
                submissionId: UUID(), userId: "judy", receiptData: purchase.receiptData, acceptedAt: Date())
            try await pipeline.store.accept(
                request,
                message: OutboxMessage(routingKey: pipeline.names.verifyDead, body: try MessageCodec().encode(request)))
            let status = try await pipeline.waitForState(request.submissionId.uuidString, timeout: .seconds(15))
            #expect(status["state"] as? String == "credited")
            #expect(status["attempts"] as? Int == 1)
        }

        @Test func deadLetteredUploadIsCreditedAfterRedrive() async throws {
            let pipeline = try await PipelineHarness.start(name: "redrive")
            Teardown.add { await pipeline.stop() }
            let names = pipeline.names
            let (request, connection) = try await pipeline.parkedUpload(by: "ivan")
            #expect(try await eventually { try await connection.queueStatus(names.verifyDead).messageCount == 1 })
            #expect(try await pipeline.status(request.submissionId.uuidString)["state"] as? String == "pending")

            let moved = try await DeadLetters(connection: connection).redrive(
                names.verifyDead, fallback: names.verify, limit: 10, priority: VerifyPriority.retry)
            #expect(moved == 1)
            #expect(try await pipeline.waitForState(request.submissionId.uuidString)["state"] as? String == "credited")
            await connection.close()
        }
    }
}
