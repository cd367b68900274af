import Foundation
@testable import Intake
import Logging
@testable import OrderStore
@testable import Store
import Ledger
import Testing
import TestSupport

/// The rate-limit buckets in the order store (both backends): what several order services on
/// one PostgreSQL count together.
@Suite("Rate-limit buckets in the order store", .teardown)
struct RateBucketTests {
    let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-buckets-\(UUID().uuidString)")

    @Test(arguments: TestStore.backends) func aBucketAllowsItsBurstThenRefillsAtItsRate(_ backend: Backend) async throws {
        let store = try await TestStore.open(in: folder, on: backend)
        Teardown.add { await store.close() }
        let start = Date()
        for _ in 0..<3 {
            #expect(try await store.takeRateToken("user:ana", perSecond: 1, burst: 3, now: start) == nil)
        }
        let wait = try #require(try await store.takeRateToken("user:ana", perSecond: 1, burst: 3, now: start))
        #expect(abs(wait - 1) < 0.001, "\(wait)")
        // Another key has a bucket of its own.
        #expect(try await store.takeRateToken("user:bob", perSecond: 1, burst: 3, now: start) == nil)
        // 1.5 s later: one token and a half; one is taken, half a second to the next.
        let later = start.addingTimeInterval(1.5)
        #expect(try await store.takeRateToken("user:ana", perSecond: 1, burst: 3, now: later) == nil)
        let next = try #require(try await store.takeRateToken("user:ana", perSecond: 1, burst: 3, now: later))
        #expect(abs(next - 0.5) < 0.001, "\(next)")
        // A clock behind the bucket's never refills it.
        #expect(try await store.takeRateToken("user:ana", perSecond: 1, burst: 3, now: start) != nil)
        // Refilled up to the burst, never beyond it.
        let muchLater = start.addingTimeInterval(3600)
        for _ in 0..<3 {
            #expect(try await store.takeRateToken("user:ana", perSecond: 1, burst: 3, now: muchLater) == nil)
        }
        #expect(try await store.takeRateToken("user:ana", perSecond: 1, burst: 3, now: muchLater) != nil)
    }

    @Test(arguments: TestStore.backends) func idleBucketsArePurgedAndStartFull(_ backend: Backend) async throws {
        let store = try await TestStore.open(in: folder, on: backend)
        Teardown.add { await store.close() }
        let start = Date()
        #expect(try await store.takeRateToken("address:10.0.0.1", perSecond: 1, burst: 1, now: start) == nil)
        #expect(try await store.takeRateToken("address:10.0.0.2", perSecond: 1, burst: 1, now: start.addingTimeInterval(590)) == nil)
        let purged = try await store.purgeIdleRateBuckets(now: start.addingTimeInterval(OrderStore.rateBucketIdleLifetime + 1))
        #expect(purged == 1)
        let left: Int? = try await store.testValue("SELECT COUNT(*) FROM rate_bucket")
        #expect(left == 1)
    }

    /// Two order services on one PostgreSQL (two store objects, each with its own
    /// connections) count one user's and one address's requests together: the deployment
    /// allows the burst once, not once per service.
    @Test(.needsPostgres)
    func twoOrderServicesAllowTheRateOnceNotOnceEach() async throws {
        let stores = try await [TestStore.open(in: folder, on: .postgres), TestStore.open(in: folder, on: .postgres)]
        Teardown.add { for store in stores { await store.close() } }
        #expect(stores[0].sharesRateLimits && stores[1].sharesRateLimits)
        let logger = Logger(label: "iap.tests.ratelimit")
        let limit = RateLimit(perSecond: 1, burst: 10)
        let limiters = stores.map { RateLimiter(limit, scope: "user", store: $0) }
        let allowed = await withTaskGroup(of: Bool.self) { group in
            for index in 0..<40 {
                group.addTask { await limiters[index % 2].take("ana", logger: logger) == nil }
            }
            return await group.reduce(into: 0) { count, ok in count += ok ? 1 : 0 }
        }
        // Ten at once, and at most one more per second the loop took (each service alone would allow ten).
        #expect(allowed >= 10 && allowed <= 12, "\(allowed) of 40 allowed")
        // Another user, and the same user's address limit, are buckets of their own.
        #expect(await limiters[1].take("bob", logger: logger) == nil)
        let addresses = RateLimiter(limit, scope: "address", store: stores[0])
        #expect(await addresses.take("ana", logger: logger) == nil)
    }

    /// Racing takes at one instant, from two services: exactly the burst is allowed.
    @Test(.needsPostgres)
    func concurrentTakesFromTwoServicesNeverExceedTheBurst() async throws {
        let stores = try await [TestStore.open(in: folder, on: .postgres), TestStore.open(in: folder, on: .postgres)]
        Teardown.add { for store in stores { await store.close() } }
        let now = Date()
        // A take that got no connection in time (the machine busy with other suites) ran no
        // statement and took nothing: it is asked again, as a caller would, so the count stays
        // exact. One whose statement may have run (no answer in time) fails the test.
        func take(_ store: OrderStore) async throws -> Bool {
            for _ in 0..<200 {
                do {
                    return try await store.takeRateToken("notifications:appstore", perSecond: 1, burst: 20, now: now) == nil
                } catch let error as SQLError
                    where error.kind == .connection
                    && (error.description.contains("no connection to") || error.description.contains("did not answer a moment ago"))
                {
                    try await Task.sleep(for: .milliseconds(100))
                }
            }
            throw SQLError(.connection, "no connection in 200 tries")
        }
        let allowed = try await withThrowingTaskGroup(of: Bool.self) { group in
            for index in 0..<60 {
                group.addTask { try await take(stores[index % 2]) }
            }
            return try await group.reduce(into: 0) { count, ok in count += ok ? 1 : 0 }
        }
        #expect(allowed == 20)
    }

    /// On SQLite one order service writes the file: the limits stay in its memory alone.
    @Test func oneSQLiteServiceCountsInMemoryOnly() async throws {
        let store = try await TestStore.open(in: folder)
        Teardown.add { await store.close() }
        #expect(!store.sharesRateLimits)
        let limiter = RateLimiter(RateLimit(perSecond: 1, burst: 2), scope: "user", store: store)
        let logger = Logger(label: "iap.tests.ratelimit")
        #expect(await limiter.take("ana", logger: logger) == nil)
        #expect(await limiter.take("ana", logger: logger) == nil)
        #expect(await limiter.take("ana", logger: logger) != nil)
        let buckets: Int? = try await store.testValue("SELECT COUNT(*) FROM rate_bucket")
        #expect(buckets == 0)
    }
}
