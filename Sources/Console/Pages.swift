import AppStore
import Foundation
import Hummingbird
import IAPCore
import Ledger
import Logging
import Messaging
import NIOConcurrencyHelpers
import OrderStore

/// What Apple's Look Up Order ID said.
enum AppleLookup {
    /// Apple's transactions for the order, decoded and verified, with each as Apple signed it.
    case found([JWSTransactionDecodedPayload], signed: [String], environment: String)
    case notFound
    case unavailable(String)
    case notConfigured
}

extension Console {
    // MARK: - Home: search, work queues, chart, dead letters

    func home(_ request: Request, session: ConsoleSession) async -> Response {
        var context: [String: Any] = [:]
        var notices: [String] = []
        let query = (request.uri.queryParameters.get("q") ?? "").trimmingCharacters(in: .whitespacesAndNewlines)
        if !query.isEmpty {
            context["query"] = query
            do {
                var hits = try await deps.store.consoleSearch(query)
                if hits.isEmpty, Self.looksLikeAppleOrderId(query) {
                    switch await lookUpOrder(query) {
                    case .found(let transactions, _, _):
                        let known = try await deps.store.consolePurchases(transactions.map(\.transactionId))
                        let owners = Set(known.values.map(\.userId))
                        if owners.count == 1, known.count == transactions.count, let owner = owners.first {
                            return Self.redirect(Self.userPath(owner))
                        }
                        return Self.redirect("/admin/apple-orders/" + Self.pathComponent(query))
                    case .notFound:
                        notices.append("Apple knows no order \(query) (production or sandbox).")
                    case .unavailable(let why):
                        notices.append("Apple could not be reached to look up order \(query): \(why). Only this store was searched; try again shortly.")
                    case .notConfigured:
                        notices.append("Apple order ids cannot be looked up: the App Store Server API key is not configured.")
                    }
                }
                if hits.count == 1 { return Self.redirect(Self.userPath(hits[0].userId)) }
                hits.sort { $0.userId < $1.userId }
                context["hits"] = hits.map {
                    ["userId": $0.userId, "href": Self.userPath($0.userId), "matched": $0.matched.replacingOccurrences(of: "_", with: " "),
                     "subject": $0.subject]
                }
                context["searched"] = true
                context["noHits"] = hits.isEmpty
            } catch {
                notices.append("The order store could not be read: \(error).")
            }
        }
        do {
            let queues = try await deps.store.consoleWorkQueues(alertsSince: Date().addingTimeInterval(-7 * 86_400))
            context["needsReview"] = queues.needsReview.map(Self.submissionContext)
            context["needsReviewCount"] = queues.needsReviewCount
            context["held"] = queues.held.map(Self.purchaseContext)
            context["heldCount"] = queues.heldCount
            context["refundRequests"] = try await deps.store.consumptionRequests(limit: 20).map { request -> [String: Any] in
                var fields: [String: Any] = [
                    "transactionId": request.transactionId, "reason": request.reason ?? "no reason given",
                    "answer": Self.consumptionAnswerText(request),
                    "deadline": request.deadline.map(Self.when) ?? "—",
                ]
                if let userId = request.userId {
                    fields["userId"] = userId
                    fields["href"] = Self.userPath(userId)
                }
                return fields
            }
            context["alerts"] = queues.alerts.map(Self.submissionContext)
            context["alertCount"] = queues.alertCount
            let hours = try await deps.store.consoleHourlyActivity()
            context["chart"] = ActivityChart.svg(hours)
            context["chartRows"] = hours.filter { $0.uploads > 0 || $0.credits > 0 }.map {
                ["hour": Self.when($0.start), "uploads": $0.uploads, "credits": $0.credits] as [String: Any]
            }
            context["chartTotals"] = [
                "uploads": hours.reduce(0) { $0 + $1.uploads }, "credits": hours.reduce(0) { $0 + $1.credits },
            ]
        } catch {
            notices.append("The order store could not be read: \(error).")
        }
        let dead = await deadLetters()
        context["deadQueues"] = dead.queues
        if let problem = dead.problem { notices.append(problem) }
        context["notices"] = notices
        context["back"] = "/admin/"
        context["key"] = ConsoleSessions.randomToken()
        return page("home", title: "Customer service", session: session, context)
    }

    /// The dead-letter queues with their first messages, or why they cannot be read.
    func deadLetters() async -> (queues: [[String: Any]], problem: String?) {
        guard let broker = deps.broker else { return ([], "Dead letters are not shown: this process has no broker connection.") }
        guard broker.isConnected else {
            return ([], "The broker (RabbitMQ) is unreachable: dead letters cannot be listed or redriven right now.")
        }
        var queues: [[String: Any]] = []
        for (label, queue) in [("verify", deps.names.verifyDead), ("results", deps.names.resultsDead)] {
            let count = await withTimeout(seconds: 5) { try await broker.queueStatus(queue).messageCount }
            let listing = await withTimeout(seconds: 5) { try await DeadLetters(connection: broker).list(queue, limit: 20) }
            guard let entries = listing else {
                return (queues, "The broker (RabbitMQ) did not answer in time: dead letters cannot be listed right now.")
            }
            queues.append([
                "queue": label, "name": queue, "count": count.map { Int($0) } ?? entries.count, "key": ConsoleSessions.randomToken(),
                "empty": entries.isEmpty,
                "entries": entries.map { entry -> [String: Any] in
                    var fields: [String: Any] = [
                        "reason": entry.reason ?? "unknown", "messageId": entry.messageId ?? "", "bytes": entry.body.count,
                    ]
                    let codec = MessageCodec()
                    let body = (try? entry.decodedBody()) ?? entry.body
                    if let request = try? codec.decode(VerifyRequest.self, from: body) {
                        fields["submissionId"] = request.submissionId.uuidString
                        fields["userId"] = request.userId
                        fields["href"] = Self.userPath(request.userId)
                    } else if let result = try? codec.decode(VerifyResult.self, from: body) {
                        fields["submissionId"] = result.submissionId.uuidString
                    }
                    return fields
                },
            ])
        }
        return (queues, nil)
    }

    // MARK: - Customer

    func customer(_ userId: String, session: ConsoleSession) async -> Response {
        let customer: ConsoleCustomer
        do {
            customer = try await deps.store.consoleCustomer(userId)
        } catch {
            return storeUnavailable(error, session: session)
        }
        let back = Self.userPath(userId)
        let products = (deps.catalog?.products ?? []).map(\.productId)
        var context: [String: Any] = ["userId": userId, "back": back, "known": !customer.isEmpty]
        let granted = Set(customer.grants.map(\.grant.transactionId))
        let held = customer.purchases.filter { $0.heldReason != nil && !granted.contains($0.transactionId) }
        context["held"] = held.map { purchase -> [String: Any] in
            var fields = Self.purchaseContext(purchase)
            fields["key"] = ConsoleSessions.randomToken()
            fields["products"] = products.map { ["productId": $0, "selected": $0 == purchase.productId] }
            fields["inCatalog"] = products.contains(purchase.productId)
            return fields
        }
        context["groupsHref"] = deps.appStore == nil ? nil : Self.userPath(userId) + "/groups"
        context["appTransactionIds"] = customer.appTransactionIds
        context["hasAppTransactionIds"] = !customer.appTransactionIds.isEmpty
        context["grants"] = customer.grants.map { entry -> [String: Any] in
            let grant = entry.grant
            var fields: [String: Any] = [
                "transactionId": grant.transactionId, "productId": grant.productId, "quantity": grant.quantity,
                "state": grant.state.rawValue, "active": grant.isActive, "source": grant.source.rawValue,
                "environment": grant.environment, "grantedAt": Self.when(grant.grantedAt),
                "revokedAt": grant.revokedAt.map(Self.when) ?? "", "key": ConsoleSessions.randomToken(),
            ]
            if let revokedBy = grant.revokedBy { fields["revokedBy"] = revokedBy.rawValue }
            fields["atApple"] = Self.finishText(entry.finish)
            fields["paid"] = Self.termsText(entry.terms)
            return fields
        }
        context["subscriptions"] = customer.subscriptions.map {
            [
                "key": ConsoleSessions.randomToken(),
                "originalTransactionId": $0.originalTransactionId, "productId": $0.productId, "state": $0.state.rawValue,
                "expires": $0.expiresDate.map(Self.when) ?? "—", "autoRenew": $0.autoRenew.map { $0 ? "on" : "off" } ?? "—",
                "environment": $0.environment, "renews": Self.renews($0.renewal),
            ]
        }
        context["orders"] = customer.orders.map {
            [
                "orderId": $0.id, "productId": $0.productId, "state": $0.state.rawValue, "transactionId": $0.transactionId ?? "—",
                "createdAt": Self.when($0.createdAt),
            ]
        }
        context["submissions"] = customer.submissions.map { submission -> [String: Any] in
            var fields = Self.submissionContext(submission)
            fields["canFinish"] = !submission.finishable && submission.state != "credited"
            fields["canReverify"] = ["pending", "retrying", "needs_review"].contains(submission.state)
            fields["finishKey"] = ConsoleSessions.randomToken()
            fields["reverifyKey"] = ConsoleSessions.randomToken()
            return fields
        }
        context["timeline"] = customer.timeline.map { event -> [String: Any] in
            var fields: [String: Any] = [
                "at": Self.when(event.at), "iso": Self.iso(event.at), "kind": event.kind, "summary": event.summary,
            ]
            // Absent, not empty: an empty string still opens a Mustache section.
            if let actor = event.actor, !actor.isEmpty { fields["actor"] = actor }
            if let reason = event.reason, !reason.isEmpty { fields["reason"] = reason }
            return fields
        }
        context["noteKey"] = ConsoleSessions.randomToken()
        context["hasHeld"] = !held.isEmpty
        context["hasGrants"] = !customer.grants.isEmpty
        context["hasSubmissions"] = !customer.submissions.isEmpty
        return page("customer", title: "Customer \(userId)", session: session, context)
    }

    // MARK: - An Apple order

    func appleOrder(_ orderId: String, session: ConsoleSession) async -> Response {
        var context: [String: Any] = ["orderId": orderId, "back": "/admin/apple-orders/" + Self.pathComponent(orderId)]
        switch await lookUpOrder(orderId) {
        case .found(let transactions, _, let environment):
            let known: [String: PurchaseRecord]
            do {
                known = try await deps.store.consolePurchases(transactions.map(\.transactionId))
            } catch {
                return storeUnavailable(error, session: session)
            }
            context["environment"] = environment
            context["hasTransactions"] = !transactions.isEmpty
            context["transactions"] = transactions.map { transaction -> [String: Any] in
                var fields: [String: Any] = [
                    "transactionId": transaction.transactionId, "productId": transaction.productId,
                    "purchased": transaction.purchaseDate.map { Self.when(Date(timeIntervalSince1970: Double($0) / 1000)) } ?? "—",
                    "revoked": transaction.revocationDate != nil, "key": ConsoleSessions.randomToken(),
                ]
                if let purchase = known[transaction.transactionId] {
                    fields["owner"] = purchase.userId
                    fields["href"] = Self.userPath(purchase.userId)
                    fields["held"] = purchase.heldReason ?? ""
                    fields["isHeld"] = purchase.heldReason != nil
                } else {
                    fields["unknown"] = true
                }
                return fields
            }
        case .notFound:
            context["problem"] = "Apple knows no order \(orderId), in production or in the sandbox."
        case .unavailable(let why):
            context["problem"] = "Apple could not be reached: \(why). Nothing was changed; try again shortly."
        case .notConfigured:
            context["problem"] = "The App Store Server API key is not configured: order ids cannot be looked up."
        }
        return page("apple_order", title: "Apple order \(orderId)", session: session, context)
    }

    /// The page for an order store that could not be read: 503, nothing changed.
    func storeUnavailable(_ error: any Error, session: ConsoleSession) -> Response {
        message(
            status: .serviceUnavailable, title: "Order store unavailable",
            text: "The order store could not be read: \(error). Try again shortly.", session: session)
    }

    // MARK: - Multiseat groups

    /// The groups each of the user's Apple customers is in now (Get Customer Groups).
    func customerGroups(_ userId: String, session: ConsoleSession) async -> Response {
        var context: [String: Any] = ["userId": userId, "userHref": Self.userPath(userId)]
        guard let client = deps.appStore else {
            context["problem"] = "The App Store Server API key is not configured: groups cannot be asked of Apple."
            return page("customer_groups", title: "Groups of \(userId)", session: session, context)
        }
        do {
            let customers = try await deps.store.appleCustomerIds(ofUser: userId).prefix(10).map {
                (id: $0.id, environment: $0.environment == .sandbox ? ServerAPIEnvironment.sandbox : .production)
            }
            let found = try await client.groups(ofCustomers: customers)
            context["asked"] = customers.count
            context["hasGroups"] = !found.isEmpty
            context["groups"] = found.map { entry -> [String: Any] in
                [
                    "groupId": entry.group.groupId, "groupType": entry.group.groupType,
                    "environment": entry.environment.rawValue, "askedWith": entry.askedWith,
                    "href": "/admin/groups/\(Self.pathComponent(entry.group.groupId))?environment=\(entry.environment.rawValue)",
                    "roles": (entry.group.roles ?? []).map { ["productId": $0.productId, "role": $0.role] },
                ]
            }
        } catch let error as ServerAPIError {
            context["problem"] = "Apple could not answer: \(error.description). Nothing was changed; try again shortly."
        } catch {
            return storeUnavailable(error, session: session)
        }
        return page("customer_groups", title: "Groups of \(userId)", session: session, context)
    }

    /// One page of a group's members (Get Group Members), each with the users known for it.
    func groupMembers(_ groupId: String, environment: String?, paginationToken: String?, session: ConsoleSession) async -> Response {
        guard AppStoreServerAPIClient.isGroupId(groupId) else {
            return message(status: .badRequest, title: "Not a valid group ID", text: "A group ID is Apple's number.", session: session)
        }
        var environments: [ServerAPIEnvironment] = [.production, .sandbox]
        if let environment {
            guard let chosen = ServerAPIEnvironment(rawValue: environment) else {
                return message(status: .badRequest, title: "Not an environment", text: "Production or Sandbox.", session: session)
            }
            environments = [chosen]
        }
        if let paginationToken, !AppStoreServerAPIClient.isPaginationToken(paginationToken) {
            return message(status: .badRequest, title: "Not a page of this group", text: "Start from the group's first page.", session: session)
        }
        var context: [String: Any] = ["groupId": groupId]
        guard let client = deps.appStore else {
            context["problem"] = "The App Store Server API key is not configured: groups cannot be asked of Apple."
            return page("group_members", title: "Group \(groupId)", session: session, context)
        }
        do {
            if let (page, environment) = try await client.groupMembers(
                groupId, paginationToken: paginationToken, limit: 50, inFirstOf: environments)
            {
                let users = try await deps.store.users(ofAppTransactions: page.members.map(\.appTransactionId))
                context["environment"] = environment.rawValue
                context["hasMembers"] = !page.members.isEmpty
                context["members"] = page.members.map { member -> [String: Any] in
                    let known = users[member.appTransactionId] ?? []
                    return [
                        "appTransactionId": member.appTransactionId, "unknown": known.isEmpty,
                        "users": known.map { ["userId": $0, "href": Self.userPath($0)] },
                    ]
                }
                if page.hasMore, let next = page.paginationToken {
                    context["next"] = "/admin/groups/\(groupId)?environment=\(environment.rawValue)&page=\(Self.pathComponent(next))"
                }
            } else {
                context["problem"] = "Apple knows no group \(groupId) in \(environments.map(\.rawValue).joined(separator: " or "))."
            }
        } catch let error as ServerAPIError {
            context["problem"] = "Apple could not answer: \(error.description). Try again shortly."
        } catch {
            return storeUnavailable(error, session: session)
        }
        return page("group_members", title: "Group \(groupId)", session: session, context)
    }

    /// Look Up Order ID, production first, then the sandbox; each transaction checked.
    func lookUpOrder(_ orderId: String) async -> AppleLookup {
        guard let client = deps.appStore, let verifier = deps.signedData else { return .notConfigured }
        for environment in ServerAPIEnvironment.allCases {
            do {
                let answer = try await client.lookUpOrder(orderId, in: environment)
                guard answer.valid, !answer.signedTransactions.isEmpty else { continue }
                var transactions: [JWSTransactionDecodedPayload] = []
                for jws in answer.signedTransactions {
                    do {
                        transactions.append(try await verifier.verifyTransaction(jws))
                    } catch {
                        return .unavailable("Apple's answer failed our checks (\(error.code))")
                    }
                }
                return .found(transactions, signed: answer.signedTransactions, environment: environment.rawValue)
            } catch {
                switch error.kind {
                case .notFound, .unauthorized: continue
                case .transient, .invalid:
                    return .unavailable(error.httpStatus.map { "HTTP \($0)" } ?? error.message)
                }
            }
        }
        return .notFound
    }

    // MARK: - Helpers

    static func looksLikeAppleOrderId(_ text: String) -> Bool {
        (1...64).contains(text.count) && text.allSatisfy { $0.isASCII && ($0.isLetter || $0.isNumber) }
    }

    static func userPath(_ userId: String) -> String { "/admin/users/" + pathComponent(userId) }

    static func pathComponent(_ text: String) -> String {
        text.addingPercentEncoding(withAllowedCharacters: .alphanumerics.union(CharacterSet(charactersIn: "-_.~"))) ?? text
    }

    static func when(_ date: Date) -> String {
        date.formatted(
            .iso8601.year().month().day().dateSeparator(.dash).dateTimeSeparator(.space).time(includingFractionalSeconds: false)
                .timeSeparator(.colon)) + " UTC"
    }

    static func iso(_ date: Date) -> String {
        date.formatted(.iso8601)
    }

    static func submissionContext(_ submission: ConsoleSubmission) -> [String: Any] {
        [
            "submissionId": submission.submissionId, "userId": submission.userId, "href": userPath(submission.userId),
            "state": submission.state, "reason": submission.reason ?? "", "attempts": submission.attempts,
            "acceptedAt": when(submission.acceptedAt), "updatedAt": when(submission.updatedAt),
            "alertedAt": submission.alertedAt.map(when) ?? "", "finishable": submission.finishable,
        ]
    }

    /// What a purchase cost and under which offer, in a few words: `0.99 USD, offer code SPRING`.
    static func termsText(_ terms: PurchaseTerms?) -> String {
        guard let terms else { return "—" }
        var parts = priceAndOffer(
            price: terms.price, currency: terms.currency, offerType: terms.offerType, offerIdentifier: terms.offerIdentifier,
            offerDiscountType: terms.offerDiscountType, offerPeriod: terms.offerPeriod)
        if let plan = terms.billingPlanType { parts.append("billed \(plan)") }
        if let commitment = terms.commitment {
            var text = "commitment"
            if let number = commitment.billingPeriodNumber, let total = commitment.totalBillingPeriods {
                text += " period \(number) of \(total)"
            }
            if let price = commitment.commitmentPrice { text += ", \(String(format: "%.2f", Double(price) / 1000)) in all" }
            if let ends = commitment.commitmentExpiresDate { text += ", until \(when(ends))" }
            parts.append(text)
        }
        switch terms.ownershipType {
        case nil: break
        case "ASSIGNED": parts.append("an assigned seat (multiseat): access, not a payment")
        case "FAMILY_SHARED": parts.append("family shared: access, not a payment")
        case let other?: parts.append("ownership \(other)")
        }
        return parts.isEmpty ? "—" : parts.joined(separator: ", ")
    }

    /// A price and an offer in a few words each: `0.99 USD`, `introductory offer intro1 (FREE_TRIAL, P1M)`.
    static func priceAndOffer(
        price: Int64?, currency: String?, offerType: Int?, offerIdentifier: String?, offerDiscountType: String?,
        offerPeriod: String?
    ) -> [String] {
        var parts: [String] = []
        if let price {
            let amount = String(format: "%.2f", Double(price) / 1000)
            parts.append(currency.map { "\(amount) \($0)" } ?? amount)
        }
        if let offerType {
            let names = [1: "introductory offer", 2: "promotional offer", 3: "offer code", 4: "win-back offer"]
            var offer = names[offerType] ?? "offer \(offerType)"
            if let offerIdentifier { offer += " \(offerIdentifier)" }
            if let offerDiscountType { offer += " (\(offerDiscountType)\(offerPeriod.map { ", \($0)" } ?? ""))" }
            parts.append(offer)
        }
        return parts
    }

    /// What a subscription renews to, in a few words (product, price, offer, a price
    /// increase's consent); nil when Apple's renewal information said nothing.
    static func renews(_ renewal: RenewalTerms?) -> String? {
        guard let renewal else { return nil }
        var parts = renewal.autoRenewProductId.map { [$0] } ?? []
        parts += priceAndOffer(
            price: renewal.renewalPrice, currency: renewal.currency, offerType: renewal.offerType,
            offerIdentifier: renewal.offerIdentifier, offerDiscountType: renewal.offerDiscountType, offerPeriod: renewal.offerPeriod)
        if let plan = renewal.billingPlanType { parts.append("billed \(plan)") }
        if let commitment = renewal.commitment {
            var text = commitment.autoRenewStatus == 0 ? "commitment ends" : "commitment renews"
            if let product = commitment.autoRenewProductId { text += " to \(product)" }
            if let price = commitment.renewalPrice { text += " at \(String(format: "%.2f", Double(price) / 1000))" }
            if let plan = commitment.billingPlanType { text += " billed \(plan)" }
            if let date = commitment.renewalDate { text += " on \(when(date))" }
            parts.append(text)
        }
        switch renewal.priceIncrease {
        case "pending": parts.append("price increase awaiting the customer's consent (without it, it ends at renewal)")
        case "accepted": parts.append("price increase accepted")
        default: break
        }
        return parts.isEmpty ? nil : parts.joined(separator: ", ")
    }

    /// What was answered to a refund request, in a few words.
    static func consumptionAnswerText(_ request: ConsumptionRequestRecord) -> String {
        switch request.answer {
        case "sent": "answered \(request.answeredAt.map(when) ?? "")"
        case "skipped": "not answered (\(request.answerReason ?? "no reason"))"
        case "refused": "Apple refused the answer: \(request.answerReason ?? "no reason given")"
        case "expired": "not answered in time: \(request.answerReason ?? "no reason given")"
        case "queued":
            request.attempts > 0 ? "answering: \(request.attempts) call(s) failed (\(request.answerReason ?? "no answer"))" : "answering"
        default: "recorded (not answered by this release)"
        }
    }

    /// Where a transaction's finish at Apple stands, in a few words.
    static func finishText(_ finish: AppleFinishState?) -> String {
        guard let finish else { return "—" }
        switch finish.state {
        case "finished": return "finished by \(finish.finishedBy ?? "server") \(finish.finishedAt.map(when) ?? "")"
        case "refused": return "Apple refused to finish it: \(finish.lastError ?? "no reason given")"
        default:
            guard finish.attempts > 0 else { return "finishing" }
            let next = finish.dueAt.map { ", next call \(when($0))" } ?? ""
            return "finishing: \(finish.attempts) call(s) failed\(next) (\(finish.lastError ?? "no answer"))"
        }
    }

    static func purchaseContext(_ purchase: PurchaseRecord) -> [String: Any] {
        [
            "transactionId": purchase.transactionId, "originalTransactionId": purchase.originalTransactionId,
            "productId": purchase.productId, "quantity": purchase.quantity, "environment": purchase.environment,
            "userId": purchase.userId, "href": userPath(purchase.userId), "submissionId": purchase.submissionId,
            "heldReason": purchase.heldReason ?? "", "recordedAt": when(purchase.recordedAt),
        ]
    }
}

/// Runs `operation`, giving up after `seconds` (nil then, or when it throws); what it was
/// doing goes on in the background and its answer is dropped.
func withTimeout<T: Sendable>(seconds: Double, _ operation: @escaping @Sendable () async throws -> T) async -> T? {
    let resumed = NIOLockedValueBox(false)
    return await withCheckedContinuation { (continuation: CheckedContinuation<T?, Never>) in
        let finish: @Sendable (T?) -> Void = { value in
            let first = resumed.withLockedValue { done in
                defer { done = true }
                return !done
            }
            if first { continuation.resume(returning: value) }
        }
        Task { finish(try? await operation()) }
        Task {
            try? await Task.sleep(for: .seconds(seconds))
            finish(nil)
        }
    }
}
