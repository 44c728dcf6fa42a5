//! The write side of the SQLite store: the one read-write connection, owned
//! by one writer thread, which drains its queue and commits everything
//! queued in one transaction (group commit), each operation inside a
//! savepoint so a failing one rolls back alone. Also what only the writer
//! does to the file: its pragmas and giving free pages back.
//!
//! Giving space back: the file is in `auto_vacuum = INCREMENTAL` mode, so
//! deleting rows only puts their pages on the free list, where new rows
//! reuse them; [`reclaim_space`] hands pages beyond a slack back to the
//! file system with `incremental_vacuum`, bounded per run, and then
//! checkpoints and truncates the WAL so the shrink reaches the disk. It is
//! upkeep's job (one run per cycle while there is more to give back, else
//! one every 10 s), never part of a delete: a delete stays as cheap
//! as it is, and a burst's pages are given back after it drained, whichever
//! operation removed its rows.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use rusqlite::Connection;

use super::exec::sql_error;
use crate::store::{FileSpace, SpaceReclaim, StoreError, StoreResult};

/// Free space always left in the file for reuse: rows arriving next fill
/// free pages before the file grows, so giving back what is about to be
/// taken again would only cost writes.
const FREE_BYTES_KEPT: u64 = 8 << 20;
/// ... and a quarter of the file, so a store holding many rows keeps room
/// in proportion while a drained one shrinks down to [`FREE_BYTES_KEPT`].
const FREE_SHARE_KEPT: u64 = 4;
/// Pages one reclaim run gives back at most, in bytes. A run holds the
/// writer for its vacuum and checkpoint: 40 to 75 ms per 4 MiB run on a
/// drained file in a debug build on a 2-core VM (tests/sqlite_store.rs's
/// drain), most of it the commit's and the checkpoint's fsyncs, so one
/// run delays the writes queued behind it about as much as a few group
/// commits do.
const VACUUM_BYTES_PER_RUN: u64 = 4 << 20;
/// A WAL left larger than this (a burst written in big transactions) is
/// truncated by a reclaim run even with nothing to vacuum;
/// `journal_size_limit` alone would keep up to [`JOURNAL_SIZE_LIMIT`].
const WAL_BYTES_KEPT: u64 = 8 << 20;
/// `PRAGMA auto_vacuum`'s value for INCREMENTAL.
const AUTO_VACUUM_INCREMENTAL: i64 = 2;
/// Operations one group-commit transaction may hold.
const MAX_GROUP: usize = 256;
/// After a checkpoint, the WAL file is truncated to this size.
const JOURNAL_SIZE_LIMIT: i64 = 64 * 1024 * 1024;

/// Called once the transaction holding an operation has committed (`Ok`) or
/// failed (`Err`); delivers the operation's result to its caller.
pub(super) type Completion = Box<dyn FnOnce(StoreResult<()>) + Send>;

/// One operation for the writer thread. Given the connection (or the error
/// that prevented opening a transaction), runs and reports whether it
/// succeeded, so the writer can keep or roll back its savepoint.
pub(super) type WriteJob =
    Box<dyn FnOnce(Result<&Connection, &StoreError>) -> (bool, Completion) + Send>;

/// What the store asks of the writer thread.
pub(super) enum Command {
    Write {
        durable: bool,
        job: WriteJob,
    },
    /// Runs alone, outside any transaction (migrations, reclaiming space).
    Exclusive(Box<dyn FnOnce(&mut Connection) + Send>),
}

/// The error of an operation the writer thread can no longer take.
pub(super) fn writer_gone(operation: &'static str) -> StoreError {
    StoreError::Unavailable {
        operation,
        message: "the SQLite writer thread has stopped".to_owned(),
    }
}

/// Opens the one read-write connection: WAL, a full fsync per commit until a
/// group says otherwise, incremental vacuum on a new file.
pub(super) fn open_writer(path: &Path, busy_timeout: Duration) -> StoreResult<Connection> {
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
    // auto_vacuum must be set before the first table is created (before
    // WAL mode too, which writes the first page): on a new file it takes
    // effect here; a file created without it is switched below.
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
    switch_to_incremental_vacuum(&connection, path, busy_timeout)?;
    connection.set_prepared_statement_cache_capacity(64);
    Ok(connection)
}

/// A file created with `auto_vacuum = NONE` (not by this store: by hand,
/// or restored from an SQL dump with the `sqlite3` shell) never gives
/// space back: the pragma set at open reads back NONE on a file that has
/// tables, and only a full `VACUUM` rewrites it in the new mode. Done
/// once, at open, before the writer thread and the migrations start,
/// outside any transaction: it rewrites the whole file (through the WAL,
/// truncated afterwards), so it takes as long as copying the file and
/// needs as much free disk again. A VACUUM that fails (no disk space for
/// the copy) leaves the file as it was: the broker runs on, logs why, and
/// tries again at the next start.
fn switch_to_incremental_vacuum(
    connection: &Connection,
    path: &Path,
    busy_timeout: Duration,
) -> StoreResult<()> {
    const OP: &str = "open";
    let mode: i64 = connection
        .query_row("PRAGMA auto_vacuum", [], |row| row.get(0))
        .map_err(|e| sql_error(OP, e))?;
    if mode == AUTO_VACUUM_INCREMENTAL {
        return Ok(());
    }
    let bytes = std::fs::metadata(path).map_or(0, |metadata| metadata.len());
    tracing::info!(path = %path.display(), bytes, auto_vacuum = mode,
        "SQLite file created without incremental vacuum: rewriting it once (VACUUM) \
         so it can give space back; this takes as long as copying the file");
    let started = std::time::Instant::now();
    if let Err(err) = connection.execute_batch("VACUUM") {
        tracing::warn!(path = %path.display(), error = %err,
            "cannot switch the SQLite file to incremental vacuum; it keeps its size \
             high-water mark until a later start manages it");
        return Ok(());
    }
    // The rewrite went through the WAL, as large as the file now: empty it.
    checkpoint_truncate(connection, busy_timeout)?;
    tracing::info!(path = %path.display(), seconds = started.elapsed().as_secs_f64(),
        "SQLite file switched to incremental vacuum");
    Ok(())
}

/// The writer thread: group commit until every sender is gone.
pub(super) fn writer_loop(
    mut connection: Connection,
    commands: mpsc::Receiver<Command>,
    async_commit: bool,
) {
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

/// One bounded reclaim run, outside any transaction (a checkpoint cannot
/// run inside one): gives free pages beyond what is kept (the larger of
/// [`FREE_BYTES_KEPT`] and a [`FREE_SHARE_KEPT`]th of the file) back, at
/// most [`VACUUM_BYTES_PER_RUN`], then checkpoints and truncates the WAL,
/// which is when a WAL-mode file actually shrinks on disk. The checkpoint
/// never waits for readers: one holding an old snapshot leaves it partial
/// and the answer says `more`, for the next run to finish.
pub(super) fn reclaim_space(
    connection: &Connection,
    path: &Path,
    busy_timeout: Duration,
) -> StoreResult<SpaceReclaim> {
    const OP: &str = "reclaim_space";
    let before = file_space(connection, path)?;
    let pragma = |name: &str| -> StoreResult<u64> {
        let value: i64 = connection
            .query_row(&format!("PRAGMA {name}"), [], |row| row.get(0))
            .map_err(|e| sql_error(OP, e))?;
        Ok(u64::try_from(value).unwrap_or(0))
    };
    let page_size = pragma("page_size")?.max(1);
    // A file the switch at open could not rewrite has nothing to vacuum.
    let vacuum_pages = if pragma("auto_vacuum")? == AUTO_VACUUM_INCREMENTAL as u64 {
        let kept = FREE_BYTES_KEPT.max(pragma("page_count")? * page_size / FREE_SHARE_KEPT);
        before.free_bytes.saturating_sub(kept) / page_size
    } else {
        0
    };
    let this_run = vacuum_pages.min(VACUUM_BYTES_PER_RUN / page_size);
    if this_run > 0 {
        // The vacuum runs as the statement is stepped: step it to the end.
        let mut statement = connection
            .prepare(&format!("PRAGMA incremental_vacuum({this_run})"))
            .map_err(|e| sql_error(OP, e))?;
        let mut rows = statement.query([]).map_err(|e| sql_error(OP, e))?;
        while rows.next().map_err(|e| sql_error(OP, e))?.is_some() {}
    }
    let checkpointed = if this_run > 0 || before.wal_bytes > WAL_BYTES_KEPT {
        checkpoint_truncate(connection, busy_timeout)?
    } else {
        true
    };
    Ok(SpaceReclaim {
        before,
        after: file_space(connection, path)?,
        more: vacuum_pages > this_run || !checkpointed,
    })
}

/// `PRAGMA wal_checkpoint(TRUNCATE)` without waiting for readers: with
/// no busy handler it checkpoints what it can, as PASSIVE does, instead of
/// holding the writer until every reader moved on. Puts the connection's
/// `busy_timeout` back afterwards. Answers whether it finished: every
/// frame copied into the file, the file cut to its pages, the WAL to zero
/// bytes.
fn checkpoint_truncate(connection: &Connection, busy_timeout: Duration) -> StoreResult<bool> {
    const OP: &str = "checkpoint";
    connection
        .busy_timeout(Duration::ZERO)
        .map_err(|e| sql_error(OP, e))?;
    let busy = connection.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |row| {
        row.get::<_, i64>(0)
    });
    connection
        .busy_timeout(busy_timeout)
        .map_err(|e| sql_error(OP, e))?;
    Ok(busy.map_err(|e| sql_error(OP, e))? == 0)
}

/// The file's and the WAL's lengths on disk and the free list's bytes, as
/// the writer sees them.
fn file_space(connection: &Connection, path: &Path) -> StoreResult<FileSpace> {
    const OP: &str = "reclaim_space";
    let free_bytes: i64 = connection
        .query_row(
            "SELECT freelist_count * page_size FROM pragma_freelist_count(), pragma_page_size()",
            [],
            |row| row.get(0),
        )
        .map_err(|e| sql_error(OP, e))?;
    let length = |suffix: &str| {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        // No WAL file (not created yet, or removed at close) is an empty one.
        std::fs::metadata(&file).map_or(0, |metadata| metadata.len())
    };
    Ok(FileSpace {
        file_bytes: length(""),
        wal_bytes: length("-wal"),
        free_bytes: u64::try_from(free_bytes).unwrap_or(0),
    })
}
