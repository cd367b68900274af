import Foundation
import Logging

/// Lines of text on standard error (`IAP_LOG_FORMAT=text`, the default): time, level, label,
/// metadata, source and message, as swift-log's stream handler writes them, with every
/// control, format and line-separator character of a value written as `\u{…}`: a value a
/// client chose (a token header's `alg`, a user id) can never start a line of its own.
struct TextLogHandler: LogHandler {
    let label: String
    var logLevel: Logger.Level
    var metadata: Logger.Metadata = [:]

    subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }

    func log(event: LogEvent) {
        let merged = metadata.merging(event.metadata ?? [:], uniquingKeysWith: { $1 })
        let fields = merged.sorted { $0.key < $1.key }.map { "\(Self.escaped($0.key))=\(Self.escaped(Self.plain($0.value)))" }
        let rendered = fields.isEmpty ? "" : " " + fields.joined(separator: " ")
        let line = "\(Self.timestamp()) \(event.level) \(label) :\(rendered) [\(event.source)] \(Self.escaped(event.message.description))\n"
        FileHandle.standardError.write(Data(line.utf8))
    }

    /// `text` with its control, format and separator characters as `\u{…}`.
    static func escaped(_ text: String) -> String {
        var out = String.UnicodeScalarView()
        for scalar in text.unicodeScalars {
            switch scalar.properties.generalCategory {
            case .control, .format, .lineSeparator, .paragraphSeparator:
                out.append(contentsOf: "\\u{\(String(scalar.value, radix: 16))}".unicodeScalars)
            default:
                out.append(scalar)
            }
        }
        return String(out)
    }

    private static func plain(_ value: Logger.MetadataValue) -> String {
        switch value {
        case .string(let string): string
        case .stringConvertible(let convertible): convertible.description
        case .array(let array): "[" + array.map(plain).joined(separator: ", ") + "]"
        case .dictionary(let dictionary):
            "[" + dictionary.sorted { $0.key < $1.key }.map { "\($0.key): \(plain($0.value))" }.joined(separator: ", ") + "]"
        }
    }

    private static func timestamp() -> String {
        Date().formatted(.iso8601.year().month().day().time(includingFractionalSeconds: false).timeZone(separator: .omitted))
    }
}
