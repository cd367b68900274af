package import Messaging

/// A publisher that hands each message to `body` instead of a broker: a relay's test that
/// holds, fails or records publishes.
package struct Publishing: MessagePublisher {
    package let body: @Sendable (OutgoingMessage) async throws -> Void

    package init(_ body: @escaping @Sendable (OutgoingMessage) async throws -> Void) {
        self.body = body
    }

    package func publish(_ message: OutgoingMessage) async throws {
        try await body(message)
    }
}
