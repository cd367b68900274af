import Foundation
import Logging

/// One JSON object per line on standard error (`IAP_LOG_FORMAT=json`), for log shippers:
/// `ts`, `level`, `label`, `message`, `source`, and every metadata key at the top level.
struct JSONLogHandler: LogHandler {
    let label: String
    var logLevel: Logger.Level
    var metadata: Logger.Metadata = [:]

    subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }

    func log(event: LogEvent) {
        var fields: [String: Any] = [
            "ts": Self.timestamp(), "level": event.level.rawValue, "label": label,
            "message": event.message.description, "source": event.source,
        ]
        for (key, value) in metadata.merging(event.metadata ?? [:], uniquingKeysWith: { $1 }) {
            fields[key] = Self.plain(value)
        }
        guard var line = try? JSONSerialization.data(withJSONObject: fields, options: [.sortedKeys]) else { return }
        line.append(0x0A)
        FileHandle.standardError.write(line)
    }

    private static func plain(_ value: Logger.MetadataValue) -> Any {
        switch value {
        case .string(let string): string
        case .stringConvertible(let convertible): convertible.description
        case .array(let array): array.map(plain)
        case .dictionary(let dictionary): dictionary.mapValues(plain)
        }
    }

    private static func timestamp() -> String {
        Date().formatted(.iso8601.year().month().day().time(includingFractionalSeconds: true))
    }
}
