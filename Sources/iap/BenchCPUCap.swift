import Foundation

/// A CPU cap for one process a benchmark starts: a control group of its own whose quota is
/// `cores` of a CPU per 100 ms period, as if the process had a machine of that size to itself.
/// On a small machine every process of the pipeline shares the same cores, so adding an order
/// service adds CPU demand and cannot show whether order services scale; with each one capped,
/// the order services are the bottleneck and a second one shows what it adds.
///
/// Linux only, as root: cgroup v2 (`cpu.max`) or the v1 `cpu` controller
/// (`cpu.cfs_quota_us`). The group is removed once its process has exited.
struct BenchCPUCap: Sendable {
    private enum Hierarchy: Sendable {
        case unified, v1
    }

    private static let period = 100_000  // microseconds
    private let directory: URL
    private let hierarchy: Hierarchy

    /// Creates the group `name` with a quota of `cores`.
    init(name: String, cores: Double) throws {
        let fileManager = FileManager.default
        let root: URL
        if fileManager.fileExists(atPath: "/sys/fs/cgroup/cgroup.controllers") {
            hierarchy = .unified
            root = URL(fileURLWithPath: "/sys/fs/cgroup")
            // A child group gets a cpu.max only where its parent hands the controller down.
            let control = root.appendingPathComponent("cgroup.subtree_control")
            let enabled = (try? String(contentsOf: control, encoding: .utf8)) ?? ""
            if !enabled.split(separator: " ").contains(where: { $0.trimmingCharacters(in: .whitespacesAndNewlines) == "cpu" }) {
                try Self.write("+cpu", to: control)
            }
        } else if fileManager.fileExists(atPath: "/sys/fs/cgroup/cpu/cpu.cfs_quota_us") {
            hierarchy = .v1
            root = URL(fileURLWithPath: "/sys/fs/cgroup/cpu")
        } else {
            throw BenchCPUCapError("no cgroup cpu controller at /sys/fs/cgroup (cgroup v2, or v1's cpu)")
        }
        directory = root.appendingPathComponent(name)
        do {
            try fileManager.createDirectory(at: directory, withIntermediateDirectories: false)
        } catch {
            throw BenchCPUCapError("cannot create the control group \(directory.path) (run as root): \(error)")
        }
        let quota = max(1_000, Int((cores * Double(Self.period)).rounded()))
        switch hierarchy {
        case .unified:
            try Self.write("\(quota) \(Self.period)", to: directory.appendingPathComponent("cpu.max"))
        case .v1:
            try Self.write(String(Self.period), to: directory.appendingPathComponent("cpu.cfs_period_us"))
            try Self.write(String(quota), to: directory.appendingPathComponent("cpu.cfs_quota_us"))
        }
    }

    /// Moves `pid` (all its threads, and every thread it starts later) into the group.
    func add(_ pid: Int32) throws {
        try Self.write(String(pid), to: directory.appendingPathComponent("cgroup.procs"))
    }

    /// How many periods the group was held back at its quota so far (`nr_throttled`).
    func throttledPeriods() -> Int? {
        guard let stat = try? String(contentsOf: directory.appendingPathComponent("cpu.stat"), encoding: .utf8) else { return nil }
        for line in stat.split(separator: "\n") {
            let fields = line.split(separator: " ")
            if fields.count == 2, fields[0] == "nr_throttled" { return Int(fields[1]) }
        }
        return nil
    }

    /// Removes the group; its processes must have exited.
    func remove() {
        _ = rmdir(directory.path)
    }

    private static func write(_ value: String, to file: URL) throws {
        do {
            let handle = try FileHandle(forWritingTo: file)
            defer { try? handle.close() }
            try handle.write(contentsOf: Data(value.utf8))
        } catch {
            throw BenchCPUCapError("cannot write '\(value)' to \(file.path): \(error)")
        }
    }
}

struct BenchCPUCapError: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}
