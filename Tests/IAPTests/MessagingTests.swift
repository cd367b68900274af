import Foundation
import Messaging
import NIOConcurrencyHelpers
import Testing
import TestSupport

extension BrokerTests {
    @Suite("Messaging against the live broker")
    struct MessagingTests {
        /// One work queue with a dead-letter queue, under a prefix of its own.
        struct Queues {
            let work: String
            let dead: String
            var topology: Topology {
                Topology(queues: [
                    .init(name: dead),
                    .init(
                        name: work,
                        arguments: [
                            "x-dead-letter-exchange": .string(""), "x-dead-letter-routing-key": .string(dead),
                        ]),
                ])
            }

            init(_ name: String) {
                let prefix = TestBroker.uniquePrefix(name)
                work = prefix + ".work"
                dead = prefix + ".dead"
            }
        }

        func connect(_ queues: Queues) async throws -> AMQPConnection {
            let connection = AMQPConnection(
                configuration: try TestBroker.configuration(), topology: queues.topology, logger: TestBroker.logger)
            let url = try TestBroker.url()
            #expect(await connection.waitUntilConnected(timeout: .seconds(15)), "cannot reach \(url)")
            return connection
        }

        func message(_ queue: String, _ number: Int) -> OutgoingMessage {
            OutgoingMessage(routingKey: queue, body: Array("message \(number)".utf8), headers: ["n": "\(number)"])
        }

        @Test func publishReturnsAfterTheBrokerConfirmsEveryMessage() async throws {
            let queues = Queues("confirms")
            let connection = try await connect(queues)
            try await withThrowingTaskGroup(of: Void.self) { group in
                for number in 0..<1000 {
                    group.addTask { try await connection.publish(message(queues.work, number)) }
                }
                try await group.waitForAll()
            }
            // Every confirmed message is in the queue at once: nothing was acked before it was stored.
            #expect(try await connection.queueStatus(queues.work).messageCount == 1000)
            await connection.close()
        }

        @Test func publishToAQueueThatDoesNotExistFails() async throws {
            let queues = Queues("unroutable")
            let connection = try await connect(queues)
            await #expect(throws: AMQPError.self) {
                try await connection.publish(message(queues.work + ".nowhere", 1))
            }
            // The connection stays usable.
            try await connection.publish(message(queues.work, 2))
            #expect(try await connection.queueStatus(queues.work).messageCount == 1)
            await connection.close()
        }

        @Test func prefetchLimitsUnackedDeliveries() async throws {
            let queues = Queues("prefetch")
            let connection = try await connect(queues)
            for number in 0..<20 { try await connection.publish(message(queues.work, number)) }
            let consumer = connection.consume(queue: queues.work, prefetch: 5)
            var iterator = consumer.makeAsyncIterator()
            var held: [AMQPDelivery] = []
            for _ in 0..<5 {
                if let delivery = await iterator.next() { held.append(delivery) }
            }
            #expect(held.map { $0.headers["n"] } == ["0", "1", "2", "3", "4"])
            // With five unacked, the broker sends nothing more.
            try await Task.sleep(for: .milliseconds(500))
            #expect(try await connection.queueStatus(queues.work).messageCount == 15)
            try await held[0].ack()
            let next = await iterator.next()
            #expect(next?.headers["n"] == "5")
            #expect(try await eventually { try await connection.queueStatus(queues.work).messageCount == 14 })
            await consumer.cancel()
            await connection.close()
        }

        @Test func rejectedMessageGoesToTheDeadLetterQueue() async throws {
            let queues = Queues("deadletter")
            let connection = try await connect(queues)
            try await connection.publish(message(queues.work, 7))
            let consumer = connection.consume(queue: queues.work, prefetch: 1)
            var iterator = consumer.makeAsyncIterator()
            let delivery = try #require(await iterator.next())
            try await delivery.reject(requeue: false)
            #expect(try await eventually { try await connection.queueStatus(queues.dead).messageCount == 1 })
            #expect(try await connection.queueStatus(queues.work).messageCount == 0)

            let deadConsumer = connection.consume(queue: queues.dead, prefetch: 1)
            var deadIterator = deadConsumer.makeAsyncIterator()
            let dead = try #require(await deadIterator.next())
            #expect(dead.body == Array("message 7".utf8))
            #expect(dead.headers["n"] == "7")
            try await dead.ack()
            await consumer.cancel()
            await deadConsumer.cancel()
            await connection.close()
        }

        /// A body's `content-encoding` travels with it: to a consumer, into a dead-letter
        /// queue by `deadLetter`, through an operator's listing and back by `redrive`.
        @Test func aDeflatedBodyKeepsItsEncodingThroughDeadLetteringAndRedrive() async throws {
            let queues = Queues("encoding")
            let connection = try await connect(queues)
            let text = Array(String(repeating: "a receipt repeats itself; ", count: 200).utf8)
            var message = OutgoingMessage(routingKey: queues.work, body: try ContentEncoding.deflate.encode(text))
            message.contentEncoding = ContentEncoding.deflate.rawValue
            try await connection.publish(message)
            let delivery = try #require(try await connection.get(queues.work))
            #expect(delivery.contentEncoding == "deflate" && delivery.body.count < text.count / 10)
            #expect(try delivery.decodedBody() == text)

            await connection.deadLetter(delivery, to: queues.dead, reason: "a test")
            let listed = try await DeadLetters(connection: connection).list(queues.dead, limit: 5)
            #expect(listed.count == 1 && listed.first?.contentEncoding == "deflate" && listed.first?.reason == "a test")
            #expect(try listed.first?.decodedBody() == text)

            #expect(try await DeadLetters(connection: connection).redrive(queues.dead, fallback: queues.work, limit: 5) == 1)
            let back = try #require(try await connection.get(queues.work))
            #expect(back.contentEncoding == "deflate")
            #expect(try back.decodedBody() == text)
            try await back.ack()
            await connection.close()
        }

        @Test func requeuedMessageIsDeliveredAgain() async throws {
            let queues = Queues("requeue")
            let connection = try await connect(queues)
            try await connection.publish(message(queues.work, 1))
            let consumer = connection.consume(queue: queues.work, prefetch: 1)
            var iterator = consumer.makeAsyncIterator()
            let first = try #require(await iterator.next())
            #expect(!first.redelivered)
            try await first.reject(requeue: true)
            let again = try #require(await iterator.next())
            #expect(again.redelivered)
            #expect(again.body == first.body)
            try await again.ack()
            await consumer.cancel()
            await connection.close()
        }

        @Test func whenBrokerRestarts_publishingAndConsumingResumeWithNothingLost() async throws {
            let queues = Queues("restart")
            let publisher = try await connect(queues)
            let consumerConnection = try await connect(queues)
            let received = NIOLockedValueBox(Set<String>())
            let consumer = consumerConnection.consume(queue: queues.work, prefetch: 50)
            let consuming = Task {
                for await delivery in consumer {
                    // A delivery from before the restart cannot be acked; it comes again.
                    if (try? await delivery.ack()) != nil, let n = delivery.headers["n"] {
                        received.withLockedValue { _ = $0.insert(n) }
                    }
                }
            }
            for number in 0..<100 { try await publisher.publish(message(queues.work, number)) }

            try await TestBroker.control("stop")
            let restarted = Task {
                try await Task.sleep(for: .seconds(2))
                try await TestBroker.control("start")
            }
            // Published while the broker is down: each call waits and returns once confirmed.
            try await withThrowingTaskGroup(of: Void.self) { group in
                for number in 100..<200 {
                    group.addTask { try await publisher.publish(message(queues.work, number)) }
                }
                try await group.waitForAll()
            }
            try await restarted.value
            #expect(publisher.isConnected)

            let all = Set((0..<200).map(String.init))
            let complete = try await eventually(timeout: .seconds(60)) { received.withLockedValue { $0 } == all }
            #expect(complete, "missing: \(all.subtracting(received.withLockedValue { $0 }).sorted().prefix(20))")
            await consumer.cancel()
            consuming.cancel()
            await publisher.close()
            await consumerConnection.close()
        }
    }
}
