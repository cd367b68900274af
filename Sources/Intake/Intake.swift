public import Hummingbird
import HummingbirdCore
public import AppStore
public import IAPCore
public import Logging
import NIOCore
public import OrderStore
public import ServiceLifecycle

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
    /// How app users authenticate.
    public var authentication: UserAuthentication
    /// Rate limits, bounded in-flight work and body timeouts.
    public var limits: IntakeLimits
    /// The tokens of customer service's admin routes (several while one is rotated out);
    /// none disables them.
    public var adminTokens: [String]
    /// Where the admin routes listen when not beside the app's routes; nil serves them on
    /// the intake's own port.
    public var adminListener: (host: String, port: Int)?
    /// Benchmarks only: verify with Apple inside the HTTP request and answer with the final
    /// state, as a first synchronous design would (no queue, no retries).
    public var inlineVerifier: (any ReceiptVerifying)?
    /// Who finishes a settled transaction at Apple: with `server` the answers never tell the
    /// app to finish; with `server` or `both` what customer service settles is queued to be
    /// finished at Apple as the finisher's credits are.
    public var finishTransactions: FinishMode = .app
    /// The App Store Server API, for the admin routes that ask Apple (binding a purchase); nil
    /// answers them `apple_unavailable`.
    public var appStore: AppStoreServerAPIClient?
    /// Checks each App Store notification's signature, chain, bundle id, environment and app
    /// id before anything is stored; nil answers every notification 503 (Apple retries).
    public var notificationVerifier: SignedDataVerifier?
    /// Largest App Store notification body accepted, in bytes (Apple's are a few KB).
    public var maxNotificationBytes: Int
    /// The app's bundle ids (`IAP_BUNDLE_IDS`): an uploaded receipt that names another app is
    /// refused before it is stored (400 `receipt_other_app`); empty checks nothing.
    public var bundleIds: Set<String> = []
    /// The roots an uploaded receipt's certificates must be able to lead to (the verifiers'
    /// own): a receipt whose certificates lead to none of them at any time is refused before it
    /// is stored (400 `receipt_untrusted`); receipts of Xcode's StoreKit testing are left to the
    /// verifier. Nil checks nothing (set by the pipeline unless Apple's roots are the default
    /// and `verifyReceipt` points at a stand-in for Apple).
    public var receiptRoots: ReceiptSignature?
    /// More routes served where the admin routes are (beside the app's routes, or on the
    /// admin listener): customer service's console pages, added by the process that runs it.
    public var adminPages: (@Sendable (Router<IntakeContext>) -> Void)?

    /// Creates settings.
    public init(
        host: String = Setting.httpHost.defaultText, port: Int = Setting.httpPort.defaultInt,
        maxBodyBytes: Int = Setting.maxBodyBytes.defaultInt, names: PipelineNames = .init(),
        sweeper: SweeperSettings = .init(), catalog: Catalog? = nil, authentication: UserAuthentication = .off,
        limits: IntakeLimits = .init(), adminTokens: [String] = [], adminListener: (host: String, port: Int)? = nil,
        notificationVerifier: SignedDataVerifier? = nil, maxNotificationBytes: Int = Setting.notificationMaxBytes.defaultInt
    ) {
        self.notificationVerifier = notificationVerifier
        self.maxNotificationBytes = maxNotificationBytes
        self.catalog = catalog
        self.authentication = authentication
        self.limits = limits
        self.adminTokens = adminTokens
        self.adminListener = adminListener
        self.host = host
        self.port = port
        self.maxBodyBytes = maxBodyBytes
        self.names = names
        self.sweeper = sweeper
    }
}

/// Builds the intake's router: uploads, status, orders, health, and the admin routes unless
/// they have a listener of their own.
public func makeIntakeRouter(settings: IntakeSettings, store: OrderStore) -> Router<IntakeContext> {
    let router = Router(context: IntakeContext.self)
    let routes = RouteTable()
    router.add(middleware: RefusalCostMiddleware(limits: settings.limits, store: store))
    router.add(middleware: APIErrorMiddleware(routes: routes))
    let addressLimit = settings.limits.perAddress.map { RateLimiter($0, scope: "address", store: store) }
    let usersChargedToThemselves: Bool
    if case .jwt = settings.authentication { usersChargedToThemselves = true } else { usersChargedToThemselves = false }
    router.add(
        middleware: AdmissionMiddleware(
            limits: settings.limits, addressLimit: addressLimit, usersChargedToThemselves: usersChargedToThemselves))
    router.get("/healthz") { _, _ in
        try JSONResponse.make(["status": "ok"])
    }
    let orders = OrdersController(store: store, settings: settings)
    orders.addPublicRoutes(to: router)
    let users = router.group().add(
        middleware: UserAuthMiddleware(
            authentication: settings.authentication, limit: settings.limits.perUser, addressLimit: addressLimit,
            limits: settings.limits, store: store))
    let receipts = ReceiptsController(store: store, settings: settings)
    receipts.addRoutes(to: users)
    receipts.addNotificationRoute(to: router)
    orders.addRoutes(to: users)
    if settings.adminListener == nil {
        AdminController(store: store, settings: settings).addRoutes(to: router)
        settings.adminPages?(router)
    }
    routes.record(router)
    return router
}

/// The admin routes alone, for their own listener.
public func makeAdminRouter(settings: IntakeSettings, store: OrderStore) -> Router<IntakeContext> {
    let router = Router(context: IntakeContext.self)
    let routes = RouteTable()
    router.add(middleware: RefusalCostMiddleware(limits: settings.limits, store: store))
    router.add(middleware: APIErrorMiddleware(routes: routes))
    router.get("/healthz") { _, _ in
        try JSONResponse.make(["status": "ok"])
    }
    AdminController(store: store, settings: settings).addRoutes(to: router)
    settings.adminPages?(router)
    routes.record(router)
    return router
}

/// The intake's services: the sweeper and the HTTP servers (the app's last). What the intake
/// writes to the outbox reaches the broker through the process's relay.
///
/// `onServerRunning` and `onAdminServerRunning` report the bound ports (useful with port 0).
public func makeIntakeServices(
    settings: IntakeSettings, store: OrderStore, logger: Logger,
    onServerRunning: @escaping @Sendable (Int) async -> Void = { _ in },
    onAdminServerRunning: @escaping @Sendable (Int) async -> Void = { _ in }
) -> [any Service] {
    if case .off = settings.authentication {
        logger.warning(
            "USER AUTHENTICATION IS OFF: anyone can upload and read as any user. \(Setting.auth.variable)=off is for local development only.")
    }
    let sweeper = SubmissionSweeper(settings: settings.sweeper, names: settings.names, store: store, logger: logger)
    // Idle connections are closed; a body that trickles in is cut off by the body timeout.
    let server = HTTPServerBuilder.http1(configuration: .init(idleTimeout: .seconds(75)))
    var services: [any Service] = [sweeper]
    if let admin = settings.adminListener {
        services.append(
            Application(
                router: makeAdminRouter(settings: settings, store: store), server: server,
                configuration: .init(address: .hostname(admin.host, port: admin.port), serverName: "iap-admin"),
                onServerRunning: { channel in await onAdminServerRunning(channel.localAddress?.port ?? admin.port) },
                logger: logger))
    }
    let router = makeIntakeRouter(settings: settings, store: store)
    services.append(
        Application(
            router: router, server: server,
            configuration: .init(address: .hostname(settings.host, port: settings.port), serverName: "iap-intake"),
            onServerRunning: { channel in await onServerRunning(channel.localAddress?.port ?? settings.port) },
            logger: logger))
    return services
}
