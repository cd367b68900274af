internal import CZlib

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

    /// `body` encoded. Deflate runs at its fastest level with an 8 KiB window and a small
    /// hash table (a verify message is about 4 KB): on a receipt's base64 that saves within
    /// 3 % of what zlib's defaults save, and starting the stream, most of the cost for a
    /// message this small, clears a tenth of the memory.
    public func encode(_ body: [UInt8]) throws(AMQPError) -> [UInt8] {
        var stream = z_stream()
        guard iap_deflate_init(&stream, Z_BEST_SPEED, 13, 5) == Z_OK else {
            throw AMQPError(.undecodable, "deflate: cannot start a stream")
        }
        defer { deflateEnd(&stream) }
        var output = [UInt8](repeating: 0, count: Int(deflateBound(&stream, uLong(body.count))))
        let status = body.withUnsafeBufferPointer { input in
            output.withUnsafeMutableBufferPointer { out in
                stream.next_in = UnsafeMutablePointer(mutating: input.baseAddress)
                stream.avail_in = uInt(input.count)
                stream.next_out = out.baseAddress
                stream.avail_out = uInt(out.count)
                return CZlib.deflate(&stream, Z_FINISH)
            }
        }
        guard status == Z_STREAM_END else { throw AMQPError(.undecodable, "deflate: stream ended with \(status)") }
        output.removeSubrange(Int(stream.total_out)...)
        return output
    }

    /// `body` decoded; throws for a body that is not this encoding, or that unfolds past
    /// `maximumDecodedBytes`.
    public func decode(_ body: [UInt8]) throws(AMQPError) -> [UInt8] {
        var stream = z_stream()
        guard iap_inflate_init(&stream) == Z_OK else { throw AMQPError(.undecodable, "inflate: cannot start a stream") }
        defer { inflateEnd(&stream) }
        var output: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 16 << 10)
        var status = Z_OK
        body.withUnsafeBufferPointer { input in
            stream.next_in = UnsafeMutablePointer(mutating: input.baseAddress)
            stream.avail_in = uInt(input.count)
            while status == Z_OK && output.count <= Self.maximumDecodedBytes {
                let produced = chunk.withUnsafeMutableBufferPointer { out -> Int in
                    stream.next_out = out.baseAddress
                    stream.avail_out = uInt(out.count)
                    status = inflate(&stream, Z_NO_FLUSH)
                    return out.count - Int(stream.avail_out)
                }
                output.append(contentsOf: chunk[..<produced])
                // Input used up before the stream's end: a truncated body.
                if status == Z_OK && stream.avail_in == 0 && produced == 0 { status = Z_BUF_ERROR }
            }
        }
        guard output.count <= Self.maximumDecodedBytes else {
            throw AMQPError(.undecodable, "a deflated body unfolds past \(Self.maximumDecodedBytes) bytes")
        }
        guard status == Z_STREAM_END, stream.avail_in == 0 else {
            throw AMQPError(.undecodable, "a body marked deflate is not a whole zlib stream (\(status))")
        }
        return output
    }
}
