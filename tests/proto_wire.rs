//! The generated protobuf code speaks the taskbroker v1 wire format of PROTOCOL.md.
//!
//! Messages are encoded by hand from the field tables (field numbers and wire types), never with
//! prost, and then decoded with prost: a renumbered or retyped field in `proto/` fails here.

use prost::Message;
use taskbroker::proto::{
    FetchNextTask, OnAttemptsExceeded, PushTaskRequest, RetryState,
    SetBatchActivationStatusRequest, SetTaskStatusRequest, TaskActivation, TaskActivationStatus,
};

const VARINT: u64 = 0;
const LENGTH_DELIMITED: u64 = 2;

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn tag(out: &mut Vec<u8>, field: u64, wire_type: u64) {
    varint(out, (field << 3) | wire_type);
}

fn uint_field(out: &mut Vec<u8>, field: u64, value: u64) {
    tag(out, field, VARINT);
    varint(out, value);
}

fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    tag(out, field, LENGTH_DELIMITED);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn decode<M: Message + Default>(bytes: &[u8]) -> M {
    match M::decode(bytes) {
        Ok(message) => message,
        Err(error) => panic!("hand-encoded bytes must decode: {error}"),
    }
}

fn retry_state_bytes() -> Vec<u8> {
    let mut out = Vec::new();
    uint_field(&mut out, 1, 2); // attempts
    uint_field(&mut out, 2, 7); // max_attempts
    uint_field(&mut out, 3, 2); // on_attempts_exceeded = DEADLETTER
    uint_field(&mut out, 4, 1); // at_most_once = true
    uint_field(&mut out, 5, 300); // delay_on_retry (two varint bytes)
    out
}

fn header_entry(key: &str, value: &str) -> Vec<u8> {
    let mut entry = Vec::new();
    bytes_field(&mut entry, 1, key.as_bytes());
    bytes_field(&mut entry, 2, value.as_bytes());
    entry
}

/// A TaskActivation with every field of the table set.
fn full_activation_bytes() -> Vec<u8> {
    let mut received_at = Vec::new();
    uint_field(&mut received_at, 1, 1_700_000_000); // seconds
    uint_field(&mut received_at, 2, 123_456_789); // nanos

    let mut out = Vec::new();
    bytes_field(&mut out, 1, b"0f2d7c6a9b8e4d3c8a1b2c3d4e5f6a7b");
    bytes_field(&mut out, 2, b"billing");
    bytes_field(&mut out, 3, b"billing.tasks.charge");
    bytes_field(&mut out, 4, br#"{"args":[1],"kwargs":{}}"#);
    bytes_field(&mut out, 5, &header_entry("compression-type", "zstd"));
    bytes_field(&mut out, 5, &header_entry("sentry-trace", "abc-def"));
    bytes_field(&mut out, 6, &received_at);
    bytes_field(&mut out, 7, &retry_state_bytes());
    uint_field(&mut out, 8, 60); // processing_deadline_duration
    uint_field(&mut out, 9, 3600); // expires
    uint_field(&mut out, 11, 30); // delay
    bytes_field(&mut out, 12, b"getsentry");
    bytes_field(&mut out, 13, &[0x28, 0xb5, 0x2f, 0xfd, 0x00, 0xff, 0xc3]);
    out
}

#[test]
fn task_activation_decodes_every_field_from_hand_encoded_bytes() {
    let activation: TaskActivation = decode(&full_activation_bytes());

    assert_eq!(activation.id, "0f2d7c6a9b8e4d3c8a1b2c3d4e5f6a7b");
    assert_eq!(activation.namespace, "billing");
    assert_eq!(activation.taskname, "billing.tasks.charge");
    assert_eq!(activation.parameters, r#"{"args":[1],"kwargs":{}}"#);
    assert_eq!(activation.headers.len(), 2);
    assert_eq!(
        activation
            .headers
            .get("compression-type")
            .map(String::as_str),
        Some("zstd")
    );
    assert_eq!(
        activation.headers.get("sentry-trace").map(String::as_str),
        Some("abc-def")
    );
    let received_at = activation.received_at.expect("received_at is set");
    assert_eq!(received_at.seconds, 1_700_000_000);
    assert_eq!(received_at.nanos, 123_456_789);

    let retry_state = activation.retry_state.expect("retry_state is set");
    assert_eq!(retry_state.attempts, 2);
    assert_eq!(retry_state.max_attempts, 7);
    assert_eq!(
        retry_state.on_attempts_exceeded(),
        OnAttemptsExceeded::Deadletter
    );
    assert_eq!(retry_state.at_most_once, Some(true));
    assert_eq!(retry_state.delay_on_retry, Some(300));

    assert_eq!(activation.processing_deadline_duration, 60);
    assert_eq!(activation.expires, Some(3600));
    assert_eq!(activation.delay, Some(30));
    assert_eq!(activation.application.as_deref(), Some("getsentry"));
    assert_eq!(
        activation.parameters_bytes,
        vec![0x28, 0xb5, 0x2f, 0xfd, 0x00, 0xff, 0xc3]
    );
}

#[test]
fn task_activation_survives_a_prost_round_trip() {
    let activation: TaskActivation = decode(&full_activation_bytes());
    let again: TaskActivation = decode(&activation.encode_to_vec());
    assert_eq!(again, activation);
}

#[test]
fn field_10_of_task_activation_is_skipped_as_unknown() {
    let baseline_bytes = full_activation_bytes();
    let baseline: TaskActivation = decode(&baseline_bytes);

    // Field 10 is reserved: a record carrying it, as a varint or as a string, still decodes and
    // no other field changes.
    for wire_type in [VARINT, LENGTH_DELIMITED] {
        let mut field_10 = Vec::new();
        if wire_type == VARINT {
            uint_field(&mut field_10, 10, 99);
        } else {
            bytes_field(&mut field_10, 10, b"old field");
        }
        let mut bytes = baseline_bytes.clone();
        bytes.extend_from_slice(&field_10);
        let mut field_10_first = field_10.clone();
        field_10_first.extend_from_slice(&baseline_bytes);

        assert_eq!(decode::<TaskActivation>(&bytes), baseline);
        assert_eq!(decode::<TaskActivation>(&field_10_first), baseline);
    }
}

#[test]
fn optional_fields_keep_an_explicit_zero_apart_from_unset() {
    let mut retry_state = Vec::new();
    uint_field(&mut retry_state, 4, 0); // at_most_once = false, present
    uint_field(&mut retry_state, 5, 0); // delay_on_retry = 0, present

    let mut bytes = Vec::new();
    bytes_field(&mut bytes, 1, b"id");
    bytes_field(&mut bytes, 7, &retry_state);
    uint_field(&mut bytes, 9, 0); // expires = 0, present
    let activation: TaskActivation = decode(&bytes);
    let state = activation.retry_state.expect("retry_state is set");
    assert_eq!(state.at_most_once, Some(false));
    assert_eq!(state.delay_on_retry, Some(0));
    assert_eq!(activation.expires, Some(0));
    assert_eq!(activation.delay, None);
    assert_eq!(activation.application, None);

    let mut minimal = Vec::new();
    bytes_field(&mut minimal, 1, b"id");
    let activation: TaskActivation = decode(&minimal);
    assert_eq!(activation.retry_state, None);
    assert_eq!(activation.received_at, None);
    assert_eq!(activation.expires, None);
}

fn set_task_status_bytes(id: &str, status: u64, delay_on_retry: u64) -> Vec<u8> {
    let mut fetch_next = Vec::new();
    bytes_field(&mut fetch_next, 1, b"billing");
    bytes_field(&mut fetch_next, 2, b"getsentry");

    let mut out = Vec::new();
    bytes_field(&mut out, 1, id.as_bytes());
    uint_field(&mut out, 2, status);
    bytes_field(&mut out, 3, &fetch_next);
    uint_field(&mut out, 4, 9); // max_attempts
    uint_field(&mut out, 5, delay_on_retry);
    out
}

#[test]
fn set_task_status_request_round_trips_byte_for_byte() {
    let bytes = set_task_status_bytes("abc123", 4, 120);
    let request: SetTaskStatusRequest = decode(&bytes);

    assert_eq!(request.id, "abc123");
    assert_eq!(request.status(), TaskActivationStatus::Retry);
    assert_eq!(
        request.fetch_next_task,
        Some(FetchNextTask {
            namespace: Some("billing".to_string()),
            application: Some("getsentry".to_string()),
        })
    );
    assert_eq!(request.max_attempts, Some(9));
    assert_eq!(request.delay_on_retry, Some(120));

    // prost writes fields in number order, as the hand encoding does.
    assert_eq!(request.encode_to_vec(), bytes);
}

#[test]
fn set_batch_activation_status_request_carries_repeated_updates() {
    let first = set_task_status_bytes("first", 5, 0);
    let second = set_task_status_bytes("second", 3, 1);
    let mut bytes = Vec::new();
    bytes_field(&mut bytes, 1, &first);
    bytes_field(&mut bytes, 1, &second);

    let batch: SetBatchActivationStatusRequest = decode(&bytes);
    let ids: Vec<&str> = batch.updates.iter().map(|u| u.id.as_str()).collect();
    assert_eq!(ids, ["first", "second"]);
    assert_eq!(batch.updates[0].status(), TaskActivationStatus::Complete);
    assert_eq!(batch.updates[1].status(), TaskActivationStatus::Failure);
    assert_eq!(batch.encode_to_vec(), bytes);
}

#[test]
fn push_task_request_carries_the_activation_and_callback_url() {
    let mut bytes = Vec::new();
    bytes_field(&mut bytes, 1, &full_activation_bytes());
    bytes_field(&mut bytes, 2, b"broker-0:50051");

    let request: PushTaskRequest = decode(&bytes);
    assert_eq!(request.callback_url, "broker-0:50051");
    assert_eq!(
        request.task,
        Some(decode::<TaskActivation>(&full_activation_bytes()))
    );
}

#[test]
fn unknown_enum_numbers_decode_without_error() {
    // An out-of-range status must reach the handler (which answers INVALID_ARGUMENT), not fail
    // decoding.
    let request: SetTaskStatusRequest = decode(&set_task_status_bytes("abc", 42, 0));
    assert_eq!(request.status, 42);
    assert!(TaskActivationStatus::try_from(request.status).is_err());

    let state: RetryState = decode(&[0x18, 0x07]); // on_attempts_exceeded = 7
    assert_eq!(state.on_attempts_exceeded, 7);
}
