public import IAPCore

/// Anything that can verify an upload with Apple.
public protocol ReceiptVerifying: Sendable {
    /// Verifies one upload. Never throws: every failure is an outcome, and a failure that
    /// may go away by itself is `.retryLater`, never `.rejected`.
    func verify(_ request: VerifyRequest) async -> VerificationOutcome
}
