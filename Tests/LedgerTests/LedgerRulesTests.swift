import Foundation
import IAPCore
import Ledger
import Testing

/// The ledger's pure rules (`Ledger`), with no store, broker or clock: credit keys, who a
/// purchase belongs to, and what the app may finish; and docs/ledger.md's tables against them.
@Suite("Ledger rules")
struct LedgerRulesTests {
    func purchase(_ id: String, original: String? = nil, period: String? = nil) -> VerifiedPurchase {
        VerifiedPurchase(
            transactionId: id, originalTransactionId: original ?? id, productId: "p", quantity: 1, purchaseDate: nil,
            environment: .production, webOrderLineItemId: period)
    }

    @Test func eachProductTypeIsCreditedOnceByItsOwnKey() {
        let restore = purchase("t2", original: "t1", period: "w1")
        #expect(CreditKey(of: restore, type: .consumable) == .transaction("t2"))
        #expect(CreditKey(of: restore, type: nil) == .transaction("t2"))
        #expect(CreditKey(of: restore, type: .nonConsumable) == .originalTransaction("t1"))
        #expect(CreditKey(of: restore, type: .nonRenewing) == .originalTransaction("t1"))
        #expect(CreditKey(of: restore, type: .autoRenewable) == .billingPeriod("w1"))
        #expect(CreditKey(of: purchase("t3"), type: .autoRenewable) == .transaction("t3"))
        for key in [CreditKey.transaction("1"), .originalTransaction("2"), .billingPeriod("3")] {
            #expect(CreditKey(stored: key.stored) == key)
        }
        // The stored form is the one every earlier version wrote.
        #expect(CreditKey.billingPeriod("42").stored == "wol:42")
        #expect(CreditKey(stored: "xyz:1") == nil)
        #expect(CreditKey.transaction("1").isPerTransaction && !CreditKey.originalTransaction("1").isPerTransaction)
    }

    @Test func aLookupProvesNobodysOwnership() {
        for restore in RestorePolicy.allCases {
            // A bare id or an unsigned receipt: held, whoever asks.
            #expect(Ownership.decide(.init(uploader: "mallory", evidence: .lookup), restore: restore) == .held(.ownerUnknown))
            // An upload Apple vouches for: the uploader's.
            #expect(Ownership.decide(.init(uploader: "ana", evidence: .signedUpload), restore: restore) == .credit(owner: "ana"))
            // A token naming one of our orders: that order's owner's, whoever uploads, whatever the evidence.
            for evidence in OwnershipEvidence.allCases {
                #expect(
                    Ownership.decide(.init(uploader: "mallory", evidence: evidence, tokenOrderOwner: "ana"), restore: restore)
                        == .credit(owner: "ana"))
            }
        }
    }

    @Test func everyBillingPeriodGoesToTheSubscriptionsOwner() {
        for evidence in OwnershipEvidence.allCases {
            // The owner's own period, by any route.
            #expect(
                Ownership.decide(.init(uploader: "ana", evidence: evidence, subscriptionOwner: "ana"), restore: .keep)
                    == .credit(owner: "ana"))
            // Uploaded by someone else under keep: still the owner's.
            #expect(
                Ownership.decide(.init(uploader: "ben", evidence: evidence, subscriptionOwner: "ana"), restore: .keep)
                    == .credit(owner: "ana"))
        }
        // Under transfer, only an upload Apple vouches for moves the subscription.
        #expect(
            Ownership.decide(.init(uploader: "ben", evidence: .signedUpload, subscriptionOwner: "ana"), restore: .transfer)
                == .creditMovingSubscription(from: "ana", to: "ben"))
        #expect(
            Ownership.decide(.init(uploader: "ben", evidence: .lookup, subscriptionOwner: "ana"), restore: .transfer)
                == .credit(owner: "ana"))
    }

    @Test func usersAreComparedByteForByte() {
        let composed = "jos\u{E9}"
        let decomposed = "jose\u{301}"
        #expect(composed == decomposed)  // Swift's equality: canonical equivalence
        #expect(!sameUser(composed, decomposed))
        #expect(
            Ownership.decide(.init(uploader: decomposed, evidence: .lookup, subscriptionOwner: composed), restore: .keep)
                == .credit(owner: composed))
        #expect(sameUser("ana", "ana"))
    }

    /// A receipt that does not hold the transaction the upload names: refunded in full (and not
    /// reversed since), Apple leaves it out of every receipt, so the upload is settled; anything
    /// else may be a receipt older than the purchase, and the app refreshes it.
    @Test func aNamedTransactionMissingFromTheReceiptIsSettledOnlyByAFullRefund() {
        let at = Date(timeIntervalSince1970: 1_800_000_000)
        func revocation(full: Date? = nil, partly: Date? = nil, reversed: Date? = nil) -> LedgerFacts.Revocation {
            LedgerFacts.Revocation(
                creditKey: .transaction("1"), transactionId: "1", source: "REFUND", revokedAt: full ?? partly ?? at, reversedAt: reversed,
                fullyRevokedAt: full, partlyRevokedAt: partly, revokedUnits: partly == nil ? nil : 1)
        }
        let cases: [([LedgerFacts.Revocation], ReasonCode)] = [
            ([], .transactionNotInReceipt),
            ([revocation(full: at)], .purchaseRevoked),
            ([revocation(full: at, reversed: at.addingTimeInterval(1))], .transactionNotInReceipt),
            ([revocation(full: at.addingTimeInterval(2), reversed: at.addingTimeInterval(1))], .purchaseRevoked),
            ([revocation(partly: at)], .transactionNotInReceipt),
        ]
        for (revocations, expected) in cases {
            let reason = FinishAdvice.namedTransactionMissing(revocations: revocations)
            #expect(reason == expected, "\(revocations)")
            #expect(
                FinishAdvice.mayFinishUpload(state: .rejected, reason: reason, named: .transaction, settledByHand: false)
                    == (expected == .purchaseRevoked))
        }
    }

    @Test func anUploadThatNamesNothingIsNeverFinishableAtTheTop() {
        for state in SubmissionState.allCases {
            for reason in [nil, ReasonCode.invalidReceipt, .replayedFromOtherUser, .purchaseRevoked] {
                #expect(!FinishAdvice.mayFinishUpload(state: state, reason: reason, named: .nothing, settledByHand: false))
                #expect(FinishAdvice.mayFinishUpload(state: state, reason: reason, named: .nothing, settledByHand: true))
            }
        }
        #expect(FinishAdvice.mayFinishUpload(state: .credited, reason: nil, named: .order, settledByHand: false))
        #expect(!FinishAdvice.mayFinishUpload(state: .rejected, reason: .transactionNotInReceipt, named: .order, settledByHand: false))
        #expect(!FinishAdvice.mayFinishUpload(state: .needsReview, reason: .ownerUnknown, named: .transaction, settledByHand: false))
    }

    /// Every answer has a way out: each reason the code can give (every `ReasonCode("…")` in
    /// the sources, the verifier's JWS reasons among them) has its row in docs/ledger.md's
    /// table of what the app does next, and a row that says "finishes" only for a reason the
    /// app may finish on.
    @Test func everyReasonHasAWayOut() throws {
        let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
            .deletingLastPathComponent()
        let page = try String(contentsOf: root.appendingPathComponent("docs/ledger.md"), encoding: .utf8)
        let section = try #require(page.components(separatedBy: "## Every answer has a way out").dropFirst().first)
        let table = section.components(separatedBy: "\n## ").first ?? section
        var documented: [String: String] = [:]
        for line in table.split(separator: "\n") where line.hasPrefix("| `") {
            let cells = line.split(separator: "|").map { $0.trimmingCharacters(in: .whitespaces) }
            for (index, part) in cells[0].split(separator: "`", omittingEmptySubsequences: false).enumerated() where index % 2 == 1 {
                documented[String(part)] = cells[1]
            }
        }
        var given: Set<String> = []
        let sources = root.appendingPathComponent("Sources")
        let files = FileManager.default.enumerator(at: sources, includingPropertiesForKeys: nil)
        while let file = files?.nextObject() as? URL {
            guard file.pathExtension == "swift", !file.path.contains("/FakeAppStore/") else { continue }
            let text = try String(contentsOf: file, encoding: .utf8)
            for piece in text.components(separatedBy: "ReasonCode(\"").dropFirst() {
                let code = piece.prefix { $0.isLowercase || $0 == "_" || $0.isNumber }
                if !code.isEmpty, piece.dropFirst(code.count).hasPrefix("\")") { given.insert(String(code)) }
            }
        }
        // The JWS verifier's reasons are its error codes (`SignedDataError`).
        given.formUnion([
            "jws_untrusted_chain", "jws_certificate_expired", "jws_invalid_certificate", "environment_mismatch",
            "app_apple_id_mismatch",
        ])
        #expect(given.count > 30, "the sources' reasons were not found: \(given.sorted())")
        for reason in given.sorted() where reason != "some_new_reason" {
            #expect(documented[reason] != nil, "\(reason) has no way out in docs/ledger.md")
        }
        for (reason, action) in documented where action.hasPrefix("finishes the transaction") {
            #expect(
                FinishAdvice.mayFinishUpload(state: .rejected, reason: ReasonCode(reason), named: .transaction, settledByHand: false)
                    || reason == "original_transaction_settled", "\(reason) says finish but is not finishable")
        }
    }

    /// docs/ledger.md's two finish tables say what the code does, row by row.
    @Test func theLedgerPagesFinishTablesMatchTheCode() throws {
        let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
            .deletingLastPathComponent()
        let page = try String(contentsOf: root.appendingPathComponent("docs/ledger.md"), encoding: .utf8)
        let rows = page.split(separator: "\n").filter { $0.hasPrefix("| `") || $0.hasPrefix("| any") }.map { line in
            line.split(separator: "|", omittingEmptySubsequences: false).dropFirst().dropLast()
                .map { $0.trimmingCharacters(in: .whitespaces) }
        }
        func codes(_ cell: String) -> [String] {
            cell.split(separator: "`", omittingEmptySubsequences: false).enumerated().filter { $0.offset % 2 == 1 }
                .map { String($0.element) }
        }
        var transactionRows = 0
        var submissionRows = 0
        for cells in rows {
            if cells.count == 3, let state = codes(cells[0]).first.flatMap(TransactionCreditState.init(rawValue:)) {
                transactionRows += 1
                #expect(FinishAdvice.mayFinish(state) == (cells[1] == "true"), "transaction row \(cells)")
            } else if cells.count == 4, cells[2] == "true" || cells[2] == "false" {
                let expected = cells[2] == "true"
                let states = cells[0].hasPrefix("any") ? SubmissionState.allCases : codes(cells[0]).compactMap(SubmissionState.init(rawValue:))
                let reasons: [ReasonCode?] = codes(cells[1]).isEmpty ? [nil, ReasonCode("some_new_reason")] : codes(cells[1]).map { ReasonCode($0) }
                let byHand = cells[1].contains("customer service")
                let named: FinishAdvice.Named = cells[0].contains("names no transaction") ? .nothing : .transaction
                #expect(!states.isEmpty, "submission row \(cells)")
                submissionRows += 1
                for state in states {
                    for reason in reasons where !(state == .rejected && reason == nil && !byHand && named != .nothing) {
                        #expect(
                            FinishAdvice.mayFinishUpload(state: state, reason: reason, named: named, settledByHand: byHand)
                                == expected,
                            "submission row \(cells): \(state) \(reason?.rawValue ?? "-")")
                    }
                }
            }
        }
        #expect(transactionRows == 8, "every transaction state has its row")
        #expect(submissionRows >= 12)
    }
}
