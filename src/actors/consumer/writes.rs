//! Storing a consumed batch and dead-lettering its invalid records, through
//! outages: a store failure or a failed dead-letter write is retried with
//! backoff while the partitions are paused, and a batch the store refuses
//! as data is split until each refused row is alone (it then goes to the
//! ingest dead-letter topic). Offsets never move past a record that is
//! neither stored nor dead-lettered.

use std::sync::Arc;
use std::time::Duration;

use super::dead_letter::{self, Invalid};
use super::{ConsumeLoop, RETRY_BACKOFF_MAX, RETRY_BACKOFF_MIN, Stopped};
use rdkafka::producer::FutureRecord;
use rdkafka::util::Timeout;

use crate::kafka::{Producer, refused_as_too_large};
use crate::metrics::Stage;
use crate::model::{ActivationError, InflightActivation, KafkaPosition};
use crate::store::StoreError;

/// Exponential backoff between retries.
pub(super) struct Backoff(Duration);

impl Backoff {
    pub(super) fn new() -> Self {
        Backoff(RETRY_BACKOFF_MIN)
    }

    pub(super) fn next(&mut self) -> Duration {
        let pause = self.0;
        self.0 = (self.0 * 2).min(RETRY_BACKOFF_MAX);
        pause
    }
}

/// The outcome of one insert, retried through transient failures.
pub(super) enum Inserted {
    Stored(u64),
    Rejected(StoreError),
}

impl ConsumeLoop {
    /// Stores `rows`. When the store refuses the batch as data, splits it in
    /// halves until each refused row is alone; returns how many rows were
    /// new and the refused rows, ready for the ingest DLQ.
    pub(super) async fn store_rows(
        &mut self,
        rows: Vec<InflightActivation>,
    ) -> Result<(u64, Vec<Invalid>), Stopped> {
        let mut stored = 0;
        let mut refused = Vec::new();
        let mut groups = vec![rows];
        while let Some(group) = groups.pop() {
            let group = Arc::new(group);
            match self.insert_retrying(Arc::clone(&group)).await? {
                Inserted::Stored(count) => stored += count,
                Inserted::Rejected(err) => {
                    // The StoreActor has usually dropped its copy by now;
                    // cloning is the rare fallback.
                    let mut group =
                        Arc::try_unwrap(group).unwrap_or_else(|shared| (*shared).clone());
                    if group.len() > 1 {
                        let second = group.split_off(group.len() / 2);
                        groups.push(second);
                        groups.push(group);
                    } else if let Some(row) = group.pop() {
                        refused.push(Invalid {
                            position: KafkaPosition {
                                topic: row.topic,
                                partition: row.partition,
                                offset: row.kafka_offset,
                            },
                            bytes: row.activation,
                            original_len: None,
                            error: ActivationError::StoreRejected(err.to_string()),
                        });
                    }
                }
            }
        }
        Ok((stored, refused))
    }

    /// One insert, retried with backoff through anything but a refusal of
    /// the data: offsets never move past rows that are not stored.
    pub(super) async fn insert_retrying(
        &mut self,
        rows: Arc<Vec<InflightActivation>>,
    ) -> Result<Inserted, Stopped> {
        let mut backoff = Backoff::new();
        loop {
            let insert = self.store.insert(Arc::clone(&rows));
            let pause = backoff.next();
            match self.attempt(insert).await.ok_or(Stopped)? {
                Ok(stored) => {
                    let now = chrono::Utc::now();
                    for row in rows.iter() {
                        let waited = (now - row.received_at).as_seconds_f64();
                        self.metrics.observe_stage(Stage::ReceivedToStored, waited);
                    }
                    return Ok(Inserted::Stored(stored));
                }
                Err(err @ StoreError::Rejected { .. }) => {
                    tracing::warn!(error = %err, rows = rows.len(), "the store refused a consumed batch; isolating the refused rows");
                    return Ok(Inserted::Rejected(err));
                }
                Err(err) => {
                    crate::warn_throttled!(error = %err, rows = rows.len(), retry_in = ?pause, "cannot store consumed batch; retrying");
                }
            }
            self.held = true;
            if !self.wait_polling(pause).await {
                return Err(Stopped);
            }
        }
    }

    /// Writes every invalid record to the ingest dead-letter topic and
    /// returns once Kafka acknowledged them all; failed writes are retried
    /// with backoff, partitions paused, so an offset never moves past a
    /// record that is neither stored nor dead-lettered.
    pub(super) async fn dead_letter(&mut self, invalid: Vec<Invalid>) -> Result<(), Stopped> {
        for record in &invalid {
            let reason = record.error.reason();
            self.metrics
                .invalid_records
                .with_label_values(&[&self.label, reason])
                .inc();
            self.metrics
                .consumer_records
                .with_label_values(&[&self.label, "invalid"])
                .inc();
            let position = &record.position;
            tracing::warn!(
                topic = %position.topic,
                partition = position.partition,
                offset = position.offset,
                reason,
                error = %record.error,
                "invalid activation record; sending it to the ingest dead-letter topic"
            );
        }
        let mut pending = invalid;
        let mut backoff = Backoff::new();
        while !pending.is_empty() {
            let sends = futures::future::join_all(pending.iter().map(|record| {
                dead_letter::send(&self.dead_letters, &self.config.ingest_dlq_topic, record)
            }));
            let results = self.attempt(sends).await.ok_or(Stopped)?;
            let mut failed = Vec::new();
            let mut cut = Vec::new();
            let mut last_error = None;
            for (mut record, result) in pending.into_iter().zip(results) {
                let whole = record.original_len.is_none();
                match result {
                    Ok(()) => {
                        self.metrics
                            .ingest_dead_letters
                            .with_label_values(&["ok"])
                            .inc();
                    }
                    // Kafka will never take it whole: cut it and send the
                    // cut record at once. The offset still waits for it.
                    Err(err)
                        if refused_as_too_large(&err)
                            && record.cut(self.config.max_activation_bytes) =>
                    {
                        self.count_cut(&record, &err, whole);
                        cut.push(record);
                    }
                    Err(err) => {
                        self.metrics
                            .ingest_dead_letters
                            .with_label_values(&["error"])
                            .inc();
                        last_error = Some(err);
                        failed.push(record);
                    }
                }
            }
            pending = failed;
            pending.extend(cut);
            if let Some(err) = last_error {
                let pause = backoff.next();
                crate::warn_throttled!(
                    error = %err,
                    records = pending.len(),
                    topic = %self.config.ingest_dlq_topic,
                    retry_in = ?pause,
                    "cannot write invalid records to the ingest dead-letter topic; \
                     partitions paused until it succeeds"
                );
                self.held = true;
                if !self.wait_polling(pause).await {
                    return Err(Stopped);
                }
            }
        }
        Ok(())
    }

    /// Counts and logs a dead letter cut after Kafka refused it (once per
    /// record, however many cuts it takes).
    fn count_cut(&self, record: &Invalid, err: &rdkafka::error::KafkaError, first: bool) {
        let position = &record.position;
        let original = record.original_len.unwrap_or(record.bytes.len());
        if first {
            self.metrics
                .dead_letters_truncated
                .with_label_values(&["ingest"])
                .inc();
        }
        tracing::warn!(
            topic = %position.topic,
            partition = position.partition,
            offset = position.offset,
            bytes = original,
            cut_to = record.bytes.len(),
            dlq = %self.config.ingest_dlq_topic,
            error = %err,
            "Kafka refused the ingest dead letter as too large; sending it cut short \
             (the whole record stays in the source topic at this offset until its retention)"
        );
    }

    /// Forwards demoted namespaces' activations, unchanged and keyed by id,
    /// to the demoted topic on the default cluster; resolves once Kafka
    /// acknowledged every one. Failures are retried with backoff and the
    /// partitions paused, like dead letters: no offset moves past a record
    /// that is neither stored nor forwarded.
    pub(super) async fn forward_demoted(
        &mut self,
        demoted: Vec<(InflightActivation, Arc<str>)>,
    ) -> Result<(), Stopped> {
        let mut pending = demoted;
        let mut backoff = Backoff::new();
        while !pending.is_empty() {
            let failure = match self.forward_producer() {
                Err(err) => Some(err),
                Ok(producer) => {
                    let timeout = Timeout::After(dead_letter::DEAD_LETTER_DELIVERY_TIMEOUT);
                    let sends = futures::future::join_all(pending.iter().map(|(row, topic)| {
                        producer.send(
                            FutureRecord::to(topic)
                                .key(&row.id)
                                .payload(&row.activation),
                            timeout,
                        )
                    }));
                    let results = self.attempt(sends).await.ok_or(Stopped)?;
                    let mut last_error = None;
                    let mut failed = Vec::new();
                    for (item, result) in pending.into_iter().zip(results) {
                        if let Err((err, _)) = result {
                            last_error = Some(err.to_string());
                            failed.push(item);
                        }
                    }
                    pending = failed;
                    last_error
                }
            };
            if let Some(err) = failure {
                let pause = backoff.next();
                crate::warn_throttled!(
                    error = %err,
                    records = pending.len(),
                    retry_in = ?pause,
                    "cannot forward demoted tasks to the demoted topic; partitions paused \
                     until it succeeds"
                );
                self.held = true;
                if !self.wait_polling(pause).await {
                    return Err(Stopped);
                }
            }
        }
        Ok(())
    }

    fn forward_producer(&mut self) -> Result<Producer, String> {
        if let Some(producer) = &self.forwarder {
            return Ok(producer.clone());
        }
        let producer = self
            .config
            .forward_kafka
            .create_producer(dead_letter::DEAD_LETTER_DELIVERY_TIMEOUT)
            .map_err(|err| format!("Kafka producer for the demoted topic: {err}"))?;
        self.forwarder = Some(producer.clone());
        Ok(producer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_ceiling() {
        let mut backoff = Backoff::new();
        let pauses: Vec<u64> = (0..9).map(|_| backoff.next().as_millis() as u64).collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
    }
}
