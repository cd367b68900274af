import Foundation
import IAPCore
import Testing

/// Every setting of `iap` is declared once (`Setting`, in IAPCore): its variable, default and
/// help. These read the sources as a reviewer's grep would: no variable's name and no default
/// written a second time anywhere else in `Sources`.
@Suite("Settings declared once")
struct SettingCatalogTests {
    static let sources = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().appendingPathComponent("Sources")
    static let catalog = sources.appendingPathComponent("IAPCore/Setting.swift")

    /// Every Swift file of `Sources` but the catalog, with its comments left out: (path, line
    /// number, code).
    static func codeLines() throws -> [(String, Int, String)] {
        var found: [(String, Int, String)] = []
        let files = FileManager.default.enumerator(at: sources, includingPropertiesForKeys: nil)!
        for case let file as URL in files where file.pathExtension == "swift" && file.path != catalog.path {
            let text = try String(contentsOf: file, encoding: .utf8)
            for (index, line) in text.split(separator: "\n", omittingEmptySubsequences: false).enumerated() {
                let trimmed = line.trimmingCharacters(in: .whitespaces)
                if trimmed.hasPrefix("//") { continue }
                // A trailing comment: `//` outside a string (good enough for this code base).
                var code = String(line)
                if let comment = code.range(of: " // ") { code = String(code[..<comment.lowerBound]) }
                found.append((file.path.replacingOccurrences(of: sources.path + "/", with: ""), index + 1, code))
            }
        }
        return found
    }

    /// The declarations: (variable, default) of each `Setting(…)` in the catalog.
    static func declarations() throws -> [(variable: String, fallback: String?)] {
        let text = try String(contentsOf: catalog, encoding: .utf8)
        let pattern = try NSRegularExpression(pattern: #"Setting\(\s*"(IAP_[A-Z0-9_]+)"(?:, fallback: "([^"]*)")?"#)
        return pattern.matches(in: text, range: NSRange(text.startIndex..., in: text)).map { match in
            let variable = String(text[Range(match.range(at: 1), in: text)!])
            let fallback = Range(match.range(at: 2), in: text).map { String(text[$0]) }
            return (variable, fallback)
        }
    }

    @Test func eachVariableIsDeclaredOnceAndNamedNowhereElse() throws {
        let declared = try Self.declarations()
        #expect(declared.count >= 70, "declarations read: \(declared.count)")
        let variables = declared.map(\.variable)
        #expect(Set(variables).count == variables.count, "declared twice: \(variables.filter { v in variables.filter { $0 == v }.count > 1 })")
        let name = try NSRegularExpression(pattern: "IAP_[A-Z][A-Z0-9_]*")
        var written: [String] = []
        for (path, number, code) in try Self.codeLines() {
            for match in name.matches(in: code, range: NSRange(code.startIndex..., in: code)) {
                written.append("\(path):\(number): \(code[Range(match.range, in: code)!])")
            }
        }
        #expect(written.isEmpty, "a setting's name written outside its declaration:\n\(written.joined(separator: "\n"))")
    }

    /// The words of a name, lower case: `IAP_HTTP_PORT` and `httpPort` both give http, port;
    /// words any setting may share (seconds, max, per) left out.
    static func words(_ name: String) -> Set<String> {
        let spaced = name.replacingOccurrences(of: "IAP_", with: "").replacingOccurrences(
            of: "([a-z0-9])([A-Z])", with: "$1_$2", options: .regularExpression)
        return Set(spaced.lowercased().split(separator: "_").map(String.init))
            .subtracting(["seconds", "max", "per", "default", "limit", "count", "s", "in"])
    }

    @Test func noDefaultIsWrittenASecondTime() throws {
        var written: [String] = []
        let lines = try Self.codeLines()
        // A parameter with a number for its default: `port: Int = 8080`, `timeout: Duration = .seconds(15)`.
        let numeric = try NSRegularExpression(
            pattern: #"(\w+): (?:Int\??|Double|TimeInterval|Duration) = (?:\.seconds\()?([0-9_]+)\b"#)
        for (variable, fallback) in try Self.declarations() {
            guard let fallback else { continue }
            if Int(fallback) == nil {
                // A text default: a reader's (`default: "24h"`), or a parameter's that is the
                // setting's (`host: String = "0.0.0.0"`; they share a word).
                let quoted = #"""# + NSRegularExpression.escapedPattern(for: fallback) + #"""#
                let reader = try NSRegularExpression(pattern: "default: " + quoted)
                let parameter = try NSRegularExpression(pattern: #"(\w+): String\?? = "# + quoted)
                for (path, number, code) in lines {
                    let range = NSRange(code.startIndex..., in: code)
                    let named = parameter.matches(in: code, range: range).contains { match in
                        !Self.words(String(code[Range(match.range(at: 1), in: code)!])).isDisjoint(with: Self.words(variable))
                    }
                    if named || reader.firstMatch(in: code, range: range) != nil {
                        written.append("\(path):\(number): \(variable)'s default \(fallback): \(code.trimmingCharacters(in: .whitespaces))")
                    }
                }
                continue
            }
            // A number only where the parameter is the setting's (they share a word).
            for (path, number, code) in lines {
                for match in numeric.matches(in: code, range: NSRange(code.startIndex..., in: code)) {
                    let parameter = String(code[Range(match.range(at: 1), in: code)!])
                    let value = code[Range(match.range(at: 2), in: code)!].replacingOccurrences(of: "_", with: "")
                    if value == fallback, !Self.words(parameter).isDisjoint(with: Self.words(variable)) {
                        written.append("\(path):\(number): \(variable)'s default \(fallback): \(code.trimmingCharacters(in: .whitespaces))")
                    }
                }
            }
        }
        #expect(written.isEmpty, "a default written outside its declaration:\n\(written.joined(separator: "\n"))")
    }

    @Test func theHelpAndTheLibrariesDefaultsComeFromTheDeclaration() {
        #expect(Setting.httpHost.help == "Address the intake listens on. (env IAP_HTTP_HOST; default 0.0.0.0, 127.0.0.1 for dev)")
        #expect(Setting.adminPort.help.hasSuffix("(env IAP_ADMIN_PORT; default the intake's port)"))
        #expect(Setting.catalog.help.hasSuffix("(env IAP_CATALOG)"))
        #expect(Setting.httpHost.fallback(dev: true) == "127.0.0.1" && Setting.httpHost.fallback(dev: false) == "0.0.0.0")
        #expect(Setting.reconcileInterval.defaultDuration == .seconds(86_400))
        #expect(Setting.maxBodyBytes.defaultBytes == "1 MiB" && Setting.notificationMaxBytes.defaultBytes == "64 KiB")
        #expect(RetrySchedule().delaysSeconds == [5, 30, 120, 600, 1800])
        #expect(PipelineNames().prefix == Setting.queuePrefix.fallback)
        #expect(Setting.amqpURL.isSecret && Setting.amqpURL.fileVariable == "IAP_AMQP_URL_FILE")
    }
}
