//! The ingest dead-letter record: the invalid record's bytes, whole, and
//! headers that say why and where it came from.
//!
//! A record is dead-lettered as it was read, whatever its size: its
//! producer is sized for any record a consumer can read and compresses.
//! Only when Kafka itself refuses it as too large (the dead-letter topic's
//! `max.message.bytes` is below it even compressed) is it cut
//! ([`Invalid::cut`]), counted and logged; the whole record then stays in the
//! source topic, at the position the source header names, until the topic's
//! retention removes it.

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
pub use crate::kafka::cut::{
    DEAD_LETTER_HEADER_ROOM, ERROR_HEADER, ORIGINAL_BYTES_HEADER, REASON_HEADER, SOURCE_HEADER,
    dead_letter_cut, next_cut,
};

/// A record that is not a valid activation, kept for the ingest DLQ.
pub(super) struct Invalid {
    pub(super) bytes: Vec<u8>,
    /// Size of the record as read, once `bytes` holds only its beginning.
    pub(super) original_len: Option<usize>,
    pub(super) position: KafkaPosition,
    pub(super) error: ActivationError,
}

impl Invalid {
    /// Cuts the record after Kafka refused it as too large (see
    /// [`next_cut`]). Returns false when there is nothing left to cut.
    pub(super) fn cut(&mut self, max_activation_bytes: usize) -> bool {
        let Some(size) = next_cut(self.bytes.len(), max_activation_bytes) else {
            return false;
        };
        self.original_len.get_or_insert(self.bytes.len());
        self.bytes.truncate(size);
        self.bytes.shrink_to_fit();
        true
    }
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
