import Hummingbird
import IAPCore
import Logging
import NIOCore
import OrderStore
import ServiceLifecycle

/// How the intake runs.
public struct IntakeSettings: Sendable {
    /// Address to listen on.
    public var host: String
    /// Port to listen on (0 picks a free one).
    public var port: Int
    /// Largest request body accepted, in bytes.
    public var maxBodyBytes: Int
    /// Queue names.
    public var names: PipelineNames
    /// Lost-message recovery.
    public var sweeper: SweeperSettings
    /// What the app sells (`GET /v1/products`, order and manual-grant checks).
    public var catalog: Catalog?
    /// The token of customer service's admin routes; nil disables them.
    public var adminToken: String?

    /// Creates settings.
    public init(
        host: String = "0.0.0.0", port: Int = 8080, maxBodyBytes: Int = 1_048_576, names: PipelineNames = .init(),
        sweeper: SweeperSettings = .init(), catalog: Catalog? = nil, adminToken: String? = nil
    ) {
        self.catalog = catalog
        self.adminToken = adminToken
        self.host = host
        self.port = port
        self.maxBodyBytes = maxBodyBytes
        self.names = names
        self.sweeper = sweeper
    }
}

/// Builds the intake's router: uploads, status and health.
public func makeIntakeRouter(
    settings: IntakeSettings, store: OrderStore, acceptedUpload: @escaping @Sendable () -> Void
) -> Router<BasicRequestContext> {
    let router = Router()
    router.add(middleware: APIErrorMiddleware())
    router.get("/healthz") { _, _ in
        try JSONResponse.make(["status": "ok"])
    }
    ReceiptsController(store: store, settings: settings, acceptedUpload: acceptedUpload).addRoutes(to: router)
    OrdersController(store: store, settings: settings).addRoutes(to: router)
    AdminController(store: store, settings: settings).addRoutes(to: router, changed: acceptedUpload)
    return router
}

/// The intake's services: the sweeper and the HTTP server (last). `relay` publishes what the
/// intake writes to the outbox.
///
/// `onServerRunning` reports the bound port (useful with port 0).
public func makeIntakeServices(
    settings: IntakeSettings, store: OrderStore, relay: OutboxRelay, logger: Logger,
    onServerRunning: @escaping @Sendable (Int) async -> Void = { _ in }
) -> [any Service] {
    let sweeper = SubmissionSweeper(
        settings: settings.sweeper, names: settings.names, store: store, logger: logger, requeued: { relay.notify() })
    let router = makeIntakeRouter(settings: settings, store: store, acceptedUpload: { relay.notify() })
    let application = Application(
        router: router,
        configuration: .init(address: .hostname(settings.host, port: settings.port), serverName: "iap-intake"),
        onServerRunning: { channel in await onServerRunning(channel.localAddress?.port ?? settings.port) },
        logger: logger)
    return [sweeper, application]
}
