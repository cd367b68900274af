import Foundation
import IAPClient
import NIOConcurrencyHelpers
import Testing

/// An `IAPClient` on a scripted order service, a scripted store, a queue in memory and a
/// hand-turned clock: what the client does for each answer, without a network or a sleep.
final class Rig: Sendable {
    static let orderId = "6F1D2C1E-8A4B-4B8E-9D4E-2F1C3B5A7D90"
    let clock = ManualClock()
    let store = MemoryTransactionStore()
    let source = ScriptedStore()
    let service: ScriptedOrderService
    let client: IAPClient

    init(signedIn: Bool = true, alert: (@Sendable (QueueEntry) -> Void)? = nil) async throws {
        service = ScriptedOrderService(clock: clock)
        let cache = FileManager.default.temporaryDirectory.appendingPathComponent("iap-client-rig-\(UUID().uuidString)")
        client = IAPClient(
            configuration: .init(serverURL: try #require(URL(string: "http://orders.test")), cacheDirectory: cache),
            store: store, source: source, transport: service, clock: clock, seed: 1, alert: alert)
        if signedIn { try await client.signIn(userId: "ana", token: { "token-ana" }) }
    }

    /// An upload's status as the service answers it.
    static func status(_ state: String, reason: String? = nil, finish: Bool = false, nextAttemptIn: TimeInterval? = nil)
        -> ScriptedOrderService.Status
    {
        .init(state: state, reason: reason, finish: finish, nextAttemptIn: nextAttemptIn)
    }

    /// What goes wrong on the way to the service.
    enum Trouble: Sendable, CustomTestStringConvertible {
        /// No answer at all (no connection, a timeout).
        case noAnswer
        /// The service answers this status (with an error body).
        case status(Int)
        /// The expected status, with the body cut short.
        case cutAnswer

        var testDescription: String {
            switch self {
            case .noAnswer: "no answer"
            case .status(let status): "HTTP \(status)"
            case .cutAnswer: "a cut answer"
            }
        }
    }
}

/// The client's clock, turned by the test.
final class ManualClock: ClientClock {
    private let current = NIOLockedValueBox(Date(timeIntervalSince1970: 1_800_000_000))

    func now() -> Date { current.withLockedValue { $0 } }

    func advance(by seconds: TimeInterval) {
        current.withLockedValue { $0 = $0.addingTimeInterval(seconds) }
    }

    func sleep(until deadline: Date) async throws {
        // The tests drive `processDue()` themselves; the run loop's timer is never started.
        try await Task.sleep(for: .seconds(max(0, deadline.timeIntervalSince(now()))))
    }
}

/// The queue in memory.
final class MemoryTransactionStore: TransactionStore {
    private let all = NIOLockedValueBox([QueueEntry]())

    func entries() throws -> [QueueEntry] { all.withLockedValue { $0 } }

    func put(_ entry: QueueEntry) throws {
        all.withLockedValue { entries in
            if let index = entries.firstIndex(where: { $0.userId == entry.userId && $0.transactionId == entry.transactionId }) {
                entries[index] = entry
            } else {
                entries.append(entry)
            }
        }
    }

    func remove(userId: String, transactionId: String) throws {
        all.withLockedValue { $0.removeAll { $0.userId == userId && $0.transactionId == transactionId } }
    }
}

/// StoreKit, scripted: a purchase sheet that always buys `t9`, finishes recorded in order.
final class ScriptedStore: PurchaseSource {
    private let state = NIOLockedValueBox((finished: [String](), tokens: [UUID?](), onFinish: (@Sendable () throws -> Void)?.none))

    var finished: [String] { state.withLockedValue { $0.finished } }
    var tokens: [UUID?] { state.withLockedValue { $0.tokens } }
    /// Runs inside `finish(transactionId:)`, before it returns.
    var onFinish: (@Sendable () throws -> Void)? {
        get { state.withLockedValue { $0.onFinish } }
        set { state.withLockedValue { $0.onFinish = newValue } }
    }

    func purchase(productId: String, appAccountToken: UUID) async throws -> StorePurchaseResult {
        state.withLockedValue { $0.tokens.append(appAccountToken) }
        var transaction = ClientQueueTests.transaction("t9")
        transaction.appAccountToken = appAccountToken
        return .purchased(transaction)
    }

    func unfinishedTransactions() async throws -> [StoreTransaction] { [] }

    func transactionUpdates() -> AsyncStream<StoreTransaction> { AsyncStream { $0.finish() } }

    func finish(transactionId: String) async throws {
        try onFinish?()
        state.withLockedValue { $0.finished.append(transactionId) }
    }

    func appReceipt() async throws -> String? { "receipt" }
}

/// The order service, scripted: each route answers as the test set it, every request logged.
final class ScriptedOrderService: HTTPTransport {
    struct Status: Sendable {
        var state: String
        var reason: String?
        var finish: Bool
        var nextAttemptIn: TimeInterval?
    }

    private struct State {
        var log: [(route: String, body: [String: String], authorization: String?)] = []
        var statuses: [Status] = []
        var trouble: Rig.Trouble?
        var retryAfter: Int?
        var uploadRefusal: String?
        var statusNotFound = false
        var uploads = 0
        var holdUploads = false
        var held: [CheckedContinuation<Void, Never>] = []
        var heldWaiter: CheckedContinuation<Void, Never>?
        var onUpload: (@Sendable () throws -> Void)?
    }

    private let state = NIOLockedValueBox(State())
    private let clock: ManualClock

    init(clock: ManualClock) {
        self.clock = clock
    }

    var statuses: [Status] {
        get { state.withLockedValue { $0.statuses } }
        set { state.withLockedValue { $0.statuses = newValue } }
    }
    var trouble: Rig.Trouble? {
        get { state.withLockedValue { $0.trouble } }
        set { state.withLockedValue { $0.trouble = newValue } }
    }
    var retryAfter: Int? {
        get { state.withLockedValue { $0.retryAfter } }
        set { state.withLockedValue { $0.retryAfter = newValue } }
    }
    var uploadRefusal: String? {
        get { state.withLockedValue { $0.uploadRefusal } }
        set { state.withLockedValue { $0.uploadRefusal = newValue } }
    }
    var statusNotFound: Bool {
        get { state.withLockedValue { $0.statusNotFound } }
        set { state.withLockedValue { $0.statusNotFound = newValue } }
    }
    var holdUploads: Bool {
        get { state.withLockedValue { $0.holdUploads } }
        set { state.withLockedValue { $0.holdUploads = newValue } }
    }
    var onUpload: (@Sendable () throws -> Void)? {
        get { state.withLockedValue { $0.onUpload } }
        set { state.withLockedValue { $0.onUpload = newValue } }
    }

    /// Requests to `route` ("POST /v1/receipts", "GET /v1/receipts/s-1").
    func count(_ route: String) -> Int { state.withLockedValue { $0.log.filter { $0.route == route }.count } }

    /// The JSON bodies sent to `route`, in order.
    func bodies(_ route: String) -> [[String: String]] { state.withLockedValue { $0.log.filter { $0.route == route }.map(\.body) } }

    /// The Authorization header of each upload.
    var authorizations: [String?] { state.withLockedValue { $0.log.filter { $0.route == "POST /v1/receipts" }.map(\.authorization) } }

    /// Returns once an upload is held (`holdUploads`).
    func waitForHeldUpload() async throws {
        await withCheckedContinuation { continuation in
            let ready = state.withLockedValue { state -> Bool in
                if !state.held.isEmpty { return true }
                state.heldWaiter = continuation
                return false
            }
            if ready { continuation.resume() }
        }
    }

    func releaseUploads() {
        let held = state.withLockedValue { state -> [CheckedContinuation<Void, Never>] in
            state.holdUploads = false
            defer { state.held = [] }
            return state.held
        }
        for continuation in held { continuation.resume() }
    }

    func send(_ exchange: HTTPExchange) async throws -> HTTPAnswer {
        let route = "\(exchange.method) \(exchange.url.path)"
        let body = exchange.body.flatMap { try? JSONSerialization.jsonObject(with: $0) as? [String: String] } ?? [:]
        let trouble = state.withLockedValue { state -> Rig.Trouble? in
            state.log.append((route, body, exchange.headers["Authorization"]))
            return state.trouble
        }
        switch trouble {
        case .noAnswer?: throw URLError(.timedOut)
        case .status(let status)?:
            var headers: [String: String] = [:]
            if let retryAfter = state.withLockedValue({ $0.retryAfter }) { headers["retry-after"] = String(retryAfter) }
            return HTTPAnswer(status: status, headers: headers, body: Data(#"{"error":{"code":"trouble","message":"scripted"}}"#.utf8))
        case .cutAnswer?, nil: break
        }
        let answer = try await answer(route, exchange)
        if case .cutAnswer? = trouble { return HTTPAnswer(status: answer.status, headers: [:], body: answer.body.prefix(answer.body.count / 2)) }
        return answer
    }

    private func answer(_ route: String, _ exchange: HTTPExchange) async throws -> HTTPAnswer {
        switch route {
        case "POST /v1/orders":
            return Self.json(201, ["orderId": Rig.orderId, "productId": "com.example.coins.60", "state": "created"])
        case "POST /v1/receipts":
            try state.withLockedValue { $0.onUpload }?()
            await holdIfAsked()
            if let refusal = state.withLockedValue({ $0.uploadRefusal }) {
                return Self.json(400, ["error": ["code": refusal, "message": "refused"]])
            }
            let number = state.withLockedValue { state in
                state.uploads += 1
                return state.uploads
            }
            return Self.json(202, ["submissionId": "s-\(number)", "state": "pending"])
        case let route where route.hasPrefix("GET /v1/receipts/"):
            if state.withLockedValue({ $0.statusNotFound }) {
                return Self.json(404, ["error": ["code": "submission_not_found", "message": "no such upload"]])
            }
            let status = state.withLockedValue { state in state.statuses.isEmpty ? nil : state.statuses.removeFirst() }
                ?? Status(state: "pending", finish: false)
            var object: [String: Any] = [
                "submissionId": exchange.url.lastPathComponent, "state": status.state, "finishTransaction": status.finish,
                "transactions": [], "attempts": 1, "acceptedAt": "2027-01-15T08:00:00Z",
            ]
            if let reason = status.reason {
                object["reason"] = reason
                object["message"] = "said \(reason)"
            }
            if let wait = status.nextAttemptIn {
                object["nextAttemptAt"] = ISO8601DateFormatter().string(from: clock.now().addingTimeInterval(wait))
            }
            return Self.json(200, object)
        case let route where route.hasPrefix("POST /v1/users/") && route.hasSuffix("/finished"):
            return HTTPAnswer(status: 204, headers: [:], body: Data())
        case let route where route.hasPrefix("GET /v1/users/") && route.hasSuffix("/entitlements"):
            return Self.json(200, [
                "grants": [["transactionId": "t1", "productId": "com.example.coins.60", "quantity": 3, "state": "active"]],
                "subscriptions": [["originalTransactionId": "t2", "productId": "com.example.vip.month", "state": "active"]],
                "balances": ["coins": 180],
            ])
        default:
            return Self.json(404, ["error": ["code": "not_found", "message": route]])
        }
    }

    private func holdIfAsked() async {
        await withCheckedContinuation { continuation in
            let (hold, waiter) = state.withLockedValue { state -> (Bool, CheckedContinuation<Void, Never>?) in
                guard state.holdUploads else { return (false, nil) }
                state.held.append(continuation)
                defer { state.heldWaiter = nil }
                return (true, state.heldWaiter)
            }
            waiter?.resume()
            if !hold { continuation.resume() }
        }
    }

    private static func json(_ status: Int, _ object: [String: Any]) -> HTTPAnswer {
        HTTPAnswer(status: status, headers: [:], body: (try? JSONSerialization.data(withJSONObject: object)) ?? Data())
    }
}
