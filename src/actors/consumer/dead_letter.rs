//! The ingest dead-letter record: the invalid record's bytes (cut short
//! when it is over `MAX_ACTIVATION_BYTES`) and headers that say why and
//! where it came from.

use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::util::Timeout;

use crate::kafka::Producer;
use crate::model::{ActivationError, KafkaPosition};

/// How long the dead-letter producer tries to deliver one record before the
/// attempt counts as failed and is retried.
pub(in crate::actors::consumer) const DEAD_LETTER_DELIVERY_TIMEOUT: Duration =
    Duration::from_secs(10);
/// Header names on ingest dead-letter records.
pub const ERROR_HEADER: &str = "taskbroker-error";
pub const REASON_HEADER: &str = "taskbroker-error-reason";
pub const SOURCE_HEADER: &str = "taskbroker-source";
/// On a dead-letter record cut short (see [`dead_letter_cut`]): the size of
/// the original record, which stays in the source topic (see SOURCE_HEADER).
pub const ORIGINAL_BYTES_HEADER: &str = "taskbroker-original-bytes";
/// Room kept for the dead-letter headers when a record is cut short.
pub const DEAD_LETTER_HEADER_ROOM: usize = 4096;

/// How many bytes of a record over `max_activation_bytes` go to the ingest
/// DLQ: with its headers, the dead letter is no larger than the largest
/// valid activation, so any topic and producer that take activations take
/// it (half the limit for limits too small to spare the room).
pub fn dead_letter_cut(max_activation_bytes: usize) -> usize {
    max_activation_bytes
        .saturating_sub(DEAD_LETTER_HEADER_ROOM)
        .max(max_activation_bytes / 2)
}

/// A record that is not a valid activation, kept for the ingest DLQ.
pub(super) struct Invalid {
    pub(super) bytes: Vec<u8>,
    /// Size of the record as read, when `bytes` holds only its beginning.
    pub(super) original_len: Option<usize>,
    pub(super) position: KafkaPosition,
    pub(super) error: ActivationError,
}

/// Writes one invalid record to the ingest dead-letter topic; resolves
/// when Kafka acknowledged it (or the delivery failed).
pub(super) async fn send(
    producer: &Producer,
    topic: &str,
    record: &Invalid,
) -> Result<(), KafkaError> {
    let position = &record.position;
    let source = format!(
        "{}/{}/{}",
        position.topic, position.partition, position.offset
    );
    let error = record.error.to_string();
    let original_len = record.original_len.map(|len| len.to_string());
    let mut headers = OwnedHeaders::new()
        .insert(Header {
            key: ERROR_HEADER,
            value: Some(error.as_str()),
        })
        .insert(Header {
            key: REASON_HEADER,
            value: Some(record.error.reason()),
        })
        .insert(Header {
            key: SOURCE_HEADER,
            value: Some(source.as_str()),
        });
    if let Some(original_len) = &original_len {
        headers = headers.insert(Header {
            key: ORIGINAL_BYTES_HEADER,
            value: Some(original_len.as_str()),
        });
    }
    producer
        .send(
            FutureRecord::<(), _>::to(topic)
                .payload(&record.bytes)
                .headers(headers),
            Timeout::After(DEAD_LETTER_DELIVERY_TIMEOUT),
        )
        .await
        .map(drop)
        .map_err(|(err, _)| err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letters_cut_short_leave_room_for_their_headers() {
        assert_eq!(
            dead_letter_cut(1 << 20),
            (1 << 20) - DEAD_LETTER_HEADER_ROOM
        );
        // MAX_ACTIVATION_BYTES may be as small as 1 KiB.
        assert_eq!(dead_letter_cut(1024), 512);
    }
}
