public import IAPCore

/// What a transaction's answer becomes when its grant changed after the upload was answered:
/// the status the app reads follows the ledger, not the answer of the day.
public enum LaterEvents {
    /// A changed answer.
    public enum Answer: Sendable, Equatable {
        /// Held or revoked when answered, its grant is in force now: credited, by Apple (a
        /// reversed refund, a later proof) or by customer service.
        case credited(by: GrantSource)
        /// Credited when answered, its grant was taken back since: by Apple
        /// (`purchase_revoked`) or by customer service or a restore elsewhere
        /// (`revoked_by_customer_service`).
        case revoked(ReasonCode)
    }

    /// The answer for a transaction answered `answered` whose grant (for its uploader) is now
    /// `grant`; nil when the answer stands.
    public static func answer(_ answered: TransactionCreditState, grant: Grant) -> Answer? {
        switch answered {
        case .held where grant.isActive, .revoked where grant.isActive:
            return .credited(by: grant.source)
        case .credited where !grant.isActive, .alreadyCredited where !grant.isActive:
            return .revoked(grant.revokedBy == .apple ? .purchaseRevoked : .revokedByCustomerService)
        default:
            return nil
        }
    }
}
