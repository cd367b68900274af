public import IAPCore

/// What the order service tells Apple about a refund request (`CONSUMPTION_REQUEST`), with Send
/// Consumption Information v2, decided from the ledger's facts alone.
///
/// Apple asks before it decides a refund, and gives the developer 12 hours. The answer is
/// sent only with the customer's consent (every customer's, by the app's terms, or this user's,
/// as the app recorded it), never for a transaction an organization assigned (multiseat: Apple
/// refuses those), and says what the ledger knows: whether the purchase was delivered (credited
/// to someone), how much of it the app reported used, and the deployment's refund preference.
public enum ConsumptionAnswer {
    /// Whose consent lets the order service answer (`IAP_CONSUMPTION_CONSENT`).
    public enum Consent: String, Sendable, Equatable, CaseIterable {
        /// Nobody's: no answer is sent (Apple decides without our facts).
        case none
        /// Every customer's: the app's terms obtained it.
        case all
        /// Only the users the app recorded consent for (`POST /v1/users/{userId}/consumption`).
        case perUser = "per-user"
    }

    /// The deployment's side of the answer.
    public struct Settings: Sendable, Equatable {
        public var consent: Consent
        /// DECLINE, GRANT_FULL or GRANT_PRORATED; nil sends no preference.
        public var refundPreference: String?
        /// Whether the app offers a free sample, trial or description before purchase.
        public var sampleContentProvided: Bool

        /// Creates settings.
        public init(consent: Consent = .none, refundPreference: String? = nil, sampleContentProvided: Bool = false) {
            self.consent = consent
            self.refundPreference = refundPreference
            self.sampleContentProvided = sampleContentProvided
        }

        /// Apple's refund preferences.
        public static let refundPreferences: Set<String> = ["DECLINE", "GRANT_FULL", "GRANT_PRORATED"]
    }

    /// What the ledger knows of the transaction Apple asks about.
    public struct Facts: Sendable, Equatable {
        /// `PURCHASED`, `FAMILY_SHARED` or `ASSIGNED`, as Apple's transaction said.
        public var ownershipType: String?
        /// Whether it was credited to someone (a grant of it exists, in force or taken back since).
        public var delivered: Bool
        /// The share the app reported used, in milli-units (100000 is all of it).
        public var consumptionPercentage: Int?
        /// Whether the purchase's user consented (`per-user`); nil when the app said nothing.
        public var userConsented: Bool?
        /// The product's type, as the catalog said when Apple asked; nil when it was not known.
        public var productType: Catalog.ProductType?

        /// Creates facts.
        public init(
            ownershipType: String?, delivered: Bool, consumptionPercentage: Int?, userConsented: Bool?,
            productType: Catalog.ProductType? = nil
        ) {
            self.ownershipType = ownershipType
            self.delivered = delivered
            self.consumptionPercentage = consumptionPercentage
            self.userConsented = userConsented
            self.productType = productType
        }
    }

    /// The body of Send Consumption Information v2.
    public typealias Body = ConsumptionInformation

    /// Send `Body`, or send nothing and say why.
    public enum Decision: Sendable, Equatable {
        case send(Body)
        case skip(reason: String)
    }

    /// Why nothing is sent: no consent.
    public static let noConsent = "no_consent"
    /// Why nothing is sent: an assigned (multiseat) transaction.
    public static let assigned = "assigned"

    /// The answer to a consumption request about a transaction with `facts`.
    public static func decide(_ facts: Facts, settings: Settings) -> Decision {
        if facts.ownershipType == "ASSIGNED" { return .skip(reason: assigned) }
        switch settings.consent {
        case .none: return .skip(reason: noConsent)
        case .perUser where facts.userConsented != true: return .skip(reason: noConsent)
        case .all, .perUser: break
        }
        // Not credited to anyone: nothing of it was delivered, so nothing of it was used. Apple
        // takes no share for an auto-renewable subscription (it refuses one).
        let used: Int? =
            facts.productType == .autoRenewable
            ? nil : facts.delivered ? facts.consumptionPercentage.map { min(max($0, 0), 100_000) } : 0
        // A prorated refund needs the share: without one, no preference is said rather than a
        // share made up (Apple decides with the rest of the facts).
        let preference = settings.refundPreference == "GRANT_PRORATED" && used == nil ? nil : settings.refundPreference
        return .send(
            Body(
                customerConsented: true, deliveryStatus: facts.delivered ? "DELIVERED" : "UNDELIVERED_OTHER",
                sampleContentProvided: settings.sampleContentProvided, consumptionPercentage: used,
                refundPreference: preference))
    }
}
