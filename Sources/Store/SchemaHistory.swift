import GRDB

/// One step of the order store's schema: its number, and its SQLite and PostgreSQL texts side
/// by side, so that a change is written once, in one place, for both backends.
package struct SchemaStep: Sendable {
    /// The step's number, the same on both backends (SQLite's migration `v<version>: <name>`).
    package let version: Int
    package let name: String
    /// What SQLite runs.
    package let sqlite: String
    /// What PostgreSQL runs; nil for steps 1 to 5, which PostgreSQL took together with step 6
    /// (its first migration created the schema as of SQLite's v6).
    package let postgres: String?
    /// The number PostgreSQL's `iap_schema_migration` records the step under: the frozen prefix
    /// kept the numbers PostgreSQL gave it (1 to 6 for steps 6 to 11); from step 12 on, `version`.
    package let postgresRecordedAs: Int

    package init(version: Int, name: String, sqlite: String, postgres: String?, postgresRecordedAs: Int? = nil) {
        self.version = version
        self.name = name
        self.sqlite = sqlite
        self.postgres = postgres
        self.postgresRecordedAs = postgresRecordedAs ?? version
    }
}

/// The order store's one schema history. Add steps at the end, each with both texts (a
/// PostgreSQL text in PostgreSQL's types: `COLLATE "C"` on text, as SQLite compares bytes);
/// never edit a step that shipped. `SchemaParityTests` compares the two live schemas after the
/// last step.
///
/// Steps 1 to 11 are the two histories as they shipped, frozen: SQLite numbered each step;
/// PostgreSQL created the schema of steps 1 to 6 in one migration and numbered its own from there.
package enum SchemaHistory {
    package static let steps: [SchemaStep] = [
        SchemaStep(
            version: 1, name: "submissions, purchases, grants, orders, outbox",
            sqlite: """
                CREATE TABLE submission (
                    id TEXT PRIMARY KEY NOT NULL,
                    userId TEXT NOT NULL,
                    orderId TEXT,
                    transactionId TEXT,
                    receiptData TEXT NOT NULL,
                    state TEXT NOT NULL
                        CHECK (state IN ('pending', 'retrying', 'credited', 'rejected', 'needs_review')),
                    reason TEXT,
                    reasonMessage TEXT,
                    environment TEXT CHECK (environment IN ('Production', 'Sandbox')),
                    attempts INTEGER NOT NULL DEFAULT 0,
                    nextAttemptAt DATETIME,
                    alertedAt DATETIME,
                    -- Set by customer service: the app may finish its transactions whatever the state.
                    finishable BOOLEAN NOT NULL DEFAULT 0,
                    acceptedAt DATETIME NOT NULL,
                    updatedAt DATETIME NOT NULL
                );
                CREATE INDEX submission_state ON submission(state, updatedAt);
                CREATE INDEX submission_user ON submission(userId);

                CREATE TABLE orders (
                    id TEXT PRIMARY KEY NOT NULL,
                    userId TEXT NOT NULL,
                    productId TEXT NOT NULL,
                    state TEXT NOT NULL CHECK (state IN ('created', 'paid', 'cancelled', 'refunded')),
                    transactionId TEXT UNIQUE,
                    createdAt DATETIME NOT NULL,
                    updatedAt DATETIME NOT NULL
                );

                -- One row per Apple transaction, ever: the primary key is what makes
                -- double crediting impossible.
                CREATE TABLE purchase (
                    transactionId TEXT PRIMARY KEY NOT NULL,
                    originalTransactionId TEXT NOT NULL,
                    productId TEXT NOT NULL,
                    quantity INTEGER NOT NULL CHECK (quantity > 0),
                    environment TEXT NOT NULL CHECK (environment IN ('Production', 'Sandbox')),
                    bundleId TEXT NOT NULL,
                    purchaseDate DATETIME,
                    userId TEXT NOT NULL,
                    orderId TEXT,
                    submissionId TEXT NOT NULL REFERENCES submission(id),
                    appAccountToken TEXT,
                    -- Why it is not granted yet (unknown_product, product_mismatch, …); NULL when granted.
                    heldReason TEXT,
                    creditedAt DATETIME NOT NULL
                );
                CREATE INDEX purchase_user ON purchase(userId);

                -- One grant per Apple transaction, ever (manual grants have their own ids).
                CREATE TABLE grants (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    transactionId TEXT NOT NULL UNIQUE,
                    userId TEXT NOT NULL,
                    productId TEXT NOT NULL,
                    orderId TEXT,
                    quantity INTEGER NOT NULL CHECK (quantity > 0),
                    grantJSON TEXT NOT NULL,
                    environment TEXT NOT NULL,
                    source TEXT NOT NULL CHECK (source IN ('apple', 'manual')),
                    state TEXT NOT NULL CHECK (state IN ('active', 'revoked')),
                    grantedAt DATETIME NOT NULL,
                    revokedAt DATETIME
                );
                CREATE INDEX grants_user ON grants(userId);

                -- What each upload did with each transaction it carried.
                CREATE TABLE submission_transaction (
                    submissionId TEXT NOT NULL REFERENCES submission(id),
                    transactionId TEXT NOT NULL,
                    originalTransactionId TEXT NOT NULL,
                    productId TEXT NOT NULL,
                    environment TEXT NOT NULL,
                    state TEXT NOT NULL CHECK (
                        state IN ('credited', 'already_credited', 'replayed_from_other_user', 'cancelled', 'held')),
                    reason TEXT,
                    PRIMARY KEY (submissionId, transactionId)
                );

                -- Who did what, when and why: customer service actions and replay attempts.
                -- Append-only: the triggers refuse changes.
                CREATE TABLE audit_log (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    at DATETIME NOT NULL,
                    actor TEXT NOT NULL,
                    action TEXT NOT NULL,
                    subject TEXT NOT NULL,
                    reason TEXT NOT NULL,
                    details TEXT
                );
                CREATE TRIGGER audit_log_no_update BEFORE UPDATE ON audit_log
                    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
                CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log
                    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
                CREATE TRIGGER audit_log_no_replace BEFORE INSERT ON audit_log
                    WHEN NEW.id IS NOT NULL AND EXISTS (SELECT 1 FROM audit_log WHERE id = NEW.id)
                    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;

                -- Messages committed with the change that caused them, published by the relay.
                CREATE TABLE outbox (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    exchange TEXT NOT NULL,
                    routingKey TEXT NOT NULL,
                    body BLOB NOT NULL,
                    messageId TEXT,
                    priority INTEGER,
                    mandatory BOOLEAN NOT NULL DEFAULT 1,
                    createdAt DATETIME NOT NULL,
                    attempts INTEGER NOT NULL DEFAULT 0,
                    lastError TEXT
                );
                """,
            postgres: nil),
        SchemaStep(
            version: 2, name: "StoreKit 2 uploads, notifications, subscriptions",
            sqlite: """
                -- A StoreKit 2 upload keeps its signed transaction; a notification its signed payload.
                ALTER TABLE submission ADD COLUMN signedTransaction TEXT;
                ALTER TABLE submission ADD COLUMN signedPayload TEXT;

                -- Every App Store Server Notification applied, once per notificationUUID.
                CREATE TABLE notification (
                    notificationUUID TEXT PRIMARY KEY NOT NULL,
                    notificationType TEXT NOT NULL,
                    subtype TEXT,
                    environment TEXT NOT NULL,
                    transactionId TEXT,
                    submissionId TEXT NOT NULL,
                    outcome TEXT NOT NULL,
                    signedDate DATETIME,
                    appliedAt DATETIME NOT NULL
                );
                CREATE INDEX notification_transaction ON notification(transactionId);

                -- The state of each auto-renewable subscription, as Apple's notifications say.
                CREATE TABLE subscription (
                    originalTransactionId TEXT PRIMARY KEY NOT NULL,
                    userId TEXT,
                    productId TEXT NOT NULL,
                    environment TEXT NOT NULL,
                    state TEXT NOT NULL
                        CHECK (state IN ('active', 'expired', 'billing_retry', 'grace_period', 'revoked')),
                    expiresDate DATETIME,
                    autoRenew BOOLEAN,
                    gracePeriodExpiresDate DATETIME,
                    lastTransactionId TEXT NOT NULL,
                    updatedAt DATETIME NOT NULL
                );
                CREATE INDEX subscription_user ON subscription(userId);

                -- Apple asked for consumption information about a refund request.
                CREATE TABLE consumption_request (
                    notificationUUID TEXT PRIMARY KEY NOT NULL,
                    transactionId TEXT NOT NULL,
                    userId TEXT,
                    reason TEXT,
                    environment TEXT NOT NULL,
                    receivedAt DATETIME NOT NULL
                );
                """,
            postgres: nil),
        SchemaStep(
            version: 3, name: "credit keys, remembered revocations, subscription order, indexes",
            sqlite: """
                -- What a purchase is credited once by (txn:<transactionId> for consumables,
                -- otx:<originalTransactionId> for non-consumables and non-renewing subscriptions,
                -- wol:<webOrderLineItemId> for a billing period of an auto-renewable one).
                ALTER TABLE grants ADD COLUMN creditKey TEXT;
                UPDATE grants SET creditKey = 'txn:' || transactionId;
                -- Who revoked a revoked grant: apple (a refund or revocation), transfer, or an admin.
                ALTER TABLE grants ADD COLUMN revokedBy TEXT;
                -- Customer service's revocations name a person in the audit log; the rest were Apple's.
                UPDATE grants SET revokedBy = CASE
                    WHEN (SELECT actor FROM audit_log WHERE subject = 'transaction:' || grants.transactionId
                        AND action = 'grant_revoked' ORDER BY id DESC LIMIT 1) IN ('apple', 'system')
                    THEN 'apple' ELSE 'admin' END
                WHERE state = 'revoked';
                -- At most one active grant per credit key, and one grant per key and user, ever.
                CREATE UNIQUE INDEX grants_active_key ON grants(creditKey) WHERE state = 'active';
                CREATE UNIQUE INDEX grants_key_user ON grants(creditKey, userId);

                ALTER TABLE purchase ADD COLUMN creditKey TEXT;
                UPDATE purchase SET creditKey = 'txn:' || transactionId;
                ALTER TABLE purchase ADD COLUMN webOrderLineItemId TEXT;
                CREATE INDEX purchase_original ON purchase(originalTransactionId);
                CREATE INDEX purchase_key ON purchase(creditKey);
                CREATE INDEX purchase_web_order ON purchase(webOrderLineItemId);

                -- What Apple took back, by credit key, whether or not anything was credited yet;
                -- a reversal lifts it (reversedAt later than revokedAt).
                CREATE TABLE revocation (
                    creditKey TEXT PRIMARY KEY NOT NULL,
                    transactionId TEXT NOT NULL,
                    source TEXT NOT NULL,
                    revokedAt DATETIME NOT NULL,
                    reversedAt DATETIME,
                    updatedAt DATETIME NOT NULL
                );

                -- Subscription states are applied newest first by Apple's signedDate.
                ALTER TABLE subscription ADD COLUMN stateDate DATETIME;

                CREATE INDEX outbox_message ON outbox(messageId);

                -- New transaction states: rebuilt, as SQLite cannot change a CHECK in place.
                CREATE TABLE submission_transaction_v3 (
                    submissionId TEXT NOT NULL REFERENCES submission(id),
                    transactionId TEXT NOT NULL,
                    originalTransactionId TEXT NOT NULL,
                    productId TEXT NOT NULL,
                    environment TEXT NOT NULL,
                    state TEXT NOT NULL CHECK (
                        state IN ('credited', 'already_credited', 'replayed_from_other_user', 'cancelled', 'held',
                            'revoked', 'owned_by_other_user', 'superseded')),
                    reason TEXT,
                    PRIMARY KEY (submissionId, transactionId)
                );
                INSERT INTO submission_transaction_v3 SELECT submissionId, transactionId, originalTransactionId,
                    productId, environment, state, reason FROM submission_transaction ORDER BY rowid;
                DROP TABLE submission_transaction;
                ALTER TABLE submission_transaction_v3 RENAME TO submission_transaction;
                CREATE INDEX submission_transaction_transaction ON submission_transaction(transactionId);
                """,
            postgres: nil),
        SchemaStep(
            version: 4, name: "reconciliation runs, re-delivered notifications, due subscriptions",
            sqlite: """
                -- When each reconciliation task (subscriptions, notifications) last ran to its end:
                -- the next run is due an interval later and asks Apple's history from there.
                CREATE TABLE reconciliation_run (
                    task TEXT PRIMARY KEY NOT NULL,
                    lastRunAt DATETIME NOT NULL
                );

                -- Notifications from Apple's history (onlyFailures) queued again, once each.
                CREATE TABLE redelivered_notification (
                    notificationUUID TEXT PRIMARY KEY NOT NULL,
                    submissionId TEXT NOT NULL,
                    redeliveredAt DATETIME NOT NULL
                );

                -- The reconciliation reads subscriptions by state and expiry.
                CREATE INDEX subscription_due ON subscription(state, expiresDate);
                """,
            postgres: nil),
        SchemaStep(
            version: 5, name: "grant expiry and chain",
            sqlite: """
                -- A subscription period's grant ends with the period (and its grace period).
                ALTER TABLE grants ADD COLUMN originalTransactionId TEXT;
                UPDATE grants SET originalTransactionId =
                    (SELECT originalTransactionId FROM purchase WHERE purchase.transactionId = grants.transactionId);
                ALTER TABLE grants ADD COLUMN expiresAt DATETIME;
                ALTER TABLE grants ADD COLUMN gracePeriodExpiresAt DATETIME;
                CREATE INDEX grants_original ON grants(originalTransactionId);

                -- The status an app polls follows what happened to each transaction later.
                ALTER TABLE submission_transaction ADD COLUMN creditKey TEXT;
                CREATE INDEX audit_log_subject ON audit_log(subject);
                """,
            postgres: nil),
        SchemaStep(
            version: 6, name: "outbox claims",
            sqlite: """
                -- Which relay is publishing a row, until when (several order services share
                -- one PostgreSQL store; the columns are the same on both backends).
                ALTER TABLE outbox ADD COLUMN claimedBy TEXT;
                ALTER TABLE outbox ADD COLUMN claimedUntil DATETIME;
                CREATE INDEX outbox_kind ON outbox(mandatory, id);
                """,
            postgres: """
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
                """, postgresRecordedAs: 1),
        SchemaStep(
            version: 7, name: "rate-limit buckets",
            sqlite: """
                -- Token buckets that several order services count together (PostgreSQL);
                -- the same table here keeps one set of operations on both backends.
                CREATE TABLE rate_bucket (
                    key TEXT PRIMARY KEY NOT NULL,
                    tokens REAL NOT NULL,
                    allowed INTEGER NOT NULL,
                    updated REAL NOT NULL
                );
                CREATE INDEX rate_bucket_updated ON rate_bucket(updated);
                """,
            // Token buckets counted by every order service together. UNLOGGED: a bucket is worth a
            // few seconds of traffic, so it need not survive a crash and its updates write no WAL.
            postgres: """
                CREATE UNLOGGED TABLE rate_bucket (
                    key TEXT COLLATE "C" PRIMARY KEY NOT NULL,
                    tokens DOUBLE PRECISION NOT NULL,
                    allowed BIGINT NOT NULL,
                    updated DOUBLE PRECISION NOT NULL
                );
                CREATE INDEX rate_bucket_updated ON rate_bucket(updated);
                """, postgresRecordedAs: 2),
        SchemaStep(
            version: 8, name: "a purchase's period end",
            sqlite: """
                -- When a subscription period ends, as Apple said when it was recorded: a held
                -- period that customer service grants later ends with it.
                ALTER TABLE purchase ADD COLUMN expiresDate DATETIME;
                """,
            // When a subscription period ends, as Apple said when it was recorded.
            postgres: """
                ALTER TABLE purchase ADD COLUMN expiresDate TEXT COLLATE "C";
                """, postgresRecordedAs: 3),
        SchemaStep(
            version: 9, name: "prorated refunds",
            sqlite: """
                -- Apple's latest full refund or revocation, and its latest prorated refund of a
                -- consumable with the units it took back; revokedAt stays the latest of either.
                ALTER TABLE revocation ADD COLUMN fullyRevokedAt DATETIME;
                ALTER TABLE revocation ADD COLUMN partlyRevokedAt DATETIME;
                ALTER TABLE revocation ADD COLUMN revokedUnits INTEGER;
                UPDATE revocation SET fullyRevokedAt = revokedAt;
                """,
            // Apple's latest full refund or revocation, and its latest prorated refund of a consumable
            // with the units it took back; revokedAt stays the latest of either.
            postgres: """
                ALTER TABLE revocation ADD COLUMN fullyRevokedAt TEXT COLLATE "C";
                ALTER TABLE revocation ADD COLUMN partlyRevokedAt TEXT COLLATE "C";
                ALTER TABLE revocation ADD COLUMN revokedUnits BIGINT;
                UPDATE revocation SET fullyRevokedAt = revokedAt;
                """, postgresRecordedAs: 4),
        SchemaStep(
            version: 10, name: "what a named StoreKit 1 transaction stands for",
            sqlite: """
                -- The original transaction and product the app said the named transaction
                -- stands for (a StoreKit 1 restore, whose id the receipt may not hold).
                ALTER TABLE submission ADD COLUMN originalTransactionId TEXT;
                ALTER TABLE submission ADD COLUMN productId TEXT;
                """,
            // The original transaction and product the app said the named transaction stands for (a
            // StoreKit 1 restore, whose id the receipt may not hold).
            postgres: """
                ALTER TABLE submission ADD COLUMN originalTransactionId TEXT COLLATE "C";
                ALTER TABLE submission ADD COLUMN productId TEXT COLLATE "C";
                """, postgresRecordedAs: 5),
        SchemaStep(
            version: 11, name: "where a subscription owner's stretch of the chain begins",
            sqlite: """
                -- The purchase date of the new purchase (a resubscription, an upgrade) that
                -- began the owner's stretch of the chain; NULL: the first stretch.
                ALTER TABLE subscription ADD COLUMN ownedSince DATETIME;
                """,
            // Where a subscription owner's stretch of the chain begins: the purchase date of the new
            // purchase that began it; NULL for the first stretch.
            postgres: """
                ALTER TABLE subscription ADD COLUMN ownedSince TEXT COLLATE "C";
                """, postgresRecordedAs: 6),
        SchemaStep(
            version: 12, name: "a unit's reads in one round trip, its writes in another",
            // SQLite runs in the process: a batch is its statements one after the other.
            sqlite: """
                -- Nothing to create: SQLite runs a batch one statement at a time, in a savepoint.
                """,
            // Each statement comes with `%L` where its values go, and its values as text (JSON
            // null for NULL): `format` quotes each as a literal, which the column's type reads as
            // it would read a bound value.
            // `iap_write` (`SQLConnection.executeBatch`, `executeLater`) runs a batch of writes
            // in one call, all or nothing: a statement that fails, or that must change a row
            // (`required`) and changes none, undoes the batch (the block's own subtransaction)
            // and the answer says which and why (`failed <statement> <SQLSTATE> <message>`),
            // leaving the caller's transaction usable: a unit whose one write is its last needs
            // no savepoint. Otherwise it answers each statement's count of changed rows.
            // `iap_read` (`SQLConnection.readBatch`) runs queries the same way and answers every
            // one's rows as one JSON array of arrays (`json_agg` of each, in the query's order).
            postgres: """
                CREATE FUNCTION iap_write(statements TEXT[], arguments JSONB, required BOOLEAN[]) RETURNS TEXT
                LANGUAGE plpgsql AS $$
                DECLARE
                    counts BIGINT[] := '{}';
                    changed BIGINT;
                    bound TEXT[];
                    current INT := 0;
                BEGIN
                    BEGIN
                        FOR i IN 1 .. coalesce(array_length(statements, 1), 0) LOOP
                            current := i;
                            bound := ARRAY(
                                SELECT value FROM jsonb_array_elements_text(arguments -> (i - 1)) WITH ORDINALITY AS a(value, n)
                                ORDER BY n);
                            EXECUTE format(statements[i], VARIADIC bound);
                            GET DIAGNOSTICS changed = ROW_COUNT;
                            IF changed = 0 AND required[i] THEN
                                RAISE EXCEPTION 'statement % changed no row', i USING ERRCODE = 'IAP00';
                            END IF;
                            counts := counts || changed;
                        END LOOP;
                    EXCEPTION WHEN OTHERS THEN
                        RETURN 'failed ' || current || ' ' || SQLSTATE || ' ' || SQLERRM;
                    END;
                    RETURN counts::TEXT;
                END $$;
                CREATE FUNCTION iap_read(statements TEXT[], arguments JSONB) RETURNS TEXT
                LANGUAGE plpgsql AS $$
                DECLARE
                    answer TEXT := '[';
                    part TEXT;
                    bound TEXT[];
                BEGIN
                    FOR i IN 1 .. coalesce(array_length(statements, 1), 0) LOOP
                        bound := ARRAY(
                            SELECT value FROM jsonb_array_elements_text(arguments -> (i - 1)) WITH ORDINALITY AS a(value, n)
                            ORDER BY n);
                        EXECUTE 'SELECT coalesce(json_agg(r), ''[]'')::TEXT FROM (' || format(statements[i], VARIADIC bound)
                            || ') AS r' INTO part;
                        IF i > 1 THEN answer := answer || ','; END IF;
                        answer := answer || part;
                    END LOOP;
                    RETURN answer || ']';
                END $$;
                """),
        SchemaStep(
            version: 13, name: "a verify message refers to its submission",
            sqlite: """
                -- A verify request's message names its submission, whose row holds the receipt,
                -- and is built from it when published (its body stays empty): the receipt is
                -- stored once. Rows without it carry their whole body, as before.
                ALTER TABLE outbox ADD COLUMN submissionId TEXT;
                """,
            // A verify request's message names its submission and is built from it when published
            // (its body stays empty), so the receipt is stored once.
            postgres: """
                ALTER TABLE outbox ADD COLUMN submissionId TEXT COLLATE "C";
                """),
        SchemaStep(
            version: 14, name: "room on the outbox's pages for its claims",
            sqlite: """
                -- PostgreSQL only: SQLite has one relay, which claims nothing.
                """,
            // A relay claims each row (an UPDATE of claimedBy and claimedUntil, which no index
            // holds) before it publishes. With the pages packed full the new version goes to
            // another page and every index of the table gets an entry for it; with half of
            // each page kept free it stays on its page (a heap-only update) and no index is
            // written. The rows live for a moment: the space costs nothing.
            postgres: """
                ALTER TABLE outbox SET (fillfactor = 50);
                """),
        SchemaStep(
            version: 15, name: "a receipt kept as bytes in a row of its own",
            sqlite: """
                -- An uploaded receipt's bytes (not their base64), written once: the submission
                -- row, updated as its verification goes on, stays small. Receipts stored
                -- before stay in submission.receiptData, which readers fall back to.
                CREATE TABLE submission_receipt (
                    submissionId TEXT NOT NULL PRIMARY KEY REFERENCES submission(id),
                    receipt BLOB NOT NULL
                );
                """,
            // An uploaded receipt's bytes (not their base64), written once: the submission row,
            // updated as its verification goes on, stays small. Receipts stored before stay in
            // submission.receiptData, which readers fall back to. PostgreSQL compresses the
            // bytes in their row, as it does any row past 2 KB.
            postgres: """
                CREATE TABLE submission_receipt (
                    submissionId TEXT COLLATE "C" NOT NULL PRIMARY KEY REFERENCES submission(id),
                    receipt BYTEA NOT NULL
                );
                """),
        SchemaStep(
            version: 16, name: "transactions the server finishes at Apple",
            sqlite: """
                -- Each settled transaction the order service is to finish at Apple (Finish
                -- Transaction), queued in the commit that settled it and kept once; the worker
                -- that calls Apple claims rows for a while, and records what Apple answered.
                CREATE TABLE apple_finish (
                    transactionId TEXT PRIMARY KEY NOT NULL,
                    environment TEXT NOT NULL,
                    state TEXT NOT NULL CHECK (state IN ('queued', 'finished', 'refused')),
                    queuedAt DATETIME NOT NULL,
                    dueAt DATETIME NOT NULL,
                    attempts INTEGER NOT NULL DEFAULT 0,
                    lastError TEXT,
                    finishedAt DATETIME,
                    finishedBy TEXT,
                    claimedBy TEXT,
                    claimedUntil DATETIME
                );
                CREATE INDEX apple_finish_due ON apple_finish(state, dueAt);
                """,
            // Each settled transaction the order service is to finish at Apple (Finish
            // Transaction), queued in the commit that settled it and kept once; the worker that
            // calls Apple claims rows for a while, and records what Apple answered.
            postgres: """
                CREATE TABLE apple_finish (
                    transactionId TEXT COLLATE "C" PRIMARY KEY NOT NULL,
                    environment TEXT COLLATE "C" NOT NULL,
                    state TEXT COLLATE "C" NOT NULL CHECK (state IN ('queued', 'finished', 'refused')),
                    queuedAt TEXT COLLATE "C" NOT NULL,
                    dueAt TEXT COLLATE "C" NOT NULL,
                    attempts BIGINT NOT NULL DEFAULT 0,
                    lastError TEXT COLLATE "C",
                    finishedAt TEXT COLLATE "C",
                    finishedBy TEXT COLLATE "C",
                    claimedBy TEXT COLLATE "C",
                    claimedUntil TEXT COLLATE "C"
                );
                CREATE INDEX apple_finish_due ON apple_finish(state, dueAt);
                """),
        SchemaStep(
            version: 17, name: "refund requests answered with the ledger's facts",
            sqlite: """
                -- Each consumption request is answered once (Send Consumption Information v2)
                -- before its deadline: queued when recorded, then sent, skipped (no consent, an
                -- assigned transaction), refused by Apple or expired; the body sent is kept.
                ALTER TABLE consumption_request ADD COLUMN ownershipType TEXT;
                ALTER TABLE consumption_request ADD COLUMN deadline DATETIME;
                ALTER TABLE consumption_request ADD COLUMN answer TEXT
                    CHECK (answer IN ('queued', 'sent', 'skipped', 'refused', 'expired'));
                ALTER TABLE consumption_request ADD COLUMN answerReason TEXT;
                ALTER TABLE consumption_request ADD COLUMN answerJSON TEXT;
                ALTER TABLE consumption_request ADD COLUMN answeredAt DATETIME;
                ALTER TABLE consumption_request ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
                ALTER TABLE consumption_request ADD COLUMN dueAt DATETIME;
                ALTER TABLE consumption_request ADD COLUMN claimedBy TEXT;
                ALTER TABLE consumption_request ADD COLUMN claimedUntil DATETIME;
                CREATE INDEX consumption_request_due ON consumption_request(answer, dueAt);

                -- What the app reported of a purchase's use, and a user's consent to tell Apple.
                CREATE TABLE consumption_report (
                    transactionId TEXT PRIMARY KEY NOT NULL,
                    userId TEXT NOT NULL,
                    consumptionPercentage INTEGER NOT NULL,
                    reportedAt DATETIME NOT NULL
                );
                CREATE TABLE consumption_consent (
                    userId TEXT PRIMARY KEY NOT NULL,
                    consented INTEGER NOT NULL,
                    updatedAt DATETIME NOT NULL
                );
                """,
            // Each consumption request is answered once (Send Consumption Information v2) before
            // its deadline: queued when recorded, then sent, skipped (no consent, an assigned
            // transaction), refused by Apple or expired; the body sent is kept. What the app
            // reported of a purchase's use, and a user's consent to tell Apple.
            postgres: """
                ALTER TABLE consumption_request ADD COLUMN ownershipType TEXT COLLATE "C";
                ALTER TABLE consumption_request ADD COLUMN deadline TEXT COLLATE "C";
                ALTER TABLE consumption_request ADD COLUMN answer TEXT COLLATE "C"
                    CHECK (answer IN ('queued', 'sent', 'skipped', 'refused', 'expired'));
                ALTER TABLE consumption_request ADD COLUMN answerReason TEXT COLLATE "C";
                ALTER TABLE consumption_request ADD COLUMN answerJSON TEXT COLLATE "C";
                ALTER TABLE consumption_request ADD COLUMN answeredAt TEXT COLLATE "C";
                ALTER TABLE consumption_request ADD COLUMN attempts BIGINT NOT NULL DEFAULT 0;
                ALTER TABLE consumption_request ADD COLUMN dueAt TEXT COLLATE "C";
                ALTER TABLE consumption_request ADD COLUMN claimedBy TEXT COLLATE "C";
                ALTER TABLE consumption_request ADD COLUMN claimedUntil TEXT COLLATE "C";
                CREATE INDEX consumption_request_due ON consumption_request(answer, dueAt);

                CREATE TABLE consumption_report (
                    transactionId TEXT COLLATE "C" PRIMARY KEY NOT NULL,
                    userId TEXT COLLATE "C" NOT NULL,
                    consumptionPercentage BIGINT NOT NULL,
                    reportedAt TEXT COLLATE "C" NOT NULL
                );
                CREATE TABLE consumption_consent (
                    userId TEXT COLLATE "C" PRIMARY KEY NOT NULL,
                    consented BIGINT NOT NULL,
                    updatedAt TEXT COLLATE "C" NOT NULL
                );
                """),
        SchemaStep(
            version: 18, name: "how far each customer's history was read",
            sqlite: """
                -- Apple's revision of each customer's transaction history, by the transaction the
                -- reconciliation asks with: the next run asks only for what changed since.
                -- `customer` is Apple's appTransactionId, one per customer and app: a customer's
                -- history is read once a run, whichever of their transactions asks.
                CREATE TABLE history_revision (
                    anchor TEXT PRIMARY KEY NOT NULL,
                    environment TEXT NOT NULL,
                    revision TEXT NOT NULL,
                    customer TEXT,
                    readAt DATETIME NOT NULL
                );
                """,
            // Apple's revision of each customer's transaction history, by the transaction the
            // reconciliation asks with: the next run asks only for what changed since. `customer`
            // is Apple's appTransactionId, one per customer and app: a customer's history is read
            // once a run, whichever of their transactions asks.
            postgres: """
                CREATE TABLE history_revision (
                    anchor TEXT COLLATE "C" PRIMARY KEY NOT NULL,
                    environment TEXT COLLATE "C" NOT NULL,
                    revision TEXT COLLATE "C" NOT NULL,
                    customer TEXT COLLATE "C",
                    readAt TEXT COLLATE "C" NOT NULL
                );
                """),
        SchemaStep(
            version: 19, name: "what each credited purchase cost",
            sqlite: """
                -- What a credited transaction cost and under which offer, as Apple's signed
                -- transaction says (price in milli-units), and the customer's app download;
                -- written once with its credit, for the console and the app's revenue.
                CREATE TABLE purchase_terms (
                    transactionId TEXT PRIMARY KEY NOT NULL,
                    price INTEGER,
                    currency TEXT,
                    offerType INTEGER,
                    offerIdentifier TEXT,
                    offerDiscountType TEXT,
                    offerPeriod TEXT,
                    billingPlanType TEXT,
                    appTransactionId TEXT
                );
                CREATE INDEX purchase_terms_customer ON purchase_terms(appTransactionId);
                """,
            // What a credited transaction cost and under which offer, as Apple's signed transaction
            // says (price in milli-units), and the customer's app download; written once with its
            // credit, for the console and the app's revenue.
            postgres: """
                CREATE TABLE purchase_terms (
                    transactionId TEXT COLLATE "C" PRIMARY KEY NOT NULL,
                    price BIGINT,
                    currency TEXT COLLATE "C",
                    offerType BIGINT,
                    offerIdentifier TEXT COLLATE "C",
                    offerDiscountType TEXT COLLATE "C",
                    offerPeriod TEXT COLLATE "C",
                    billingPlanType TEXT COLLATE "C",
                    appTransactionId TEXT COLLATE "C"
                );
                CREATE INDEX purchase_terms_customer ON purchase_terms(appTransactionId);
                """),
        SchemaStep(
            version: 20, name: "the app downloads a user uploaded",
            sqlite: """
                -- The customer's download of the app (Apple's appTransactionId) an upload carried,
                -- verified, by user: who the user is at Apple, for customer service.
                CREATE TABLE user_app_transaction (
                    userId TEXT NOT NULL,
                    appTransactionId TEXT NOT NULL,
                    environment TEXT NOT NULL,
                    recordedAt DATETIME NOT NULL,
                    PRIMARY KEY (userId, appTransactionId)
                );
                """,
            // The customer's download of the app (Apple's appTransactionId) an upload carried,
            // verified, by user: who the user is at Apple, for customer service.
            postgres: """
                CREATE TABLE user_app_transaction (
                    userId TEXT COLLATE "C" NOT NULL,
                    appTransactionId TEXT COLLATE "C" NOT NULL,
                    environment TEXT COLLATE "C" NOT NULL,
                    recordedAt TEXT COLLATE "C" NOT NULL,
                    PRIMARY KEY (userId, appTransactionId)
                );
                """),
        SchemaStep(
            version: 21, name: "whose access a credit is",
            sqlite: """
                -- Apple's inAppOwnershipType of a credited transaction when it is no purchase of
                -- the customer's own (FAMILY_SHARED, ASSIGNED: a multiseat seat), for the console.
                ALTER TABLE purchase_terms ADD COLUMN ownershipType TEXT;
                """,
            // Apple's inAppOwnershipType of a credited transaction when it is no purchase of the
            // customer's own (FAMILY_SHARED, ASSIGNED: a multiseat seat), for the console.
            postgres: """
                ALTER TABLE purchase_terms ADD COLUMN ownershipType TEXT COLLATE "C";
                """),
        SchemaStep(
            version: 22, name: "what a user can make the store keep",
            sqlite: """
                -- What an upload named and carried, hashed: the same upload repeated by its owner
                -- shortly after one was credited is answered with that one, never stored again.
                ALTER TABLE submission ADD COLUMN uploadDigest TEXT;
                CREATE INDEX submission_upload ON submission(userId, uploadDigest);
                -- What a refund request's purchase is credited once by, and its product's type:
                -- whether it was delivered is read by its key, and Apple takes no share of an
                -- auto-renewable subscription.
                ALTER TABLE consumption_request ADD COLUMN creditKey TEXT;
                ALTER TABLE consumption_request ADD COLUMN productType TEXT;
                -- Audit entries about no money (consent reports, replays refused, purges, sign-outs)
                -- may be deleted once past the retention period; every other entry stays for ever.
                DROP TRIGGER audit_log_no_delete;
                CREATE TRIGGER audit_log_no_delete BEFORE DELETE ON audit_log
                    WHEN OLD.action NOT IN ('consumption_consent_given', 'consumption_consent_withdrawn', 'replay_refused',
                        'retention_purge', 'logout')
                    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
                """,
            // What an upload named and carried, hashed: the same upload repeated by its owner shortly
            // after one was credited is answered with that one, never stored again. A refund
            // request's credit key and product type. Audit entries about no money may be deleted
            // once past the retention period; every other entry stays.
            postgres: """
                ALTER TABLE submission ADD COLUMN uploadDigest TEXT COLLATE "C";
                CREATE INDEX submission_upload ON submission(userId, uploadDigest);
                ALTER TABLE consumption_request ADD COLUMN creditKey TEXT COLLATE "C";
                ALTER TABLE consumption_request ADD COLUMN productType TEXT COLLATE "C";
                CREATE OR REPLACE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
                    BEGIN
                        IF TG_OP = 'DELETE' AND OLD.action IN ('consumption_consent_given', 'consumption_consent_withdrawn',
                            'replay_refused', 'retention_purge', 'logout')
                        THEN
                            RETURN OLD;
                        END IF;
                        RAISE EXCEPTION 'the audit log is append-only';
                    END;
                $$;
                """),
        SchemaStep(
            version: 23, name: "which purchase can pay an order named alone",
            sqlite: """
                -- A user's open orders of a product: an upload naming an order alone pays it only
                -- when no other open order could be paid by the same purchase.
                CREATE INDEX orders_open ON orders(userId, productId) WHERE state = 'created';
                -- Apple's ownershipType of each purchase: access someone else paid for (a family
                -- member's sharing, an assigned seat) pays no order.
                ALTER TABLE purchase ADD COLUMN ownershipType TEXT;
                """,
            postgres: """
                CREATE INDEX orders_open ON orders(userId, productId) WHERE state = 'created';
                ALTER TABLE purchase ADD COLUMN ownershipType TEXT COLLATE "C";
                """),
        SchemaStep(
            version: 24, name: "what a subscription renews to",
            sqlite: """
                -- Apple's renewal information, as signed last: the next period's product, price and
                -- offer, and the customer's answer to a price increase (0 awaited, 1 consented).
                ALTER TABLE subscription ADD COLUMN renewalProductId TEXT;
                ALTER TABLE subscription ADD COLUMN renewalPrice INTEGER;
                ALTER TABLE subscription ADD COLUMN renewalCurrency TEXT;
                ALTER TABLE subscription ADD COLUMN renewalOfferType INTEGER;
                ALTER TABLE subscription ADD COLUMN renewalOfferIdentifier TEXT;
                ALTER TABLE subscription ADD COLUMN renewalOfferDiscountType TEXT;
                ALTER TABLE subscription ADD COLUMN renewalOfferPeriod TEXT;
                ALTER TABLE subscription ADD COLUMN priceIncreaseStatus INTEGER;
                """,
            postgres: """
                ALTER TABLE subscription ADD COLUMN renewalProductId TEXT COLLATE "C";
                ALTER TABLE subscription ADD COLUMN renewalPrice BIGINT;
                ALTER TABLE subscription ADD COLUMN renewalCurrency TEXT COLLATE "C";
                ALTER TABLE subscription ADD COLUMN renewalOfferType INTEGER;
                ALTER TABLE subscription ADD COLUMN renewalOfferIdentifier TEXT COLLATE "C";
                ALTER TABLE subscription ADD COLUMN renewalOfferDiscountType TEXT COLLATE "C";
                ALTER TABLE subscription ADD COLUMN renewalOfferPeriod TEXT COLLATE "C";
                ALTER TABLE subscription ADD COLUMN priceIncreaseStatus INTEGER;
                """),
        SchemaStep(
            version: 25, name: "commitment plans, and refunded new purchases in a chain",
            sqlite: """
                -- A new purchase in a subscription's chain (a resubscription, an upgrade) kept
                -- after a refund stopped it: it still tells whose stretch of the chain its
                -- renewals are.
                ALTER TABLE purchase ADD COLUMN beginsStretch BOOLEAN NOT NULL DEFAULT 0;
                -- Where a commitment plan stands at each transaction (Apple's commitmentInfo): this
                -- period's number of how many, the commitment's end and price.
                ALTER TABLE purchase_terms ADD COLUMN commitmentBillingPeriod INTEGER;
                ALTER TABLE purchase_terms ADD COLUMN commitmentTotalPeriods INTEGER;
                ALTER TABLE purchase_terms ADD COLUMN commitmentExpiresDate DATETIME;
                ALTER TABLE purchase_terms ADD COLUMN commitmentPrice INTEGER;
                -- How the next period is billed, and what the commitment renews to.
                ALTER TABLE subscription ADD COLUMN renewalBillingPlanType TEXT;
                ALTER TABLE subscription ADD COLUMN commitmentRenewalProductId TEXT;
                ALTER TABLE subscription ADD COLUMN commitmentAutoRenewStatus INTEGER;
                ALTER TABLE subscription ADD COLUMN commitmentRenewalBillingPlanType TEXT;
                ALTER TABLE subscription ADD COLUMN commitmentRenewalDate DATETIME;
                ALTER TABLE subscription ADD COLUMN commitmentRenewalPrice INTEGER;
                """,
            postgres: """
                ALTER TABLE purchase ADD COLUMN beginsStretch BIGINT NOT NULL DEFAULT 0;
                ALTER TABLE purchase_terms ADD COLUMN commitmentBillingPeriod INTEGER;
                ALTER TABLE purchase_terms ADD COLUMN commitmentTotalPeriods INTEGER;
                ALTER TABLE purchase_terms ADD COLUMN commitmentExpiresDate TEXT COLLATE "C";
                ALTER TABLE purchase_terms ADD COLUMN commitmentPrice BIGINT;
                ALTER TABLE subscription ADD COLUMN renewalBillingPlanType TEXT COLLATE "C";
                ALTER TABLE subscription ADD COLUMN commitmentRenewalProductId TEXT COLLATE "C";
                ALTER TABLE subscription ADD COLUMN commitmentAutoRenewStatus INTEGER;
                ALTER TABLE subscription ADD COLUMN commitmentRenewalBillingPlanType TEXT COLLATE "C";
                ALTER TABLE subscription ADD COLUMN commitmentRenewalDate TEXT COLLATE "C";
                ALTER TABLE subscription ADD COLUMN commitmentRenewalPrice BIGINT;
                """),
    ]

    /// SQLite's migrations: each step under the name it has always had in GRDB's table.
    static var sqliteMigrator: DatabaseMigrator {
        var migrator = DatabaseMigrator()
        for step in steps {
            migrator.registerMigration("v\(step.version): \(step.name)") { db in try db.execute(sql: step.sqlite) }
        }
        return migrator
    }

    /// PostgreSQL's migrations, by the number each is recorded under.
    package static var postgresMigrations: [(recordedAs: Int, name: String, sql: String)] {
        steps.compactMap { step in step.postgres.map { (step.postgresRecordedAs, "v\(step.version): \(step.name)", $0) } }
    }
}
