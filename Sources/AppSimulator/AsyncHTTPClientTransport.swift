import AsyncHTTPClient
import Foundation
public import IAPClient
import NIOCore
import NIOHTTP1

/// `HTTPTransport` over AsyncHTTPClient, for the simulated app on Linux: swift-corelibs'
/// `URLSession` stops the process ("Transfer completed, but there's no response") when a
/// connection closes before any answer, which a flaky network does all day. Apps on Apple
/// platforms keep `URLSessionTransport`.
public struct AsyncHTTPClientTransport: HTTPTransport {
    private let client: HTTPClient
    private let timeout: Duration
    /// The largest answer read; the order service's are a few kilobytes.
    private static let maximumBody = 4 * 1024 * 1024

    /// A transport on the shared client whose requests give up after `timeout`.
    public init(timeout: Duration = .seconds(10)) {
        client = HTTPClient.shared
        self.timeout = timeout
    }

    public func send(_ exchange: HTTPExchange) async throws -> HTTPAnswer {
        var request = HTTPClientRequest(url: exchange.url.absoluteString)
        request.method = HTTPMethod(rawValue: exchange.method)
        for (name, value) in exchange.headers { request.headers.add(name: name, value: value) }
        if let body = exchange.body { request.body = .bytes(ByteBuffer(bytes: body)) }
        let response = try await client.execute(request, timeout: .nanoseconds(timeout.components.seconds * 1_000_000_000))
        var body = try await response.body.collect(upTo: Self.maximumBody)
        var headers: [String: String] = [:]
        for header in response.headers { headers[header.name.lowercased()] = header.value }
        return HTTPAnswer(status: Int(response.status.code), headers: headers, body: Data(body.readBytes(length: body.readableBytes) ?? []))
    }
}
