import Foundation
import Testing

/// The documentation stands alone in a clone: its relative links lead somewhere, and nothing
/// points outside the repository for the project's own design.
@Suite("Documentation links")
struct DocumentationTests {
    /// README.md and every Markdown file under docs/.
    static func documents() throws -> [URL] {
        let docs = repositoryRoot.appendingPathComponent("docs")
        let files = try FileManager.default.contentsOfDirectory(at: docs, includingPropertiesForKeys: nil)
            .filter { $0.pathExtension == "md" }
        return [repositoryRoot.appendingPathComponent("README.md")] + files.sorted { $0.path < $1.path }
    }

    /// The targets of Markdown links `[text](target)` outside code spans and blocks.
    static func links(in markdown: String) -> [String] {
        var targets: [String] = []
        var inFence = false
        for line in markdown.split(separator: "\n", omittingEmptySubsequences: false) {
            if line.trimmingCharacters(in: .whitespaces).hasPrefix("```") {
                inFence.toggle()
                continue
            }
            guard !inFence else { continue }
            // Drop code spans, whose brackets are not links.
            let prose = line.split(separator: "`", omittingEmptySubsequences: false).enumerated()
                .filter { $0.offset % 2 == 0 }.map(\.element).joined(separator: " ")
            var rest = Substring(prose)
            while let close = rest.range(of: "](") {
                let after = rest[close.upperBound...]
                guard let end = after.firstIndex(of: ")") else { break }
                targets.append(String(after[..<end]).trimmingCharacters(in: .whitespaces))
                rest = after[end...]
            }
        }
        return targets
    }

    @Test func relativeLinksPointAtFilesThatExist() throws {
        var checked = 0
        for document in try Self.documents() {
            let text = try String(contentsOf: document, encoding: .utf8)
            for target in Self.links(in: text) {
                if target.hasPrefix("http://") || target.hasPrefix("https://") || target.hasPrefix("mailto:") { continue }
                let path = String(target.split(separator: "#", maxSplits: 1, omittingEmptySubsequences: false)[0])
                guard !path.isEmpty else { continue }  // an anchor in the same file
                let resolved = document.deletingLastPathComponent().appendingPathComponent(path).standardizedFileURL
                checked += 1
                #expect(
                    FileManager.default.fileExists(atPath: resolved.path),
                    "\(document.lastPathComponent): the link (\(target)) points at nothing")
                #expect(
                    resolved.path.hasPrefix(repositoryRoot.standardizedFileURL.path),
                    "\(document.lastPathComponent): the link (\(target)) leaves the repository")
            }
        }
        #expect(checked >= 5, "only \(checked) relative links found: is the parser broken?")
    }

    @Test func onlyApplesDocumentationIsLinkedOutside() throws {
        for document in try Self.documents() {
            let text = try String(contentsOf: document, encoding: .utf8)
            #expect(!text.contains("../shared"), "\(document.lastPathComponent) refers to ../shared, which a clone lacks")
            for target in Self.links(in: text) where target.hasPrefix("http") {
                let host = URL(string: target)?.host ?? ""
                #expect(
                    host.hasSuffix("apple.com") || host == "127.0.0.1" || host == "localhost",
                    "\(document.lastPathComponent) links outside the repository: \(target)")
            }
        }
    }

    /// `METHOD path` of each route in the README's fake App Store table (`/inApps/…` as a prefix).
    static func fakeRoutes(_ readme: String) -> [(method: String, path: String)] {
        guard let section = readme.range(of: "## The fake App Store") else { return [] }
        var routes: [(String, String)] = []
        for line in readme[section.upperBound...].split(separator: "\n") {
            if line.hasPrefix("## ") { break }
            guard line.hasPrefix("| `") else { continue }
            let firstCell = line.split(separator: "|")[0]
            for span in firstCell.split(separator: "`").enumerated().filter({ $0.offset % 2 == 1 }).map(\.element) {
                let words = span.split(separator: " ")
                if words.count == 2 {
                    routes.append((String(words[0]), String(words[1])))
                } else if words.count == 1 {
                    routes.append(("GET", String(words[0]).replacingOccurrences(of: "…", with: "")))
                }
            }
        }
        return routes
    }

    /// Every `curl` line of the README's code blocks, as (method, URL path).
    static func curlCalls(_ readme: String) -> [(method: String, path: String)] {
        readme.split(separator: "\n").compactMap { line -> (String, String)? in
            guard line.hasPrefix("curl ") else { return nil }
            let words = line.split(separator: " ")
            let method = words.first { $0.hasPrefix("-X") }.map { String($0.dropFirst(2)) } ?? "GET"
            guard let url = words.first(where: { $0.contains("localhost:") || $0.contains("127.0.0.1:") }) else { return nil }
            let withoutHost = url.drop { $0 != "/" }.split(separator: "?")[0]
            return (method, String(withoutHost).trimmingCharacters(in: CharacterSet(charactersIn: "\"'")))
        }
    }

    /// A route template (`/fake/purchases/{transactionId}/refund`) matches an example path
    /// (`/fake/purchases/<transactionId>/refund`) segment by segment; `/inApps/` is a prefix.
    static func matches(template: String, path: String) -> Bool {
        if template.hasSuffix("/") { return path.hasPrefix(template) }
        let expected = template.split(separator: "/")
        let actual = path.split(separator: "/")
        return expected.count == actual.count
            && zip(expected, actual).allSatisfy { $0.hasPrefix("{") ? $1.hasPrefix("<") : $0 == $1 }
    }

    @Test func everyFakeAppStoreRouteHasAnExample() throws {
        let readme = try String(contentsOf: repositoryRoot.appendingPathComponent("README.md"), encoding: .utf8)
        let routes = Self.fakeRoutes(readme)
        #expect(routes.count >= 15, "the fake App Store's route table was not found: \(routes)")
        let calls = Self.curlCalls(readme)
        for route in routes {
            #expect(
                calls.contains { $0.method == route.method && Self.matches(template: route.path, path: $0.path) },
                "the README has no curl example of \(route.method) \(route.path)")
        }
    }

    @Test func theLinkReaderFindsLinksAndSkipsCode() {
        let markdown = """
            See [the ledger](docs/ledger.md#keys) and [Apple](https://developer.apple.com/x).
            `[not](a-link)` and
            ```
            [also](not-a-link)
            ```
            """
        #expect(Self.links(in: markdown) == ["docs/ledger.md#keys", "https://developer.apple.com/x"])
    }
}
