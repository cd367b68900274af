#if canImport(Security)
    import Foundation
    import Security

    /// The queue in the Keychain (Apple platforms): one generic-password item per user, its
    /// entries as JSON, readable after the first unlock and kept on this device only. Keychain
    /// items outlive the app on iOS, so a purchase queued before an uninstall is still there
    /// when the app comes back. Each change replaces the user's item whole, as the Keychain
    /// writes it: never half written.
    ///
    /// - Important: `IAPClient` serializes its calls; two clients (or an app and its extension)
    ///   on one service name need an access group and must not write at the same moment.
    public struct KeychainTransactionStore: TransactionStore {
        /// The items' service name.
        public let service: String
        /// The Keychain access group shared with extensions, if any.
        public let accessGroup: String?

        /// A store under `service` (in `accessGroup`, when given).
        public init(service: String = "iap-pipeline.queue", accessGroup: String? = nil) {
            self.service = service
            self.accessGroup = accessGroup
        }

        public func entries() throws -> [QueueEntry] {
            // The users first (attributes only), then each user's data: asking for the data of
            // every item at once is refused by some keychains.
            var query = baseQuery()
            query[kSecMatchLimit as String] = kSecMatchLimitAll
            query[kSecReturnAttributes as String] = true
            var result: CFTypeRef?
            let status = SecItemCopyMatching(query as CFDictionary, &result)
            if status == errSecItemNotFound { return [] }
            guard status == errSecSuccess else { throw Self.failure(status, "list the queue") }
            let accounts = (result as? [[String: Any]] ?? []).compactMap { $0[kSecAttrAccount as String] as? String }
            return try accounts.sorted().flatMap { try read(userId: $0) }
        }

        public func put(_ entry: QueueEntry) throws {
            var entries = try read(userId: entry.userId).filter { $0.transactionId != entry.transactionId }
            entries.append(entry)
            try write(entries, userId: entry.userId)
        }

        public func remove(userId: String, transactionId: String) throws {
            let entries = try read(userId: userId)
            let kept = entries.filter { $0.transactionId != transactionId }
            guard kept.count != entries.count else { return }
            if kept.isEmpty {
                let status = SecItemDelete(itemQuery(userId) as CFDictionary)
                guard status == errSecSuccess || status == errSecItemNotFound else { throw Self.failure(status, "remove") }
            } else {
                try write(kept, userId: userId)
            }
        }

        private func read(userId: String) throws -> [QueueEntry] {
            var query = itemQuery(userId)
            query[kSecMatchLimit as String] = kSecMatchLimitOne
            query[kSecReturnData as String] = true
            var result: CFTypeRef?
            let status = SecItemCopyMatching(query as CFDictionary, &result)
            if status == errSecItemNotFound { return [] }
            guard status == errSecSuccess, let data = result as? Data else { throw Self.failure(status, "read") }
            do {
                return try FileTransactionStore.decoder.decode([QueueEntry].self, from: data)
            } catch {
                throw TransactionStoreError("the queue item of \(userId) does not decode (\(error)); it is kept as it is")
            }
        }

        private func write(_ entries: [QueueEntry], userId: String) throws {
            let data = try FileTransactionStore.encoder.encode(entries)
            let update = SecItemUpdate(itemQuery(userId) as CFDictionary, [kSecValueData as String: data] as CFDictionary)
            if update == errSecSuccess { return }
            guard update == errSecItemNotFound else { throw Self.failure(update, "update") }
            var item = itemQuery(userId)
            item[kSecValueData as String] = data
            item[kSecAttrAccessible as String] = kSecAttrAccessibleAfterFirstUnlockThisDeviceOnly
            let add = SecItemAdd(item as CFDictionary, nil)
            guard add == errSecSuccess else { throw Self.failure(add, "add") }
        }

        private func baseQuery() -> [String: Any] {
            var query: [String: Any] = [kSecClass as String: kSecClassGenericPassword, kSecAttrService as String: service]
            if let accessGroup { query[kSecAttrAccessGroup as String] = accessGroup }
            return query
        }

        private func itemQuery(_ userId: String) -> [String: Any] {
            var query = baseQuery()
            query[kSecAttrAccount as String] = userId
            return query
        }

        private static func failure(_ status: OSStatus, _ what: String) -> TransactionStoreError {
            let text = SecCopyErrorMessageString(status, nil) as String? ?? "OSStatus \(status)"
            return TransactionStoreError("the Keychain could not \(what): \(text)")
        }
    }
#endif
