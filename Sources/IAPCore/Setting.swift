/// A setting of `iap`, declared once: its environment variable, its default and its help.
/// The command line's `--help` and the reader both derive from it, and every message that names
/// a setting names it through its declaration, so no name or default is written twice.
public struct Setting: Sendable, Hashable {
    /// The environment variable; a flag of the same name (`--http-host`) overrides it.
    public let variable: String
    /// What the reader uses when neither flag nor variable is set; nil: nothing.
    public let fallback: String?
    /// `iap dev`'s default, where it differs (a laptop's loopback, authentication off).
    public let devFallback: String?
    /// What `--help` adds about the default: the whole of it when there is no `fallback` (a
    /// default that follows other settings), else a remark after it.
    public let defaultNote: String?
    /// Read from `variable` or from the file `fileVariable` names; never from a flag.
    public let isSecret: Bool
    public let summary: String

    public init(
        _ variable: String, fallback: String? = nil, devFallback: String? = nil, defaultNote: String? = nil,
        secret: Bool = false, _ summary: String
    ) {
        self.variable = variable
        self.fallback = fallback
        self.devFallback = devFallback
        self.defaultNote = defaultNote
        self.isSecret = secret
        self.summary = summary
    }

    /// The default as messages quote it.
    public var defaultText: String { fallback ?? "none" }

    /// A whole-number default, for the libraries' own defaults.
    public var defaultInt: Int {
        guard let value = fallback.flatMap({ Int($0) }) else { preconditionFailure("\(variable) has no whole-number default") }
        return value
    }

    /// A default in seconds as a duration.
    public var defaultSeconds: Duration { .seconds(defaultInt) }

    /// A default written as a duration (`24h`, `30m`, `90s`, `7d`, or whole seconds).
    public var defaultDuration: Duration {
        let units: [Character: Int64] = ["s": 1, "m": 60, "h": 3600, "d": 86_400]
        let text = defaultText
        let unit = text.last.flatMap { units[$0] }
        guard let count = Int64(unit == nil ? text : String(text.dropLast())) else {
            preconditionFailure("\(variable) has no duration default")
        }
        return .seconds(count * (unit ?? 1))
    }

    /// A fractional default.
    public var defaultDouble: Double {
        guard let value = fallback.flatMap({ Double($0) }) else { preconditionFailure("\(variable) has no numeric default") }
        return value
    }

    /// A default in bytes as messages quote it: `1 MiB`, `64 KiB`.
    public var defaultBytes: String {
        guard let bytes = fallback.flatMap({ Int($0) }) else { return defaultText }
        if bytes % (1 << 20) == 0 { return "\(bytes >> 20) MiB" }
        if bytes % (1 << 10) == 0 { return "\(bytes >> 10) KiB" }
        return "\(bytes) bytes"
    }

    /// The variable naming a file that holds a secret's value.
    public var fileVariable: String { variable + "_FILE" }

    /// The default for `iap dev` (`dev`) or for every other role.
    public func fallback(dev: Bool) -> String? { dev ? devFallback ?? fallback : fallback }

    /// `<summary> (env VARIABLE; default …)`: the text of the option's `--help`.
    public var help: String {
        var text = [fallback, devFallback.map { "\($0) for dev" }].compactMap { $0 }.joined(separator: ", ")
        if let defaultNote { text = text.isEmpty ? defaultNote : text + "; " + defaultNote }
        return "\(summary) (env \(variable)\(text.isEmpty ? "" : "; default \(text)"))"
    }
}

extension Setting {
    public static let adminFailedAttempts = Setting(
        "IAP_ADMIN_FAILED_ATTEMPTS", fallback: "5",
        "Failed admin authorizations (admin bearer tokens, console sign-ins) one client address may make in five minutes before it is locked to one try every two seconds; 0 is unlimited (API conformance checks only).")
    public static let adminHost = Setting(
        "IAP_ADMIN_HOST", fallback: "127.0.0.1",
        "Address of the admin routes' own listener, used with --admin-port.")
    public static let adminPort = Setting(
        "IAP_ADMIN_PORT", fallback: nil, defaultNote: "the intake's port",
        "Serve the admin routes on this port only, not beside the app's routes.")
    public static let amqpHeartbeatSeconds = Setting(
        "IAP_AMQP_HEARTBEAT_SECONDS", fallback: "10",
        "AMQP heartbeat in seconds, 1 to 600; a silent broker is dropped after two.")
    public static let appStoreAPIRateShare = Setting(
        "IAP_APPSTORE_API_RATE_SHARE", fallback: "1",
        "Share of Apple's per-app Server API rate limits this process may use: 1 for one verifier, 1/N for N.")
    public static let appStoreAPIURL = Setting(
        "IAP_APPSTORE_API_URL", fallback: "https://api.storekit.apple.com",
        "App Store Server API base URL.")
    public static let appStoreIssuerId = Setting(
        "IAP_APPSTORE_ISSUER_ID",
        "The issuer id of the key (App Store Connect, Keys).")
    public static let appStoreKeyId = Setting(
        "IAP_APPSTORE_KEY_ID",
        "The key's id in App Store Connect.")
    public static let appStoreKeyPath = Setting(
        "IAP_APPSTORE_KEY_PATH",
        "The App Store Server API key (.p8, PEM) from App Store Connect; enables transaction-id uploads and the Server API route for receipts.")
    public static let appStoreSandboxAPIURL = Setting(
        "IAP_APPSTORE_SANDBOX_API_URL", fallback: "https://api.storekit-sandbox.apple.com",
        "Sandbox App Store Server API base URL.")
    public static let appStoreSandboxVerifyURL = Setting(
        "IAP_APPSTORE_SANDBOX_VERIFY_URL", fallback: "https://sandbox.itunes.apple.com/verifyReceipt",
        "Sandbox verifyReceipt URL.")
    public static let appStoreTimeoutSeconds = Setting(
        "IAP_APPSTORE_TIMEOUT_SECONDS", fallback: "15",
        "Seconds allowed for one call to Apple.")
    public static let appStoreVerifyURL = Setting(
        "IAP_APPSTORE_VERIFY_URL", fallback: "https://buy.itunes.apple.com/verifyReceipt",
        "Production verifyReceipt URL.")
    public static let appAppleId = Setting(
        "IAP_APP_APPLE_ID",
        "The app's App Store id; production notifications must name it.")
    public static let auth = Setting(
        "IAP_AUTH", fallback: "jwt", devFallback: "off",
        "User authentication: jwt, or off (local development only: the body names the user; refused unless \(Setting.httpHost.variable) is loopback).")
    public static let authAudience = Setting(
        "IAP_AUTH_AUDIENCE",
        "Audience user tokens must name in aud; unset skips the check.")
    public static let authIssuer = Setting(
        "IAP_AUTH_ISSUER",
        "Issuer user tokens must name in iss; unset skips the check.")
    public static let authMaxLifetime = Setting(
        "IAP_AUTH_MAX_LIFETIME", fallback: "24h",
        "Longest a user token may live, exp - iat (exp - now without iat): seconds, or with s, m, h or d; longer ones get 401 token_malformed.")
    public static let authPublicKeyPath = Setting(
        "IAP_AUTH_PUBLIC_KEY_PATH",
        "PEM public key (P-256 for ES256, RSA for RS256) or JWKS file that verifies user tokens.")
    public static let bodyTimeoutSeconds = Setting(
        "IAP_BODY_TIMEOUT_SECONDS", fallback: "30",
        "Seconds allowed to receive a request body; slower ones get 408.")
    public static let breakerFailures = Setting(
        "IAP_BREAKER_FAILURES", fallback: "20",
        "Transient Apple failures in a row that pause verification.")
    public static let breakerOpenSeconds = Setting(
        "IAP_BREAKER_OPEN_SECONDS", fallback: "30",
        "Seconds verification stays paused before a probe.")
    public static let bundleIds = Setting(
        "IAP_BUNDLE_IDS", devFallback: "com.example.demo",
        "Comma-separated bundle ids this deployment serves; receipts and notifications of other apps are refused. Required.")
    public static let catalog = Setting(
        "IAP_CATALOG",
        "JSON file of the products sold and what each grants; required (iap dev uses a demo catalog).")
    public static let clientIPHeader = Setting(
        "IAP_CLIENT_IP_HEADER",
        "Header a trusted reverse proxy sets to the client's address, e.g. X-Real-IP, believed only from the peers IAP_TRUSTED_PROXIES names (required with it); unset uses the TCP peer.")
    public static let trustedProxies = Setting(
        "IAP_TRUSTED_PROXIES",
        "Comma-separated addresses or CIDR blocks (10.0.0.5, 172.30.0.0/24, fd00::/8) of the reverse proxies whose IAP_CLIENT_IP_HEADER is believed; a request from any other peer is counted under its own address.")
    public static let confirmWithAPI = Setting(
        "IAP_CONFIRM_WITH_API", fallback: "false",
        "Confirm locally verified signed transactions with Get Transaction Info: true or false.")
    public static let databasePasswordFile = Setting(
        "IAP_DATABASE_PASSWORD_FILE",
        "File whose first line is the PostgreSQL password, when the URL leaves it out.")
    public static let databasePath = Setting(
        "IAP_DATABASE_PATH", fallback: "iap-orders.sqlite", devFallback: "iap-dev.sqlite",
        "SQLite file of the order store; created with mode 0600.")
    public static let consumptionConsent = Setting(
        "IAP_CONSUMPTION_CONSENT", fallback: "none",
        "Whose consent lets the order service answer Apple's refund requests (CONSUMPTION_REQUEST) with Send Consumption Information: none (no answer is sent), all (the app's terms obtained every customer's) or per-user (the users the app recorded consent for with POST /v1/users/{userId}/consumption).")
    public static let databaseURL = Setting(
        "IAP_DATABASE_URL",
        "PostgreSQL order store instead of the SQLite file: postgres://USER:PASSWORD@HOST:PORT/DB; several order services may share it.")
    public static let fakeAPIKeyId = Setting(
        "IAP_FAKE_API_KEY_ID",
        "Key id the fake expects in bearer tokens.")
    public static let fakeAPIKeyPath = Setting(
        "IAP_FAKE_API_KEY_PATH",
        "PEM private key whose public half checks Server API bearer tokens; unset, the fake's Server API refuses every call.")
    public static let fakeAppStoreHost = Setting(
        "IAP_FAKE_APPSTORE_HOST", fallback: "127.0.0.1",
        "Address the fake App Store listens on.")
    public static let fakeAppStorePort = Setting(
        "IAP_FAKE_APPSTORE_PORT", fallback: "8090",
        "Port the fake App Store listens on.")
    public static let fakeDatabasePath = Setting(
        "IAP_FAKE_DATABASE_PATH", fallback: "fake-appstore.sqlite", defaultNote: "for dev beside the order store",
        "SQLite file where the fake App Store keeps what it minted.")
    public static let fakeIssuerId = Setting(
        "IAP_FAKE_ISSUER_ID",
        "Issuer id the fake expects in bearer tokens.")
    public static let fakeNotificationURL = Setting(
        "IAP_FAKE_NOTIFICATION_URL",
        "Where the fake sends App Store Server Notifications.")
    public static let environment = Setting(
        "IAP_ENVIRONMENT", fallback: "production",
        "production, or xcode for local development with StoreKit testing in Xcode: receipts Xcode issued are then credited as sandbox purchases when signed by the certificate in \(Setting.xcodeCertificate.variable). Xcode's receipts are refused in production.")
    public static let finishTransactions = Setting(
        "IAP_FINISH_TRANSACTIONS", fallback: nil, defaultNote: "both with the App Store Server API key, else app",
        "Who finishes a credited transaction at Apple: server (the order service calls Finish Transaction after the commit that settled it; answers never tell the app to finish), app (the app, on the status answer's advice) or both.")
    public static let finisherPrefetch = Setting(
        "IAP_FINISHER_PREFETCH", fallback: "64",
        "Results fetched and applied at once (they share group commits).")
    public static let httpHost = Setting(
        "IAP_HTTP_HOST", fallback: "0.0.0.0", devFallback: "127.0.0.1",
        "Address the intake listens on.")
    public static let httpPort = Setting(
        "IAP_HTTP_PORT", fallback: "8080",
        "Port the intake listens on.")
    public static let logFormat = Setting(
        "IAP_LOG_FORMAT", fallback: "text",
        "Log format: text, or json (one object per line).")
    public static let logLevel = Setting(
        "IAP_LOG_LEVEL", fallback: "info",
        "Log level: trace, debug, info, notice, warning, error, critical.")
    public static let maxBodyBytes = Setting(
        "IAP_MAX_BODY_BYTES", fallback: "1048576",
        "Largest upload body in bytes; larger ones get 413.")
    public static let maxInFlightRequests = Setting(
        "IAP_MAX_IN_FLIGHT_REQUESTS", fallback: "1024",
        "Requests handled at once; more get 503 overloaded.")
    public static let maxRetryAgeHours = Setting(
        "IAP_MAX_RETRY_AGE_HOURS", fallback: "72",
        "Hours after which an upload that keeps failing transiently needs review.")
    public static let messageEncoding = Setting(
        "IAP_MESSAGE_ENCODING", fallback: "deflate",
        "How the services encode the messages that carry a receipt or its verification on the broker (verify requests, their retries, results): deflate (about half the bytes in the broker's store and on the wire) or identity. Every consumer reads both; identity is for while consumers of a release that does not read deflate still run.")
    public static let notificationMaxBytes = Setting(
        "IAP_NOTIFICATION_MAX_BYTES", fallback: "65536",
        "Largest App Store notification body in bytes; larger ones get 413.")
    public static let notificationRate = Setting(
        "IAP_NOTIFICATION_RATE", fallback: "50",
        "App Store notifications per second for the whole deployment, any sender (bursts of twice that); more get 429; 0 is unlimited.")
    public static let opsHost = Setting(
        "IAP_OPS_HOST", fallback: "0.0.0.0", devFallback: "127.0.0.1",
        "Address of the operators' endpoint (/metrics, /healthz, /readyz).")
    public static let opsPort = Setting(
        "IAP_OPS_PORT", fallback: "9100",
        "Port of the operators' endpoint; 'off' serves none.")
    public static let queueDeliveryLimit = Setting(
        "IAP_QUEUE_DELIVERY_LIMIT", fallback: "5",
        "Quorum queues: deliveries of one message before it is dead-lettered with reason delivery_limit, 1 to 1000.")
    public static let queuePrefix = Setting(
        "IAP_QUEUE_PREFIX", fallback: "iap",
        "Prefix of every queue name.")
    public static let queueType = Setting(
        "IAP_QUEUE_TYPE", fallback: nil, defaultNote: "quorum when \(Setting.amqpURL.variable) names several nodes, else classic",
        "classic or quorum queues; quorum needs a RabbitMQ cluster (3.10+) and fresh queues, as a queue's type is fixed when it is declared.")
    public static let rateLimitPerIP = Setting(
        "IAP_RATE_LIMIT_PER_IP", fallback: "300",
        "Requests per second one client address may send, counted across the order services sharing a PostgreSQL store (bursts of twice that); 0 is unlimited.")
    public static let rateLimitPerUser = Setting(
        "IAP_RATE_LIMIT_PER_USER", fallback: "10",
        "Requests per second one user may send, counted across the order services sharing a PostgreSQL store (bursts of twice that); 0 is unlimited.")
    public static let receiptsVia = Setting(
        "IAP_RECEIPTS_VIA", fallback: "verify-receipt",
        defaultNote: "server-api holds receipt purchases without an appAccountToken as owner_unknown",
        "How app receipts are proven (every route checks the receipt's PKCS#7 signature first): local (the signature alone, offline, with no call to Apple), server-api (transaction ids read locally, then looked up) or verify-receipt.")
    public static let reconcileInterval = Setting(
        "IAP_RECONCILE_INTERVAL", fallback: "24h",
        "How often the order service asks Apple about subscriptions due to renew, in billing retry or in a grace period, and re-delivers the notifications Apple could not send (needs \(Setting.appStoreKeyPath.variable)): e.g. 24h, 30m, 90s; 0 turns it off.")
    public static let refundPreference = Setting(
        "IAP_REFUND_PREFERENCE", fallback: "none",
        "The refund outcome the consumption answers ask Apple for: DECLINE, GRANT_FULL, GRANT_PRORATED, or none (no preference).")
    public static let refusalsPerIP = Setting(
        "IAP_REFUSALS_PER_IP", fallback: "10",
        "Requests per second one client address may have refused for what they carried (400, 408, 413; bursts of twice that); past it they are answered 429; good requests are never refused for it; 0 is unlimited.")
    public static let retentionDays = Setting(
        "IAP_RETENTION_DAYS", fallback: "30",
        "Days after which rejected submissions and their receipts or signed payloads are deleted (the audit log stays); 0 keeps them.")
    public static let retryDelays = Setting(
        "IAP_RETRY_DELAYS", fallback: "5,30,120,600,1800",
        "Comma-separated delays in seconds between attempts; the last repeats.")
    public static let sampleContentProvided = Setting(
        "IAP_SAMPLE_CONTENT_PROVIDED", fallback: "false",
        "Whether the app offers a free sample, trial or description of its content before purchase, as the consumption answers tell Apple: true or false.")
    public static let sandbox = Setting(
        "IAP_SANDBOX", fallback: "accept",
        "Sandbox purchases: accept, reject, or allowlist (users in \(Setting.sandboxAllowlist.variable) only).")
    public static let sandboxAllowlist = Setting(
        "IAP_SANDBOX_ALLOWLIST",
        "Comma-separated user ids whose sandbox purchases are credited under 'allowlist'.")
    public static let sweepIntervalSeconds = Setting(
        "IAP_SWEEP_INTERVAL_SECONDS", fallback: "60",
        "Seconds between sweeps for stuck submissions.")
    public static let sweepPendingAfterSeconds = Setting(
        "IAP_SWEEP_PENDING_AFTER_SECONDS", fallback: "600",
        "A pending submission untouched this many seconds is queued again.")
    public static let sweepRetryGraceSeconds = Setting(
        "IAP_SWEEP_RETRY_GRACE_SECONDS", fallback: "600",
        "A retry this many seconds overdue is queued again.")
    public static let trustedRoots = Setting(
        "IAP_TRUSTED_ROOTS", fallback: nil, defaultNote: "Apple Root CA - G3, shipped",
        "Comma-separated root certificate files (DER or PEM) that signed data and notifications must chain to; for tests only.")
    public static let xcodeCertificate = Setting(
        "IAP_XCODE_CERTIFICATE", fallback: nil,
        "The certificate Xcode signs its StoreKit testing receipts with (DER or PEM; Xcode: Editor > Save Public Certificate, with the StoreKit configuration file open); needed by IAP_ENVIRONMENT=xcode.")
    public static let verifierConcurrency = Setting(
        "IAP_VERIFIER_CONCURRENCY", fallback: "64",
        "Verifications in flight per process.")

    // Read from the environment only: secrets (from VARIABLE or the file VARIABLE_FILE names,
    // never a flag, which `ps` shows) and what the roles' long help explains.
    public static let amqpURL = Setting(
        "IAP_AMQP_URL", fallback: "amqp://guest:guest@127.0.0.1:5672/", secret: true,
        "The broker: amqp://user:password@host:port/vhost, or the comma-separated URLs of a cluster's nodes.")
    public static let adminToken = Setting(
        "IAP_ADMIN_TOKEN", secret: true,
        "Customer service's bearer tokens for the admin routes and the console, comma-separated, each at least 32 characters.")
    public static let viewerToken = Setting(
        "IAP_VIEWER_TOKEN", secret: true,
        "Read-only support's tokens for the console, in the same form as the admin tokens.")
    public static let authHS256Secret = Setting(
        "IAP_AUTH_HS256_SECRET", secret: true,
        "The HS256 secret that verifies user tokens, at least 32 bytes.")
    public static let appStoreSharedSecret = Setting(
        "IAP_APPSTORE_SHARED_SECRET", secret: true,
        "The app's shared secret for verifyReceipt (auto-renewable subscriptions).")
    public static let restore = Setting(
        "IAP_RESTORE", fallback: "keep",
        "What a restore uploaded by another user than the owner does: keep (the entitlement stays with its owner) or transfer.")
    public static let adminInsecureCookies = Setting(
        "IAP_ADMIN_INSECURE_COOKIES", fallback: "0", devFallback: "1",
        "1: console session cookies without Secure, for plain HTTP on loopback.")
    public static let adminPublic = Setting(
        "IAP_ADMIN_PUBLIC", fallback: "0", defaultNote: "1 for iap dev on loopback",
        "1: serve the admin routes and the console on the intake's port.")
    public static let alertAfterAttempts = Setting(
        "IAP_ALERT_AFTER_ATTEMPTS", fallback: "10",
        "Failed attempts after which a submission alerts, once.")
    public static let alertWebhook = Setting(
        "IAP_ALERT_WEBHOOK",
        "An http(s) URL that receives each alert as a JSON POST.")
    public static let inlineVerification = Setting(
        "IAP_INLINE_VERIFICATION", fallback: "false",
        "true: the intake verifies inside the HTTP request (the synchronous baseline), for benchmarks.")
}
