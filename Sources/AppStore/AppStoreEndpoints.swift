/// Where Apple's `verifyReceipt` lives; overridable so the same client talks to the fake.
public struct VerifyReceiptEndpoints: Sendable, Equatable {
    /// Production `verifyReceipt`.
    public var production: String
    /// Sandbox `verifyReceipt`.
    public var sandbox: String

    /// Apple's own hosts.
    public static let apple = VerifyReceiptEndpoints(
        production: "https://buy.itunes.apple.com/verifyReceipt",
        sandbox: "https://sandbox.itunes.apple.com/verifyReceipt")

    /// Creates endpoints.
    public init(production: String, sandbox: String) {
        self.production = production
        self.sandbox = sandbox
    }
}
