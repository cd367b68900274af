import Foundation
import OrderStore

/// A small server-side SVG bar chart of uploads and credits per hour (no script, no CDN).
enum ActivityChart {
    static func svg(_ hours: [ConsoleHour]) -> String {
        let width = 960.0
        let height = 180.0
        let left = 40.0
        let bottom = 24.0
        let top = 10.0
        let plotHeight = height - bottom - top
        let peak = max(1, hours.map { max($0.uploads, $0.credits) }.max() ?? 1)
        let slot = (width - left - 10) / Double(max(1, hours.count))
        let bar = max(1, slot / 2 - 1)
        var parts: [String] = []
        let totalUploads = hours.reduce(0) { $0 + $1.uploads }
        let totalCredits = hours.reduce(0) { $0 + $1.credits }
        parts.append(
            """
            <svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 \(Int(width)) \(Int(height))" width="100%" role="img" \
            aria-labelledby="chart-title" class="chart">
            <title id="chart-title">Uploads and credits per hour, last \(hours.count) hours: \(totalUploads) uploads, \
            \(totalCredits) credits</title>
            """)
        // Axis and gridlines at 0, half and the peak.
        for fraction in [0.0, 0.5, 1.0] {
            let y = top + plotHeight * (1 - fraction)
            let label = Int((Double(peak) * fraction).rounded())
            parts.append(
                "<line x1=\"\(left)\" y1=\"\(y)\" x2=\"\(width - 10)\" y2=\"\(y)\" stroke=\"#c8ccd2\" stroke-width=\"1\"/>")
            parts.append(
                "<text x=\"\(left - 6)\" y=\"\(y + 4)\" text-anchor=\"end\" font-size=\"11\" fill=\"#3a3f45\">\(label)</text>")
        }
        for (index, hour) in hours.enumerated() {
            let x = left + Double(index) * slot
            let uploadHeight = plotHeight * Double(hour.uploads) / Double(peak)
            let creditHeight = plotHeight * Double(hour.credits) / Double(peak)
            parts.append(
                "<rect x=\"\(fmt(x))\" y=\"\(fmt(top + plotHeight - uploadHeight))\" width=\"\(fmt(bar))\" height=\"\(fmt(uploadHeight))\" fill=\"#2b6cb0\"/>")
            parts.append(
                "<rect x=\"\(fmt(x + bar + 1))\" y=\"\(fmt(top + plotHeight - creditHeight))\" width=\"\(fmt(bar))\" height=\"\(fmt(creditHeight))\" fill=\"#2f855a\"/>")
            if index % 6 == 0 {
                let hourOfDay = Calendar(identifier: .gregorian).dateComponents(in: TimeZone(identifier: "UTC")!, from: hour.start).hour ?? 0
                parts.append(
                    "<text x=\"\(fmt(x))\" y=\"\(height - 6)\" font-size=\"11\" fill=\"#3a3f45\">\(String(format: "%02d:00", hourOfDay))</text>")
            }
        }
        parts.append("</svg>")
        return parts.joined(separator: "\n")
    }

    private static func fmt(_ value: Double) -> String {
        String(format: "%.1f", value)
    }
}
