import Foundation
import Testing

/// Every module imports only what `Package.swift` declares it depends on: a module reached only
/// through another package's dependencies (swift-crypto through postgres-nio, HTTPTypes through
/// Hummingbird) builds today and breaks when that package changes its own. SwiftPM's
/// `--explicit-target-dependency-import-check` (on in `scripts/dev test`) does not see products
/// reached that way; this reads the sources.
@Suite("Package.swift declares what each module imports")
struct PackageImportsTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent()

    /// Modules of the toolchain, which no package declares.
    static let toolchain: Set<String> = [
        "Foundation", "FoundationEssentials", "FoundationNetworking", "Dispatch", "Glibc", "Testing", "XCTest",
        "Synchronization", "_Concurrency",
    ]

    /// Each target's name and the modules its `dependencies:` name (targets and products).
    static func declared() throws -> [String: Set<String>] {
        let manifest = try String(contentsOf: root.appendingPathComponent("Package.swift"), encoding: .utf8)
        let target = try NSRegularExpression(
            pattern: #"\.(?:target|executableTarget|testTarget)\(\s*name: "([^"]+)",\s*dependencies: \[(.*?)\]"#,
            options: .dotMatchesLineSeparators)
        let product = try NSRegularExpression(pattern: #"\.product\(name: "([^"]+)""#)
        let plain = try NSRegularExpression(pattern: #"(?:^|[\[,\s])"([A-Za-z0-9]+)""#)
        var targets: [String: Set<String>] = [:]
        for match in target.matches(in: manifest, range: NSRange(manifest.startIndex..., in: manifest)) {
            let name = String(manifest[Range(match.range(at: 1), in: manifest)!])
            let list = String(manifest[Range(match.range(at: 2), in: manifest)!])
            let range = NSRange(list.startIndex..., in: list)
            var modules = Set(product.matches(in: list, range: range).map { String(list[Range($0.range(at: 1), in: list)!]) })
            modules.formUnion(plain.matches(in: list, range: range).map { String(list[Range($0.range(at: 1), in: list)!]) })
            targets[name] = modules
        }
        return targets
    }

    @Test func everyImportIsADeclaredDependency() throws {
        let targets = try Self.declared()
        #expect(targets.count >= 10, "targets read from Package.swift: \(targets.keys.sorted())")
        let statement = try NSRegularExpression(pattern: #"^(?:@testable |@_exported |internal |public |package )?import (\w+)"#)
        var undeclared: [String] = []
        for (name, dependencies) in targets.sorted(by: { $0.key < $1.key }) {
            let folder = ["Sources", "Tests"].map { Self.root.appendingPathComponent($0).appendingPathComponent(name) }
                .first { FileManager.default.fileExists(atPath: $0.path) }
            guard let folder, let files = FileManager.default.enumerator(at: folder, includingPropertiesForKeys: nil) else {
                undeclared.append("\(name): no folder under Sources or Tests")
                continue
            }
            for case let file as URL in files where file.pathExtension == "swift" {
                let text = try String(contentsOf: file, encoding: .utf8)
                for line in text.split(separator: "\n") {
                    let line = String(line)
                    guard let match = statement.firstMatch(in: line, range: NSRange(line.startIndex..., in: line)) else { continue }
                    let module = String(line[Range(match.range(at: 1), in: line)!])
                    if !dependencies.contains(module), !Self.toolchain.contains(module), module != name {
                        undeclared.append("\(name) imports \(module) (\(file.lastPathComponent)) without depending on it")
                    }
                }
            }
        }
        #expect(undeclared.isEmpty, "\(Set(undeclared).sorted().joined(separator: "\n"))")
    }

    /// The app side is a package an app adds: it fetches nothing and imports only the system's
    /// modules and its own, so adding it builds nothing of the server.
    @Test func theClientPackageDependsOnNothingButTheSystem() throws {
        let client = Self.root.appendingPathComponent("Client")
        let manifest = try String(contentsOf: client.appendingPathComponent("Package.swift"), encoding: .utf8)
        #expect(!manifest.contains(".package("), "Client/Package.swift depends on another package")
        let allowed: Set<String> = [
            "Foundation", "FoundationNetworking", "Glibc", "Musl", "Darwin", "Security", "StoreKit", "StoreKitSurface", "IAPClient",
        ]
        let statement = try NSRegularExpression(pattern: #"^\s*(?:@testable |@_exported |internal |public |package )?import (\w+)"#)
        var imported: Set<String> = []
        let files = try #require(FileManager.default.enumerator(at: client.appendingPathComponent("Sources"), includingPropertiesForKeys: nil))
        for case let file as URL in files where file.pathExtension == "swift" {
            for line in try String(contentsOf: file, encoding: .utf8).split(separator: "\n").map(String.init) {
                guard let match = statement.firstMatch(in: line, range: NSRange(line.startIndex..., in: line)) else { continue }
                imported.insert(String(line[Range(match.range(at: 1), in: line)!]))
            }
        }
        #expect(imported.contains("Foundation"), "the client's sources were not found")
        #expect(imported.subtracting(allowed).isEmpty, "the client imports \(imported.subtracting(allowed).sorted())")
    }
}
