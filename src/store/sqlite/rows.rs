//! Mapping between SQLite rows and parameters and the store's values: a
//! returned row (in `sql::columns!` order) as an `InflightActivation`,
//! timestamps as integer microseconds, and id lists and claim tokens as the
//! JSON arrays the batch statements unpack.

use std::time::Duration;

use chrono::{DateTime, Utc};
use rusqlite::Row;

use super::exec::sql_error;
use crate::model::{ActivationStatus, ClaimToken, InflightActivation, OnAttemptsExceeded};
use crate::store::{StoreError, StoreResult, retry_edit_from_columns};

pub(super) fn micros_of(at: DateTime<Utc>) -> i64 {
    at.timestamp_micros()
}

pub(super) fn now_micros() -> i64 {
    micros_of(Utc::now())
}

pub(super) fn duration_micros(duration: Duration) -> i64 {
    i64::try_from(duration.as_micros()).unwrap_or(i64::MAX)
}

pub(super) fn limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

/// One returned row, its columns in `sql::columns!` order.
pub(super) fn activation_from_row(row: &Row<'_>) -> StoreResult<InflightActivation> {
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
    let retry_edit = retry_edit_from_columns(
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

/// JSON text of `values` as an array of strings, for `json_each(?)`:
/// a whole id list travels as one parameter, so a batch is one statement.
pub(super) fn json_strings<'a>(values: impl IntoIterator<Item = &'a str>) -> String {
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
pub(super) fn json_tokens(claims: &[ClaimToken]) -> String {
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
