import Foundation
public import Hummingbird
public import Logging
import NIOConcurrencyHelpers
import NIOCore
import SwiftASN1
import X509

/// A local stand-in for Apple: it mints purchases and answers `verifyReceipt` and the App Store
/// Server API with Apple's JSON shapes and id semantics, with injectable latency and faults.
/// Used by tests, benchmarks and `iap dev`; never for production.
///
/// Receipts are real app receipts: DER PKCS#7 `SignedData` around Apple's ASN.1 payload,
/// signed by the fake's own certificate chain (kept in its file, so a restarted fake keeps
/// its identity). Ids follow Apple's: a restore gets a new transaction id with the original
/// transaction id and web order line item id of what it restores; a renewal a new transaction
/// id and a new web order line item id in the same chain.
///
/// Routes (bodies and answers are JSON; errors of `/fake/` routes are `{"error": {"message"}}`):
/// - `POST /fake/purchases` `{"bundleId", "productId", "environment"?: "Production"|"Sandbox",
///   "type"?: "consumable"|"non_consumable"|"auto_renewable"|"non_renewing", "quantity"?,
///   "deviceId"?, "appAccountToken"? (a UUID), "applicationUsername"?, "expiresInSeconds"?,
///   "inAppOwnershipType"? (`ASSIGNED`: a multiseat seat, auto-renewable only, `quantity` seats),
///   "groupId"? (the group the purchase's account joins: its `ADMIN` for a purchase, a member for
///   an assigned seat, which joins Apple's sandbox placeholder group `900000000000000000` unless
///   named),
///   "price"? (milli-units, default 990), "currency"? (default USD), "offerType"?, "offerIdentifier"?,
///   "offerDiscountType"?, "offerPeriod"?, "billingPlanType"? (as the signed transactions say),
///   "previousOriginalTransactionId"? (a migrated subscription: the chain it continues; a
///   MIGRATION notification tells of it), "commitmentTotalPeriods"?, "commitmentBillingPeriod"?,
///   "commitmentPrice"? (a commitment plan: its transactions' and renewal info's `commitmentInfo`),
///   "familyShared"? (non-consumables and subscriptions only), "receiptIncludesPurchase"?
///   (default true; false answers the device's receipt from before the purchase)}` → 201
///   `{"transactionId", "originalTransactionId", "webOrderLineItemId"? (subscriptions),
///   "receiptData" (the device's new receipt, base64), "signedTransaction" (JWS), "orderId" (the
///   invoice's), "deviceId"}`. A one-time purchase (not `auto_renewable`) sends ONE_TIME_CHARGE,
///   as Apple does since May 2025.
/// - `POST /fake/devices/{deviceId}/receipt` → `{"receiptData"}`: the device's refreshed
///   receipt, holding everything it bought; 404 for a device that bought nothing.
/// - `POST /fake/purchases/{transactionId}/restore` `{"deviceId"?, "inReceipt"?}` (body optional;
///   a new device when absent) → 201 in the same shape: a new transaction id, the same original
///   transaction id, web order line item id, product and expiry; 404 unknown, 409 a consumable
///   or a refunded purchase. With `"inReceipt": false` the new id is one StoreKit 1 hands the
///   app but no receipt holds: the device's receipt lists the restored transaction instead.
/// - `POST /fake/purchases/{transactionId}/finish` → `{"transactionId", "finishedDateMs",
///   "leavesReceipt"}`: the app's `finishTransaction`. A finished consumable leaves every
///   receipt its device is issued afterwards (and their `verifyReceipt` answers); other
///   purchases stay. Idempotent; 404 unknown. `GET` on the same path → `{"transactionId",
///   "finishedDateMs"? (absent while unfinished), "serverFinishCalls"}`: how it was finished,
///   and how many Finish Transaction calls of the Server API named it.
/// - `POST /fake/subscriptions/{originalTransactionId}/renew` → 201 in the same shape: the next
///   billing period (new transaction and web order line item ids, `transactionReason` RENEWAL)
///   on the device of the chain's latest transaction, whose receipt holds the whole chain;
///   sends DID_RENEW (BILLING_RECOVERY while Apple retries a failed renewal). 404 unknown
///   chain, 409 not auto-renewable or lapsed (that is `/resubscribe`).
/// - `POST /fake/subscriptions/{originalTransactionId}/resubscribe` `{"deviceId"?,
///   "appAccountToken"?, "productId"?, "expiresInSeconds"?}` (body optional) → 201 in the same
///   shape: a lapsed chain bought again, a new period from now in the same chain
///   (`transactionReason` PURCHASE), on `deviceId` when given (another account of the same
///   Apple ID); sends SUBSCRIBED (RESUBSCRIBE). 404 unknown chain, 409 not auto-renewable, a
///   period in force or a renewal being retried.
/// - `POST /fake/subscriptions/{originalTransactionId}/fail-renewal` `{"gracePeriodSeconds"?}`
///   (body optional) → `{"originalTransactionId", "transactionId", "notificationType", "subtype",
///   "status", "gracePeriodExpiresDateMs"?}`: the period in force ends now and Apple's billing
///   retry opens (status 3; 4 during the grace period); renewal info and `pending_renewal_info`
///   say so; sends DID_FAIL_TO_RENEW (GRACE_PERIOD with a grace period). 409 lapsed or failing.
/// - `POST /fake/subscriptions/{originalTransactionId}/expire` → the same shape: EXPIRED,
///   BILLING_RETRY when a retry was open, else VOLUNTARY (the period in force ends now,
///   auto-renew off). 409 when it already expired.
/// - `POST /fake/subscriptions/{originalTransactionId}/price-increase` `{"price", "consent":
///   "pending"|"accepted"}` → the same shape: PRICE_INCREASE (PENDING, or ACCEPTED once the
///   customer consented); the renewal info's `renewalPrice` and `priceIncreaseStatus` say it
///   from then on. 409 with no period in force.
/// - `POST /fake/subscriptions/{originalTransactionId}/upgrade` `{"productId",
///   "expiresInSeconds"?, "appAccountToken"?}` → 201 in the same shape: an upgrade within the
///   group, at once (a new period of `productId` in the same chain, `transactionReason`
///   PURCHASE, with the token it was bought with; the period it replaces is marked
///   `isUpgraded`, `is_upgraded`); sends DID_CHANGE_RENEWAL_PREF (UPGRADE). 404 unknown chain,
///   409 not auto-renewable or already on that product.
/// - `POST /fake/subscriptions/{originalTransactionId}/extend` `{"days"}` (1 to 90) →
///   `{"originalTransactionId", "transactionId", "expiresDateMs", "notificationType"}`: the
///   period in force ends `days` later; sends RENEWAL_EXTENDED. 409 when no period is in force.
/// - `POST /fake/notifications/hold` → 204: from now on every notification (renewals, refunds,
///   `/notify`, resends, all of them) waits, keeping the `signedDate` it was signed with.
///   `POST /fake/notifications/release` `{"order"?: "signed"|"reverse"|"shuffle", "seed"?,
///   "duplicate"?}` (body optional; `signed` by default) ends the hold and delivers what waited
///   in that order (each twice with `duplicate`) → `{"order", "released": [{"notificationType",
///   "transactionId", "signedDate", "results"}]}`.
/// - `POST /fake/purchases/{transactionId}/cancel` → `{"transactionId", "cancellationDateMs",
///   "revokedTransactionIds"}`: refunds as Apple does (a non-consumable or non-renewing
///   subscription with every transaction of its original transaction id, a subscription period
///   with every transaction of its web order line item id, a consumable alone);
///   `.../refund` `{"revocationType"?, "revocationPercentage"?}` (body optional) does the same
///   and sends REFUND (`"notificationType"` in the answer): REFUND_FULL by default;
///   REFUND_PRORATED with `revocationPercentage` (milli-units of 100 %) refunds a share and may
///   follow another prorated refund; ASSIGNMENT_REVOKE (an `ASSIGNED` seat only, which nothing
///   else takes back) ends an assigned seat and sends REVOKE, no money moving; FAMILY_REVOKE ends a family member's access and sends
///   REVOKE. The signed transaction then carries `revocationType` and `revocationPercentage`.
/// - `POST /fake/purchases/{transactionId}/notify` `{"notificationType", "subtype"?,
///   "consumptionRequestReason"?}` → `{"transactionId", "notificationType"}`: sends any
///   notification; REFUND_REVERSED first undoes the refund of the same set.
/// - `GET /fake/consumption/{transactionId}`: the consumption information received for it (the
///   last body; `?all=true`: every body received, oldest first, as an array).
/// - `POST /fake/faults` `{"status"?, "httpStatus"?, "delayMs"?, "count"?, "transactionId"?,
///   "retryable"?}` → 204 injects a misbehaviour (`count` 0: until cleared); one scoped to a
///   transaction reaches the `verifyReceipt` answers holding it and the Server API's Finish
///   Transaction calls naming it. `DELETE /fake/faults` → 204 clears them.
/// - `POST /fake/config` `{"latencyMs"?, "errorRate"?, "notificationURL"?, "oneTimeCharge"?}` →
///   204 (`oneTimeCharge` false: one-time purchases send no ONE_TIME_CHARGE).
/// - `GET /fake/stats` → `{"verifyReceiptCalls", "serverAPICalls"}`; `GET /fake/root-certificate`
///   → the root (DER); `GET /healthz`.
/// - `POST /verifyReceipt`, `POST /sandbox/verifyReceipt`: Apple's `verifyReceipt`; like
///   Apple's, its `in_app` leaves out consumables and non-consumables refunded in full or
///   revoked, and keeps refunded subscription periods with their `cancellation_date`.
/// - `POST /fake/external-purchase-tokens` `{"bundleId", "environment"?, "tokenType"?}` → sends
///   `EXTERNAL_PURCHASE_TOKEN` (`UNREPORTED`), about a purchase made outside the App Store.
/// - With an API key, the App Store Server API under `/inApps` (production) and
///   `/sandbox/inApps`: Get Transaction Info, Get Transaction History (v1 and v2 alike, with
///   Apple's filters), Get Refund History v2,
///   Look Up Order ID, Get All Subscription Statuses, Get
///   Notification History, Request a Test Notification, Send Consumption Information, Finish
///   Transaction (the state `/fake/purchases/{transactionId}/finish` sets), Set App Account Token,
///   Get App Transaction Info (every signed transaction names its customer's `appTransactionId`);
///   and under `/groups` (`/sandbox/groups`) Get Customer Groups and Get Group Members (API
///   1.22: every group is an `ORGANIZATION`; an `ASSIGNMENT_REVOKE` takes the seat's holder out).
public struct FakeAppStore: Sendable {
    /// The longest period or grace period a request may ask for: ten years, in seconds.
    static let maxLengthSeconds = 10 * 366 * 86_400
    let ledger: FakeLedger
    let minter: ReceiptMinter
    let storeKit: FakeStoreKit
    /// Where notifications go (App Store Server Notifications V2); also set by `POST /fake/config`.
    private let notificationURL: NIOLockedValueBox<String?>

    /// The fake's App Store app id, in its notifications and Server API answers.
    public static let defaultAppAppleId: Int64 = 1_234_567_890
    /// The group Apple's sandbox answers for assigned seats (Get Customer Groups).
    public static let sandboxGroupId = "900000000000000000"

    /// Creates a fake that remembers what it minted, and its signing identity, in the SQLite
    /// file at `databasePath` (in memory when nil). With `apiKey` it serves the App Store
    /// Server API (production under `/inApps`, sandbox under `/sandbox/inApps`) to callers
    /// whose bearer token that key verifies; notifications go to `notificationURL`.
    public init(
        databasePath: String? = nil, apiKey: FakeServerAPIKey? = nil, notificationURL: String? = nil,
        appAppleId: Int64 = defaultAppAppleId
    ) throws {
        ledger = try FakeLedger(path: databasePath)
        let bundle = try ledger.identity("certificate-authority") {
            Array(try FakeCertificateAuthority.generate().pemBundle().utf8)
        }
        let authority = try FakeCertificateAuthority(pemBundle: String(decoding: bundle, as: UTF8.self))
        minter = ReceiptMinter(authority: authority)
        let notificationURL = NIOLockedValueBox(notificationURL)
        storeKit = FakeStoreKit(
            ledger: ledger, authority: authority, apiKey: apiKey, appAppleId: appAppleId, notificationURL: notificationURL)
        self.notificationURL = notificationURL
    }

    /// The root certificate the fake's receipts chain up to, as DER.
    public func rootCertificateDER() throws -> [UInt8] {
        var serializer = DER.Serializer()
        try serializer.serialize(minter.authority.root)
        return serializer.serializedBytes
    }

    /// The routes.
    public func makeRouter() -> Router<BasicRequestContext> {
        let router = Router()
        router.get("/healthz") { _, _ in "ok" }
        router.get("/fake/root-certificate") { _, _ in
            Response(
                status: .ok, headers: [.contentType: "application/pkix-cert"],
                body: .init(byteBuffer: ByteBuffer(bytes: try rootCertificateDER())))
        }
        addPurchasesRoutes(to: router)
        addDevicesRoutes(to: router)
        addSubscriptionsRoutes(to: router)
        addNotificationsRoutes(to: router)
        addFaultsRoutes(to: router)
        addAppleRoutes(to: router)
        return router
    }

    /// `/fake/purchases`: minting, and what happens to a purchase afterwards (cancel, refund,
    /// decline a refund, restore, finish).
    private func addPurchasesRoutes(to router: Router<BasicRequestContext>) {
        router.post("/fake/purchases") { request, context in
            try await mintPurchase(request, context: context)
        }
        router.post("/fake/purchases/{transactionId}/cancel") { _, context in
            let id = try context.parameters.require("transactionId")
            guard let refund = try ledger.cancel(transactionId: id) else {
                throw HTTPError(.notFound, message: "no purchase \(id)")
            }
            return try json(
                RefundAnswer(
                    transactionId: id, cancellationDateMs: String(Self.milliseconds(refund.date)),
                    revokedTransactionIds: refund.revoked))
        }
        router.post("/fake/purchases/{transactionId}/refund") { request, context in
            // A refund as Apple makes it: the purchase is revoked and a REFUND notification sent
            // (REVOKE for a family member's access); a prorated one refunds a share.
            let id = try context.parameters.require("transactionId")
            let ask = try await Self.body(of: request, or: RefundRequest())
            let type = ask.revocationType ?? "REFUND_FULL"
            switch type {
            case "REFUND_FULL", "FAMILY_REVOKE", "ASSIGNMENT_REVOKE":
                guard ask.revocationPercentage == nil else {
                    throw HTTPError(.badRequest, message: "revocationPercentage goes with REFUND_PRORATED only")
                }
            case "REFUND_PRORATED":
                guard let percentage = ask.revocationPercentage, (1...100_000).contains(percentage) else {
                    throw HTTPError(.badRequest, message: "REFUND_PRORATED needs revocationPercentage in 1...100000 (milli-units of 100 %)")
                }
            default:
                throw HTTPError(
                    .badRequest, message: "revocationType is REFUND_FULL, REFUND_PRORATED, FAMILY_REVOKE or ASSIGNMENT_REVOKE")
            }
            // The purchaser takes an assigned seat back (multiseat): only an assigned one.
            if let known = try ledger.purchase(transactionId: id),
                (type == "ASSIGNMENT_REVOKE") != (known.inAppOwnershipType == "ASSIGNED")
            {
                throw HTTPError(
                    .conflict,
                    message: type == "ASSIGNMENT_REVOKE"
                        ? "ASSIGNMENT_REVOKE takes back an assigned seat; \(id) is not one"
                        : "an assigned seat is taken back with ASSIGNMENT_REVOKE, never refunded")
            }
            guard let refund = try ledger.cancel(transactionId: id, type: type, percentage: ask.revocationPercentage),
                let purchase = try ledger.purchase(transactionId: id)
            else {
                throw HTTPError(.notFound, message: "no purchase \(id)")
            }
            let notificationType = ["FAMILY_REVOKE", "ASSIGNMENT_REVOKE"].contains(type) ? "REVOKE" : "REFUND"
            try await notify(notificationType, subtype: nil, purchase: purchase)
            return try json(
                RefundAnswer(
                    transactionId: id, cancellationDateMs: String(Self.milliseconds(refund.date)),
                    revokedTransactionIds: refund.revoked, notificationType: notificationType,
                    revocationType: purchase.revocationType, revocationPercentage: purchase.revocationPercentage))
        }
        router.post("/fake/purchases/{transactionId}/decline-refund") { _, context in
            // The customer asked for a refund and Apple said no: REFUND_DECLINED, the purchase unchanged.
            let id = try context.parameters.require("transactionId")
            guard let purchase = try ledger.purchase(transactionId: id) else {
                throw HTTPError(.notFound, message: "no purchase \(id)")
            }
            try await notify("REFUND_DECLINED", subtype: nil, purchase: purchase)
            return try json(["transactionId": id, "notificationType": "REFUND_DECLINED"])
        }
        router.post("/fake/purchases/{transactionId}/restore") { request, context in
            let id = try context.parameters.require("transactionId")
            let ask = try await Self.body(of: request, or: RestoreRequest())
            let restored = try ledger.restore(
                transactionId: id, deviceId: ask.deviceId, inReceipt: ask.inReceipt ?? true, encode: encodeReceipt)
            return try minted(try refused(restored, id: id))
        }
        router.post("/fake/purchases/{transactionId}/finish") { _, context in
            // The app's finishTransaction: a finished consumable leaves the device's later receipts.
            let id = try context.parameters.require("transactionId")
            guard let purchase = try ledger.finish(transactionId: id) else {
                throw HTTPError(.notFound, message: "no purchase \(id)")
            }
            return try json(
                FinishAnswer(
                    transactionId: id, finishedDateMs: String(Self.milliseconds(purchase.finishedDate ?? Date())),
                    leavesReceipt: purchase.type == "consumable"))
        }
        router.get("/fake/purchases/{transactionId}/finish") { _, context in
            // How a transaction was finished: when, and how many Finish Transaction calls named it.
            let id = try context.parameters.require("transactionId")
            guard let record = try ledger.finishRecord(transactionId: id) else {
                throw HTTPError(.notFound, message: "no purchase \(id)")
            }
            return try json(
                FinishRecord(
                    transactionId: id, finishedDateMs: record.finishedDate.map { String(Self.milliseconds($0)) },
                    serverFinishCalls: record.serverCalls))
        }
    }

    /// `/fake/devices`: a device's receipt, refreshed.
    private func addDevicesRoutes(to router: Router<BasicRequestContext>) {
        router.post("/fake/devices/{deviceId}/receipt") { _, context in
            try self.refreshedReceipt(deviceId: try context.parameters.require("deviceId"))
        }
        router.get("/fake/devices/{deviceId}/transactions") { _, context in
            // What StoreKit on the device holds: each purchase signed as `Transaction` hands it
            // over, and whether the app finished it (`Transaction.unfinished` is those not).
            let purchases = try ledger.purchases(deviceId: try context.parameters.require("deviceId"))
            return try json(
                DeviceTransactions(
                    transactions: try purchases.map { purchase in
                        DeviceTransaction(
                            transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId,
                            productId: purchase.productId, type: purchase.type,
                            purchaseDateMs: String(Self.milliseconds(purchase.purchaseDate)),
                            finishedDateMs: purchase.finishedDate.map { String(Self.milliseconds($0)) },
                            revoked: purchase.cancellationDate != nil, signedTransaction: try storeKit.signedTransaction(purchase))
                    }),
                status: .ok)
        }
    }

    /// `/fake/subscriptions`: a chain's renewals, resubscriptions, renewal trouble, expiry,
    /// upgrades and extensions.
    private func addSubscriptionsRoutes(to router: Router<BasicRequestContext>) {
        router.post("/fake/subscriptions/{originalTransactionId}/renew") { _, context in
            // The next period; while Apple retries a failed renewal, its recovery.
            let id = try context.parameters.require("originalTransactionId")
            let renewal = try refused(try ledger.renew(originalTransactionId: id, encode: encodeReceipt), id: id)
            try await notify("DID_RENEW", subtype: renewal.billingRecovery ? "BILLING_RECOVERY" : nil, purchase: renewal.0)
            return try minted((renewal.0, renewal.1))
        }
        router.post("/fake/subscriptions/{originalTransactionId}/resubscribe") { request, context in
            // A lapsed chain bought again, perhaps by another account of the same Apple ID:
            // SUBSCRIBED (RESUBSCRIBE) about the new period.
            let id = try context.parameters.require("originalTransactionId")
            let ask = try await Self.body(of: request, or: ResubscribeRequest())
            if let seconds = ask.expiresInSeconds, seconds <= 0 || seconds > Self.maxLengthSeconds {
                throw HTTPError(.badRequest, message: "expiresInSeconds must be from 1 to \(Self.maxLengthSeconds)")
            }
            if ask.productId?.isEmpty == true { throw HTTPError(.badRequest, message: "productId must not be empty") }
            let token = try Self.accountToken(ask.appAccountToken)
            let period = try refused(
                try ledger.resubscribe(
                    originalTransactionId: id, deviceId: ask.deviceId, appAccountToken: token, productId: ask.productId,
                    length: ask.expiresInSeconds.map(TimeInterval.init), encode: encodeReceipt),
                id: id)
            try await notify("SUBSCRIBED", subtype: "RESUBSCRIBE", purchase: period.0)
            return try minted(period)
        }
        router.post("/fake/subscriptions/{originalTransactionId}/fail-renewal") { request, context in
            // Apple cannot charge the renewal: DID_FAIL_TO_RENEW, GRACE_PERIOD when there is one.
            let id = try context.parameters.require("originalTransactionId")
            let ask = try await Self.body(of: request, or: FailRenewalRequest())
            if let seconds = ask.gracePeriodSeconds, seconds <= 0 || seconds > Self.maxLengthSeconds {
                throw HTTPError(.badRequest, message: "gracePeriodSeconds must be from 1 to \(Self.maxLengthSeconds)")
            }
            let (latest, state) = try refused(
                try ledger.failRenewal(originalTransactionId: id, gracePeriod: ask.gracePeriodSeconds.map(TimeInterval.init)), id: id)
            let subtype = state.gracePeriodExpiresDate == nil ? nil : "GRACE_PERIOD"
            try await notify("DID_FAIL_TO_RENEW", subtype: subtype, purchase: latest)
            return try json(
                RenewalTroubleAnswer(
                    originalTransactionId: id, transactionId: latest.transactionId, notificationType: "DID_FAIL_TO_RENEW",
                    subtype: subtype, status: FakeStoreKit.status(of: latest, state: state),
                    gracePeriodExpiresDateMs: state.gracePeriodExpiresDate.map { String(Self.milliseconds($0)) }))
        }
        router.post("/fake/subscriptions/{originalTransactionId}/price-increase") { request, context in
            // Apple raises the price of the next periods: PRICE_INCREASE, PENDING while the
            // customer's consent is awaited, ACCEPTED once given (post again with "accepted").
            let id = try context.parameters.require("originalTransactionId")
            let ask = try await Self.body(of: request, or: PriceIncreaseRequest())
            guard (1...1_000_000_000).contains(ask.price ?? 0) else {
                throw HTTPError(.badRequest, message: "price is the next period's price in milli-units, from 1 to 1000000000")
            }
            guard let consent = ask.consent, ["pending", "accepted"].contains(consent) else {
                throw HTTPError(.badRequest, message: "consent is pending or accepted")
            }
            let (latest, state) = try refused(
                try ledger.raisePrice(originalTransactionId: id, price: Int64(ask.price ?? 0), consented: consent == "accepted"), id: id)
            let subtype = consent == "accepted" ? "ACCEPTED" : "PENDING"
            try await notify("PRICE_INCREASE", subtype: subtype, purchase: latest)
            return try json(
                RenewalTroubleAnswer(
                    originalTransactionId: id, transactionId: latest.transactionId, notificationType: "PRICE_INCREASE",
                    subtype: subtype, status: FakeStoreKit.status(of: latest, state: state)))
        }
        router.post("/fake/subscriptions/{originalTransactionId}/expire") { _, context in
            // EXPIRED: BILLING_RETRY when Apple gave up a failed renewal, VOLUNTARY otherwise.
            let id = try context.parameters.require("originalTransactionId")
            let (latest, subtype, state) = try refused(try ledger.expire(originalTransactionId: id), id: id)
            try await notify("EXPIRED", subtype: subtype, purchase: latest)
            return try json(
                RenewalTroubleAnswer(
                    originalTransactionId: id, transactionId: latest.transactionId, notificationType: "EXPIRED",
                    subtype: subtype, status: FakeStoreKit.status(of: latest, state: state)))
        }
        router.post("/fake/subscriptions/{originalTransactionId}/upgrade") { request, context in
            // An upgrade within the subscription group, at once: a new period of the higher tier
            // in the same chain; DID_CHANGE_RENEWAL_PREF (UPGRADE) about it.
            let id = try context.parameters.require("originalTransactionId")
            let ask = try await request.decode(as: UpgradeRequest.self, context: context)
            guard !ask.productId.isEmpty else { throw HTTPError(.badRequest, message: "productId must not be empty") }
            if let seconds = ask.expiresInSeconds, seconds <= 0 || seconds > Self.maxLengthSeconds {
                throw HTTPError(.badRequest, message: "expiresInSeconds must be from 1 to \(Self.maxLengthSeconds)")
            }
            let upgrade = try refused(
                try ledger.upgrade(
                    originalTransactionId: id, to: ask.productId, length: ask.expiresInSeconds.map(TimeInterval.init),
                    appAccountToken: try Self.accountToken(ask.appAccountToken), encode: encodeReceipt),
                id: id)
            try await notify("DID_CHANGE_RENEWAL_PREF", subtype: "UPGRADE", purchase: upgrade.0)
            return try minted(upgrade)
        }
        router.post("/fake/subscriptions/{originalTransactionId}/extend") { request, context in
            // Apple's Extend a Subscription Renewal Date: the period in force ends `days` later;
            // RENEWAL_EXTENDED about it.
            let id = try context.parameters.require("originalTransactionId")
            let ask = try await request.decode(as: ExtendRequest.self, context: context)
            guard (1...90).contains(ask.days) else {
                throw HTTPError(.badRequest, message: "days must be 1 to 90, as Apple's extendByDays")
            }
            let period = try refused(try ledger.extend(originalTransactionId: id, days: ask.days), id: id)
            try await notify("RENEWAL_EXTENDED", subtype: nil, purchase: period)
            return try json(
                ExtendAnswer(
                    originalTransactionId: id, transactionId: period.transactionId,
                    expiresDateMs: period.expiresDate.map { String(Self.milliseconds($0)) } ?? "",
                    notificationType: "RENEWAL_EXTENDED"))
        }
    }

    /// What Apple tells the developer's server: held and released notifications, a purchase's
    /// notification sent (again), consent rescinded, and the consumption answers received.
    private func addNotificationsRoutes(to router: Router<BasicRequestContext>) {
        router.post("/fake/notifications/hold") { _, _ in
            // From now on every notification waits for /fake/notifications/release.
            ledger.hold()
            return HTTPResponse.Status.noContent
        }
        router.post("/fake/notifications/release") { request, _ in
            try await release(try await Self.body(of: request, or: ReleaseRequest()))
        }
        router.post("/fake/purchases/{transactionId}/notify") { request, context in
            // Any notification about a purchase: {"notificationType", "subtype"?, "consumptionRequestReason"?}.
            let id = try context.parameters.require("transactionId")
            let ask = try await request.decode(as: NotifyRequest.self, context: context)
            let purchase: FakeLedger.Purchase?
            if ask.notificationType == "REFUND_REVERSED" {
                purchase = try ledger.reverseCancel(transactionId: id)
            } else {
                purchase = try ledger.purchase(transactionId: id)
            }
            guard let purchase else { throw HTTPError(.notFound, message: "no purchase \(id)") }
            try await notify(
                ask.notificationType, subtype: ask.subtype, purchase: purchase,
                consumptionRequestReason: ask.consumptionRequestReason)
            return try json(["transactionId": id, "notificationType": ask.notificationType])
        }
        router.post("/fake/purchases/{transactionId}/notify-again") { request, context in
            // The last notification sent about the purchase (of `notificationType`, when given),
            // sent once more byte for byte, as Apple's retries and duplicate deliveries are.
            let id = try context.parameters.require("transactionId")
            let ask = try await Self.body(of: request, or: NotifyAgainRequest())
            guard
                let sent = ledger.notifications.last(where: {
                    $0.transactionId == id && (ask.notificationType == nil || $0.notificationType == ask.notificationType)
                })
            else { throw HTTPError(.notFound, message: "no notification sent about \(id)") }
            let result = await storeKit.resend(
                sent.signedPayload, type: sent.notificationType, transactionId: sent.transactionId, environment: sent.environment,
                to: notificationURL.withLockedValue { $0 })
            return try json(["transactionId": id, "notificationType": sent.notificationType, "sendAttempt": result])
        }
        router.post("/fake/rescind-consent") { request, context in
            // A customer's (or their guardian's) consent withdrawn: RESCIND_CONSENT, about the
            // app rather than a purchase. {"bundleId", "environment"?}.
            let ask = try await request.decode(as: RescindConsentRequest.self, context: context)
            let environment = ask.environment ?? "Production"
            guard ["Production", "Sandbox"].contains(environment) else {
                throw HTTPError(.badRequest, message: "environment must be Production or Sandbox")
            }
            let notification = try storeKit.signedConsentRescinded(bundleId: ask.bundleId, environment: environment)
            await storeKit.send(
                notification.payload, type: "RESCIND_CONSENT", transactionId: nil, environment: environment,
                to: notificationURL.withLockedValue { $0 })
            return try json([
                "notificationType": "RESCIND_CONSENT", "notificationUUID": notification.uuid,
                "appTransactionId": notification.appTransactionId,
            ])
        }
        router.post("/fake/external-purchase-tokens") { request, context in
            // A purchase made outside the App Store whose token the app never reported:
            // EXTERNAL_PURCHASE_TOKEN (UNREPORTED), about no App Store purchase.
            // {"bundleId", "environment"?, "tokenType"? (e.g. CORE_TECHNOLOGY)}.
            let ask = try await request.decode(as: ExternalTokenRequest.self, context: context)
            let environment = ask.environment ?? "Production"
            guard ["Production", "Sandbox"].contains(environment) else {
                throw HTTPError(.badRequest, message: "environment must be Production or Sandbox")
            }
            let notification = try storeKit.signedExternalPurchaseToken(
                bundleId: ask.bundleId, environment: environment, tokenType: ask.tokenType)
            await storeKit.send(
                notification.payload, type: "EXTERNAL_PURCHASE_TOKEN", transactionId: nil, environment: environment,
                to: notificationURL.withLockedValue { $0 })
            return try json([
                "notificationType": "EXTERNAL_PURCHASE_TOKEN", "notificationUUID": notification.uuid,
                "externalPurchaseId": notification.externalPurchaseId, "signedPayload": notification.payload,
            ])
        }
        router.get("/fake/consumption/{transactionId}") { request, context in
            // The last body received; with ?all=true every one, oldest first, as a JSON array.
            let id = try context.parameters.require("transactionId")
            guard let bodies = ledger.consumption[id], let last = bodies.last else {
                throw HTTPError(.notFound, message: "nothing sent for \(id)")
            }
            let text = request.uri.queryParameters["all"] == "true" ? "[" + bodies.joined(separator: ",") + "]" : last
            return Response(
                status: .ok, headers: [.contentType: "application/json"], body: .init(byteBuffer: ByteBuffer(string: text)))
        }
    }

    /// Faults, latency and counters the tests set and read.
    private func addFaultsRoutes(to router: Router<BasicRequestContext>) {
        router.post("/fake/faults") { request, context in
            let fault = try await request.decode(as: FakeLedger.Fault.self, context: context)
            // Numbers from outside are bounded before they are used: a status code HTTP can send,
            // a count and a delay that cannot overflow.
            if let status = fault.httpStatus, !(100...599).contains(status) {
                throw HTTPError(.badRequest, message: "httpStatus must be from 100 to 599")
            }
            if let count = fault.count, count < 0 || count > 1_000_000 {
                throw HTTPError(.badRequest, message: "count must be from 0 to 1000000")
            }
            if let delay = fault.delayMs, delay < 0 || delay > 600_000 {
                throw HTTPError(.badRequest, message: "delayMs must be from 0 to 600000")
            }
            ledger.addFault(fault)
            return HTTPResponse.Status.noContent
        }
        router.delete("/fake/faults") { _, _ in
            ledger.clearFaults()
            return HTTPResponse.Status.noContent
        }
        router.get("/fake/stats") { _, _ in
            try json(["verifyReceiptCalls": ledger.verifyReceiptCalls, "serverAPICalls": ledger.serverAPICalls])
        }
        router.post("/fake/config") { request, context in
            let config = try await request.decode(as: FakeConfig.self, context: context)
            if let latency = config.latencyMs { ledger.setLatency(milliseconds: latency) }
            if let oneTimeCharge = config.oneTimeCharge { ledger.sendsOneTimeCharge = oneTimeCharge }
            if let url = config.notificationURL { notificationURL.withLockedValue { $0 = url.isEmpty ? nil : url } }
            if let rate = config.errorRate { ledger.errorRate = rate }
            return HTTPResponse.Status.noContent
        }
    }

    /// Apple's own endpoints: `verifyReceipt` and the App Store Server API, production and sandbox.
    private func addAppleRoutes(to router: Router<BasicRequestContext>) {
        storeKit.addRoutes(to: router, prefix: "", environment: "Production")
        storeKit.addRoutes(to: router, prefix: "/sandbox", environment: "Sandbox")
        router.post("/verifyReceipt") { request, _ in
            try await verifyReceipt(request, endpoint: "Production")
        }
        router.post("/sandbox/verifyReceipt") { request, _ in
            try await verifyReceipt(request, endpoint: "Sandbox")
        }
    }

    /// Builds the fake as a runnable HTTP application.
    public func makeApplication(
        host: String, port: Int, logger: Logger,
        onServerRunning: @escaping @Sendable (any Channel) async -> Void = { _ in }
    ) -> some ApplicationProtocol {
        Application(
            router: makeRouter(),
            configuration: .init(address: .hostname(host, port: port), serverName: "fake-appstore"),
            onServerRunning: onServerRunning, logger: logger)
    }

    private struct FakeConfig: Decodable {
        var latencyMs: Int?
        /// The share of calls answered with 503, 0 to 1.
        var errorRate: Double?
        var notificationURL: String?
        /// False: one-time purchases send no ONE_TIME_CHARGE (true by default, as Apple).
        var oneTimeCharge: Bool?
    }

    private struct UpgradeRequest: Decodable {
        var productId: String
        /// The new period's length, and the chain's from then on (default: the chain's period).
        var expiresInSeconds: Int?
        /// The token the upgrade was bought with (a UUID); none when absent.
        var appAccountToken: String?
    }

    private struct ResubscribeRequest: Decodable {
        /// The account or device of the same Apple ID that buys it (default: the device of the
        /// chain's latest transaction).
        var deviceId: String?
        /// The token the resubscription was bought with (a UUID); none when absent.
        var appAccountToken: String?
        /// Default: the product of the chain's latest period.
        var productId: String?
        /// The new period's length, and the chain's from then on (default: the chain's period).
        var expiresInSeconds: Int?
    }

    private struct PriceIncreaseRequest: Decodable {
        /// The next period's price in milli-units.
        var price: Int?
        /// `pending` (Apple awaits the customer's consent) or `accepted`.
        var consent: String?
    }

    private struct FailRenewalRequest: Decodable {
        /// The billing grace period's length; none when absent.
        var gracePeriodSeconds: Int?
    }

    private struct FinishRecord: Encodable {
        var transactionId: String
        /// When it was first finished, by the app or the server; absent while unfinished.
        var finishedDateMs: String?
        /// Finish Transaction calls of the App Store Server API that named it.
        var serverFinishCalls: Int
    }

    private struct FinishAnswer: Encodable {
        var transactionId: String
        /// When the transaction was first finished.
        var finishedDateMs: String
        /// True for a consumable: the device's later receipts no longer hold it.
        var leavesReceipt: Bool
    }

    /// What `/fail-renewal` and `/expire` did.
    private struct RenewalTroubleAnswer: Encodable {
        var originalTransactionId: String
        /// The chain's latest transaction, which the notification carries.
        var transactionId: String
        var notificationType: String
        var subtype: String?
        /// Apple's subscription status now: 2 expired, 3 billing retry, 4 grace period.
        var status: Int
        var gracePeriodExpiresDateMs: String?
    }

    /// A request's `appAccountToken`, lowercased; 400 when it is not a UUID.
    private static func accountToken(_ token: String?) throws -> String? {
        guard let token else { return nil }
        guard UUID(uuidString: token) != nil else { throw HTTPError(.badRequest, message: "appAccountToken must be a UUID") }
        return token.lowercased()
    }

    private struct ExtendRequest: Decodable {
        var days: Int
    }

    private struct ExtendAnswer: Encodable {
        var originalTransactionId: String
        var transactionId: String
        var expiresDateMs: String
        var notificationType: String
    }

    private struct ReleaseRequest: Decodable {
        /// `signed` (default: Apple's order), `reverse` or `shuffle`.
        var order: String?
        /// The shuffle's seed: the same seed gives the same order.
        var seed: UInt64?
        /// Deliver each notification twice, as Apple's duplicate deliveries do.
        var duplicate: Bool?
    }

    private struct ReleaseAnswer: Encodable {
        struct Delivered: Encodable {
            var notificationType: String
            var transactionId: String?
            var signedDate: Int64
            /// Each delivery's result, as Get Notification History spells it.
            var results: [String]
        }

        var order: String
        var released: [Delivered]
    }

    /// `POST /fake/notifications/release`: ends the hold and delivers what waited, one at a
    /// time, in the order asked (ties in `signedDate` keep the order they were signed in).
    private func release(_ ask: ReleaseRequest) async throws -> Response {
        let order = ask.order ?? "signed"
        guard ["signed", "reverse", "shuffle"].contains(order) else {
            throw HTTPError(.badRequest, message: "order is signed, reverse or shuffle")
        }
        guard order == "shuffle" || ask.seed == nil else {
            throw HTTPError(.badRequest, message: "seed goes with order shuffle only")
        }
        var waiting = ledger.release().enumerated().sorted { ($0.element.signedDate, $0.offset) < ($1.element.signedDate, $1.offset) }
            .map(\.element)
        switch order {
        case "reverse":
            waiting.reverse()
        case "shuffle":
            var generator = SeededGenerator(seed: ask.seed ?? UInt64.random(in: .min ... .max))
            waiting.shuffle(using: &generator)
        default:
            break
        }
        let url = notificationURL.withLockedValue { $0 }
        var released: [ReleaseAnswer.Delivered] = []
        for notification in waiting {
            var results = [await storeKit.deliver(notification, to: url)]
            if ask.duplicate == true {
                results.append(
                    await storeKit.resend(
                        notification.signedPayload, type: notification.notificationType,
                        transactionId: notification.transactionId, environment: notification.environment, to: url))
            }
            released.append(
                .init(
                    notificationType: notification.notificationType, transactionId: notification.transactionId,
                    signedDate: notification.signedDate, results: results))
        }
        return try json(ReleaseAnswer(order: order, released: released))
    }

    private struct RestoreRequest: Decodable {
        /// The device the purchase is restored on; a new one when absent.
        var deviceId: String?
        /// False: the new transaction id is StoreKit 1's, which no receipt holds; the device's
        /// receipt lists the restored transaction instead. Default true.
        var inReceipt: Bool?
    }

    private struct RefundAnswer: Encodable {
        var transactionId: String
        var cancellationDateMs: String
        /// Every transaction the refund revoked (restores, or the billing period's), oldest first.
        var revokedTransactionIds: [String]
        var notificationType: String?
        var revocationType: String?
        var revocationPercentage: Int?
    }

    private struct RefundRequest: Decodable {
        /// REFUND_FULL (default), REFUND_PRORATED, FAMILY_REVOKE or ASSIGNMENT_REVOKE.
        var revocationType: String?
        /// For REFUND_PRORATED: the share refunded, in milli-units of 100 % (1 of 3 units: 33333).
        var revocationPercentage: Int?
    }

    /// A request's optional JSON body: `empty` when it has none.
    private static func body<Body: Decodable>(of request: Request, or empty: Body) async throws -> Body {
        var request = request
        let body = try await request.collectBody(upTo: 64 * 1024)
        return body.readableBytes == 0 ? empty : try JSONDecoder().decode(Body.self, from: Data(body.readableBytesView))
    }

    private struct ExternalTokenRequest: Decodable {
        var bundleId: String
        var environment: String?
        var tokenType: String?
    }

    private struct RescindConsentRequest: Decodable {
        var bundleId: String
        var environment: String?
    }

    private struct NotifyAgainRequest: Decodable {
        var notificationType: String?
    }

    private struct NotifyRequest: Decodable {
        var notificationType: String
        var subtype: String?
        var consumptionRequestReason: String?
    }

    /// Signs a notification about `purchase` and sends it to the configured URL.
    private func notify(
        _ type: String, subtype: String?, purchase: FakeLedger.Purchase, consumptionRequestReason: String? = nil
    ) async throws {
        let payload = try storeKit.signedNotification(
            type: type, subtype: subtype, purchase: purchase, consumptionRequestReason: consumptionRequestReason)
        await storeKit.send(
            payload, type: type, transactionId: purchase.transactionId, environment: purchase.environment,
            to: notificationURL.withLockedValue { $0 })
    }

    /// `POST /fake/purchases`' body: its fields, and the price and offer (`FakeLedger.Terms`)
    /// read from the same object.
    @dynamicMemberLookup
    private struct MintRequest: Decodable {
        var fields: MintFields
        var terms: FakeLedger.Terms

        init(from decoder: any Decoder) throws {
            fields = try MintFields(from: decoder)
            terms = try FakeLedger.Terms(from: decoder)
        }

        subscript<Value>(dynamicMember path: KeyPath<MintFields, Value>) -> Value { fields[keyPath: path] }
    }

    private struct MintFields: Decodable {
        var bundleId: String
        var productId: String
        var environment: String?
        var applicationUsername: String?
        /// StoreKit 2's token; StoreKit 1's `applicationUsername` becomes one when it is a UUID.
        var appAccountToken: String?
        var quantity: Int?
        var deviceId: String?
        /// `consumable` (default), `non_consumable`, `auto_renewable` or `non_renewing`.
        var type: String?
        /// For `auto_renewable`: seconds until the period ends (default 30 days).
        var expiresInSeconds: Int?
        /// A family member's access to this purchase (`FAMILY_SHARED`); Apple shares only
        /// non-consumables and auto-renewable subscriptions.
        var familyShared: Bool?
        /// `PURCHASED` (default), `FAMILY_SHARED` (as `familyShared`) or `ASSIGNED`: a seat of
        /// a multiseat subscription an organization assigned (auto-renewable only; `quantity` is
        /// the purchase's seats).
        var inAppOwnershipType: String?
        /// False: the receipt answered is the device's from before this purchase (stale).
        var receiptIncludesPurchase: Bool?
        /// The group (Apple's numeric id) the purchase puts its account in: the organization
        /// that bought seats (its `ADMIN`) or the one that assigned this seat (a member with no
        /// role). An `ASSIGNED` seat names none: Apple's sandbox placeholder group.
        var groupId: String?
    }

    /// `GET /fake/devices/{deviceId}/transactions`.
    private struct DeviceTransactions: Encodable {
        var transactions: [DeviceTransaction]
    }

    private struct DeviceTransaction: Encodable {
        var transactionId: String
        var originalTransactionId: String
        var productId: String
        var type: String
        var purchaseDateMs: String
        /// When the app finished it; absent while it is unfinished.
        var finishedDateMs: String?
        var revoked: Bool
        var signedTransaction: String
    }

    private struct MintResponse: Encodable {
        var transactionId: String
        var originalTransactionId: String
        var receiptData: String
        /// The purchase as StoreKit 2 hands it to the app: a JWS signed like Apple's.
        var signedTransaction: String
        /// Apple's invoice order id (what the user sees on the receipt email).
        var orderId: String
        var deviceId: String
        /// A subscription's billing period (the same for a restore of that period).
        var webOrderLineItemId: String?
    }

    private func mintPurchase(_ request: Request, context: BasicRequestContext) async throws -> Response {
        let mint = try await request.decode(as: MintRequest.self, context: context)
        let environment = mint.environment ?? "Production"
        guard environment == "Production" || environment == "Sandbox" else {
            throw HTTPError(.badRequest, message: "environment must be Production or Sandbox")
        }
        let type = mint.type ?? "consumable"
        guard ["consumable", "non_consumable", "auto_renewable", "non_renewing"].contains(type) else {
            throw HTTPError(.badRequest, message: "type must be consumable, non_consumable, auto_renewable or non_renewing")
        }
        let ownership = mint.inAppOwnershipType ?? (mint.familyShared == true ? "FAMILY_SHARED" : "PURCHASED")
        guard ["PURCHASED", "FAMILY_SHARED", "ASSIGNED"].contains(ownership) else {
            throw HTTPError(.badRequest, message: "inAppOwnershipType is PURCHASED, FAMILY_SHARED or ASSIGNED")
        }
        let familyShared = ownership == "FAMILY_SHARED"
        guard !familyShared || type == "non_consumable" || type == "auto_renewable" else {
            throw HTTPError(.badRequest, message: "familyShared is only for non_consumable and auto_renewable purchases")
        }
        guard ownership != "ASSIGNED" || type == "auto_renewable" else {
            throw HTTPError(.badRequest, message: "ASSIGNED (a multiseat seat) is only for auto_renewable purchases")
        }
        if let previous = mint.terms.previousOriginalTransactionId {
            guard type == "auto_renewable", let chain = try ledger.purchase(transactionId: previous), chain.type == "auto_renewable",
                chain.originalTransactionId == previous
            else {
                throw HTTPError(.badRequest, message: "previousOriginalTransactionId names an auto-renewable chain, for an auto_renewable purchase")
            }
        }
        if let token = mint.appAccountToken, UUID(uuidString: token) == nil {
            throw HTTPError(.badRequest, message: "appAccountToken must be a UUID")
        }
        if let seconds = mint.expiresInSeconds, seconds <= 0 || seconds > Self.maxLengthSeconds {
            throw HTTPError(.badRequest, message: "expiresInSeconds must be from 1 to \(Self.maxLengthSeconds)")
        }
        if let quantity = mint.quantity, !(1...10_000).contains(quantity) {
            throw HTTPError(.badRequest, message: "quantity must be from 1 to 10000 (units, or a multiseat plan's seats)")
        }
        if let groupId = mint.groupId, groupId.isEmpty || groupId.count > 20 || !groupId.allSatisfy(\.isASCII) || !groupId.allSatisfy(\.isNumber) {
            throw HTTPError(.badRequest, message: "groupId is Apple's numeric group id")
        }
        let order = FakeLedger.Order(
            bundleId: mint.bundleId, productId: mint.productId, environment: environment, type: type,
            quantity: mint.quantity ?? 1,
            applicationUsername: mint.appAccountToken?.lowercased()
                ?? mint.applicationUsername.flatMap { UUID(uuidString: $0) != nil ? $0 : nil },
            deviceId: mint.deviceId,
            expiresIn: mint.expiresInSeconds.map(TimeInterval.init), familyShared: familyShared,
            assigned: ownership == "ASSIGNED",
            terms: try Self.terms(of: mint),
            // An assigned seat is always some group's: Apple's sandbox placeholder unless named.
            groupId: mint.groupId ?? (ownership == "ASSIGNED" ? FakeAppStore.sandboxGroupId : nil),
            receiptIncludesPurchase: mint.receiptIncludesPurchase ?? true)
        let result = try ledger.mint(order, encode: encodeReceipt)
        if mint.terms.previousOriginalTransactionId != nil {
            // Apple tells the server that the subscription moved to its new chain.
            try await notify("MIGRATION", subtype: nil, purchase: result.0)
        }
        if type != "auto_renewable", ledger.sendsOneTimeCharge {
            // Apple tells the server of every one-time purchase (consumable, non-consumable,
            // non-renewing subscription) too, in production since May 2025.
            try await notify("ONE_TIME_CHARGE", subtype: nil, purchase: result.0)
        }
        return try minted(result)
    }

    /// A mint's price and offer as the ledger keeps them (JSON), nil when it names none.
    private static func terms(of mint: MintRequest) throws -> String? {
        let terms = mint.terms
        if let price = terms.price, price < 0 { throw HTTPError(.badRequest, message: "price is in milli-units, 0 or more") }
        if let price = terms.price, price > 1_000_000_000_000 { throw HTTPError(.badRequest, message: "price is at most 10^12 milli-units") }
        if let total = terms.commitmentTotalPeriods {
            guard (1...1_000).contains(total), (terms.commitmentBillingPeriod ?? 1) >= 1, (terms.commitmentBillingPeriod ?? 1) <= total
            else {
                throw HTTPError(.badRequest, message: "commitmentTotalPeriods is 1 to 1000, commitmentBillingPeriod 1 to it")
            }
        } else if terms.commitmentBillingPeriod != nil || terms.commitmentPrice != nil {
            throw HTTPError(.badRequest, message: "a commitment names commitmentTotalPeriods")
        }
        if let price = terms.commitmentPrice, !(0...1_000_000_000_000_000).contains(price) {
            throw HTTPError(.badRequest, message: "commitmentPrice is 0 to 10^15 milli-units")
        }
        if let type = terms.offerType, !(1...4).contains(type) {
            throw HTTPError(.badRequest, message: "offerType is 1 (introductory), 2 (promotional), 3 (offer code) or 4 (win-back)")
        }
        let encoded = try JSONEncoder().encode(terms)
        // Nothing named: the list price, no offer.
        return encoded == Data("{}".utf8) ? nil : String(decoding: encoded, as: UTF8.self)
    }

    /// `POST /fake/devices/{deviceId}/receipt`: the device's refreshed receipt.
    private func refreshedReceipt(deviceId: String) throws -> Response {
        guard let bytes = try ledger.refreshReceipt(deviceId: deviceId, encode: encodeReceipt) else {
            throw HTTPError(.notFound, message: "device \(deviceId) bought nothing")
        }
        return try json(["receiptData": Data(bytes).base64EncodedString()], status: .ok)
    }

    /// The device's receipt as the app would upload it.
    private func encodeReceipt(_ receipt: FakeLedger.Receipt) throws -> [UInt8] {
        try minter.mint(
            ReceiptPayload(
                receiptType: receipt.environment == "Sandbox" ? "ProductionSandbox" : "Production",
                bundleId: receipt.bundleId, creationDate: receipt.createdAt,
                inApp: receipt.purchases.map { purchase in
                    InAppPurchasePayload(
                        quantity: purchase.quantity, productId: purchase.productId,
                        transactionId: purchase.transactionId,
                        originalTransactionId: purchase.originalTransactionId, purchaseDate: purchase.purchaseDate,
                        originalPurchaseDate: purchase.originalPurchaseDate, expiresDate: purchase.expiresDate,
                        webOrderLineItemId: purchase.webOrderLineItemId.flatMap { Int64($0) },
                        cancellationDate: purchase.cancellationDate)
                }))
    }

    /// The 201 answer for a minted, restored or renewed purchase.
    private func minted(_ result: (FakeLedger.Purchase, [UInt8])) throws -> Response {
        let (purchase, bytes) = result
        return try json(
            MintResponse(
                transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId,
                receiptData: Data(bytes).base64EncodedString(), signedTransaction: try storeKit.signedTransaction(purchase),
                orderId: "F" + purchase.transactionId, deviceId: purchase.deviceId,
                webOrderLineItemId: purchase.webOrderLineItemId),
            status: .created)
    }

    /// A refused restore or renewal as an HTTP error: 404 for an unknown id, 409 otherwise.
    private func refused<Value>(_ result: Result<Value, FakeLedger.Refusal>, id: String) throws -> Value {
        switch result {
        case .success(let value): return value
        case .failure(.notFound): throw HTTPError(.notFound, message: "no purchase \(id)")
        case .failure(.conflict(let reason)): throw HTTPError(.conflict, message: reason)
        }
    }

    private func verifyReceipt(_ request: Request, endpoint: String) async throws -> Response {
        var request = request
        let body = try await request.collectBody(upTo: 8 * 1024 * 1024)
        ledger.countVerifyReceiptCall()
        let latency = ledger.latencyMs
        if latency > 0 { try await Task.sleep(for: .milliseconds(latency)) }
        if ledger.failsAtRandom() { return Response(status: .serviceUnavailable) }

        let object = try? JSONSerialization.jsonObject(with: Data(body.readableBytesView)) as? [String: Any]
        let bytes = (object?["receipt-data"] as? String).flatMap { Data(base64Encoded: $0) }.map { [UInt8]($0) }
        let receipt = try bytes.flatMap { try ledger.receipt(bytes: $0) }

        if let fault = ledger.takeFault(transactionIds: Set(receipt?.purchases.map(\.transactionId) ?? [])) {
            if let delay = fault.delayMs { try await Task.sleep(for: .milliseconds(delay)) }
            if let httpStatus = fault.httpStatus {
                return Response(status: .init(code: httpStatus))
            }
            if let status = fault.status {
                return try json(AppleStatusOnly(status: status, environment: endpoint, is_retryable: fault.retryable))
            }
        }
        guard bytes != nil else {
            return try json(AppleStatusOnly(status: 21002, environment: endpoint))
        }
        guard let receipt else {
            return try json(AppleStatusOnly(status: 21003, environment: endpoint))
        }
        if receipt.environment == "Sandbox" && endpoint == "Production" {
            return try json(AppleStatusOnly(status: 21007, environment: endpoint))
        }
        if receipt.environment == "Production" && endpoint == "Sandbox" {
            return try json(AppleStatusOnly(status: 21008, environment: endpoint))
        }
        let excludeOld = (object?["exclude-old-transactions"] as? Bool) ?? false
        let subscriptions = try ledger.subscriptions(of: receipt)
        let states = try ledger.subscriptionStates(of: subscriptions.map(\.originalTransactionId))
        return try json(
            AppleVerifyReceiptAnswer(receipt: receipt, subscriptions: subscriptions, states: states, excludeOld: excludeOld))
    }

    private func json(_ value: some Encodable, status: HTTPResponse.Status = .ok) throws -> Response {
        let data = try JSONEncoder().encode(value)
        return Response(
            status: status, headers: [.contentType: "application/json"],
            body: .init(byteBuffer: ByteBuffer(bytes: data)))
    }

    static func milliseconds(_ date: Date) -> Int64 {
        Int64((date.timeIntervalSince1970 * 1000).rounded())
    }
}

/// Apple's answer when it has no receipt to show.
struct AppleStatusOnly: Encodable {
    var status: Int
    var environment: String
    var is_retryable: Bool?
}

/// Apple's `verifyReceipt` answer for a valid receipt: every number and date as a string.
struct AppleVerifyReceiptAnswer: Encodable {
    struct Receipt: Encodable {
        var receipt_type: String
        var bundle_id: String
        var application_version = "1"
        var original_application_version = "1.0"
        var receipt_creation_date_ms: String
        var request_date_ms: String
        var in_app: [Transaction]
    }

    /// One element of `in_app` or `latest_receipt_info`.
    struct Transaction: Encodable {
        var quantity: String
        var product_id: String
        var transaction_id: String
        var original_transaction_id: String
        var purchase_date: String
        var purchase_date_ms: String
        var original_purchase_date: String
        var original_purchase_date_ms: String
        var expires_date: String?
        var expires_date_ms: String?
        var web_order_line_item_id: String?
        var cancellation_date: String?
        var cancellation_date_ms: String?
        var cancellation_reason: String?
        var app_account_token: String?
        var is_trial_period = "false"
        var is_upgraded: String?
        var in_app_ownership_type: String

        init(_ purchase: FakeLedger.Purchase) {
            quantity = String(purchase.quantity)
            product_id = purchase.productId
            transaction_id = purchase.transactionId
            original_transaction_id = purchase.originalTransactionId
            purchase_date = AppleVerifyReceiptAnswer.appleDate(purchase.purchaseDate)
            purchase_date_ms = String(FakeAppStore.milliseconds(purchase.purchaseDate))
            original_purchase_date = AppleVerifyReceiptAnswer.appleDate(purchase.originalPurchaseDate)
            original_purchase_date_ms = String(FakeAppStore.milliseconds(purchase.originalPurchaseDate))
            expires_date = purchase.expiresDate.map(AppleVerifyReceiptAnswer.appleDate)
            expires_date_ms = purchase.expiresDate.map { String(FakeAppStore.milliseconds($0)) }
            web_order_line_item_id = purchase.webOrderLineItemId
            cancellation_date = purchase.cancellationDate.map(AppleVerifyReceiptAnswer.appleDate)
            cancellation_date_ms = purchase.cancellationDate.map { String(FakeAppStore.milliseconds($0)) }
            cancellation_reason = purchase.cancellationDate == nil ? nil : "0"
            app_account_token = purchase.applicationUsername?.lowercased()
            in_app_ownership_type = purchase.inAppOwnershipType
            is_upgraded = purchase.isUpgraded ? "true" : nil
        }
    }

    struct PendingRenewal: Encodable {
        var auto_renew_product_id: String
        var product_id: String
        var original_transaction_id: String
        var auto_renew_status = "1"
        /// "1" while Apple retries a failed renewal, "0" once the subscription expired.
        var is_in_billing_retry_period: String?
        /// "1" the customer cancelled, "2" a billing error.
        var expiration_intent: String?
        var grace_period_expires_date: String?
        var grace_period_expires_date_ms: String?

        init(latest: FakeLedger.Purchase, state: FakeLedger.SubscriptionState?, now: Date) {
            auto_renew_product_id = latest.productId
            product_id = latest.productId
            original_transaction_id = latest.originalTransactionId
            auto_renew_status = state?.autoRenew == false ? "0" : "1"
            let retrying = state?.billingRetrySince != nil
            let expired = !retrying && (latest.expiresDate ?? .distantFuture) <= now
            is_in_billing_retry_period = retrying ? "1" : expired ? "0" : nil
            expiration_intent = retrying || expired ? state?.expirationIntent.map(String.init) : nil
            grace_period_expires_date = state?.gracePeriodExpiresDate.map(AppleVerifyReceiptAnswer.appleDate)
            grace_period_expires_date_ms = state?.gracePeriodExpiresDate.map { String(FakeAppStore.milliseconds($0)) }
        }
    }

    var status = 0
    var environment: String
    var receipt: Receipt
    var latest_receipt_info: [Transaction]?
    var pending_renewal_info: [PendingRenewal]?

    init(
        receipt: FakeLedger.Receipt, subscriptions: [FakeLedger.Purchase], states: [String: FakeLedger.SubscriptionState],
        excludeOld: Bool
    ) {
        environment = receipt.environment
        self.receipt = Receipt(
            receipt_type: receipt.environment == "Sandbox" ? "ProductionSandbox" : "Production",
            bundle_id: receipt.bundleId,
            receipt_creation_date_ms: String(FakeAppStore.milliseconds(receipt.createdAt)),
            request_date_ms: String(FakeAppStore.milliseconds(Date())),
            in_app: receipt.purchases.filter(\.isListedInReceipt).map(Transaction.init))
        if !subscriptions.isEmpty {
            // Newest first, as Apple lists them; only the latest per chain with exclude-old-transactions.
            var latest = subscriptions.sorted { $0.purchaseDate > $1.purchaseDate }
            if excludeOld {
                var seen = Set<String>()
                latest = latest.filter { seen.insert($0.originalTransactionId).inserted }
            }
            latest_receipt_info = latest.map(Transaction.init)
            var seen = Set<String>()
            let now = Date()
            pending_renewal_info = latest.filter { seen.insert($0.originalTransactionId).inserted }.map {
                PendingRenewal(latest: $0, state: states[$0.originalTransactionId], now: now)
            }
        }
    }

    /// Apple's `yyyy-MM-dd HH:mm:ss Etc/GMT`. Written by hand: a `DateFormatter` per date
    /// was the largest item in a profile of the benchmark, and one shared is not `Sendable`.
    static func appleDate(_ date: Date) -> String {
        var seconds = time_t(date.timeIntervalSince1970.rounded(.down))
        var parts = tm()
        gmtime_r(&seconds, &parts)
        func digits(_ value: Int32, _ width: Int) -> String {
            let text = String(value)
            return String(repeating: "0", count: max(0, width - text.count)) + text
        }
        return digits(parts.tm_year + 1900, 4) + "-" + digits(parts.tm_mon + 1, 2) + "-" + digits(parts.tm_mday, 2) + " "
            + digits(parts.tm_hour, 2) + ":" + digits(parts.tm_min, 2) + ":" + digits(parts.tm_sec, 2) + " Etc/GMT"
    }
}

extension FakeLedger.Purchase {
    /// Whether `verifyReceipt` lists it in the receipt's `in_app`: Apple leaves out consumables
    /// and non-consumables it refunded in full or revoked (a prorated refund keeps the rest of
    /// the purchase); a refunded subscription period stays, with its `cancellation_date`.
    var isListedInReceipt: Bool {
        guard cancellationDate != nil, type == "consumable" || type == "non_consumable" else { return true }
        return revocationType == "REFUND_PRORATED"
    }
}

/// SplitMix64: a seeded generator, so that `{"order": "shuffle", "seed": N}` gives the same
/// order every time.
struct SeededGenerator: RandomNumberGenerator {
    private var state: UInt64

    init(seed: UInt64) {
        state = seed
    }

    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var mixed = state
        mixed = (mixed ^ (mixed >> 30)) &* 0xBF58_476D_1CE4_E5B9
        mixed = (mixed ^ (mixed >> 27)) &* 0x94D0_49BB_1331_11EB
        return mixed ^ (mixed >> 31)
    }
}
