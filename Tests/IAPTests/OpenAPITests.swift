import AppStore
import Foundation
import Hummingbird
import IAPCore
import Intake
import OrderStore
import Ledger
import Testing

/// `docs/openapi.yaml` describes exactly the routes the intake serves: none missing, none
/// made up. (`scripts/api-check` validates the document and runs schemathesis against a
/// live intake; this test keeps the two lists the same on every run of the suite.)
@Suite("OpenAPI document")
struct OpenAPITests {
    static let document = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().appendingPathComponent("docs/openapi.yaml")

    /// "METHOD /path" for each operation under `paths:`.
    static func documentedOperations(_ yaml: String) -> Set<String> {
        var operations: Set<String> = []
        var inPaths = false
        var path: String?
        for line in yaml.split(separator: "\n", omittingEmptySubsequences: false) {
            if line.hasPrefix("paths:") {
                inPaths = true
                continue
            }
            guard inPaths else { continue }
            if let first = line.first, !first.isWhitespace, first != "#" { break }
            let trimmed = line.trimmingCharacters(in: .whitespaces)
            let indent = line.prefix { $0 == " " }.count
            if indent == 2, trimmed.hasPrefix("/"), trimmed.hasSuffix(":") {
                path = String(trimmed.dropLast()).trimmingCharacters(in: CharacterSet(charactersIn: "'\""))
            } else if indent == 4, let path, let method = trimmed.split(separator: ":").first,
                ["get", "post", "put", "patch", "delete", "head", "options"].contains(String(method))
            {
                operations.insert("\(method.uppercased()) \(path)")
            }
        }
        return operations
    }

    /// Why the notification endpoint refuses a notification (each is the verifier's code).
    static let notificationRefusals: [JWSVerificationError.Code] = [
        .malformed, .unsupportedAlgorithm, .invalidChainLength, .invalidCertificate, .missingAppleExtension,
        .certificateExpired, .untrustedChain, .invalidSignature, .bundleIdMismatch, .environmentMismatch,
        .appAppleIdMismatch,
    ]

    /// The words of the `enum` of `property` in the schema `schema` (under `components:
    /// schemas:`), nil when the document has no such list.
    static func enumeration(_ yaml: String, schema: String, property: String) -> [String]? {
        let lines = yaml.components(separatedBy: "\n")
        guard let start = lines.firstIndex(of: "    \(schema):"),
            let at = lines[(start + 1)...].prefix(while: { $0.isEmpty || $0.hasPrefix("     ") })
                .firstIndex(of: "        \(property):")
        else { return nil }
        // The property's own keys, up to the next property.
        let own = lines[(at + 1)...].prefix { $0.hasPrefix("         ") }
        guard let first = own.firstIndex(where: { $0.trimmingCharacters(in: .whitespaces).hasPrefix("enum: [") }) else { return nil }
        var text = ""
        for line in own[first...] {
            text += line
            if line.contains("]") { break }
        }
        guard let open = text.firstIndex(of: "["), let close = text.firstIndex(of: "]") else { return nil }
        return text[text.index(after: open)..<close].split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }
    }

    /// Every state the API answers is a case of the core's (or IAPCore's) enum, declared once,
    /// and the document lists exactly those cases.
    @Test func everyStateTheAPIAnswersIsDeclaredOnceAndDocumented() throws {
        let yaml = try String(contentsOf: Self.document, encoding: .utf8)
        let states: [(schema: String, property: String, cases: [String])] = [
            ("Order", "state", OrderState.allCases.map(\.rawValue)),
            ("Grant", "state", GrantState.allCases.map(\.rawValue)),
            ("Grant", "source", GrantSource.allCases.map(\.rawValue)),
            ("Subscription", "state", SubscriptionState.allCases.map(\.rawValue)),
            ("SubmissionStatus", "state", SubmissionState.allCases.map(\.rawValue)),
            ("SubmissionTransaction", "state", TransactionCreditState.allCases.map(\.rawValue)),
        ]
        for (schema, property, cases) in states {
            let documented = try #require(Self.enumeration(yaml, schema: schema, property: property), "\(schema).\(property)")
            #expect(Set(documented) == Set(cases) && documented.count == cases.count, "\(schema).\(property): \(documented) ≠ \(cases)")
        }
    }

    @Test func everyRouteIsDocumentedAndNothingElse() async throws {
        let yaml = try String(contentsOf: Self.document, encoding: .utf8)
        let documented = Self.documentedOperations(yaml)
        let store = try await OrderStore(
            path: FileManager.default.temporaryDirectory.appendingPathComponent("openapi-\(UUID().uuidString).sqlite").path)
        let router = makeIntakeRouter(settings: IntakeSettings(adminTokens: ["x"]), store: store)
        let served = Set(router.routes.map { "\($0.method) \($0.path)" })
        #expect(served.count >= 12, "\(served)")
        #expect(served.subtracting(documented).isEmpty, "served but not in docs/openapi.yaml: \(served.subtracting(documented).sorted())")
        #expect(documented.subtracting(served).isEmpty, "in docs/openapi.yaml but not served: \(documented.subtracting(served).sorted())")
        // Every error code the intake can answer with is in the document (ErrorCatalogueTests
        // checks the Error schema's list against the catalogue in both directions).
        for code in APIErrorCode.allCases.map(\.rawValue) + Self.notificationRefusals.map(\.rawValue) {
            #expect(yaml.contains(code), "docs/openapi.yaml does not mention the error code \(code)")
        }
    }
}

extension OpenAPITests {
    /// The pattern docs/openapi.yaml gives every id (`Id`, `OptionalId`, `Actor`): what
    /// `IdentifierText` refuses, spelled as two character classes over the Basic Multilingual
    /// Plane, the first for an id's first character (which may not be a combining mark either),
    /// the second for the rest. `\uXXXX` escapes only, which ECMA-262, Python and Rust read
    /// alike; the few refused characters beyond U+FFFF (tag characters, format controls,
    /// noncharacters) are named in the schemas' descriptions instead, and so are lone
    /// surrogates (a JSON `\uD800` escape).
    static func idPattern() -> String {
        var first: [ClosedRange<UInt32>] = []
        var rest: [ClosedRange<UInt32>] = []
        func add(_ value: UInt32, to ranges: inout [ClosedRange<UInt32>]) {
            if let last = ranges.last, last.upperBound + 1 == value {
                ranges[ranges.count - 1] = last.lowerBound...value
            } else {
                ranges.append(value...value)
            }
        }
        for value in UInt32(0)...0xFFFF {
            // A surrogate is no character: no UTF-8 text holds one, and Rust's engine, which the
            // validators use, refuses one in a pattern.
            guard let scalar = Unicode.Scalar(value) else { continue }
            if IdentifierText.problem("a" + String(scalar)) != nil {
                add(value, to: &first)
                add(value, to: &rest)
            } else if IdentifierText.problem(String(scalar)) != nil {
                add(value, to: &first)
            }
        }
        func escaped(_ value: UInt32) -> String {
            let digits = String(value, radix: 16, uppercase: true)
            return "\\u" + String(repeating: "0", count: 4 - digits.count) + digits
        }
        func negatedClass(_ ranges: [ClosedRange<UInt32>]) -> String {
            "[^" + ranges.map { range in
                range.count == 1 ? escaped(range.lowerBound) : escaped(range.lowerBound) + "-" + escaped(range.upperBound)
            }.joined() + "]"
        }
        return "^(?:" + negatedClass(first) + negatedClass(rest) + "*)?$"
    }

    @Test func idSchemasRefuseWhatTheIntakeRefuses() throws {
        let yaml = try String(contentsOf: Self.document, encoding: .utf8)
        let pattern = Self.idPattern()
        let declaration = "pattern: &idText '\(pattern)'"
        if !yaml.contains(declaration) {
            let file = FileManager.default.temporaryDirectory.appendingPathComponent("openapi-id-pattern.txt")
            try? Data(declaration.utf8).write(to: file)
            Issue.record("docs/openapi.yaml does not declare the id pattern IdentifierText implies; the line it needs is in \(file.path)")
        }
        for schema in ["Id", "OptionalId", "Actor"] {
            let lines = yaml.components(separatedBy: "\n").drop { $0 != "    \(schema):" }.dropFirst()
            let body = lines.prefix { $0.hasPrefix("      ") }.joined(separator: "\n")
            #expect(body.contains("pattern: &idText") || body.contains("pattern: *idText"), "schema \(schema) does not use the id pattern")
        }
        // The pattern read by a regular-expression engine agrees with IdentifierText on every
        // character of the plane, first and later.
        let regex = try NSRegularExpression(pattern: pattern)
        // The whole text (ICU's `$`, as Python's, also matches before a final line break, where
        // ECMA-262's and the validators' do not).
        func matches(_ text: String) -> Bool {
            regex.firstMatch(in: text, range: NSRange(text.startIndex..., in: text))?.range.length == text.utf16.count
        }
        var disagreements: [String] = []
        for value in UInt32(0)...0xFFFF {
            guard let scalar = Unicode.Scalar(value) else { continue }
            for text in [String(scalar), "a" + String(scalar), "a" + String(scalar) + "b"]
            where matches(text) != (IdentifierText.problem(text) == nil) {
                disagreements.append(String(value, radix: 16))
            }
        }
        #expect(disagreements.isEmpty, "the pattern and IdentifierText disagree on U+\(disagreements.prefix(10))")
        #expect(matches("") && matches("user-42") && !matches("a\u{0}") && !matches("\u{301}a"))
    }
}
