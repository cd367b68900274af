public import Foundation

/// Dates as text in UTC with milliseconds (rounded down), written without a formatter: the
/// order store's columns and the events' fields write several per purchase.
public enum DateText {
    /// The dates anything from outside may carry, in milliseconds since 1970: from 1970-01-01 to
    /// 9999-12-31T23:59:59.999Z. Every date decoded from a request, a signed payload, a receipt,
    /// Apple's answers or a message is checked against it before any arithmetic.
    public static let acceptedMilliseconds: ClosedRange<Int64> = 0...253_402_300_799_999

    /// The date of `milliseconds` since 1970, or nil outside ``acceptedMilliseconds``.
    public static func date(milliseconds: Int64) -> Date? {
        acceptedMilliseconds.contains(milliseconds) ? Date(timeIntervalSince1970: Double(milliseconds) / 1000) : nil
    }

    /// The date of `milliseconds` since 1970 (any number), or nil when it is not finite or lies
    /// outside ``acceptedMilliseconds``.
    public static func date(milliseconds: Double) -> Date? {
        guard milliseconds.isFinite, milliseconds >= 0, milliseconds <= Double(acceptedMilliseconds.upperBound) else { return nil }
        return Date(timeIntervalSince1970: milliseconds / 1000)
    }

    /// Whether `date` lies within ``acceptedMilliseconds``.
    public static func accepts(_ date: Date) -> Bool {
        date.timeIntervalSince1970.isFinite && date.timeIntervalSince1970 >= 0
            && date.timeIntervalSince1970 * 1000 <= Double(acceptedMilliseconds.upperBound)
    }

    /// `yyyy-MM-dd<separator>HH:mm:ss.SSS<zone>`; ISO 8601 as events carry it with the defaults.
    /// A date outside ``acceptedMilliseconds`` is written as the nearest one inside it: nothing
    /// written can trap, or be unreadable later (inputs are bounded where they are decoded; this
    /// is the backstop).
    public static func format(_ date: Date, separator: String = "T", zone: String = "Z") -> String {
        let raw = date.timeIntervalSince1970 * 1000
        let bounded = raw.isNaN ? 0 : min(max(raw, 0), Double(acceptedMilliseconds.upperBound))
        let milliseconds = Int64(bounded.rounded(.down))
        var days = milliseconds >= 0 ? milliseconds / 86_400_000 : (milliseconds - 86_399_999) / 86_400_000
        let inDay = milliseconds - days * 86_400_000
        // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
        days += 719_468
        let era = (days >= 0 ? days : days - 146_096) / 146_097
        let dayOfEra = days - era * 146_097
        let yearOfEra = (dayOfEra - dayOfEra / 1460 + dayOfEra / 36524 - dayOfEra / 146_096) / 365
        let dayOfYear = dayOfEra - (365 * yearOfEra + yearOfEra / 4 - yearOfEra / 100)
        let monthIndex = (5 * dayOfYear + 2) / 153
        let day = dayOfYear - (153 * monthIndex + 2) / 5 + 1
        let month = monthIndex < 10 ? monthIndex + 3 : monthIndex - 9
        let year = yearOfEra + era * 400 + (month <= 2 ? 1 : 0)
        var text = ""
        text.reserveCapacity(23)
        func append(_ value: Int64, width: Int) {
            let digits = String(value)
            if digits.count < width { text += String(repeating: "0", count: width - digits.count) }
            text += digits
        }
        append(year, width: 4)
        text += "-"
        append(month, width: 2)
        text += "-"
        append(day, width: 2)
        text += separator
        append(inDay / 3_600_000, width: 2)
        text += ":"
        append(inDay / 60_000 % 60, width: 2)
        text += ":"
        append(inDay / 1000 % 60, width: 2)
        text += "."
        append(inDay % 1000, width: 3)
        text += zone
        return text
    }
}
