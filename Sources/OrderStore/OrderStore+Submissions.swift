public import Foundation
public import IAPCore
public import Ledger
import Store

/// What the status endpoint tells the app about one upload.
public struct SubmissionStatus: Sendable, Equatable {
    /// One Apple transaction the upload carried.
    public struct Transaction: Sendable, Equatable {
        /// Apple's transaction id.
        public var transactionId: String
        /// The first transaction of its subscription chain.
        public var originalTransactionId: String
        /// The App Store product.
        public var productId: String
        /// Production or Sandbox.
        public var environment: AppStoreEnvironment
        /// What this upload did with it.
        public var state: TransactionCreditState
        /// Why it is held, when it is.
        public var reason: ReasonCode?
        /// Who granted it when that was not Apple's answer to this upload: a customer service
        /// operator, or `apple` (a reversed refund); nil otherwise.
        public var grantedBy: String? = nil
        /// `server` once Apple confirmed the order service's Finish Transaction call, `app`
        /// once the app reported it finished it (`POST /v1/users/{userId}/finished`); nil before.
        public var finishedBy: String? = nil
        /// When Apple confirmed it, or the app reported it.
        public var finishedAt: Date? = nil

        /// Whether the app may finish this transaction: it is settled (see `FinishAdvice`).
        public var finishTransaction: Bool { FinishAdvice.mayFinish(state) }
    }

    /// The submission.
    public var submissionId: SubmissionID
    /// Who uploaded it.
    public var userId: String
    /// Where it stands.
    public var state: SubmissionState
    /// Why it is rejected, retrying or waiting for review.
    public var reason: ReasonCode?
    /// A human-readable detail for `reason`.
    public var reasonMessage: String?
    /// Verification attempts made so far.
    public var attempts: Int
    /// When the next attempt is due, while retrying.
    public var nextAttemptAt: Date?
    /// The Apple environment that verified it.
    public var environment: AppStoreEnvironment?
    /// When the intake accepted it.
    public var acceptedAt: Date
    /// The transactions in it, in receipt order.
    public var transactions: [Transaction]

    /// Customer service marked it finishable.
    public var finishable: Bool = false

    /// What the upload named: a transaction, an order, or nothing (a receipt on its own).
    public var named: FinishAdvice.Named = .transaction

    /// Whether the app may finish the transaction this upload names (see
    /// `FinishAdvice.mayFinishUpload`): once it is credited; after a rejection only when Apple
    /// said the purchase itself is invalid (or it belongs to someone else, or is refunded);
    /// never while work is pending or a person has to look; never for an upload that names
    /// nothing (each transaction's own advice says what to finish); always once customer
    /// service settled it.
    public var finishTransaction: Bool {
        FinishAdvice.mayFinishUpload(state: state, reason: reason, named: named, settledByHand: finishable)
    }
}

extension OrderStore {
    /// Stores an accepted upload together with the message that asks for its verification
    /// (none when the caller verifies it at once, as the inline baseline of the benchmarks does).
    ///
    /// - Important: The caller answers 202 only after this returns: from then on the
    ///   upload survives any crash, and the outbox relay delivers the message.
    public func accept(_ request: VerifyRequest, message: OutboxMessage?) async throws(OrderStoreError) {
        do {
            try await insertAccepted(request, message: message)
        } catch let error as OrderStoreError {
            throw error
        } catch {
            // Disk full, a locked or broken file: the upload is not taken; the caller says so.
            throw OrderStoreError(.unavailable, "cannot store the upload: \(error)")
        }
    }

    private func insertAccepted(_ request: VerifyRequest, message: OutboxMessage?) async throws {
        do {
            // Both rows in one write (one round trip on PostgreSQL, with no savepoint).
            try await acceptCommit.write(keys: ["submission:" + request.submissionId.uuidString]) { db in
                var statements = StoredReceipt.statements(for: request)
                if let message { statements.append(Self.insertStatement(message, now: request.acceptedAt)) }
                try await db.executeLater(statements)
            }
        } catch let error as SQLError where error.kind == .uniqueViolation {
            // The submission's id, or its message's (the same id), is taken.
            throw OrderStoreError(.duplicateSubmission, "submission \(request.submissionId) exists already")
        }
    }

    /// Writes an accepted upload as a `pending` submission.
    static func insertSubmission(_ request: VerifyRequest, in db: any SQLConnection) async throws {
        try await db.executeLater(StoredReceipt.statements(for: request))
    }

    /// The row of an accepted upload, a `pending` submission, with `receiptData` for its
    /// receipt (empty when the receipt is kept as bytes: `StoredReceipt`).
    static func submissionStatement(_ request: VerifyRequest, receiptData: String) -> SQLStatement {
        SQLStatement(
            """
            INSERT INTO submission (id, userId, orderId, transactionId, originalTransactionId, productId,
                receiptData, signedTransaction, signedPayload, state, acceptedAt, updatedAt, uploadDigest)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, \(SubmissionState.pending.sql), ?, ?, ?)
            """,
            [
                request.submissionId.uuidString, request.userId, request.orderId, request.transactionId,
                request.originalTransactionId, request.productId, receiptData, request.signedTransaction, request.signedPayload, request.acceptedAt,
                request.acceptedAt, uploadDigest(of: request),
            ])
    }

    /// The status of one submission, or nil if this store has never accepted it.
    public func status(of id: SubmissionID) async throws -> SubmissionStatus? {
        try await database.read { db in
            guard
                let row = try await db.cachedRow(
                    sql: """
                        SELECT submission.*, submission_receipt.submissionId AS receiptOf FROM \(StoredReceipt.source)
                        WHERE id = ?
                        """, arguments: [id.uuidString])
            else { return nil }
            var transactions: [SubmissionStatus.Transaction] = []
            for transaction in try await db.rows(
                sql: "SELECT * FROM submission_transaction WHERE submissionId = ? ORDER BY rowid", arguments: [id.uuidString])
            {
                var current = SubmissionStatus.Transaction(
                    transactionId: transaction["transactionId"], originalTransactionId: transaction["originalTransactionId"],
                    productId: transaction["productId"],
                    environment: AppStoreEnvironment(rawValue: transaction["environment"]) ?? .production,
                    state: TransactionCreditState(rawValue: transaction["state"]) ?? .alreadyCredited,
                    reason: (transaction["reason"] as String?).map(ReasonCode.init(rawValue:)))
                try await Self.followLaterEvents(&current, key: transaction["creditKey"], userId: row["userId"], in: db)
                transactions.append(current)
            }
            let finishes = try await Self.finishStates(of: transactions.map(\.transactionId), in: db)
            for index in transactions.indices {
                guard let finish = finishes[transactions[index].transactionId], finish.state == "finished" else { continue }
                transactions[index].finishedBy = finish.finishedBy
                transactions[index].finishedAt = finish.finishedAt
            }
            var status = SubmissionStatus(
                submissionId: id, userId: row["userId"],
                state: SubmissionState(rawValue: row["state"]) ?? .pending,
                reason: (row["reason"] as String?).map(ReasonCode.init(rawValue:)),
                reasonMessage: row["reasonMessage"], attempts: row["attempts"], nextAttemptAt: row["nextAttemptAt"],
                environment: (row["environment"] as String?).flatMap(AppStoreEnvironment.init(rawValue:)),
                acceptedAt: row["acceptedAt"], transactions: transactions, finishable: row["finishable"],
                named: Self.named(row))
            // Held or refunded before, everything in it is credited now (by customer service, or
            // a reversed refund): the upload is settled and the app may finish it.
            if status.state == .needsReview || status.reason == .purchaseRevoked, !transactions.isEmpty,
                transactions.allSatisfy({ [.credited, .alreadyCredited, .superseded].contains($0.state) })
            {
                status.state = .credited
                status.reason = nil
                status.reasonMessage = transactions.compactMap(\.grantedBy).first.map { "granted by \($0)" }
            }
            return status
        }
    }

    /// What an upload named, from its row: a transaction (named, signed or bare), an order,
    /// or nothing (a receipt on its own).
    private static func named(_ row: SQLRow) -> FinishAdvice.Named {
        if (row["transactionId"] as String?) != nil || (row["signedTransaction"] as String?) != nil { return .transaction }
        if (row["orderId"] as String?) != nil { return .order }
        if (row["signedPayload"] as String?) != nil { return .transaction }
        let receipt = (row["receiptOf"] as String?) != nil || !(row["receiptData"] as String).isEmpty
        return receipt ? .nothing : .transaction
    }

    /// What happened to a transaction since its upload was answered (`LaterEvents`): its
    /// grant made by customer service or restored by a reversed refund, or revoked since.
    private static func followLaterEvents(
        _ transaction: inout SubmissionStatus.Transaction, key: String?, userId: String, in db: any SQLConnection
    ) async throws {
        guard let key,
            let row = try await db.cachedRow(sql: "SELECT * FROM grants WHERE creditKey = ? AND userId = ?", arguments: [key, userId])
        else { return }
        let grant = Grant(row: row)
        switch LaterEvents.answer(transaction.state, grant: grant) {
        case .credited(let source):
            transaction.state = .credited
            transaction.reason = nil
            transaction.grantedBy = source == .apple ? source.rawValue : try await String.fetchOne(
                db,
                sql: "SELECT actor FROM audit_log WHERE subject = ? AND action = 'grant_manual' ORDER BY id DESC LIMIT 1",
                arguments: ["transaction:\(grant.transactionId)"]) ?? "customer service"
        case .revoked(let reason):
            transaction.state = .revoked
            transaction.reason = reason
        case nil:
            break
        }
    }

    /// What applying one result did.
    public struct Applied: Sendable, Equatable {
        /// The submission's state afterwards.
        public var state: SubmissionState
        /// Purchases this result credited (new grants).
        public var credited: Int
        /// Purchases in it that belong to another user.
        public var replayed: Int
        /// Grants it revoked (a refund or revocation, by a notification or in Apple's answer;
        /// a grant moved away by a restore).
        public var revoked: Int = 0
    }

    /// Applies one verification result, all or nothing, and returns the submission's new state
    /// (durable on return; results applied at the same time share one commit).
    ///
    /// Idempotent: a result for a submission that already reached a terminal state changes
    /// nothing, and a transaction id is credited at most once whatever arrives.
    public func apply(_ result: VerifyResult, policy: CreditPolicy = .init(), now: Date = Date()) async throws
        -> SubmissionState
    {
        try await applyCounting(result, policy: policy, now: now).state
    }

    /// `apply`, also saying how many purchases it credited and how many were replays.
    public func applyCounting(_ result: VerifyResult, policy: CreditPolicy = .init(), now: Date = Date()) async throws
        -> Applied
    {
        try await groupCommit.write(keys: Self.keys(of: result, policy: policy)) { db -> Applied in
            var counts = Applied(state: .pending, credited: 0, replayed: 0)
            counts.state = try await Self.apply(result, policy: policy, now: now, counts: &counts, in: db)
            return counts
        }
    }

    /// The rows applying `result` may read or write, by name (see `GroupCommit.write(keys:_:)`):
    /// its submission's, and for each purchase in it, those of its transaction, its chain, its
    /// credit key and the orders it names. (What else a result reads, it reads alone.)
    static func keys(of result: VerifyResult, policy: CreditPolicy) -> Set<String> {
        var keys: Set<String> = ["submission:" + result.submissionId.uuidString]
        if let orderId = result.orderId { keys.insert("order:" + orderId.lowercased()) }
        var purchases: [VerifiedPurchase] = []
        switch result.outcome {
        case .verified(let receipt): purchases = receipt.purchases
        case .notification(let notification): purchases = notification.purchase.map { [$0] } ?? []
        case .rejected, .retryLater, .needsReview: break
        }
        for purchase in purchases {
            keys.insert("transaction:" + purchase.transactionId)
            keys.insert("chain:" + purchase.originalTransactionId)
            if let previous = purchase.previousOriginalTransactionId { keys.insert("chain:" + previous) }
            keys.insert("credit:" + policy.creditKey(of: purchase))
            if let token = purchase.appAccountToken { keys.insert("order:" + token.lowercased()) }
        }
        return keys
    }

    private static func apply(
        _ result: VerifyResult, policy: CreditPolicy, now: Date, counts: inout Applied, in db: any SQLConnection
    ) async throws -> SubmissionState {
        do {
            let id = result.submissionId.uuidString
            // The upload's row, and the facts of the first purchase Apple verified, in one read
            // (one round trip on PostgreSQL): what crediting it reads follows from the result.
            var reads = [
                SQLStatement(
                    """
                    SELECT userId, state, attempts, transactionId, originalTransactionId, productId,
                        signedTransaction IS NOT NULL AS signed,
                        CASE WHEN transactionId IS NULL OR signedTransaction IS NOT NULL OR receiptData <> '' THEN FALSE
                            ELSE NOT EXISTS (SELECT 1 FROM submission_receipt WHERE submission_receipt.submissionId = submission.id)
                        END AS bareId
                    FROM submission WHERE id = ?
                    """,
                    [id])
            ]
            var firstRead: FactsRead?
            if case .verified(let receipt) = result.outcome, let first = receipt.purchases.first {
                let read = FactsRead(
                    Ledger.query(forUploadOf: first, orderId: result.orderId, policy: policy.ledger), forNotification: false)
                reads += read.queries
                firstRead = read
            }
            let sets = try await db.readBatch(reads)
            guard let row = sets[0].first else {
                throw OrderStoreError(.unknownSubmission, "no submission \(result.submissionId)")
            }
            let userId: String = row["userId"]
            let current = SubmissionState(rawValue: row["state"]) ?? .pending
            let attempts: Int = row["attempts"]
            if current.isTerminal { return current }

            switch result.outcome {
            case .retryLater(_, let message) where result.gaveUp:
                try await Self.finish(
                    id, state: .needsReview, reason: .retriesExhausted, message: message,
                    attempt: max(attempts, result.attempt), environment: nil, now: now, in: db)
                return .needsReview
            case .retryLater(let reason, let message):
                guard result.attempt >= attempts else { return current }
                try await db.executeLater([
                    SQLStatement(
                        """
                        UPDATE submission SET state = \(SubmissionState.retrying.sql), reason = ?, reasonMessage = ?, attempts = ?,
                            nextAttemptAt = ?, updatedAt = ? WHERE id = ?
                        """,
                        [reason.rawValue, message, result.attempt, result.nextAttemptAt, now, id])
                ])
                return .retrying
            case .needsReview(let reason, let message):
                try await Self.finish(
                    id, state: .needsReview, reason: reason, message: message,
                    attempt: max(attempts, result.attempt), environment: nil, now: now, in: db)
                return .needsReview
            case .rejected(let reason, let message):
                let verdict = FinishAdvice.rejection(reason, message: message, lookup: row["bareId"])
                try await Self.finish(
                    id, state: verdict.state, reason: verdict.reason, message: verdict.message ?? message,
                    attempt: max(attempts, result.attempt), environment: nil, now: now, in: db)
                return verdict.state
            case .notification(let notification):
                let state = try await Self.apply(notification, submissionId: id, policy: policy, now: now, in: db)
                counts.revoked += state.revoked
                try await Self.finish(
                    id, state: state.state, reason: nil, message: state.message, attempt: max(attempts, result.attempt),
                    environment: notification.environment, now: now, in: db)
                return state.state
            case .verified(let receipt):
                // What the upload names: the transaction it named, or the one signed transaction it
                // carried (what the app holds, as surely as a named one).
                let signed: Bool = row["signed"]
                let named: String? = row["transactionId"] ?? (signed ? receipt.purchases.first?.transactionId : nil)
                var run = UploadRun(
                    purchases: receipt.purchases,
                    upload: .init(
                        userId: userId, submissionId: id, orderId: result.orderId, transactionId: named, bundleId: receipt.bundleId),
                    namedOriginal: (row["originalTransactionId"] as String?).map {
                        FinishAdvice.NamedOriginal(originalTransactionId: $0, productId: row["productId"])
                    },
                    policy: policy.ledger)
                // The first purchase's facts came with the upload's row; the others' are read
                // after the plans before them are written.
                var known = firstRead.map { $0.facts(from: Array(sets.dropFirst())) }
                let settled: UploadResult
                steps: while true {
                    switch run.next() {
                    case .plan(let event):
                        run.planned(try await Self.applyLedger(event, policy: policy, now: now, facts: known, in: db))
                        known = nil
                    case .read(let query):
                        // The verdict is the core's; the shell reads what it asks for, as the plans left it.
                        var revocations: [LedgerFacts.Revocation] = []
                        if let named = query.revocationsOf { revocations = try await Self.revocations(of: named, in: db) }
                        var order: Order?
                        if let id = query.order { order = try await Self.order(id, in: db) }
                        run.read(revocations: revocations, order: order)
                    case .done(let result):
                        settled = result
                        break steps
                    }
                }
                let verdict = settled.verdict
                counts.credited += settled.credited
                counts.replayed = settled.replayed
                counts.revoked += settled.revoked
                // What the upload became, queued with the plans' writes: when the verdict read
                // nothing, all of them go as the unit's one write (one round trip on PostgreSQL).
                var closing = settled.listed.map { purchase, outcome in
                    SQLStatement(
                        """
                        INSERT INTO submission_transaction
                            (submissionId, transactionId, originalTransactionId, productId, environment, state, reason,
                                creditKey)
                        VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING
                        """,
                        [
                            id, purchase.transactionId, purchase.originalTransactionId, purchase.productId,
                            purchase.environment.rawValue, outcome.state.rawValue, outcome.reason?.rawValue, policy.creditKey(of: purchase),
                        ])
                }
                if policy.finishAtApple {
                    closing += settled.finishAtApple.map {
                        Self.queueAppleFinish($0.transactionId, environment: $0.environment.rawValue, now: now)
                    }
                }
                if settled.replayed > 0 {
                    closing.append(
                        Self.auditStatement(
                            actor: "system", action: "replay_refused", subject: "submission:\(id)",
                            reason: "purchases credited to another user uploaded by \(userId)",
                            details: ["count": "\(settled.replayed)"], now: now))
                }
                closing.append(
                    Self.finishStatement(
                        id, state: verdict.state, reason: verdict.reason, message: verdict.message,
                        attempt: max(attempts, result.attempt), environment: receipt.environment, now: now))
                try await db.executeLater(closing)
                return verdict.state
            }
        }
    }

    /// Apple's refunds and revocations of `transactionId`: of its own id, or of the credit key
    /// it was credited under (a restore of a refunded non-consumable).
    private static func revocations(of transactionId: String, in db: any SQLConnection) async throws -> [LedgerFacts.Revocation] {
        try await db.rows(
            sql: """
                SELECT * FROM revocation WHERE transactionId = ?
                    OR creditKey IN (SELECT creditKey FROM grants WHERE transactionId = ?)
                """,
            arguments: [transactionId, transactionId]
        ).map(revocationFact)
    }

    private static func finish(
        _ id: String, state: SubmissionState, reason: ReasonCode?, message: String?, attempt: Int,
        environment: AppStoreEnvironment?, now: Date, in db: any SQLConnection
    ) async throws {
        try await db.executeLater([
            finishStatement(
                id, state: state, reason: reason, message: message, attempt: attempt, environment: environment, now: now)
        ])
    }

    private static func finishStatement(
        _ id: String, state: SubmissionState, reason: ReasonCode?, message: String?, attempt: Int,
        environment: AppStoreEnvironment?, now: Date
    ) -> SQLStatement {
        SQLStatement(
            """
            UPDATE submission SET state = ?, reason = ?, reasonMessage = ?, attempts = ?, nextAttemptAt = NULL,
                environment = ?, updatedAt = ? WHERE id = ?
            """,
            [state.rawValue, reason?.rawValue, message, attempt, environment?.rawValue, now, id])
    }

}
