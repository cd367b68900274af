import Foundation
import IAPCore
import Ledger

// The checker's ground truth: what each sequence's users really did (which account bought what
// on which Apple ID, for which order, what Apple took back and how much), and invariants that
// need no model of the ledger's rules and share no code with the planner or its shell:
//
// 1. nothing is held by someone who did not pay for it (the account that bought it, the owner
//    of the order its token names; without a token, any account of the app that uploaded
//    Apple's proof of it first, because accounts sharing an Apple ID are told apart by a token
//    only; whoever restored it on the Apple ID's device, as the restore policy allows);
// 2. the app is told to finish a purchase only once what it paid for is held by who paid, or
//    Apple took it back, or a person decided;
// 3. once every app uploaded its refreshed receipt and every notification arrived, every paid
//    purchase is held by someone (1 says who) or held for a person, never silently dropped;
// 4. what Apple took back, and only that, is gone;
// 5. Apple's refund question (`CONSUMPTION_REQUEST`) about any transaction, of any kind, is
//    answered as the users hold it: delivered when someone holds what it bought (a period or a
//    non-consumable held through another transaction of it too), undelivered and unused when
//    nothing of it was ever credited, no share for an auto-renewable subscription, and no
//    prorated preference without a share.
//
// The no-earlier-purchase rule of orders is checked where the memory shell binds an order.

extension CheckerRun {
    /// What an app's upload names.
    enum AppNaming {
        /// The transaction it holds (with what a StoreKit 1 id stands for, when it says).
        case transaction(String, original: FinishAdvice.NamedOriginal?)
        /// The order it bought for.
        case order(String)
        /// The transaction it holds, and the order it bought it for.
        case transactionForOrder(String, order: String)
        /// Nothing: a receipt on its own.
        case nothing
    }

    /// What is credited once, from Apple's facts alone: a consumable per transaction, a
    /// non-consumable per original transaction, a subscription per billing period.
    func identity(_ transaction: AppleTransaction) -> String {
        switch transaction.product {
        case CheckerCatalog.coins: "consumable \(transaction.id)"
        case CheckerCatalog.pro: "non-consumable \(transaction.original)"
        default: "period \(transaction.period ?? transaction.id)"
        }
    }

    func transaction(_ id: String) -> AppleTransaction? { transactions.first { $0.id == id } }

    /// The purchase that paid for `transaction`: itself, the purchase a renewal renews, or what
    /// a restore restores.
    func paidBy(_ transaction: AppleTransaction) -> AppleTransaction {
        if let renews = transaction.renews { return transactions[renews] }
        if transaction.isRestore, let bought = transactions.first(where: { !$0.isRestore && identity($0) == identity(transaction) }) {
            return paidBy(bought)
        }
        return transaction
    }

    /// Who may hold `identity`, by who really paid (see the file's comment).
    func legitUsers(_ identity: String) -> Set<String> {
        var users: Set<String> = []
        for transaction in transactions where self.identity(transaction) == identity {
            let bought = paidBy(transaction)
            if let token = bought.token, let user = orderUser[token] {
                users.insert(user)
            } else {
                users.insert(Self.user(bought.buyer))
                for other in transactions where paidBy(other).id == bought.id { users.formUnion(provers[other.id] ?? []) }
            }
            if transaction.isRestore || policy.restore == .transfer { users.formUnion(provers[transaction.id] ?? []) }
        }
        return users
    }

    /// The users holding `identity` in force now (grants of Apple purchases).
    func holders(_ identity: String) -> [String: Int] {
        var held: [String: Int] = [:]
        for grant in ledger.grants where grant.isActive && grant.source == .apple {
            if let transaction = transaction(grant.transactionId), self.identity(transaction) == identity {
                held[grant.userId, default: 0] += grant.quantity
            }
        }
        return held
    }

    /// How many units of `identity` may be held now, by Apple's word alone; nil when Apple took
    /// it all back. A prorated refund of a multi-unit consumable takes back its share, rounded
    /// either way; 0 in the set means nothing may be held.
    func allowedUnits(_ identity: String) -> Set<Int>? {
        let all = transactions.filter { self.identity($0) == identity }
        guard let first = all.first else { return [] }
        let quantity = first.product == CheckerCatalog.coins ? max(first.quantity, 1) : 1
        var allowed: Set<Int> = [quantity]
        for transaction in all where transaction.revokedAt != nil {
            guard transaction.product == CheckerCatalog.coins, transaction.revocationType == "REFUND_PRORATED", quantity > 1,
                let percentage = transaction.percentage, percentage < 100_000
            else { return nil }
            let share = Double(quantity) * Double(percentage) / 100_000
            allowed = Set([quantity - Int(share.rounded(.down)), quantity - Int(share.rounded(.up))].map { max($0, 0) })
        }
        return allowed
    }

    /// How long Apple retries a notification we did not answer: 1, 12, 24, 48 and 72 hours
    /// after the first try, then it stops. One can overtake another by no more than that.
    static let retryWindow: TimeInterval = 7 * 86_400

    /// Before a notification signed at `date` arrives, those signed more than Apple's retry
    /// window before it do (in Apple's order): Apple does not hold a notification longer.
    mutating func deliverOverdue(before date: Date) throws {
        while let index = waiting.indices.filter({ waiting[$0].notification.signedDate! < date - Self.retryWindow })
            .min(by: { waiting[$0].notification.signedDate! < waiting[$1].notification.signedDate! })
        {
            let item = waiting.remove(at: index)
            try deliver(item)
        }
    }

    /// `items` in their drawn order, except that none arrives before those signed more than
    /// Apple's retry window before it.
    static func withinRetryWindow(_ items: [(notification: AppStoreNotification, transaction: Int?)])
        -> [(notification: AppStoreNotification, transaction: Int?)]
    {
        var rest = items
        var ordered: [(notification: AppStoreNotification, transaction: Int?)] = []
        while let next = rest.first {
            let overdue = rest.indices.filter { rest[$0].notification.signedDate! < next.notification.signedDate! - retryWindow }
                .min { rest[$0].notification.signedDate! < rest[$1].notification.signedDate! }
            ordered.append(rest.remove(at: overdue ?? 0))
        }
        return ordered
    }

    /// Apple refunds a purchase, not one of its ids: its restores say what it says.
    mutating func sameRevocation(as index: Int) {
        let source = transactions[index]
        for other in transactions.indices where other != index && identity(transactions[other]) == identity(source) {
            transactions[other].revokedAt = source.revokedAt
            transactions[other].revocationType = source.revocationType
            transactions[other].percentage = source.percentage
        }
    }

    /// Invariant 1, after every step.
    func checkWhoHolds() throws {
        for grant in ledger.grants where grant.isActive && grant.source == .apple {
            guard let transaction = transaction(grant.transactionId), !transaction.upgraded else { continue }
            let identity = identity(transaction)
            if byHand.contains(identity) { continue }
            let legit = legitUsers(identity)
            guard legit.contains(grant.userId) else {
                throw fail("\(identity) is held by \(grant.userId), but was paid for by \(legit.sorted().joined(separator: ", "))")
            }
        }
    }

    /// The app finished `id` on its Apple ID, as its answer (`told`) let it. Invariant 2.
    mutating func appFinishes(_ id: String, told: String) throws {
        guard let transaction = transaction(id) else { return }
        finished.insert(id)
        // A restore was paid for before, and an upgraded period is replaced by its upgrade.
        guard !transaction.isRestore, !transaction.upgraded else { return }
        let identity = identity(transaction)
        // Apple took it back (all of it, as its share may round): nothing is left to credit.
        if byHand.contains(identity) || tookBack.contains(identity) || allowedUnits(identity)?.contains(0) ?? true { return }
        let legit = legitUsers(identity)
        guard holders(identity).keys.contains(where: legit.contains) else {
            throw fail(
                "the app was told to finish \(id) (\(told)), but \(identity) is held by \(holders(identity).keys.sorted()) and was paid for by \(legit.sorted())"
            )
        }
    }

    /// What the receipt of the Apple ID `device` holds (before index `upTo`: a stale one), as
    /// Apple's `verifyReceipt` answers: no finished consumable, no one-time purchase refunded
    /// in full, no StoreKit 1 id a receipt never holds.
    func receipt(of device: Int, upTo: Int? = nil) -> [Int] {
        transactions.indices.filter { index in
            let transaction = transactions[index]
            guard transaction.device == device, index < (upTo ?? transactions.count), transaction.inReceipt else { return false }
            if transaction.product == CheckerCatalog.coins, finished.contains(transaction.id) || serverFinished.contains(transaction.id) {
                return false
            }
            if transaction.revokedAt != nil, !transaction.isSubscription {
                let prorated = transaction.product == CheckerCatalog.coins && transaction.revocationType == "REFUND_PRORATED"
                return prorated
            }
            return true
        }
    }

    /// The app's upload in the ground-truth run: a signed transaction, a bare id, or the
    /// receipt of its Apple ID (stale or refreshed) naming the transaction it holds, its order,
    /// or nothing.
    mutating func appUpload(_ index: Int, by uploader: String, route: Int, stale: Bool, pick: Int) throws {
        let transaction = transactions[index]
        switch route {
        case 0:
            try submit([index], by: uploader, evidence: .signedUpload, naming: .transaction(transaction.id, original: nil))
        case 1:
            // A bare id may come from anywhere: only the buyer's own app finishes on its answer.
            try submit(
                [index], by: uploader, evidence: .lookup, naming: .transaction(transaction.id, original: nil),
                onDevice: uploader == Self.user(transaction.buyer))
        default:
            let naming: AppNaming =
                switch pick % 4 {
                case 0: .nothing
                case 1: transaction.order.map { .order($0) } ?? .transaction(transaction.id, original: nil)
                case 2: transaction.order.map { .transactionForOrder(transaction.id, order: $0) } ?? .transaction(transaction.id, original: nil)
                default: .transaction(transaction.id, original: nil)
                }
            try submit(receipt(of: transaction.device, upTo: stale ? index : nil), by: uploader, evidence: .signedUpload, naming: naming, holding: transaction.id, receipt: true)
        }
    }

    /// The app signed in on Apple ID `device` uploads its refreshed receipt.
    mutating func appUpload(receiptOf device: Int, by uploader: String, naming: AppNaming) throws {
        try submit(receipt(of: device), by: uploader, evidence: .signedUpload, naming: naming, receipt: true)
    }

    /// One upload through the core, its verdict as the shell asks for it, and what the app
    /// finishes on it. A receipt says neither a cancellation's type nor why a period was bought
    /// (`verifyReceipt` has no `revocationType` or `transactionReason`): the ledger tells a
    /// resubscription or an upgrade from a renewal by what it remembers and by the dates.
    @discardableResult
    mutating func submit(
        _ indexes: [Int], by uploader: String, evidence: OwnershipEvidence, naming: AppNaming, holding: String? = nil,
        receipt: Bool = false, onDevice: Bool = true
    ) throws -> UploadVerdict {
        let submission = nextId("s-")
        var named: String?
        var orderId: String?
        var original: FinishAdvice.NamedOriginal?
        switch naming {
        case .transaction(let id, let standsFor): (named, original) = (id, standsFor)
        case .transactionForOrder(let id, let order): (named, orderId) = (id, order)
        case .order(let id): orderId = id
        case .nothing: break
        }
        var listing = indexes.map { transactions[$0].purchase(evidence: evidence) }
        if receipt {
            for index in listing.indices {
                listing[index].revocationType = nil
                listing[index].revocationPercentage = nil
                listing[index].transactionReason = nil
            }
            // What the receipt lists of each chain dates its periods (as the verifier reads it).
            listing = VerifiedPurchase.withPreviousPeriods(listing)
        }
        let settled = try run(
            listing,
            upload: .init(userId: uploader, submissionId: submission, orderId: orderId, transactionId: named, bundleId: "app"),
            namedOriginal: original)
        for outcome in settled.outcomes where evidence == .signedUpload {
            provers[outcome.transactionId, default: []].insert(uploader)
        }
        let outcomes = settled.outcomes
        let verdict = settled.verdict
        if tracing { log.append("    verdict \(verdict.state) \(verdict.reason?.rawValue ?? "")") }
        let told = "\(verdict.state) \(verdict.reason?.rawValue ?? "")"
        guard onDevice else { return verdict }
        switch naming {
        case .transaction(let id, _), .transactionForOrder(let id, _):
            if FinishAdvice.mayFinishUpload(state: verdict.state, reason: verdict.reason, named: .transaction, settledByHand: false) {
                try appFinishes(id, told: told)
            }
        case .order(let order):
            if FinishAdvice.mayFinishUpload(state: verdict.state, reason: verdict.reason, named: .order, settledByHand: false), let holding {
                // Never on a guess: an order named alone is finishable only where a purchase of
                // the upload carries its token (what the app holds, only the app knows).
                guard settled.tokenNamesOrder else {
                    throw fail("told to finish \(holding) on a guess: order \(order) was named alone, and no purchase of the upload carries its token (\(told))")
                }
                try appFinishes(holding, told: told)
            }
        case .nothing:
            // Each transaction's own advice.
            for outcome in outcomes where FinishAdvice.mayFinish(outcome.state) {
                try appFinishes(outcome.transactionId, told: "\(outcome.state)")
            }
        }
        return verdict
    }

    /// Ground truth: user `user` taps buy `count` times. The app places an order of coins for
    /// each tap (StoreKit 1, no token) before any purchase is made; the purchases follow in the
    /// order `shuffle` draws, each made for its own order.
    mutating func doubleTap(by user: Int, count: Int, shuffle: Int) {
        var orders: [String] = []
        for _ in 0..<count {
            let id = nextId("order-")
            ledger.place(.init(
                id: id, userId: Self.user(user), productId: CheckerCatalog.coins, state: .created, transactionId: nil,
                createdAt: clock - 30))
            orderUser[id] = Self.user(user)
            orders.append(id)
        }
        let permutations = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]]
        for (offset, which) in permutations[shuffle % permutations.count].filter({ $0 < count }).enumerated() {
            let id = nextId("t")
            let bought = clock + Double(offset)
            transactions.append(
                AppleTransaction(
                    id: id, original: id, product: CheckerCatalog.coins, quantity: 1, buyer: user, token: nil,
                    order: orders[which], period: nil, purchased: bought, expires: nil, signed: bought, reason: "PURCHASE",
                    originalPurchased: bought, device: user))
        }
    }

    /// Ground truth: the server finishes at Apple a consumable it credited: it leaves every
    /// later receipt of its device, while the app still holds it until it finishes it too.
    mutating func serverFinish(_ pick: Int) {
        let credited = transactions.indices.filter { index in
            let transaction = transactions[index]
            return transaction.product == CheckerCatalog.coins && !serverFinished.contains(transaction.id)
                && ledger.grants.contains { $0.transactionId == transaction.id && $0.isActive }
        }
        guard !credited.isEmpty else { return }
        serverFinished.insert(transactions[credited[pick % credited.count]].id)
    }

    /// Every app still holding a purchase it made for an order does what each answer says, with
    /// its refreshed receipt: it names the order; asked to name the transaction, or told the
    /// receipt does not pay the order, it names the transaction with the order. No answer may
    /// be a dead end: within three rounds the app may finish, or a person decides. Then the
    /// order is paid by that purchase whenever it is credited to the order's user.
    mutating func settleHeldOrders() throws {
        for index in transactions.indices {
            let transaction = transactions[index]
            guard let order = transaction.order, transaction.token == nil, !transaction.isRestore, !transaction.assigned,
                !finished.contains(transaction.id), let user = orderUser[order]
            else { continue }
            var naming = AppNaming.order(order)
            var told: [String] = []
            var settled = false
            var finishable = false
            for _ in 0..<3 where !settled {
                let verdict = try submit(
                    receipt(of: transaction.device), by: user, evidence: .signedUpload, naming: naming, holding: transaction.id,
                    receipt: true)
                told.append("\(verdict.state) \(verdict.reason?.rawValue ?? "")")
                var named = FinishAdvice.Named.transaction
                if case .order = naming { named = .order }
                finishable = FinishAdvice.mayFinishUpload(state: verdict.state, reason: verdict.reason, named: named, settledByHand: false)
                if finishable || verdict.state == .needsReview {
                    settled = true
                } else if verdict.reason == .nameTheTransaction || verdict.reason == .transactionNotInReceipt {
                    naming = .transactionForOrder(transaction.id, order: order)
                }
            }
            guard settled else {
                throw fail(
                    "a dead end: the app holding \(transaction.id) for order \(order) was told \(told.joined(separator: ", then ")) while doing what each answer said"
                )
            }
            // Told to finish, the app is done with it: the order is paid by it if it is the user's.
            let credited = ledger.grants.contains { $0.transactionId == transaction.id && $0.isActive && $0.userId == user }
            if finishable, credited, ledger.orders[order]?.transactionId != transaction.id {
                throw fail(
                    "order \(order) is \(ledger.orders[order]?.state.rawValue ?? "unknown") by \(ledger.orders[order]?.transactionId ?? "nothing"), though \(transaction.id), bought for it, is credited to \(user)"
                )
            }
        }
    }

    /// Invariant: no order is paid by a purchase made for another order.
    func checkOrdersPaidByTheirOwnPurchases() throws {
        for order in ledger.orders.values where order.state != .created {
            guard let paidBy = order.transactionId, let transaction = transaction(paidBy) else { continue }
            if let madeFor = transaction.order, madeFor != order.id {
                throw fail("order \(order.id) is paid by \(paidBy), which was bought for order \(madeFor)")
            }
            if transaction.familyShared || transaction.assigned {
                throw fail("order \(order.id) is paid by \(paidBy), access someone else paid for")
            }
        }
    }

    /// Ground truth: the user's app placed an order for `shared`'s product (StoreKit 1, no
    /// token), and instead of a purchase, a family member's shares its access with the user's
    /// Apple ID (`FAMILY_SHARED`, an id of its own). The app uploads its receipt naming its order
    /// alone: the access is the user's, but it pays no order (checked after every step).
    mutating func familyShare(_ shared: inout AppleTransaction) throws {
        let user = Self.user(shared.buyer)
        let orderId = "order-for-family-\(shared.id)"
        ledger.place(.init(id: orderId, userId: user, productId: shared.product, state: .created, transactionId: nil, createdAt: clock - 30))
        orderUser[orderId] = user
        shared.familyShared = true
        shared.token = nil
        shared.order = nil
        transactions.append(shared)
        try submit(receipt(of: shared.device), by: user, evidence: .signedUpload, naming: .order(orderId), holding: shared.id, receipt: true)
        guard ledger.orders[orderId]?.state == .created else {
            throw fail("order \(orderId) is \(ledger.orders[orderId]?.state.rawValue ?? "gone"): paid by family access \(shared.id) nobody of the app paid for")
        }
    }

    /// Ground truth: customer service grants goodwill naming an Apple consumable nobody was
    /// credited with yet (the customer wrote before the app uploaded it), to the user who paid
    /// (its token's order's, else its buyer), with what Apple sold: its quantity, its original
    /// transaction and environment (the admin route asks Apple for them). The buyer's receipt
    /// then credits nothing more: every unit Apple sold is held once. False when no such
    /// purchase exists (the plain goodwill step runs instead).
    mutating func goodwillForApplePurchase(pick: Int) throws -> Bool {
        let open = transactions.indices.filter { index in
            let transaction = transactions[index]
            // Its payer is its buyer: the goodwill and the buyer's own receipt name one user.
            let payer = transaction.token.flatMap { orderUser[$0] } ?? Self.user(transaction.buyer)
            return transaction.product == CheckerCatalog.coins && transaction.revokedAt == nil && !transaction.isRestore
                && payer == Self.user(transaction.buyer) && ledger.revocations(of: transaction.id).isEmpty
                && !ledger.grants.contains { $0.transactionId == transaction.id } && ledger.purchases[transaction.id] == nil
        }
        guard !open.isEmpty else { return false }
        let index = open[pick % open.count]
        let transaction = transactions[index]
        let user = Self.user(transaction.buyer)
        var grant = LedgerEvent.ManualGrant(
            userId: user, productId: transaction.product, quantity: transaction.quantity,
            grant: CheckerCatalog.catalog.product(transaction.product)?.grant(quantity: transaction.quantity) ?? [:],
            transactionId: nil, goodwillId: nextId("manual-"), actor: "agent", reason: "wrote in", appleTransactionId: transaction.id)
        grant.appleOriginalTransactionId = transaction.original
        grant.appleEnvironment = .production
        let plan = try apply(.manualGrant(grant))
        guard case .grant = plan.outcome else { throw fail("goodwill naming Apple purchase \(transaction.id) was refused: \(plan.outcome)") }
        byHand.insert(identity(transaction))
        // The buyer's app uploads its receipt: already credited, every unit once.
        try submit(receipt(of: transaction.device), by: user, evidence: .signedUpload, naming: .nothing, receipt: true)
        let units = ledger.grants.filter { $0.isActive && $0.transactionId == transaction.id }.map(\.quantity).reduce(0, +)
        guard units == transaction.quantity else {
            throw fail("goodwill naming Apple purchase \(transaction.id) of \(transaction.quantity) units left \(units) held")
        }
        return true
    }

    /// StoreKit 1 restores a one-time purchase or a period under an id no receipt holds; the
    /// app uploads its Apple ID's receipt naming that id and what it stands for.
    /// Ground truth: user `user` of the app buys subscription `pick` again on the chain's Apple
    /// ID after it lapsed (a resubscription: Apple keeps the chain's original transaction and
    /// marks the new period `transactionReason: PURCHASE`). `token`: 0 none, 1 the buyer's
    /// order, 2 an order placed without a token (StoreKit 1).
    ///
    /// Not drawn for a chain whose renewal failed: by a receipt (no `transactionReason`) the
    /// ledger cannot tell a resubscription from the renewal Apple recovered from billing retry
    /// until Apple's `EXPIRED` arrives, and reads it as the recovery (docs/ledger.md).
    mutating func resubscribe(_ pick: Int, by user: Int, token tokenChoice: Int) throws {
        guard let (chain, last) = subscription(pick), !transactions[last].upgraded,
            !retried.contains(transactions[chain[0]].original)
        else { return }
        // The chain lapsed a day ago: the new period is a purchase of its own, not a renewal.
        clock = max(clock, transactions[last].expires! + 86_400)
        let first = transactions[chain[0]]
        let id = nextId("t")
        var token: String?
        var order: String?
        if tokenChoice == 1 {
            let orderId = nextId("order-")
            ledger.place(.init(
                id: orderId, userId: Self.user(user), productId: first.product, state: .created, transactionId: nil, createdAt: clock))
            orderUser[orderId] = Self.user(user)
            (token, order) = (orderId, orderId)
        } else if tokenChoice == 2 {
            let orderId = "order-for-\(id)"
            ledger.place(.init(
                id: orderId, userId: Self.user(user), productId: first.product, state: .created, transactionId: nil,
                createdAt: clock - 30))
            orderUser[orderId] = Self.user(user)
            order = orderId
        }
        let bought = AppleTransaction(
            id: id, original: first.original, product: first.product, quantity: 1, buyer: user, token: token, order: order,
            period: nextId("w"), purchased: clock, expires: clock + 30 * 86_400, signed: clock, reason: "PURCHASE",
            originalPurchased: first.originalPurchased ?? first.purchased, device: first.device)
        transactions.append(bought)
        subscriptions[pick % subscriptions.count].append(transactions.count - 1)
        notify("SUBSCRIBED", subtype: "RESUBSCRIBE", about: transactions.count - 1, status: 1)
    }

    mutating func restoreMissing(_ pick: Int, stranger: Int) throws {
        let restorable = transactions.indices.filter {
            transactions[$0].product != CheckerCatalog.coins && !transactions[$0].upgraded && !transactions[$0].isRestore
        }
        guard !restorable.isEmpty else { return }
        var restored = transactions[restorable[pick % restorable.count]]
        restored.id = nextId("r")
        restored.signed = clock
        restored.isRestore = true
        restored.inReceipt = false
        transactions.append(restored)
        let uploader = Self.user((restored.buyer + stranger) % 4)
        // Restored on the Apple ID's device, where this account of the app is signed in.
        provers[restored.id, default: []].insert(uploader)
        try submit(
            receipt(of: restored.device), by: uploader, evidence: .signedUpload,
            naming: .transaction(restored.id, original: .init(originalTransactionId: restored.original, productId: restored.product)),
            receipt: true)
    }

    /// Invariant 5 for transaction `index`: the answer the order service would send Apple if
    /// it asked now, decided by the core from what the ledger holds (the store asks the same
    /// of its rows), against who holds what the transaction bought. Planned only, never
    /// applied: asking changes nothing a user holds.
    func checkRefundAnswer(about index: Int) throws {
        let transaction = transactions[index]
        let question = AppStoreNotification(
            notificationUUID: "consumption-check", notificationType: "CONSUMPTION_REQUEST", subtype: nil,
            environment: .production, bundleId: "app", signedDate: clock, purchase: transaction.purchase(evidence: nil),
            consumptionRequestReason: "UNINTENDED_PURCHASE")
        let event = LedgerEvent.notification(question, submissionId: "consumption-check")
        let query = Ledger.query(for: event, policy: policy)
        let plan = Ledger.plan(event, facts: ledger.facts(for: query, event: event), policy: policy, now: clock)
        let recorded = plan.changes.compactMap { if case .recordConsumptionRequest(let request) = $0 { request } else { nil } }
        guard let request = recorded.first else {
            throw fail("Apple's refund question about \(transaction.id) was not recorded: \(plan.outcome)")
        }
        guard request.creditKey == key(transaction) else {
            throw fail("Apple's refund question about \(transaction.id) is read by \(request.creditKey ?? "nothing"), not \(key(transaction))")
        }
        let identity = identity(transaction)
        let delivered = request.isDelivered(by: ledger.grants)
        if !holders(identity).isEmpty, !delivered {
            throw fail("\(identity) is held by \(holders(identity).keys.sorted()), but Apple would be told \(transaction.id) was not delivered")
        }
        let everCredited = ledger.grants.contains { grant in
            grant.source == .apple && self.transaction(grant.transactionId).map(self.identity) == identity
        }
        if delivered, !everCredited, !byHand.contains(identity) {
            throw fail("nothing of \(identity) was ever credited, but Apple would be told \(transaction.id) was delivered")
        }
        let type = CheckerCatalog.catalog.product(transaction.product)?.type
        let facts = ConsumptionAnswer.Facts(
            ownershipType: request.ownershipType, delivered: delivered, consumptionPercentage: 40_000, userConsented: true,
            productType: request.productType.flatMap(Catalog.ProductType.init))
        for preference in ["GRANT_PRORATED", "DECLINE"] {
            let answer = ConsumptionAnswer.decide(facts, settings: .init(consent: .all, refundPreference: preference))
            guard case .send(let body) = answer else {
                if transaction.assigned { continue }
                throw fail("no answer to Apple's refund question about \(transaction.id): \(answer)")
            }
            let problem: String? =
                if (body.deliveryStatus == "DELIVERED") != delivered {
                    "says \(body.deliveryStatus)"
                } else if type == .autoRenewable, body.consumptionPercentage != nil {
                    "gives a share of an auto-renewable subscription"
                } else if !delivered, body.consumptionPercentage.map({ $0 != 0 }) ?? (type != .autoRenewable) {
                    "gives a share used of what was never delivered"
                } else if body.refundPreference == "GRANT_PRORATED", body.consumptionPercentage == nil {
                    "prefers a prorated refund without a share"
                } else {
                    nil
                }
            if let problem { throw fail("the answer to Apple's refund question about \(transaction.id) (\(identity)) \(problem)") }
        }
    }

    /// Invariants 3 and 4, at the end of a ground-truth run.
    func checkWhoPaidInTheEnd() throws {
        for transaction in transactions where !transaction.isRestore && !transaction.upgraded {
            let identity = identity(transaction)
            guard !byHand.contains(identity), let allowed = allowedUnits(identity), !allowed.contains(0) else { continue }
            if !holders(identity).isEmpty { continue }
            let heldForAPerson = ledger.purchases.values.contains { row in
                row.heldReason != nil && row.heldReason != .stoppedByRefund && self.transaction(row.transactionId).map(self.identity) == identity
            }
            if heldForAPerson { continue }
            throw fail(
                "\(transaction.id) (\(identity)), paid for by \(Self.user(transaction.buyer)), is held by nobody and for nobody after every app uploaded its refreshed receipt"
            )
        }
        for identity in Set(transactions.map(identity)) where !byHand.contains(identity) {
            let held = holders(identity)
            guard !held.isEmpty else { continue }
            guard let allowed = allowedUnits(identity) else { throw fail("\(identity) is still held by \(held), but Apple took it back") }
            let units = held.values.reduce(0, +)
            guard allowed.contains(units) else {
                throw fail("\(identity) is held with \(units) units, but Apple's word leaves \(allowed.sorted())")
            }
        }
    }
}

extension MemoryLedger {
    /// Apple's refunds and revocations of `transactionId`, as the shell reads them for a
    /// verdict: of its own id, or of the credit key it was credited under.
    func revocations(of transactionId: String) -> [LedgerFacts.Revocation] {
        let keys = Set(grants.filter { $0.transactionId == transactionId }.compactMap(\.creditKey))
        return revocations.values.filter { $0.transactionId == transactionId || keys.contains($0.creditKey) }
    }
}
