import Foundation

/// Where the queue lives: durable storage that survives a kill, a restart and (for the
/// Keychain) an uninstall. Every call is complete when it returns: an entry `put` is read back
/// by any later `entries()`, in this process or the next.
public protocol TransactionStore: Sendable {
    /// Every entry of every user.
    func entries() throws -> [QueueEntry]
    /// Writes the entry (replacing the one of the same user and transaction id), durably.
    func put(_ entry: QueueEntry) throws
    /// Removes the entry of this user and transaction id, durably; none is not an error.
    func remove(userId: String, transactionId: String) throws
}

extension TransactionStore {
    /// The entries of one user.
    public func entries(of userId: String) throws -> [QueueEntry] {
        try entries().filter { $0.userId == userId }
    }

    /// The entry holding this transaction, under whichever user it was bought.
    public func entry(transactionId: String) throws -> QueueEntry? {
        try entries().first { $0.transactionId == transactionId }
    }
}

/// What a store could not do.
public struct TransactionStoreError: Error, CustomStringConvertible {
    /// What went wrong, for people.
    public var description: String

    /// An error saying `description`.
    public init(_ description: String) {
        self.description = description
    }
}
