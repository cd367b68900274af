public import Foundation

/// What is in force now: the one rule `/entitlements`, `/subscriptions` and the console read
/// grants and subscriptions by. A period is in force until its end or, in Apple's billing
/// grace period, until the grace ends; nothing past both is in force, whatever state was
/// last recorded (Apple may say nothing when a subscription simply ends).
public enum InForce {
    /// Whether a grant may be used at `now`: active, and not past its period (or grace).
    public static func grant(isActive: Bool, expiresAt: Date?, gracePeriodExpiresAt: Date?, at now: Date) -> Bool {
        guard isActive else { return false }
        guard let expiresAt else { return true }
        return max(expiresAt, gracePeriodExpiresAt ?? expiresAt) > now
    }

    /// A subscription's state as of `now`: the recorded one, but `expired` once a state that
    /// gives access (`active`, `grace_period`) is past the period's end and its grace. Billing
    /// retry, expiry and revocation stand as recorded.
    public static func subscriptionState(
        recorded: SubscriptionState, expiresDate: Date?, gracePeriodExpiresDate: Date?, at now: Date
    ) -> SubscriptionState {
        guard recorded == .active || recorded == .gracePeriod, let expiresDate else { return recorded }
        return max(expiresDate, gracePeriodExpiresDate ?? expiresDate) > now ? recorded : .expired
    }

    /// Whether a subscription gives access at `now`: not expired or revoked as of now, and not
    /// past its period's end and grace.
    public static func subscription(recorded: SubscriptionState, expiresDate: Date?, gracePeriodExpiresDate: Date?, at now: Date) -> Bool {
        let state = subscriptionState(
            recorded: recorded, expiresDate: expiresDate, gracePeriodExpiresDate: gracePeriodExpiresDate, at: now)
        guard state != .expired, state != .revoked else { return false }
        return max(expiresDate ?? .distantFuture, gracePeriodExpiresDate ?? .distantPast) > now
    }
}
