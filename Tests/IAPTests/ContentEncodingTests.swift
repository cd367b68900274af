import Messaging
import Testing

/// The message bodies' encodings, with no broker: what a consumer reads, and what it refuses.
@Suite("Content encodings")
struct ContentEncodingTests {
    @Test func aDeflatedBodyComesBackAsItWas() throws {
        for body in [[], Array("{}".utf8), Array(String(repeating: "MIIT", count: 5_000).utf8), (0..<70_000).map { UInt8($0 % 251) }] {
            let encoded = try ContentEncoding.deflate.encode(body)
            #expect(try ContentEncoding.decode(encoded, named: "deflate") == body)
        }
    }

    @Test func noEncodingOrIdentityIsTheBodyAsItIs() throws {
        let body = Array("plain".utf8)
        #expect(try ContentEncoding.decode(body, named: nil) == body)
        #expect(try ContentEncoding.decode(body, named: "identity") == body)
    }

    @Test func anEncodingNotReadHereIsRefusedByName() {
        #expect { try ContentEncoding.decode(Array("x".utf8), named: "br") } throws: { error in
            (error as? AMQPError)?.code == .undecodable && "\(error)".contains("content-encoding 'br'")
        }
    }

    /// A body cut short, or not deflated at all, is refused rather than read in part.
    @Test func aBodyThatIsNotAWholeStreamIsRefused() throws {
        let encoded = try ContentEncoding.deflate.encode(Array(String(repeating: "receipt ", count: 500).utf8))
        for broken in [Array(encoded.dropLast(4)), Array(encoded.prefix(10)), Array("{\"not\":\"deflated\"}".utf8), encoded + [0]] {
            #expect(throws: AMQPError.self) { try ContentEncoding.deflate.decode(broken) }
        }
    }

    /// A small body that would unfold to more than the bound is refused before it is held.
    @Test func aBodyThatUnfoldsPastTheBoundIsRefused() throws {
        let bomb = try ContentEncoding.deflate.encode([UInt8](repeating: 0, count: ContentEncoding.maximumDecodedBytes + 1))
        #expect(bomb.count * 100 < ContentEncoding.maximumDecodedBytes, "\(bomb.count) bytes")
        #expect { try ContentEncoding.deflate.decode(bomb) } throws: { error in
            (error as? AMQPError)?.code == .undecodable && "\(error)".contains("unfolds past")
        }
        let largest = try ContentEncoding.deflate.encode([UInt8](repeating: 1, count: ContentEncoding.maximumDecodedBytes))
        #expect(try ContentEncoding.deflate.decode(largest).count == ContentEncoding.maximumDecodedBytes)
    }
}
