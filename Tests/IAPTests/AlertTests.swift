import Finisher
import Foundation
import Hummingbird
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOHTTP1
import ServiceLifecycle
import Testing
import TestSupport

extension BrokerTests {
    @Suite("Alerts")
    struct AlertTests {
        /// A webhook receiver on loopback that keeps what it was sent.
        struct Webhook {
            let url: String
            let received: NIOLockedValueBox<[Alert]>
            let group: ServiceGroup
            let task: Task<Void, any Error>

            static func start() async throws -> Webhook {
                let received = NIOLockedValueBox([Alert]())
                let router = Router()
                router.post("/alerts") { request, context in
                    let alert = try await request.decode(as: Alert.self, context: context)
                    received.withLockedValue { $0.append(alert) }
                    return HTTPResponse.Status.noContent
                }
                let server = try await LoopbackServer.start(router, name: "the webhook receiver")
                return Webhook(url: server.base + "/alerts", received: received, group: server.group, task: server.task)
            }

            func stop() async {
                await group.triggerGracefulShutdown()
                _ = try? await task.value
            }
        }

        @Test func repeatedFailuresAlertOnceThroughTheWebhook() async throws {
            let webhook = try await Webhook.start()
            Teardown.add { await webhook.stop() }
            let pipeline = try await PipelineHarness.start(
                name: "alerts", retryDelays: [1], alerts: AlertSettings(afterAttempts: 2, webhookURL: webhook.url))
            Teardown.add { await pipeline.stop() }
            let purchase = try await pipeline.mint()
            try await pipeline.injectFault(.init(httpStatus: 503, count: 0, transactionId: purchase.transactionId))
            let id = try await pipeline.upload(userId: "kim", receiptData: purchase.receiptData)

            #expect(try await eventually(timeout: .seconds(20)) { (try await pipeline.status(id)["attempts"] as? Int ?? 0) >= 4 })
            let alerts = webhook.received.withLockedValue { $0 }
            #expect(alerts.count == 1, "\(alerts)")
            #expect(alerts.first?.kind == "repeated_failures")
            #expect(alerts.first?.submissionId == id)
            #expect(alerts.first?.reason == "apple_unavailable")
            #expect(alerts.first?.state == "retrying")

            _ = try await HTTP.send(pipeline.fakeURL + "/fake/faults", method: .DELETE, body: nil)
            #expect(try await pipeline.waitForState(id)["state"] as? String == "credited")
            #expect(webhook.received.withLockedValue { $0.count } == 1)
        }
    }
}
