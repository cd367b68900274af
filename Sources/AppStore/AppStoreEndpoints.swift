import IAPCore
/// Where Apple's `verifyReceipt` lives; overridable so the same client talks to the fake.
public struct VerifyReceiptEndpoints: Sendable, Equatable {
    /// Production `verifyReceipt`.
    public var production: String
    /// Sandbox `verifyReceipt`.
    public var sandbox: String

    /// Apple's own hosts.
    public static let apple = VerifyReceiptEndpoints(
        production: Setting.appStoreVerifyURL.defaultText, sandbox: Setting.appStoreSandboxVerifyURL.defaultText)

    /// Creates endpoints.
    public init(production: String, sandbox: String) {
        self.production = production
        self.sandbox = sandbox
    }
}
