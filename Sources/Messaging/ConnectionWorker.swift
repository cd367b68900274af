import CRabbitMQ
import Foundation
import Logging

/// Everything that touches one rabbitmq-c connection. It is created on the
/// connection's own thread and never leaves it; see `AMQPConnection` for the model.
final class ConnectionWorker {
    private static let firstPublishChannel: amqp_channel_t = 1
    private static let queryChannel: amqp_channel_t = 2
    private static let firstConsumerChannel: amqp_channel_t = 3
    private static let publishIdHeader = "x-iap-publish-id"

    private struct Consumer {
        var registration: ConsumerRegistration
        var channel: amqp_channel_t
        var consumerTag: String?
    }

    private let configuration: AMQPConfiguration
    private let topology: Topology
    private let mailbox: Mailbox
    private let logger: Logger

    private var connection: amqp_connection_state_t?
    private var socketFD: Int32 = -1
    private var queryChannelOpen = false
    /// Counts connections; deliveries remember theirs so acks for a dead one are refused.
    private var generation: UInt64 = 0
    /// Counts reopenings of the query channel within a connection: a `get` from before a
    /// reopening cannot be settled (its tag now means another message).
    private var queryChannelEpoch: UInt64 = 0
    private var nextDeliveryTag: UInt64 = 1
    /// Sent publishes by delivery tag, waiting for the broker's ack or nack.
    private var unconfirmed: [UInt64: PendingPublish] = [:]
    /// Publishes not sent yet (disconnected), oldest first.
    private var waiting: [PendingPublish] = []
    /// Ids of publishes the broker returned as unroutable; their ack fails them.
    private var returned: Set<UInt64> = []
    private var consumers: [Int: Consumer] = [:]
    private var nextConsumerChannel = ConnectionWorker.firstConsumerChannel
    /// The channel publishes go out on: channel 1 on a new connection, a fresh number each
    /// time it is reopened within one (see `reopenPublishChannel`).
    private var publishChannel = ConnectionWorker.firstPublishChannel
    /// Whether a refused publish reopens the publish channel: with quorum queues (below).
    private let reopensPublishChannelOnNack: Bool
    private var reconnectDelay: Duration
    private var nextConnectAttempt = ContinuousClock.now
    /// The node of `configuration.nodes` connected to, or tried next.
    private var nodeIndex = 0
    /// Connection attempts that failed since the last success; every node failing once
    /// in a row (a round) brings the next, longer delay.
    private var failedAttempts = 0
    private var shutdownWaiters: [CheckedContinuation<Void, Never>] = []
    /// Publishes cancelled before they reached this thread (the cancel can overtake them).
    private var cancelledBeforeArrival: Set<UInt64> = []
    private var shutdownDeadline: ContinuousClock.Instant?

    init(configuration: AMQPConfiguration, topology: Topology, mailbox: Mailbox, logger: Logger) {
        self.configuration = configuration
        self.topology = topology
        self.mailbox = mailbox
        self.logger = logger
        self.reconnectDelay = configuration.minimumReconnectDelay
        self.reopensPublishChannelOnNack = topology.queues.contains { $0.arguments["x-queue-type"] == .string("quorum") }
    }

    // MARK: - Loop

    /// Runs until a shutdown command has been handled.
    func run() {
        while true {
            if let deadline = shutdownDeadline, unconfirmed.isEmpty || connection == nil || .now >= deadline {
                break
            }
            if connection == nil && shutdownDeadline == nil {
                // Commands wake the loop while disconnected; they do not hurry the next attempt.
                if ContinuousClock.now < nextConnectAttempt {
                    waitForWork(timeout: nextConnectAttempt - ContinuousClock.now)
                    handle(mailbox.takeAll())
                    continue
                }
                if !connect() {
                    failedAttempts += 1
                    if failedAttempts % configuration.nodes.count == 0 {
                        nextConnectAttempt = ContinuousClock.now + reconnectDelay
                        reconnectDelay = min(reconnectDelay * 2, configuration.maximumReconnectDelay)
                    }
                    handle(mailbox.takeAll())
                    continue
                }
                failedAttempts = 0
                reconnectDelay = configuration.minimumReconnectDelay
            }
            var busy = handle(mailbox.takeAll())
            busy = readFrames() || busy
            if !busy {
                waitForWork(timeout: pollInterval)
            }
        }
        finish()
    }

    private var pollInterval: Duration {
        configuration.heartbeatSeconds > 0
            ? .milliseconds(configuration.heartbeatSeconds * 250) : .seconds(1)
    }

    /// Sleeps until the socket or the mailbox has something, or `timeout` passes.
    private func waitForWork(timeout: Duration) {
        if let connection, amqp_frames_enqueued(connection) != 0 || amqp_data_in_buffer(connection) != 0 {
            return
        }
        var fds = [pollfd(fd: mailbox.wakeReadFD, events: Int16(POLLIN), revents: 0)]
        if connection != nil && socketFD >= 0 {
            fds.append(pollfd(fd: socketFD, events: Int16(POLLIN), revents: 0))
        }
        let milliseconds = timeout.components.seconds * 1000 + timeout.components.attoseconds / 1_000_000_000_000_000
        _ = poll(&fds, nfds_t(fds.count), Int32(max(1, min(milliseconds, 60_000))))
    }

    // MARK: - Commands

    /// Carries out commands; true if there were any.
    @discardableResult
    private func handle(_ commands: [Command]) -> Bool {
        for command in commands {
            switch command {
            case .publish(let publish):
                if cancelledBeforeArrival.remove(publish.id) != nil {
                    publish.done.resume(returning: .failure(AMQPError(.cancelled, "cancelled before it was sent")))
                } else if connection != nil && waiting.isEmpty {
                    send(publish)
                } else {
                    waiting.append(publish)
                }
            case .cancelPublish(let id):
                if let index = waiting.firstIndex(where: { $0.id == id }) {
                    let publish = waiting.remove(at: index)
                    publish.done.resume(returning: .failure(AMQPError(.cancelled, "cancelled before it was sent")))
                } else if !unconfirmed.values.contains(where: { $0.id == id }) {
                    if cancelledBeforeArrival.count > 10_000 { cancelledBeforeArrival.removeAll() }
                    cancelledBeforeArrival.insert(id)
                }
            case .consume(let registration):
                let channel = nextConsumerChannel
                nextConsumerChannel += 1
                consumers[registration.id] = Consumer(registration: registration, channel: channel)
                if connection != nil, !startConsumer(id: registration.id) {
                    lose("could not start a consumer")
                }
            case .cancelConsumer(let id, let done):
                cancelConsumer(id: id)
                done.resume()
            case .settle(let settlement, let channel, let generation, let epoch, let deliveryTag, let done):
                done.resume(
                    returning: settle(settlement, channel: channel, generation: generation, epoch: epoch, tag: deliveryTag))
            case .queueStatus(let queue, let done):
                done.resume(returning: queueStatus(queue))
            case .get(let queue, let done):
                done.resume(returning: get(queue))
            case .shutdown(let done):
                shutdownWaiters.append(done)
                if shutdownDeadline == nil {
                    shutdownDeadline = .now + .seconds(5)
                    for id in Array(consumers.keys) { cancelConsumer(id: id) }
                    for publish in waiting {
                        publish.done.resume(returning: .failure(AMQPError(.shutdown, "the connection is closing")))
                    }
                    waiting.removeAll()
                }
            }
        }
        return !commands.isEmpty
    }

    private func send(_ publish: PendingPublish) {
        guard let connection else {
            waiting.append(publish)
            return
        }
        let arena = CArena()
        var headers = publish.message.headers.map { ($0.key, Topology.ArgumentValue.string($0.value)) }
        headers.append((Self.publishIdHeader, .string(String(publish.id))))
        var properties = amqp_basic_properties_t()
        properties._flags =
            amqp_flags_t(AMQP_BASIC_CONTENT_TYPE_FLAG) | amqp_flags_t(AMQP_BASIC_DELIVERY_MODE_FLAG)
            | amqp_flags_t(AMQP_BASIC_HEADERS_FLAG)
        properties.content_type = arena.bytes(publish.message.contentType)
        properties.delivery_mode = 2  // persistent
        properties.headers = arena.table(headers)
        if let messageId = publish.message.messageId {
            properties._flags |= amqp_flags_t(AMQP_BASIC_MESSAGE_ID_FLAG)
            properties.message_id = arena.bytes(messageId)
        }
        if let contentEncoding = publish.message.contentEncoding {
            properties._flags |= amqp_flags_t(AMQP_BASIC_CONTENT_ENCODING_FLAG)
            properties.content_encoding = arena.bytes(contentEncoding)
        }
        if let priority = publish.message.priority {
            properties._flags |= amqp_flags_t(AMQP_BASIC_PRIORITY_FLAG)
            properties.priority = priority
        }
        if let expiration = publish.message.expiration {
            let milliseconds = max(0, expiration.components.seconds * 1000 + expiration.components.attoseconds / 1_000_000_000_000_000)
            properties._flags |= amqp_flags_t(AMQP_BASIC_EXPIRATION_FLAG)
            properties.expiration = arena.bytes(String(milliseconds))
        }
        let status = amqp_basic_publish(
            connection, publishChannel, arena.bytes(publish.message.exchange),
            arena.bytes(publish.message.routingKey), publish.message.mandatory ? 1 : 0, 0, &properties,
            arena.bytes(publish.message.body))
        guard status == AMQP_STATUS_OK.rawValue else {
            waiting.insert(publish, at: 0)
            lose("publish failed: \(Self.describe(status: status))")
            return
        }
        unconfirmed[nextDeliveryTag] = publish
        nextDeliveryTag += 1
    }

    private func settle(_ settlement: Settlement, channel: UInt16, generation: UInt64, epoch: UInt64, tag: UInt64)
        -> Result<Void, AMQPError>
    {
        guard let connection, generation == self.generation,
            channel != Self.queryChannel || epoch == queryChannelEpoch
        else {
            return .failure(AMQPError(.staleDelivery, "the connection of this delivery is gone; it will be redelivered"))
        }
        let status: Int32
        switch settlement {
        case .ack: status = amqp_basic_ack(connection, channel, tag, 0)
        case .requeue: status = amqp_basic_nack(connection, channel, tag, 0, 1)
        case .deadLetter: status = amqp_basic_nack(connection, channel, tag, 0, 0)
        }
        guard status == AMQP_STATUS_OK.rawValue else {
            let message = Self.describe(status: status)
            lose("settling a delivery failed: \(message)")
            return .failure(AMQPError(.staleDelivery, message))
        }
        return .success(())
    }

    /// Opens the channel used for queries and single gets, if needed.
    private func openQueryChannel() -> Result<amqp_connection_state_t, AMQPError> {
        guard let connection else {
            return .failure(AMQPError(.connectionFailed, "not connected to the broker"))
        }
        if !queryChannelOpen {
            queryChannelEpoch += 1
            amqp_channel_open(connection, Self.queryChannel)
            if let failure = Self.failure(of: amqp_get_rpc_reply(connection)) {
                lose("could not open the query channel: \(failure)")
                return .failure(AMQPError(.connectionFailed, failure))
            }
            queryChannelOpen = true
        }
        return .success(connection)
    }

    /// Takes one message from a queue (`basic.get`, manual ack), or nil when it is empty.
    private func get(_ queue: String) -> Result<AMQPDelivery?, AMQPError> {
        let connection: amqp_connection_state_t
        switch openQueryChannel() {
        case .success(let open): connection = open
        case .failure(let error): return .failure(error)
        }
        let arena = CArena()
        let reply = amqp_basic_get(connection, Self.queryChannel, arena.bytes(queue), 0)
        if let failure = Self.failure(of: reply) {
            queryChannelOpen = false
            if Self.isChannelClose(reply) {
                var closeOk = amqp_channel_close_ok_t(dummy: 0)
                amqp_send_method(connection, Self.queryChannel, AMQPMethod.channelCloseOk, &closeOk)
                return .failure(AMQPError(.channelClosed, failure))
            }
            lose("basic.get failed: \(failure)")
            return .failure(AMQPError(.connectionFailed, failure))
        }
        guard reply.reply.id == AMQPMethod.basicGetOk else { return .success(nil) }
        let ok = reply.reply.decoded.assumingMemoryBound(to: amqp_basic_get_ok_t.self).pointee
        let tag = ok.delivery_tag
        let redelivered = ok.redelivered != 0
        let exchange = ok.exchange.string
        let routingKey = ok.routing_key.string
        var message = amqp_message_t()
        let read = amqp_read_message(connection, Self.queryChannel, &message, 0)
        if let failure = Self.failure(of: read) {
            lose("reading a fetched message failed: \(failure)")
            return .failure(AMQPError(.connectionFailed, failure))
        }
        defer { amqp_destroy_message(&message) }
        return .success(delivery(from: message, tag: tag, redelivered: redelivered, exchange: exchange,
            routingKey: routingKey, channel: Self.queryChannel))
    }

    /// Copies what a consumer needs out of a message the library owns.
    private func delivery(
        from message: amqp_message_t, tag: UInt64, redelivered: Bool, exchange: String, routingKey: String,
        channel: amqp_channel_t
    ) -> AMQPDelivery {
        let flags = message.properties._flags
        var headers: [String: String] = [:]
        if flags & amqp_flags_t(AMQP_BASIC_HEADERS_FLAG) != 0 {
            headers = message.properties.headers.stringHeaders
            headers[Self.publishIdHeader] = nil
            // As RabbitMQ 3.13 and later send them: the newest death, where `x-first-death-*`
            // keep the oldest (for a retry that is its expiry in a delay queue).
            let death = message.properties.headers.lastDeath
            if headers["x-last-death-reason"] == nil, let reason = death["reason"] {
                headers["x-last-death-reason"] = reason
                headers["x-last-death-queue"] = death["queue"]
            }
        }
        let messageId =
            flags & amqp_flags_t(AMQP_BASIC_MESSAGE_ID_FLAG) != 0 ? message.properties.message_id.string : nil
        let contentEncoding =
            flags & amqp_flags_t(AMQP_BASIC_CONTENT_ENCODING_FLAG) != 0 ? message.properties.content_encoding.string : nil
        return AMQPDelivery(
            body: message.body.array, headers: headers, exchange: exchange, routingKey: routingKey,
            redelivered: redelivered, messageId: messageId, contentEncoding: contentEncoding, deliveryTag: tag, channel: channel,
            generation: generation, channelEpoch: channel == Self.queryChannel ? queryChannelEpoch : 0,
            mailbox: mailbox)
    }

    private func queueStatus(_ queue: String) -> Result<QueueStatus, AMQPError> {
        let connection: amqp_connection_state_t
        switch openQueryChannel() {
        case .success(let open): connection = open
        case .failure(let error): return .failure(error)
        }
        let arena = CArena()
        let ok = amqp_queue_declare(
            connection, Self.queryChannel, arena.bytes(queue), 1, 0, 0, 0, arena.table([]))
        let reply = amqp_get_rpc_reply(connection)
        if let failure = Self.failure(of: reply) {
            queryChannelOpen = false
            if Self.isChannelClose(reply) {
                var closeOk = amqp_channel_close_ok_t(dummy: 0)
                amqp_send_method(connection, Self.queryChannel, AMQPMethod.channelCloseOk, &closeOk)
                return .failure(AMQPError(.channelClosed, failure))
            }
            lose("queue query failed: \(failure)")
            return .failure(AMQPError(.connectionFailed, failure))
        }
        guard let ok else { return .failure(AMQPError(.connectionFailed, "no declare-ok")) }
        return .success(QueueStatus(messageCount: Int(ok.pointee.message_count), consumerCount: Int(ok.pointee.consumer_count)))
    }

    private func cancelConsumer(id: Int) {
        guard let consumer = consumers.removeValue(forKey: id) else { return }
        if let connection, let tag = consumer.consumerTag {
            let arena = CArena()
            amqp_basic_cancel(connection, consumer.channel, arena.bytes(tag))
            if let failure = Self.failure(of: amqp_get_rpc_reply(connection)) {
                lose("cancelling a consumer failed: \(failure)")
            }
        }
        consumer.registration.deliveries.finish()
    }

    // MARK: - Frames

    /// Reads what the broker sent; true if anything arrived.
    private func readFrames() -> Bool {
        var any = false
        for _ in 0..<256 {
            guard let connection else { return any }
            var frame = amqp_frame_t()
            // Not zero: with a zero timeout the library never compares against the broker's
            // heartbeat deadline, and a silent broker would go unnoticed until TCP gives up.
            var almostNow = timeval(tv_sec: 0, tv_usec: 1)
            let status = amqp_simple_wait_frame_noblock(connection, &frame, &almostNow)
            if status == AMQP_STATUS_TIMEOUT.rawValue { return any }
            guard status == AMQP_STATUS_OK.rawValue else {
                lose("reading from the broker failed: \(Self.describe(status: status))")
                return true
            }
            any = true
            if frame.frame_type == UInt8(AMQP_FRAME_METHOD) {
                handleMethod(frame.payload.method, channel: frame.channel)
            }
            if let connection = self.connection {
                amqp_maybe_release_buffers(connection)
            }
        }
        return any
    }

    private func handleMethod(_ method: amqp_method_t, channel: amqp_channel_t) {
        guard let connection else { return }
        switch method.id {
        case AMQPMethod.basicDeliver:
            let deliver = method.decoded.assumingMemoryBound(to: amqp_basic_deliver_t.self).pointee
            let tag = deliver.delivery_tag
            let redelivered = deliver.redelivered != 0
            let exchange = deliver.exchange.string
            let routingKey = deliver.routing_key.string
            var message = amqp_message_t()
            let reply = amqp_read_message(connection, channel, &message, 0)
            if let failure = Self.failure(of: reply) {
                lose("reading a delivery failed: \(failure)")
                return
            }
            defer { amqp_destroy_message(&message) }
            let delivery = self.delivery(
                from: message, tag: tag, redelivered: redelivered, exchange: exchange, routingKey: routingKey,
                channel: channel)
            let consumer = consumers.values.first { $0.channel == channel }
            var handed = false
            if let consumer, case .enqueued = consumer.registration.deliveries.yield(delivery) {
                handed = true
            }
            if !handed {
                amqp_basic_nack(connection, channel, tag, 0, 1)
            }
        case AMQPMethod.basicAck where channel == publishChannel:
            let ack = method.decoded.assumingMemoryBound(to: amqp_basic_ack_t.self).pointee
            confirm(upTo: ack.delivery_tag, multiple: ack.multiple != 0, acked: true)
        case AMQPMethod.basicNack where channel == publishChannel:
            let nack = method.decoded.assumingMemoryBound(to: amqp_basic_nack_t.self).pointee
            confirm(upTo: nack.delivery_tag, multiple: nack.multiple != 0, acked: false)
            if reopensPublishChannelOnNack {
                reopenPublishChannel()
            }
        case AMQPMethod.basicReturn:
            var message = amqp_message_t()
            let reply = amqp_read_message(connection, channel, &message, 0)
            if let failure = Self.failure(of: reply) {
                lose("reading a returned message failed: \(failure)")
                return
            }
            defer { amqp_destroy_message(&message) }
            if message.properties._flags & amqp_flags_t(AMQP_BASIC_HEADERS_FLAG) != 0,
                let id = message.properties.headers.stringHeaders[Self.publishIdHeader].flatMap(UInt64.init)
            {
                returned.insert(id)
            }
        case AMQPMethod.channelClose:
            let close = method.decoded.assumingMemoryBound(to: amqp_channel_close_t.self).pointee
            let reason = "channel \(channel) closed by the broker: \(close.reply_code) \(close.reply_text.string)"
            var closeOk = amqp_channel_close_ok_t(dummy: 0)
            amqp_send_method(connection, channel, AMQPMethod.channelCloseOk, &closeOk)
            if channel == publishChannel {
                // The broker refused something we published: do not resend it forever.
                failUnconfirmed(AMQPError(.channelClosed, reason))
            }
            lose(reason)
        case AMQPMethod.connectionClose:
            let close = method.decoded.assumingMemoryBound(to: amqp_connection_close_t.self).pointee
            var closeOk = amqp_connection_close_ok_t(dummy: 0)
            amqp_send_method(connection, 0, AMQPMethod.connectionCloseOk, &closeOk)
            lose("connection closed by the broker: \(close.reply_code) \(close.reply_text.string)")
        case AMQPMethod.basicCancel:
            lose("the broker cancelled a consumer (its queue was deleted?)")
        default:
            break
        }
    }

    private func confirm(upTo tag: UInt64, multiple: Bool, acked: Bool) {
        let tags = multiple ? unconfirmed.keys.filter { $0 <= tag } : (unconfirmed[tag] == nil ? [] : [tag])
        for settledTag in tags {
            guard let publish = unconfirmed.removeValue(forKey: settledTag) else { continue }
            if !acked {
                publish.done.resume(returning: .failure(AMQPError(.nacked, "the broker did not store the message")))
            } else if returned.remove(publish.id) != nil {
                publish.done.resume(
                    returning: .failure(
                        AMQPError(.unroutable, "no queue is bound for routing key \(publish.message.routingKey)")))
            } else {
                publish.done.resume(returning: .success(()))
            }
        }
    }

    /// Replaces the publish channel by a new one and sends its unconfirmed publishes again there.
    ///
    /// Seen with RabbitMQ 3.10: a channel whose first publish to a quorum queue came while
    /// the queue was electing a new leader (a failover) had everything it published to that
    /// queue refused (nacked) for as long as it lived, by all signs because it kept the dead
    /// leader. The refused publishes fail to their callers; the next ones go out on a new
    /// channel, which learns the current leader.
    ///
    /// - Important: The new channel gets a number never used on this connection, so that acks
    ///   still in flight for the old one cannot settle the new channel's delivery tags.
    private func reopenPublishChannel() {
        guard let connection else { return }
        guard nextConsumerChannel < 60_000 else {
            lose("publish channel numbers used up")
            return
        }
        let old = publishChannel
        publishChannel = nextConsumerChannel
        nextConsumerChannel += 1
        logger.warning(
            "AMQP publish channel reopened after a refused publish",
            metadata: ["amqp.url": "\(node.redactedURL)", "amqp.channel": "\(publishChannel)"])
        do throws(AMQPError) {
            try Self.check(amqp_channel_close(connection, old, AMQP_REPLY_SUCCESS), "closing the old publish channel")
            amqp_channel_open(connection, publishChannel)
            try Self.check(amqp_get_rpc_reply(connection), "opening a new publish channel")
            amqp_confirm_select(connection, publishChannel)
            try Self.check(amqp_get_rpc_reply(connection), "selecting publisher confirms")
        } catch {
            lose(error.message)
            return
        }
        let resend = unconfirmed.keys.sorted().compactMap { unconfirmed[$0] }
        unconfirmed.removeAll()
        nextDeliveryTag = 1
        for publish in resend { send(publish) }
    }

    private func failUnconfirmed(_ error: AMQPError) {
        for tag in unconfirmed.keys.sorted() {
            unconfirmed[tag]?.done.resume(returning: .failure(error))
        }
        unconfirmed.removeAll()
    }

    // MARK: - Connection

    /// The node connected to, or tried next.
    private var node: AMQPConfiguration.Node { configuration.nodes[nodeIndex] }

    /// Round-robin: the next attempt goes to the next node of the list.
    private func moveToNextNode() {
        nodeIndex = (nodeIndex + 1) % configuration.nodes.count
    }

    /// Connects to the current node; on failure the next attempt goes to the next node.
    private func connect() -> Bool {
        guard let connection = amqp_new_connection() else { return false }
        guard let socket = amqp_tcp_socket_new(connection) else {
            amqp_destroy_connection(connection)
            return false
        }
        let node = self.node
        let arena = CArena()
        let timeout = configuration.connectTimeout.components
        var tv = timeval(tv_sec: Int(timeout.seconds), tv_usec: Int(timeout.attoseconds / 1_000_000_000_000))
        let opened = amqp_socket_open_noblock(socket, arena.cString(node.host), Int32(node.port), &tv)
        guard opened == AMQP_STATUS_OK.rawValue else {
            logger.debug(
                "AMQP connect failed",
                metadata: ["amqp.url": "\(node.redactedURL)", "error": "\(Self.describe(status: opened))"])
            amqp_destroy_connection(connection)
            moveToNextNode()
            return false
        }
        publishChannel = Self.firstPublishChannel
        do throws(AMQPError) {
            try Self.check(
                iap_amqp_login_plain(
                    connection, arena.cString(node.virtualHost), 0, 131_072,
                    Int32(configuration.heartbeatSeconds), arena.cString(node.user),
                    arena.cString(node.password), arena.cString(configuration.connectionName)), "login")
            amqp_channel_open(connection, publishChannel)
            try Self.check(amqp_get_rpc_reply(connection), "opening the publish channel")
            amqp_confirm_select(connection, publishChannel)
            try Self.check(amqp_get_rpc_reply(connection), "selecting publisher confirms")
            try declare(topology, on: connection)
        } catch {
            logger.warning(
                "AMQP handshake failed",
                metadata: ["amqp.url": "\(node.redactedURL)", "error": "\(error.message)"])
            amqp_connection_close(connection, 200)
            amqp_destroy_connection(connection)
            moveToNextNode()
            return false
        }
        self.connection = connection
        self.socketFD = amqp_get_sockfd(connection)
        generation += 1
        nextDeliveryTag = 1
        returned.removeAll()
        queryChannelOpen = false
        for id in consumers.keys.sorted() where !startConsumer(id: id) {
            lose("could not start consumers")
            return false
        }
        mailbox.isConnected = true
        mailbox.connectedNode = node.redactedURL
        logger.info("AMQP connected", metadata: ["amqp.url": "\(node.redactedURL)"])
        let resend = waiting
        waiting.removeAll()
        for publish in resend { send(publish) }
        return self.connection != nil
    }

    private func declare(_ topology: Topology, on connection: amqp_connection_state_t) throws(AMQPError) {
        let arena = CArena()
        let empty = arena.table([])
        for exchange in topology.exchanges {
            amqp_exchange_declare(
                connection, publishChannel, arena.bytes(exchange.name), arena.bytes(exchange.type), 0, 1, 0, 0,
                empty)
            try Self.check(amqp_get_rpc_reply(connection), "declaring exchange \(exchange.name)")
        }
        for queue in topology.queues {
            let arguments = queue.arguments.sorted { $0.key < $1.key }.map { ($0.key, $0.value) }
            amqp_queue_declare(
                connection, publishChannel, arena.bytes(queue.name), 0, 1, 0, 0, arena.table(arguments))
            try Self.check(amqp_get_rpc_reply(connection), "declaring queue \(queue.name)")
        }
        for binding in topology.bindings {
            amqp_queue_bind(
                connection, publishChannel, arena.bytes(binding.queue), arena.bytes(binding.exchange),
                arena.bytes(binding.routingKey), empty)
            try Self.check(amqp_get_rpc_reply(connection), "binding \(binding.queue) to \(binding.exchange)")
        }
    }

    /// Opens the consumer's channel and starts consuming; false if the connection broke.
    private func startConsumer(id: Int) -> Bool {
        guard let connection, let consumer = consumers[id] else { return true }
        let arena = CArena()
        do throws(AMQPError) {
            amqp_channel_open(connection, consumer.channel)
            try Self.check(amqp_get_rpc_reply(connection), "opening a consumer channel")
            amqp_basic_qos(connection, consumer.channel, 0, consumer.registration.prefetch, 0)
            try Self.check(amqp_get_rpc_reply(connection), "setting the prefetch")
            let ok = amqp_basic_consume(
                connection, consumer.channel, arena.bytes(consumer.registration.queue), amqp_bytes_t(len: 0, bytes: nil),
                0, 0, 0, arena.table([]))
            try Self.check(amqp_get_rpc_reply(connection), "consuming from \(consumer.registration.queue)")
            consumers[id]?.consumerTag = ok?.pointee.consumer_tag.string
            return true
        } catch {
            logger.error(
                "AMQP consumer failed to start",
                metadata: ["amqp.queue": "\(consumer.registration.queue)", "error": "\(error.message)"])
            return false
        }
    }

    /// Drops a broken connection; unconfirmed publishes wait to be sent again, on the
    /// next node when there are several.
    private func lose(_ reason: String) {
        guard let connection else { return }
        logger.warning("AMQP connection lost", metadata: ["amqp.url": "\(node.redactedURL)", "reason": "\(reason)"])
        amqp_connection_close(connection, 200)
        amqp_destroy_connection(connection)
        self.connection = nil
        socketFD = -1
        mailbox.isConnected = false
        mailbox.connectedNode = nil
        moveToNextNode()
        let resend = unconfirmed.keys.sorted().compactMap { unconfirmed[$0] }
        unconfirmed.removeAll()
        if shutdownDeadline != nil {
            for publish in resend {
                publish.done.resume(returning: .failure(AMQPError(.shutdown, "closed before the broker confirmed")))
            }
        } else {
            waiting.insert(contentsOf: resend, at: 0)
        }
    }

    private func finish() {
        if let connection {
            amqp_connection_close(connection, 200)
            amqp_destroy_connection(connection)
            self.connection = nil
            mailbox.isConnected = false
            mailbox.connectedNode = nil
        }
        let error = AMQPError(.shutdown, "the connection closed before the broker confirmed")
        failUnconfirmed(error)
        for publish in waiting { publish.done.resume(returning: .failure(error)) }
        waiting.removeAll()
        for consumer in consumers.values { consumer.registration.deliveries.finish() }
        consumers.removeAll()
        // Commands that raced with the shutdown.
        for command in mailbox.takeAll() {
            switch command {
            case .publish(let publish): publish.done.resume(returning: .failure(error))
            case .cancelPublish: break
            case .consume(let registration): registration.deliveries.finish()
            case .cancelConsumer(_, let done): done.resume()
            case .settle(_, _, _, _, _, let done): done.resume(returning: .failure(error))
            case .queueStatus(_, let done): done.resume(returning: .failure(error))
            case .get(_, let done): done.resume(returning: .failure(error))
            case .shutdown(let done): shutdownWaiters.append(done)
            }
        }
        logger.debug("AMQP connection closed", metadata: ["amqp.url": "\(configuration.redactedURL)"])
        for waiter in shutdownWaiters { waiter.resume() }
    }

    // MARK: - Replies

    private static func check(_ reply: amqp_rpc_reply_t, _ what: String) throws(AMQPError) {
        if let failure = failure(of: reply) {
            throw AMQPError(.connectionFailed, "\(what): \(failure)")
        }
    }

    private static func isChannelClose(_ reply: amqp_rpc_reply_t) -> Bool {
        reply.reply_type == AMQP_RESPONSE_SERVER_EXCEPTION && reply.reply.id == AMQPMethod.channelClose
    }

    /// A readable failure, or nil for a normal reply.
    private static func failure(of reply: amqp_rpc_reply_t) -> String? {
        switch reply.reply_type {
        case AMQP_RESPONSE_NORMAL:
            return nil
        case AMQP_RESPONSE_LIBRARY_EXCEPTION:
            return describe(status: reply.library_error)
        case AMQP_RESPONSE_SERVER_EXCEPTION:
            switch reply.reply.id {
            case AMQPMethod.connectionClose:
                let close = reply.reply.decoded.assumingMemoryBound(to: amqp_connection_close_t.self).pointee
                return "connection closed by the broker: \(close.reply_code) \(close.reply_text.string)"
            case AMQPMethod.channelClose:
                let close = reply.reply.decoded.assumingMemoryBound(to: amqp_channel_close_t.self).pointee
                return "channel closed by the broker: \(close.reply_code) \(close.reply_text.string)"
            default:
                return "unexpected method \(reply.reply.id) from the broker"
            }
        default:
            return "no reply from the broker"
        }
    }

    private static func describe(status: Int32) -> String {
        guard let text = amqp_error_string2(status) else { return "status \(status)" }
        return String(cString: text)
    }
}
