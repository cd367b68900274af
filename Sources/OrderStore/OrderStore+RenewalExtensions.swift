public import Foundation
public import IAPCore
import Store

/// A renewal-date extension Apple made for customer service.
public struct RenewalDateExtension: Sendable, Equatable {
    public var originalTransactionId: String
    /// The subscription's owner here, if any.
    public var userId: String?
    public var environment: AppStoreEnvironment
    /// The period's new end, as Apple answered.
    public var effectiveDate: Date?
    public var webOrderLineItemId: String?
    public var requestIdentifier: String
}

extension OrderStore {
    /// Customer service extends the renewal date of the subscription `originalTransactionId`
    /// (Apple's Extend a Subscription Renewal Date, which `extend` asks in the subscription's
    /// environment): its period in force ends `days` later at Apple. Nothing in the ledger
    /// changes here: Apple's RENEWAL_EXTENDED about the period (or reconciliation, should it
    /// be lost) moves the grant's end, as for an extension made anywhere else. Audited
    /// (`renewal_date_extended`) once Apple answered; nothing is audited when Apple refuses
    /// (its error is thrown as it came). Asking again with the same `requestIdentifier` is
    /// Apple's same extension.
    public func extendRenewalDate(
        _ originalTransactionId: String, days: Int, reasonCode: Int, requestIdentifier: String, actor: String, reason: String,
        now: Date = Date(),
        extend: (AppStoreEnvironment) async throws -> (effectiveDate: Date?, webOrderLineItemId: String?)
    ) async throws -> RenewalDateExtension {
        guard let subscription = try await subscription(originalTransactionId) else {
            throw OrderStoreError(.notFound, "no subscription \(originalTransactionId) in this store")
        }
        let environment = AppStoreEnvironment(rawValue: subscription.environment) ?? .production
        let answer = try await extend(environment)
        let extended = RenewalDateExtension(
            originalTransactionId: originalTransactionId, userId: subscription.userId, environment: environment,
            effectiveDate: answer.effectiveDate, webOrderLineItemId: answer.webOrderLineItemId, requestIdentifier: requestIdentifier)
        var details = [
            "days": "\(days)", "reasonCode": "\(reasonCode)", "requestIdentifier": requestIdentifier,
            "environment": environment.rawValue, "owner": subscription.userId ?? "",
        ]
        details["effectiveDate"] = answer.effectiveDate.map { DateText.format($0) }
        details["webOrderLineItemId"] = answer.webOrderLineItemId
        try await recordConsoleAction(
            actor: actor, action: "renewal_date_extended", subject: "subscription:\(originalTransactionId)", reason: reason,
            details: details, now: now)
        return extended
    }

    /// Customer service asks Apple to extend the renewal date of every active subscriber of
    /// `productId` (Apple's mass extension, which `request` asks): audited
    /// (`renewal_extension_requested`, subject `renewal_extension:<requestIdentifier>`) once
    /// Apple took the request. Apple works through it later and tells of each subscription
    /// and of the end (RENEWAL_EXTENSION SUMMARY, audited under the same subject).
    public func requestMassExtension(
        productId: String, environment: AppStoreEnvironment, days: Int, reasonCode: Int, requestIdentifier: String,
        storefrontCountryCodes: [String], actor: String, reason: String, now: Date = Date(),
        request: () async throws -> Void
    ) async throws {
        try await request()
        try await recordConsoleAction(
            actor: actor, action: "renewal_extension_requested", subject: "renewal_extension:\(requestIdentifier)",
            reason: reason,
            details: [
                "productId": productId, "environment": environment.rawValue, "days": "\(days)", "reasonCode": "\(reasonCode)",
                "storefrontCountryCodes": storefrontCountryCodes.joined(separator: ","),
            ],
            now: now)
    }
}
