public import Foundation
public import IAPCore

/// One typed change of a plan: the shell writes each as it is, in order, in the transaction
/// that read the facts.
public enum LedgerChange: Sendable, Equatable {
    /// Records a purchase row. With `ifAbsent`, a row of that transaction recorded already
    /// stays; without it, finding one means the facts are stale (the shell retries the unit).
    case recordPurchase(LedgerFacts.Purchase, ifAbsent: Bool)
    /// A held purchase is granted now: it is held no more.
    case releasePurchase(transactionId: String)
    /// A period Apple told of before anyone owned its subscription (held `owner_unknown`)
    /// is recorded as `row` now that its owner is known; finding it claimed already means the
    /// facts are stale (the shell retries the unit).
    case claimPurchase(LedgerFacts.Purchase)
    /// A new active grant (`id` is the store's to give); refused when its credit key has one.
    case grant(Grant)
    /// The grant of `transactionId` is taken back, by `apple`, `transfer` or `admin`.
    case revokeGrant(transactionId: String, by: GrantRevoker, at: Date)
    /// A grant taken back by Apple or a transfer is in force again.
    case reactivateGrant(transactionId: String)
    /// Part of a grant was refunded: it keeps `quantity` units, granting `grantJSON`.
    case reduceGrant(transactionId: String, quantity: Int, grantJSON: String)
    /// Apple moved the period's end later (RENEWAL_EXTENDED).
    case extendGrant(transactionId: String, until: Date)
    /// The period ends early (an upgrade replaced it).
    case endGrant(transactionId: String, at: Date)
    /// The grant lasts into Apple's billing grace period.
    case setGracePeriod(transactionId: String, until: Date)
    /// The order is paid by `transactionId`.
    case bindOrder(orderId: String, transactionId: String, at: Date)
    /// A purchase credited before without an order, and its grant, are the order's now.
    case attachOrder(orderId: String, transactionId: String)
    /// The order paid by `transactionId` is now `state` (refunded, or paid again).
    case setOrderState(orderId: String, transactionId: String, state: OrderState, at: Date)
    /// Apple's revocation or reversal of a credit key, as it now stands (insert or replace).
    case putRevocation(LedgerFacts.Revocation)
    /// The subscription as it now stands (insert or replace).
    case putSubscription(Subscription)
    /// Apple asked for consumption information about a transaction.
    case recordConsumptionRequest(ConsumptionRequest)
    /// What a credited transaction cost and under which offer, as Apple signed it (kept once).
    case recordTerms(transactionId: String, PurchaseTerms)
    /// An entry of the append-only audit log.
    case audit(Audit)
    /// A message for the app's own services (`grant.created`, …), queued in the outbox.
    case publish(Message)

    /// One audit entry.
    public struct Audit: Sendable, Equatable {
        public var actor: String
        public var action: String
        public var subject: String
        public var reason: String
        public var details: [String: String]
        public var at: Date

        /// Creates an entry.
        public init(actor: String, action: String, subject: String, reason: String, details: [String: String], at: Date) {
            self.actor = actor
            self.action = action
            self.subject = subject
            self.reason = reason
            self.details = details
            self.at = at
        }
    }

    /// One event for the app's services.
    public struct Message: Sendable, Equatable {
        /// The event's name, also its routing key.
        public var name: String
        /// Its fields (the shell adds `event` and `eventId`).
        public var fields: [String: EventField]
        /// Its id: the same change always has the same id, so a consumer can drop repeats.
        public var id: String

        /// Creates a message.
        public init(name: String, fields: [String: EventField], id: String) {
            self.name = name
            self.fields = fields
            self.id = id
        }
    }

    /// A consumption request as recorded for customer service.
    public struct ConsumptionRequest: Sendable, Equatable {
        public var notificationUUID: String
        public var transactionId: String
        public var userId: String?
        public var reason: String?
        public var environment: String
        public var receivedAt: Date
        /// `PURCHASED`, `FAMILY_SHARED` or `ASSIGNED`, as Apple's transaction said.
        public var ownershipType: String?
        /// When Apple stops waiting for the answer: 12 hours after it signed the request.
        public var deadline: Date
        /// What the purchase asked about is credited once by (`CreditKey.stored`): whether it was
        /// delivered is read by it, not by the transaction Apple names (a non-consumable or a
        /// period is held through whichever transaction of it was credited first).
        public var creditKey: String?
        /// The product's type as the catalog says (`Catalog.ProductType`'s raw value).
        public var productType: String?

        /// Apple's time to answer a consumption request.
        public static let answerWindow: TimeInterval = 12 * 3600

        /// Creates a request.
        public init(
            notificationUUID: String, transactionId: String, userId: String?, reason: String?, environment: String,
            receivedAt: Date, ownershipType: String? = nil, deadline: Date? = nil, creditKey: String? = nil,
            productType: String? = nil
        ) {
            self.creditKey = creditKey
            self.productType = productType
            self.ownershipType = ownershipType
            self.deadline = deadline ?? receivedAt.addingTimeInterval(Self.answerWindow)
            self.notificationUUID = notificationUUID
            self.transactionId = transactionId
            self.userId = userId
            self.reason = reason
            self.environment = environment
            self.receivedAt = receivedAt
        }

        /// Whether what Apple asks about was delivered: some grant among `grants` is of its
        /// transaction or of its credit key (a non-consumable or a period credited through
        /// another transaction of it: a restore, the chain's first upload), in force or taken
        /// back since. The order service asks the same of its store when it answers
        /// (`OrderStore.claimDueConsumptionRequests`, one `EXISTS` over `grants`).
        public func isDelivered(by grants: [Grant]) -> Bool {
            grants.contains { $0.transactionId == transactionId || (creditKey != nil && $0.creditKey?.stored == creditKey) }
        }
    }
}

/// A value in an event's JSON body. Events are written by hand, keys sorted: building them
/// through `JSONSerialization` was the largest single cost of crediting a purchase.
public enum EventField: Sendable, Equatable {
    case string(String)
    case int(Int)
    case null
    /// JSON written already (a grant as stored).
    case json(String)

    /// `fields` as one JSON object, keys in byte order.
    public static func object(_ fields: [String: EventField]) -> [UInt8] {
        var out: [UInt8] = [UInt8(ascii: "{")]
        for (index, key) in fields.keys.sorted(by: { $0.utf8.lexicographicallyPrecedes($1.utf8) }).enumerated() {
            if index > 0 { out.append(UInt8(ascii: ",")) }
            appendString(key, to: &out)
            out.append(UInt8(ascii: ":"))
            switch fields[key] ?? .null {
            case .string(let text): appendString(text, to: &out)
            case .int(let number): out.append(contentsOf: String(number).utf8)
            case .null: out.append(contentsOf: "null".utf8)
            case .json(let json): out.append(contentsOf: json.utf8)
            }
        }
        out.append(UInt8(ascii: "}"))
        return out
    }

    /// A JSON string: quotes, backslashes and control characters escaped; the rest as UTF-8.
    private static func appendString(_ text: String, to out: inout [UInt8]) {
        let hex = Array("0123456789abcdef".utf8)
        out.append(UInt8(ascii: "\""))
        for byte in text.utf8 {
            switch byte {
            case UInt8(ascii: "\""), UInt8(ascii: "\\"):
                out.append(UInt8(ascii: "\\"))
                out.append(byte)
            case UInt8(ascii: "\n"): out.append(contentsOf: "\\n".utf8)
            case UInt8(ascii: "\r"): out.append(contentsOf: "\\r".utf8)
            case UInt8(ascii: "\t"): out.append(contentsOf: "\\t".utf8)
            case 0..<0x20:
                out.append(contentsOf: "\\u00".utf8)
                out.append(hex[Int(byte >> 4)])
                out.append(hex[Int(byte & 0x0F)])
            default: out.append(byte)
            }
        }
        out.append(UInt8(ascii: "\""))
    }
}
