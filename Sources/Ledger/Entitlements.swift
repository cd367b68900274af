public import Foundation
public import IAPCore

/// What a user may use right now: the one answer most apps need.
public struct Entitlements: Sendable, Equatable, Encodable {
    /// Active grants, not past their period.
    public var grants: [Grant]
    /// Subscriptions not expired (active, in grace period or in billing retry before expiry).
    public var subscriptions: [Subscription]
    /// Consumables credited, summed by what they grant (e.g. `["coins": 180]`).
    public var balances: [String: Int]

    /// What a user holding `grants` and `subscriptions` may use at `now`: the grants and
    /// subscriptions in force (`InForce`), and the balances of consumables (the numeric grant
    /// values of consumable grants in force, summed, pinned at the ends of `Int`; `catalog` says
    /// which products are consumable, and without one every grant without an expiry counts).
    public init(grants: [Grant], subscriptions: [Subscription], catalog: Catalog?, at now: Date) {
        self.grants = grants.filter { $0.isInForce(at: now) }
        self.subscriptions = subscriptions.filter { $0.isInForce(at: now) }
        var balances: [String: Int] = [:]
        for grant in self.grants {
            let type = catalog?.product(grant.productId)?.type
            guard type == .consumable || (catalog == nil && grant.expiresAt == nil) else { continue }
            for case let (name, .number(amount)) in grant.grantValues {
                let (sum, overflow) = balances[name, default: 0].addingReportingOverflow(amount)
                balances[name] = overflow ? (amount < 0 ? Int.min : Int.max) : sum
            }
        }
        self.balances = balances
    }
}
