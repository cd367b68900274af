import NIOConcurrencyHelpers
import NIOCore
import NIOPosix

/// A TCP proxy on a free loopback port between an HTTP client and a real HTTP server that
/// spoils a seeded share of the connections through it: dropped, answered by the proxy itself
/// (503, 429), answered late, cut inside the answer, or answered to the server and never to
/// the client.
///
/// Each connection carries one exchange: the proxy rewrites the request's and the answer's
/// `Connection` header to `close` (all other bytes pass as they are), so a fault drawn for a
/// connection is a fault of one request, and a client never reuses a connection the proxy has
/// ended. The fault of a connection is drawn from the seed and the connection's ordinal
/// number (`plan`), so that a run whose requests come one after another is reproducible.
final class ChaosProxy: Sendable {
    /// The shares of connections spoiled, each kind drawn on its own share.
    struct Faults: Sendable {
        /// Closed once the request's first bytes came, unanswered and not forwarded.
        var drop: Double
        /// Forwarded, and the answer cut strictly inside: the client gets its first bytes only.
        var cut: Double
        /// Answered by the proxy with 503 `service_unavailable`, not forwarded.
        var answer503: Double
        /// Answered by the proxy with 429 `rate_limited` and `Retry-After: 1`, not forwarded.
        var answer429: Double
        /// Forwarded and answered by the server, and closed to the client without a byte of the
        /// answer: the request took effect, the client never learned.
        var lostAnswer: Double
        /// Milliseconds added before an answer is forwarded, on `delayShare` of the connections.
        var latency: ClosedRange<Int>
        var delayShare: Double

        init(
            drop: Double = 0, cut: Double = 0, answer503: Double = 0, answer429: Double = 0, lostAnswer: Double = 0,
            latency: ClosedRange<Int> = 0...0, delayShare: Double = 0
        ) {
            self.drop = drop
            self.cut = cut
            self.answer503 = answer503
            self.answer429 = answer429
            self.lostAnswer = lostAnswer
            self.latency = latency
            self.delayShare = delayShare
        }

        /// Every connection forwarded whole and on time.
        static let none = Faults()
        /// 30 % of the connections spoiled, and 0 to 40 ms more on 30 % of the answers.
        static let harsh = Faults(
            drop: 0.08, cut: 0.08, answer503: 0.05, answer429: 0.04, lostAnswer: 0.05, latency: 0...40, delayShare: 0.3)
    }

    /// What befalls one connection.
    enum Fault: Sendable, Equatable {
        case clean, drop, cut, answer503, answer429, lostAnswer

        /// Whether the connection's request reaches the server.
        var forwards: Bool { self == .clean || self == .cut || self == .lostAnswer }
    }

    /// What the proxy does to one connection.
    struct Plan: Sendable, Equatable {
        var fault: Fault
        /// For `.cut`: how many bytes of the answer reach the client, when the answer is longer.
        var cutAt: Int
        /// Milliseconds a forwarded answer is held before it goes on (0: not held).
        var latency: Int
    }

    /// What happened so far. A fault is counted when it strikes, before the client can notice.
    struct Counters: Sendable, Equatable {
        var connections = 0
        var dropped = 0
        /// Answers cut strictly inside (a planned cut of an answer no longer than its cut point
        /// went through whole, and is not counted).
        var cut = 0
        var lostAnswers = 0
        var refused503 = 0
        var refused429 = 0
        /// Answers held before they went on (not a fault).
        var delayed = 0

        /// Connections whose client got no whole answer of the server's.
        var faulted: Int { dropped + cut + lostAnswers + refused503 + refused429 }
    }

    let port: Int
    private let server: any Channel
    private let shared: ChaosShared

    /// `http://127.0.0.1:<port>`.
    var url: String { "http://127.0.0.1:\(port)" }

    var counters: Counters { shared.state.withLockedValue { $0.counters } }
    var connections: Int { counters.connections }
    var dropped: Int { counters.dropped }
    var cut: Int { counters.cut }
    var lostAnswers: Int { counters.lostAnswers }
    var refused503: Int { counters.refused503 }
    var refused429: Int { counters.refused429 }
    var delayed: Int { counters.delayed }

    /// Listens on a free loopback port and forwards to `127.0.0.1:upstreamPort`.
    static func start(upstreamPort: Int, seed: UInt64, faults: Faults) async throws -> ChaosProxy {
        let shared = ChaosShared()
        let server = try await ServerBootstrap(group: MultiThreadedEventLoopGroup.singleton)
            .childChannelInitializer { channel in
                // Runs on the accepted channel's event loop, before it is active.
                let plan = ChaosProxy.plan(seed: seed, connection: shared.accept(channel), faults: faults)
                return channel.eventLoop.makeCompletedFuture(withResultOf: {
                    try channel.pipeline.syncOperations.addHandler(
                        ClientSide(plan: plan, upstreamPort: upstreamPort, shared: shared))
                })
            }
            .bind(host: "127.0.0.1", port: 0).get()
        guard let port = server.localAddress?.port else {
            server.close(promise: nil)
            throw HarnessError("the chaos proxy has no port")
        }
        return ChaosProxy(port: port, server: server, shared: shared)
    }

    private init(port: Int, server: any Channel, shared: ChaosShared) {
        self.port = port
        self.server = server
        self.shared = shared
    }

    /// Closes the listener and every connection still open, either side, and waits until they are.
    func stop() async throws {
        let open = shared.stop()
        server.close(promise: nil)
        for channel in open { channel.close(promise: nil) }
        try await server.closeFuture.get()
        for channel in open { try await channel.closeFuture.get() }
    }

    /// The plan of the connection numbered `ordinal` (from 0, in the order accepted): a pure
    /// function of the seed, the ordinal and the shares, so a test can tell what to expect.
    static func plan(seed: UInt64, connection ordinal: Int, faults: Faults) -> Plan {
        // The ordinal is mixed before it meets the seed: neighbouring ordinals would otherwise
        // give overlapping sequences.
        var ordinalMix = Generator(state: UInt64(truncatingIfNeeded: ordinal))
        var generator = Generator(state: seed ^ ordinalMix.next())
        // Every draw is made whatever the fault, so each value keeps its place in the sequence.
        let roll = generator.unit()
        let cutAt = 1 + Int(generator.next() % 200)
        let delayRoll = generator.unit()
        let latency = faults.latency.lowerBound + Int(generator.next() % UInt64(faults.latency.count))
        let shares: [(Double, Fault)] = [
            (faults.drop, .drop), (faults.cut, .cut), (faults.answer503, .answer503), (faults.answer429, .answer429),
            (faults.lostAnswer, .lostAnswer),
        ]
        var fault = Fault.clean
        var threshold = 0.0
        for (share, kind) in shares {
            threshold += share
            if roll < threshold {
                fault = kind
                break
            }
        }
        return Plan(fault: fault, cutAt: cutAt, latency: delayRoll < faults.delayShare ? max(0, latency) : 0)
    }

    /// The body of the proxy's own refusal with error `code`.
    static func refusalBody(code: String) -> String { #"{"error":{"code":"\#(code)","message":"chaos"}}"# }

    /// The proxy's own complete answer for a refusal.
    static func refusal(_ fault: Fault) -> String {
        var status = "503 Service Unavailable"
        var code = "service_unavailable"
        var extra = ""
        if fault == .answer429 {
            status = "429 Too Many Requests"
            code = "rate_limited"
            extra = "Retry-After: 1\r\n"
        }
        let body = refusalBody(code: code)
        let head = "HTTP/1.1 \(status)\r\nContent-Type: application/json\r\nContent-Length: \(body.utf8.count)\r\n"
        return head + extra + "Connection: close\r\n\r\n" + body
    }

    /// SplitMix64: small, seeded, the same on every platform and Swift version (unlike the
    /// standard library's `random(in:using:)`, whose use of the generator is not promised).
    private struct Generator {
        var state: UInt64

        mutating func next() -> UInt64 {
            state &+= 0x9E37_79B9_7F4A_7C15
            var z = state
            z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
            z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
            return z ^ (z >> 31)
        }

        /// A draw in [0, 1).
        mutating func unit() -> Double { Double(next() >> 11) * 0x1.0p-53 }
    }
}

/// The proxy's state its connections share: the counters, and the connections open for `stop`.
private final class ChaosShared: Sendable {
    struct State {
        var counters = ChaosProxy.Counters()
        var open: [ObjectIdentifier: any Channel] = [:]
        var stopped = false
    }

    let state = NIOLockedValueBox(State())

    /// Counts an accepted connection and keeps it for `stop`: its ordinal number, from 0.
    func accept(_ channel: any Channel) -> Int {
        let ordinal = state.withLockedValue { state in
            state.counters.connections += 1
            return state.counters.connections - 1
        }
        track(channel)
        return ordinal
    }

    /// Keeps `channel` until it closes, for `stop` to close; once stopped, closes it at once.
    func track(_ channel: any Channel) {
        let id = ObjectIdentifier(channel)
        let stopped = state.withLockedValue { state in
            if !state.stopped { state.open[id] = channel }
            return state.stopped
        }
        guard !stopped else {
            channel.close(promise: nil)
            return
        }
        channel.closeFuture.whenComplete { [self] _ in state.withLockedValue { _ = $0.open.removeValue(forKey: id) } }
    }

    func count(_ counter: WritableKeyPath<ChaosProxy.Counters, Int>) {
        state.withLockedValue { $0.counters[keyPath: counter] += 1 }
    }

    /// Refuses connections from now on: the ones open, to close.
    func stop() -> [any Channel] {
        state.withLockedValue { state in
            state.stopped = true
            return Array(state.open.values)
        }
    }
}

/// An HTTP/1.1 head passing through the proxy: collected up to its blank line, then passed on
/// with its `Connection` (and `Keep-Alive`) lines replaced by `Connection: close`, and the rest
/// of the stream after it as it comes. A head longer than `limit` passes unchanged.
private struct HeadRewriter {
    static let limit = 64 * 1024
    private var collected: [UInt8] = []
    /// Whether the head has been passed on (rewritten, or given up on).
    private(set) var passing = false
    private var headFound = false
    private var contentLength = 0
    /// Whether the head asks for `100 Continue`: its body may wait for an answer.
    private var expectsContinue = false
    /// Bytes after the head seen so far.
    private var bodyBytes = 0

    /// Whether a request has come in far enough to be answered: through its `Content-Length`,
    /// or at the head's end without one (a chunked body is not awaited) or with
    /// `Expect: 100-continue` (whose client may hold its body back until answered).
    var requestComplete: Bool { passing && (!headFound || expectsContinue || bodyBytes >= contentLength) }

    /// What to pass on for `buffer`: nothing while the head is incomplete, then the rewritten
    /// head and what followed it, then the bytes as they are.
    mutating func pass(_ buffer: ByteBuffer) -> [UInt8] {
        let incoming = Array(buffer.readableBytesView)
        if passing {
            bodyBytes += incoming.count
            return incoming
        }
        // The blank line may straddle two reads: search from 3 bytes before the new ones.
        let searchFrom = max(0, collected.count - 3)
        collected += incoming
        if let end = Self.endOfHead(collected, from: searchFrom) {
            passing = true
            headFound = true
            let head = collected[..<end]
            let lines = Self.lines(head)
            contentLength = lines.first { Self.name($0) == "content-length" }.flatMap(Self.intValue) ?? 0
            expectsContinue = lines.contains { Self.name($0) == "expect" }
            bodyBytes = collected.count - end
            let passed: [UInt8] = Self.closing(head) + collected[end...]
            collected = []
            return passed
        }
        return collected.count > Self.limit ? flush() : []
    }

    /// Gives up on the head (the stream ended inside it, or it is too long): what was collected.
    mutating func flush() -> [UInt8] {
        passing = true
        defer { collected = [] }
        return collected
    }

    /// The index just past the first CRLF CRLF at or after `start`.
    private static func endOfHead(_ bytes: [UInt8], from start: Int) -> Int? {
        var index = start
        while index + 3 < bytes.count {
            if bytes[index] == 13, bytes[index + 1] == 10, bytes[index + 2] == 13, bytes[index + 3] == 10 {
                return index + 4
            }
            index += 1
        }
        return nil
    }

    /// The head's lines without their CRLF, its blank last line left out.
    private static func lines(_ head: ArraySlice<UInt8>) -> [ArraySlice<UInt8>] {
        var lines: [ArraySlice<UInt8>] = []
        var start = head.startIndex
        var index = head.startIndex
        while index + 1 < head.endIndex {
            if head[index] == 13, head[index + 1] == 10 {
                if index > start { lines.append(head[start..<index]) }
                index += 2
                start = index
            } else {
                index += 1
            }
        }
        return lines
    }

    /// A header line's name, lowercased ("" for a line without a colon: the start line).
    private static func name(_ line: ArraySlice<UInt8>) -> String {
        guard let colon = line.firstIndex(of: UInt8(ascii: ":")) else { return "" }
        return String(decoding: line[..<colon], as: UTF8.self).lowercased()
    }

    /// A header line's value as a number.
    private static func intValue(_ line: ArraySlice<UInt8>) -> Int? {
        guard let colon = line.firstIndex(of: UInt8(ascii: ":")) else { return nil }
        return Int(String(decoding: line[(colon + 1)...], as: UTF8.self).filter { $0 != " " && $0 != "\t" })
    }

    /// `head` with its `Connection` and `Keep-Alive` lines replaced by `Connection: close`.
    private static func closing(_ head: ArraySlice<UInt8>) -> [UInt8] {
        var rewritten: [UInt8] = []
        for (index, line) in lines(head).enumerated() where index == 0 || !["connection", "keep-alive"].contains(name(line)) {
            rewritten += line
            rewritten += [13, 10]
        }
        return rewritten + Array("Connection: close\r\n\r\n".utf8)
    }
}

/// The accepted connection's end, which carries out the connection's plan: drops it, refuses
/// it, or forwards its request upstream and the answer back (whole, late, cut, or not at all).
private final class ClientSide: ChannelInboundHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private let plan: ChaosProxy.Plan
    private let upstreamPort: Int
    private let shared: ChaosShared
    private var context: ChannelHandlerContext?
    /// The connection upstream, once connected (never for a drop or a refusal).
    private var upstream: (any Channel)?
    /// Request bytes read before upstream was connected.
    private var waitingForUpstream: [UInt8] = []
    private var request = HeadRewriter()
    private var response = HeadRewriter()
    /// Answer bytes read from upstream and not yet forwarded: at most one answer.
    private var held: [UInt8] = []
    /// Answer bytes forwarded so far.
    private var forwarded = 0
    private var answerStarted = false
    /// Whether the answer is held for the plan's latency.
    private var holding = false
    private var upstreamEnded = false
    /// Whether the client's side is closed or closing: nothing more goes to it.
    private var finished = false
    /// Whether the client was closed on a lost answer: upstream then ends on its own.
    private var answerLost = false
    /// The last write to the client, which a close waits for.
    private var lastWrite: EventLoopFuture<Void>?

    init(plan: ChaosProxy.Plan, upstreamPort: Int, shared: ChaosShared) {
        self.plan = plan
        self.upstreamPort = upstreamPort
        self.shared = shared
    }

    func handlerAdded(context: ChannelHandlerContext) { self.context = context }

    func handlerRemoved(context: ChannelHandlerContext) { self.context = nil }

    func channelActive(context: ChannelHandlerContext) {
        // Connected now rather than on the first bytes: the request then waits less.
        if plan.fault.forwards { connectUpstream(context) }
        context.fireChannelActive()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let buffer = Self.unwrapInboundIn(data)
        guard !finished else { return }
        switch plan.fault {
        case .drop:
            shared.count(\.dropped)
            closeClient()
        case .answer503, .answer429:
            _ = request.pass(buffer)
            if request.requestComplete { refuse(context) }
        case .clean, .cut, .lostAnswer:
            let bytes = request.pass(buffer)
            guard !bytes.isEmpty else { return }
            if let upstream {
                upstream.writeAndFlush(ByteBuffer(bytes: bytes), promise: nil)
            } else {
                waitingForUpstream += bytes
            }
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        finished = true
        // After a lost answer upstream finishes its answer undisturbed, and closes on its own.
        if !answerLost { upstream?.close(promise: nil) }
        context.fireChannelInactive()
    }

    /// A reset or a failed write: the connection ends there (not passed on, which would log it).
    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        context.close(promise: nil)
    }

    /// Upstream's bytes, carried to the client as the plan says.
    func upstreamSaid(_ buffer: ByteBuffer) {
        guard !finished else { return }
        if plan.fault == .lostAnswer {
            // Upstream has answered, so the request took effect: the client learns nothing of it.
            answerLost = true
            shared.count(\.lostAnswers)
            closeClient()
            return
        }
        held += response.pass(buffer)
        if !answerStarted {
            answerStarted = true
            if plan.latency > 0, let context {
                holding = true
                shared.count(\.delayed)
                context.eventLoop.assumeIsolated().scheduleTask(in: .milliseconds(Int64(plan.latency))) {
                    self.holding = false
                    self.forward()
                }
            }
        }
        forward()
    }

    /// Upstream closed (after its answer, as asked): the rest of the answer goes on, then the
    /// client's side closes.
    func upstreamClosed() {
        upstreamEnded = true
        guard !finished else { return }
        held += response.flush()
        forward()
    }

    /// Forwards what is held, unless the latency holds it; cuts the answer when the plan says
    /// and upstream has sent more than the cut point; closes the client once upstream ended.
    private func forward() {
        guard !holding, !finished else { return }
        let room = plan.cutAt - forwarded
        if plan.fault == .cut, held.count > room {
            // More bytes exist past the cut point, so the client's answer ends strictly inside.
            shared.count(\.cut)
            write(held.prefix(room))
            held = []
            upstream?.close(promise: nil)
            closeClient()
            return
        }
        forwarded += held.count
        write(held)
        held = []
        if upstreamEnded { closeClient() }
    }

    /// The proxy's own answer, once the request came in whole.
    private func refuse(_ context: ChannelHandlerContext) {
        finished = true
        if plan.fault == .answer429 { shared.count(\.refused429) } else { shared.count(\.refused503) }
        write(Array(ChaosProxy.refusal(plan.fault).utf8))
        // Only the output is closed (after the answer is written): the client reads the answer
        // and closes, which closes this side. A full close with request bytes unread would
        // reset the connection and could lose the answer at the client.
        context.close(mode: .output, promise: nil)
    }

    private func connectUpstream(_ context: ChannelHandlerContext) {
        // The upstream channel lives on this event loop, where the loop-bound handler may be used.
        let client = NIOLoopBound(self, eventLoop: context.eventLoop)
        ClientBootstrap(group: context.eventLoop)
            .channelInitializer { channel in
                channel.eventLoop.makeCompletedFuture(withResultOf: {
                    try channel.pipeline.syncOperations.addHandler(UpstreamSide(client: client.value))
                })
            }
            .connect(host: "127.0.0.1", port: upstreamPort)
            .assumeIsolated()
            .whenComplete { result in
                switch result {
                case .success(let channel): self.upstreamConnected(channel)
                case .failure: self.closeClient()
                }
            }
    }

    private func upstreamConnected(_ channel: any Channel) {
        shared.track(channel)
        guard !finished else {
            channel.close(promise: nil)
            return
        }
        upstream = channel
        if !waitingForUpstream.isEmpty {
            channel.writeAndFlush(ByteBuffer(bytes: waitingForUpstream), promise: nil)
            waitingForUpstream = []
        }
    }

    /// Writes `bytes` to the client; a later close waits for the write.
    private func write(_ bytes: some Collection<UInt8>) {
        guard let context, !bytes.isEmpty else { return }
        let promise = context.eventLoop.makePromise(of: Void.self)
        context.writeAndFlush(Self.wrapOutboundOut(ByteBuffer(bytes: bytes)), promise: promise)
        lastWrite = promise.futureResult
    }

    /// Closes the client's side once what was written to it has gone out.
    private func closeClient() {
        finished = true
        guard let context else { return }
        if let lastWrite {
            lastWrite.assumeIsolated().whenComplete { _ in context.close(promise: nil) }
        } else {
            context.close(promise: nil)
        }
    }
}

/// The upstream connection's end: hands upstream's bytes and its closing to the client side.
private final class UpstreamSide: ChannelInboundHandler {
    typealias InboundIn = ByteBuffer

    private let client: ClientSide

    init(client: ClientSide) { self.client = client }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        client.upstreamSaid(Self.unwrapInboundIn(data))
    }

    func channelInactive(context: ChannelHandlerContext) {
        client.upstreamClosed()
        context.fireChannelInactive()
    }

    /// A reset: the connection ends there, as if closed.
    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        context.close(promise: nil)
    }
}
