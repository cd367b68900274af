public import AsyncHTTPClient
public import Foundation
public import IAPCore
import JWTKit
public import Logging
import Metrics
import NIOConcurrencyHelpers
import NIOCore
import NIOFoundationCompat
import NIOHTTP1

/// Which App Store a call goes to.
public enum ServerAPIEnvironment: String, Sendable, CaseIterable {
    case production = "Production"
    case sandbox = "Sandbox"
}

/// A failed App Store Server API call, classified for what to do next.
public struct ServerAPIError: Error, CustomStringConvertible, Sendable {
    public enum Kind: Sendable, Equatable {
        /// Apple is unavailable, slow, rate-limiting or says "try again" (4040002, 4040004,
        /// 4040006, 5000001, any 5xx, 429, a network failure or timeout).
        case transient
        /// Apple does not know this id here (4040010, 4040005): in production, ask the sandbox.
        case notFound
        /// The bearer token was refused (401); in production this also sends us to the sandbox.
        case unauthorized
        /// Anything else: the request is wrong and will stay wrong.
        case invalid
    }

    public var kind: Kind
    /// Apple's `errorCode`, when it sent one.
    public var errorCode: Int?
    public var httpStatus: Int?
    public var message: String
    /// For 429: when Apple allows the next request.
    public var retryAfter: Date?

    public var description: String {
        "\(kind) (HTTP \(httpStatus.map(String.init) ?? "none"), errorCode \(errorCode.map(String.init) ?? "none")): \(message)"
    }
}

/// A client of the App Store Server API: bearer tokens signed with the `.p8` key, Apple's
/// error bodies as typed errors, and a client-side limiter that keeps each endpoint under
/// Apple's per-app rate limits.
public final class AppStoreServerAPIClient: Sendable {
    public struct Settings: Sendable {
        /// The key's id in App Store Connect (JWT header `kid`).
        public var keyId: String
        /// The issuer id (claim `iss`).
        public var issuerId: String
        /// The `.p8` private key (PEM, P-256).
        public var privateKeyPEM: String
        /// The app (claim `bid`).
        public var bundleId: String
        /// Production base URL (Apple's host since May 2026; the `…itunes.apple.com` hosts still work).
        public var productionURL: String
        /// Sandbox base URL.
        public var sandboxURL: String
        /// Time allowed for one call.
        public var timeout: Duration
        /// The share of Apple's per-app limits this process may use (1 for one verifier;
        /// 1/N for N verifiers of the same app).
        public var rateShare: Double

        /// Creates settings with Apple's hosts.
        public init(
            keyId: String, issuerId: String, privateKeyPEM: String, bundleId: String,
            productionURL: String = Setting.appStoreAPIURL.defaultText, sandboxURL: String = Setting.appStoreSandboxAPIURL.defaultText,
            timeout: Duration = Setting.appStoreTimeoutSeconds.defaultSeconds, rateShare: Double = Setting.appStoreAPIRateShare.defaultDouble
        ) {
            self.keyId = keyId
            self.issuerId = issuerId
            self.privateKeyPEM = privateKeyPEM
            self.bundleId = bundleId
            self.productionURL = productionURL
            self.sandboxURL = sandboxURL
            self.timeout = timeout
            self.rateShare = rateShare
        }
    }

    /// Apple's limits per app, in requests per second (production; the sandbox gets 10 %).
    enum Endpoint: String {
        case transactionInfo, history, subscriptionStatuses, notificationHistory, consumption, finish, appAccountToken
        case appTransactionInfo, customerGroups, groupMembers
        case orderLookup, refundHistory
        case testNotification
        case extendRenewalDate, massExtendRenewalDate, massExtensionStatus

        /// Finish Transaction (API 1.20), Set App Account Token (1.16), Get App Transaction Info
        /// (1.17), Get Customer Groups and Get Group Members (1.22) are paced as the other
        /// per-transaction calls: Apple answers a faster caller 429, which holds the endpoint
        /// off until its `Retry-After`.
        var productionRate: Double {
            switch self {
            case .transactionInfo, .history, .subscriptionStatuses, .notificationHistory, .consumption, .finish,
                .appAccountToken, .appTransactionInfo, .customerGroups, .groupMembers:
                50
            case .orderLookup, .refundHistory: 10
            case .testNotification: 1
            // Renewal-date extensions are customer service's, one at a time: paced gently.
            case .extendRenewalDate, .massExtensionStatus: 20
            case .massExtendRenewalDate: 1
            }
        }
    }

    public let settings: Settings
    private let httpClient: HTTPClient
    private let keys: JWTKeyCollection
    private let logger: Logger
    private let limiter = NIOLockedValueBox([String: ContinuousClock.Instant]())

    private let signingKey: ES256PrivateKey
    private let keyAdded = NIOLockedValueBox(false)

    /// Creates a client; throws when the key is not a P-256 PEM private key.
    public init(settings: Settings, httpClient: HTTPClient, logger: Logger) throws {
        self.settings = settings
        self.httpClient = httpClient
        self.logger = logger
        signingKey = try ES256PrivateKey(pem: settings.privateKeyPEM)
        keys = JWTKeyCollection()
    }

    // MARK: - Calls

    /// One page of signed transactions (history, refund history).
    public struct TransactionPage: Decodable, Sendable {
        public var revision: String?
        public var hasMore: Bool?
        public var signedTransactions: [String]?
    }

    /// Get Transaction Info: the signed transaction.
    public func transactionInfo(_ transactionId: String, in environment: ServerAPIEnvironment) async throws(ServerAPIError)
        -> String
    {
        struct Answer: Decodable { var signedTransactionInfo: String }
        let answer: Answer = try await call(
            .GET, "/inApps/v1/transactions/\(try Self.pathId(transactionId))", environment, endpoint: .transactionInfo)
        return answer.signedTransactionInfo
    }

    /// Get Transaction History v2: every transaction of the customer (finished consumables
    /// included), page by page from `revision`.
    public func transactionHistory(_ transactionId: String, revision: String?, in environment: ServerAPIEnvironment)
        async throws(ServerAPIError) -> TransactionPage
    {
        try await call(
            .GET, "/inApps/v2/history/\(try Self.pathId(transactionId))" + Self.query(["revision": revision]), environment,
            endpoint: .history)
    }

    /// Look Up Order ID: the transactions of an invoice (the order id on the customer's receipt email).
    public func lookUpOrder(_ orderId: String, in environment: ServerAPIEnvironment) async throws(ServerAPIError)
        -> (valid: Bool, signedTransactions: [String])
    {
        struct Answer: Decodable {
            var status: Int
            var signedTransactions: [String]?
        }
        let answer: Answer = try await call(.GET, "/inApps/v1/lookup/\(try Self.pathId(orderId))", environment, endpoint: .orderLookup)
        return (answer.status == 0, answer.signedTransactions ?? [])
    }

    /// Get Refund History v2.
    public func refundHistory(_ transactionId: String, revision: String?, in environment: ServerAPIEnvironment)
        async throws(ServerAPIError) -> TransactionPage
    {
        try await call(
            .GET, "/inApps/v2/refund/lookup/\(try Self.pathId(transactionId))" + Self.query(["revision": revision]),
            environment, endpoint: .refundHistory)
    }

    /// Get All Subscription Statuses, as Apple's JSON.
    public struct SubscriptionStatuses: Decodable, Sendable {
        public struct Group: Decodable, Sendable {
            public struct Last: Decodable, Sendable {
                public var status: Int?
                public var originalTransactionId: String?
                public var signedTransactionInfo: String?
                public var signedRenewalInfo: String?
            }
            public var subscriptionGroupIdentifier: String?
            public var lastTransactions: [Last]?
        }
        public var environment: String?
        public var bundleId: String?
        public var data: [Group]?
    }

    public func subscriptionStatuses(_ transactionId: String, in environment: ServerAPIEnvironment)
        async throws(ServerAPIError) -> SubscriptionStatuses
    {
        try await call(
            .GET, "/inApps/v1/subscriptions/\(try Self.pathId(transactionId))", environment, endpoint: .subscriptionStatuses)
    }

    /// Get Notification History (for reconciliation: `onlyFailures` lists what did not reach us).
    public struct NotificationHistory: Decodable, Sendable {
        public struct Item: Decodable, Sendable {
            public var signedPayload: String
        }
        public var notificationHistory: [Item]?
        public var hasMore: Bool?
        public var paginationToken: String?
    }

    public func notificationHistory(
        from start: Date, to end: Date, onlyFailures: Bool, paginationToken: String?, in environment: ServerAPIEnvironment
    ) async throws(ServerAPIError) -> NotificationHistory {
        struct Body: Encodable {
            var startDate: Int64
            var endDate: Int64
            var onlyFailures: Bool
        }
        return try await call(
            .POST, "/inApps/v1/notifications/history" + Self.query(["paginationToken": paginationToken]), environment,
            endpoint: .notificationHistory,
            body: Body(startDate: start.appleMilliseconds, endDate: end.appleMilliseconds, onlyFailures: onlyFailures))
    }

    /// Request a Test Notification; returns its token.
    public func requestTestNotification(in environment: ServerAPIEnvironment) async throws(ServerAPIError) -> String {
        struct Answer: Decodable { var testNotificationToken: String }
        let answer: Answer = try await call(.POST, "/inApps/v1/notifications/test", environment, endpoint: .testNotification)
        return answer.testNotificationToken
    }

    /// What Send Consumption Information tells Apple about a refund request.
    public typealias ConsumptionInformation = IAPCore.ConsumptionInformation

    /// Send Consumption Information (v2), in answer to a CONSUMPTION_REQUEST notification.
    public func sendConsumptionInformation(
        _ transactionId: String, _ information: ConsumptionInformation, in environment: ServerAPIEnvironment
    ) async throws(ServerAPIError) {
        let _: Empty = try await call(
            .PUT, "/inApps/v2/transactions/consumption/\(try Self.pathId(transactionId))", environment,
            endpoint: .consumption, body: information)
    }

    /// Finish Transaction (API 1.20): tells Apple the server finished processing a transaction
    /// (it delivered the content), as the app's `finish()` does; a finished consumable leaves
    /// the device's later receipts. Finishing a transaction Apple already holds finished is
    /// not an error. `notFound` for an id this environment never issued.
    public func finishTransaction(_ transactionId: String, in environment: ServerAPIEnvironment) async throws(ServerAPIError) {
        let _: Empty = try await call(
            .POST, "/inApps/v1/transactions/\(try Self.pathId(transactionId))/finish", environment, endpoint: .finish)
    }

    /// Get App Transaction Info (API 1.17): the signed `AppTransaction` of the customer that
    /// `anyTransactionId` (a transaction, original transaction or app transaction id) belongs to.
    public func appTransactionInfo(_ anyTransactionId: String, in environment: ServerAPIEnvironment) async throws(ServerAPIError)
        -> String
    {
        struct Answer: Decodable { var signedAppTransactionInfo: String }
        let answer: Answer = try await call(
            .GET, "/inApps/v1/transactions/appTransactions/\(try Self.pathId(anyTransactionId))", environment,
            endpoint: .appTransactionInfo)
        return answer.signedAppTransactionInfo
    }

    /// A group a customer belongs to (Get Customer Groups, API 1.22): an organization that
    /// assigns seats of a multiseat subscription, or a group of consumers.
    public struct CustomerGroup: Codable, Sendable, Equatable {
        /// Apple's id of the group.
        public var groupId: String
        /// `ORGANIZATION` or `CONSUMER`, as Apple spells it (a new value is kept as sent).
        public var groupType: String
        /// The customer's role per product (`ADMIN`, `NONE`); organizations only.
        public var roles: [Role]?

        /// The customer's role for one product of the group.
        public struct Role: Codable, Sendable, Equatable {
            public var productId: String
            public var role: String
        }
    }

    /// Get Customer Groups (API 1.22): the groups the customer of `anyTransactionId` (a
    /// transaction, original transaction or app transaction id) is in now; empty when none.
    public func customerGroups(_ anyTransactionId: String, in environment: ServerAPIEnvironment) async throws(ServerAPIError)
        -> [CustomerGroup]
    {
        struct Answer: Decodable { var groups: [CustomerGroup]? }
        let answer: Answer = try await call(
            .GET, "/groups/v1/currentGroups/\(try Self.pathId(anyTransactionId))", environment, endpoint: .customerGroups)
        return answer.groups ?? []
    }

    /// One page of a group's members (Get Group Members, API 1.22).
    public struct GroupMembersPage: Codable, Sendable, Equatable {
        /// Each member, as Apple's id of their download of the app.
        public var members: [Member]
        /// Hand it back for the next page; only when `hasMore`.
        public var paginationToken: String?
        public var hasMore: Bool

        /// One member of the group.
        public struct Member: Codable, Sendable, Equatable {
            public var appTransactionId: String
        }
    }

    /// Whether `text` can be Apple's group id: digits, at most 20 of them.
    public static func isGroupId(_ text: String) -> Bool {
        !text.isEmpty && text.count <= 20 && text.allSatisfy { $0.isASCII && $0.isNumber }
    }

    /// Whether `text` can be a page token Apple gave: 1 to 1,000 printable ASCII characters.
    public static func isPaginationToken(_ text: String) -> Bool {
        !text.isEmpty && text.count <= 1000 && text.unicodeScalars.allSatisfy { (0x21...0x7E).contains($0.value) }
    }

    /// Get Group Members (API 1.22): one page of `groupId`'s members, at most `limit` (1 to 100)
    /// of them. Apple answers 4040022 (not found) for a group it does not know.
    public func groupMembers(
        _ groupId: String, paginationToken: String? = nil, limit: Int? = nil, in environment: ServerAPIEnvironment
    ) async throws(ServerAPIError) -> GroupMembersPage {
        try await call(
            .GET, "/groups/v1/group/\(try Self.pathId(groupId))"
                + Self.query(["paginationToken": paginationToken, "limit": limit.map(String.init)]),
            environment, endpoint: .groupMembers)
    }

    /// A group one of a user's customers is in: Apple's answer, where it was asked, with which id.
    public struct FoundGroup: Sendable {
        public var group: CustomerGroup
        public var environment: ServerAPIEnvironment
        public var askedWith: String
    }

    /// The groups `customers` (each an id Apple takes for a customer, in its environment) are in
    /// now, each listed once; a customer Apple does not list is in none.
    public func groups(ofCustomers customers: [(id: String, environment: ServerAPIEnvironment)]) async throws(ServerAPIError)
        -> [FoundGroup]
    {
        var found: [FoundGroup] = []
        for customer in customers {
            let groups: [CustomerGroup]
            do {
                groups = try await customerGroups(customer.id, in: customer.environment)
            } catch where error.kind == .notFound {
                continue
            }
            for group in groups
            where !found.contains(where: { $0.group.groupId == group.groupId && $0.environment == customer.environment }) {
                found.append(FoundGroup(group: group, environment: customer.environment, askedWith: customer.id))
            }
        }
        return found
    }

    /// Get Group Members in the first of `environments` that knows the group; nil when none does.
    /// A page token is the environment's that gave it: where Apple refuses it (4000014) and
    /// another environment is left, that one is asked.
    public func groupMembers(
        _ groupId: String, paginationToken: String?, limit: Int?, inFirstOf environments: [ServerAPIEnvironment]
    ) async throws(ServerAPIError) -> (page: GroupMembersPage, environment: ServerAPIEnvironment)? {
        for (index, environment) in environments.enumerated() {
            do {
                return (try await groupMembers(groupId, paginationToken: paginationToken, limit: limit, in: environment), environment)
            } catch where error.kind == .notFound {
                continue
            } catch where paginationToken != nil && error.errorCode == 4_000_014 && index < environments.count - 1 {
                continue
            }
        }
        return nil
    }

    /// Set App Account Token (API 1.16): binds the purchase `originalTransactionId` names to
    /// `token` (a purchase made outside the app, or one bound to the wrong account); its
    /// transactions, and the renewals to come, carry that `appAccountToken`. Apple refuses a
    /// transaction id that is not an original one (4000187), a Family Sharing purchase
    /// (4000185) and, with multiseat subscriptions, an assigned one (4000227): `invalid`.
    public func setAppAccountToken(_ token: UUID, originalTransactionId: String, in environment: ServerAPIEnvironment)
        async throws(ServerAPIError)
    {
        struct Body: Encodable { var appAccountToken: String }
        let _: Empty = try await call(
            .PUT, "/inApps/v1/transactions/\(try Self.pathId(originalTransactionId))/appAccountToken", environment,
            endpoint: .appAccountToken, body: Body(appAccountToken: token.uuidString.lowercased()))
    }

    /// Apple's `extendReasonCode`: 0 undeclared, 1 customer satisfaction, 2 other, 3 a service
    /// issue or outage.
    public static let extendReasonCodes = 0...3

    /// Apple's answer to Extend a Subscription Renewal Date.
    public struct RenewalExtension: Decodable, Sendable, Equatable {
        public var originalTransactionId: String?
        public var webOrderLineItemId: String?
        public var success: Bool?
        /// The period's new end (Apple's `effectiveDate`).
        public var effectiveDate: Date?

        enum CodingKeys: String, CodingKey { case originalTransactionId, webOrderLineItemId, success, effectiveDate }

        public init(from decoder: any Decoder) throws {
            let container = try decoder.container(keyedBy: CodingKeys.self)
            originalTransactionId = try container.decodeIfPresent(String.self, forKey: .originalTransactionId)
            webOrderLineItemId = try container.decodeIfPresent(String.self, forKey: .webOrderLineItemId)
            success = try container.decodeIfPresent(Bool.self, forKey: .success)
            effectiveDate = try container.decodeIfPresent(Int64.self, forKey: .effectiveDate).map(Date.init(appleMilliseconds:))
        }
    }

    /// Extend a Subscription Renewal Date (API 1.1): the paid period in force of the
    /// subscription `originalTransactionId` ends `days` (1 to 90) later. `requestIdentifier`
    /// is the caller's id of this request: asking again with the same one extends once. Apple
    /// refuses a free offer period, an expired or billing-retry subscription and a third
    /// extension within 365 days (4030004, 4030005), a family member's access (4030007), an
    /// assigned seat (4030028): `invalid`; an unknown chain is `notFound` (4040005).
    public func extendRenewalDate(
        originalTransactionId: String, days: Int, reasonCode: Int, requestIdentifier: String, in environment: ServerAPIEnvironment
    ) async throws(ServerAPIError) -> RenewalExtension {
        struct Body: Encodable {
            var extendByDays: Int
            var extendReasonCode: Int
            var requestIdentifier: String
        }
        return try await call(
            .PUT, "/inApps/v1/subscriptions/extend/\(try Self.pathId(originalTransactionId))", environment,
            endpoint: .extendRenewalDate,
            body: Body(extendByDays: days, extendReasonCode: reasonCode, requestIdentifier: requestIdentifier))
    }

    /// Extend Subscription Renewal Dates for All Active Subscribers (API 1.7): every eligible
    /// subscription of `productId` (in `storefrontCountryCodes`, or every storefront when
    /// empty) is extended by `days`; Apple works through them in the background and tells of
    /// each (`RENEWAL_EXTENDED`, `RENEWAL_EXTENSION` `FAILURE`) and of the end
    /// (`RENEWAL_EXTENSION` `SUMMARY`). Returns Apple's echo of `requestIdentifier`.
    public func massExtendRenewalDate(
        productId: String, days: Int, reasonCode: Int, requestIdentifier: String, storefrontCountryCodes: [String],
        in environment: ServerAPIEnvironment
    ) async throws(ServerAPIError) -> String {
        struct Body: Encodable {
            var extendByDays: Int
            var extendReasonCode: Int
            var requestIdentifier: String
            var storefrontCountryCodes: [String]?
            var productId: String
        }
        struct Answer: Decodable { var requestIdentifier: String? }
        let answer: Answer = try await call(
            .POST, "/inApps/v1/subscriptions/extend/mass", environment, endpoint: .massExtendRenewalDate,
            body: Body(
                extendByDays: days, extendReasonCode: reasonCode, requestIdentifier: requestIdentifier,
                storefrontCountryCodes: storefrontCountryCodes.isEmpty ? nil : storefrontCountryCodes, productId: productId))
        return answer.requestIdentifier ?? requestIdentifier
    }

    /// Apple's answer to Get Status of Subscription Renewal Date Extensions.
    public struct MassExtensionStatus: Decodable, Sendable, Equatable {
        public var requestIdentifier: String?
        public var complete: Bool?
        public var completeDate: Date?
        public var succeededCount: Int64?
        public var failedCount: Int64?

        enum CodingKeys: String, CodingKey { case requestIdentifier, complete, completeDate, succeededCount, failedCount }

        public init(from decoder: any Decoder) throws {
            let container = try decoder.container(keyedBy: CodingKeys.self)
            requestIdentifier = try container.decodeIfPresent(String.self, forKey: .requestIdentifier)
            complete = try container.decodeIfPresent(Bool.self, forKey: .complete)
            completeDate = try container.decodeIfPresent(Int64.self, forKey: .completeDate).map(Date.init(appleMilliseconds:))
            succeededCount = try container.decodeIfPresent(Int64.self, forKey: .succeededCount)
            failedCount = try container.decodeIfPresent(Int64.self, forKey: .failedCount)
        }
    }

    /// Get Status of Subscription Renewal Date Extensions (API 1.7): how far Apple has come
    /// with a mass extension; `notFound` (4040009) for a request it does not know.
    public func massExtensionStatus(productId: String, requestIdentifier: String, in environment: ServerAPIEnvironment)
        async throws(ServerAPIError) -> MassExtensionStatus
    {
        try await call(
            .GET,
            "/inApps/v1/subscriptions/extend/mass/\(try Self.productPathId(productId))/\(try Self.pathId(requestIdentifier))",
            environment, endpoint: .massExtensionStatus)
    }

    // MARK: - Plumbing

    private struct Empty: Decodable {}
    private struct AppleErrorBody: Decodable {
        var errorCode: Int?
        var errorMessage: String?
    }
    private struct NoBody: Encodable {}

    private struct Claims: JWTPayload {
        var iss: IssuerClaim
        var iat: IssuedAtClaim
        var exp: ExpirationClaim
        var aud: AudienceClaim
        var bid: String

        func verify(using algorithm: some JWTAlgorithm) async throws {}
    }

    /// A fresh bearer token: ES256 with `kid` and `typ: JWT`; five minutes of life.
    func bearerToken(now: Date = Date()) async throws -> String {
        if !keyAdded.withLockedValue({ $0 }) {
            await keys.add(ecdsa: signingKey, kid: JWKIdentifier(string: settings.keyId))
            keyAdded.withLockedValue { $0 = true }
        }
        let issued = Date(timeIntervalSince1970: now.timeIntervalSince1970.rounded(.down))
        var header = JWTHeader()
        header.typ = "JWT"
        return try await keys.sign(
            Claims(
                iss: .init(value: settings.issuerId), iat: .init(value: issued), exp: .init(value: issued.addingTimeInterval(300)),
                aud: .init(value: ["appstoreconnect-v1"]), bid: settings.bundleId),
            kid: JWKIdentifier(string: settings.keyId), header: header)
    }

    /// Ids go into paths: digits, letters, `-` and `_` only.
    private static func pathId(_ id: String) throws(ServerAPIError) -> String {
        guard !id.isEmpty, id.count <= 64, id.allSatisfy({ $0.isASCII && ($0.isLetter || $0.isNumber || $0 == "-" || $0 == "_") })
        else {
            throw ServerAPIError(kind: .invalid, message: "'\(id.prefix(64))' is not an id Apple issues")
        }
        return id
    }

    /// Product ids go into paths: letters, digits, `.`, `-` and `_` only (what App Store
    /// Connect allows in one).
    public static func isProductId(_ id: String) -> Bool {
        guard let first = id.first, first != ".", id.count <= 100 else { return false }
        return id.allSatisfy({ $0.isASCII && ($0.isLetter || $0.isNumber || $0 == "." || $0 == "-" || $0 == "_") })
    }

    private static func productPathId(_ id: String) throws(ServerAPIError) -> String {
        guard isProductId(id) else {
            throw ServerAPIError(kind: .invalid, message: "'\(id.prefix(100))' is not a product id")
        }
        return id
    }

    private static func query(_ items: [String: String?]) -> String {
        let present = items.compactMap { key, value in
            value.map { "\(key)=\($0.addingPercentEncoding(withAllowedCharacters: .alphanumerics) ?? "")" }
        }
        return present.isEmpty ? "" : "?" + present.sorted().joined(separator: "&")
    }

    private func call<Answer: Decodable>(
        _ method: HTTPMethod, _ path: String, _ environment: ServerAPIEnvironment, endpoint: Endpoint,
        body: (some Encodable)? = NoBody?.none
    ) async throws(ServerAPIError) -> Answer {
        await pace(endpoint, environment)
        let base = environment == .production ? settings.productionURL : settings.sandboxURL
        var request = HTTPClientRequest(url: base + path)
        request.method = method
        request.headers.add(name: "Accept", value: "application/json")
        request.headers.add(name: "User-Agent", value: "iap-pipeline")
        let started = ContinuousClock.now
        let response: HTTPClientResponse
        let bytes: ByteBuffer
        do {
            request.headers.add(name: "Authorization", value: "Bearer \(try await bearerToken())")
            if let body {
                request.headers.add(name: "Content-Type", value: "application/json")
                request.body = .bytes(ByteBuffer(data: try JSONEncoder().encode(body)))
            }
            response = try await httpClient.execute(request, timeout: .init(settings.timeout))
            bytes = try await response.body.collect(upTo: 16 << 20)
        } catch {
            record(endpoint, "transport", since: started)
            throw ServerAPIError(kind: .transient, message: "\(method) \(path) in \(environment.rawValue): \(error)")
        }
        let status = Int(response.status.code)
        record(endpoint, String(status), since: started)
        if (200..<300).contains(status) {
            if Answer.self == Empty.self { return Empty() as! Answer }
            do {
                return try JSONDecoder().decode(Answer.self, from: Data(buffer: bytes))
            } catch {
                throw ServerAPIError(
                    kind: .transient, httpStatus: status, message: "unexpected answer to \(method) \(path): \(error)")
            }
        }
        let apple = try? JSONDecoder().decode(AppleErrorBody.self, from: Data(buffer: bytes))
        let message = apple?.errorMessage ?? "HTTP \(status)"
        var error = ServerAPIError(kind: .invalid, errorCode: apple?.errorCode, httpStatus: status, message: message)
        switch (status, apple?.errorCode) {
        case (429, _):
            error.kind = .transient
            error.retryAfter = response.headers.first(name: "Retry-After").flatMap(Int64.init).map(Date.init(appleMilliseconds:))
            if let until = error.retryAfter { holdOff(endpoint, environment, until: until) }
        case (401, _):
            error.kind = .unauthorized
        case (_, 4_040_002?), (_, 4_040_004?), (_, 4_040_006?), (_, 5_000_001?):
            error.kind = .transient
        case (_, 4_040_010?), (_, 4_040_005?), (_, 4_040_009?), (_, 4_040_019?), (_, 4_040_022?):
            error.kind = .notFound
        case (500..<600, _):
            error.kind = .transient
        default:
            // Every other answer is Apple's word for good (`invalid`): among them 4000227 (an
            // assigned seat refuses consumption answers and Set App Account Token) and 4030028
            // (no renewal-date extension for an assigned subscription).
            break
        }
        if error.kind == .unauthorized {
            logger.warning("App Store Server API refused our token", metadata: ["appstore.environment": "\(environment.rawValue)"])
        }
        throw error
    }

    /// Calls to the Server API share the Apple latency histogram, as `server_api.<endpoint>`.
    private func record(_ endpoint: Endpoint, _ status: String, since started: ContinuousClock.Instant) {
        let statusClass = Int(status).map { "\($0 / 100)xx" } ?? "error"
        Timer(label: MetricNames.appleRequestDuration, dimensions: [("endpoint", "server_api.\(endpoint.rawValue)"), ("status_class", statusClass)])
            .record(duration: ContinuousClock.now - started)
    }

    /// After a 429, no call to this endpoint goes out before Apple's `Retry-After` (at most 10 minutes ahead).
    private func holdOff(_ endpoint: Endpoint, _ environment: ServerAPIEnvironment, until: Date) {
        let wait = min(max(0, until.timeIntervalSinceNow), 600)
        let resume = ContinuousClock.now + .milliseconds(Int64(wait * 1000))
        limiter.withLockedValue { slots in
            let key = "\(endpoint.rawValue).\(environment.rawValue)"
            slots[key] = max(slots[key] ?? resume, resume)
        }
    }

    /// Waits for this endpoint's turn: requests are spaced at Apple's rate (times our share),
    /// with bursts of up to one second's worth, so a backlog never trips Apple's enforcement.
    private func pace(_ endpoint: Endpoint, _ environment: ServerAPIEnvironment) async {
        let rate = max(0.1, endpoint.productionRate * (environment == .production ? 1 : 0.1) * settings.rateShare)
        let interval = Duration.seconds(1 / rate)
        let burst = interval * max(1, Int(rate))
        let now = ContinuousClock.now
        let start = limiter.withLockedValue { slots -> ContinuousClock.Instant in
            let key = "\(endpoint.rawValue).\(environment.rawValue)"
            // The theoretical arrival time of the next request, never more than a burst behind now.
            let next = max(slots[key] ?? now, now - burst)
            slots[key] = next + interval
            return next
        }
        if start > now { try? await Task.sleep(until: start, clock: .continuous) }
    }
}
