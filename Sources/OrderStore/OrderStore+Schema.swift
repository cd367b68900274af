import GRDB

extension OrderStore {
    /// Frozen history of the schema: add migrations, never edit one that shipped.
    static var sqliteMigrator: DatabaseMigrator {
        var migrator = DatabaseMigrator()
        migrator.registerMigration("v1: submissions, purchases, grants, orders, outbox") { db in
            try db.execute(
                sql: """
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
                    """)
        }
        migrator.registerMigration("v2: StoreKit 2 uploads, notifications, subscriptions") { db in
            try db.execute(
                sql: """
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
                    """)
        }
        migrator.registerMigration("v3: credit keys, remembered revocations, subscription order, indexes") { db in
            try db.execute(
                sql: """
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
                    """)
        }
        migrator.registerMigration("v4: reconciliation runs, re-delivered notifications, due subscriptions") { db in
            try db.execute(
                sql: """
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
                    """)
        }
        migrator.registerMigration("v5: grant expiry and chain") { db in
            try db.execute(
                sql: """
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
                    """)
        }
        migrator.registerMigration("v6: outbox claims") { db in
            try db.execute(
                sql: """
                    -- Which relay is publishing a row, until when (several order services share
                    -- one PostgreSQL store; the columns are the same on both backends).
                    ALTER TABLE outbox ADD COLUMN claimedBy TEXT;
                    ALTER TABLE outbox ADD COLUMN claimedUntil DATETIME;
                    CREATE INDEX outbox_kind ON outbox(mandatory, id);
                    """)
        }
        migrator.registerMigration("v7: rate-limit buckets") { db in
            try db.execute(
                sql: """
                    -- Token buckets that several order services count together (PostgreSQL);
                    -- the same table here keeps one set of operations on both backends.
                    CREATE TABLE rate_bucket (
                        key TEXT PRIMARY KEY NOT NULL,
                        tokens REAL NOT NULL,
                        allowed INTEGER NOT NULL,
                        updated REAL NOT NULL
                    );
                    CREATE INDEX rate_bucket_updated ON rate_bucket(updated);
                    """)
        }
        migrator.registerMigration("v8: a purchase's period end") { db in
            try db.execute(
                sql: """
                    -- When a subscription period ends, as Apple said when it was recorded: a held
                    -- period that customer service grants later ends with it.
                    ALTER TABLE purchase ADD COLUMN expiresDate DATETIME;
                    """)
        }
        migrator.registerMigration("v9: prorated refunds") { db in
            try db.execute(
                sql: """
                    -- Apple's latest full refund or revocation, and its latest prorated refund of a
                    -- consumable with the units it took back; revokedAt stays the latest of either.
                    ALTER TABLE revocation ADD COLUMN fullyRevokedAt DATETIME;
                    ALTER TABLE revocation ADD COLUMN partlyRevokedAt DATETIME;
                    ALTER TABLE revocation ADD COLUMN revokedUnits INTEGER;
                    UPDATE revocation SET fullyRevokedAt = revokedAt;
                    """)
        }
        migrator.registerMigration("v10: what a named StoreKit 1 transaction stands for") { db in
            try db.execute(
                sql: """
                    -- The original transaction and product the app said the named transaction
                    -- stands for (a StoreKit 1 restore, whose id the receipt may not hold).
                    ALTER TABLE submission ADD COLUMN originalTransactionId TEXT;
                    ALTER TABLE submission ADD COLUMN productId TEXT;
                    """)
        }
        migrator.registerMigration("v11: where a subscription owner's stretch of the chain begins") { db in
            try db.execute(
                sql: """
                    -- The purchase date of the new purchase (a resubscription, an upgrade) that
                    -- began the owner's stretch of the chain; NULL: the first stretch.
                    ALTER TABLE subscription ADD COLUMN ownedSince DATETIME;
                    """)
        }
        return migrator
    }
}
