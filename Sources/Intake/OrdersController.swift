import Foundation
import Hummingbird
import Logging
import IAPCore
import Ledger
import OrderStore

/// `GET /v1/products`, `POST /v1/orders`, `GET /v1/orders/{orderId}`, `GET /v1/users/{userId}/grants`,
/// `GET /v1/users/{userId}/subscriptions`, `GET /v1/users/{userId}/entitlements`,
/// `POST /v1/users/{userId}/consumption`, `POST /v1/users/{userId}/finished`.
///
/// The user is the token's subject; with authentication off, the one the request names
/// (`?userId=`, the path, or the body's `userId`). A user reads only their own orders, grants,
/// subscriptions and entitlements: anyone else's answer 404, as if they did not exist.
struct OrdersController: Sendable {
    let store: OrderStore
    let settings: IntakeSettings

    /// The public catalog.
    func addPublicRoutes(to router: Router<IntakeContext>) {
        router.get("/v1/products") { _, _ in
            guard let catalog = settings.catalog else {
                return try JSONResponse.make(["products": [Catalog.Product]()])
            }
            return try JSONResponse.make(catalog)
        }
    }

    /// The routes that act for a user.
    func addRoutes(to router: RouterGroup<IntakeContext>) {
        router.post("/v1/orders") { request, context in
            let body = try await IntakeBody.collect(request, limit: 16 * 1024, timeout: settings.limits.bodyTimeout)
            let fields = try JSONFields(body)
            let userId = try await context.resolveUser(named: try fields.id("userId"))
            let productId = try fields.requiredID("productId")
            if let catalog = settings.catalog, catalog.product(productId) == nil {
                throw APIError(.unknownProduct, "no product \(productId) in the catalog")
            }
            let order = try await store.createOrder(userId: userId, productId: productId)
            return try JSONResponse.make(order, status: .created)
        }
        router.get("/v1/orders/{orderId}") { _, context in
            let orderId = try context.pathParameter("orderId")
            guard let order = try await store.order(orderId), context.userId.map({ sameUser($0, order.userId) }) ?? true else {
                throw APIError(.orderNotFound, "no such order")
            }
            return try JSONResponse.make(order)
        }
        // What acts for one user answers only that user: anyone else's is 404, as if they did
        // not exist (`OwnUserMiddleware`).
        let user = router.group("/v1/users/{userId}").add(middleware: OwnUserMiddleware())
        user.get("grants") { _, context in
            let userId = try context.pathParameter("userId")
            let grants = try await store.grants(ofUser: userId)
            return try JSONResponse.make(["grants": grants])
        }
        user.get("subscriptions") { _, context in
            let userId = try context.pathParameter("userId")
            let subscriptions = try await store.subscriptions(ofUser: userId)
            return try JSONResponse.make(["subscriptions": subscriptions])
        }
        user.post("consumption") { request, context in
            // What the app knows for Apple's refund requests: how much of a purchase the user
            // used, and whether they consented to tell Apple (IAP_CONSUMPTION_CONSENT=per-user).
            let userId = try context.pathParameter("userId")
            let body = try await IntakeBody.collect(request, limit: 16 * 1024, timeout: settings.limits.bodyTimeout)
            let fields = try JSONFields(body)
            let report = ConsumptionReport(
                userId: userId, transactionId: try fields.id("transactionId"),
                consumptionPercentage: try fields.int("consumptionPercentage"),
                customerConsented: try fields.bool("customerConsented"))
            if let problem = report.problem {
                throw problem.why.hasPrefix("must") ? APIError.invalidField(problem.field, problem.why) : APIError.missingField(problem.field)
            }
            do {
                try await store.reportConsumption(report)
            } catch is ConsumptionReportError {
                throw APIError(.purchaseNotFound, "no purchase of this user has this transaction id")
            }
            return Response(status: .noContent)
        }
        user.post("finished") { request, context in
            // The app called StoreKit's finish() for a transaction: Apple does not tell the
            // server, so the app does, and the server no longer calls Finish Transaction for it.
            let userId = try context.pathParameter("userId")
            let body = try await IntakeBody.collect(request, limit: 16 * 1024, timeout: settings.limits.bodyTimeout)
            let transactionId = try JSONFields(body).requiredID("transactionId")
            let report: AppFinishReport
            do {
                report = try await store.reportAppFinish(userId: userId, transactionId: transactionId)
            } catch is AppFinishReportError {
                throw APIError(.purchaseNotFound, "no purchase of this user has this transaction id")
            }
            if case .heldWhenFinished(let reason, _) = report {
                // Finish is final: a finished consumable leaves every later receipt. The app
                // finished what was not credited; customer service settles it from the console.
                context.logger.error(
                    "the app finished a transaction that is held, not credited",
                    metadata: ["iap.transaction.id": "\(transactionId)", "iap.user.id": "\(userId)", "iap.reason": "\(reason)"])
            }
            return Response(status: .noContent)
        }
        user.get("entitlements") { _, context in
            let userId = try context.pathParameter("userId")
            let entitlements = try await store.entitlements(ofUser: userId, catalog: settings.catalog, now: Date())
            return try JSONResponse.make(entitlements)
        }
    }
}

/// A JSON object body, read field by field with the intake's error codes.
struct JSONFields {
    let fields: [String: Any]

    init(_ data: Data) throws(APIError) {
        guard let object = try? JSONSerialization.jsonObject(with: data), let fields = object as? [String: Any] else {
            throw .invalidJSON("the body must be a JSON object")
        }
        self.fields = fields
    }

    init(fields: [String: Any]) {
        self.fields = fields
    }

    /// A text field: nil when absent, null or empty; refused when of another type, longer than
    /// `maxLength` characters (Unicode code points, as JSON Schema's `maxLength` counts them)
    /// or holding U+0000, which no text the intake keeps may hold (PostgreSQL cannot store it).
    func string(_ name: String, maxLength: Int = 256) throws(APIError) -> String? {
        guard let value = fields[name], !(value is NSNull) else { return nil }
        guard let string = value as? String else { throw .invalidField(name, "must be a string") }
        // A string of at most maxLength bytes has at most maxLength code points: no count needed.
        guard string.utf8.count <= maxLength || string.unicodeScalars.count <= maxLength else {
            throw .invalidField(name, "is longer than \(maxLength) characters")
        }
        guard !string.utf8.contains(0) else { throw .invalidField(name, "contains a NUL character") }
        return string.isEmpty ? nil : string
    }

    /// An id field (`userId`, `orderId`, `productId`, …): a text field that `IdentifierText`
    /// accepts (no leading combining mark, no format, control or Prepend character).
    func id(_ name: String, maxLength: Int = 256) throws(APIError) -> String? {
        guard let value = try string(name, maxLength: maxLength) else { return nil }
        if let problem = IdentifierText.problem(value) { throw .invalidField(name, problem) }
        return value
    }

    func requiredID(_ name: String, maxLength: Int = 256) throws(APIError) -> String {
        guard let value = try id(name, maxLength: maxLength) else { throw .missingField(name) }
        return value
    }

    func requiredString(_ name: String, maxLength: Int = 256) throws(APIError) -> String {
        guard let value = try string(name, maxLength: maxLength) else { throw .missingField(name) }
        return value
    }

    func int(_ name: String) throws(APIError) -> Int? {
        guard let value = fields[name], !(value is NSNull) else { return nil }
        // JSON's true and false arrive as NSNumber too, and would pass for 1 and 0.
        guard type(of: value) != Self.booleanType, let number = value as? Int else {
            throw .invalidField(name, "must be a whole number")
        }
        return number
    }

    func bool(_ name: String) throws(APIError) -> Bool? {
        guard let value = fields[name], !(value is NSNull) else { return nil }
        guard type(of: value) == Self.booleanType, let flag = value as? Bool else {
            throw .invalidField(name, "must be true or false")
        }
        return flag
    }

    private static let booleanType = type(of: NSNumber(value: true))
}

/// The routes under `/v1/users/{userId}` act for the user the path names, who must be the
/// request's user (the token's subject; with authentication off, the one the request names):
/// anyone else's answers 404 `user_not_found`, as a user that does not exist does.
struct OwnUserMiddleware: RouterMiddleware {
    typealias Context = IntakeContext

    func handle(_ request: Request, context: Context, next: (Request, Context) async throws -> Response) async throws -> Response {
        let userId = try context.pathParameter("userId")
        guard context.userId.map({ sameUser($0, userId) }) ?? true else {
            throw APIError(.userNotFound, "no such user")
        }
        return try await next(request, context)
    }
}
