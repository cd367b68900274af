import Foundation
import Hummingbird
public import IAPCore
import Logging
import Messaging
import NIOCore
import OrderStore

/// Where a process serves `/metrics`, `/healthz` and `/readyz` for its operators.
public struct OpsSettings: Sendable {
    /// Address to listen on.
    public var host: String
    /// Port to listen on (0 picks a free one).
    public var port: Int
    /// The metrics in Prometheus' text format; nil serves no `/metrics`.
    public var exposition: (@Sendable () -> [UInt8])?

    /// Creates settings.
    public init(host: String = Setting.opsHost.defaultText, port: Int = Setting.opsPort.defaultInt, exposition: (@Sendable () -> [UInt8])? = nil) {
        self.host = host
        self.port = port
        self.exposition = exposition
    }
}

/// The process's readiness: every dependency it has, checked now.
struct Readiness: Sendable {
    let store: OrderStore?
    let connections: [AMQPConnection]

    /// `ready` when the store takes writes and every broker connection is up (which
    /// includes its topology: a connection counts as up only once that is declared).
    func check() async -> (ready: Bool, checks: [String: String]) {
        var checks: [String: String] = [:]
        if let store {
            checks["store"] = await store.isWritable() ? "ok" : "not writable"
        }
        if !connections.isEmpty {
            checks["broker"] = connections.allSatisfy(\.isConnected) ? "ok" : "not connected"
        }
        return (checks.values.allSatisfy { $0 == "ok" }, checks)
    }
}

/// `/healthz` (the process serves), `/readyz` (it can do its work) and `/metrics`.
func makeOpsRouter(readiness: Readiness, exposition: (@Sendable () -> [UInt8])?) -> Router<BasicRequestContext> {
    let router = Router()
    router.get("/healthz") { _, _ in
        Response(
            status: .ok, headers: [.contentType: "application/json"],
            body: .init(byteBuffer: ByteBuffer(string: #"{"status":"ok"}"#)))
    }
    router.get("/readyz") { _, _ in
        let (ready, checks) = await readiness.check()
        let body = try JSONSerialization.data(
            withJSONObject: ["ready": ready, "checks": checks] as [String: Any], options: [.sortedKeys])
        return Response(
            status: ready ? .ok : .serviceUnavailable, headers: [.contentType: "application/json"],
            body: .init(byteBuffer: ByteBuffer(bytes: body)))
    }
    if let exposition {
        router.get("/metrics") { _, _ in
            Response(
                status: .ok, headers: [.contentType: "text/plain; version=0.0.4; charset=utf-8"],
                body: .init(byteBuffer: ByteBuffer(bytes: exposition())))
        }
    }
    return router
}
