import AppStore
@testable import Console
import Foundation
import IAPCore
@testable import Intake
import Logging
import NIOConcurrencyHelpers
import NIOHTTP1
import OrderStore
import Ledger
import Testing
import TestSupport

/// Unicode tricks an attacker tries on ids and on the console's pages: combining marks after
/// or before markup characters, Prepend characters, bidi and format controls, canonically
/// and compatibility-equivalent spellings, and what a lone surrogate becomes.
enum UnicodeTricks {
    /// Text that, escaped per `Character` (an extended grapheme cluster), would leave a markup
    /// character raw, or that changes how the text around it reads.
    static let markup: [String] = [
        "\u{22}\u{301}", ">\u{301}", "\u{600}<b>", "<\u{301}b>", "'\u{301}", "&\u{301}amp;", "\u{600}<",
        "x\"\u{301} autofocus data-x=\"\u{301}", "\u{200F}<b>", "\u{FEFF}\"", "e\u{301}\u{302}\"\u{20DD}>",
        "<\u{903}", "\u{D4E}<i>", "\u{1F469}\u{200D}\"", "\u{1F1E6}\"", "\r\n\"", "\u{110BD}<s>",
        "\"\u{301}><button form=note-form formaction=/admin/actions/revoke id=injected>x</button>",
        "\"\u{301}><meta http-equiv=refresh content=\"0;url=http://127.0.0.1:9/\u{301}\">",
        "\u{600}<a href=//127.0.0.1:9/ id=injected-link>x</a>",
    ]

    /// Ids no user, order or product may have, each with why.
    static let badIds: [(String, String)] = [
        ("\u{301}ana", "a leading combining mark"), ("\u{20DD}ana", "a leading enclosing mark"),
        ("\u{903}ana", "a leading spacing mark"), ("ana\u{200E}", "a bidi mark (Cf)"),
        ("an\u{202E}a", "a bidi override (Cf)"), ("ana\u{2066}", "a bidi isolate (Cf)"),
        ("a\u{200B}na", "a zero-width space (Cf)"), ("a\u{200D}na", "a zero-width joiner (Cf)"),
        ("an\u{FEFF}a", "a byte order mark (Cf)"), ("ana\u{600}", "an Arabic number sign (Prepend, Cf)"),
        ("ana\u{D4E}", "a Malayalam dot reph (Prepend)"), ("ana\u{111C2}", "a Sharada sign (Prepend)"),
        ("an\u{7}a", "a control character"), ("ana\n", "a line feed"), ("an\u{85}a", "a C1 control"),
        ("ana\u{2028}", "a line separator"), ("ana\u{FFFD}", "a replacement character"),
        ("ana\u{FFFF}", "a noncharacter"),
    ]

    /// Canonically equivalent pairs: the first is NFC, the second another spelling of it.
    static let equivalentPairs: [(String, String)] = [
        ("jos\u{E9}", "jose\u{301}"), ("Kim", "\u{212A}im"), ("\u{3A9}mega", "\u{2126}mega"),
        ("\u{C5}sa", "\u{212B}sa"),
    ]
}

@Suite("Console escaping and ids, per Unicode scalar", .teardown)
struct UnicodeTrickTests {
    @Test func escapingIsPerUnicodeScalar() {
        #expect(ConsoleHTML.escape("\u{22}\u{301}").unicodeScalars.elementsEqual("&quot;\u{301}".unicodeScalars))
        #expect(ConsoleHTML.escape(">\u{301}").unicodeScalars.elementsEqual("&gt;\u{301}".unicodeScalars))
        #expect(ConsoleHTML.escape("\u{600}<b>").unicodeScalars.elementsEqual("\u{600}&lt;b&gt;".unicodeScalars))
        #expect(ConsoleHTML.escape("'&").unicodeScalars.elementsEqual("&#39;&amp;".unicodeScalars))
        for text in UnicodeTricks.markup {
            let escaped = ConsoleHTML.escape(text)
            #expect(!escaped.unicodeScalars.contains { "<>\"'".unicodeScalars.contains($0) }, "\(text.debugDescription)")
        }
    }

    /// Every template, rendered with every hostile text in every variable, holds exactly as
    /// many markup characters (`<`, `>`, `"`, `'`, counted per scalar) as it does rendered with
    /// plain text: nothing a value holds becomes markup, in attribute or text position.
    @Test func everyTemplateRendersHostileTextAsText() async throws {
        let folder = FileManager.default.temporaryDirectory.appendingPathComponent("iap-console-\(UUID().uuidString)")
        let store = try await TestStore.open(in: folder)
        Teardown.add { await store.close() }
        let console = try Console(
            settings: ConsoleSettings(operatorTokens: ["operator-token-0123456789abcdefghijkl"], insecureCookies: true),
            dependencies: ConsoleDependencies(
                store: store, catalog: nil, names: .init(), broker: nil, appStore: nil, signedData: nil),
            logger: Logger(label: "iap.tests.console"))
        let templatesFolder = consoleTemplatesFolder()
        let names = try FileManager.default.contentsOfDirectory(atPath: templatesFolder.path).filter { $0.hasSuffix(".mustache") }
        #expect(names.count >= 8)
        var variables: Set<String> = []
        for name in names {
            let text = try String(contentsOf: templatesFolder.appendingPathComponent(name), encoding: .utf8)
            #expect(text.hasPrefix(ConsoleHTML.pragma), "\(name) does not escape with ConsoleHTML")
            let pattern = try NSRegularExpression(pattern: #"\{\{\{?[#^/]?\s*([A-Za-z0-9_.]+)\s*\}?\}\}"#)
            for match in pattern.matches(in: text, range: NSRange(text.startIndex..., in: text)) {
                variables.insert(String(text[Range(match.range(at: 1), in: text)!]))
            }
        }
        func context(_ value: String) -> [String: Any] {
            var context: [String: Any] = [:]
            for variable in variables where variable != "chart" {
                let parts = variable.split(separator: ".").map(String.init)
                guard let first = parts.first, first != "session" else { continue }
                if parts.count == 2 {
                    var inner = context[parts[0]] as? [String: Any] ?? [:]
                    inner[parts[1]] = value
                    context[parts[0]] = inner
                } else if context[parts[0]] == nil {
                    context[parts[0]] = value
                }
            }
            context["chart"] = "<svg></svg>"
            return context
        }
        func markupCount(_ html: String) -> [Unicode.Scalar: Int] {
            var counts: [Unicode.Scalar: Int] = [:]
            for scalar in html.unicodeScalars where "<>\"'".unicodeScalars.contains(scalar) { counts[scalar, default: 0] += 1 }
            return counts
        }
        for template in names.map({ String($0.dropLast(".mustache".count)) }) {
            let session = console.sessions.create(role: .operator_, actor: "plain")
            let plain = markupCount(console.render(template, title: "plain", session: session, context("plain")))
            for hostile in UnicodeTricks.markup {
                let operatorSession = console.sessions.create(role: .operator_, actor: hostile)
                let html = console.render(template, title: hostile, session: operatorSession, context(hostile))
                #expect(markupCount(html) == plain, "\(template) with \(hostile.debugDescription)")
                for raw in ["<button form=", "<meta http-equiv", "<a href=//", "<b>", "<i>", "<s>"] {
                    #expect(!html.contains(raw), "\(template) with \(hostile.debugDescription): \(raw) went out raw")
                }
            }
        }
    }

    @Test func theNextPageAfterSignInIsAnASCIIPathUnderAdmin() {
        #expect(Console.consolePath("/admin/users/ana%40example.com") == "/admin/users/ana%40example.com")
        for next in [
            "//127.0.0.1:9/", "/admin//127.0.0.1:9", "/admin/\\\\evil", "https://evil/admin/", "/admin/\u{301}", "/admin/\"\u{301}>",
            "/admin/ x", "/other/", "/admin/\u{202E}", "/admin/\n",
        ] {
            #expect(Console.consolePath(next) == nil, "\(next.debugDescription)")
        }
    }

    @Test func eachActionHasItsOwnCSRFToken() {
        let sessions = ConsoleSessions(lifetime: 60)
        let session = sessions.create(role: .operator_, actor: "olga")
        let tokens = Set((ConsoleAction.allCases.map(\.rawValue) + ["logout"]).map { session.csrfToken(for: $0) })
        #expect(tokens.count == ConsoleAction.allCases.count + 1)
        #expect(!tokens.contains(session.csrfToken))
        let other = sessions.create(role: .operator_, actor: "olga")
        #expect(other.csrfToken(for: "note") != session.csrfToken(for: "note"))
    }

    @Test func idsThatJoinTheTextAroundThemAreRefused() {
        for (id, why) in UnicodeTricks.badIds {
            #expect(IdentifierText.problem(id) != nil, "\(why): \(id.debugDescription)")
        }
        for id in ["ana", "jos\u{E9}", "jose\u{301}", "carol@example.com", "a b", "\u{41F}\u{451}\u{442}\u{440}",
            "\u{5D0}\u{5D1}", "\u{1F600}", "user-1_2.3"]
        {
            #expect(IdentifierText.problem(id) == nil, "\(id.debugDescription)")
        }
        for (nfc, other) in UnicodeTricks.equivalentPairs {
            #expect(nfc == other, "Swift's == holds them equal: the reason for sameUser")
            #expect(!sameUser(nfc, other))
            #expect(IdentifierText.problem(nfc, requireNFC: true) == nil)
            #expect(IdentifierText.problem(other, requireNFC: true) != nil, "\(other.debugDescription)")
        }
    }

    /// Lookalikes of a reserved actor, most in one script, which the mixed-script rule lets
    /// through: the confusable skeleton (UTS #39's table, whatever the script) refuses them;
    /// plain names in any script are taken.
    @Test func reservedActorsLookalikesInAnyScriptAreRefused() {
        let lookalikes = [
            "\u{13AA}\u{13E2}\u{13E2}\u{13DE}\u{13AC}",  // Cherokee ᎪᏢᏢᏞᎬ
            "\u{1D00}\u{1D18}\u{1D18}\u{29F}\u{1D07}",  // Latin small capitals ᴀᴘᴘʟᴇ
            "\u{2C65}pple",  // ⱥ, a with stroke
            "\u{13DA}\u{13BD}\u{13DA}\u{13A2}\u{13AC}\u{13B7}",  // Cherokee ᏚᎽᏚᎢᎬᎷ
            "\u{A4E2}\u{A4EC}\u{A4E2}\u{A4D4}\u{A4F0}\u{A4DF}",  // Lisu ꓢꓬꓢꓔꓰꓟ
            "\u{455}\u{443}\u{455}\u{442}\u{435}\u{43C}",  // Cyrillic ѕуѕтем
            "\u{455}\u{442}\u{43E}\u{433}\u{435}\u{43A}\u{456}\u{442}",  // Cyrillic ѕтогекіт
            "\u{1D04}\u{1D0F}\u{274}\u{A731}\u{1D0F}\u{29F}\u{1D07}",  // Latin small capitals ᴄᴏɴꜱᴏʟᴇ
            "\u{399}\u{39D}\u{3A4}\u{391}\u{39A}\u{395}",  // Greek ΙΝΤΑΚΕ
            "\u{3B1}\u{3C1}\u{3C1}\u{3B9}\u{3B5}",  // Greek αρριε
            "APPLE", "app1e", "appIe", "c0ns0le", "Apple Inc.", "\u{FF41}\u{FF50}\u{FF50}\u{FF4C}\u{FF45}",
        ]
        for name in lookalikes {
            #expect(IdentifierText.isReservedActor(name), "\(name.unicodeScalars.map { String($0.value, radix: 16) })")
            #expect(IdentifierText.actorProblem(name) != nil, "\(name)")
        }
        #expect(IdentifierText.skeleton("\u{13AA}\u{13E2}\u{13E2}\u{13DE}\u{13AC}") == IdentifierText.skeleton("apple"))
        // An app user's entries are signed `user:<id>` (a user named `apple` never signs as Apple):
        // no staff name may look like one.
        for name in ["user:bob", "USER:apple", "\u{1D1C}ser:ann"] { #expect(IdentifierText.actorProblem(name) != nil, "\(name)") }
        for name in [
            "anna", "bob", "support-team", "\u{674E}\u{96F7}", "m\u{FC}ller", "\u{41C}\u{430}\u{440}\u{438}\u{44F}",
            "\u{3A3}\u{3BF}\u{3C6}\u{3AF}\u{3B1}", "apples", "systems", "Samantha Appleton", "admin",
        ] {
            #expect(!IdentifierText.isReservedActor(name), "\(name)")
            #expect(IdentifierText.actorProblem(name) == nil, "\(name)")
        }
    }

    @Test func canonicallyEquivalentKeysHaveBucketsOfTheirOwn() {
        let buckets = TokenBuckets(RateLimit(perSecond: 1, burst: 1))
        for (nfc, other) in UnicodeTricks.equivalentPairs {
            #expect(buckets.take(nfc) == nil)
            #expect(buckets.take(other) == nil, "\(other.debugDescription) shared \(nfc)'s bucket")
            #expect(buckets.take(nfc) != nil)
        }
    }
}

extension UnicodeTrickTests {
    /// 32 threads taking tokens as fast as they can for a second let through no more than
    /// the burst and the rate for the time they ran.
    @Test func bucketsHoldTheirRateUnderConcurrency() {
        let limit = RateLimit(perSecond: 200, burst: 20)
        let buckets = TokenBuckets(limit)
        let passed = NIOLockedValueBox(0)
        let start = DispatchTime.now().uptimeNanoseconds
        let deadline = start + 1_000_000_000
        DispatchQueue.concurrentPerform(iterations: 32) { _ in
            var mine = 0
            while DispatchTime.now().uptimeNanoseconds < deadline {
                if buckets.take("ana") == nil { mine += 1 }
            }
            passed.withLockedValue { $0 += mine }
        }
        let seconds = Double(DispatchTime.now().uptimeNanoseconds - start) / 1e9
        let allowed = Double(limit.burst) + Double(limit.perSecond) * seconds
        let count = passed.withLockedValue { $0 }
        #expect(Double(count) <= allowed + 1, "\(count) passed in \(seconds) s; at most \(allowed)")
        #expect(Double(count) >= Double(limit.perSecond) * 0.5, "\(count) passed: the bucket barely refilled")
    }

    /// A clock reading older than the bucket's last (a request that read it before another took
    /// the lock) refills nothing: elapsed time saturates at zero, it never wraps.
    @Test func aClockThatSeemsToGoBackNeverRefillsABucket() {
        let now = NIOLockedValueBox(UInt64(10_000_000_000))
        let buckets = TokenBuckets(RateLimit(perSecond: 1, burst: 2), clock: { now.withLockedValue { $0 } })
        #expect(buckets.take("ana") == nil)
        #expect(buckets.take("ana") == nil)
        #expect(buckets.take("ana") != nil)
        now.withLockedValue { $0 -= 100_000_000 }
        #expect(buckets.take("ana") != nil, "a clock 0.1 s behind refilled the bucket")
        now.withLockedValue { $0 += 1_100_000_000 }
        #expect(buckets.take("ana") == nil)
        #expect(buckets.take("ana") != nil)
    }
}

/// The folder of the console's templates in the source tree.
func consoleTemplatesFolder() -> URL {
    repositoryRoot.appendingPathComponent("Sources/Console/Templates")
}

extension BrokerTests {
    @Suite("Unicode tricks against every id field")
    struct UnicodeIdTests {
        static func path(_ id: String) -> String {
            id.addingPercentEncoding(withAllowedCharacters: .alphanumerics) ?? id
        }

        /// Canonically equivalent spellings of one name (NFD and NFC `josé`, KELVIN SIGN and
        /// `K`, OHM SIGN and `Ω`, ANGSTROM SIGN and `Å`) are two ids to the store, which compares
        /// bytes: a token for one reads nothing of the other on any user route, and a token
        /// whose `sub` is not NFC is refused.
        @Test func canonicallyEquivalentUserIdsReadNothingOfEachOther() async throws {
            let pipeline = try await PipelineHarness.startAuthenticated(name: "samebytes")
            Teardown.add { await pipeline.stop() }
            let base = pipeline.intakeURL
            for (owner, twin) in UnicodeTricks.equivalentPairs {
                // The other spelling's data, as another path (the admin routes, an older deployment) wrote it.
                let order = try await pipeline.store.createOrder(userId: twin, productId: "com.example.coins.60")
                let submission = VerifyRequest(submissionId: UUID(), userId: twin, receiptData: "AAAA", acceptedAt: Date())
                try await pipeline.store.accept(submission, message: nil)
                let granted = try await UserHTTP.send(
                    .POST, base + "/v1/admin/grants", token: PipelineHarness.adminToken,
                    json: ["userId": twin, "productId": "com.example.coins.60", "reason": "goodwill"])
                #expect(granted.status == 201, "\(granted.text)")

                let token = try await TestTokens.hs256(.init(owner))
                for route in ["grants", "subscriptions", "entitlements"] {
                    let answer = try await UserHTTP.send(.GET, base + "/v1/users/\(Self.path(twin))/\(route)", token: token)
                    #expect(answer.status == 404 && answer.errorCode == "user_not_found", "\(owner) \(route): \(answer.text)")
                    let own = try await UserHTTP.send(.GET, base + "/v1/users/\(Self.path(owner))/\(route)", token: token)
                    #expect(own.status == 200, "\(owner) \(route): \(own.text)")
                    #expect(!own.text.contains("com.example.coins.60"), "\(owner) sees \(twin.debugDescription)'s \(route)")
                }
                let theirOrder = try await UserHTTP.send(.GET, base + "/v1/orders/\(order.id)", token: token)
                #expect(theirOrder.status == 404 && theirOrder.errorCode == "order_not_found", "\(theirOrder.text)")
                let theirUpload = try await UserHTTP.send(.GET, base + "/v1/receipts/\(submission.submissionId)", token: token)
                #expect(theirUpload.status == 404 && theirUpload.errorCode == "submission_not_found", "\(theirUpload.text)")
                let uploadAs = try await UserHTTP.send(
                    .POST, base + "/v1/receipts", token: token, json: ["userId": twin, "transactionId": "1000000000000001"])
                #expect(uploadAs.status == 403 && uploadAs.errorCode == "user_mismatch", "\(uploadAs.text)")
                let orderAs = try await UserHTTP.send(
                    .POST, base + "/v1/orders", token: token, json: ["userId": twin, "productId": "com.example.coins.60"])
                #expect(orderAs.status == 403 && orderAs.errorCode == "user_mismatch", "\(orderAs.text)")

                // The other spelling cannot sign in at all: its sub is not NFC.
                let twinToken = try await TestTokens.hs256(.init(twin))
                for (method, path) in [
                    (HTTPMethod.GET, "/v1/users/\(Self.path(twin))/grants"), (.GET, "/v1/orders/\(order.id)"),
                    (.GET, "/v1/receipts/\(submission.submissionId)"), (.POST, "/v1/orders"),
                ] {
                    let answer = try await UserHTTP.send(
                        method, base + path, token: twinToken, json: method == .POST ? ["productId": "com.example.coins.60"] : nil)
                    #expect(answer.status == 401 && answer.errorCode == "token_malformed", "\(twin.debugDescription) \(path): \(answer.text)")
                }
            }
        }

        /// Every id a request can carry (bodies, paths, queries, tokens, admin bodies) refuses
        /// the corpus of ids that join the text around them; lone surrogates in JSON escapes
        /// never become ids; an admin may not sign as one of the services.
        @Test func everyIdFieldRefusesTheCorpus() async throws {
            let pipeline = try await PipelineHarness.start(name: "idcorpus")
            Teardown.add { await pipeline.stop() }
            let base = pipeline.intakeURL
            let admin = PipelineHarness.adminToken
            for (id, why) in UnicodeTricks.badIds {
                let p = Self.path(id)
                let answers: [(String, HTTP.Answer)] = [
                    ("upload userId", try await UserHTTP.send(.POST, base + "/v1/receipts", token: nil, json: ["userId": id, "transactionId": "1000000000000001"])),
                    ("upload orderId", try await UserHTTP.send(.POST, base + "/v1/receipts", token: nil, json: ["userId": "ana", "orderId": id, "transactionId": "1000000000000001"])),
                    ("order userId", try await UserHTTP.send(.POST, base + "/v1/orders", token: nil, json: ["userId": id, "productId": "com.example.coins.60"])),
                    ("order productId", try await UserHTTP.send(.POST, base + "/v1/orders", token: nil, json: ["userId": "ana", "productId": id])),
                    ("path userId", try await HTTP.get(base + "/v1/users/\(p)/grants")),
                    ("query userId", try await HTTP.get(base + "/v1/receipts/\(UUID())?userId=\(p)")),
                    ("path orderId", try await HTTP.get(base + "/v1/orders/\(p)?userId=ana")),
                    ("admin userId", try await UserHTTP.send(.POST, base + "/v1/admin/grants", token: admin, json: ["userId": id, "productId": "com.example.coins.60", "reason": "r"])),
                    ("admin productId", try await UserHTTP.send(.POST, base + "/v1/admin/grants", token: admin, json: ["userId": "ana", "productId": id, "reason": "r"])),
                    ("admin actor", try await UserHTTP.send(.POST, base + "/v1/admin/grants", token: admin, json: ["userId": "ana", "productId": "com.example.coins.60", "reason": "r", "actor": id])),
                    ("admin path", try await UserHTTP.send(.GET, base + "/v1/admin/purchases/\(p)", token: admin)),
                ]
                for (field, answer) in answers {
                    #expect(answer.status == 400 && answer.errorCode == "invalid_field", "\(field) with \(why): \(answer.text)")
                }
            }
            for surrogate in [#"\ud800"#, #"\udc00x"#, #"a\ud83d"#, #"\ud800\u0041"#] {
                let body = Data(#"{"userId": "\#(surrogate)", "transactionId": "1000000000000001"}"#.utf8)
                let answer = try await HTTP.post(base + "/v1/receipts", raw: body)
                #expect(answer.status == 400, "\(surrogate): \(answer.text)")
            }
            for actor in ["apple", "Apple ", "system", "reconciliation"] {
                let answer = try await UserHTTP.send(
                    .POST, base + "/v1/admin/grants", token: admin,
                    json: ["userId": "ana", "productId": "com.example.coins.60", "reason": "r", "actor": actor])
                #expect(answer.status == 400 && answer.errorCode == "invalid_field", "\(actor): \(answer.text)")
            }
            #expect(try await pipeline.store.submissionCounts().values.reduce(0, +) == 0)
            #expect(try await pipeline.store.auditLog(limit: 100).isEmpty)
        }

        @Test func aTokenWhoseSubJoinsTheTextAroundItIsMalformed() async throws {
            let pipeline = try await PipelineHarness.startAuthenticated(name: "subcorpus")
            Teardown.add { await pipeline.stop() }
            for (id, why) in UnicodeTricks.badIds {
                let token = try await TestTokens.hs256(.init(id))
                let answer = try await UserHTTP.send(.GET, pipeline.intakeURL + "/v1/users/ana/grants", token: token)
                #expect(answer.status == 401 && answer.errorCode == "token_malformed", "\(why): \(answer.text)")
            }
        }
    }
}
