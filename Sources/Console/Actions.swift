import AppStore
import Crypto
import Foundation
import Hummingbird
import IAPCore
import Ledger
import Logging
import Messaging
import OrderStore

/// The console's changes; each is a form posted to `/admin/actions/<name>`.
enum ConsoleAction: String, CaseIterable, Sendable {
    /// Grants a held purchase to its owner.
    case grant
    /// Grants the transaction of an Apple order id to a customer.
    case appleGrant = "apple-grant"
    /// Revokes a grant.
    case revoke
    /// Lets the app finish an upload's transactions.
    case finishable
    /// Queues an upload for verification again.
    case reverify
    /// Moves a dead-letter queue's messages back.
    case redrive
    /// A note about a customer.
    case note
    /// Binds a subscription to a customer (Apple's Set App Account Token).
    case bind
    /// Extends a subscription's renewal date at Apple.
    case extend
    /// Extends the renewal date of every active subscriber of a product at Apple.
    case massExtend = "mass-extend"

    /// The name of its CSRF token in the templates (`session.csrf.<formKey>`).
    var formKey: String {
        switch self {
        case .appleGrant: "appleGrant"
        case .massExtend: "massExtend"
        default: rawValue
        }
    }
}

/// What an action did, shown on the next page.
private struct Outcome {
    var kind: String
    var text: String
}

extension Console {
    /// Runs one action for an operator: a reason is required, the form's one-time key makes a
    /// second post of the same form say what the first did, and the store's own refusals
    /// ("granted already") read as "already done".
    func perform(_ action: ConsoleAction, form: [String: String], session: ConsoleSession) async -> Response {
        let back = form["back"].flatMap(Self.consolePath) ?? "/admin/"
        let reason = (action == .note ? form["text"] : form["reason"])?.trimmingCharacters(in: .whitespacesAndNewlines) ?? ""
        guard !reason.isEmpty, reason.count <= 1000 else {
            sessions.setFlash(
                session.id, kind: "error",
                text: action == .note ? "A note needs text (at most 1000 characters)." : "Say why (a reason of at most 1000 characters): nothing was changed.")
            return Self.redirect(back)
        }
        let key = form["key"] ?? ""
        if !key.isEmpty {
            switch keys.claim(key) {
            case .first: break
            case .inProgress:
                sessions.setFlash(session.id, kind: "info", text: "Already being done: this form was sent twice.")
                return Self.redirect(back)
            case .done(let text):
                sessions.setFlash(session.id, kind: "info", text: "Already done: \(text)")
                return Self.redirect(back)
            }
        }
        let outcome: Outcome
        var location = back
        do {
            (outcome, location) = try await run(action, form: form, reason: reason, actor: session.actor, back: back)
        } catch let error as OrderStoreError where error.code == .conflict {
            outcome = Outcome(kind: "info", text: "Already done: \(error.message).")
        } catch let error as OrderStoreError where error.code == .notFound {
            outcome = Outcome(kind: "error", text: "Not found: \(error.message). Nothing was changed.")
        } catch let error as ActionRefused {
            if !key.isEmpty { keys.release(key) }
            sessions.setFlash(session.id, kind: "error", text: error.text)
            return Self.redirect(back)
        } catch {
            if !key.isEmpty { keys.release(key) }
            logger.error("console action failed", metadata: ["iap.action": "\(action.rawValue)", "error": "\(error)"])
            sessions.setFlash(session.id, kind: "error", text: "Nothing was changed: \(error). Try again.")
            return Self.redirect(back)
        }
        if !key.isEmpty { keys.finish(key, outcome: outcome.text) }
        logger.info(
            "console action", metadata: ["iap.action": "\(action.rawValue)", "iap.actor": "\(session.actor)", "iap.outcome": "\(outcome.text)"])
        sessions.setFlash(session.id, kind: outcome.kind, text: outcome.text)
        return Self.redirect(location)
    }

    private var policy: CreditPolicy {
        CreditPolicy(catalog: deps.catalog, eventsExchange: deps.names.events, finishAtApple: deps.finishAtApple)
    }

    /// A renewal-date extension's days (1 to 90) and Apple's reason code (0 to 3) from a form.
    private static func extensionAsk(_ form: [String: String]) throws -> (days: Int, reasonCode: Int) {
        guard let days = form["days"].flatMap({ Int($0.trimmingCharacters(in: .whitespaces)) }), (1...90).contains(days) else {
            throw ActionRefused(text: "Extend by 1 to 90 days (Apple's most): nothing was changed.")
        }
        guard let code = form["reasonCode"].flatMap({ Int($0) }), AppStoreServerAPIClient.extendReasonCodes.contains(code) else {
            throw ActionRefused(text: "Choose why (Apple's reason code): nothing was changed.")
        }
        return (days, code)
    }

    /// The request identifier Apple is given for the form whose one-time key is `key`: the
    /// same form sent twice is the same request at Apple (a new one without a key).
    static func requestIdentifier(forKey key: String) -> String {
        guard !key.isEmpty else { return UUID().uuidString.lowercased() }
        var bytes = Array(SHA256.hash(data: Data("renewal-extension:\(key)".utf8)).prefix(16))
        bytes[6] = (bytes[6] & 0x0F) | 0x50
        bytes[8] = (bytes[8] & 0x3F) | 0x80
        let uuid = UUID(uuid: (
            bytes[0], bytes[1], bytes[2], bytes[3], bytes[4], bytes[5], bytes[6], bytes[7],
            bytes[8], bytes[9], bytes[10], bytes[11], bytes[12], bytes[13], bytes[14], bytes[15]))
        return uuid.uuidString.lowercased()
    }

    /// What the operator reads when Apple refused a change or could not be asked.
    private static func appleRefusal(_ error: ServerAPIError, of what: String) -> String {
        error.kind == .invalid || error.kind == .notFound
            ? "Apple refused to \(what): \(error.description). Nothing was changed."
            : "Apple could not be asked now (\(error.description)): nothing was changed. Try again shortly."
    }

    private func required(_ form: [String: String], _ name: String) throws -> String {
        guard let value = form[name]?.trimmingCharacters(in: .whitespacesAndNewlines), !value.isEmpty,
            value.unicodeScalars.count <= 256
        else {
            throw ActionRefused(text: "The form lacks \(name): nothing was changed.")
        }
        if let problem = IdentifierText.problem(value) {
            throw ActionRefused(text: "The form's \(name) \(problem): nothing was changed.")
        }
        return value
    }

    private func run(_ action: ConsoleAction, form: [String: String], reason: String, actor: String, back: String) async throws
        -> (Outcome, String)
    {
        let store = deps.store
        switch action {
        case .grant:
            let transactionId = try required(form, "transactionId")
            let userId = try required(form, "userId")
            let productId = form["productId"].flatMap { $0.isEmpty ? nil : $0 }
            return (try await grantHeld(transactionId, userId: userId, productId: productId, reason: reason, actor: actor), back)
        case .appleGrant:
            let orderId = try required(form, "orderId")
            let transactionId = try required(form, "transactionId")
            let userId = try required(form, "userId")
            // The form's word is not enough: Apple must list this transaction under this order now.
            guard case .found(let transactions, let signed, _) = await lookUpOrder(orderId) else {
                throw ActionRefused(text: "Apple could not confirm order \(orderId) now: nothing was changed. Try again shortly.")
            }
            guard let listed = transactions.firstIndex(where: { $0.transactionId == transactionId }), listed < signed.count else {
                throw ActionRefused(text: "Apple does not list transaction \(transactionId) under order \(orderId): nothing was changed.")
            }
            if let known = try await store.consolePurchases([transactionId])[transactionId] {
                guard sameUser(known.userId, userId) else {
                    throw ActionRefused(
                        text: "Transaction \(transactionId) belongs to user \(known.userId), not \(userId): nothing was changed.")
                }
                return (try await grantHeld(transactionId, userId: userId, productId: nil, reason: reason, actor: actor), Self.userPath(userId))
            }
            // Never uploaded: the transaction as Apple signed it for the customer's order id (which
            // only the buyer's e-mailed receipt carries; the operator confirmed whose it is) is
            // verified through the pipeline like the app's own upload of its signed transaction,
            // so the ledger's rules (tokens, subscription owners, refunds) decide, and a person's
            // confirmation is never a bare id that proves nothing.
            var request = VerifyRequest(
                submissionId: UUID(), userId: userId, receiptData: "", transactionId: transactionId, acceptedAt: Date())
            request.signedTransaction = signed[listed]
            let message = OutboxMessage.verify(request, routingKey: deps.names.verify, priority: VerifyPriority.firstAttempt)
            try await store.acceptForCustomer(request, message: message, actor: actor, reason: reason)
            return (
                Outcome(
                    kind: "success",
                    text: "Transaction \(transactionId) of order \(orderId) was queued for verification for \(userId) (upload \(request.submissionId.uuidString)); it is credited once Apple confirms it."),
                Self.userPath(userId)
            )
        case .bind:
            let original = try required(form, "originalTransactionId")
            let userId = try required(form, "userId")
            guard let client = deps.appStore else {
                throw ActionRefused(text: "Purchases cannot be bound: the App Store Server API key is not configured.")
            }
            do {
                _ = try await store.bindPurchase(original, to: userId, actor: actor, reason: reason, policy: policy) { token, environment in
                    try await client.setAppAccountToken(
                        token, originalTransactionId: original, in: environment == .sandbox ? .sandbox : .production)
                }
            } catch let error as ServerAPIError {
                throw ActionRefused(
                    text: error.kind == .invalid || error.kind == .notFound
                        ? "Apple refused to bind subscription \(original): \(error.description). Nothing was changed."
                        : "Apple could not be asked now (\(error.description)): nothing was changed. Try again shortly.")
            }
            return (
                Outcome(
                    kind: "success",
                    text: "Subscription \(original) is bound to \(userId): its renewals and refunds follow them from now on."),
                Self.userPath(userId)
            )
        case .extend:
            let original = try required(form, "originalTransactionId")
            let (days, reasonCode) = try Self.extensionAsk(form)
            guard let client = deps.appStore else {
                throw ActionRefused(text: "Renewal dates cannot be extended: the App Store Server API key is not configured.")
            }
            // The form's one-time key names the request at Apple: the same form sent twice is one extension.
            let requestIdentifier = Self.requestIdentifier(forKey: form["key"] ?? "")
            let extended: RenewalDateExtension
            do {
                extended = try await store.extendRenewalDate(
                    original, days: days, reasonCode: reasonCode, requestIdentifier: requestIdentifier, actor: actor, reason: reason
                ) { environment in
                    let answer = try await client.extendRenewalDate(
                        originalTransactionId: original, days: days, reasonCode: reasonCode, requestIdentifier: requestIdentifier,
                        in: environment == .sandbox ? .sandbox : .production)
                    return (answer.effectiveDate, answer.webOrderLineItemId)
                }
            } catch let error as ServerAPIError {
                throw ActionRefused(text: Self.appleRefusal(error, of: "extend subscription \(original)"))
            }
            let until = extended.effectiveDate.map { " to \(DateText.format($0, separator: " ", zone: " UTC"))" } ?? ""
            return (
                Outcome(
                    kind: "success",
                    text: "Apple extended subscription \(original) by \(days) days\(until); the grant follows when Apple's notification arrives."),
                back
            )
        case .massExtend:
            let productId = try required(form, "productId")
            let (days, reasonCode) = try Self.extensionAsk(form)
            let environment: ServerAPIEnvironment = form["environment"] == "Sandbox" ? .sandbox : .production
            let storefronts = (form["storefrontCountryCodes"] ?? "").split(whereSeparator: { $0 == "," || $0 == " " }).map(String.init)
            guard storefronts.count <= 300, storefronts.allSatisfy({ $0.utf8.count == 3 && $0.utf8.allSatisfy { (65...90).contains($0) } })
            else {
                throw ActionRefused(text: "Storefronts are three upper-case letters each (USA, FRA), comma-separated: nothing was changed.")
            }
            if let catalog = deps.catalog, catalog.product(productId)?.type != .autoRenewable {
                throw ActionRefused(text: "\(productId) is no auto-renewable subscription of the catalog: nothing was changed.")
            }
            guard let client = deps.appStore else {
                throw ActionRefused(text: "Renewal dates cannot be extended: the App Store Server API key is not configured.")
            }
            let requestIdentifier = Self.requestIdentifier(forKey: form["key"] ?? "")
            do {
                try await store.requestMassExtension(
                    productId: productId, environment: environment == .sandbox ? .sandbox : .production, days: days,
                    reasonCode: reasonCode, requestIdentifier: requestIdentifier, storefrontCountryCodes: storefronts, actor: actor,
                    reason: reason
                ) {
                    _ = try await client.massExtendRenewalDate(
                        productId: productId, days: days, reasonCode: reasonCode, requestIdentifier: requestIdentifier,
                        storefrontCountryCodes: storefronts, in: environment)
                }
            } catch let error as ServerAPIError {
                throw ActionRefused(text: Self.appleRefusal(error, of: "extend the subscribers of \(productId)"))
            }
            return (
                Outcome(
                    kind: "success",
                    text: "Apple took request \(requestIdentifier) to extend every active subscriber of \(productId) by \(days) days; the audit log shows its summary when Apple is done."),
                back
            )
        case .revoke:
            let transactionId = try required(form, "transactionId")
            let grant = try await store.revoke(transactionId: transactionId, actor: actor, reason: reason, policy: policy)
            return (Outcome(kind: "success", text: "Revoked the grant of transaction \(grant.transactionId) (\(grant.productId))."), back)
        case .finishable:
            guard let id = UUID(uuidString: try required(form, "submissionId")) else {
                throw ActionRefused(text: "That is not a submission id: nothing was changed.")
            }
            if let status = try await store.status(of: id), status.finishable {
                return (Outcome(kind: "info", text: "Already done: upload \(id.uuidString) is finishable already."), back)
            }
            try await store.markFinishable(id, actor: actor, reason: reason, finishAtApple: deps.finishAtApple)
            return (Outcome(kind: "success", text: "Upload \(id.uuidString) is finishable: the app may finish its transactions."), back)
        case .reverify:
            guard let id = UUID(uuidString: try required(form, "submissionId")) else {
                throw ActionRefused(text: "That is not a submission id: nothing was changed.")
            }
            let verify = deps.names.verifyQueue(priority: VerifyPriority.retry)
            let request = try await store.requeueSubmission(id, actor: actor, reason: reason) { request in
                .verify(request, routingKey: verify, priority: VerifyPriority.retry)
            }
            return (Outcome(kind: "success", text: "Upload \(request.submissionId.uuidString) was queued for verification again."), back)
        case .redrive:
            let which = try required(form, "queue")
            guard let broker = deps.broker else { throw ActionRefused(text: "No broker connection here: nothing was redriven.") }
            guard broker.isConnected else {
                throw ActionRefused(text: "The broker (RabbitMQ) is unreachable: nothing was redriven. Try again once it is back.")
            }
            let names = deps.names
            let (dead, home, priority): (String, String, UInt8?) =
                which == "results" ? (names.resultsDead, names.results, nil) : (names.verifyDead, names.verifyQueue(priority: VerifyPriority.retry), VerifyPriority.retry)
            let moved = await withTimeout(seconds: 15) {
                try await DeadLetters(connection: broker).redrive(dead, fallback: home, limit: 1000, priority: priority)
            }
            guard let moved else {
                throw ActionRefused(text: "The broker did not finish the redrive in time; look at the dead-letter count before trying again.")
            }
            try await store.recordConsoleAction(
                actor: actor, action: "dead_letters_redriven", subject: "queue:\(dead)", reason: reason,
                details: ["count": String(moved)])
            guard moved > 0 else {
                return (Outcome(kind: "info", text: "Already done: \(dead) holds nothing to redrive."), back)
            }
            return (Outcome(kind: "success", text: "Redrove \(moved) message(s) from \(dead) back to \(home)."), back)
        case .note:
            let userId = try required(form, "userId")
            try await store.addNote(userId: userId, actor: actor, text: reason)
            return (Outcome(kind: "success", text: "Note added."), back)
        }
    }

    /// Grants a held purchase to its owner, with the product Apple sold unless the operator
    /// chose a catalog product (a product missing from the catalog).
    private func grantHeld(_ transactionId: String, userId: String, productId: String?, reason: String, actor: String) async throws
        -> Outcome
    {
        guard let purchase = try await deps.store.purchase(transactionId) else {
            throw OrderStoreError(.notFound, "no purchase \(transactionId) in this store")
        }
        let productId = productId ?? purchase.productId
        var grant: [String: Catalog.GrantValue] = [:]
        if let catalog = deps.catalog {
            guard let product = catalog.product(productId) else {
                throw ActionRefused(text: "\(productId) is not in the catalog: choose the catalog product to grant.")
            }
            grant = product.grant(quantity: purchase.quantity)
        }
        let granted = try await deps.store.grantManually(
            userId: userId, productId: productId, quantity: purchase.quantity, grant: grant, transactionId: transactionId,
            actor: actor, reason: reason, policy: policy)
        return Outcome(
            kind: "success", text: "Granted \(granted.productId) ×\(granted.quantity) to \(userId) for transaction \(transactionId).")
    }
}

/// An action refused before anything changed, with what to tell the operator.
struct ActionRefused: Error {
    var text: String
}
