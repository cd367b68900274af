import Foundation
import IAPCore
import Testing

/// The failed-attempt limiter of admin tokens and console sign-ins, on a clock of the test's own.
@Suite("Failed admin attempts per address")
struct FailedAttemptsTests {
    let start = Date(timeIntervalSince1970: 1_800_000_000)

    func isRefused(_ admission: FailedAttempts.Admission) -> Bool {
        if case .refused = admission { return true }
        return false
    }

    @Test func fiveFailuresLockTheAddressToOneTryEveryTwoSeconds() {
        let limiter = FailedAttempts()
        for second in 0..<5 {
            #expect(!isRefused(limiter.reserve("198.51.100.7", now: start + Double(second))))
        }
        #expect(limiter.isLocked("198.51.100.7", now: start + 5))
        // Locked: one check, then refusals until two seconds have passed.
        #expect(!isRefused(limiter.reserve("198.51.100.7", now: start + 5)))
        #expect(isRefused(limiter.reserve("198.51.100.7", now: start + 6)))
        #expect(!isRefused(limiter.reserve("198.51.100.7", now: start + 7.5)))
        // Another address is not touched; five minutes later the address is free again.
        #expect(!limiter.isLocked("198.51.100.8", now: start + 6))
        #expect(!limiter.isLocked("198.51.100.7", now: start + 7.5 + 300))
    }

    @Test func aSuccessForgivesItsAttempt() {
        let limiter = FailedAttempts()
        var last: UInt64 = 0
        for second in 0..<5 {
            if case .attempt(let id) = limiter.reserve("198.51.100.7", now: start + Double(second)) { last = id }
        }
        limiter.release(last)
        #expect(!limiter.isLocked("198.51.100.7", now: start + 5))
    }

    /// `IAP_ADMIN_FAILED_ATTEMPTS=0` (a limit of `Int.max`): never locked, nothing kept.
    @Test func anUnlimitedLimiterNeverLocks() {
        let limiter = FailedAttempts(limit: .max)
        for attempt in 0..<1000 {
            #expect(!isRefused(limiter.reserve("198.51.100.7", now: start + Double(attempt) / 1000)))
        }
        #expect(!limiter.isLocked("198.51.100.7", now: start + 1))
    }
}
