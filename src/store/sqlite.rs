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
//! transaction committed. Reads (`get`, counts, lag) run on a small pool of
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
//! Space: the database is created with `auto_vacuum = INCREMENTAL`; when
//! upkeep removes finished rows and the free list grows past
//! [`FREE_PAGES_KEPT`], a bounded `incremental_vacuum` returns pages to the
//! file system, so the file tracks the in-flight rows, not the history.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension, Row, params};
use tokio::sync::oneshot;

use super::{ActivationStore, StoreError, StoreResult, claimed_rows};
use crate::model::{
    ActivationStatus, BucketRange, ClaimToken, ClaimedActivation, DeadlineOutcome,
    InflightActivation, OnAttemptsExceeded, PublishKind, PullFilter, StatusCounts, StatusUpdate,
    StatusUpdateOutcome, WorkerStatus,
};

mod embedded {
    refinery::embed_migrations!("migrations/sqlite");
}

/// Free pages (4 KiB each) left in the file for reuse before
/// `incremental_vacuum` gives the rest back: 8 MiB of slack.
const FREE_PAGES_KEPT: i64 = 2048;
/// Pages one upkeep pass may return, so a vacuum never stalls the writer.
const VACUUM_PAGES_PER_PASS: i64 = 1024;
/// Operations one group-commit transaction may hold.
const MAX_GROUP: usize = 256;
/// After a checkpoint, the WAL file is truncated to this size.
const JOURNAL_SIZE_LIMIT: i64 = 64 * 1024 * 1024;

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
}

impl SqliteStoreConfig {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        SqliteStoreConfig {
            path: path.into(),
            readers: 4,
            async_commit: false,
            busy_timeout: Duration::from_secs(5),
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
}

/// Called once the transaction holding an operation has committed (`Ok`) or
/// failed (`Err`); delivers the operation's result to its caller.
type Completion = Box<dyn FnOnce(StoreResult<()>) + Send>;

/// One operation for the writer thread. Given the connection (or the error
/// that prevented opening a transaction), runs and reports whether it
/// succeeded, so the writer can keep or roll back its savepoint.
type WriteJob = Box<dyn FnOnce(Result<&Connection, &StoreError>) -> (bool, Completion) + Send>;

enum Command {
    Write {
        durable: bool,
        job: WriteJob,
    },
    /// Runs alone, outside any transaction (migrations).
    Exclusive(Box<dyn FnOnce(&mut Connection) + Send>),
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
        let readers = Arc::clone(&self.readers);
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
}

fn writer_gone(operation: &'static str) -> StoreError {
    StoreError::Unavailable {
        operation,
        message: "the SQLite writer thread has stopped".to_owned(),
    }
}

/// The path every name of one database file shares: symlinks and `..` resolved. The file may
/// not exist yet, so its directory is resolved and the name joined back.
fn canonical_path(path: &Path) -> StoreResult<PathBuf> {
    let resolve = |p: &Path| {
        std::fs::canonicalize(p).map_err(|err| {
            StoreError::Config(format!("cannot resolve SQLite path {}: {err}", p.display()))
        })
    };
    if path.exists() {
        return resolve(path);
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
    let name = path.file_name().ok_or_else(|| {
        StoreError::Config(format!("SQLite path {} names no file", path.display()))
    })?;
    Ok(resolve(parent.unwrap_or(Path::new(".")))?.join(name))
}

/// Locks `<file>.lock` beside the database, keyed on the file's canonical path, so a second
/// process reaching the same file by another name (a symlink, a relative path) is refused too.
fn lock_for_this_process(path: &Path) -> StoreResult<std::fs::File> {
    let path = canonical_path(path)?;
    let path = path.as_path();
    let mut lock_path = path.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|err| {
            StoreError::Config(format!(
                "cannot open lock file {}: {err}",
                lock_path.display()
            ))
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Config(format!(
            "SQLite database {} is in use by another taskbroker process (it holds {}); \
             the embedded store serves one process, use PostgreSQL for several replicas",
            path.display(),
            lock_path.display()
        ))),
        Err(std::fs::TryLockError::Error(err)) => Err(StoreError::Config(format!(
            "cannot lock {}: {err}",
            lock_path.display()
        ))),
    }
}

fn open_writer(path: &Path, busy_timeout: Duration) -> StoreResult<Connection> {
    const OP: &str = "open";
    let connection = Connection::open(path).map_err(|err| {
        StoreError::Config(format!(
            "cannot open SQLite database {}: {err}",
            path.display()
        ))
    })?;
    connection
        .busy_timeout(busy_timeout)
        .map_err(|e| sql_error(OP, e))?;
    // auto_vacuum only takes effect on a database without tables, i.e. when
    // the file is new; an older file keeps what it was created with.
    connection
        .execute_batch("PRAGMA auto_vacuum = INCREMENTAL;")
        .map_err(|e| sql_error(OP, e))?;
    let mode: String = connection
        .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
        .map_err(|e| sql_error(OP, e))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Config(format!(
            "SQLite database {} cannot use WAL mode (got {mode}); is it on a network file system?",
            path.display()
        )));
    }
    connection
        .execute_batch("PRAGMA synchronous = FULL")
        .map_err(|e| sql_error(OP, e))?;
    connection
        .query_row(
            &format!("PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}"),
            [],
            |_| Ok(()),
        )
        .map_err(|e| sql_error(OP, e))?;
    connection.set_prepared_statement_cache_capacity(64);
    Ok(connection)
}

/// The writer thread: group commit until every sender is gone.
fn writer_loop(mut connection: Connection, commands: mpsc::Receiver<Command>, async_commit: bool) {
    let mut synchronous_full = true;
    while let Ok(first) = commands.recv() {
        let mut pending = vec![first];
        while pending.len() < MAX_GROUP {
            match commands.try_recv() {
                Ok(command) => pending.push(command),
                Err(_) => break,
            }
        }
        let mut group = Vec::with_capacity(pending.len());
        for command in pending {
            match command {
                Command::Write { durable, job } => group.push((durable, job)),
                Command::Exclusive(run) => {
                    commit_group(
                        &connection,
                        std::mem::take(&mut group),
                        async_commit,
                        &mut synchronous_full,
                    );
                    run(&mut connection);
                }
            }
        }
        commit_group(&connection, group, async_commit, &mut synchronous_full);
    }
}

fn commit_group(
    connection: &Connection,
    group: Vec<(bool, WriteJob)>,
    async_commit: bool,
    synchronous_full: &mut bool,
) {
    const OP: &str = "commit";
    if group.is_empty() {
        return;
    }
    // `synchronous` cannot change inside a transaction: choose it for the
    // whole group before BEGIN.
    let want_full = !async_commit || group.iter().any(|(durable, _)| *durable);
    if want_full != *synchronous_full {
        let pragma = if want_full {
            "PRAGMA synchronous = FULL"
        } else {
            "PRAGMA synchronous = NORMAL"
        };
        if connection.execute_batch(pragma).is_ok() {
            *synchronous_full = want_full;
        }
    }
    if let Err(err) = connection.execute_batch("BEGIN IMMEDIATE") {
        let err = sql_error(OP, err);
        for (_, job) in group {
            let (_, complete) = job(Err(&err));
            complete(Err(err.clone()));
        }
        return;
    }
    let mut completions: Vec<Completion> = Vec::with_capacity(group.len());
    for (_, job) in group {
        let savepoint = connection.execute_batch("SAVEPOINT op");
        if let Err(err) = savepoint {
            let err = sql_error(OP, err);
            let (_, complete) = job(Err(&err));
            complete(Err(err));
            continue;
        }
        let (ok, complete) = job(Ok(connection));
        let end = if ok {
            connection.execute_batch("RELEASE op")
        } else {
            connection.execute_batch("ROLLBACK TO op; RELEASE op")
        };
        if let Err(err) = end {
            // The savepoint machinery itself failed: the transaction is in
            // an unknown state, so nothing in it may be reported done.
            let err = sql_error(OP, err);
            let _ = connection.execute_batch("ROLLBACK");
            complete(Err(err.clone()));
            for complete in completions {
                complete(Err(err.clone()));
            }
            return;
        }
        completions.push(complete);
    }
    let committed = connection.execute_batch("COMMIT").map_err(|err| {
        let _ = connection.execute_batch("ROLLBACK");
        sql_error(OP, err)
    });
    for complete in completions {
        complete(committed.clone());
    }
}

/// Read-only connections, opened on demand and kept up to `max_idle`.
struct ReaderPool {
    path: PathBuf,
    busy_timeout: Duration,
    max_idle: usize,
    idle: Mutex<Vec<Connection>>,
}

impl ReaderPool {
    fn take(&self, operation: &'static str) -> StoreResult<Connection> {
        if let Some(connection) = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Ok(connection);
        }
        let connection = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| sql_error(operation, e))?;
        connection
            .busy_timeout(self.busy_timeout)
            .map_err(|e| sql_error(operation, e))?;
        Ok(connection)
    }

    fn put(&self, connection: Connection) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < self.max_idle {
            idle.push(connection);
        }
    }
}

/// Lock contention and I/O trouble (disk full, file gone) may pass:
/// `Unavailable`. Data SQLite refuses is `Rejected`; any other statement it
/// rejects is a `Query` error.
fn sql_error(operation: &'static str, err: rusqlite::Error) -> StoreError {
    let unavailable = matches!(
        err.sqlite_error_code(),
        Some(
            ErrorCode::DatabaseBusy
                | ErrorCode::DatabaseLocked
                | ErrorCode::SystemIoFailure
                | ErrorCode::DiskFull
                | ErrorCode::CannotOpen
                | ErrorCode::OutOfMemory
        )
    );
    // The rows themselves are at fault: a value too big, a constraint, a
    // type mismatch, a parameter out of range. Retrying cannot help.
    let rejected = matches!(
        err.sqlite_error_code(),
        Some(
            ErrorCode::TooBig
                | ErrorCode::ConstraintViolation
                | ErrorCode::TypeMismatch
                | ErrorCode::ParameterOutOfRange
        )
    );
    let message = err.to_string();
    if unavailable {
        StoreError::Unavailable { operation, message }
    } else if rejected {
        StoreError::Rejected { operation, message }
    } else {
        StoreError::Query { operation, message }
    }
}

fn micros_of(at: DateTime<Utc>) -> i64 {
    at.timestamp_micros()
}

fn now_micros() -> i64 {
    micros_of(Utc::now())
}

fn duration_micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

fn limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// The row columns, in the order `activation_from_row` reads them.
macro_rules! columns {
    () => {
        "id, activation, topic, partition, kafka_offset, added_at, received_at, \
         processing_attempts, expires_at, delay_until, processing_deadline_duration, \
         processing_deadline, claim_expires_at, status, at_most_once, application, namespace, \
         taskname, on_attempts_exceeded, bucket, retry_max_attempts, retry_delay_on_retry"
    };
}

fn activation_from_row(row: &Row<'_>) -> StoreResult<InflightActivation> {
    let id: String = row.get(0).map_err(|e| sql_error("decode_row", e))?;
    let invalid = |column: &'static str, value: String| StoreError::InvalidRow {
        id: id.clone(),
        column,
        value,
    };
    let get_err = |err: rusqlite::Error| invalid("row", err.to_string());
    let time = |index: usize, column: &'static str| -> StoreResult<DateTime<Utc>> {
        let micros: i64 = row.get(index).map_err(get_err)?;
        DateTime::from_timestamp_micros(micros).ok_or_else(|| invalid(column, micros.to_string()))
    };
    let optional_time =
        |index: usize, column: &'static str| -> StoreResult<Option<DateTime<Utc>>> {
            let micros: Option<i64> = row.get(index).map_err(get_err)?;
            micros
                .map(|micros| {
                    DateTime::from_timestamp_micros(micros)
                        .ok_or_else(|| invalid(column, micros.to_string()))
                })
                .transpose()
        };
    let status: String = row.get(13).map_err(get_err)?;
    let status = status
        .parse::<ActivationStatus>()
        .map_err(|value| invalid("status", value))?;
    let exceeded: i32 = row.get(18).map_err(get_err)?;
    let on_attempts_exceeded = OnAttemptsExceeded::from_i32(exceeded)
        .ok_or_else(|| invalid("on_attempts_exceeded", exceeded.to_string()))?;
    let retry_edit = super::retry_edit_from_columns(
        &id,
        row.get(20).map_err(get_err)?,
        row.get(21).map_err(get_err)?,
    )?;
    Ok(InflightActivation {
        activation: row.get(1).map_err(get_err)?,
        topic: row.get(2).map_err(get_err)?,
        partition: row.get(3).map_err(get_err)?,
        kafka_offset: row.get(4).map_err(get_err)?,
        added_at: time(5, "added_at")?,
        received_at: time(6, "received_at")?,
        processing_attempts: row.get(7).map_err(get_err)?,
        expires_at: optional_time(8, "expires_at")?,
        delay_until: optional_time(9, "delay_until")?,
        processing_deadline_duration: row.get(10).map_err(get_err)?,
        processing_deadline: optional_time(11, "processing_deadline")?,
        claim_expires_at: optional_time(12, "claim_expires_at")?,
        status,
        at_most_once: row.get(14).map_err(get_err)?,
        application: row.get(15).map_err(get_err)?,
        namespace: row.get(16).map_err(get_err)?,
        taskname: row.get(17).map_err(get_err)?,
        on_attempts_exceeded,
        bucket: row.get(19).map_err(get_err)?,
        retry_edit,
        id,
    })
}

/// Runs a statement returning whole rows (`RETURNING` or `SELECT`).
fn query_rows(
    connection: &Connection,
    operation: &'static str,
    sql: &str,
    params: impl rusqlite::Params,
) -> StoreResult<Vec<InflightActivation>> {
    let mut statement = connection
        .prepare_cached(sql)
        .map_err(|e| sql_error(operation, e))?;
    let mut rows = statement
        .query(params)
        .map_err(|e| sql_error(operation, e))?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(|e| sql_error(operation, e))? {
        out.push(activation_from_row(row)?);
    }
    Ok(out)
}

/// Runs a statement and returns how many rows it changed.
fn execute(
    connection: &Connection,
    operation: &'static str,
    sql: &str,
    params: impl rusqlite::Params,
) -> StoreResult<u64> {
    let mut statement = connection
        .prepare_cached(sql)
        .map_err(|e| sql_error(operation, e))?;
    let changed = statement
        .execute(params)
        .map_err(|e| sql_error(operation, e))?;
    Ok(changed as u64)
}

/// JSON text of `values` as an array of strings, for `json_each(?)`:
/// a whole id list travels as one parameter, so a batch is one statement.
fn json_strings<'a>(values: impl IntoIterator<Item = &'a str>) -> String {
    let mut json = String::from("[");
    for (index, value) in values.into_iter().enumerate() {
        if index > 0 {
            json.push(',');
        }
        push_json_string(&mut json, value);
    }
    json.push(']');
    json
}

/// JSON text of claim tokens as `[[id, claim_expires_at µs], …]`.
fn json_tokens(claims: &[ClaimToken]) -> String {
    let mut json = String::from("[");
    for (index, claim) in claims.iter().enumerate() {
        if index > 0 {
            json.push(',');
        }
        json.push('[');
        push_json_string(&mut json, &claim.id);
        json.push(',');
        json.push_str(&micros_of(claim.claim_expires_at).to_string());
        json.push(']');
    }
    json.push(']');
    json
}

fn push_json_string(json: &mut String, value: &str) {
    json.push('"');
    for c in value.chars() {
        match c {
            '"' => json.push_str("\\\""),
            '\\' => json.push_str("\\\\"),
            c if u32::from(c) < 0x20 => json.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => json.push(c),
        }
    }
    json.push('"');
}

/// Runs one fenced statement over every claim token (`?1`, see
/// [`json_tokens`]; `?2` = `extra` if given) and returns the ids of the
/// rows it changed.
fn fenced(
    connection: &Connection,
    operation: &'static str,
    sql: &str,
    claims: &[ClaimToken],
    extra: Option<i64>,
) -> StoreResult<Vec<String>> {
    let mut statement = connection
        .prepare_cached(sql)
        .map_err(|e| sql_error(operation, e))?;
    let tokens = json_tokens(claims);
    let mut rows = match extra {
        Some(extra) => statement.query(params![tokens, extra]),
        None => statement.query(params![tokens]),
    }
    .map_err(|e| sql_error(operation, e))?;
    let mut moved = Vec::new();
    while let Some(row) = rows.next().map_err(|e| sql_error(operation, e))? {
        moved.push(row.get(0).map_err(|e| sql_error(operation, e))?);
    }
    Ok(moved)
}

const INSERT: &str = concat!(
    "INSERT INTO inflight_taskactivations (",
    columns!(),
    ") VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, \
     ?19, ?20, ?21, ?22) ON CONFLICT (id) DO NOTHING"
);

// The single writer makes "skip rows others hold" unnecessary: no other
// claim runs at the same time. `?4` is now + lease; the expiry is strictly
// later than any this row had.
const CLAIM_FOR_PUSH: &str = concat!(
    "UPDATE inflight_taskactivations \
       SET status = 'Claimed', claim_expires_at = max(?4, coalesce(claim_expires_at + 1, 0)) \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Pending' AND bucket BETWEEN ?1 AND ?2 \
         AND (expires_at IS NULL OR expires_at > ?5) \
       ORDER BY added_at LIMIT ?3) \
     RETURNING ",
    columns!()
);

// `?1` now, `?2` now + grace (µs), `?3` application, `?4` namespace.
macro_rules! claim_for_pull {
    ($filter:literal) => {
        concat!(
            "UPDATE inflight_taskactivations \
               SET status = 'Processing', \
                   processing_deadline = ?2 + processing_deadline_duration * 1000000 \
             WHERE id IN (SELECT id FROM inflight_taskactivations \
               WHERE status = 'Pending' AND (expires_at IS NULL OR expires_at > ?1) ",
            $filter,
            " ORDER BY added_at LIMIT 1) RETURNING ",
            columns!()
        )
    };
}
const CLAIM_FOR_PULL_ANY: &str = claim_for_pull!("AND ?3 IS NULL AND ?4 IS NULL");
const CLAIM_FOR_PULL_APPLICATION: &str = claim_for_pull!("AND application = ?3 AND ?4 IS NULL");
const CLAIM_FOR_PULL_NAMESPACE: &str = claim_for_pull!("AND application = ?3 AND namespace = ?4");

// Fenced by id, status and the exact claim_expires_at the holder saw: one
// statement for the whole batch, its tokens unpacked from one JSON array.
macro_rules! fenced_claims {
    ($set:literal) => {
        concat!(
            "UPDATE inflight_taskactivations AS t SET ",
            $set,
            " FROM (SELECT value ->> 0 AS id, value ->> 1 AS claim_expires_at \
                    FROM json_each(?1)) AS r \
             WHERE t.id = r.id AND t.claim_expires_at = r.claim_expires_at \
               AND t.status = 'Claimed' \
             RETURNING id"
        )
    };
}

const RELEASE_CLAIMS: &str = fenced_claims!("status = 'Pending'");

const MARK_PROCESSING: &str = fenced_claims!(
    "status = 'Processing', processing_deadline = ?2 + processing_deadline_duration * 1000000"
);

const FAIL_CLAIM_ATTEMPT: &str = fenced_claims!(
    "processing_attempts = processing_attempts + 1, \
     status = CASE WHEN processing_attempts + 1 >= ?2 THEN 'Failure' ELSE 'Pending' END"
);

// The push used up the task's one delivery: the attempt counts.
const FAIL_CLAIMS: &str =
    fenced_claims!("processing_attempts = processing_attempts + 1, status = 'Failure'");

const DEFER_CLAIMS: &str = fenced_claims!("status = 'Delay', delay_until = ?2");

// Answers one row when the report applied, saying whether it likely came
// from an earlier delivery (`?3` now): past the processing deadline, or
// delivered before. The update changes only `status` (and a RETRY's edit
// columns), so RETURNING sees the deadline and attempts as they were. Of Claimed and Processing rows only
// Processing ones carry a deadline (handing a task out sets it, deadline
// expiry clears it), so no status test is needed.
macro_rules! set_status {
    ($set:literal) => {
        concat!(
            "UPDATE inflight_taskactivations SET status = ?2",
            $set,
            " WHERE id = ?1 AND status IN ('Claimed', 'Processing') \
             RETURNING (processing_deadline IS NOT NULL AND processing_deadline < ?3) \
               OR processing_attempts > 0"
        )
    };
}
const SET_STATUS: &str = set_status!("");
// A RETRY report with edits: the same statement, which also stores the
// edit's given values (`?4`, `?5`) with the row, under the same fence.
const SET_STATUS_WITH_EDIT: &str = set_status!(
    ", retry_max_attempts = coalesce(?4, retry_max_attempts), \
     retry_delay_on_retry = coalesce(?5, retry_delay_on_retry)"
);

const EXISTS: &str = "SELECT 1 FROM inflight_taskactivations WHERE id = ?1";

const DELETE_BATCH: &str = "DELETE FROM inflight_taskactivations \
     WHERE id IN (SELECT value FROM json_each(?1))";

const RELEASE_EXPIRED_CLAIMS: &str = "UPDATE inflight_taskactivations SET status = 'Pending' \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Claimed' AND claim_expires_at < ?1 ORDER BY claim_expires_at LIMIT ?2)";

const HANDLE_PROCESSING_DEADLINES: &str = "UPDATE inflight_taskactivations \
       SET status = CASE WHEN at_most_once THEN 'Failure' ELSE 'Pending' END, \
           processing_attempts = processing_attempts + 1, processing_deadline = NULL \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Processing' AND processing_deadline < ?1 \
       ORDER BY processing_deadline LIMIT ?2) \
     RETURNING at_most_once";

const FAIL_EXHAUSTED_ATTEMPTS: &str = "UPDATE inflight_taskactivations SET status = 'Failure' \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Pending' AND processing_attempts >= ?1 LIMIT ?2)";

const REMOVE_EXPIRED: &str = "DELETE FROM inflight_taskactivations \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Pending' AND expires_at IS NOT NULL AND expires_at < ?1 LIMIT ?2)";

const RELEASE_DELAYED: &str = "UPDATE inflight_taskactivations SET status = 'Pending' \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Delay' AND delay_until <= ?1 ORDER BY delay_until LIMIT ?2)";

// `?1` now, `?2` limit, `?3` now + lease.
macro_rules! take_for_publish {
    ($filter:literal) => {
        concat!(
            "UPDATE inflight_taskactivations SET publish_expires_at = ?3 \
             WHERE id IN (SELECT id FROM inflight_taskactivations WHERE ",
            $filter,
            " AND (publish_expires_at IS NULL OR publish_expires_at < ?1) \
               ORDER BY added_at LIMIT ?2) RETURNING ",
            columns!()
        )
    };
}
const TAKE_RETRIES: &str = take_for_publish!("status = 'Retry'");
const TAKE_DEAD_LETTERS: &str =
    take_for_publish!("status = 'Failure' AND on_attempts_exceeded = 2");

const DISCARD_FAILURES: &str = "UPDATE inflight_taskactivations SET status = 'Complete' \
     WHERE id IN (SELECT id FROM inflight_taskactivations \
       WHERE status = 'Failure' AND on_attempts_exceeded <> 2 LIMIT ?1)";

const MARK_PUBLISHED: &str = "UPDATE inflight_taskactivations SET status = 'Complete' \
     WHERE id IN (SELECT value FROM json_each(?1)) AND status IN ('Retry', 'Failure')";

const REMOVE_COMPLETED: &str = "DELETE FROM inflight_taskactivations \
     WHERE id IN (SELECT id FROM inflight_taskactivations WHERE status = 'Complete' LIMIT ?1)";

const COUNT_BY_STATUS: &str =
    "SELECT status, count(*) FROM inflight_taskactivations GROUP BY status";

const OLDEST_RUNNABLE: &str = "SELECT min(max(received_at, coalesce(delay_until, received_at))) \
     FROM inflight_taskactivations \
     WHERE status IN ('Pending', 'Claimed') AND processing_attempts = 0";

const GET: &str = concat!(
    "SELECT ",
    columns!(),
    " FROM inflight_taskactivations WHERE id = ?1"
);

#[async_trait]
impl ActivationStore for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn migrate(&self) -> StoreResult<()> {
        let (reply, result) = oneshot::channel();
        self.writer
            .send(Command::Exclusive(Box::new(move |connection| {
                let outcome = embedded::migrations::runner()
                    .run(connection)
                    .map(|_| ())
                    .map_err(|err| StoreError::Migration(err.to_string()));
                let _ = reply.send(outcome);
            })))
            .map_err(|_| writer_gone("migrate"))?;
        result.await.map_err(|_| writer_gone("migrate"))?
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
        let lease = duration_micros(lease);
        self.write(OP, false, move |connection| {
            let now = now_micros();
            let claimed = query_rows(
                connection,
                OP,
                CLAIM_FOR_PUSH,
                params![
                    buckets.first,
                    buckets.last,
                    limit(limit_rows),
                    now.saturating_add(lease),
                    now
                ],
            )?;
            claimed_rows(claimed)
        })
        .await
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
        let filter = filter.clone();
        let grace = duration_micros(deadline_grace);
        self.write(OP, true, move |connection| {
            let now = now_micros();
            let rows = query_rows(
                connection,
                OP,
                sql,
                params![
                    now,
                    now.saturating_add(grace),
                    filter.application,
                    filter.namespace
                ],
            )?;
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
                let status = status_name(update.status);
                let applied: Option<bool> = if update.edits_retry_state() {
                    let (edit_attempts, edit_delay) =
                        super::retry_edit_columns(&update.retry_edit());
                    connection
                        .prepare_cached(SET_STATUS_WITH_EDIT)
                        .and_then(|mut statement| {
                            statement
                                .query_row(
                                    params![
                                        update.id,
                                        status,
                                        now_micros(),
                                        edit_attempts,
                                        edit_delay
                                    ],
                                    |row| row.get(0),
                                )
                                .optional()
                        })
                } else {
                    connection
                        .prepare_cached(SET_STATUS)
                        .and_then(|mut statement| {
                            statement
                                .query_row(params![update.id, status, now_micros()], |row| {
                                    row.get(0)
                                })
                                .optional()
                        })
                }
                .map_err(|e| sql_error(OP, e))?;
                if let Some(late) = applied {
                    outcome.updated += 1;
                    outcome.late += u64::from(late);
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
        const OP: &str = "delete_batch";
        if ids.is_empty() {
            return Ok(0);
        }
        let ids = json_strings(ids.iter().map(String::as_str));
        self.write(OP, false, move |connection| {
            execute(connection, OP, DELETE_BATCH, params![ids])
        })
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

    async fn discard_failures(&self, limit_rows: usize) -> StoreResult<u64> {
        const OP: &str = "discard_failures";
        self.write(OP, true, move |connection| {
            execute(connection, OP, DISCARD_FAILURES, params![limit(limit_rows)])
        })
        .await
    }

    async fn mark_published(&self, ids: &[String]) -> StoreResult<u64> {
        const OP: &str = "mark_published";
        if ids.is_empty() {
            return Ok(0);
        }
        let ids = json_strings(ids.iter().map(String::as_str));
        self.write(OP, true, move |connection| {
            execute(connection, OP, MARK_PUBLISHED, params![ids])
        })
        .await
    }

    async fn remove_completed(&self, limit_rows: usize) -> StoreResult<u64> {
        const OP: &str = "remove_completed";
        self.write(OP, false, move |connection| {
            let removed = execute(connection, OP, REMOVE_COMPLETED, params![limit(limit_rows)])?;
            if removed > 0 {
                reclaim_free_pages(connection)?;
            }
            Ok(removed)
        })
        .await
    }

    async fn count_by_status(&self) -> StoreResult<StatusCounts> {
        const OP: &str = "count_by_status";
        self.read(OP, |connection| {
            let mut statement = connection
                .prepare_cached(COUNT_BY_STATUS)
                .map_err(|e| sql_error(OP, e))?;
            let mut rows = statement.query([]).map_err(|e| sql_error(OP, e))?;
            let mut counts = StatusCounts::default();
            while let Some(row) = rows.next().map_err(|e| sql_error(OP, e))? {
                let status: String = row.get(0).map_err(|e| sql_error(OP, e))?;
                let count: i64 = row.get(1).map_err(|e| sql_error(OP, e))?;
                super::add_status_count(&mut counts, &status, count)?;
            }
            Ok(counts)
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

fn status_name(status: WorkerStatus) -> &'static str {
    status.as_status().as_str()
}

fn exists(connection: &Connection, id: &str) -> StoreResult<bool> {
    const OP: &str = "set_status";
    connection
        .prepare_cached(EXISTS)
        .and_then(|mut statement| {
            statement
                .query_row(params![id], |_| Ok(()))
                .optional()
                .map(|found| found.is_some())
        })
        .map_err(|e| sql_error(OP, e))
}

/// Gives free pages beyond [`FREE_PAGES_KEPT`] back to the file system,
/// at most [`VACUUM_PAGES_PER_PASS`] per call.
fn reclaim_free_pages(connection: &Connection) -> StoreResult<()> {
    const OP: &str = "remove_completed";
    let free: i64 = connection
        .query_row("PRAGMA freelist_count", [], |row| row.get(0))
        .map_err(|e| sql_error(OP, e))?;
    let excess = free - FREE_PAGES_KEPT;
    if excess > 0 {
        // The vacuum runs as the statement is stepped: step it to the end.
        let mut statement = connection
            .prepare(&format!(
                "PRAGMA incremental_vacuum({})",
                excess.min(VACUUM_PAGES_PER_PASS)
            ))
            .map_err(|e| sql_error(OP, e))?;
        let mut rows = statement.query([]).map_err(|e| sql_error(OP, e))?;
        while rows.next().map_err(|e| sql_error(OP, e))?.is_some() {}
    }
    Ok(())
}
