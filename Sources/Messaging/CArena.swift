import CRabbitMQ
import Foundation

/// Owns C copies of Swift strings and byte arrays for the length of one library call.
///
/// `amqp_cstring_bytes(swiftString)` would point at a temporary; everything handed to
/// rabbitmq-c is copied here instead and freed when the arena goes away.
final class CArena {
    private var blocks: [UnsafeMutableRawPointer] = []

    deinit {
        for block in blocks { free(block) }
    }

    func bytes(_ string: String) -> amqp_bytes_t {
        bytes(Array(string.utf8))
    }

    func bytes(_ array: [UInt8]) -> amqp_bytes_t {
        guard !array.isEmpty else { return amqp_bytes_t(len: 0, bytes: nil) }
        let block = malloc(array.count)!
        array.withUnsafeBytes { block.copyMemory(from: $0.baseAddress!, byteCount: array.count) }
        blocks.append(block)
        return amqp_bytes_t(len: array.count, bytes: block)
    }

    func cString(_ string: String) -> UnsafePointer<CChar> {
        let copy = strdup(string)!
        blocks.append(UnsafeMutableRawPointer(copy))
        return UnsafePointer(copy)
    }

    func table(_ pairs: [(String, Topology.ArgumentValue)]) -> amqp_table_t {
        guard !pairs.isEmpty else { return amqp_table_t(num_entries: 0, entries: nil) }
        let raw = malloc(MemoryLayout<amqp_table_entry_t>.stride * pairs.count)!
        blocks.append(raw)
        let entries = raw.bindMemory(to: amqp_table_entry_t.self, capacity: pairs.count)
        for (index, (key, value)) in pairs.enumerated() {
            var field = amqp_field_value_t()
            switch value {
            case .string(let string):
                field.kind = UInt8(AMQP_FIELD_KIND_UTF8.rawValue)
                field.value.bytes = bytes(string)
            case .int(let number):
                field.kind = UInt8(AMQP_FIELD_KIND_I64.rawValue)
                field.value.i64 = number
            }
            entries[index] = amqp_table_entry_t(key: bytes(key), value: field)
        }
        return amqp_table_t(num_entries: Int32(pairs.count), entries: entries)
    }
}

extension amqp_bytes_t {
    /// A Swift copy of the bytes.
    var array: [UInt8] {
        guard len > 0, let bytes else { return [] }
        return Array(UnsafeRawBufferPointer(start: bytes, count: len))
    }

    /// The bytes read as UTF-8.
    var string: String {
        guard len > 0, let bytes else { return "" }
        return String(decoding: UnsafeRawBufferPointer(start: bytes, count: len), as: UTF8.self)
    }
}

extension amqp_table_t {
    /// String and numeric entries as strings; nested tables and arrays are left out.
    var stringHeaders: [String: String] {
        guard num_entries > 0, let entries else { return [:] }
        var headers: [String: String] = [:]
        for index in 0..<Int(num_entries) {
            let entry = entries[index]
            let value = entry.value
            let text: String?
            switch UInt32(value.kind) {
            case AMQP_FIELD_KIND_UTF8.rawValue, AMQP_FIELD_KIND_BYTES.rawValue: text = value.value.bytes.string
            case AMQP_FIELD_KIND_I64.rawValue: text = String(value.value.i64)
            case AMQP_FIELD_KIND_U64.rawValue: text = String(value.value.u64)
            case AMQP_FIELD_KIND_I32.rawValue: text = String(value.value.i32)
            case AMQP_FIELD_KIND_U32.rawValue: text = String(value.value.u32)
            case AMQP_FIELD_KIND_I16.rawValue: text = String(value.value.i16)
            case AMQP_FIELD_KIND_U16.rawValue: text = String(value.value.u16)
            case AMQP_FIELD_KIND_I8.rawValue: text = String(value.value.i8)
            case AMQP_FIELD_KIND_U8.rawValue: text = String(value.value.u8)
            case AMQP_FIELD_KIND_BOOLEAN.rawValue: text = value.value.boolean != 0 ? "true" : "false"
            default: text = nil
            }
            if let text { headers[entry.key.string] = text }
        }
        return headers
    }

    /// The string entries of the newest death in the broker's `x-death` array (its first
    /// table), such as `reason` and `queue`; empty when the message never died.
    var lastDeath: [String: String] {
        guard num_entries > 0, let entries else { return [:] }
        for index in 0..<Int(num_entries) where entries[index].key.string == "x-death" {
            let value = entries[index].value
            guard UInt32(value.kind) == AMQP_FIELD_KIND_ARRAY.rawValue, value.value.array.num_entries > 0,
                let first = value.value.array.entries, UInt32(first.pointee.kind) == AMQP_FIELD_KIND_TABLE.rawValue
            else { return [:] }
            return first.pointee.value.table.stringHeaders
        }
        return [:]
    }
}

/// AMQP method ids (class << 16 | method); the C macros carry casts that do not import.
enum AMQPMethod {
    static let connectionClose: amqp_method_number_t = 0x000A_0032
    static let connectionCloseOk: amqp_method_number_t = 0x000A_0033
    static let channelClose: amqp_method_number_t = 0x0014_0028
    static let channelCloseOk: amqp_method_number_t = 0x0014_0029
    static let basicCancel: amqp_method_number_t = 0x003C_001E
    static let basicReturn: amqp_method_number_t = 0x003C_0032
    static let basicDeliver: amqp_method_number_t = 0x003C_003C
    static let basicAck: amqp_method_number_t = 0x003C_0050
    static let basicNack: amqp_method_number_t = 0x003C_0078
    static let basicGetOk: amqp_method_number_t = 0x003C_0047
    static let basicGetEmpty: amqp_method_number_t = 0x003C_0048
}
