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

    /// The most attempts (and malformed answers) a message may count: a counter from outside
    /// is bounded before anything adds to it.
    public static let maxAttempts = 1_000_000

    /// Reads an upload to verify; throws for anything that is not one, and for counters or
    /// quantities out of their bounds.
    public func decodeRequest(from bytes: [UInt8]) throws -> VerifyRequest {
        let request = try decode(VerifyRequest.self, from: bytes)
        guard (1...Self.maxAttempts).contains(request.attempt), (0...Self.maxAttempts).contains(request.malformedAnswers ?? 0) else {
            throw MessageBoundsError(description: "attempt \(request.attempt) or malformedAnswers out of bounds")
        }
        return request
    }

    /// Reads a verification result; throws for anything that is not one, and for counters or
    /// quantities out of their bounds.
    public func decodeResult(from bytes: [UInt8]) throws -> VerifyResult {
        let result = try decode(VerifyResult.self, from: bytes)
        guard (1...Self.maxAttempts).contains(result.attempt) else {
            throw MessageBoundsError(description: "attempt \(result.attempt) out of bounds")
        }
        if case .verified(let receipt) = result.outcome,
            let purchase = receipt.purchases.first(where: { !(1...VerifiedPurchase.maxQuantity).contains($0.quantity) })
        {
            throw MessageBoundsError(description: "quantity \(purchase.quantity) of \(purchase.transactionId) out of bounds")
        }
        return result
    }

    /// Reads an envelope; throws `DecodingError` for anything that is not one, a date outside
    /// `DateText.acceptedMilliseconds` included (a message is input too: no date in it may trap
    /// a conversion later).
    public func decode<Value: Decodable>(_ type: Value.Type, from bytes: [UInt8]) throws -> Value {
        let decoder = JSONDecoder()
        decoder.dateDecodingStrategy = .custom { decoder in
            let container = try decoder.singleValueContainer()
            let milliseconds = try container.decode(Double.self)
            guard let date = DateText.date(milliseconds: milliseconds) else {
                throw DecodingError.dataCorruptedError(in: container, debugDescription: "a date outside 1970…9999")
            }
            return date
        }
        return try decoder.decode(type, from: Data(bytes))
    }
}

/// A message whose numbers lie outside their bounds.
public struct MessageBoundsError: Error, CustomStringConvertible, Sendable {
    public let description: String
}
