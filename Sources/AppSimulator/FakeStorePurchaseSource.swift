public import Foundation
public import IAPClient

/// `PurchaseSource` over the fake App Store's routes: one simulated device buying
/// (`POST /fake/purchases`), finishing (`POST /fake/purchases/{id}/finish`), its unfinished
/// transactions (`GET /fake/devices/{id}/transactions`) and receipt. The real client code runs
/// on top of it as it runs on StoreKit.
public final class FakeStorePurchaseSource: PurchaseSource {
    /// What the fake App Store said when it was not what a purchase needs.
    public struct Failure: Error, CustomStringConvertible {
        /// What went wrong.
        public var description: String
    }

    private let fakeURL: URL
    private let bundleId: String
    /// The simulated device (the fake's `deviceId`): its purchases are what StoreKit holds.
    public let deviceId: String
    private let environment: String
    private let productTypes: @Sendable (String) -> String
    private let transport: any HTTPTransport
    private let updates: AsyncStream<StoreTransaction>
    private let updatesSink: AsyncStream<StoreTransaction>.Continuation

    /// A device `deviceId` of `bundleId` at the fake App Store at `fakeURL`; `productTypes` gives a
    /// product's App Store type (`consumable`, `auto_renewable`, …) as the catalog says.
    public init(
        fakeURL: URL, bundleId: String, deviceId: String, environment: String = "Production",
        transport: any HTTPTransport, productTypes: @escaping @Sendable (String) -> String
    ) {
        self.fakeURL = fakeURL
        self.bundleId = bundleId
        self.deviceId = deviceId
        self.environment = environment
        self.transport = transport
        self.productTypes = productTypes
        (updates, updatesSink) = AsyncStream.makeStream(of: StoreTransaction.self)
    }

    public func purchase(productId: String, appAccountToken: UUID) async throws -> StorePurchaseResult {
        let body: [String: String] = [
            "bundleId": bundleId, "productId": productId, "deviceId": deviceId, "environment": environment,
            "appAccountToken": appAccountToken.uuidString.lowercased(), "type": productTypes(productId),
        ]
        let answer = try await call("POST", "/fake/purchases", body: body, expect: [201])
        guard let object = try JSONSerialization.jsonObject(with: answer.body) as? [String: Any],
            let signed = object["signedTransaction"] as? String, let transaction = Self.transaction(signed: signed)
        else { throw Failure(description: "the fake App Store's mint answer lacks a signed transaction") }
        return .purchased(transaction)
    }

    public func unfinishedTransactions() async throws -> [StoreTransaction] {
        try await deviceTransactions().filter { $0.finishedDateMs == nil }.compactMap { Self.transaction(signed: $0.signedTransaction) }
    }

    public func transactionUpdates() -> AsyncStream<StoreTransaction> {
        updates
    }

    /// Hands the app a transaction outside a purchase sheet, as `Transaction.updates` does (a
    /// purchase made elsewhere, an Ask to Buy approval).
    public func deliver(_ transaction: StoreTransaction) {
        updatesSink.yield(transaction)
    }

    public func finish(transactionId: String) async throws {
        _ = try await call("POST", "/fake/purchases/\(transactionId)/finish", expect: [200, 404])
    }

    public func appReceipt() async throws -> String? {
        let answer = try await call("POST", "/fake/devices/\(deviceId)/receipt", expect: [200, 404])
        guard answer.status == 200 else { return nil }
        return (try JSONSerialization.jsonObject(with: answer.body) as? [String: Any])?["receiptData"] as? String
    }

    /// A purchase as the fake App Store holds it for this device.
    public struct DeviceTransaction: Decodable, Sendable {
        /// Apple's transaction id.
        public var transactionId: String
        /// The product.
        public var productId: String
        /// Its App Store type.
        public var type: String
        /// When it was finished, in milliseconds since 1970; nil while unfinished.
        public var finishedDateMs: String?
        /// Whether Apple refunded or revoked it.
        public var revoked: Bool
        /// The signed transaction as StoreKit hands it over.
        public var signedTransaction: String
    }

    /// Every purchase the device made, finished or not, oldest first.
    public func deviceTransactions() async throws -> [DeviceTransaction] {
        struct Answer: Decodable { var transactions: [DeviceTransaction] }
        let answer = try await call("GET", "/fake/devices/\(deviceId)/transactions", expect: [200])
        return try JSONDecoder().decode(Answer.self, from: answer.body).transactions
    }

    /// The transaction a signed transaction carries, read as StoreKit's `unsafePayloadValue`
    /// (the order service checks the signature).
    public static func transaction(signed: String) -> StoreTransaction? {
        let parts = signed.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let payload = Data(base64URL: String(parts[1])),
            let object = try? JSONSerialization.jsonObject(with: payload) as? [String: Any],
            let transactionId = object["transactionId"] as? String,
            let originalTransactionId = object["originalTransactionId"] as? String,
            let productId = object["productId"] as? String
        else { return nil }
        let purchaseDate = (object["purchaseDate"] as? NSNumber).map { Date(timeIntervalSince1970: $0.doubleValue / 1000) } ?? Date()
        return StoreTransaction(
            transactionId: transactionId, originalTransactionId: originalTransactionId, productId: productId,
            appAccountToken: (object["appAccountToken"] as? String).flatMap(UUID.init(uuidString:)), purchaseDate: purchaseDate,
            signedTransaction: signed)
    }

    private func call(_ method: String, _ path: String, body: [String: String]? = nil, expect: Set<Int>) async throws -> HTTPAnswer {
        guard let url = URL(string: fakeURL.absoluteString + path) else { throw Failure(description: "cannot make a URL of \(path)") }
        var headers: [String: String] = [:]
        var data: Data?
        if let body {
            headers["Content-Type"] = "application/json"
            data = try JSONSerialization.data(withJSONObject: body)
        }
        let answer = try await transport.send(HTTPExchange(method: method, url: url, headers: headers, body: data))
        guard expect.contains(answer.status) else {
            throw Failure(description: "\(method) \(path) at the fake App Store answered \(answer.status): \(String(decoding: answer.body, as: UTF8.self))")
        }
        return answer
    }
}

extension Data {
    /// Base64url without padding, as a JWS part is.
    init?(base64URL text: String) {
        var base64 = text.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        base64 += String(repeating: "=", count: (4 - base64.count % 4) % 4)
        self.init(base64Encoded: base64)
    }
}
