import Foundation

/// One transaction in the app's queue: written before anything else is done with it, removed
/// only after StoreKit's `finish()` returned.
public struct QueueEntry: Codable, Sendable, Equatable {
    /// The app user it was bought under; it stays theirs across sign-outs and user switches.
    public var userId: String
    /// The transaction as the store reported it.
    public var transaction: StoreTransaction
    /// The order it pays (the purchase's `appAccountToken`), when there is one.
    public var orderId: String?
    /// When the queue first wrote it.
    public var addedAt: Date
    /// Uploads the order service accepted (202).
    public var uploads: Int = 0
    /// Every exchange tried for it: uploads and status reads, answered or not.
    public var attempts: Int = 0
    /// Failures in a row (no answer, 408, 429, 5xx, a cut answer); reset by any answer.
    public var failures: Int = 0
    /// Failures in all: each was followed by a retry.
    public var retries: Int = 0
    /// The last failure, for people.
    public var lastError: String?
    /// Not tried again before this; nil means now.
    public var nextAttemptAt: Date?
    /// The upload being followed (`/v1/receipts/{submissionId}`).
    public var submissionId: String?
    /// Reads of that upload's status that found it not final yet.
    public var polls: Int = 0
    /// The order service's final answer when it is not "finish": retries have stopped, and the
    /// entry is read again only when the app wakes the client (customer service may mark it
    /// finishable meanwhile).
    public var stopped: StopReason?
    /// Whether the alert hook was called for it (once).
    public var alerted: Bool = false

    /// A new entry, never uploaded.
    public init(userId: String, transaction: StoreTransaction, orderId: String?, addedAt: Date) {
        self.userId = userId
        self.transaction = transaction
        self.orderId = orderId
        self.addedAt = addedAt
    }

    /// The transaction id, the entry's key within its user.
    public var transactionId: String { transaction.transactionId }
}

/// Why the uploader stopped retrying an entry: the order service's answer, which will not
/// change by asking again.
public struct StopReason: Codable, Sendable, Equatable {
    /// The submission's state (`rejected`, `needs_review`, `credited`) or, when the upload
    /// itself was refused, `refused`.
    public var state: String
    /// The server's reason or error code (`transaction_not_in_receipt`, `receipt_malformed`, …).
    public var reason: String?
    /// The server's message, for people.
    public var message: String?

    /// A stop with the server's words.
    public init(state: String, reason: String?, message: String?) {
        self.state = state
        self.reason = reason
        self.message = message
    }
}
