import Foundation
import GRDB

/// An auto-renewable chain's life at the fake, as Apple runs it: renewals, upgrades,
/// extensions, renewals that fail (billing retry, grace period) or recover, expiry, and a
/// resubscription once the chain lapsed.
extension FakeLedger {
    /// How an auto-renewable chain's renewal stands: what Apple's renewal info
    /// (`JWSRenewalInfoDecodedPayload`, `pending_renewal_info`) and subscription status say.
    struct SubscriptionState: Sendable, Equatable {
        /// The length of the chain's billing period: the first period's, or that of the last
        /// upgrade or resubscription bought with a length of its own.
        var periodSeconds: TimeInterval
        /// Whether the subscription renews (`autoRenewStatus`); off once the customer let it expire.
        var autoRenew = true
        /// When the renewal failed and Apple began retrying it (`isInBillingRetryPeriod`); nil
        /// while no retry is open.
        var billingRetrySince: Date? = nil
        /// The end of the billing grace period of an open retry that has one.
        var gracePeriodExpiresDate: Date? = nil
        /// Apple's `expirationIntent`: 1 the customer cancelled, 2 a billing error.
        var expirationIntent: Int? = nil
        /// When the chain expired (EXPIRED sent); nil again once a new period is bought.
        var expiredDate: Date? = nil
        /// The next period's price once Apple raised it, in milli-units; nil: the list price.
        var renewalPrice: Int64? = nil
        /// Apple's `priceIncreaseStatus`: 0 the customer has not answered a price increase that
        /// needs consent, 1 they consented; nil while no increase was told.
        var priceIncreaseStatus: Int? = nil

        /// Apple's subscription status of `purchase` (one of this chain's transactions): 1
        /// active, 2 expired, 3 in billing retry, 4 in the billing grace period, 5 revoked.
        func status(of purchase: Purchase, at now: Date = Date()) -> Int {
            if purchase.cancellationDate != nil { return 5 }
            if billingRetrySince != nil { return (gracePeriodExpiresDate.map { $0 > now } ?? false) ? 4 : 3 }
            return (purchase.expiresDate ?? .distantFuture) > now ? 1 : 2
        }
    }

    /// Bills the next period of an auto-renewable chain: a new transaction id and web order line
    /// item id, the same original transaction id, bought now, `transactionReason` RENEWAL,
    /// expiring one billing period after the period in force ends; on the device of the chain's
    /// latest transaction, whose new receipt holds the whole chain. While Apple retries a failed
    /// renewal it is a billing recovery (`billingRecovery` true): within the grace period the
    /// dates go on as if nothing failed, after it the new period starts now. Refused once the
    /// chain lapsed (the period ended with no retry open): buying it again is `resubscribe`.
    func renew(
        originalTransactionId: String, encode: (Receipt) throws -> [UInt8]
    ) throws -> Result<(Purchase, [UInt8], billingRecovery: Bool), Refusal> {
        var recovery = false
        let result = try database.write { db in
            try Self.nextPeriod(of: originalTransactionId, db, encode: encode) { chain, state, renewal, now in
                let end = Self.periodEnd(of: chain)
                if state.billingRetrySince != nil {
                    recovery = true
                    let inGrace = state.gracePeriodExpiresDate.map { $0 > now } ?? false
                    renewal.expiresDate = (inGrace ? end : max(end, now)).addingTimeInterval(state.periodSeconds)
                } else if end <= now {
                    return "the subscription lapsed at \(end): nothing renews it; buying it again is /resubscribe"
                } else {
                    renewal.expiresDate = end.addingTimeInterval(state.periodSeconds)
                }
                renewal.transactionReason = "RENEWAL"
                state = SubscriptionState(periodSeconds: state.periodSeconds, autoRenew: state.autoRenew)
                return nil
            }
        }
        return result.map { ($0.0, $0.1, recovery) }
    }

    /// Upgrades an auto-renewable chain to `productId` as Apple does within a subscription
    /// group: at once, with a new billing period of the new product (a new transaction and web
    /// order line item id, the same original transaction id, `transactionReason` PURCHASE,
    /// `appAccountToken` the one the upgrade was bought with) from now for `length` (the
    /// chain's billing period when nil; the chain's period from then on when given); the
    /// period in force is marked `isUpgraded`. Refused for an unknown chain, a chain that is
    /// not auto-renewable, and the product it already has.
    func upgrade(
        originalTransactionId: String, to productId: String, length: TimeInterval?, appAccountToken: String?,
        encode: (Receipt) throws -> [UInt8]
    ) throws -> Result<(Purchase, [UInt8]), Refusal> {
        try database.write { db in
            try Self.nextPeriod(of: originalTransactionId, db, encode: encode) { chain, state, upgrade, now in
                let latest = chain[chain.count - 1]
                guard latest.productId != productId else { return "the subscription is already on \(productId)" }
                if let length { state.periodSeconds = length }
                upgrade.productId = productId
                upgrade.applicationUsername = appAccountToken
                upgrade.expiresDate = now.addingTimeInterval(state.periodSeconds)
                upgrade.transactionReason = "PURCHASE"
                try db.execute(
                    sql: """
                        UPDATE purchase SET isUpgraded = 1
                        WHERE originalTransactionId = ? AND webOrderLineItemId = ? AND cancellationDate IS NULL
                        """,
                    arguments: [originalTransactionId, latest.webOrderLineItemId])
                return nil
            }
        }
    }

    /// A customer buys a lapsed chain again, as Apple's resubscription: a new billing period
    /// from now in the same chain (the same original transaction id; a new transaction and web
    /// order line item id), `transactionReason` PURCHASE, on `deviceId` (another account or
    /// device of the same Apple ID may buy it; the device of the chain's latest transaction
    /// when nil), with `appAccountToken` (none when nil: the token is the new purchase's),
    /// of `productId` (the latest period's when nil), for `length` (the chain's billing period
    /// when nil). Refused while a period is in force or Apple still retries a failed renewal.
    func resubscribe(
        originalTransactionId: String, deviceId: String?, appAccountToken: String?, productId: String?,
        length: TimeInterval?, encode: (Receipt) throws -> [UInt8]
    ) throws -> Result<(Purchase, [UInt8]), Refusal> {
        try database.write { db in
            try Self.nextPeriod(of: originalTransactionId, db, encode: encode) { chain, state, period, now in
                guard state.billingRetrySince == nil else {
                    return "Apple is still retrying the failed renewal: /renew recovers it, /expire ends it"
                }
                let end = Self.periodEnd(of: chain)
                guard end <= now else { return "a period is in force until \(end): only a lapsed subscription is bought again" }
                if let length { state.periodSeconds = length }
                if let deviceId { period.deviceId = deviceId }
                if let productId { period.productId = productId }
                period.applicationUsername = appAccountToken
                period.expiresDate = now.addingTimeInterval(state.periodSeconds)
                period.transactionReason = "PURCHASE"
                state = SubscriptionState(periodSeconds: state.periodSeconds)
                return nil
            }
        }
    }

    /// The renewal of the period in force fails, as when Apple cannot charge the customer: the
    /// period ends now (the fake does not wait for its date) and Apple's billing retry opens,
    /// with a grace period of `gracePeriod` when given (access goes on until it ends);
    /// `expirationIntent` 2, a billing error. The chain's latest transaction and the new
    /// state. Refused for an unknown chain, one that is not auto-renewable, one that lapsed and
    /// one whose renewal already fails.
    func failRenewal(
        originalTransactionId: String, gracePeriod: TimeInterval?
    ) throws -> Result<(Purchase, SubscriptionState), Refusal> {
        try database.write { db in
            let chain = try Self.chain(originalTransactionId, db)
            if let refusal = Self.refusal(chain, originalTransactionId) { return .failure(refusal) }
            var state = try Self.state(of: originalTransactionId, chain: chain, db)
            guard state.billingRetrySince == nil else {
                return .failure(.conflict("the renewal already failed: Apple is retrying it"))
            }
            let now = Self.millisecondFloor(Date())
            guard Self.periodEnd(of: chain) > now else {
                return .failure(.conflict("no period is in force: the subscription lapsed; /resubscribe buys it again"))
            }
            try Self.endPeriods(of: originalTransactionId, at: now, db)
            state.billingRetrySince = now
            state.gracePeriodExpiresDate = gracePeriod.map { now.addingTimeInterval($0) }
            state.expirationIntent = 2
            try Self.save(state, of: originalTransactionId, db)
            return .success((try Self.latestTransaction(ofChain: originalTransactionId, db)!, state))
        }
    }

    /// The chain expires, as Apple's EXPIRED: `BILLING_RETRY` when Apple gave up retrying a
    /// failed renewal; otherwise `VOLUNTARY`, the customer turned renewal off and the period in
    /// force ends now. The chain's latest transaction, the subtype and the new state. Refused
    /// for an unknown chain, one that is not auto-renewable, and one that already expired.
    func expire(originalTransactionId: String) throws -> Result<(Purchase, subtype: String, SubscriptionState), Refusal> {
        try database.write { db in
            let chain = try Self.chain(originalTransactionId, db)
            if let refusal = Self.refusal(chain, originalTransactionId) { return .failure(refusal) }
            var state = try Self.state(of: originalTransactionId, chain: chain, db)
            guard state.expiredDate == nil else { return .failure(.conflict("the subscription already expired")) }
            let now = Self.millisecondFloor(Date())
            let subtype: String
            if state.billingRetrySince != nil {
                subtype = "BILLING_RETRY"
                state.expirationIntent = 2
            } else {
                subtype = "VOLUNTARY"
                state.autoRenew = false
                state.expirationIntent = 1
                try Self.endPeriods(of: originalTransactionId, at: now, db)
            }
            state.billingRetrySince = nil
            state.gracePeriodExpiresDate = nil
            state.expiredDate = now
            try Self.save(state, of: originalTransactionId, db)
            return .success((try Self.latestTransaction(ofChain: originalTransactionId, db)!, subtype, state))
        }
    }

    /// Apple raises the price of the chain's next periods to `price` (milli-units), as
    /// `PRICE_INCREASE` tells: `consented` false while Apple awaits the customer's consent
    /// (`PENDING`), true once they gave it or none was needed (`ACCEPTED`). The chain's latest
    /// transaction and the new state. Refused for an unknown chain, one that is not
    /// auto-renewable, and one with no period in force.
    func raisePrice(originalTransactionId: String, price: Int64, consented: Bool) throws -> Result<(Purchase, SubscriptionState), Refusal> {
        try database.write { db in
            let chain = try Self.chain(originalTransactionId, db)
            if let refusal = Self.refusal(chain, originalTransactionId) { return .failure(refusal) }
            var state = try Self.state(of: originalTransactionId, chain: chain, db)
            guard state.expiredDate == nil, Self.periodEnd(of: chain) > Date() else {
                return .failure(.conflict("no period is in force: a lapsed subscription renews at no price"))
            }
            state.renewalPrice = price
            state.priceIncreaseStatus = consented ? 1 : 0
            try Self.save(state, of: originalTransactionId, db)
            return .success((try Self.latestTransaction(ofChain: originalTransactionId, db)!, state))
        }
    }

    /// Extends the billing period in force of an auto-renewable chain by `days` (Apple's
    /// Extend a Subscription Renewal Date): its transactions' `expiresDate` moves; the period as
    /// it is now. Refused for an unknown chain, one that is not auto-renewable, and a refunded
    /// or lapsed period.
    func extend(originalTransactionId: String, days: Int) throws -> Result<Purchase, Refusal> {
        try database.write { db in
            guard
                let latest = try Row.fetchOne(
                    db, sql: "SELECT * FROM purchase WHERE originalTransactionId = ? ORDER BY rowid DESC LIMIT 1",
                    arguments: [originalTransactionId]
                ).map(Purchase.init(row:))
            else { return .failure(.notFound) }
            guard latest.type == "auto_renewable", let expires = latest.expiresDate, let lineItem = latest.webOrderLineItemId else {
                return .failure(.conflict("\(originalTransactionId) is not an auto-renewable subscription"))
            }
            guard latest.cancellationDate == nil, expires > Date() else {
                return .failure(.conflict("the subscription has no period in force to extend"))
            }
            try db.execute(
                sql: "UPDATE purchase SET expiresDate = ? WHERE webOrderLineItemId = ?",
                arguments: [expires.addingTimeInterval(TimeInterval(days) * 86_400), lineItem])
            return .success(try Self.purchase(latest.transactionId, db)!)
        }
    }

    /// Why Apple refuses to extend a subscription's renewal date: its error code and message.
    struct ExtensionRefusal: Error, Sendable, Equatable {
        var status: Int
        var errorCode: Int
        var message: String

        static let notFound = ExtensionRefusal(status: 404, errorCode: 4_040_005, message: "Original transaction id not found.")
        static let ineligible = ExtensionRefusal(
            status: 403, errorCode: 4_030_004,
            message: "Forbidden - subscription state ineligible for extension.")
        static let maximum = ExtensionRefusal(
            status: 403, errorCode: 4_030_005, message: "Forbidden - subscription has reached maximum extension count.")
        static let familyShared = ExtensionRefusal(
            status: 403, errorCode: 4_030_007,
            message: "Subscriptions that were obtained through Family Sharing cannot be extended directly.")
        static let assigned = ExtensionRefusal(
            status: 403, errorCode: 4_030_028, message: "Assigned subscriptions cannot be extended directly.")
    }

    /// One renewal-date extension Apple made: what its answer says.
    struct RenewalExtension: Sendable, Equatable {
        var originalTransactionId: String
        var webOrderLineItemId: String
        var effectiveDate: Date
        /// The period, as extended (what RENEWAL_EXTENDED tells of).
        var period: Purchase
    }

    /// Apple's Extend a Subscription Renewal Date: the paid period in force of the chain ends
    /// `days` later. The same `requestIdentifier` again answers as the first time and extends
    /// nothing more. Refused as Apple refuses: an unknown chain (4040005), a family member's
    /// access (4030007), an assigned seat (4030028), a chain with no paid period in force (a
    /// free offer, billing retry, expired, refunded: 4030004), two extensions within 365 days
    /// already (4030005).
    func extendRenewalDate(
        originalTransactionId: String, bundleId: String, environment: String, days: Int, requestIdentifier: String,
        now: Date = Date()
    ) throws -> Result<RenewalExtension, ExtensionRefusal> {
        try database.write { db in
            try Self.extendRenewalDate(
                originalTransactionId: originalTransactionId, bundleId: bundleId, environment: environment, days: days,
                requestIdentifier: requestIdentifier, now: now, db)
        }
    }

    private static func extendRenewalDate(
        originalTransactionId: String, bundleId: String, environment: String, days: Int, requestIdentifier: String,
        now: Date, _ db: Database
    ) throws -> Result<RenewalExtension, ExtensionRefusal> {
        let chain = try chain(originalTransactionId, db).filter { $0.bundleId == bundleId && $0.environment == environment }
        guard let first = chain.first, first.transactionId == originalTransactionId,
            let latest = try latestTransaction(ofChain: originalTransactionId, db)
        else { return .failure(.notFound) }
        if let done = try Row.fetchOne(
            db, sql: "SELECT * FROM renewal_extension WHERE requestIdentifier = ? AND originalTransactionId = ?",
            arguments: [requestIdentifier, originalTransactionId])
        {
            let lineItem: String = done["webOrderLineItemId"]
            let period = chain.last { $0.webOrderLineItemId == lineItem } ?? latest
            return .success(
                RenewalExtension(
                    originalTransactionId: originalTransactionId, webOrderLineItemId: lineItem,
                    effectiveDate: done["effectiveDate"], period: period))
        }
        switch first.inAppOwnershipType {
        case "FAMILY_SHARED": return .failure(.familyShared)
        case "ASSIGNED": return .failure(.assigned)
        default: break
        }
        guard latest.type == "auto_renewable", let lineItem = latest.webOrderLineItemId else { return .failure(.ineligible) }
        let state = try state(of: originalTransactionId, chain: chain, db)
        let end = periodEnd(of: chain)
        let free = latest.terms.flatMap { try? JSONDecoder().decode(Terms.self, from: Data($0.utf8)) }?.offerDiscountType == "FREE_TRIAL"
        guard latest.cancellationDate == nil, end > now, state.expiredDate == nil, state.billingRetrySince == nil, !free else {
            return .failure(.ineligible)
        }
        let recent = try Int.fetchOne(
            db, sql: "SELECT count(*) FROM renewal_extension WHERE originalTransactionId = ? AND extendedAt > ?",
            arguments: [originalTransactionId, now.addingTimeInterval(-365 * 86_400)]) ?? 0
        guard recent < 2 else { return .failure(.maximum) }
        // To the millisecond Apple signs the period's end with (the nearest, as every signed date).
        let effective = Date(
            timeIntervalSince1970: (end.addingTimeInterval(TimeInterval(days) * 86_400).timeIntervalSince1970 * 1000).rounded() / 1000)
        try db.execute(
            sql: "UPDATE purchase SET expiresDate = ? WHERE webOrderLineItemId = ? AND originalTransactionId = ?",
            arguments: [effective, lineItem, originalTransactionId])
        try db.execute(
            sql: """
                INSERT INTO renewal_extension (requestIdentifier, originalTransactionId, webOrderLineItemId, effectiveDate, extendedAt)
                VALUES (?, ?, ?, ?, ?)
                """,
            arguments: [requestIdentifier, originalTransactionId, lineItem, effective, now])
        return .success(
            RenewalExtension(
                originalTransactionId: originalTransactionId, webOrderLineItemId: lineItem, effectiveDate: effective,
                period: try purchase(latest.transactionId, db)!))
    }

    /// A request to extend every active subscription of a product (Apple's mass extension).
    struct MassExtension: Sendable, Equatable {
        var requestIdentifier: String
        var productId: String
        var bundleId: String
        var environment: String
        var days: Int
        var storefrontCountryCodes: [String]
        var completeDate: Date?
        var succeededCount: Int
        var failedCount: Int
    }

    /// Records a mass extension; false when one with this `requestIdentifier` was asked
    /// before (it is not run again).
    func beginMassExtension(_ request: MassExtension) throws -> Bool {
        try database.write { db in
            try db.execute(
                sql: """
                    INSERT INTO mass_extension (requestIdentifier, productId, bundleId, environment, days, storefronts)
                    VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING
                    """,
                arguments: [
                    request.requestIdentifier, request.productId, request.bundleId, request.environment, request.days,
                    request.storefrontCountryCodes.joined(separator: ","),
                ])
            return db.changesCount > 0
        }
    }

    /// The chains a mass extension reaches: every auto-renewable chain of its product in its
    /// app and environment bought by its customer (a family member's access follows its
    /// purchase), in the storefronts it names (every fake purchase is in `USA`).
    func massExtensionChains(_ request: MassExtension) throws -> [String] {
        guard request.storefrontCountryCodes.isEmpty || request.storefrontCountryCodes.contains("USA") else { return [] }
        return try database.read { db in
            try String.fetchAll(
                db,
                sql: """
                    SELECT DISTINCT originalTransactionId FROM purchase
                    WHERE productId = ? AND bundleId = ? AND environment = ? AND type = 'auto_renewable'
                        AND transactionId = originalTransactionId AND inAppOwnershipType = 'PURCHASED'
                    ORDER BY rowid
                    """,
                arguments: [request.productId, request.bundleId, request.environment])
        }
    }

    /// One chain of a mass extension: extended (with its own request identifier under the
    /// mass one) or refused; counted either way.
    func extendForMass(_ request: MassExtension, originalTransactionId: String) throws -> Result<RenewalExtension, ExtensionRefusal> {
        try database.write { db in
            let result = try Self.extendRenewalDate(
                originalTransactionId: originalTransactionId, bundleId: request.bundleId, environment: request.environment,
                days: request.days, requestIdentifier: "mass:\(request.requestIdentifier)", now: Date(), db)
            let column = if case .success = result { "succeededCount" } else { "failedCount" }
            try db.execute(
                sql: "UPDATE mass_extension SET \(column) = \(column) + 1 WHERE requestIdentifier = ?",
                arguments: [request.requestIdentifier])
            return result
        }
    }

    /// Marks a mass extension complete; returns it as it ended.
    func completeMassExtension(_ requestIdentifier: String) throws -> MassExtension? {
        try database.write { db in
            try db.execute(
                sql: "UPDATE mass_extension SET completeDate = ? WHERE requestIdentifier = ?", arguments: [Date(), requestIdentifier])
            return try Self.massExtension(requestIdentifier, db)
        }
    }

    /// A mass extension asked of this app and environment, as it stands.
    func massExtension(_ requestIdentifier: String) throws -> MassExtension? {
        try database.read { db in try Self.massExtension(requestIdentifier, db) }
    }

    private static func massExtension(_ requestIdentifier: String, _ db: Database) throws -> MassExtension? {
        try Row.fetchOne(db, sql: "SELECT * FROM mass_extension WHERE requestIdentifier = ?", arguments: [requestIdentifier]).map {
            let storefronts: String = $0["storefronts"]
            return MassExtension(
                requestIdentifier: $0["requestIdentifier"], productId: $0["productId"], bundleId: $0["bundleId"],
                environment: $0["environment"], days: $0["days"],
                storefrontCountryCodes: storefronts.split(separator: ",").map(String.init), completeDate: $0["completeDate"],
                succeededCount: $0["succeededCount"], failedCount: $0["failedCount"])
        }
    }

    /// How the renewal of each of these chains stands; a chain the fake holds no state for
    /// renews normally.
    func subscriptionStates(of originalTransactionIds: some Collection<String>) throws -> [String: SubscriptionState] {
        guard !originalTransactionIds.isEmpty else { return [:] }
        return try database.read { db in
            var states: [String: SubscriptionState] = [:]
            for id in Set(originalTransactionIds) {
                if let row = try Row.fetchOne(
                    db.cachedStatement(sql: "SELECT * FROM subscription WHERE originalTransactionId = ?"), arguments: [id])
                {
                    states[id] = SubscriptionState(row: row)
                }
            }
            return states
        }
    }

    /// The chain's latest transaction (of the period bought last): what the subscription
    /// status reports, whichever device holds it.
    func latestTransaction(ofChain originalTransactionId: String) throws -> Purchase? {
        try database.read { db in try Self.latestTransaction(ofChain: originalTransactionId, db) }
    }

    /// A new billing period of the chain `originalTransactionId`, shaped by `shape` (which may
    /// refuse it with a reason, and changes the chain's state as the period does), stored, and
    /// the receipt of the period's device (by default the device of the chain's latest
    /// transaction), which holds the whole chain.
    private static func nextPeriod(
        of originalTransactionId: String, _ db: Database, encode: (Receipt) throws -> [UInt8],
        shape: (_ chain: [Purchase], _ state: inout SubscriptionState, _ period: inout Purchase, _ now: Date) throws -> String?
    ) throws -> Result<(Purchase, [UInt8]), Refusal> {
        let chain = try Self.chain(originalTransactionId, db)
        if let refusal = Self.refusal(chain, originalTransactionId) { return .failure(refusal) }
        var state = try Self.state(of: originalTransactionId, chain: chain, db)
        let now = Date()
        let transactionId = try nextTransactionId(db)
        var period = chain[chain.count - 1]
        period.transactionId = transactionId
        period.webOrderLineItemId = lineItemId(transactionId)
        period.purchaseDate = now
        period.cancellationDate = nil
        period.revocationType = nil
        period.revocationPercentage = nil
        period.isUpgraded = false
        period.finishedDate = nil
        period.receiptTransactionId = nil
        // An offer is the first period's; later periods are at the list price.
        period.terms = nil
        if let refusal = try shape(chain, &state, &period, now) { return .failure(.conflict(refusal)) }
        try insert(period, db)
        try save(state, of: originalTransactionId, db)
        return .success((period, try issueReceipt(for: period, at: now, db, encode: encode)))
    }

    /// Every transaction of a chain, in the order the fake made them.
    private static func chain(_ originalTransactionId: String, _ db: Database) throws -> [Purchase] {
        try Row.fetchAll(
            db, sql: "SELECT * FROM purchase WHERE originalTransactionId = ? ORDER BY rowid", arguments: [originalTransactionId]
        ).map(Purchase.init(row:))
    }

    /// Why nothing about `chain`'s renewal can happen: unknown, or not auto-renewable.
    private static func refusal(_ chain: [Purchase], _ originalTransactionId: String) -> Refusal? {
        guard let latest = chain.last, let first = chain.first else { return .notFound }
        guard latest.type == "auto_renewable", first.expiresDate != nil else {
            return .conflict("\(originalTransactionId) is not an auto-renewable subscription")
        }
        return nil
    }

    /// When the chain's period in force ends (or the last one ended): the latest expiry of
    /// the periods not upgraded from.
    private static func periodEnd(of chain: [Purchase]) -> Date {
        chain.filter { !$0.isUpgraded }.compactMap(\.expiresDate).max() ?? chain.compactMap(\.expiresDate).max() ?? .distantPast
    }

    /// Every period of the chain still running ends at `date`.
    private static func endPeriods(of originalTransactionId: String, at date: Date, _ db: Database) throws {
        try db.execute(
            sql: "UPDATE purchase SET expiresDate = ? WHERE originalTransactionId = ? AND expiresDate > ?",
            arguments: [date, originalTransactionId, date])
    }

    private static func latestTransaction(ofChain originalTransactionId: String, _ db: Database) throws -> Purchase? {
        try Row.fetchOne(
            db.cachedStatement(
                sql: """
                    SELECT * FROM purchase WHERE originalTransactionId = ? AND receiptTransactionId IS NULL
                    ORDER BY purchaseDate DESC, rowid DESC LIMIT 1
                    """),
            arguments: [originalTransactionId]
        ).map(Purchase.init(row:))
    }

    /// The chain's state; for a chain minted before the fake kept one, a normal renewal with
    /// the first period's length.
    private static func state(of originalTransactionId: String, chain: [Purchase], _ db: Database) throws -> SubscriptionState {
        if let row = try Row.fetchOne(db, sql: "SELECT * FROM subscription WHERE originalTransactionId = ?", arguments: [originalTransactionId]) {
            return SubscriptionState(row: row)
        }
        let first = chain[0]
        return SubscriptionState(periodSeconds: first.expiresDate!.timeIntervalSince(first.purchaseDate))
    }

    static func save(_ state: SubscriptionState, of originalTransactionId: String, _ db: Database) throws {
        try db.execute(
            sql: """
                INSERT OR REPLACE INTO subscription (
                    originalTransactionId, periodSeconds, autoRenew, billingRetrySince, gracePeriodExpiresDate,
                    expirationIntent, expiredDate, renewalPrice, priceIncreaseStatus
                ) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
                """,
            arguments: [
                originalTransactionId, state.periodSeconds, state.autoRenew, state.billingRetrySince,
                state.gracePeriodExpiresDate, state.expirationIntent, state.expiredDate, state.renewalPrice,
                state.priceIncreaseStatus,
            ])
    }

    /// `date` to the millisecond below: what the fake stores and signs, so that a period
    /// ended "now" is over at once.
    private static func millisecondFloor(_ date: Date) -> Date {
        Date(timeIntervalSince1970: (date.timeIntervalSince1970 * 1000).rounded(.down) / 1000)
    }
}

extension FakeLedger.SubscriptionState {
    init(row: Row) {
        self.init(
            periodSeconds: row["periodSeconds"], autoRenew: row["autoRenew"], billingRetrySince: row["billingRetrySince"],
            gracePeriodExpiresDate: row["gracePeriodExpiresDate"], expirationIntent: row["expirationIntent"],
            expiredDate: row["expiredDate"], renewalPrice: row["renewalPrice"], priceIncreaseStatus: row["priceIncreaseStatus"])
    }
}
