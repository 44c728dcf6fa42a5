//! The batch a consumer builds between flushes: each record read is
//! classified (a row to store, an invalid record for the ingest dead-letter
//! topic, an activation of a demoted namespace to forward, or an expired or
//! killswitched one to count) and its offset noted under the
//! partition's ownership generation, so a flush commits only what it settled.

use std::collections::BTreeMap;

use std::sync::Arc;

use tokio::time::Instant;

use rdkafka::message::{Headers as _, Message};

use super::dead_letter::Invalid;
use super::{ConsumeLoop, ConsumerConfig};
use crate::kafka::raw::{RawRecord, raw_activation};
use crate::model::{
    ActivationError, InflightActivation, KafkaPosition, inflight_from_record, timestamp_in_range,
};
use crate::runtime::AtIngest;

/// Records read since the last flush.
#[derive(Default)]
pub(super) struct Batch {
    pub(super) rows: Vec<InflightActivation>,
    pub(super) invalid: Vec<Invalid>,
    pub(super) expired: u64,
    /// Records a killswitch dropped.
    pub(super) killswitched: u64,
    /// Activations of demoted namespaces, with the topic they go to.
    pub(super) demoted: Vec<(InflightActivation, Arc<str>)>,
    /// Per (topic, partition): the ownership generation the records were
    /// read under, and the highest offset read.
    pub(super) offsets: BTreeMap<(String, i32), (u64, i64)>,
    pub(super) started: Option<Instant>,
    /// Payload bytes of the records read (`INSERT_BATCH_BYTES`).
    pub(super) bytes: usize,
}

impl Batch {
    pub(super) fn records(&self) -> usize {
        self.rows.len()
            + self.invalid.len()
            + self.demoted.len()
            + (self.expired + self.killswitched) as usize
    }

    /// Whether the batch should be written now: `batch_size` records, or
    /// `batch_bytes` of payload (so a batch of large tasks holds at most
    /// that plus one record).
    pub(super) fn is_full(&self, batch_size: usize, batch_bytes: usize) -> bool {
        self.records() >= batch_size || self.bytes >= batch_bytes
    }
}

/// The payload and position of a record, owned, so the borrowed message (and with it the
/// consumer) is released at once. A raw topic's record is turned into the activation it
/// stands for.
pub(super) fn record_of(
    config: &ConsumerConfig,
    message: &impl Message,
) -> (Vec<u8>, KafkaPosition) {
    let position = KafkaPosition {
        topic: message.topic().to_owned(),
        partition: message.partition(),
        offset: message.offset(),
    };
    let payload = message.payload().unwrap_or_default();
    let payload = match &config.raw {
        // An oversized record is dead-lettered as it is, like any other.
        Some(mode) if payload.len() <= config.max_activation_bytes => {
            let headers = message
                .headers()
                .map(|headers| {
                    headers
                        .iter()
                        .filter_map(|header| {
                            let value = std::str::from_utf8(header.value?).ok()?;
                            Some((header.key.to_owned(), value.to_owned()))
                        })
                        .collect()
                })
                .unwrap_or_default();
            let timestamp = message
                .timestamp()
                .to_millis()
                .and_then(chrono::DateTime::from_timestamp_millis)
                .filter(|at| timestamp_in_range(*at));
            let record = RawRecord {
                cluster: &config.cluster,
                position: &position,
                payload,
                headers,
                timestamp,
            };
            raw_activation(record, mode, chrono::Utc::now())
        }
        _ => payload.to_vec(),
    };
    (payload, position)
}

impl ConsumeLoop {
    /// Classifies one record into the batch being built.
    pub(super) fn read(&mut self, payload: Vec<u8>, position: KafkaPosition) {
        let batch = &mut self.batch;
        batch.started.get_or_insert_with(Instant::now);
        batch.bytes += payload.len();
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
            // Dead-lettered whole: the ingest DLQ producer takes any record
            // a consumer can read, and only a refusal by Kafka itself cuts
            // it (`writes.rs`).
            batch.invalid.push(Invalid {
                bytes: payload,
                original_len: None,
                position,
                error,
            });
        } else {
            let now = chrono::Utc::now();
            match inflight_from_record(&payload, position.clone(), now, self.config.max_delay) {
                Ok(row) if row.expires_at.is_some_and(|expires| expires <= now) => {
                    batch.expired += 1;
                }
                Ok(row) => {
                    match self
                        .config
                        .rules
                        .at_ingest(&row.namespace, &row.taskname, &row.topic)
                    {
                        AtIngest::Store => batch.rows.push(row),
                        AtIngest::Killed => batch.killswitched += 1,
                        AtIngest::Demoted(topic) => batch.demoted.push((row, topic)),
                    }
                }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_full_at_its_record_count_or_its_bytes() {
        let mut batch = Batch::default();
        assert!(!batch.is_full(3, 1000));
        batch.expired = 3;
        assert!(batch.is_full(3, 1000), "three records");
        let mut batch = Batch {
            bytes: 999,
            ..Batch::default()
        };
        assert!(!batch.is_full(256, 1000));
        batch.bytes = 1000;
        assert!(batch.is_full(256, 1000), "INSERT_BATCH_BYTES reached");
    }
}
