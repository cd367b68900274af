public import Foundation

/// Identifies one receipt upload; chosen by the intake when it accepts the upload.
public typealias SubmissionID = UUID

/// The life of one upload, as the app reads it from the status endpoint.
public enum SubmissionState: String, Codable, Sendable, CaseIterable {
    /// Accepted and durable; verification has not finished yet.
    case pending
    /// A transient failure (Apple slow or down) happened; another attempt is scheduled.
    case retrying
    /// Verified; every purchase in it is now credited to the uploading user (now or by an earlier upload).
    case credited
    /// Definitively refused (invalid receipt, wrong app, a purchase belonging to another user).
    case rejected
    /// Retries gave up or the result needs a person; never a silent rejection.
    case needsReview = "needs_review"

    /// Whether the state will not change by itself any more.
    public var isTerminal: Bool {
        switch self {
        case .pending, .retrying: false
        case .credited, .rejected, .needsReview: true
        }
    }
}

/// Apple's two worlds: real money, and the sandbox used by TestFlight and App Review.
public enum AppStoreEnvironment: String, Codable, Sendable, CaseIterable {
    case production = "Production"
    case sandbox = "Sandbox"
}

/// What happened to one Apple transaction inside one upload.
public enum TransactionCreditState: String, Codable, Sendable, CaseIterable {
    /// This upload credited the transaction.
    case credited
    /// An earlier upload of the same user credited it; nothing new was granted.
    case alreadyCredited = "already_credited"
    /// The transaction was credited to another user first; this upload gets nothing.
    case replayedFromOtherUser = "replayed_from_other_user"
    /// Apple refunded or revoked the purchase; it is not credited (written by earlier versions).
    case cancelled
    /// Recorded for this user but not granted until a person decides (`reason` says why).
    case held
    /// Apple refunded or revoked it (before or after the upload): no active grant.
    case revoked
    /// A restore of something credited to another user, who keeps it (`IAP_RESTORE=keep`).
    case ownedByOtherUser = "owned_by_other_user"
    /// Replaced by an upgrade within its subscription group: never credited.
    case superseded
}

/// The upload as the intake accepted it: what the verifier needs to do its work.
public struct VerifyRequest: Codable, Sendable, Equatable {
    /// The submission this request verifies.
    public var submissionId: SubmissionID
    /// The user who uploaded it (the one to credit).
    public var userId: String
    /// The base64 app receipt, exactly as uploaded; empty when the upload is a StoreKit 2
    /// signed transaction, a transaction id alone, or a notification.
    public var receiptData: String
    /// A StoreKit 2 signed transaction (JWS), as uploaded.
    public var signedTransaction: String?
    /// An App Store Server Notification V2 (`signedPayload`), as Apple sent it.
    public var signedPayload: String?
    /// The transaction the app was finishing when it uploaded, if it said.
    public var transactionId: String?
    /// Our own order the app says this upload pays for, if it said.
    public var orderId: String?
    /// What the named StoreKit 1 transaction stands for, if the app said: its original
    /// transaction (`SKPaymentTransaction.original`, for a restore) and its product.
    public var originalTransactionId: String?
    public var productId: String?
    /// 1 for the first attempt; grows by one for every retry.
    public var attempt: Int
    /// When the intake accepted the upload; retries give up after a maximum age counted from here.
    public var acceptedAt: Date
    /// How many times Apple answered 21002 ("malformed, or a temporary issue") so far;
    /// counted apart from other failures so that timeouts never hasten a rejection.
    public var malformedAnswers: Int?

    /// Creates a request.
    public init(
        submissionId: SubmissionID, userId: String, receiptData: String, transactionId: String? = nil,
        orderId: String? = nil, attempt: Int = 1, acceptedAt: Date
    ) {
        self.submissionId = submissionId
        self.userId = userId
        self.receiptData = receiptData
        self.transactionId = transactionId
        self.orderId = orderId
        self.attempt = attempt
        self.acceptedAt = acceptedAt
    }
}
