import Foundation
import Ledger
import Testing

/// Event bodies are written by hand: they must stay JSON whatever a user id or reason holds.
@Suite("Event JSON")
struct EventJSONTests {
    @Test func everyStringSurvivesTheRoundTripAndKeysAreSorted() throws {
        let awkward = "quote \" backslash \\ newline \n tab \t bell \u{07} nul \u{00} del \u{7F} é 🎉 </script>"
        let body = EventField.object([
            "zeta": .string(awkward), "alpha": .int(-42), "grant": .json(#"{"coins":60}"#), "orderId": .null,
            "\u{01}key": .string(""),
        ])
        let text = String(decoding: body, as: UTF8.self)
        let object = try #require(try JSONSerialization.jsonObject(with: Data(body)) as? [String: Any], "\(text)")
        #expect(object["zeta"] as? String == awkward)
        #expect(object["alpha"] as? Int == -42)
        #expect((object["grant"] as? [String: Any])?["coins"] as? Int == 60)
        #expect(object["orderId"] is NSNull)
        #expect(object["\u{01}key"] as? String == "")
        #expect(text.hasPrefix(#"{"\u0001key":"","alpha":-42,"grant":{"coins":60},"orderId":null,"zeta":"#), "\(text)")
    }
}
