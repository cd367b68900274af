import Foundation
import Testing

@Suite("Deployment files")
struct ComposeTests {
    @Test func composeFileIsValid() throws {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = ["docker-compose", "-f", "compose/docker-compose.yml", "config", "-q"]
        process.currentDirectoryURL = repositoryRoot
        let errors = Pipe()
        process.standardError = errors
        try process.run()
        process.waitUntilExit()
        let message = String(decoding: errors.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        #expect(process.terminationStatus == 0, "docker-compose config: \(message)")
    }
}
