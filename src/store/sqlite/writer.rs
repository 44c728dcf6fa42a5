//! The write side of the SQLite store: the one read-write connection, owned
//! by one writer thread, which drains its queue and commits everything
//! queued in one transaction (group commit), each operation inside a
//! savepoint so a failing one rolls back alone. Also what only the writer
//! does to the file: its pragmas and giving free pages back.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use rusqlite::Connection;

use super::exec::sql_error;
use crate::store::{StoreError, StoreResult};

/// Free pages (4 KiB each) left in the file for reuse before
/// `incremental_vacuum` gives the rest back: 8 MiB of slack.
const FREE_PAGES_KEPT: i64 = 2048;
/// Pages one upkeep pass may return, so a vacuum never stalls the writer.
const VACUUM_PAGES_PER_PASS: i64 = 1024;
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
    /// Runs alone, outside any transaction (migrations).
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

/// Gives free pages beyond [`FREE_PAGES_KEPT`] back to the file system,
/// at most [`VACUUM_PAGES_PER_PASS`] per call.
pub(super) fn reclaim_free_pages(connection: &Connection) -> StoreResult<()> {
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
