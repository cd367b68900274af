import Foundation
import IAPCore
import Ledger
import Testing

/// The one upload run every shell drives (`UploadRun`): the exact steps it asks of a shell, in
/// order, and what it settles, with no store.
@Suite("Ledger: one upload's run, as every shell drives it")
struct UploadRunTests {
    static let t0 = Date(timeIntervalSince1970: 1_800_000_000)
    let policy = LedgerPolicy(catalog: Catalog(products: [.init(productId: "coins", type: .consumable, grant: ["coins": .number(1)])]))

    func coins(_ id: String, token: String? = nil) -> VerifiedPurchase {
        var purchase = VerifiedPurchase(
            transactionId: id, originalTransactionId: id, productId: "coins", quantity: 1, purchaseDate: Self.t0,
            environment: .production)
        purchase.appAccountToken = token
        return purchase
    }

    /// Drives `run` with empty facts for each plan (each purchase new) and the given rows,
    /// recording every step it asked for.
    func drive(_ run: inout UploadRun, order: Order? = nil) -> (steps: [String], result: UploadResult) {
        var steps: [String] = []
        while true {
            switch run.next() {
            case .plan(let event):
                switch event {
                case .upload(let purchase, _): steps.append("plan upload \(purchase.transactionId)")
                case .naming(let naming):
                    steps.append("plan naming order=\(naming.orderId ?? "-") missing=\(naming.missingTransactionId ?? "-")")
                default: steps.append("plan \(event)")
                }
                run.planned(Ledger.plan(event, facts: LedgerFacts(), policy: policy, now: Self.t0 + 60))
            case .read(let query):
                steps.append("read revocations=\(query.revocationsOf ?? "-") order=\(query.order ?? "-")")
                run.read(revocations: [], order: order)
            case .done(let result):
                steps.append("done \(result.verdict.state)")
                return (steps, result)
            }
        }
    }

    @Test func aReceiptIsCreditedPurchaseByPurchaseEachTransactionOnceAndNothingIsReadForAVerdictThatNeedsNothing() {
        var run = UploadRun(
            purchases: [coins("1"), coins("2"), coins("1")],
            upload: .init(userId: "olga", submissionId: "s", orderId: nil, transactionId: "2", bundleId: "app"), policy: policy)
        let (steps, result) = drive(&run)
        #expect(steps == ["plan upload 1", "plan upload 2", "done credited"])
        #expect(result.outcomes.map(\.transactionId) == ["1", "2"] && result.credited == 2 && result.replayed == 0)
        #expect(result.listed.map(\.purchase.transactionId) == ["1", "2"])
        #expect(result.finishAtApple.map(\.transactionId) == ["1", "2"])
    }

    @Test func aNamedTransactionTheReceiptLacksIsNamedToTheLedgerAndItsRevocationsRead() {
        var run = UploadRun(
            purchases: [coins("1")], upload: .init(userId: "olga", submissionId: "s", orderId: nil, transactionId: "9", bundleId: "app"),
            policy: policy)
        let (steps, result) = drive(&run)
        #expect(steps == ["plan upload 1", "plan naming order=- missing=9", "read revocations=9 order=-", "done rejected"])
        #expect(result.verdict.reason == .transactionNotInReceipt, "\(result.verdict)")
        // Never an id the upload only named: only what the receipt holds is finished at Apple.
        #expect(result.finishAtApple.map(\.transactionId) == ["1"])
    }

    @Test func anOrderNamedAloneIsNamedToTheLedgerWithWhetherAPurchaseCarriesItsTokenAndTheOrderRead() {
        let token = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
        var run = UploadRun(
            purchases: [coins("1", token: token.uppercased())],
            upload: .init(userId: "olga", submissionId: "s", orderId: token, transactionId: nil, bundleId: "app"), policy: policy)
        let paid = Order(
            id: token, userId: "olga", productId: "coins", state: .paid, transactionId: "1", createdAt: Self.t0)
        let (steps, result) = drive(&run, order: paid)
        #expect(steps == ["plan upload 1", "plan naming order=\(token) missing=-", "read revocations=- order=\(token)", "done credited"])
        #expect(result.tokenNamesOrder)
    }
}

/// Reconciliation's one question to the core before it applies what Apple's history says.
@Suite("Ledger: what reconciliation applies")
struct ReconciliationNewsTests {
    let standing = LedgerFacts.Revocation(
        creditKey: .transaction("1"), transactionId: "1", source: "REFUND", revokedAt: UploadRunTests.t0, reversedAt: nil,
        fullyRevokedAt: UploadRunTests.t0)

    @Test func aRefundTheLedgerHoldsStandingWithNothingGrantedIsNoNewsAndEverythingElseIs() {
        #expect(!ReconciliationChoice.isNews("REFUND", revocation: standing, grantedUnderKey: false))
        #expect(!ReconciliationChoice.isNews("REVOKE", revocation: standing, grantedUnderKey: false))
        // Something granted under the key again (by hand, or a restore): the refund applies.
        #expect(ReconciliationChoice.isNews("REFUND", revocation: standing, grantedUnderKey: true))
        // A reversal later than the refund: the refund no longer stands, so Apple's word is news.
        var reversed = standing
        reversed.reversedAt = UploadRunTests.t0 + 60
        #expect(ReconciliationChoice.isNews("REFUND", revocation: reversed, grantedUnderKey: false))
        #expect(ReconciliationChoice.isNews("REFUND", revocation: nil, grantedUnderKey: false))
        #expect(ReconciliationChoice.isNews("DID_RENEW", revocation: standing, grantedUnderKey: false))
    }
}
