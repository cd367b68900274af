public import AsyncHTTPClient
import Foundation
public import IAPCore
public import Logging
import Metrics
import NIOCore
import NIOHTTP1
import OrderStore

/// Something a person has to look at: a submission that keeps failing or needs review.
public struct Alert: Sendable, Codable, Equatable {
    /// Why: `repeated_failures`, `needs_review`, or `configuration` (Apple refused our shared secret).
    public var kind: String
    /// The submission concerned.
    public var submissionId: String
    /// Its user.
    public var userId: String
    /// Its state now.
    public var state: String
    /// Attempts so far.
    public var attempts: Int
    /// The last reason code.
    public var reason: String?
    /// The last reason's text.
    public var message: String?
}

extension Alert {
    /// Takes `reason` and `message` from the submission's stored status: its own reason, else
    /// that of its first held transaction (`unknown_product`, `owner_unknown`, …).
    mutating func fill(from status: SubmissionStatus) {
        if let reason = status.reason {
            self.reason = reason.rawValue
            message = message ?? status.reasonMessage ?? reason.rawValue
            return
        }
        let held = status.transactions.filter { $0.state == .held }
        guard let first = held.first else { return }
        reason = first.reason?.rawValue ?? "held"
        message = message ?? "\(held.count) purchase(s) held for review, first \(first.transactionId) (\(first.productId)): \(reason ?? "held")"
    }
}

/// When the finisher alerts, and where to.
public struct AlertSettings: Sendable {
    /// A submission alerts once when it reaches this many failed attempts.
    public var afterAttempts: Int
    /// Where alerts are POSTed as JSON, if anywhere.
    public var webhookURL: String?

    /// Creates settings.
    public init(afterAttempts: Int = Setting.alertAfterAttempts.defaultInt, webhookURL: String? = nil) {
        self.afterAttempts = max(1, afterAttempts)
        self.webhookURL = webhookURL
    }
}

/// Delivers alerts: always a structured error log line and the `iap_alerts_total` counter;
/// also a webhook POST when one is configured (three tries; a webhook that is down is logged,
/// it never holds the finisher up).
public struct AlertSender: Sendable {
    private let settings: AlertSettings
    private let httpClient: HTTPClient?
    private let logger: Logger
    private let counter = Counter(label: MetricNames.alerts)

    /// Creates a sender; `httpClient` is needed only with a webhook.
    public init(settings: AlertSettings, httpClient: HTTPClient?, logger: Logger) {
        self.settings = settings
        self.httpClient = httpClient
        self.logger = logger
        counter.increment(by: 0)
    }

    /// Sends one alert.
    public func send(_ alert: Alert) async {
        counter.increment()
        logger.error(
            "submission needs attention",
            metadata: [
                "iap.alert": "\(alert.kind)", "iap.submission.id": "\(alert.submissionId)",
                "iap.attempt": "\(alert.attempts)", "iap.state": "\(alert.state)",
                "iap.reason": "\(alert.reason ?? "")", "iap.message": "\(alert.message ?? "")",
            ])
        guard let url = settings.webhookURL, let httpClient else { return }
        for attempt in 1...3 {
            do {
                var request = HTTPClientRequest(url: url)
                request.method = .POST
                request.headers.add(name: "Content-Type", value: "application/json")
                request.body = .bytes(ByteBuffer(bytes: try JSONEncoder().encode(alert)))
                let response = try await httpClient.execute(request, timeout: .seconds(5))
                _ = try await response.body.collect(upTo: 64 * 1024)
                if (200..<300).contains(response.status.code) { return }
                logger.warning("alert webhook refused", metadata: ["http.status": "\(response.status.code)"])
            } catch {
                logger.warning("alert webhook failed", metadata: ["error": "\(error)", "iap.attempt": "\(attempt)"])
            }
            try? await Task.sleep(for: .milliseconds(200 * attempt))
        }
    }

    /// The alert a result calls for, if any.
    func alert(for result: VerifyResult, state: SubmissionState) -> Alert? {
        let reason: (ReasonCode, String)?
        switch result.outcome {
        case .retryLater(let code, let message), .needsReview(let code, let message), .rejected(let code, let message):
            reason = (code, message)
        case .verified, .notification:
            reason = nil
        }
        let kind: String
        if state == .needsReview {
            kind = "needs_review"
        } else if reason?.0 == .sharedSecretMismatch || reason?.0 == .appleBadRequest {
            // Our configuration, not the user's purchase: a person must act at once.
            kind = "configuration"
        } else if state == .retrying && result.attempt >= settings.afterAttempts {
            kind = "repeated_failures"
        } else {
            return nil
        }
        return Alert(
            kind: kind, submissionId: result.submissionId.uuidString, userId: result.userId, state: state.rawValue,
            attempts: result.attempt, reason: reason?.0.rawValue, message: reason?.1)
    }
}
