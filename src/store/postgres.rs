//! PostgreSQL backend: deadpool-postgres pool, prepared (cached) statements,
//! one statement per batch. Timestamps come from the database clock (`now()`),
//! so replicas sharing the database agree on expiry.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use deadpool_postgres::{
    Hook, HookError, Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime,
};
use tokio_postgres::{NoTls, Row, error::SqlState};

use super::{ActivationStore, StoreError, StoreResult, claimed_rows};
use crate::model::{
    ActivationStatus, BucketRange, ClaimToken, ClaimedActivation, DeadlineOutcome,
    InflightActivation, OnAttemptsExceeded, PublishKind, PullFilter, StatusCounts, StatusUpdate,
    StatusUpdateOutcome,
};

mod embedded {
    refinery::embed_migrations!("migrations/postgres");
}

/// Key of the session advisory lock that serializes migrations across
/// replicas starting at the same moment ("taskbroker" in ASCII, truncated).
const MIGRATION_LOCK_KEY: i64 = 0x7461_736b_6272_6f6b;

/// Settings for [`PostgresStore::connect`].
#[derive(Debug, Clone)]
pub struct PostgresStoreConfig {
    pub url: String,
    pub pool_size: usize,
    /// Run the transitions a lease or deadline would replay anyway (claims,
    /// mark processing, removal of finished rows) with
    /// `synchronous_commit = off`. After a database crash some tasks may run
    /// twice; none is lost.
    pub async_commit: bool,
    /// Bound on connecting and on waiting for a pooled connection, so callers
    /// get `Unavailable` instead of hanging while the database is away.
    pub connect_timeout: Duration,
}

impl PostgresStoreConfig {
    pub fn new(url: impl Into<String>) -> Self {
        PostgresStoreConfig {
            url: url.into(),
            pool_size: 16,
            async_commit: false,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

pub struct PostgresStore {
    url: String,
    connect_timeout: Duration,
    /// Durable commits: inserts, worker results, upkeep that publishes.
    pool: Pool,
    /// Transitions that may use asynchronous commit (same pool unless
    /// `async_commit` is on).
    replayable: Pool,
}

impl PostgresStore {
    /// Builds the pools. Connections are opened lazily, so a database that
    /// is down at startup shows up as `Unavailable` on first use.
    pub fn connect(config: &PostgresStoreConfig) -> StoreResult<Self> {
        let pool = build_pool(config, false)?;
        let replayable = if config.async_commit {
            build_pool(config, true)?
        } else {
            pool.clone()
        };
        Ok(PostgresStore {
            url: config.url.clone(),
            connect_timeout: config.connect_timeout,
            pool,
            replayable,
        })
    }

    async fn client(
        &self,
        pool: &Pool,
        operation: &'static str,
    ) -> StoreResult<deadpool_postgres::Object> {
        pool.get().await.map_err(|err| pool_error(operation, err))
    }
}

fn build_pool(config: &PostgresStoreConfig, async_commit: bool) -> StoreResult<Pool> {
    let mut pg_config: tokio_postgres::Config = config
        .url
        .parse()
        .map_err(|err| StoreError::Config(format!("invalid PostgreSQL URL: {err}")))?;
    pg_config.connect_timeout(config.connect_timeout);
    if pg_config.get_application_name().is_none() {
        pg_config.application_name("taskbroker");
    }
    let manager = Manager::from_config(
        pg_config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let mut builder = Pool::builder(manager)
        .max_size(config.pool_size.max(1))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(config.connect_timeout))
        .create_timeout(Some(config.connect_timeout))
        .recycle_timeout(Some(config.connect_timeout));
    if async_commit {
        builder = builder.post_create(Hook::async_fn(|client, _| {
            Box::pin(async move {
                client
                    .batch_execute("SET synchronous_commit = off")
                    .await
                    .map_err(HookError::Backend)
            })
        }));
    }
    builder
        .build()
        .map_err(|err| StoreError::Config(format!("cannot build connection pool: {err}")))
}

/// Connection-level failures are retryable (`Unavailable`); data the server
/// refused is `Rejected`; anything else it rejected about the statement
/// itself is a `Query` error.
fn query_error(operation: &'static str, err: tokio_postgres::Error) -> StoreError {
    let unavailable = match err.code() {
        Some(code) => {
            code.code().starts_with("08")
                || [
                    SqlState::ADMIN_SHUTDOWN,
                    SqlState::CRASH_SHUTDOWN,
                    SqlState::CANNOT_CONNECT_NOW,
                    SqlState::TOO_MANY_CONNECTIONS,
                    // Transient: the same statement succeeds when re-run.
                    SqlState::T_R_DEADLOCK_DETECTED,
                    SqlState::T_R_SERIALIZATION_FAILURE,
                ]
                .contains(code)
        }
        // No SQLSTATE: a broken connection is retryable; a client-side
        // encode, decode or row-count error is not.
        None => {
            err.is_closed()
                || std::error::Error::source(&err).is_some_and(|s| s.is::<std::io::Error>())
        }
    };
    // Data exception, integrity constraint violation, program limit
    // exceeded (e.g. 54000, an index row too large): the rows themselves are
    // at fault and fail the same way on every retry.
    let rejected = err.code().is_some_and(|code| {
        ["22", "23", "54"]
            .iter()
            .any(|class| code.code().starts_with(class))
    });
    let message = match err.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => describe(&err),
    };
    if unavailable {
        StoreError::Unavailable { operation, message }
    } else if rejected {
        StoreError::Rejected { operation, message }
    } else {
        StoreError::Query { operation, message }
    }
}

fn pool_error(operation: &'static str, err: PoolError) -> StoreError {
    StoreError::Unavailable {
        operation,
        message: describe(&err),
    }
}

/// `err` and its causes: deadpool and tokio-postgres keep the reason (the
/// server's message, the io error) in `source()`, not in `Display`.
fn describe(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

/// The row columns, in the order `activation_from_row` reads them.
macro_rules! columns {
    () => {
        "id, activation, topic, partition, kafka_offset, added_at, received_at, \
         processing_attempts, expires_at, delay_until, processing_deadline_duration, \
         processing_deadline, claim_expires_at, status, at_most_once, application, namespace, \
         taskname, on_attempts_exceeded, bucket, retry_max_attempts, retry_delay_on_retry"
    };
    (t) => {
        "t.id, t.activation, t.topic, t.partition, t.kafka_offset, t.added_at, t.received_at, \
         t.processing_attempts, t.expires_at, t.delay_until, t.processing_deadline_duration, \
         t.processing_deadline, t.claim_expires_at, t.status, t.at_most_once, t.application, \
         t.namespace, t.taskname, t.on_attempts_exceeded, t.bucket, t.retry_max_attempts, \
         t.retry_delay_on_retry"
    };
}

fn activation_from_row(row: &Row) -> StoreResult<InflightActivation> {
    let id: String = row
        .try_get(0)
        .map_err(|err| query_error("decode_row", err))?;
    let get = |err: tokio_postgres::Error| StoreError::InvalidRow {
        id: id.clone(),
        column: "row",
        value: err.to_string(),
    };
    let status: String = row.try_get(13).map_err(get)?;
    let status = status
        .parse::<ActivationStatus>()
        .map_err(|value| StoreError::InvalidRow {
            id: id.clone(),
            column: "status",
            value,
        })?;
    let on_attempts_exceeded: i32 = row.try_get(18).map_err(get)?;
    let on_attempts_exceeded =
        OnAttemptsExceeded::from_i32(on_attempts_exceeded).ok_or_else(|| {
            StoreError::InvalidRow {
                id: id.clone(),
                column: "on_attempts_exceeded",
                value: on_attempts_exceeded.to_string(),
            }
        })?;
    let retry_edit = super::retry_edit_from_columns(
        &id,
        row.try_get(20).map_err(get)?,
        row.try_get(21).map_err(get)?,
    )?;
    Ok(InflightActivation {
        activation: row.try_get(1).map_err(get)?,
        topic: row.try_get(2).map_err(get)?,
        partition: row.try_get(3).map_err(get)?,
        kafka_offset: row.try_get(4).map_err(get)?,
        added_at: row.try_get(5).map_err(get)?,
        received_at: row.try_get(6).map_err(get)?,
        processing_attempts: row.try_get(7).map_err(get)?,
        expires_at: row.try_get(8).map_err(get)?,
        delay_until: row.try_get(9).map_err(get)?,
        processing_deadline_duration: row.try_get(10).map_err(get)?,
        processing_deadline: row.try_get(11).map_err(get)?,
        claim_expires_at: row.try_get(12).map_err(get)?,
        status,
        at_most_once: row.try_get(14).map_err(get)?,
        application: row.try_get(15).map_err(get)?,
        namespace: row.try_get(16).map_err(get)?,
        taskname: row.try_get(17).map_err(get)?,
        on_attempts_exceeded,
        bucket: row.try_get(19).map_err(get)?,
        retry_edit,
        id,
    })
}

fn activations_from_rows(rows: &[Row]) -> StoreResult<Vec<InflightActivation>> {
    rows.iter().map(activation_from_row).collect()
}

fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

fn limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

fn split_tokens(claims: &[ClaimToken]) -> (Vec<&str>, Vec<DateTime<Utc>>) {
    claims
        .iter()
        .map(|claim| (claim.id.as_str(), claim.claim_expires_at))
        .unzip()
}

// Bounded statements pick their rows in a MATERIALIZED CTE: a
// `WHERE id IN (SELECT .. LIMIT n FOR UPDATE SKIP LOCKED)` may be re-run per
// outer row and then touch far more than `n` rows.

const INSERT: &str = concat!(
    "INSERT INTO inflight_taskactivations (",
    columns!(),
    ") SELECT * FROM unnest($1::text[], $2::bytea[], $3::text[], $4::int4[], $5::int8[], \
     $6::timestamptz[], $7::timestamptz[], $8::int4[], $9::timestamptz[], $10::timestamptz[], \
     $11::int4[], $12::timestamptz[], $13::timestamptz[], $14::text[], $15::bool[], $16::text[], \
     $17::text[], $18::text[], $19::int4[], $20::int2[], $21::int8[], $22::int8[]) \
     ON CONFLICT (id) DO NOTHING"
);

// The new expiry is strictly later than any this row had, even if the clock
// or the lease went backwards: that is what makes the fence unambiguous.
const CLAIM_FOR_PUSH: &str = concat!(
    "WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Pending' AND bucket BETWEEN $1 AND $2 \
         AND (expires_at IS NULL OR expires_at > now()) \
       ORDER BY added_at LIMIT $3 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Claimed', \
       claim_expires_at = GREATEST(now() + $4::int8 * interval '1 microsecond', \
                                   t.claim_expires_at + interval '1 microsecond') \
     FROM picked WHERE t.id = picked.id RETURNING ",
    columns!(t)
);

macro_rules! claim_for_pull {
    ($filter:literal) => {
        concat!(
            "WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations \
               WHERE status = 'Pending' AND (expires_at IS NULL OR expires_at > now()) ",
            $filter,
            " ORDER BY added_at LIMIT 1 FOR UPDATE SKIP LOCKED) \
             UPDATE inflight_taskactivations t SET status = 'Processing', \
               processing_deadline = now() + ($1::float8 + t.processing_deadline_duration) \
                                              * interval '1 second' \
             FROM picked WHERE t.id = picked.id RETURNING ",
            columns!(t)
        )
    };
}
const CLAIM_FOR_PULL_ANY: &str = claim_for_pull!("AND $2::text IS NULL AND $3::text IS NULL");
const CLAIM_FOR_PULL_APPLICATION: &str =
    claim_for_pull!("AND application = $2 AND $3::text IS NULL");
const CLAIM_FOR_PULL_NAMESPACE: &str = claim_for_pull!("AND application = $2 AND namespace = $3");

// Batch writes by id lock their rows in id order first (`held`): two
// batches touching the same rows (a push pool marking pushes while workers
// report results) would otherwise lock them in different orders and
// deadlock. The fence (status and claim_expires_at) is re-checked on the
// locked row version.
macro_rules! fenced_claims {
    () => {
        "WITH held AS MATERIALIZED (SELECT t.id FROM inflight_taskactivations t \
           JOIN unnest($1::text[], $2::timestamptz[]) AS r(id, claim_expires_at) \
             ON t.id = r.id AND t.claim_expires_at = r.claim_expires_at \
           WHERE t.status = 'Claimed' ORDER BY t.id FOR UPDATE OF t) "
    };
}

const RELEASE_CLAIMS: &str = concat!(
    fenced_claims!(),
    "UPDATE inflight_taskactivations t SET status = 'Pending' \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed'"
);

const MARK_PROCESSING: &str = concat!(
    fenced_claims!(),
    "UPDATE inflight_taskactivations t SET status = 'Processing', \
       processing_deadline = now() + ($3::float8 + t.processing_deadline_duration) \
                                      * interval '1 second' \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed' RETURNING t.id"
);

const FAIL_CLAIM_ATTEMPT: &str = concat!(
    fenced_claims!(),
    "UPDATE inflight_taskactivations t \
       SET processing_attempts = t.processing_attempts + 1, \
           status = CASE WHEN t.processing_attempts + 1 >= $3 THEN 'Failure' ELSE 'Pending' END \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed'"
);

// The push used up the task's one delivery: the attempt counts.
const FAIL_CLAIMS: &str = concat!(
    fenced_claims!(),
    "UPDATE inflight_taskactivations t \
       SET processing_attempts = t.processing_attempts + 1, status = 'Failure' \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed'"
);

const DEFER_CLAIMS: &str = concat!(
    fenced_claims!(),
    "UPDATE inflight_taskactivations t SET status = 'Delay', delay_until = $3 \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed'"
);

// Counts are over distinct ids; `existing` is read from the statement's
// snapshot, i.e. before the update. `late` marks reports that likely come
// from an earlier delivery (the row is past its processing deadline, or was
// delivered before): `held` keeps the locked row's values from before the
// update, so the count needs no second query.
macro_rules! set_status {
    ($reports:literal, $set:literal) => {
        concat!(
            "WITH u AS (SELECT DISTINCT ON (id) * FROM ",
            $reports,
            "), \
             held AS MATERIALIZED (SELECT t.id, \
                 (t.status = 'Processing' AND t.processing_deadline < now()) \
                   OR t.processing_attempts > 0 AS late \
               FROM inflight_taskactivations t JOIN u ON t.id = u.id \
               WHERE t.status IN ('Claimed', 'Processing') ORDER BY t.id FOR UPDATE OF t), \
             updated AS (UPDATE inflight_taskactivations t SET status = u.status",
            $set,
            " FROM u, held \
               WHERE t.id = u.id AND t.id = held.id AND t.status IN ('Claimed', 'Processing') \
               RETURNING held.late) \
             SELECT (SELECT count(*) FROM u), \
                    (SELECT count(*) FROM inflight_taskactivations t JOIN u ON t.id = u.id), \
                    (SELECT count(*) FROM updated), \
                    (SELECT count(*) FROM updated WHERE late)"
        )
    };
}
const SET_STATUS: &str = set_status!("unnest($1::text[], $2::text[]) AS u(id, status)", "");
// A batch where some RETRY reports carry edits: the same statement, which
// also stores each edit's given values with its row, under the same fence.
const SET_STATUS_WITH_EDITS: &str = set_status!(
    "unnest($1::text[], $2::text[], $3::int8[], $4::int8[]) \
       AS u(id, status, max_attempts, delay_on_retry)",
    ", retry_max_attempts = COALESCE(u.max_attempts, t.retry_max_attempts), \
     retry_delay_on_retry = COALESCE(u.delay_on_retry, t.retry_delay_on_retry)"
);

const DELETE_BATCH: &str = "DELETE FROM inflight_taskactivations WHERE id = ANY($1)";

const RELEASE_EXPIRED_CLAIMS: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Claimed' AND claim_expires_at < now() \
       ORDER BY claim_expires_at LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Pending' \
     FROM picked WHERE t.id = picked.id AND t.status = 'Claimed'";

const HANDLE_PROCESSING_DEADLINES: &str = "WITH due AS MATERIALIZED (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Processing' AND processing_deadline < now() \
       ORDER BY processing_deadline LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t \
       SET status = CASE WHEN t.at_most_once THEN 'Failure' ELSE 'Pending' END, \
           processing_attempts = t.processing_attempts + 1, processing_deadline = NULL \
     FROM due WHERE t.id = due.id AND t.status = 'Processing' RETURNING t.at_most_once";

const FAIL_EXHAUSTED_ATTEMPTS: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Pending' AND processing_attempts >= $1 \
       LIMIT $2 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Failure' \
     FROM picked WHERE t.id = picked.id AND t.status = 'Pending'";

const REMOVE_EXPIRED: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations \
       WHERE status = 'Pending' AND expires_at IS NOT NULL AND expires_at < now() \
       LIMIT $1 FOR UPDATE SKIP LOCKED) \
     DELETE FROM inflight_taskactivations t USING picked \
     WHERE t.id = picked.id AND t.status = 'Pending'";

const RELEASE_DELAYED: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Delay' AND delay_until <= now() \
       ORDER BY delay_until LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Pending' \
     FROM picked WHERE t.id = picked.id AND t.status = 'Delay'";

macro_rules! take_for_publish {
    ($filter:literal) => {
        concat!(
            "WITH picked AS MATERIALIZED (SELECT id FROM inflight_taskactivations WHERE ",
            $filter,
            " AND (publish_expires_at IS NULL OR publish_expires_at < now()) \
              ORDER BY added_at LIMIT $1 FOR UPDATE SKIP LOCKED) \
             UPDATE inflight_taskactivations t \
               SET publish_expires_at = now() + $2::int8 * interval '1 microsecond' \
             FROM picked WHERE t.id = picked.id RETURNING ",
            columns!(t)
        )
    };
}
const TAKE_RETRIES: &str = take_for_publish!("status = 'Retry'");
const TAKE_DEAD_LETTERS: &str =
    take_for_publish!("status = 'Failure' AND on_attempts_exceeded = 2");

const DISCARD_FAILURES: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Failure' AND on_attempts_exceeded <> 2 \
       LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE inflight_taskactivations t SET status = 'Complete' \
     FROM picked WHERE t.id = picked.id AND t.status = 'Failure'";

const MARK_PUBLISHED: &str = "UPDATE inflight_taskactivations SET status = 'Complete' \
     WHERE id = ANY($1) AND status IN ('Retry', 'Failure')";

const REMOVE_COMPLETED: &str = "WITH picked AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Complete' \
       LIMIT $1 FOR UPDATE SKIP LOCKED) \
     DELETE FROM inflight_taskactivations t USING picked \
     WHERE t.id = picked.id AND t.status = 'Complete'";

const COUNT_BY_STATUS: &str =
    "SELECT status, count(*) FROM inflight_taskactivations GROUP BY status";

const MAX_PENDING_LAG: &str = "SELECT COALESCE(GREATEST(EXTRACT(EPOCH FROM \
       now() - min(GREATEST(received_at, COALESCE(delay_until, received_at)))), 0), 0)::float8 \
     FROM inflight_taskactivations \
     WHERE status IN ('Pending', 'Claimed') AND processing_attempts = 0";

const GET: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM inflight_taskactivations WHERE id = $1"
);

#[async_trait]
impl ActivationStore for PostgresStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    async fn migrate(&self) -> StoreResult<()> {
        let migration_error = |err: tokio_postgres::Error| StoreError::Migration(describe(&err));
        let mut pg_config: tokio_postgres::Config = self
            .url
            .parse()
            .map_err(|err| StoreError::Config(format!("invalid PostgreSQL URL: {err}")))?;
        pg_config.connect_timeout(self.connect_timeout);
        let (mut client, connection) = pg_config.connect(NoTls).await.map_err(migration_error)?;
        let driver = tokio::spawn(connection);
        // A session lock, held by this connection only: if this process dies
        // mid-migration the lock goes with its connection.
        client
            .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY])
            .await
            .map_err(migration_error)?;
        let outcome = embedded::migrations::runner()
            .run_async(&mut client)
            .await
            .map(|_| ())
            .map_err(|err| StoreError::Migration(err.to_string()));
        let unlocked = client
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY])
            .await;
        drop(client);
        let _ = driver.await;
        outcome?;
        unlocked.map_err(migration_error)?;
        Ok(())
    }

    async fn ping(&self) -> StoreResult<()> {
        const OP: &str = "ping";
        let client = self.client(&self.pool, OP).await?;
        client
            .simple_query("SELECT 1")
            .await
            .map(drop)
            .map_err(|e| query_error(OP, e))
    }

    async fn insert_batch(&self, rows: &[InflightActivation]) -> StoreResult<u64> {
        const OP: &str = "insert_batch";
        if rows.is_empty() {
            return Ok(0);
        }
        let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        let activations: Vec<&[u8]> = rows.iter().map(|r| r.activation.as_slice()).collect();
        let topics: Vec<&str> = rows.iter().map(|r| r.topic.as_str()).collect();
        let partitions: Vec<i32> = rows.iter().map(|r| r.partition).collect();
        let offsets: Vec<i64> = rows.iter().map(|r| r.kafka_offset).collect();
        let added: Vec<DateTime<Utc>> = rows.iter().map(|r| r.added_at).collect();
        let received: Vec<DateTime<Utc>> = rows.iter().map(|r| r.received_at).collect();
        let attempts: Vec<i32> = rows.iter().map(|r| r.processing_attempts).collect();
        let expires: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.expires_at).collect();
        let delays: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.delay_until).collect();
        let durations: Vec<i32> = rows
            .iter()
            .map(|r| r.processing_deadline_duration)
            .collect();
        let deadlines: Vec<Option<DateTime<Utc>>> =
            rows.iter().map(|r| r.processing_deadline).collect();
        let claims: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.claim_expires_at).collect();
        let statuses: Vec<&str> = rows.iter().map(|r| r.status.as_str()).collect();
        let at_most_once: Vec<bool> = rows.iter().map(|r| r.at_most_once).collect();
        let applications: Vec<&str> = rows.iter().map(|r| r.application.as_str()).collect();
        let namespaces: Vec<&str> = rows.iter().map(|r| r.namespace.as_str()).collect();
        let tasknames: Vec<&str> = rows.iter().map(|r| r.taskname.as_str()).collect();
        let exceeded: Vec<i32> = rows
            .iter()
            .map(|r| r.on_attempts_exceeded.as_i32())
            .collect();
        let buckets: Vec<i16> = rows.iter().map(|r| r.bucket).collect();
        let (edit_attempts, edit_delays): (Vec<Option<i64>>, Vec<Option<i64>>) = rows
            .iter()
            .map(|r| super::retry_edit_columns(&r.retry_edit))
            .unzip();

        self.execute(
            &self.pool,
            OP,
            INSERT,
            &[
                &ids,
                &activations,
                &topics,
                &partitions,
                &offsets,
                &added,
                &received,
                &attempts,
                &expires,
                &delays,
                &durations,
                &deadlines,
                &claims,
                &statuses,
                &at_most_once,
                &applications,
                &namespaces,
                &tasknames,
                &exceeded,
                &buckets,
                &edit_attempts,
                &edit_delays,
            ],
        )
        .await
    }

    async fn claim_for_push(
        &self,
        buckets: BucketRange,
        limit_rows: usize,
        lease: Duration,
    ) -> StoreResult<Vec<ClaimedActivation>> {
        const OP: &str = "claim_for_push";
        if limit_rows == 0 {
            return Ok(Vec::new());
        }
        let rows = self
            .query(
                &self.replayable,
                OP,
                CLAIM_FOR_PUSH,
                &[
                    &buckets.first,
                    &buckets.last,
                    &limit(limit_rows),
                    &micros(lease),
                ],
            )
            .await?;
        claimed_rows(activations_from_rows(&rows)?)
    }

    async fn claim_for_pull(
        &self,
        filter: &PullFilter,
        deadline_grace: Duration,
    ) -> StoreResult<Option<InflightActivation>> {
        const OP: &str = "claim_for_pull";
        let sql = match (&filter.application, &filter.namespace) {
            (None, None) => CLAIM_FOR_PULL_ANY,
            (Some(_), None) => CLAIM_FOR_PULL_APPLICATION,
            (Some(_), Some(_)) => CLAIM_FOR_PULL_NAMESPACE,
            (None, Some(_)) => return Ok(None),
        };
        let rows = self
            .query(
                &self.pool,
                OP,
                sql,
                &[
                    &deadline_grace.as_secs_f64(),
                    &filter.application,
                    &filter.namespace,
                ],
            )
            .await?;
        rows.first().map(activation_from_row).transpose()
    }

    async fn release_claims(&self, claims: &[ClaimToken]) -> StoreResult<u64> {
        const OP: &str = "release_claims";
        if claims.is_empty() {
            return Ok(0);
        }
        let (ids, expiries) = split_tokens(claims);
        self.execute(&self.pool, OP, RELEASE_CLAIMS, &[&ids, &expiries])
            .await
    }

    async fn mark_processing(
        &self,
        claims: &[ClaimToken],
        deadline_grace: Duration,
    ) -> StoreResult<Vec<String>> {
        const OP: &str = "mark_processing";
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let (ids, expiries) = split_tokens(claims);
        let rows = self
            .query(
                &self.replayable,
                OP,
                MARK_PROCESSING,
                &[&ids, &expiries, &deadline_grace.as_secs_f64()],
            )
            .await?;
        rows.iter()
            .map(|row| row.try_get(0).map_err(|e| query_error(OP, e)))
            .collect()
    }

    async fn fail_claim_attempt(
        &self,
        claims: &[ClaimToken],
        max_attempts: u32,
    ) -> StoreResult<u64> {
        const OP: &str = "fail_claim_attempt";
        if claims.is_empty() {
            return Ok(0);
        }
        let (ids, expiries) = split_tokens(claims);
        let max_attempts = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        self.execute(
            &self.pool,
            OP,
            FAIL_CLAIM_ATTEMPT,
            &[&ids, &expiries, &max_attempts],
        )
        .await
    }

    async fn set_status(&self, updates: &[StatusUpdate]) -> StoreResult<StatusUpdateOutcome> {
        const OP: &str = "set_status";
        if updates.is_empty() {
            return Ok(StatusUpdateOutcome::default());
        }
        let ids: Vec<&str> = updates.iter().map(|u| u.id.as_str()).collect();
        let statuses: Vec<&str> = updates
            .iter()
            .map(|u| u.status.as_status().as_str())
            .collect();
        // One statement either way; only a batch with edits names them.
        let rows = if updates.iter().any(StatusUpdate::edits_retry_state) {
            let (edit_attempts, edit_delays): (Vec<Option<i64>>, Vec<Option<i64>>) = updates
                .iter()
                .map(|u| super::retry_edit_columns(&u.retry_edit()))
                .unzip();
            self.query(
                &self.pool,
                OP,
                SET_STATUS_WITH_EDITS,
                &[&ids, &statuses, &edit_attempts, &edit_delays],
            )
            .await?
        } else {
            self.query(&self.pool, OP, SET_STATUS, &[&ids, &statuses])
                .await?
        };
        let row = rows.into_iter().next();
        let row = row.ok_or(StoreError::Query {
            operation: OP,
            message: "status counts returned no row".to_owned(),
        })?;
        let count = |index: usize| -> StoreResult<u64> {
            let value: i64 = row.try_get(index).map_err(|e| query_error(OP, e))?;
            Ok(u64::try_from(value).unwrap_or(0))
        };
        let (distinct, existing, updated) = (count(0)?, count(1)?, count(2)?);
        Ok(StatusUpdateOutcome {
            updated,
            ignored: existing.saturating_sub(updated),
            missing: distinct.saturating_sub(existing),
            late: count(3)?,
        })
    }

    async fn delete_batch(&self, ids: &[String]) -> StoreResult<u64> {
        const OP: &str = "delete_batch";
        if ids.is_empty() {
            return Ok(0);
        }
        self.execute(&self.replayable, OP, DELETE_BATCH, &[&ids])
            .await
    }

    async fn release_expired_claims(&self, limit_rows: usize) -> StoreResult<u64> {
        self.execute(
            &self.pool,
            "release_expired_claims",
            RELEASE_EXPIRED_CLAIMS,
            &[&limit(limit_rows)],
        )
        .await
    }

    async fn handle_processing_deadlines(&self, limit_rows: usize) -> StoreResult<DeadlineOutcome> {
        const OP: &str = "handle_processing_deadlines";
        let rows = self
            .query(
                &self.pool,
                OP,
                HANDLE_PROCESSING_DEADLINES,
                &[&limit(limit_rows)],
            )
            .await?;
        let mut outcome = DeadlineOutcome::default();
        for row in &rows {
            let at_most_once: bool = row.try_get(0).map_err(|e| query_error(OP, e))?;
            if at_most_once {
                outcome.failed += 1;
            } else {
                outcome.retried += 1;
            }
        }
        Ok(outcome)
    }

    async fn fail_exhausted_attempts(
        &self,
        max_attempts: u32,
        limit_rows: usize,
    ) -> StoreResult<u64> {
        let max_attempts = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        self.execute(
            &self.pool,
            "fail_exhausted_attempts",
            FAIL_EXHAUSTED_ATTEMPTS,
            &[&max_attempts, &limit(limit_rows)],
        )
        .await
    }

    async fn remove_expired(&self, limit_rows: usize) -> StoreResult<u64> {
        self.execute(
            &self.pool,
            "remove_expired",
            REMOVE_EXPIRED,
            &[&limit(limit_rows)],
        )
        .await
    }

    async fn release_delayed(&self, limit_rows: usize) -> StoreResult<u64> {
        self.execute(
            &self.pool,
            "release_delayed",
            RELEASE_DELAYED,
            &[&limit(limit_rows)],
        )
        .await
    }

    async fn take_for_publish(
        &self,
        kind: PublishKind,
        limit_rows: usize,
        lease: Duration,
    ) -> StoreResult<Vec<InflightActivation>> {
        const OP: &str = "take_for_publish";
        let sql = match kind {
            PublishKind::Retry => TAKE_RETRIES,
            PublishKind::DeadLetter => TAKE_DEAD_LETTERS,
        };
        let rows = self
            .query(&self.pool, OP, sql, &[&limit(limit_rows), &micros(lease)])
            .await?;
        activations_from_rows(&rows)
    }

    async fn discard_failures(&self, limit_rows: usize) -> StoreResult<u64> {
        self.execute(
            &self.pool,
            "discard_failures",
            DISCARD_FAILURES,
            &[&limit(limit_rows)],
        )
        .await
    }

    async fn mark_published(&self, ids: &[String]) -> StoreResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        self.execute(&self.pool, "mark_published", MARK_PUBLISHED, &[&ids])
            .await
    }

    async fn remove_completed(&self, limit_rows: usize) -> StoreResult<u64> {
        self.execute(
            &self.replayable,
            "remove_completed",
            REMOVE_COMPLETED,
            &[&limit(limit_rows)],
        )
        .await
    }

    async fn count_by_status(&self) -> StoreResult<StatusCounts> {
        const OP: &str = "count_by_status";
        let rows = self.query(&self.pool, OP, COUNT_BY_STATUS, &[]).await?;
        let mut counts = StatusCounts::default();
        for row in &rows {
            let status: String = row.try_get(0).map_err(|e| query_error(OP, e))?;
            let count: i64 = row.try_get(1).map_err(|e| query_error(OP, e))?;
            super::add_status_count(&mut counts, &status, count)?;
        }
        Ok(counts)
    }

    async fn max_pending_lag(&self) -> StoreResult<f64> {
        const OP: &str = "max_pending_lag";
        let rows = self.query(&self.pool, OP, MAX_PENDING_LAG, &[]).await?;
        let row = rows.first().ok_or(StoreError::Query {
            operation: OP,
            message: "aggregate returned no row".to_owned(),
        })?;
        row.try_get(0).map_err(|e| query_error(OP, e))
    }

    async fn get(&self, id: &str) -> StoreResult<Option<InflightActivation>> {
        const OP: &str = "get";
        let rows = self.query(&self.pool, OP, GET, &[&id]).await?;
        rows.first().map(activation_from_row).transpose()
    }

    async fn fail_claims(&self, claims: &[ClaimToken]) -> StoreResult<u64> {
        const OP: &str = "fail_claims";
        if claims.is_empty() {
            return Ok(0);
        }
        let (ids, expiries) = split_tokens(claims);
        self.execute(&self.pool, OP, FAIL_CLAIMS, &[&ids, &expiries])
            .await
    }

    async fn defer_claims(&self, claims: &[ClaimToken], until: DateTime<Utc>) -> StoreResult<u64> {
        const OP: &str = "defer_claims";
        if claims.is_empty() {
            return Ok(0);
        }
        let (ids, expiries) = split_tokens(claims);
        self.execute(&self.pool, OP, DEFER_CLAIMS, &[&ids, &expiries, &until])
            .await
    }
}

impl PostgresStore {
    /// Runs one prepared statement and returns its rows.
    async fn query(
        &self,
        pool: &Pool,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<Vec<Row>> {
        let client = self.client(pool, operation).await?;
        let statement = client
            .prepare_cached(sql)
            .await
            .map_err(|e| query_error(operation, e))?;
        client
            .query(&statement, params)
            .await
            .map_err(|e| query_error(operation, e))
    }

    /// Runs one prepared statement and returns the rows it affected.
    async fn execute(
        &self,
        pool: &Pool,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<u64> {
        let client = self.client(pool, operation).await?;
        let statement = client
            .prepare_cached(sql)
            .await
            .map_err(|e| query_error(operation, e))?;
        client
            .execute(&statement, params)
            .await
            .map_err(|e| query_error(operation, e))
    }
}
