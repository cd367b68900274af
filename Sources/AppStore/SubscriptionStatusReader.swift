public import Foundation
public import IAPCore

/// Asks the App Store Server API where a subscription stands and says it as the
/// notifications Apple would have sent, built from verified signed data only: so that a
/// missed notification is applied exactly as if it had arrived.
public struct SubscriptionStatusReader: Sendable {
    /// Asks Apple.
    public let client: AppStoreServerAPIClient
    /// Checks every signed transaction and renewal info in Apple's answers.
    public let verifier: SignedDataVerifier

    /// A notification built from Apple's answer, with the signed transaction it was read from.
    public struct Finding: Sendable {
        /// What to apply, as if Apple had sent it.
        public var notification: AppStoreNotification
        /// The signed transaction (JWS) it is about, as Apple sent it.
        public var signedTransaction: String
    }

    /// Creates a reader.
    public init(client: AppStoreServerAPIClient, verifier: SignedDataVerifier) {
        self.client = client
        self.verifier = verifier
    }

    /// What Apple says of the subscription `originalTransactionId` (asked with one of its
    /// transactions): first a REFUND per refunded transaction of it (Get Refund History v2), then
    /// one notification for its last transaction (Get All Subscription Statuses). Apple signs the
    /// status after the refunds, so the subscription's state ends as the status says.
    ///
    /// Throws `ServerAPIError` when Apple fails, `JWSVerificationError` when its answer does not verify.
    public func notifications(
        originalTransactionId: String, transactionId: String, in environment: ServerAPIEnvironment
    ) async throws -> [Finding] {
        var findings: [Finding] = []
        var revision: String?
        var pages = 0
        repeat {
            let page = try await client.refundHistory(transactionId, revision: revision, in: environment)
            for jws in page.signedTransactions ?? [] {
                let transaction = try await verifier.verifyTransaction(jws)
                guard transaction.originalTransactionId == originalTransactionId else { continue }
                findings.append(Finding(notification: Self.refund(transaction), signedTransaction: jws))
            }
            revision = page.hasMore == true ? page.revision : nil
            pages += 1
        } while revision != nil && pages < 100
        let statuses = try await client.subscriptionStatuses(transactionId, in: environment)
        for group in statuses.data ?? [] {
            for last in group.lastTransactions ?? [] where last.originalTransactionId == originalTransactionId {
                guard let status = last.status, let signed = last.signedTransactionInfo else { continue }
                let transaction = try await verifier.verifyTransaction(signed)
                guard transaction.originalTransactionId == originalTransactionId else { continue }
                var renewal: JWSRenewalInfoDecodedPayload?
                if let signedRenewal = last.signedRenewalInfo { renewal = try await verifier.verifyRenewalInfo(signedRenewal) }
                if let notification = Self.notification(status: status, transaction: transaction, renewal: renewal) {
                    findings.append(Finding(notification: notification, signedTransaction: signed))
                }
            }
        }
        return findings
    }

    /// The notification Apple sends for a subscription in `status` (1 active: DID_RENEW, which
    /// credits the period once if it is new; 2 expired: EXPIRED; 3 billing retry:
    /// DID_FAIL_TO_RENEW; 4 grace period: DID_FAIL_TO_RENEW with GRACE_PERIOD; 5 revoked:
    /// REVOKE), signed when the transaction was; nil for a status Apple has not defined.
    /// Its `notificationUUID` is `reconcile:<originalTransactionId>:<transactionId>:<status>`,
    /// so the same answer applies once however often it is asked.
    public static func notification(
        status: Int, transaction: JWSTransactionDecodedPayload, renewal: JWSRenewalInfoDecodedPayload?
    ) -> AppStoreNotification? {
        let (type, subtype): (String, String?)
        switch status {
        case 1: (type, subtype) = ("DID_RENEW", nil)
        case 2: (type, subtype) = ("EXPIRED", nil)
        case 3: (type, subtype) = ("DID_FAIL_TO_RENEW", nil)
        case 4: (type, subtype) = ("DID_FAIL_TO_RENEW", "GRACE_PERIOD")
        case 5: (type, subtype) = ("REVOKE", nil)
        default: return nil
        }
        return AppStoreNotification(
            notificationUUID: "reconcile:\(transaction.originalTransactionId):\(transaction.transactionId):\(status)",
            notificationType: type, subtype: subtype, environment: transaction.environment == "Sandbox" ? .sandbox : .production,
            bundleId: transaction.bundleId, signedDate: transaction.signedDate.map(Date.init(appleMilliseconds:)),
            purchase: AppStoreVerifier.purchase(transaction), subscriptionStatus: status,
            autoRenewStatus: renewal?.autoRenewStatus,
            gracePeriodExpiresDate: renewal?.gracePeriodExpiresDate.map(Date.init(appleMilliseconds:)))
    }

    /// The REFUND Apple sends for a refunded transaction,
    /// `reconcile:<originalTransactionId>:<transactionId>:refund:<revocationDate>` (a refund
    /// after a reversed one is another refund), dated when Apple refunded it (not when Apple
    /// answered the read).
    public static func refund(_ transaction: JWSTransactionDecodedPayload) -> AppStoreNotification {
        AppStoreNotification(
            notificationUUID:
                "reconcile:\(transaction.originalTransactionId):\(transaction.transactionId):refund:\(transaction.revocationDate ?? 0)",
            notificationType: "REFUND", subtype: nil, environment: transaction.environment == "Sandbox" ? .sandbox : .production,
            bundleId: transaction.bundleId,
            signedDate: (transaction.revocationDate ?? transaction.signedDate).map(Date.init(appleMilliseconds:)),
            purchase: AppStoreVerifier.purchase(transaction))
    }
}

extension SubscriptionStatusReader {
    /// What changed in a customer's purchases since a revision: each transaction verified, and
    /// Apple's revision to ask with next time.
    public struct Changes: Sendable {
        /// The changed transactions (new ones, refunded ones, reversed refunds, …), each with
        /// its JWS, in the order Apple lists them (by when each last changed).
        public var transactions: [(transaction: JWSTransactionDecodedPayload, signed: String)]
        /// Where the next read starts.
        public var revision: String?
    }

    /// Every transaction of the customer `anyTransactionId` belongs to that changed since
    /// `revision` (all of them without one): Get Transaction History v2, every page (Apple sorts
    /// it by each transaction's last change, and its revision answers what changed since).
    ///
    /// Throws `ServerAPIError` when Apple fails, `JWSVerificationError` when its answer does not verify.
    public func changes(of anyTransactionId: String, since revision: String?, in environment: ServerAPIEnvironment)
        async throws -> Changes
    {
        var changes = Changes(transactions: [], revision: revision)
        var pages = 0
        while pages < 500 {
            let page = try await client.transactionHistory(anyTransactionId, revision: changes.revision, in: environment)
            for jws in page.signedTransactions ?? [] {
                changes.transactions.append((try await verifier.verifyTransaction(jws), jws))
            }
            changes.revision = page.revision ?? changes.revision
            pages += 1
            if page.hasMore != true { break }
        }
        return changes
    }

    /// The notification Apple sends about a transaction as Transaction History shows it now:
    /// REVOKE for a family member's access taken back, REFUND for one refunded, REFUND_REVERSED
    /// for one whose refund the store holds and Apple no longer shows, DID_RENEW for a period of
    /// an auto-renewable subscription (credited once, to the subscription's owner), and
    /// ONE_TIME_CHARGE for any other purchase (credited to the user its token's order names, or
    /// kept for its buyer's upload). Its `notificationUUID` names the transaction and what
    /// Apple's answer says of it, so the same answer applies once however often it is read.
    ///
    /// Its date is when the change happened, as Apple's own notification would be signed: the
    /// revocation's date, or the period's purchase date. A history transaction's `signedDate`
    /// is when Apple answered the read, later than everything recorded, and would let an old
    /// period found late replace the subscription's newer state. Only a reversed refund, which
    /// Apple dates nowhere, takes the read's date.
    public static func notification(history transaction: JWSTransactionDecodedPayload, refundStands: Bool) -> AppStoreNotification {
        let type: String
        var stamp = ""
        var happened = transaction.purchaseDate
        if let revoked = transaction.revocationDate {
            // A family member's access or an assigned seat taken back is Apple's REVOKE: no refund.
            type = ["FAMILY_REVOKE", "ASSIGNMENT_REVOKE"].contains(transaction.revocationType) ? "REVOKE" : "REFUND"
            stamp = ":\(revoked)"
            happened = revoked
        } else if refundStands {
            type = "REFUND_REVERSED"
            stamp = ":\(transaction.signedDate ?? 0)"
            happened = transaction.signedDate
        } else {
            type = transaction.type == "Auto-Renewable Subscription" ? "DID_RENEW" : "ONE_TIME_CHARGE"
        }
        return AppStoreNotification(
            notificationUUID: "reconcile:\(transaction.originalTransactionId):\(transaction.transactionId):\(type)\(stamp)",
            notificationType: type, subtype: nil, environment: transaction.environment == "Sandbox" ? .sandbox : .production,
            bundleId: transaction.bundleId, signedDate: (happened ?? transaction.signedDate).map(Date.init(appleMilliseconds:)),
            purchase: AppStoreVerifier.purchase(transaction))
    }
}

extension AppStoreServerAPIClient {
    /// The signed payloads of every notification Apple could not deliver to us between
    /// `start` and `end` (Get Notification History with `onlyFailures`, every page).
    public func failedNotifications(from start: Date, to end: Date, in environment: ServerAPIEnvironment)
        async throws(ServerAPIError) -> [String]
    {
        var payloads: [String] = []
        var token: String?
        var pages = 0
        repeat {
            let page = try await notificationHistory(
                from: start, to: end, onlyFailures: true, paginationToken: token, in: environment)
            payloads += (page.notificationHistory ?? []).map(\.signedPayload)
            token = page.hasMore == true ? page.paginationToken : nil
            pages += 1
        } while token != nil && pages < 1000
        return payloads
    }
}
