/// Why a byte string is not an app receipt we can read.
///
/// Every malformed input ends here, never in a crash: `code` is stable (clients and logs may
/// switch on it), `message` is for people and may change.
public struct AppReceiptError: Error, Sendable, Equatable, CustomStringConvertible {
    /// A stable, machine-readable reason. New codes may be added.
    public struct Code: RawRepresentable, Hashable, Sendable, CustomStringConvertible {
        /// The code as it appears in logs and JSON, e.g. `not_pkcs7`.
        public var rawValue: String

        /// Creates a code from its text.
        public init(rawValue: String) {
            self.rawValue = rawValue
        }

        /// The input is empty.
        public static let empty = Code(rawValue: "empty")
        /// The text form is not base64.
        public static let notBase64 = Code(rawValue: "not_base64")
        /// The input is larger than `AppReceiptParser.maxInputBytes`.
        public static let tooLarge = Code(rawValue: "too_large")
        /// The input holds more ASN.1 elements than `AppReceiptParser.maxElements`.
        public static let tooManyElements = Code(rawValue: "too_many_elements")
        /// The input nests deeper than `AppReceiptParser.maxDepth`.
        public static let tooDeep = Code(rawValue: "too_deep")
        /// The input ends in the middle of an element.
        public static let truncated = Code(rawValue: "truncated")
        /// A length is malformed or disagrees with its enclosing element.
        public static let invalidLength = Code(rawValue: "invalid_length")
        /// A tag is malformed or not allowed where it stands.
        public static let invalidTag = Code(rawValue: "invalid_tag")
        /// The input is not a PKCS#7 `SignedData` container.
        public static let notPKCS7 = Code(rawValue: "not_pkcs7")
        /// The container carries no certificates or no signer (Apple's always carry both).
        public static let unsigned = Code(rawValue: "unsigned")
        /// The container is well formed but does not hold an app receipt payload.
        public static let notAReceipt = Code(rawValue: "not_a_receipt")
        /// A receipt attribute is missing, repeated or has a value of the wrong shape.
        public static let invalidField = Code(rawValue: "invalid_field")

        public var description: String { rawValue }
    }

    /// The stable reason.
    public var code: Code
    /// What went wrong, for people.
    public var message: String

    /// Creates an error.
    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }

    public var description: String { "\(code.rawValue): \(message)" }
}
