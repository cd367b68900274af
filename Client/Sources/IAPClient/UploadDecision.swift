import Foundation

/// What the uploader does after reading an upload's status: a pure function of the answer.
enum UploadDecision: Equatable {
    /// The service says the app may finish the transaction: finish it, then drop the entry.
    case finish
    /// Not final yet (`pending`, `retrying`): read the status again then.
    case readAgain(at: Date)
    /// Final, and not "finish": stop retrying; read again only when the app wakes the client.
    case stop(StopReason)
    /// The receipt did not hold the transaction yet: upload again later with a fresh receipt.
    case uploadAgain(StopReason)

    /// The next step for `entry` after `status`.
    static func after(_ status: OrderService.Status, of entry: QueueEntry, now: Date, policy: RetryPolicy) -> UploadDecision {
        if status.finishTransaction { return .finish }
        let reason = StopReason(state: status.state, reason: status.reason, message: status.message)
        switch status.state {
        case "pending":
            return .readAgain(at: now.addingTimeInterval(readDelay(after: entry.polls, policy: policy)))
        case "retrying":
            // The service retries Apple itself; reading before its next attempt tells nothing new.
            let soonest = now.addingTimeInterval(readDelay(after: entry.polls, policy: policy))
            let latest = now.addingTimeInterval(policy.maximumDelay)
            let planned = status.nextAttemptAt.flatMap(Self.date) ?? soonest
            return .readAgain(at: min(max(soonest, planned), latest))
        case "rejected" where status.reason == "transaction_not_in_receipt" && entry.transaction.signedTransaction == nil:
            // Apple told the app before its receipt held the purchase: a later receipt will.
            return .uploadAgain(reason)
        default:
            // `credited` without "finish" (the service finishes with Apple itself, or it waits
            // for customer service), `rejected`, `needs_review`, and states this client does not
            // know: asking again the same way gets the same answer.
            return .stop(reason)
        }
    }

    /// Reads of a pending upload back off as failures do, without jitter: 2 s, 4 s, … the cap.
    static func readDelay(after polls: Int, policy: RetryPolicy) -> TimeInterval {
        let exponent = Double(min(max(polls, 0), 64))
        return min(policy.maximumDelay, policy.statusPollDelay * pow(2, exponent))
    }

    static func date(_ text: String) -> Date? {
        let formatter = ISO8601DateFormatter()
        formatter.formatOptions = [.withInternetDateTime, .withFractionalSeconds]
        if let date = formatter.date(from: text) { return date }
        formatter.formatOptions = [.withInternetDateTime]
        return formatter.date(from: text)
    }
}
