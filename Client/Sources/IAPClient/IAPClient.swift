import Foundation

/// The app side of IAP Pipeline: every transaction the store reports is written to the queue
/// before anything else, uploaded naming the transaction it holds, followed to the order
/// service's answer, and finished only when that answer says so; the entry leaves the queue
/// only after `finish()` returned.
///
/// Call `start()` at launch, `signIn(userId:token:)` when a user signs in, `wake()` when the app
/// comes to the foreground or the network returns; buy with `purchase(productId:)`; read what
/// the user has with `entitlements()`.
public actor IAPClient {
    /// Where the service is and how the client retries.
    public struct Configuration: Sendable {
        /// The order service's base URL (`https://orders.example.com`).
        public var serverURL: URL
        /// Delays, their cap, the alert threshold.
        public var retry: RetryPolicy
        /// A folder for the last entitlements answer of each user (offline launches); nil keeps none.
        public var cacheDirectory: URL?

        /// A configuration.
        public init(serverURL: URL, retry: RetryPolicy = RetryPolicy(), cacheDirectory: URL? = nil) {
            self.serverURL = serverURL
            self.retry = retry
            self.cacheDirectory = cacheDirectory
        }
    }

    /// What happened to a queued transaction, for the app's UI and logs.
    public enum Event: Sendable, Equatable {
        /// The service credited it (or settled it) and the store finished it: it left the queue.
        case finished(QueueEntry)
        /// The service's answer is final and not "finish" (rejected, held for customer
        /// service): the retries stopped, with the service's reason.
        case stopped(QueueEntry)
        /// It failed `alertAfterFailures` times in a row (called once per entry).
        case alert(QueueEntry)
    }

    /// What `purchase(productId:)` ended in.
    public enum PurchaseOutcome: Sendable, Equatable {
        /// Apple charged the user; the transaction is in the queue, on its way to the service.
        case purchased(QueueEntry)
        /// The user closed the sheet.
        case userCancelled
        /// Waiting for approval; the transaction arrives later by itself.
        case pending
    }

    /// Gives the signed-in user's bearer token (nil when the service runs without one).
    public typealias TokenProvider = @Sendable () async throws -> String?

    private let configuration: Configuration
    private let store: any TransactionStore
    private let source: any PurchaseSource
    private let service: OrderService
    private let clock: any ClientClock
    private let cache: EntitlementsCache?
    private let alertHook: (@Sendable (QueueEntry) -> Void)?
    private var random: SeededGenerator
    private var user: (id: String, token: TokenProvider)?
    private var inFlight: Set<String> = []
    private var recheckStopped = false
    private var loop: Task<Void, Never>?
    private var listener: Task<Void, Never>?
    private var timer: Task<Void, Never>?
    private let wakes: AsyncStream<Void>
    private let wakeSignal: AsyncStream<Void>.Continuation
    private let eventSink: AsyncStream<Event>.Continuation

    /// Events, in the order they happen (one reader).
    public nonisolated let events: AsyncStream<Event>

    /// A client on `store` (`FileTransactionStore`, or `KeychainTransactionStore` on Apple
    /// platforms) buying from `source` (`StoreKitPurchaseSource` in an app). `alert` is called
    /// once for an entry that failed `retry.alertAfterFailures` times in a row.
    public init(
        configuration: Configuration, store: any TransactionStore, source: any PurchaseSource,
        transport: any HTTPTransport = URLSessionTransport(), clock: any ClientClock = SystemClock(),
        seed: UInt64 = UInt64.random(in: .min ... .max), alert: (@Sendable (QueueEntry) -> Void)? = nil
    ) {
        self.configuration = configuration
        self.store = store
        self.source = source
        service = OrderService(baseURL: configuration.serverURL, transport: transport)
        self.clock = clock
        cache = configuration.cacheDirectory.map(EntitlementsCache.init(directory:))
        alertHook = alert
        random = SeededGenerator(seed: seed)
        (wakes, wakeSignal) = AsyncStream.makeStream(of: Void.self, bufferingPolicy: .bufferingNewest(1))
        (events, eventSink) = AsyncStream.makeStream(of: Event.self, bufferingPolicy: .bufferingNewest(1000))
    }

    // MARK: - The app's calls

    /// At launch: records what the store has not seen finished, listens for transactions the
    /// store reports later, and starts uploading. Calling it again does nothing more.
    public func start() async throws {
        guard loop == nil else { return }
        for transaction in try await source.unfinishedTransactions() {
            try record(transaction)
        }
        let updates = source.transactionUpdates()
        listener = Task { [weak self] in
            for await transaction in updates {
                // A write that fails leaves the transaction unfinished in the store, which
                // reports it again at the next launch.
                _ = try? await self?.record(transaction)
            }
        }
        loop = Task { [weak self] in await self?.run() }
        wake()
    }

    /// Stops uploading and listening, for good: `events` ends (the queue stays as it is; a new
    /// client on the same store carries on).
    public func stop() {
        loop?.cancel()
        listener?.cancel()
        timer?.cancel()
        loop = nil
        listener = nil
        timer = nil
        eventSink.finish()
    }

    /// Signs `userId` in: their entries are uploaded with `token`'s bearer tokens. Entries
    /// recorded while nobody was signed in become theirs; other users' entries wait for them.
    public func signIn(userId: String, token: @escaping TokenProvider) throws {
        user = (userId, token)
        for var entry in try store.entries(of: "") {
            try store.remove(userId: "", transactionId: entry.transactionId)
            entry.userId = userId
            try store.put(entry)
        }
        wake()
    }

    /// Signs the user out: their entries stay in the queue, untouched, until they sign in again.
    public func signOut() {
        user = nil
    }

    /// Tries now what is due, and reads again the uploads stopped on a final answer (customer
    /// service may have marked one finishable): call it when the app comes to the foreground
    /// and when the network returns.
    public func wake() {
        recheckStopped = true
        wakeSignal.yield()
    }

    /// Buys `productId` for the signed-in user: creates the order first, then asks the store to
    /// buy with the order's id as `appAccountToken`, so that the purchase pays that order
    /// whoever uploads it. The transaction is queued before this returns.
    public func purchase(productId: String) async throws -> PurchaseOutcome {
        guard let user else { throw IAPClientError(kind: .notSignedIn, message: "sign a user in before buying") }
        let token = try await bearer(user.token)
        let order = try await service.createOrder(productId: productId, userId: user.id, token: token)
        guard let accountToken = UUID(uuidString: order.orderId) else {
            throw IAPClientError(kind: .refused, message: "the order id \(order.orderId) is not a UUID")
        }
        switch try await source.purchase(productId: productId, appAccountToken: accountToken) {
        case .purchased(let transaction):
            return .purchased(try record(transaction, orderId: order.orderId.lowercased()))
        case .userCancelled:
            return .userCancelled
        case .pending:
            return .pending
        }
    }

    /// What the signed-in user may use now. When the service cannot be asked, the last answer
    /// kept on disk, marked stale; without one, the error.
    public func entitlements() async throws -> Entitlements {
        guard let user else { throw IAPClientError(kind: .notSignedIn, message: "sign a user in first") }
        do {
            let data = try await service.entitlements(userId: user.id, token: try await bearer(user.token))
            guard let answer = try? JSONDecoder().decode(EntitlementsAnswer.self, from: data) else {
                throw IAPClientError(kind: .unreachable, message: "an entitlements answer that does not decode")
            }
            let entitlements = Entitlements(
                grants: answer.grants, subscriptions: answer.subscriptions, balances: answer.balances,
                fetchedAt: clock.now(), isStale: false)
            cache?.write(entitlements, userId: user.id)
            return entitlements
        } catch let error as IAPClientError where error.isTransient {
            guard var kept = cache?.read(userId: user.id) else { throw error }
            kept.isStale = true
            return kept
        }
    }

    /// Every entry in the queue, of every user.
    public func queued() throws -> [QueueEntry] {
        try store.entries()
    }

    /// Writes a transaction the store reported to the queue (before anything else is done
    /// with it). A transaction already queued keeps its entry and its user.
    @discardableResult
    public func record(_ transaction: StoreTransaction) throws -> QueueEntry {
        try record(transaction, orderId: transaction.appAccountToken?.uuidString.lowercased())
    }

    // MARK: - The uploader

    /// One pass: every entry of the signed-in user that is due, in upload order (and, after a
    /// `wake()`, the stopped ones); returns when the next one is due.
    @discardableResult
    public func processDue() async -> Date? {
        guard let user else { return nil }
        let recheck = recheckStopped
        recheckStopped = false
        let now = clock.now()
        let entries: [QueueEntry]
        do {
            entries = try store.entries(of: user.id)
        } catch {
            return now.addingTimeInterval(configuration.retry.initialDelay)
        }
        let due = entries.filter { entry in
            guard !inFlight.contains(entry.transactionId) else { return false }
            return entry.stopped == nil ? (entry.nextAttemptAt ?? now) <= now : recheck
        }
        for entry in due.sorted(by: QueueEntry.uploadOrder) {
            await process(entry, as: user)
        }
        let waiting = (try? store.entries(of: user.id)) ?? entries
        return waiting.filter { $0.stopped == nil }.map { $0.nextAttemptAt ?? now }.min()
    }

    private func run() async {
        var signals = wakes.makeAsyncIterator()
        while !Task.isCancelled {
            let next = await processDue()
            timer?.cancel()
            if let next {
                timer = Task { [clock, wakeSignal] in
                    guard (try? await clock.sleep(until: next)) != nil else { return }
                    wakeSignal.yield()
                }
            }
            guard await signals.next() != nil else { return }
        }
    }

    /// One step for one entry: upload it if it has no submission, read its status, act on it.
    private func process(_ queued: QueueEntry, as user: (id: String, token: TokenProvider)) async {
        let id = queued.transactionId
        guard inFlight.insert(id).inserted else { return }
        defer { inFlight.remove(id) }
        var entry = queued
        entry.attempts += 1
        do {
            let token = try await bearer(user.token)
            if entry.submissionId == nil {
                let receipt = entry.transaction.signedTransaction == nil ? try await source.appReceipt() : nil
                if entry.transaction.signedTransaction == nil, receipt == nil {
                    throw IAPClientError(kind: .unreachable, message: "the device has no app receipt yet")
                }
                let accepted = try await service.upload(entry, receipt: receipt, token: token)
                entry.uploads += 1
                entry.polls = 0
                entry.submissionId = accepted.submissionId
                // The submission is remembered before it is followed: a kill now re-reads it.
                try store.put(entry)
            }
            let status = try await service.status(submissionId: entry.submissionId ?? "", userId: entry.userId, token: token)
            entry.failures = 0
            entry.lastError = nil
            try await act(on: UploadDecision.after(status, of: entry, now: clock.now(), policy: configuration.retry), entry, token)
        } catch let error as IAPClientError where error.code == "submission_not_found" {
            // The service no longer knows the upload (a store restored from a backup): upload again.
            entry.submissionId = nil
            failed(&entry, error)
        } catch let error as IAPClientError where !error.isTransient && error.status != 401 {
            let stop = StopReason(state: "refused", reason: error.code, message: error.message)
            entry.stopped = stop
            entry.nextAttemptAt = nil
            save(entry)
            eventSink.yield(.stopped(entry))
        } catch {
            failed(&entry, error)
        }
    }

    private func act(on decision: UploadDecision, _ queued: QueueEntry, _ token: String?) async throws {
        var entry = queued
        switch decision {
        case .finish:
            try await source.finish(transactionId: entry.transactionId)
            // Only now may the entry go: a kill before this line finishes it again (harmless).
            try? await service.reportFinished(userId: entry.userId, transactionId: entry.transactionId, token: token)
            try store.remove(userId: entry.userId, transactionId: entry.transactionId)
            eventSink.yield(.finished(entry))
        case .readAgain(let date):
            entry.polls += 1
            entry.stopped = nil
            entry.nextAttemptAt = date
            try store.put(entry)
        case .stop(let reason):
            let changed = entry.stopped != reason
            entry.stopped = reason
            entry.nextAttemptAt = nil
            try store.put(entry)
            if changed { eventSink.yield(.stopped(entry)) }
        case .uploadAgain(let reason):
            entry.submissionId = nil
            failed(&entry, IAPClientError(kind: .refused, code: reason.reason, message: reason.message ?? "upload again"))
        }
    }

    /// A failure: the next try after a growing delay; the alert once past the threshold.
    private func failed(_ entry: inout QueueEntry, _ error: any Error) {
        let policy = configuration.retry
        entry.failures += 1
        entry.retries += 1
        entry.stopped = nil
        entry.lastError = "\(error)"
        let retryAfter = (error as? IAPClientError)?.retryAfter
        let wait = policy.delay(afterFailures: entry.failures, retryAfter: retryAfter, using: &random)
        entry.nextAttemptAt = clock.now().addingTimeInterval(wait)
        let alert = entry.failures >= policy.alertAfterFailures && !entry.alerted
        if alert { entry.alerted = true }
        save(entry)
        if alert {
            alertHook?(entry)
            eventSink.yield(.alert(entry))
        }
    }

    /// Writes the entry; a store that cannot write now keeps the last state it has, and the
    /// entry is tried again from that (an upload again at worst, which the service answers alike).
    private func save(_ entry: QueueEntry) {
        try? store.put(entry)
    }

    private func record(_ transaction: StoreTransaction, orderId: String?) throws -> QueueEntry {
        if var known = try store.entry(transactionId: transaction.transactionId) {
            if known.orderId == nil, let orderId {
                known.orderId = orderId
                try store.put(known)
            }
            return known
        }
        let entry = QueueEntry(userId: user?.id ?? "", transaction: transaction, orderId: orderId, addedAt: clock.now())
        try store.put(entry)
        wakeSignal.yield()
        return entry
    }

    private func bearer(_ token: TokenProvider) async throws -> String? {
        do {
            return try await token()
        } catch {
            throw IAPClientError(kind: .unreachable, status: 401, message: "no token for the user: \(error)")
        }
    }

    private struct EntitlementsAnswer: Decodable {
        var grants: [Entitlements.Grant]
        var subscriptions: [Entitlements.Subscription]
        var balances: [String: Int]
    }
}
