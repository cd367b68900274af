import Foundation
import IAPCore

/// Apple's notification types (App Store Server Notifications V2), with a raw twin for the
/// values Apple adds later: an unknown type is recorded, never refused.
public enum NotificationType: Sendable, Equatable {
    case refund, revoke, refundReversed, refundDeclined
    case subscribed, didRenew, offerRedeemed, didChangeRenewalPref, renewalExtended, oneTimeCharge
    case expired, gracePeriodExpired, didFailToRenew, didChangeRenewalStatus
    case consumptionRequest, rescindConsent, test
    /// Apple moved a subscription to a new chain (to the Advanced Commerce API): the same
    /// customer's subscription goes on under a new original transaction that names the old one.
    case migration
    /// Apple told the customer of a price increase: `PENDING` awaits their consent (without it
    /// the subscription expires at its renewal date), `ACCEPTED` they consented or none was needed.
    case priceIncrease
    /// How a renewal-date extension went where Apple tells of it apart from `RENEWAL_EXTENDED`:
    /// `FAILURE` for a subscription a mass extension could not extend, `SUMMARY` when the mass
    /// extension is done.
    case renewalExtension
    /// Any other type, as Apple spelled it.
    case other(String)

    /// The type Apple's `notificationType` names.
    public init(_ raw: String) {
        self =
            switch raw {
            case "REFUND": .refund
            case "REVOKE": .revoke
            case "REFUND_REVERSED": .refundReversed
            case "REFUND_DECLINED": .refundDeclined
            case "SUBSCRIBED": .subscribed
            case "DID_RENEW": .didRenew
            case "OFFER_REDEEMED": .offerRedeemed
            case "DID_CHANGE_RENEWAL_PREF": .didChangeRenewalPref
            case "RENEWAL_EXTENDED": .renewalExtended
            case "ONE_TIME_CHARGE": .oneTimeCharge
            case "EXPIRED": .expired
            case "GRACE_PERIOD_EXPIRED": .gracePeriodExpired
            case "DID_FAIL_TO_RENEW": .didFailToRenew
            case "DID_CHANGE_RENEWAL_STATUS": .didChangeRenewalStatus
            case "CONSUMPTION_REQUEST": .consumptionRequest
            case "RESCIND_CONSENT": .rescindConsent
            case "TEST": .test
            case "MIGRATION": .migration
            case "PRICE_INCREASE": .priceIncrease
            case "RENEWAL_EXTENSION": .renewalExtension
            default: .other(raw)
            }
    }

    /// Whether it tells of a purchase to credit (a new period, a new one-time purchase).
    public var credits: Bool {
        switch self {
        case .subscribed, .didRenew, .offerRedeemed, .didChangeRenewalPref, .renewalExtended, .oneTimeCharge: true
        default: false
        }
    }
}

extension Planner {
    /// Applies a verified notification not applied before; returns what it did.
    mutating func apply(_ notification: AppStoreNotification, submissionId: String) -> NotificationOutcome {
        let type = NotificationType(notification.notificationType)
        guard let purchase = notification.purchase else { return applyWithoutPurchase(notification, type: type) }
        let key = policy.creditKey(of: purchase)
        let owner = owner(of: purchase, key: key)
        let tag = "\(notification.notificationType):\(notification.notificationUUID)"
        let signed = notification.signedDate ?? now
        switch type {
        case .refund, .revoke:
            return applyRefund(notification, purchase: purchase, key: key, tag: tag, signed: signed)
        case .refundReversed:
            return applyRefundReversed(
                notification, purchase: purchase, key: key, owner: owner, tag: tag, signed: signed, submissionId: submissionId)
        case .subscribed, .didRenew, .offerRedeemed, .didChangeRenewalPref, .renewalExtended, .oneTimeCharge:
            return applyPaidPeriod(notification, type: type, purchase: purchase, key: key, owner: owner, submissionId: submissionId)
        case .expired:
            updateSubscription(notification, state: .expired)
            return .subscriptionState(.expired)
        case .gracePeriodExpired:
            // The grace ended, billing retry goes on (Apple's status 3): no access, but not
            // over; a later DID_RENEW (BILLING_RECOVERY) brings it back.
            updateSubscription(notification, state: .billingRetry)
            return .subscriptionState(.billingRetry)
        case .didFailToRenew:
            let state: SubscriptionState = notification.subtype == "GRACE_PERIOD" ? .gracePeriod : .billingRetry
            updateSubscription(notification, state: state)
            return .subscriptionState(state)
        case .didChangeRenewalStatus:
            updateSubscription(notification, state: nil)
            return .autoRenew(on: notification.subtype != "AUTO_RENEW_DISABLED")
        case .consumptionRequest:
            recordConsumptionRequest(notification, purchase: purchase, key: key, owner: owner)
            return .recorded
        case .refundDeclined:
            // A case closed: nothing changes; Apple may still refund later.
            return .declined
        case .migration:
            migrate(notification, purchase: purchase)
            return .recorded
        case .priceIncrease:
            return applyPriceIncrease(notification, purchase: purchase, owner: owner)
        case .renewalExtension:
            // A mass extension could not extend this subscription (`FAILURE`): its period ends
            // when it did; customer service sees why in the audit log.
            updateSubscription(notification, state: nil)
            audit(
                actor: "apple", action: "renewal_extension_failed", subject: "subscription:\(purchase.originalTransactionId)",
                reason: "RENEWAL_EXTENSION \(notification.subtype ?? "")",
                details: ["transactionId": purchase.transactionId, "productId": purchase.productId, "owner": owner ?? ""])
            return .recorded
        case .rescindConsent, .test, .other:
            return .recorded
        }
    }

    /// A notification about no transaction: a test, a consent rescinded, a mass extension's summary.
    mutating func applyWithoutPurchase(_ notification: AppStoreNotification, type: NotificationType) -> NotificationOutcome {
        switch type {
        case .test: return .test
        case .rescindConsent:
            consentRescinded(notification)
            return .recorded
        case .renewalExtension:
            if let summary = notification.extensionSummary { massExtensionEnded(summary, notification: notification) }
            return .recorded
        default: return .recorded
        }
    }

    /// Apple asks for consumption information: recorded, to be answered within Apple's window.
    mutating func recordConsumptionRequest(
        _ notification: AppStoreNotification, purchase: VerifiedPurchase, key: CreditKey, owner: String?
    ) {
        emit(
            .recordConsumptionRequest(
                .init(
                    notificationUUID: notification.notificationUUID, transactionId: purchase.transactionId, userId: owner,
                    reason: notification.consumptionRequestReason, environment: notification.environment.rawValue,
                    receivedAt: now, ownershipType: purchase.ownershipType,
                    deadline: (notification.signedDate ?? now).addingTimeInterval(
                        LedgerChange.ConsumptionRequest.answerWindow),
                    creditKey: key.stored, productType: product(purchase.productId)?.type.rawValue)))
    }

    /// A refund or revocation: per billing period, the subscription is revoked only when its
    /// newest period is; a refund of an earlier one leaves the paid current period, its state
    /// and expiry.
    mutating func applyRefund(
        _ notification: AppStoreNotification, purchase: VerifiedPurchase, key: CreditKey, tag: String, signed: Date
    ) -> NotificationOutcome {
        if isNewestPeriod(purchase) {
            updateSubscription(notification, state: .revoked)
        }
        let quantity = max(facts.purchase?.quantity ?? purchase.quantity, 1)
        guard
            recordRevocation(
                key: key, transactionId: purchase.transactionId, source: notification.notificationType,
                at: purchase.cancellationDate ?? signed, units: partialUnits(purchase, quantity: quantity))
        else { return .reversedAlready }
        let before = facts.activeGrant(of: key)
        if settle(key: key, quantity: quantity, reason: notification.notificationType, tag: tag) {
            revoked += 1
            return .revoked
        }
        guard let before else { return facts.revocation?.stands == true ? .revocationPending : .reversedAlready }
        return facts.activeGrant(of: key).map { $0.quantity < before.quantity ? .partlyRevoked : .unchanged } ?? .unchanged
    }

    /// Apple reversed a refund: what it took back is given back, and a purchase nobody was
    /// credited with is credited to its token's order's owner, or kept for its owner's proof.
    mutating func applyRefundReversed(
        _ notification: AppStoreNotification, purchase: VerifiedPurchase, key: CreditKey, owner: String?, tag: String, signed: Date,
        submissionId: String
    ) -> NotificationOutcome {
        let stood = facts.revocation?.creditKey == key && facts.revocation?.stands == true
        recordReversal(key: key, transactionId: purchase.transactionId, at: signed)
        let before = facts.grants(of: key)
        settle(key: key, quantity: max(purchase.quantity, 1), reason: "REFUND_REVERSED", tag: tag, purchase: purchase)
        let after = facts.grants(of: key)
        if before.isEmpty, !after.isEmpty { return .credit(.credited, nil) }
        if before != after {
            updateSubscription(notification, state: .active)
            return .restored
        }
        let lifted = stood && facts.revocation?.stands != true
        if after.isEmpty, facts.purchase == nil, facts.revocation?.stands != true {
            // Apple gave back a purchase nobody was credited with (its app may have finished
            // it on the refund, so no later receipt holds it): its token's order's owner is
            // credited; otherwise it is kept for its owner's proof and listed for customer
            // service, never dropped.
            if let owner, purchase.appAccountToken != nil, facts.tokenOrder != nil {
                let upload = LedgerEvent.Upload(
                    userId: owner, submissionId: submissionId, orderId: nil, transactionId: nil, bundleId: notification.bundleId ?? "")
                let (state, reason) = credit(purchase, upload: upload)
                return .credit(state, reason)
            }
            if owner == nil,
                recordUnowned(purchase, key: key, submissionId: submissionId, bundleId: notification.bundleId ?? "", anyKey: true)
            {
                return .kept(.ownerUnknown)
            }
        }
        return lifted ? .revocationLifted : .nothingRevoked
    }

    /// A notification that tells of a paid period (a subscription, a renewal, an offer, a
    /// renewal preference, an extension, a one-time charge): credited to its owner, or kept
    /// until an upload proves whose it is.
    mutating func applyPaidPeriod(
        _ notification: AppStoreNotification, type: NotificationType, purchase: VerifiedPurchase, key: CreditKey, owner: String?,
        submissionId: String
    ) -> NotificationOutcome {
        guard notification.environment == .production || policy.sandbox.allows(userId: owner ?? "") else {
            return .sandboxNotAllowed
        }
        updateSubscription(notification, state: nil)
        // A new purchase in the chain (a resubscription, an upgrade, a crossgrade) may be
        // another account's of the app on the same Apple ID: without a token naming an
        // order, only the buyer's upload proves whose it is, so it waits for that upload
        // (`buyer_unknown`) like a period nobody owns yet.
        let newPurchase = purchase.isNewPurchaseInChain && !(purchase.appAccountToken != nil && facts.tokenOrder != nil)
            && facts.activeGrant(of: key) == nil
        let credited: NotificationOutcome
        if let owner, !newPurchase {
            let upload = LedgerEvent.Upload(
                userId: owner, submissionId: submissionId, orderId: nil, transactionId: nil,
                bundleId: notification.bundleId ?? "")
            let (state, reason) = credit(purchase, upload: upload)
            credited = .credit(state, reason)
        } else {
            // Nobody owns the subscription yet: Apple's signed period is kept, and credited
            // to whoever the app's first upload proves is the owner (Apple does not tell
            // again of a notification we answered).
            if recordUnowned(
                purchase, key: key, submissionId: submissionId, bundleId: notification.bundleId ?? "", awaitsBuyer: newPurchase),
                newPurchase
            {
                awaitBuyer(of: purchase)
            }
            credited = .kept(newPurchase ? .buyerUnknown : .ownerUnknown)
        }
        if type == .renewalExtended, let expires = purchase.expiresDate {
            // Apple moved the period's end: the grant in force lasts as long.
            // Never past the start of a period that replaced it (an upgrade).
            var extended = false
            for grant in facts.grants(of: key) where grant.isActive {
                var extendedPurchase = purchase
                extendedPurchase.purchaseDate = grant.periodStart ?? purchase.purchaseDate
                let until = replacedTiers(by: extendedPurchase, key: key).own.map { min($0, expires) } ?? expires
                guard let current = grant.expiresAt, current < until else { continue }
                emit(.extendGrant(transactionId: grant.transactionId, until: until))
                extended = true
            }
            if extended { return .extended }
        }
        return credited
    }

    /// A price increase: the renewal terms (price, the consent's state) are kept on the
    /// subscription, as every notification's are; nothing is credited or taken back now.
    /// Audited, and published for the app's services (a reminder to consent is theirs to
    /// send). Without renewal information, the subtype says the consent's state, and what was
    /// kept of the renewal stays.
    mutating func applyPriceIncrease(
        _ notification: AppStoreNotification, purchase: VerifiedPurchase, owner: String?
    ) -> NotificationOutcome {
        var told = notification
        if told.renewal?.priceIncreaseStatus == nil, let consent = notification.subtype.flatMap(Self.priceIncreaseStatus) {
            let kept = facts.subscription?.originalTransactionId == purchase.originalTransactionId ? facts.subscription?.renewal : nil
            told.renewal = told.renewal ?? kept ?? RenewalTerms()
            told.renewal?.priceIncreaseStatus = consent
        }
        updateSubscription(told, state: nil)
        let consent = told.renewal?.priceIncrease ?? "unknown"
        audit(
            actor: "apple", action: "price_increase", subject: "subscription:\(purchase.originalTransactionId)",
            reason: notification.subtype ?? "PRICE_INCREASE", details: ["consent": consent, "owner": owner ?? ""])
        publish(
            "subscription.price_increase",
            [
                "originalTransactionId": .string(purchase.originalTransactionId), "userId": owner.map(EventField.string) ?? .null,
                "productId": .string(told.renewal?.autoRenewProductId ?? purchase.productId), "consent": .string(consent),
                "renewalPrice": told.renewal?.renewalPrice.map { .int(Int($0)) } ?? .null,
                "currency": told.renewal?.currency.map(EventField.string) ?? .null,
                "signedDate": notification.signedDate.map { .string(Ledger.iso8601($0)) } ?? .null,
            ], id: "subscription.price_increase:\(notification.notificationUUID)")
        return .recorded
    }

    /// Apple's word that a mass renewal-date extension is done (`RENEWAL_EXTENSION`
    /// `SUMMARY`): how many subscriptions it extended and how many it could not. Audited
    /// under the request's identifier, beside customer service's request.
    mutating func massExtensionEnded(_ summary: AppStoreNotification.ExtensionSummary, notification: AppStoreNotification) {
        audit(
            actor: "apple", action: "renewal_extension_completed", subject: "renewal_extension:\(summary.requestIdentifier)",
            reason: "RENEWAL_EXTENSION \(notification.subtype ?? "SUMMARY")",
            details: [
                "productId": summary.productId, "environment": notification.environment.rawValue,
                "succeededCount": "\(summary.succeededCount)", "failedCount": "\(summary.failedCount)",
                "storefrontCountryCodes": summary.storefrontCountryCodes.joined(separator: ","),
            ])
    }

    /// `MIGRATION`: Apple moved the subscription to a new chain whose transaction names the old
    /// one (`previousOriginalTransactionId`). Nothing was bought, so nothing is credited (the
    /// period in force stays credited under the old chain); the new chain is its old chain's
    /// owner's from now on, so its renewals, refunds and status follow them. A migration whose
    /// old chain nobody owns yet is recorded with no owner, like any period told before an
    /// upload; the owner's first credit of the old chain reaches the new one. Audited.
    mutating func migrate(_ notification: AppStoreNotification, purchase: VerifiedPurchase) {
        let owner = purchase.previousOriginalTransactionId != nil ? facts.previousChainOwner : nil
        updateSubscription(
            purchase, owner: owner, environment: notification.environment.rawValue,
            state: notification.subscriptionStatus.flatMap(SubscriptionState.init(appleStatus:)) ?? .active,
            autoRenew: notification.autoRenewStatus.map { $0 == 1 }, renewal: notification.renewal, grace: .keep, stateDate: notification.signedDate ?? now)
        var details = ["owner": owner ?? ""]
        details["from"] = purchase.previousOriginalTransactionId
        audit(
            actor: "apple", action: "subscription_migrated", subject: "subscription:\(purchase.originalTransactionId)",
            reason: "MIGRATION", details: details)
    }

    /// A customer (or their guardian) withdrew the consent the app's use rests on: nothing in
    /// the ledger changes; audited and published as `consent.rescinded` for the app's services.
    mutating func consentRescinded(_ notification: AppStoreNotification) {
        let app = notification.bundleId ?? ""
        var details = ["notificationUUID": notification.notificationUUID, "environment": notification.environment.rawValue]
        details["appTransactionId"] = notification.appTransactionId
        audit(actor: "apple", action: "consent_rescinded", subject: "app:\(app)", reason: "RESCIND_CONSENT", details: details)
        publish(
            "consent.rescinded",
            [
                "bundleId": .string(app), "environment": .string(notification.environment.rawValue),
                "appTransactionId": notification.appTransactionId.map(EventField.string) ?? .null,
                "notificationUUID": .string(notification.notificationUUID),
                "signedDate": notification.signedDate.map { .string(Ledger.iso8601($0)) } ?? .null,
                "receivedAt": .string(nowText),
            ], id: "consent.rescinded:\(notification.notificationUUID)")
    }

    /// Whether `purchase` is its subscription's newest known period (or nothing says otherwise).
    func isNewestPeriod(_ purchase: VerifiedPurchase) -> Bool {
        guard let expires = purchase.expiresDate, let subscription = facts.subscription,
            subscription.originalTransactionId == purchase.originalTransactionId
        else { return true }
        return subscription.expiresDate.map { expires >= $0 } ?? true
    }

    /// Whose purchase this is: the owner of its active grant, else its subscription's owner,
    /// else whoever it or its chain was credited to, else the order its `appAccountToken`
    /// names; nil when nothing of it was credited yet (an upload a refund stopped or a person
    /// holds does not make its uploader the owner).
    func owner(of purchase: VerifiedPurchase, key: CreditKey) -> String? {
        if let grant = facts.activeGrant(of: key) { return grant.userId }
        if case .billingPeriod = key, facts.subscription?.originalTransactionId == purchase.originalTransactionId {
            // The owner of its stretch of the chain; else its token's order's, or, for a
            // migrated chain nobody owns yet, its old chain's owner; or nobody yet.
            let stretch = stretchOwner(of: purchase)
            if case .owner(let owner) = stretch { return owner }
            if purchase.appAccountToken != nil, let order = facts.tokenOrder { return order.userId }
            if case .unclaimed = stretch, facts.subscription?.userId == nil, let continued = facts.previousChainOwner {
                return continued
            }
            return nil
        }
        if let owner = facts.subscription?.userId { return owner }
        if let user = facts.chainCreditedUser { return user }
        // A migrated subscription's first period: its old chain's owner.
        if let continued = facts.previousChainOwner { return continued }
        if purchase.appAccountToken != nil, let order = facts.tokenOrder { return order.userId }
        return nil
    }

    /// Keeps a billing period Apple told of while its subscription has no owner (held
    /// `owner_unknown`, for nobody), so that the owner's first credit credits it too.
    @discardableResult
    mutating func recordUnowned(
        _ purchase: VerifiedPurchase, key: CreditKey, submissionId: String, bundleId: String, awaitsBuyer: Bool = false,
        anyKey: Bool = false
    ) -> Bool {
        var period = false
        if case .billingPeriod = key { period = true }
        guard period || anyKey, facts.purchase == nil, facts.grants(of: key).isEmpty, purchase.isUpgraded != true
        else { return false }
        emit(
            .recordPurchase(
                .init(
                    transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId,
                    productId: purchase.productId, quantity: max(purchase.quantity, 1), environment: purchase.environment,
                    bundleId: bundleId, purchaseDate: purchase.purchaseDate, userId: "", orderId: nil,
                    submissionId: submissionId, appAccountToken: purchase.appAccountToken,
                    heldReason: awaitsBuyer ? .buyerUnknown : .ownerUnknown, creditedAt: now, creditKey: key,
                    webOrderLineItemId: purchase.webOrderLineItemId, expiresDate: purchase.expiresDate,
                    ownershipType: purchase.ownershipType),
                ifAbsent: true))
        return true
    }

    /// A new purchase in the chain that nothing proves whose it is yet: kept for its buyer's
    /// upload (`buyer_unknown`); the periods before it stay with the owner they were credited
    /// to. Audited.
    mutating func awaitBuyer(of purchase: VerifiedPurchase) {
        guard let subscription = facts.subscription, subscription.originalTransactionId == purchase.originalTransactionId,
            let previous = subscription.userId
        else { return }
        audit(
            actor: "system", action: "subscription_awaits_buyer", subject: "subscription:\(purchase.originalTransactionId)",
            reason: "bought again (transaction \(purchase.transactionId)) by an account not proven yet; owned by \(previous)",
            details: ["owner": previous, "transactionId": purchase.transactionId])
    }

    /// Credits a period kept while its subscription had no owner to the owner known now,
    /// unless Apple took it back meanwhile (then it waits, held `revoked`, for a reversal).
    mutating func creditUnowned(_ row: LedgerFacts.Purchase, owner: String, upload: LedgerEvent.Upload) {
        let key = row.creditKey ?? .transaction(row.transactionId)
        // The period is credited already (this credit was a restore of it): its own upload
        // settles the transaction, as if Apple had not told of it.
        guard facts.grants(of: key).isEmpty else { return }
        let revocation = facts.unownedRevocations.first { $0.creditKey == key }
        var claimed = row
        claimed.userId = owner
        claimed.creditedAt = now
        claimed.heldReason = revocation?.standsFully == true ? .stoppedByRefund : nil
        emit(.claimPurchase(claimed))
        guard claimed.heldReason == nil else { return }
        let product = product(row.productId)
        let period = recorded(row)
        let ends = replacedTiers(by: period, key: key)
        let quantity = max(row.quantity - (revocation?.standingUnits ?? 0), 1)
        grant(
            transactionId: row.transactionId, originalTransactionId: row.originalTransactionId, creditKey: key,
            userId: owner, productId: row.productId, orderId: nil, quantity: quantity,
            grant: product?.grant(quantity: quantity) ?? [:], environment: row.environment, source: .apple,
            expiresAt: ends.own ?? row.expiresDate, periodStart: row.purchaseDate)
        endReplaced(ends.others, by: period)
        audit(
            actor: "system", action: "period_credited_to_new_owner", subject: "transaction:\(row.transactionId)",
            reason: "Apple told of this period before the subscription had an owner; \(owner) proved it theirs",
            details: ["userId": owner, "submissionId": upload.submissionId, "creditKey": key.stored])
    }

    /// Grants a purchase whose upload a refund stopped, now that Apple reversed the refund.
    mutating func creditBlocked(_ row: LedgerFacts.Purchase, key: CreditKey, purchase: VerifiedPurchase) {
        emit(.releasePurchase(transactionId: row.transactionId))
        let product = product(row.productId)
        let period = recorded(row, expiresDate: purchase.expiresDate)
        let ends = product?.type == .autoRenewable ? replacedTiers(by: period, key: key) : nil
        grant(
            transactionId: row.transactionId, originalTransactionId: row.originalTransactionId, creditKey: key,
            userId: row.userId, productId: row.productId, orderId: nil, quantity: row.quantity,
            grant: product?.grant(quantity: row.quantity) ?? [:], environment: row.environment, source: .apple,
            expiresAt: product?.type == .autoRenewable ? (ends?.own ?? purchase.expiresDate) : nil, periodStart: row.purchaseDate)
        endReplaced(ends?.others ?? [], by: period)
        if case .billingPeriod = key {
            // Credited now: its subscription has an owner, whose every later period is theirs.
            recordSubscription(of: recorded(row, expiresDate: purchase.expiresDate), owner: row.userId)
        }
        audit(
            actor: "apple", action: "grant_restored", subject: "transaction:\(row.transactionId)", reason: "REFUND_REVERSED",
            details: ["userId": row.userId])
    }

    /// Undoes a revocation: the grant is active again, its order paid, `grant.restored` published.
    mutating func restoreGrant(_ grant: Grant, tag: String) {
        emit(.reactivateGrant(transactionId: grant.transactionId))
        if let orderId = grant.orderId {
            emit(.setOrderState(orderId: orderId, transactionId: grant.transactionId, state: .paid, at: now))
        }
        publish(
            "grant.restored",
            [
                "transactionId": .string(grant.transactionId), "userId": .string(grant.userId),
                "productId": .string(grant.productId), "quantity": .int(grant.quantity), "grant": .json(grant.grantJSON),
                "restoredAt": .string(nowText),
            ], id: "grant.restored:\(tag)")
        audit(
            actor: "apple", action: "grant_restored", subject: "transaction:\(grant.transactionId)", reason: "REFUND_REVERSED",
            details: ["userId": grant.userId])
    }

    /// Records a subscription's state and expiry from a notification: `state`, else Apple's
    /// status, else active; the newest period's grant lasts into Apple's grace period. A
    /// notification names no owner: a subscription's owner is whoever its first period was
    /// credited to (`credit`), never a notification's guess.
    mutating func updateSubscription(_ notification: AppStoreNotification, state: SubscriptionState?) {
        guard let purchase = notification.purchase, purchase.expiresDate != nil || notification.subscriptionStatus != nil
        else { return }
        if let grace = notification.gracePeriodExpiresDate,
            let newest = facts.grants.filter({ $0.isActive && $0.originalTransactionId == purchase.originalTransactionId })
                .max(by: { ($0.expiresAt ?? .distantPast, $0.id) < ($1.expiresAt ?? .distantPast, $1.id) })
        {
            emit(.setGracePeriod(transactionId: newest.transactionId, until: grace))
        }
        updateSubscription(
            purchase, owner: nil, environment: notification.environment.rawValue,
            state: state ?? notification.subscriptionStatus.flatMap(SubscriptionState.init(appleStatus:)) ?? .active,
            autoRenew: notification.autoRenewStatus.map { $0 == 1 }, renewal: notification.renewal,
            grace: .set(notification.gracePeriodExpiresDate),
            stateDate: notification.signedDate ?? now)
    }

    /// Apple's `priceIncreaseStatus` a `PRICE_INCREASE` subtype stands for.
    static func priceIncreaseStatus(_ subtype: String) -> Int? {
        switch subtype {
        case "PENDING": 0
        case "ACCEPTED": 1
        default: nil
        }
    }

    /// A purchase row as the ledger reads a purchase; `expiresDate` where the row has none.
    func recorded(_ row: LedgerFacts.Purchase, expiresDate: Date? = nil) -> VerifiedPurchase {
        VerifiedPurchase(
            transactionId: row.transactionId, originalTransactionId: row.originalTransactionId, productId: row.productId,
            quantity: row.quantity, purchaseDate: row.purchaseDate, environment: row.environment,
            expiresDate: row.expiresDate ?? expiresDate, webOrderLineItemId: row.webOrderLineItemId)
    }
}

// MARK: - Customer service

extension Planner {
    /// Grants by hand: a held purchase to its owner, or goodwill under a new id. Audited.
    mutating func grantByHand(_ request: LedgerEvent.ManualGrant) -> LedgerOutcome {
        var target = ManualTarget(id: request.goodwillId)
        if request.transactionId == nil, let transactionId = request.appleTransactionId {
            if let refused = targetNotUploaded(transactionId, request: request, into: &target) { return refused }
        } else if let transactionId = request.transactionId {
            if let refused = targetHeld(transactionId, request: request, into: &target) { return refused }
        } else if facts.grant(ofTransaction: target.id) != nil {
            return .refused(.conflict, "grant \(target.id) exists already")
        }
        if let earlier = facts.grants(of: target.creditKey).first(where: { $0.userId == request.userId }) {
            return regrant(earlier, request: request, target: target)
        }
        var quantity = max(1, request.quantity)
        var granted = request.grant
        if let revocation = facts.revocation, revocation.creditKey == target.creditKey, revocation.standingUnits > 0 {
            // A prorated refund took some units back: the rest is granted.
            quantity = max(quantity - revocation.standingUnits, 1)
            granted = product(request.productId)?.grant(quantity: quantity) ?? granted
        }
        grant(
            transactionId: target.id, originalTransactionId: target.original, creditKey: target.creditKey, userId: request.userId,
            productId: request.productId, orderId: target.orderId, quantity: quantity, grant: granted,
            environment: target.environment, source: .manual, expiresAt: target.expiresAt, periodStart: target.periodStart)
        audit(
            actor: request.actor, action: "grant_manual", subject: "transaction:\(target.id)", reason: request.reason,
            details: ["userId": request.userId, "productId": request.productId, "quantity": "\(quantity)"])
        return .grant(transactionId: target.id)
    }

    /// What a grant by hand grants: goodwill of its own, an Apple purchase not uploaded yet,
    /// or a purchase held here.
    struct ManualTarget {
        var id: String
        var environment = AppStoreEnvironment.production
        var original: String
        var creditKey: CreditKey
        var orderId: String?
        var expiresAt: Date?
        var periodStart: Date?

        init(id: String) {
            self.id = id
            original = id
            creditKey = .transaction(id)
        }
    }

    /// Goodwill for an Apple purchase that has not reached us (the customer wrote before the
    /// app uploaded it): bound to what that purchase credits, so that its upload is
    /// `already_credited`, not a second credit. A subscription's period cannot be known from
    /// its transaction id: those are granted once their purchase is held. The refusal, if any.
    func targetNotUploaded(_ transactionId: String, request: LedgerEvent.ManualGrant, into target: inout ManualTarget) -> LedgerOutcome? {
        guard product(request.productId)?.type != .autoRenewable else {
            return .refused(.conflict, "a subscription period is granted by hand once its purchase is held, not by its transaction id")
        }
        if let recorded = facts.purchase, recorded.transactionId == transactionId {
            return .refused(.conflict, "purchase \(transactionId) is recorded: grant it as a held purchase, or it is credited already")
        }
        target.id = transactionId
        target.original = request.applePurchase.originalTransactionId
        target.environment = request.applePurchase.environment
        target.creditKey = policy.creditKey(of: request.applePurchase)
        if let revocation = facts.revocation, revocation.creditKey == target.creditKey, revocation.standsFully {
            return .refused(.conflict, "Apple refunded or revoked purchase \(transactionId)")
        }
        guard facts.activeGrant(of: target.creditKey) == nil, facts.grant(ofTransaction: transactionId) == nil else {
            return .refused(.conflict, "what purchase \(transactionId) buys is granted already")
        }
        return nil
    }

    /// A purchase held here, granted by hand: the user's own, or a period Apple told of before
    /// anyone owned its subscription (nobody's yet: customer service may give it to the user
    /// they found paid for it). The refusal, if any.
    mutating func targetHeld(_ transactionId: String, request: LedgerEvent.ManualGrant, into target: inout ManualTarget) -> LedgerOutcome? {
        guard let purchase = facts.purchase, purchase.transactionId == transactionId else {
            return .refused(.notFound, "no purchase \(transactionId)")
        }
        let unowned = purchase.isUnowned
        guard purchase.userId == request.userId || unowned else {
            return .refused(.conflict, "purchase \(transactionId) belongs to another user")
        }
        guard facts.grant(ofTransaction: transactionId) == nil else {
            return .refused(.conflict, "purchase \(transactionId) is granted already")
        }
        target.id = transactionId
        target.creditKey = purchase.creditKey ?? .transaction(transactionId)
        if let revocation = facts.revocation, revocation.creditKey == target.creditKey, revocation.standsFully {
            return .refused(.conflict, "Apple refunded or revoked purchase \(transactionId)")
        }
        guard facts.activeGrant(of: target.creditKey) == nil else {
            return .refused(.conflict, "what purchase \(transactionId) buys is granted already")
        }
        target.original = purchase.originalTransactionId
        target.environment = purchase.environment
        target.orderId = purchase.orderId
        if case .billingPeriod = target.creditKey {
            // A subscription period granted by hand ends with the period Apple sold (or where
            // a plan change replaced it), and makes its subscription the user's (if nobody
            // owned it yet).
            let period = recorded(purchase)
            let ends = replacedTiers(by: period, key: target.creditKey)
            target.expiresAt = ends.own ?? purchase.expiresDate
            target.periodStart = purchase.purchaseDate
            recordSubscription(of: period, owner: request.userId)
            endReplaced(ends.others, by: period)
        }
        if unowned {
            var claimed = purchase
            claimed.userId = request.userId
            claimed.heldReason = nil
            emit(.claimPurchase(claimed))
        } else {
            emit(.releasePurchase(transactionId: transactionId))
        }
        return nil
    }

    /// The user held it before and it was taken back: customer service gives it again.
    mutating func regrant(_ earlier: Grant, request: LedgerEvent.ManualGrant, target: ManualTarget) -> LedgerOutcome {
        emit(.reactivateGrant(transactionId: earlier.transactionId))
        publish(
            "grant.created",
            [
                "transactionId": .string(earlier.transactionId), "originalTransactionId": .string(target.original),
                "userId": .string(request.userId), "productId": .string(earlier.productId), "orderId": .null,
                "quantity": .int(earlier.quantity), "grant": .json(earlier.grantJSON), "environment": .string(earlier.environment),
                "source": .string("manual"), "grantedAt": .string(nowText),
            ], id: "grant.created:\(earlier.transactionId):manual:\(request.goodwillId)")
        audit(
            actor: request.actor, action: "grant_manual", subject: "transaction:\(target.id)", reason: request.reason,
            details: ["userId": request.userId, "productId": request.productId, "regranted": earlier.transactionId])
        return .grant(transactionId: earlier.transactionId)
    }

    /// Binds a subscription to `userId` by hand (its token at Apple now names their order
    /// `orderId`): the subscription is theirs from now on, so its next renewals, restores and
    /// refunds follow them; the periods credited before stay with whom they were credited to.
    /// Refused for a chain that is no subscription of this store. Audited.
    mutating func bindByHand(
        _ originalTransactionId: String, to userId: String, orderId: String, actor: String, reason: String
    ) -> LedgerOutcome {
        guard var subscription = facts.subscription, subscription.originalTransactionId == originalTransactionId else {
            return .refused(.notFound, "no subscription \(originalTransactionId) in this store")
        }
        let from = subscription.userId
        if let from, sameUser(from, userId) {
            return .refused(.conflict, "subscription \(originalTransactionId) is \(userId)'s already")
        }
        subscription.userId = userId
        subscription.ownedSince = now
        subscription.updatedAt = now
        emit(.putSubscription(subscription))
        audit(
            actor: actor, action: "purchase_bound", subject: "subscription:\(originalTransactionId)", reason: reason,
            details: ["from": from ?? "", "to": userId, "appAccountToken": orderId])
        return .bound(originalTransactionId: originalTransactionId)
    }

    /// Takes a grant back by hand (refund, fraud): its order refunded, `grant.revoked`. Audited.
    mutating func revokeByHand(_ transactionId: String, actor: String, reason: String, tag: String) -> LedgerOutcome {
        guard let grant = facts.grant(ofTransaction: transactionId) else {
            return .refused(.notFound, "no grant for \(transactionId)")
        }
        guard grant.isActive else { return .refused(.conflict, "the grant for \(transactionId) is revoked already") }
        revokeGrant(
            grant, actor: Ledger.reservedActors.contains(actor) ? "admin:\(actor)" : actor, reason: reason,
            eventId: "grant.revoked:\(transactionId):admin:\(tag)")
        return .grant(transactionId: transactionId)
    }
}
