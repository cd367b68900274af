import Foundation

/// Reads what `iap_read` answers: a JSON array with, for each query, the array of its rows as
/// objects (`json_agg`), each column a JSON null, boolean, number or string.
///
/// Numbers without a fraction or exponent are integers, others reals; booleans are the
/// integers 0 and 1, as the store reads booleans everywhere; strings are text (dates are text
/// in this store). A nested array or object is refused: no column the store reads in a batch
/// holds one.
package enum RowSetsJSON {
    package static func parse(_ text: String) throws -> [[SQLRow]] {
        var text = text
        return try text.withUTF8 { bytes in
            var reader = Reader(bytes: bytes)
            let sets = try reader.rowSets()
            reader.skipSpace()
            guard reader.index == bytes.count else { throw reader.failure("text after the answer") }
            return sets
        }
    }

    private struct Reader {
        let bytes: UnsafeBufferPointer<UInt8>
        var index = 0

        init(bytes: UnsafeBufferPointer<UInt8>) {
            self.bytes = bytes
        }

        func failure(_ what: String) -> SQLError {
            SQLError(.other, "iap_read answered JSON the store cannot read: \(what) at byte \(index)")
        }

        mutating func skipSpace() {
            while index < bytes.count, bytes[index] == 0x20 || bytes[index] == 0x0a || bytes[index] == 0x0d || bytes[index] == 0x09 {
                index += 1
            }
        }

        mutating func expect(_ byte: UInt8) throws {
            skipSpace()
            guard index < bytes.count, bytes[index] == byte else { throw failure("expected \(Character(Unicode.Scalar(byte)))") }
            index += 1
        }

        /// Reads `[` items separated by `,` `]`, each by `item`.
        mutating func list(_ open: UInt8, _ close: UInt8, _ item: (inout Reader) throws -> Void) throws {
            try expect(open)
            skipSpace()
            if index < bytes.count, bytes[index] == close {
                index += 1
                return
            }
            while true {
                try item(&self)
                skipSpace()
                guard index < bytes.count else { throw failure("unfinished list") }
                if bytes[index] == close {
                    index += 1
                    return
                }
                try expect(0x2c)
            }
        }

        mutating func rowSets() throws -> [[SQLRow]] {
            var sets: [[SQLRow]] = []
            try list(0x5b, 0x5d) { reader in
                var rows: [SQLRow] = []
                try reader.list(0x5b, 0x5d) { reader in rows.append(try reader.row()) }
                sets.append(rows)
            }
            return sets
        }

        mutating func row() throws -> SQLRow {
            var columns: [String] = []
            var values: [SQLValue] = []
            try list(0x7b, 0x7d) { reader in
                columns.append(try reader.string())
                try reader.expect(0x3a)
                values.append(try reader.value())
            }
            return SQLRow(columns: columns, values: values)
        }

        mutating func value() throws -> SQLValue {
            skipSpace()
            guard index < bytes.count else { throw failure("missing value") }
            switch bytes[index] {
            case 0x22: return .text(try string())
            case 0x6e: try word("null"); return .null
            case 0x74: try word("true"); return .integer(1)
            case 0x66: try word("false"); return .integer(0)
            case 0x2d, 0x30...0x39: return try number()
            default: throw failure("a nested array or object")
            }
        }

        mutating func word(_ word: String) throws {
            let expected = Array(word.utf8)
            guard index + expected.count <= bytes.count, bytes[index..<index + expected.count].elementsEqual(expected) else {
                throw failure("expected \(word)")
            }
            index += expected.count
        }

        mutating func number() throws -> SQLValue {
            let start = index
            var integral = true
            while index < bytes.count {
                let byte = bytes[index]
                if byte == 0x2e || byte == 0x65 || byte == 0x45 || byte == 0x2b {
                    integral = false
                } else if !(byte == 0x2d || (0x30...0x39).contains(byte)) {
                    break
                }
                index += 1
            }
            let text = String(decoding: UnsafeBufferPointer(rebasing: bytes[start..<index]), as: UTF8.self)
            if integral, let integer = Int64(text) { return .integer(integer) }
            guard let real = Double(text) else { throw failure("a number") }
            return .real(real)
        }

        mutating func string() throws -> String {
            try expect(0x22)
            let start = index
            // Most strings have no escapes: taken whole.
            while index < bytes.count, bytes[index] != 0x22, bytes[index] != 0x5c { index += 1 }
            guard index < bytes.count else { throw failure("unfinished string") }
            if bytes[index] == 0x22 {
                defer { index += 1 }
                return String(decoding: UnsafeBufferPointer(rebasing: bytes[start..<index]), as: UTF8.self)
            }
            var scalars = Array(bytes[start..<index])
            while true {
                guard index < bytes.count else { throw failure("unfinished string") }
                let byte = bytes[index]
                index += 1
                if byte == 0x22 { break }
                guard byte == 0x5c else {
                    scalars.append(byte)
                    continue
                }
                guard index < bytes.count else { throw failure("unfinished escape") }
                let escaped = bytes[index]
                index += 1
                switch escaped {
                case 0x22, 0x5c, 0x2f: scalars.append(escaped)
                case 0x62: scalars.append(0x08)
                case 0x66: scalars.append(0x0c)
                case 0x6e: scalars.append(0x0a)
                case 0x72: scalars.append(0x0d)
                case 0x74: scalars.append(0x09)
                case 0x75:
                    var code = try hex4()
                    if (0xd800...0xdbff).contains(code) {
                        // A surrogate pair: its second half follows as `\uXXXX`.
                        guard index + 1 < bytes.count, bytes[index] == 0x5c, bytes[index + 1] == 0x75 else {
                            throw failure("a lone surrogate")
                        }
                        index += 2
                        let low = try hex4()
                        guard (0xdc00...0xdfff).contains(low) else { throw failure("a lone surrogate") }
                        code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00)
                    }
                    guard let scalar = Unicode.Scalar(code) else { throw failure("an invalid \\u escape") }
                    scalars.append(contentsOf: Array(String(Character(scalar)).utf8))
                default:
                    throw failure("an invalid escape")
                }
            }
            return String(decoding: scalars, as: UTF8.self)
        }

        mutating func hex4() throws -> UInt32 {
            guard index + 4 <= bytes.count else { throw failure("a short \\u escape") }
            var code: UInt32 = 0
            for _ in 0..<4 {
                let byte = bytes[index]
                index += 1
                let digit: UInt32
                switch byte {
                case 0x30...0x39: digit = UInt32(byte - 0x30)
                case 0x61...0x66: digit = UInt32(byte - 0x61 + 10)
                case 0x41...0x46: digit = UInt32(byte - 0x41 + 10)
                default: throw failure("a \\u escape")
                }
                code = code << 4 | digit
            }
            return code
        }
    }
}
