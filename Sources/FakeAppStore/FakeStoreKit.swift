import AsyncHTTPClient
public import Crypto
import Foundation
import Hummingbird
import NIOConcurrencyHelpers
import NIOCore
import NIOFoundationCompat
import NIOHTTP1

/// The App Store Server API key the fake checks bearer tokens against: the public half of
/// the `.p8` key the verifier signs with, its key id, and the issuer id.
public struct FakeServerAPIKey: Sendable {
    public var keyId: String
    public var issuerId: String
    public var publicKey: P256.Signing.PublicKey

    /// Reads the key from the PEM private key (`IAP_FAKE_API_KEY_PATH`).
    public init(privateKeyPEM: String, keyId: String, issuerId: String) throws {
        self.keyId = keyId
        self.issuerId = issuerId
        publicKey = try P256.Signing.PrivateKey(pemRepresentation: privateKeyPEM).publicKey
    }
}

/// How the fake talks StoreKit 2: signed transactions, the App Store Server API and Server
/// Notifications V2, in Apple's JSON shapes (defined here apart from the verifier's, so a
/// mistake on one side is not mirrored on the other).
struct FakeStoreKit: Sendable {
    let ledger: FakeLedger
    let authority: FakeCertificateAuthority
    let apiKey: FakeServerAPIKey?
    let appAppleId: Int64
    /// Where notifications go (shared with `FakeAppStore`, which sets it).
    let notificationURL: NIOLockedValueBox<String?>

    /// Apple's `JWSTransactionDecodedPayload`.
    struct Transaction: Encodable {
        var transactionId: String
        var originalTransactionId: String
        var webOrderLineItemId: String?
        var bundleId: String
        var productId: String
        var subscriptionGroupIdentifier: String?
        var purchaseDate: Int64
        var originalPurchaseDate: Int64
        var expiresDate: Int64?
        var quantity: Int
        var type: String
        var appAccountToken: String?
        var inAppOwnershipType: String
        var signedDate: Int64
        var revocationReason: Int?
        var revocationDate: Int64?
        var revocationType: String?
        var revocationPercentage: Int?
        var environment: String
        var transactionReason: String
        var isUpgraded: Bool?
        var appTransactionId: String
        var storefront = "USA"
        var storefrontId = "143441"
        var price: Int64 = 990
        var currency = "USD"
        var offerType: Int? = nil
        var offerIdentifier: String? = nil
        var offerDiscountType: String? = nil
        var offerPeriod: String? = nil
        var billingPlanType: String? = nil
        var previousOriginalTransactionId: String? = nil
        var commitmentInfo: CommitmentInfo? = nil
    }

    /// Apple's `TransactionCommitmentInfo`.
    struct CommitmentInfo: Encodable {
        var billingPeriodNumber: Int
        var totalBillingPeriods: Int
        var commitmentExpiresDate: Int64
        var commitmentPrice: Int64
    }

    /// Apple's `RenewalCommitmentInfo`.
    struct RenewalCommitmentInfo: Encodable {
        var commitmentAutoRenewProductId: String
        var commitmentAutoRenewStatus: Int
        var commitmentRenewalBillingPlanType: String?
        var commitmentRenewalDate: Int64
        var commitmentRenewalPrice: Int64
    }

    /// Apple's `JWSRenewalInfoDecodedPayload`.
    struct RenewalInfo: Encodable {
        var originalTransactionId: String
        var autoRenewProductId: String
        var productId: String
        var autoRenewStatus: Int
        var environment: String
        var signedDate: Int64
        var renewalDate: Int64?
        var recentSubscriptionStartDate: Int64
        /// 1 the customer cancelled, 2 a billing error: why it expired, or why renewing fails.
        var expirationIntent: Int?
        /// True while Apple retries a failed renewal; false once the subscription expired.
        var isInBillingRetryPeriod: Bool?
        var gracePeriodExpiresDate: Int64?
        /// The next period's price in milli-units (the list price until Apple raised it).
        var renewalPrice: Int64
        var currency: String
        /// 0: a price increase awaits the customer's consent; 1: consented; absent: none told.
        var priceIncreaseStatus: Int?
        var renewalBillingPlanType: String? = nil
        var commitmentInfo: RenewalCommitmentInfo? = nil
    }

    /// Apple's `ResponseBodyV2DecodedPayload`, one shape for every notification: `data` about a
    /// purchase, or in its place `summary` (a mass extension's end), `externalPurchaseToken`
    /// (`EXTERNAL_PURCHASE_TOKEN`) or `appData` (about the app: `RESCIND_CONSENT`).
    struct Notification: Encodable {
        struct Payload: Encodable {
            var appAppleId: Int64
            var bundleId: String
            var bundleVersion = "1"
            var environment: String
            var signedTransactionInfo: String?
            var signedRenewalInfo: String?
            var status: Int?
            var consumptionRequestReason: String?
        }

        struct Summary: Encodable {
            var requestIdentifier: String
            var environment: String
            var appAppleId: Int64
            var bundleId: String
            var productId: String
            var storefrontCountryCodes: [String]
            var failedCount: Int64
            var succeededCount: Int64
        }

        struct ExternalPurchaseToken: Encodable {
            var externalPurchaseId: String
            var tokenCreationDate: Int64
            var appAppleId: Int64
            var bundleId: String
            var tokenType: String?
        }

        struct AppData: Encodable {
            var appAppleId: Int64
            var bundleId: String
            var environment: String
            var signedAppTransactionInfo: String
        }

        var notificationType: String
        var subtype: String?
        var notificationUUID = UUID().uuidString.lowercased()
        var data: Payload?
        var summary: Summary?
        var externalPurchaseToken: ExternalPurchaseToken?
        var appData: AppData?
        var version = "2.0"
        var signedDate = FakeAppStore.milliseconds(Date())
    }

    /// Apple's `AppTransaction` (`JWSAppTransactionDecodedPayload`): one customer's download.
    struct AppTransaction: Encodable {
        var appTransactionId: String
        var bundleId: String
        var appAppleId: Int64
        var applicationVersion = "1"
        var originalApplicationVersion = "1"
        var receiptType: String
        var receiptCreationDate: Int64
        var originalPurchaseDate: Int64
        var originalPlatform = "iOS"
        var signedDate: Int64
    }

    /// A signed `EXTERNAL_PURCHASE_TOKEN` for `bundleId`: a token the app made for a purchase
    /// outside the App Store and never reported (Apple's `UNREPORTED`). Its environment is in
    /// its id, as Apple's: a sandbox token's starts with `SANDBOX`.
    func signedExternalPurchaseToken(bundleId: String, environment: String, tokenType: String?) throws
        -> (payload: String, uuid: String, externalPurchaseId: String)
    {
        let now = FakeAppStore.milliseconds(Date())
        let id = (environment == "Sandbox" ? "SANDBOX_" : "") + UUID().uuidString.lowercased()
        let uuid = UUID().uuidString.lowercased()
        let payload = try authority.signJWS(
            Notification(
                notificationType: "EXTERNAL_PURCHASE_TOKEN", subtype: "UNREPORTED", notificationUUID: uuid,
                externalPurchaseToken: .init(
                    externalPurchaseId: id, tokenCreationDate: now - 60_000, appAppleId: appAppleId, bundleId: bundleId,
                    tokenType: tokenType),
                signedDate: now))
        return (payload, uuid, id)
    }

    /// A signed `RESCIND_CONSENT` for `bundleId`: the customer's signed `AppTransaction` in
    /// its `appData`; also its `notificationUUID` and the `appTransactionId`.
    func signedConsentRescinded(bundleId: String, environment: String) throws -> (payload: String, uuid: String, appTransactionId: String) {
        let now = FakeAppStore.milliseconds(Date())
        let appTransactionId = String(UInt64.random(in: 700_000_000_000_000_000...799_999_999_999_999_999))
        let appTransaction = try authority.signJWS(
            AppTransaction(
                appTransactionId: appTransactionId, bundleId: bundleId, appAppleId: appAppleId, receiptType: environment,
                receiptCreationDate: now, originalPurchaseDate: now - 86_400_000, signedDate: now))
        let uuid = UUID().uuidString.lowercased()
        let payload = try authority.signJWS(
            Notification(
                notificationType: "RESCIND_CONSENT", notificationUUID: uuid,
                appData: .init(
                    appAppleId: appAppleId, bundleId: bundleId, environment: environment, signedAppTransactionInfo: appTransaction),
                signedDate: now))
        return (payload, uuid, appTransactionId)
    }

    static func appleType(_ type: String) -> String {
        switch type {
        case "non_consumable": "Non-Consumable"
        case "auto_renewable": "Auto-Renewable Subscription"
        case "non_renewing": "Non-Renewing Subscription"
        default: "Consumable"
        }
    }

    func signedTransaction(_ purchase: FakeLedger.Purchase) throws -> String {
        let now = FakeAppStore.milliseconds(Date())
        var transaction = Transaction(
                transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId,
                webOrderLineItemId: purchase.webOrderLineItemId, bundleId: purchase.bundleId, productId: purchase.productId,
                subscriptionGroupIdentifier: purchase.type == "auto_renewable" ? Self.subscriptionGroup : nil,
                purchaseDate: FakeAppStore.milliseconds(purchase.purchaseDate),
                originalPurchaseDate: FakeAppStore.milliseconds(purchase.originalPurchaseDate),
                expiresDate: purchase.expiresDate.map(FakeAppStore.milliseconds), quantity: purchase.quantity,
                type: Self.appleType(purchase.type),
                appAccountToken: purchase.applicationUsername.flatMap { UUID(uuidString: $0) }?.uuidString.lowercased(),
                inAppOwnershipType: purchase.inAppOwnershipType, signedDate: now, revocationReason: purchase.cancellationDate == nil ? nil : 0,
                revocationDate: purchase.cancellationDate.map(FakeAppStore.milliseconds),
                revocationType: purchase.cancellationDate == nil ? nil : purchase.revocationType ?? "REFUND_FULL",
                revocationPercentage: purchase.cancellationDate == nil ? nil : purchase.revocationPercentage,
                environment: purchase.environment, transactionReason: purchase.transactionReason,
                isUpgraded: purchase.isUpgraded ? true : nil, appTransactionId: Self.appTransactionId(of: purchase))
        if let text = purchase.terms, let terms = try? JSONDecoder().decode(FakeLedger.Terms.self, from: Data(text.utf8)) {
            if let price = terms.price { transaction.price = price }
            if let currency = terms.currency { transaction.currency = currency }
            transaction.offerType = terms.offerType
            transaction.offerIdentifier = terms.offerIdentifier
            transaction.offerDiscountType = terms.offerDiscountType
            transaction.offerPeriod = terms.offerPeriod
            transaction.billingPlanType = terms.billingPlanType
            transaction.previousOriginalTransactionId = terms.previousOriginalTransactionId
            if let commitment = Self.commitment(of: purchase, terms: terms) {
                transaction.commitmentInfo = CommitmentInfo(
                    billingPeriodNumber: commitment.number, totalBillingPeriods: commitment.total,
                    commitmentExpiresDate: FakeAppStore.milliseconds(commitment.ends), commitmentPrice: commitment.price)
            }
        }
        return try authority.signJWS(transaction)
    }

    /// The app transaction id of `purchase`'s customer (API 1.15): Apple keeps one per Apple
    /// account and app; the fake's accounts are its devices, so one per device, app and
    /// environment, the same every time it is asked.
    static func appTransactionId(of purchase: FakeLedger.Purchase) -> String {
        appTransactionId(bundleId: purchase.bundleId, environment: purchase.environment, deviceId: purchase.deviceId)
    }

    /// The app transaction id of the account (device) `deviceId` of `bundleId` in `environment`.
    static func appTransactionId(bundleId: String, environment: String, deviceId: String) -> String {
        let digest = SHA256.hash(data: Data("\(bundleId)|\(environment)|\(deviceId)".utf8))
        let value = digest.prefix(8).reduce(UInt64(0)) { $0 << 8 | UInt64($1) } % 100_000_000_000_000_000
        return String(700_000_000_000_000_000 + value)
    }

    /// The signed `AppTransaction` of `purchase`'s customer (Get App Transaction Info): its
    /// download dated a day before the account's first purchase.
    func signedAppTransaction(of purchase: FakeLedger.Purchase) throws -> String {
        let first = try ledger.purchases(bundleId: purchase.bundleId, environment: purchase.environment, deviceId: purchase.deviceId)
            .first?.purchaseDate ?? purchase.purchaseDate
        let now = FakeAppStore.milliseconds(Date())
        return try authority.signJWS(
            AppTransaction(
                appTransactionId: Self.appTransactionId(of: purchase), bundleId: purchase.bundleId, appAppleId: appAppleId,
                receiptType: purchase.environment, receiptCreationDate: now,
                originalPurchaseDate: FakeAppStore.milliseconds(first) - 86_400_000, signedDate: now))
    }

    /// A commitment plan's place at `purchase` as minted: its number of how many periods, its
    /// end (the periods left, each as long as this one) and price; nil for no commitment.
    static func commitment(of purchase: FakeLedger.Purchase, terms: FakeLedger.Terms)
        -> (number: Int, total: Int, ends: Date, price: Int64)?
    {
        guard let total = terms.commitmentTotalPeriods, let expires = purchase.expiresDate else { return nil }
        let number = min(max(terms.commitmentBillingPeriod ?? 1, 1), total)
        let length = expires.timeIntervalSince(purchase.purchaseDate)
        let price = terms.commitmentPrice ?? (terms.price ?? FakeLedger.listPrice) * Int64(total)
        return (number, total, expires.addingTimeInterval(length * Double(total - number)), price)
    }

    /// The renewal info of `purchase`'s chain as it stands (`state`, read from the ledger when nil).
    func signedRenewalInfo(_ purchase: FakeLedger.Purchase, state: FakeLedger.SubscriptionState? = nil) throws -> String {
        let state = try state ?? ledger.subscriptionStates(of: [purchase.originalTransactionId])[purchase.originalTransactionId]
        let now = Date()
        let expired = state?.billingRetrySince == nil && (purchase.expiresDate ?? .distantFuture) <= now
        var info = RenewalInfo(
                originalTransactionId: purchase.originalTransactionId, autoRenewProductId: purchase.productId,
                productId: purchase.productId, autoRenewStatus: state?.autoRenew == false ? 0 : 1,
                environment: purchase.environment, signedDate: FakeAppStore.milliseconds(now),
                renewalDate: purchase.expiresDate.map(FakeAppStore.milliseconds),
                recentSubscriptionStartDate: FakeAppStore.milliseconds(purchase.originalPurchaseDate),
                expirationIntent: state?.billingRetrySince != nil || expired ? state?.expirationIntent : nil,
                isInBillingRetryPeriod: state?.billingRetrySince != nil ? true : expired ? false : nil,
                gracePeriodExpiresDate: state?.gracePeriodExpiresDate.map(FakeAppStore.milliseconds),
                renewalPrice: state?.renewalPrice ?? FakeLedger.listPrice, currency: "USD",
                priceIncreaseStatus: state?.priceIncreaseStatus)
        if let text = purchase.terms, let terms = try? JSONDecoder().decode(FakeLedger.Terms.self, from: Data(text.utf8)) {
            info.renewalBillingPlanType = terms.billingPlanType
            if let commitment = Self.commitment(of: purchase, terms: terms) {
                // The commitment renews to a new one of the same product and length when it ends.
                info.commitmentInfo = RenewalCommitmentInfo(
                    commitmentAutoRenewProductId: purchase.productId, commitmentAutoRenewStatus: state?.autoRenew == false ? 0 : 1,
                    commitmentRenewalBillingPlanType: terms.billingPlanType,
                    commitmentRenewalDate: FakeAppStore.milliseconds(commitment.ends), commitmentRenewalPrice: commitment.price)
            }
        }
        return try authority.signJWS(info)
    }

    /// A signed notification of `type` about `purchase`.
    func signedNotification(
        type: String, subtype: String?, purchase: FakeLedger.Purchase, consumptionRequestReason: String? = nil
    ) throws -> String {
        let subscription = purchase.type == "auto_renewable"
        let state =
            subscription
            ? try ledger.subscriptionStates(of: [purchase.originalTransactionId])[purchase.originalTransactionId] : nil
        let status: Int? = subscription ? Self.status(of: purchase, state: state) : nil
        return try authority.signJWS(
            Notification(
                notificationType: type, subtype: subtype, notificationUUID: UUID().uuidString.lowercased(),
                data: .init(
                    appAppleId: appAppleId, bundleId: purchase.bundleId, environment: purchase.environment,
                    signedTransactionInfo: try signedTransaction(purchase),
                    signedRenewalInfo: subscription ? try signedRenewalInfo(purchase, state: state) : nil, status: status,
                    consumptionRequestReason: consumptionRequestReason),
                signedDate: FakeAppStore.milliseconds(Date())))
    }

    /// POSTs `{"signedPayload"}` to `url` once (Apple retries only in production, hours apart)
    /// and records the attempt for Get Notification History.
    /// While notifications are held (`FakeLedger.hold()`) it waits instead, for `deliver(_:to:)`.
    func send(_ signedPayload: String, type: String, transactionId: String?, environment: String, to url: String?) async {
        let waiting = FakeLedger.HeldNotification(
            signedPayload: signedPayload, notificationType: type, transactionId: transactionId, environment: environment,
            signedDate: Self.signedDate(of: signedPayload) ?? FakeAppStore.milliseconds(Date()))
        if ledger.keep(waiting) { return }
        await deliver(waiting, to: url)
    }

    /// POSTs a notification that was held, as `send` would have, and records the attempt.
    @discardableResult
    func deliver(_ notification: FakeLedger.HeldNotification, to url: String?) async -> String {
        let result = await post(notification.signedPayload, to: url)
        ledger.recordNotification(
            .init(
                signedPayload: notification.signedPayload, notificationType: notification.notificationType,
                transactionId: notification.transactionId, environment: notification.environment,
                attempts: [(Date(), result)]))
        return result
    }

    /// The `signedDate` of a JWS's payload, in milliseconds.
    static func signedDate(of jws: String) -> Int64? {
        let parts = jws.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let payload = base64URLDecode(parts[1]),
            let object = try? JSONSerialization.jsonObject(with: payload) as? [String: Any],
            let date = object["signedDate"] as? NSNumber
        else { return nil }
        return date.int64Value
    }

    /// POSTs a notification sent before once more, byte for byte (Apple's retry, or its
    /// duplicate delivery), and records the attempt; the result as Get Notification History
    /// spells it (`SUCCESS` for a 200).
    /// While notifications are held the copy waits with them (`HELD`).
    func resend(_ signedPayload: String, type: String, transactionId: String?, environment: String, to url: String?) async -> String {
        let copy = FakeLedger.HeldNotification(
            signedPayload: signedPayload, notificationType: type, transactionId: transactionId, environment: environment,
            signedDate: Self.signedDate(of: signedPayload) ?? FakeAppStore.milliseconds(Date()))
        if ledger.keep(copy) { return "HELD" }
        let result = await post(signedPayload, to: url)
        ledger.recordAttempt(signedPayload: signedPayload, at: Date(), result: result)
        return result
    }

    private func post(_ signedPayload: String, to url: String?) async -> String {
        var result = "NO_RESPONSE"
        if let url {
            var request = HTTPClientRequest(url: url)
            request.method = .POST
            request.headers.add(name: "Content-Type", value: "application/json")
            request.body = .bytes(ByteBuffer(data: (try? JSONEncoder().encode(["signedPayload": signedPayload])) ?? Data()))
            do {
                let response = try await HTTPClient.shared.execute(request, timeout: .seconds(10))
                _ = try? await response.body.collect(upTo: 1 << 20)
                result = response.status.code == 200 ? "SUCCESS" : "UNSUCCESSFUL_HTTP_RESPONSE_CODE"
            } catch {
                result = "TIMED_OUT"
            }
        }
        return result
    }

    // MARK: - The App Store Server API

    struct APIError: Error {
        var status: HTTPResponse.Status
        var errorCode: Int?
        var errorMessage: String?
    }

    /// Apple's error body.
    struct ErrorBody: Encodable {
        var errorCode: Int?
        var errorMessage: String?
    }

    static let transactionNotFound = APIError(status: .notFound, errorCode: 4_040_010, errorMessage: "Transaction id not found.")

    /// The routes of one environment; `prefix` is "" for production and "/sandbox" for sandbox.
    func addRoutes(to router: Router<BasicRequestContext>, prefix: String, environment: String) {
        addLookupRoutes(to: router, prefix: prefix, environment: environment)
        addSubscriptionStatusRoutes(to: router, prefix: prefix, environment: environment)
        addNotificationHistoryRoutes(to: router, prefix: prefix, environment: environment)
        addGroupRoutes(to: router, prefix: prefix, environment: environment)
        addChangeRoutes(to: router, prefix: prefix, environment: environment)
        addRenewalExtensionRoutes(to: router, prefix: prefix, environment: environment)
    }

    /// Get Transaction Info, Get Transaction History (v1 and v2), Look Up Refunds, Look Up Order ID and Get App Transaction Info.
    private func addLookupRoutes(to router: Router<BasicRequestContext>, prefix: String, environment: String) {
        router.get("\(prefix)/inApps/v1/transactions/{transactionId}") { request, context in
            try await answer(request) { bundleId in
                let purchase = try found(try context.parameters.require("transactionId"), bundleId, environment)
                return ["signedTransactionInfo": try signedTransaction(purchase)]
            }
        }
        // Apple's client libraries still default to v1; the fake answers both alike.
        for version in ["v1", "v2"] {
            router.get("\(prefix)/inApps/\(version)/history/{transactionId}") { request, context in
                try await answer(request) { bundleId in
                    let purchase = try found(try context.parameters.require("transactionId"), bundleId, environment)
                    let filter = HistoryFilter(request.uri.queryParameters)
                    return try page(
                        filter.apply(to: try ledger.history(of: purchase.transactionId)), descending: filter.descending,
                        revision: request.uri.queryParameters.get("revision"), bundleId: bundleId, environment: environment)
                }
            }
        }
        router.get("\(prefix)/inApps/v2/refund/lookup/{transactionId}") { request, context in
            try await answer(request) { bundleId in
                let purchase = try found(try context.parameters.require("transactionId"), bundleId, environment)
                let refunded = try ledger.history(of: purchase.transactionId).filter { $0.cancellationDate != nil }
                    .sorted { $0.modifiedSeq < $1.modifiedSeq }
                return try page(
                    refunded, descending: false, revision: request.uri.queryParameters.get("revision"), bundleId: bundleId,
                    environment: environment)
            }
        }
        router.get("\(prefix)/inApps/v1/lookup/{orderId}") { request, context in
            try await answer(request) { bundleId in
                // The fake's invoice order ids are "F" and the transaction id.
                let orderId = try context.parameters.require("orderId")
                guard orderId.hasPrefix("F"), let purchase = try ledger.purchase(transactionId: String(orderId.dropFirst())),
                    purchase.bundleId == bundleId, purchase.environment == environment
                else {
                    return LookupAnswer(status: 1, signedTransactions: [])
                }
                return LookupAnswer(status: 0, signedTransactions: [try signedTransaction(purchase)])
            }
        }
        router.get("\(prefix)/inApps/v1/transactions/appTransactions/{transactionId}") { request, context in
            // Get App Transaction Info: any transaction id of the customer, or the customer's
            // appTransactionId.
            try await answer(request) { bundleId in
                let owner = try customer(try context.parameters.require("transactionId"), bundleId, environment)
                guard let owner else {
                    throw APIError(
                        status: .notFound, errorCode: 4_040_019, errorMessage: "No app transaction exists for the customer.")
                }
                return ["signedAppTransactionInfo": try signedAppTransaction(of: owner)]
            }
        }
    }

    /// Get All Subscription Statuses.
    private func addSubscriptionStatusRoutes(to router: Router<BasicRequestContext>, prefix: String, environment: String) {
        router.get("\(prefix)/inApps/v1/subscriptions/{transactionId}") { request, context in
            try await answer(request) { bundleId in
                let purchase = try found(try context.parameters.require("transactionId"), bundleId, environment)
                // Each chain of the customer's, by its latest transaction wherever it was bought
                // (a resubscription may be another device's).
                let chains = Set(
                    try ledger.history(of: purchase.transactionId).filter { $0.type == "auto_renewable" }.map(\.originalTransactionId))
                var latest: [String: FakeLedger.Purchase] = [:]
                for chain in chains { latest[chain] = try ledger.latestTransaction(ofChain: chain) }
                let states = try ledger.subscriptionStates(of: chains)
                func status(_ last: FakeLedger.Purchase) -> Int { Self.status(of: last, state: states[last.originalTransactionId]) }
                // `status` may repeat: only subscriptions in one of those states.
                let wanted = Set(request.uri.queryParameters[values: "status"].compactMap { Int($0) })
                if !wanted.isEmpty { latest = latest.filter { wanted.contains(status($0.value)) } }
                return StatusesAnswer(
                    environment: environment, bundleId: bundleId, appAppleId: appAppleId,
                    data: latest.isEmpty
                        ? []
                        : [
                            .init(
                                subscriptionGroupIdentifier: Self.subscriptionGroup,
                                lastTransactions: try latest.values.sorted { $0.purchaseDate < $1.purchaseDate }.map { last in
                                    .init(
                                        status: status(last),
                                        originalTransactionId: last.originalTransactionId,
                                        signedTransactionInfo: try signedTransaction(last),
                                        signedRenewalInfo: try signedRenewalInfo(last, state: states[last.originalTransactionId]))
                                })
                        ])
            }
        }
    }

    /// Get Notification History and Request a Test Notification.
    private func addNotificationHistoryRoutes(to router: Router<BasicRequestContext>, prefix: String, environment: String) {
        router.post("\(prefix)/inApps/v1/notifications/history") { request, context in
            try await answer(request) { bundleId in
                var request = request
                let body = try await request.collectBody(upTo: 64 * 1024)
                let filter = (try? JSONSerialization.jsonObject(with: Data(body.readableBytesView))) as? [String: Any] ?? [:]
                let onlyFailures = filter["onlyFailures"] as? Bool ?? false
                // Apple requires the time span (milliseconds); the fake lets either end open.
                let start = (filter["startDate"] as? NSNumber)?.int64Value ?? .min
                let end = (filter["endDate"] as? NSNumber)?.int64Value ?? .max
                let history = ledger.notifications.filter { notification in
                    let sent = notification.attempts.first.map { FakeAppStore.milliseconds($0.date) } ?? 0
                    return notification.environment == environment && sent >= start && sent <= end
                        && (!onlyFailures || notification.attempts.contains { $0.result != "SUCCESS" })
                        && (filter["transactionId"] as? String).map { $0 == notification.transactionId } ?? true
                        && (filter["notificationType"] as? String).map { $0 == notification.notificationType } ?? true
                }
                return HistoryAnswer(
                    notificationHistory: history.map { notification in
                        .init(
                            signedPayload: notification.signedPayload,
                            sendAttempts: notification.attempts.map {
                                .init(attemptDate: FakeAppStore.milliseconds($0.date), sendAttemptResult: $0.result)
                            })
                    }, hasMore: false, paginationToken: nil)
            }
        }
        router.post("\(prefix)/inApps/v1/notifications/test") { request, _ in
            try await answer(request) { bundleId in
                ["testNotificationToken": UUID().uuidString.lowercased()]
            }
        }
    }

    /// Get Customer Groups and Get Group Members.
    private func addGroupRoutes(to router: Router<BasicRequestContext>, prefix: String, environment: String) {
        router.get("\(prefix)/groups/v1/currentGroups/{anyTransactionId}") { request, context in
            // Get Customer Groups (API 1.22): the groups of the customer any of whose ids
            // (transaction, original transaction, app transaction) is named.
            try await answer(request) { bundleId in
                guard let owner = try customer(try context.parameters.require("anyTransactionId"), bundleId, environment) else {
                    throw Self.transactionNotFound
                }
                let groups = try ledger.groups(bundleId: bundleId, environment: environment, deviceId: owner.deviceId)
                return CustomerGroupsAnswer(
                    groups: groups.map { group in
                        .init(
                            groupId: group.groupId, groupType: "ORGANIZATION",
                            roles: group.roles.map { .init(productId: $0.productId, role: $0.role) })
                    })
            }
        }
        router.get("\(prefix)/groups/v1/group/{groupId}") { request, context in
            // Get Group Members (API 1.22): a page of the group's members, by their customers'
            // appTransactionId; the token is where the next page starts.
            try await answer(request) { bundleId in
                let groupId = try context.parameters.require("groupId")
                guard !groupId.isEmpty, groupId.count <= 20, groupId.allSatisfy(\.isNumber) else {
                    throw APIError(status: .badRequest, errorCode: 4_000_225, errorMessage: "Invalid request. The group ID is invalid.")
                }
                let query = request.uri.queryParameters
                var limit = 100
                if let raw = query.get("limit") {
                    guard let value = Int(raw), (1...100).contains(value) else {
                        throw APIError(status: .badRequest, errorCode: 4_000_004, errorMessage: "Invalid request limit.")
                    }
                    limit = value
                }
                var start = 0
                if let token = query.get("paginationToken") {
                    guard let data = Data(base64Encoded: token), let text = String(data: data, encoding: .utf8),
                        text.hasPrefix("\(groupId):"), let offset = Int(text.dropFirst(groupId.count + 1)), offset > 0
                    else {
                        throw APIError(status: .badRequest, errorCode: 4_000_014, errorMessage: "Invalid pagination token.")
                    }
                    start = offset
                }
                let devices = try ledger.members(of: groupId, bundleId: bundleId, environment: environment)
                guard !devices.isEmpty else {
                    throw APIError(status: .notFound, errorCode: 4_040_022, errorMessage: "Group not found.")
                }
                let page = devices.dropFirst(start).prefix(limit)
                let end = start + page.count
                return GroupMembersAnswer(
                    members: page.map { .init(appTransactionId: Self.appTransactionId(bundleId: bundleId, environment: environment, deviceId: $0)) },
                    paginationToken: end < devices.count ? Data("\(groupId):\(end)".utf8).base64EncodedString() : nil,
                    hasMore: end < devices.count)
            }
        }
    }

    /// what the server changes at Apple: Finish Transaction, Set App Account Token, Send Consumption Information.
    private func addChangeRoutes(to router: Router<BasicRequestContext>, prefix: String, environment: String) {
        router.post("\(prefix)/inApps/v1/transactions/{transactionId}/finish") { request, context in
            // Finish Transaction: the same state the app's finishTransaction sets (the fake's
            // /fake/purchases/{id}/finish); a finished consumable leaves later receipts.
            let id = try context.parameters.require("transactionId")
            return try await answer(request, naming: [id]) { bundleId in
                let purchase = try found(id, bundleId, environment)
                _ = try ledger.finish(transactionId: purchase.transactionId, byServer: true)
                return [String: String]()
            }
        }
        router.put("\(prefix)/inApps/v1/transactions/{transactionId}/appAccountToken") { request, context in
            // Set App Account Token: every transaction of the purchase, and the renewals to
            // come (each takes its chain's latest token), carry the new token.
            try await answer(request) { bundleId in
                var request = request
                let body = try await request.collectBody(upTo: 64 * 1024)
                let fields = (try? JSONSerialization.jsonObject(with: Data(body.readableBytesView))) as? [String: Any]
                guard let text = fields?["appAccountToken"] as? String, let token = UUID(uuidString: text) else {
                    throw APIError(
                        status: .badRequest, errorCode: 4_000_183, errorMessage: "Invalid request. The app account token field must be a valid UUID.")
                }
                let purchase = try found(try context.parameters.require("transactionId"), bundleId, environment)
                guard purchase.transactionId == purchase.originalTransactionId else {
                    throw APIError(
                        status: .badRequest, errorCode: 4_000_187,
                        errorMessage: "Invalid request. The transaction ID provided is not an original transaction ID.")
                }
                try Self.refuseAssigned(purchase)
                guard purchase.inAppOwnershipType != "FAMILY_SHARED" else {
                    throw APIError(
                        status: .badRequest, errorCode: 4_000_185,
                        errorMessage: "Invalid request. Family Sharing transactions aren't supported by this endpoint.")
                }
                try ledger.setAppAccountToken(token.uuidString.lowercased(), originalTransactionId: purchase.originalTransactionId)
                return [String: String]()
            }
        }
        router.put("\(prefix)/inApps/v2/transactions/consumption/{transactionId}") { request, context in
            try await answer(request, status: .accepted) { bundleId in
                let purchase = try found(try context.parameters.require("transactionId"), bundleId, environment)
                var request = request
                let body = try await request.collectBody(upTo: 64 * 1024)
                guard let fields = (try? JSONSerialization.jsonObject(with: Data(body.readableBytesView))) as? [String: Any] else {
                    throw APIError(status: .badRequest, errorCode: 4_000_000, errorMessage: "Invalid request.")
                }
                try Self.refuseAssigned(purchase)
                try Self.checkConsumption(fields)
                ledger.recordConsumption(transactionId: purchase.transactionId, body: fields)
                return [String: String]()
            }
        }
    

    }

    /// Apple's 4000227: an assigned seat (multiseat) takes neither consumption answers nor Set
    /// App Account Token.
    static func refuseAssigned(_ purchase: FakeLedger.Purchase) throws {
        guard purchase.inAppOwnershipType == "ASSIGNED" else { return }
        throw APIError(
            status: .badRequest, errorCode: 4_000_227,
            errorMessage: "Invalid request. Assigned transactions aren't supported by this endpoint.")
    }

    /// Send Consumption Information v2's body as Apple checks it: `customerConsented` true
    /// (4000035), `deliveryStatus` one of Apple's five (4000036), `sampleContentProvided` a
    /// Boolean (4000041), `consumptionPercentage` 0 to 100000 milli-units and `refundPreference`
    /// one of Apple's three when present (4000000).
    static func checkConsumption(_ fields: [String: Any]) throws {
        let boolean = type(of: NSNumber(value: true))
        func isBool(_ value: Any?) -> Bool { value.map { type(of: $0) == boolean } ?? false }
        guard isBool(fields["customerConsented"]), fields["customerConsented"] as? Bool == true else {
            throw APIError(status: .badRequest, errorCode: 4_000_035, errorMessage: "Invalid request. The customer consented field is invalid.")
        }
        let deliveryStatuses: Set = [
            "DELIVERED", "UNDELIVERED_QUALITY_ISSUE", "UNDELIVERED_WRONG_ITEM", "UNDELIVERED_SERVER_OUTAGE", "UNDELIVERED_OTHER",
        ]
        guard let status = fields["deliveryStatus"] as? String, deliveryStatuses.contains(status) else {
            throw APIError(status: .badRequest, errorCode: 4_000_036, errorMessage: "Invalid request. The delivery status field is invalid.")
        }
        guard isBool(fields["sampleContentProvided"]) else {
            throw APIError(
                status: .badRequest, errorCode: 4_000_041, errorMessage: "Invalid request. The sample content provided field is invalid.")
        }
        if let used = fields["consumptionPercentage"], !(used is NSNull) {
            guard !isBool(used), let share = used as? Int, (0...100_000).contains(share) else {
                throw APIError(status: .badRequest, errorCode: 4_000_000, errorMessage: "Invalid request.")
            }
        }
        if let preference = fields["refundPreference"], !(preference is NSNull) {
            guard let text = preference as? String, ["DECLINE", "GRANT_FULL", "GRANT_PRORATED"].contains(text) else {
                throw APIError(status: .badRequest, errorCode: 4_000_000, errorMessage: "Invalid request.")
            }
        }
    }

    /// Apple's subscription status: 1 active, 2 expired, 3 billing retry, 4 billing grace
    /// period, 5 revoked.
    static func status(of purchase: FakeLedger.Purchase, state: FakeLedger.SubscriptionState?) -> Int {
        (state ?? FakeLedger.SubscriptionState(periodSeconds: 0)).status(of: purchase)
    }

    /// Get Transaction History's query: `productId`, `productType` and
    /// `subscriptionGroupIdentifier` may repeat; `revoked` is a boolean in any case (Apple's
    /// Python library sends `True`); dates are milliseconds; `sort` is ASCENDING (default) or
    /// DESCENDING.
    struct HistoryFilter {
        var productIds: Set<String>
        var productTypes: Set<String>
        var groups: Set<String>
        var ownership: String?
        var revoked: Bool?
        var start: Int64?
        var end: Int64?
        var descending: Bool

        init(_ query: some Collection<(key: Substring, value: Substring)>) {
            func all(_ name: String) -> [String] { query.filter { $0.key == name }.map { String($0.value) } }
            productIds = Set(all("productId"))
            productTypes = Set(all("productType").map { $0.uppercased() })
            groups = Set(all("subscriptionGroupIdentifier"))
            ownership = all("inAppOwnershipType").first
            revoked = all("revoked").first.flatMap { ["true": true, "false": false][$0.lowercased()] }
            start = all("startDate").first.flatMap { Int64($0) }
            end = all("endDate").first.flatMap { Int64($0) }
            descending = all("sort").first?.uppercased() == "DESCENDING"
        }

        /// Apple's product type names in this query.
        static func productType(_ type: String) -> String {
            switch type {
            case "auto_renewable": "AUTO_RENEWABLE"
            case "non_renewing": "NON_RENEWABLE"
            case "non_consumable": "NON_CONSUMABLE"
            default: "CONSUMABLE"
            }
        }

        func apply(to purchases: [FakeLedger.Purchase]) -> [FakeLedger.Purchase] {
            let kept = purchases.filter { purchase in
                let date = FakeAppStore.milliseconds(purchase.purchaseDate)
                return (productIds.isEmpty || productIds.contains(purchase.productId))
                    && (productTypes.isEmpty || productTypes.contains(Self.productType(purchase.type)))
                    // Every subscription of the fake is in one group.
                    && (groups.isEmpty || (purchase.type == "auto_renewable" && groups.contains(FakeStoreKit.subscriptionGroup)))
                    && (ownership.map { $0 == purchase.inAppOwnershipType } ?? true)
                    && (revoked.map { $0 == (purchase.cancellationDate != nil) } ?? true)
                    && (start.map { date >= $0 } ?? true) && (end.map { date < $0 } ?? true)
            }
            // Apple sorts by the date each transaction last changed.
            let sorted = kept.sorted { $0.modifiedSeq < $1.modifiedSeq }
            return descending ? sorted.reversed() : sorted
        }
    }

    /// The one subscription group of the fake's app.
    static let subscriptionGroup = "21000000"

    struct LookupAnswer: Encodable {
        var status: Int
        var signedTransactions: [String]
    }

    struct PageAnswer: Encodable {
        var revision: String
        var hasMore: Bool
        var bundleId: String
        var appAppleId: Int64
        var environment: String
        var signedTransactions: [String]
    }

    struct StatusesAnswer: Encodable {
        struct Group: Encodable {
            struct Last: Encodable {
                var status: Int
                var originalTransactionId: String
                var signedTransactionInfo: String
                var signedRenewalInfo: String
            }
            var subscriptionGroupIdentifier: String
            var lastTransactions: [Last]
        }
        var environment: String
        var bundleId: String
        var appAppleId: Int64
        var data: [Group]
    }

    struct HistoryAnswer: Encodable {
        struct Item: Encodable {
            struct Attempt: Encodable {
                var attemptDate: Int64
                var sendAttemptResult: String
            }
            var signedPayload: String
            var sendAttempts: [Attempt]
        }
        var notificationHistory: [Item]
        var hasMore: Bool
        var paginationToken: String?
    }

    /// 20 signed transactions per page, in the order `purchases` are sorted in (by their last
    /// change). The revision says how far the caller has read: asked with it, the answer holds
    /// only what changed after (ascending: a transaction refunded since comes again, with its
    /// refund), or, sorted descending, the next older page. Every answer carries a revision;
    /// one that found nothing new gives back the one it was asked with. A revision the fake did
    /// not make is Apple's 4000005.
    private func page(
        _ purchases: [FakeLedger.Purchase], descending: Bool, revision: String?, bundleId: String, environment: String
    ) throws -> PageAnswer {
        var cursor: Int64?
        if let revision {
            guard let seq = Self.revisionSeq(revision) else {
                throw APIError(status: .badRequest, errorCode: 4_000_005, errorMessage: "Invalid request revision.")
            }
            cursor = seq
        }
        let after = purchases.filter { purchase in
            guard let cursor else { return true }
            return descending ? purchase.modifiedSeq < cursor : purchase.modifiedSeq > cursor
        }
        let slice = after.prefix(20)
        let next = slice.last?.modifiedSeq ?? cursor ?? (descending ? Int64.max : 0)
        return PageAnswer(
            revision: Self.revisionToken(next), hasMore: after.count > slice.count, bundleId: bundleId,
            appAppleId: appAppleId, environment: environment, signedTransactions: try slice.map(signedTransaction))
    }

    /// An opaque revision, as Apple's are: where a caller's reading stands.
    static func revisionToken(_ seq: Int64) -> String {
        Data("rev:\(seq)".utf8).base64EncodedString()
    }

    static func revisionSeq(_ token: String) -> Int64? {
        guard let data = Data(base64Encoded: token), let text = String(data: data, encoding: .utf8), text.hasPrefix("rev:")
        else { return nil }
        return Int64(text.dropFirst(4))
    }

    /// Get Customer Groups' answer.
    private struct CustomerGroupsAnswer: Encodable {
        struct Group: Encodable {
            var groupId: String
            var groupType: String
            var roles: [Role]?
        }
        struct Role: Encodable {
            var productId: String
            var role: String
        }
        var groups: [Group]
    }

    /// Get Group Members' answer.
    private struct GroupMembersAnswer: Encodable {
        struct Member: Encodable { var appTransactionId: String }
        var members: [Member]
        var paginationToken: String?
        var hasMore: Bool
    }

    /// A purchase of the customer `id` names (a transaction or original transaction id of
    /// theirs, or their `appTransactionId`), nil when the app has no such customer here; 400
    /// 4000006 for an id that is not a number.
    private func customer(_ id: String, _ bundleId: String, _ environment: String) throws -> FakeLedger.Purchase? {
        guard !id.isEmpty, id.allSatisfy(\.isNumber) else {
            throw APIError(status: .badRequest, errorCode: 4_000_006, errorMessage: "Invalid transaction id.")
        }
        return try ledger.purchase(transactionId: id).flatMap { $0.bundleId == bundleId && $0.environment == environment ? $0 : nil }
            ?? ledger.purchases(bundleId: bundleId, environment: environment).first { Self.appTransactionId(of: $0) == id }
    }

    func found(_ transactionId: String, _ bundleId: String, _ environment: String) throws -> FakeLedger.Purchase {
        guard transactionId.allSatisfy(\.isNumber), !transactionId.isEmpty else {
            throw APIError(status: .badRequest, errorCode: 4_000_006, errorMessage: "Invalid transaction id.")
        }
        guard let purchase = try ledger.purchase(transactionId: transactionId), purchase.bundleId == bundleId,
            purchase.environment == environment
        else { throw Self.transactionNotFound }
        return purchase
    }

    /// Checks the bearer token, applies faults and latency, and renders Apple's answers and errors.
    func answer(
        _ request: Request, status: HTTPResponse.Status = .ok, naming transactionIds: Set<String> = [],
        _ body: (String) async throws -> some Encodable
    ) async throws -> Response {
        ledger.countServerAPICall()
        let latency = ledger.latencyMs
        if latency > 0 { try await Task.sleep(for: .milliseconds(latency)) }
        if ledger.failsAtRandom() { return Response(status: .serviceUnavailable) }
        guard let bundleId = authorizedBundleId(request) else {
            return Response(status: .unauthorized, body: .init(byteBuffer: ByteBuffer(string: "Unauthenticated\n")))
        }
        do {
            // A fault scoped to a transaction reaches the calls whose path names it (Finish Transaction).
            if let fault = ledger.takeFault(transactionIds: transactionIds, serverAPI: true), let httpStatus = fault.httpStatus {
                if let delay = fault.delayMs { try await Task.sleep(for: .milliseconds(delay)) }
                var response = Response(status: .init(code: httpStatus))
                if httpStatus == 429 {
                    response.headers[.retryAfter] = String(FakeAppStore.milliseconds(Date().addingTimeInterval(1)))
                }
                return response
            }
            let value = try await body(bundleId)
            if status == .accepted { return Response(status: .accepted) }
            return Response(
                status: status, headers: [.contentType: "application/json"],
                body: .init(byteBuffer: ByteBuffer(data: try JSONEncoder().encode(value))))
        } catch let error as APIError {
            return Response(
                status: error.status, headers: [.contentType: "application/json"],
                body: .init(
                    byteBuffer: ByteBuffer(
                        data: try JSONEncoder().encode(ErrorBody(errorCode: error.errorCode, errorMessage: error.errorMessage)))))
        }
    }

    /// The bundle id of a valid bearer token: ES256 by the configured key (`kid`), `typ` JWT,
    /// `iss` the issuer, `aud` appstoreconnect-v1, `bid` set, `exp` ahead (at most an hour
    /// after `iat` when there is one: Apple's own libraries send none) and at most an hour
    /// from now.
    private func authorizedBundleId(_ request: Request) -> String? {
        guard let apiKey, let header = request.headers[.authorization], header.hasPrefix("Bearer ") else { return nil }
        let parts = header.dropFirst(7).split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let headerJSON = Self.base64URLDecode(parts[0]), let claimsJSON = Self.base64URLDecode(parts[1]),
            let signature = Self.base64URLDecode(parts[2]),
            let jose = (try? JSONSerialization.jsonObject(with: headerJSON)) as? [String: Any],
            let claims = (try? JSONSerialization.jsonObject(with: claimsJSON)) as? [String: Any],
            jose["alg"] as? String == "ES256", jose["kid"] as? String == apiKey.keyId, jose["typ"] as? String == "JWT",
            let ecdsa = try? P256.Signing.ECDSASignature(rawRepresentation: signature),
            apiKey.publicKey.isValidSignature(ecdsa, for: Data("\(parts[0]).\(parts[1])".utf8)),
            claims["iss"] as? String == apiKey.issuerId, claims["aud"] as? String == "appstoreconnect-v1",
            let bundleId = claims["bid"] as? String, let expires = claims["exp"] as? Double
        else { return nil }
        let now = Date().timeIntervalSince1970
        guard expires > now, expires <= now + 3600 + 60 else { return nil }
        if let claim = claims["iat"] {
            guard let issuedAt = claim as? Double, expires - issuedAt <= 3600, issuedAt <= now + 60 else { return nil }
        }
        return bundleId
    }

    static func base64URLDecode(_ text: Substring) -> Data? {
        var base64 = text.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while base64.count % 4 != 0 { base64 += "=" }
        return Data(base64Encoded: base64)
    }
}
