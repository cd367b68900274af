import Foundation

/// The order store's schema on PostgreSQL: the same tables, columns, keys and indexes as the
/// SQLite schema after all its migrations, in PostgreSQL's types.
///
/// Text columns sort byte-wise (`COLLATE "C"`), as SQLite's do; dates are text in the store's
/// one format; booleans are 0 and 1; `rowid` columns keep insertion order where the store reads it.
enum PostgresSchema {
    /// Frozen history: add migrations, never edit one that shipped.
    static let migrations: [(version: Int, name: String, sql: String)] = [
        (1, "the ledger as of SQLite schema v6", version1),
        (2, "rate-limit buckets (SQLite schema v7)", version2),
        (3, "a purchase's period end (SQLite schema v8)", version3),
        (4, "prorated refunds (SQLite schema v9)", version4),
        (5, "what a named StoreKit 1 transaction stands for (SQLite schema v10)", version5),
        (6, "where a subscription owner's stretch of the chain begins (SQLite schema v11)", version6),
    ]

    /// A key only this store's migrations take (`pg_advisory_lock`), so that the first
    /// instance to start migrates and the others wait, then find nothing to do.
    static let migrationLock: Int64 = 0x1A9_5702_E001

    /// Applies the migrations not yet applied, one transaction each, under the advisory lock.
    static func migrate(_ session: PostgresSession) throws {
        try session.execute(sql: "SELECT pg_advisory_lock(\(migrationLock))")
        defer { _ = try? session.execute(sql: "SELECT pg_advisory_unlock(\(migrationLock))") }
        try session.execute(
            sql: """
                CREATE TABLE IF NOT EXISTS iap_schema_migration (
                    version BIGINT PRIMARY KEY, name TEXT NOT NULL, appliedAt TEXT NOT NULL)
                """)
        let applied = Set(try Int.fetchAll(session, sql: "SELECT version FROM iap_schema_migration"))
        for migration in migrations where !applied.contains(migration.version) {
            session.beginTransaction()
            try session.execute(sql: "BEGIN")
            do {
                for statement in statements(migration.sql) { try session.execute(sql: statement) }
                try session.execute(
                    sql: "INSERT INTO iap_schema_migration (version, name, appliedAt) VALUES (?, ?, ?)",
                    arguments: [migration.version, migration.name, Date()])
                try session.execute(sql: "COMMIT")
            } catch {
                _ = try? session.execute(sql: "ROLLBACK")
                throw error
            }
            session.endTransaction()
        }
    }

    /// The statements of a script, split at `;` outside quotes, `$$` bodies and `--` comments.
    static func statements(_ script: String) -> [String] {
        var statements: [String] = []
        var current = ""
        var inQuote = false
        var inBody = false
        var inComment = false
        var previous: Character = " "
        for character in script {
            if inComment {
                if character == "\n" { inComment = false }
                previous = character
                continue
            }
            if character == "-" && previous == "-" && !inQuote && !inBody {
                // A `--` comment runs to the end of its line: its quotes and semicolons are text.
                current.removeLast()
                inComment = true
                previous = " "
                continue
            }
            if character == "'" && !inBody { inQuote.toggle() }
            if character == "$" && previous == "$" && !inQuote { inBody.toggle() }
            if character == ";" && !inQuote && !inBody {
                let statement = current.trimmingCharacters(in: .whitespacesAndNewlines)
                if !statement.isEmpty { statements.append(statement) }
                current = ""
            } else {
                current.append(character)
            }
            previous = character
        }
        let last = current.trimmingCharacters(in: .whitespacesAndNewlines)
        if !last.isEmpty { statements.append(last) }
        return statements
    }

    private static let version1 = """
        CREATE TABLE submission (
            id TEXT COLLATE "C" PRIMARY KEY NOT NULL,
            userId TEXT COLLATE "C" NOT NULL,
            orderId TEXT COLLATE "C",
            transactionId TEXT COLLATE "C",
            receiptData TEXT COLLATE "C" NOT NULL,
            state TEXT COLLATE "C" NOT NULL
                CHECK (state IN ('pending', 'retrying', 'credited', 'rejected', 'needs_review')),
            reason TEXT COLLATE "C",
            reasonMessage TEXT COLLATE "C",
            environment TEXT COLLATE "C" CHECK (environment IN ('Production', 'Sandbox')),
            attempts BIGINT NOT NULL DEFAULT 0,
            nextAttemptAt TEXT COLLATE "C",
            alertedAt TEXT COLLATE "C",
            finishable BIGINT NOT NULL DEFAULT 0,
            acceptedAt TEXT COLLATE "C" NOT NULL,
            updatedAt TEXT COLLATE "C" NOT NULL,
            signedTransaction TEXT COLLATE "C",
            signedPayload TEXT COLLATE "C"
        );
        CREATE INDEX submission_state ON submission(state, updatedAt);
        CREATE INDEX submission_user ON submission(userId);

        CREATE TABLE orders (
            id TEXT COLLATE "C" PRIMARY KEY NOT NULL,
            userId TEXT COLLATE "C" NOT NULL,
            productId TEXT COLLATE "C" NOT NULL,
            state TEXT COLLATE "C" NOT NULL CHECK (state IN ('created', 'paid', 'cancelled', 'refunded')),
            transactionId TEXT COLLATE "C" UNIQUE,
            createdAt TEXT COLLATE "C" NOT NULL,
            updatedAt TEXT COLLATE "C" NOT NULL
        );

        CREATE TABLE purchase (
            rowid BIGINT GENERATED BY DEFAULT AS IDENTITY UNIQUE,
            transactionId TEXT COLLATE "C" PRIMARY KEY NOT NULL,
            originalTransactionId TEXT COLLATE "C" NOT NULL,
            productId TEXT COLLATE "C" NOT NULL,
            quantity BIGINT NOT NULL CHECK (quantity > 0),
            environment TEXT COLLATE "C" NOT NULL CHECK (environment IN ('Production', 'Sandbox')),
            bundleId TEXT COLLATE "C" NOT NULL,
            purchaseDate TEXT COLLATE "C",
            userId TEXT COLLATE "C" NOT NULL,
            orderId TEXT COLLATE "C",
            submissionId TEXT COLLATE "C" NOT NULL REFERENCES submission(id),
            appAccountToken TEXT COLLATE "C",
            heldReason TEXT COLLATE "C",
            creditedAt TEXT COLLATE "C" NOT NULL,
            creditKey TEXT COLLATE "C",
            webOrderLineItemId TEXT COLLATE "C"
        );
        CREATE INDEX purchase_user ON purchase(userId);
        CREATE INDEX purchase_original ON purchase(originalTransactionId);
        CREATE INDEX purchase_key ON purchase(creditKey);
        CREATE INDEX purchase_web_order ON purchase(webOrderLineItemId);

        CREATE TABLE grants (
            id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            transactionId TEXT COLLATE "C" NOT NULL UNIQUE,
            userId TEXT COLLATE "C" NOT NULL,
            productId TEXT COLLATE "C" NOT NULL,
            orderId TEXT COLLATE "C",
            quantity BIGINT NOT NULL CHECK (quantity > 0),
            grantJSON TEXT COLLATE "C" NOT NULL,
            environment TEXT COLLATE "C" NOT NULL,
            source TEXT COLLATE "C" NOT NULL CHECK (source IN ('apple', 'manual')),
            state TEXT COLLATE "C" NOT NULL CHECK (state IN ('active', 'revoked')),
            grantedAt TEXT COLLATE "C" NOT NULL,
            revokedAt TEXT COLLATE "C",
            creditKey TEXT COLLATE "C",
            revokedBy TEXT COLLATE "C",
            originalTransactionId TEXT COLLATE "C",
            expiresAt TEXT COLLATE "C",
            gracePeriodExpiresAt TEXT COLLATE "C"
        );
        CREATE INDEX grants_user ON grants(userId);
        CREATE UNIQUE INDEX grants_active_key ON grants(creditKey) WHERE state = 'active';
        CREATE UNIQUE INDEX grants_key_user ON grants(creditKey, userId);
        CREATE INDEX grants_original ON grants(originalTransactionId);

        CREATE TABLE submission_transaction (
            rowid BIGINT GENERATED BY DEFAULT AS IDENTITY UNIQUE,
            submissionId TEXT COLLATE "C" NOT NULL REFERENCES submission(id),
            transactionId TEXT COLLATE "C" NOT NULL,
            originalTransactionId TEXT COLLATE "C" NOT NULL,
            productId TEXT COLLATE "C" NOT NULL,
            environment TEXT COLLATE "C" NOT NULL,
            state TEXT COLLATE "C" NOT NULL CHECK (
                state IN ('credited', 'already_credited', 'replayed_from_other_user', 'cancelled', 'held',
                    'revoked', 'owned_by_other_user', 'superseded')),
            reason TEXT COLLATE "C",
            creditKey TEXT COLLATE "C",
            PRIMARY KEY (submissionId, transactionId)
        );
        CREATE INDEX submission_transaction_transaction ON submission_transaction(transactionId);

        CREATE TABLE audit_log (
            id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            at TEXT COLLATE "C" NOT NULL,
            actor TEXT COLLATE "C" NOT NULL,
            action TEXT COLLATE "C" NOT NULL,
            subject TEXT COLLATE "C" NOT NULL,
            reason TEXT COLLATE "C" NOT NULL,
            details TEXT COLLATE "C"
        );
        CREATE INDEX audit_log_subject ON audit_log(subject);
        CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'the audit log is append-only'; END;
        $$;
        CREATE TRIGGER audit_log_no_change BEFORE UPDATE OR DELETE ON audit_log
            FOR EACH ROW EXECUTE FUNCTION audit_log_append_only();
        CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
            FOR EACH STATEMENT EXECUTE FUNCTION audit_log_append_only();

        -- A field of a JSON text, NULL when the text is not JSON (as json_valid and json_extract on SQLite).
        CREATE FUNCTION iap_json_field(document TEXT, field TEXT) RETURNS TEXT LANGUAGE plpgsql IMMUTABLE AS $$
            BEGIN RETURN document::jsonb ->> field; EXCEPTION WHEN others THEN RETURN NULL; END;
        $$;

        CREATE TABLE outbox (
            id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
            exchange TEXT COLLATE "C" NOT NULL,
            routingKey TEXT COLLATE "C" NOT NULL,
            body BYTEA NOT NULL,
            messageId TEXT COLLATE "C",
            priority BIGINT,
            mandatory BIGINT NOT NULL DEFAULT 1,
            createdAt TEXT COLLATE "C" NOT NULL,
            attempts BIGINT NOT NULL DEFAULT 0,
            lastError TEXT COLLATE "C",
            claimedBy TEXT COLLATE "C",
            claimedUntil TEXT COLLATE "C"
        );
        CREATE INDEX outbox_message ON outbox(messageId);
        CREATE INDEX outbox_kind ON outbox(mandatory, id);

        CREATE TABLE notification (
            rowid BIGINT GENERATED BY DEFAULT AS IDENTITY UNIQUE,
            notificationUUID TEXT COLLATE "C" PRIMARY KEY NOT NULL,
            notificationType TEXT COLLATE "C" NOT NULL,
            subtype TEXT COLLATE "C",
            environment TEXT COLLATE "C" NOT NULL,
            transactionId TEXT COLLATE "C",
            submissionId TEXT COLLATE "C" NOT NULL,
            outcome TEXT COLLATE "C" NOT NULL,
            signedDate TEXT COLLATE "C",
            appliedAt TEXT COLLATE "C" NOT NULL
        );
        CREATE INDEX notification_transaction ON notification(transactionId);

        CREATE TABLE subscription (
            originalTransactionId TEXT COLLATE "C" PRIMARY KEY NOT NULL,
            userId TEXT COLLATE "C",
            productId TEXT COLLATE "C" NOT NULL,
            environment TEXT COLLATE "C" NOT NULL,
            state TEXT COLLATE "C" NOT NULL
                CHECK (state IN ('active', 'expired', 'billing_retry', 'grace_period', 'revoked')),
            expiresDate TEXT COLLATE "C",
            autoRenew BIGINT,
            gracePeriodExpiresDate TEXT COLLATE "C",
            lastTransactionId TEXT COLLATE "C" NOT NULL,
            updatedAt TEXT COLLATE "C" NOT NULL,
            stateDate TEXT COLLATE "C"
        );
        CREATE INDEX subscription_user ON subscription(userId);
        CREATE INDEX subscription_due ON subscription(state, expiresDate);

        CREATE TABLE consumption_request (
            notificationUUID TEXT COLLATE "C" PRIMARY KEY NOT NULL,
            transactionId TEXT COLLATE "C" NOT NULL,
            userId TEXT COLLATE "C",
            reason TEXT COLLATE "C",
            environment TEXT COLLATE "C" NOT NULL,
            receivedAt TEXT COLLATE "C" NOT NULL
        );

        CREATE TABLE revocation (
            creditKey TEXT COLLATE "C" PRIMARY KEY NOT NULL,
            transactionId TEXT COLLATE "C" NOT NULL,
            source TEXT COLLATE "C" NOT NULL,
            revokedAt TEXT COLLATE "C" NOT NULL,
            reversedAt TEXT COLLATE "C",
            updatedAt TEXT COLLATE "C" NOT NULL
        );

        CREATE TABLE reconciliation_run (
            task TEXT COLLATE "C" PRIMARY KEY NOT NULL,
            lastRunAt TEXT COLLATE "C" NOT NULL
        );

        CREATE TABLE redelivered_notification (
            notificationUUID TEXT COLLATE "C" PRIMARY KEY NOT NULL,
            submissionId TEXT COLLATE "C" NOT NULL,
            redeliveredAt TEXT COLLATE "C" NOT NULL
        );
        """

    /// Token buckets counted by every order service together. UNLOGGED: a bucket is worth a
    /// few seconds of traffic, so it need not survive a crash and its updates write no WAL.
    static let version2 = """
        CREATE UNLOGGED TABLE rate_bucket (
            key TEXT COLLATE "C" PRIMARY KEY NOT NULL,
            tokens DOUBLE PRECISION NOT NULL,
            allowed BIGINT NOT NULL,
            updated DOUBLE PRECISION NOT NULL
        );
        CREATE INDEX rate_bucket_updated ON rate_bucket(updated);
        """

    /// When a subscription period ends, as Apple said when it was recorded.
    static let version3 = """
        ALTER TABLE purchase ADD COLUMN expiresDate TEXT COLLATE "C";
        """

    /// Apple's latest full refund or revocation, and its latest prorated refund of a consumable
    /// with the units it took back; revokedAt stays the latest of either.
    static let version4 = """
        ALTER TABLE revocation ADD COLUMN fullyRevokedAt TEXT COLLATE "C";
        ALTER TABLE revocation ADD COLUMN partlyRevokedAt TEXT COLLATE "C";
        ALTER TABLE revocation ADD COLUMN revokedUnits BIGINT;
        UPDATE revocation SET fullyRevokedAt = revokedAt;
        """

    /// The original transaction and product the app said the named transaction stands for (a
    /// StoreKit 1 restore, whose id the receipt may not hold).
    static let version5 = """
        ALTER TABLE submission ADD COLUMN originalTransactionId TEXT COLLATE "C";
        ALTER TABLE submission ADD COLUMN productId TEXT COLLATE "C";
        """

    /// Where a subscription owner's stretch of the chain begins: the purchase date of the new
    /// purchase that began it; NULL for the first stretch.
    static let version6 = """
        ALTER TABLE subscription ADD COLUMN ownedSince TEXT COLLATE "C";
        """
}
