public import Foundation
import IAPCore

/// Which subscriptions the reconciliation asks Apple about, and in what order: the one rule,
/// so that the store only reads the subscriptions that may be due and the choice is the core's.
///
/// Apple says nothing when a notification is lost, so the reconciliation asks about every
/// subscription whose recorded state may be out of date:
/// - one in billing retry or its grace period: Apple decides when that ends;
/// - an active one whose period (with its grace) ends before the horizon, or ended already;
/// - an active one holding periods Apple told of that nobody owns yet (`owner_unknown`,
///   `buyer_unknown`): its recorded expiry may be such a period's, which must never hide the
///   subscription from the owner's reconciliation.
/// Expired and revoked subscriptions are not asked about: a resubscription or a reversed refund
/// comes with a notification, and Apple's undelivered notifications are read by the
/// reconciliation's second task.
public enum ReconciliationChoice {
    /// The states the store reads candidates in: only a subscription in one of them can be due.
    public static let candidateStates: [SubscriptionState] = [.active, .billingRetry, .gracePeriod]

    /// One subscription as the store holds it.
    public struct Candidate: Sendable, Equatable {
        /// The subscription's chain.
        public var originalTransactionId: String
        /// Its state as recorded.
        public var state: SubscriptionState
        /// The end of its current period, as recorded.
        public var expiresDate: Date?
        /// The end of its billing grace period, when in one.
        public var gracePeriodExpiresDate: Date?
        /// Whether it holds periods Apple told of that nobody owns yet.
        public var holdsUnownedPeriods: Bool

        /// Creates a candidate.
        public init(
            originalTransactionId: String, state: SubscriptionState, expiresDate: Date?, gracePeriodExpiresDate: Date? = nil,
            holdsUnownedPeriods: Bool = false
        ) {
            self.originalTransactionId = originalTransactionId
            self.state = state
            self.expiresDate = expiresDate
            self.gracePeriodExpiresDate = gracePeriodExpiresDate
            self.holdsUnownedPeriods = holdsUnownedPeriods
        }
    }

    /// Whether `candidate` is asked about in a run whose horizon is `horizon`.
    public static func isDue(_ candidate: Candidate, horizon: Date) -> Bool {
        switch candidate.state {
        case .billingRetry, .gracePeriod:
            return true
        case .active:
            if candidate.holdsUnownedPeriods { return true }
            guard let expires = candidate.expiresDate else { return false }
            return max(expires, candidate.gracePeriodExpiresDate ?? expires) < horizon
        case .expired, .revoked:
            return false
        }
    }

    /// The due candidates, soonest end first (an unknown end first of all), then by chain.
    public static func due<C>(_ candidates: [C], horizon: Date, by candidate: (C) -> Candidate) -> [C] {
        candidates.map { (item: $0, candidate: candidate($0)) }
            .filter { isDue($0.candidate, horizon: horizon) }
            .sorted { left, right in
                let (a, b) = (left.candidate, right.candidate)
                if a.expiresDate != b.expiresDate {
                    guard let x = a.expiresDate else { return true }
                    guard let y = b.expiresDate else { return false }
                    return x < y
                }
                return a.originalTransactionId.utf8.lexicographicallyPrecedes(b.originalTransactionId.utf8)
            }
            .map(\.item)
    }
}

extension ReconciliationChoice {
    /// Whether a notification rebuilt from Apple's history is news to the ledger: a refund or
    /// revocation of a credit key whose recorded revocation stands (`LedgerFacts.Revocation.stands`)
    /// and under which nothing is granted is not; anything else is applied.
    public static func isNews(
        _ notificationType: String, revocation: LedgerFacts.Revocation?, grantedUnderKey: Bool
    ) -> Bool {
        guard [.refund, .revoke].contains(NotificationType(notificationType)) else { return true }
        return revocation?.stands != true || grantedUnderKey
    }

    /// Whether applying a notification rebuilt from Apple's history corrected the ledger: it
    /// credited, revoked or restored a grant (`outcome`, as the notification's row recorded it),
    /// or moved the subscription's state, expiry or newest transaction.
    public static func corrected(outcome: String, subscriptionChanged: Bool) -> Bool {
        let corrections: [NotificationOutcome] = [.credit(.credited, nil), .revoked, .restored]
        return subscriptionChanged || corrections.contains { $0.description == outcome }
    }
}
