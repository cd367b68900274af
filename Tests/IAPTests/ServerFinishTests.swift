import Crypto
import Foundation
import NIOHTTP1
import IAPCore
import OrderStore
@testable import Store
import Ledger
import Testing
import TestSupport

/// How the fake App Store says a transaction was finished.
struct FakeFinishRecord: Decodable, Equatable {
    var finishedDateMs: String?
    var serverFinishCalls: Int

    static func of(_ transactionId: String, at fakeURL: String) async throws -> FakeFinishRecord {
        let answer = try await HTTP.get(fakeURL + "/fake/purchases/\(transactionId)/finish")
        #expect(answer.status == 200, "\(answer.text)")
        return try JSONDecoder().decode(FakeFinishRecord.self, from: answer.body)
    }
}

extension BrokerTests {
    /// `IAP_FINISH_TRANSACTIONS`: the order service finishes at Apple (Finish Transaction) what
    /// it credited, once, and never what it holds; checked at the fake, which counts the calls.
    @Suite("The server finishes what it credited")
    struct ServerFinishTests {
        @Test(arguments: TestStore.backends)
        func aCreditedPurchaseIsFinishedOnceAndAHeldOneNever(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "server-finish", finishTransactions: .both, on: backend)
            Teardown.add { await pipeline.stop() }
            let paid = try await pipeline.mintStoreKit2()
            let looked = try await pipeline.mintStoreKit2(productId: "com.example.coins.120")
            // A bare transaction id proves no ownership: answered `proof_required`, never finished.
            let held = try await pipeline.upload(["userId": "mallory", "transactionId": looked.transactionId])
            #expect(try await pipeline.waitForState(held)["reason"] as? String == "proof_required")
            let credited = try await pipeline.upload(["userId": "ana", "signedTransaction": try #require(paid.signedTransaction)])
            #expect(try await pipeline.waitForState(credited)["state"] as? String == "credited")

            let finished = try await eventually(timeout: .seconds(20)) {
                try await FakeFinishRecord.of(paid.transactionId, at: pipeline.fakeURL).finishedDateMs != nil
            }
            #expect(finished, "the credited purchase was not finished at Apple")
            let answer = try await eventually(timeout: .seconds(10)) {
                let status = try await pipeline.status(credited)
                let transaction = (status["transactions"] as? [[String: Any]])?.first
                return transaction?["finishedBy"] as? String == "server" && transaction?["finishTransaction"] as? Bool == true
            }
            #expect(answer, "the answer does not say the server finished it")
            // Polled past the worker's next rounds: one call, and none for the held purchase.
            try await Task.sleep(for: .seconds(3))
            #expect(try await FakeFinishRecord.of(paid.transactionId, at: pipeline.fakeURL).serverFinishCalls == 1)
            #expect(try await FakeFinishRecord.of(looked.transactionId, at: pipeline.fakeURL) == .init(serverFinishCalls: 0))
            #expect(try await pipeline.status(held)["finishTransaction"] as? Bool == false)
            let states = try await pipeline.store.finishStates(of: [paid.transactionId, looked.transactionId])
            #expect(states[paid.transactionId]?.finishedBy == "server" && states[looked.transactionId] == nil)
        }

        /// The app says it finished (`POST /v1/users/{userId}/finished`): recorded as the app's,
        /// and the server's finish still queued for it is never called; a stranger's report,
        /// like an unknown id's, is `purchase_not_found`; a held purchase's is recorded.
        @Test(arguments: TestStore.backends)
        func anAppsReportedFinishIsRecordedAndTheServerNoLongerCallsForIt(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "app-finish", finishTransactions: .both, on: backend)
            Teardown.add { await pipeline.stop() }
            let paid = try await pipeline.mintStoreKit2(productId: "com.example.coins.60")
            // Apple fails the server's Finish Transaction calls for it: the finish stays queued.
            try await pipeline.injectFault(.init(httpStatus: 503, count: 0, transactionId: paid.transactionId))
            let credited = try await pipeline.upload(["userId": "ana", "signedTransaction": try #require(paid.signedTransaction)])
            #expect(try await pipeline.waitForState(credited)["state"] as? String == "credited")
            let tried = try await eventually(timeout: .seconds(20)) {
                (try await pipeline.store.finishStates(of: [paid.transactionId])[paid.transactionId]?.attempts ?? 0) >= 1
            }
            #expect(tried, "the server never tried to finish it")

            func report(_ userId: String, _ body: [String: String]) async throws -> HTTP.Answer {
                try await HTTP.post(pipeline.intakeURL + "/v1/users/\(userId)/finished", json: body)
            }
            let stranger = try await report("mallory", ["transactionId": paid.transactionId])
            let unknown = try await report("ana", ["transactionId": "2999999999999999"])
            #expect(stranger.status == 404 && stranger.errorCode == "purchase_not_found", "\(stranger.text)")
            #expect(unknown.status == 404 && unknown.errorCode == "purchase_not_found", "\(unknown.text)")
            #expect(try await report("ana", [:]).errorCode == "missing_field")
            #expect(try await pipeline.store.finishStates(of: [paid.transactionId])[paid.transactionId]?.state == "queued")

            let reported = try await report("ana", ["transactionId": paid.transactionId])
            #expect(reported.status == 204, "\(reported.text)")
            #expect(try await report("ana", ["transactionId": paid.transactionId]).status == 204)
            let state = try await pipeline.store.finishStates(of: [paid.transactionId])[paid.transactionId]
            #expect(state?.state == "finished" && state?.finishedBy == "app" && state?.finishedAt != nil, "\(String(describing: state))")
            let transaction = (try await pipeline.status(credited)["transactions"] as? [[String: Any]])?.first
            #expect(transaction?["finishedBy"] as? String == "app", "\(String(describing: transaction))")

            // Apple answers again; the server's queued call is gone, so Apple is never asked.
            #expect(try await HTTP.send(pipeline.fakeURL + "/fake/faults", method: .DELETE, body: nil).status == 204)
            let calls = try await FakeFinishRecord.of(paid.transactionId, at: pipeline.fakeURL).serverFinishCalls
            try await Task.sleep(for: .seconds(5))
            let after = try await FakeFinishRecord.of(paid.transactionId, at: pipeline.fakeURL)
            #expect(after.serverFinishCalls == calls && after.finishedDateMs == nil, "\(after)")

            // A purchase held for customer service (a product the catalog lacks): the report is
            // recorded, and the server never finishes it itself.
            let mystery = try await pipeline.mintStoreKit2(productId: "com.example.mystery")
            let held = try await pipeline.upload(["userId": "nina", "signedTransaction": try #require(mystery.signedTransaction)])
            #expect(try await pipeline.waitForState(held)["state"] as? String == "needs_review")
            #expect(try await report("nina", ["transactionId": mystery.transactionId]).status == 204)
            #expect(try await pipeline.store.finishStates(of: [mystery.transactionId])[mystery.transactionId]?.finishedBy == "app")
            #expect(try await FakeFinishRecord.of(mystery.transactionId, at: pipeline.fakeURL).serverFinishCalls == 0)
            #expect(
                try await pipeline.store.reportAppFinish(userId: "nina", transactionId: mystery.transactionId)
                    == .alreadyFinished(by: "app"))

            // Refunded before its upload: Apple voided it, the answer says finish, and the app's
            // report of that is no held purchase finished.
            let refunded = try await pipeline.mintStoreKit2(productId: "com.example.coins.60")
            let refund = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(refunded.transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            // Apple fails the server's finish of it, which stays queued for the app's report.
            try await pipeline.injectFault(.init(httpStatus: 503, count: 0, transactionId: refunded.transactionId))
            let late = try await pipeline.upload(["userId": "ana", "signedTransaction": try #require(refunded.signedTransaction)])
            let lateState = try await pipeline.waitForState(late)
            #expect(lateState["finishTransaction"] as? Bool == true, "\(lateState)")
            #expect(try await pipeline.store.reportAppFinish(userId: "ana", transactionId: refunded.transactionId) == .recorded)

            // A bare id proves nobody's purchase, and its upload records nothing: the report of
            // it is answered as any stranger's is, so that reporting a finish cannot tell a
            // genuine id from an unknown one either. Nothing is written, however often.
            let looked = try await pipeline.mintStoreKit2(productId: "com.example.coins.60")
            let lookup = try await pipeline.upload(["userId": "olaf", "transactionId": looked.transactionId])
            #expect(try await pipeline.waitForState(lookup)["reason"] as? String == "proof_required")
            for _ in 0..<3 {
                #expect(try await report("olaf", ["transactionId": looked.transactionId]).errorCode == "purchase_not_found")
            }
            #expect(try await report("mallory", ["transactionId": looked.transactionId]).errorCode == "purchase_not_found")
            #expect(try await report("olaf", ["transactionId": "2000000999999999"]).errorCode == "purchase_not_found")
            #expect(
                try await pipeline.store.auditLog(limit: 1000).filter { $0.subject == "transaction:\(looked.transactionId)" }.isEmpty)
            #expect(try await pipeline.store.finishStates(of: [looked.transactionId]).isEmpty)
        }

        /// A grant by hand is finished at Apple only when Apple verified its purchase (a held
        /// one): goodwill naming an Apple transaction id rests on the customer's word, and that
        /// id may be another customer's consumable, which a finish would take from their
        /// receipts for good; goodwill under our own id is nothing Apple knows.
        @Test(arguments: TestStore.backends)
        func aGrantByHandIsFinishedAtAppleOnlyWhenAppleVerifiedItsPurchase(_ backend: Backend) async throws {
            let pipeline = try await PipelineHarness.start(name: "manual-finish", finishTransactions: .both, on: backend)
            Teardown.add { await pipeline.stop() }
            // Bea's purchase, not uploaded yet; Mallory writes that it is hers.
            let beas = try await pipeline.mintStoreKit2(productId: "com.example.coins.60")
            let named = try await pipeline.admin(
                .POST, "/v1/admin/grants",
                ["userId": "mallory", "productId": "com.example.coins.60", "appleTransactionId": beas.transactionId,
                 "reason": "says she paid"])
            #expect(named.status == 201, "\(named.text)")
            let goodwill = try await pipeline.admin(
                .POST, "/v1/admin/grants", ["userId": "mallory", "productId": "com.example.coins.60", "reason": "sorry"])
            #expect(goodwill.status == 201, "\(goodwill.text)")
            let goodwillId = try #require(goodwill.json["transactionId"] as? String, "\(goodwill.text)")
            // A held purchase (a product the catalog lacks), granted to its uploader by hand.
            let mystery = try await pipeline.mintStoreKit2(productId: "com.example.mystery")
            let held = try await pipeline.upload(["userId": "nina", "signedTransaction": try #require(mystery.signedTransaction)])
            #expect(try await pipeline.waitForState(held)["state"] as? String == "needs_review")
            let granted = try await pipeline.admin(
                .POST, "/v1/admin/grants",
                ["userId": "nina", "productId": "com.example.coins.60", "transactionId": mystery.transactionId,
                 "reason": "sold under an old product id"])
            #expect(granted.status == 201, "\(granted.text)")

            let finished = try await eventually(timeout: .seconds(20)) {
                try await FakeFinishRecord.of(mystery.transactionId, at: pipeline.fakeURL).finishedDateMs != nil
            }
            #expect(finished, "the held purchase granted by hand was not finished at Apple")
            try await Task.sleep(for: .seconds(2))
            #expect(try await FakeFinishRecord.of(beas.transactionId, at: pipeline.fakeURL) == .init(serverFinishCalls: 0))
            let states = try await pipeline.store.finishStates(of: [beas.transactionId, goodwillId, mystery.transactionId])
            #expect(states[beas.transactionId] == nil && states[goodwillId] == nil, "\(states)")
            #expect(states[mystery.transactionId]?.finishedBy == "server", "\(states)")
        }

        @Test func withServerTheAnswersNeverTellTheAppToFinish() async throws {
            let pipeline = try await PipelineHarness.start(name: "server-only-finish", finishTransactions: .server)
            Teardown.add { await pipeline.stop() }
            let paid = try await pipeline.mintStoreKit2()
            let credited = try await pipeline.upload(["userId": "ana", "signedTransaction": try #require(paid.signedTransaction)])
            #expect(try await pipeline.waitForState(credited)["state"] as? String == "credited")
            let finished = try await eventually(timeout: .seconds(20)) {
                let transaction = (try await pipeline.status(credited)["transactions"] as? [[String: Any]])?.first
                return transaction?["finishedBy"] as? String == "server"
            }
            #expect(finished)
            let status = try await pipeline.status(credited)
            #expect(status["finishTransaction"] as? Bool == false)
            #expect((status["transactions"] as? [[String: Any]])?.first?["finishTransaction"] as? Bool == false)
            #expect(try await FakeFinishRecord.of(paid.transactionId, at: pipeline.fakeURL).serverFinishCalls == 1)

            // Customer service settles stuck uploads: the app is never told to finish, so the
            // server finishes the transaction each names, when it is the uploader's purchase
            // (here one held for a product the catalog lacks). An id the upload only named is a
            // lookup: Finish Transaction reaches any transaction of the app, so never that one.
            func settle(_ submission: String) async throws {
                let marked = try await pipeline.admin(
                    .POST, "/v1/admin/submissions/\(submission)/finishable", ["reason": "ticket 81: settled by hand"])
                #expect(marked.status == 200, "\(marked.text)")
                #expect(marked.json["finishTransaction"] as? Bool == false, "\(marked.text)")
            }
            let mystery = try await pipeline.mintStoreKit2(productId: "com.example.mystery")
            let own = try await pipeline.upload(["userId": "nina", "signedTransaction": try #require(mystery.signedTransaction)])
            #expect(try await pipeline.waitForState(own)["state"] as? String == "needs_review")
            let looked = try await pipeline.mintStoreKit2(productId: "com.example.coins.120")
            let named = try await pipeline.upload(["userId": "mallory", "transactionId": looked.transactionId])
            #expect(try await pipeline.waitForState(named)["reason"] as? String == "proof_required")
            try await settle(own)
            try await settle(named)
            let settled = try await eventually(timeout: .seconds(20)) {
                try await FakeFinishRecord.of(mystery.transactionId, at: pipeline.fakeURL).finishedDateMs != nil
            }
            #expect(settled, "the upload customer service settled was not finished at Apple")
            try await Task.sleep(for: .seconds(2))
            #expect(try await FakeFinishRecord.of(looked.transactionId, at: pipeline.fakeURL) == .init(serverFinishCalls: 0))

            // Another customer's transaction that Apple refunded, which a user only names beside
            // a receipt of her own: the answer may call it settled, but the server never
            // finishes an id the upload only named.
            let beas = try await pipeline.mint(deviceId: "bea-phone")
            let refund = try await HTTP.post(pipeline.fakeURL + "/fake/purchases/\(beas.transactionId)/refund", json: [String: String]())
            #expect(refund.status == 200, "\(refund.text)")
            #expect(
                try await eventually(timeout: .seconds(20)) {
                    try await pipeline.store.notifications(ofTransaction: beas.transactionId).map(\.type).contains("REFUND")
                })
            let mallorys = try await pipeline.mint(deviceId: "mallory-phone")
            let probe = try await pipeline.upload(userId: "mallory", receiptData: mallorys.receiptData, transactionId: beas.transactionId)
            _ = try await pipeline.waitForState(probe)
            // The verdict that once queued the named id's finish (the status answer then follows
            // the purchase the receipt carried).
            let verdict = try await pipeline.store.testRows("SELECT reason FROM submission WHERE id = ?", [probe]).first
            #expect((verdict?["reason"] as String?) == "purchase_revoked", "\(String(describing: verdict))")
            try await Task.sleep(for: .seconds(2))
            #expect(try await FakeFinishRecord.of(beas.transactionId, at: pipeline.fakeURL) == .init(serverFinishCalls: 0))
        }
    }
}

extension DisruptiveTests {
    /// The finish is queued in the commit that credited: an order service killed (kill -9)
    /// after that commit and before Apple confirmed the call finishes it once it is back.
    @Suite("The server finishes what it credited, across a crash", .timeLimit(.minutes(4)))
    struct ServerFinishDrillTests {
        @Test(arguments: TestStore.backends)
        func aCreditNotYetFinishedWhenTheOrderServiceDiesIsFinishedOnceAfterItsRestart(_ backend: Backend) async throws {
            let keyFile = FileManager.default.temporaryDirectory.appendingPathComponent("key-\(UUID().uuidString).p8")
            try ServerAPIKey.privateKey.pemRepresentation.write(to: keyFile, atomically: true, encoding: .utf8)
            let rootFile = FileManager.default.temporaryDirectory.appendingPathComponent("root-\(UUID().uuidString).der")
            let drill = try await ProcessDrill(
                name: "finish-crash", on: backend,
                environment: [
                    "IAP_AMQP_URL": try TestBroker.drillNodeURL(),
                    "IAP_FAKE_API_KEY_PATH": keyFile.path, "IAP_FAKE_API_KEY_ID": ServerAPIKey.keyId,
                    "IAP_FAKE_ISSUER_ID": ServerAPIKey.issuerId,
                    "IAP_RECONCILE_INTERVAL": "0", "IAP_FINISH_TRANSACTIONS": "both",
                ])
            try drill.start("fake-appstore")
            try await drill.waitHealthy(drill.fakeURL)
            try Data(try await HTTP.get(drill.fakeURL + "/fake/root-certificate").body).write(to: rootFile)
            let apple = [
                "IAP_APPSTORE_KEY_PATH": keyFile.path, "IAP_APPSTORE_KEY_ID": ServerAPIKey.keyId,
                "IAP_APPSTORE_ISSUER_ID": ServerAPIKey.issuerId, "IAP_APPSTORE_API_URL": drill.fakeURL,
                "IAP_APPSTORE_SANDBOX_API_URL": drill.fakeURL + "/sandbox", "IAP_TRUSTED_ROOTS": rootFile.path,
            ]
            try drill.start("orders", environment: apple)
            try await drill.waitHealthy(drill.intakeURL)
            try drill.start("verifier", environment: apple)
            try await drill.waitHealthy(drill.opsURL("verifier"))

            let minted = try await HTTP.post(
                drill.fakeURL + "/fake/purchases", json: ["bundleId": PipelineHarness.bundleId, "productId": "com.example.coins.60"])
            let purchase = try JSONDecoder().decode(PipelineHarness.Purchase.self, from: minted.body)
            // Apple fails every Finish Transaction call for it until told otherwise.
            let fault = try await HTTP.post(
                drill.fakeURL + "/fake/faults",
                json: PipelineHarness.ScopedFault(httpStatus: 503, count: 0, transactionId: purchase.transactionId))
            #expect(fault.status == 204, "\(fault.text)")
            let upload = try await HTTP.post(
                drill.intakeURL + "/v1/receipts",
                json: ["userId": "ana", "signedTransaction": try #require(purchase.signedTransaction)])
            let submission = try #require(upload.json["submissionId"] as? String, "\(upload.text)")
            let store = try await OrderStore(location: drill.storeLocation)
            let tried = try await eventually(timeout: .seconds(30)) {
                (try await store.finishStates(of: [purchase.transactionId])[purchase.transactionId]?.attempts ?? 0) >= 1
            }
            #expect(tried, "the order service never called Finish Transaction: \(drill.logTail("orders"))")
            #expect(try await FakeFinishRecord.of(purchase.transactionId, at: drill.fakeURL).finishedDateMs == nil)

            drill.kill9("orders")
            #expect(try await HTTP.send(drill.fakeURL + "/fake/faults", method: .DELETE, body: nil).status == 204)
            try drill.start("orders", environment: apple)
            try await drill.waitHealthy(drill.intakeURL)
            let finished = try await eventually(timeout: .seconds(60)) {
                try await FakeFinishRecord.of(purchase.transactionId, at: drill.fakeURL).finishedDateMs != nil
            }
            #expect(finished, "not finished after the restart: \(drill.logTail("orders"))")
            try await Task.sleep(for: .seconds(3))
            #expect(try await FakeFinishRecord.of(purchase.transactionId, at: drill.fakeURL).serverFinishCalls == 1)
            let status = try await HTTP.get(drill.intakeURL + "/v1/receipts/\(submission)?userId=ana")
            let transaction = (status.json["transactions"] as? [[String: Any]])?.first
            #expect(transaction?["finishedBy"] as? String == "server", "\(status.text)")
            await store.close()
        }
    }
}
