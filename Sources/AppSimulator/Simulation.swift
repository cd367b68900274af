import Crypto
public import Foundation
public import IAPClient

/// Devices buying through `IAPClient` as apps do: each its own user, fake App Store device and
/// queue folder; started again on the same folder it resumes what the folder holds and buys
/// only what is left. Its summary is checked against who really paid: the fake App Store's
/// purchases and the order service's grants, never against the client's own word.
public struct Simulation: Sendable {
    /// What to run.
    public struct Settings: Sendable {
        /// The order service (or a proxy in front of it).
        public var intakeURL: URL
        /// The fake App Store.
        public var fakeURL: URL
        /// The app's bundle id.
        public var bundleId: String
        /// The folder of the devices' queues (one folder per device).
        public var queueDirectory: URL
        /// Devices, each its own user.
        public var devices: Int
        /// Purchases in all, shared among the devices.
        public var purchases: Int
        /// Chooses the users, the products and the jitter.
        public var seed: UInt64
        /// A file to append one JSON line to per purchase minted and per purchase settled.
        public var reportFile: URL?
        /// Signs the users' tokens (HS256, as `IAP_AUTH_HS256_SECRET`); nil when the service
        /// runs without user authentication.
        public var authSecret: String?
        /// The devices' retry policy.
        public var retry: RetryPolicy
        /// How long to wait for the queues to empty once everything is bought.
        public var drainTimeout: Duration

        /// Settings.
        public init(
            intakeURL: URL, fakeURL: URL, bundleId: String, queueDirectory: URL, devices: Int, purchases: Int, seed: UInt64,
            reportFile: URL? = nil, authSecret: String? = nil, retry: RetryPolicy = RetryPolicy(), drainTimeout: Duration = .seconds(600)
        ) {
            self.intakeURL = intakeURL
            self.fakeURL = fakeURL
            self.bundleId = bundleId
            self.queueDirectory = queueDirectory
            self.devices = devices
            self.purchases = purchases
            self.seed = seed
            self.reportFile = reportFile
            self.authSecret = authSecret
            self.retry = retry
            self.drainTimeout = drainTimeout
        }
    }

    /// What happened, from the fake App Store's purchases and the service's grants.
    public struct Summary: Codable, Sendable, Equatable {
        /// Purchases Apple (the fake) charged for, on these devices.
        public var minted = 0
        /// Of those, credited by the order service.
        public var credited = 0
        /// Finished before the service credited them (or finished and never credited).
        public var finishedBeforeCredited = 0
        /// Never finished.
        public var finishedNever = 0
        /// Charged, never credited, and not in any queue: a dropped order.
        public var lost = 0
        /// Credited more than once, or credited without a purchase.
        public var doubled = 0
        /// Entries left in the queues.
        public var queueLeft = 0
        /// Uploads the service accepted, over the purchases this run saw finished.
        public var uploads = 0
        /// Exchanges tried again after a failure, over the same purchases.
        public var retries = 0
    }

    let settings: Settings

    /// A simulation of `settings`.
    public init(settings: Settings) {
        self.settings = settings
    }

    /// Runs every device until it has bought its share and its queue is empty (or the drain
    /// timeout passed), then counts.
    public func run() async throws -> Summary {
        let transport = AsyncHTTPClientTransport(timeout: .seconds(10))
        let catalog = try await products(transport)
        guard !catalog.isEmpty else { throw Simulation.Failure(description: "the service's catalog is empty") }
        let report = try settings.reportFile.map(ReportFile.init(url:))
        try await withThrowingTaskGroup(of: Void.self) { group in
            for index in 0..<settings.devices {
                group.addTask {
                    try await device(index).run(catalog: catalog, transport: transport, report: report)
                }
            }
            try await group.waitForAll()
        }
        return try await count(transport)
    }

    /// What went wrong running the simulation.
    public struct Failure: Error, CustomStringConvertible {
        /// What.
        public var description: String
    }

    func device(_ index: Int) -> SimulatedDevice {
        let share = settings.purchases / max(settings.devices, 1) + (index < settings.purchases % max(settings.devices, 1) ? 1 : 0)
        let tag = String(settings.seed, radix: 16)
        return SimulatedDevice(
            index: index, userId: "sim-\(tag)-user-\(index)", deviceId: "sim-\(tag)-device-\(index)",
            folder: settings.queueDirectory.appendingPathComponent("device-\(index)"), purchases: share, settings: settings)
    }

    /// The products for sale and their types (`GET /v1/products`), asked until answered.
    private func products(_ transport: any HTTPTransport) async throws -> [String: String] {
        struct Catalog: Decodable {
            struct Product: Decodable {
                var productId: String
                var type: String
            }
            var products: [Product]
        }
        let data = try await Self.getUntilAnswered(settings.intakeURL.appendingPathComponent("v1/products"), token: nil, transport)
        let catalog = try JSONDecoder().decode(Catalog.self, from: data)
        return Dictionary(catalog.products.map { ($0.productId, $0.type) }, uniquingKeysWith: { first, _ in first })
    }

    /// The summary: each device's purchases at the fake App Store against the user's grants.
    private func count(_ transport: any HTTPTransport) async throws -> Summary {
        var summary = Summary()
        for index in 0..<settings.devices {
            let device = device(index)
            let source = device.source(transport: transport, catalog: [:])
            let bought = try await source.deviceTransactions()
            let grants = try await device.grants(transport)
            let queued = try FileTransactionStore(directory: device.folder).entries()
            let stats = device.readStats()
            summary.uploads += stats.uploads
            summary.retries += stats.retries
            summary.queueLeft += queued.count
            let minted = Set(bought.map(\.transactionId))
            var grantCount: [String: Int] = [:]
            for grant in grants { grantCount[grant.transactionId, default: 0] += 1 }
            summary.doubled += grantCount.values.filter { $0 > 1 }.count + grantCount.keys.filter { !minted.contains($0) }.count
            for purchase in bought {
                summary.minted += 1
                let grant = grants.first { $0.transactionId == purchase.transactionId }
                if grant != nil { summary.credited += 1 }
                guard let finished = purchase.finishedDateMs.flatMap(Double.init) else {
                    summary.finishedNever += 1
                    if grant == nil, !queued.contains(where: { $0.transactionId == purchase.transactionId }) { summary.lost += 1 }
                    continue
                }
                // `grantedAt` is to the second, rounded down: a finish before it is surely early.
                if let grant, let granted = UploadDates.date(grant.grantedAt), finished / 1000 >= granted.timeIntervalSince1970 {
                    continue
                }
                summary.finishedBeforeCredited += 1
                if grant == nil { summary.lost += 1 }
            }
        }
        return summary
    }

    /// GET `url` until the service answers 200 (through a flaky network), at most 200 times.
    static func getUntilAnswered(_ url: URL, token: String?, _ transport: any HTTPTransport) async throws -> Data {
        var headers: [String: String] = [:]
        if let token { headers["Authorization"] = "Bearer \(token)" }
        var last = ""
        for attempt in 0..<200 {
            do {
                let answer = try await transport.send(HTTPExchange(method: "GET", url: url, headers: headers))
                if answer.status == 200 { return answer.body }
                last = "HTTP \(answer.status)"
                if (400..<500).contains(answer.status), answer.status != 408, answer.status != 429 { break }
            } catch {
                last = "\(error)"
            }
            try await Task.sleep(for: .milliseconds(min(50 * (attempt + 1), 1000)))
        }
        throw Failure(description: "GET \(url.path) went unanswered: \(last)")
    }

    /// An HS256 token for `userId`, as the service's `IAP_AUTH=jwt` with a shared secret checks it.
    static func token(userId: String, secret: String) -> String {
        func part(_ data: Data) -> String {
            data.base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_")
                .replacingOccurrences(of: "=", with: "")
        }
        let now = Int(Date().timeIntervalSince1970)
        let header = part(Data(#"{"alg":"HS256","typ":"JWT"}"#.utf8))
        let claims: [String: Any] = ["sub": userId, "iat": now, "exp": now + 3600]
        let payload = part((try? JSONSerialization.data(withJSONObject: claims, options: [.sortedKeys])) ?? Data())
        let signature = HMAC<SHA256>.authenticationCode(for: Data("\(header).\(payload)".utf8), using: SymmetricKey(data: Data(secret.utf8)))
        return "\(header).\(payload).\(part(Data(signature)))"
    }
}

/// Dates as the service writes them (ISO 8601, with or without fractions of a second).
enum UploadDates {
    static func date(_ text: String) -> Date? {
        let formatter = ISO8601DateFormatter()
        formatter.formatOptions = [.withInternetDateTime, .withFractionalSeconds]
        if let date = formatter.date(from: text) { return date }
        formatter.formatOptions = [.withInternetDateTime]
        return formatter.date(from: text)
    }
}
