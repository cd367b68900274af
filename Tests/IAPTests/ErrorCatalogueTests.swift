import Foundation
import Intake
import Testing

/// The error catalogue (`APIErrorCode`) is the one list of codes: the README's error table and
/// `docs/openapi.yaml` say exactly what it says, in both directions.
@Suite("Error catalogue")
struct ErrorCatalogueTests {
    /// The rows `| status | `code` | meaning |` of the README's error table.
    static func readmeRows() throws -> [(status: Int, code: String, meaning: String)] {
        let readme = try String(contentsOf: repositoryRoot.appendingPathComponent("README.md"), encoding: .utf8)
        let lines = readme.split(separator: "\n", omittingEmptySubsequences: false)
        guard let header = lines.firstIndex(where: { $0.hasPrefix("| status | code | when |") }) else { return [] }
        var rows: [(Int, String, String)] = []
        for line in lines[(header + 2)...] {
            guard line.hasPrefix("|") else { break }
            let cells = line.split(separator: "|", omittingEmptySubsequences: false).dropFirst().dropLast()
                .map { $0.trimmingCharacters(in: .whitespaces) }
            guard cells.count == 3, let status = Int(cells[0]), cells[1].hasPrefix("`"), cells[1].hasSuffix("`") else {
                Issue.record("README error table: a row that is not `| status | `code` | meaning |`: \(line)")
                continue
            }
            rows.append((status, String(cells[1].dropFirst().dropLast()), cells[2]))
        }
        return rows
    }

    /// The `enum` of the `Error` schema's `code` in docs/openapi.yaml.
    static func openAPICodes() throws -> [String] {
        let yaml = try String(contentsOf: repositoryRoot.appendingPathComponent("docs/openapi.yaml"), encoding: .utf8)
        guard let schema = yaml.range(of: "\n    Error:\n"),
            let enumStart = yaml.range(of: "enum: [", range: schema.upperBound..<yaml.endIndex),
            let enumEnd = yaml.range(of: "]", range: enumStart.upperBound..<yaml.endIndex)
        else { return [] }
        return yaml[enumStart.upperBound..<enumEnd.lowerBound].split(separator: ",")
            .map { $0.trimmingCharacters(in: .whitespacesAndNewlines) }
    }

    @Test func theReadmeTableIsTheCatalogue() throws {
        let rows = try Self.readmeRows()
        #expect(rows.count >= 40, "the README's error table was not found or is short: \(rows.count) rows")
        let documented = Dictionary(rows.map { ($0.code, $0) }, uniquingKeysWith: { first, _ in first })
        #expect(documented.count == rows.count, "a code appears twice in the README's error table")
        for code in APIErrorCode.allCases {
            guard let row = documented[code.rawValue] else {
                Issue.record("the README's error table lacks \(code.rawValue)")
                continue
            }
            #expect(row.status == code.httpStatus, "README: \(code.rawValue) is \(row.status), the code answers \(code.httpStatus)")
            #expect(row.meaning == code.meaning, "README: \(code.rawValue) means '\(code.meaning)', the table says '\(row.meaning)'")
        }
        let unknown = Set(documented.keys).subtracting(APIErrorCode.allCases.map(\.rawValue))
        #expect(unknown.isEmpty, "the README's error table has codes no route answers: \(unknown.sorted())")
    }

    @Test func theOpenAPIErrorSchemaListsTheCatalogue() throws {
        let codes = try Self.openAPICodes()
        #expect(Set(codes).count == codes.count, "a code appears twice in docs/openapi.yaml's Error enum")
        let catalogue = Set(APIErrorCode.allCases.map(\.rawValue))
        #expect(catalogue.subtracting(codes).isEmpty, "docs/openapi.yaml lacks \(catalogue.subtracting(codes).sorted())")
        #expect(Set(codes).subtracting(catalogue).isEmpty, "docs/openapi.yaml has codes no route answers: \(Set(codes).subtracting(catalogue).sorted())")
        // Each code is also named where it is answered (a response's description or example).
        let yaml = try String(contentsOf: repositoryRoot.appendingPathComponent("docs/openapi.yaml"), encoding: .utf8)
        let outsideEnum = yaml.replacingOccurrences(of: codes.joined(separator: ", "), with: "")
        for code in catalogue.sorted() where code != APIErrorCode.internalError.rawValue {
            #expect(outsideEnum.contains("`\(code)`") || outsideEnum.contains("code: \(code)"),
                "docs/openapi.yaml names \(code) in no response")
        }
    }

    @Test func everyCodeHasItsOwnMeaningAndAnErrorStatus() {
        let meanings = APIErrorCode.allCases.map(\.meaning)
        #expect(Set(meanings).count == meanings.count, "two codes share a meaning")
        for code in APIErrorCode.allCases {
            #expect((400..<600).contains(code.httpStatus), "\(code.rawValue)")
            #expect(!code.meaning.isEmpty && !code.meaning.contains("\n"), "\(code.rawValue)")
            #expect(code.rawValue.allSatisfy { $0.isLowercase || $0.isNumber || $0 == "_" }, "\(code.rawValue) is not snake_case")
        }
    }
}
