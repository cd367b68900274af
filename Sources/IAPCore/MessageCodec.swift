import Foundation

/// Encodes and decodes the JSON envelopes that travel between the roles.
///
/// Dates travel as epoch milliseconds so that every role reads them the same way.
public struct MessageCodec: Sendable {
    /// Creates a codec.
    public init() {}

    /// Serialises an envelope.
    public func encode<Value: Encodable>(_ value: Value) throws -> [UInt8] {
        let encoder = JSONEncoder()
        encoder.dateEncodingStrategy = .millisecondsSince1970
        encoder.outputFormatting = [.sortedKeys]
        return Array(try encoder.encode(value))
    }

    /// Reads an envelope; throws `DecodingError` for anything that is not one.
    public func decode<Value: Decodable>(_ type: Value.Type, from bytes: [UInt8]) throws -> Value {
        let decoder = JSONDecoder()
        decoder.dateDecodingStrategy = .millisecondsSince1970
        return try decoder.decode(type, from: Data(bytes))
    }
}
