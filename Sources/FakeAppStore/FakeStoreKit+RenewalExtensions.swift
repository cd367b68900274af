import Foundation
import Hummingbird
import NIOConcurrencyHelpers

// Apple's renewal-date extensions, one subscription at a time and for every active subscriber
// of a product, with Apple's checks of each field, its refusals, its idempotent request
// identifiers, a mass extension worked through in the background (its status polled until
// `complete`), and the notifications Apple sends about each: RENEWAL_EXTENDED for a period
// extended, RENEWAL_EXTENSION FAILURE for a subscription a mass extension could not extend,
// RENEWAL_EXTENSION SUMMARY when it is done.
extension FakeStoreKit {
    private struct ExtendAnswer: Encodable {
        var effectiveDate: Int64
        var originalTransactionId: String
        var success: Bool
        var webOrderLineItemId: String
    }

    private struct MassStatus: Encodable {
        var requestIdentifier: String
        var complete: Bool
        var completeDate: Int64?
        var succeededCount: Int64
        var failedCount: Int64
    }

    func addRenewalExtensionRoutes(to router: Router<BasicRequestContext>, prefix: String, environment: String) {
        router.put("\(prefix)/inApps/v1/subscriptions/extend/{originalTransactionId}") { request, context in
            try await answer(request) { bundleId in
                let original = try context.parameters.require("originalTransactionId")
                let fields = try await Self.fields(of: request)
                let days = try Self.days(fields)
                _ = try Self.reasonCode(fields)
                let requestIdentifier = try Self.requestIdentifier(fields)
                guard !original.isEmpty, original.allSatisfy(\.isNumber) else {
                    throw APIError(status: .badRequest, errorCode: 4_000_008, errorMessage: "Invalid original transaction id.")
                }
                switch try ledger.extendRenewalDate(
                    originalTransactionId: original, bundleId: bundleId, environment: environment, days: days,
                    requestIdentifier: requestIdentifier)
                {
                case .failure(let refusal):
                    throw APIError(status: .init(code: refusal.status), errorCode: refusal.errorCode, errorMessage: refusal.message)
                case .success(let extended):
                    try await notify("RENEWAL_EXTENDED", subtype: nil, purchase: extended.period)
                    return ExtendAnswer(
                        effectiveDate: FakeAppStore.milliseconds(extended.effectiveDate), originalTransactionId: original,
                        success: true, webOrderLineItemId: extended.webOrderLineItemId)
                }
            }
        }
        router.post("\(prefix)/inApps/v1/subscriptions/extend/mass") { request, context in
            try await answer(request) { bundleId in
                let fields = try await Self.fields(of: request)
                let days = try Self.days(fields)
                _ = try Self.reasonCode(fields)
                let requestIdentifier = try Self.requestIdentifier(fields)
                guard let productId = fields["productId"] as? String, !productId.isEmpty, productId.count <= 100 else {
                    throw APIError(status: .badRequest, errorCode: 4_000_023, errorMessage: "Invalid request. The product id parameter is invalid.")
                }
                var storefronts: [String] = []
                if let listed = fields["storefrontCountryCodes"], !(listed is NSNull) {
                    guard let codes = listed as? [String], !codes.isEmpty else {
                        throw APIError(
                            status: .badRequest, errorCode: 4_000_027,
                            errorMessage: "Invalid request. The storefront country code list must not be empty.")
                    }
                    guard codes.allSatisfy({ $0.count == 3 && $0.allSatisfy { $0.isASCII && $0.isUppercase } }) else {
                        throw APIError(
                            status: .badRequest, errorCode: 4_000_028,
                            errorMessage: "Invalid request. A storefront country code was invalid.")
                    }
                    storefronts = codes
                }
                let mass = FakeLedger.MassExtension(
                    requestIdentifier: requestIdentifier, productId: productId, bundleId: bundleId, environment: environment,
                    days: days, storefrontCountryCodes: storefronts, completeDate: nil, succeededCount: 0, failedCount: 0)
                if try ledger.beginMassExtension(mass) {
                    // Apple answers at once and works through the subscribers later.
                    Task { await runMassExtension(mass) }
                }
                return ["requestIdentifier": requestIdentifier]
            }
        }
        router.get("\(prefix)/inApps/v1/subscriptions/extend/mass/{productId}/{requestIdentifier}") { request, context in
            try await answer(request) { bundleId in
                let productId = try context.parameters.require("productId")
                let requestIdentifier = try context.parameters.require("requestIdentifier")
                guard let mass = try ledger.massExtension(requestIdentifier), mass.productId == productId,
                    mass.bundleId == bundleId, mass.environment == environment
                else {
                    throw APIError(status: .notFound, errorCode: 4_040_009, errorMessage: "Invalid request identifier.")
                }
                return MassStatus(
                    requestIdentifier: requestIdentifier, complete: mass.completeDate != nil,
                    completeDate: mass.completeDate.map(FakeAppStore.milliseconds), succeededCount: Int64(mass.succeededCount),
                    failedCount: Int64(mass.failedCount))
            }
        }
    }

    /// Extends each chain the mass extension reaches, telling of each, then of the end.
    private func runMassExtension(_ request: FakeLedger.MassExtension) async {
        do {
            for original in try ledger.massExtensionChains(request) {
                switch try ledger.extendForMass(request, originalTransactionId: original) {
                case .success(let extended):
                    try await notify("RENEWAL_EXTENDED", subtype: nil, purchase: extended.period)
                case .failure:
                    if let latest = try ledger.latestTransaction(ofChain: original) {
                        try await notify("RENEWAL_EXTENSION", subtype: "FAILURE", purchase: latest)
                    }
                }
            }
            guard let done = try ledger.completeMassExtension(request.requestIdentifier) else { return }
            let payload = try authority.signJWS(
                Notification(
                    notificationType: "RENEWAL_EXTENSION", subtype: "SUMMARY",
                    summary: .init(
                        requestIdentifier: done.requestIdentifier, environment: done.environment, appAppleId: appAppleId,
                        bundleId: done.bundleId, productId: done.productId, storefrontCountryCodes: done.storefrontCountryCodes,
                        failedCount: Int64(done.failedCount), succeededCount: Int64(done.succeededCount))))
            await send(
                payload, type: "RENEWAL_EXTENSION", transactionId: nil, environment: done.environment,
                to: notificationURL.withLockedValue { $0 })
        } catch {
            // The fake's own store failed: the request stays incomplete, as Apple's would.
        }
    }

    /// Sends a notification about `purchase` where notifications go.
    func notify(_ type: String, subtype: String?, purchase: FakeLedger.Purchase) async throws {
        let payload = try signedNotification(type: type, subtype: subtype, purchase: purchase)
        await send(
            payload, type: type, transactionId: purchase.transactionId, environment: purchase.environment,
            to: notificationURL.withLockedValue { $0 })
    }

    private static func fields(of request: Request) async throws -> [String: Any] {
        var request = request
        let body = try await request.collectBody(upTo: 64 * 1024)
        guard let fields = (try? JSONSerialization.jsonObject(with: Data(body.readableBytesView))) as? [String: Any] else {
            throw APIError(status: .badRequest, errorCode: 4_000_000, errorMessage: "Invalid request.")
        }
        return fields
    }

    /// An integer of JSON, not a Boolean or a fraction.
    private static func integer(_ value: Any?) -> Int? {
        guard let value, type(of: value) != type(of: NSNumber(value: true)) else { return nil }
        return value as? Int
    }

    private static func days(_ fields: [String: Any]) throws -> Int {
        guard let days = integer(fields["extendByDays"]), (1...90).contains(days) else {
            throw APIError(status: .badRequest, errorCode: 4_000_009, errorMessage: "Invalid extend by days value.")
        }
        return days
    }

    private static func reasonCode(_ fields: [String: Any]) throws -> Int {
        guard let code = integer(fields["extendReasonCode"]), (0...3).contains(code) else {
            throw APIError(status: .badRequest, errorCode: 4_000_010, errorMessage: "Invalid extend reason code.")
        }
        return code
    }

    private static func requestIdentifier(_ fields: [String: Any]) throws -> String {
        guard let identifier = fields["requestIdentifier"] as? String, !identifier.isEmpty, identifier.count <= 128 else {
            throw APIError(status: .badRequest, errorCode: 4_000_011, errorMessage: "Invalid request identifier.")
        }
        return identifier
    }
}
