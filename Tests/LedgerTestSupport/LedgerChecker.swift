import Foundation
import IAPCore
import Ledger
import Testing

// A model checker of the ledger's functional core alone: no store, no broker, no clock. Seeded
// random sequences of what Apple and the app's users do (purchases by every product type,
// uploads by owner and stranger on every route, stale receipts, bare ids, restores, renewals,
// upgrades, extensions, full, prorated and declined refunds, reversals, family revocations,
// consent rescinded, customer service's actions) with Apple's notifications late, duplicated
// and reordered; the ground-truth half (LedgerGroundTruth.swift) adds resubscriptions by any
// account of the app on the chain's Apple ID, upgrades as Apple marks them (purchases), and
// StoreKit 1 restores no receipt holds. Every plan is written to the tables in memory (`MemoryLedger`, which keeps the
// store's unique keys) and, after every step, what users hold is compared with a reference
// model written here (`ReferenceLedger`). A failing sequence is shrunk to the fewest steps
// that still fail, printed, and kept in Tests/LedgerTests/Fixtures/ledger-checker-regressions.txt.

// MARK: - The tables in memory

/// The order store's ledger tables in memory, read and written the way `OrderStore`'s shell
/// does (the same queries, the same unique keys): the shell the checker runs plans through.
struct MemoryLedger {
    var purchases: [String: LedgerFacts.Purchase] = [:]
    var purchaseRow: [String: Int] = [:]
    var grants: [Grant] = []
    var revocations: [CreditKey: LedgerFacts.Revocation] = [:]
    var subscriptions: [String: Subscription] = [:]
    var orders: [String: Order] = [:]
    /// Notification UUIDs applied (the shell applies each once).
    var applied: Set<String> = []
    var audits = 0
    var messages = 0
    /// What this shell did, when a test asks for it (`ShellConformanceTests` replays it on the
    /// real stores): each order placed, and each event with the query, facts and plan of it.
    var journal: [JournalEntry]?

    enum JournalEntry {
        case order(Order)
        case step(event: LedgerEvent, query: LedgerQuery, facts: LedgerFacts, plan: LedgerPlan, now: Date)
    }

    /// The app places an order (outside the ledger: `POST /v1/orders`).
    mutating func place(_ order: Order) {
        orders[order.id] = order
        journal?.append(.order(order))
    }

    /// A write the store would refuse: a unique key broken, or a change to a row that is not there.
    struct Refused: Error, CustomStringConvertible {
        let description: String
    }

    func facts(for query: LedgerQuery, event: LedgerEvent) -> LedgerFacts {
        var facts = LedgerFacts()
        if let id = query.transactionId { facts.purchase = purchases[id] }
        // As the store reads them: a subscription's chain, or a one-time purchase's key alone.
        let chain = query.readsSubscription && query.originalTransactionId != nil
        facts.grants = grants.filter {
            ($0.creditKey != nil && $0.creditKey == query.creditKey)
                || (chain && $0.originalTransactionId != nil && $0.originalTransactionId == query.originalTransactionId)
                || $0.transactionId == query.transactionId
        }.map { grant in
            // A chain's grants come with their period's start (its purchase's date, joined);
            // a one-time purchase's without.
            var read = grant
            read.periodStart = chain ? purchases[grant.transactionId]?.purchaseDate : nil
            return read
        }
        if let key = query.creditKey { facts.revocation = revocations[key] }
        if let original = query.originalTransactionId, query.readsSubscription { facts.subscription = subscriptions[original] }
        if let original = query.originalTransactionId, facts.subscription != nil {
            facts.unownedPeriods = purchases.values
                .filter { $0.originalTransactionId == original && $0.isUnowned }
                .sorted { ($0.purchaseDate ?? .distantPast, $0.transactionId) < ($1.purchaseDate ?? .distantPast, $1.transactionId) }
            facts.refundedPeriods = purchases.values
                .filter { $0.originalTransactionId == original && $0.heldReason == .stoppedByRefund && $0.beginsStretch }
                .sorted { ($0.purchaseDate ?? .distantPast, $0.transactionId) < ($1.purchaseDate ?? .distantPast, $1.transactionId) }
            let keys = Set(facts.unownedPeriods.compactMap(\.creditKey))
            facts.unownedRevocations = revocations.values.filter { keys.contains($0.creditKey) }
        }
        if case .notification = event, let key = query.creditKey, let original = query.originalTransactionId {
            facts.blocked = purchases.values.filter { $0.creditKey == key && $0.heldReason == .stoppedByRefund }
                .sorted { ($0.creditedAt, purchaseRow[$0.transactionId]!) < ($1.creditedAt, purchaseRow[$1.transactionId]!) }
            let credited = purchases.values.filter { $0.heldReason == nil }.sorted { purchaseRow[$0.transactionId]! < purchaseRow[$1.transactionId]! }
            facts.chainCreditedUser =
                credited.first { $0.transactionId == query.transactionId }?.userId
                ?? credited.first { $0.originalTransactionId == original }?.userId
        }
        if let token = query.tokenOrderId { facts.tokenOrder = orders[token.lowercased()] }
        if let named = query.uploadOrderId { facts.uploadOrder = orders[named.lowercased()] }
        if query.readsOrderCandidates, let named = query.uploadOrderId, let order = orders[named.lowercased()] {
            facts.openOrders = orders.values
                .filter { $0.userId == order.userId && $0.productId == order.productId && $0.state == .created }
                .sorted { ($0.createdAt, $0.id) < ($1.createdAt, $1.id) }
                .prefix(16).map { $0 }
            facts.orderCandidates = purchases.values
                .filter {
                    $0.userId == order.userId && $0.productId == order.productId && $0.orderId == nil && $0.heldReason == nil
                        && $0.purchaseDate != nil && $0.appAccountToken == nil
                }
                .sorted { ($1.purchaseDate!, $0.transactionId) < ($0.purchaseDate!, $1.transactionId) }
                .prefix(16)
                .map { purchase in
                    LedgerFacts.OrderCandidate(
                        transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId,
                        productId: purchase.productId, purchaseDate: purchase.purchaseDate, orderId: nil,
                        granted: grants.contains {
                            $0.transactionId == purchase.transactionId && $0.userId == purchase.userId && $0.isActive
                        },
                        ownershipType: purchase.ownershipType)
                }
        }
        return facts
    }

    /// Plans `event` and writes the plan.
    mutating func apply(_ event: LedgerEvent, policy: LedgerPolicy, now: Date) throws -> LedgerPlan {
        var recorded: LedgerFacts.Purchase?
        if case .manualGrant(let grant) = event, let id = grant.transactionId { recorded = purchases[id] }
        let query = Ledger.query(for: event, policy: policy, recorded: recorded)
        let facts = facts(for: query, event: event)
        let plan = Ledger.plan(event, facts: facts, policy: policy, now: now)
        journal?.append(.step(event: event, query: query, facts: facts, plan: plan, now: now))
        // In place: a refused write ends the run, so nothing reads what it left half done.
        for change in plan.changes { try write(change) }
        return plan
    }

    private func grantIndex(_ transactionId: String) throws -> Int {
        guard let index = grants.firstIndex(where: { $0.transactionId == transactionId }) else {
            throw Refused(description: "no grant \(transactionId) to change")
        }
        return index
    }

    mutating func write(_ change: LedgerChange) throws {
        switch change {
        case .recordPurchase(let row, let ifAbsent):
            if purchases[row.transactionId] != nil {
                if ifAbsent { return }
                throw Refused(description: "purchase \(row.transactionId) recorded twice")
            }
            purchases[row.transactionId] = row
            purchaseRow[row.transactionId] = purchaseRow.count + 1
        case .releasePurchase(let id):
            purchases[id]?.heldReason = nil
        case .claimPurchase(let row):
            guard purchases[row.transactionId]?.isUnowned == true else {
                throw Refused(description: "purchase \(row.transactionId) claimed but not unowned")
            }
            purchases[row.transactionId] = row
        case .grant(var grant):
            if grants.contains(where: { $0.transactionId == grant.transactionId }) {
                throw Refused(description: "a second grant of transaction \(grant.transactionId)")
            }
            if grants.contains(where: { $0.creditKey == grant.creditKey && $0.isActive }) {
                throw Refused(description: "a second active grant of \(grant.creditKey?.stored ?? "")")
            }
            if grants.contains(where: { $0.creditKey == grant.creditKey && $0.userId == grant.userId }) {
                throw Refused(description: "a second grant of \(grant.creditKey?.stored ?? "") to \(grant.userId)")
            }
            grant.id = Int64(grants.count + 1)
            grants.append(grant)
        case .revokeGrant(let id, let by, let at):
            let index = try grantIndex(id)
            guard grants[index].isActive else { throw Refused(description: "grant \(id) revoked twice") }
            grants[index].isActive = false
            grants[index].revokedAt = at
            grants[index].revokedBy = by
        case .reactivateGrant(let id):
            let index = try grantIndex(id)
            if grants.contains(where: { $0.creditKey == grants[index].creditKey && $0.isActive }) {
                throw Refused(description: "a second active grant of \(grants[index].creditKey?.stored ?? "") (reactivated)")
            }
            grants[index].isActive = true
            grants[index].revokedAt = nil
            grants[index].revokedBy = nil
        case .reduceGrant(let id, let quantity, let json):
            let index = try grantIndex(id)
            guard quantity > 0 else { throw Refused(description: "grant \(id) reduced to \(quantity)") }
            grants[index].quantity = quantity
            grants[index].grantJSON = json
        case .extendGrant(let id, let date), .endGrant(let id, let date):
            grants[try grantIndex(id)].expiresAt = date
        case .setGracePeriod(let id, let until):
            grants[try grantIndex(id)].gracePeriodExpiresAt = until
        case .bindOrder(let orderId, let transactionId, let at):
            if orders.values.contains(where: { $0.transactionId == transactionId && $0.id != orderId }) {
                throw Refused(description: "transaction \(transactionId) pays two orders")
            }
            // Who really paid: only the purchase made for an order pays it, never one bought before it.
            if let order = orders[orderId], let purchase = purchases[transactionId], purchase.appAccountToken != orderId,
                let bought = purchase.purchaseDate, bought < order.createdAt - LedgerPolicy.clockSkewAllowed
            {
                throw Refused(description: "order \(orderId) paid by \(transactionId), bought before the order was placed")
            }
            orders[orderId]?.state = .paid
            orders[orderId]?.transactionId = transactionId
            orders[orderId]?.updatedAt = at
        case .attachOrder(let orderId, let transactionId):
            if purchases[transactionId]?.orderId == nil { purchases[transactionId]?.orderId = orderId }
            if let index = grants.firstIndex(where: { $0.transactionId == transactionId }), grants[index].orderId == nil {
                grants[index].orderId = orderId
            }
        case .setOrderState(let orderId, let transactionId, let state, let at):
            if orders[orderId]?.transactionId == transactionId {
                orders[orderId]?.state = state
                orders[orderId]?.updatedAt = at
            }
        case .putRevocation(let row):
            revocations[row.creditKey] = row
        case .putSubscription(let row):
            subscriptions[row.originalTransactionId] = row
        case .recordConsumptionRequest, .recordTerms:
            break
        case .audit:
            audits += 1
        case .publish:
            messages += 1
        }
    }

    /// What users hold: each credit key's active grant, its holder and units; and each
    /// subscription's owner.
    var holdings: Holdings {
        var keys: [String: Holdings.Held] = [:]
        // Goodwill grants (under their own `manual-` ids) buy nothing and are left out.
        for grant in grants where grant.isActive && grant.creditKey?.stored.hasPrefix("txn:manual-") != true {
            keys[grant.creditKey?.stored ?? grant.transactionId] = .init(user: grant.userId, units: grant.quantity)
        }
        return Holdings(keys: keys, subscriptionOwners: subscriptions.compactMapValues(\.userId))
    }
}

/// What users hold, as both the ledger and the reference model say.
struct Holdings: Equatable, CustomStringConvertible {
    struct Held: Equatable, CustomStringConvertible {
        var user: String
        var units: Int
        var description: String { "\(user)×\(units)" }
    }
    var keys: [String: Held]
    var subscriptionOwners: [String: String]

    var description: String {
        let held = keys.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }.joined(separator: " ")
        let owners = subscriptionOwners.sorted { $0.key < $1.key }.map { "\($0.key)→\($0.value)" }.joined(separator: " ")
        return "[\(held)] subscriptions [\(owners)]"
    }
}

// MARK: - Apple's side

/// The products of the checker's app: one of each type, and a higher tier of the subscription.
enum CheckerCatalog {
    static let coins = "coins"
    static let pro = "pro"
    static let vip = "vip"
    static let vipPlus = "vip_plus"
    static let catalog = Catalog(products: [
        .init(productId: coins, type: .consumable, grant: ["coins": .number(100)]),
        .init(productId: pro, type: .nonConsumable, grant: ["tier": .name("pro")]),
        .init(productId: vip, type: .autoRenewable, grant: ["tier": .name("vip")]),
        .init(productId: vipPlus, type: .autoRenewable, grant: ["tier": .name("vip_plus")]),
    ])
}

/// One transaction as Apple holds it now.
struct AppleTransaction {
    var id: String
    var original: String
    var product: String
    var quantity: Int
    /// The user whose Apple account (and device) made it.
    var buyer: Int
    var token: String?
    /// The order the app placed for it (its token's, or one placed without a token).
    var order: String?
    var period: String?
    var purchased: Date
    var expires: Date?
    var revokedAt: Date?
    var revocationType: String?
    var percentage: Int?
    var upgraded = false
    /// When Apple last signed a change to it (its notifications carry this).
    var signed: Date
    /// Apple's `transactionReason`: PURCHASE for what the customer bought, RENEWAL for a
    /// renewal; nil where Apple's answer does not say.
    var reason: String?
    /// When the chain's first period was bought (Apple's `originalPurchaseDate`).
    var originalPurchased: Date?
    /// The Apple ID (its device) it was bought or restored on: the receipt that holds it.
    var device = 0
    /// For a period: the index of the purchase it renews (nil: it is one, bought by `buyer`).
    var renews: Int?
    /// A restore: what it restores was bought before, under another id.
    var isRestore = false
    /// Whether receipts hold it under its own id (a StoreKit 1 restore's may never be).
    var inReceipt = true
    /// A seat of a multiseat subscription an organization paid for and assigned (`ASSIGNED`):
    /// access, not a payment: it pays no order, and only `ASSIGNMENT_REVOKE` takes it back.
    var assigned = false
    /// Access a family member's purchase shares with its holder's Apple ID (`FAMILY_SHARED`):
    /// the holder paid nothing, so it pays no order of theirs.
    var familyShared = false

    var isSubscription: Bool { period != nil }

    /// The purchase as Apple's signed answer says it now, with `evidence`.
    func purchase(evidence: OwnershipEvidence?) -> VerifiedPurchase {
        var purchase = VerifiedPurchase(
            transactionId: id, originalTransactionId: original, productId: product, quantity: quantity,
            purchaseDate: purchased, environment: .production, cancellationDate: revokedAt, expiresDate: expires,
            appAccountToken: token, webOrderLineItemId: period,
            ownershipType: assigned ? "ASSIGNED" : familyShared ? "FAMILY_SHARED" : "PURCHASED",
            isUpgraded: upgraded ? true : nil, signedDate: signed)
        purchase.revocationType = revokedAt == nil ? nil : revocationType
        purchase.revocationPercentage = revokedAt == nil ? nil : percentage
        purchase.transactionReason = reason
        purchase.originalPurchaseDate = originalPurchased
        purchase.evidence = evidence
        return purchase
    }
}

// MARK: - The reference model

/// The ledger's rules stated once more, in terms of who holds what: the checker's yardstick.
/// docs/ledger.md says the same in prose.
struct ReferenceLedger {
    let restore: RestorePolicy
    /// Each credit key's holder, once anyone was credited with it.
    var holder: [String: String] = [:]
    /// Units bought, per credit key credited.
    var units: [String: Int] = [:]
    /// Apple's word per key, as delivered: refunds (with the units of a prorated one) and reversals.
    var apple: [String: [(at: Date, reversal: Bool, units: Int?)]] = [:]
    /// Keys customer service took back: only a person gives them again.
    var revokedByHand: Set<String> = []
    /// Keys a standing refund stopped before anyone held them: who proved them, by which transaction.
    var stopped: [String: (user: String, transactionId: String)] = [:]
    /// Transactions recorded for a user: held ones (`held`) and credited ones.
    var recorded: [String: (user: String, held: Bool)] = [:]
    /// Each subscription's owner.
    var subscriptionOwner: [String: String] = [:]
    /// Orders: id → (user, product, paid).
    var orders: [String: (user: String, product: String, paid: Bool)] = [:]
    /// Periods Apple told of while their subscription had no owner, per chain: credited to the
    /// owner its first credit makes.
    var told: [String: [(transaction: AppleTransaction, key: String)]] = [:]

    /// The units a prorated refund of `percentage` (Apple's thousandths of a percent) takes
    /// back of `quantity`: the nearest whole unit, halves up, at least one and at most all.
    static func unitsRefunded(of quantity: Int, percentage: Int) -> Int {
        let exact = Double(quantity) * Double(percentage) / 100_000
        return min(max(Int(exact.rounded(.toNearestOrAwayFromZero)), 1), quantity)
    }

    enum Standing: Equatable {
        case none
        case all
        case units(Int)
    }

    /// What Apple took back of `key` now: the refunds dated after the latest reversal (a
    /// reversal wins a tie), whatever order they arrived in; of those, a full refund takes it
    /// all, and otherwise the latest signed share is Apple's word (a transaction carries one
    /// `revocationPercentage`: a later one replaces an earlier, as after a reversal nobody told).
    func standing(_ key: String) -> Standing {
        let events = apple[key] ?? []
        let lastReversal = events.filter(\.reversal).map(\.at).max()
        let refunds = events.filter { event in !event.reversal && (lastReversal.map { event.at > $0 } ?? true) }
        if refunds.isEmpty { return .none }
        if refunds.contains(where: { $0.units == nil }) { return .all }
        return .units(refunds.max { $0.at < $1.at }!.units!)
    }

    /// Whether `key`'s holder may use it now.
    func inForce(_ key: String) -> Bool {
        holder[key] != nil && !revokedByHand.contains(key) && standing(key) != .all
    }

    var holdings: Holdings {
        var keys: [String: Holdings.Held] = [:]
        for (key, user) in holder where inForce(key) {
            var held = units[key]!
            if case .units(let refunded) = standing(key) { held = max(held - refunded, 1) }
            keys[key] = .init(user: user, units: held)
        }
        return Holdings(keys: keys, subscriptionOwners: subscriptionOwner)
    }

    /// Apple said `key` was refunded (`units` of it, for a prorated refund of a consumable).
    mutating func refunded(_ key: String, at: Date, units: Int?) {
        apple[key, default: []].append((at, false, units))
    }

    /// Apple reversed a refund of `key`: what a refund stopped is credited now.
    mutating func reversed(_ key: String, at: Date, transaction: AppleTransaction, period: Bool, catalog: Catalog) {
        let before = standing(key)
        apple[key, default: []].append((at, true, nil))
        if before == .all, standing(key) != .all, holder[key] == nil, let (user, id) = stopped[key] {
            var stoppedTransaction = transaction
            stoppedTransaction.id = id
            credit(key, to: user, transaction: stoppedTransaction, period: period)
        } else if standing(key) == .none, holder[key] == nil, stopped[key] == nil, recorded[transaction.id] == nil,
            transaction.token.flatMap({ orders[$0] }) != nil
        {
            // Given back, never uploaded: its token's order says whose it is.
            received(transaction, key: key, uploader: nil, evidence: .signedUpload, catalog: catalog)
        }
    }

    mutating func credit(_ key: String, to user: String, transaction: AppleTransaction, period: Bool) {
        holder[key] = user
        units[key] = max(transaction.quantity, 1)
        recorded[transaction.id] = recorded[transaction.id] ?? (user, false)
        if period, subscriptionOwner[transaction.original] == nil { subscriptionOwner[transaction.original] = user }
    }

    /// A purchase of `transaction` reached the ledger: uploaded by `uploader` with `evidence`,
    /// or told by a notification (`uploader` nil: it goes to whoever owns it).
    mutating func received(_ transaction: AppleTransaction, key: String, uploader: String?, evidence: OwnershipEvidence, catalog: Catalog) {
        let type = catalog.product(transaction.product)?.type
        let period = type == .autoRenewable
        if transaction.upgraded { return }
        if let at = transaction.revokedAt {
            let partial = transaction.revocationType == "REFUND_PRORATED" && type == .consumable
                ? transaction.percentage.map { ReferenceLedger.unitsRefunded(of: max(transaction.quantity, 1), percentage: $0) }.flatMap { $0 < max(transaction.quantity, 1) ? $0 : nil }
                : nil
            refunded(key, at: at, units: partial)
        }
        let tokenOrder = transaction.token.flatMap { orders[$0] }
        // Whoever a notification's purchase belongs to: its holder, its subscription's owner, the
        // user its chain was credited to, the owner of the order its token names.
        let claimant = uploader ?? holder[key] ?? subscriptionOwner[transaction.original]
            ?? recorded.first { $0.key == transaction.id && !$0.value.held }?.value.user
            ?? tokenOrder?.user
        guard let claimant else {
            if period, uploader == nil, recorded[transaction.id] == nil, holder[key] == nil,
                !(told[transaction.original] ?? []).contains(where: { $0.key == key })
            {
                told[transaction.original, default: []].append((transaction, key))
            }
            return
        }
        if let current = holder[key] {
            // Held already: a restore moves it only under `transfer`, only on Apple's word about
            // an upload by another user, and only while it is in force.
            guard restore == .transfer, uploader != nil, evidence == .signedUpload, current != claimant,
                !key.hasPrefix("txn:"), inForce(key), recorded[transaction.id].map({ $0.user == claimant }) ?? true
            else { return }
            holder[key] = claimant
            recorded[transaction.id] = recorded[transaction.id] ?? (claimant, false)
            if period { subscriptionOwner[transaction.original] = claimant }
            return
        }
        // An order is paid by the purchase it was placed for (a subscription's first period); an
        // assigned seat is access, and pays none.
        let pays = !(period && transaction.id != transaction.original) && !transaction.assigned
        let mismatch = tokenOrder.map { pays && !$0.paid && $0.product != transaction.product } ?? false
        if standing(key) == .all {
            // Stopped: remembered for the one who proved it, credited if Apple reverses the refund
            // (unless its token names an order for another product: then a person decides).
            if tokenOrder != nil || evidence == .signedUpload, recorded[transaction.id] == nil {
                let user = tokenOrder?.user ?? claimant
                recorded[transaction.id] = (user, true)
                if stopped[key] == nil, !mismatch { stopped[key] = (user, transaction.id) }
                if period, subscriptionOwner[transaction.original] == nil { subscriptionOwner[transaction.original] = user }
            }
            return
        }
        if recorded[transaction.id] != nil { return }
        // Whose it is: the token's order, the subscription's owner, or the uploader on Apple's word.
        var owner: String?
        if let tokenOrder {
            owner = tokenOrder.user
        } else if period, let subscriber = subscriptionOwner[transaction.original] {
            owner = subscriber
            if restore == .transfer, uploader != nil, evidence == .signedUpload, subscriber != claimant {
                owner = claimant
                subscriptionOwner[transaction.original] = claimant
            }
        } else if evidence == .signedUpload {
            owner = claimant
        }
        guard let owner else { return }
        if let tokenOrder, pays, !tokenOrder.paid, tokenOrder.product != transaction.product {
            // Held for a person, yet proven: a subscription is its owner's.
            recorded[transaction.id] = (owner, true)
            if period, subscriptionOwner[transaction.original] == nil { subscriptionOwner[transaction.original] = owner }
            return
        }
        if let token = transaction.token, pays, tokenOrder?.paid == false { orders[token]?.paid = true }
        let firstOwner = period && subscriptionOwner[transaction.original] == nil
        credit(key, to: owner, transaction: transaction, period: period)
        if firstOwner { creditTold(transaction.original, to: owner, except: transaction.id) }
    }

    /// The subscription `original` has its first owner: the periods Apple told of before are theirs
    /// (stopped, for a reversal to credit, where Apple took one back).
    mutating func creditTold(_ original: String, to owner: String, except id: String) {
        for (transaction, key) in told.removeValue(forKey: original) ?? []
        where transaction.id != id && recorded[transaction.id] == nil && holder[key] == nil {
            if standing(key) == .all {
                recorded[transaction.id] = (owner, true)
                if stopped[key] == nil { stopped[key] = (owner, transaction.id) }
            } else {
                credit(key, to: owner, transaction: transaction, period: true)
            }
        }
    }
}

// MARK: - One sequence

/// One step of a sequence. Its numbers are resolved when it runs (an index modulo what exists
/// then), so any subsequence of a sequence is a sequence too: what shrinking needs.
enum CheckerStep: Equatable, CustomStringConvertible {
    /// A user buys: product, quantity, and whether the app set a token (0 none, 1 the buyer's
    /// order for it, 2 the buyer's order for another product, 3 another user's order).
    case buy(user: Int, product: Int, quantity: Int, token: Int)
    /// An upload of a transaction: by its buyer or someone else, signed or as a bare id, or as
    /// the buyer's receipt (which holds every purchase of the device Apple has not refunded).
    case upload(transaction: Int, stranger: Int, route: Int)
    /// The buyer's device restores a one-time purchase or a period; uploaded by the app's user then.
    case restore(transaction: Int, stranger: Int)
    case renew(subscription: Int)
    case upgrade(subscription: Int)
    case extend(subscription: Int, days: Int)
    /// Apple refunds: 0 fully, 1 prorated, 2 a family member's access revoked.
    case refund(transaction: Int, kind: Int, percent: Int)
    case reverse(transaction: Int)
    case decline(transaction: Int)
    case expire(subscription: Int)
    case failToRenew(subscription: Int)
    case rescindConsent
    /// One waiting notification arrives; sometimes it stays waiting too (a duplicate to come).
    case deliver(pick: Int, duplicate: Bool)
    /// Everything waiting arrives at once in a drawn order; checked against Apple's order.
    case releaseAll(order: UInt64)
    case grantHeld(pick: Int)
    case revokeByHand(pick: Int)
    case goodwill(user: Int)
    /// Ground truth only: StoreKit 1 restores a one-time purchase or a period under an id no
    /// receipt holds; the app uploads its receipt naming that id and what it stands for.
    case restoreMissing(transaction: Int, stranger: Int)
    /// Ground truth only: a user of the app buys subscription `subscription` again on its Apple
    /// ID after it lapsed (a resubscription, maybe by another account of the app): `token` 0
    /// none, 1 the buyer's order, 2 an order placed without a token (StoreKit 1).
    case resubscribe(subscription: Int, user: Int, token: Int)
    /// Ground truth only: user `user` taps buy `count` times: as many orders of coins are
    /// placed (StoreKit 1, no token) before any of their purchases, which are then made in the
    /// order `shuffle` draws.
    case doubleTap(user: Int, count: Int, shuffle: Int)
    /// Ground truth only: the server finishes at Apple a consumable it credited
    /// (`IAP_FINISH_TRANSACTIONS=both`): it leaves every later receipt of its device.
    case serverFinish(transaction: Int)

    var description: String {
        switch self {
        case .buy(let u, let p, let q, let t): "buy(u\(u), \(p), ×\(q), token \(t))"
        case .upload(let t, let s, let r): "upload(#\(t), stranger \(s), route \(r))"
        case .restore(let t, let s): "restore(#\(t), stranger \(s))"
        case .renew(let s): "renew(sub \(s))"
        case .upgrade(let s): "upgrade(sub \(s))"
        case .extend(let s, let d): "extend(sub \(s), \(d) days)"
        case .refund(let t, let k, let p): "refund(#\(t), kind \(k), \(p)%)"
        case .reverse(let t): "reverse(#\(t))"
        case .decline(let t): "decline(#\(t))"
        case .expire(let s): "expire(sub \(s))"
        case .failToRenew(let s): "failToRenew(sub \(s))"
        case .rescindConsent: "rescindConsent"
        case .deliver(let p, let d): "deliver(\(p)\(d ? ", again later" : ""))"
        case .releaseAll(let o): "releaseAll(\(o % 1000))"
        case .grantHeld(let p): "grantHeld(\(p))"
        case .revokeByHand(let p): "revokeByHand(\(p))"
        case .goodwill(let u): "goodwill(u\(u))"
        case .restoreMissing(let t, let s): "restoreMissing(#\(t), stranger \(s))"
        case .resubscribe(let s, let u, let t): "resubscribe(sub \(s), u\(u), token \(t))"
        case .doubleTap(let u, let c, let o): "doubleTap(u\(u), ×\(c), order \(o))"
        case .serverFinish(let t): "serverFinish(#\(t))"
        }
    }

    /// A sequence of `count` steps drawn from `seed`; `truth` draws the steps only the
    /// ground-truth run takes too.
    static func sequence(seed: UInt64, count: Int, truth: Bool = false) -> [CheckerStep] {
        var random = ModelRandom(seed: seed)
        return (0..<count).map { _ in
            let n = random.below(100)
            let a = random.below(64)
            let b = random.below(64)
            if truth {
                let extra = random.below(100)
                if extra < 5 { return .restoreMissing(transaction: a, stranger: random.pick([0, 0, 1])) }
                if extra < 10 { return .resubscribe(subscription: a, user: random.below(4), token: random.pick([0, 0, 1, 2])) }
                if extra < 16 { return .doubleTap(user: random.below(4), count: random.within(2...3), shuffle: random.below(6)) }
                if extra < 22 { return .serverFinish(transaction: a) }
            }
            switch n {
            case 0..<16: return .buy(user: random.below(4), product: random.below(4), quantity: random.within(1...3), token: random.pick([0, 0, 1, 1, 2, 3]))
            case 16..<38: return .upload(transaction: a, stranger: random.pick([0, 0, 0, 1, 2]), route: random.below(3))
            case 38..<43: return .restore(transaction: a, stranger: random.pick([0, 0, 1]))
            case 43..<49: return .renew(subscription: a)
            case 49..<51: return .upgrade(subscription: a)
            case 51..<53: return .extend(subscription: a, days: random.within(1...30))
            case 53..<60: return .refund(transaction: a, kind: random.pick([0, 0, 1, 1, 2]), percent: random.within(1...99))
            case 60..<64: return .reverse(transaction: a)
            case 64..<66: return .decline(transaction: a)
            case 66..<68: return .expire(subscription: a)
            case 68..<70: return .failToRenew(subscription: a)
            case 70: return .rescindConsent
            case 71..<88: return .deliver(pick: b, duplicate: random.chance(20))
            case 88..<92: return .releaseAll(order: random.next())
            case 92..<95: return .grantHeld(pick: b)
            case 95..<98: return .revokeByHand(pick: b)
            default: return .goodwill(user: random.below(4))
            }
        }
    }
}

/// A sequence that broke a rule: where, and why.
struct CheckerFailure: Error, CustomStringConvertible {
    var step: Int
    var problem: String
    var log: [String] = []
    var description: String { "step \(step): \(problem)" }
}

/// One run of a sequence: Apple's side, the ledger in memory, the reference model.
struct CheckerRun {
    let policy: LedgerPolicy
    var ledger = MemoryLedger()
    var reference: ReferenceLedger
    var transactions: [AppleTransaction] = []
    /// Each subscription: its transactions, newest last.
    var subscriptions: [[Int]] = []
    /// Notifications sent and not yet delivered, each with its transaction's index.
    var waiting: [(notification: AppStoreNotification, transaction: Int?)] = []
    var clock = Date(timeIntervalSince1970: 1_800_000_000)
    var counter = 0
    var steps = 0
    /// What happened, step by step, when `tracing` (a shrunk failure's replay prints it).
    var log: [String] = []
    var tracing = false
    /// Checked against who really paid only (`LedgerGroundTruth.swift`), with the steps the
    /// reference model does not know; otherwise against the reference model too.
    let truth: Bool
    /// Ground truth: the users whose uploads carried Apple's proof of each transaction (a
    /// signed transaction, a receipt holding it, a restore).
    var provers: [String: Set<String>] = [:]
    /// Transactions the app finished, as its answers told it.
    var finished: Set<String> = []
    /// Consumables the server finished at Apple: they leave every later receipt, but the app
    /// still holds each until it finishes it.
    var serverFinished: Set<String> = []
    /// What customer service granted or took back by hand, by identity: a person decided.
    var byHand: Set<String> = []
    /// Each order's user, as the app placed it.
    var orderUser: [String: String] = [:]
    /// What Apple took back at some point (a later reversal gives it back, and the ledger with it).
    var tookBack: Set<String> = []
    /// The subscriptions (original ids) whose renewal failed once: Apple retried billing them.
    var retried: Set<String> = []

    init(restore: RestorePolicy, truth: Bool = false) {
        policy = LedgerPolicy(catalog: CheckerCatalog.catalog, sandbox: .accept, restore: restore)
        reference = ReferenceLedger(restore: restore)
        self.truth = truth
    }

    static func user(_ index: Int) -> String { "u\(index)" }

    mutating func nextId(_ prefix: String) -> String {
        counter += 1
        return "\(prefix)\(counter)"
    }

    /// What Apple's documentation says is bought once, in the stored form the store's keys
    /// compare with: a consumable per transaction, a non-consumable or non-renewing
    /// subscription per original transaction, an auto-renewable subscription per billing period.
    /// Stated here, not asked of the ledger, so that a wrong key in the ledger shows.
    func key(_ transaction: AppleTransaction) -> String {
        switch CheckerCatalog.catalog.product(transaction.product)?.type {
        case .nonConsumable?, .nonRenewing?: "otx:\(transaction.original)"
        case .autoRenewable?: transaction.period.map { "wol:\($0)" } ?? "txn:\(transaction.id)"
        case .consumable?, nil: "txn:\(transaction.id)"
        }
    }

    /// Runs `steps`, comparing after each; throws the first failure.
    mutating func run(_ steps: [CheckerStep]) throws {
        for (index, step) in steps.enumerated() {
            self.steps = index
            clock += 60
            if tracing { log.append("  \(step)") }
            // Apple stops retrying after a few days: what it sent a week ago has arrived.
            if truth { try deliverOverdue(before: clock) }
            try perform(step)
            if tracing { log.append("    holds \(ledger.holdings)") }
            try check()
            // Apple may ask about any transaction at any time: one of them, in turn.
            if truth, !transactions.isEmpty { try checkRefundAnswer(about: index % transactions.count) }
        }
        // Everything Apple sent arrives in the end (in the order it waits in; the drawn
        // `releaseAll` steps compare orders).
        self.steps = steps.count
        let rest = waiting
        waiting = []
        for item in rest { try deliver(item) }
        try check()
        if truth {
            // Every app uploads its refreshed receipt once more: then every paid purchase is
            // credited to who really paid, or held for a person.
            try catchUp()
            try check()
            try checkWhoPaidInTheEnd()
            for index in transactions.indices { try checkRefundAnswer(about: index) }
        }
    }

    func fail(_ problem: String) -> CheckerFailure { CheckerFailure(step: steps, problem: problem, log: log) }

    static func describe(_ event: LedgerEvent) -> String {
        func purchase(_ p: VerifiedPurchase) -> String {
            "\(p.transactionId)/\(p.originalTransactionId) \(p.productId)×\(p.quantity)"
                + (p.webOrderLineItemId.map { " \($0)" } ?? "") + (p.appAccountToken.map { " token \($0)" } ?? "")
                + (p.cancellationDate != nil ? " revoked(\(p.revocationType ?? "?") \(p.revocationPercentage ?? 0))" : "")
                + (p.isUpgraded == true ? " upgraded" : "")
        }
        switch event {
        case .upload(let p, let upload): return "upload \(purchase(p)) by \(upload.userId) (\(p.ownershipEvidence.rawValue))"
        case .notification(let n, _):
            return "\(n.notificationType) \(n.notificationUUID) signed \(Int(n.signedDate!.timeIntervalSince1970) % 100_000) \(n.purchase.map(purchase) ?? "")"
        case .manualGrant(let grant): return "grant by hand \(grant.transactionId ?? grant.goodwillId) to \(grant.userId)"
        case .manualRevoke(let id, _, _, _): return "revoke by hand \(id)"
        case .naming(let naming): return "naming order \(naming.orderId ?? "-") transaction \(naming.missingTransactionId ?? "-")"
        case .bind(let original, let userId, _, _, _): return "bind by hand \(original) to \(userId)"
        }
    }

    mutating func apply(_ event: LedgerEvent) throws -> LedgerPlan {
        do {
            let plan = try ledger.apply(event, policy: policy, now: clock)
            if tracing { log.append("    \(Self.describe(event)) → \(plan.outcome)") }
            return plan
        } catch {
            throw fail("the store refused the plan: \(error)")
        }
    }

    mutating func perform(_ step: CheckerStep) throws {
        switch step {
        case .buy(let user, let productIndex, let quantity, let tokenChoice):
            let products = [CheckerCatalog.coins, CheckerCatalog.pro, CheckerCatalog.vip, CheckerCatalog.coins]
            let product = products[productIndex % products.count]
            var token: String?
            if tokenChoice > 0 {
                let orderUser = tokenChoice == 3 ? Self.user((user + 1) % 4) : Self.user(user)
                let orderProduct = tokenChoice == 2 ? (product == CheckerCatalog.pro ? CheckerCatalog.coins : CheckerCatalog.pro) : product
                let id = nextId("order-")
                ledger.place(.init(id: id, userId: orderUser, productId: orderProduct, state: .created, transactionId: nil, createdAt: clock))
                reference.orders[id] = (orderUser, orderProduct, false)
                self.orderUser[id] = orderUser
                token = id
            }
            let id = nextId("t")
            var order = token
            if tokenChoice == 0, productIndex % products.count == 3 {
                // The app placed an order and bought without a token (StoreKit 1): only a
                // purchase bought at or after the order pays it.
                let orderId = "order-for-\(id)"
                ledger.place(.init(
                    id: orderId, userId: Self.user(user), productId: product, state: .created, transactionId: nil,
                    createdAt: clock - 30))
                orderUser[orderId] = Self.user(user)
                order = orderId
            }
            let subscription = product == CheckerCatalog.vip
            let transaction = AppleTransaction(
                id: id, original: id, product: product, quantity: product == CheckerCatalog.coins ? quantity : 1, buyer: user,
                token: token, order: order, period: subscription ? nextId("w") : nil, purchased: clock,
                expires: subscription ? clock + 30 * 86_400 : nil, signed: clock, reason: "PURCHASE", originalPurchased: clock,
                device: user)
            var bought = transaction
            // A third of the subscriptions (by the quantity drawn, which a subscription does not
            // use, so the sequences kept draw as before) are seats an organization assigned.
            bought.assigned = subscription && quantity == 3
            if truth, product == CheckerCatalog.pro, quantity == 3 {
                // Ground truth: a third of the non-consumables (by the same unused quantity) are
                // family sharing: someone outside the app's users bought it, and its access
                // reaches the user's Apple ID under an id of its own. The user's app had placed
                // an order for it (StoreKit 1, no token) before the family's access arrived.
                try familyShare(&bought)
                return
            }
            transactions.append(bought)
            if subscription {
                subscriptions.append([transactions.count - 1])
                notify("SUBSCRIBED", subtype: "INITIAL_BUY", about: transactions.count - 1, status: 1)
            } else if quantity == 2 {
                notify("ONE_TIME_CHARGE", about: transactions.count - 1)
            }
        case .upload(let pick, let stranger, let route):
            guard !transactions.isEmpty else { return }
            let index = pick % transactions.count
            let transaction = transactions[index]
            let uploader = stranger == 0 ? Self.user(transaction.buyer) : Self.user((transaction.buyer + stranger) % 4)
            if truth {
                try appUpload(index, by: uploader, route: route, stale: stranger == 2, pick: pick)
                return
            }
            switch route {
            case 0:
                // A signed transaction (or Apple's answer about the uploaded receipt).
                try upload([index], by: uploader, evidence: .signedUpload)
            case 1:
                // A bare id looked up with Apple: proves nothing.
                try upload([index], by: uploader, evidence: .lookup)
            default:
                // The buyer's receipt as the device has it: every purchase made on it up to this
                // one (a stale receipt lacks the newest), without what Apple refunded of one-time
                // purchases.
                let upTo = stranger == 2 ? index : index + 1
                let held = (0..<upTo).filter {
                    transactions[$0].buyer == transaction.buyer && !(transactions[$0].revokedAt != nil && !transactions[$0].isSubscription)
                }
                if pick >= 32, transaction.token == nil, let order = transaction.order {
                    // The app names only the order it bought for (no token, no transaction id).
                    try upload(held, by: uploader, evidence: .signedUpload, naming: .order(order))
                } else {
                    try upload(held, by: uploader, evidence: .signedUpload)
                }
            }
        case .restore(let pick, let stranger):
            let restorable = transactions.indices.filter { transactions[$0].product != CheckerCatalog.coins && !transactions[$0].upgraded }
            guard !restorable.isEmpty else { return }
            var restored = transactions[restorable[pick % restorable.count]]
            restored.id = nextId("r")
            restored.signed = clock
            restored.isRestore = true
            transactions.append(restored)
            let uploader = Self.user((restored.buyer + stranger) % 4)
            if truth {
                try appUpload(transactions.count - 1, by: uploader, route: 0, stale: false, pick: 0)
                return
            }
            try upload([transactions.count - 1], by: uploader, evidence: .signedUpload)
        case .renew(let pick):
            guard let (chain, last) = subscription(pick), !transactions[last].upgraded else { return }
            // Apple renews when the period ends: the clock gets there first, and the new period
            // begins where the last one ends (a receipt's later period bought after that is a
            // resubscription by its dates).
            clock = max(clock, transactions[last].expires!)
            var renewal = transactions[last]
            renewal.id = nextId("t")
            renewal.period = nextId("w")
            renewal.purchased = renewal.expires!
            renewal.expires = renewal.purchased + 30 * 86_400
            renewal.revokedAt = nil
            renewal.renews = transactions[last].renews ?? last
            renewal.token = truth ? transactions[renewal.renews!].token : transactions[chain[0]].token
            renewal.reason = "RENEWAL"
            // A renewal is bought for no order (the ground-truth run says so; the reference
            // model's run keeps its old sequences).
            if truth { renewal.order = nil }
            renewal.isRestore = false
            renewal.signed = clock
            transactions.append(renewal)
            subscriptions[pick % subscriptions.count].append(transactions.count - 1)
            notify("DID_RENEW", about: transactions.count - 1, status: 1)
        case .upgrade(let pick):
            guard let (_, last) = subscription(pick), transactions[last].product == CheckerCatalog.vip, !transactions[last].upgraded
            else { return }
            transactions[last].upgraded = true
            transactions[last].signed = clock
            var higher = transactions[last]
            higher.id = nextId("t")
            higher.period = nextId("w")
            higher.product = CheckerCatalog.vipPlus
            higher.purchased = clock
            higher.expires = clock + 30 * 86_400
            higher.upgraded = false
            higher.revokedAt = nil
            higher.renews = transactions[last].renews ?? last
            // Apple marks an upgrade a purchase (`transactionReason: PURCHASE`), bought by the
            // account that holds the stretch (the ground-truth run says so). The reference
            // model's run keeps it a period of the chain, as if Apple had said RENEWAL (its
            // dates would make the ledger read it as the upgrade it is).
            higher.reason = truth ? "PURCHASE" : "RENEWAL"
            // Not bought for the first purchase's order (the ground-truth run says so).
            if truth { higher.order = nil }
            higher.isRestore = false
            higher.signed = clock
            transactions.append(higher)
            subscriptions[pick % subscriptions.count].append(transactions.count - 1)
            notify("DID_CHANGE_RENEWAL_PREF", subtype: "UPGRADE", about: transactions.count - 1, status: 1)
        case .extend(let pick, let days):
            guard let (_, last) = subscription(pick) else { return }
            transactions[last].expires = transactions[last].expires! + Double(days) * 86_400
            transactions[last].signed = clock
            notify("RENEWAL_EXTENDED", about: last, status: 1)
        case .refund(let pick, let kind, let percent):
            guard !transactions.isEmpty else { return }
            let index = pick % transactions.count
            var transaction = transactions[index]
            if transaction.revokedAt != nil, transaction.revocationType != "REFUND_PRORATED" { return }
            let previous = transaction.revocationType == "REFUND_PRORATED" ? transaction.percentage ?? 0 : 0
            transaction.revokedAt = clock
            transaction.signed = clock
            switch kind {
            case _ where transaction.assigned:
                // The organization took the seat back; Apple refunds a seat nothing.
                transaction.revocationType = "ASSIGNMENT_REVOKE"
                transaction.percentage = nil
            case 0:
                transaction.revocationType = "REFUND_FULL"
                transaction.percentage = nil
            case 1:
                // Apple's share grows with each prorated refund.
                transaction.revocationType = "REFUND_PRORATED"
                transaction.percentage = min(100_000, max(previous + 1, percent * 1_000 + previous))
            default:
                transaction.revocationType = "FAMILY_REVOKE"
                transaction.percentage = nil
            }
            transactions[index] = transaction
            if truth {
                sameRevocation(as: index)
                if allowedUnits(identity(transaction))?.contains(0) ?? true { tookBack.insert(identity(transaction)) }
            }
            notify(kind == 2 || transaction.assigned ? "REVOKE" : "REFUND", about: index, status: transaction.isSubscription ? 5 : nil)
        case .reverse(let pick):
            let refunded = transactions.indices.filter {
                transactions[$0].revokedAt != nil && !["FAMILY_REVOKE", "ASSIGNMENT_REVOKE"].contains(transactions[$0].revocationType)
            }
            guard !refunded.isEmpty else { return }
            let index = refunded[pick % refunded.count]
            transactions[index].revokedAt = nil
            transactions[index].revocationType = nil
            transactions[index].percentage = nil
            transactions[index].signed = clock
            if truth { sameRevocation(as: index) }
            notify("REFUND_REVERSED", about: index, status: transactions[index].isSubscription ? 1 : nil)
        case .decline(let pick):
            guard !transactions.isEmpty else { return }
            notify("REFUND_DECLINED", about: pick % transactions.count)
        case .expire(let pick):
            guard let (_, last) = subscription(pick) else { return }
            transactions[last].signed = clock
            notify("EXPIRED", subtype: "VOLUNTARY", about: last, status: 2)
        case .failToRenew(let pick):
            guard let (chain, last) = subscription(pick) else { return }
            retried.insert(transactions[chain[0]].original)
            transactions[last].signed = clock
            notify("DID_FAIL_TO_RENEW", subtype: "GRACE_PERIOD", about: last, status: 4, grace: clock + 6 * 86_400)
        case .rescindConsent:
            let notification = AppStoreNotification(
                notificationUUID: nextId("n-"), notificationType: "RESCIND_CONSENT", subtype: nil, environment: .production,
                bundleId: "app", signedDate: clock, purchase: nil, appTransactionId: nextId("app-"))
            waiting.append((notification, nil))
        case .deliver(let pick, let duplicate):
            guard !waiting.isEmpty else { return }
            let index = pick % waiting.count
            let item = waiting[index]
            if !duplicate { waiting.remove(at: index) }
            if truth { try deliverOverdue(before: item.notification.signedDate!) }
            try deliver(item)
        case .releaseAll(let order):
            guard !waiting.isEmpty else { return }
            // Apple's order on a copy, the drawn order here: the same ledger.
            var inOrder = self
            inOrder.waiting.sort { ($0.notification.signedDate!, $0.notification.notificationUUID) < ($1.notification.signedDate!, $1.notification.notificationUUID) }
            let batch = inOrder.waiting
            inOrder.waiting = []
            for item in batch { try inOrder.deliver(item) }
            var random = ModelRandom(seed: order)
            var shuffled = waiting
            for i in stride(from: shuffled.count - 1, to: 0, by: -1) { shuffled.swapAt(i, random.below(i + 1)) }
            if truth { shuffled = Self.withinRetryWindow(shuffled) }
            waiting = []
            for item in shuffled { try deliver(item) }
            // What a notification could not credit yet (a renewal of a subscription nobody
            // owned when it arrived) the app's next upload does: compared after it, on copies.
            // Under `transfer` an upload may move what it restores, so there the notifications
            // alone are compared.
            var drawn = self
            if policy.restore == .keep {
                try drawn.catchUp()
                try inOrder.catchUp()
            }
            guard drawn.ledger.holdings == inOrder.ledger.holdings else {
                let apple = tracing ? "\n  in Apple's order:\n" + inOrder.log.suffix(from: log.count).joined(separator: "\n") : ""
                throw fail("notifications in another order give another ledger:\n  drawn order: \(drawn.ledger.holdings)\n  Apple's order: \(inOrder.ledger.holdings)" + apple)
            }
        case .grantHeld(let pick):
            // Periods nobody owns yet (told before any upload) are left to the owner's upload.
            let held = ledger.purchases.values.filter {
                $0.heldReason != nil && $0.heldReason != .stoppedByRefund && !$0.isUnowned
            }.sorted { $0.transactionId < $1.transactionId }
            guard !held.isEmpty else { return }
            let purchase = held[pick % held.count]
            let plan = try apply(
                .manualGrant(
                    .init(
                        userId: purchase.userId, productId: purchase.productId, quantity: purchase.quantity,
                        grant: CheckerCatalog.catalog.product(purchase.productId)?.grant(quantity: purchase.quantity) ?? [:],
                        transactionId: purchase.transactionId, goodwillId: nextId("manual-"), actor: "agent", reason: "checked")))
            if let transaction = transactions.first(where: { $0.id == purchase.transactionId }) {
                byHand.insert(identity(transaction))
            }
            if case .grant = plan.outcome, let transaction = transactions.first(where: { $0.id == purchase.transactionId }) {
                let key = purchase.creditKey?.stored ?? key(transaction)
                reference.revokedByHand.remove(key)
                reference.credit(key, to: purchase.userId, transaction: transaction, period: key.hasPrefix("wol:"))
                reference.recorded[purchase.transactionId] = (purchase.userId, false)
            }
        case .revokeByHand(let pick):
            let active = ledger.grants.filter { $0.isActive && $0.source == .apple }
            guard !active.isEmpty else { return }
            let grant = active[pick % active.count]
            let plan = try apply(.manualRevoke(transactionId: grant.transactionId, actor: "agent", reason: "fraud", eventTag: nextId("x")))
            guard case .grant = plan.outcome else { throw fail("revoking an active grant by hand was refused: \(plan.outcome)") }
            reference.revokedByHand.insert(grant.creditKey!.stored)
            if let transaction = transactions.first(where: { $0.id == grant.transactionId }) { byHand.insert(identity(transaction)) }
        case .goodwill(let user):
            if truth, try goodwillForApplePurchase(pick: user) { return }
            let plan = try apply(
                .manualGrant(
                    .init(
                        userId: Self.user(user), productId: CheckerCatalog.coins, quantity: 1, grant: ["coins": .number(5)],
                        transactionId: nil, goodwillId: nextId("manual-"), actor: "agent", reason: "sorry")))
            guard case .grant = plan.outcome else { throw fail("a goodwill grant was refused: \(plan.outcome)") }
        case .restoreMissing(let pick, let stranger):
            try restoreMissing(pick, stranger: stranger)
        case .resubscribe(let pick, let user, let token):
            try resubscribe(pick, by: user, token: token)
        case .doubleTap(let user, let count, let shuffle):
            doubleTap(by: user, count: count, shuffle: shuffle)
        case .serverFinish(let pick):
            serverFinish(pick)
        }
    }

    /// Every buyer's app uploads its receipt: everything its device bought that Apple has not
    /// refunded (refunded subscription periods stay in a receipt).
    mutating func catchUp() throws {
        if truth {
            for device in 0..<4 where transactions.contains(where: { $0.device == device }) {
                try appUpload(receiptOf: device, by: Self.user(device), naming: .nothing)
            }
            try settleHeldOrders()
            return
        }
        for buyer in 0..<4 {
            let held = transactions.indices.filter {
                transactions[$0].buyer == buyer && !(transactions[$0].revokedAt != nil && !transactions[$0].isSubscription)
            }
            if !held.isEmpty { try upload(held, by: Self.user(buyer), evidence: .signedUpload) }
        }
    }

    /// The chain and newest transaction of subscription `pick`.
    func subscription(_ pick: Int) -> ([Int], Int)? {
        guard !subscriptions.isEmpty else { return nil }
        let chain = subscriptions[pick % subscriptions.count]
        return (chain, chain.last!)
    }

    /// Apple signs a notification about transaction `index` as it stands now; it waits.
    mutating func notify(_ type: String, subtype: String? = nil, about index: Int, status: Int? = nil, grace: Date? = nil) {
        let transaction = transactions[index]
        let notification = AppStoreNotification(
            notificationUUID: nextId("n-"), notificationType: type, subtype: subtype, environment: .production, bundleId: "app",
            signedDate: clock, purchase: transaction.purchase(evidence: nil),
            subscriptionStatus: transaction.isSubscription ? status : nil, autoRenewStatus: transaction.isSubscription ? 1 : nil,
            gracePeriodExpiresDate: grace)
        waiting.append((notification, index))
    }

    mutating func deliver(_ item: (notification: AppStoreNotification, transaction: Int?)) throws {
        let notification = item.notification
        // The shell applies each notification once, however often Apple sends it.
        guard ledger.applied.insert(notification.notificationUUID).inserted else { return }
        _ = try apply(.notification(notification, submissionId: nextId("s-")))
        guard let purchase = notification.purchase, let index = item.transaction else { return }
        var transaction = transactions[index]
        // The reference reads the transaction as Apple signed it into the notification.
        transaction.revokedAt = purchase.cancellationDate
        transaction.revocationType = purchase.revocationType
        transaction.percentage = purchase.revocationPercentage
        transaction.expires = purchase.expiresDate
        transaction.upgraded = purchase.isUpgraded == true
        let key = key(transaction)
        switch NotificationType(notification.notificationType) {
        case .refund, .revoke:
            let type = CheckerCatalog.catalog.product(transaction.product)?.type
            let quantity = max(ledger.purchases[transaction.id]?.quantity ?? transaction.quantity, 1)
            let units = transaction.revocationType == "REFUND_PRORATED" && type == .consumable
                ? transaction.percentage.map { ReferenceLedger.unitsRefunded(of: quantity, percentage: $0) }.flatMap { $0 < quantity ? $0 : nil }
                : nil
            reference.refunded(key, at: purchase.cancellationDate ?? notification.signedDate!, units: units)
        case .refundReversed:
            reference.reversed(
                key, at: notification.signedDate!, transaction: transaction, period: key.hasPrefix("wol:"), catalog: CheckerCatalog.catalog)
        case let type where type.credits:
            reference.received(transaction, key: key, uploader: nil, evidence: .signedUpload, catalog: CheckerCatalog.catalog)
        default:
            break
        }
    }

    /// What an upload names: each purchase its own transaction (the checker's usual upload), or
    /// one order only (a receipt sent for the order the app bought for).
    enum Naming {
        case eachTransaction
        case order(String)
    }

    mutating func upload(_ indexes: [Int], by uploader: String, evidence: OwnershipEvidence, naming: Naming = .eachTransaction)
        throws
    {
        var orderId: String?
        if case .order(let id) = naming { orderId = id }
        // Each transaction its own upload naming it, or one upload of them all naming the order.
        let uploads = orderId == nil ? indexes.map { [$0] } : [indexes]
        var verdict = UploadVerdict(state: .credited)
        for upload in uploads {
            let result = try run(
                upload.map { transactions[$0].purchase(evidence: evidence) },
                upload: .init(
                    userId: uploader, submissionId: nextId("s-"), orderId: orderId,
                    transactionId: orderId == nil ? transactions[upload[0]].id : nil, bundleId: "app"))
            verdict = result.verdict
            for (index, outcome) in zip(upload, result.outcomes) {
                try received(index, outcome: outcome, by: uploader, evidence: evidence)
            }
        }
        guard let orderId else { return }
        // Who really paid: the app that bought for this order finishes what it holds only once
        // that purchase is credited to the order's user, or Apple took it back.
        guard FinishAdvice.mayFinishUpload(state: verdict.state, reason: verdict.reason, named: .order, settledByHand: false),
            let bought = transactions.first(where: { $0.order == orderId }), Self.user(bought.buyer) == uploader
        else { return }
        let key = key(bought)
        guard ledger.holdings.keys[key].map({ $0.user == uploader }) == true || bought.revokedAt != nil
            || reference.revokedByHand.contains(key)
        else {
            throw fail(
                "the upload naming \(orderId) was told to finish (\(verdict.state)), but \(bought.id), bought for it, is \(ledger.holdings.keys[key].map(\.description) ?? "credited to nobody")"
            )
        }
    }

    /// One upload through the ledger's run, as every shell drives it.
    mutating func run(
        _ purchases: [VerifiedPurchase], upload: LedgerEvent.Upload, namedOriginal: FinishAdvice.NamedOriginal? = nil
    ) throws -> UploadResult {
        var run = UploadRun(purchases: purchases, upload: upload, namedOriginal: namedOriginal, policy: policy)
        while true {
            switch run.next() {
            case .plan(let event):
                run.planned(try apply(event))
            case .read(let query):
                run.read(
                    revocations: query.revocationsOf.map(ledger.revocations(of:)) ?? [], order: query.order.flatMap { ledger.orders[$0] })
            case .done(let result):
                return result
            }
        }
    }

    /// What the checker asks of each purchase an upload credited: the app is told to finish
    /// only what is settled, and a bare id proves nothing.
    mutating func received(_ index: Int, outcome: FinishAdvice.PurchaseOutcome, by uploader: String, evidence: OwnershipEvidence) throws {
        let transaction = transactions[index]
        if evidence == .signedUpload { provers[transaction.id, default: []].insert(uploader) }
        reference.received(transaction, key: key(transaction), uploader: uploader, evidence: evidence, catalog: CheckerCatalog.catalog)
        let state = outcome.state
        // The app is told to finish only what is settled: credited means held by the uploader.
        let key = key(transaction)
        if state == .credited || state == .alreadyCredited {
            guard let held = ledger.holdings.keys[key], held.user == uploader else {
                throw fail("\(transaction.id) answered \(state) to \(uploader), but \(key) is \(ledger.holdings.keys[key].map(\.description) ?? "held by nobody")")
            }
        }
        // A bare id proves nothing: credited only where a token or the subscription says whose it is.
        if evidence == .lookup, state == .credited {
            let tokenOwner = transaction.token.flatMap { reference.orders[$0]?.user }
            let subscriber = reference.subscriptionOwner[transaction.original]
            guard tokenOwner == uploader || (transaction.isSubscription && subscriber == uploader) else {
                throw fail("a bare id credited \(transaction.id) to \(uploader)")
            }
        }
    }

    /// After every step: what users hold is what the reference says, and the store's rules hold.
    func check() throws {
        try checkWhoHolds()
        if truth { try checkOrdersPaidByTheirOwnPurchases() }
        for order in ledger.orders.values where order.state == .paid {
            if let paidBy = order.transactionId, transactions.contains(where: { $0.id == paidBy && $0.assigned }) {
                throw fail("order \(order.id) is paid by \(paidBy), an assigned seat (access, not a payment)")
            }
        }
        if truth { return }
        let actual = ledger.holdings
        let expected = reference.holdings
        guard actual == expected else {
            let keys = Set(actual.keys.keys).union(expected.keys.keys).sorted().filter { actual.keys[$0] != expected.keys[$0] }
            let owners = Set(actual.subscriptionOwners.keys).union(expected.subscriptionOwners.keys).sorted()
                .filter { actual.subscriptionOwners[$0] != expected.subscriptionOwners[$0] }
            let lines = keys.map { "  \($0): ledger \(actual.keys[$0].map(\.description) ?? "-"), reference \(expected.keys[$0].map(\.description) ?? "-")" }
                + owners.map { "  subscription \($0): ledger \(actual.subscriptionOwners[$0] ?? "-"), reference \(expected.subscriptionOwners[$0] ?? "-")" }
            throw fail("the ledger and the reference disagree:\n" + lines.joined(separator: "\n"))
        }
        // Invariant 4 under `keep`: a credit key is only ever granted to one user.
        if policy.restore == .keep {
            var users: [String: String] = [:]
            for grant in ledger.grants where grant.source == .apple {
                if let other = users[grant.creditKey!.stored], other != grant.userId {
                    throw fail("\(grant.creditKey!) was granted to \(other) and to \(grant.userId)")
                }
                users[grant.creditKey!.stored] = grant.userId
            }
        }
        // An upgraded period never stays in force past the upgrade.
        for grant in ledger.grants where grant.isActive {
            guard let transaction = transactions.first(where: { $0.id == grant.transactionId }), transaction.upgraded,
                let higher = transactions.first(where: { $0.original == transaction.original && $0.product == CheckerCatalog.vipPlus }),
                ledger.grants.contains(where: { $0.transactionId == higher.id && $0.isActive })
            else { continue }
            if (grant.expiresAt ?? .distantFuture) > higher.purchased {
                throw fail("the upgraded period \(grant.transactionId) stays in force after the upgrade")
            }
        }
    }
}

// MARK: - Running and shrinking

enum LedgerChecker {
    /// Steps a sequence has.
    static let length = 14

    /// Runs the sequence `steps` under `restore`; the failure, if any.
    static func failure(of steps: [CheckerStep], restore: RestorePolicy, truth: Bool = false, tracing: Bool = false) -> CheckerFailure? {
        var run = CheckerRun(restore: restore, truth: truth)
        run.tracing = tracing
        do {
            try run.run(steps)
            return nil
        } catch let failure as CheckerFailure {
            return failure
        } catch {
            return CheckerFailure(step: -1, problem: "\(error)", log: run.log)
        }
    }

    /// The fewest steps of `steps` that still fail: each step left out while the rest still fails.
    static func shrink(_ steps: [Int], of all: [CheckerStep], restore: RestorePolicy, truth: Bool = false) -> [Int] {
        var kept = steps
        var changed = true
        while changed {
            changed = false
            for index in kept.indices.reversed() {
                var fewer = kept
                fewer.remove(at: index)
                if failure(of: fewer.map { all[$0] }, restore: restore, truth: truth) != nil {
                    kept = fewer
                    changed = true
                }
            }
        }
        return kept
    }

    /// A regression case as kept in the fixture: `<seed> <policy>[+truth] <kept step indexes>`.
    struct Regression {
        var seed: UInt64
        var restore: RestorePolicy
        var truth = false
        var kept: [Int]?

        var steps: [CheckerStep] {
            let all = CheckerStep.sequence(seed: seed, count: LedgerChecker.length, truth: truth)
            return kept.map { $0.map { all[$0] } } ?? all
        }
    }

    static var fixture: URL {
        URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("LedgerTests/Fixtures/ledger-checker-regressions.txt")
    }

    static func regressions() throws -> [Regression] {
        try String(contentsOf: fixture, encoding: .utf8).split(separator: "\n").compactMap { line in
            let fields = line.split(separator: "#", maxSplits: 1, omittingEmptySubsequences: false).first?
                .split(separator: " ", omittingEmptySubsequences: true) ?? []
            let mode = fields.count >= 2 ? fields[1].split(separator: "+").map(String.init) : []
            guard fields.count >= 2, let seed = ModelRandom.parse(String(fields[0])), let restore = RestorePolicy(rawValue: mode[0])
            else { return nil }
            let kept = fields.count > 2 ? fields[2].split(separator: ",").compactMap { Int($0) } : nil
            return Regression(seed: seed, restore: restore, truth: mode.contains("truth"), kept: kept)
        }
    }

    /// How many sequences a run checks (IAP_TEST_CHECKER_SEQUENCES, else 100,000), and its time
    /// bound: about 30 s alone on two cores (the core and this module are optimized in debug
    /// builds too), shared with every other suite in the whole run.
    static var sequences: Int {
        ProcessInfo.processInfo.environment["IAP_TEST_CHECKER_SEQUENCES"].flatMap { Int($0) } ?? 100_000
    }
    static let timeBound: Duration = .seconds(150)
}
