internal import CZlib

/// zlib's format (RFC 1950, HTTP's `Content-Encoding: deflate`), for the bytes the pipeline
/// keeps or carries that repeat themselves: an app receipt is a DER structure whose
/// certificate names and object identifiers recur, and its base64 a quarter larger again.
///
/// Deflate runs at its fastest level with an 8 KiB window and a small hash table (what is
/// deflated here is a few KB): on a receipt that saves within 3 % of what zlib's defaults
/// save, and starting the stream, most of the cost for input this small, clears a tenth of
/// the memory.
public enum Deflate {
    /// `bytes` deflated.
    public static func compress(_ bytes: [UInt8]) throws(DeflateError) -> [UInt8] {
        var stream = z_stream()
        guard iap_deflate_init(&stream, Z_BEST_SPEED, 13, 5) == Z_OK else {
            throw DeflateError("deflate: cannot start a stream")
        }
        defer { deflateEnd(&stream) }
        var output = [UInt8](repeating: 0, count: Int(deflateBound(&stream, uLong(bytes.count))))
        let status = bytes.withUnsafeBufferPointer { input in
            output.withUnsafeMutableBufferPointer { out in
                stream.next_in = UnsafeMutablePointer(mutating: input.baseAddress)
                stream.avail_in = uInt(input.count)
                stream.next_out = out.baseAddress
                stream.avail_out = uInt(out.count)
                return CZlib.deflate(&stream, Z_FINISH)
            }
        }
        guard status == Z_STREAM_END else { throw DeflateError("deflate: stream ended with \(status)") }
        output.removeSubrange(Int(stream.total_out)...)
        return output
    }

    /// `bytes` inflated; throws for bytes that are not one whole zlib stream, or that unfold
    /// past `limit` bytes (refused, not allocated).
    public static func decompress(_ bytes: [UInt8], limit: Int) throws(DeflateError) -> [UInt8] {
        var stream = z_stream()
        guard iap_inflate_init(&stream) == Z_OK else { throw DeflateError("inflate: cannot start a stream") }
        defer { inflateEnd(&stream) }
        var output: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 16 << 10)
        var status = Z_OK
        bytes.withUnsafeBufferPointer { input in
            stream.next_in = UnsafeMutablePointer(mutating: input.baseAddress)
            stream.avail_in = uInt(input.count)
            while status == Z_OK && output.count <= limit {
                let produced = chunk.withUnsafeMutableBufferPointer { out -> Int in
                    stream.next_out = out.baseAddress
                    stream.avail_out = uInt(out.count)
                    status = inflate(&stream, Z_NO_FLUSH)
                    return out.count - Int(stream.avail_out)
                }
                output.append(contentsOf: chunk[..<produced])
                // Input used up before the stream's end: truncated.
                if status == Z_OK && stream.avail_in == 0 && produced == 0 { status = Z_BUF_ERROR }
            }
        }
        guard output.count <= limit else { throw DeflateError("the stream unfolds past \(limit) bytes") }
        guard status == Z_STREAM_END, stream.avail_in == 0 else {
            throw DeflateError("not a whole zlib stream (\(status))")
        }
        return output
    }
}

/// Why bytes could not be deflated or inflated.
public struct DeflateError: Error, Sendable, CustomStringConvertible {
    /// What went wrong, for logs and error answers.
    public let description: String

    init(_ description: String) { self.description = description }
}
