public import AsyncHTTPClient
import Foundation
public import IAPCore
public import Logging
import Metrics
import NIOCore
import NIOFoundationCompat
import NIOHTTP1

/// Verifies app receipts with Apple's (deprecated, still served) `verifyReceipt` endpoint.
///
/// Production first; a `21007` answer sends the receipt to the sandbox, a `21008` from the
/// sandbox sends it back to production. Apple's statuses are classified so that only a
/// definitive answer rejects; everything that may pass becomes `.retryLater`.
public struct VerifyReceiptClient: ReceiptVerifying {
    /// How the client behaves.
    public struct Settings: Sendable {
        /// Where to send receipts.
        public var endpoints: VerifyReceiptEndpoints
        /// The app-specific shared secret (needed for auto-renewable subscriptions).
        public var sharedSecret: String?
        /// Bundle ids this deployment serves; a receipt of any other app is rejected.
        public var bundleIds: Set<String>
        /// Time allowed for one call to Apple.
        public var timeout: Duration
        /// `21002` answers ("malformed, or try again") after which the upload waits for a person.
        public var malformedRetryLimit: Int

        /// Creates settings.
        public init(
            endpoints: VerifyReceiptEndpoints, sharedSecret: String? = nil, bundleIds: Set<String>,
            timeout: Duration = Setting.appStoreTimeoutSeconds.defaultSeconds, malformedRetryLimit: Int = 3
        ) {
            self.endpoints = endpoints
            self.sharedSecret = sharedSecret
            self.bundleIds = bundleIds
            self.timeout = timeout
            self.malformedRetryLimit = malformedRetryLimit
        }
    }

    private let settings: Settings
    private let httpClient: HTTPClient
    private let logger: Logger

    /// Creates a client that uses `httpClient` (owned by the caller).
    public init(settings: Settings, httpClient: HTTPClient, logger: Logger) {
        self.settings = settings
        self.httpClient = httpClient
        self.logger = logger
    }

    // Only the waits are async: an async function's locals, and those of everything inlined
    // into it, live in its task's frame for the whole call, and a verifier holds thousands of
    // calls at once. The synchronous steps are kept out of line, so their locals stay on the
    // thread's stack.

    public func verify(_ request: VerifyRequest) async -> VerificationOutcome {
        var environment = AppStoreEnvironment.production
        // At most one switch each way: production → sandbox (21007) → production (21008).
        for _ in 0..<3 {
            switch await call(environment, receiptData: request.receiptData) {
            case .success(let answer):
                switch next(after: answer, calledIn: environment, for: request) {
                case .done(let outcome): return outcome
                case .ask(let other): environment = other
                }
            case .failure(let box):
                return box.outcome
            }
        }
        return .retryLater(.unexpectedAppleResponse, message: "Apple kept switching environments")
    }

    /// What an answer means: an outcome, or the environment to ask instead.
    private enum Step {
        case done(VerificationOutcome)
        case ask(AppStoreEnvironment)
    }

    @inline(never)
    private func next(after answer: VerifyReceiptResponse, calledIn environment: AppStoreEnvironment, for request: VerifyRequest)
        -> Step
    {
        let status = Int(answer.status.value) ?? -1
        switch status {
        case 0, 21006:
            return .done(verified(answer, calledIn: environment))
        case 21007 where environment == .production:
            return .ask(.sandbox)
        case 21008 where environment == .sandbox:
            return .ask(.production)
        case 21000:
            // Our request, not the receipt: a fault of this deployment. Retried and alerted.
            logger.error(
                "verifyReceipt answered 21000: the request we sent is malformed",
                metadata: ["iap.submission.id": "\(request.submissionId)"])
            return .done(.retryLater(.appleBadRequest, message: "Apple answered 21000: our request was malformed"))
        case 21003, 21010:
            return .done(.rejected(.invalidReceipt, message: "Apple answered status \(status)"))
        case 21002:
            // "Malformed, or a temporary issue": Apple cannot tell us which, so it never rejects.
            let answers = (request.malformedAnswers ?? 0) + 1
            if answers >= settings.malformedRetryLimit {
                return .done(
                    .needsReview(.appleMalformed, message: "Apple answered 21002 \(answers) times: a person must look"))
            }
            return .done(.retryLater(.appleMalformed, message: "Apple answered 21002 (malformed or temporary)"))
        case 21004:
            logger.error(
                "verifyReceipt refused the shared secret",
                metadata: ["iap.submission.id": "\(request.submissionId)"])
            return .done(.retryLater(.sharedSecretMismatch, message: "Apple answered 21004: check the shared secret"))
        case 21005, 21009:
            return .done(.retryLater(.appleUnavailable, message: "Apple answered status \(status)"))
        case 21100...21199:
            // Apple's flag says whether retrying can help; without the flag, assume it can.
            if answer.retryable == false {
                return .done(.needsReview(.appleUnresolvable, message: "Apple answered status \(status), not retryable"))
            }
            return .done(.retryLater(.appleRetryable, message: "Apple answered status \(status)"))
        default:
            return .done(.retryLater(.unexpectedAppleResponse, message: "Apple answered status \(status)"))
        }
    }

    private func verified(_ answer: VerifyReceiptResponse, calledIn environment: AppStoreEnvironment)
        -> VerificationOutcome
    {
        let environment = answer.environment.flatMap(AppStoreEnvironment.init(rawValue:)) ?? environment
        guard let bundleId = answer.receipt?.bundleId else {
            return .retryLater(.unexpectedAppleResponse, message: "Apple's answer has no receipt.bundle_id")
        }
        guard settings.bundleIds.contains(bundleId) else {
            return .rejected(.bundleIdMismatch, message: "receipt belongs to \(bundleId)")
        }
        var purchases: [VerifiedPurchase] = []
        for item in (answer.receipt?.inApp ?? []) + (answer.latestReceiptInfo ?? []) {
            guard let transactionId = item.transactionId?.value, let productId = item.productId?.value else {
                continue
            }
            purchases.append(
                VerifiedPurchase(
                    transactionId: transactionId,
                    originalTransactionId: item.originalTransactionId?.value ?? transactionId,
                    productId: productId,
                    quantity: item.quantity.flatMap { Int($0.value) }.map { min(max($0, 1), VerifiedPurchase.maxQuantity) } ?? 1,
                    purchaseDate: Self.date(item.purchaseDateMs), environment: environment,
                    cancellationDate: Self.date(item.cancellationDateMs), expiresDate: Self.date(item.expiresDateMs),
                    appAccountToken: item.appAccountToken?.value.lowercased(),
                    webOrderLineItemId: item.webOrderLineItemId?.value,
                    ownershipType: item.inAppOwnershipType?.value,
                    isUpgraded: item.isUpgraded.map { $0.value == "true" || $0.value == "1" }))
        }
        return .verified(VerifiedReceipt(bundleId: bundleId, environment: environment, purchases: purchases))
    }

    private static func record(endpoint: String, statusClass: String, since started: ContinuousClock.Instant) {
        Timer(label: MetricNames.appleRequestDuration, dimensions: [("endpoint", endpoint), ("status_class", statusClass)])
            .record(duration: ContinuousClock.now - started)
    }

    /// Apple's dates in milliseconds since 1970, sent as strings: whole numbers within
    /// `DateText.acceptedMilliseconds`, else no date (never `nan`, `inf` or `1e300`).
    private static func date(_ milliseconds: LenientString?) -> Date? {
        milliseconds.flatMap { Int64($0.value) }.flatMap { DateText.date(milliseconds: $0) }
    }

    private func call(_ environment: AppStoreEnvironment, receiptData: String) async
        -> Result<VerifyReceiptResponse, VerificationOutcomeBox>
    {
        let started = ContinuousClock.now
        let endpoint = environment == .production ? "production" : "sandbox"
        do {
            let request = try makeRequest(environment, receiptData: receiptData)
            let response: HTTPClientResponse
            do {
                response = try await httpClient.execute(request, timeout: .nanoseconds(settings.timeout.nanoseconds))
            } catch {
                Self.record(endpoint: endpoint, statusClass: "error", since: started)
                throw error
            }
            let bytes = try await response.body.collect(upTo: 16 * 1024 * 1024)
            Self.record(endpoint: endpoint, statusClass: "\(response.status.code / 100)xx", since: started)
            return Self.read(status: response.status, body: bytes)
        } catch {
            return .failure(.retryLater(.appleUnavailable, message: "verifyReceipt call failed: \(String(describing: error))"))
        }
    }

    @inline(never)
    private func makeRequest(_ environment: AppStoreEnvironment, receiptData: String) throws -> HTTPClientRequest {
        let url = environment == .production ? settings.endpoints.production : settings.endpoints.sandbox
        let body = VerifyReceiptRequestBody(receiptData: receiptData, password: settings.sharedSecret)
        var request = HTTPClientRequest(url: url)
        request.method = .POST
        request.headers.add(name: "Content-Type", value: "application/json")
        request.body = .bytes(ByteBuffer(bytes: try JSONEncoder().encode(body)))
        return request
    }

    @inline(never)
    private static func read(status: HTTPResponseStatus, body: ByteBuffer)
        -> Result<VerifyReceiptResponse, VerificationOutcomeBox>
    {
        guard status == .ok else {
            return .failure(.retryLater(.appleUnavailable, message: "verifyReceipt answered HTTP \(status.code)"))
        }
        do {
            return .success(try JSONDecoder().decode(VerifyReceiptResponse.self, from: Data(buffer: body)))
        } catch {
            return .failure(.retryLater(.unexpectedAppleResponse, message: "verifyReceipt answered unreadable JSON"))
        }
    }
}

/// Carries an early outcome through `Result`'s error slot.
struct VerificationOutcomeBox: Error {
    var outcome: VerificationOutcome
    init(_ outcome: VerificationOutcome) { self.outcome = outcome }
}

extension Result where Failure == VerificationOutcomeBox {
    fileprivate static func failure(_ outcome: VerificationOutcome) -> Self { .failure(VerificationOutcomeBox(outcome)) }
}

extension Duration {
    /// The duration in whole nanoseconds.
    var nanoseconds: Int64 {
        components.seconds * 1_000_000_000 + components.attoseconds / 1_000_000_000
    }
}

/// The `verifyReceipt` request body. Encoded with `JSONEncoder`: `JSONSerialization` cost
/// the verifier more than the rest of the call together.
private struct VerifyReceiptRequestBody: Encodable {
    var receiptData: String
    var password: String?
    var excludeOldTransactions = false

    enum CodingKeys: String, CodingKey {
        case receiptData = "receipt-data"
        case password
        case excludeOldTransactions = "exclude-old-transactions"
    }
}
