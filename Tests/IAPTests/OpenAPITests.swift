import AppStore
import Foundation
import Hummingbird
import IAPCore
import Intake
import OrderStore
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

    @Test func everyRouteIsDocumentedAndNothingElse() async throws {
        let yaml = try String(contentsOf: Self.document, encoding: .utf8)
        let documented = Self.documentedOperations(yaml)
        let store = try OrderStore(
            path: FileManager.default.temporaryDirectory.appendingPathComponent("openapi-\(UUID().uuidString).sqlite").path)
        let router = makeIntakeRouter(settings: IntakeSettings(adminTokens: ["x"]), store: store, acceptedUpload: {})
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
