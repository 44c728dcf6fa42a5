//! ConsumerActor: reads task activations from Kafka into the store.
//!
//! - Owns: the Kafka consumer (group member on `KAFKA_TOPIC`), the batch
//!   being built, a producer for the ingest dead-letter topic.
//! - Receives: [`StopConsuming`]; Kafka records and rebalance events arrive
//!   through its consume loop.
//! - Sends: [`InsertBatch`] and [`CountByStatus`] to the StoreActor;
//!   [`WakeFetch`] to FetchActors after each stored batch.
//!
//! Offsets are committed by hand, and only up to records the batch fully
//! settled: rows the StoreActor acknowledged as durable, invalid records the
//! ingest DLQ acknowledged, expired records counted. A crash between insert
//! and commit re-reads the batch; inserts are idempotent, so each activation
//! is still stored once. Offsets of a partition revoked after its records
//! were read are never committed: its new owner re-reads them.
//!
//! A batch the store refuses as data (`StoreError::Rejected`) is split in
//! halves until each refused row is alone; the others are stored and the
//! refused ones dead-lettered (`store_rejected`). Any other store failure,
//! and any failed dead-letter write, is retried with backoff
//! ([`RETRY_BACKOFF_MIN`] doubling to [`RETRY_BACKOFF_MAX`]) while every
//! assigned partition is paused, so nothing piles up and nothing is skipped.
//!
//! Backpressure: when the rows still in flight (Pending, Delay, Claimed,
//! Processing) reach `MAX_INFLIGHT`, every assigned partition is paused, and
//! no batch is inserted until they drop below 90 % of the limit. The bound
//! is checked at startup before the first poll, on every assignment (inside
//! the rebalance callback, before librdkafka hands out a record) and before
//! every insert, so the table never holds more than `MAX_INFLIGHT` plus one
//! batch per consumer. While paused the loop keeps polling, so group
//! membership and rebalances stay alive.
//!
//! Stopping: what was read is stored and committed; once stop is requested a
//! write gets `stop_grace` more to finish, and nothing is retried, so a
//! store or Kafka outage cannot hold shutdown up. What could not be stored
//! or dead-lettered is left uncommitted for the next owner.

mod dead_letter;
mod rebalance;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use futures::FutureExt as _;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use self::dead_letter::{DEAD_LETTER_DELIVERY_TIMEOUT, Invalid};
pub use self::dead_letter::{
    DEAD_LETTER_HEADER_ROOM, ERROR_HEADER, ORIGINAL_BYTES_HEADER, REASON_HEADER, SOURCE_HEADER,
    dead_letter_cut,
};
use self::rebalance::{Ownership, RebalanceContext, Rebalanced};
use super::fetch::WakeFetch;
use super::store::{CountByStatus, InsertBatch, StoreHandle};
use crate::kafka::{KafkaSettings, Producer, ThrottledLog};
use crate::metrics::Metrics;
use crate::model::InflightActivation;
use crate::model::{ActivationError, KafkaPosition, inflight_from_record};
use crate::store::StoreError;

/// How often a paused consumer re-reads the in-flight count, and the longest
/// the loop goes without polling Kafka.
const TICK: Duration = Duration::from_millis(250);
/// Pause after a consumer error before polling again.
const CONSUMER_ERROR_PAUSE: Duration = Duration::from_millis(200);
/// First pause before retrying a failed insert or dead-letter write.
pub const RETRY_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest pause between retries; the backoff doubles up to it.
pub const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The least `stop_grace` a consumer gets.
pub const MIN_STOP_GRACE: Duration = Duration::from_secs(1);
/// Settings of the consumer.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    pub kafka: KafkaSettings,
    pub topic: String,
    pub group: String,
    /// `earliest` or `latest`.
    pub auto_offset_reset: String,
    pub ingest_dlq_topic: String,
    pub batch_size: usize,
    pub batch_max_wait: Duration,
    pub max_inflight: u64,
    pub max_delay: Duration,
    pub max_activation_bytes: usize,
    /// Test-only switch: after this many stored batches the loop stops
    /// without committing, as if the process died between insert and commit.
    pub crash_before_commit_after: Option<u64>,
    /// Once stop is requested, how much longer the last writes (the batch
    /// being inserted, the final flush's insert and dead-letter writes) may
    /// take before the consumer gives up on them without committing: long
    /// enough for a slow but healthy database, short enough that an outage
    /// cannot hold shutdown past `SHUTDOWN_TIMEOUT_MS` (see
    /// `ConsumerConfig::from_config`).
    pub stop_grace: Duration,
}

/// Stop consuming: flush and commit what was read, then stop. Resolves when
/// the consumer has left.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct StopConsuming;

/// The stop signal: `Some(when the consumer gives up on unfinished writes)`
/// once stop was requested.
type StopSignal = watch::Receiver<Option<Instant>>;

pub struct ConsumerActor {
    config: ConsumerConfig,
    store: StoreHandle,
    wake: Vec<Recipient<WakeFetch>>,
    metrics: Arc<Metrics>,
    stop: watch::Sender<Option<Instant>>,
    stopped: Vec<oneshot::Sender<()>>,
}

impl ConsumerActor {
    pub fn new(
        config: ConsumerConfig,
        store: StoreHandle,
        wake: Vec<Recipient<WakeFetch>>,
        metrics: Arc<Metrics>,
    ) -> Self {
        ConsumerActor {
            config,
            store,
            wake,
            metrics,
            stop: watch::channel(None).0,
            stopped: Vec::new(),
        }
    }
}

impl Actor for ConsumerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let consume = ConsumeLoop::start(
            self.config.clone(),
            self.store.clone(),
            self.wake.clone(),
            Arc::clone(&self.metrics),
            self.stop.subscribe(),
        );
        ctx.spawn(
            async move {
                match consume {
                    Ok(consume) => consume.run().await,
                    Err(err) => tracing::error!(error = %err, "cannot start the Kafka consumer"),
                }
            }
            .into_actor(self)
            .map(|(), _act, ctx| ctx.stop()),
        );
    }

    fn stopped(&mut self, _ctx: &mut Self::Context) {
        for done in self.stopped.drain(..) {
            let _ = done.send(());
        }
    }
}

impl Handler<StopConsuming> for ConsumerActor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: StopConsuming, _ctx: &mut Self::Context) -> Self::Result {
        // The first request fixes the deadline; later ones do not extend it.
        let grace = self.config.stop_grace.max(MIN_STOP_GRACE);
        self.stop.send_if_modified(|stop| {
            let first = stop.is_none();
            stop.get_or_insert_with(|| Instant::now() + grace);
            first
        });
        let (done, stopped) = oneshot::channel();
        self.stopped.push(done);
        Box::pin(async move {
            let _ = stopped.await;
        })
    }
}

/// Records read since the last flush.
#[derive(Default)]
struct Batch {
    rows: Vec<InflightActivation>,
    invalid: Vec<Invalid>,
    expired: u64,
    /// Per (topic, partition): the ownership generation the records were
    /// read under, and the highest offset read.
    offsets: BTreeMap<(String, i32), (u64, i64)>,
    started: Option<Instant>,
}

impl Batch {
    fn records(&self) -> usize {
        self.rows.len() + self.invalid.len() + self.expired as usize
    }
}

/// How a flush ended.
#[derive(Debug, PartialEq, Eq)]
enum Flushed {
    /// Everything stored or dead-lettered, offsets committed.
    Committed,
    /// Stop was requested before the batch could be written: nothing of it
    /// was committed.
    GaveUp,
    /// The test-only crash switch fired.
    Crashed,
}

/// Stop was requested while a write was unfinished.
#[derive(Debug)]
struct Stopped;

/// Exponential backoff between retries.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Backoff(RETRY_BACKOFF_MIN)
    }

    fn next(&mut self) -> Duration {
        let pause = self.0;
        self.0 = (self.0 * 2).min(RETRY_BACKOFF_MAX);
        pause
    }
}

/// Resolves once stop is requested (or the actor is gone).
async fn stop_requested(stop: &mut StopSignal) {
    let _ = stop.wait_for(Option::is_some).await;
}

/// Resolves when a stopping consumer gives up on unfinished writes.
async fn give_up(mut stop: StopSignal) {
    let deadline = match stop.wait_for(Option::is_some).await {
        Ok(deadline) => deadline.unwrap_or_else(Instant::now),
        Err(_) => return, // the actor is gone
    };
    tokio::time::sleep_until(deadline).await;
}

/// The payload and position of a record, owned, so the borrowed message
/// (and with it the consumer) is released at once.
fn record_of(message: &impl rdkafka::message::Message) -> (Vec<u8>, KafkaPosition) {
    let position = KafkaPosition {
        topic: message.topic().to_owned(),
        partition: message.partition(),
        offset: message.offset(),
    };
    (message.payload().unwrap_or_default().to_vec(), position)
}

/// The outcome of one insert, retried through transient failures.
enum Inserted {
    Stored(u64),
    Rejected(StoreError),
}

struct ConsumeLoop {
    config: ConsumerConfig,
    consumer: StreamConsumer<RebalanceContext>,
    ownership: Arc<Ownership>,
    dead_letters: Producer,
    error_log: ThrottledLog,
    rebalances: mpsc::UnboundedReceiver<Rebalanced>,
    store: StoreHandle,
    wake: Vec<Recipient<WakeFetch>>,
    metrics: Arc<Metrics>,
    stop: StopSignal,
    /// Records read and not yet handed to a flush.
    batch: Batch,
    /// Records of the flush under way.
    flushing: usize,
    /// The store holds `MAX_INFLIGHT` rows (until it drains below 90 %).
    full: bool,
    /// A flush waits for the store or the ingest DLQ.
    held: bool,
    /// Whether the assigned partitions are paused now.
    paused: bool,
    /// In-flight rows: last count read plus rows stored since.
    inflight: u64,
    batches_stored: u64,
}

impl Drop for ConsumeLoop {
    fn drop(&mut self) {
        // Runs before the consumer field is dropped (and closed): the
        // revocation that closing triggers must not commit from inside it.
        self.ownership.closing();
    }
}

impl ConsumeLoop {
    fn start(
        config: ConsumerConfig,
        store: StoreHandle,
        wake: Vec<Recipient<WakeFetch>>,
        metrics: Arc<Metrics>,
        stop: StopSignal,
    ) -> Result<Self, String> {
        let (events, rebalances) = mpsc::unbounded_channel();
        let ownership = Arc::new(Ownership::default());
        let consumer: StreamConsumer<RebalanceContext> = config
            .kafka
            .consumer(&config.group, &config.auto_offset_reset)
            .create_with_context(RebalanceContext {
                events,
                ownership: Arc::clone(&ownership),
                log: ThrottledLog::default(),
            })
            .map_err(|err| format!("Kafka consumer: {err}"))?;
        consumer
            .subscribe(&[config.topic.as_str()])
            .map_err(|err| format!("cannot subscribe to {}: {err}", config.topic))?;
        let dead_letters = config
            .kafka
            .create_producer(DEAD_LETTER_DELIVERY_TIMEOUT)
            .map_err(|err| format!("Kafka producer: {err}"))?;
        Ok(ConsumeLoop {
            config,
            consumer,
            ownership,
            dead_letters,
            rebalances,
            store,
            wake,
            metrics,
            stop,
            error_log: ThrottledLog::default(),
            batch: Batch::default(),
            flushing: 0,
            full: false,
            held: false,
            paused: false,
            inflight: 0,
            batches_stored: 0,
        })
    }

    async fn run(mut self) {
        tracing::info!(topic = %self.config.topic, group = %self.config.group, "consuming");
        // Before the first poll: a broker restarted on a full store must
        // not insert another batch before it notices.
        self.refresh_inflight().await;
        self.update_backpressure();
        let mut tick = tokio::time::interval(TICK);
        loop {
            let flush_at = self
                .batch
                .started
                .map(|started| started + self.config.batch_max_wait);
            tokio::select! {
                biased;
                () = stop_requested(&mut self.stop) => break,
                Some(event) = self.rebalances.recv() => self.rebalanced(event),
                () = sleep_until(flush_at) => {
                    if self.flush(CommitMode::Async).await != Flushed::Committed { return; }
                }
                // Also keeps librdkafka polled while paused, so the group
                // does not consider this member dead.
                _ = tick.tick() => {
                    if self.full {
                        self.refresh_inflight().await;
                        self.update_backpressure();
                    }
                }
                // Paused partitions deliver nothing; polling goes on regardless.
                message = self.consumer.recv() => {
                    match message {
                        Ok(message) => {
                            let (payload, position) = record_of(&message);
                            self.read(payload, position);
                            // Take whatever else librdkafka already holds, up
                            // to a full batch: with INSERT_BATCH_MAX_MS = 0
                            // the batch is written as soon as nothing more is
                            // ready, so it grows with the load (records pile
                            // up while the previous insert runs).
                            while self.batch.records() < self.config.batch_size {
                                match self.consumer.recv().now_or_never() {
                                    Some(Ok(message)) => {
                                        let (payload, position) = record_of(&message);
                                        self.read(payload, position);
                                    }
                                    Some(Err(err)) => {
                                        self.log_consumer_error(&err);
                                        break;
                                    }
                                    None => break,
                                }
                            }
                        }
                        Err(err) => {
                            // librdkafka repeats errors such as "all brokers
                            // down" on every poll: log a few, and do not spin.
                            self.log_consumer_error(&err);
                            tokio::time::sleep(CONSUMER_ERROR_PAUSE).await;
                        }
                    }
                    if self.batch.records() >= self.config.batch_size
                        && self.flush(CommitMode::Async).await != Flushed::Committed
                    {
                        return;
                    }
                }
            }
        }
        // Stopping: what was read is stored and committed before leaving,
        // synchronously: an asynchronous commit still queued when the
        // consumer closes can be lost, and the partition's next owner would
        // then read (and run) the batch again.
        self.flush(CommitMode::Sync).await;
        tracing::info!(topic = %self.config.topic, "consumer stopped");
    }

    fn log_consumer_error(&self, err: &KafkaError) {
        self.error_log.maybe(|suppressed| {
            tracing::warn!(error = %err, suppressed, "Kafka consumer error");
        });
    }

    fn rebalanced(&mut self, event: Rebalanced) {
        let assigned = self.consumer.assignment().map_or(0, |list| list.count());
        self.metrics.partitions_assigned.set(assigned as i64);
        match event {
            Rebalanced::Assigned => {
                tracing::info!(partitions = assigned, "Kafka partitions assigned");
                self.metrics.consumer_assignments.inc();
            }
            // Rows already read are still stored (inserts are idempotent);
            // their offsets are left to the partition's next owner.
            Rebalanced::Revoked => {
                tracing::info!(partitions = assigned, "Kafka partitions revoked")
            }
        }
        // The callback paused new partitions already; this keeps the gauge
        // (and any partition it could not pause) in step.
        if self.paused {
            self.pause_assigned();
        }
    }

    /// Classifies one record into the batch being built.
    fn read(&mut self, payload: Vec<u8>, position: KafkaPosition) {
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

    fn show_pending(&self) {
        self.metrics
            .consumer_pending_records
            .set((self.batch.records() + self.flushing) as i64);
    }

    /// Stores the batch, dead-letters its invalid records, then commits its
    /// offsets; records read meanwhile form the next batch.
    async fn flush(&mut self, mode: CommitMode) -> Flushed {
        if self.batch.records() == 0 {
            self.batch.started = None;
            return Flushed::Committed;
        }
        let batch = std::mem::take(&mut self.batch);
        self.flushing = batch.records();
        let flushed = self.write(batch, mode).await;
        self.flushing = 0;
        self.show_pending();
        self.held = false;
        self.update_backpressure();
        if flushed == Flushed::GaveUp {
            tracing::warn!(
                "stopping with a batch not fully written; its offsets stay uncommitted \
                 and the partitions' next owner reads it again"
            );
        }
        flushed
    }

    async fn write(&mut self, batch: Batch, mode: CommitMode) -> Flushed {
        let Batch {
            mut rows,
            mut invalid,
            expired,
            offsets,
            ..
        } = batch;
        // Records of partitions that went to another consumer since they
        // were read are left to it: it reads them again from the last
        // committed offset. Storing them here as well could let this broker
        // run and remove a task that the new owner then stores again.
        let gone: Vec<&(String, i32)> = offsets
            .iter()
            .filter(|((topic, partition), (read_under, _))| {
                self.ownership.generation(topic, *partition) != *read_under
            })
            .map(|(key, _)| key)
            .collect();
        if !gone.is_empty() {
            let kept = |topic: &str, partition: i32| {
                !gone.iter().any(|(t, p)| *p == partition && t == topic)
            };
            rows.retain(|row| kept(&row.topic, row.partition));
            invalid.retain(|record| kept(&record.position.topic, record.position.partition));
        }
        let read = rows.len() as u64;
        let mut stored = 0;
        if !rows.is_empty() {
            if self.wait_for_room().await.is_err() {
                return Flushed::GaveUp;
            }
            let Ok((inserted, refused)) = self.store_rows(rows).await else {
                return Flushed::GaveUp;
            };
            stored = inserted;
            invalid.extend(refused);
        }
        let refused = invalid
            .iter()
            .filter(|record| matches!(record.error, ActivationError::StoreRejected(_)))
            .count() as u64;
        if self.dead_letter(invalid).await.is_err() {
            return Flushed::GaveUp;
        }
        let metrics = &self.metrics.consumer_records;
        metrics.with_label_values(&["expired"]).inc_by(expired);
        metrics.with_label_values(&["stored"]).inc_by(stored);
        metrics
            .with_label_values(&["duplicate"])
            .inc_by(read - refused - stored);
        self.batches_stored += 1;
        if self
            .config
            .crash_before_commit_after
            .is_some_and(|limit| self.batches_stored >= limit)
        {
            tracing::warn!("test switch: stopping between insert and commit");
            return Flushed::Crashed;
        }
        self.ownership.settled(&offsets);
        self.commit(&offsets, mode);
        if stored > 0 {
            for fetcher in &self.wake {
                let _ = fetcher.try_send(WakeFetch);
            }
        }
        self.inflight += stored;
        Flushed::Committed
    }

    /// Waits, paused, while the store holds `MAX_INFLIGHT` rows or more:
    /// the check before every insert.
    async fn wait_for_room(&mut self) -> Result<(), Stopped> {
        if self.inflight < self.config.max_inflight {
            return Ok(());
        }
        // The local count only grows between reads (rows stored, none
        // finished): read the store before pausing on it.
        self.refresh_inflight().await;
        self.update_backpressure();
        while self.full {
            if !self.wait_polling(TICK).await {
                return Err(Stopped);
            }
            self.refresh_inflight().await;
            self.update_backpressure();
        }
        Ok(())
    }

    /// Stores `rows`. When the store refuses the batch as data, splits it in
    /// halves until each refused row is alone; returns how many rows were
    /// new and the refused rows, ready for the ingest DLQ.
    async fn store_rows(
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
    async fn insert_retrying(
        &mut self,
        rows: Arc<Vec<InflightActivation>>,
    ) -> Result<Inserted, Stopped> {
        let mut backoff = Backoff::new();
        loop {
            let insert = self.store.call(InsertBatch {
                rows: Arc::clone(&rows),
            });
            let pause = backoff.next();
            match self.attempt(insert).await.ok_or(Stopped)? {
                Ok(stored) => return Ok(Inserted::Stored(stored)),
                Err(err @ StoreError::Rejected { .. }) => {
                    tracing::warn!(error = %err, rows = rows.len(), "the store refused a consumed batch; isolating the refused rows");
                    return Ok(Inserted::Rejected(err));
                }
                Err(err) => {
                    tracing::warn!(error = %err, rows = rows.len(), retry_in = ?pause, "cannot store consumed batch; retrying");
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
    async fn dead_letter(&mut self, invalid: Vec<Invalid>) -> Result<(), Stopped> {
        for record in &invalid {
            let reason = record.error.reason();
            self.metrics
                .invalid_records
                .with_label_values(&[reason])
                .inc();
            self.metrics
                .consumer_records
                .with_label_values(&["invalid"])
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
            let mut last_error = None;
            for (record, result) in pending.into_iter().zip(results) {
                let label = if result.is_ok() { "ok" } else { "error" };
                self.metrics
                    .ingest_dead_letters
                    .with_label_values(&[label])
                    .inc();
                if let Err(err) = result {
                    last_error = Some(err);
                    failed.push(record);
                }
            }
            pending = failed;
            if let Some(err) = last_error {
                let pause = backoff.next();
                tracing::warn!(
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

    /// Runs one write, unless the consumer is stopping and its grace ran
    /// out first (`None`).
    async fn attempt<T>(&self, write: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            biased;
            result = write => Some(result),
            () = give_up(self.stop.clone()) => None,
        }
    }

    /// Waits `pause` with the partitions paused as the state asks (a held
    /// flush or a full store), still polling Kafka: rebalances are handled
    /// and a record fetched before the pause joins the next batch. Returns
    /// false, at once, when stop is requested.
    async fn wait_polling(&mut self, pause: Duration) -> bool {
        if self.stop.borrow().is_some() {
            return false;
        }
        self.update_pause();
        let until = Instant::now() + pause;
        loop {
            tokio::select! {
                biased;
                () = stop_requested(&mut self.stop) => return false,
                Some(event) = self.rebalances.recv() => self.rebalanced(event),
                () = tokio::time::sleep_until(until) => return true,
                message = self.consumer.recv() => match message {
                    Ok(message) => {
                        let (payload, position) = record_of(&message);
                        self.read(payload, position);
                    }
                    Err(err) => {
                        self.log_consumer_error(&err);
                        tokio::time::sleep_until(until.min(Instant::now() + CONSUMER_ERROR_PAUSE)).await;
                    }
                },
            }
        }
    }

    /// Commits `offsets` + 1, leaving out partitions revoked since their
    /// records were read.
    fn commit(&self, offsets: &BTreeMap<(String, i32), (u64, i64)>, mode: CommitMode) {
        let mut partitions = TopicPartitionList::new();
        let mut revoked = 0;
        for ((topic, partition), (generation, offset)) in offsets {
            if self.ownership.generation(topic, *partition) != *generation {
                revoked += 1;
                continue;
            }
            if let Err(err) =
                partitions.add_partition_offset(topic, *partition, Offset::Offset(offset + 1))
            {
                tracing::warn!(error = %err, "cannot build the offset commit");
            }
        }
        if revoked > 0 {
            tracing::info!(
                partitions = revoked,
                "not committing offsets of partitions revoked since they were read"
            );
        }
        if partitions.count() == 0 {
            return;
        }
        if let Err(err) = self.consumer.commit(&partitions, mode) {
            tracing::warn!(error = %err, "cannot commit offsets; they are committed with the next batch");
        }
    }

    async fn refresh_inflight(&mut self) {
        let count = self.store.call(CountByStatus {});
        if let Some(Ok(counts)) = self.attempt(count).await {
            self.inflight = counts.inflight();
        }
    }

    /// Pauses at `MAX_INFLIGHT`, resumes below 90 % of it.
    fn update_backpressure(&mut self) {
        let limit = self.config.max_inflight;
        if !self.full && self.inflight >= limit {
            tracing::info!(
                inflight = self.inflight,
                limit,
                "store full; pausing consumption"
            );
            self.full = true;
        } else if self.full && self.inflight < limit - limit / 10 {
            tracing::info!(
                inflight = self.inflight,
                "store drained; resuming consumption"
            );
            self.full = false;
        }
        self.update_pause();
    }

    /// Pauses or resumes every assigned partition to match the state, and
    /// tells the rebalance callback whether to pause new ones.
    fn update_pause(&mut self) {
        let hold = self.full || self.held;
        self.ownership.lock().hold = hold;
        if hold == self.paused {
            return;
        }
        self.paused = hold;
        if hold {
            self.pause_assigned();
        } else {
            if let Ok(assigned) = self.consumer.assignment()
                && let Err(err) = self.consumer.resume(&assigned)
            {
                tracing::warn!(error = %err, "cannot resume partitions");
            }
            self.metrics.partitions_paused.set(0);
        }
    }

    fn pause_assigned(&self) {
        match self.consumer.assignment() {
            Ok(assigned) => {
                if let Err(err) = self.consumer.pause(&assigned) {
                    tracing::warn!(error = %err, "cannot pause partitions");
                }
                self.metrics.partitions_paused.set(assigned.count() as i64);
            }
            Err(err) => tracing::warn!(error = %err, "cannot read the assignment"),
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
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
