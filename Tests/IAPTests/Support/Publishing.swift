import Messaging

/// A publisher that hands each message to `body` instead of a broker: a relay's test that
/// holds, fails or records publishes.
struct Publishing: MessagePublisher {
    let body: @Sendable (OutgoingMessage) async throws -> Void

    init(_ body: @escaping @Sendable (OutgoingMessage) async throws -> Void) {
        self.body = body
    }

    func publish(_ message: OutgoingMessage) async throws {
        try await body(message)
    }
}
