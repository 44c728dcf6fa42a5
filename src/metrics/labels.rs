//! The label values the code emits, one list per label. The metrics are
//! created with every value at zero (`Metrics::new`); a value missing here
//! still works, it only appears once first used.
//!
//! Kept apart from the code that emits them: tests/deploy_assets.rs reads
//! the rest of the source to check that every value listed here is emitted.

/// `taskbroker_push_submits_total{result}` (FetchActor).
pub const SUBMIT_RESULTS: &[&str] = &["ok", "full", "timeout", "closed"];
/// `taskbroker_claims_released_total{reason}`: FetchActor (queue_*),
/// push pool (push_failed), upkeep (lease_expired), broker stop
/// (shutdown), a claim guard dropped while held (dropped), a restarted
/// broker's previous claims (restart), a silent peer's claims
/// (takeover).
pub const RELEASE_REASONS: &[&str] = &[
    "queue_timeout",
    "queue_closed",
    "push_failed",
    "lease_expired",
    "shutdown",
    "dropped",
    "restart",
    "takeover",
];
/// `taskbroker_grpc_tls_reloads_total{result}` (the gRPC server's
/// certificate watcher).
pub const TLS_RELOAD_RESULTS: &[&str] = &["ok", "error"];
/// `taskbroker_pushes_total{result}` (PushPoolActor).
pub const PUSH_RESULTS: &[&str] = &[
    "ok",
    "error",
    "unreachable",
    "backoff",
    "busy",
    "timeout",
    "unroutable",
    "undecodable",
    "stale",
    "too_large",
    "lease_expired",
    "not_live",
];
/// `taskbroker_consumer_records_total{result}` (ConsumerActor).
/// `killswitched`: dropped by a killswitch of the runtime file.
/// `demoted`: forwarded to the demoted topic.
pub const CONSUMER_RESULTS: &[&str] = &[
    "stored",
    "duplicate",
    "invalid",
    "expired",
    "killswitched",
    "demoted",
];
/// `taskbroker_namespace_activations{status}`: the unfinished statuses.
pub const NAMESPACE_STATUSES: &[&str] = &["pending", "delay", "claimed", "processing"];
/// `taskbroker_namespace_results_total{status}`: what a worker reports.
pub const NAMESPACE_RESULT_STATUSES: &[&str] = &["complete", "retry", "failure"];
/// The namespace label standing for every namespace outside the top K.
pub const OTHER_NAMESPACES: &str = "other";
/// `taskbroker_runtime_rules{kind}`.
pub const RUNTIME_RULE_KINDS: &[&str] = &["killswitches", "paused", "demoted_namespaces"];
/// `taskbroker_consumer_invalid_records_total{reason}`:
/// `ActivationError::reason`.
pub const INVALID_REASONS: &[&str] = &[
    "empty_payload",
    "undecodable",
    "empty_id",
    "unknown_enum",
    "invalid_timestamp",
    "out_of_range",
    "too_large",
    "invalid_text",
    "store_rejected",
];
/// Kafka writes: `taskbroker_ingest_dead_letters_total{result}` and the
/// `result` of `taskbroker_published_total`.
pub const PUBLISH_RESULTS: &[&str] = &["ok", "error"];
/// The `result` of `taskbroker_published_total`: a record Kafka refuses
/// as too large is given up (the row completed), not retried.
pub const PUBLISHED_RESULTS: &[&str] = &["ok", "error", "too_large"];
/// `taskbroker_dead_letters_truncated_total{kind}`: an ingest dead letter
/// (ConsumerActor) or a task's dead letter (upkeep).
pub const DEAD_LETTER_KINDS: &[&str] = &["ingest", "deadletter"];
/// The `kind` of `taskbroker_published_total`.
pub const PUBLISH_KINDS: &[&str] = &["retry", "deadletter"];
/// `taskbroker_upkeep_step_duration_seconds{step}` and
/// `taskbroker_upkeep_backlog{step}`.
pub const UPKEEP_STEPS: &[&str] = &[
    "discard_failures",
    "release_expired_claims",
    "processing_deadlines",
    "fail_exhausted_attempts",
    "remove_killswitched",
    "remove_expired",
    "release_delayed",
    "remove_completed",
    "publish_retries",
    "publish_dead_letters",
    "forward_demoted",
];
/// `taskbroker_upkeep_transitions_total{step}`: the processing-deadline
/// step counts its two outcomes separately.
pub const UPKEEP_TRANSITIONS: &[&str] = &[
    "discard_failures",
    "release_expired_claims",
    "processing_deadline_retried",
    "processing_deadline_failed",
    "fail_exhausted_attempts",
    "remove_killswitched",
    "remove_expired",
    "release_delayed",
    "remove_completed",
    "publish_retries",
    "publish_dead_letters",
    "forward_demoted",
];
/// `taskbroker_upkeep_errors_total{step}`: the steps, the gauge refresh
/// queries, and the SQLite space reclaim (which sets
/// `taskbroker_sqlite_bytes`).
pub const UPKEEP_ERROR_STEPS: &[&str] = &[
    "discard_failures",
    "release_expired_claims",
    "processing_deadlines",
    "fail_exhausted_attempts",
    "remove_killswitched",
    "remove_expired",
    "release_delayed",
    "remove_completed",
    "publish_retries",
    "publish_dead_letters",
    "forward_demoted",
    "count_by_namespace",
    "count_by_status",
    "has_rows",
    "max_pending_lag",
    "inflight_bytes_by_topic",
    "reclaim_space",
];
/// `taskbroker_status_reports_total{status}`: each report as the gRPC
/// API received it, or `invalid` when it refused it.
pub const STATUS_REPORTS: &[&str] = &["complete", "retry", "failure", "invalid"];
/// `taskbroker_status_updates_total{result}`: what the store write did
/// with each valid report.
pub const STATUS_UPDATE_RESULTS: &[&str] = &["updated", "ignored", "missing"];
/// The `operation` of the store metrics: the operations the StoreActor
/// runs (each message's `OPERATION`; a test keeps the two lists equal).
pub const STORE_OPERATIONS: &[&str] = &[
    "insert_batch",
    "claim_for_push",
    "claim_for_pull",
    "release_claims",
    "undo_claim",
    "mark_processing",
    "fail_claim_attempt",
    "set_status",
    "release_expired_claims",
    "handle_processing_deadlines",
    "fail_exhausted_attempts",
    "remove_killswitched",
    "remove_expired",
    "release_delayed",
    "take_for_publish",
    "take_demoted",
    "remove_forwarded",
    "register_broker",
    "read_broker",
    "release_previous_claims",
    "heartbeat",
    "take_over_silent",
    "unregister_broker",
    "discard_failures",
    "mark_published",
    "remove_completed",
    "reclaim_space",
    "count_by_status",
    "count_by_namespace",
    "count_inflight_by_topic",
    "inflight_bytes_by_topic",
    "has_rows",
    "max_pending_lag",
    "ping",
    "fail_claims",
    "defer_claims",
];
/// `taskbroker_sqlite_bytes{kind}`: the database file, its WAL, and the
/// free pages inside the file.
pub const SQLITE_BYTES_KINDS: &[&str] = &["file", "wal", "free"];
/// The `kind` of `taskbroker_store_operation_errors_total`: what
/// `StoreError::kind` answers for a running operation (migration and
/// configuration errors only happen at startup, outside these metrics).
pub const STORE_ERROR_KINDS: &[&str] = &["unavailable", "rejected", "query", "invalid_row"];
/// The `status` of `taskbroker_activations`: every lifecycle status,
/// in lower case as Prometheus label values are (the store's names are
/// capitalised; a test keeps the two lists equal but for case).
pub const ACTIVATION_STATUSES: &[&str] = &[
    "pending",
    "delay",
    "claimed",
    "processing",
    "retry",
    "failure",
    "complete",
];

/// The label value of a status by its stored name (`Pending` →
/// `pending`); `None` for a name that is no status.
pub fn activation_status(stored: &str) -> Option<&'static str> {
    ACTIVATION_STATUSES
        .iter()
        .copied()
        .find(|label| label.eq_ignore_ascii_case(stored))
}
