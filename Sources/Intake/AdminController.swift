import AppStore
import Crypto
import Foundation
import Hummingbird
import IAPCore
import Ledger
import Logging
import Metrics
import OrderStore

/// Customer service, behind `Authorization: Bearer <IAP_ADMIN_TOKEN>` (compared in constant
/// time): look a purchase up, grant by hand, revoke, mark a stuck upload finishable, read the
/// audit log. Every change needs a `reason` and lands in the append-only audit log.
struct AdminController: Sendable {
    let store: OrderStore
    let settings: IntakeSettings
    /// Failed authorizations per client address: five (`IntakeLimits.failedAdminAttempts`) in
    /// five minutes lock the address, which then has one try every two seconds (the right token
    /// gets through a stranger's lockout).
    let attempts: FailedAttempts

    init(store: OrderStore, settings: IntakeSettings) {
        self.store = store
        self.settings = settings
        attempts = FailedAttempts(limit: settings.limits.failedAdminAttempts ?? .max)
    }

    var policy: CreditPolicy {
        CreditPolicy(
            catalog: settings.catalog, eventsExchange: settings.names.events,
            finishAtApple: settings.finishTransactions.serverFinishes)
    }

    func addRoutes(to router: Router<IntakeContext>) {
        // Every admin route asks for an admin token first (`AdminAuthorizationMiddleware`).
        let admin = router.group("/v1/admin").add(middleware: AdminAuthorizationMiddleware(settings: settings, attempts: attempts))
        addPurchaseRoutes(to: admin)
        addSubmissionRoutes(to: admin)
        addSubscriptionRoutes(to: admin)
        addRenewalExtensionRoutes(to: admin)
        addAppTransactionRoutes(to: admin)
        addGroupRoutes(to: admin)
        addRecordRoutes(to: admin)
    }

    /// Purchases and grants: a purchase as held, a grant by hand, a grant taken back.
    private func addPurchaseRoutes(to admin: RouterGroup<IntakeContext>) {
        admin.get("purchases/{transactionId}") { request, context in
            let id = try context.pathParameter("transactionId")
            guard let purchase = try await store.purchase(id) else {
                throw APIError(.purchaseNotFound, "no purchase \(id) in this store")
            }
            return try JSONResponse.make(purchase)
        }
        admin.post("grants") { request, context in
            let fields = try await fields(of: request)
            let userId = try fields.requiredID("userId")
            // Granting a held purchase: what Apple sold, unless the body says otherwise.
            let held = try await fields.string("transactionId").asyncFlatMap { try await store.purchase($0) }
            guard let productId = try fields.id("productId") ?? held?.productId else {
                throw APIError.missingField("productId")
            }
            // Goodwill for an Apple purchase the customer wrote about before the app uploaded it:
            // bound to it, so that its upload is not a second credit.
            let apple = try fields.string("appleTransactionId", maxLength: 32)
            if let apple, !(apple.allSatisfy { $0.isASCII && $0.isNumber } && !apple.isEmpty) {
                throw APIError.invalidField("appleTransactionId", "must be Apple's numeric transaction id")
            }
            let named = try fields.string("transactionId")
            if apple != nil, named != nil {
                throw APIError(
                    .conflict, "name a held purchase (transactionId) or an Apple purchase not uploaded yet (appleTransactionId), not both")
            }
            // Apple's word, when it can be asked: the purchase's quantity, its original
            // transaction (what a restore's id stands for) and environment bind the goodwill.
            let said = try await apple.asyncFlatMap { try await checkWithApple($0, productId: productId, userId: userId) }
            let asked = try fields.int("quantity")
            if let said, let asked, asked != said.quantity {
                throw APIError(.conflict, "Apple's transaction \(apple ?? "") bought \(said.quantity), not \(asked): its upload would credit nothing more")
            }
            let quantity = said?.quantity ?? asked ?? held?.quantity ?? 1
            guard (1...10_000).contains(quantity) else { throw APIError.invalidField("quantity", "must be 1 to 10000") }
            var grant: [String: Catalog.GrantValue] = [:]
            if let catalog = settings.catalog {
                guard let product = catalog.product(productId) else {
                    throw APIError(.unknownProduct, "no product \(productId) in the catalog")
                }
                grant = product.grant(quantity: quantity)
            }
            let granted = try await mapped(notFound: .purchaseNotFound) {
                try await store.grantManually(
                    userId: userId, productId: productId, quantity: quantity, grant: grant,
                    transactionId: named, appleTransactionId: apple,
                    appleSaid: said.map { ($0.originalTransactionId, $0.environment) }, actor: try Self.actor(fields),
                    reason: try fields.requiredString("reason", maxLength: 1000), policy: policy)
            }
            Counter(label: MetricNames.grants).increment()
            return try JSONResponse.make(granted, status: .created)
        }
        admin.post("grants/{transactionId}/revoke") { request, context in
            let id = try context.pathParameter("transactionId")
            let fields = try await fields(of: request)
            let revoked = try await mapped(notFound: .purchaseNotFound) {
                try await store.revoke(
                    transactionId: id, actor: try Self.actor(fields),
                    reason: try fields.requiredString("reason", maxLength: 1000), policy: policy)
            }
            Counter(label: MetricNames.revocations).increment()
            return try JSONResponse.make(revoked)
        }
    }

    /// Submissions: customer service's word that an upload's transaction may be finished.
    private func addSubmissionRoutes(to admin: RouterGroup<IntakeContext>) {
        admin.post("submissions/{submissionId}/finishable") { request, context in
            guard let id = UUID(uuidString: try context.pathParameter("submissionId")) else {
                throw APIError(.submissionNotFound, "no such submission")
            }
            let fields = try await fields(of: request)
            try await mapped(notFound: .submissionNotFound) {
                try await store.markFinishable(
                    id, actor: try Self.actor(fields), reason: try fields.requiredString("reason", maxLength: 1000),
                    finishAtApple: settings.finishTransactions.serverFinishes)
            }
            guard let status = try await store.status(of: id) else {
                throw APIError(.submissionNotFound, "no such submission")
            }
            return try JSONResponse.make(SubmissionStatusBody(status, finishMode: settings.finishTransactions))
        }
    }

    /// Subscriptions: bound to a user by hand, a renewal date extended at Apple.
    private func addSubscriptionRoutes(to admin: RouterGroup<IntakeContext>) {
        admin.post("subscriptions/{originalTransactionId}/bind") { request, context in
            // Customer service binds a subscription to a user: Apple's Set App Account Token
            // names an order of theirs, and its renewals and refunds follow them from now on.
            let original = try context.pathParameter("originalTransactionId")
            let fields = try await fields(of: request)
            let userId = try fields.requiredID("userId")
            let actor = try Self.actor(fields)
            let reason = try fields.requiredString("reason", maxLength: 1000)
            guard let client = settings.appStore else {
                throw APIError(.appleUnavailable, "the App Store Server API key is not configured")
            }
            guard try await store.subscription(original) != nil else {
                // Not a subscription this store holds: a one-time purchase (an offer code redeemed
                // outside the app, a purchase bound to the wrong account) is bound the same way.
                let bound = try await bindOneTimePurchase(original, to: userId, actor: actor, reason: reason, client: client)
                return try JSONResponse.make(bound)
            }
            let order = try await mapped(notFound: .purchaseNotFound) {
                try await Self.askingApple {
                    try await store.bindPurchase(original, to: userId, actor: actor, reason: reason, policy: policy) { token, environment in
                        try await client.setAppAccountToken(
                            token, originalTransactionId: original, in: environment == .sandbox ? .sandbox : .production)
                    }
                }
            }
            return try JSONResponse.make(["originalTransactionId": original, "userId": userId, "appAccountToken": order.id])
        }
        admin.post("subscriptions/{originalTransactionId}/extend") { request, context in
            // Customer service extends a subscription's renewal date at Apple (a service outage,
            // goodwill): its period in force ends `days` later; Apple's RENEWAL_EXTENDED moves
            // the grant's end.
            let original = try context.pathParameter("originalTransactionId")
            let fields = try await fields(of: request)
            let ask = try Self.extensionAsk(fields)
            let actor = try Self.actor(fields)
            let reason = try fields.requiredString("reason", maxLength: 1000)
            guard let client = settings.appStore else {
                throw APIError(.appleUnavailable, "the App Store Server API key is not configured")
            }
            let extended = try await mapped(notFound: .purchaseNotFound) {
                try await Self.askingApple {
                    try await store.extendRenewalDate(
                        original, days: ask.days, reasonCode: ask.reasonCode, requestIdentifier: ask.requestIdentifier, actor: actor,
                        reason: reason
                    ) { environment in
                        let answer = try await client.extendRenewalDate(
                            originalTransactionId: original, days: ask.days, reasonCode: ask.reasonCode,
                            requestIdentifier: ask.requestIdentifier, in: environment == .sandbox ? .sandbox : .production)
                        return (answer.effectiveDate, answer.webOrderLineItemId)
                    }
                }
            }
            return try JSONResponse.make(RenewalExtensionBody(extended))
        }
    }

    /// Apple's mass renewal-date extensions: asked for, and their progress.
    private func addRenewalExtensionRoutes(to admin: RouterGroup<IntakeContext>) {
        admin.post("renewal-extensions") { request, context in
            // Every active subscriber of a product: Apple takes the request and works through
            // them later; its status is polled below, and its SUMMARY notification is audited.
            let fields = try await fields(of: request)
            let productId = try fields.requiredID("productId", maxLength: 100)
            guard AppStoreServerAPIClient.isProductId(productId) else {
                throw APIError.invalidField("productId", "must be a product id (letters, digits, '.', '-', '_')")
            }
            if let catalog = settings.catalog {
                guard let product = catalog.product(productId) else {
                    throw APIError(.unknownProduct, "no product \(productId) in the catalog")
                }
                guard product.type == .autoRenewable else {
                    throw APIError.invalidField("productId", "must be an auto-renewable subscription")
                }
            }
            let ask = try Self.extensionAsk(fields)
            let environment = try Self.environment(fields.string("environment")) ?? .production
            let storefronts = try Self.storefronts(fields.fields["storefrontCountryCodes"])
            let actor = try Self.actor(fields)
            let reason = try fields.requiredString("reason", maxLength: 1000)
            guard let client = settings.appStore else {
                throw APIError(.appleUnavailable, "the App Store Server API key is not configured")
            }
            try await Self.askingApple {
                try await store.requestMassExtension(
                    productId: productId, environment: environment == .sandbox ? .sandbox : .production, days: ask.days,
                    reasonCode: ask.reasonCode, requestIdentifier: ask.requestIdentifier, storefrontCountryCodes: storefronts,
                    actor: actor, reason: reason
                ) {
                    _ = try await client.massExtendRenewalDate(
                        productId: productId, days: ask.days, reasonCode: ask.reasonCode, requestIdentifier: ask.requestIdentifier,
                        storefrontCountryCodes: storefronts, in: environment)
                }
            }
            return try JSONResponse.make(
                MassExtensionBody(
                    requestIdentifier: ask.requestIdentifier, productId: productId, environment: environment.rawValue, complete: false),
                status: .accepted)
        }
        admin.get("renewal-extensions/{productId}/{requestIdentifier}") { request, context in
            let productId = try context.pathParameter("productId")
            guard AppStoreServerAPIClient.isProductId(productId) else {
                throw APIError.invalidField("productId", "must be a product id (letters, digits, '.', '-', '_')")
            }
            let requestIdentifier = try context.pathParameter("requestIdentifier")
            guard UUID(uuidString: requestIdentifier) != nil else {
                throw APIError.invalidField("requestIdentifier", "must be the UUID the request was made with")
            }
            let environment = try Self.environment(request.uri.queryParameters.get("environment").map { String($0) }) ?? .production
            guard let client = settings.appStore else {
                throw APIError(.appleUnavailable, "the App Store Server API key is not configured")
            }
            let status: AppStoreServerAPIClient.MassExtensionStatus
            do {
                status = try await Self.askingApple {
                    try await client.massExtensionStatus(productId: productId, requestIdentifier: requestIdentifier, in: environment)
                }
            } catch let error as APIError where error.code == .purchaseNotFound {
                throw APIError(.extensionNotFound, "Apple knows no extension \(requestIdentifier) of \(productId) in \(environment.rawValue)")
            }
            var body = MassExtensionBody(
                requestIdentifier: requestIdentifier, productId: productId, environment: environment.rawValue,
                complete: status.complete ?? false)
            body.completeDate = status.completeDate.map { DateText.format($0) }
            body.succeededCount = status.succeededCount
            body.failedCount = status.failedCount
            return try JSONResponse.make(body)
        }
    }

    /// A customer's app transaction, as Apple holds it.
    private func addAppTransactionRoutes(to admin: RouterGroup<IntakeContext>) {
        admin.get("app-transactions/{transactionId}") { request, context in
            // Get App Transaction Info for customer service: whose download of the app a
            // transaction (or an appTransactionId) belongs to, as Apple signs it, verified.
            let id = try context.pathParameter("transactionId")
            guard let client = settings.appStore, let verifier = settings.notificationVerifier else {
                throw APIError(.appleUnavailable, "the App Store Server API key is not configured")
            }
            let signed = try await Self.askingApple { () async throws -> String in
                do {
                    return try await client.appTransactionInfo(id, in: .production)
                } catch let error as ServerAPIError where error.kind == .notFound {
                    return try await client.appTransactionInfo(id, in: .sandbox)
                }
            }
            let app: AppTransactionDecodedPayload
            do {
                app = try await verifier.verifyAppTransaction(signed)
            } catch {
                throw APIError(.appleUnavailable, "Apple's answer did not verify: \(error)")
            }
            return try JSONResponse.make(app)
        }
    }

    /// Multi-seat groups: a user's groups, a group's members.
    private func addGroupRoutes(to admin: RouterGroup<IntakeContext>) {
        admin.get("users/{userId}/groups") { request, context in
            // Get Customer Groups for customer service: the groups (multiseat organizations)
            // each of the user's Apple customers is in now, asked of Apple with each customer's
            // id (at most ten customers).
            let userId = try context.pathParameter("userId")
            guard let client = settings.appStore else {
                throw APIError(.appleUnavailable, "the App Store Server API key is not configured")
            }
            let customers = try await store.appleCustomerIds(ofUser: userId).prefix(10).map {
                (id: $0.id, environment: $0.environment == .sandbox ? ServerAPIEnvironment.sandbox : .production)
            }
            let groups = try await Self.askingApple { try await client.groups(ofCustomers: customers) }.map(CustomerGroupBody.init)
            return try JSONResponse.make(CustomerGroupsBody(userId: userId, customersAsked: customers.count, groups: groups))
        }
        admin.get("groups/{groupId}/members") { request, context in
            // Get Group Members for customer service: one page of the group's members, each with
            // the users it is known for here.
            let groupId = try context.pathParameter("groupId")
            guard AppStoreServerAPIClient.isGroupId(groupId) else {
                throw APIError.invalidField("groupId", "must be Apple's numeric group id")
            }
            let query = request.uri.queryParameters
            var limit: Int?
            if let raw = query.get("limit") {
                guard let value = Int(raw), (1...100).contains(value) else { throw APIError.invalidField("limit", "must be 1 to 100") }
                limit = value
            }
            let token = query.get("paginationToken")
            if let token, !AppStoreServerAPIClient.isPaginationToken(token) {
                throw APIError.invalidField("paginationToken", "must be the token of the page before, as Apple gave it")
            }
            var environments: [ServerAPIEnvironment] = [.production, .sandbox]
            if let raw = query.get("environment") {
                guard let environment = ServerAPIEnvironment(rawValue: raw) else {
                    throw APIError.invalidField("environment", "must be Production or Sandbox")
                }
                environments = [environment]
            }
            guard let client = settings.appStore else {
                throw APIError(.appleUnavailable, "the App Store Server API key is not configured")
            }
            let found = try await Self.askingApple {
                try await client.groupMembers(groupId, paginationToken: token, limit: limit, inFirstOf: environments)
            }
            if let (page, environment) = found {
                let users = try await store.users(ofAppTransactions: page.members.map(\.appTransactionId))
                return try JSONResponse.make(
                    GroupMembersBody(
                        groupId: groupId, environment: environment.rawValue,
                        members: page.members.map { .init(appTransactionId: $0.appTransactionId, userIds: users[$0.appTransactionId] ?? []) },
                        paginationToken: page.paginationToken, hasMore: page.hasMore))
            }
            throw APIError(.groupNotFound, "Apple knows no group \(groupId) in \(environments.map(\.rawValue).joined(separator: " or "))")
        }
    }

    /// What the store recorded: consumption requests, the audit log.
    private func addRecordRoutes(to admin: RouterGroup<IntakeContext>) {
        admin.get("consumption-requests") { request, context in
            let limit = try Self.limit(request)
            let requests = try await store.consumptionRequests(limit: limit)
            return try JSONResponse.make(["consumptionRequests": requests])
        }
        admin.get("audit") { request, context in
            let limit = try Self.limit(request)
            let before = try request.uri.queryParameters.get("before").map { raw throws(APIError) in
                guard let id = Int64(raw), id > 0 else { throw APIError.invalidField("before", "must be an entry's id (a whole number above 0)") }
                return id
            }
            let entries = try await store.auditLog(limit: limit, before: before)
            // The next page: the entries older than the last one shown.
            return try JSONResponse.make(AuditPage(entries: entries, nextBefore: entries.count == limit ? entries.last?.id : nil))
        }
    }

    /// The body's `actor` (default `admin`): an id-like name that neither looks like one of the
    /// services' own or Apple's (`apple`, `system`, `Apple Inc.`, `ａｐｐｌｅ`, `аpple` with a Cyrillic
    /// `а`, …) nor mixes scripts, refused with 400 `invalid_field`.
    private static func actor(_ fields: JSONFields) throws(APIError) -> String {
        guard let actor = try fields.id("actor") else { return "admin" }
        if let problem = IdentifierText.actorProblem(actor) { throw .invalidField("actor", problem) }
        return actor
    }

    /// `?limit=`: 1 to 1000, 100 when absent.
    private static func limit(_ request: Request) throws(APIError) -> Int {
        let raw = request.uri.queryParameters.get("limit")
        guard let limit = raw.map({ Int($0) }) ?? 100, (1...1000).contains(limit) else {
            throw APIError.invalidField("limit", "must be a whole number from 1 to 1000")
        }
        return limit
    }

    /// A change request's JSON body.
    private func fields(of request: Request) async throws -> JSONFields {
        try JSONFields(try await IntakeBody.collect(request, limit: 16 * 1024, timeout: settings.limits.bodyTimeout))
    }

    /// The store's errors as API answers: what the store lacks is answered with the route's
    /// own code (an unknown transaction is `purchase_not_found` on every route).
    /// Apple's refusal of a call as `apple_refused`, its absence as `apple_unavailable`.
    /// Goodwill naming an Apple transaction rests on the customer's word; with the Server API
    /// key, Apple's own word on the id is asked first (Get Transaction Info, production, then
    /// the sandbox): an id Apple does not have (a typo) is `purchase_not_found`; another
    /// product, a refunded purchase, or one whose `appAccountToken` names another user's order
    /// is a `conflict`. None of this proves the purchase the customer's (a transaction id is a
    /// lookup): the buyer's own upload later still wins a person's review.
    /// What Apple's signed answer says of a transaction a goodwill grant names.
    struct AppleSaid {
        var quantity: Int
        var originalTransactionId: String
        var environment: AppStoreEnvironment
    }

    /// Asks Apple about the transaction a goodwill grant names (when the App Store Server API
    /// key is configured; nil otherwise) and refuses what cannot be this user's purchase of
    /// `productId`: another product, refunded, bought for another user's order.
    private func checkWithApple(_ transactionId: String, productId: String, userId: String) async throws -> AppleSaid? {
        guard let client = settings.appStore, let verifier = settings.notificationVerifier else { return nil }
        let signed: String
        do {
            signed = try await Self.askingApple { () async throws -> String in
                do {
                    return try await client.transactionInfo(transactionId, in: .production)
                } catch let error as ServerAPIError where error.kind == .notFound {
                    return try await client.transactionInfo(transactionId, in: .sandbox)
                }
            }
        } catch let error as APIError where error.code == .appleRefused {
            // Apple refuses an id that cannot be one of its transactions: no such purchase.
            throw APIError(.purchaseNotFound, error.message)
        }
        let transaction: JWSTransactionDecodedPayload
        do {
            transaction = try await verifier.verifyTransaction(signed)
        } catch {
            throw APIError(.appleUnavailable, "Apple's answer did not verify: \(error)")
        }
        guard transaction.productId == productId else {
            throw APIError(.conflict, "Apple's transaction \(transactionId) bought \(transaction.productId), not \(productId)")
        }
        guard transaction.revocationDate == nil else {
            throw APIError(.conflict, "Apple refunded or revoked transaction \(transactionId)")
        }
        if let token = transaction.appAccountToken, let order = try await store.order(token.lowercased()),
            !sameUser(order.userId, userId)
        {
            throw APIError(.conflict, "Apple's transaction \(transactionId) was bought for another user's order")
        }
        return AppleSaid(
            quantity: min(max(transaction.quantity ?? 1, 1), VerifiedPurchase.maxQuantity),
            originalTransactionId: transaction.originalTransactionId,
            environment: transaction.environment == "Sandbox" ? .sandbox : .production)
    }

    /// A one-time purchase bound by hand, and the upload that credits it.
    struct OneTimeBindingBody: Encodable {
        var originalTransactionId: String
        var userId: String
        var appAccountToken: String
        var submissionId: String
    }

    /// Binds a one-time purchase to `userId` (Set App Account Token takes any original
    /// transaction): Apple's word on the purchase (its product and environment), a new order
    /// of the user's for its product, Apple's token set to that order's id, then the purchase
    /// as Apple now signs it (carrying the token) queued for verification for the user, so the
    /// ledger's own rules credit it: the token's order is theirs and is paid by it. Refused
    /// when the purchase is credited already (to them: nothing to do; to someone else:
    /// customer service revokes that first), when it is not an original transaction, and
    /// when Apple refuses (a family member's access, an assigned seat). Audited
    /// (`purchase_bound`, and the upload as `upload_for_customer`).
    private func bindOneTimePurchase(
        _ original: String, to userId: String, actor: String, reason: String, client: AppStoreServerAPIClient
    ) async throws -> OneTimeBindingBody {
        guard let verifier = settings.notificationVerifier else {
            throw APIError(.appleUnavailable, "Apple's signed answers cannot be verified here: notifications are not configured")
        }
        if let held = try await store.purchase(original), let grant = held.grant, grant.isActive {
            throw APIError(
                .conflict,
                sameUser(grant.userId, userId)
                    ? "purchase \(original) is \(userId)'s already"
                    : "purchase \(original) is credited to another user: revoke that grant first, then bind it")
        }
        let (signed, environment) = try await Self.askingApple { () async throws -> (String, ServerAPIEnvironment) in
            do {
                return (try await client.transactionInfo(original, in: .production), .production)
            } catch let error as ServerAPIError where error.kind == .notFound {
                return (try await client.transactionInfo(original, in: .sandbox), .sandbox)
            }
        }
        let transaction: JWSTransactionDecodedPayload
        do {
            transaction = try await verifier.verifyTransaction(signed)
        } catch {
            throw APIError(.appleUnavailable, "Apple's answer did not verify: \(error)")
        }
        guard transaction.originalTransactionId == original else {
            throw APIError.invalidField("originalTransactionId", "\(original) is a later transaction of \(transaction.originalTransactionId): name the original")
        }
        guard transaction.revocationDate == nil else {
            throw APIError(.conflict, "Apple refunded or revoked purchase \(original)")
        }
        let order = try await store.createOrder(userId: userId, productId: transaction.productId)
        guard let token = UUID(uuidString: order.id) else {
            throw APIError(.storeUnavailable, "order \(order.id) is no UUID")
        }
        let rebound = try await Self.askingApple { () async throws -> String in
            try await client.setAppAccountToken(token, originalTransactionId: original, in: environment)
            return try await client.transactionInfo(original, in: environment)
        }
        var request = VerifyRequest(
            submissionId: UUID(), userId: userId, receiptData: "", transactionId: original, acceptedAt: Date())
        request.signedTransaction = rebound
        request.orderId = order.id
        let message = OutboxMessage.verify(request, routingKey: settings.names.verify, priority: VerifyPriority.firstAttempt)
        try await store.acceptForCustomer(request, message: message, actor: actor, reason: reason)
        try await store.recordConsoleAction(
            actor: actor, action: "purchase_bound", subject: "transaction:\(original)", reason: reason,
            details: [
                "to": userId, "appAccountToken": order.id, "productId": transaction.productId,
                "environment": environment.rawValue, "submissionId": request.submissionId.uuidString,
            ])
        return OneTimeBindingBody(
            originalTransactionId: original, userId: userId, appAccountToken: order.id,
            submissionId: request.submissionId.uuidString)
    }

    /// What a renewal-date extension asks of Apple: `days` (1 to 90), `reasonCode` (Apple's
    /// `extendReasonCode`, 0 to 3) and the request's identifier (a UUID the caller may give, so
    /// that asking again is the same request at Apple; a new one otherwise).
    struct ExtensionAsk {
        var days: Int
        var reasonCode: Int
        var requestIdentifier: String
    }

    static func extensionAsk(_ fields: JSONFields) throws -> ExtensionAsk {
        guard let days = try fields.int("days") else { throw APIError.missingField("days") }
        guard (1...90).contains(days) else { throw APIError.invalidField("days", "must be 1 to 90 (Apple's most)") }
        guard let reasonCode = try fields.int("reasonCode") else { throw APIError.missingField("reasonCode") }
        guard AppStoreServerAPIClient.extendReasonCodes.contains(reasonCode) else {
            throw APIError.invalidField(
                "reasonCode", "must be 0 (undeclared), 1 (customer satisfaction), 2 (other) or 3 (service issue or outage)")
        }
        var requestIdentifier = UUID().uuidString.lowercased()
        if fields.fields["requestIdentifier"] as? String == "" {
            throw APIError.invalidField("requestIdentifier", "must be a UUID")
        }
        if let given = try fields.string("requestIdentifier", maxLength: 36) {
            guard let uuid = UUID(uuidString: given) else { throw APIError.invalidField("requestIdentifier", "must be a UUID") }
            requestIdentifier = uuid.uuidString.lowercased()
        }
        return ExtensionAsk(days: days, reasonCode: reasonCode, requestIdentifier: requestIdentifier)
    }

    static func environment(_ text: String?) throws -> ServerAPIEnvironment? {
        guard let text else { return nil }
        guard let environment = ServerAPIEnvironment(rawValue: text) else {
            throw APIError.invalidField("environment", "must be Production or Sandbox")
        }
        return environment
    }

    /// Apple's storefront country codes (ISO 3166-1 alpha-3, upper case), at most 300; none
    /// means every storefront.
    static func storefronts(_ value: Any?) throws -> [String] {
        guard let value, !(value is NSNull) else { return [] }
        guard let codes = value as? [Any], codes.count <= 300 else {
            throw APIError.invalidField("storefrontCountryCodes", "must be a list of at most 300 country codes")
        }
        return try codes.map { code in
            guard let text = code as? String, text.utf8.count == 3, text.utf8.allSatisfy({ (65...90).contains($0) }) else {
                throw APIError.invalidField("storefrontCountryCodes", "each must be three upper-case letters (USA, FRA)")
            }
            return text
        }
    }

    private static func askingApple<T>(_ body: () async throws -> T) async throws -> T {
        do {
            return try await body()
        } catch let error as ServerAPIError {
            switch error.kind {
            case .notFound: throw APIError(.purchaseNotFound, "Apple knows no such transaction: \(error.description)")
            case .invalid: throw APIError(.appleRefused, "Apple refused: \(error.description)")
            case .transient, .unauthorized: throw APIError(.appleUnavailable, "Apple could not be asked: \(error.description)")
            }
        }
    }

    private func mapped<T>(notFound: APIErrorCode, _ body: () async throws -> T) async throws -> T {
        do {
            return try await body()
        } catch let error as OrderStoreError {
            switch error.code {
            case .notFound: throw APIError(notFound, error.message)
            case .conflict: throw APIError(.conflict, error.message)
            default: throw error
            }
        }
    }
}

/// A renewal-date extension Apple made (`POST /v1/admin/subscriptions/{id}/extend`).
struct RenewalExtensionBody: Encodable {
    var originalTransactionId: String
    var userId: String?
    var environment: String
    var effectiveDate: String?
    var webOrderLineItemId: String?
    var requestIdentifier: String

    init(_ extended: RenewalDateExtension) {
        originalTransactionId = extended.originalTransactionId
        userId = extended.userId
        environment = extended.environment.rawValue
        effectiveDate = extended.effectiveDate.map { DateText.format($0) }
        webOrderLineItemId = extended.webOrderLineItemId
        requestIdentifier = extended.requestIdentifier
    }
}

/// A mass renewal-date extension as Apple says it stands.
struct MassExtensionBody: Encodable {
    var requestIdentifier: String
    var productId: String
    var environment: String
    var complete: Bool
    var completeDate: String?
    var succeededCount: Int64?
    var failedCount: Int64?
}

/// A group of one of the user's Apple customers (`GET /v1/admin/users/{userId}/groups`).
struct CustomerGroupBody: Encodable {
    var groupId: String
    var groupType: String
    var roles: [AppStoreServerAPIClient.CustomerGroup.Role]
    var environment: String
    /// The customer's id Apple was asked with.
    var askedWith: String

    init(_ found: AppStoreServerAPIClient.FoundGroup) {
        groupId = found.group.groupId
        groupType = found.group.groupType
        roles = found.group.roles ?? []
        environment = found.environment.rawValue
        askedWith = found.askedWith
    }
}

struct CustomerGroupsBody: Encodable {
    var userId: String
    /// How many of the user's Apple customers were asked.
    var customersAsked: Int
    var groups: [CustomerGroupBody]
}

/// One page of a group's members (`GET /v1/admin/groups/{groupId}/members`).
struct GroupMembersBody: Encodable {
    struct Member: Encodable {
        var appTransactionId: String
        /// The users this customer is known for here.
        var userIds: [String]
    }
    var groupId: String
    var environment: String
    var members: [Member]
    var paginationToken: String?
    var hasMore: Bool
}

/// A page of the audit log, newest first, and where the next (older) page begins.
struct AuditPage: Encodable {
    var entries: [AuditEntry]
    var nextBefore: Int64?
}

extension Optional {
    /// `flatMap` with an async transform.
    func asyncFlatMap<U>(_ transform: (Wrapped) async throws -> U?) async rethrows -> U? {
        guard let self else { return nil }
        return try await transform(self)
    }
}

/// Refuses admin requests without an admin token (a user's token is refused too). Every
/// configured token is compared, each in the same time whatever matches. Every authorization
/// counts against the client's address until it succeeds (`attempts`): an address past its
/// failures gets 429 before anything is compared.
struct AdminAuthorizationMiddleware: RouterMiddleware {
    typealias Context = IntakeContext

    let settings: IntakeSettings
    let attempts: FailedAttempts

    func handle(_ request: Request, context: Context, next: (Request, Context) async throws -> Response) async throws -> Response {
        guard !settings.adminTokens.isEmpty else {
            throw APIError(.adminDisabled, "\(Setting.adminToken.variable) is not set")
        }
        let address = settings.limits.clientAddress(of: request, peer: context.remoteAddress)
        // A try a locked address still has (one every two seconds) is answered 429 unless it is right.
        let locked = attempts.isLocked(address)
        let attempt: UInt64
        switch attempts.reserve(address) {
        case .refused(let wait):
            throw APIError.rateLimited(retryAfter: wait)
        case .attempt(let id):
            attempt = id
        }
        guard let header = request.headers[.authorization], header.count > 7, header.prefix(7).lowercased() == "bearer "
        else {
            if locked { throw APIError.rateLimited(retryAfter: Int(attempts.lockedInterval)) }
            var error = APIError(.unauthenticated, "admin routes need Authorization: Bearer <admin token>")
            error.headers[.wwwAuthenticate] = "Bearer"
            throw error
        }
        let given = SHA256.hash(data: Data(header.dropFirst(7).utf8))
        var matched = false
        for token in settings.adminTokens {
            // Fixed-length digests, compared byte by byte without an early exit.
            var difference: UInt8 = 0
            for (left, right) in zip(given, SHA256.hash(data: Data(token.utf8))) { difference |= left ^ right }
            matched = matched || difference == 0
        }
        guard matched else {
            // Never the token itself.
            context.logger.info("admin token refused", metadata: ["iap.address": "\(address)"])
            if locked { throw APIError.rateLimited(retryAfter: Int(attempts.lockedInterval)) }
            throw APIError(.forbidden, "this token may not use admin routes")
        }
        attempts.release(attempt)
        return try await next(request, context)
    }
}
