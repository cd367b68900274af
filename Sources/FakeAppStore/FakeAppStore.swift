import Foundation
import Hummingbird
import Logging
import NIOCore

/// A local stand-in for Apple: it mints purchases and answers `verifyReceipt` with Apple's
/// JSON shapes, with injectable latency and faults. Used by tests, benchmarks and `iap dev`.
///
/// Receipts are opaque tokens for now (`FAKE-RECEIPT-V1:<id>`, base64); what matters to the
/// pipeline is Apple's answer, which follows Apple's format.
public struct FakeAppStore: Sendable {
    static let receiptPrefix = "FAKE-RECEIPT-V1:"
    let ledger = FakeLedger()

    /// Creates an empty fake.
    public init() {}

    /// The routes: `/fake/...` to drive the fake, `/verifyReceipt` and `/sandbox/verifyReceipt` as Apple's.
    public func makeRouter() -> Router<BasicRequestContext> {
        let router = Router()
        router.get("/healthz") { _, _ in "ok" }
        router.post("/fake/purchases") { request, context in
            try await mintPurchase(request, context: context)
        }
        router.post("/fake/faults") { request, context in
            let fault = try await request.decode(as: FakeLedger.Fault.self, context: context)
            await ledger.addFault(fault)
            return HTTPResponse.Status.noContent
        }
        router.delete("/fake/faults") { _, _ in
            await ledger.clearFaults()
            return HTTPResponse.Status.noContent
        }
        router.post("/fake/config") { request, context in
            let config = try await request.decode(as: FakeConfig.self, context: context)
            if let latency = config.latencyMs { await ledger.setLatency(milliseconds: latency) }
            return HTTPResponse.Status.noContent
        }
        router.post("/verifyReceipt") { request, _ in
            try await verifyReceipt(request, endpoint: "Production")
        }
        router.post("/sandbox/verifyReceipt") { request, _ in
            try await verifyReceipt(request, endpoint: "Sandbox")
        }
        return router
    }

    /// Builds the fake as a runnable HTTP application.
    public func makeApplication(
        host: String, port: Int, logger: Logger,
        onServerRunning: @escaping @Sendable (any Channel) async -> Void = { _ in }
    ) -> some ApplicationProtocol {
        Application(
            router: makeRouter(),
            configuration: .init(address: .hostname(host, port: port), serverName: "fake-appstore"),
            onServerRunning: onServerRunning, logger: logger)
    }

    private struct FakeConfig: Decodable {
        var latencyMs: Int?
    }

    private struct MintRequest: Decodable {
        var bundleId: String
        var productId: String
        var environment: String?
        var applicationUsername: String?
        var quantity: Int?
        var deviceId: String?
    }

    private struct MintResponse: Encodable {
        var transactionId: String
        var originalTransactionId: String
        var receiptData: String
    }

    private func mintPurchase(_ request: Request, context: BasicRequestContext) async throws -> Response {
        let mint = try await request.decode(as: MintRequest.self, context: context)
        let environment = mint.environment ?? "Production"
        guard environment == "Production" || environment == "Sandbox" else {
            throw HTTPError(.badRequest, message: "environment must be Production or Sandbox")
        }
        let (purchase, receiptId) = await ledger.mint(
            bundleId: mint.bundleId, productId: mint.productId, environment: environment,
            quantity: max(mint.quantity ?? 1, 1), applicationUsername: mint.applicationUsername,
            deviceId: mint.deviceId)
        let token = Data((Self.receiptPrefix + receiptId).utf8).base64EncodedString()
        return try json(
            MintResponse(
                transactionId: purchase.transactionId, originalTransactionId: purchase.originalTransactionId,
                receiptData: token),
            status: .created)
    }

    private func verifyReceipt(_ request: Request, endpoint: String) async throws -> Response {
        var request = request
        let body = try await request.collectBody(upTo: 8 * 1024 * 1024)
        let latency = await ledger.latencyMs
        if latency > 0 { try await Task.sleep(for: .milliseconds(latency)) }
        if let fault = await ledger.takeFault() {
            if let delay = fault.delayMs { try await Task.sleep(for: .milliseconds(delay)) }
            if let httpStatus = fault.httpStatus {
                return Response(status: .init(code: httpStatus))
            }
            if let status = fault.status {
                return try json(AppleStatusOnly(status: status, environment: endpoint))
            }
        }
        guard
            let object = try? JSONSerialization.jsonObject(with: Data(body.readableBytesView)) as? [String: Any],
            let receiptData = object["receipt-data"] as? String,
            let decoded = Data(base64Encoded: receiptData),
            let token = String(data: decoded, encoding: .utf8), token.hasPrefix(Self.receiptPrefix)
        else {
            return try json(AppleStatusOnly(status: 21002, environment: endpoint))
        }
        guard let (receipt, purchases) = await ledger.receipt(String(token.dropFirst(Self.receiptPrefix.count))) else {
            return try json(AppleStatusOnly(status: 21003, environment: endpoint))
        }
        if receipt.environment == "Sandbox" && endpoint == "Production" {
            return try json(AppleStatusOnly(status: 21007, environment: endpoint))
        }
        if receipt.environment == "Production" && endpoint == "Sandbox" {
            return try json(AppleStatusOnly(status: 21008, environment: endpoint))
        }
        return try json(AppleVerifyReceiptAnswer(receipt: receipt, purchases: purchases))
    }

    private func json(_ value: some Encodable, status: HTTPResponse.Status = .ok) throws -> Response {
        let data = try JSONEncoder().encode(value)
        return Response(
            status: status, headers: [.contentType: "application/json"],
            body: .init(byteBuffer: ByteBuffer(bytes: data)))
    }
}

/// Apple's answer when it has no receipt to show.
struct AppleStatusOnly: Encodable {
    var status: Int
    var environment: String
}

/// Apple's `verifyReceipt` answer for a valid receipt: every number and date as a string.
struct AppleVerifyReceiptAnswer: Encodable {
    struct Receipt: Encodable {
        var receipt_type: String
        var bundle_id: String
        var application_version = "1"
        var original_application_version = "1.0"
        var in_app: [InApp]
    }

    struct InApp: Encodable {
        var quantity: String
        var product_id: String
        var transaction_id: String
        var original_transaction_id: String
        var purchase_date: String
        var purchase_date_ms: String
        var original_purchase_date_ms: String
        var is_trial_period = "false"
        var in_app_ownership_type = "PURCHASED"
    }

    var status = 0
    var environment: String
    var receipt: Receipt

    init(receipt: FakeLedger.Receipt, purchases: [FakeLedger.Purchase]) {
        environment = receipt.environment
        self.receipt = Receipt(
            receipt_type: receipt.environment == "Sandbox" ? "ProductionSandbox" : "Production",
            bundle_id: receipt.bundleId,
            in_app: purchases.map { purchase in
                let millis = String(Int64(purchase.purchaseDate.timeIntervalSince1970 * 1000))
                return InApp(
                    quantity: String(purchase.quantity), product_id: purchase.productId,
                    transaction_id: purchase.transactionId, original_transaction_id: purchase.originalTransactionId,
                    purchase_date: Self.appleDate(purchase.purchaseDate), purchase_date_ms: millis,
                    original_purchase_date_ms: millis)
            })
    }

    static func appleDate(_ date: Date) -> String {
        let formatter = DateFormatter()
        formatter.locale = Locale(identifier: "en_US_POSIX")
        formatter.timeZone = TimeZone(identifier: "UTC")
        formatter.dateFormat = "yyyy-MM-dd HH:mm:ss"
        return formatter.string(from: date) + " Etc/GMT"
    }
}
