import Foundation

/// What the user may use now (`GET /v1/users/{userId}/entitlements`), possibly from the last
/// answer kept on disk.
public struct Entitlements: Codable, Sendable, Equatable {
    /// A grant in force.
    public struct Grant: Codable, Sendable, Equatable {
        /// The purchase it came from.
        public var transactionId: String
        /// The product.
        public var productId: String
        /// Units bought.
        public var quantity: Int
        /// `active`.
        public var state: String
        /// When a period ends, for a subscription's grant.
        public var expiresAt: String?
    }

    /// A subscription that has not expired.
    public struct Subscription: Codable, Sendable, Equatable {
        /// Its chain.
        public var originalTransactionId: String
        /// The product.
        public var productId: String
        /// `active`, `grace_period`, `billing_retry`.
        public var state: String
        /// When the current period ends.
        public var expiresDate: String?
    }

    /// Grants in force.
    public var grants: [Grant]
    /// Subscriptions not expired.
    public var subscriptions: [Subscription]
    /// Each numeric grant of the consumables, summed (`["coins": 180]`).
    public var balances: [String: Int]
    /// When the service gave this answer.
    public var fetchedAt: Date
    /// True when the service could not be asked and this is the last answer kept on disk: show
    /// it, and ask again later.
    public var isStale: Bool

    /// The products the user may use now: every grant's product and every subscription's.
    public var productIds: Set<String> {
        Set(grants.map(\.productId) + subscriptions.map(\.productId))
    }
}

/// The last entitlements answer of each user, kept in a folder so that an offline launch still
/// knows what the user has (marked stale).
struct EntitlementsCache: Sendable {
    let directory: URL

    func read(userId: String) -> Entitlements? {
        guard let data = try? Data(contentsOf: file(of: userId)) else { return nil }
        return try? FileTransactionStore.decoder.decode(Entitlements.self, from: data)
    }

    func write(_ entitlements: Entitlements, userId: String) {
        // A cache: a write that fails costs an offline launch its last answer, nothing more.
        try? FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        guard let data = try? FileTransactionStore.encoder.encode(entitlements) else { return }
        try? data.write(to: file(of: userId), options: .atomic)
    }

    private func file(of userId: String) -> URL {
        directory.appendingPathComponent("entitlements-" + userId.utf8.map { String(format: "%02x", $0) }.joined() + ".json")
    }
}
