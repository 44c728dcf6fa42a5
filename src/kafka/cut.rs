//! Dead letters Kafka refuses as too large: how they are cut short, and
//! the headers every dead letter carries.
//!
//! A dead letter is written whole: the producers that write them are sized
//! for the records they carry and compress. Only a refusal by Kafka itself
//! (librdkafka's `message.max.bytes`, or the topic's `max.message.bytes`
//! even compressed) cuts one: first to [`dead_letter_cut`], then to half of
//! what was refused each time, down to headers alone, which still name
//! where the whole record is (its source topic, partition and offset).

use std::sync::Arc;
use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;

use super::{Producer, refused_as_too_large};
use crate::metrics::Metrics;
use crate::model::InflightActivation;

/// Header names on ingest dead-letter records.
pub const ERROR_HEADER: &str = "taskbroker-error";
pub const REASON_HEADER: &str = "taskbroker-error-reason";
pub const SOURCE_HEADER: &str = "taskbroker-source";
/// On a dead-letter record cut short (see [`next_cut`]): the size of
/// the original record, which stays in the source topic (see SOURCE_HEADER).
pub const ORIGINAL_BYTES_HEADER: &str = "taskbroker-original-bytes";
/// Room kept for the dead-letter headers when a record is cut short.
pub const DEAD_LETTER_HEADER_ROOM: usize = 4096;

/// The first size a dead letter Kafka refused is cut to: with its headers,
/// no larger than the largest valid activation, so a topic sized for
/// activations takes it (half the limit for limits too small to spare the
/// room).
pub fn dead_letter_cut(max_activation_bytes: usize) -> usize {
    max_activation_bytes
        .saturating_sub(DEAD_LETTER_HEADER_ROOM)
        .max(max_activation_bytes / 2)
}

/// The size a dead letter of `len` bytes that Kafka refused as too large is
/// cut to: [`dead_letter_cut`] first, then half of what was refused each
/// time, down to no payload at all (the headers still say where the whole
/// record is). `None` once there is nothing left to cut.
pub fn next_cut(len: usize, max_activation_bytes: usize) -> Option<usize> {
    if len == 0 {
        return None;
    }
    let first = dead_letter_cut(max_activation_bytes);
    Some(if len > first { first } else { len / 2 })
}

/// Writes a task's dead letter after Kafka refused a record of it as too
/// large: the stored activation whole first when `whole` is given (a retry
/// was refused), then cut short ([`next_cut`]) until Kafka takes it, with
/// headers naming the task's source position and its original size.
pub struct CutDeadLetter<'a> {
    pub producer: Producer,
    pub topic: &'a str,
    pub max_activation_bytes: usize,
    pub timeout: Duration,
    pub metrics: Arc<Metrics>,
}

impl CutDeadLetter<'_> {
    pub async fn send(
        &self,
        row: &InflightActivation,
        whole: Option<Vec<u8>>,
        refused: Vec<u8>,
    ) -> Result<(), KafkaError> {
        let timeout = rdkafka::util::Timeout::After(self.timeout);
        let mut payload = match whole {
            Some(whole) => {
                let record = FutureRecord::to(self.topic).key(&row.id).payload(&whole);
                match self.producer.send(record, timeout).await {
                    Ok(_) => return Ok(()),
                    Err((err, _)) if refused_as_too_large(&err) => whole,
                    Err((err, _)) => return Err(err),
                }
            }
            None => refused,
        };
        let original = payload.len().to_string();
        let source = format!("{}/{}/{}", row.topic, row.partition, row.kafka_offset);
        self.metrics
            .dead_letters_truncated
            .with_label_values(&["deadletter"])
            .inc();
        tracing::warn!(activation_id = %row.id, topic = %row.topic, partition = row.partition,
            offset = row.kafka_offset, bytes = payload.len(), dlq = %self.topic,
            "Kafka refused the task's dead letter as too large; sending it cut short \
             (the whole activation stays in the source topic at this offset until its retention)");
        loop {
            let Some(size) = next_cut(payload.len(), self.max_activation_bytes) else {
                return Err(KafkaError::MessageProduction(
                    rdkafka::types::RDKafkaErrorCode::MessageSizeTooLarge,
                ));
            };
            payload.truncate(size);
            let headers = OwnedHeaders::new()
                .insert(Header {
                    key: REASON_HEADER,
                    value: Some("too_large"),
                })
                .insert(Header {
                    key: SOURCE_HEADER,
                    value: Some(source.as_str()),
                })
                .insert(Header {
                    key: ORIGINAL_BYTES_HEADER,
                    value: Some(original.as_str()),
                });
            let record = FutureRecord::to(self.topic)
                .key(&row.id)
                .payload(&payload)
                .headers(headers);
            match self.producer.send(record, timeout).await {
                Ok(_) => return Ok(()),
                Err((err, _)) if refused_as_too_large(&err) => continue,
                Err((err, _)) => return Err(err),
            }
        }
    }
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

    #[test]
    fn refused_dead_letters_are_cut_to_the_limit_then_halved_down_to_nothing() {
        let limit = 8 << 20;
        let mut sizes = vec![9 << 20];
        while let Some(next) = next_cut(*sizes.last().unwrap(), limit) {
            sizes.push(next);
        }
        assert_eq!(sizes[1], limit - DEAD_LETTER_HEADER_ROOM);
        assert_eq!(sizes[2], (limit - DEAD_LETTER_HEADER_ROOM) / 2);
        assert_eq!(sizes.last(), Some(&0));
        // Bounded: one refusal per halving.
        assert!(sizes.len() < 30, "{sizes:?}");
        // A record under the limit that the topic still refuses is halved.
        assert_eq!(next_cut(1000, limit), Some(500));
    }
}
