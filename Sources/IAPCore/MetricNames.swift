/// Every metric the services export, in one place (the dashboard and the tests use these).
///
/// Counters end in `_total`; the Apple latency timer is exported as a histogram in seconds.
public enum MetricNames {
    /// Uploads by `result` (`accepted`, `refused`) and, when refused, `reason` (the error code).
    public static let uploads = "iap_uploads_total"
    /// Verification attempts by `outcome` (`verified`, `rejected`, `retry_later`, `needs_review`, `postponed`).
    public static let verifications = "iap_verifications_total"
    /// Calls to Apple by `endpoint` (`production`, `sandbox`) and `status_class` (`2xx`, `4xx`, `5xx`, `error`).
    public static let appleRequestDuration = "iap_apple_request_duration_seconds"
    /// App Store Server Notifications accepted.
    public static let notifications = "iap_notifications_total"
    /// App Store notifications answered 200 without storing them again: their
    /// `notificationUUID` was applied already (Apple's retries, replays).
    public static let notificationsDuplicate = "iap_notifications_duplicate_total"
    /// App Store notifications the intake refused, by `reason` (the error code):
    /// `notifications_busy` counts verified ones refused over `IAP_NOTIFICATION_RATE` (alert on it).
    public static let notificationsRefused = "iap_notifications_refused_total"
    /// Retries scheduled.
    public static let retries = "iap_retries_total"
    /// Messages moved to a dead-letter queue, by `queue` (`verify`, `results`).
    public static let deadLetters = "iap_dead_letters_total"
    /// Results applied by the finisher, by the submission's new `state`.
    public static let resultsApplied = "iap_results_applied_total"
    /// Purchases credited.
    public static let grants = "iap_grants_total"
    /// Grants revoked (refunds).
    public static let revocations = "iap_revocations_total"
    /// Purchases uploaded by a user other than the one they were credited to.
    public static let replays = "iap_replays_total"
    /// Alerts raised.
    public static let alerts = "iap_alerts_total"
    /// Submissions by `state` (sampled from the store).
    public static let submissions = "iap_submissions"
    /// Messages waiting in the outbox (sampled).
    public static let outboxBacklog = "iap_outbox_backlog"
    /// Ready messages by `queue` (sampled with passive declares).
    public static let queueMessages = "iap_queue_messages"
    /// Consumers by `queue` (sampled with passive declares).
    public static let queueConsumers = "iap_queue_consumers"
    /// 1 while the circuit breaker toward Apple holds calls back.
    public static let breakerOpen = "iap_apple_breaker_open"
    /// Rejected submissions deleted after `IAP_RETENTION_DAYS`.
    public static let retentionPurged = "iap_retention_purged_total"
    /// Reconciliation runs by `result` (`ok`, or `failed` when a call to Apple or a check of
    /// its answer failed; what could be applied was applied).
    public static let reconciliationRuns = "iap_reconciliation_runs_total"
    /// Changes a reconciliation made (a grant credited or revoked, a subscription's state
    /// corrected), by the notification `type` it applied them as.
    public static let reconciliationCorrections = "iap_reconciliation_corrections_total"
    /// Notifications Apple could not deliver, re-delivered by a reconciliation.
    public static let reconciliationRedelivered = "iap_reconciliation_redelivered_total"
    /// Finish Transaction calls the order service made, by `result`: `finished` (Apple
    /// confirmed), `retry` (Apple could not answer now) or `refused` (never asked again).
    public static let appleFinishes = "iap_apple_finishes_total"
    /// Settled transactions queued to be finished at Apple and not finished yet (sampled).
    public static let appleFinishBacklog = "iap_apple_finish_backlog"
    /// Apple's refund requests answered, by `result`: `sent`, `skipped` (no consent, an
    /// assigned transaction), `refused` (by Apple), `expired` (past Apple's deadline) or
    /// `retry` (Apple could not answer now).
    public static let consumptionAnswers = "iap_consumption_answers_total"

    /// All of them.
    public static let all: [String] = [
        uploads, verifications, appleRequestDuration, retries, deadLetters, resultsApplied, grants, revocations,
        replays, alerts, submissions, outboxBacklog, queueMessages, queueConsumers, breakerOpen, notifications, notificationsDuplicate, notificationsRefused,
        retentionPurged, reconciliationRuns, reconciliationCorrections, reconciliationRedelivered, appleFinishes,
        appleFinishBacklog, consumptionAnswers,
    ]
}
