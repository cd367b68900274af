import Foundation
import Hummingbird
import AppStore
import IAPCore
import Logging
import Metrics
import NIOConcurrencyHelpers
import NIOCore
import NIOHTTP1
import OrderStore

/// `POST /v1/receipts` (accept an upload) and `GET /v1/receipts/{submissionId}` (its status).
struct ReceiptsController: Sendable {
    let store: OrderStore
    let settings: IntakeSettings

    func addRoutes(to router: RouterGroup<IntakeContext>) {
        router.post("/v1/receipts") { request, context in
            try await upload(request, context: context)
        }
        router.get("/v1/receipts/{submissionId}") { _, context in
            try await status(context: context)
        }
    }

    private func upload(_ request: Request, context: IntakeContext) async throws -> Response {
        do {
            let response = try await accept(request, context: context)
            Counter(label: MetricNames.uploads, dimensions: [("result", "accepted")]).increment()
            return response
        } catch let error as APIError {
            Counter(label: MetricNames.uploads, dimensions: [("result", "refused"), ("reason", error.code.rawValue)]).increment()
            throw error
        }
    }

    private func accept(_ request: Request, context: IntakeContext) async throws -> Response {
        let body = try await IntakeBody.collect(request, limit: settings.maxBodyBytes, timeout: settings.limits.bodyTimeout)
        let upload = try await ReceiptUpload(
            json: body, context: context, bundleIds: settings.bundleIds, receiptRoots: settings.receiptRoots)
        var verifyRequest = VerifyRequest(
            submissionId: UUID(), userId: upload.userId, receiptData: upload.receiptData,
            transactionId: upload.transactionId, orderId: upload.orderId, attempt: 1, acceptedAt: Date())
        verifyRequest.signedTransaction = upload.signedTransaction
        verifyRequest.originalTransactionId = upload.originalTransactionId
        verifyRequest.productId = upload.productId
        // The owner's same upload, credited within the hour: answered with that submission
        // (whose status follows every later event), not stored again nor sent to Apple again.
        // A store that cannot say is no reason to refuse: the upload is taken as a new one.
        if let earlier = try? await store.creditedUpload(repeatedBy: verifyRequest, now: verifyRequest.acceptedAt) {
            context.logger.debug("upload repeats one credited", metadata: ["iap.submission.id": "\(earlier)"])
            var response = try JSONResponse.make(
                Accepted(submissionId: earlier.uuidString, state: SubmissionState.credited.rawValue), status: .accepted)
            response.headers[.location] = "/v1/receipts/\(earlier.uuidString)"
            return response
        }
        if let verifier = settings.inlineVerifier {
            return try await verifyInline(verifyRequest, with: verifier)
        }
        try await enqueue(verifyRequest)
        context.logger.debug(
            "upload accepted", metadata: ["iap.submission.id": "\(verifyRequest.submissionId)"])
        if let app = upload.signedAppTransaction { await recordAppTransaction(app, of: upload.userId, context: context) }
        var response = try JSONResponse.make(
            Accepted(submissionId: verifyRequest.submissionId.uuidString, state: SubmissionState.pending.rawValue),
            status: .accepted)
        response.headers[.location] = "/v1/receipts/\(verifyRequest.submissionId.uuidString)"
        return response
    }

    /// The customer's download of the app the upload carried, verified like any signed data
    /// (Apple's chain, the bundle id, the environment), recorded for the user. The upload is
    /// accepted already: an app transaction that does not verify is logged, never a refusal of
    /// the purchase it came with.
    private func recordAppTransaction(_ jws: String, of userId: String, context: IntakeContext) async {
        guard let verifier = settings.notificationVerifier else { return }
        do {
            let app = try await verifier.verifyAppTransaction(jws)
            guard let id = app.appTransactionId else { return }
            try await store.recordAppTransaction(id, userId: userId, environment: app.receiptType ?? "Production")
        } catch {
            context.logger.warning("an uploaded app transaction was not recorded", metadata: ["error": "\(error)"])
        }
    }

    /// The synchronous baseline: store, ask Apple, apply, answer 200 with the final status.
    private func verifyInline(_ request: VerifyRequest, with verifier: any ReceiptVerifying) async throws -> Response {
        try await store.accept(request, message: nil)
        let outcome = await verifier.verify(request)
        _ = try await store.apply(
            VerifyResult(
                submissionId: request.submissionId, userId: request.userId, orderId: request.orderId, attempt: 1,
                outcome: outcome),
            policy: CreditPolicy(
                catalog: settings.catalog, eventsExchange: settings.names.events,
                finishAtApple: settings.finishTransactions.serverFinishes))
        guard let status = try await store.status(of: request.submissionId) else {
            throw APIError(.internalError, "the upload vanished")
        }
        return try JSONResponse.make(SubmissionStatusBody(status, finishMode: settings.finishTransactions))
    }

    /// Stores the request and its queue message in one transaction; durable once this returns.
    private func enqueue(_ verifyRequest: VerifyRequest) async throws {
        let message = OutboxMessage.verify(verifyRequest, routingKey: settings.names.verify, priority: VerifyPriority.firstAttempt)
        try await store.accept(verifyRequest, message: message)
    }

    /// `POST /v1/notifications/appstore`: App Store Server Notifications V2. Public: the JWS
    /// signature is what proves Apple sent it, so it is checked here, before anything is
    /// stored (a forged notification costs a signature check, never disk or queue space).
    /// Answers 200 only once the notification is durable, so Apple's own retries cover any
    /// downtime of ours; a fault of ours (store unavailable) stays 503, never 4xx.
    ///
    /// Nobody spends Apple's budget but Apple, and no notification that verifies is refused for
    /// what others sent: nothing is taken before the body is read (a limiter in front of the
    /// body could not tell Apple's notification from a stranger's junk on a shared address).
    /// The bounded body is read, its signature checked (the validated chain is cached, so this
    /// is one ECDSA verification), and only a refusal is charged: each one takes a token of its
    /// sender's address (`notificationFailuresPerAddress`), and past it the refusal is answered
    /// 429 with `Retry-After` instead, telling the sender to back off. Only verified
    /// notifications take from the deployment's notification budget (`notifications`), and
    /// one over it is answered 503 with `Retry-After`, which Apple retries, and raises an
    /// alert (an error log line and `iap_notifications_refused_total{reason="notifications_busy"}`).
    func addNotificationRoute(to router: Router<IntakeContext>) {
        let accepted = Counter(label: MetricNames.notifications)
        let duplicates = Counter(label: MetricNames.notificationsDuplicate)
        let overBudget = Counter(
            label: MetricNames.notificationsRefused, dimensions: [("reason", APIErrorCode.notificationsBusy.rawValue)])
        let budget = settings.limits.notifications.map { RateLimiter($0, scope: "notifications", store: store, maxKeys: 1) }
        let failures = settings.limits.notificationFailuresPerAddress.map { TokenBuckets($0) }
        let lastAlert = NIOLockedValueBox(ContinuousClock.now - .seconds(3600))
        let limits = settings.limits
        router.post("/v1/notifications/appstore") { request, context in
            let address = limits.clientAddress(of: request, peer: context.remoteAddress)
            // Charged once the refusal is known, never before: past the address's budget, a
            // refusal becomes 429 (a fault of ours, 5xx, is never the sender's).
            func charged(_ error: APIError) -> APIError {
                guard error.status.code < 500 else { return error }
                Counter(label: MetricNames.notificationsRefused, dimensions: [("reason", error.code.rawValue)]).increment()
                guard let wait = failures?.take(address) else { return error }
                return APIError.rateLimited(retryAfter: wait)
            }
            let notification: ResponseBodyV2DecodedPayload
            let payload: String
            do {
                payload = try await signedPayload(of: request, context: context)
                notification = try await checkSignature(of: payload, context: context)
            } catch let error as APIError {
                throw charged(error)
            }
            // Applied already (Apple's retry of one we answered, or a replay of a captured one):
            // answered as the first time, stored again never, and no budget spent on it. One
            // still on its way through the pipeline is stored again; the finisher applies a
            // `notificationUUID` once.
            if let original = try await store.appliedNotification(notification.notificationUUID) {
                duplicates.increment()
                context.logger.info(
                    "App Store notification applied already",
                    metadata: ["iap.submission.id": "\(original)", "iap.notification.uuid": "\(notification.notificationUUID)"])
                return try JSONResponse.make(["notificationId": original.uuidString])
            }
            // One budget for the deployment, for verified notifications only: Apple sends from many addresses.
            if let wait = await budget?.take("appstore", logger: context.logger) {
                overBudget.increment()
                let now = ContinuousClock.now
                let alert = lastAlert.withLockedValue { last in
                    guard now - last >= .seconds(60) else { return false }
                    last = now
                    return true
                }
                if alert {
                    context.logger.error(
                        "verified App Store notifications refused: over \(Setting.notificationRate.variable); Apple retries production ones, not sandbox ones",
                        metadata: ["iap.error.code": "\(APIErrorCode.notificationsBusy.rawValue)"])
                }
                var error = APIError(.notificationsBusy, "too many notifications at once; retry after \(wait) s")
                error.headers[.retryAfter] = String(wait)
                throw error
            }
            var verifyRequest = VerifyRequest(
                submissionId: UUID(), userId: "", receiptData: "", attempt: 1, acceptedAt: Date())
            verifyRequest.signedPayload = payload
            try await enqueue(verifyRequest)
            accepted.increment()
            context.logger.info("App Store notification accepted", metadata: ["iap.submission.id": "\(verifyRequest.submissionId)"])
            return try JSONResponse.make(["notificationId": verifyRequest.submissionId.uuidString])
        }
    }

    /// The notification's `signedPayload`, in the shape of a JWS, from a body of at most
    /// `maxNotificationBytes`.
    private func signedPayload(of request: Request, context: IntakeContext) async throws -> String {
        do {
            let limit = settings.maxNotificationBytes
            let body = try await IntakeBody.collect(request, limit: limit, timeout: settings.limits.bodyTimeout)
            let payload = try JSONFields(body).requiredString("signedPayload", maxLength: limit)
            try ReceiptUpload.checkJWSShape(payload, field: "signedPayload")
            return payload
        } catch let error as APIError {
            context.logger.info("App Store notification refused", metadata: ["iap.error.code": "\(error.code.rawValue)"])
            throw error
        }
    }

    /// Verifies the notification as the verifier will (signature, chain up to a trusted root,
    /// bundle id, environment, app id); refused with the verifier's code, logged without the payload.
    private func checkSignature(of payload: String, context: IntakeContext) async throws -> ResponseBodyV2DecodedPayload {
        guard let verifier = settings.notificationVerifier else {
            context.logger.error("App Store notifications cannot be checked: no signed-data settings")
            var error = APIError(.notificationsUnavailable, "notifications cannot be checked now; try again")
            error.headers[.retryAfter] = "60"
            throw error
        }
        do {
            return try await verifier.verifyNotification(payload)
        } catch {
            context.logger.info("App Store notification refused", metadata: ["iap.error.code": "\(error.code.rawValue)"])
            throw APIError.notificationRefused(error)
        }
    }

    private func status(context: IntakeContext) async throws -> Response {
        // Another user's submission is as unknown as a missing one: ids are not to be probed.
        guard let raw = try? context.pathParameter("submissionId"), let id = UUID(uuidString: raw),
            let status = try await store.status(of: id), context.userId.map({ sameUser($0, status.userId) }) ?? true
        else {
            throw APIError(.submissionNotFound, "no such submission")
        }
        return try JSONResponse.make(SubmissionStatusBody(status, finishMode: settings.finishTransactions))
    }
}

private struct Accepted: Encodable {
    var submissionId: String
    var state: String
}

/// The status answer the app polls.
struct SubmissionStatusBody: Encodable {
    struct Transaction: Encodable {
        var transactionId: String
        var originalTransactionId: String
        var productId: String
        var environment: String
        var state: String
        var reason: String?
        var grantedBy: String?
        /// Whether the app may finish this transaction (it is settled, and the app finishes).
        var finishTransaction: Bool
        /// `server` once Apple confirmed the order service's Finish Transaction call, `app` once
        /// the app reported it finished it; whoever finished first.
        var finishedBy: String?
        var finishedAt: Date?
    }

    var submissionId: String
    var state: String
    var finishTransaction: Bool
    var transactions: [Transaction]
    var reason: String?
    var message: String?
    var attempts: Int
    var nextAttemptAt: Date?
    var environment: String?
    var acceptedAt: Date

    /// The answer for `status`; with `FinishMode.server` it never tells the app to finish.
    init(_ status: SubmissionStatus, finishMode: FinishMode) {
        submissionId = status.submissionId.uuidString
        state = status.state.rawValue
        finishTransaction = finishMode.appFinishes && status.finishTransaction
        transactions = status.transactions.map {
            Transaction(
                transactionId: $0.transactionId, originalTransactionId: $0.originalTransactionId,
                productId: $0.productId, environment: $0.environment.rawValue, state: $0.state.rawValue,
                reason: $0.reason?.rawValue, grantedBy: $0.grantedBy,
                finishTransaction: finishMode.appFinishes && $0.finishTransaction, finishedBy: $0.finishedBy,
                finishedAt: $0.finishedAt)
        }
        reason = status.reason?.rawValue
        message = status.reasonMessage
        attempts = status.attempts
        nextAttemptAt = status.nextAttemptAt
        environment = status.environment?.rawValue
        acceptedAt = status.acceptedAt
    }
}

/// JSON answers with ISO 8601 dates.
enum JSONResponse {
    static func make(_ value: some Encodable, status: HTTPResponse.Status = .ok) throws -> Response {
        let encoder = JSONEncoder()
        encoder.dateEncodingStrategy = .iso8601
        encoder.outputFormatting = [.sortedKeys]
        return Response(
            status: status, headers: [.contentType: "application/json"],
            body: .init(byteBuffer: ByteBuffer(bytes: try encoder.encode(value))))
    }
}

/// Reads a request body with a size cap.
enum IntakeBody {
    /// The body, refused with 413 past `limit` bytes and 408 when it takes longer than
    /// `timeout` to arrive (a client trickling bytes holds no server resources for long).
    ///
    /// A body in a transfer coding other than `chunked` alone (`gzip`, `xchunked`,
    /// `gzip, chunked`), or whose bytes NIO's parser cannot read, is refused with 400
    /// `bad_request`, never a 500: the client sent it, and the route that read it counts it
    /// against its sender as any other refusal.
    static func collect(_ request: Request, limit: Int, timeout: Duration) async throws -> Data {
        if let length = request.headers[.contentLength].flatMap(Int.init), length > limit {
            throw APIError.bodyTooLarge(limit: limit)
        }
        let coding = unreadableTransferCoding(request.headers)
        let body: Data
        do {
            body = try await read(request, limit: limit, timeout: timeout)
        } catch is HTTPParserError {
            throw APIError(.badRequest, coding ?? "the body cannot be read as HTTP/1.1 (a malformed chunk)")
        }
        // `gzip, chunked` parses; its bytes are still not what the route reads.
        if let coding { throw APIError(.badRequest, coding) }
        return body
    }

    /// Why a request's `Transfer-Encoding` cannot be read, or nil when it has none or is
    /// `chunked` alone (RFC 9112 §6.1: a request whose final coding is not `chunked` is a 400).
    static func unreadableTransferCoding(_ headers: HTTPFields) -> String? {
        let values = headers[values: .transferEncoding]
        guard !values.isEmpty else { return nil }
        let codings = values.flatMap { $0.split(separator: ",") }.map { $0.trimmingCharacters(in: .whitespaces).lowercased() }
        guard codings != ["chunked"] else { return nil }
        return "Transfer-Encoding \(String(values.joined(separator: ", ").prefix(40)).debugDescription) is not chunked alone"
    }

    /// Reads what is left of the body of a request refused before its route read it, so that
    /// the connection answers once (bounded by `limit` and `timeout`); what it holds is dropped.
    static func discard(_ request: Request, limit: Int = 64 * 1024, timeout: Duration) async {
        _ = try? await read(request, limit: limit, timeout: timeout)
    }

    private static func read(_ request: Request, limit: Int, timeout: Duration) async throws -> Data {
        try await withThrowingTaskGroup(of: Data?.self) { group in
            group.addTask {
                var request = request
                do {
                    let buffer = try await request.collectBody(upTo: limit)
                    return Data(buffer.readableBytesView)
                } catch let error as HTTPError where error.status == .contentTooLarge {
                    throw APIError.bodyTooLarge(limit: limit)
                } catch is NIOTooManyBytesError {
                    // A chunked body (no Content-Length) found too large while it arrives.
                    throw APIError.bodyTooLarge(limit: limit)
                }
            }
            group.addTask {
                try await Task.sleep(for: timeout)
                return nil
            }
            defer { group.cancelAll() }
            guard let first = try await group.next(), let body = first else {
                throw APIError(.requestTimeout, "the body took too long to arrive")
            }
            return body
        }
    }
}
