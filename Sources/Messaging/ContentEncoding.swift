internal import Compressing

/// How a message's body is encoded on the wire, named by AMQP's `content-encoding` property.
///
/// A receipt is base64 text of a DER structure that repeats itself (certificate names, object
/// identifiers); deflated, a verify message is about half its size, in the broker's message
/// store and on the way to a verifier. Consumers read every encoding listed here, so a
/// deployment upgrades its consumers before it lets a publisher deflate.
public enum ContentEncoding: String, Sendable, CaseIterable {
    /// zlib's format (RFC 1950), as HTTP's `Content-Encoding: deflate`.
    case deflate

    /// The largest body an encoded message may unfold to. A verify message holds one
    /// upload, which the intake caps far below this; a body that unfolds past it is refused,
    /// not allocated.
    public static let maximumDecodedBytes = 8 << 20

    /// `body` decoded by the encoding `name` (nil or `identity`: as it is).
    public static func decode(_ body: [UInt8], named name: String?) throws(AMQPError) -> [UInt8] {
        guard let name, name != "identity" else { return body }
        guard let encoding = ContentEncoding(rawValue: name) else {
            throw AMQPError(.undecodable, "a body in content-encoding '\(name.prefix(40))', which is not read here")
        }
        return try encoding.decode(body)
    }

    /// `body` encoded (deflate: `Deflate.compress`, zlib's fastest level with a small window).
    public func encode(_ body: [UInt8]) throws(AMQPError) -> [UInt8] {
        do {
            return try Deflate.compress(body)
        } catch {
            throw AMQPError(.undecodable, error.description)
        }
    }

    /// `body` decoded; throws for a body that is not this encoding, or that unfolds past
    /// `maximumDecodedBytes`.
    public func decode(_ body: [UInt8]) throws(AMQPError) -> [UInt8] {
        do {
            return try Deflate.decompress(body, limit: Self.maximumDecodedBytes)
        } catch {
            throw AMQPError(.undecodable, "a body in content-encoding deflate: \(error.description)")
        }
    }
}
