import IAPCore
import Ledger
import Testing

/// The answer to Apple's refund request, from the ledger's facts alone: no broker, no store.
@Suite("Refund requests answered from the ledger's facts")
struct ConsumptionAnswerTests {
    let spent = ConsumptionAnswer.Facts(ownershipType: "PURCHASED", delivered: true, consumptionPercentage: 100_000, userConsented: nil)

    @Test func nothingIsSentWithoutConsent() {
        #expect(ConsumptionAnswer.decide(spent, settings: .init(consent: .none)) == .skip(reason: ConsumptionAnswer.noConsent))
        // Per user: only a user the app recorded as consenting.
        var facts = spent
        for consented in [nil, false] as [Bool?] {
            facts.userConsented = consented
            #expect(ConsumptionAnswer.decide(facts, settings: .init(consent: .perUser)) == .skip(reason: ConsumptionAnswer.noConsent))
        }
        facts.userConsented = true
        guard case .send = ConsumptionAnswer.decide(facts, settings: .init(consent: .perUser)) else {
            Issue.record("a consenting user's request is not answered")
            return
        }
    }

    @Test func anAssignedTransactionIsNeverAnswered() {
        var facts = spent
        facts.ownershipType = "ASSIGNED"
        facts.userConsented = true
        for consent in ConsumptionAnswer.Consent.allCases {
            #expect(ConsumptionAnswer.decide(facts, settings: .init(consent: consent)) == .skip(reason: ConsumptionAnswer.assigned))
        }
    }

    @Test func theAnswerSaysWhatTheLedgerKnows() {
        let settings = ConsumptionAnswer.Settings(consent: .all, refundPreference: "DECLINE", sampleContentProvided: true)
        let expected = ConsumptionAnswer.Body(
            customerConsented: true, deliveryStatus: "DELIVERED", sampleContentProvided: true, consumptionPercentage: 100_000,
            refundPreference: "DECLINE")
        #expect(ConsumptionAnswer.decide(spent, settings: settings) == .send(expected))
        // Credited, nothing reported: the share used is not known, so it is not said.
        var unreported = spent
        unreported.consumptionPercentage = nil
        guard case .send(let body) = ConsumptionAnswer.decide(unreported, settings: .init(consent: .all)) else {
            Issue.record("not answered")
            return
        }
        #expect(body.consumptionPercentage == nil && body.refundPreference == nil && body.deliveryStatus == "DELIVERED")
        // Never credited to anyone (held, or never uploaded): not delivered, nothing used,
        // whatever the app reported.
        var undelivered = spent
        undelivered.delivered = false
        guard case .send(let missing) = ConsumptionAnswer.decide(undelivered, settings: .init(consent: .all)) else {
            Issue.record("not answered")
            return
        }
        #expect(missing.deliveryStatus == "UNDELIVERED_OTHER" && missing.consumptionPercentage == 0)
    }

    /// Apple takes no share of an auto-renewable subscription, and a prorated refund only with a
    /// share: without one, no preference is said rather than a share made up.
    @Test func aSubscriptionHasNoShareAndAProratedPreferenceNeedsOne() {
        let prorated = ConsumptionAnswer.Settings(consent: .all, refundPreference: "GRANT_PRORATED")
        var period = spent
        period.productType = .autoRenewable
        #expect(
            ConsumptionAnswer.decide(period, settings: prorated)
                == .send(.init(customerConsented: true, deliveryStatus: "DELIVERED", sampleContentProvided: false, consumptionPercentage: nil, refundPreference: nil)))
        period.delivered = false
        guard case .send(let undelivered) = ConsumptionAnswer.decide(period, settings: prorated) else { return }
        #expect(undelivered.consumptionPercentage == nil && undelivered.deliveryStatus == "UNDELIVERED_OTHER")
        var consumable = spent
        consumable.productType = .consumable
        guard case .send(let spentBody) = ConsumptionAnswer.decide(consumable, settings: prorated) else { return }
        #expect(spentBody.consumptionPercentage == 100_000 && spentBody.refundPreference == "GRANT_PRORATED")
        consumable.consumptionPercentage = nil
        guard case .send(let unknown) = ConsumptionAnswer.decide(consumable, settings: prorated) else { return }
        #expect(unknown.consumptionPercentage == nil && unknown.refundPreference == nil)
    }
}
