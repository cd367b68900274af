public import Foundation
public import IAPCore
public import Ledger
import Store

/// A consumption request due to be answered, with the ledger's facts about its transaction.
public struct DueConsumptionRequest: Sendable, Equatable {
    public var notificationUUID: String
    public var transactionId: String
    public var environment: AppStoreEnvironment
    public var deadline: Date
    public var attempts: Int
    public var facts: ConsumptionAnswer.Facts
}

/// What became of one consumption request's answer.
public enum ConsumptionAnswerOutcome: Sendable, Equatable {
    /// Apple took `body` (JSON, as sent).
    case sent(body: String)
    /// Nothing is sent, for `reason` (no consent, an assigned transaction).
    case skipped(reason: String)
    /// Apple refused it for good.
    case refused(String)
    /// Apple could not be told before the deadline.
    case expired(String)
    /// Apple could not answer now: sent again at `at`.
    case retry(at: Date, error: String)
}

/// What the app reports for Apple's refund requests: how much of a purchase `userId` used, and
/// whether they consented to tell Apple. Arrives as `POST /v1/users/{userId}/consumption` or as
/// a message on `<prefix>.consumption` (this shape, as JSON).
public struct ConsumptionReport: Codable, Sendable, Equatable {
    public var userId: String
    public var transactionId: String?
    /// Milli-units: 100000 is all of it.
    public var consumptionPercentage: Int?
    public var customerConsented: Bool?

    /// Creates a report.
    public init(userId: String, transactionId: String?, consumptionPercentage: Int?, customerConsented: Bool?) {
        self.userId = userId
        self.transactionId = transactionId
        self.consumptionPercentage = consumptionPercentage
        self.customerConsented = customerConsented
    }

    /// What is wrong with it, if anything: the field and why.
    public var problem: (field: String, why: String)? {
        if let used = consumptionPercentage, !(0...100_000).contains(used) {
            return ("consumptionPercentage", "must be 0 to 100000 (milli-units: 100000 is all of it)")
        }
        if consumptionPercentage != nil, transactionId == nil { return ("transactionId", "is required with consumptionPercentage") }
        if consumptionPercentage == nil, customerConsented == nil {
            return ("consumptionPercentage", "or customerConsented is required")
        }
        return nil
    }
}

/// The app's report about a purchase (`POST /v1/users/{userId}/consumption`) was refused.
public struct ConsumptionReportError: Error, Equatable, Sendable {
    public enum Kind: Sendable { case transactionNotFound }
    public var kind: Kind
}

extension OrderStore {
    /// The queued consumption requests that are due, at most `limit`, claimed for `worker` until
    /// `lease` has passed, each with the facts its answer is decided from, read in the same
    /// transaction: whether its transaction was credited, what the app reported used, and
    /// whether the purchase's user consented.
    public func claimDueConsumptionRequests(
        limit: Int, worker: String, lease: TimeInterval = 60, now: Date = Date()
    ) async throws -> [DueConsumptionRequest] {
        let rows = try await claimDue(
            from: "consumption_request", key: "notificationUUID",
            columns: """
                consumption_request.*,
                    -- LedgerChange.ConsumptionRequest.isDelivered(by:), the ledger checker's rule.
                    EXISTS (
                        SELECT 1 FROM grants WHERE grants.transactionId = consumption_request.transactionId
                            OR grants.creditKey = consumption_request.creditKey
                    ) AS delivered,
                    (SELECT max(consumptionPercentage) FROM consumption_report
                        WHERE consumption_report.transactionId = consumption_request.transactionId
                            OR consumption_report.transactionId IN (
                                SELECT transactionId FROM purchase WHERE purchase.creditKey = consumption_request.creditKey)
                    ) AS used,
                    (SELECT consented FROM consumption_consent WHERE consumption_consent.userId = coalesce(
                        (SELECT userId FROM purchase WHERE purchase.transactionId = consumption_request.transactionId),
                        (SELECT userId FROM grants WHERE grants.creditKey = consumption_request.creditKey
                            ORDER BY grants.id LIMIT 1),
                        consumption_request.userId)) AS consented
                """,
            queued: "answer = 'queued'", limit: limit, worker: worker, lease: lease, now: now)
        return rows.map { row in
            DueConsumptionRequest(
                notificationUUID: row["notificationUUID"], transactionId: row["transactionId"],
                environment: AppStoreEnvironment(rawValue: row["environment"]) ?? .production,
                deadline: (row["deadline"] as Date?) ?? (row["receivedAt"] as Date).addingTimeInterval(
                    LedgerChange.ConsumptionRequest.answerWindow),
                attempts: row["attempts"],
                facts: ConsumptionAnswer.Facts(
                    ownershipType: row["ownershipType"], delivered: row["delivered"], consumptionPercentage: row["used"],
                    userConsented: row["consented"], productType: (row["productType"] as String?).flatMap(Catalog.ProductType.init)))
        }
    }

    /// Records what became of a consumption request's answer and lets go of the claim; every
    /// outcome but a retry is final and audited (actor `system`).
    public func recordConsumptionAnswer(
        _ request: DueConsumptionRequest, _ outcome: ConsumptionAnswerOutcome, now: Date = Date()
    ) async throws {
        var statements: [SQLStatement] = []
        func close(_ answer: String, reason: String?, json: String?) {
            statements.append(
                SQLStatement(
                    """
                    UPDATE consumption_request SET answer = ?, answerReason = ?, answerJSON = ?, answeredAt = ?,
                        attempts = attempts + ?, claimedBy = NULL, claimedUntil = NULL
                    WHERE notificationUUID = ? AND answer = 'queued'
                    """,
                    [answer, reason, json, now, answer == "skipped" ? 0 : 1, request.notificationUUID]))
            var details = ["notificationUUID": request.notificationUUID, "answer": answer]
            details["sent"] = json
            statements.append(
                Self.auditStatement(
                    actor: "system", action: "consumption_answer", subject: "transaction:\(request.transactionId)",
                    reason: reason ?? "answered Apple's refund request with the ledger's facts", details: details, now: now))
        }
        switch outcome {
        case .sent(let body): close("sent", reason: nil, json: body)
        case .skipped(let reason): close("skipped", reason: reason, json: nil)
        case .refused(let error): close("refused", reason: error, json: nil)
        case .expired(let error): close("expired", reason: error, json: nil)
        case .retry(let at, let error):
            statements.append(
                SQLStatement(
                    """
                    UPDATE consumption_request SET dueAt = ?, attempts = attempts + 1, answerReason = ?, claimedBy = NULL,
                        claimedUntil = NULL
                    WHERE notificationUUID = ? AND answer = 'queued'
                    """,
                    [at, error, request.notificationUUID]))
        }
        let batch = statements
        try await database.writeQueues { db in try await db.executeBatch(batch) }
    }

    /// The app's report about one of `userId`'s purchases: the share of it used (milli-units,
    /// 100000 is all of it), and the user's consent to tell Apple when they ask for a refund.
    /// A transaction that is not the user's is refused as unknown. A share never goes down: use
    /// only grows, so a later, smaller report (a buyer who asked Apple for a refund) leaves the
    /// highest share reported.
    public func reportConsumption(_ report: ConsumptionReport, now: Date = Date()) async throws {
        let userId = report.userId, transactionId = report.transactionId
        let consumptionPercentage = report.consumptionPercentage, consented = report.customerConsented
        try await database.write { db in
            if let transactionId {
                // The purchase of that id, or the one credited through another transaction of it
                // (a restore of a non-consumable names the original the app may report by).
                let owner = try await db.row(
                    sql: """
                        SELECT userId FROM purchase WHERE transactionId = ? OR originalTransactionId = ?
                        ORDER BY CASE WHEN transactionId = ? THEN 0 ELSE 1 END LIMIT 1
                        """, arguments: [transactionId, transactionId, transactionId])
                guard let owner, sameUser(owner["userId"], userId) else {
                    throw ConsumptionReportError(kind: .transactionNotFound)
                }
                if let consumptionPercentage {
                    try await db.executeLater([
                        SQLStatement(
                            """
                            INSERT INTO consumption_report (transactionId, userId, consumptionPercentage, reportedAt)
                            VALUES (?, ?, ?, ?)
                            ON CONFLICT (transactionId) DO UPDATE SET consumptionPercentage = CASE
                                    WHEN excluded.consumptionPercentage > consumption_report.consumptionPercentage
                                    THEN excluded.consumptionPercentage ELSE consumption_report.consumptionPercentage END,
                                reportedAt = excluded.reportedAt
                            """, [transactionId, userId, consumptionPercentage, now])
                    ])
                }
            }
            if let consented {
                try await Self.recordConsent(consented, of: userId, in: db, now: now)
            }
        }
    }

    /// The shortest time between two audit rows of one user's consent: a user flipping it in a
    /// loop changes the state each time but writes at most one audit row an hour.
    static let consentAuditInterval: TimeInterval = 3600

    /// A consent report is state, not a log: the same answer again writes nothing; a change
    /// updates the user's row and is audited unless the user's last consent audit row is less
    /// than ``consentAuditInterval`` old (what the user can make the store keep stays bounded).
    private static func recordConsent(_ consented: Bool, of userId: String, in db: any SQLConnection, now: Date) async throws {
        let current = try await db.row(sql: "SELECT consented FROM consumption_consent WHERE userId = ?", arguments: [userId])
        if let current, (current["consented"] as Bool) == consented { return }
        var statements = [
            SQLStatement(
                """
                INSERT INTO consumption_consent (userId, consented, updatedAt) VALUES (?, ?, ?)
                ON CONFLICT (userId) DO UPDATE SET consented = excluded.consented, updatedAt = excluded.updatedAt
                """, [userId, consented, now])
        ]
        let lastAudit = try await db.row(
            sql: """
                SELECT at FROM audit_log WHERE subject = ? AND action IN ('consumption_consent_given', 'consumption_consent_withdrawn')
                ORDER BY id DESC LIMIT 1
                """, arguments: ["user:\(userId)"])
        let lastAt: Date? = lastAudit?["at"]
        if lastAt.map({ now.timeIntervalSince($0) >= consentAuditInterval || now < $0 }) ?? true {
            statements.append(
                auditStatement(
                    actor: "user:\(userId)", action: consented ? "consumption_consent_given" : "consumption_consent_withdrawn",
                    subject: "user:\(userId)", reason: "reported by the app", details: [:], now: now))
        }
        try await db.executeLater(statements)
    }
}
