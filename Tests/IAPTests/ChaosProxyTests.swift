import AsyncHTTPClient
import Hummingbird
import NIOConcurrencyHelpers
import NIOCore
import NIOHTTP1
import ServiceLifecycle
import Testing
import TestSupport

/// The chaos proxy of the end-to-end tests does what it says, against a small real HTTP server:
/// each connection meets the fault its seed plans and the fault is counted, a connection not
/// faulted carries the server's whole answer, and a cut answer never arrives whole.
@Suite("Chaos proxy", .teardown, .timeLimit(.minutes(3)))
struct ChaosProxyTests {
    /// What one request through the proxy came to.
    enum Outcome: Equatable {
        case answered(status: UInt, body: String, retryAfter: String?)
        /// No answer, or not a whole one: the client failed.
        case failed
    }

    /// A server on a free loopback port that answers each `POST /work` with a body naming the
    /// request, longer than any cut point (so that every planned cut falls inside the answer).
    struct Upstream {
        let server: LoopbackServer
        /// The requests it answered.
        let answered: NIOLockedValueBox<Int>

        var port: Int { EdgeHarness.port(server.base) }

        static func start() async throws -> Upstream {
            let answered = NIOLockedValueBox(0)
            let router = Router()
            router.post("/work") { request, _ -> String in
                let text = String(buffer: try await request.body.collect(upTo: 1 << 16))
                answered.withLockedValue { $0 += 1 }
                return Upstream.answer(to: text)
            }
            let server = try await LoopbackServer.start(router, name: "the chaos proxy's upstream")
            return Upstream(server: server, answered: answered)
        }

        /// The body of the answer to a request whose body is `request`: over 300 bytes.
        static func answer(to request: String) -> String { "answer to \(request): " + String(repeating: "-", count: 300) }

        func stop() async {
            await server.group.triggerGracefulShutdown()
            _ = try? await server.task.value
        }
    }

    /// Sends request number `index` through the proxy at `url`, given 5 s.
    static func send(_ index: Int, to url: String) async -> Outcome {
        var request = HTTPClientRequest(url: url + "/work")
        request.method = .POST
        request.body = .bytes(ByteBuffer(string: "request \(index)"))
        do {
            let response = try await HTTPClient.shared.execute(request, timeout: .seconds(5))
            let body = try await response.body.collect(upTo: 1 << 20)
            return .answered(
                status: response.status.code, body: String(buffer: body),
                retryAfter: response.headers.first(name: "Retry-After"))
        } catch {
            return .failed
        }
    }

    /// The server's whole answer to request number `index`.
    static func whole(_ index: Int) -> Outcome {
        .answered(status: 200, body: Upstream.answer(to: "request \(index)"), retryAfter: nil)
    }

    static func plans(seed: UInt64, count: Int, faults: ChaosProxy.Faults) -> [ChaosProxy.Plan] {
        (0..<count).map { ChaosProxy.plan(seed: seed, connection: $0, faults: faults) }
    }

    @Test("A connection's plan is a function of the seed and its ordinal; harsh spoils over 20 %")
    func plansFollowTheSeed() {
        let plans = Self.plans(seed: 42, count: 1000, faults: .harsh)
        #expect(plans == Self.plans(seed: 42, count: 1000, faults: .harsh))
        #expect(plans != Self.plans(seed: 43, count: 1000, faults: .harsh))
        #expect(plans.filter { $0.fault != .clean }.count >= 200)
        #expect(plans.allSatisfy { (1...200).contains($0.cutAt) && (0...40).contains($0.latency) })
        #expect(Self.plans(seed: 42, count: 1000, faults: .none).allSatisfy { $0.fault == .clean && $0.latency == 0 })
    }

    @Test("Harsh faults, seed 42, 200 requests one after another: each meets its planned fault, counted")
    func harshFaultsAsPlanned() async throws {
        let upstream = try await Upstream.start()
        Teardown.add { await upstream.stop() }
        let proxy = try await ChaosProxy.start(upstreamPort: upstream.port, seed: 42, faults: .harsh)
        Teardown.add { _ = try? await proxy.stop() }
        let requests = 200
        var outcomes: [Outcome] = []
        for index in 0..<requests { outcomes.append(await Self.send(index, to: proxy.url)) }

        // One connection a request, in order: request i met connection i's plan.
        let counters = proxy.counters
        #expect(counters.connections == requests)
        let plans = Self.plans(seed: 42, count: requests, faults: .harsh)
        for (index, (plan, outcome)) in zip(plans, outcomes).enumerated() {
            switch plan.fault {
            case .clean:
                #expect(outcome == Self.whole(index), "request \(index)")
            case .answer503:
                let refusal = Outcome.answered(
                    status: 503, body: ChaosProxy.refusalBody(code: "service_unavailable"), retryAfter: nil)
                #expect(outcome == refusal, "request \(index)")
            case .answer429:
                let refusal = Outcome.answered(status: 429, body: ChaosProxy.refusalBody(code: "rate_limited"), retryAfter: "1")
                #expect(outcome == refusal, "request \(index)")
            case .drop, .cut, .lostAnswer:
                // A cut answer is never taken whole: the client fails on it as on no answer.
                #expect(outcome == .failed, "request \(index) (\(plan.fault))")
            }
        }

        // Every fault kind struck, as often as planned (each answer is longer than any cut point).
        func planned(_ fault: ChaosProxy.Fault) -> Int { plans.filter { $0.fault == fault }.count }
        #expect(counters.dropped == planned(.drop) && counters.dropped >= 1)
        #expect(counters.cut == planned(.cut) && counters.cut >= 1)
        #expect(counters.lostAnswers == planned(.lostAnswer) && counters.lostAnswers >= 1)
        #expect(counters.refused503 == planned(.answer503) && counters.refused503 >= 1)
        #expect(counters.refused429 == planned(.answer429) && counters.refused429 >= 1)
        #expect(counters.delayed == plans.filter { ($0.fault == .clean || $0.fault == .cut) && $0.latency > 0 }.count)
        #expect(counters.delayed >= 1)

        // The faults counted are the requests without the server's whole answer, at least 20 %.
        let whole = outcomes.enumerated().filter { $0.element == Self.whole($0.offset) }.count
        #expect(counters.faulted == requests - whole)
        #expect(counters.faulted * 5 >= requests)
        // What reached the server: the whole answers, the cut ones and the lost ones; never a
        // dropped or refused request.
        #expect(upstream.answered.withLockedValue { $0 } == whole + counters.cut + counters.lostAnswers)
    }

    @Test("No faults: 50 requests all answered whole, nothing counted but the connections")
    func noFaults() async throws {
        let upstream = try await Upstream.start()
        Teardown.add { await upstream.stop() }
        let proxy = try await ChaosProxy.start(upstreamPort: upstream.port, seed: 42, faults: .none)
        Teardown.add { _ = try? await proxy.stop() }
        for index in 0..<50 {
            let outcome = await Self.send(index, to: proxy.url)
            #expect(outcome == Self.whole(index), "request \(index)")
        }
        #expect(proxy.counters == ChaosProxy.Counters(connections: 50))
        #expect(upstream.answered.withLockedValue { $0 } == 50)
        try await proxy.stop()
    }
}
