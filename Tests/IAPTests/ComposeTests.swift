import Foundation
import IAPCore
import Testing

@Suite("Deployment files")
struct ComposeTests {
    @Test func composeFileIsValid() async throws {
        try await expectValid("compose/docker-compose.yml")
    }

    /// Three RabbitMQ nodes, PostgreSQL, two order services behind a load balancer.
    @Test func clusterComposeFileIsValid() async throws {
        try await expectValid("compose/docker-compose.cluster.yml")
    }

    /// The cluster file as docker-compose resolves it has the shape docs/scaling.md describes:
    /// three RabbitMQ nodes that form one cluster, PostgreSQL on a volume, two order services
    /// on it behind the balancer, verifiers that scale and see no secret but their own, and
    /// Prometheus and Grafana.
    @Test func clusterComposeFileHasTheDeploymentsShape() async throws {
        let config = try await resolved("compose/docker-compose.cluster.yml")
        let services = try #require(config["services"] as? [String: [String: Any]])
        for name in ["rabbitmq-1", "rabbitmq-2", "rabbitmq-3", "postgres", "orders-1", "orders-2", "lb", "verifier", "prometheus", "grafana"] {
            #expect(services[name] != nil, "no service \(name)")
        }
        func volumes(_ service: String) -> [String] {
            (services[service]?["volumes"] as? [Any] ?? []).map { volume in
                if let text = volume as? String { return text }
                let mount = volume as? [String: Any] ?? [:]
                return "\(mount["source"] ?? ""):\(mount["target"] ?? "")"
            }
        }
        func environment(_ service: String) -> [String: String] {
            (services[service]?["environment"] as? [String: Any] ?? [:]).mapValues { "\($0)" }
        }
        func secrets(_ service: String) -> [String] {
            (services[service]?["secrets"] as? [Any] ?? []).map { ($0 as? String) ?? "\(($0 as? [String: Any])?["source"] ?? "")" }
        }
        let rabbitConfig = try String(
            contentsOf: repositoryRoot.appendingPathComponent("compose/rabbitmq/rabbitmq.conf"), encoding: .utf8)
        for node in 1...3 {
            #expect(volumes("rabbitmq-\(node)").contains { $0.hasPrefix("rabbitmq-\(node)-data:") }, "rabbitmq-\(node) keeps its data")
            #expect(rabbitConfig.contains("classic_config.nodes.\(node) = rabbit@rabbitmq-\(node)"), "node \(node) joins the cluster")
            #expect(secrets("rabbitmq-\(node)").contains("rabbitmq-erlang-cookie"))
        }
        #expect(volumes("postgres").contains { $0.hasPrefix("postgres-data:/var/lib/postgresql/data") }, "\(volumes("postgres"))")
        let balancer = try String(contentsOf: repositoryRoot.appendingPathComponent("compose/haproxy/haproxy.cfg"), encoding: .utf8)
        for orders in ["orders-1", "orders-2"] {
            let settings = environment(orders)
            #expect(settings["IAP_DATABASE_URL"]?.hasPrefix("postgres://") == true, "\(orders): \(settings)")
            #expect(settings["IAP_QUEUE_TYPE"] == "quorum" && settings["IAP_AMQP_URL_FILE"] != nil, "\(orders)")
            #expect(balancer.contains("server \(orders) \(orders):8080"), "the balancer sends uploads to \(orders)")
        }
        let verifier = try #require(services["verifier"])
        #expect(((verifier["deploy"] as? [String: Any])?["replicas"] as? Int ?? 0) >= 2, "verifiers scale by replicas")
        #expect(environment("verifier")["IAP_QUEUE_TYPE"] == "quorum")
        #expect(Set(secrets("verifier")) == ["amqp-urls"], "\(secrets("verifier"))")
        #expect(!volumes("verifier").contains { $0.hasSuffix(":/run/secrets") || $0.hasSuffix(":/run/secrets:ro") }, "\(volumes("verifier"))")
    }

    /// Grafana has no stand-in image (no Debian package), so `scripts/dev compose test` leaves
    /// it out of the run: its provisioning is checked here instead. The files parse, the data
    /// source is the compose files' Prometheus, the dashboards folder is the one mounted, and
    /// every panel query names only metrics the services export (`MetricNames`).
    @Test func grafanaProvisioningMatchesTheStack() async throws {
        let datasources = try await yaml("compose/grafana/provisioning/datasources/prometheus.yml")
        let sources = try #require(datasources["datasources"] as? [[String: Any]])
        let prometheus = try #require(sources.first { $0["type"] as? String == "prometheus" }, "\(sources)")
        #expect(prometheus["url"] as? String == "http://prometheus:9090")
        let uid = try #require(prometheus["uid"] as? String)
        for file in ["compose/docker-compose.yml", "compose/docker-compose.cluster.yml"] {
            let services = try #require(try await resolved(file)["services"] as? [String: [String: Any]])
            let ports = (services["prometheus"]?["ports"] as? [Any] ?? []).map { "\($0)" }
            #expect(ports.contains { $0.contains("9090") }, "\(file): prometheus serves 9090: \(ports)")
            let grafana = (services["grafana"]?["volumes"] as? [Any] ?? []).map { "\($0)" }
            #expect(grafana.contains { $0.contains("/var/lib/grafana/dashboards") }, "\(file): \(grafana)")
        }
        let providers = try await yaml("compose/grafana/provisioning/dashboards/iap.yml")
        let provider = try #require((providers["providers"] as? [[String: Any]])?.first)
        #expect((provider["options"] as? [String: Any])?["path"] as? String == "/var/lib/grafana/dashboards")

        let dashboardData = try Data(
            contentsOf: repositoryRoot.appendingPathComponent("compose/grafana/dashboards/iap-pipeline.json"))
        let dashboard = try #require(try JSONSerialization.jsonObject(with: dashboardData) as? [String: Any])
        let panels = try #require(dashboard["panels"] as? [[String: Any]])
        #expect(!panels.isEmpty)
        // A histogram is exported as its _bucket, _count and _sum series.
        let exported = Set(MetricNames.all.flatMap { [$0, $0 + "_bucket", $0 + "_count", $0 + "_sum"] })
        let metricName = /iap_[a-z_]+/
        for panel in panels {
            let title = panel["title"] as? String ?? "?"
            let targets = panel["targets"] as? [[String: Any]] ?? []
            #expect(!targets.isEmpty, "panel \(title) has no query")
            for target in targets {
                let expr = target["expr"] as? String ?? ""
                let names = expr.matches(of: metricName).map { String($0.output) }
                #expect(!names.isEmpty, "panel \(title): \(expr) names no iap metric")
                for name in names {
                    #expect(exported.contains(name), "panel \(title): \(name) is not a metric the services export")
                }
                #expect((target["datasource"] as? [String: Any])?["uid"] as? String == uid, "panel \(title)")
            }
        }
    }

    /// A YAML file of the repository as JSON objects (PyYAML, as `resolved`).
    private func yaml(_ path: String) async throws -> [String: Any] {
        let run = try await runProgram(
            "/usr/bin/python3",
            ["-c", "import json, sys, yaml; json.dump(yaml.safe_load(open(sys.argv[1])), sys.stdout)",
             repositoryRoot.appendingPathComponent(path).path])
        #expect(run.status == 0, "\(path): \(run.error)")
        return try #require(try JSONSerialization.jsonObject(with: Data(run.output.utf8)) as? [String: Any], "\(run.error)")
    }

    /// `docker-compose config` of `path`, as JSON objects (its YAML read by the PyYAML that
    /// Debian's docker-compose itself runs on).
    private func resolved(_ path: String) async throws -> [String: Any] {
        let run = try await runProgram(
            "/bin/sh",
            [
                "-c",
                "cd \"$1\" && docker-compose -f \"$2\" config | /usr/bin/python3 -c 'import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)'",
                "sh", repositoryRoot.path, path,
            ])
        #expect(run.status == 0, "docker-compose config \(path): \(run.error)")
        return try #require(try JSONSerialization.jsonObject(with: Data(run.output.utf8)) as? [String: Any], "\(run.error)")
    }

    /// Fails when `docker-compose config` refuses the file, or when the file is missing (the
    /// tool then exits non-zero too; the first check says which).
    private func expectValid(_ path: String) async throws {
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
        await process.exited()
        let message = String(decoding: errors.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        #expect(process.terminationStatus == 0, "docker-compose config \(path): \(message)")
    }
}
