import Foundation
import Testing

@Suite("Deployment files")
struct ComposeTests {
    @Test func composeFileIsValid() throws {
        try expectValid("compose/docker-compose.yml")
    }

    /// Three RabbitMQ nodes, PostgreSQL, two order services behind a load balancer.
    @Test func clusterComposeFileIsValid() throws {
        try expectValid("compose/docker-compose.cluster.yml")
    }

    /// Fails when `docker-compose config` refuses the file, or when the file is missing (the
    /// tool then exits non-zero too; the first check says which).
    private func expectValid(_ path: String) throws {
        #expect(
            FileManager.default.fileExists(atPath: repositoryRoot.appendingPathComponent(path).path),
            "\(path) is missing")
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = ["docker-compose", "-f", path, "config", "-q"]
        process.currentDirectoryURL = repositoryRoot
        let errors = Pipe()
        process.standardError = errors
        try process.run()
        process.waitUntilExit()
        let message = String(decoding: errors.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        #expect(process.terminationStatus == 0, "docker-compose config \(path): \(message)")
    }
}
