//! The batch a consumer builds between flushes: each record read is
//! classified (a row to store, an invalid record for the ingest dead-letter
//! topic, or an expired one to count) and its offset noted under the
//! partition's ownership generation, so a flush commits only what it settled.

use std::collections::BTreeMap;

use tokio::time::Instant;

use super::ConsumeLoop;
use super::dead_letter::{Invalid, dead_letter_cut};
use crate::model::{ActivationError, InflightActivation, KafkaPosition, inflight_from_record};

/// Records read since the last flush.
#[derive(Default)]
pub(super) struct Batch {
    pub(super) rows: Vec<InflightActivation>,
    pub(super) invalid: Vec<Invalid>,
    pub(super) expired: u64,
    /// Per (topic, partition): the ownership generation the records were
    /// read under, and the highest offset read.
    pub(super) offsets: BTreeMap<(String, i32), (u64, i64)>,
    pub(super) started: Option<Instant>,
}

impl Batch {
    pub(super) fn records(&self) -> usize {
        self.rows.len() + self.invalid.len() + self.expired as usize
    }
}

/// The payload and position of a record, owned, so the borrowed message
/// (and with it the consumer) is released at once.
pub(super) fn record_of(message: &impl rdkafka::message::Message) -> (Vec<u8>, KafkaPosition) {
    let position = KafkaPosition {
        topic: message.topic().to_owned(),
        partition: message.partition(),
        offset: message.offset(),
    };
    (message.payload().unwrap_or_default().to_vec(), position)
}

impl ConsumeLoop {
    /// Classifies one record into the batch being built.
    pub(super) fn read(&mut self, payload: Vec<u8>, position: KafkaPosition) {
        let batch = &mut self.batch;
        batch.started.get_or_insert_with(Instant::now);
        let generation = self
            .ownership
            .generation(&position.topic, position.partition);
        let offset = position.offset;
        batch
            .offsets
            .entry((position.topic.clone(), position.partition))
            .and_modify(|(read_under, highest)| {
                if *read_under == generation {
                    *highest = (*highest).max(offset);
                } else {
                    // Read again under a new ownership: only what was read
                    // since counts.
                    *read_under = generation;
                    *highest = offset;
                }
            })
            .or_insert((generation, offset));

        let limit = self.config.max_activation_bytes;
        if payload.len() > limit {
            let error = ActivationError::TooLarge {
                bytes: payload.len(),
                limit,
            };
            // Producers and topics are sized for MAX_ACTIVATION_BYTES: an
            // oversized record goes to the DLQ cut short (its full bytes
            // stay in the source topic, named by the source header), so it
            // can never block the partition.
            let original_len = payload.len();
            let mut bytes = payload;
            bytes.truncate(dead_letter_cut(limit));
            batch.invalid.push(Invalid {
                bytes,
                original_len: Some(original_len),
                position,
                error,
            });
        } else {
            let now = chrono::Utc::now();
            match inflight_from_record(&payload, position.clone(), now, self.config.max_delay) {
                Ok(row) if row.expires_at.is_some_and(|expires| expires <= now) => {
                    batch.expired += 1;
                }
                Ok(row) => batch.rows.push(row),
                Err(error) => batch.invalid.push(Invalid {
                    bytes: payload,
                    original_len: None,
                    position,
                    error,
                }),
            }
        }
        self.show_pending();
    }
}
