//! Running one statement on a connection (the writer's or a reader's) and
//! telling the caller what a SQLite failure means: `Unavailable` (retry),
//! `Rejected` (the data) or `Query`.

use rusqlite::{Connection, ErrorCode, OptionalExtension, ToSql, params};

use super::rows::{activation_from_row, json_tokens, now_micros};
use super::sql::{DELETE_FINISHED, EXISTS, SET_STATUS, SET_STATUS_WITH_EDIT};
use crate::model::{ClaimToken, InflightActivation, StatusUpdate, WorkerStatus};
use crate::store::{StoreError, StoreResult, retry_edit_columns};

/// Lock contention and I/O trouble (disk full, file gone) may pass:
/// `Unavailable`. Data SQLite refuses is `Rejected`; any other statement it
/// rejects is a `Query` error.
pub(super) fn sql_error(operation: &'static str, err: rusqlite::Error) -> StoreError {
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

/// `(name, count)` rows of `sql`: counts by status, rows and bytes by topic.
pub(super) fn named_counts(
    operation: &'static str,
    connection: &Connection,
    sql: &str,
) -> StoreResult<Vec<(String, u64)>> {
    let mut statement = connection
        .prepare_cached(sql)
        .map_err(|e| sql_error(operation, e))?;
    let mut rows = statement.query([]).map_err(|e| sql_error(operation, e))?;
    let mut counts = Vec::new();
    while let Some(row) = rows.next().map_err(|e| sql_error(operation, e))? {
        let topic: String = row.get(0).map_err(|e| sql_error(operation, e))?;
        let count: Option<i64> = row.get(1).map_err(|e| sql_error(operation, e))?;
        counts.push((
            topic,
            count
                .and_then(|count| u64::try_from(count).ok())
                .unwrap_or(0),
        ));
    }
    Ok(counts)
}

/// Runs a statement returning whole rows (`RETURNING` or `SELECT`).
pub(super) fn query_rows(
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
pub(super) fn execute(
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

/// Runs one fenced statement over every claim token (`?1`, see
/// [`json_tokens`]; `?2` = `extra` if given) and returns the ids of the
/// rows it changed.
pub(super) fn fenced(
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

/// Applies one worker report if its row is handed out (Claimed or
/// Processing): `Some((late, namespace))` when it applied, `None` otherwise. A report
/// that finishes the task for good (COMPLETE, or FAILURE of a task that
/// discards) deletes the row; a RETRY report's edit is stored with the row
/// by the same statement.
pub(super) fn apply_report(
    connection: &Connection,
    update: &StatusUpdate,
) -> StoreResult<Option<(bool, String)>> {
    const OP: &str = "set_status";
    let status = update.status.as_status().as_str();
    let now = now_micros();
    let single_row = |sql: &str, params: &[&dyn ToSql]| {
        connection
            .prepare_cached(sql)
            .and_then(|mut statement| {
                statement
                    .query_row(params, |row| Ok((row.get(0)?, row.get(1)?)))
                    .optional()
            })
            .map_err(|e| sql_error(OP, e))
    };
    match update.status {
        WorkerStatus::Complete => {
            return single_row(DELETE_FINISHED, &[&update.id, &status, &now]);
        }
        // Only a discarding task's row goes; a dead-lettered one stays.
        WorkerStatus::Failure => {
            if let Some(applied) = single_row(DELETE_FINISHED, &[&update.id, &status, &now])? {
                return Ok(Some(applied));
            }
        }
        WorkerStatus::Retry => {}
    }
    let (edit_attempts, edit_delay) = retry_edit_columns(&update.retry_edit());
    if update.edits_retry_state() {
        single_row(
            SET_STATUS_WITH_EDIT,
            &[&update.id, &status, &now, &edit_attempts, &edit_delay],
        )
    } else {
        single_row(SET_STATUS, &[&update.id, &status, &now])
    }
}

/// Whether a row with this id exists (for `set_status`'s counts).
pub(super) fn exists(connection: &Connection, id: &str) -> StoreResult<bool> {
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
