public import Foundation
import IAPCore

/// Apple's dates in signed payloads: milliseconds since 1970.
extension Date {
    /// The date of Apple's milliseconds, taken as the nearest date within
    /// `DateText.acceptedMilliseconds` (1970…9999) when outside it: whatever a payload says,
    /// no date read from it traps a conversion or is unreadable once stored.
    public init(appleMilliseconds: Int64) {
        let bounded = min(max(appleMilliseconds, DateText.acceptedMilliseconds.lowerBound), DateText.acceptedMilliseconds.upperBound)
        self.init(timeIntervalSince1970: Double(bounded) / 1000)
    }

    /// This date as Apple writes it: milliseconds since 1970 (saturating outside 1970…9999).
    public var appleMilliseconds: Int64 {
        let raw = timeIntervalSince1970 * 1000
        guard !raw.isNaN else { return 0 }
        return Int64(min(max(raw, 0), Double(DateText.acceptedMilliseconds.upperBound)).rounded())
    }
}

/// Anything Apple signs carries the date it was signed and its environment.
public protocol SignedAppStorePayload: Decodable, Sendable {
    /// When Apple signed it (milliseconds since 1970); chains are validated at this time.
    var signedDate: Int64? { get }
}

/// A StoreKit 2 transaction (`JWSTransactionDecodedPayload`). Unknown fields are ignored;
/// every field Apple may omit is optional.
public struct JWSTransactionDecodedPayload: SignedAppStorePayload, Codable, Equatable {
    public var transactionId: String
    public var originalTransactionId: String
    public var bundleId: String
    public var productId: String
    public var environment: String
    public var purchaseDate: Int64?
    public var originalPurchaseDate: Int64?
    public var expiresDate: Int64?
    public var quantity: Int?
    /// "Auto-Renewable Subscription", "Non-Consumable", "Consumable" or "Non-Renewing Subscription".
    public var type: String?
    public var appAccountToken: String?
    public var inAppOwnershipType: String?
    public var signedDate: Int64?
    public var revocationDate: Int64?
    public var revocationReason: Int?
    /// REFUND_FULL, REFUND_PRORATED or FAMILY_REVOKE (kept as Apple spells it).
    public var revocationType: String?
    /// For a prorated refund: the share refunded, in milli-units of 100 %.
    public var revocationPercentage: Int?
    public var isUpgraded: Bool?
    public var webOrderLineItemId: String?
    public var subscriptionGroupIdentifier: String?
    public var transactionReason: String?
    public var storefront: String?
    public var storefrontId: String?
    public var price: Int64?
    public var currency: String?
    public var offerType: Int?
    public var offerIdentifier: String?
    public var appTransactionId: String?
    /// FREE_TRIAL, PAY_AS_YOU_GO, PAY_UP_FRONT, ONE_TIME (kept as Apple spells it).
    public var offerDiscountType: String?
    public var offerPeriod: String?
    /// BILLED_UPFRONT or MONTHLY (kept as Apple spells it).
    public var billingPlanType: String?
    /// A commitment plan's progress (API 1.21).
    public var commitmentInfo: CommitmentInfo?
    /// The chain a migrated subscription continues (2025).
    public var previousOriginalTransactionId: String?

    /// A commitment plan's progress: which billing period this is of how many, and until when.
    public struct CommitmentInfo: Codable, Equatable, Sendable {
        public var billingPeriodNumber: Int?
        public var totalBillingPeriods: Int?
        public var commitmentExpiresDate: Int64?
        public var commitmentPrice: Int64?
    }

    /// Creates a payload (the fake App Store signs these).
    public init(
        transactionId: String, originalTransactionId: String, bundleId: String, productId: String, environment: String,
        purchaseDate: Int64?, quantity: Int?, type: String?, signedDate: Int64?
    ) {
        self.transactionId = transactionId
        self.originalTransactionId = originalTransactionId
        self.bundleId = bundleId
        self.productId = productId
        self.environment = environment
        self.purchaseDate = purchaseDate
        self.originalPurchaseDate = purchaseDate
        self.quantity = quantity
        self.type = type
        self.signedDate = signedDate
    }
}

/// A subscription's renewal information (`JWSRenewalInfoDecodedPayload`).
public struct JWSRenewalInfoDecodedPayload: SignedAppStorePayload, Codable, Equatable {
    public var originalTransactionId: String
    public var productId: String?
    public var autoRenewProductId: String?
    /// 1: renews at the end of the period; 0: the user turned renewal off.
    public var autoRenewStatus: Int?
    public var environment: String
    public var expirationIntent: Int?
    public var gracePeriodExpiresDate: Int64?
    public var isInBillingRetryPeriod: Bool?
    public var renewalDate: Int64?
    public var recentSubscriptionStartDate: Int64?
    public var signedDate: Int64?
    public var appAccountToken: String?
    /// The next period's price, in milli-units of `currency`.
    public var renewalPrice: Int64?
    public var currency: String?
    public var offerType: Int?
    public var offerIdentifier: String?
    public var offerDiscountType: String?
    public var offerPeriod: String?
    /// 0: the customer has not answered a price increase that needs consent; 1: consented, or
    /// told of one that needs none.
    public var priceIncreaseStatus: Int?
    /// BILLED_UPFRONT or MONTHLY (kept as Apple spells it).
    public var renewalBillingPlanType: String?
    /// What a commitment plan renews to (API 1.21).
    public var commitmentInfo: RenewalCommitmentInfo?

    /// What a commitment plan renews to when it ends.
    public struct RenewalCommitmentInfo: Codable, Equatable, Sendable {
        public var commitmentAutoRenewProductId: String?
        public var commitmentAutoRenewStatus: Int?
        public var commitmentRenewalBillingPlanType: String?
        public var commitmentRenewalDate: Int64?
        public var commitmentRenewalPrice: Int64?
    }

    /// Creates renewal information (the fake App Store signs these).
    public init(originalTransactionId: String, productId: String?, autoRenewStatus: Int?, environment: String, signedDate: Int64?) {
        self.originalTransactionId = originalTransactionId
        self.productId = productId
        self.autoRenewProductId = productId
        self.autoRenewStatus = autoRenewStatus
        self.environment = environment
        self.signedDate = signedDate
    }
}

/// The app's download by one customer (`AppTransaction`, `JWSAppTransactionDecodedPayload`):
/// what a `RESCIND_CONSENT` notification's `appData` carries, signed, to say whose consent it is.
public struct AppTransactionDecodedPayload: SignedAppStorePayload, Codable, Equatable {
    /// The customer's download of the app: the same on every device of their account.
    public var appTransactionId: String?
    public var bundleId: String?
    public var appAppleId: Int64?
    /// `Production`, `Sandbox`, … (the environment).
    public var receiptType: String?
    public var originalPurchaseDate: Int64?
    public var receiptCreationDate: Int64?
    public var signedDate: Int64?
    /// Where the app was downloaded from (API 1.22; kept as Apple spells it).
    public var storeType: String?

    /// Creates one (the fake App Store signs these).
    public init(
        appTransactionId: String?, bundleId: String?, appAppleId: Int64?, receiptType: String?, originalPurchaseDate: Int64?,
        signedDate: Int64?
    ) {
        self.appTransactionId = appTransactionId
        self.bundleId = bundleId
        self.appAppleId = appAppleId
        self.receiptType = receiptType
        self.originalPurchaseDate = originalPurchaseDate
        self.receiptCreationDate = signedDate
        self.signedDate = signedDate
    }
}

/// An App Store Server Notification V2 (`ResponseBodyV2DecodedPayload`), delivered as
/// `{"signedPayload": "<JWS>"}`.
public struct ResponseBodyV2DecodedPayload: SignedAppStorePayload, Codable, Equatable {
    public struct NotificationData: Codable, Equatable, Sendable {
        public var appAppleId: Int64?
        public var bundleId: String?
        public var bundleVersion: String?
        public var environment: String?
        public var signedTransactionInfo: String?
        public var signedRenewalInfo: String?
        public var status: Int?
        public var consumptionRequestReason: String?

        /// Creates notification data.
        public init(
            appAppleId: Int64?, bundleId: String?, environment: String?, signedTransactionInfo: String?,
            signedRenewalInfo: String? = nil, status: Int? = nil, consumptionRequestReason: String? = nil
        ) {
            self.appAppleId = appAppleId
            self.bundleId = bundleId
            self.environment = environment
            self.signedTransactionInfo = signedTransactionInfo
            self.signedRenewalInfo = signedRenewalInfo
            self.status = status
            self.consumptionRequestReason = consumptionRequestReason
        }
    }

    /// The notification's summary (for requests that affect many subscriptions at once).
    public struct Summary: Codable, Equatable, Sendable {
        public var requestIdentifier: String?
        public var environment: String?
        public var appAppleId: Int64?
        public var bundleId: String?
        public var productId: String?
        public var storefrontCountryCodes: [String]?
        public var failedCount: Int64?
        public var succeededCount: Int64?
    }

    /// The app a notification about no purchase is for (`RESCIND_CONSENT`): its ids, its
    /// environment, and the customer's signed `AppTransaction`.
    public struct AppData: Codable, Equatable, Sendable {
        public var appAppleId: Int64?
        public var bundleId: String?
        public var environment: String?
        public var signedAppTransactionInfo: String?

        /// Creates app data.
        public init(appAppleId: Int64?, bundleId: String?, environment: String?, signedAppTransactionInfo: String?) {
            self.appAppleId = appAppleId
            self.bundleId = bundleId
            self.environment = environment
            self.signedAppTransactionInfo = signedAppTransactionInfo
        }
    }

    /// A token the app made for a purchase outside the App Store (`EXTERNAL_PURCHASE_TOKEN`).
    /// Its environment is in its id: a sandbox token's starts with `SANDBOX`.
    public struct ExternalPurchaseToken: Codable, Equatable, Sendable {
        public var externalPurchaseId: String?
        public var tokenCreationDate: Int64?
        public var appAppleId: Int64?
        public var bundleId: String?
        /// What kind of token, as Apple spells it (`CORE_TECHNOLOGY`, …).
        public var tokenType: String?
    }

    public var notificationType: String
    public var subtype: String?
    public var notificationUUID: String
    public var data: NotificationData?
    public var summary: Summary?
    public var externalPurchaseToken: ExternalPurchaseToken?
    public var appData: AppData?
    public var version: String?
    public var signedDate: Int64?

    /// Creates a notification (the fake App Store signs these).
    public init(
        notificationType: String, subtype: String?, notificationUUID: String, data: NotificationData?, signedDate: Int64?,
        appData: AppData? = nil
    ) {
        self.notificationType = notificationType
        self.subtype = subtype
        self.notificationUUID = notificationUUID
        self.data = data
        self.appData = appData
        self.version = "2.0"
        self.signedDate = signedDate
    }

    /// The app's bundle id, environment and App Store id, from the first of `data`, `summary`,
    /// `externalPurchaseToken` and `appData` the notification has (as Apple's library reads them): nothing from a
    /// later one when an earlier one is there without it.
    var bundleId: String? { identity.bundleId }
    var environment: String? { identity.environment }
    var appAppleId: Int64? { identity.appAppleId }

    private var identity: (bundleId: String?, environment: String?, appAppleId: Int64?) {
        if let data { return (data.bundleId, data.environment, data.appAppleId) }
        if let summary { return (summary.bundleId, summary.environment, summary.appAppleId) }
        if let token = externalPurchaseToken {
            let sandbox = token.externalPurchaseId?.hasPrefix("SANDBOX") == true
            return (token.bundleId, sandbox ? "Sandbox" : "Production", token.appAppleId)
        }
        if let appData { return (appData.bundleId, appData.environment, appData.appAppleId) }
        return (nil, nil, nil)
    }
}
