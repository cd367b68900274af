import Foundation
import IAPCore
import OrderStore
import Ledger
import Testing
import TestSupport

extension ClusterDrills {
    /// Drills for several order services on one PostgreSQL store: real `iap` processes, real
    /// uploads (`DrillTraffic`: until the fault has landed and 300 more), something broken
    /// once 150 uploads are through, and the same three promises as the other fault drills
    /// (see docs/reliability.md).
    @Suite("Fault drills on PostgreSQL", .needsPostgres, .timeLimit(.minutes(5)))
    struct PostgresDrillTests {
        /// The fake App Store, two order services (`orders`, `orders-b`, each its own intake)
        /// and two verifiers, all on the drill's store and, unless `environment` names other
        /// brokers, on the suite's three-node cluster (quorum queues) when the run has one.
        func startTwoOfEach(_ name: String, environment: [String: String] = [:]) async throws -> (ProcessDrill, [String]) {
            var environment = environment
            if environment["IAP_AMQP_URL"] == nil {
                environment["IAP_AMQP_URL"] = try TestCluster.isAvailable ? TestCluster.urls() : TestBroker.drillNodeURL()
            }
            let drill = try await ProcessDrill(name: name, on: .postgres, environment: environment)
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
            let traffic = DrillTraffic(drill, intakes: intakes)
            try await traffic.waitForMore(150)
            // Results are in flight: some purchases are credited already, more are not yet. Both
            // are waited for (the verifiers may drain the queue between two reads), not sampled once.
            let store = try await OrderStore(location: drill.storeLocation)
            var atKill: [SubmissionState: Int] = [:]
            let deadline = ContinuousClock.now + .seconds(20)
            repeat {
                atKill = try await store.submissionCounts()
                if (atKill[.credited] ?? 0) > 0, (atKill[.pending] ?? 0) + (atKill[.retrying] ?? 0) > 0 { break }
                try await Task.sleep(for: .milliseconds(50))
            } while ContinuousClock.now < deadline
            await store.close()
            let flowing = (atKill[.credited] ?? 0) > 0
            #expect(flowing, "no result was applied before the kill")
            #expect((atKill[.pending] ?? 0) + (atKill[.retrying] ?? 0) > 0, "nothing was in flight at the kill: \(atKill)")
            drill.kill9("orders")
            traffic.faultLanded()
            try await Task.sleep(for: .seconds(2))
            try drill.start("orders")
            let recovered = ContinuousClock.now
            let submissions = try await traffic.finish()
            let outcome = try await drill.settle(submissions)
            check(outcome, purchases: submissions.count, drill: drill, name: "kill -9 one of two order services", recovery: .now - recovered)
        }

        /// The database restarts under two order services mid-stream: writes wait for it and
        /// run again on new connections; what they could not store in time the phones resend.
        @Test func postgresRestartedMidStream() async throws {
            // Under the checkout's .run/, where the scripts keep (and may wipe) their servers.
            let folder = repositoryRoot.appendingPathComponent(".run/test/drill-postgres-\(UUID().uuidString.prefix(8))")
            let server = try DrillPostgres(folder: folder, root: repositoryRoot)
            defer { server.stop() }
            let url = try await server.start()
            let (drill, intakes) = try await startTwoOfEach("pg-restart", environment: ["IAP_DATABASE_URL": url])
            let traffic = DrillTraffic(drill, intakes: intakes)
            try await traffic.waitForMore(150)
            try await server.restart(pause: .seconds(3))
            traffic.faultLanded()
            let recovered = ContinuousClock.now
            let submissions = try await traffic.finish()
            let outcome = try await drill.settle(submissions, store: .postgres(try .init(url: url)))
            check(outcome, purchases: submissions.count, drill: drill, name: "PostgreSQL restarted (3 s down)", recovery: .now - recovered)
        }

        /// The broker node every service is connected to dies (kill -9) mid-stream: they move
        /// to the next node of their list, declare their queues again and resend what the dead
        /// node never confirmed. The node comes back 3 s later and rejoins.
        @Test(.enabled(if: TestCluster.isAvailable, Comment(rawValue: TestCluster.missing)))
        func theBrokerNodeInUseKilledMidStream() async throws {
            let urls = try TestCluster.urls().split(separator: ",").map(String.init)
            try #require(urls.count == 3)
            let victim = try #require(TestCluster.port(of: urls[1]))
            // Node 2 first in every service's list: that is the node they all connect to.
            let (drill, intakes) = try await startTwoOfEach(
                "pg-kill-node", environment: ["IAP_AMQP_URL": [urls[1], urls[0], urls[2]].joined(separator: ",")])
            let traffic = DrillTraffic(drill, intakes: intakes)
            try await traffic.waitForMore(150)
            // Two connections each (publishing, consuming), four services: all eight on node 2.
            #expect(try await TestCluster.clientConnections(onNodeWithPort: victim) >= 8, "the services are not all on node 2")
            try await TestCluster.control("kill \(victim)")
            traffic.faultLanded()
            // Whatever happens to the wait, the suite's cluster gets its node back.
            try await TestCluster.restartingNode(victim) { try await Task.sleep(for: .seconds(3)) }
            let recovered = ContinuousClock.now
            let submissions = try await traffic.finish()
            let outcome = try await drill.settle(submissions)
            check(outcome, purchases: submissions.count, drill: drill, name: "kill -9 the broker node in use", recovery: .now - recovered)
        }

        /// A network partition: the link of the node every service is connected to goes down
        /// for 20 s, cutting it off from the other two nodes and from the services at once. It
        /// stops serving (pause_minority); the services notice by missed heartbeats and move on;
        /// quorum queues keep their majority on the other two. Then the link comes back.
        @Test func aBrokerNodeCutOffByAPartition() async throws {
            let folder = repositoryRoot.appendingPathComponent(".run/test/drill-cluster-\(UUID().uuidString.prefix(8))")
            let cluster = try DrillCluster(folder: folder, root: repositoryRoot)
            defer { cluster.stop() }
            let urls = try await cluster.start()
            try #require(urls.count == 3)
            // Node 3, the one in a namespace of its own, first in every service's list.
            let (drill, intakes) = try await startTwoOfEach(
                "pg-partition", environment: ["IAP_AMQP_URL": [urls[2], urls[0], urls[1]].joined(separator: ",")])
            let traffic = DrillTraffic(drill, intakes: intakes)
            try await traffic.waitForMore(150)
            // Two connections each (publishing, consuming), four services: all eight on node 3.
            #expect(try await cluster.clientConnections(onNode: 3) >= 8, "the services are not all on node 3")
            try await cluster.partition(.down)
            traffic.faultLanded()
            let cut = ContinuousClock.now
            // While the link is down the services notice by missed heartbeats and reach the
            // majority's nodes.
            let moved = try await eventually(timeout: .seconds(19), interval: .milliseconds(500)) {
                try await cluster.clientConnections(onNode: 1) + cluster.clientConnections(onNode: 2) >= 4
            }
            #expect(moved, "the services did not reach nodes 1 and 2 while node 3 was cut off")
            let movedAfter = ContinuousClock.now - cut
            try await Task.sleep(until: cut + .seconds(20), clock: .continuous)
            try await cluster.partition(.up)
            let recovered = ContinuousClock.now
            let submissions = try await traffic.finish()
            let outcome = try await drill.settle(submissions)
            check(
                outcome, purchases: submissions.count, drill: drill,
                name: "partition: node in use cut off for 20 s (services on the majority after \(movedAfter))",
                recovery: .now - recovered)
            // And the node that was cut off is a running member of the cluster again (a paused
            // node retries its peers on its own schedule: one full run saw it take over a
            // minute on a loaded machine, so the bound is generous).
            let whole = try await eventually(timeout: .seconds(180), interval: .seconds(1)) { await cluster.isWhole() }
            #expect(whole, "node 3 did not rejoin the cluster after the link came back")
        }
    }
}

/// Runs a bash snippet with the repository's scripts at hand: `$1` is the repository, `$2` a
/// drill's folder, `$3` the env file of the server it keeps there. Fails with the end of its
/// error output.
@discardableResult
private func drillScript(_ text: String, root: URL, folder: URL, env: String, what: String) async throws -> String {
    try await offThePool { try drillScriptBlocking(text, root: root, folder: folder, env: env, what: what) }
}

/// `drillScript` for `stop()`, which runs from `defer`.
@discardableResult
private func drillScriptBlocking(_ text: String, root: URL, folder: URL, env: String, what: String) throws -> String {
    let run = try runProgramBlocking("/bin/bash", ["-c", "set -euo pipefail; " + text, what, root.path, folder.path, env])
    guard run.status == 0 else { throw HarnessError("\(what): \(run.error.suffix(800))") }
    return run.output
}

/// A three-node RabbitMQ cluster of one drill's own whose node 3 lives in a network namespace
/// joined to the machine by one veth link (`scripts/dev cluster partition down|up`), so that a
/// drill can cut it off without touching the suite's cluster.
struct DrillCluster {
    enum Link: String { case down, up }

    let folder: URL
    let root: URL
    var env: String { folder.appendingPathComponent("cluster.env").path }

    init(folder: URL, root: URL) throws {
        self.folder = folder
        self.root = root
        try FileManager.default.createDirectory(at: folder, withIntermediateDirectories: true)
    }

    /// Starts a fresh cluster and returns its nodes' AMQP URLs, node 1 first.
    func start() async throws -> [String] {
        try await script(
            #"source "$1/scripts/lib/common.sh"; source "$1/scripts/lib/broker.sh"; cluster_fresh_start iap-drill "$2/nodes" "$3" netns >&2"#)
        return try await script(
            #"source "$1/scripts/lib/common.sh"; source "$1/scripts/lib/broker.sh"; cluster_load "$3"; echo "$IAP_CLUSTER_AMQP_URLS""#
        ).trimmingCharacters(in: .whitespacesAndNewlines).split(separator: ",").map(String.init)
    }

    /// Takes node 3's link down or brings it up.
    func partition(_ link: Link) async throws {
        try await script(#"IAP_CLUSTER_ENV="$3" "$1/scripts/dev" cluster partition "# + link.rawValue + " >&2")
    }

    /// How many client connections node `node` (1-3) holds.
    func clientConnections(onNode node: Int) async throws -> Int {
        try await Int(script(#"IAP_CLUSTER_ENV="$3" "$1/scripts/dev" cluster connections "# + String(node))
            .trimmingCharacters(in: .whitespacesAndNewlines)) ?? 0
    }

    /// Whether all three nodes run as members of one cluster (`scripts/dev cluster status`).
    func isWhole() async -> Bool {
        (try? await script(#"IAP_CLUSTER_ENV="$3" "$1/scripts/dev" cluster status >&2"#)) != nil
    }

    /// Stops the nodes, removes the namespace and the folder.
    func stop() {
        _ = try? drillScriptBlocking(
            #"IAP_CLUSTER_ENV="$3" "$1/scripts/dev" cluster stop >&2"#, root: root, folder: folder, env: env, what: "drill cluster")
        try? FileManager.default.removeItem(at: folder)
    }

    @discardableResult
    private func script(_ text: String) async throws -> String {
        try await drillScript(text, root: root, folder: folder, env: env, what: "drill cluster")
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
    func start() async throws -> String {
        try await script(
            #"source "$1/scripts/lib/common.sh"; source "$1/scripts/lib/postgres.sh"; postgres_fresh_start "$2/postgres" "$3" on >&2"#)
        return try await script(
            #"source "$1/scripts/lib/common.sh"; source "$1/scripts/lib/postgres.sh"; postgres_load "$3"; postgres_url postgres"#
        ).trimmingCharacters(in: .whitespacesAndNewlines)
    }

    /// Stops the server (fast shutdown: sessions end), waits `pause`, starts it again.
    func restart(pause: Duration) async throws {
        try await script(#"IAP_POSTGRES_ENV="$3" "$1/scripts/dev" postgres stop >&2"#)
        try await Task.sleep(for: pause)
        try await script(#"IAP_POSTGRES_ENV="$3" "$1/scripts/dev" postgres start >&2"#)
    }

    /// Stops the server and removes its folder.
    func stop() {
        _ = try? drillScriptBlocking(
            #"IAP_POSTGRES_ENV="$3" "$1/scripts/dev" postgres stop >&2"#, root: root, folder: folder, env: env,
            what: "drill PostgreSQL")
        try? FileManager.default.removeItem(at: folder)
    }

    @discardableResult
    private func script(_ text: String) async throws -> String {
        try await drillScript(text, root: root, folder: folder, env: env, what: "drill PostgreSQL")
    }
}
