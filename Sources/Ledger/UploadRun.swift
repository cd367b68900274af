import Foundation
public import IAPCore

/// One verified upload through the ledger, written once for every shell (the order store, the
/// checker's memory ledger, the ground truth): each purchase is credited in receipt order,
/// then what the upload named that they did not settle, then the verdict, from the rows it
/// asks for. The run does no I/O: it says what to do next (`next()`), and the shell does it,
/// planning each event on its facts as the writes before it left them, and hands back what
/// came of it.
///
///     var run = UploadRun(purchases: ..., upload: ..., namedOriginal: ..., policy: ...)
///     while true {
///         switch run.next() {
///         case .plan(let event): run.planned(try shell.apply(event))
///         case .read(let query): run.read(revocations: ..., order: ...)
///         case .done(let result): return result
///         }
///     }
public struct UploadRun: Sendable {
    /// What the shell does next.
    public enum Step: Sendable {
        /// Plan this event on the facts as the writes so far left them, write the plan, and
        /// hand it to `planned(_:)`.
        case plan(LedgerEvent)
        /// Read what the verdict asks for and hand it to `read(revocations:order:)`.
        case read(FinishAdvice.VerdictQuery)
        /// The upload is settled.
        case done(UploadResult)
    }

    private let purchases: [VerifiedPurchase]
    private let upload: LedgerEvent.Upload
    private let namedOriginal: FinishAdvice.NamedOriginal?
    private let policy: LedgerPolicy
    private var position = 0
    private var result = UploadResult()
    private var naming: LedgerEvent.Naming?
    private var namingOutcome = NamingOutcome.nothing
    private var query: FinishAdvice.VerdictQuery?
    private var rows: (revocations: [LedgerFacts.Revocation], order: Order?)?

    /// A run of `purchases` (as the verified result lists them; a transaction listed twice is
    /// credited once) from `upload`, which names `upload.transactionId` and `upload.orderId`;
    /// `namedOriginal`: what a named StoreKit 1 transaction stands for.
    public init(
        purchases: [VerifiedPurchase], upload: LedgerEvent.Upload, namedOriginal: FinishAdvice.NamedOriginal? = nil,
        policy: LedgerPolicy
    ) {
        var seen = Set<String>()
        self.purchases = purchases.filter { seen.insert($0.transactionId).inserted }
        self.upload = upload
        self.namedOriginal = namedOriginal
        self.policy = policy
    }

    /// What to do next.
    public mutating func next() -> Step {
        if position < purchases.count { return .plan(.upload(purchases[position], upload)) }
        if naming == nil {
            let naming = namingEvent()
            self.naming = naming
            if naming.isNeeded { return .plan(.naming(naming)) }
        }
        if query == nil {
            let query = FinishAdvice.verdictQuery(transactionId: upload.transactionId, orderId: upload.orderId, outcomes: result.outcomes)
            self.query = query
            if query.revocationsOf != nil || query.order != nil { return .read(query) }
            rows = ([], nil)
        }
        return .done(settled())
    }

    /// The plan the shell wrote for the event `next()` gave.
    public mutating func planned(_ plan: LedgerPlan) {
        result.revoked += plan.revoked
        switch plan.outcome {
        case .transaction(let state, let reason):
            precondition(position < purchases.count, "an upload's run was handed a purchase's plan it did not ask for")
            let purchase = purchases[position]
            position += 1
            result.outcomes.append(
                .init(
                    transactionId: purchase.transactionId, state: state, reason: reason,
                    lookup: purchase.ownershipEvidence == .lookup, originalTransactionId: purchase.originalTransactionId,
                    productId: purchase.productId, staysInReceipts: policy.staysInReceipts(purchase.productId)))
            result.purchases.append(purchase)
        case .naming(let outcome):
            namingOutcome = outcome
        default:
            preconditionFailure("the ledger answered an upload's event with \(plan.outcome)")
        }
    }

    /// The rows the verdict asked for (`Step.read`), as the plans left them.
    public mutating func read(revocations: [LedgerFacts.Revocation], order: Order?) {
        rows = (revocations, order)
    }

    /// What the upload named that its purchases did not settle: an order named alone, or a
    /// named transaction the receipt lacks (the ledger may hold it).
    private func namingEvent() -> LedgerEvent.Naming {
        let named = upload.transactionId
        let missing = named.flatMap { named in result.outcomes.contains { $0.transactionId == named } ? nil : named }
        var naming = LedgerEvent.Naming(
            userId: upload.userId, submissionId: upload.submissionId, orderId: named == nil || missing != nil ? upload.orderId : nil,
            missingTransactionId: missing)
        naming.inUpload = Set(purchases.map(\.transactionId))
        naming.tokenNamesOrder =
            upload.orderId.map { order in purchases.contains { $0.appAccountToken?.lowercased() == order.lowercased() } } ?? false
        return naming
    }

    private func settled() -> UploadResult {
        var result = result
        result.tokenNamesOrder = naming?.tokenNamesOrder ?? false
        result.verdict = FinishAdvice.verdict(
            userId: upload.userId, transactionId: upload.transactionId, orderId: upload.orderId, outcomes: result.outcomes,
            namedRevocations: rows?.revocations ?? [], namedOrder: rows?.order, namedOriginal: namedOriginal, naming: namingOutcome)
        return result
    }
}

/// What an upload came to (`UploadRun`).
public struct UploadResult: Sendable {
    /// The answer the app gets.
    public var verdict = UploadVerdict(state: .credited)
    /// What became of each purchase, in receipt order (each transaction once).
    public var outcomes: [FinishAdvice.PurchaseOutcome] = []
    /// The purchases those outcomes are of, in the same order.
    public var purchases: [VerifiedPurchase] = []
    /// Grants the upload's plans revoked (Apple's answer said refunded, or a restore moved one).
    public var revoked = 0
    /// Whether a purchase of the upload carries the token of the order it names.
    public var tokenNamesOrder = false

    /// How many of its purchases were credited now.
    public var credited: Int { outcomes.filter { $0.state == .credited }.count }
    /// How many of its purchases are credited to another user (a replay, refused).
    public var replayed: Int { outcomes.filter { $0.state == .replayedFromOtherUser }.count }

    /// The purchases the answer lists with their outcomes (none when the verdict lists none).
    public var listed: [(purchase: VerifiedPurchase, outcome: FinishAdvice.PurchaseOutcome)] {
        verdict.listsTransactions ? Array(zip(purchases, outcomes)) : []
    }

    /// The purchases to finish at Apple once this upload is committed, when the server finishes
    /// them: every transaction of the upload that is settled (credited now or before, another
    /// user's, refunded, replaced); a held one never is, and a lookup that proved nothing
    /// finishes nothing. Never an id the upload only named (a transaction the receipt lacks,
    /// refunded or a StoreKit 1 restore): a transaction id is a lookup, and Apple's Finish
    /// Transaction reaches any customer's; only the app's own `finish()`, which reaches its own
    /// device's alone, may end it.
    public var finishAtApple: [VerifiedPurchase] {
        listed.filter { FinishAdvice.mayFinish($0.outcome.state) }.map(\.purchase)
    }
}
