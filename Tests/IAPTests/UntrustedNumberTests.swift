import AppStore
import Foundation
import IAPCore
import Ledger
import Testing

/// No number from outside traps the process: each kind of input (receipt dates, signed payload
/// dates and counts, Apple's answers, message bodies, what the store writes) at the edges of
/// its range and far past them is refused or bounded where it is decoded. (User tokens:
/// `UserTokenTests.outOfRangeNumericDatesAreRefusedNeverTrapped`.)
@Suite("Untrusted numbers")
struct UntrustedNumberTests {
    static let extremes: [Double] = [1e19, -1e19, 1e20, -1e20, 1e300, -1e300, .infinity, -.infinity, .nan]

    /// A receipt date whose offset carries it out of 1970…9999 (the year 10000, the year -1) is
    /// an invalid field, never a date handed to the certificate check, where it would trap.
    @Test func receiptDatesOutsideTheirRangeAreInvalidFields() throws {
        for text in ["9999-12-31T23:59:59-23:59", "0000-01-01T00:00:00+00:01", "1969-12-31T23:59:59Z", "0001-01-01T00:00:00Z"] {
            let payload = TestDER.set([
                TestDER.attribute(0, TestDER.utf8("Production")),
                TestDER.attribute(2, TestDER.utf8(AppReceiptTests.bundleId)),
                TestDER.attribute(12, TestDER.ia5(text)),
            ])
            #expect(throws: AppReceiptError.self, "\(text)") { try AppReceiptParser.parse(TestDER.signedData(content: payload)) }
        }
        let fine = TestDER.set([
            TestDER.attribute(2, TestDER.utf8(AppReceiptTests.bundleId)),
            TestDER.attribute(12, TestDER.ia5("9999-12-31T23:59:59Z")),
        ])
        #expect(try AppReceiptParser.parse(TestDER.signedData(content: fine)).creationDate != nil)
    }

    /// Apple's milliseconds in a signed payload are taken as the nearest date within 1970…9999,
    /// and every date, however it was made, is written without a trap.
    @Test func signedPayloadDatesAndStoredDatesNeverTrap() {
        for milliseconds in [Int64.max, Int64.min, -1, 0, 253_402_300_800_000] {
            let date = Date(appleMilliseconds: milliseconds)
            #expect(DateText.accepts(date), "\(milliseconds)")
            #expect(DateText.acceptedMilliseconds.contains(date.appleMilliseconds))
            #expect(DateText.format(date).count == 24, "\(DateText.format(date))")
        }
        for seconds in Self.extremes {
            let date = Date(timeIntervalSince1970: seconds)
            let text = DateText.format(date)
            #expect(text.hasPrefix("1970-") || text.hasPrefix("9999-"), "\(seconds): \(text)")
            _ = date.appleMilliseconds
            #expect(DateText.date(milliseconds: seconds) == nil || (0...253_402_300_799_999).contains(seconds))
        }
        #expect(DateText.date(milliseconds: Int64.max) == nil && DateText.date(milliseconds: Int64(-1)) == nil)
    }

    /// Counts and shares from outside: a quantity or a refund share at any Int is bounded before
    /// it is multiplied, and balances add up saturating.
    @Test func quantitiesAndSharesAreBoundedBeforeArithmetic() {
        for percentage in [Int.max, Int.min, -1, 100_001] {
            let units = Ledger.refundedUnits(of: 3, percentage: percentage)
            #expect((1...3).contains(units), "\(percentage)")
        }
        #expect(Ledger.refundedUnits(of: Int.max, percentage: 100_000) == VerifiedPurchase.maxQuantity)
        let coins = Catalog.Product(productId: "coins", type: .consumable, grant: ["coins": .number(60)])
        #expect(coins.grant(quantity: Int.max)["coins"] == .number(Int.max))
        #expect(coins.grant(quantity: 3)["coins"] == .number(180))
    }

    /// A message is input too: a date past 9999 or before 1970, an attempt counter at either
    /// end of Int, a quantity past its bound, is an undecodable message (dead-lettered), never a
    /// trap further on.
    @Test func messagesWithNumbersOutOfBoundsAreUndecodable() throws {
        let codec = MessageCodec()
        // Whole seconds: milliseconds travel as a Double, and a date read back is compared exactly.
        let request = VerifyRequest(submissionId: UUID(), userId: "u1", receiptData: "AAAA", acceptedAt: Date(timeIntervalSince1970: 1_800_000_000))
        let good = try codec.encode(request)
        #expect(try codec.decodeRequest(from: good) == request)
        func replacing(_ bytes: [UInt8], _ key: String, with value: String) throws -> [UInt8] {
            var object = try #require(try JSONSerialization.jsonObject(with: Data(bytes)) as? [String: Any])
            object[key] = try JSONSerialization.jsonObject(with: Data(value.utf8), options: .fragmentsAllowed)
            return Array(try JSONSerialization.data(withJSONObject: object))
        }
        for (key, value) in [
            ("acceptedAt", "1e300"), ("acceptedAt", "-1e19"), ("acceptedAt", "253402300800000"), ("attempt", "9223372036854775807"),
            ("attempt", "-9223372036854775808"), ("attempt", "0"), ("malformedAnswers", "9223372036854775807"),
        ] {
            #expect(throws: (any Error).self, "\(key) \(value)") { try codec.decodeRequest(from: try replacing(good, key, with: value)) }
        }
        let purchase = VerifiedPurchase(
            transactionId: "1", originalTransactionId: "1", productId: "p", quantity: Int.max, purchaseDate: nil, environment: .production)
        let result = VerifyResult(
            submissionId: UUID(), userId: "u1", orderId: nil, attempt: 1,
            outcome: .verified(VerifiedReceipt(bundleId: "b", environment: .production, purchases: [purchase])))
        #expect(throws: MessageBoundsError.self) { try codec.decodeResult(from: try codec.encode(result)) }
    }
}
