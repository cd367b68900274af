public import Foundation

/// One purchase that Apple confirmed, as the verifier read it from Apple's answer.
public struct VerifiedPurchase: Codable, Sendable, Equatable {
    /// The most units one purchase may carry (Apple's receipts hold a 32-bit quantity): a
    /// quantity from outside is bounded to 1…this where it is decoded.
    public static let maxQuantity = Int(Int32.max)
    /// Apple's id of this transaction; the unit of crediting.
    public var transactionId: String
    /// The first transaction of a subscription chain (equal to `transactionId` for most purchases).
    public var originalTransactionId: String
    /// The App Store product identifier.
    public var productId: String
    /// How many units were bought.
    public var quantity: Int
    /// When Apple charged the user.
    public var purchaseDate: Date?
    /// Which App Store world the purchase was made in.
    public var environment: AppStoreEnvironment
    /// When Apple refunded or revoked it; such a purchase is never credited (but for the
    /// units a prorated refund left).
    public var cancellationDate: Date?
    /// Apple's `revocationType`: REFUND_FULL, REFUND_PRORATED or FAMILY_REVOKE; nil when not
    /// revoked or not said.
    public var revocationType: String?
    /// Apple's `revocationPercentage` of a prorated refund, in milli-units of 100 % (33,333
    /// for one of three units).
    public var revocationPercentage: Int?
    /// For subscriptions: when the period ends.
    public var expiresDate: Date?
    /// The UUID the app set (`appAccountToken`, or StoreKit 1's `applicationUsername` when a UUID):
    /// our order id.
    public var appAccountToken: String?
    /// For auto-renewable subscriptions: Apple's id of the billing period (the same for a
    /// restore of that period, new for every renewal). What a subscription is credited by.
    public var webOrderLineItemId: String?
    /// `PURCHASED`, or `FAMILY_SHARED` for a family member's access to another's purchase.
    public var ownershipType: String?
    /// Apple replaced this subscription transaction by an upgrade: never credited.
    public var isUpgraded: Bool?
    /// Apple's `transactionReason`: PURCHASE for a purchase the customer made (a first
    /// purchase, a resubscription, an upgrade or crossgrade), RENEWAL for an automatic renewal;
    /// nil where Apple's answer does not say (`verifyReceipt`).
    public var transactionReason: String?
    /// When the chain's first transaction was bought (Apple's `originalPurchaseDate`); a
    /// restore of a period keeps that period's `purchaseDate`.
    public var originalPurchaseDate: Date?
    /// When Apple signed what this purchase was read from (StoreKit 2), for ordering states.
    public var signedDate: Date?
    /// For receipts looked up through the App Store Server API: whether the uploaded receipt
    /// itself holds this transaction (false for history the receipt does not prove); nil
    /// when Apple's answer is about the upload itself.
    public var inUploadedReceipt: Bool?
    /// What the upload proves about who made this purchase; nil in results of earlier
    /// versions, read as `inUploadedReceipt` says (see `ownershipEvidence`).
    public var evidence: OwnershipEvidence?
    /// The chain this subscription continues (Apple's `previousOriginalTransactionId`): a
    /// migrated subscription starts a new original transaction; its owner is the old chain's.
    public var previousOriginalTransactionId: String?
    /// What Apple's signed transaction says the customer paid and under which offer; nil where
    /// Apple's answer does not say (`verifyReceipt`, receipts read offline).
    public var terms: PurchaseTerms?
    /// For a period of a subscription: when the latest other period of its chain that the same
    /// answer lists as bought before it ends, and its product (`VerifiedReceipt.init` reads
    /// them from the listing). A receipt says no `transactionReason`; its own dates say whether
    /// this period was bought after the chain lapsed or while another product's period was in
    /// force (a new purchase), as the ledger reads them. Nil when the answer lists none.
    public var previousPeriodEnd: Date?
    /// The product of the period `previousPeriodEnd` ends.
    public var previousPeriodProductId: String?

    /// What the upload proves: `evidence`, else a lookup when the receipt did not hold it,
    /// else Apple's signed word about the upload itself.
    public var ownershipEvidence: OwnershipEvidence {
        evidence ?? (inUploadedReceipt == false ? .lookup : .signedUpload)
    }

    /// Creates a purchase.
    public init(
        transactionId: String, originalTransactionId: String, productId: String, quantity: Int,
        purchaseDate: Date?, environment: AppStoreEnvironment, cancellationDate: Date? = nil, expiresDate: Date? = nil,
        appAccountToken: String? = nil, webOrderLineItemId: String? = nil, ownershipType: String? = nil,
        isUpgraded: Bool? = nil, signedDate: Date? = nil
    ) {
        self.webOrderLineItemId = webOrderLineItemId
        self.ownershipType = ownershipType
        self.isUpgraded = isUpgraded
        self.signedDate = signedDate
        self.appAccountToken = appAccountToken
        self.transactionId = transactionId
        self.originalTransactionId = originalTransactionId
        self.productId = productId
        self.quantity = quantity
        self.purchaseDate = purchaseDate
        self.environment = environment
        self.cancellationDate = cancellationDate
        self.expiresDate = expiresDate
    }
}

/// What an upload proves about who made a purchase it carries.
public enum OwnershipEvidence: String, Codable, Sendable, Hashable, CaseIterable {
    /// Apple vouches that the uploaded data itself holds the purchase: a signed transaction
    /// the app uploaded and we verified, or Apple's `verifyReceipt` answer about the uploaded
    /// receipt. Whoever uploads it had it on their device.
    case signedUpload = "signed_upload"
    /// Found by a lookup: a bare transaction id, the ids of a receipt read without its
    /// signature checked, or the account's history. Apple says the purchase exists, not who
    /// made it: credited only on another proof (an `appAccountToken` naming the uploader's
    /// order, the same purchase already theirs, the subscription it renews theirs).
    case lookup
}

/// What a purchase cost and under which offer, as Apple's signed transaction says (App Store
/// Server API up to 1.21). Values Apple adds later are kept as Apple spells them.
public struct PurchaseTerms: Codable, Sendable, Equatable {
    /// The price in milli-units of `currency` (990 is 0.99).
    public var price: Int64?
    /// ISO 4217.
    public var currency: String?
    /// 1 introductory, 2 promotional, 3 offer code, 4 win-back.
    public var offerType: Int?
    public var offerIdentifier: String?
    /// FREE_TRIAL, PAY_AS_YOU_GO, PAY_UP_FRONT, ONE_TIME.
    public var offerDiscountType: String?
    /// ISO 8601 duration of the offer (`P1M`).
    public var offerPeriod: String?
    /// BILLED_UPFRONT or MONTHLY (a commitment billed monthly).
    public var billingPlanType: String?
    /// The customer's download of the app (one per customer and app).
    public var appTransactionId: String?
    /// Apple's `inAppOwnershipType` when it is not `PURCHASED`: `FAMILY_SHARED`, `ASSIGNED` (a
    /// multiseat seat), or a value Apple adds, as spelled.
    public var ownershipType: String?

    /// Creates terms.
    public init(
        price: Int64? = nil, currency: String? = nil, offerType: Int? = nil, offerIdentifier: String? = nil,
        offerDiscountType: String? = nil, offerPeriod: String? = nil, billingPlanType: String? = nil,
        appTransactionId: String? = nil, ownershipType: String? = nil
    ) {
        self.ownershipType = ownershipType
        self.price = price
        self.currency = currency
        self.offerType = offerType
        self.offerIdentifier = offerIdentifier
        self.offerDiscountType = offerDiscountType
        self.offerPeriod = offerPeriod
        self.billingPlanType = billingPlanType
        self.appTransactionId = appTransactionId
    }

    /// A commitment plan's progress at this transaction (Apple's `commitmentInfo`); nil for a
    /// purchase that is no commitment.
    public var commitment: CommitmentProgress?

    /// Whether it says anything at all.
    public var isEmpty: Bool { self == PurchaseTerms() }
}

/// Where a commitment plan (a subscription committed to for several billing periods, billed
/// monthly or up front) stands at one transaction, as Apple's `commitmentInfo` signs it.
public struct CommitmentProgress: Codable, Sendable, Equatable {
    /// This billing period's number within the commitment (1 for the first).
    public var billingPeriodNumber: Int?
    /// How many billing periods the commitment has.
    public var totalBillingPeriods: Int?
    /// When the commitment ends.
    public var commitmentExpiresDate: Date?
    /// The whole commitment's price, in milli-units of the transaction's currency.
    public var commitmentPrice: Int64?

    /// Creates a commitment's progress.
    public init(billingPeriodNumber: Int? = nil, totalBillingPeriods: Int? = nil, commitmentExpiresDate: Date? = nil, commitmentPrice: Int64? = nil) {
        self.billingPeriodNumber = billingPeriodNumber
        self.totalBillingPeriods = totalBillingPeriods
        self.commitmentExpiresDate = commitmentExpiresDate
        self.commitmentPrice = commitmentPrice
    }
}

/// What a commitment plan renews to when it ends, as Apple's renewal information's
/// `commitmentInfo` signs it.
public struct CommitmentRenewal: Codable, Sendable, Equatable {
    /// The product the next commitment renews to.
    public var autoRenewProductId: String?
    /// 1: the commitment renews; 0: it ends.
    public var autoRenewStatus: Int?
    /// BILLED_UPFRONT or MONTHLY, as Apple spells it.
    public var billingPlanType: String?
    /// When the next commitment begins.
    public var renewalDate: Date?
    /// The next commitment's price, in milli-units of the renewal's currency.
    public var renewalPrice: Int64?

    /// Creates a commitment's renewal.
    public init(
        autoRenewProductId: String? = nil, autoRenewStatus: Int? = nil, billingPlanType: String? = nil, renewalDate: Date? = nil,
        renewalPrice: Int64? = nil
    ) {
        self.autoRenewProductId = autoRenewProductId
        self.autoRenewStatus = autoRenewStatus
        self.billingPlanType = billingPlanType
        self.renewalDate = renewalDate
        self.renewalPrice = renewalPrice
    }
}

/// What a subscription renews to, as Apple's signed renewal information says
/// (`JWSRenewalInfoDecodedPayload`): the product, price and offer of the next period, and the
/// customer's answer to a price increase.
public struct RenewalTerms: Codable, Sendable, Equatable {
    /// The product the next period renews to (a downgrade takes effect there).
    public var autoRenewProductId: String?
    /// The next period's price in milli-units of `currency`.
    public var renewalPrice: Int64?
    /// ISO 4217.
    public var currency: String?
    /// The offer the next period renews with: 1 introductory, 2 promotional, 3 offer code, 4 win-back.
    public var offerType: Int?
    public var offerIdentifier: String?
    /// FREE_TRIAL, PAY_AS_YOU_GO, PAY_UP_FRONT, ONE_TIME.
    public var offerDiscountType: String?
    /// ISO 8601 duration of the offer (`P1M`).
    public var offerPeriod: String?
    /// Apple's `priceIncreaseStatus`: 0 the customer has not answered a price increase that needs
    /// their consent (without it the subscription expires at the renewal date), 1 they consented
    /// or were told of one that needs none; nil when Apple said nothing of one.
    public var priceIncreaseStatus: Int?
    /// How the next period is billed (`renewalBillingPlanType`: BILLED_UPFRONT or MONTHLY).
    public var billingPlanType: String?
    /// What the commitment plan renews to when it ends; nil for no commitment.
    public var commitment: CommitmentRenewal?

    /// Creates terms.
    public init(
        autoRenewProductId: String? = nil, renewalPrice: Int64? = nil, currency: String? = nil, offerType: Int? = nil,
        offerIdentifier: String? = nil, offerDiscountType: String? = nil, offerPeriod: String? = nil,
        priceIncreaseStatus: Int? = nil
    ) {
        self.autoRenewProductId = autoRenewProductId
        self.renewalPrice = renewalPrice
        self.currency = currency
        self.offerType = offerType
        self.offerIdentifier = offerIdentifier
        self.offerDiscountType = offerDiscountType
        self.offerPeriod = offerPeriod
        self.priceIncreaseStatus = priceIncreaseStatus
    }

    /// What a price increase's state reads as: `pending` (the customer's consent is awaited),
    /// `accepted`, or nil when none was told.
    public var priceIncrease: String? {
        switch priceIncreaseStatus {
        case 0: "pending"
        case 1: "accepted"
        default: nil
        }
    }
}

/// What Send Consumption Information (v2) tells Apple about a refund request.
public struct ConsumptionInformation: Codable, Sendable, Equatable {
    public var customerConsented: Bool
    /// DELIVERED, UNDELIVERED_QUALITY_ISSUE, UNDELIVERED_WRONG_ITEM, UNDELIVERED_SERVER_OUTAGE, UNDELIVERED_OTHER.
    public var deliveryStatus: String
    public var sampleContentProvided: Bool
    /// Consumed share in milliunits (100000 is all of it), when known.
    public var consumptionPercentage: Int?
    /// DECLINE, GRANT_FULL or GRANT_PRORATED, when the app has a preference.
    public var refundPreference: String?

    /// Creates the information.
    public init(
        customerConsented: Bool, deliveryStatus: String, sampleContentProvided: Bool, consumptionPercentage: Int?,
        refundPreference: String?
    ) {
        self.customerConsented = customerConsented
        self.deliveryStatus = deliveryStatus
        self.sampleContentProvided = sampleContentProvided
        self.consumptionPercentage = consumptionPercentage
        self.refundPreference = refundPreference
    }
}

/// A receipt that Apple confirmed as genuine, with every purchase it holds.
public struct VerifiedReceipt: Codable, Sendable, Equatable {
    /// The app the receipt belongs to, as Apple says.
    public var bundleId: String
    /// The world Apple verified it in.
    public var environment: AppStoreEnvironment
    /// Every purchase Apple listed for the receipt.
    public var purchases: [VerifiedPurchase]

    /// Creates a verified receipt; each period's `previousPeriodEnd` is read from `purchases`.
    public init(bundleId: String, environment: AppStoreEnvironment, purchases: [VerifiedPurchase]) {
        self.bundleId = bundleId
        self.environment = environment
        self.purchases = VerifiedPurchase.withPreviousPeriods(purchases)
    }
}

extension VerifiedPurchase {
    /// `purchases`, one answer's listing, with each period's `previousPeriodEnd` and
    /// `previousPeriodProductId`: the other period of its chain (another billing period, by its
    /// web order line item id) bought latest before it, as the listing dates them. A listing
    /// may hold a transaction twice (`verifyReceipt`'s `in_app` and `latest_receipt_info`).
    public static func withPreviousPeriods(_ purchases: [VerifiedPurchase]) -> [VerifiedPurchase] {
        // Each chain's periods by purchase date: a receipt may list years of them, so each
        // purchase finds its previous one by a binary search, not by a pass over its chain.
        var chains: [String: [(bought: Date, ends: Date, lineItem: String, productId: String)]] = [:]
        for purchase in purchases {
            guard let bought = purchase.purchaseDate, let ends = purchase.expiresDate, let lineItem = purchase.webOrderLineItemId
            else { continue }
            chains[purchase.originalTransactionId, default: []].append((bought, ends, lineItem, purchase.productId))
        }
        guard chains.values.contains(where: { $0.count > 1 }) else { return purchases }
        for key in chains.keys { chains[key]!.sort { ($0.bought, $0.ends) < ($1.bought, $1.ends) } }
        return purchases.map { purchase in
            guard let bought = purchase.purchaseDate, let lineItem = purchase.webOrderLineItemId,
                let chain = chains[purchase.originalTransactionId]
            else { return purchase }
            // The first period bought at or after it; the one before that, past this very
            // period's copies (the same line item listed twice), is the previous one.
            var low = 0
            var high = chain.count
            while low < high {
                let middle = (low + high) / 2
                if chain[middle].bought < bought { low = middle + 1 } else { high = middle }
            }
            var index = low - 1
            while index >= 0, chain[index].lineItem == lineItem { index -= 1 }
            guard index >= 0 else { return purchase }
            var listed = purchase
            listed.previousPeriodEnd = chain[index].ends
            listed.previousPeriodProductId = chain[index].productId
            return listed
        }
    }
}

/// A stable, machine-readable reason, extensible without breaking decoding.
public struct ReasonCode: RawRepresentable, Codable, Sendable, Hashable, CustomStringConvertible {
    /// The wire form, e.g. `invalid_receipt`.
    public var rawValue: String
    /// Wraps a wire form.
    public init(rawValue: String) { self.rawValue = rawValue }
    /// Wraps a wire form.
    public init(_ rawValue: String) { self.rawValue = rawValue }
    /// The wire form.
    public var description: String { rawValue }

    public init(from decoder: any Decoder) throws {
        self.rawValue = try decoder.singleValueContainer().decode(String.self)
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.singleValueContainer()
        try container.encode(rawValue)
    }

    /// Apple said the receipt is not a valid receipt (21000, 21002 repeatedly, 21003, 21010).
    public static let invalidReceipt = ReasonCode("invalid_receipt")
    /// The receipt belongs to an app this deployment does not serve.
    public static let bundleIdMismatch = ReasonCode("bundle_id_mismatch")
    /// Apple could not be reached, timed out, or answered with a server error.
    public static let appleUnavailable = ReasonCode("apple_unavailable")
    /// Apple answered 21002: malformed, or a temporary issue; retried a few times.
    public static let appleMalformed = ReasonCode("apple_malformed")
    /// Apple answered with a status that asks us to try again later.
    public static let appleRetryable = ReasonCode("apple_retryable")
    /// Our shared secret does not match Apple's (21004): a configuration fault, never the user's.
    public static let sharedSecretMismatch = ReasonCode("shared_secret_mismatch")
    /// Apple answered with something this version does not understand.
    public static let unexpectedAppleResponse = ReasonCode("unexpected_apple_response")
    /// Retries went on for longer than the configured maximum age.
    public static let retriesExhausted = ReasonCode("retries_exhausted")
    /// Every purchase in the upload had been credited to another user first.
    public static let replayedFromOtherUser = ReasonCode("replayed_from_other_user")
    /// The transaction the upload named is not in the receipt yet: the app should refresh
    /// its receipt and upload again (Apple sometimes tells the app before the receipt has it).
    public static let transactionNotInReceipt = ReasonCode("transaction_not_in_receipt")
    /// The StoreKit 1 transaction the upload names is not in the receipt, as Apple's restores
    /// often are not (StoreKit 1's id "may not be the same" as the receipt's), but the receipt
    /// holds the purchase it stands for (the original transaction the upload named, of the same
    /// product), settled: the app may finish it. Only for non-consumables and subscriptions,
    /// which stay in every later receipt; a consumable missing from its receipt never is.
    public static let originalTransactionSettled = ReasonCode("original_transaction_settled")
    /// The upload names an order that is not one of the uploader's (unknown, or another user's):
    /// it says nothing of the purchase the app holds, so the top-level advice is not to finish;
    /// each transaction's own advice says what is settled.
    public static let orderUnknown = ReasonCode("order_unknown")
    /// The upload names an order alone, with no purchase of it carrying the order's token:
    /// which transaction the app holds for it only the app knows. `rejected` when more than one
    /// purchase or order of its product could be the one it was placed for (the server never
    /// pays an order on a guess); `credited` when the one purchase that can be its paid it, but
    /// the app is still not told to finish on a match of dates. Either way the app uploads again
    /// naming the transaction it holds for the order (`transactionId` with `orderId`); never
    /// finishes on this answer.
    public static let nameTheTransaction = ReasonCode("name_the_transaction")
    /// Apple reported an internal error it will not recover from for this receipt.
    public static let appleUnresolvable = ReasonCode("apple_unresolvable")
    /// A sandbox purchase, refused by the deployment's sandbox policy.
    public static let sandboxNotAllowed = ReasonCode("sandbox_not_allowed")
    /// Apple knows no such transaction, in production or in the sandbox: a signed transaction
    /// the App Store Server API does not know (earlier versions said it of a bare id too; a bare
    /// id is now answered `proof_required`, whatever Apple knows of it).
    public static let transactionNotFound = ReasonCode("transaction_not_found")
    /// A bare transaction id that proves nothing: no purchase of it is, or becomes, the
    /// uploader's. Answered alike whatever the id is (unknown to Apple, a purchase nobody
    /// uploaded yet, someone else's, a refunded one), with nothing listed, so that a lookup
    /// tells a stranger nothing and opens no case for customer service. Never finishable: the
    /// app may hold that very purchase, unproven. It uploads the signed transaction (StoreKit 2)
    /// or the receipt that holds it, whose answer settles it.
    public static let proofRequired = ReasonCode("proof_required")
    /// The upload needs a way of verifying that this deployment has not configured.
    public static let notConfigured = ReasonCode("not_configured")
    /// The App Store Server API refused our token: our key, issuer or bundle id is wrong.
    public static let serverAPIUnauthorized = ReasonCode("server_api_unauthorized")
    /// Apple answered 21000: our request to `verifyReceipt` was malformed. A fault of this
    /// deployment, never of the purchase: retried and alerted.
    public static let appleBadRequest = ReasonCode("apple_bad_request")
    /// A signed answer from Apple's own Server API failed our checks: a person must look.
    public static let appleAnswerUnverified = ReasonCode("apple_answer_unverified")
    /// Apple refunded or revoked the purchase (before or after it was uploaded).
    public static let purchaseRevoked = ReasonCode("purchase_revoked")
    /// The purchase (a restore, or the same purchase on another device) is credited to
    /// another user of the app, who keeps it.
    public static let ownedByOtherUser = ReasonCode("owned_by_other_user")
    /// Apple lists the purchase for the customer, but the upload does not prove that the
    /// uploader made it (a bare transaction id, a receipt read without its signature checked):
    /// held for customer service.
    public static let ownerUnknown = ReasonCode("owner_unknown")
    /// A new purchase in a subscription's chain (a resubscription, an upgrade) that Apple told
    /// of and nothing proves whose it is yet (the same Apple ID may serve several accounts of
    /// the app): held until its buyer's upload (a signed transaction, a receipt holding it) or an
    /// order's token proves it; the periods after it wait with it.
    public static let buyerUnknown = ReasonCode("buyer_unknown")
    /// Customer service granted this Apple transaction by hand to another user, on that user's
    /// word (goodwill naming its id, before any upload), and this upload proves it was bought
    /// by its uploader: held for customer service, never finished as another user's.
    public static let grantedByHandToAnotherUser = ReasonCode("granted_by_hand_to_another_user")
    /// Credited when the upload was answered, and taken back since by customer service (or
    /// moved to another user by a restore): the app keeps the transaction; customer service
    /// answers the customer.
    public static let revokedByCustomerService = ReasonCode("revoked_by_customer_service")
    /// Apple's transaction history for the receipt's transaction is empty: a person looks
    /// (never a rejection: Apple did not say the receipt is invalid).
    public static let appleHistoryEmpty = ReasonCode("apple_history_empty")
    /// Our own reader could not read the receipt on the App Store Server API route: a person
    /// looks (never a rejection: Apple did not say the receipt is invalid).
    public static let receiptUnreadable = ReasonCode("receipt_unreadable")
    /// The receipt's PKCS#7 signature provably does not cover its content (a byte changed,
    /// another key's signature): rejected, but our own check, not Apple's word, so the app is
    /// not told to finish.
    public static let receiptSignatureInvalid = ReasonCode("receipt_signature_invalid")
    /// The receipt is soundly signed by a chain that ends in no trusted root (re-signed with
    /// another key, Xcode's StoreKit testing certificate), or its signed data cannot be checked
    /// here, on a route where its signature is the proof: a person looks.
    public static let receiptUntrustedChain = ReasonCode("receipt_untrusted_chain")
    /// The receipt is one of Xcode's StoreKit testing (its type says `Xcode`, and Apple did not
    /// sign it): nobody paid for it. Rejected outside `IAP_ENVIRONMENT=xcode`; our own check, so
    /// the app is not told to finish.
    public static let xcodeReceipt = ReasonCode("xcode_receipt")

    /// Rejections after which the app may finish its transactions: Apple said the receipt or
    /// transaction is invalid, unknown or refunded, it is not real money, it is credited (to
    /// another user), or the signed data cannot be Apple's. Any other rejection, including
    /// those our own settings could cause, keeps the transaction unfinished.
    public static let finishableRejections: Set<ReasonCode> = [
        .invalidReceipt, .transactionNotFound, .replayedFromOtherUser, .ownedByOtherUser, .purchaseRevoked,
        .sandboxNotAllowed,
        // Signed data that cannot be Apple's, whatever our settings: malformed or forged.
        ReasonCode("jws_malformed"), ReasonCode("jws_unsupported_algorithm"), ReasonCode("jws_invalid_chain_length"),
        ReasonCode("jws_missing_apple_extension"), ReasonCode("jws_invalid_signature"),
        // Not here, on purpose: bundle_id_mismatch, environment_mismatch, app_apple_id_mismatch,
        // jws_untrusted_chain, jws_certificate_expired and jws_invalid_certificate also follow from
        // our own settings (bundle ids, app id, trusted roots) or clock: a genuine purchase is held.
    ]
}

/// Which sandbox purchases are credited. A sandbox purchase costs nothing, but App Review
/// buys in the sandbox against the production server, so `accept` is the default.
public enum SandboxPolicy: Sendable, Equatable {
    /// Credit sandbox purchases like real ones.
    case accept
    /// Reject every sandbox purchase.
    case reject
    /// Credit sandbox purchases of these users only (testers, reviewers).
    case allowlist(Set<String>)

    /// Whether a sandbox purchase of `userId` is credited.
    public func allows(userId: String) -> Bool {
        switch self {
        case .accept: true
        case .reject: false
        case .allowlist(let users): users.contains(userId)
        }
    }
}

/// What happens when another user of the app uploads a restore (a new transaction id of a
/// non-consumable or subscription period already credited to someone).
public enum RestorePolicy: String, Sendable, Equatable, CaseIterable {
    /// The entitlement stays with its first owner; the other user gets nothing.
    case keep
    /// The entitlement moves to the user who restored it (revoked for the previous owner).
    case transfer
}

/// Who tells Apple a credited transaction is finished (`IAP_FINISH_TRANSACTIONS`).
///
/// Apple's Finish Transaction (App Store Server API 1.20) lets the server finish a transaction
/// once it delivered the content, as the app's `finish()` does: a purchase is then finished
/// even when the app never comes back. Either way only a settled transaction is finished.
public enum FinishMode: String, Sendable, Equatable, CaseIterable {
    /// The app finishes, on the status answer's advice; the server never calls Apple for it.
    case app
    /// The server finishes each transaction it settled, and the answers never tell the app to
    /// (`finishTransaction` stays false; `finishedBy` says when Apple confirmed the server's
    /// call): for apps whose StoreKit code leaves finishing to the server.
    case server
    /// The server finishes each transaction it settled, and the answers tell the app it may
    /// finish too, as with `app`; Apple takes both, whichever comes first.
    case both

    /// Whether the order service calls Finish Transaction.
    public var serverFinishes: Bool { self != .app }
    /// Whether the status answers may tell the app to finish.
    public var appFinishes: Bool { self != .server }
}

/// An App Store Server Notification V2, verified: what the finisher needs to apply it.
public struct AppStoreNotification: Codable, Sendable, Equatable {
    /// Apple's id of the notification; the same notification applies once.
    public var notificationUUID: String
    /// REFUND, REVOKE, REFUND_REVERSED, DID_RENEW, SUBSCRIBED, EXPIRED, DID_FAIL_TO_RENEW,
    /// GRACE_PERIOD_EXPIRED, CONSUMPTION_REQUEST, TEST, …
    public var notificationType: String
    public var subtype: String?
    public var environment: AppStoreEnvironment
    public var bundleId: String?
    public var signedDate: Date?
    /// The transaction the notification is about (verified), if any.
    public var purchase: VerifiedPurchase?
    /// Apple's subscription status (1 active, 2 expired, 3 billing retry, 4 grace period, 5 revoked).
    public var subscriptionStatus: Int?
    /// From the signed renewal info: whether the subscription renews (1) or not (0).
    public var autoRenewStatus: Int?
    /// From the signed renewal info: the end of a billing grace period.
    public var gracePeriodExpiresDate: Date?
    /// For CONSUMPTION_REQUEST: why the customer asked for a refund.
    public var consumptionRequestReason: String?
    /// For RESCIND_CONSENT: the customer's download of the app (`appTransactionId` of the
    /// verified `AppTransaction` in `appData`), when Apple sent one.
    public var appTransactionId: String?
    /// From the signed renewal info: what the subscription renews to (price, offer, a price
    /// increase's consent).
    public var renewal: RenewalTerms?
    /// For RENEWAL_EXTENSION SUMMARY: how a renewal-date extension for every active subscriber
    /// of a product ended.
    public var extensionSummary: ExtensionSummary?

    /// Apple's summary of a mass renewal-date extension (`summary`).
    public struct ExtensionSummary: Codable, Sendable, Equatable {
        public var requestIdentifier: String
        public var productId: String
        public var storefrontCountryCodes: [String]
        public var succeededCount: Int64
        public var failedCount: Int64

        /// Creates a summary.
        public init(requestIdentifier: String, productId: String, storefrontCountryCodes: [String], succeededCount: Int64, failedCount: Int64) {
            self.requestIdentifier = requestIdentifier
            self.productId = productId
            self.storefrontCountryCodes = storefrontCountryCodes
            self.succeededCount = succeededCount
            self.failedCount = failedCount
        }
    }

    /// Creates a notification.
    public init(
        notificationUUID: String, notificationType: String, subtype: String?, environment: AppStoreEnvironment,
        bundleId: String?, signedDate: Date?, purchase: VerifiedPurchase?, subscriptionStatus: Int? = nil,
        autoRenewStatus: Int? = nil, gracePeriodExpiresDate: Date? = nil, consumptionRequestReason: String? = nil,
        appTransactionId: String? = nil, renewal: RenewalTerms? = nil
    ) {
        self.renewal = renewal
        self.appTransactionId = appTransactionId
        self.notificationUUID = notificationUUID
        self.notificationType = notificationType
        self.subtype = subtype
        self.environment = environment
        self.bundleId = bundleId
        self.signedDate = signedDate
        self.purchase = purchase
        self.subscriptionStatus = subscriptionStatus
        self.autoRenewStatus = autoRenewStatus
        self.gracePeriodExpiresDate = gracePeriodExpiresDate
        self.consumptionRequestReason = consumptionRequestReason
    }
}

/// What one verification attempt concluded. A transient failure is its own case,
/// so it can never be mistaken for a rejection.
public enum VerificationOutcome: Sendable, Equatable {
    /// Apple confirmed the receipt.
    case verified(VerifiedReceipt)
    /// A notification from Apple, verified.
    case notification(AppStoreNotification)
    /// The receipt is definitively not acceptable.
    case rejected(ReasonCode, message: String)
    /// Apple could not answer now; try again later.
    case retryLater(ReasonCode, message: String)
    /// Neither valid nor provably invalid, and retrying will not help (Apple's non-retryable
    /// 21100–21199): a person has to look. Never a rejection.
    case needsReview(ReasonCode, message: String)
}

/// The verifier's message to the finisher about one attempt on one submission.
public struct VerifyResult: Codable, Sendable, Equatable {
    /// The submission this result is about.
    public var submissionId: SubmissionID
    /// The user who uploaded it (repeated so the finisher needs no lookup).
    public var userId: String
    /// Our order the upload named, if any.
    public var orderId: String?
    /// Which attempt produced this result.
    public var attempt: Int
    /// What the attempt concluded.
    public var outcome: VerificationOutcome
    /// For `retryLater`: when the next attempt is due.
    public var nextAttemptAt: Date?
    /// For `retryLater`: retries went on for longer than allowed and stop here; the
    /// submission needs a person, it is not rejected.
    public var gaveUp: Bool

    /// Creates a result.
    public init(
        submissionId: SubmissionID, userId: String, orderId: String?, attempt: Int,
        outcome: VerificationOutcome, nextAttemptAt: Date? = nil, gaveUp: Bool = false
    ) {
        self.submissionId = submissionId
        self.userId = userId
        self.orderId = orderId
        self.attempt = attempt
        self.outcome = outcome
        self.nextAttemptAt = nextAttemptAt
        self.gaveUp = gaveUp
    }
}

extension VerificationOutcome: Codable {
    private enum CodingKeys: String, CodingKey { case kind, receipt, reason, message, notification }
    private enum Kind: String, Codable {
        case verified, rejected, notification
        case retryLater = "retry_later"
        case needsReview = "needs_review"
    }

    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        switch try container.decode(Kind.self, forKey: .kind) {
        case .verified:
            self = .verified(try container.decode(VerifiedReceipt.self, forKey: .receipt))
        case .notification:
            self = .notification(try container.decode(AppStoreNotification.self, forKey: .notification))
        case .rejected:
            self = .rejected(
                try container.decode(ReasonCode.self, forKey: .reason),
                message: try container.decode(String.self, forKey: .message))
        case .retryLater:
            self = .retryLater(
                try container.decode(ReasonCode.self, forKey: .reason),
                message: try container.decode(String.self, forKey: .message))
        case .needsReview:
            self = .needsReview(
                try container.decode(ReasonCode.self, forKey: .reason),
                message: try container.decode(String.self, forKey: .message))
        }
    }

    public func encode(to encoder: any Encoder) throws {
        var container = encoder.container(keyedBy: CodingKeys.self)
        switch self {
        case .verified(let receipt):
            try container.encode(Kind.verified, forKey: .kind)
            try container.encode(receipt, forKey: .receipt)
        case .notification(let notification):
            try container.encode(Kind.notification, forKey: .kind)
            try container.encode(notification, forKey: .notification)
        case .rejected(let reason, let message):
            try container.encode(Kind.rejected, forKey: .kind)
            try container.encode(reason, forKey: .reason)
            try container.encode(message, forKey: .message)
        case .retryLater(let reason, let message):
            try container.encode(Kind.retryLater, forKey: .kind)
            try container.encode(reason, forKey: .reason)
            try container.encode(message, forKey: .message)
        case .needsReview(let reason, let message):
            try container.encode(Kind.needsReview, forKey: .kind)
            try container.encode(reason, forKey: .reason)
            try container.encode(message, forKey: .message)
        }
    }
}
