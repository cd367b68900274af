import Foundation
import IAPClient
import NIOConcurrencyHelpers
import Testing

/// The app side's queue and uploader against a scripted order service, a scripted store and a
/// hand-turned clock: no network, no sleeps. What the service answers decides what the client
/// does; these tests say what it must and must never do.
@Suite("Client queue and retry policy", .timeLimit(.minutes(1)))
struct ClientQueueTests {
    // MARK: - The retry policy

    @Test func delaysGrowFromTheFirstToTheCapWithJitterInsideTheirBounds() {
        let policy = RetryPolicy()
        var random = SeededGenerator(seed: 7)
        var previousTop: TimeInterval = 0
        for failures in 1...40 {
            let bounds = policy.bounds(afterFailures: failures)
            #expect(bounds.upperBound >= previousTop, "the bound never shrinks")
            #expect(bounds.upperBound <= 600, "capped")
            #expect(bounds.lowerBound == bounds.upperBound / 2, "half of each wait is drawn")
            for _ in 0..<50 {
                #expect(bounds.contains(policy.delay(afterFailures: failures, using: &random)))
            }
            previousTop = bounds.upperBound
        }
        #expect(policy.bounds(afterFailures: 1) == 1...2)
        #expect(policy.bounds(afterFailures: 3) == 4...8)
        #expect(policy.bounds(afterFailures: 40).upperBound == 600)
        // A count no phone reaches still gives the cap, not an overflow.
        #expect(policy.bounds(afterFailures: .max).upperBound == 600)
    }

    @Test func jitterSpreadsDevicesThatFailedTogether() {
        let policy = RetryPolicy()
        let waits = Set((0..<20).map { device -> TimeInterval in
            var random = SeededGenerator(seed: UInt64(device))
            return policy.delay(afterFailures: 5, using: &random)
        })
        #expect(waits.count >= 18, "twenty devices failing at once come back at twenty moments")
        var again = SeededGenerator(seed: 3)
        var same = SeededGenerator(seed: 3)
        #expect(policy.delay(afterFailures: 5, using: &again) == policy.delay(afterFailures: 5, using: &same), "a seed replays")
    }

    @Test func retryAfterIsHonouredAndBounded() {
        let policy = RetryPolicy()
        var random = SeededGenerator(seed: 1)
        #expect(policy.delay(afterFailures: 1, retryAfter: 120, using: &random) == 120)
        // Longer than the computed wait only when the server asks for longer.
        #expect(policy.delay(afterFailures: 20, retryAfter: 1, using: &random) >= 300)
        // A server cannot park a phone's queue for a week.
        #expect(policy.delay(afterFailures: 1, retryAfter: 7 * 86_400, using: &random) == 3600)
        #expect(policy.delay(afterFailures: 1, retryAfter: .infinity, using: &random) <= 2)
    }

    @Test func neverUploadedEntriesGoFirstThenTheFewestAttemptsThenTheOldest() {
        let start = Date(timeIntervalSince1970: 1_800_000_000)
        func entry(_ id: String, uploads: Int, attempts: Int, age: TimeInterval) -> QueueEntry {
            var entry = QueueEntry(userId: "u", transaction: Self.transaction(id), orderId: nil, addedAt: start.addingTimeInterval(-age))
            entry.uploads = uploads
            entry.attempts = attempts
            return entry
        }
        let entries = [
            entry("old-tried", uploads: 1, attempts: 9, age: 900), entry("new", uploads: 0, attempts: 0, age: 1),
            entry("failing-unsent", uploads: 0, attempts: 4, age: 500), entry("tried-once", uploads: 1, attempts: 1, age: 10),
            entry("older-new", uploads: 0, attempts: 0, age: 50),
        ]
        #expect(entries.sorted(by: QueueEntry.uploadOrder).map(\.transactionId) == [
            "older-new", "new", "failing-unsent", "tried-once", "old-tried",
        ])
    }

    // MARK: - Finishing

    @Test func finishesOnlyWhenTheServiceSaysSoAndDropsTheEntryOnlyAfterFinishReturned() async throws {
        let rig = try await Rig()
        rig.service.statuses = [Rig.status("pending"), Rig.status("retrying", nextAttemptIn: 30), Rig.status("credited", finish: true)]
        try await rig.client.record(Self.transaction("t1"))
        await rig.client.processDue()
        #expect(rig.source.finished.isEmpty, "pending is not credited")
        #expect(try rig.store.entries().first?.submissionId == "s-1")
        rig.clock.advance(by: 3)
        await rig.client.processDue()
        #expect(rig.source.finished.isEmpty, "retrying is not credited")
        // The service retries Apple in 30 s: reading before then tells nothing new.
        rig.clock.advance(by: 10)
        await rig.client.processDue()
        #expect(rig.service.count("GET /v1/receipts/s-1") == 2)
        rig.clock.advance(by: 25)
        // The entry is still there while `finish()` runs, and gone once it returned.
        rig.source.onFinish = {
            let queued = try rig.store.entries().count
            #expect(queued == 1)
        }
        await rig.client.processDue()
        #expect(rig.source.finished == ["t1"])
        #expect(try rig.store.entries().isEmpty)
        #expect(rig.service.count("POST /v1/users/ana/finished") == 1, "the service hears that the app finished it")
        #expect(rig.service.count("POST /v1/receipts") == 1, "one upload, followed to its answer")
    }

    @Test(arguments: [
        Rig.Trouble.noAnswer, .status(503), .status(500), .status(429), .status(408), .cutAnswer, .status(401),
    ])
    func noAnswerAndTransientAnswersNeverFinishAndComeBackLater(_ trouble: Rig.Trouble) async throws {
        let rig = try await Rig()
        rig.service.trouble = trouble
        try await rig.client.record(Self.transaction("t1"))
        for _ in 0..<5 {
            await rig.client.processDue()
            let entry = try #require(try rig.store.entries().first)
            let wait = try #require(entry.nextAttemptAt).timeIntervalSince(rig.clock.now())
            #expect(RetryPolicy().bounds(afterFailures: entry.failures).contains((wait * 1000).rounded() / 1000))
            #expect(entry.stopped == nil, "a transient answer never ends the retries")
            rig.clock.advance(by: wait)
        }
        #expect(rig.source.finished.isEmpty)
        #expect(try rig.store.entries().first?.failures == 5)
        #expect(try rig.store.entries().first?.retries == 5)
        rig.service.trouble = nil
        rig.service.statuses = [Rig.status("credited", finish: true)]
        await rig.client.processDue()
        #expect(rig.source.finished == ["t1"])
    }

    @Test func aRetryAfterParksTheEntryAsLongAsAsked() async throws {
        let rig = try await Rig()
        rig.service.trouble = .status(429)
        rig.service.retryAfter = 90
        try await rig.client.record(Self.transaction("t1"))
        await rig.client.processDue()
        let next = try #require(try rig.store.entries().first?.nextAttemptAt)
        #expect(next.timeIntervalSince(rig.clock.now()) >= 90)
        rig.clock.advance(by: 60)
        await rig.client.processDue()
        #expect(rig.service.count("POST /v1/receipts") == 1, "not before the service said")
    }

    @Test func theAlertHookIsCalledOnceAfterTenFailures() async throws {
        let alerts = NIOLockedValueBox([String]())
        let rig = try await Rig(alert: { entry in alerts.withLockedValue { $0.append(entry.transactionId) } })
        rig.service.trouble = .noAnswer
        try await rig.client.record(Self.transaction("t1"))
        for round in 1...25 {
            await rig.client.processDue()
            #expect(alerts.withLockedValue { $0.count } == (round >= 10 ? 1 : 0))
            rig.clock.advance(by: 3600)
        }
        #expect(try rig.store.entries().first?.alerted == true)
    }

    // MARK: - Terminal answers

    @Test(arguments: [
        ("rejected", "bundle_id_mismatch"), ("needs_review", "unknown_product"), ("credited", "name_the_transaction"),
        ("rejected", "transaction_not_in_receipt"),
    ])
    func aFinalAnswerThatIsNotFinishStopsTheRetriesAndSurfacesItsReason(state: String, reason: String) async throws {
        let rig = try await Rig()
        rig.service.statuses = [Rig.status(state, reason: reason)]
        try await rig.client.record(Self.transaction("t1"))
        var events = rig.client.events.makeAsyncIterator()
        await rig.client.processDue()
        #expect(await events.next() == .stopped(try #require(try rig.store.entries().first)))
        #expect(try rig.store.entries().first?.stopped == StopReason(state: state, reason: reason, message: "said \(reason)"))
        // Time alone asks nothing more.
        for _ in 0..<5 {
            rig.clock.advance(by: 86_400)
            await rig.client.processDue()
        }
        #expect(rig.service.count("GET /v1/receipts/s-1") == 1)
        #expect(rig.source.finished.isEmpty)
    }

    @Test func aHeldUploadCustomerServiceMarksFinishableIsFinishedAtTheNextWake() async throws {
        let rig = try await Rig()
        rig.service.statuses = [Rig.status("needs_review", reason: "unknown_product"), Rig.status("needs_review", reason: "unknown_product")]
        try await rig.client.record(Self.transaction("t1"))
        await rig.client.processDue()
        await rig.client.wake()
        await rig.client.processDue()
        #expect(rig.source.finished.isEmpty, "still held")
        rig.service.statuses = [Rig.status("needs_review", reason: "unknown_product", finish: true)]
        await rig.client.processDue()
        #expect(rig.service.count("GET /v1/receipts/s-1") == 2, "a stopped entry is read again only on a wake")
        await rig.client.wake()
        await rig.client.processDue()
        #expect(rig.source.finished == ["t1"])
        #expect(try rig.store.entries().isEmpty)
    }

    @Test func aReceiptThatDoesNotHoldTheTransactionYetIsUploadedAgainLater() async throws {
        let rig = try await Rig()
        var storeKit1 = Self.transaction("t1")
        storeKit1.signedTransaction = nil
        rig.service.statuses = [Rig.status("rejected", reason: "transaction_not_in_receipt"), Rig.status("credited", finish: true)]
        try await rig.client.record(storeKit1)
        await rig.client.processDue()
        #expect(try rig.store.entries().first?.stopped == nil)
        rig.clock.advance(by: 3)
        await rig.client.processDue()
        #expect(rig.service.count("POST /v1/receipts") == 2)
        #expect(rig.service.bodies("POST /v1/receipts").allSatisfy { $0["transactionId"] == "t1" && $0["receiptData"] == "receipt" })
        #expect(rig.source.finished == ["t1"])
    }

    @Test func anUploadTheServiceRefusesStopsWithItsErrorCode() async throws {
        let rig = try await Rig()
        rig.service.uploadRefusal = "receipt_malformed"
        try await rig.client.record(Self.transaction("t1"))
        await rig.client.processDue()
        #expect(try rig.store.entries().first?.stopped?.reason == "receipt_malformed")
        #expect(rig.source.finished.isEmpty)
    }

    @Test func anUploadTheServiceNoLongerKnowsIsUploadedAgain() async throws {
        let rig = try await Rig()
        rig.service.statusNotFound = true
        try await rig.client.record(Self.transaction("t1"))
        await rig.client.processDue()
        #expect(try rig.store.entries().first?.submissionId == nil)
        rig.service.statusNotFound = false
        rig.service.statuses = [Rig.status("credited", finish: true)]
        rig.clock.advance(by: 3)
        await rig.client.processDue()
        #expect(rig.service.count("POST /v1/receipts") == 2)
        #expect(rig.source.finished == ["t1"])
    }

    // MARK: - What the uploader sends, and in which order

    @Test func eachUploadNamesTheTransactionItHoldsAndItsOrder() async throws {
        let rig = try await Rig()
        rig.service.statuses = [Rig.status("credited", finish: true)]
        let order = UUID()
        var bought = Self.transaction("t1")
        bought.appAccountToken = order
        try await rig.client.record(bought)
        await rig.client.processDue()
        #expect(rig.service.bodies("POST /v1/receipts") == [
            ["signedTransaction": "jws-t1", "orderId": order.uuidString.lowercased(), "userId": "ana"]
        ])
    }

    @Test func neverUploadedEntriesAreUploadedBeforeOnesAlreadyTried() async throws {
        let rig = try await Rig()
        rig.service.trouble = .noAnswer
        try await rig.client.record(Self.transaction("old"))
        await rig.client.processDue()
        rig.service.trouble = nil
        rig.service.statuses = [Rig.status("pending"), Rig.status("pending")]
        rig.clock.advance(by: 10)
        try await rig.client.record(Self.transaction("new"))
        await rig.client.processDue()
        #expect(rig.service.bodies("POST /v1/receipts").map { $0["signedTransaction"] } == ["jws-old", "jws-new", "jws-old"])
    }

    @Test func oneUploadPerTransactionIsInFlightWhateverWakesIt() async throws {
        let rig = try await Rig()
        rig.service.holdUploads = true
        rig.service.statuses = [Rig.status("credited", finish: true)]
        try await rig.client.record(Self.transaction("t1"))
        async let first: Date? = rig.client.processDue()
        try await rig.service.waitForHeldUpload()
        // Launch, foreground and network return all at once.
        await rig.client.wake()
        _ = await rig.client.processDue()
        _ = await rig.client.processDue()
        rig.service.releaseUploads()
        _ = await first
        #expect(rig.service.count("POST /v1/receipts") == 1)
        #expect(rig.source.finished == ["t1"])
    }

    // MARK: - Durable first, users kept apart

    @Test func aPurchaseIsQueuedBeforeTheServiceHearsOfItAndBoundToItsOrder() async throws {
        let rig = try await Rig()
        rig.service.statuses = [Rig.status("credited", finish: true)]
        rig.service.onUpload = {
            let queued = try rig.store.entries().map(\.transactionId)
            #expect(queued == ["t9"])
        }
        let outcome = try await rig.client.purchase(productId: "com.example.coins.60")
        guard case .purchased(let entry) = outcome else { Issue.record("bought nothing: \(outcome)"); return }
        #expect(rig.source.tokens == [UUID(uuidString: Rig.orderId)])
        #expect(entry.orderId == Rig.orderId.lowercased())
        #expect(try rig.store.entries().map(\.transactionId) == ["t9"], "queued when purchase(productId:) returned")
        await rig.client.processDue()
        #expect(rig.source.finished == ["t9"])
    }

    @Test func anEntryKeepsTheUserItWasBoughtUnderAcrossAUserSwitch() async throws {
        let rig = try await Rig()
        rig.service.statuses = [Rig.status("credited", finish: true), Rig.status("credited", finish: true)]
        try await rig.client.record(Self.transaction("anas"))
        try await rig.client.signIn(userId: "ben", token: { "token-ben" })
        try await rig.client.record(Self.transaction("anas"))  // StoreKit reports it again at launch
        try await rig.client.record(Self.transaction("bens"))
        await rig.client.processDue()
        #expect(rig.source.finished == ["bens"], "Ana's purchase waits for Ana")
        #expect(try rig.store.entries().map(\.userId) == ["ana"])
        try await rig.client.signIn(userId: "ana", token: { "token-ana" })
        await rig.client.processDue()
        #expect(rig.source.finished == ["bens", "anas"])
        #expect(rig.service.bodies("POST /v1/receipts").map { $0["userId"] } == ["ben", "ana"])
        #expect(rig.service.authorizations == ["Bearer token-ben", "Bearer token-ana"])
    }

    @Test func aTransactionReportedWhileNobodyIsSignedInBecomesTheNextUsersEntry() async throws {
        let rig = try await Rig(signedIn: false)
        try await rig.client.record(Self.transaction("t1"))
        #expect(try rig.store.entries().map(\.userId) == [""])
        await rig.client.processDue()
        #expect(rig.service.count("POST /v1/receipts") == 0)
        try await rig.client.signIn(userId: "ana", token: { nil })
        #expect(try rig.store.entries().map(\.userId) == ["ana"])
    }

    @Test func entitlementsComeFromTheServiceAndFromDiskWhenItCannotBeAsked() async throws {
        let rig = try await Rig()
        let first = try await rig.client.entitlements()
        #expect(first.balances == ["coins": 180] && !first.isStale)
        #expect(first.productIds == ["com.example.coins.60", "com.example.vip.month"])
        rig.service.trouble = .noAnswer
        let offline = try await rig.client.entitlements()
        #expect(offline.isStale && offline.balances == ["coins": 180])
        rig.service.trouble = .status(404)
        await #expect(throws: IAPClientError.self) { try await rig.client.entitlements() }
    }

    // MARK: - Rig

    static func transaction(_ id: String) -> StoreTransaction {
        StoreTransaction(
            transactionId: id, originalTransactionId: id, productId: "com.example.coins.60", appAccountToken: nil,
            purchaseDate: Date(timeIntervalSince1970: 1_800_000_000), signedTransaction: "jws-\(id)")
    }
}
