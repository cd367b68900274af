public import Foundation
public import IAPCore
public import Ledger
import Store

/// A user that a console search matched, and by what.
public struct ConsoleSearchHit: Sendable, Equatable {
    /// The customer.
    public var userId: String
    /// What matched: `user`, `submission`, `order`, `transaction`, `original_transaction`, `grant`, `upload`.
    public var matched: String
    /// The id that matched.
    public var subject: String
}

/// One thing that happened to a customer's purchases, for the console's timeline.
public struct ConsoleEvent: Sendable, Equatable {
    /// When it happened.
    public var at: Date
    /// What kind: `upload`, `answer`, `credit`, `revoked`, `notification`, `refund`, `reversal`, `alert`, `audit`.
    public var kind: String
    /// One line saying what happened.
    public var summary: String
    /// Who did it (admin actions, the system), when known.
    public var actor: String?
    /// Why, when someone said.
    public var reason: String?
    /// The submission or transaction it is about.
    public var subject: String?
}

/// A submission as the console lists it.
public struct ConsoleSubmission: Sendable, Equatable {
    /// The submission.
    public var submissionId: String
    /// Who uploaded it.
    public var userId: String
    /// Where it stands.
    public var state: String
    /// Why it is where it stands.
    public var reason: String?
    /// Customer service marked it finishable.
    public var finishable: Bool
    /// Verification attempts.
    public var attempts: Int
    /// When the intake accepted it.
    public var acceptedAt: Date
    /// Its last change.
    public var updatedAt: Date
    /// When it was alerted, if it was.
    public var alertedAt: Date?
}

/// A grant with what the console shows beyond `Grant`.
public struct ConsoleGrant: Sendable, Equatable {
    /// The grant.
    public var grant: Grant
    /// Where its transaction's finish at Apple stands; nil when the server does not finish it.
    public var finish: AppleFinishState? = nil
    /// What its transaction cost and under which offer, when Apple's answer said.
    public var terms: PurchaseTerms? = nil
}

/// Everything the console's customer page shows.
public struct ConsoleCustomer: Sendable {
    /// The customer.
    public var userId: String
    /// Their grants, oldest first.
    public var grants: [ConsoleGrant]
    /// Their purchases (held ones included), oldest first.
    public var purchases: [PurchaseRecord]
    /// Their subscriptions.
    public var subscriptions: [Subscription]
    /// Their orders, oldest first.
    public var orders: [Order]
    /// Their uploads, oldest first.
    public var submissions: [ConsoleSubmission]
    /// Everything that happened, oldest first.
    public var timeline: [ConsoleEvent]
    /// Apple's ids of the customers (downloads of the app) their credited purchases came from.
    public var appTransactionIds: [String] = []

    /// Whether the store knows anything of this user.
    public var isEmpty: Bool {
        grants.isEmpty && purchases.isEmpty && subscriptions.isEmpty && orders.isEmpty && submissions.isEmpty
            && timeline.isEmpty
    }
}

/// The console's work queues, oldest first, with their full counts.
public struct ConsoleWorkQueues: Sendable {
    /// Submissions waiting for a person (not yet marked finishable).
    public var needsReview: [ConsoleSubmission]
    /// How many in all.
    public var needsReviewCount: Int
    /// Purchases held and not granted.
    public var held: [PurchaseRecord]
    /// How many in all.
    public var heldCount: Int
    /// Submissions alerted since the cut-off.
    public var alerts: [ConsoleSubmission]
    /// How many in all.
    public var alertCount: Int
}

/// Uploads and credits in one hour.
public struct ConsoleHour: Sendable, Equatable {
    /// The start of the hour (UTC).
    public var start: Date
    /// Submissions accepted in it.
    public var uploads: Int
    /// Grants made in it.
    public var credits: Int
}

extension OrderStore {
    /// The customers a console search term names: a user id, a submission or order id, a
    /// transaction or original transaction id (purchases, grants, or what an upload carried).
    public func consoleSearch(_ term: String, limit: Int = 50) async throws -> [ConsoleSearchHit] {
        let term = term.trimmingCharacters(in: .whitespacesAndNewlines)
        guard !term.isEmpty else { return [] }
        return try await database.read { db in
            var hits: [ConsoleSearchHit] = []
            func add(_ sql: String, _ matched: String, _ arguments: SQLArguments) async throws {
                for row in try await db.rows(sql: sql, arguments: arguments) {
                    let hit = ConsoleSearchHit(userId: row["userId"], matched: matched, subject: row["subject"])
                    if !hits.contains(where: { $0.userId == hit.userId }) { hits.append(hit) }
                }
            }
            try await add(
                "SELECT userId, id AS subject FROM submission WHERE id = upper(?) LIMIT ?", "submission", [term, limit])
            try await add("SELECT userId, id AS subject FROM orders WHERE id = lower(?) LIMIT ?", "order", [term, limit])
            try await add(
                "SELECT userId, transactionId AS subject FROM purchase WHERE transactionId = ? LIMIT ?", "transaction",
                [term, limit])
            try await add(
                "SELECT userId, originalTransactionId AS subject FROM purchase WHERE originalTransactionId = ? LIMIT ?",
                "original_transaction", [term, limit])
            try await add(
                "SELECT userId, transactionId AS subject FROM grants WHERE transactionId = ? LIMIT ?", "grant", [term, limit])
            try await add(
                """
                SELECT submission.userId AS userId, submission_transaction.transactionId AS subject
                FROM submission_transaction JOIN submission ON submission.id = submission_transaction.submissionId
                WHERE submission_transaction.transactionId = ? OR submission_transaction.originalTransactionId = ? LIMIT ?
                """, "upload", [term, term, limit])
            try await add(
                """
                SELECT ? AS userId, ? AS subject WHERE EXISTS (SELECT 1 FROM submission WHERE userId = ?)
                    OR EXISTS (SELECT 1 FROM purchase WHERE userId = ?) OR EXISTS (SELECT 1 FROM grants WHERE userId = ?)
                    OR EXISTS (SELECT 1 FROM orders WHERE userId = ?) OR EXISTS (SELECT 1 FROM subscription WHERE userId = ?)
                """, "user", [term, term, term, term, term, term, term])
            return Array(hits.prefix(limit))
        }
    }

    /// What the store knows of each of these Apple transactions: its purchase (owner, held
    /// reason), keyed by transaction id; unknown ones are absent.
    /// What `transactionIds` cost and under which offer, by transaction id (absent: not said).
    static func terms(of transactionIds: [String], in db: any SQLConnection) async throws -> [String: PurchaseTerms] {
        guard !transactionIds.isEmpty else { return [:] }
        var found: [String: PurchaseTerms] = [:]
        for row in try await db.rows(
            sql: "SELECT * FROM purchase_terms WHERE transactionId IN (\(sqlMarks(transactionIds.count)))",
            arguments: SQLArguments(transactionIds))
        {
            var terms = PurchaseTerms(
                price: row["price"], currency: row["currency"], offerType: row["offerType"], offerIdentifier: row["offerIdentifier"],
                offerDiscountType: row["offerDiscountType"], offerPeriod: row["offerPeriod"], billingPlanType: row["billingPlanType"],
                appTransactionId: row["appTransactionId"], ownershipType: row["ownershipType"])
            let commitment = CommitmentProgress(
                billingPeriodNumber: row["commitmentBillingPeriod"], totalBillingPeriods: row["commitmentTotalPeriods"],
                commitmentExpiresDate: row["commitmentExpiresDate"], commitmentPrice: row["commitmentPrice"])
            terms.commitment = commitment == CommitmentProgress() ? nil : commitment
            found[row["transactionId"]] = terms
        }
        return found
    }

    /// The ids Apple's customer look-ups (Get Customer Groups) take for `userId`: each of their
    /// customers' `appTransactionId` known here, with its environment; and, for an environment
    /// none is known in (purchases proven by receipts name none), their latest purchase's
    /// transaction id, which Apple takes for its customer as well.
    public func appleCustomerIds(ofUser userId: String) async throws -> [(id: String, environment: AppStoreEnvironment)] {
        try await database.read { db in
            var found: [(id: String, environment: AppStoreEnvironment)] = []
            for row in try await db.rows(
                sql: """
                    SELECT purchase_terms.appTransactionId AS id, purchase.environment AS environment FROM purchase_terms
                    JOIN purchase ON purchase.transactionId = purchase_terms.transactionId
                    WHERE purchase.userId = ? AND purchase_terms.appTransactionId IS NOT NULL
                    UNION SELECT appTransactionId, environment FROM user_app_transaction WHERE userId = ? ORDER BY 1
                    """, arguments: [userId, userId])
            {
                if let environment = AppStoreEnvironment(rawValue: row["environment"]) { found.append((row["id"], environment)) }
            }
            for row in try await db.rows(
                sql: """
                    SELECT transactionId, environment FROM purchase WHERE userId = ?
                    ORDER BY creditedAt DESC, transactionId DESC
                    """, arguments: [userId])
            {
                guard let environment = AppStoreEnvironment(rawValue: row["environment"]),
                    !found.contains(where: { $0.environment == environment })
                else { continue }
                found.append((row["transactionId"], environment))
            }
            return found
        }
    }

    /// The users each of `appTransactionIds` (Apple's customers) is known for here: whose
    /// credited purchases named it, or who uploaded it.
    public func users(ofAppTransactions appTransactionIds: [String]) async throws -> [String: [String]] {
        guard !appTransactionIds.isEmpty else { return [:] }
        let marks = sqlMarks(appTransactionIds.count)
        return try await database.read { db in
            var users: [String: Set<String>] = [:]
            for row in try await db.rows(
                sql: """
                    SELECT purchase_terms.appTransactionId AS id, purchase.userId AS userId FROM purchase_terms
                    JOIN purchase ON purchase.transactionId = purchase_terms.transactionId
                    WHERE purchase_terms.appTransactionId IN (\(marks))
                    UNION SELECT appTransactionId, userId FROM user_app_transaction WHERE appTransactionId IN (\(marks))
                    """, arguments: SQLArguments(appTransactionIds + appTransactionIds))
            {
                users[row["id"], default: []].insert(row["userId"])
            }
            return users.mapValues { $0.sorted() }
        }
    }

    /// Records that `userId` uploaded the customer's download of the app `appTransactionId`
    /// (verified); once per user and download.
    public func recordAppTransaction(_ appTransactionId: String, userId: String, environment: String, now: Date = Date())
        async throws
    {
        try await database.write(keys: ["app:" + userId]) { db in
            try await db.executeLater([
                SQLStatement(
                    """
                    INSERT INTO user_app_transaction (userId, appTransactionId, environment, recordedAt) VALUES (?, ?, ?, ?)
                    ON CONFLICT (userId, appTransactionId) DO NOTHING
                    """, [userId, appTransactionId, environment, now])
            ])
        }
    }

    /// What `transactionIds` cost and under which offer, by transaction id.
    public func purchaseTerms(_ transactionIds: [String]) async throws -> [String: PurchaseTerms] {
        try await database.read { db in try await Self.terms(of: transactionIds, in: db) }
    }

    public func consolePurchases(_ transactionIds: [String]) async throws -> [String: PurchaseRecord] {
        guard !transactionIds.isEmpty else { return [:] }
        return try await database.read { db in
            let marks = sqlMarks(transactionIds.count)
            var found: [String: PurchaseRecord] = [:]
            for row in try await db.rows(sql: "SELECT * FROM purchase WHERE transactionId IN (\(marks))", arguments: SQLArguments(transactionIds))
            {
                let purchase = PurchaseRecord(row: row)
                found[purchase.transactionId] = purchase
            }
            return found
        }
    }

    /// One customer as the console shows them: grants, purchases, subscriptions, orders,
    /// uploads, and one timeline of everything that happened to their purchases.
    public func consoleCustomer(_ userId: String, limit: Int = 500) async throws -> ConsoleCustomer {
        try await database.read { db in
            var grants = try await db.rows(sql: "SELECT * FROM grants WHERE userId = ? ORDER BY id LIMIT ?", arguments: [userId, limit]
            ).map { ConsoleGrant(grant: Grant(row: $0)) }
            let finishes = try await Self.finishStates(of: grants.map(\.grant.transactionId), in: db)
            for index in grants.indices { grants[index].finish = finishes[grants[index].grant.transactionId] }
            let terms = try await Self.terms(of: grants.map(\.grant.transactionId), in: db)
            for index in grants.indices { grants[index].terms = terms[grants[index].grant.transactionId] }
            let purchases = try await db.rows(sql: "SELECT * FROM purchase WHERE userId = ? ORDER BY creditedAt LIMIT ?", arguments: [userId, limit]
            ).map { PurchaseRecord(row: $0) }
            let subscriptions = try await db.rows(sql: "SELECT * FROM subscription WHERE userId = ? ORDER BY updatedAt DESC LIMIT ?", arguments: [userId, limit]
            ).map { Subscription(row: $0).asOf(Date()) }
            let orders = try await db.rows(sql: "SELECT * FROM orders WHERE userId = ? ORDER BY createdAt LIMIT ?", arguments: [userId, limit]
            ).map(Order.init(row:))
            let submissions = try await db.rows(sql: "SELECT * FROM submission WHERE userId = ? ORDER BY acceptedAt LIMIT ?", arguments: [userId, limit]
            ).map(ConsoleSubmission.init(row:))

            var timeline: [ConsoleEvent] = []
            for submission in submissions {
                timeline.append(
                    ConsoleEvent(
                        at: submission.acceptedAt, kind: "upload", summary: "Upload \(submission.submissionId) accepted",
                        subject: submission.submissionId))
                if submission.state != "pending" {
                    var line = "Upload \(submission.submissionId) \(submission.state)"
                    if let reason = submission.reason { line += " (\(reason))" }
                    if submission.attempts > 1 { line += " after \(submission.attempts) attempts" }
                    timeline.append(
                        ConsoleEvent(at: submission.updatedAt, kind: "answer", summary: line, subject: submission.submissionId))
                }
                if let alertedAt = submission.alertedAt {
                    timeline.append(
                        ConsoleEvent(
                            at: alertedAt, kind: "alert", summary: "Alert raised for upload \(submission.submissionId)",
                            subject: submission.submissionId))
                }
            }
            for row in try await db.rows(sql: """
                    SELECT submission_transaction.*, submission.updatedAt AS at FROM submission_transaction
                    JOIN submission ON submission.id = submission_transaction.submissionId
                    WHERE submission.userId = ? ORDER BY submission.acceptedAt, submission_transaction.rowid LIMIT ?
                    """, arguments: [userId, limit])
            {
                var line = "Transaction \(row["transactionId"] as String) (\(row["productId"] as String)): \(row["state"] as String)"
                if let reason: String = row["reason"] { line += " (\(reason))" }
                timeline.append(ConsoleEvent(at: row["at"], kind: "answer", summary: line, subject: row["transactionId"]))
            }
            for entry in grants {
                let grant = entry.grant
                timeline.append(
                    ConsoleEvent(
                        at: grant.grantedAt, kind: "credit",
                        summary: "Credited \(grant.productId) ×\(grant.quantity) for transaction \(grant.transactionId) (\(grant.source))",
                        subject: grant.transactionId))
                if let finish = entry.finish, let finishedAt = finish.finishedAt {
                    timeline.append(
                        ConsoleEvent(
                            at: finishedAt, kind: "finished",
                            summary: "Transaction \(grant.transactionId) finished at Apple by the \(finish.finishedBy ?? "server")",
                            subject: grant.transactionId))
                }
                if let revokedAt = grant.revokedAt {
                    timeline.append(
                        ConsoleEvent(
                            at: revokedAt, kind: "revoked", summary: "Grant for transaction \(grant.transactionId) revoked",
                            actor: grant.revokedBy?.rawValue, subject: grant.transactionId))
                }
            }
            for row in try await db.rows(sql: """
                    SELECT * FROM notification WHERE transactionId IN (
                        SELECT transactionId FROM purchase WHERE userId = ? UNION SELECT transactionId FROM grants WHERE userId = ?)
                    ORDER BY appliedAt LIMIT ?
                    """, arguments: [userId, userId, limit])
            {
                var type: String = row["notificationType"]
                if let subtype: String = row["subtype"] { type += "/\(subtype)" }
                timeline.append(
                    ConsoleEvent(
                        at: row["appliedAt"], kind: "notification",
                        summary: "App Store notification \(type) on transaction \(row["transactionId"] as String? ?? "?"): \(row["outcome"] as String)",
                        actor: "apple", subject: row["transactionId"]))
            }
            for row in try await db.rows(sql: """
                    SELECT * FROM revocation WHERE creditKey IN (
                        SELECT creditKey FROM purchase WHERE userId = ? UNION SELECT creditKey FROM grants WHERE userId = ?)
                    LIMIT ?
                    """, arguments: [userId, userId, limit])
            {
                let transactionId: String = row["transactionId"]
                timeline.append(
                    ConsoleEvent(
                        at: row["revokedAt"], kind: "refund",
                        summary: "Apple refunded or revoked \(row["creditKey"] as String) (transaction \(transactionId))",
                        actor: row["source"], subject: transactionId))
                if let reversedAt: Date = row["reversedAt"] {
                    timeline.append(
                        ConsoleEvent(
                            at: reversedAt, kind: "reversal", summary: "Apple reversed the refund of transaction \(transactionId)",
                            actor: "apple", subject: transactionId))
                }
            }
            for row in try await db.rows(sql: """
                    SELECT * FROM audit_log WHERE subject = 'user:' || ?
                        OR subject IN (
                            SELECT 'transaction:' || transactionId FROM purchase WHERE userId = ?
                            UNION SELECT 'transaction:' || transactionId FROM grants WHERE userId = ?
                            UNION SELECT 'submission:' || id FROM submission WHERE userId = ?
                            UNION SELECT 'subscription:' || originalTransactionId FROM subscription WHERE userId = ?)
                        OR \(db.dialect == .sqlite
                            ? "(json_valid(details) AND json_extract(details, '$.userId') = ?)"
                            : "iap_json_field(details, 'userId') = ?")
                    ORDER BY id LIMIT ?
                    """, arguments: [userId, userId, userId, userId, userId, userId, limit])
            {
                let action: String = row["action"]
                let subject: String = row["subject"]
                let summary = action == "note" ? "Note" : "\(action.replacingOccurrences(of: "_", with: " ")) on \(subject)"
                timeline.append(
                    ConsoleEvent(
                        at: row["at"], kind: action == "note" ? "note" : "audit", summary: summary, actor: row["actor"],
                        reason: row["reason"], subject: subject))
            }
            // Stable: events of the same instant keep the order they were gathered in.
            let ordered = timeline.enumerated().sorted { ($0.element.at, $0.offset) < ($1.element.at, $1.offset) }.map(\.element)
            var customer = ConsoleCustomer(
                userId: userId, grants: grants, purchases: purchases, subscriptions: subscriptions, orders: orders,
                submissions: submissions, timeline: ordered)
            customer.appTransactionIds = try await db.rows(
                sql: """
                    SELECT purchase_terms.appTransactionId AS id FROM purchase_terms
                    JOIN purchase ON purchase.transactionId = purchase_terms.transactionId
                    WHERE purchase.userId = ? AND purchase_terms.appTransactionId IS NOT NULL
                    UNION SELECT appTransactionId FROM user_app_transaction WHERE userId = ? ORDER BY 1
                    """, arguments: [userId, userId]
            ).map { $0["id"] as String }
            return customer
        }
    }

    /// The console's work queues, oldest first: submissions in `needs_review` not yet settled,
    /// held purchases not granted, and submissions alerted since `alertsSince`.
    public func consoleWorkQueues(limit: Int = 50, alertsSince: Date) async throws -> ConsoleWorkQueues {
        try await database.read { db in
            let needsReview = try await db.rows(sql: "SELECT * FROM submission WHERE state = \(SubmissionState.needsReview.sql) AND finishable = 0 ORDER BY updatedAt LIMIT ?",
                arguments: [limit]
            ).map(ConsoleSubmission.init(row:))
            let needsReviewCount =
                try await Int.fetchOne(db, sql: "SELECT COUNT(*) FROM submission WHERE state = \(SubmissionState.needsReview.sql) AND finishable = 0") ?? 0
            let heldFilter = """
                FROM purchase WHERE heldReason IS NOT NULL AND heldReason <> \(ReasonCode.stoppedByRefund.sql)
                    AND NOT EXISTS (SELECT 1 FROM grants WHERE grants.transactionId = purchase.transactionId)
                """
            let held = try await db.rows(sql: "SELECT * \(heldFilter) ORDER BY creditedAt LIMIT ?", arguments: [limit])
                .map { PurchaseRecord(row: $0) }
            let heldCount = try await Int.fetchOne(db, sql: "SELECT COUNT(*) \(heldFilter)") ?? 0
            let alerts = try await db.rows(sql: "SELECT * FROM submission WHERE alertedAt >= ? ORDER BY alertedAt LIMIT ?",
                arguments: [alertsSince, limit]
            ).map(ConsoleSubmission.init(row:))
            let alertCount =
                try await Int.fetchOne(db, sql: "SELECT COUNT(*) FROM submission WHERE alertedAt >= ?", arguments: [alertsSince]) ?? 0
            return ConsoleWorkQueues(
                needsReview: needsReview, needsReviewCount: needsReviewCount, held: held, heldCount: heldCount,
                alerts: alerts, alertCount: alertCount)
        }
    }

    /// Uploads accepted and grants made per hour, for the `hours` whole hours up to `now`
    /// (oldest first, empty hours included).
    public func consoleHourlyActivity(hours: Int = 48, now: Date = Date()) async throws -> [ConsoleHour] {
        let hourStart = Date(timeIntervalSince1970: (now.timeIntervalSince1970 / 3600).rounded(.down) * 3600)
        let since = hourStart.addingTimeInterval(-Double(hours - 1) * 3600)
        let counts = try await database.read { db -> (uploads: [Int: Int], credits: [Int: Int]) in
            func perHour(_ sql: String) async throws -> [Int: Int] {
                var result: [Int: Int] = [:]
                for row in try await db.rows(sql: sql, arguments: [since]) {
                    let at: Date = row["at"]
                    let index = Int((at.timeIntervalSince(since) / 3600).rounded(.down))
                    result[index, default: 0] += 1
                }
                return result
            }
            return await (
                try perHour("SELECT acceptedAt AS at FROM submission WHERE acceptedAt >= ?"),
                try perHour("SELECT grantedAt AS at FROM grants WHERE grantedAt >= ?")
            )
        }
        return (0..<hours).map { index in
            ConsoleHour(
                start: since.addingTimeInterval(Double(index) * 3600), uploads: counts.uploads[index] ?? 0,
                credits: counts.credits[index] ?? 0)
        }
    }

    /// Adds a note about a customer to the audit log (action `note`, subject `user:<id>`).
    public func addNote(userId: String, actor: String, text: String, now: Date = Date()) async throws {
        try await database.write { db in
            try await Self.audit(actor: actor, action: "note", subject: "user:\(userId)", reason: text, details: [:], now: now, in: db)
        }
    }

    /// Appends a console action that changes nothing in the ledger itself (a redrive) to the audit log.
    public func recordConsoleAction(
        actor: String, action: String, subject: String, reason: String, details: [String: String], now: Date = Date()
    ) async throws {
        try await database.write { db in
            try await Self.audit(actor: actor, action: action, subject: subject, reason: reason, details: details, now: now, in: db)
        }
    }

    /// Queues a submission for verification again (customer service re-runs it): a new
    /// verify message in the outbox, the submission `pending` again if it was `needs_review`,
    /// audited. Refused (conflict) for credited or rejected submissions.
    public func requeueSubmission(
        _ id: SubmissionID, actor: String, reason: String, now: Date = Date(),
        message: @escaping @Sendable (VerifyRequest) throws -> OutboxMessage
    ) async throws(OrderStoreError) -> VerifyRequest {
        do {
            return try await database.write { db throws -> VerifyRequest in
                guard
                    let row = try await db.row(sql: """
                            SELECT \(Self.submissionColumns), state FROM \(StoredReceipt.source) WHERE id = ?
                            """, arguments: [id.uuidString])
                else { throw OrderStoreError(.notFound, "no submission \(id)") }
                let state: String = row["state"]
                guard ["pending", "retrying", "needs_review"].contains(state) else {
                    throw OrderStoreError(.conflict, "submission \(id) is \(state) already")
                }
                let request = Self.nextAttempt(of: row, id: id)
                try await Self.insert(try message(request), now: now, in: db)
                try await db.execute(
                    sql: """
                        UPDATE submission SET updatedAt = ?,
                            state = CASE WHEN state = \(SubmissionState.needsReview.sql) THEN \(SubmissionState.pending.sql) ELSE state END,
                            reason = CASE WHEN state = \(SubmissionState.needsReview.sql) THEN NULL ELSE reason END,
                            reasonMessage = CASE WHEN state = \(SubmissionState.needsReview.sql) THEN NULL ELSE reasonMessage END
                        WHERE id = ?
                        """, arguments: [now, id.uuidString])
                try await Self.audit(
                    actor: actor, action: "submission_reverify", subject: "submission:\(id.uuidString)", reason: reason,
                    details: ["userId": row["userId"] as String, "from": state], now: now, in: db)
                return request
            }
        } catch let error as OrderStoreError {
            throw error
        } catch {
            throw OrderStoreError(.unavailable, "\(error)")
        }
    }

    /// Accepts an upload made by customer service for a customer (a transaction Apple lists
    /// for the customer's invoice that no upload brought), with its verify message, audited.
    public func acceptForCustomer(
        _ request: VerifyRequest, message: OutboxMessage, actor: String, reason: String, now: Date = Date()
    ) async throws(OrderStoreError) {
        do {
            try await database.write { db in
                try await Self.insertSubmission(request, in: db)
                try await Self.insert(message, now: now, in: db)
                try await Self.audit(
                    actor: actor, action: "upload_for_customer", subject: "submission:\(request.submissionId.uuidString)",
                    reason: reason, details: ["userId": request.userId, "transactionId": request.transactionId ?? ""], now: now,
                    in: db)
            }
        } catch let error as OrderStoreError {
            throw error
        } catch {
            throw OrderStoreError(.unavailable, "\(error)")
        }
    }
}

extension ConsoleSubmission {
    init(row: SQLRow) {
        self.init(
            submissionId: row["id"], userId: row["userId"], state: row["state"], reason: row["reason"],
            finishable: row["finishable"], attempts: row["attempts"], acceptedAt: row["acceptedAt"],
            updatedAt: row["updatedAt"], alertedAt: row["alertedAt"])
    }
}

extension PurchaseRecord {
    /// A `purchase` row, with its grant when there is one.
    init(row: SQLRow, grant: Grant? = nil) {
        self.init(
            transactionId: row["transactionId"], originalTransactionId: row["originalTransactionId"],
            productId: row["productId"], quantity: row["quantity"], environment: row["environment"], userId: row["userId"],
            orderId: row["orderId"], submissionId: row["submissionId"], heldReason: row["heldReason"],
            recordedAt: row["creditedAt"], grant: grant)
    }
}
