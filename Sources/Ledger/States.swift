/// The states and sources the ledger records, each declared once: the store keeps their raw
/// values in its columns, the API and the console show them as they are (an interpolation
/// writes the raw value too).

/// Where a grant stands.
public enum GrantState: String, Codable, Sendable, CaseIterable, CustomStringConvertible {
    /// The raw value, as stored and shown.
    public var description: String { rawValue }

    /// The user may use it (within its period, for a subscription).
    case active
    /// Taken back: by Apple's refund or revocation, a restore to another user, or an admin.
    case revoked
}

/// Who credited a grant.
public enum GrantSource: String, Codable, Sendable, CaseIterable, CustomStringConvertible {
    /// The raw value, as stored and shown.
    public var description: String { rawValue }

    /// A purchase Apple confirmed.
    case apple
    /// Customer service, by hand.
    case manual
}

/// What took a grant back.
public enum GrantRevoker: String, Codable, Sendable, CaseIterable, CustomStringConvertible {
    /// The raw value, as stored and shown.
    public var description: String { rawValue }

    /// Apple: a refund or a revocation.
    case apple
    /// A restore of the same purchase by another user.
    case transfer
    /// Customer service.
    case admin

    /// The revoker an actor of the ledger stands for: `apple` and `transfer` are themselves,
    /// every admin's name is `admin`.
    public init(actor: String) {
        self = GrantRevoker(rawValue: actor) ?? .admin
    }
}

/// Where one of our orders stands.
public enum OrderState: String, Codable, Sendable, CaseIterable, CustomStringConvertible {
    /// The raw value, as stored and shown.
    public var description: String { rawValue }

    /// Waiting for the purchase made for it.
    case created
    /// The purchase made for it is credited.
    case paid
    /// Given up before anything paid it.
    case cancelled
    /// Its purchase was refunded.
    case refunded
}

/// Where an auto-renewable subscription stands, as Apple's status says.
public enum SubscriptionState: String, Codable, Sendable, CaseIterable, CustomStringConvertible {
    /// The raw value, as stored and shown.
    public var description: String { rawValue }

    /// In its period.
    case active
    /// Past its period, not renewed.
    case expired
    /// Apple is retrying a failed renewal; nothing in force past the period.
    case billingRetry = "billing_retry"
    /// Apple is retrying a failed renewal within the app's billing grace period: in force.
    case gracePeriod = "grace_period"
    /// Refunded or revoked.
    case revoked

    /// The state of Apple's subscription `status` (1 active, 2 expired, 3 billing retry, 4
    /// grace period, 5 revoked); nil for another number.
    public init?(appleStatus: Int) {
        switch appleStatus {
        case 1: self = .active
        case 2: self = .expired
        case 3: self = .billingRetry
        case 4: self = .gracePeriod
        case 5: self = .revoked
        default: return nil
        }
    }

    /// Whether Apple is still trying to renew it (billing retry or grace period).
    public var isRetrying: Bool { self == .billingRetry || self == .gracePeriod }
}
