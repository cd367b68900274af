import Foundation
import OrderStore
import Testing

extension BrokerTests {
    /// Drills for several order services on one PostgreSQL store (the PostgreSQL pass of the
    /// suite): real `iap` processes, 2,000 purchases, something broken mid-stream, and the same
    /// three promises as the other fault drills (see docs/reliability.md).
    @Suite("Fault drills on PostgreSQL", .enabled(if: TestStore.usesPostgres), .timeLimit(.minutes(5)))
    struct PostgresDrillTests {
        static let purchases = 2_000

        /// The fake App Store, two order services (`orders`, `orders-b`, each its own intake)
        /// and two verifiers, all on the drill's store.
        func startTwoOfEach(_ name: String, environment: [String: String] = [:]) async throws -> (ProcessDrill, [String]) {
            let drill = try ProcessDrill(name: name, environment: environment)
            try drill.start("fake-appstore")
            try await drill.waitHealthy(drill.fakeURL)
            let secondPort = try ProcessDrill.freePort()
            try drill.start("orders")
            try drill.start("orders", as: "orders-b", environment: ["IAP_HTTP_PORT": String(secondPort)])
            let intakes = [drill.intakeURL, "http://127.0.0.1:\(secondPort)"]
            for intake in intakes { try await drill.waitHealthy(intake) }
            try drill.start("verifier")
            try drill.start("verifier", as: "verifier-b")
            return (drill, intakes)
        }

        func check(_ outcome: ProcessDrill.Outcome, purchases: Int, drill: ProcessDrill, name: String, recovery: Duration) {
            drill.check(outcome, purchases: purchases, name: name, recovery: recovery, logs: ["orders", "orders-b"])
        }

        /// One of two order services dies (kill -9) while uploads arrive and results are in
        /// flight; phones go to the other one, its results are redelivered to either finisher.
        @Test func oneOfTwoOrderServicesKilledMidStream() async throws {
            let (drill, intakes) = try await startTwoOfEach("pg-kill-orders")
            defer { drill.stopAll() }
            let purchases = try await drill.mint(Self.purchases)
            let uploads = Task { try await drill.upload(purchases, deadline: .seconds(200), intakes: intakes) }
            try await Task.sleep(for: .milliseconds(1500))
            drill.kill9("orders")
            try await Task.sleep(for: .seconds(2))
            try drill.start("orders")
            let recovered = ContinuousClock.now
            let outcome = try await drill.settle(try await uploads.value)
            check(outcome, purchases: purchases.count, drill: drill, name: "kill -9 one of two order services", recovery: .now - recovered)
        }

        /// The database restarts under two order services mid-stream: writes wait for it and
        /// run again on new connections; what they could not store in time the phones resend.
        @Test func postgresRestartedMidStream() async throws {
            // Under the checkout's .run/, where the scripts keep (and may wipe) their servers.
            let folder = repositoryRoot.appendingPathComponent(".run/test/drill-postgres-\(UUID().uuidString.prefix(8))")
            let server = try DrillPostgres(folder: folder, root: repositoryRoot)
            defer { server.stop() }
            let url = try server.start()
            let (drill, intakes) = try await startTwoOfEach("pg-restart", environment: ["IAP_DATABASE_URL": url])
            defer { drill.stopAll() }
            let purchases = try await drill.mint(Self.purchases)
            let uploads = Task { try await drill.upload(purchases, deadline: .seconds(200), intakes: intakes) }
            try await Task.sleep(for: .milliseconds(1500))
            try server.restart(pause: .seconds(3))
            let recovered = ContinuousClock.now
            let outcome = try await drill.settle(try await uploads.value, store: .postgres(try .init(url: url)))
            check(outcome, purchases: purchases.count, drill: drill, name: "PostgreSQL restarted (3 s down)", recovery: .now - recovered)
        }
    }
}

/// A PostgreSQL server of one drill's own (restarting the suite's server would break the
/// tests running beside it), through the project's scripts.
struct DrillPostgres {
    let folder: URL
    let root: URL
    var env: String { folder.appendingPathComponent("postgres.env").path }

    init(folder: URL, root: URL) throws {
        self.folder = folder
        self.root = root
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
    }

    /// Starts a fresh server and returns the admin URL of database `postgres`.
    func start() throws -> String {
        try script(
            #"source "$1/scripts/lib/common.sh"; source "$1/scripts/lib/postgres.sh"; postgres_fresh_start "$2/postgres" "$3" on >&2"#)
        return try script(
            #"source "$1/scripts/lib/common.sh"; source "$1/scripts/lib/postgres.sh"; postgres_load "$3"; postgres_url postgres"#
        ).trimmingCharacters(in: .whitespacesAndNewlines)
    }

    /// Stops the server (fast shutdown: sessions end), waits `pause`, starts it again.
    func restart(pause: Duration) throws {
        try script(#"IAP_POSTGRES_ENV="$3" "$1/scripts/dev" postgres stop >&2"#)
        Thread.sleep(forTimeInterval: Double(pause.components.seconds))
        try script(#"IAP_POSTGRES_ENV="$3" "$1/scripts/dev" postgres start >&2"#)
    }

    /// Stops the server and removes its folder.
    func stop() {
        _ = try? script(#"IAP_POSTGRES_ENV="$3" "$1/scripts/dev" postgres stop >&2"#)
        try? FileManager.default.removeItem(at: folder)
    }

    @discardableResult
    private func script(_ text: String) throws -> String {
        let run = try runProgram(
            "/bin/bash", ["-c", "set -euo pipefail; " + text, "drill-postgres", root.path, folder.path, env])
        guard run.status == 0 else { throw HarnessError("drill PostgreSQL: \(run.error.suffix(800))") }
        return run.output
    }
}
