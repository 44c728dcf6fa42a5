//! Raw-mode topics: a record of plain bytes becomes a new TaskActivation.
//!
//! The task is the one `KAFKA_RAW_TOPICS` names, with the record's bytes as its only
//! positional argument, encoded as the Python worker (taskbroker-client) decodes
//! `parameters_bytes`: msgpack `{"args": [<bytes as bin>], "kwargs": {}}`, then, unless
//! compression is off, one zstd frame that carries its content size (the client calls
//! `zstandard.decompress`, which refuses frames without it) and the header
//! `compression-type: zstd`.
//!
//! The id is a UUID (version 5) of the record's cluster, topic, partition and offset, so a
//! record read again after a crash or a rebalance gets the same id and the store keeps one
//! row. The task has no retry state: a failure discards it.

use chrono::{DateTime, Utc};
use prost::Message as _;
use uuid::Uuid;

use crate::config::{RawCompression, RawMode};
use crate::model::KafkaPosition;
use crate::proto::TaskActivation;

/// The header the Python worker reads to decompress `parameters_bytes`.
pub const COMPRESSION_HEADER: &str = "compression-type";

/// The namespace of raw tasks' UUIDs (a fixed, random UUID of this project's).
const RAW_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6f1c_52e4_8a0d_4c1b_9b8e_0f3d_2a71_c5e9);

/// zstd level for raw payloads: fast, and the Python worker decodes any level.
const ZSTD_LEVEL: i32 = 3;

/// A record of a raw topic, as read.
pub struct RawRecord<'a> {
    pub cluster: &'a str,
    pub position: &'a KafkaPosition,
    pub payload: &'a [u8],
    /// Headers with UTF-8 values; others are left out.
    pub headers: Vec<(String, String)>,
    /// The record's timestamp, when Kafka gave one.
    pub timestamp: Option<DateTime<Utc>>,
}

/// The id of the task made from the record at `position` on `cluster`.
pub fn raw_task_id(cluster: &str, position: &KafkaPosition) -> String {
    let name = format!(
        "{cluster}/{}/{}/{}",
        position.topic, position.partition, position.offset
    );
    Uuid::new_v5(&RAW_ID_NAMESPACE, name.as_bytes()).to_string()
}

/// msgpack of `{"args": [payload], "kwargs": {}}`, the payload as a `bin` value.
pub fn msgpack_args(payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 24);
    out.push(0x82); // map of 2
    out.extend_from_slice(&[0xa4, b'a', b'r', b'g', b's']);
    out.push(0x91); // array of 1
    let len = payload.len();
    if let Ok(len) = u8::try_from(len) {
        out.extend_from_slice(&[0xc4, len]);
    } else if let Ok(len) = u16::try_from(len) {
        out.push(0xc5);
        out.extend_from_slice(&len.to_be_bytes());
    } else {
        // Records are bounded by MAX_ACTIVATION_BYTES (at most 64 MiB).
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        out.push(0xc6);
        out.extend_from_slice(&len.to_be_bytes());
    }
    out.extend_from_slice(payload);
    out.extend_from_slice(&[0xa6, b'k', b'w', b'a', b'r', b'g', b's']);
    out.push(0x80); // empty map
    out
}

/// The encoded TaskActivation a raw record becomes.
pub fn raw_activation(record: RawRecord<'_>, mode: &RawMode, now: DateTime<Utc>) -> Vec<u8> {
    let mut headers: std::collections::HashMap<String, String> =
        record.headers.into_iter().collect();
    let arguments = msgpack_args(record.payload);
    // The bulk API writes the content size into the frame header. It fails
    // only when zstd cannot allocate its context; the task then carries its
    // arguments uncompressed, which the worker reads as well, rather than
    // panicking on a record from outside.
    let compressed = match mode.compression {
        RawCompression::Zstd => zstd::bulk::compress(&arguments, ZSTD_LEVEL).ok(),
        RawCompression::None => None,
    };
    let parameters_bytes = match compressed {
        Some(frame) => {
            headers.insert(COMPRESSION_HEADER.to_owned(), "zstd".to_owned());
            frame
        }
        None => {
            headers.remove(COMPRESSION_HEADER);
            arguments
        }
    };
    let received_at = record.timestamp.unwrap_or(now);
    let activation = TaskActivation {
        id: raw_task_id(record.cluster, record.position),
        application: Some(mode.task.application.clone()),
        namespace: mode.task.namespace.clone(),
        taskname: mode.task.taskname.clone(),
        parameters: String::new(),
        parameters_bytes,
        headers,
        received_at: Some(prost_types::Timestamp {
            seconds: received_at.timestamp(),
            nanos: i32::try_from(received_at.timestamp_subsec_nanos()).unwrap_or(0),
        }),
        retry_state: None,
        processing_deadline_duration: mode.deadline.as_secs(),
        expires: None,
        delay: None,
    };
    activation.encode_to_vec()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::RawTaskName;

    fn mode(compression: RawCompression) -> RawMode {
        RawMode {
            task: RawTaskName {
                application: "app".to_owned(),
                namespace: "ns".to_owned(),
                taskname: "ingest".to_owned(),
            },
            deadline: Duration::from_secs(30),
            compression,
        }
    }

    fn position(offset: i64) -> KafkaPosition {
        KafkaPosition {
            topic: "events".to_owned(),
            partition: 2,
            offset,
        }
    }

    #[test]
    fn arguments_match_what_python_msgpack_writes() {
        // python3 -c "import msgpack; print(msgpack.packb({'args': [b'\x00\xffhello'],
        //   'kwargs': {}}, use_bin_type=True).hex())"  (msgpack 1.1)
        assert_eq!(
            msgpack_args(b"\x00\xffhello"),
            [
                0x82, 0xa4, b'a', b'r', b'g', b's', 0x91, 0xc4, 0x07, 0x00, 0xff, b'h', b'e', b'l',
                b'l', b'o', 0xa6, b'k', b'w', b'a', b'r', b'g', b's', 0x80
            ]
        );
        // The longer length forms: bin 16 and bin 32, big-endian lengths.
        let long = vec![7u8; 300];
        assert_eq!(&msgpack_args(&long)[6..10], &[0x91, 0xc5, 0x01, 0x2c]);
        let longer = vec![7u8; 70_000];
        assert_eq!(
            &msgpack_args(&longer)[6..12],
            &[0x91, 0xc6, 0x00, 0x01, 0x11, 0x70]
        );
    }

    #[test]
    fn a_raw_record_becomes_a_task_whose_frame_carries_its_content_size() {
        let position = position(41);
        let record = RawRecord {
            cluster: "east",
            position: &position,
            payload: b"\x01\x02 payload",
            headers: vec![("trace".to_owned(), "abc".to_owned())],
            timestamp: DateTime::from_timestamp(1_700_000_000, 5_000_000),
        };
        let bytes = raw_activation(record, &mode(RawCompression::Zstd), Utc::now());
        let activation = TaskActivation::decode(bytes.as_slice()).unwrap();
        assert_eq!(activation.id, raw_task_id("east", &position));
        assert_eq!(activation.application.as_deref(), Some("app"));
        assert_eq!(activation.namespace, "ns");
        assert_eq!(activation.taskname, "ingest");
        assert_eq!(activation.processing_deadline_duration, 30);
        assert_eq!(activation.headers["trace"], "abc");
        assert_eq!(activation.headers[COMPRESSION_HEADER], "zstd");
        assert_eq!(activation.received_at.unwrap().seconds, 1_700_000_000);
        assert!(activation.retry_state.is_none());
        let expected = msgpack_args(b"\x01\x02 payload");
        assert_eq!(
            zstd::zstd_safe::get_frame_content_size(&activation.parameters_bytes).unwrap(),
            Some(expected.len() as u64),
            "python's zstandard.decompress needs the content size in the frame"
        );
        assert_eq!(
            zstd::bulk::decompress(&activation.parameters_bytes, 1 << 20).unwrap(),
            expected
        );
    }

    #[test]
    fn without_compression_the_arguments_are_plain_msgpack() {
        let position = position(0);
        let record = RawRecord {
            cluster: "default",
            position: &position,
            payload: b"x",
            headers: vec![(COMPRESSION_HEADER.to_owned(), "zstd".to_owned())],
            timestamp: None,
        };
        let now = Utc::now();
        let bytes = raw_activation(record, &mode(RawCompression::None), now);
        let activation = TaskActivation::decode(bytes.as_slice()).unwrap();
        assert_eq!(activation.parameters_bytes, msgpack_args(b"x"));
        assert!(!activation.headers.contains_key(COMPRESSION_HEADER));
        assert_eq!(activation.received_at.unwrap().seconds, now.timestamp());
    }

    #[test]
    fn ids_are_stable_per_position_and_distinct_across_them() {
        let first = raw_task_id("default", &position(7));
        assert_eq!(first, raw_task_id("default", &position(7)));
        assert_ne!(first, raw_task_id("default", &position(8)));
        assert_ne!(first, raw_task_id("east", &position(7)));
    }
}
