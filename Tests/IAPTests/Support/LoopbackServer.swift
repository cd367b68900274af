import Foundation
import Hummingbird
import Logging
import NIOConcurrencyHelpers
import ServiceLifecycle

/// A stand-in HTTP server of the tests (a webhook receiver, a notification relay) on a free
/// loopback port, started and running when `start` returns.
struct LoopbackServer: Sendable {
    /// `http://127.0.0.1:<port>`.
    let base: String
    let group: ServiceGroup
    let task: Task<Void, any Error>

    /// Serves `router`; `name` says what failed to start. Waits for the listener itself (or for
    /// the server's end, when it cannot bind), however loaded the machine is.
    static func start(_ router: Router<BasicRequestContext>, name: String) async throws -> LoopbackServer {
        let (listening, announce) = AsyncStream<Int>.makeStream()
        let application = Application(
            router: router, configuration: .init(address: .hostname("127.0.0.1", port: 0)),
            onServerRunning: { channel in
                announce.yield(channel.localAddress?.port ?? 0)
                announce.finish()
            },
            logger: TestBroker.logger)
        let group = ServiceGroup(
            configuration: .init(services: [application], gracefulShutdownSignals: [], logger: TestBroker.logger))
        let task = Task {
            defer { announce.finish() }
            try await group.run()
        }
        var ports = listening.makeAsyncIterator()
        guard let port = await ports.next(), port != 0 else {
            task.cancel()
            throw HarnessError("\(name) did not start: \(await task.result)")
        }
        return LoopbackServer(base: "http://127.0.0.1:\(port)", group: group, task: task)
    }
}

/// Runs a program to its end, waiting off the cooperative pool: its exit status, standard
/// output and standard error.
func runProgram(_ path: String, _ arguments: [String]) async throws -> (status: Int32, output: String, error: String) {
    try await offThePool { try runProgramBlocking(path, arguments) }
}

/// `runProgram` for a caller that cannot wait (a `stop()` run from `defer`).
func runProgramBlocking(_ path: String, _ arguments: [String]) throws -> (status: Int32, output: String, error: String) {
    let process = Process()
    process.executableURL = URL(fileURLWithPath: path)
    process.arguments = arguments
    let output = Pipe()
    let error = Pipe()
    process.standardOutput = output
    process.standardError = error
    try process.run()
    // Standard error is read beside standard output: either pipe filling up would block it.
    let errors = NIOLockedValueBox(Data())
    let reader = Thread { errors.withLockedValue { $0 = error.fileHandleForReading.readDataToEndOfFile() } }
    reader.start()
    let out = output.fileHandleForReading.readDataToEndOfFile()
    process.waitUntilExit()
    while reader.isExecuting || !reader.isFinished { usleep(1000) }
    return (process.terminationStatus, String(decoding: out, as: UTF8.self), String(decoding: errors.withLockedValue { $0 }, as: UTF8.self))
}

/// Runs one of the repository's Python scripts with the interpreter at `python` (absolute, or
/// relative to the repository), waiting off the cooperative pool; its exit status and
/// everything it printed.
func runPythonScript(_ python: String, _ script: String, _ arguments: [String]) async throws -> (status: Int32, output: String) {
    try await offThePool { try runPythonScriptBlocking(python, script, arguments) }
}

private func runPythonScriptBlocking(_ python: String, _ script: String, _ arguments: [String]) throws -> (status: Int32, output: String) {
    let process = Process()
    process.executableURL = python.hasPrefix("/") ? URL(fileURLWithPath: python) : repositoryRoot.appendingPathComponent(python)
    process.arguments = [repositoryRoot.appendingPathComponent(script).path] + arguments
    process.currentDirectoryURL = repositoryRoot
    let output = Pipe()
    process.standardOutput = output
    process.standardError = output
    try process.run()
    // Read before waiting: a full pipe would block the script.
    let text = String(decoding: output.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
    process.waitUntilExit()
    return (process.terminationStatus, text)
}
