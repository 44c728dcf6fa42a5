//! Turning a wire `TaskActivation` into a store row: the checks that keep
//! hostile records out and the columns derived from the bytes. Everything
//! here handles data from outside: every failure is a typed
//! [`ActivationError`], never a panic. (What a retry makes of a stored
//! activation is in `retry.rs`.)

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use prost::Message;

use super::retry::RetryEdit;
use super::row::{ActivationStatus, InflightActivation, OnAttemptsExceeded, bucket_for_id};
use crate::proto::TaskActivation;

/// Why a record cannot become an activation row.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActivationError {
    #[error("empty payload")]
    EmptyPayload,
    #[error("not a TaskActivation: {0}")]
    Undecodable(String),
    #[error("activation id is empty")]
    EmptyId,
    #[error("unknown on_attempts_exceeded value {0}")]
    UnknownOnAttemptsExceeded(i32),
    #[error(
        "received_at ({seconds}s, {nanos}ns) is not a valid timestamp between \
         1970-01-01T00:00:00Z and 9999-12-31T23:59:59Z"
    )]
    InvalidReceivedAt { seconds: i64, nanos: i32 },
    #[error("{field} of {value} seconds is out of range")]
    OutOfRange { field: &'static str, value: u64 },
    #[error("record of {bytes} bytes is larger than the {limit}-byte limit")]
    TooLarge { bytes: usize, limit: usize },
    #[error("{field} {problem}")]
    InvalidText {
        field: &'static str,
        problem: TextProblem,
    },
    /// Decoded fine, but the store refused the row (`StoreError::Rejected`):
    /// the defence behind the checks above, for whatever they miss.
    #[error("the store refused the activation: {0}")]
    StoreRejected(String),
}

/// Longest activation id either store accepts, in bytes. Ids are UUIDs in
/// practice (32–36 bytes); the bound keeps every key well inside
/// PostgreSQL's B-tree entry limit (about 2,700 bytes) and out of the way of
/// hostile input.
pub const MAX_ID_BYTES: usize = 256;
/// Longest namespace, application or task name, in bytes (same reasons).
pub const MAX_NAME_BYTES: usize = 256;

/// Earliest timestamp the broker stores: the Unix epoch. Both stores and
/// `chrono` accept far more (PostgreSQL from 4713 BC, SQLite's microsecond
/// integers about ±292,000 years); one documented range that every consumer
/// of the table (psql, the dead-letter tooling, other languages' clients)
/// can handle keeps hostile values out.
pub const MIN_TIMESTAMP_SECS: i64 = 0;
/// Latest timestamp the broker stores: 9999-12-31T23:59:59Z.
pub const MAX_TIMESTAMP_SECS: i64 = 253_402_300_799;

/// Whether `at` lies in the stored range, 1970-01-01T00:00:00Z ..=
/// 9999-12-31T23:59:59Z.
pub fn timestamp_in_range(at: DateTime<Utc>) -> bool {
    let secs = at.timestamp();
    secs >= MIN_TIMESTAMP_SECS
        && (secs < MAX_TIMESTAMP_SECS
            || (secs == MAX_TIMESTAMP_SECS && at.timestamp_subsec_nanos() == 0))
}

/// What is wrong with a text field from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TextProblem {
    #[error("contains a NUL character")]
    Nul,
    #[error("is {bytes} bytes long, more than the {limit}-byte limit")]
    TooLong { bytes: usize, limit: usize },
}

/// Checks a text field that a store keeps in a TEXT column (and indexes):
/// no NUL character (PostgreSQL refuses it) and at most `limit` bytes.
/// Valid UTF-8 is already guaranteed by `&str` (prost refuses invalid UTF-8
/// at decode).
pub fn check_text(field: &'static str, value: &str, limit: usize) -> Result<(), ActivationError> {
    let problem = if value.len() > limit {
        TextProblem::TooLong {
            bytes: value.len(),
            limit,
        }
    } else if value.contains('\0') {
        TextProblem::Nul
    } else {
        return Ok(());
    };
    Err(ActivationError::InvalidText { field, problem })
}

impl ActivationError {
    /// Short, bounded label for metrics and the ingest dead-letter header.
    pub fn reason(&self) -> &'static str {
        match self {
            ActivationError::EmptyPayload => "empty_payload",
            ActivationError::Undecodable(_) => "undecodable",
            ActivationError::EmptyId => "empty_id",
            ActivationError::UnknownOnAttemptsExceeded(_) => "unknown_enum",
            ActivationError::InvalidReceivedAt { .. } => "invalid_timestamp",
            ActivationError::OutOfRange { .. } => "out_of_range",
            ActivationError::TooLarge { .. } => "too_large",
            ActivationError::InvalidText { .. } => "invalid_text",
            ActivationError::StoreRejected(_) => "store_rejected",
        }
    }
}

/// Where a record came from in Kafka.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaPosition {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

/// Decodes a TaskActivation record into a store row (DESIGN.md, "Store").
///
/// - `received_at` falls back to `now` when the producer left it unset;
/// - `expires_at` = received_at + `expires`;
/// - `delay_until` = received_at + min(`delay`, `max_delay`), and the row
///   starts as Delay while that is in the future, Pending otherwise.
pub fn inflight_from_record(
    bytes: &[u8],
    position: KafkaPosition,
    now: DateTime<Utc>,
    max_delay: Duration,
) -> Result<InflightActivation, ActivationError> {
    if bytes.is_empty() {
        return Err(ActivationError::EmptyPayload);
    }
    let activation = TaskActivation::decode(bytes)
        .map_err(|err| ActivationError::Undecodable(err.to_string()))?;
    if activation.id.is_empty() {
        return Err(ActivationError::EmptyId);
    }
    // Everything a store indexes or keeps as TEXT: PostgreSQL refuses a NUL
    // character and index entries past its B-tree limit, and either refusal
    // would fail the whole insert batch.
    check_text("id", &activation.id, MAX_ID_BYTES)?;
    check_text("namespace", &activation.namespace, MAX_NAME_BYTES)?;
    check_text("taskname", &activation.taskname, MAX_NAME_BYTES)?;
    if let Some(application) = &activation.application {
        check_text("application", application, MAX_NAME_BYTES)?;
    }
    let retry_state = activation.retry_state.unwrap_or_default();
    let on_attempts_exceeded = OnAttemptsExceeded::from_i32(retry_state.on_attempts_exceeded)
        .ok_or(ActivationError::UnknownOnAttemptsExceeded(
            retry_state.on_attempts_exceeded,
        ))?;
    let received_at = match &activation.received_at {
        None => now,
        Some(ts) => {
            let invalid = ActivationError::InvalidReceivedAt {
                seconds: ts.seconds,
                nanos: ts.nanos,
            };
            // chrono reads nanos of 1e9 and more as a leap second; the wire
            // format (google.protobuf.Timestamp) does not allow them.
            let nanos = u32::try_from(ts.nanos)
                .ok()
                .filter(|nanos| *nanos < 1_000_000_000)
                .ok_or_else(|| invalid.clone())?;
            DateTime::from_timestamp(ts.seconds, nanos)
                .filter(|at| timestamp_in_range(*at))
                .ok_or(invalid)?
        }
    };
    let expires_at = activation
        .expires
        .map(|secs| add_seconds(received_at, "expires", secs))
        .transpose()?;
    let delay_until = match activation.delay {
        Some(secs) if secs > 0 => {
            let capped = secs.min(max_delay.as_secs());
            Some(add_seconds(received_at, "delay", capped)?)
        }
        _ => None,
    };
    let status = match delay_until {
        Some(until) if until > now => ActivationStatus::Delay,
        _ => ActivationStatus::Pending,
    };
    let processing_deadline_duration = i32::try_from(activation.processing_deadline_duration)
        .map_err(|_| ActivationError::OutOfRange {
            field: "processing_deadline_duration",
            value: activation.processing_deadline_duration,
        })?;
    // The broker later stores a processing deadline of about now + this
    // duration (+ grace): refuse here what could not be stored then.
    add_seconds(
        now,
        "processing_deadline_duration",
        activation.processing_deadline_duration,
    )?;
    Ok(InflightActivation {
        bucket: bucket_for_id(&activation.id),
        activation: bytes.to_vec(),
        topic: position.topic,
        partition: position.partition,
        kafka_offset: position.offset,
        added_at: now,
        received_at,
        processing_attempts: 0,
        expires_at,
        delay_until,
        processing_deadline_duration,
        processing_deadline: None,
        claim_expires_at: None,
        status,
        at_most_once: retry_state.at_most_once.unwrap_or(false),
        application: activation.application.unwrap_or_default(),
        namespace: activation.namespace,
        taskname: activation.taskname,
        on_attempts_exceeded,
        retry_edit: RetryEdit::default(),
        id: activation.id,
    })
}

/// `base` + `secs`, refused when the sum leaves the stored range.
fn add_seconds(
    base: DateTime<Utc>,
    field: &'static str,
    secs: u64,
) -> Result<DateTime<Utc>, ActivationError> {
    i64::try_from(secs)
        .ok()
        .and_then(TimeDelta::try_seconds)
        .and_then(|delta| base.checked_add_signed(delta))
        .filter(|at| timestamp_in_range(*at))
        .ok_or(ActivationError::OutOfRange { field, value: secs })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::proto::RetryState;
    use prost_types::Timestamp;

    fn position() -> KafkaPosition {
        KafkaPosition {
            topic: "tasks".into(),
            partition: 3,
            offset: 42,
        }
    }

    /// A valid wire activation, also the base of `retry.rs`'s tests.
    pub(in crate::model) fn base_activation() -> TaskActivation {
        TaskActivation {
            id: "0195f6a3c1f47a0e9b3c5d6e7f809112".into(),
            namespace: "ns".into(),
            taskname: "do.it".into(),
            received_at: Some(Timestamp {
                seconds: 1_700_000_000,
                nanos: 5_000,
            }),
            processing_deadline_duration: 30,
            ..Default::default()
        }
    }

    /// A fixed "now", ten seconds after `base_activation` was received.
    pub(in crate::model) fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_010, 0).unwrap()
    }

    const MAX_DELAY: Duration = Duration::from_secs(3600);

    #[test]
    fn decodes_every_derived_column() {
        let mut activation = base_activation();
        activation.expires = Some(60);
        activation.application = Some("app".into());
        activation.retry_state = Some(RetryState {
            at_most_once: Some(true),
            on_attempts_exceeded: 2,
            ..Default::default()
        });
        let bytes = activation.encode_to_vec();
        let row = inflight_from_record(&bytes, position(), now(), MAX_DELAY).unwrap();
        let received = DateTime::from_timestamp(1_700_000_000, 5_000).unwrap();
        assert_eq!(row.id, activation.id);
        assert_eq!(row.activation, bytes);
        assert_eq!(
            (row.topic.as_str(), row.partition, row.kafka_offset),
            ("tasks", 3, 42)
        );
        assert_eq!(row.received_at, received);
        assert_eq!(row.added_at, now());
        assert_eq!(row.expires_at, Some(received + TimeDelta::seconds(60)));
        assert_eq!(row.delay_until, None);
        assert_eq!(row.status, ActivationStatus::Pending);
        assert!(row.at_most_once);
        assert_eq!(row.on_attempts_exceeded, OnAttemptsExceeded::Deadletter);
        assert_eq!(row.application, "app");
        assert_eq!(row.processing_deadline_duration, 30);
        assert_eq!(row.bucket, bucket_for_id(&activation.id));
    }

    #[test]
    fn missing_received_at_and_application_default() {
        let mut activation = base_activation();
        activation.received_at = None;
        let row = inflight_from_record(&activation.encode_to_vec(), position(), now(), MAX_DELAY)
            .unwrap();
        assert_eq!(row.received_at, now());
        assert_eq!(row.application, "");
        assert!(!row.at_most_once);
        assert_eq!(row.on_attempts_exceeded, OnAttemptsExceeded::Unspecified);
    }

    #[test]
    fn future_delay_is_capped_and_stored_as_delay() {
        let mut activation = base_activation();
        activation.delay = Some(10 * 3600);
        let row = inflight_from_record(&activation.encode_to_vec(), position(), now(), MAX_DELAY)
            .unwrap();
        let received = DateTime::from_timestamp(1_700_000_000, 5_000).unwrap();
        assert_eq!(row.delay_until, Some(received + TimeDelta::seconds(3600)));
        assert_eq!(row.status, ActivationStatus::Delay);
    }

    #[test]
    fn delay_already_passed_is_pending() {
        let mut activation = base_activation();
        activation.delay = Some(5);
        let row = inflight_from_record(&activation.encode_to_vec(), position(), now(), MAX_DELAY)
            .unwrap();
        assert_eq!(row.status, ActivationStatus::Pending);
        assert!(row.delay_until.is_some());
    }

    #[test]
    fn invalid_input_is_a_typed_error() {
        let err = |bytes: &[u8]| inflight_from_record(bytes, position(), now(), MAX_DELAY);
        assert_eq!(err(&[]).unwrap_err(), ActivationError::EmptyPayload);
        assert!(matches!(
            err(&[0xff, 0xff, 0xff]).unwrap_err(),
            ActivationError::Undecodable(_)
        ));

        let mut no_id = base_activation();
        no_id.id.clear();
        assert_eq!(
            err(&no_id.encode_to_vec()).unwrap_err(),
            ActivationError::EmptyId
        );

        let mut bad_enum = base_activation();
        bad_enum.retry_state = Some(RetryState {
            on_attempts_exceeded: 7,
            ..Default::default()
        });
        assert_eq!(
            err(&bad_enum.encode_to_vec()).unwrap_err(),
            ActivationError::UnknownOnAttemptsExceeded(7)
        );

        let mut bad_time = base_activation();
        bad_time.received_at = Some(Timestamp {
            seconds: i64::MAX,
            nanos: 0,
        });
        assert!(matches!(
            err(&bad_time.encode_to_vec()).unwrap_err(),
            ActivationError::InvalidReceivedAt { .. }
        ));

        let mut huge_expiry = base_activation();
        huge_expiry.expires = Some(u64::MAX);
        assert_eq!(
            err(&huge_expiry.encode_to_vec()).unwrap_err().reason(),
            "out_of_range"
        );

        let mut huge_deadline = base_activation();
        huge_deadline.processing_deadline_duration = u64::MAX;
        assert_eq!(
            err(&huge_deadline.encode_to_vec()).unwrap_err().reason(),
            "out_of_range"
        );
    }

    #[test]
    fn text_checks_refuse_nul_and_overlong_values() {
        assert_eq!(check_text("id", "abc", MAX_ID_BYTES), Ok(()));
        assert_eq!(
            check_text("namespace", "a\0b", MAX_NAME_BYTES),
            Err(ActivationError::InvalidText {
                field: "namespace",
                problem: TextProblem::Nul
            })
        );
        let long = "x".repeat(MAX_ID_BYTES + 1);
        let err = check_text("id", &long, MAX_ID_BYTES).unwrap_err();
        assert_eq!(err.reason(), "invalid_text");
        assert_eq!(
            err.to_string(),
            "id is 257 bytes long, more than the 256-byte limit"
        );
    }

    #[test]
    fn text_fields_a_store_would_refuse_are_invalid() {
        let err = |activation: TaskActivation| {
            inflight_from_record(&activation.encode_to_vec(), position(), now(), MAX_DELAY)
                .unwrap_err()
        };
        let mut nul_namespace = base_activation();
        nul_namespace.namespace = "ns\0x".into();
        assert_eq!(
            err(nul_namespace),
            ActivationError::InvalidText {
                field: "namespace",
                problem: TextProblem::Nul
            }
        );
        let mut nul_application = base_activation();
        nul_application.application = Some("\0".into());
        assert_eq!(err(nul_application).reason(), "invalid_text");
        let mut nul_taskname = base_activation();
        nul_taskname.taskname = "a\0".into();
        assert_eq!(err(nul_taskname).reason(), "invalid_text");
        let mut long_id = base_activation();
        long_id.id = "x".repeat(MAX_ID_BYTES + 1);
        assert!(matches!(
            err(long_id),
            ActivationError::InvalidText {
                field: "id",
                problem: TextProblem::TooLong { .. }
            }
        ));
        let mut long_name = base_activation();
        long_name.taskname = "t".repeat(MAX_NAME_BYTES + 1);
        assert_eq!(err(long_name).reason(), "invalid_text");

        let mut at_the_limits = base_activation();
        at_the_limits.id = "i".repeat(MAX_ID_BYTES);
        at_the_limits.namespace = "n".repeat(MAX_NAME_BYTES);
        at_the_limits.application = Some("a".repeat(MAX_NAME_BYTES));
        at_the_limits.taskname = "t".repeat(MAX_NAME_BYTES);
        assert!(
            inflight_from_record(&at_the_limits.encode_to_vec(), position(), now(), MAX_DELAY)
                .is_ok()
        );
    }

    #[test]
    fn timestamps_outside_the_stored_range_are_invalid() {
        let decode = |activation: TaskActivation| {
            inflight_from_record(&activation.encode_to_vec(), position(), now(), MAX_DELAY)
        };
        let received = |seconds: i64, nanos: i32| {
            let mut activation = base_activation();
            activation.received_at = Some(Timestamp { seconds, nanos });
            activation
        };
        for (seconds, nanos) in [
            (-1, 0),
            (MAX_TIMESTAMP_SECS, 1),
            (MAX_TIMESTAMP_SECS + 1, 0),
            (1_700_000_000, 1_500_000_000), // a leap second to chrono
            (1_700_000_000, -1),
        ] {
            assert_eq!(
                decode(received(seconds, nanos)).unwrap_err().reason(),
                "invalid_timestamp",
                "{seconds}s {nanos}ns"
            );
        }
        assert!(decode(received(MIN_TIMESTAMP_SECS, 0)).is_ok());
        let latest = decode(received(MAX_TIMESTAMP_SECS, 0)).unwrap();
        assert_eq!(latest.received_at.to_rfc3339(), "9999-12-31T23:59:59+00:00");

        let mut late_expiry = received(MAX_TIMESTAMP_SECS - 10, 0);
        late_expiry.expires = Some(11);
        assert_eq!(
            decode(late_expiry).unwrap_err(),
            ActivationError::OutOfRange {
                field: "expires",
                value: 11
            }
        );
        let mut late_delay = received(MAX_TIMESTAMP_SECS - 10, 0);
        late_delay.delay = Some(11);
        assert_eq!(decode(late_delay).unwrap_err().reason(), "out_of_range");
        let mut expiry_at_the_limit = received(MAX_TIMESTAMP_SECS - 10, 0);
        expiry_at_the_limit.expires = Some(10);
        assert!(decode(expiry_at_the_limit).is_ok());
    }

    #[test]
    fn non_uuid_ids_get_a_stable_bucket() {
        let mut activation = base_activation();
        activation.id = "not-a-uuid".into();
        let bytes = activation.encode_to_vec();
        let first = inflight_from_record(&bytes, position(), now(), MAX_DELAY).unwrap();
        let second = inflight_from_record(&bytes, position(), now(), MAX_DELAY).unwrap();
        assert_eq!(first.bucket, second.bucket);
    }
}
