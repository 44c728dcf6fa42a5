//! Mapping between PostgreSQL rows and parameters and the store's values:
//! a returned row (in `sql::columns!` order) as an `InflightActivation`, and
//! the small conversions the statements' parameters need.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::Row;

use super::pool::query_error;
use crate::model::{ActivationStatus, ClaimToken, InflightActivation, OnAttemptsExceeded};
use crate::store::{StoreError, StoreResult, retry_edit_from_columns};

/// One returned row, its columns in `sql::columns!` order.
pub(super) fn activation_from_row(row: &Row) -> StoreResult<InflightActivation> {
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
    let retry_edit = retry_edit_from_columns(
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

pub(super) fn activations_from_rows(rows: &[Row]) -> StoreResult<Vec<InflightActivation>> {
    rows.iter().map(activation_from_row).collect()
}

pub(super) fn micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

pub(super) fn limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

pub(super) fn split_tokens(claims: &[ClaimToken]) -> (Vec<&str>, Vec<DateTime<Utc>>) {
    claims
        .iter()
        .map(|claim| (claim.id.as_str(), claim.claim_expires_at))
        .unzip()
}

/// `(name, count)` rows: counts by status, rows and bytes by topic.
pub(super) fn named_counts(
    operation: &'static str,
    rows: &[Row],
) -> StoreResult<Vec<(String, u64)>> {
    rows.iter()
        .map(|row| {
            let topic: String = row.try_get(0).map_err(|e| query_error(operation, e))?;
            let count: Option<i64> = row.try_get(1).map_err(|e| query_error(operation, e))?;
            Ok((
                topic,
                count
                    .and_then(|count| u64::try_from(count).ok())
                    .unwrap_or(0),
            ))
        })
        .collect()
}
