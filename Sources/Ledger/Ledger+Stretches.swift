import Foundation
import IAPCore

// A subscription's chain may be bought into by several accounts of the app on one Apple ID:
// Apple keeps the chain's `originalTransactionId` when a customer resubscribes after a lapse,
// upgrades or crossgrades, and the account that bought again need not be the first one. Each
// new purchase (Apple's `transactionReason` PURCHASE on a later transaction) begins a stretch
// of the chain, owned by whoever proves they bought it; the renewals after it are that
// stretch's, until the next new purchase. The subscription row's owner is the owner of the
// latest stretch anyone owns, `ownedSince` that stretch's first purchase date (nil: the
// first stretch, the whole chain so far).

/// Whose stretch of its chain a billing period belongs to, as the store's facts say.
enum StretchOwner: Equatable {
    /// The stretch's owner.
    case owner(String)
    /// Nobody owns the stretch yet and nothing in it awaits a buyer (the chain's first stretch,
    /// or an earlier one nobody proved): the first upload Apple vouches for claims it.
    case unclaimed
    /// A new purchase begins the stretch and awaits its buyer's proof: its periods wait with it.
    case awaitsBuyer
}

extension Planner {
    /// The periods Apple told of that nobody owns yet and nothing else credited (a restore of
    /// the same period credits its key): they wait for their stretch's owner.
    var pendingPeriods: [LedgerFacts.Purchase] {
        facts.unownedPeriods.filter { facts.grants(of: $0.creditKey ?? .transaction($0.transactionId)).isEmpty }
    }

    /// Whether `purchase` lies in the subscription owner's stretch of its chain (or the chain
    /// has no subscription row yet).
    func inOwnersStretch(_ purchase: VerifiedPurchase) -> Bool {
        guard let subscription = facts.subscription, subscription.originalTransactionId == purchase.originalTransactionId else {
            return true
        }
        return (purchase.purchaseDate ?? .distantFuture) >= (subscription.ownedSince ?? .distantPast)
    }

    /// Whose stretch `purchase` (a billing period of a subscription) belongs to.
    func stretchOwner(of purchase: VerifiedPurchase) -> StretchOwner {
        guard let subscription = facts.subscription, subscription.originalTransactionId == purchase.originalTransactionId else {
            return .unclaimed
        }
        let date = purchase.purchaseDate ?? .distantFuture
        let pending = pendingPeriods.filter { $0.transactionId != purchase.transactionId }
        func awaited(after start: Date) -> Bool {
            pending.contains { $0.awaitsBuyer && ($0.purchaseDate ?? .distantPast) > start && ($0.purchaseDate ?? .distantPast) <= date }
        }
        let since = subscription.ownedSince ?? .distantPast
        if let owner = subscription.userId, date >= since {
            // The owner's stretch, unless a later new purchase nobody proved yet began another.
            return awaited(after: since) ? .awaitsBuyer : .owner(owner)
        }
        // An earlier stretch (or nobody owns any): the latest period credited before it says
        // (or a new purchase its buyer proved after a refund stopped it: it would have been
        // credited), unless a new purchase awaiting its buyer lies between.
        let credited = facts.grants.filter {
            $0.originalTransactionId == purchase.originalTransactionId && $0.source == .apple
                && ($0.periodStart ?? .distantFuture) <= date && $0.transactionId != purchase.transactionId
        }
        let latestCredited = credited.max { ($0.periodStart ?? .distantPast, $0.id) < ($1.periodStart ?? .distantPast, $1.id) }
        let refunded = facts.refundedPeriods.filter {
            $0.beginsStretch && $0.originalTransactionId == purchase.originalTransactionId && ($0.purchaseDate ?? .distantFuture) <= date
                && $0.transactionId != purchase.transactionId
        }
        let latestRefunded = refunded.max { ($0.purchaseDate ?? .distantPast) < ($1.purchaseDate ?? .distantPast) }
        var previous = latestCredited.map { (start: $0.periodStart ?? .distantPast, owner: $0.userId) }
        if let row = latestRefunded, (row.purchaseDate ?? .distantPast) > (previous?.start ?? .distantPast) {
            previous = (row.purchaseDate ?? .distantPast, row.userId)
        }
        if awaited(after: previous?.start ?? .distantPast) { return .awaitsBuyer }
        return previous.map { .owner($0.owner) } ?? .unclaimed
    }

    /// `purchase`, a billing period, was credited to `owner`: the periods of its stretch that
    /// Apple told of while nobody owned it are theirs too, and the subscription is theirs when
    /// this stretch is its latest owned one.
    /// `before` is the subscription as it was before this credit recorded it.
    /// `claims`: nobody owned its stretch before this credit (or it begins one), so the periods
    /// Apple told of in it are claimed with it.
    mutating func claimStretch(
        of purchase: VerifiedPurchase, owner: String, upload: LedgerEvent.Upload, before: Subscription?,
        claims: Bool
    ) {
        guard facts.subscription?.originalTransactionId == purchase.originalTransactionId else { return }
        let before = before?.originalTransactionId == purchase.originalTransactionId ? before : nil
        let date = purchase.purchaseDate ?? .distantPast
        let startsStretch = purchase.isNewPurchaseInChain
        let since = before?.userId == nil ? nil : before?.ownedSince
        let pending = pendingPeriods.filter { $0.transactionId != purchase.transactionId }
        // After it: up to the next new purchase awaiting its buyer, and, for an earlier stretch,
        // up to the current owner's.
        let end = pending.filter { $0.awaitsBuyer && ($0.purchaseDate ?? .distantPast) > date }
            .compactMap(\.purchaseDate).min()
        let bound = [end, since.flatMap { $0 > date ? $0 : nil }].compactMap { $0 }.min() ?? .distantFuture
        // Before it only for the chain's first owner (a new purchase begins its stretch; an
        // earlier stretch's periods are claimed by their own proof).
        let from = startsStretch || before?.userId != nil ? date : .distantPast
        for period in pending where claims && !period.awaitsBuyer {
            let at = period.purchaseDate ?? .distantPast
            guard at >= from, at < bound else { continue }
            creditUnowned(period, owner: owner, upload: upload)
        }
        // The subscription is the latest owned stretch's.
        guard var row = facts.subscription else { return }
        if before?.userId == nil {
            // Its first owner: from this new purchase on, or the whole chain.
            let ownedSince = startsStretch ? date : nil
            guard row.userId != owner || row.ownedSince != ownedSince else { return }
            row.userId = owner
            row.ownedSince = ownedSince
            row.updatedAt = now
            emit(.putSubscription(row))
        } else if startsStretch, let current = before?.userId, date > (before?.ownedSince ?? .distantPast) {
            moveSubscription(purchase.originalTransactionId, from: current, to: owner, boughtAt: date)
        }
    }
}
