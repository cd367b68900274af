import AsyncHTTPClient
import Foundation
import Intake
import NIOCore
import NIOHTTP1
import Testing
import TestSupport

/// The admin surface stays off the public port, slow console sign-ins hold none of the app's
/// slots, and what clients choose never forges a log line.
@Suite("The admin surface and the logs", .teardown)
struct AdminSurfaceTests {
    /// `iap orders` with an admin token and no admin listener refuses to start, naming the
    /// settings that fix it; the main compose file serves the admin port on loopback only.
    @Test(.timeLimit(.minutes(1))) func ordersRefusesToServeTheAdminSurfaceOnThePublicPort() async throws {
        let run = try await CommandLineTests().iap(
            ["orders"],
            environment: [
                "IAP_ADMIN_TOKEN": "an-admin-token-0123456789abcdefghijkl", "IAP_ADMIN_PORT": "", "IAP_ADMIN_PUBLIC": "",
                "IAP_AUTH": "off", "IAP_HTTP_PORT": "0", "IAP_BUNDLE_IDS": "com.example.tests",
                "IAP_CATALOG": repositoryRoot.appendingPathComponent("compose/catalog.json").path,
            ])
        #expect(run.status != 0, "\(run.output)")
        #expect(run.output.contains("IAP_ADMIN_PORT") && run.output.contains("IAP_ADMIN_PUBLIC=1"), "\(run.output)")
    }

    @Test func theMainComposeFilePublishesTheAdminPortOnLoopbackOnly() async throws {
        let text = try String(contentsOf: repositoryRoot.appendingPathComponent("compose/docker-compose.yml"), encoding: .utf8)
        #expect(text.contains("IAP_ADMIN_PORT: \"8081\""))
        let published = text.split(separator: "\n").filter { $0.contains(":8081") }
        // Published on the loopback address only (the host port may be chosen, as the compose test does).
        #expect(
            !published.isEmpty && published.allSatisfy { $0.contains("\"127.0.0.1:") && $0.contains(":8081\"") }, "\(published)")
    }
}

extension BrokerTests {
    @Suite("Admin surface under load, and log lines")
    struct AdminSurfaceLoadTests {
        /// Where the console shares the public port (IAP_ADMIN_PUBLIC), sign-ins that send half a
        /// body hold none of the app's in-flight slots, are cut off by the body timeout, and the
        /// attempts count before their bodies arrive.
        @Test func slowConsoleSignInsNeverHoldTheAppsSlots() async throws {
            let pipeline = try await PipelineHarness.start(
                name: "slowsignin",
                limits: IntakeLimits(
                    perUser: nil, perAddress: nil, maxInFlight: 4, bodyTimeout: .seconds(2), notifications: nil,
                    notificationFailuresPerAddress: nil))
            Teardown.add { await pipeline.stop() }
            let held = (0..<8).map { _ in
                Task { () -> Int in
                    var request = HTTPClientRequest(url: pipeline.intakeURL + "/admin/login")
                    request.method = .POST
                    request.headers.add(name: "Content-Type", value: "application/x-www-form-urlencoded")
                    let stream = AsyncStream<ByteBuffer> { continuation in
                        continuation.yield(ByteBuffer(string: "token=guess&"))
                        Task {
                            try? await Task.sleep(for: .seconds(30))
                            continuation.finish()
                        }
                    }
                    request.body = .stream(stream, length: .known(Int64(1000)))
                    let response = try await HTTPClient.shared.execute(request, timeout: .seconds(40))
                    return Int(response.status.code)
                }
            }
            defer { for task in held { task.cancel() } }
            try await Task.sleep(for: .milliseconds(500))
            for _ in 0..<3 {
                let answer = try await HTTP.get(pipeline.intakeURL + "/v1/receipts/\(UUID())?userId=ana")
                #expect(answer.status == 404, "the app's route answered \(answer.status) while sign-ins were held: \(answer.text)")
            }
            // The held attempts counted as they started: this address has had its five.
            let next = try await HTTP.post(
                pipeline.intakeURL + "/admin/login", raw: Data("token=another-guess".utf8),
                contentType: "application/x-www-form-urlencoded")
            #expect(next.status == 429, "\(next.status)")
        }

        /// A console form that trickles in is cut off by the body timeout, as the app's bodies are.
        @Test func aSlowConsoleFormIsCutOffByTheBodyTimeout() async throws {
            let pipeline = try await PipelineHarness.start(
                name: "slowform", limits: IntakeLimits(perUser: nil, perAddress: nil, bodyTimeout: .seconds(1)))
            Teardown.add { await pipeline.stop() }
            let port = try #require(URLComponents(string: pipeline.intakeURL)?.port)
            let slow = try RawHTTPClient(port: port)
            let started = ContinuousClock.now
            try slow.send(
                "POST /admin/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                    + "Content-Length: 100\r\n\r\ntoken=gu")
            let reply = try await slow.receiveOffThePool(timeout: 10)
            #expect(reply.hasPrefix("HTTP/1.1 400"), "\(reply)")
            #expect(ContinuousClock.now - started < .seconds(5), "the form was held for \(ContinuousClock.now - started)")
        }

        /// A token header's `alg` (or any client-chosen value) with a line break is written
        /// escaped in the text log: it never starts a line of its own.
        @Test func aClientChosenValueNeverStartsALogLineOfItsOwn() async throws {
            let drill = try await ProcessDrill(
                name: "loglines",
                environment: [
                    "IAP_LOG_LEVEL": "info", "IAP_LOG_FORMAT": "text", "IAP_AUTH": "jwt",
                    "IAP_AUTH_HS256_SECRET": TestTokens.secret,
                ])
            try drill.start("orders")
            try await drill.waitHealthy(drill.intakeURL)
            let token = try TestTokens.handmade(header: ["alg": "x\nFORGED critical"], claims: .init("ana"))
            let answer = try await UserHTTP.send(.GET, drill.intakeURL + "/v1/users/ana/grants", token: token)
            #expect(answer.status == 401, "\(answer.text)")
            let logged = try await eventually(timeout: .seconds(5)) { drill.logTail("orders", lines: .max).contains("FORGED") }
            let log = drill.logTail("orders", lines: .max)
            #expect(logged, "\(log)")
            #expect(!log.split(separator: "\n").contains { $0.hasPrefix("FORGED") }, "\(log)")
        }
    }
}
