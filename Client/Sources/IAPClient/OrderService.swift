import Foundation

/// The order service's HTTP API as the app uses it (docs/openapi.yaml): orders, uploads and
/// their status, entitlements, finished transactions.
struct OrderService: Sendable {
    let baseURL: URL
    let transport: any HTTPTransport

    /// An order the service created (`POST /v1/orders`).
    struct Order: Decodable, Sendable {
        var orderId: String
        var productId: String
        var state: String
    }

    /// An upload the service stored (`POST /v1/receipts`, 202).
    struct Accepted: Decodable, Sendable {
        var submissionId: String
        var state: String
    }

    /// An upload's status (`GET /v1/receipts/{submissionId}`).
    struct Status: Decodable, Sendable, Equatable {
        var submissionId: String
        var state: String
        var finishTransaction: Bool
        var reason: String?
        var message: String?
        var nextAttemptAt: String?
    }

    func createOrder(productId: String, userId: String, token: String?) async throws(IAPClientError) -> Order {
        let body = ["productId": productId, "userId": userId]
        return try decode(Order.self, from: try await send("POST", "/v1/orders", json: body, token: token, expect: 201))
    }

    /// Uploads the entry, naming the transaction it holds: the signed transaction (StoreKit 2),
    /// or the receipt with the transaction id (StoreKit 1); the order when there is one.
    func upload(_ entry: QueueEntry, receipt: String?, token: String?) async throws(IAPClientError) -> Accepted {
        var body = ["userId": entry.userId]
        if let signed = entry.transaction.signedTransaction {
            body["signedTransaction"] = signed
        } else {
            body["receiptData"] = receipt
            body["transactionId"] = entry.transactionId
        }
        if let orderId = entry.orderId { body["orderId"] = orderId }
        return try decode(Accepted.self, from: try await send("POST", "/v1/receipts", json: body, token: token, expect: 202))
    }

    /// The user is named in the query too: a service running without tokens (development)
    /// knows the user only from it; with tokens it must be the token's.
    func status(submissionId: String, userId: String, token: String?) async throws(IAPClientError) -> Status {
        let path = "/v1/receipts/\(Self.escaped(submissionId))?userId=\(Self.escaped(userId, query: true))"
        return try decode(Status.self, from: try await send("GET", path, token: token, expect: 200))
    }

    func entitlements(userId: String, token: String?) async throws(IAPClientError) -> Data {
        try await send("GET", "/v1/users/\(Self.escaped(userId))/entitlements", token: token, expect: 200)
    }

    /// Tells the service the app finished the transaction (it then never calls Finish Transaction for it).
    func reportFinished(userId: String, transactionId: String, token: String?) async throws(IAPClientError) {
        _ = try await send(
            "POST", "/v1/users/\(Self.escaped(userId))/finished", json: ["transactionId": transactionId], token: token,
            expect: 204)
    }

    // MARK: - Exchanges

    private func send(
        _ method: String, _ path: String, json: [String: String]? = nil, token: String?, expect: Int
    ) async throws(IAPClientError) -> Data {
        guard let url = URL(string: baseURL.absoluteString.trimmingSuffix("/") + path) else {
            throw IAPClientError(kind: .refused, message: "cannot make a URL of \(path)")
        }
        var headers = ["Accept": "application/json"]
        if let token { headers["Authorization"] = "Bearer \(token)" }
        var body: Data?
        if let json {
            headers["Content-Type"] = "application/json"
            body = try? JSONSerialization.data(withJSONObject: json, options: [.sortedKeys])
        }
        let answer: HTTPAnswer
        do {
            answer = try await transport.send(HTTPExchange(method: method, url: url, headers: headers, body: body))
        } catch {
            throw IAPClientError(kind: .unreachable, message: "\(method) \(path): \(error)")
        }
        guard answer.status != expect else { return answer.body }
        let error = (try? JSONDecoder().decode(ErrorBody.self, from: answer.body))?.error
        let retryAfter = answer.headers["retry-after"].flatMap(Int.init).map { TimeInterval(max(0, $0)) }
        let transient = answer.status == 408 || answer.status == 429 || answer.status >= 500
        throw IAPClientError(
            kind: transient ? .unavailable : (200..<300).contains(answer.status) ? .unreachable : .refused,
            status: answer.status, code: error?.code,
            message: error?.message ?? "\(method) \(path) answered \(answer.status)", retryAfter: retryAfter)
    }

    private func decode<T: Decodable>(_ type: T.Type, from data: Data) throws(IAPClientError) -> T {
        do {
            return try JSONDecoder().decode(type, from: data)
        } catch {
            // A 2xx whose body does not read is an answer lost on the way, not a refusal.
            throw IAPClientError(kind: .unreachable, message: "an answer that does not decode: \(error)")
        }
    }

    private struct ErrorBody: Decodable {
        struct Detail: Decodable {
            var code: String
            var message: String?
        }
        var error: Detail
    }

    static func escaped(_ segment: String, query: Bool = false) -> String {
        var allowed = query ? CharacterSet.urlQueryAllowed : CharacterSet.urlPathAllowed
        allowed.remove(charactersIn: query ? "&=+#" : "/")
        return segment.addingPercentEncoding(withAllowedCharacters: allowed) ?? segment
    }
}

extension String {
    fileprivate func trimmingSuffix(_ suffix: String) -> String {
        hasSuffix(suffix) ? String(dropLast(suffix.count)) : self
    }
}
