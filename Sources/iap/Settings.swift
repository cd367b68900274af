import AppStore
import ArgumentParser
import Finisher
import FakeAppStore
import Foundation
import IAPCore
import Intake
import JWTKit
import Logging
import Messaging
import OrderStore
import Metrics
import Prometheus
import Pipeline
import SwiftASN1
import Verifier
import X509

/// Reads a setting: the flag if given, else the environment variable, else the default.
/// Only this executable reads the environment.
struct SettingReader {
    let environment = ProcessInfo.processInfo.environment

    func string(_ flag: String?, _ variable: String, default fallback: String) -> String {
        if let flag { return flag }
        if let value = environment[variable], !value.isEmpty { return value }
        return fallback
    }

    func optionalString(_ flag: String?, _ variable: String) -> String? {
        if let flag { return flag }
        if let value = environment[variable], !value.isEmpty { return value }
        return nil
    }

    func int(_ flag: Int?, _ variable: String, default fallback: Int, in range: ClosedRange<Int>) throws -> Int {
        let value: Int
        if let flag {
            value = flag
        } else if let raw = environment[variable], !raw.isEmpty {
            guard let parsed = Int(raw) else {
                throw ValidationError("\(variable) must be a whole number, got '\(raw)'")
            }
            value = parsed
        } else {
            value = fallback
        }
        guard range.contains(value) else {
            throw ValidationError("\(variable) must be between \(range.lowerBound) and \(range.upperBound), got \(value)")
        }
        return value
    }

    /// A secret from `VARIABLE` or from the file named by `VARIABLE_FILE`; never from a flag,
    /// which `ps` would show.
    func secret(_ variable: String) throws -> String? {
        if let path = environment[variable + "_FILE"], !path.isEmpty {
            do {
                return try String(contentsOfFile: path, encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)
            } catch {
                throw ValidationError("\(variable)_FILE: cannot read \(path): \(error.localizedDescription)")
            }
        }
        if let value = environment[variable], !value.isEmpty { return value }
        return nil
    }
}

struct LogOptions: ParsableArguments {
    @Option(name: .long, help: "Log level: trace, debug, info, notice, warning, error, critical. (env IAP_LOG_LEVEL; default info)")
    var logLevel: String?

    @Option(name: .long, help: "Log format: text, or json (one object per line). (env IAP_LOG_FORMAT; default text)")
    var logFormat: String?

    func makeLogger(label: String) throws -> Logger {
        let reader = SettingReader()
        let raw = reader.string(logLevel, "IAP_LOG_LEVEL", default: "info")
        guard let level = Logger.Level(rawValue: raw) else {
            throw ValidationError("IAP_LOG_LEVEL must be one of trace, debug, info, notice, warning, error, critical; got '\(raw)'")
        }
        let format = reader.string(logFormat, "IAP_LOG_FORMAT", default: "text")
        guard format == "text" || format == "json" else {
            throw ValidationError("IAP_LOG_FORMAT must be text or json; got '\(format)'")
        }
        LoggingSystem.bootstrap { label in
            if format == "json" {
                return JSONLogHandler(label: label, logLevel: level)
            }
            return TextLogHandler(label: label, logLevel: level)
        }
        var logger = Logger(label: label)
        logger.logLevel = level
        return logger
    }
}

struct BrokerOptions: ParsableArguments {
    @Option(name: .long, help: "Prefix of every queue name. (env IAP_QUEUE_PREFIX; default iap)")
    var queuePrefix: String?

    @Option(name: .long, help: "AMQP heartbeat in seconds, 1 to 600; a silent broker is dropped after two. (env IAP_AMQP_HEARTBEAT_SECONDS; default 10)")
    var amqpHeartbeatSeconds: Int?

    @Option(name: .long, help: "classic or quorum queues; quorum needs a RabbitMQ cluster (3.10+) and fresh queues, as a queue's type is fixed when it is declared. (env IAP_QUEUE_TYPE; default quorum when IAP_AMQP_URL names several nodes, else classic)")
    var queueType: String?

    @Option(name: .long, help: "Quorum queues: deliveries of one message before it is dead-lettered with reason delivery_limit, 1 to 1000. (env IAP_QUEUE_DELIVERY_LIMIT; default 5)")
    var queueDeliveryLimit: Int?

    /// IAP_AMQP_URL: one URL, or the comma-separated URLs of a cluster's nodes.
    /// It carries the broker password: from the environment or a file only, never a flag.
    private func url() throws -> String {
        try SettingReader().secret("IAP_AMQP_URL") ?? "amqp://guest:guest@127.0.0.1:5672/"
    }

    func configuration() throws -> AMQPConfiguration {
        let reader = SettingReader()
        let url = try url()
        let heartbeat = try reader.int(amqpHeartbeatSeconds, "IAP_AMQP_HEARTBEAT_SECONDS", default: 10, in: 1...600)
        do {
            return try AMQPConfiguration(url: url, heartbeatSeconds: heartbeat)
        } catch {
            throw ValidationError("IAP_AMQP_URL: \(error.message)")
        }
    }

    func names() throws -> PipelineNames {
        let prefix = SettingReader().string(queuePrefix, "IAP_QUEUE_PREFIX", default: "iap")
        guard !prefix.isEmpty, prefix.allSatisfy({ $0.isLetter || $0.isNumber || "-_.".contains($0) }) else {
            throw ValidationError("IAP_QUEUE_PREFIX may hold letters, digits, '-', '_' and '.' only; got '\(prefix)'")
        }
        return PipelineNames(prefix: prefix, queueType: try queueKind())
    }

    /// IAP_QUEUE_TYPE and IAP_QUEUE_DELIVERY_LIMIT; the default follows the number of nodes.
    private func queueKind() throws -> QueueType {
        let reader = SettingReader()
        let nodes = (try? configuration().nodes.count) ?? 1
        let kind = reader.string(queueType, "IAP_QUEUE_TYPE", default: nodes > 1 ? "quorum" : "classic")
        let limit = try reader.int(
            queueDeliveryLimit, "IAP_QUEUE_DELIVERY_LIMIT", default: QueueType.defaultDeliveryLimit, in: 1...1000)
        switch kind {
        case "classic": return .classic
        case "quorum": return .quorum(deliveryLimit: limit)
        default: throw ValidationError("IAP_QUEUE_TYPE must be classic or quorum; got '\(kind)'")
        }
    }
}

struct OpsOptions: ParsableArguments {
    @Option(name: .long, help: "Address of the operators' endpoint (/metrics, /healthz, /readyz). (env IAP_OPS_HOST; default 0.0.0.0, 127.0.0.1 for dev)")
    var opsHost: String?

    @Option(name: .long, help: "Port of the operators' endpoint; 'off' serves none. (env IAP_OPS_PORT; default 9100)")
    var opsPort: String?

    /// Bootstraps Prometheus metrics for this process (once) and says where to serve them.
    func settings(defaultHost: String = "0.0.0.0") throws -> OpsSettings? {
        let reader = SettingReader()
        let rawPort = reader.string(opsPort, "IAP_OPS_PORT", default: "9100")
        if rawPort == "off" { return nil }
        guard let port = Int(rawPort), (0...65535).contains(port) else {
            throw ValidationError("IAP_OPS_PORT must be a port number or 'off', got '\(rawPort)'")
        }
        let registry = PrometheusCollectorRegistry()
        var factory = PrometheusMetricsFactory(registry: registry)
        factory.defaultDurationHistogramBuckets = [
            .milliseconds(5), .milliseconds(10), .milliseconds(25), .milliseconds(50), .milliseconds(100),
            .milliseconds(250), .milliseconds(500), .seconds(1), .milliseconds(2500), .seconds(5), .seconds(10),
            .seconds(30),
        ]
        MetricsSystem.bootstrap(factory)
        return OpsSettings(
            host: reader.string(opsHost, "IAP_OPS_HOST", default: defaultHost), port: port,
            exposition: { registry.emitToBuffer() })
    }
}

struct CatalogOptions: ParsableArguments {
    @Option(name: .long, help: "JSON file of the products sold and what each grants; required (iap dev uses a demo catalog). (env IAP_CATALOG)")
    var catalog: String?

    func load(demoIfUnset: Bool = false) throws -> Catalog {
        guard let path = SettingReader().optionalString(catalog, "IAP_CATALOG") else {
            if demoIfUnset {
                return try Catalog.parse(Data(DemoCatalog.json.utf8), source: "the demo catalog")
            }
            throw ValidationError("IAP_CATALOG is required: the JSON file of the products this app sells")
        }
        do {
            return try Catalog.load(path: path)
        } catch {
            throw ValidationError("IAP_CATALOG: \(error.description)")
        }
    }
}

struct StoreOptions: ParsableArguments {
    @Option(name: .long, help: "SQLite file of the order store; created with mode 0600. (env IAP_DATABASE_PATH; default iap-orders.sqlite)")
    var databasePath: String?

    @Option(name: .long, help: "PostgreSQL order store instead of the SQLite file: postgres://USER:PASSWORD@HOST:PORT/DB; several order services may share it. (env IAP_DATABASE_URL)")
    var databaseURL: String?

    @Option(name: .long, help: "File whose first line is the PostgreSQL password, when the URL leaves it out. (env IAP_DATABASE_PASSWORD_FILE)")
    var databasePasswordFile: String?

    func path(default fallback: String = "iap-orders.sqlite") -> String {
        SettingReader().string(databasePath, "IAP_DATABASE_PATH", default: fallback)
    }

    /// IAP_DATABASE_URL parsed; nil when unset (the SQLite file is used).
    func postgres() throws -> PostgresLocation? {
        let reader = SettingReader()
        guard let url = reader.optionalString(databaseURL, "IAP_DATABASE_URL"), !url.isEmpty else { return nil }
        do {
            return try PostgresLocation(
                url: url, passwordFile: reader.optionalString(databasePasswordFile, "IAP_DATABASE_PASSWORD_FILE"))
        } catch {
            throw ValidationError("IAP_DATABASE_URL: \(error.message)")
        }
    }

    /// Where the order store lives: PostgreSQL when IAP_DATABASE_URL is set, else the SQLite file.
    func location(default fallback: String = "iap-orders.sqlite") throws -> StoreLocation {
        try postgres().map { .postgres($0) } ?? .sqlite(path: path(default: fallback))
    }
}

struct ReconcileOptions: ParsableArguments {
    @Option(name: .long, help: "How often the order service asks Apple about subscriptions due to renew, in billing retry or in a grace period, and re-delivers the notifications Apple could not send (needs IAP_APPSTORE_KEY_PATH): e.g. 24h, 30m, 90s; 0 turns it off. (env IAP_RECONCILE_INTERVAL; default 24h)")
    var reconcileInterval: String?

    /// IAP_RECONCILE_INTERVAL as settings; nil when it is 0 (off).
    func settings() throws -> ReconciliationSettings? {
        let raw = SettingReader().string(reconcileInterval, "IAP_RECONCILE_INTERVAL", default: "24h")
        let units: [Character: Int64] = ["s": 1, "m": 60, "h": 3600, "d": 86_400]
        let unit = raw.last.flatMap { units[$0] }
        guard let count = Int64(unit == nil ? raw : String(raw.dropLast())), count >= 0, count <= 366 * 86_400 else {
            throw ValidationError("IAP_RECONCILE_INTERVAL must be a duration such as 24h, 30m or 90s (0 turns it off); got '\(raw)'")
        }
        let seconds = count * (unit ?? 1)
        guard seconds > 0 else { return nil }
        guard seconds >= 60, seconds <= 366 * 86_400 else {
            throw ValidationError("IAP_RECONCILE_INTERVAL must be between 1m and 366d (or 0); got '\(raw)'")
        }
        return ReconciliationSettings(interval: .seconds(seconds))
    }
}

struct HTTPOptions: ParsableArguments {
    @Option(name: .long, help: "Address the intake listens on. (env IAP_HTTP_HOST; default 0.0.0.0, 127.0.0.1 for dev)")
    var host: String?

    @Option(name: .long, help: "Port the intake listens on. (env IAP_HTTP_PORT; default 8080)")
    var port: Int?

    @Option(name: .long, help: "Largest upload body in bytes; larger ones get 413. (env IAP_MAX_BODY_BYTES; default 1048576)")
    var maxBodyBytes: Int?

    @Option(name: .long, help: "Seconds between sweeps for stuck submissions. (env IAP_SWEEP_INTERVAL_SECONDS; default 60)")
    var sweepIntervalSeconds: Int?

    @Option(name: .long, help: "A pending submission untouched this many seconds is queued again. (env IAP_SWEEP_PENDING_AFTER_SECONDS; default 600)")
    var sweepPendingAfterSeconds: Int?

    @Option(name: .long, help: "A retry this many seconds overdue is queued again. (env IAP_SWEEP_RETRY_GRACE_SECONDS; default 600)")
    var sweepRetryGraceSeconds: Int?

    @Option(name: .long, help: "Requests per second one user may send, counted across the order services sharing a PostgreSQL store (bursts of twice that); 0 is unlimited. (env IAP_RATE_LIMIT_PER_USER; default 10)")
    var rateLimitPerUser: Int?

    @Option(name: .long, help: "Requests per second one client address may send, counted across the order services sharing a PostgreSQL store (bursts of twice that); 0 is unlimited. (env IAP_RATE_LIMIT_PER_IP; default 300)")
    var rateLimitPerIP: Int?

    @Option(name: .long, help: "Requests per second one client address may have refused for what they carried (400, 408, 413; bursts of twice that); past it they are answered 429; good requests are never refused for it; 0 is unlimited. (env IAP_REFUSALS_PER_IP; default 10)")
    var refusalsPerIP: Int?

    @Option(name: .long, help: "Failed admin authorizations (admin bearer tokens, console sign-ins) one client address may make in five minutes before it is locked to one try every two seconds; 0 is unlimited (API conformance checks only). (env IAP_ADMIN_FAILED_ATTEMPTS; default 5)")
    var adminFailedAttempts: Int?

    @Option(name: .long, help: "Header a trusted reverse proxy sets to the client's address, e.g. X-Real-IP; unset uses the TCP peer. (env IAP_CLIENT_IP_HEADER)")
    var clientIPHeader: String?

    @Option(name: .long, help: "Requests handled at once; more get 503 overloaded. (env IAP_MAX_IN_FLIGHT_REQUESTS; default 1024)")
    var maxInFlightRequests: Int?

    @Option(name: .long, help: "Seconds allowed to receive a request body; slower ones get 408. (env IAP_BODY_TIMEOUT_SECONDS; default 30)")
    var bodyTimeoutSeconds: Int?

    @Option(name: .long, help: "Largest App Store notification body in bytes; larger ones get 413. (env IAP_NOTIFICATION_MAX_BYTES; default 65536)")
    var notificationMaxBytes: Int?

    @Option(name: .long, help: "App Store notifications per second for the whole deployment, any sender (bursts of twice that); more get 429; 0 is unlimited. (env IAP_NOTIFICATION_RATE; default 50)")
    var notificationRate: Int?

    @Option(name: .long, help: "Days after which rejected submissions and their receipts or signed payloads are deleted (the audit log stays); 0 keeps them. (env IAP_RETENTION_DAYS; default 30)")
    var retentionDays: Int?

    @Option(name: .long, help: "Address of the admin routes' own listener, used with --admin-port. (env IAP_ADMIN_HOST; default 127.0.0.1)")
    var adminHost: String?

    @Option(name: .long, help: "Serve the admin routes on this port only, not beside the app's routes. (env IAP_ADMIN_PORT; default: the intake's port)")
    var adminPort: Int?

    @Option(name: .long, help: "User authentication: jwt, or off (local development only: the body names the user; refused unless IAP_HTTP_HOST is loopback). (env IAP_AUTH; default jwt, off for dev)")
    var auth: String?

    @Option(name: .long, help: "PEM public key (P-256 for ES256, RSA for RS256) or JWKS file that verifies user tokens. (env IAP_AUTH_PUBLIC_KEY_PATH)")
    var authPublicKeyPath: String?

    @Option(name: .long, help: "Audience user tokens must name in aud; unset skips the check. (env IAP_AUTH_AUDIENCE)")
    var authAudience: String?

    @Option(name: .long, help: "Issuer user tokens must name in iss; unset skips the check. (env IAP_AUTH_ISSUER)")
    var authIssuer: String?

    @Option(name: .long, help: "Longest a user token may live, exp - iat (exp - now without iat): seconds, or with s, m, h or d; longer ones get 401 token_malformed. (env IAP_AUTH_MAX_LIFETIME; default 24h)")
    var authMaxLifetime: String?

    func settings(names: PipelineNames, defaultHost: String = "0.0.0.0") throws -> IntakeSettings {
        let reader = SettingReader()
        let perUser = try reader.int(rateLimitPerUser, "IAP_RATE_LIMIT_PER_USER", default: 10, in: 0...1_000_000)
        let perAddress = try reader.int(rateLimitPerIP, "IAP_RATE_LIMIT_PER_IP", default: 300, in: 0...1_000_000)
        let notifications = try reader.int(notificationRate, "IAP_NOTIFICATION_RATE", default: 50, in: 0...1_000_000)
        let refusals = try reader.int(refusalsPerIP, "IAP_REFUSALS_PER_IP", default: 10, in: 0...1_000_000)
        let failedAdminAttempts = try reader.int(adminFailedAttempts, "IAP_ADMIN_FAILED_ATTEMPTS", default: 5, in: 0...1_000_000)
        let retention = try reader.int(retentionDays, "IAP_RETENTION_DAYS", default: 30, in: 0...36_500)
        let adminPort = try reader.optionalString(adminPort.map(String.init), "IAP_ADMIN_PORT").map { raw in
            guard let port = Int(raw), (0...65535).contains(port) else {
                throw ValidationError("IAP_ADMIN_PORT must be a port number, got '\(raw)'")
            }
            return port
        }
        return IntakeSettings(
            host: reader.string(host, "IAP_HTTP_HOST", default: defaultHost),
            port: try reader.int(port, "IAP_HTTP_PORT", default: 8080, in: 0...65535),
            maxBodyBytes: try reader.int(maxBodyBytes, "IAP_MAX_BODY_BYTES", default: 1_048_576, in: 1024...(64 << 20)),
            names: names,
            sweeper: SweeperSettings(
                interval: .seconds(try reader.int(sweepIntervalSeconds, "IAP_SWEEP_INTERVAL_SECONDS", default: 60, in: 1...86_400)),
                pendingAfter: .seconds(
                    try reader.int(sweepPendingAfterSeconds, "IAP_SWEEP_PENDING_AFTER_SECONDS", default: 600, in: 1...604_800)),
                retryGrace: .seconds(
                    try reader.int(sweepRetryGraceSeconds, "IAP_SWEEP_RETRY_GRACE_SECONDS", default: 600, in: 1...604_800)),
                retention: retention == 0 ? nil : .seconds(retention * 86_400)),
            limits: IntakeLimits(
                perUser: perUser == 0 ? nil : RateLimit(perSecond: perUser),
                perAddress: perAddress == 0 ? nil : RateLimit(perSecond: perAddress),
                maxInFlight: try reader.int(maxInFlightRequests, "IAP_MAX_IN_FLIGHT_REQUESTS", default: 1024, in: 1...1_000_000),
                clientAddressHeader: reader.optionalString(clientIPHeader, "IAP_CLIENT_IP_HEADER"),
                bodyTimeout: .seconds(try reader.int(bodyTimeoutSeconds, "IAP_BODY_TIMEOUT_SECONDS", default: 30, in: 1...3600)),
                notifications: notifications == 0 ? nil : RateLimit(perSecond: notifications),
                refusalsPerAddress: refusals == 0 ? nil : RateLimit(perSecond: refusals),
                failedAdminAttempts: failedAdminAttempts == 0 ? nil : failedAdminAttempts),
            adminListener: adminPort.map { (reader.string(adminHost, "IAP_ADMIN_HOST", default: "127.0.0.1"), $0) },
            maxNotificationBytes: try reader.int(
                notificationMaxBytes, "IAP_NOTIFICATION_MAX_BYTES", default: 65_536, in: 1024...(1 << 20)))
    }

    /// `IAP_AUTH_MAX_LIFETIME`: whole seconds, or a number with `s`, `m`, `h` or `d`; one second to a year.
    static func maxLifetime(_ text: String) throws -> TimeInterval {
        let units: [Character: Double] = ["s": 1, "m": 60, "h": 3600, "d": 86_400]
        let trimmed = text.trimmingCharacters(in: .whitespaces).lowercased()
        let unit = trimmed.last.flatMap { units[$0] }
        let number = unit == nil ? trimmed : String(trimmed.dropLast())
        guard let value = Int(number), value > 0, case let seconds = Double(value) * (unit ?? 1), seconds <= 366 * 86_400 else {
            throw ValidationError("IAP_AUTH_MAX_LIFETIME must be a duration such as 3600, 90m, 24h or 7d (at most a year), got '\(text)'")
        }
        return seconds
    }

    /// How app users authenticate. `jwt` (the default, `off` for dev) needs exactly one key:
    /// IAP_AUTH_HS256_SECRET (or its _FILE; never a flag) or IAP_AUTH_PUBLIC_KEY_PATH.
    func authentication(defaultMode: String = "jwt") async throws -> UserAuthentication {
        let reader = SettingReader()
        switch reader.string(auth, "IAP_AUTH", default: defaultMode) {
        case "off":
            return .off
        case "jwt":
            let lifetime = try Self.maxLifetime(reader.string(authMaxLifetime, "IAP_AUTH_MAX_LIFETIME", default: "24h"))
            let secret = try reader.secret("IAP_AUTH_HS256_SECRET")
            let keyPath = reader.optionalString(authPublicKeyPath, "IAP_AUTH_PUBLIC_KEY_PATH")
            let key: UserTokenVerifier.Key
            switch (secret, keyPath) {
            case (let secret?, nil):
                key = .hs256(secret: secret)
            case (nil, let path?):
                do {
                    key = .publicKey(try String(contentsOfFile: path, encoding: .utf8))
                } catch {
                    throw ValidationError("IAP_AUTH_PUBLIC_KEY_PATH: cannot read \(path): \(error.localizedDescription)")
                }
            case (nil, nil):
                throw ValidationError(
                    "IAP_AUTH=jwt (the default) needs IAP_AUTH_HS256_SECRET (or IAP_AUTH_HS256_SECRET_FILE) or IAP_AUTH_PUBLIC_KEY_PATH; IAP_AUTH=off is for local development only")
            case (_?, _?):
                throw ValidationError("set one of IAP_AUTH_HS256_SECRET and IAP_AUTH_PUBLIC_KEY_PATH, not both")
            }
            do {
                return .jwt(
                    try await UserTokenVerifier(
                        key: key, audience: reader.optionalString(authAudience, "IAP_AUTH_AUDIENCE"),
                        issuer: reader.optionalString(authIssuer, "IAP_AUTH_ISSUER"), maxLifetime: lifetime))
            } catch {
                throw ValidationError(keyPath == nil ? "IAP_AUTH_HS256_SECRET: \(error)" : "IAP_AUTH_PUBLIC_KEY_PATH: \(error)")
            }
        case let other:
            throw ValidationError("IAP_AUTH must be jwt or off; got '\(other)'")
        }
    }
}

struct VerifierOptions: ParsableArguments {
    @Option(name: .long, help: "Comma-separated bundle ids this deployment serves; receipts of other apps are rejected. Required. (env IAP_BUNDLE_IDS)")
    var bundleIds: String?

    @Option(name: .long, help: "Production verifyReceipt URL. (env IAP_APPSTORE_VERIFY_URL; default https://buy.itunes.apple.com/verifyReceipt)")
    var verifyURL: String?

    @Option(name: .long, help: "Sandbox verifyReceipt URL. (env IAP_APPSTORE_SANDBOX_VERIFY_URL; default https://sandbox.itunes.apple.com/verifyReceipt)")
    var sandboxVerifyURL: String?

    @Option(name: .long, help: "Seconds allowed for one call to Apple. (env IAP_APPSTORE_TIMEOUT_SECONDS; default 15)")
    var appleTimeoutSeconds: Int?

    @Option(name: .long, help: "Verifications in flight per process. (env IAP_VERIFIER_CONCURRENCY; default 64)")
    var concurrency: Int?

    @Option(name: .long, help: "Comma-separated delays in seconds between attempts; the last repeats. (env IAP_RETRY_DELAYS; default 5,30,120,600,1800)")
    var retryDelays: String?

    @Option(name: .long, help: "Hours after which an upload that keeps failing transiently needs review. (env IAP_MAX_RETRY_AGE_HOURS; default 72)")
    var maxRetryAgeHours: Int?

    @Option(name: .long, help: "Sandbox purchases: accept, reject, or allowlist (users in IAP_SANDBOX_ALLOWLIST only). (env IAP_SANDBOX; default accept)")
    var sandbox: String?

    @Option(name: .long, help: "Comma-separated user ids whose sandbox purchases are credited under 'allowlist'. (env IAP_SANDBOX_ALLOWLIST)")
    var sandboxAllowlist: String?

    func sandboxPolicy() throws -> SandboxPolicy {
        try Self.sandboxPolicy(flag: sandbox, allowlistFlag: sandboxAllowlist)
    }

    /// IAP_SANDBOX and IAP_SANDBOX_ALLOWLIST (or their flags): which sandbox purchases are
    /// credited, by uploads and by notifications alike.
    static func sandboxPolicy(flag sandbox: String? = nil, allowlistFlag sandboxAllowlist: String? = nil) throws -> SandboxPolicy {
        let reader = SettingReader()
        switch reader.string(sandbox, "IAP_SANDBOX", default: "accept") {
        case "accept": return .accept
        case "reject": return .reject
        case "allowlist":
            let users = (reader.optionalString(sandboxAllowlist, "IAP_SANDBOX_ALLOWLIST") ?? "")
                .split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty }
            guard !users.isEmpty else {
                throw ValidationError("IAP_SANDBOX=allowlist needs IAP_SANDBOX_ALLOWLIST with at least one user id")
            }
            return .allowlist(Set(users))
        case let other:
            throw ValidationError("IAP_SANDBOX must be accept, reject or allowlist; got '\(other)'")
        }
    }

    /// IAP_RESTORE: what a restore uploaded by another user than the owner does.
    static func restorePolicy() throws -> RestorePolicy {
        let raw = SettingReader().string(nil, "IAP_RESTORE", default: "keep")
        guard let policy = RestorePolicy(rawValue: raw) else {
            throw ValidationError("IAP_RESTORE must be keep or transfer; got '\(raw)'")
        }
        return policy
    }

    @Option(name: .long, help: "Transient Apple failures in a row that pause verification. (env IAP_BREAKER_FAILURES; default 20)")
    var breakerFailures: Int?

    @Option(name: .long, help: "Seconds verification stays paused before a probe. (env IAP_BREAKER_OPEN_SECONDS; default 30)")
    var breakerOpenSeconds: Int?

    /// The shared secret comes from IAP_APPSTORE_SHARED_SECRET or IAP_APPSTORE_SHARED_SECRET_FILE only.
    func verifyReceiptSettings(endpointsOverride: VerifyReceiptEndpoints? = nil, defaultBundleIds: String? = nil) throws
        -> VerifyReceiptClient.Settings
    {
        let reader = SettingReader()
        let ids = try readBundleIds(bundleIds, default: defaultBundleIds)
        let endpoints =
            endpointsOverride
            ?? VerifyReceiptEndpoints(
                production: reader.string(verifyURL, "IAP_APPSTORE_VERIFY_URL", default: VerifyReceiptEndpoints.apple.production),
                sandbox: reader.string(
                    sandboxVerifyURL, "IAP_APPSTORE_SANDBOX_VERIFY_URL", default: VerifyReceiptEndpoints.apple.sandbox))
        for (variable, url) in [("IAP_APPSTORE_VERIFY_URL", endpoints.production), ("IAP_APPSTORE_SANDBOX_VERIFY_URL", endpoints.sandbox)] {
            guard let parsed = URL(string: url), ["http", "https"].contains(parsed.scheme ?? ""), parsed.host != nil else {
                throw ValidationError("\(variable) must be an http(s) URL, got '\(url)'")
            }
        }
        return VerifyReceiptClient.Settings(
            endpoints: endpoints, sharedSecret: try reader.secret("IAP_APPSTORE_SHARED_SECRET"), bundleIds: ids,
            timeout: .seconds(try reader.int(appleTimeoutSeconds, "IAP_APPSTORE_TIMEOUT_SECONDS", default: 15, in: 1...300)))
    }

    func verifierSettings(names: PipelineNames) throws -> VerifierSettings {
        let reader = SettingReader()
        let rawDelays = reader.string(retryDelays, "IAP_RETRY_DELAYS", default: "5,30,120,600,1800")
        let delays = rawDelays.split(separator: ",").compactMap { Int($0.trimmingCharacters(in: .whitespaces)) }
        guard !delays.isEmpty, delays.count == rawDelays.split(separator: ",").count, delays.allSatisfy({ $0 > 0 }) else {
            throw ValidationError("IAP_RETRY_DELAYS must be positive whole seconds separated by commas, got '\(rawDelays)'")
        }
        return VerifierSettings(
            names: names,
            concurrency: try reader.int(concurrency, "IAP_VERIFIER_CONCURRENCY", default: 64, in: 1...10_000),
            retrySchedule: RetrySchedule(delaysSeconds: delays),
            maxRetryAge: .seconds(try reader.int(maxRetryAgeHours, "IAP_MAX_RETRY_AGE_HOURS", default: 72, in: 1...8760) * 3600),
            sandboxPolicy: try sandboxPolicy(),
            circuitBreaker: CircuitBreaker.Settings(
                failureThreshold: try reader.int(breakerFailures, "IAP_BREAKER_FAILURES", default: 20, in: 1...100_000),
                openDuration: .seconds(try reader.int(breakerOpenSeconds, "IAP_BREAKER_OPEN_SECONDS", default: 30, in: 1...3600))))
    }
}

struct FakeAppStoreOptions: ParsableArguments {
    @Option(name: .customLong("fake-appstore-host"), help: "Address the fake App Store listens on. (env IAP_FAKE_APPSTORE_HOST; default 127.0.0.1)")
    var fakeAppStoreHost: String?

    @Option(name: .customLong("fake-appstore-port"), help: "Port the fake App Store listens on. (env IAP_FAKE_APPSTORE_PORT; default 8090)")
    var fakeAppStorePort: Int?

    @Option(name: .customLong("fake-appstore-database-path"), help: "SQLite file where the fake App Store keeps what it minted. (env IAP_FAKE_DATABASE_PATH; default fake-appstore.sqlite, for dev beside the order store)")
    var fakeAppStoreDatabasePath: String?

    func databasePath(default fallback: String) -> String {
        SettingReader().string(fakeAppStoreDatabasePath, "IAP_FAKE_DATABASE_PATH", default: fallback)
    }

    @Option(name: .customLong("fake-api-key-path"), help: "PEM private key whose public half checks Server API bearer tokens; unset, the fake's Server API refuses every call. (env IAP_FAKE_API_KEY_PATH)")
    var fakeAPIKeyPath: String?

    @Option(name: .customLong("fake-api-key-id"), help: "Key id the fake expects in bearer tokens. (env IAP_FAKE_API_KEY_ID)")
    var fakeAPIKeyId: String?

    @Option(name: .customLong("fake-issuer-id"), help: "Issuer id the fake expects in bearer tokens. (env IAP_FAKE_ISSUER_ID)")
    var fakeIssuerId: String?

    @Option(name: .customLong("fake-notification-url"), help: "Where the fake sends App Store Server Notifications. (env IAP_FAKE_NOTIFICATION_URL)")
    var fakeNotificationURL: String?

    /// The Server API key the fake checks tokens against, if configured.
    func apiKey() throws -> FakeServerAPIKey? {
        let reader = SettingReader()
        guard let path = reader.optionalString(fakeAPIKeyPath, "IAP_FAKE_API_KEY_PATH") else { return nil }
        guard let keyId = reader.optionalString(fakeAPIKeyId, "IAP_FAKE_API_KEY_ID"),
            let issuerId = reader.optionalString(fakeIssuerId, "IAP_FAKE_ISSUER_ID")
        else {
            throw ValidationError("IAP_FAKE_API_KEY_PATH needs IAP_FAKE_API_KEY_ID and IAP_FAKE_ISSUER_ID")
        }
        do {
            return try FakeServerAPIKey(
                privateKeyPEM: try String(contentsOfFile: path, encoding: .utf8), keyId: keyId, issuerId: issuerId)
        } catch {
            throw ValidationError("IAP_FAKE_API_KEY_PATH: \(path) is not a readable P-256 PEM private key")
        }
    }

    func notificationURL() -> String? {
        SettingReader().optionalString(fakeNotificationURL, "IAP_FAKE_NOTIFICATION_URL")
    }

    func address() throws -> (host: String, port: Int) {
        let reader = SettingReader()
        return (
            reader.string(fakeAppStoreHost, "IAP_FAKE_APPSTORE_HOST", default: "127.0.0.1"),
            try reader.int(fakeAppStorePort, "IAP_FAKE_APPSTORE_PORT", default: 8090, in: 0...65535)
        )
    }
}

struct StoreKitOptions: ParsableArguments {
    @Option(name: .long, help: "The App Store Server API key (.p8, PEM) from App Store Connect; enables transaction-id uploads and the Server API route for receipts. (env IAP_APPSTORE_KEY_PATH)")
    var appstoreKeyPath: String?

    @Option(name: .long, help: "The key's id in App Store Connect. (env IAP_APPSTORE_KEY_ID)")
    var appstoreKeyId: String?

    @Option(name: .long, help: "The issuer id of the key (App Store Connect, Keys). (env IAP_APPSTORE_ISSUER_ID)")
    var appstoreIssuerId: String?

    @Option(name: .long, help: "App Store Server API base URL. (env IAP_APPSTORE_API_URL; default https://api.storekit.apple.com)")
    var appstoreApiURL: String?

    @Option(name: .long, help: "Sandbox App Store Server API base URL. (env IAP_APPSTORE_SANDBOX_API_URL; default https://api.storekit-sandbox.apple.com)")
    var appstoreSandboxApiURL: String?

    @Option(name: .long, help: "Share of Apple's per-app Server API rate limits this process may use: 1 for one verifier, 1/N for N. (env IAP_APPSTORE_API_RATE_SHARE; default 1)")
    var appstoreApiRateShare: Double?

    @Option(name: .long, help: "The app's App Store id; production notifications must name it. (env IAP_APP_APPLE_ID)")
    var appAppleId: Int64?

    @Option(name: .long, help: "Confirm locally verified signed transactions with Get Transaction Info: true or false. (env IAP_CONFIRM_WITH_API; default false)")
    var confirmWithAPI: String?

    @Option(name: .long, help: "How app receipts are verified: server-api (transaction ids read locally, then looked up) or verify-receipt. (env IAP_RECEIPTS_VIA; default verify-receipt; server-api holds receipt purchases without an appAccountToken as owner_unknown)")
    var receiptsVia: String?

    @Option(name: .long, help: "Comma-separated root certificate files (DER or PEM) that signed data must chain to; for tests only. (env IAP_TRUSTED_ROOTS; default Apple Root CA - G3, shipped)")
    var trustedRoots: String?

    /// StoreKit 2 settings; `bundleIds` names the app of the Server API key (exactly one).
    func settings(bundleIds: Set<String>, defaults: StoreKitSettings = .init()) throws -> StoreKitSettings {
        let reader = SettingReader()
        var settings = defaults
        if let roots = try readTrustedRoots(trustedRoots) { settings.trustedRoots = roots }
        if let appAppleId = try readOptionalInt64(appAppleId, "IAP_APP_APPLE_ID") { settings.appAppleId = appAppleId }
        switch reader.string(confirmWithAPI, "IAP_CONFIRM_WITH_API", default: settings.confirmWithAPI ? "true" : "false") {
        case "true": settings.confirmWithAPI = true
        case "false": settings.confirmWithAPI = false
        case let other: throw ValidationError("IAP_CONFIRM_WITH_API must be true or false, got '\(other)'")
        }
        if let keyPath = reader.optionalString(appstoreKeyPath, "IAP_APPSTORE_KEY_PATH") {
            guard let keyId = reader.optionalString(appstoreKeyId, "IAP_APPSTORE_KEY_ID"),
                let issuerId = reader.optionalString(appstoreIssuerId, "IAP_APPSTORE_ISSUER_ID")
            else {
                throw ValidationError("IAP_APPSTORE_KEY_PATH needs IAP_APPSTORE_KEY_ID and IAP_APPSTORE_ISSUER_ID")
            }
            guard bundleIds.count == 1, let bundleId = bundleIds.first else {
                throw ValidationError("the App Store Server API key serves one app: set exactly one bundle id in IAP_BUNDLE_IDS")
            }
            let pem: String
            do {
                pem = try String(contentsOfFile: keyPath, encoding: .utf8)
            } catch {
                throw ValidationError("IAP_APPSTORE_KEY_PATH: cannot read \(keyPath): \(error.localizedDescription)")
            }
            let share = appstoreApiRateShare ?? Double(reader.optionalString(nil, "IAP_APPSTORE_API_RATE_SHARE") ?? "1")
            guard let share, share > 0, share <= 1 else {
                throw ValidationError("IAP_APPSTORE_API_RATE_SHARE must be a number above 0 and at most 1")
            }
            settings.serverAPI = AppStoreServerAPIClient.Settings(
                keyId: keyId, issuerId: issuerId, privateKeyPEM: pem, bundleId: bundleId,
                productionURL: reader.string(appstoreApiURL, "IAP_APPSTORE_API_URL", default: "https://api.storekit.apple.com"),
                sandboxURL: reader.string(
                    appstoreSandboxApiURL, "IAP_APPSTORE_SANDBOX_API_URL", default: "https://api.storekit-sandbox.apple.com"),
                rateShare: share)
            do {
                _ = try ES256PrivateKey(pem: pem)
            } catch {
                throw ValidationError("IAP_APPSTORE_KEY_PATH: \(keyPath) is not a P-256 private key in PEM (.p8)")
            }
        }
        switch reader.optionalString(receiptsVia, "IAP_RECEIPTS_VIA") {
        case nil:
            // verifyReceipt: Apple's answer vouches for the receipt. The Server API route reads
            // the receipt without checking its signature, so what it lists proves no ownership
            // (held as owner_unknown without an appAccountToken); it is chosen, never a default.
            settings.receiptsThroughServerAPI = false
        case "server-api":
            guard settings.serverAPI != nil else {
                throw ValidationError("IAP_RECEIPTS_VIA=server-api needs the App Store Server API key (IAP_APPSTORE_KEY_PATH)")
            }
            settings.receiptsThroughServerAPI = true
        case "verify-receipt": settings.receiptsThroughServerAPI = false
        case let other?: throw ValidationError("IAP_RECEIPTS_VIA must be server-api or verify-receipt, got '\(other)'")
        }
        return settings
    }
}

/// What the intake checks App Store notifications against, for `iap intake` and `iap orders`
/// (`iap verifier` and `iap dev` read the same variables with their own options).
struct NotificationOptions: ParsableArguments {
    @Option(name: .long, help: "Comma-separated bundle ids this deployment serves; notifications for other apps get 403. Required. (env IAP_BUNDLE_IDS)")
    var bundleIds: String?

    @Option(name: .long, help: "The app's App Store id; production notifications must name it. (env IAP_APP_APPLE_ID)")
    var appAppleId: Int64?

    @Option(name: .long, help: "Comma-separated root certificate files (DER or PEM) that notifications must chain to; for tests only. (env IAP_TRUSTED_ROOTS; default Apple Root CA - G3, shipped)")
    var trustedRoots: String?

    /// Sets the bundle ids, roots and app id the intake checks each notification against.
    func apply(to settings: inout PipelineSettings) throws {
        settings.verifyReceipt.bundleIds = try readBundleIds(bundleIds, default: nil, purpose: "notifications")
        if let roots = try readTrustedRoots(trustedRoots) { settings.storeKit.trustedRoots = roots }
        if let appAppleId = try readOptionalInt64(appAppleId, "IAP_APP_APPLE_ID") { settings.storeKit.appAppleId = appAppleId }
    }
}

/// IAP_BUNDLE_IDS (or its flag): one or more bundle ids, separated by commas; required.
private func readBundleIds(_ flag: String?, default fallback: String?, purpose: String = "receipts") throws -> Set<String> {
    guard let raw = SettingReader().optionalString(flag, "IAP_BUNDLE_IDS") ?? fallback else {
        throw ValidationError("IAP_BUNDLE_IDS is required: the bundle ids whose \(purpose) this deployment accepts")
    }
    let ids = Set(raw.split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty })
    guard !ids.isEmpty else { throw ValidationError("IAP_BUNDLE_IDS names no bundle id") }
    return ids
}

/// IAP_TRUSTED_ROOTS (or its flag): certificate files, separated by commas; nil when unset.
private func readTrustedRoots(_ flag: String?) throws -> [Certificate]? {
    guard let paths = SettingReader().optionalString(flag, "IAP_TRUSTED_ROOTS") else { return nil }
    return try paths.split(separator: ",").map { path in
        let path = path.trimmingCharacters(in: .whitespaces)
        do {
            return try certificate(atPath: path)
        } catch {
            throw ValidationError("IAP_TRUSTED_ROOTS: \(path) is not a readable certificate: \(error)")
        }
    }
}

private func readOptionalInt64(_ flag: Int64?, _ variable: String) throws -> Int64? {
    if let flag { return flag }
    guard let raw = SettingReader().optionalString(nil, variable) else { return nil }
    guard let value = Int64(raw) else { throw ValidationError("\(variable) must be a whole number, got '\(raw)'") }
    return value
}
