//! SQLite backend, for a single-node broker with no database server.
//!
//! One file in WAL mode. All writes go through **one writer thread** that
//! owns the only read-write connection: SQLite allows one writer at a time
//! anyway, and owning it means no lock contention, no `SQLITE_BUSY` between
//! our own connections, and claims that cannot race (a claim is a plain
//! `UPDATE … WHERE id IN (SELECT … LIMIT n)` because no other writer exists).
//! The writer drains its queue and runs everything queued in one transaction
//! (group commit), each operation inside a savepoint so one failing
//! operation rolls back alone. Callers get their result only after the
//! transaction committed. Reads (`get`, counts, lag, ping) run on a small pool of
//! read-only connections on tokio's blocking pool, concurrently with the
//! writer, as WAL allows. Nothing blocking runs on an async executor.
//!
//! Timestamps are INTEGER microseconds since the epoch, taken from this
//! process's clock (there is only one process). Equality on
//! `claim_expires_at` is exact, and each claim writes
//! `max(now + lease, previous + 1 µs)`, so the fence is as strict as
//! PostgreSQL's.
//!
//! Durability follows `DB_ASYNC_COMMIT` like PostgreSQL: a group holding an
//! insert or a worker result always commits with `synchronous = FULL`;
//! groups of only replayable transitions may commit with `NORMAL` (the
//! process can crash without loss either way; only an OS crash or power
//! cut can drop those, and leases replay them).
//!
//! Space: the database is created with `auto_vacuum = INCREMENTAL` (a file
//! created without it is rewritten once at open); deleted rows' pages go
//! to the free list, and upkeep's `reclaim_space` gives what exceeds a
//! slack back to the file system in bounded runs (`writer.rs`), so the
//! file tracks the in-flight rows, not the history.
//!
//! This file is the store itself: its configuration, opening, and the
//! `ActivationStore` operations as jobs for the writer or the readers. The
//! writer thread and its transactions are in `writer.rs`, the reader pool in
//! `reader.rs`, the statements in `sql.rs`, row and parameter mapping in
//! `rows.rs`, running a statement and classifying errors in `exec.rs`, and
//! the one-process lock in `lock.rs`.

mod brokers;
mod exec;
mod fair;
mod lock;
mod reader;
mod rows;
mod sql;
mod writer;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use rusqlite::{Connection, params};
use tokio::sync::oneshot;

use self::exec::{apply_report, execute, exists, fenced, named_counts, query_rows, sql_error};
use self::fair::claim_fair;
use self::lock::lock_for_this_process;
use self::reader::ReaderPool;
use self::rows::{duration_micros, json_strings, limit, micros_of, now_micros};
use self::sql::*;
use self::writer::{Command, WriteJob, open_writer, reclaim_space, writer_gone, writer_loop};
use super::view::{GroupCount, Inspection, NearExpiry, StoreView};
use super::{ActivationStore, SpaceReclaim, StoreError, StoreResult, claimed_rows};
use crate::model::{
    ActivationStatus, BucketRange, ClaimToken, ClaimedActivation, DeadlineOutcome, Dispatch,
    InflightActivation, Killswitch, NamespaceCount, PauseRule, PublishKind, PullFilter,
    StatusCounts, StatusUpdate, StatusUpdateOutcome,
};

mod embedded {
    refinery::embed_migrations!("migrations/sqlite");
}

/// Settings for [`SqliteStore::open`].
#[derive(Debug, Clone)]
pub struct SqliteStoreConfig {
    pub path: PathBuf,
    /// Read-only connections for `get`, counts and lag (at least 1).
    pub readers: usize,
    /// See the module docs: replayable transitions may skip the fsync.
    pub async_commit: bool,
    /// How long a statement waits for a lock held by another process
    /// (e.g. a `sqlite3` shell) before the operation fails as `Unavailable`.
    pub busy_timeout: Duration,
    /// The broker this store claims for (`claimed_by`, its row in
    /// `taskbroker_brokers`): `TASKBROKER_BROKER_ID`.
    pub broker_id: String,
    /// Most activation bytes one push claim returns (`FETCH_BATCH_BYTES`;
    /// always at least one row).
    pub claim_max_bytes: usize,
}

impl SqliteStoreConfig {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        SqliteStoreConfig {
            path: path.into(),
            readers: 4,
            async_commit: false,
            busy_timeout: Duration::from_secs(5),
            broker_id: super::fresh_broker_id(),
            claim_max_bytes: super::DEFAULT_CLAIM_MAX_BYTES,
        }
    }
}

pub struct SqliteStore {
    path: PathBuf,
    writer: mpsc::Sender<Command>,
    readers: Arc<ReaderPool>,
    /// Exclusive lock on `<path>.lock`, held while the store is open: a
    /// second broker process on the same file refuses to start instead of
    /// competing for the writer lock. The kernel drops it if we die.
    _process_lock: std::fs::File,
    /// The byte budget of a push claim (`within_bytes!` in sql.rs).
    claim_max_bytes: usize,
    /// Written into every claim (`claimed_by`).
    broker_id: String,
}

impl SqliteStore {
    /// Opens (creating if needed) the database file and starts the writer
    /// thread. Fails with a clear message when the file cannot be opened.
    pub fn open(config: &SqliteStoreConfig) -> StoreResult<Self> {
        if let Some(parent) = config.path.parent().filter(|p| !p.as_os_str().is_empty())
            && !parent.is_dir()
        {
            return Err(StoreError::Config(format!(
                "SQLite path {}: directory {} does not exist",
                config.path.display(),
                parent.display()
            )));
        }
        let process_lock = lock_for_this_process(&config.path)?;
        let connection = open_writer(&config.path, config.busy_timeout)?;
        let (sender, receiver) = mpsc::channel();
        let async_commit = config.async_commit;
        std::thread::Builder::new()
            .name("sqlite-writer".to_owned())
            .spawn(move || writer_loop(connection, receiver, async_commit))
            .map_err(|err| StoreError::Config(format!("cannot start SQLite writer: {err}")))?;
        Ok(SqliteStore {
            path: config.path.clone(),
            writer: sender,
            readers: Arc::new(ReaderPool {
                path: config.path.clone(),
                busy_timeout: config.busy_timeout,
                max_idle: config.readers.max(1),
                idle: Mutex::new(Vec::new()),
            }),
            _process_lock: process_lock,
            broker_id: config.broker_id.clone(),
            claim_max_bytes: config.claim_max_bytes,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Queues `operation` on the writer and waits for its committed result.
    /// `durable` operations (inserts, worker results) always commit with a
    /// full fsync.
    async fn write<T, F>(&self, operation: &'static str, durable: bool, run: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        let (reply, result) = oneshot::channel();
        let job: WriteJob = Box::new(move |connection| match connection {
            Err(err) => {
                let err = err.clone();
                (false, Box::new(move |_| drop(reply.send(Err(err)))))
            }
            Ok(connection) => match run(connection) {
                Ok(value) => (
                    true,
                    Box::new(move |committed: StoreResult<()>| {
                        drop(reply.send(committed.map(|()| value)))
                    }),
                ),
                Err(err) => (false, Box::new(move |_| drop(reply.send(Err(err))))),
            },
        });
        self.writer
            .send(Command::Write { durable, job })
            .map_err(|_| writer_gone(operation))?;
        result.await.map_err(|_| writer_gone(operation))?
    }

    /// Runs `run` on the writer between two group commits, outside any
    /// transaction (migrations, checkpoints), and waits for its result.
    async fn exclusive<T, F>(&self, operation: &'static str, run: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> StoreResult<T> + Send + 'static,
    {
        let (reply, result) = oneshot::channel();
        self.writer
            .send(Command::Exclusive(Box::new(move |connection| {
                drop(reply.send(run(connection)));
            })))
            .map_err(|_| writer_gone(operation))?;
        result.await.map_err(|_| writer_gone(operation))?
    }

    /// A statement over rows named by id (`?1`, a JSON array); no ids, no
    /// statement. Answers the rows it changed.
    async fn write_by_ids(
        &self,
        operation: &'static str,
        durable: bool,
        sql: &'static str,
        ids: &[String],
    ) -> StoreResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let ids = json_strings(ids.iter().map(String::as_str));
        self.write(operation, durable, move |connection| {
            execute(connection, operation, sql, params![ids])
        })
        .await
    }

    /// An upkeep statement over rows due by now: `?1` now, `?2` limit.
    async fn due_now(
        &self,
        operation: &'static str,
        sql: &'static str,
        limit_rows: usize,
    ) -> StoreResult<u64> {
        self.write(operation, true, move |connection| {
            execute(
                connection,
                operation,
                sql,
                params![now_micros(), limit(limit_rows)],
            )
        })
        .await
    }

    /// The database file and the files SQLite and the store keep beside it
    /// (WAL, shared memory, process lock): what to remove with the database.
    pub fn files(path: &Path) -> [PathBuf; 4] {
        ["", "-wal", "-shm", ".lock"].map(|suffix| {
            let mut file = path.as_os_str().to_owned();
            file.push(suffix);
            PathBuf::from(file)
        })
    }

    /// Runs `read` on a read-only connection on the blocking pool.
    async fn read<T, F>(&self, operation: &'static str, read: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    {
        read_on(&self.readers, operation, read).await
    }
}

/// Runs `read` on a read-only connection of `readers`, on tokio's blocking pool.
async fn read_on<T, F>(
    readers: &Arc<ReaderPool>,
    operation: &'static str,
    read: F,
) -> StoreResult<T>
where
    T: Send + 'static,
    F: FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
{
    let readers = Arc::clone(readers);
    tokio::task::spawn_blocking(move || {
        let connection = readers.take(operation)?;
        let result = read(&connection);
        readers.put(connection);
        result
    })
    .await
    .map_err(|err| StoreError::Unavailable {
        operation,
        message: format!("read task failed: {err}"),
    })?
}

/// A read-only view of an SQLite store file (`taskbroker inspect`): opens
/// the file read-only, with neither the writer nor the one-process lock, so
/// it is safe beside the broker that owns the file (WAL lets readers run
/// while it writes).
pub struct SqliteView {
    readers: Arc<ReaderPool>,
}

impl SqliteView {
    /// Fails with a clear message when there is no database at `path`.
    pub fn open(path: &Path) -> StoreResult<SqliteView> {
        if !path.is_file() {
            return Err(StoreError::Config(format!(
                "no SQLite database at {} (TASKBROKER_SQLITE_PATH)",
                path.display()
            )));
        }
        Ok(SqliteView {
            readers: Arc::new(ReaderPool {
                path: path.to_owned(),
                busy_timeout: Duration::from_secs(5),
                max_idle: 1,
                idle: Mutex::new(Vec::new()),
            }),
        })
    }
}

#[async_trait]
impl StoreView for SqliteView {
    async fn inspect(&self, near: Duration, limit_rows: usize) -> StoreResult<Inspection> {
        const OP: &str = "inspect";
        let due_before = now_micros().saturating_add(duration_micros(near));
        read_on(&self.readers, OP, move |connection| {
            let failed = |e| sql_error(OP, e);
            let status = |id: &str, value: String| {
                value
                    .parse::<ActivationStatus>()
                    .map_err(|value| StoreError::InvalidRow {
                        id: id.to_owned(),
                        column: "status",
                        value,
                    })
            };
            let time = |id: &str, micros: i64| {
                DateTime::from_timestamp_micros(micros).ok_or_else(|| StoreError::InvalidRow {
                    id: id.to_owned(),
                    column: "time",
                    value: micros.to_string(),
                })
            };
            let mut groups = Vec::new();
            let mut statement = connection.prepare(INSPECT_GROUPS).map_err(failed)?;
            let mut rows = statement.query([]).map_err(failed)?;
            while let Some(row) = rows.next().map_err(failed)? {
                let oldest: Option<i64> = row.get(4).map_err(failed)?;
                groups.push(GroupCount {
                    status: status("(count)", row.get(0).map_err(failed)?)?,
                    namespace: row.get(1).map_err(failed)?,
                    taskname: row.get(2).map_err(failed)?,
                    count: u64::try_from(row.get::<_, i64>(3).map_err(failed)?).unwrap_or(0),
                    oldest_received: oldest.map(|micros| time("(count)", micros)).transpose()?,
                    bytes: u64::try_from(row.get::<_, i64>(5).map_err(failed)?).unwrap_or(0),
                });
            }
            let mut near_expiry = Vec::new();
            let mut statement = connection.prepare(INSPECT_NEAR_EXPIRY).map_err(failed)?;
            let mut rows = statement
                .query(params![due_before, limit(limit_rows)])
                .map_err(failed)?;
            while let Some(row) = rows.next().map_err(failed)? {
                let id: String = row.get(0).map_err(failed)?;
                near_expiry.push(NearExpiry {
                    namespace: row.get(1).map_err(failed)?,
                    taskname: row.get(2).map_err(failed)?,
                    status: status(&id, row.get(3).map_err(failed)?)?,
                    due: time(&id, row.get(4).map_err(failed)?)?,
                    id,
                });
            }
            Ok(Inspection {
                groups,
                near_expiry,
            })
        })
        .await
    }

    async fn row(&self, id: &str) -> StoreResult<Option<InflightActivation>> {
        const OP: &str = "get";
        let id = id.to_owned();
        read_on(&self.readers, OP, move |connection| {
            Ok(query_rows(connection, OP, GET, params![id])?
                .into_iter()
                .next())
        })
        .await
    }
}

#[async_trait]
impl ActivationStore for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn migrate(&self) -> StoreResult<()> {
        self.exclusive("migrate", |connection| {
            embedded::migrations::runner()
                .run(connection)
                .map(|_| ())
                .map_err(|err| StoreError::Migration(err.to_string()))
        })
        .await
    }

    async fn ping(&self) -> StoreResult<()> {
        const OP: &str = "ping";
        self.read(OP, |connection| {
            connection
                .query_row("SELECT 1", [], |_| Ok(()))
                .map_err(|e| sql_error(OP, e))
        })
        .await
    }

    async fn insert_batch(&self, rows: &[InflightActivation]) -> StoreResult<u64> {
        const OP: &str = "insert_batch";
        if rows.is_empty() {
            return Ok(0);
        }
        let rows = rows.to_vec();
        self.write(OP, true, move |connection| {
            let mut statement = connection
                .prepare_cached(INSERT)
                .map_err(|e| sql_error(OP, e))?;
            let mut inserted = 0;
            for r in &rows {
                let (edit_attempts, edit_delay) = super::retry_edit_columns(&r.retry_edit);
                inserted += statement
                    .execute(params![
                        r.id,
                        r.activation,
                        r.topic,
                        r.partition,
                        r.kafka_offset,
                        micros_of(r.added_at),
                        micros_of(r.received_at),
                        r.processing_attempts,
                        r.expires_at.map(micros_of),
                        r.delay_until.map(micros_of),
                        r.processing_deadline_duration,
                        r.processing_deadline.map(micros_of),
                        r.claim_expires_at.map(micros_of),
                        r.status.as_str(),
                        r.at_most_once,
                        r.application,
                        r.namespace,
                        r.taskname,
                        r.on_attempts_exceeded.as_i32(),
                        r.bucket,
                        edit_attempts,
                        edit_delay,
                    ])
                    .map_err(|e| sql_error(OP, e))? as u64;
            }
            Ok(inserted)
        })
        .await
    }

    async fn claim_for_push_except(
        &self,
        buckets: BucketRange,
        limit_rows: usize,
        lease: Duration,
        paused: &[PauseRule],
        dispatch: Dispatch<'_>,
    ) -> StoreResult<Vec<ClaimedActivation>> {
        const OP: &str = "claim_for_push";
        if limit_rows == 0 {
            return Ok(Vec::new());
        }
        let lease = duration_micros(lease);
        let fair = match dispatch {
            Dispatch::OldestFirst => None,
            Dispatch::Fair(weights) => Some((weights.to_vec(), paused.to_vec())),
        };
        let paused = (!paused.is_empty()).then(|| json_pause_rules(paused));
        let claimer = self.broker_id.clone();
        let budget = self.claim_max_bytes;
        self.write(OP, false, move |connection| {
            let now = now_micros();
            let expiry = now.saturating_add(lease);
            let mut claimed = Vec::new();
            if let Some((weights, paused)) = &fair {
                claimed = claim_fair(
                    connection,
                    buckets,
                    (limit_rows, budget),
                    (expiry, &claimer),
                    now,
                    weights,
                    paused,
                )?;
            }
            let room = limit_rows.saturating_sub(claimed.len());
            let claimed_bytes: usize = claimed.iter().map(|row| row.activation.len()).sum();
            if room == 0 || claimed_bytes >= budget {
                return claimed_rows(claimed);
            }
            // Oldest first: the whole claim, or what fair shares left.
            let (first, last, limit_rows) = (buckets.first, buckets.last, limit(room));
            let left = byte_param(budget - claimed_bytes);
            claimed.extend(match &paused {
                None => query_rows(
                    connection,
                    OP,
                    CLAIM_FOR_PUSH,
                    params![first, last, limit_rows, expiry, now, claimer, left],
                )?,
                Some(paused) => query_rows(
                    connection,
                    OP,
                    CLAIM_FOR_PUSH_UNPAUSED,
                    params![first, last, limit_rows, expiry, now, claimer, left, paused],
                )?,
            });
            claimed_rows(claimed)
        })
        .await
    }

    async fn claim_limited(
        &self,
        namespace: &str,
        max_in_flight: u32,
        limit_rows: usize,
        lease: Duration,
    ) -> StoreResult<Vec<ClaimedActivation>> {
        const OP: &str = "claim_limited";
        if limit_rows == 0 {
            return Ok(Vec::new());
        }
        let namespace = namespace.to_owned();
        let lease = duration_micros(lease);
        let claimer = self.broker_id.clone();
        let budget = byte_param(self.claim_max_bytes);
        self.write(OP, false, move |connection| {
            let in_flight: i64 = connection
                .prepare_cached(COUNT_NAMESPACE_IN_FLIGHT)
                .and_then(|mut statement| statement.query_row(params![namespace], |row| row.get(0)))
                .map_err(|e| sql_error(OP, e))?;
            let room = i64::from(max_in_flight).saturating_sub(in_flight);
            if room <= 0 {
                return Ok(Vec::new());
            }
            let now = now_micros();
            let claimed = query_rows(
                connection,
                OP,
                CLAIM_LIMITED,
                params![
                    namespace,
                    room.min(limit(limit_rows)),
                    now.saturating_add(lease),
                    now,
                    claimer,
                    budget
                ],
            )?;
            claimed_rows(claimed)
        })
        .await
    }

    async fn claim_for_pull_except(
        &self,
        filter: &PullFilter,
        deadline_grace: Duration,
        paused: &[PauseRule],
    ) -> StoreResult<Option<InflightActivation>> {
        const OP: &str = "claim_for_pull";
        let sql = match (&filter.application, &filter.namespace, paused.is_empty()) {
            (None, Some(_), _) => return Ok(None),
            (None, None, true) => CLAIM_FOR_PULL_ANY,
            (Some(_), None, true) => CLAIM_FOR_PULL_APPLICATION,
            (Some(_), Some(_), true) => CLAIM_FOR_PULL_NAMESPACE,
            (None, None, false) => CLAIM_FOR_PULL_ANY_UNPAUSED,
            (Some(_), None, false) => CLAIM_FOR_PULL_APPLICATION_UNPAUSED,
            (Some(_), Some(_), false) => CLAIM_FOR_PULL_NAMESPACE_UNPAUSED,
        };
        let filter = filter.clone();
        let grace = duration_micros(deadline_grace);
        let paused = (!paused.is_empty()).then(|| json_pause_rules(paused));
        self.write(OP, true, move |connection| {
            let now = now_micros();
            let deadline = now.saturating_add(grace);
            let rows = match &paused {
                None => query_rows(
                    connection,
                    OP,
                    sql,
                    params![now, deadline, filter.application, filter.namespace],
                )?,
                Some(paused) => query_rows(
                    connection,
                    OP,
                    sql,
                    params![now, deadline, filter.application, filter.namespace, paused],
                )?,
            };
            Ok(rows.into_iter().next())
        })
        .await
    }

    async fn release_claims(&self, claims: &[ClaimToken]) -> StoreResult<u64> {
        const OP: &str = "release_claims";
        if claims.is_empty() {
            return Ok(0);
        }
        let claims = claims.to_vec();
        // Durable: a lost release would only be replayed by the lease, but
        // it is rare and small, so it pays for the fsync.
        self.write(OP, true, move |connection| {
            fenced(connection, OP, RELEASE_CLAIMS, &claims, None).map(|ids| ids.len() as u64)
        })
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
        let claims = claims.to_vec();
        let grace = duration_micros(deadline_grace);
        self.write(OP, false, move |connection| {
            let deadline_base = now_micros().saturating_add(grace);
            fenced(
                connection,
                OP,
                MARK_PROCESSING,
                &claims,
                Some(deadline_base),
            )
        })
        .await
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
        let claims = claims.to_vec();
        let max_attempts = i64::from(max_attempts);
        self.write(OP, true, move |connection| {
            fenced(
                connection,
                OP,
                FAIL_CLAIM_ATTEMPT,
                &claims,
                Some(max_attempts),
            )
            .map(|ids| ids.len() as u64)
        })
        .await
    }

    async fn set_status(&self, updates: &[StatusUpdate]) -> StoreResult<StatusUpdateOutcome> {
        const OP: &str = "set_status";
        if updates.is_empty() {
            return Ok(StatusUpdateOutcome::default());
        }
        // One update per id, the first given, as PostgreSQL's DISTINCT ON.
        let mut seen = HashSet::with_capacity(updates.len());
        let updates: Vec<StatusUpdate> = updates
            .iter()
            .filter(|update| seen.insert(update.id.clone()))
            .cloned()
            .collect();
        self.write(OP, true, move |connection| {
            let mut outcome = StatusUpdateOutcome::default();
            for update in &updates {
                if let Some((late, namespace)) = apply_report(connection, update)? {
                    outcome.add_applied(&namespace, update.status, late);
                } else if exists(connection, &update.id)? {
                    outcome.ignored += 1;
                } else {
                    outcome.missing += 1;
                }
            }
            Ok(outcome)
        })
        .await
    }

    async fn delete_batch(&self, ids: &[String]) -> StoreResult<u64> {
        self.write_by_ids("delete_batch", false, DELETE_BATCH, ids)
            .await
    }

    async fn release_expired_claims(&self, limit_rows: usize) -> StoreResult<u64> {
        self.due_now("release_expired_claims", RELEASE_EXPIRED_CLAIMS, limit_rows)
            .await
    }

    async fn handle_processing_deadlines(&self, limit_rows: usize) -> StoreResult<DeadlineOutcome> {
        const OP: &str = "handle_processing_deadlines";
        self.write(OP, true, move |connection| {
            let mut statement = connection
                .prepare_cached(HANDLE_PROCESSING_DEADLINES)
                .map_err(|e| sql_error(OP, e))?;
            let mut rows = statement
                .query(params![now_micros(), limit(limit_rows)])
                .map_err(|e| sql_error(OP, e))?;
            let mut outcome = DeadlineOutcome::default();
            while let Some(row) = rows.next().map_err(|e| sql_error(OP, e))? {
                let at_most_once: bool = row.get(0).map_err(|e| sql_error(OP, e))?;
                if at_most_once {
                    outcome.failed += 1;
                } else {
                    outcome.retried += 1;
                }
            }
            Ok(outcome)
        })
        .await
    }

    async fn fail_exhausted_attempts(
        &self,
        max_attempts: u32,
        limit_rows: usize,
    ) -> StoreResult<u64> {
        const OP: &str = "fail_exhausted_attempts";
        self.write(OP, true, move |connection| {
            execute(
                connection,
                OP,
                FAIL_EXHAUSTED_ATTEMPTS,
                params![i64::from(max_attempts), limit(limit_rows)],
            )
        })
        .await
    }

    async fn remove_killswitched(
        &self,
        killswitches: &[Killswitch],
        limit_rows: usize,
    ) -> StoreResult<u64> {
        const OP: &str = "remove_killswitched";
        if killswitches.is_empty() {
            return Ok(0);
        }
        let patterns = json_pairs(killswitches.iter().map(Killswitch::sqlite_patterns));
        self.write(OP, true, move |connection| {
            execute(
                connection,
                OP,
                REMOVE_KILLSWITCHED,
                params![patterns, limit(limit_rows)],
            )
        })
        .await
    }

    async fn remove_expired(&self, limit_rows: usize) -> StoreResult<u64> {
        self.due_now("remove_expired", REMOVE_EXPIRED, limit_rows)
            .await
    }

    async fn release_delayed(&self, limit_rows: usize) -> StoreResult<u64> {
        self.due_now("release_delayed", RELEASE_DELAYED, limit_rows)
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
        let lease = duration_micros(lease);
        self.write(OP, true, move |connection| {
            let now = now_micros();
            query_rows(
                connection,
                OP,
                sql,
                params![now, limit(limit_rows), now.saturating_add(lease)],
            )
        })
        .await
    }

    async fn take_demoted(
        &self,
        namespaces: &[String],
        demoted_topic: &str,
        limit_rows: usize,
        lease: Duration,
    ) -> StoreResult<Vec<InflightActivation>> {
        const OP: &str = "take_demoted";
        if namespaces.is_empty() || limit_rows == 0 {
            return Ok(Vec::new());
        }
        let namespaces = json_strings(namespaces.iter().map(String::as_str));
        let topic = demoted_topic.to_owned();
        let lease = duration_micros(lease);
        self.write(OP, true, move |connection| {
            let now = now_micros();
            query_rows(
                connection,
                OP,
                TAKE_DEMOTED,
                params![
                    namespaces,
                    topic,
                    limit(limit_rows),
                    now.saturating_add(lease),
                    now
                ],
            )
        })
        .await
    }

    async fn remove_forwarded(&self, ids: &[String]) -> StoreResult<u64> {
        self.write_by_ids("remove_forwarded", true, REMOVE_FORWARDED, ids)
            .await
    }

    async fn discard_failures(&self, limit_rows: usize) -> StoreResult<u64> {
        const OP: &str = "discard_failures";
        self.write(OP, true, move |connection| {
            execute(connection, OP, DISCARD_FAILURES, params![limit(limit_rows)])
        })
        .await
    }

    async fn mark_published(&self, ids: &[String]) -> StoreResult<u64> {
        self.write_by_ids("mark_published", true, MARK_PUBLISHED, ids)
            .await
    }

    async fn remove_completed(&self, limit_rows: usize) -> StoreResult<u64> {
        const OP: &str = "remove_completed";
        self.write(OP, false, move |connection| {
            execute(connection, OP, REMOVE_COMPLETED, params![limit(limit_rows)])
        })
        .await
    }

    async fn reclaim_space(&self) -> StoreResult<Option<SpaceReclaim>> {
        let path = self.path.clone();
        let busy_timeout = self.readers.busy_timeout;
        self.exclusive("reclaim_space", move |connection| {
            reclaim_space(connection, &path, busy_timeout).map(Some)
        })
        .await
    }

    async fn count_by_status(&self) -> StoreResult<StatusCounts> {
        const OP: &str = "count_by_status";
        self.read(OP, |connection| {
            super::status_counts(named_counts(OP, connection, COUNT_BY_STATUS)?)
        })
        .await
    }

    async fn count_by_namespace(&self) -> StoreResult<Vec<NamespaceCount>> {
        const OP: &str = "count_by_namespace";
        self.read(OP, |connection| {
            let failed = |e| sql_error(OP, e);
            let mut statement = connection
                .prepare_cached(COUNT_BY_NAMESPACE)
                .map_err(failed)?;
            let mut rows = statement.query([]).map_err(failed)?;
            let mut counts = Vec::new();
            while let Some(row) = rows.next().map_err(failed)? {
                let oldest: Option<i64> = row.get(3).map_err(failed)?;
                counts.push(NamespaceCount {
                    namespace: row.get(0).map_err(failed)?,
                    status: super::parse_status(row.get(1).map_err(failed)?)?,
                    count: u64::try_from(row.get::<_, i64>(2).map_err(failed)?).unwrap_or(0),
                    oldest_runnable: oldest.and_then(DateTime::from_timestamp_micros),
                });
            }
            Ok(counts)
        })
        .await
    }

    async fn count_inflight_by_topic(&self) -> StoreResult<Vec<(String, u64)>> {
        const OP: &str = "count_inflight_by_topic";
        self.read(OP, |connection| {
            named_counts(OP, connection, COUNT_INFLIGHT_BY_TOPIC)
        })
        .await
    }

    async fn inflight_bytes_by_topic(&self) -> StoreResult<Vec<(String, u64)>> {
        const OP: &str = "inflight_bytes_by_topic";
        self.read(OP, |connection| {
            named_counts(OP, connection, INFLIGHT_BYTES_BY_TOPIC)
        })
        .await
    }

    async fn has_rows(&self) -> StoreResult<bool> {
        const OP: &str = "has_rows";
        self.read(OP, |connection| {
            connection
                .prepare_cached(HAS_ROWS)
                .and_then(|mut statement| statement.query_row([], |row| row.get(0)))
                .map_err(|e| sql_error(OP, e))
        })
        .await
    }

    async fn max_pending_lag(&self) -> StoreResult<f64> {
        const OP: &str = "max_pending_lag";
        self.read(OP, |connection| {
            let oldest: Option<i64> = connection
                .prepare_cached(OLDEST_RUNNABLE)
                .and_then(|mut statement| statement.query_row([], |row| row.get(0)))
                .map_err(|e| sql_error(OP, e))?;
            Ok(oldest
                .map(|oldest| (now_micros().saturating_sub(oldest)).max(0) as f64 / 1e6)
                .unwrap_or(0.0))
        })
        .await
    }

    async fn get(&self, id: &str) -> StoreResult<Option<InflightActivation>> {
        const OP: &str = "get";
        let id = id.to_owned();
        self.read(OP, move |connection| {
            Ok(query_rows(connection, OP, GET, params![id])?
                .into_iter()
                .next())
        })
        .await
    }

    async fn fail_claims(&self, claims: &[ClaimToken]) -> StoreResult<u64> {
        const OP: &str = "fail_claims";
        if claims.is_empty() {
            return Ok(0);
        }
        let claims = claims.to_vec();
        // Durable: losing it would deliver an at_most_once task again.
        self.write(OP, true, move |connection| {
            fenced(connection, OP, FAIL_CLAIMS, &claims, None).map(|ids| ids.len() as u64)
        })
        .await
    }

    async fn defer_claims(&self, claims: &[ClaimToken], until: DateTime<Utc>) -> StoreResult<u64> {
        const OP: &str = "defer_claims";
        if claims.is_empty() {
            return Ok(0);
        }
        let claims = claims.to_vec();
        let until = micros_of(until);
        self.write(OP, true, move |connection| {
            fenced(connection, OP, DEFER_CLAIMS, &claims, Some(until)).map(|ids| ids.len() as u64)
        })
        .await
    }
}

/// Paused rules as the JSON parameter of the `_UNPAUSED` claims: one
/// `[application, namespace]` pair per rule, "" for "any" (a rule never
/// names an empty one).
fn json_pause_rules(paused: &[PauseRule]) -> String {
    json_pairs(paused.iter().map(|rule| {
        (
            rule.application.clone().unwrap_or_default(),
            rule.namespace.clone().unwrap_or_default(),
        )
    }))
}

/// A JSON array of two-string arrays.
fn json_pairs(pairs: impl Iterator<Item = (String, String)>) -> String {
    let pairs: Vec<String> = pairs
        .map(|(first, second)| json_strings([first.as_str(), second.as_str()]))
        .collect();
    format!("[{}]", pairs.join(","))
}

/// A byte count as SQLite's integer.
fn byte_param(bytes: usize) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}
