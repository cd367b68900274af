import Crypto
import Foundation
import GRDB
import NIOConcurrencyHelpers

/// What the fake App Store remembers, like Apple never forgetting: every purchase it minted
/// and every receipt it issued, in its own SQLite file (or in memory for tests).
final class FakeLedger: Sendable {
    /// One minted purchase, as Apple would hold it.
    struct Purchase: Sendable, Equatable {
        var transactionId: String
        var originalTransactionId: String
        var productId: String
        var type: String
        var quantity: Int
        var purchaseDate: Date
        var originalPurchaseDate: Date
        var expiresDate: Date?
        var webOrderLineItemId: String?
        var cancellationDate: Date?
        var environment: String
        var bundleId: String
        var applicationUsername: String?
        var deviceId: String
        /// `PURCHASED`, or `FAMILY_SHARED` for a purchase a family member shares.
        var inAppOwnershipType = "PURCHASED"
        /// `PURCHASE` (a purchase or a restore of one), or `RENEWAL` (a period Apple billed).
        var transactionReason = "PURCHASE"
        /// With `cancellationDate`: REFUND_FULL, REFUND_PRORATED or FAMILY_REVOKE.
        var revocationType: String? = nil
        /// For REFUND_PRORATED: the share refunded, in milli-units of 100 %.
        var revocationPercentage: Int? = nil
        /// A subscription period the customer upgraded from (Apple's `isUpgraded`,
        /// `is_upgraded`): the higher tier's period began when this one was replaced.
        var isUpgraded = false
        /// When the app finished the transaction (`finishTransaction`); a finished consumable
        /// leaves the device's later receipts.
        var finishedDate: Date? = nil
        /// A StoreKit 1 restore the receipt never holds: receipts list this transaction (the
        /// one restored) in its place.
        var receiptTransactionId: String? = nil
        /// Where its last change stands in the order of every change the fake made: the order
        /// Get Transaction History sorts by (Apple sorts by the date a transaction last
        /// changed), and what a `revision` counts from.
        var modifiedSeq: Int64 = 0
        /// What the customer paid and under which offer, as the purchase was minted (JSON of
        /// `FakeLedger.Terms`); nil: the product's list price, no offer.
        var terms: String? = nil
    }

    /// A purchase's price and offer, as `POST /fake/purchases` takes them: the price in
    /// milli-units (default 990) and its currency (default USD); an offer (`offerType` 1
    /// introductory, 2 promotional, 3 offer code, 4 win-back, `offerIdentifier`,
    /// `offerDiscountType`, `offerPeriod`) and `billingPlanType`, as the signed transactions then
    /// say (renewals are at the list price); and for a migrated subscription the auto-renewable
    /// chain it continues.
    /// A product's list price in milli-units: what a purchase minted without a price costs,
    /// and what a subscription renews at until Apple raises it.
    static let listPrice: Int64 = 990

    struct Terms: Codable, Sendable {
        var price: Int64?
        var currency: String?
        var offerType: Int?
        var offerIdentifier: String?
        var offerDiscountType: String?
        var offerPeriod: String?
        var billingPlanType: String?
        /// The chain a migrated subscription continues (its first period only).
        var previousOriginalTransactionId: String?
        /// A commitment plan (an auto-renewable subscription committed to for several periods):
        /// this period's number, how many, and the whole commitment's price; its end follows
        /// from the period's length.
        var commitmentBillingPeriod: Int?
        var commitmentTotalPeriods: Int?
        var commitmentPrice: Int64?
    }

    /// What a receipt held when it was issued.
    struct Receipt: Sendable {
        var bundleId: String
        var environment: String
        var deviceId: String
        var createdAt: Date
        var purchases: [Purchase]
    }

    /// A purchase to mint.
    struct Order: Sendable {
        var bundleId: String
        var productId: String
        var environment: String
        var type: String
        var quantity: Int
        var applicationUsername: String?
        var deviceId: String?
        var expiresIn: TimeInterval?
        /// Shared by a family member (`FAMILY_SHARED`); only non-consumables and subscriptions.
        var familyShared = false
        /// A seat an organization assigned (multiseat, `ASSIGNED`); only auto-renewable
        /// subscriptions, `quantity` the purchase's seats.
        var assigned = false
        /// Its price and offer (JSON of `Terms`); nil: list price, no offer.
        var terms: String? = nil
        /// The group it puts its account in (Get Customer Groups): the organization's `ADMIN`
        /// for a purchase, a member with no role (`NONE`) for an assigned seat.
        var groupId: String? = nil
        /// Whether the receipt answered with the purchase already holds it. False gives the
        /// device's receipt as it was before (Apple tells the app about a purchase before its
        /// receipt is refreshed); `refreshReceipt` gives the one that holds it.
        var receiptIncludesPurchase = true
    }

    /// Why a restore or renewal was refused.
    enum Refusal: Error, Sendable, Equatable {
        /// No purchase (or subscription chain) with that id.
        case notFound
        /// The purchase cannot be restored, or the chain renewed; says why.
        case conflict(String)
    }

    /// An injected misbehaviour for the next `verifyReceipt` calls.
    struct Fault: Sendable, Codable {
        /// Answer with this Apple status instead of the real one.
        var status: Int?
        /// Answer with this HTTP status and an empty body.
        var httpStatus: Int?
        /// Wait this long before answering.
        var delayMs: Int?
        /// How many calls the fault applies to (default 1); 0 means until cleared.
        var count: Int?
        /// Only for receipts that hold this transaction.
        var transactionId: String?
        /// Add Apple's retry flag to a status answer (`is_retryable`).
        var retryable: Bool?
    }

    private struct Volatile {
        var faults: [Fault] = []
        var latencyMs = 0
        var errorRate = 0.0
        var verifyReceiptCalls = 0
        var serverAPICalls = 0
        var notifications: [SentNotification] = []
        /// Notifications signed while held (`POST /fake/notifications/hold`), waiting for
        /// release; nil when notifications go out as they are signed.
        var held: [HeldNotification]?
        var consumption: [String: [String]] = [:]
        /// Whether a one-time purchase sends ONE_TIME_CHARGE (Apple does).
        var sendsOneTimeCharge = true
    }

    let database: DatabaseQueue
    private let volatile = NIOLockedValueBox(Volatile())

    /// Opens the ledger at `path`, or in memory when `path` is nil.
    init(path: String?) throws {
        if let path {
            try FileManager.default.createDirectory(
                at: URL(fileURLWithPath: path).deletingLastPathComponent(), withIntermediateDirectories: true)
            var configuration = Configuration()
            configuration.busyMode = .timeout(10)
            // A stand-in for Apple: losing its last writes to a power cut is harmless, and
            // benchmarks mint purchases by the hundred thousand.
            configuration.prepareDatabase { db in try db.execute(sql: "PRAGMA synchronous = OFF") }
            database = try DatabaseQueue(path: path, configuration: configuration)
        } else {
            database = try DatabaseQueue()
        }
        try Self.migrator.migrate(database)
    }

    private static var migrator: DatabaseMigrator {
        var migrator = DatabaseMigrator()
        migrator.registerMigration("v1: purchases and receipts") { db in
            try db.execute(
                sql: """
                    CREATE TABLE purchase (
                        transactionId TEXT PRIMARY KEY NOT NULL,
                        originalTransactionId TEXT NOT NULL,
                        productId TEXT NOT NULL,
                        type TEXT NOT NULL,
                        quantity INTEGER NOT NULL,
                        purchaseDate DATETIME NOT NULL,
                        originalPurchaseDate DATETIME NOT NULL,
                        expiresDate DATETIME,
                        webOrderLineItemId TEXT,
                        cancellationDate DATETIME,
                        environment TEXT NOT NULL,
                        bundleId TEXT NOT NULL,
                        applicationUsername TEXT,
                        deviceId TEXT NOT NULL
                    );
                    CREATE INDEX purchase_device ON purchase(deviceId, bundleId, environment);
                    -- A receipt is found by the SHA-256 of its bytes, as sent to verifyReceipt.
                    CREATE TABLE receipt (
                        digest TEXT PRIMARY KEY NOT NULL,
                        bundleId TEXT NOT NULL,
                        environment TEXT NOT NULL,
                        deviceId TEXT NOT NULL,
                        transactionIds TEXT NOT NULL,
                        createdAt DATETIME NOT NULL
                    );
                    CREATE TABLE identity (
                        name TEXT PRIMARY KEY NOT NULL,
                        value BLOB NOT NULL
                    );
                    """)
        }
        migrator.registerMigration("v2: ownership and transaction reason") { db in
            try db.execute(
                sql: """
                    ALTER TABLE purchase ADD COLUMN inAppOwnershipType TEXT NOT NULL DEFAULT 'PURCHASED';
                    ALTER TABLE purchase ADD COLUMN transactionReason TEXT NOT NULL DEFAULT 'PURCHASE';
                    CREATE INDEX purchase_original ON purchase(originalTransactionId);
                    CREATE INDEX purchase_line_item ON purchase(webOrderLineItemId);
                    """)
        }
        migrator.registerMigration("v3: revocation type and percentage") { db in
            try db.execute(
                sql: """
                    ALTER TABLE purchase ADD COLUMN revocationType TEXT;
                    ALTER TABLE purchase ADD COLUMN revocationPercentage INTEGER;
                    """)
        }
        migrator.registerMigration("v4: upgraded periods") { db in
            try db.execute(sql: "ALTER TABLE purchase ADD COLUMN isUpgraded BOOLEAN NOT NULL DEFAULT 0")
        }
        migrator.registerMigration("v5: finished transactions, restores off the receipt, renewal state") { db in
            try db.execute(
                sql: """
                    ALTER TABLE purchase ADD COLUMN finishedDate DATETIME;
                    ALTER TABLE purchase ADD COLUMN receiptTransactionId TEXT;
                    -- One row per auto-renewable chain: its billing period's length and how its
                    -- renewal stands (see SubscriptionState).
                    CREATE TABLE subscription (
                        originalTransactionId TEXT PRIMARY KEY NOT NULL,
                        periodSeconds DOUBLE NOT NULL,
                        autoRenew BOOLEAN NOT NULL DEFAULT 1,
                        billingRetrySince DATETIME,
                        gracePeriodExpiresDate DATETIME,
                        expirationIntent INTEGER,
                        expiredDate DATETIME
                    );
                    """)
        }
        migrator.registerMigration("v6: Finish Transaction calls counted") { db in
            try db.execute(sql: "ALTER TABLE purchase ADD COLUMN serverFinishCalls INTEGER NOT NULL DEFAULT 0")
        }
        migrator.registerMigration("v7: transactions ordered by their last change") { db in
            // Each insert, and each change of what a signed transaction says (a refund and its
            // reversal, an upgrade, a new token, a new expiry), takes the next number: Get
            // Transaction History sorts by it and a revision answers what changed since.
            try db.execute(
                sql: """
                    ALTER TABLE purchase ADD COLUMN modifiedSeq INTEGER;
                    UPDATE purchase SET modifiedSeq = rowid;
                    CREATE INDEX purchase_modified ON purchase(modifiedSeq);
                    CREATE TRIGGER purchase_modified_on_insert AFTER INSERT ON purchase BEGIN
                        UPDATE purchase SET modifiedSeq = (SELECT coalesce(max(modifiedSeq), 0) + 1 FROM purchase)
                        WHERE rowid = NEW.rowid;
                    END;
                    CREATE TRIGGER purchase_modified_on_change
                    AFTER UPDATE OF cancellationDate, revocationType, revocationPercentage, isUpgraded, applicationUsername,
                        expiresDate ON purchase
                    WHEN OLD.cancellationDate IS NOT NEW.cancellationDate OR OLD.revocationType IS NOT NEW.revocationType
                        OR OLD.revocationPercentage IS NOT NEW.revocationPercentage OR OLD.isUpgraded IS NOT NEW.isUpgraded
                        OR OLD.applicationUsername IS NOT NEW.applicationUsername OR OLD.expiresDate IS NOT NEW.expiresDate
                    BEGIN
                        UPDATE purchase SET modifiedSeq = (SELECT coalesce(max(modifiedSeq), 0) + 1 FROM purchase)
                        WHERE rowid = NEW.rowid;
                    END;
                    """)
        }
        migrator.registerMigration("v8: price and offer of a purchase") { db in
            try db.execute(sql: "ALTER TABLE purchase ADD COLUMN terms TEXT")
        }
        migrator.registerMigration("v9: groups of multiseat subscriptions") { db in
            // Each row: an account (device) of the app in a group, with its role for a product.
            try db.execute(
                sql: """
                    CREATE TABLE group_member (
                        seq INTEGER PRIMARY KEY AUTOINCREMENT,
                        groupId TEXT NOT NULL,
                        bundleId TEXT NOT NULL,
                        environment TEXT NOT NULL,
                        deviceId TEXT NOT NULL,
                        productId TEXT NOT NULL,
                        role TEXT NOT NULL,
                        UNIQUE (groupId, bundleId, environment, deviceId, productId)
                    );
                    CREATE INDEX group_member_device ON group_member(deviceId, bundleId, environment);
                    """)
        }
        migrator.registerMigration("v10: a subscription's raised price and the customer's consent") { db in
            try db.execute(sql: "ALTER TABLE subscription ADD COLUMN renewalPrice INTEGER")
            try db.execute(sql: "ALTER TABLE subscription ADD COLUMN priceIncreaseStatus INTEGER")
        }
        migrator.registerMigration("v11: renewal-date extensions, one and for all subscribers") { db in
            try db.execute(
                sql: """
                    -- Each extension Apple made (a mass one's chains under `mass:<its identifier>`):
                    -- the same request is answered again, and two in 365 days are the most.
                    CREATE TABLE renewal_extension (
                        requestIdentifier TEXT NOT NULL,
                        originalTransactionId TEXT NOT NULL,
                        webOrderLineItemId TEXT NOT NULL,
                        effectiveDate DATETIME NOT NULL,
                        extendedAt DATETIME NOT NULL,
                        PRIMARY KEY (requestIdentifier, originalTransactionId)
                    );
                    CREATE INDEX renewal_extension_chain ON renewal_extension(originalTransactionId, extendedAt);
                    CREATE TABLE mass_extension (
                        requestIdentifier TEXT PRIMARY KEY NOT NULL,
                        productId TEXT NOT NULL,
                        bundleId TEXT NOT NULL,
                        environment TEXT NOT NULL,
                        days INTEGER NOT NULL,
                        storefronts TEXT NOT NULL,
                        completeDate DATETIME,
                        succeededCount INTEGER NOT NULL DEFAULT 0,
                        failedCount INTEGER NOT NULL DEFAULT 0
                    );
                    """)
        }
        return migrator
    }

    /// Mints a purchase and the receipt its device holds right after it; `encode` turns the
    /// receipt into the bytes the app would upload.
    func mint(_ order: Order, encode: (Receipt) throws -> [UInt8]) throws -> (Purchase, [UInt8]) {
        try database.write { db in
            let now = Date()
            let transactionId = try Self.nextTransactionId(db)
            let subscription = order.type == "auto_renewable"
            let purchase = Purchase(
                transactionId: transactionId, originalTransactionId: transactionId, productId: order.productId,
                type: order.type, quantity: max(1, order.quantity), purchaseDate: now, originalPurchaseDate: now,
                expiresDate: subscription ? now.addingTimeInterval(order.expiresIn ?? 30 * 86400) : nil,
                webOrderLineItemId: subscription ? Self.lineItemId(transactionId) : nil,
                cancellationDate: nil, environment: order.environment, bundleId: order.bundleId,
                applicationUsername: order.applicationUsername, deviceId: order.deviceId ?? UUID().uuidString,
                inAppOwnershipType: order.assigned ? "ASSIGNED" : order.familyShared ? "FAMILY_SHARED" : "PURCHASED",
                terms: order.terms)
            try Self.insert(purchase, db)
            if let groupId = order.groupId {
                try db.execute(
                    sql: """
                        INSERT INTO group_member (groupId, bundleId, environment, deviceId, productId, role)
                        VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET role = excluded.role
                        """,
                    arguments: [groupId, purchase.bundleId, purchase.environment, purchase.deviceId, purchase.productId,
                        order.assigned ? "NONE" : "ADMIN"])
            }
            if subscription, let expires = purchase.expiresDate {
                try Self.save(SubscriptionState(periodSeconds: expires.timeIntervalSince(now)), of: transactionId, db)
            }
            let excluded: Set<String> = order.receiptIncludesPurchase ? [] : [transactionId]
            return (purchase, try Self.issueReceipt(for: purchase, at: now, db, excluding: excluded, encode: encode))
        }
    }

    /// The receipt `deviceId` holds after a refresh (`SKReceiptRefreshRequest`): every purchase
    /// of the device for the app and environment of its latest purchase; nil for a device that
    /// bought nothing.
    func refreshReceipt(deviceId: String, encode: (Receipt) throws -> [UInt8]) throws -> [UInt8]? {
        try database.write { db in
            guard
                let latest = try Row.fetchOne(
                    db, sql: "SELECT * FROM purchase WHERE deviceId = ? ORDER BY purchaseDate DESC, rowid DESC LIMIT 1",
                    arguments: [deviceId]
                ).map(Purchase.init(row:))
            else { return nil }
            return try Self.issueReceipt(for: latest, at: Date(), db, encode: encode)
        }
    }

    /// Restores a purchase as Apple does: a new transaction id with the same original
    /// transaction id, web order line item id, product and expiry, on `deviceId` (a new device
    /// when nil), and that device's new receipt. Consumables and refunded purchases cannot be
    /// restored. With `inReceipt` false the new id is one StoreKit 1 hands the app but no
    /// receipt holds (`transactionIdentifier` "may not be the same" as the receipt's): the
    /// device's receipts list the restored transaction in its place.
    func restore(
        transactionId: String, deviceId: String?, inReceipt: Bool = true, encode: (Receipt) throws -> [UInt8]
    ) throws -> Result<(Purchase, [UInt8]), Refusal> {
        try database.write { db in
            guard let restored = try Self.purchase(transactionId, db) else { return .failure(.notFound) }
            guard restored.type != "consumable" else {
                return .failure(.conflict("a consumable cannot be restored"))
            }
            guard restored.cancellationDate == nil else {
                return .failure(.conflict("the purchase was refunded; there is nothing to restore"))
            }
            var restore = restored
            restore.transactionId = try Self.nextTransactionId(db)
            restore.deviceId = deviceId ?? UUID().uuidString
            restore.finishedDate = nil
            restore.receiptTransactionId = inReceipt ? nil : restored.receiptTransactionId ?? restored.transactionId
            try Self.insert(restore, db)
            return .success((restore, try Self.issueReceipt(for: restore, at: Date(), db, encode: encode)))
        }
    }

    /// Marks a transaction finished, as the app's `finishTransaction` does and the Server API's
    /// Finish Transaction: the one place that state is kept. A finished consumable
    /// leaves every receipt its device is issued from now on; other purchases stay. Finishing
    /// again changes nothing. The purchase as it is now.
    func finish(transactionId: String, byServer: Bool = false) throws -> Purchase? {
        try database.write { db in
            try db.execute(
                sql: "UPDATE purchase SET finishedDate = ? WHERE transactionId = ? AND finishedDate IS NULL",
                arguments: [Date(), transactionId])
            if byServer {
                try db.execute(
                    sql: "UPDATE purchase SET serverFinishCalls = serverFinishCalls + 1 WHERE transactionId = ?",
                    arguments: [transactionId])
            }
            return try Self.purchase(transactionId, db)
        }
    }

    /// When a transaction was finished (by the app or the Server API) and how many Finish
    /// Transaction calls named it; nil for an unknown id.
    func finishRecord(transactionId: String) throws -> (finishedDate: Date?, serverCalls: Int)? {
        try database.read { db in
            try Row.fetchOne(
                db, sql: "SELECT finishedDate, serverFinishCalls FROM purchase WHERE transactionId = ?", arguments: [transactionId]
            ).map { ($0["finishedDate"], $0["serverFinishCalls"]) }
        }
    }

    /// Set App Account Token: `token` on every transaction of the purchase whose original
    /// transaction id is `originalTransactionId`; a subscription's next period takes it from
    /// the latest one.
    func setAppAccountToken(_ token: String, originalTransactionId: String) throws {
        try database.write { db in
            try db.execute(
                sql: "UPDATE purchase SET applicationUsername = ? WHERE originalTransactionId = ?",
                arguments: [token, originalTransactionId])
        }
    }

    /// Stores a purchase.
    static func insert(_ purchase: Purchase, _ db: Database) throws {
        try db.execute(
            sql: """
                INSERT INTO purchase (
                    transactionId, originalTransactionId, productId, type, quantity, purchaseDate,
                    originalPurchaseDate, expiresDate, webOrderLineItemId, cancellationDate, environment, bundleId,
                    applicationUsername, deviceId, inAppOwnershipType, transactionReason, isUpgraded, finishedDate,
                    receiptTransactionId, terms
                ) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                """,
            arguments: [
                purchase.transactionId, purchase.originalTransactionId, purchase.productId, purchase.type,
                purchase.quantity, purchase.purchaseDate, purchase.originalPurchaseDate, purchase.expiresDate,
                purchase.webOrderLineItemId, purchase.cancellationDate, purchase.environment, purchase.bundleId,
                purchase.applicationUsername, purchase.deviceId, purchase.inAppOwnershipType, purchase.transactionReason,
                purchase.isUpgraded, purchase.finishedDate, purchase.receiptTransactionId, purchase.terms,
            ])
    }

    /// Issues the new receipt of `purchase`'s device: every purchase of that device (same app
    /// and environment) and, for a subscription, every transaction of its chain; not the
    /// consumables the app finished (StoreKit removes them from the receipt), and for a restore
    /// no receipt holds, the transaction it restored.
    static func issueReceipt(
        for purchase: Purchase, at now: Date, _ db: Database, excluding excluded: Set<String> = [],
        encode: (Receipt) throws -> [UInt8]
    ) throws -> [UInt8] {
        var held = try Row.fetchAll(
            db.cachedStatement(
                sql: """
                    SELECT * FROM purchase WHERE deviceId = ? AND bundleId = ? AND environment = ?
                    ORDER BY purchaseDate, transactionId
                    """),
            arguments: [purchase.deviceId, purchase.bundleId, purchase.environment]
        ).map(Purchase.init(row:))
        if purchase.type == "auto_renewable" {
            let ids = Set(held.map(\.transactionId))
            held += try Row.fetchAll(
                db, sql: "SELECT * FROM purchase WHERE originalTransactionId = ?", arguments: [purchase.originalTransactionId]
            ).map(Purchase.init(row:)).filter { !ids.contains($0.transactionId) }
            held.sort { ($0.purchaseDate, $0.transactionId) < ($1.purchaseDate, $1.transactionId) }
        }
        held.removeAll { excluded.contains($0.transactionId) || ($0.type == "consumable" && $0.finishedDate != nil) }
        if held.contains(where: { $0.receiptTransactionId != nil }) {
            var listed = Set<String>()
            held = try held.compactMap { purchase in
                guard let shown = purchase.receiptTransactionId else { return purchase }
                return try Self.purchase(shown, db)
            }.filter { listed.insert($0.transactionId).inserted }
            held.sort { ($0.purchaseDate, $0.transactionId) < ($1.purchaseDate, $1.transactionId) }
        }
        let receipt = Receipt(
            bundleId: purchase.bundleId, environment: purchase.environment, deviceId: purchase.deviceId, createdAt: now,
            purchases: held)
        let bytes = try encode(receipt)
        try db.execute(
            sql: "INSERT INTO receipt VALUES (?, ?, ?, ?, ?, ?)",
            arguments: [
                digest(bytes), purchase.bundleId, purchase.environment, purchase.deviceId,
                held.map(\.transactionId).joined(separator: ","), now,
            ])
        return bytes
    }

    /// The fake's web order line item ids: the transaction id that began the period, shifted
    /// clear of transaction ids.
    static func lineItemId(_ transactionId: String) -> String {
        String(UInt64(transactionId)! + 7_000_000_000_000_000)
    }

    static func purchase(_ transactionId: String, _ db: Database) throws -> Purchase? {
        try Row.fetchOne(db, sql: "SELECT * FROM purchase WHERE transactionId = ?", arguments: [transactionId])
            .map(Purchase.init(row:))
    }

    /// Every transaction a refund of `purchase` revokes, as Apple decides: for a non-consumable
    /// or a non-renewing subscription every transaction with its original transaction id
    /// (restores included), for an auto-renewable subscription every transaction of its billing
    /// period (its web order line item id), for a consumable itself.
    private static func refundSet(of purchase: Purchase) -> (sql: String, argument: String) {
        switch (purchase.type, purchase.webOrderLineItemId) {
        case ("non_consumable", _), ("non_renewing", _):
            ("originalTransactionId = ?", purchase.originalTransactionId)
        case ("auto_renewable", let lineItem?):
            ("webOrderLineItemId = ?", lineItem)
        default:
            ("transactionId = ?", purchase.transactionId)
        }
    }

    /// The receipt with these bytes, with the current state of its purchases.
    func receipt(bytes: [UInt8]) throws -> Receipt? {
        try database.read { db in
            // Cached statements: this runs once per verifyReceipt call, and preparing SQL each
            // time cost more than running it.
            guard
                let row = try Row.fetchOne(
                    db.cachedStatement(sql: "SELECT * FROM receipt WHERE digest = ?"), arguments: [Self.digest(bytes)])
            else { return nil }
            let ids = (row["transactionIds"] as String).split(separator: ",").map(String.init)
            let purchases = try ids.compactMap { id in
                try Row.fetchOne(db.cachedStatement(sql: "SELECT * FROM purchase WHERE transactionId = ?"), arguments: [id])
                    .map(Purchase.init(row:))
            }
            return Receipt(
                bundleId: row["bundleId"], environment: row["environment"], deviceId: row["deviceId"],
                createdAt: row["createdAt"], purchases: purchases)
        }
    }

    /// Every auto-renewable purchase of the receipt's device, and every transaction of the
    /// chains the receipt holds: what `latest_receipt_info` lists (not a restore no receipt
    /// holds).
    func subscriptions(of receipt: Receipt) throws -> [Purchase] {
        try database.read { db in
            var all = try Row.fetchAll(
                db.cachedStatement(
                    sql: """
                        SELECT * FROM purchase WHERE deviceId = ? AND bundleId = ? AND environment = ?
                            AND type = 'auto_renewable' ORDER BY purchaseDate, transactionId
                        """),
                arguments: [receipt.deviceId, receipt.bundleId, receipt.environment]
            ).map(Purchase.init(row:))
            var ids = Set(all.map(\.transactionId))
            for chain in Set(receipt.purchases.filter { $0.type == "auto_renewable" }.map(\.originalTransactionId)) {
                for purchase in try Row.fetchAll(
                    db.cachedStatement(sql: "SELECT * FROM purchase WHERE originalTransactionId = ?"), arguments: [chain]
                ).map(Purchase.init(row:)) where ids.insert(purchase.transactionId).inserted {
                    all.append(purchase)
                }
            }
            return all.filter { $0.receiptTransactionId == nil }
                .sorted { ($0.purchaseDate, $0.transactionId) < ($1.purchaseDate, $1.transactionId) }
        }
    }

    /// Refunds a purchase and everything Apple revokes with it (see `refundSet(of:)`), as
    /// `type` says (REFUND_FULL, REFUND_PRORATED with `percentage`, FAMILY_REVOKE); the
    /// purchase's cancellation date and the ids revoked, nil if there is no such purchase. A
    /// prorated refund may follow another (Apple's percentage grows); nothing follows a full one.
    func cancel(transactionId: String, type: String = "REFUND_FULL", percentage: Int? = nil) throws -> (date: Date, revoked: [String])? {
        try database.write { db in
            guard let purchase = try Self.purchase(transactionId, db) else { return nil }
            let set = Self.refundSet(of: purchase)
            try db.execute(
                sql: """
                    UPDATE purchase SET cancellationDate = ?, revocationType = ?, revocationPercentage = ?
                    WHERE \(set.sql) AND (cancellationDate IS NULL OR (revocationType = 'REFUND_PRORATED' AND ? = 'REFUND_PRORATED'))
                    """,
                arguments: [Date(), type, type == "REFUND_PRORATED" ? percentage : nil, set.argument, type])
            let revoked = try String.fetchAll(
                db, sql: "SELECT transactionId FROM purchase WHERE \(set.sql) ORDER BY rowid", arguments: [set.argument])
            if type == "ASSIGNMENT_REVOKE" {
                // The organization took the seat back: its holder leaves the group for that product.
                try db.execute(
                    sql: "DELETE FROM group_member WHERE bundleId = ? AND environment = ? AND deviceId = ? AND productId = ? AND role = 'NONE'",
                    arguments: [purchase.bundleId, purchase.environment, purchase.deviceId, purchase.productId])
            }
            guard let date = try Self.purchase(transactionId, db)?.cancellationDate else { return nil }
            return (date, revoked)
        }
    }

    /// A group an account is in, with its role per product.
    struct Membership: Sendable, Equatable {
        var groupId: String
        var roles: [(productId: String, role: String)]

        static func == (lhs: Membership, rhs: Membership) -> Bool {
            lhs.groupId == rhs.groupId && lhs.roles.elementsEqual(rhs.roles) { $0 == $1 }
        }
    }

    /// The groups the account (device) `deviceId` of `bundleId` is in, in the order it joined them.
    func groups(bundleId: String, environment: String, deviceId: String) throws -> [Membership] {
        try database.read { db in
            var groups: [Membership] = []
            for row in try Row.fetchAll(
                db, sql: "SELECT * FROM group_member WHERE bundleId = ? AND environment = ? AND deviceId = ? ORDER BY seq",
                arguments: [bundleId, environment, deviceId])
            {
                let groupId: String = row["groupId"]
                let role = (productId: row["productId"] as String, role: row["role"] as String)
                if let at = groups.firstIndex(where: { $0.groupId == groupId }) {
                    groups[at].roles.append(role)
                } else {
                    groups.append(Membership(groupId: groupId, roles: [role]))
                }
            }
            return groups
        }
    }

    /// The accounts (devices) in `groupId`, in the order they joined; empty for a group the
    /// app does not have in `environment`.
    func members(of groupId: String, bundleId: String, environment: String) throws -> [String] {
        try database.read { db in
            try String.fetchAll(
                db,
                sql: """
                    SELECT deviceId FROM group_member WHERE groupId = ? AND bundleId = ? AND environment = ?
                    GROUP BY deviceId ORDER BY min(seq)
                    """,
                arguments: [groupId, bundleId, environment])
        }
    }

    /// One purchase, by its transaction id.
    func purchase(transactionId: String) throws -> Purchase? {
        try database.read { db in
            try Row.fetchOne(db, sql: "SELECT * FROM purchase WHERE transactionId = ?", arguments: [transactionId])
                .map(Purchase.init(row:))
        }
    }

    /// Every purchase of the account (device) that made `transactionId`, oldest first: what
    /// Apple's transaction history lists from any one of them.
    func history(of transactionId: String) throws -> [Purchase] {
        try database.read { db in
            try Row.fetchAll(
                db,
                sql: """
                    SELECT p.* FROM purchase p JOIN purchase t
                        ON t.transactionId = ? AND p.deviceId = t.deviceId AND p.bundleId = t.bundleId
                            AND p.environment = t.environment
                    ORDER BY p.purchaseDate, p.transactionId
                    """,
                arguments: [transactionId]
            ).map(Purchase.init(row:))
        }
    }

    /// The purchases of `bundleId` in `environment` made on `deviceId`, oldest first (nil:
    /// every device's).
    func purchases(bundleId: String, environment: String, deviceId: String? = nil) throws -> [Purchase] {
        try database.read { db in
            try Row.fetchAll(
                db,
                sql: """
                    SELECT * FROM purchase WHERE bundleId = ? AND environment = ? AND (? IS NULL OR deviceId = ?)
                    ORDER BY purchaseDate, transactionId
                    """,
                arguments: [bundleId, environment, deviceId, deviceId]
            ).map(Purchase.init(row:))
        }
    }

    /// Every purchase made on `deviceId` (of any app), oldest first: what StoreKit on that
    /// device knows of, finished or not.
    func purchases(deviceId: String) throws -> [Purchase] {
        try database.read { db in
            try Row.fetchAll(
                db, sql: "SELECT * FROM purchase WHERE deviceId = ? ORDER BY purchaseDate, transactionId",
                arguments: [deviceId]
            ).map(Purchase.init(row:))
        }
    }

    /// Undoes a refund, for everything the refund revoked; the purchase as it is now, nil if
    /// there is no such purchase.
    func reverseCancel(transactionId: String) throws -> Purchase? {
        try database.write { db in
            guard let purchase = try Self.purchase(transactionId, db) else { return nil }
            let set = Self.refundSet(of: purchase)
            try db.execute(
                sql: "UPDATE purchase SET cancellationDate = NULL, revocationType = NULL, revocationPercentage = NULL WHERE \(set.sql)",
                arguments: [set.argument])
            return try Self.purchase(transactionId, db)
        }
    }

    /// A notification the fake sent (or tried to), for Get Notification History.
    struct SentNotification: Sendable {
        var signedPayload: String
        var notificationType: String
        var transactionId: String?
        var environment: String
        var attempts: [(date: Date, result: String)]
    }

    /// A notification signed while notifications are held, waiting to be delivered.
    struct HeldNotification: Sendable {
        var signedPayload: String
        var notificationType: String
        var transactionId: String?
        var environment: String
        /// The payload's `signedDate`, in milliseconds: Apple's order.
        var signedDate: Int64
    }

    /// From now on, notifications wait (see `keep(_:)`) until `release()`; holding twice
    /// keeps what already waits.
    func hold() {
        volatile.withLockedValue { if $0.held == nil { $0.held = [] } }
    }

    /// Keeps `notification` for later when notifications are held; false when they are not.
    func keep(_ notification: HeldNotification) -> Bool {
        volatile.withLockedValue { state in
            guard state.held != nil else { return false }
            state.held!.append(notification)
            return true
        }
    }

    /// Ends the hold: what waited, in the order it was signed.
    func release() -> [HeldNotification] {
        volatile.withLockedValue { state in
            defer { state.held = nil }
            return state.held ?? []
        }
    }

    func recordNotification(_ notification: SentNotification) {
        volatile.withLockedValue { $0.notifications.append(notification) }
    }

    /// Another attempt at sending the notification whose payload is `signedPayload`.
    func recordAttempt(signedPayload: String, at date: Date, result: String) {
        volatile.withLockedValue { state in
            guard let index = state.notifications.lastIndex(where: { $0.signedPayload == signedPayload }) else { return }
            state.notifications[index].attempts.append((date, result))
        }
    }

    var notifications: [SentNotification] {
        volatile.withLockedValue { $0.notifications }
    }

    /// Consumption information received for a transaction (Send Consumption Information).
    func recordConsumption(transactionId: String, body: [String: Any]) {
        let text = (try? JSONSerialization.data(withJSONObject: body, options: .sortedKeys)).map { String(decoding: $0, as: UTF8.self) }
        volatile.withLockedValue { $0.consumption[transactionId, default: []].append(text ?? "{}") }
    }

    /// Every body received for each transaction, oldest first.
    var consumption: [String: [String]] {
        volatile.withLockedValue { $0.consumption }
    }

    /// Counts one Server API call.
    func countServerAPICall() {
        volatile.withLockedValue { $0.serverAPICalls += 1 }
    }

    var serverAPICalls: Int {
        volatile.withLockedValue { $0.serverAPICalls }
    }

    /// A value the fake keeps across restarts (its signing identity).
    func identity(_ name: String, orCreate make: () throws -> [UInt8]) throws -> [UInt8] {
        try database.write { db in
            if let existing = try Data.fetchOne(db, sql: "SELECT value FROM identity WHERE name = ?", arguments: [name]) {
                return [UInt8](existing)
            }
            let value = try make()
            try db.execute(sql: "INSERT INTO identity VALUES (?, ?)", arguments: [name, Data(value)])
            return value
        }
    }

    /// Counts one `verifyReceipt` call (for tests that check how often Apple was asked).
    func countVerifyReceiptCall() {
        volatile.withLockedValue { $0.verifyReceiptCalls += 1 }
    }

    var verifyReceiptCalls: Int {
        volatile.withLockedValue { $0.verifyReceiptCalls }
    }

    func addFault(_ fault: Fault) {
        volatile.withLockedValue { $0.faults.append(fault) }
    }

    func clearFaults() {
        volatile.withLockedValue { $0.faults.removeAll() }
    }

    var latencyMs: Int {
        get { volatile.withLockedValue { $0.latencyMs } }
    }

    /// The share of calls answered with HTTP 503 (benchmarks of a flaky Apple).
    var errorRate: Double {
        get { volatile.withLockedValue { $0.errorRate } }
        set { volatile.withLockedValue { $0.errorRate = min(1, max(0, newValue)) } }
    }

    /// True for a call that should fail, at `errorRate`.
    func failsAtRandom() -> Bool {
        let rate = errorRate
        return rate > 0 && Double.random(in: 0..<1) < rate
    }

    /// Whether a one-time purchase sends ONE_TIME_CHARGE, as Apple does (the default).
    var sendsOneTimeCharge: Bool {
        get { volatile.withLockedValue { $0.sendsOneTimeCharge } }
        set { volatile.withLockedValue { $0.sendsOneTimeCharge = newValue } }
    }

    func setLatency(milliseconds: Int) {
        volatile.withLockedValue { $0.latencyMs = max(0, milliseconds) }
    }

    /// The first fault that applies to a call about these transactions, counting it down.
    func takeFault(transactionIds: Set<String>, serverAPI: Bool = false) -> Fault? {
        volatile.withLockedValue { state in
            guard
                let index = state.faults.firstIndex(where: { fault in
                    // The Server API answers with HTTP statuses only; verifyReceipt statuses are not for it.
                    (fault.transactionId.map(transactionIds.contains) ?? true) && (!serverAPI || fault.httpStatus != nil)
                })
            else { return nil }
            let fault = state.faults[index]
            switch fault.count ?? 1 {
            case 0: break
            case 1: state.faults.remove(at: index)
            case let count: state.faults[index].count = count - 1
            }
            return fault
        }
    }

    /// Apple's ids are 16-digit numbers. Starting from the clock keeps ids of a fake that lost
    /// its file clear of the ones it minted before.
    static func nextTransactionId(_ db: Database) throws -> String {
        let fromClock = 2_000_000_000_000_000 + UInt64(Date().timeIntervalSince1970 * 1000) * 1000
        // Ids only grow, so the newest row holds the largest: one index step, where MAX over
        // every row made minting quadratic (160,000 purchases took many minutes).
        let last =
            try String.fetchOne(db, sql: "SELECT transactionId FROM purchase ORDER BY rowid DESC LIMIT 1").flatMap(Int64.init) ?? 0
        return String(max(fromClock, UInt64(max(0, last)) + 1))
    }

    private static func digest(_ bytes: [UInt8]) -> String {
        let hex = Array("0123456789abcdef".utf8)
        var text = [UInt8]()
        text.reserveCapacity(64)
        for byte in SHA256.hash(data: bytes) {
            text.append(hex[Int(byte >> 4)])
            text.append(hex[Int(byte & 0x0F)])
        }
        return String(decoding: text, as: UTF8.self)
    }
}

extension FakeLedger.Purchase {
    init(row: Row) {
        self.init(
            transactionId: row["transactionId"], originalTransactionId: row["originalTransactionId"],
            productId: row["productId"], type: row["type"], quantity: row["quantity"],
            purchaseDate: row["purchaseDate"], originalPurchaseDate: row["originalPurchaseDate"],
            expiresDate: row["expiresDate"], webOrderLineItemId: row["webOrderLineItemId"],
            cancellationDate: row["cancellationDate"], environment: row["environment"], bundleId: row["bundleId"],
            applicationUsername: row["applicationUsername"], deviceId: row["deviceId"],
            inAppOwnershipType: row["inAppOwnershipType"], transactionReason: row["transactionReason"],
            revocationType: row["revocationType"], revocationPercentage: row["revocationPercentage"],
            isUpgraded: row["isUpgraded"], finishedDate: row["finishedDate"],
            receiptTransactionId: row["receiptTransactionId"], modifiedSeq: row["modifiedSeq"] ?? 0, terms: row["terms"])
    }
}
