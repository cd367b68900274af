public import Foundation
import Store

extension OrderStore {
    /// Whether the intake must count its rate limits here as well as in its own memory: true
    /// on PostgreSQL, where several order services share the store and each would otherwise
    /// allow the whole rate on its own.
    public var sharesRateLimits: Bool { dialect == .postgres }

    /// A bucket untouched this long is full again whatever its rate, and is deleted.
    public static let rateBucketIdleLifetime: TimeInterval = 600

    /// Takes one token from the bucket `key` that every order service on this store shares:
    /// `perSecond` tokens a second refill it, up to `burst`. Returns nil when a token was
    /// taken, else the seconds until one is there. One statement, atomic per bucket on both
    /// backends, run beside the ledger's writes rather than behind them; the clock is the
    /// caller's (services keep their clocks in step; a clock behind never refills twice).
    public func takeRateToken(_ key: String, perSecond: Double, burst: Double, now: Date = Date()) async throws -> Double? {
        let (least, greatest) = dialect == .postgres ? ("LEAST", "GREATEST") : ("MIN", "MAX")
        // The bucket's level once refilled up to now; `?` twice (burst, rate).
        let level = "\(least)(?, rate_bucket.tokens + \(greatest)(0, excluded.updated - rate_bucket.updated) * ?)"
        let sql = """
            INSERT INTO rate_bucket (key, tokens, allowed, updated) VALUES (?, ?, 1, ?)
            ON CONFLICT (key) DO UPDATE SET
                tokens = \(level) - CASE WHEN \(level) >= 1 THEN 1 ELSE 0 END,
                allowed = CASE WHEN \(level) >= 1 THEN 1 ELSE 0 END,
                updated = \(greatest)(rate_bucket.updated, excluded.updated)
            RETURNING allowed, tokens
            """
        let rate = max(perSecond, 0.001)
        let full = max(burst, 1)
        let arguments: SQLArguments = [key, full - 1, now.timeIntervalSince1970, full, rate, full, rate, full, rate]
        let row = try await database.writeCounters { db in try await db.row(sql: sql, arguments: arguments) }
        guard let row else { throw OrderStoreError(.unavailable, "the rate-limit bucket '\(key)' returned no row") }
        if (row["allowed"] as Int) != 0 { return nil }
        return max(0, 1 - (row["tokens"] as Double)) / rate
    }

    /// Deletes the buckets nobody touched for `rateBucketIdleLifetime` (they are full, as a
    /// bucket never seen is); returns how many.
    @discardableResult
    public func purgeIdleRateBuckets(now: Date = Date()) async throws -> Int {
        let cutoff = now.timeIntervalSince1970 - Self.rateBucketIdleLifetime
        return try await database.writeCounters { db in
            try await db.execute(sql: "DELETE FROM rate_bucket WHERE updated < ?", arguments: [cutoff])
        }
    }
}
