import Foundation

#if canImport(FoundationNetworking)
    import FoundationNetworking
#endif

/// One HTTP exchange as the client needs it.
public struct HTTPExchange: Sendable {
    /// `GET` or `POST`.
    public var method: String
    /// The whole URL.
    public var url: URL
    /// Request headers.
    public var headers: [String: String]
    /// The request body, if any.
    public var body: Data?

    /// A request.
    public init(method: String, url: URL, headers: [String: String] = [:], body: Data? = nil) {
        self.method = method
        self.url = url
        self.headers = headers
        self.body = body
    }
}

/// An answer: its status, headers (names in lower case) and whole body.
public struct HTTPAnswer: Sendable {
    /// The HTTP status.
    public var status: Int
    /// The headers, names in lower case.
    public var headers: [String: String]
    /// The body.
    public var body: Data

    /// An answer.
    public init(status: Int, headers: [String: String], body: Data) {
        self.status = status
        self.headers = headers
        self.body = body
    }
}

/// Sends a request and returns the whole answer; throws when there is none (no connection, a
/// timeout, a connection cut before the end of the body).
public protocol HTTPTransport: Sendable {
    /// One exchange.
    func send(_ exchange: HTTPExchange) async throws -> HTTPAnswer
}

/// `URLSession`, ephemeral (no cache, no cookies), with a time limit per request: what an app on
/// an Apple platform uses.
///
/// - Important: On Linux, swift-corelibs' `URLSession` stops the process when a connection
///   closes before any answer ("Transfer completed, but there's no response"); give the client
///   another `HTTPTransport` there (the simulated app uses AsyncHTTPClient).
public struct URLSessionTransport: HTTPTransport {
    private let session: URLSession

    /// A transport whose requests give up after `timeout` seconds.
    public init(timeout: TimeInterval = 30) {
        let configuration = URLSessionConfiguration.ephemeral
        configuration.timeoutIntervalForRequest = timeout
        configuration.timeoutIntervalForResource = timeout
        configuration.requestCachePolicy = .reloadIgnoringLocalCacheData
        session = URLSession(configuration: configuration)
    }

    public func send(_ exchange: HTTPExchange) async throws -> HTTPAnswer {
        var request = URLRequest(url: exchange.url)
        request.httpMethod = exchange.method
        for (name, value) in exchange.headers { request.setValue(value, forHTTPHeaderField: name) }
        request.httpBody = exchange.body
        let (data, response) = try await session.data(for: request)
        guard let http = response as? HTTPURLResponse else { throw URLError(.badServerResponse) }
        var headers: [String: String] = [:]
        for (name, value) in http.allHeaderFields {
            if let name = name as? String, let value = value as? String { headers[name.lowercased()] = value }
        }
        // A body shorter than its Content-Length is a cut answer, not a short one.
        if let length = headers["content-length"].flatMap(Int.init), length != data.count {
            throw URLError(.networkConnectionLost)
        }
        return HTTPAnswer(status: http.statusCode, headers: headers, body: data)
    }
}
