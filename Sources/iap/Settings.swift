import AppStore
import AppleCalls
import ArgumentParser
import Finisher
import FakeAppStore
import Foundation
import IAPCore
import Intake
import JWTKit
import Ledger
import Logging
import Messaging
import OrderStore
import Metrics
import Prometheus
import Pipeline
import SwiftASN1
import Verifier
import X509

/// Reads a setting (`Setting`, declared once in IAPCore): the flag if given, else the
/// environment variable, else the setting's default. Only this executable reads the environment.
struct SettingReader {
    let environment = ProcessInfo.processInfo.environment

    /// The setting's value; `fallback` replaces its declared default (one that follows the role).
    func string(_ flag: String?, _ setting: Setting, default fallback: String? = nil) -> String {
        guard let value = optionalString(flag, setting) ?? fallback ?? setting.fallback else {
            preconditionFailure("\(setting.variable) has no default: read it with optionalString")
        }
        return value
    }

    func optionalString(_ flag: String?, _ setting: Setting) -> String? {
        if let flag { return flag }
        if let value = environment[setting.variable], !value.isEmpty { return value }
        return nil
    }

    func int(_ flag: Int?, _ setting: Setting, default fallback: Int? = nil, in range: ClosedRange<Int>) throws -> Int {
        let value: Int
        if let flag {
            value = flag
        } else if let raw = environment[setting.variable], !raw.isEmpty {
            guard let parsed = Int(raw) else {
                throw ValidationError("\(setting.variable) must be a whole number, got '\(raw)'")
            }
            value = parsed
        } else if let fallback = fallback ?? setting.fallback.flatMap({ Int($0) }) {
            value = fallback
        } else {
            preconditionFailure("\(setting.variable) has no whole-number default")
        }
        guard range.contains(value) else {
            throw ValidationError("\(setting.variable) must be between \(range.lowerBound) and \(range.upperBound), got \(value)")
        }
        return value
    }

    /// A secret with a default (the broker's URL): the secret, else the default.
    func string(secret setting: Setting) throws -> String {
        guard let value = try secret(setting) ?? setting.fallback else {
            preconditionFailure("\(setting.variable) has no default: read it with secret")
        }
        return value
    }

    /// A secret from its variable or from the file its `_FILE` variable names; never from a
    /// flag, which `ps` would show.
    func secret(_ setting: Setting) throws -> String? {
        if let path = environment[setting.fileVariable], !path.isEmpty {
            do {
                return try String(contentsOfFile: path, encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)
            } catch {
                throw ValidationError("\(setting.fileVariable): cannot read \(path): \(error.localizedDescription)")
            }
        }
        if let value = environment[setting.variable], !value.isEmpty { return value }
        return nil
    }
}

struct LogOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp(Setting.logLevel.help))
    var logLevel: String?

    @Option(name: .long, help: ArgumentHelp(Setting.logFormat.help))
    var logFormat: String?

    func makeLogger(label: String) throws -> Logger {
        let reader = SettingReader()
        let raw = reader.string(logLevel, .logLevel)
        guard let level = Logger.Level(rawValue: raw) else {
            throw ValidationError("\(Setting.logLevel.variable) must be one of trace, debug, info, notice, warning, error, critical; got '\(raw)'")
        }
        let format = reader.string(logFormat, .logFormat)
        guard format == "text" || format == "json" else {
            throw ValidationError("\(Setting.logFormat.variable) must be text or json; got '\(format)'")
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
    @Option(name: .long, help: ArgumentHelp(Setting.queuePrefix.help))
    var queuePrefix: String?

    @Option(name: .long, help: ArgumentHelp(Setting.amqpHeartbeatSeconds.help))
    var amqpHeartbeatSeconds: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.queueType.help))
    var queueType: String?

    @Option(name: .long, help: ArgumentHelp(Setting.queueDeliveryLimit.help))
    var queueDeliveryLimit: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.messageEncoding.help))
    var messageEncoding: String?

    /// IAP_MESSAGE_ENCODING: nil for identity.
    func encoding() throws -> ContentEncoding? {
        let value = SettingReader().string(messageEncoding, .messageEncoding)
        if value == "identity" { return nil }
        guard let encoding = ContentEncoding(rawValue: value) else {
            throw ValidationError("\(Setting.messageEncoding.variable) must be deflate or identity, got '\(value)'")
        }
        return encoding
    }

    /// IAP_AMQP_URL: one URL, or the comma-separated URLs of a cluster's nodes.
    /// It carries the broker password: from the environment or a file only, never a flag.
    private func url() throws -> String {
        try SettingReader().string(secret: .amqpURL)
    }

    func configuration() throws -> AMQPConfiguration {
        let reader = SettingReader()
        let url = try url()
        let heartbeat = try reader.int(amqpHeartbeatSeconds, .amqpHeartbeatSeconds, in: 1...600)
        do {
            return try AMQPConfiguration(url: url, heartbeatSeconds: heartbeat)
        } catch {
            throw ValidationError("\(Setting.amqpURL.variable): \(error.message)")
        }
    }

    func names() throws -> PipelineNames {
        let prefix = SettingReader().string(queuePrefix, .queuePrefix)
        guard !prefix.isEmpty, prefix.allSatisfy({ $0.isLetter || $0.isNumber || "-_.".contains($0) }) else {
            throw ValidationError("\(Setting.queuePrefix.variable) may hold letters, digits, '-', '_' and '.' only; got '\(prefix)'")
        }
        return PipelineNames(prefix: prefix, queueType: try queueKind())
    }

    /// IAP_QUEUE_TYPE and IAP_QUEUE_DELIVERY_LIMIT; the default follows the number of nodes.
    private func queueKind() throws -> QueueType {
        let reader = SettingReader()
        let nodes = (try? configuration().nodes.count) ?? 1
        let kind = reader.string(queueType, .queueType, default: nodes > 1 ? "quorum" : "classic")
        let limit = try reader.int(
            queueDeliveryLimit, .queueDeliveryLimit, in: 1...1000)
        switch kind {
        case "classic": return .classic
        case "quorum": return .quorum(deliveryLimit: limit)
        default: throw ValidationError("\(Setting.queueType.variable) must be classic or quorum; got '\(kind)'")
        }
    }
}

struct OpsOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp(Setting.opsHost.help))
    var opsHost: String?

    @Option(name: .long, help: ArgumentHelp(Setting.opsPort.help))
    var opsPort: String?

    /// Bootstraps Prometheus metrics for this process (once) and says where to serve them.
    func settings(dev: Bool = false) throws -> OpsSettings? {
        let reader = SettingReader()
        let rawPort = reader.string(opsPort, .opsPort)
        if rawPort == "off" { return nil }
        guard let port = Int(rawPort), (0...65535).contains(port) else {
            throw ValidationError("\(Setting.opsPort.variable) must be a port number or 'off', got '\(rawPort)'")
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
            host: reader.string(opsHost, .opsHost, default: Setting.opsHost.fallback(dev: dev)), port: port,
            exposition: { registry.emitToBuffer() })
    }
}

struct CatalogOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp(Setting.catalog.help))
    var catalog: String?

    func load(demoIfUnset: Bool = false) throws -> Catalog {
        guard let path = SettingReader().optionalString(catalog, .catalog) else {
            if demoIfUnset {
                return try Catalog.parse(Data(DemoCatalog.json.utf8), source: "the demo catalog")
            }
            throw ValidationError("\(Setting.catalog.variable) is required: the JSON file of the products this app sells")
        }
        do {
            return try Catalog.load(path: path)
        } catch {
            throw ValidationError("\(Setting.catalog.variable): \(error.description)")
        }
    }
}

struct StoreOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp(Setting.databasePath.help))
    var databasePath: String?

    @Option(name: .long, help: ArgumentHelp(Setting.databaseURL.help))
    var databaseURL: String?

    @Option(name: .long, help: ArgumentHelp(Setting.databasePasswordFile.help))
    var databasePasswordFile: String?

    func path(dev: Bool = false) -> String {
        SettingReader().string(databasePath, .databasePath, default: Setting.databasePath.fallback(dev: dev))
    }

    /// IAP_DATABASE_URL parsed; nil when unset (the SQLite file is used).
    func postgres() throws -> PostgresLocation? {
        let reader = SettingReader()
        guard let url = reader.optionalString(databaseURL, .databaseURL), !url.isEmpty else { return nil }
        do {
            return try PostgresLocation(
                url: url, passwordFile: reader.optionalString(databasePasswordFile, .databasePasswordFile))
        } catch {
            throw ValidationError("\(Setting.databaseURL.variable): \(error.message)")
        }
    }

    /// Where the order store lives: PostgreSQL when IAP_DATABASE_URL is set, else the SQLite file.
    func location() throws -> StoreLocation {
        try postgres().map { .postgres($0) } ?? .sqlite(path: path())
    }
}

struct ReconcileOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp(Setting.reconcileInterval.help))
    var reconcileInterval: String?

    /// IAP_RECONCILE_INTERVAL as settings; nil when it is 0 (off).
    func settings() throws -> ReconciliationSettings? {
        let raw = SettingReader().string(reconcileInterval, .reconcileInterval)
        let units: [Character: Int64] = ["s": 1, "m": 60, "h": 3600, "d": 86_400]
        let unit = raw.last.flatMap { units[$0] }
        guard let count = Int64(unit == nil ? raw : String(raw.dropLast())), count >= 0, count <= 366 * 86_400 else {
            throw ValidationError("\(Setting.reconcileInterval.variable) must be a duration such as 24h, 30m or 90s (0 turns it off); got '\(raw)'")
        }
        let seconds = count * (unit ?? 1)
        guard seconds > 0 else { return nil }
        guard seconds >= 60, seconds <= 366 * 86_400 else {
            throw ValidationError("\(Setting.reconcileInterval.variable) must be between 1m and 366d (or 0); got '\(raw)'")
        }
        return ReconciliationSettings(interval: .seconds(seconds))
    }
}

struct HTTPOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp(Setting.httpHost.help))
    var host: String?

    @Option(name: .long, help: ArgumentHelp(Setting.httpPort.help))
    var port: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.maxBodyBytes.help))
    var maxBodyBytes: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.sweepIntervalSeconds.help))
    var sweepIntervalSeconds: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.sweepPendingAfterSeconds.help))
    var sweepPendingAfterSeconds: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.sweepRetryGraceSeconds.help))
    var sweepRetryGraceSeconds: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.rateLimitPerUser.help))
    var rateLimitPerUser: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.rateLimitPerIP.help))
    var rateLimitPerIP: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.refusalsPerIP.help))
    var refusalsPerIP: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.adminFailedAttempts.help))
    var adminFailedAttempts: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.clientIPHeader.help))
    var clientIPHeader: String?

    @Option(name: .long, help: ArgumentHelp(Setting.trustedProxies.help))
    var trustedProxies: String?

    @Option(name: .long, help: ArgumentHelp(Setting.maxInFlightRequests.help))
    var maxInFlightRequests: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.bodyTimeoutSeconds.help))
    var bodyTimeoutSeconds: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.notificationMaxBytes.help))
    var notificationMaxBytes: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.notificationRate.help))
    var notificationRate: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.retentionDays.help))
    var retentionDays: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.adminHost.help))
    var adminHost: String?

    @Option(name: .long, help: ArgumentHelp(Setting.adminPort.help))
    var adminPort: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.auth.help))
    var auth: String?

    @Option(name: .long, help: ArgumentHelp(Setting.authPublicKeyPath.help))
    var authPublicKeyPath: String?

    @Option(name: .long, help: ArgumentHelp(Setting.authAudience.help))
    var authAudience: String?

    @Option(name: .long, help: ArgumentHelp(Setting.authIssuer.help))
    var authIssuer: String?

    @Option(name: .long, help: ArgumentHelp(Setting.authMaxLifetime.help))
    var authMaxLifetime: String?

    func settings(names: PipelineNames, dev: Bool = false) throws -> IntakeSettings {
        let reader = SettingReader()
        let perUser = try reader.int(rateLimitPerUser, .rateLimitPerUser, in: 0...1_000_000)
        let perAddress = try reader.int(rateLimitPerIP, .rateLimitPerIP, in: 0...1_000_000)
        let notifications = try reader.int(notificationRate, .notificationRate, in: 0...1_000_000)
        let refusals = try reader.int(refusalsPerIP, .refusalsPerIP, in: 0...1_000_000)
        let failedAdminAttempts = try reader.int(adminFailedAttempts, .adminFailedAttempts, in: 0...1_000_000)
        let retention = try reader.int(retentionDays, .retentionDays, in: 0...36_500)
        let adminPort = try reader.optionalString(adminPort.map(String.init), .adminPort).map { raw in
            guard let port = Int(raw), (0...65535).contains(port) else {
                throw ValidationError("\(Setting.adminPort.variable) must be a port number, got '\(raw)'")
            }
            return port
        }
        return IntakeSettings(
            host: reader.string(host, .httpHost, default: Setting.httpHost.fallback(dev: dev)),
            port: try reader.int(port, .httpPort, in: 0...65535),
            maxBodyBytes: try reader.int(maxBodyBytes, .maxBodyBytes, in: 1024...(64 << 20)),
            names: names,
            sweeper: SweeperSettings(
                interval: .seconds(try reader.int(sweepIntervalSeconds, .sweepIntervalSeconds, in: 1...86_400)),
                pendingAfter: .seconds(
                    try reader.int(sweepPendingAfterSeconds, .sweepPendingAfterSeconds, in: 1...604_800)),
                retryGrace: .seconds(
                    try reader.int(sweepRetryGraceSeconds, .sweepRetryGraceSeconds, in: 1...604_800)),
                retention: retention == 0 ? nil : .seconds(retention * 86_400)),
            limits: IntakeLimits(
                perUser: perUser == 0 ? nil : RateLimit(perSecond: perUser),
                perAddress: perAddress == 0 ? nil : RateLimit(perSecond: perAddress),
                maxInFlight: try reader.int(maxInFlightRequests, .maxInFlightRequests, in: 1...1_000_000),
                clientAddresses: try clientAddresses(reader),
                bodyTimeout: .seconds(try reader.int(bodyTimeoutSeconds, .bodyTimeoutSeconds, in: 1...3600)),
                notifications: notifications == 0 ? nil : RateLimit(perSecond: notifications),
                refusalsPerAddress: refusals == 0 ? nil : RateLimit(perSecond: refusals),
                failedAdminAttempts: failedAdminAttempts == 0 ? nil : failedAdminAttempts),
            adminListener: adminPort.map { (reader.string(adminHost, .adminHost), $0) },
            maxNotificationBytes: try reader.int(
                notificationMaxBytes, .notificationMaxBytes, in: 1024...(1 << 20)))
    }

    /// `IAP_CLIENT_IP_HEADER` and `IAP_TRUSTED_PROXIES`: a header needs the proxies it is
    /// believed from, and every proxy must be an address or CIDR block.
    func clientAddresses(_ reader: SettingReader) throws -> ClientAddressPolicy {
        let header = reader.optionalString(clientIPHeader, .clientIPHeader)
        let texts = (reader.optionalString(trustedProxies, .trustedProxies) ?? "").split(separator: ",")
            .map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty }
        let proxies = try texts.map { text in
            guard let block = NetworkBlock(text) else {
                throw ValidationError("\(Setting.trustedProxies.variable) must list addresses or CIDR blocks, got '\(text)'")
            }
            return block
        }
        if let header {
            guard !header.isEmpty, header.allSatisfy({ $0.isASCII && ($0.isLetter || $0.isNumber || $0 == "-" || $0 == "_") }) else {
                throw ValidationError("\(Setting.clientIPHeader.variable) must be a header name, got '\(header)'")
            }
            guard !proxies.isEmpty else {
                throw ValidationError(
                    "\(Setting.clientIPHeader.variable) is set but \(Setting.trustedProxies.variable) is not: name the reverse proxies whose header is believed (any other sender could pick its own address)")
            }
        }
        return ClientAddressPolicy(header: header, trustedProxies: header == nil ? [] : proxies)
    }

    /// `IAP_AUTH_MAX_LIFETIME`: whole seconds, or a number with `s`, `m`, `h` or `d`; one second to a year.
    static func maxLifetime(_ text: String) throws -> TimeInterval {
        let units: [Character: Double] = ["s": 1, "m": 60, "h": 3600, "d": 86_400]
        let trimmed = text.trimmingCharacters(in: .whitespaces).lowercased()
        let unit = trimmed.last.flatMap { units[$0] }
        let number = unit == nil ? trimmed : String(trimmed.dropLast())
        guard let value = Int(number), value > 0, case let seconds = Double(value) * (unit ?? 1), seconds <= 366 * 86_400 else {
            throw ValidationError("\(Setting.authMaxLifetime.variable) must be a duration such as 3600, 90m, 24h or 7d (at most a year), got '\(text)'")
        }
        return seconds
    }

    /// How app users authenticate. `jwt` (the default, `off` for dev) needs exactly one key:
    /// IAP_AUTH_HS256_SECRET (or its _FILE; never a flag) or IAP_AUTH_PUBLIC_KEY_PATH.
    func authentication(dev: Bool = false) async throws -> UserAuthentication {
        let reader = SettingReader()
        switch reader.string(auth, .auth, default: Setting.auth.fallback(dev: dev)) {
        case "off":
            return .off
        case "jwt":
            let lifetime = try Self.maxLifetime(reader.string(authMaxLifetime, .authMaxLifetime))
            let secret = try reader.secret(.authHS256Secret)
            let keyPath = reader.optionalString(authPublicKeyPath, .authPublicKeyPath)
            let key: UserTokenVerifier.Key
            switch (secret, keyPath) {
            case (let secret?, nil):
                key = .hs256(secret: secret)
            case (nil, let path?):
                do {
                    key = .publicKey(try String(contentsOfFile: path, encoding: .utf8))
                } catch {
                    throw ValidationError("\(Setting.authPublicKeyPath.variable): cannot read \(path): \(error.localizedDescription)")
                }
            case (nil, nil):
                throw ValidationError(
                    "\(Setting.auth.variable)=jwt (the default) needs \(Setting.authHS256Secret.variable) (or \(Setting.authHS256Secret.fileVariable)) or \(Setting.authPublicKeyPath.variable); \(Setting.auth.variable)=off is for local development only")
            case (_?, _?):
                throw ValidationError("set one of \(Setting.authHS256Secret.variable) and \(Setting.authPublicKeyPath.variable), not both")
            }
            do {
                return .jwt(
                    try await UserTokenVerifier(
                        key: key, audience: reader.optionalString(authAudience, .authAudience),
                        issuer: reader.optionalString(authIssuer, .authIssuer), maxLifetime: lifetime))
            } catch {
                throw ValidationError(keyPath == nil ? "\(Setting.authHS256Secret.variable): \(error)" : "\(Setting.authPublicKeyPath.variable): \(error)")
            }
        case let other:
            throw ValidationError("\(Setting.auth.variable) must be jwt or off; got '\(other)'")
        }
    }
}

struct VerifierOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp(Setting.bundleIds.help))
    var bundleIds: String?

    @Option(name: .long, help: ArgumentHelp(Setting.appStoreVerifyURL.help))
    var verifyURL: String?

    @Option(name: .long, help: ArgumentHelp(Setting.appStoreSandboxVerifyURL.help))
    var sandboxVerifyURL: String?

    @Option(name: .long, help: ArgumentHelp(Setting.appStoreTimeoutSeconds.help))
    var appleTimeoutSeconds: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.verifierConcurrency.help))
    var concurrency: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.retryDelays.help))
    var retryDelays: String?

    @Option(name: .long, help: ArgumentHelp(Setting.maxRetryAgeHours.help))
    var maxRetryAgeHours: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.sandbox.help))
    var sandbox: String?

    @Option(name: .long, help: ArgumentHelp(Setting.sandboxAllowlist.help))
    var sandboxAllowlist: String?

    func sandboxPolicy() throws -> SandboxPolicy {
        try Self.sandboxPolicy(flag: sandbox, allowlistFlag: sandboxAllowlist)
    }

    /// IAP_SANDBOX and IAP_SANDBOX_ALLOWLIST (or their flags): which sandbox purchases are
    /// credited, by uploads and by notifications alike.
    static func sandboxPolicy(flag sandbox: String? = nil, allowlistFlag sandboxAllowlist: String? = nil) throws -> SandboxPolicy {
        let reader = SettingReader()
        switch reader.string(sandbox, .sandbox) {
        case "accept": return .accept
        case "reject": return .reject
        case "allowlist":
            let users = (reader.optionalString(sandboxAllowlist, .sandboxAllowlist) ?? "")
                .split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty }
            guard !users.isEmpty else {
                throw ValidationError("\(Setting.sandbox.variable)=allowlist needs \(Setting.sandboxAllowlist.variable) with at least one user id")
            }
            return .allowlist(Set(users))
        case let other:
            throw ValidationError("\(Setting.sandbox.variable) must be accept, reject or allowlist; got '\(other)'")
        }
    }

    /// IAP_RESTORE: what a restore uploaded by another user than the owner does.
    static func restorePolicy() throws -> RestorePolicy {
        let raw = SettingReader().string(nil, .restore)
        guard let policy = RestorePolicy(rawValue: raw) else {
            throw ValidationError("\(Setting.restore.variable) must be keep or transfer; got '\(raw)'")
        }
        return policy
    }

    @Option(name: .long, help: ArgumentHelp(Setting.breakerFailures.help))
    var breakerFailures: Int?

    @Option(name: .long, help: ArgumentHelp(Setting.breakerOpenSeconds.help))
    var breakerOpenSeconds: Int?

    /// The shared secret comes from IAP_APPSTORE_SHARED_SECRET or IAP_APPSTORE_SHARED_SECRET_FILE only.
    func verifyReceiptSettings(endpointsOverride: VerifyReceiptEndpoints? = nil, dev: Bool = false) throws
        -> VerifyReceiptClient.Settings
    {
        let reader = SettingReader()
        let ids = try readBundleIds(bundleIds, default: dev ? Setting.bundleIds.devFallback : nil)
        let endpoints =
            endpointsOverride
            ?? VerifyReceiptEndpoints(
                production: reader.string(verifyURL, .appStoreVerifyURL, default: VerifyReceiptEndpoints.apple.production),
                sandbox: reader.string(
                    sandboxVerifyURL, .appStoreSandboxVerifyURL, default: VerifyReceiptEndpoints.apple.sandbox))
        for (variable, url) in [(Setting.appStoreVerifyURL.variable, endpoints.production), (Setting.appStoreSandboxVerifyURL.variable, endpoints.sandbox)] {
            guard let parsed = URL(string: url), ["http", "https"].contains(parsed.scheme ?? ""), parsed.host != nil else {
                throw ValidationError("\(variable) must be an http(s) URL, got '\(url)'")
            }
        }
        return VerifyReceiptClient.Settings(
            endpoints: endpoints, sharedSecret: try reader.secret(.appStoreSharedSecret), bundleIds: ids,
            timeout: .seconds(try reader.int(appleTimeoutSeconds, .appStoreTimeoutSeconds, in: 1...300)))
    }

    func verifierSettings(names: PipelineNames) throws -> VerifierSettings {
        let reader = SettingReader()
        let rawDelays = reader.string(retryDelays, .retryDelays)
        let delays = rawDelays.split(separator: ",").compactMap { Int($0.trimmingCharacters(in: .whitespaces)) }
        guard !delays.isEmpty, delays.count == rawDelays.split(separator: ",").count, delays.allSatisfy({ $0 > 0 }) else {
            throw ValidationError("\(Setting.retryDelays.variable) must be positive whole seconds separated by commas, got '\(rawDelays)'")
        }
        return VerifierSettings(
            names: names,
            concurrency: try reader.int(concurrency, .verifierConcurrency, in: 1...10_000),
            retrySchedule: RetrySchedule(delaysSeconds: delays),
            maxRetryAge: .seconds(try reader.int(maxRetryAgeHours, .maxRetryAgeHours, in: 1...8760) * 3600),
            sandboxPolicy: try sandboxPolicy(),
            circuitBreaker: CircuitBreaker.Settings(
                failureThreshold: try reader.int(breakerFailures, .breakerFailures, in: 1...100_000),
                openDuration: .seconds(try reader.int(breakerOpenSeconds, .breakerOpenSeconds, in: 1...3600))))
    }
}

struct FakeAppStoreOptions: ParsableArguments {
    @Option(name: .customLong("fake-appstore-host"), help: ArgumentHelp(Setting.fakeAppStoreHost.help))
    var fakeAppStoreHost: String?

    @Option(name: .customLong("fake-appstore-port"), help: ArgumentHelp(Setting.fakeAppStorePort.help))
    var fakeAppStorePort: Int?

    @Option(name: .customLong("fake-appstore-database-path"), help: ArgumentHelp(Setting.fakeDatabasePath.help))
    var fakeAppStoreDatabasePath: String?

    /// The fake's SQLite file; `beside`, a file in whose folder the default goes (`iap dev`
    /// keeps it beside the order store).
    func databasePath(beside other: String? = nil) -> String {
        let fallback = other.map {
            URL(fileURLWithPath: $0).deletingLastPathComponent().appendingPathComponent(Setting.fakeDatabasePath.fallback ?? "").path
        }
        return SettingReader().string(fakeAppStoreDatabasePath, .fakeDatabasePath, default: fallback)
    }

    @Option(name: .customLong("fake-api-key-path"), help: ArgumentHelp(Setting.fakeAPIKeyPath.help))
    var fakeAPIKeyPath: String?

    @Option(name: .customLong("fake-api-key-id"), help: ArgumentHelp(Setting.fakeAPIKeyId.help))
    var fakeAPIKeyId: String?

    @Option(name: .customLong("fake-issuer-id"), help: ArgumentHelp(Setting.fakeIssuerId.help))
    var fakeIssuerId: String?

    @Option(name: .customLong("fake-notification-url"), help: ArgumentHelp(Setting.fakeNotificationURL.help))
    var fakeNotificationURL: String?

    /// The Server API key the fake checks tokens against, if configured.
    func apiKey() throws -> FakeServerAPIKey? {
        let reader = SettingReader()
        guard let path = reader.optionalString(fakeAPIKeyPath, .fakeAPIKeyPath) else { return nil }
        guard let keyId = reader.optionalString(fakeAPIKeyId, .fakeAPIKeyId),
            let issuerId = reader.optionalString(fakeIssuerId, .fakeIssuerId)
        else {
            throw ValidationError("\(Setting.fakeAPIKeyPath.variable) needs \(Setting.fakeAPIKeyId.variable) and \(Setting.fakeIssuerId.variable)")
        }
        do {
            return try FakeServerAPIKey(
                privateKeyPEM: try String(contentsOfFile: path, encoding: .utf8), keyId: keyId, issuerId: issuerId)
        } catch {
            throw ValidationError("\(Setting.fakeAPIKeyPath.variable): \(path) is not a readable P-256 PEM private key")
        }
    }

    func notificationURL() -> String? {
        SettingReader().optionalString(fakeNotificationURL, .fakeNotificationURL)
    }

    func address() throws -> (host: String, port: Int) {
        let reader = SettingReader()
        return (
            reader.string(fakeAppStoreHost, .fakeAppStoreHost),
            try reader.int(fakeAppStorePort, .fakeAppStorePort, in: 0...65535)
        )
    }
}

struct StoreKitOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp(Setting.appStoreKeyPath.help))
    var appstoreKeyPath: String?

    @Option(name: .long, help: ArgumentHelp(Setting.appStoreKeyId.help))
    var appstoreKeyId: String?

    @Option(name: .long, help: ArgumentHelp(Setting.appStoreIssuerId.help))
    var appstoreIssuerId: String?

    @Option(name: .long, help: ArgumentHelp(Setting.appStoreAPIURL.help))
    var appstoreApiURL: String?

    @Option(name: .long, help: ArgumentHelp(Setting.appStoreSandboxAPIURL.help))
    var appstoreSandboxApiURL: String?

    @Option(name: .long, help: ArgumentHelp(Setting.appStoreAPIRateShare.help))
    var appstoreApiRateShare: Double?

    @Option(name: .long, help: ArgumentHelp(Setting.appAppleId.help))
    var appAppleId: Int64?

    @Option(name: .long, help: ArgumentHelp(Setting.confirmWithAPI.help))
    var confirmWithAPI: String?

    @Option(name: .long, help: ArgumentHelp(Setting.receiptsVia.help))
    var receiptsVia: String?

    @Option(name: .long, help: ArgumentHelp(Setting.trustedRoots.help))
    var trustedRoots: String?

    @Option(name: .long, help: ArgumentHelp(Setting.environment.help))
    var environment: String?

    @Option(name: .long, help: ArgumentHelp(Setting.xcodeCertificate.help))
    var xcodeCertificate: String?

    @Option(name: .long, help: ArgumentHelp(Setting.finishTransactions.help))
    var finishTransactions: String?

    /// StoreKit 2 settings; `bundleIds` names the app of the Server API key (exactly one).
    func settings(bundleIds: Set<String>, defaults: StoreKitSettings = .init()) throws -> StoreKitSettings {
        let reader = SettingReader()
        var settings = defaults
        if let roots = try readTrustedRoots(trustedRoots) { settings.trustedRoots = roots }
        if let appAppleId = try readOptionalInt64(appAppleId, .appAppleId) { settings.appAppleId = appAppleId }
        switch reader.string(confirmWithAPI, .confirmWithAPI, default: settings.confirmWithAPI ? "true" : nil) {
        case "true": settings.confirmWithAPI = true
        case "false": settings.confirmWithAPI = false
        case let other: throw ValidationError("\(Setting.confirmWithAPI.variable) must be true or false, got '\(other)'")
        }
        if let keyPath = reader.optionalString(appstoreKeyPath, .appStoreKeyPath) {
            guard let keyId = reader.optionalString(appstoreKeyId, .appStoreKeyId),
                let issuerId = reader.optionalString(appstoreIssuerId, .appStoreIssuerId)
            else {
                throw ValidationError("\(Setting.appStoreKeyPath.variable) needs \(Setting.appStoreKeyId.variable) and \(Setting.appStoreIssuerId.variable)")
            }
            guard bundleIds.count == 1, let bundleId = bundleIds.first else {
                throw ValidationError("the App Store Server API key serves one app: set exactly one bundle id in \(Setting.bundleIds.variable)")
            }
            let pem: String
            do {
                pem = try String(contentsOfFile: keyPath, encoding: .utf8)
            } catch {
                throw ValidationError("\(Setting.appStoreKeyPath.variable): cannot read \(keyPath): \(error.localizedDescription)")
            }
            let share = appstoreApiRateShare ?? Double(reader.string(nil, .appStoreAPIRateShare))
            guard let share, share > 0, share <= 1 else {
                throw ValidationError("\(Setting.appStoreAPIRateShare.variable) must be a number above 0 and at most 1")
            }
            settings.serverAPI = AppStoreServerAPIClient.Settings(
                keyId: keyId, issuerId: issuerId, privateKeyPEM: pem, bundleId: bundleId,
                productionURL: reader.string(appstoreApiURL, .appStoreAPIURL),
                sandboxURL: reader.string(
                    appstoreSandboxApiURL, .appStoreSandboxAPIURL),
                rateShare: share)
            do {
                _ = try ES256PrivateKey(pem: pem)
            } catch {
                throw ValidationError("\(Setting.appStoreKeyPath.variable): \(keyPath) is not a P-256 private key in PEM (.p8)")
            }
        }
        switch reader.optionalString(receiptsVia, .receiptsVia) {
        case nil:
            // verifyReceipt: Apple's answer vouches for the receipt. The Server API route reads
            // the receipt without checking its signature, so what it lists proves no ownership
            // (held as owner_unknown without an appAccountToken); it is chosen, never a default.
            settings.receiptsThroughServerAPI = false
        case "server-api":
            guard settings.serverAPI != nil else {
                throw ValidationError("\(Setting.receiptsVia.variable)=server-api needs the App Store Server API key (\(Setting.appStoreKeyPath.variable))")
            }
            settings.receiptsThroughServerAPI = true
        case "verify-receipt": settings.receiptsThroughServerAPI = false
        case "local":
            // The receipt's signature is the proof, checked offline; Apple is not asked.
            settings.receiptsThroughServerAPI = false
            settings.localReceipts = true
        case let other?:
            throw ValidationError("\(Setting.receiptsVia.variable) must be local, server-api or verify-receipt, got '\(other)'")
        }
        switch reader.string(environment, .environment) {
        case "production":
            guard reader.optionalString(xcodeCertificate, .xcodeCertificate) == nil else {
                throw ValidationError("\(Setting.xcodeCertificate.variable) is for \(Setting.environment.variable)=xcode only")
            }
        case "xcode":
            guard let path = reader.optionalString(xcodeCertificate, .xcodeCertificate) else {
                throw ValidationError("\(Setting.environment.variable)=xcode needs Xcode's certificate in \(Setting.xcodeCertificate.variable)")
            }
            do {
                settings.xcodeCertificate = try certificate(atPath: path)
            } catch {
                throw ValidationError("\(Setting.xcodeCertificate.variable): \(path) is not a readable certificate: \(error)")
            }
        case let other:
            throw ValidationError("\(Setting.environment.variable) must be production or xcode, got '\(other)'")
        }
        let modes = FinishMode.allCases.map(\.rawValue).joined(separator: ", ")
        switch reader.optionalString(finishTransactions, .finishTransactions) {
        case nil: settings.finishTransactions = settings.serverAPI == nil ? .app : .both
        case let raw?:
            guard let mode = FinishMode(rawValue: raw) else {
                throw ValidationError("\(Setting.finishTransactions.variable) must be one of \(modes), got '\(raw)'")
            }
            guard !mode.serverFinishes || settings.serverAPI != nil else {
                throw ValidationError("\(Setting.finishTransactions.variable)=\(raw) needs the App Store Server API key (\(Setting.appStoreKeyPath.variable))")
            }
            settings.finishTransactions = mode
        }
        let consents = ConsumptionAnswer.Consent.allCases.map(\.rawValue).joined(separator: ", ")
        let consent = reader.string(nil, .consumptionConsent)
        guard let consumptionConsent = ConsumptionAnswer.Consent(rawValue: consent) else {
            throw ValidationError("\(Setting.consumptionConsent.variable) must be one of \(consents), got '\(consent)'")
        }
        settings.consumption.consent = consumptionConsent
        switch reader.string(nil, .refundPreference) {
        case "none": settings.consumption.refundPreference = nil
        case let preference where ConsumptionAnswer.Settings.refundPreferences.contains(preference):
            settings.consumption.refundPreference = preference
        case let other:
            let allowed = ConsumptionAnswer.Settings.refundPreferences.sorted().joined(separator: ", ")
            throw ValidationError("\(Setting.refundPreference.variable) must be none or one of \(allowed), got '\(other)'")
        }
        switch reader.string(nil, .sampleContentProvided) {
        case "true": settings.consumption.sampleContentProvided = true
        case "false": settings.consumption.sampleContentProvided = false
        case let other: throw ValidationError("\(Setting.sampleContentProvided.variable) must be true or false, got '\(other)'")
        }
        return settings
    }
}

/// What the intake checks App Store notifications against, for `iap intake` and `iap orders`
/// (`iap verifier` and `iap dev` read the same variables with their own options).
struct NotificationOptions: ParsableArguments {
    @Option(name: .long, help: ArgumentHelp(Setting.bundleIds.help))
    var bundleIds: String?

    @Option(name: .long, help: ArgumentHelp(Setting.appAppleId.help))
    var appAppleId: Int64?

    @Option(name: .long, help: ArgumentHelp(Setting.trustedRoots.help))
    var trustedRoots: String?

    /// Sets the bundle ids, roots and app id the intake checks each notification against, and
    /// where `verifyReceipt` is (from the environment only, as the verifier reads it): the
    /// intake refuses at its door a receipt whose certificates cannot lead to Apple's roots only
    /// where `verifyReceipt` is Apple's own or the roots are named.
    func apply(to settings: inout PipelineSettings) throws {
        settings.verifyReceipt.bundleIds = try readBundleIds(bundleIds, default: nil, purpose: "notifications")
        let reader = SettingReader()
        settings.verifyReceipt.endpoints = VerifyReceiptEndpoints(
            production: reader.string(nil, .appStoreVerifyURL, default: VerifyReceiptEndpoints.apple.production),
            sandbox: reader.string(nil, .appStoreSandboxVerifyURL, default: VerifyReceiptEndpoints.apple.sandbox))
        if let roots = try readTrustedRoots(trustedRoots) { settings.storeKit.trustedRoots = roots }
        if let appAppleId = try readOptionalInt64(appAppleId, .appAppleId) { settings.storeKit.appAppleId = appAppleId }
    }
}

/// IAP_BUNDLE_IDS (or its flag): one or more bundle ids, separated by commas; required.
private func readBundleIds(_ flag: String?, default fallback: String?, purpose: String = "receipts") throws -> Set<String> {
    guard let raw = SettingReader().optionalString(flag, .bundleIds) ?? fallback else {
        throw ValidationError("\(Setting.bundleIds.variable) is required: the bundle ids whose \(purpose) this deployment accepts")
    }
    let ids = Set(raw.split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty })
    guard !ids.isEmpty else { throw ValidationError("\(Setting.bundleIds.variable) names no bundle id") }
    return ids
}

/// IAP_TRUSTED_ROOTS (or its flag): certificate files, separated by commas; nil when unset.
private func readTrustedRoots(_ flag: String?) throws -> [Certificate]? {
    guard let paths = SettingReader().optionalString(flag, .trustedRoots) else { return nil }
    return try paths.split(separator: ",").map { path in
        let path = path.trimmingCharacters(in: .whitespaces)
        do {
            return try certificate(atPath: path)
        } catch {
            throw ValidationError("\(Setting.trustedRoots.variable): \(path) is not a readable certificate: \(error)")
        }
    }
}

private func readOptionalInt64(_ flag: Int64?, _ setting: Setting) throws -> Int64? {
    if let flag { return flag }
    guard let raw = SettingReader().optionalString(nil, setting) else { return nil }
    guard let value = Int64(raw) else { throw ValidationError("\(setting.variable) must be a whole number, got '\(raw)'") }
    return value
}
