import Foundation

/// Prometheus' text format, read into samples: name, labels, value.
struct MetricsText {
    struct Sample {
        var name: String
        var labels: [String: String]
        var value: Double
    }

    let samples: [Sample]

    init(_ text: String) {
        var samples: [Sample] = []
        for line in text.split(separator: "\n") where !line.hasPrefix("#") && !line.isEmpty {
            guard let space = line.lastIndex(of: " "), let value = Double(line[line.index(after: space)...]) else {
                continue
            }
            let series = line[..<space]
            var labels: [String: String] = [:]
            let name: String
            if let open = series.firstIndex(of: "{"), series.hasSuffix("}") {
                name = String(series[..<open])
                let inner = series[series.index(after: open)..<series.index(before: series.endIndex)]
                for pair in inner.split(separator: ",") {
                    let parts = pair.split(separator: "=", maxSplits: 1)
                    guard parts.count == 2 else { continue }
                    labels[String(parts[0])] = String(parts[1]).trimmingCharacters(in: CharacterSet(charactersIn: "\""))
                }
            } else {
                name = String(series)
            }
            samples.append(Sample(name: name, labels: labels, value: value))
        }
        self.samples = samples
    }

    /// The value of the sample with this name whose labels include `labels`; sums several.
    func value(_ name: String, _ labels: [String: String] = [:]) -> Double? {
        let matching = samples.filter { sample in
            sample.name == name && labels.allSatisfy { sample.labels[$0.key] == $0.value }
        }
        return matching.isEmpty ? nil : matching.reduce(0) { $0 + $1.value }
    }

    /// Every metric family present (histogram series reduced to their family name).
    var families: Set<String> {
        Set(samples.map { sample in
            for suffix in ["_bucket", "_count", "_sum"] where sample.name.hasSuffix(suffix) {
                return String(sample.name.dropLast(suffix.count))
            }
            return sample.name
        })
    }
}
