//! The in-flight activation store: one interface of intent-named operations,
//! implemented by PostgreSQL (`postgres/`) and SQLite (`sqlite/`).
//!
//! Every transition that a claim could race is *fenced*: it names the row by
//! id **and** by the `claim_expires_at` the caller saw when it claimed it. Each
//! claim writes a strictly later expiry than the row ever had, so a stale
//! release, undo or mark-processing can never touch a newer claim of the same
//! row. Every statement is bounded: batch operations take explicit id lists
//! (empty lists are no-ops that never reach the database) and upkeep
//! operations take a `limit`.
//!
//! The store persists and fences; it does not interpret or rewrite the
//! stored activation bytes. What a worker's RETRY edits is kept in columns of
//! its own and applied by the code that publishes the retry (`model::retry`).

mod postgres;
mod space;
mod sqlite;
mod view;

pub use postgres::{PostgresStore, PostgresStoreConfig};
pub use space::{FileSpace, SpaceReclaim};
pub use sqlite::{SqliteStore, SqliteStoreConfig, SqliteView};
pub use view::{GroupCount, Inspection, NearExpiry, StoreView};

// The values the store's operations take and answer belong to the domain
// and are imported from `crate::model` by everyone, the store included.
use crate::model::{
    ActivationStatus, BeatAnswer, BrokerRow, BucketRange, ClaimToken, ClaimedActivation,
    DeadlineOutcome, Dispatch, InflightActivation, Killswitch, NamespaceCount, PauseRule,
    PublishKind, PullFilter, Registration, RetryEdit, StatusCounts, StatusUpdate,
    StatusUpdateOutcome, Takeover,
};

use std::time::Duration;

use async_trait::async_trait;

pub use crate::config::fresh_broker_id;

/// Result of every store operation.
pub type StoreResult<T> = Result<T, StoreError>;

/// Errors a caller can branch on: `Unavailable` is retryable (the database
/// went away, the pool is exhausted, a transaction lost a serialization race
/// or a deadlock); `Rejected` means the database refused the data itself,
/// so the same rows fail again however often they are retried; the others
/// are not retryable either.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable during {operation}: {message}")]
    Unavailable {
        operation: &'static str,
        message: String,
    },
    /// The data was refused (a value out of range or not representable, a
    /// constraint, an index entry too large): PostgreSQL's SQLSTATE classes
    /// 22, 23 and 54; SQLite's TOOBIG, CONSTRAINT, MISMATCH and RANGE.
    #[error("store refused the data of {operation}: {message}")]
    Rejected {
        operation: &'static str,
        message: String,
    },
    #[error("store operation {operation} failed: {message}")]
    Query {
        operation: &'static str,
        message: String,
    },
    #[error("row {id} has an invalid {column}: {value}")]
    InvalidRow {
        id: String,
        column: &'static str,
        value: String,
    },
    /// The database could not be reached at all (`target` names where:
    /// `host:port`, never credentials).
    #[error("cannot connect to PostgreSQL at {target}: {message}")]
    Connect { target: String, message: String },
    #[error("migration failed: {0}")]
    Migration(String),
    #[error("invalid store configuration: {0}")]
    Config(String),
}

impl StoreError {
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable { .. } | StoreError::Connect { .. }
        )
    }

    /// Short, bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Unavailable { .. } | StoreError::Connect { .. } => "unavailable",
            StoreError::Rejected { .. } => "rejected",
            StoreError::Query { .. } => "query",
            StoreError::InvalidRow { .. } => "invalid_row",
            StoreError::Migration(_) => "migration",
            StoreError::Config(_) => "config",
        }
    }
}

/// A push claim's byte budget unless the configuration says otherwise
/// (`FETCH_BATCH_BYTES`'s default).
pub const DEFAULT_CLAIM_MAX_BYTES: usize = 16 << 20;

/// A status as stored, or the row error naming it.
pub(crate) fn parse_status(value: String) -> StoreResult<ActivationStatus> {
    value
        .parse::<ActivationStatus>()
        .map_err(|value| StoreError::InvalidRow {
            id: String::from("(count)"),
            column: "status",
            value,
        })
}

/// Adds one `(status, count)` row of a `GROUP BY status` query to `counts`;
/// both backends read their counts this way.
pub(crate) fn status_counts(pairs: Vec<(String, u64)>) -> StoreResult<StatusCounts> {
    let mut counts = StatusCounts::default();
    for (status, count) in pairs {
        let status =
            status
                .parse::<ActivationStatus>()
                .map_err(|value| StoreError::InvalidRow {
                    id: String::from("(count)"),
                    column: "status",
                    value,
                })?;
        counts.set(status, count);
    }
    Ok(counts)
}

/// A retry edit as its two columns (`retry_max_attempts`,
/// `retry_delay_on_retry`), NULL where it names nothing. `delay_on_retry`
/// is stored as the bit pattern of the `u64`, so every value reads back
/// exactly (see the V2 migrations).
pub(crate) fn retry_edit_columns(edit: &RetryEdit) -> (Option<i64>, Option<i64>) {
    (
        edit.max_attempts.map(i64::from),
        edit.delay_on_retry.map(|delay| delay as i64),
    )
}

/// The retry edit of row `id` from its two columns.
pub(crate) fn retry_edit_from_columns(
    id: &str,
    max_attempts: Option<i64>,
    delay_on_retry: Option<i64>,
) -> StoreResult<RetryEdit> {
    let max_attempts = max_attempts
        .map(|value| {
            u32::try_from(value).map_err(|_| StoreError::InvalidRow {
                id: id.to_owned(),
                column: "retry_max_attempts",
                value: value.to_string(),
            })
        })
        .transpose()?;
    Ok(RetryEdit {
        max_attempts,
        delay_on_retry: delay_on_retry.map(|delay| delay as u64),
    })
}

/// The rows a claim statement returned, oldest `added_at` first, each with
/// the fence it wrote; both backends answer claims this way.
pub(crate) fn claimed_rows(
    mut rows: Vec<InflightActivation>,
) -> StoreResult<Vec<ClaimedActivation>> {
    // RETURNING has no order; hand them out oldest first.
    rows.sort_by_key(|row| row.added_at);
    rows.into_iter()
        .map(|row| match row.claim_expires_at {
            Some(claim_expires_at) => Ok(ClaimedActivation {
                token: ClaimToken {
                    id: row.id.clone(),
                    claim_expires_at,
                },
                activation: row,
            }),
            None => Err(StoreError::InvalidRow {
                id: row.id,
                column: "claim_expires_at",
                value: "NULL on a claimed row".to_owned(),
            }),
        })
        .collect()
}

/// Broker identity and liveness (DESIGN.md, "Broker identity and
/// recovery"): each store is opened for one broker id, written into every
/// claim it makes (`claimed_by`), and each running broker keeps a row in
/// `taskbroker_brokers` with a heartbeat.
///
/// Every release here is fenced like the others: it only returns rows
/// still Claimed *by the broker named*, so a row claimed again by anyone
/// else is never touched.
#[async_trait]
pub trait Membership: Send + Sync + 'static {
    /// The broker id this store claims for.
    fn broker_id(&self) -> &str;

    /// Writes this broker's row (host, a fresh `incarnation`, started and
    /// heartbeat now), replacing any row of a previous incarnation, and
    /// answers how many other brokers' heartbeats are within `live_within`.
    async fn register_broker(
        &self,
        host: &str,
        incarnation: &str,
        live_within: Duration,
    ) -> StoreResult<Registration>;

    /// Startup, before this incarnation claims anything: returns to Pending
    /// the Claimed rows earlier incarnations of this broker left, which
    /// nobody is pushing. PostgreSQL: rows claimed under this broker id.
    /// SQLite: every Claimed row, since only one process can open the file
    /// and so every claim in it belongs to a process that is gone. Never
    /// consumes an attempt; Processing rows keep their deadlines.
    async fn release_previous_claims(&self) -> StoreResult<u64>;

    /// This broker id's row, if there is one: what a broker starting under
    /// the id finds (its previous run's, or a live process's with the same
    /// id).
    async fn read_broker(&self) -> StoreResult<Option<BrokerRow>>;

    /// Refreshes this broker's `heartbeat_at` if its row still has
    /// `incarnation`, and counts the other brokers silent for longer than
    /// `silent_after`; otherwise says whether the row is gone (a peer took
    /// this broker over) or another process registered the same id.
    async fn heartbeat(&self, incarnation: &str, silent_after: Duration)
    -> StoreResult<BeatAnswer>;

    /// Takes over every other broker whose heartbeat is older than
    /// `timeout`: removes its row and returns its Claimed rows to Pending,
    /// in one statement (PostgreSQL) or one write (SQLite). Peers doing
    /// this at once take each broker over once.
    async fn take_over_silent(&self, timeout: Duration) -> StoreResult<Vec<Takeover>>;

    /// Clean shutdown: removes this broker's row if it still has
    /// `incarnation`. Answers whether it did.
    async fn unregister_broker(&self, incarnation: &str) -> StoreResult<bool>;
}

/// The operations the broker performs on in-flight activations.
///
/// Implementations must be safe to call concurrently from many tasks and from
/// several broker replicas sharing one database.
#[async_trait]
pub trait ActivationStore: Membership {
    /// Which backend this is, for logs ("postgres", "sqlite").
    fn backend(&self) -> &'static str;

    /// Applies pending schema migrations; safe when replicas start together.
    async fn migrate(&self) -> StoreResult<()>;

    /// Whether the database answers: one trivial statement (`SELECT 1`) on
    /// a pooled or reader connection, no table touched. `Unavailable` when
    /// it does not; for health checks.
    async fn ping(&self) -> StoreResult<()>;

    /// Wake-ups for new rows stored by any process sharing this store, this
    /// one included: the stream yields (coalesced) whenever an insert that
    /// stored rows committed, and once when it starts or reconnects.
    /// PostgreSQL listens on a connection of its own (`LISTEN`), started on
    /// the current tokio runtime and closed when the stream is dropped.
    /// `None` where only this process writes (SQLite): its in-process
    /// wake-ups are enough.
    fn new_rows(&self) -> Option<futures::stream::BoxStream<'static, ()>> {
        None
    }

    /// Inserts activations, ignoring ids already stored. Returns how many were new.
    async fn insert_batch(&self, rows: &[InflightActivation]) -> StoreResult<u64>;

    /// Push mode: claims up to `limit` Pending, unexpired rows in `buckets`,
    /// oldest `added_at` first, skipping rows other claimers hold. Returns them
    /// Claimed, in `added_at` order, each with the exact `claim_expires_at`
    /// that fences later transitions.
    async fn claim_for_push(
        &self,
        buckets: BucketRange,
        limit: usize,
        lease: Duration,
    ) -> StoreResult<Vec<ClaimedActivation>> {
        self.claim_for_push_except(buckets, limit, lease, &[], Dispatch::OldestFirst)
            .await
    }

    /// `claim_for_push`, leaving out rows any of the `paused` rules match
    /// (they stay Pending, untouched), choosing the rows as `dispatch`
    /// says. Oldest first with no rules is the same statement as
    /// `claim_for_push`. Fair dispatch reads the flows (application and
    /// namespace) with Pending rows from their index, one probe each, takes
    /// each flow's share of the batch oldest first, interleaves them by
    /// weighted turn (ties in random order) and fills what the shares left
    /// unused oldest first, all in one statement (PostgreSQL) or one write
    /// (SQLite).
    async fn claim_for_push_except(
        &self,
        buckets: BucketRange,
        limit: usize,
        lease: Duration,
        paused: &[PauseRule],
        dispatch: Dispatch<'_>,
    ) -> StoreResult<Vec<ClaimedActivation>>;

    /// Push mode, a namespace under a concurrency limit: claims up to
    /// `limit` of its Pending, unexpired rows (every bucket, oldest first),
    /// but never so many that its Claimed and Processing rows exceed
    /// `max_in_flight`. Counting and claiming are one atomic step across
    /// every broker sharing the store (PostgreSQL: an advisory lock on the
    /// namespace for the transaction; SQLite: its single writer).
    async fn claim_limited(
        &self,
        namespace: &str,
        max_in_flight: u32,
        limit: usize,
        lease: Duration,
    ) -> StoreResult<Vec<ClaimedActivation>>;

    /// Pull mode: moves the oldest Pending, unexpired row matching `filter`
    /// straight to Processing with its deadline. A namespace without an
    /// application matches nothing (the protocol requires both).
    async fn claim_for_pull(
        &self,
        filter: &PullFilter,
        deadline_grace: Duration,
    ) -> StoreResult<Option<InflightActivation>> {
        self.claim_for_pull_except(filter, deadline_grace, &[])
            .await
    }

    /// `claim_for_pull`, leaving out rows any of the `paused` rules match.
    async fn claim_for_pull_except(
        &self,
        filter: &PullFilter,
        deadline_grace: Duration,
        paused: &[PauseRule],
    ) -> StoreResult<Option<InflightActivation>>;

    /// Returns claimed rows to Pending in one statement, fenced. Never
    /// consumes an attempt; rows claimed again or already Processing are
    /// left alone. Returns how many rows were released.
    async fn release_claims(&self, claims: &[ClaimToken]) -> StoreResult<u64>;

    /// A push failed: the same fenced return to Pending as `release_claims`,
    /// for one row. Returns whether the row was still held by this claim.
    async fn undo_claim(&self, claim: &ClaimToken) -> StoreResult<bool> {
        Ok(self.release_claims(std::slice::from_ref(claim)).await? == 1)
    }

    /// Pushes succeeded: fenced Claimed → Processing with
    /// `processing_deadline` = now + `processing_deadline_duration` + grace.
    /// Returns the ids of the rows that moved; the others were stale
    /// (claimed again, released, or gone), so callers can count them.
    async fn mark_processing(
        &self,
        claims: &[ClaimToken],
        deadline_grace: Duration,
    ) -> StoreResult<Vec<String>>;

    /// A claimed activation can never be delivered (no worker serves its
    /// application, or its stored bytes do not decode): fenced Claimed →
    /// Pending with one more attempt, or → Failure once that makes
    /// `max_attempts`, so a poison task ends like any other instead of
    /// cycling forever. Returns how many rows moved.
    async fn fail_claim_attempt(
        &self,
        claims: &[ClaimToken],
        max_attempts: u32,
    ) -> StoreResult<u64>;

    /// Worker results. Only rows in Claimed or Processing change; others are
    /// counted as ignored (wrong status) or missing (no such id). A result
    /// that needs nothing more (COMPLETE, or FAILURE of a task that
    /// discards) deletes the row in the same statement, so upkeep never
    /// sees it; RETRY and dead-lettering FAILURE rows stay until upkeep has
    /// published them. A RETRY
    /// update's `max_attempts` / `delay_on_retry` are stored with the row
    /// (its `retry_edit`), fenced the same way; the stored activation bytes
    /// are never rewritten.
    async fn set_status(&self, updates: &[StatusUpdate]) -> StoreResult<StatusUpdateOutcome>;

    /// Deletes rows by id regardless of status. Returns how many were deleted.
    async fn delete_batch(&self, ids: &[String]) -> StoreResult<u64>;

    /// Upkeep: Claimed rows whose lease ran out → Pending, no attempt consumed.
    async fn release_expired_claims(&self, limit: usize) -> StoreResult<u64>;

    /// Upkeep: Processing rows past their deadline → Pending with one more
    /// attempt, or Failure when the task is at_most_once.
    async fn handle_processing_deadlines(&self, limit: usize) -> StoreResult<DeadlineOutcome>;

    /// Upkeep: Pending rows that used `max_attempts` or more → Failure.
    async fn fail_exhausted_attempts(&self, max_attempts: u32, limit: usize) -> StoreResult<u64>;

    /// Upkeep: deletes up to `limit` rows any of the `killswitches` match,
    /// in every status but Processing (a worker is running those; its
    /// report ends them). Returns how many were deleted; no killswitches,
    /// no statement.
    async fn remove_killswitched(
        &self,
        killswitches: &[Killswitch],
        limit: usize,
    ) -> StoreResult<u64>;

    /// Upkeep: deletes Pending rows whose `expires_at` has passed.
    async fn remove_expired(&self, limit: usize) -> StoreResult<u64>;

    /// Upkeep: Delay rows whose `delay_until` has passed → Pending.
    async fn release_delayed(&self, limit: usize) -> StoreResult<u64>;

    /// Upkeep: takes up to `limit` rows to publish (Retry rows, or Failure
    /// rows to dead-letter). Rows are taken under row locks and leased for
    /// `lease`, so concurrent callers (other replicas) never receive the same
    /// row; if the caller dies before `mark_published`, the rows are offered
    /// again after the lease.
    async fn take_for_publish(
        &self,
        kind: PublishKind,
        limit: usize,
        lease: Duration,
    ) -> StoreResult<Vec<InflightActivation>>;

    /// Upkeep: takes up to `limit` Pending or Delay rows of the demoted
    /// `namespaces` to forward to `demoted_topic` (rows consumed from that
    /// topic are not taken), leased for `lease` like rows taken for
    /// publishing, so two brokers never forward the same row.
    async fn take_demoted(
        &self,
        namespaces: &[String],
        demoted_topic: &str,
        limit: usize,
        lease: Duration,
    ) -> StoreResult<Vec<InflightActivation>>;

    /// Upkeep: Kafka acknowledged these forwarded rows: deletes those still
    /// Pending or Delay. Returns how many were deleted.
    async fn remove_forwarded(&self, ids: &[String]) -> StoreResult<u64>;

    /// Upkeep: Failure rows whose task says discard → Complete.
    async fn discard_failures(&self, limit: usize) -> StoreResult<u64>;

    /// Upkeep: Kafka acknowledged these rows' records: Retry/Failure → Complete.
    async fn mark_published(&self, ids: &[String]) -> StoreResult<u64>;

    /// Upkeep: deletes Complete rows.
    async fn remove_completed(&self, limit: usize) -> StoreResult<u64>;

    /// Upkeep: gives free space in the store's own file back to the file
    /// system, bounded per run so the single writer is never held long,
    /// and answers the file's sizes before and after (`more`: run again
    /// soon). `None` from a store with no file of its own: PostgreSQL,
    /// whose server reclaims its space itself (autovacuum).
    async fn reclaim_space(&self) -> StoreResult<Option<SpaceReclaim>> {
        Ok(None)
    }

    /// Row counts per status.
    async fn count_by_status(&self) -> StoreResult<StatusCounts>;

    /// Rows per namespace and status (one scan of the table), with the
    /// oldest first-attempt Pending row's runnable time per namespace.
    async fn count_by_namespace(&self) -> StoreResult<Vec<NamespaceCount>>;

    /// In-flight rows (Pending, Delay, Claimed, Processing) per Kafka topic
    /// they were consumed from: each topic's consumer pauses on its own count.
    async fn count_inflight_by_topic(&self) -> StoreResult<Vec<(String, u64)>>;

    /// Bytes of the activations the table holds (every status) per Kafka
    /// topic: each topic's consumer pauses on its own sum
    /// (`MAX_INFLIGHT_BYTES`). Kept with every insert and delete by the
    /// store's triggers (migration V5), so reading it never scans the table.
    async fn inflight_bytes_by_topic(&self) -> StoreResult<Vec<(String, u64)>>;

    /// Whether the table holds any row at all: an idle broker's upkeep asks
    /// this one cheap question instead of running every step on an empty
    /// table.
    async fn has_rows(&self) -> StoreResult<bool>;

    /// Age in seconds of the oldest first-attempt Pending or Claimed row,
    /// measured from when it became runnable (`received_at`, or `delay_until`
    /// when later); 0 when there is none. Read from indexes, not the whole
    /// table: among the 64 first stored Pending rows and the 64 oldest
    /// claims.
    async fn max_pending_lag(&self) -> StoreResult<f64>;

    /// One row by id, for inspection and tests.
    async fn get(&self, id: &str) -> StoreResult<Option<InflightActivation>>;

    /// A claimed activation's push ended in a way that uses up its one
    /// delivery (an at_most_once task whose push outcome is unknown, or a
    /// request too large for the worker): fenced Claimed → Failure with one
    /// more attempt, so upkeep dead-letters or discards it per its
    /// `on_attempts_exceeded`. Returns how many rows moved.
    async fn fail_claims(&self, claims: &[ClaimToken]) -> StoreResult<u64>;

    /// No worker serves these claims' application: fenced Claimed → Delay
    /// until `until`, no attempt consumed; upkeep's Delay → Pending step
    /// offers them again. Returns how many rows moved.
    async fn defer_claims(
        &self,
        claims: &[ClaimToken],
        until: chrono::DateTime<chrono::Utc>,
    ) -> StoreResult<u64>;
}
