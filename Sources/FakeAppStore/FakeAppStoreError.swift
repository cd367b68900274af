/// Why the fake App Store could not do what it was asked.
public struct FakeAppStoreError: Error, Sendable, Equatable, CustomStringConvertible {
    /// A stable, machine-readable reason.
    public var code: String
    /// What went wrong, for people.
    public var message: String

    /// Creates an error.
    public init(code: String, message: String) {
        self.code = code
        self.message = message
    }

    /// Certificates or keys could not be created, read or written.
    static func certificate(_ message: String) -> FakeAppStoreError {
        FakeAppStoreError(code: "certificate_error", message: message)
    }

    /// A receipt could not be encoded or signed.
    static func receipt(_ message: String) -> FakeAppStoreError {
        FakeAppStoreError(code: "receipt_error", message: message)
    }

    public var description: String { "\(code): \(message)" }
}
