import Foundation

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#elseif canImport(Darwin)
    import Darwin
#endif

/// The queue in files: one file per user in a folder of the app's own (Application Support on
/// iOS), each replaced whole on every change (written to a new file, flushed to the disk,
/// renamed over the old one, the folder flushed too). A kill at any instruction leaves either
/// the old file or the new one, never a torn one; a file that does not decode is an error, never
/// an empty queue.
public struct FileTransactionStore: TransactionStore {
    /// The folder the files are in.
    public let directory: URL

    /// A store in `directory`, made if missing. Leftovers of a write a kill interrupted (never
    /// renamed into place, so never part of the queue) are removed.
    public init(directory: URL) throws {
        self.directory = directory
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        let names = try FileManager.default.contentsOfDirectory(atPath: directory.path)
        for name in names where name.hasPrefix(Self.prefix) && name.contains(Self.partSuffix) {
            try? FileManager.default.removeItem(at: directory.appendingPathComponent(name))
        }
    }

    public func entries() throws -> [QueueEntry] {
        try locked {
            let names = try FileManager.default.contentsOfDirectory(atPath: directory.path)
            var all: [QueueEntry] = []
            for name in names.sorted() where name.hasPrefix(Self.prefix) && name.hasSuffix(Self.suffix) {
                all += try read(directory.appendingPathComponent(name))
            }
            return all
        }
    }

    public func put(_ entry: QueueEntry) throws {
        try locked {
            let file = file(of: entry.userId)
            var entries = try read(file).filter { $0.transactionId != entry.transactionId }
            entries.append(entry)
            try replace(file, with: entries)
        }
    }

    public func remove(userId: String, transactionId: String) throws {
        try locked {
            let file = file(of: userId)
            let entries = try read(file)
            let kept = entries.filter { $0.transactionId != transactionId }
            guard kept.count != entries.count else { return }
            if kept.isEmpty {
                try removeDurably(file)
            } else {
                try replace(file, with: kept)
            }
        }
    }

    // MARK: - Files

    private static let prefix = "queue-"
    private static let suffix = ".json"
    private static let partSuffix = ".part-"

    /// A user's file: the user id in hexadecimal, so that any id makes a safe file name.
    private func file(of userId: String) -> URL {
        let hex = userId.utf8.map { String(format: "%02x", $0) }.joined()
        return directory.appendingPathComponent(Self.prefix + hex + Self.suffix)
    }

    private func read(_ file: URL) throws -> [QueueEntry] {
        guard FileManager.default.fileExists(atPath: file.path) else { return [] }
        let data = try Data(contentsOf: file)
        do {
            return try Self.decoder.decode([QueueEntry].self, from: data)
        } catch {
            throw TransactionStoreError("\(file.lastPathComponent) does not decode (\(error)); it is kept as it is")
        }
    }

    /// Replaces `file` with `entries`: a new file, flushed, renamed over the old, the folder flushed.
    private func replace(_ file: URL, with entries: [QueueEntry]) throws {
        let data = try Self.encoder.encode(entries)
        let part = file.path + Self.partSuffix + UUID().uuidString
        let fd = open(part, O_WRONLY | O_CREAT | O_EXCL, 0o600)
        guard fd >= 0 else { throw Self.posixError("open", part) }
        var written = 0
        let failure: TransactionStoreError? = data.withUnsafeBytes { bytes in
            while written < bytes.count {
                let n = write(fd, bytes.baseAddress! + written, bytes.count - written)
                if n < 0 {
                    if errno == EINTR { continue }
                    return Self.posixError("write", part)
                }
                written += n
            }
            return fsync(fd) == 0 ? nil : Self.posixError("fsync", part)
        }
        close(fd)
        if let failure {
            unlink(part)
            throw failure
        }
        guard rename(part, file.path) == 0 else {
            let error = Self.posixError("rename", part)
            unlink(part)
            throw error
        }
        try syncDirectory()
    }

    private func removeDurably(_ file: URL) throws {
        guard unlink(file.path) == 0 || errno == ENOENT else { throw Self.posixError("unlink", file.path) }
        try syncDirectory()
    }

    /// Flushes the folder, so that a rename or an unlink survives a power cut too.
    private func syncDirectory() throws {
        let fd = open(directory.path, O_RDONLY)
        guard fd >= 0 else { throw Self.posixError("open", directory.path) }
        defer { close(fd) }
        guard fsync(fd) == 0 else { throw Self.posixError("fsync", directory.path) }
    }

    /// Runs `body` holding the folder's lock, so that two processes of the app (an app and its
    /// extension) never interleave a read and a write.
    private func locked<T>(_ body: () throws -> T) throws -> T {
        let path = directory.appendingPathComponent(".lock").path
        let fd = open(path, O_RDWR | O_CREAT, 0o600)
        guard fd >= 0 else { throw Self.posixError("open", path) }
        defer { close(fd) }
        while flock(fd, LOCK_EX) != 0 {
            guard errno == EINTR else { throw Self.posixError("flock", path) }
        }
        defer { flock(fd, LOCK_UN) }
        return try body()
    }

    private static func posixError(_ call: String, _ path: String) -> TransactionStoreError {
        TransactionStoreError("\(call) \(path): \(String(cString: strerror(errno)))")
    }

    static var encoder: JSONEncoder {
        let encoder = JSONEncoder()
        encoder.dateEncodingStrategy = .millisecondsSince1970
        encoder.outputFormatting = [.sortedKeys]
        return encoder
    }

    static var decoder: JSONDecoder {
        let decoder = JSONDecoder()
        decoder.dateDecodingStrategy = .millisecondsSince1970
        return decoder
    }
}
