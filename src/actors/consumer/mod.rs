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
//! ingest DLQ acknowledged, demoted activations the demoted topic
//! acknowledged, expired and killswitched records counted. A crash between insert
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
//!
//! Beside this file, by job: `batch.rs` classifies records into the batch,
//! `writes.rs` stores it and dead-letters its invalid records through
//! outages, `pause.rs` keeps backpressure and the partitions' pause,
//! `rebalance.rs` follows partition ownership, `dead_letter.rs` builds
//! ingest dead-letter records.

mod batch;
mod dead_letter;
mod pause;
mod rebalance;
mod writes;

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

use self::batch::{Batch, record_of};
use self::dead_letter::DEAD_LETTER_DELIVERY_TIMEOUT;
pub use self::dead_letter::{
    DEAD_LETTER_HEADER_ROOM, ERROR_HEADER, ORIGINAL_BYTES_HEADER, REASON_HEADER, SOURCE_HEADER,
    dead_letter_cut,
};
use self::rebalance::{Ownership, PartitionLag, RebalanceContext, Rebalanced};
use super::fetch::WakeFetch;
use super::store::StoreHandle;
use crate::config::RawMode;
use crate::kafka::{KafkaSettings, PRODUCER_HEADROOM_BYTES, Producer, ThrottledLog};
use crate::metrics::Metrics;
use crate::model::ActivationError;
use crate::runtime::RuntimeRules;
use crate::supervisor::Health;

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
    /// The cluster the topic is on.
    pub kafka: KafkaSettings,
    /// Its name in the topology (raw tasks' ids include it).
    pub cluster: String,
    pub topic: String,
    pub group: String,
    /// How the topic's records become tasks when it is a raw topic.
    pub raw: Option<RawMode>,
    /// The cluster of the ingest dead-letter topic.
    pub ingest_dlq_kafka: KafkaSettings,
    /// `earliest` or `latest`.
    pub auto_offset_reset: String,
    pub ingest_dlq_topic: String,
    pub batch_size: usize,
    /// `INSERT_BATCH_BYTES`: a batch is written once its payloads reach it.
    pub batch_bytes: usize,
    pub batch_max_wait: Duration,
    pub max_inflight: u64,
    /// `MAX_INFLIGHT_BYTES` (0: no byte bound).
    pub max_inflight_bytes: u64,
    pub max_delay: Duration,
    pub max_activation_bytes: usize,
    /// Where assignments are reported (readiness waits for the first).
    pub health: Health,
    /// The operators' rules: records a killswitch matches are dropped,
    /// demoted namespaces' activations forwarded.
    pub rules: RuntimeRules,
    /// The default cluster, where demoted namespaces' activations go.
    pub forward_kafka: KafkaSettings,
    /// Test-only switch (`test-hooks` builds only): after this many stored
    /// batches the loop stops without committing, as if the process died
    /// between insert and commit.
    #[cfg(feature = "test-hooks")]
    pub crash_before_commit_after: Option<u64>,
    /// Once stop is requested, how much longer the last writes (the batch
    /// being inserted, the final flush's insert and dead-letter writes) may
    /// take before the consumer gives up on them without committing: long
    /// enough for a slow but healthy database, short enough that an outage
    /// cannot hold shutdown past `SHUTDOWN_TIMEOUT_MS` (see
    /// `ConsumerConfig::for_topic`).
    pub stop_grace: Duration,
}

impl ConsumerConfig {
    /// The topic's metrics label: `topic`, or `topic@cluster` off the default cluster.
    pub fn label(&self) -> String {
        crate::config::TopicAt {
            topic: self.topic.clone(),
            cluster: self.cluster.clone(),
        }
        .to_string()
    }
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
        // Here rather than on start: the topic's series exist from the
        // moment the broker is built, for the first scrape too.
        metrics.initialise_topic(&config.label());
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

/// How a flush ended.
#[derive(Debug, PartialEq, Eq)]
enum Flushed {
    /// Everything stored or dead-lettered, offsets committed.
    Committed,
    /// Stop was requested before the batch could be written: nothing of it
    /// was committed.
    GaveUp,
    /// The test-only crash switch fired.
    #[cfg(feature = "test-hooks")]
    Crashed,
}

/// Stop was requested while a write was unfinished.
#[derive(Debug)]
struct Stopped;

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

struct ConsumeLoop {
    config: ConsumerConfig,
    consumer: StreamConsumer<RebalanceContext>,
    ownership: Arc<Ownership>,
    dead_letters: Producer,
    /// Forwards demoted namespaces' activations; created on first use.
    forwarder: Option<Producer>,
    error_log: ThrottledLog,
    rebalances: mpsc::UnboundedReceiver<Rebalanced>,
    store: StoreHandle,
    wake: Vec<Recipient<WakeFetch>>,
    metrics: Arc<Metrics>,
    /// The topic's metrics label.
    label: String,
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
    /// Stored activation bytes of the topic: last sum read plus bytes
    /// stored since.
    inflight_bytes: u64,
    /// Batches stored so far, for the crash switch.
    #[cfg(feature = "test-hooks")]
    batches_stored: u64,
}

impl Drop for ConsumeLoop {
    fn drop(&mut self) {
        // Runs before the consumer field is dropped (and closed): the
        // revocation that closing triggers must not commit from inside it.
        self.ownership.closing();
        // A stopped consumer holds no partition: its lag series go.
        self.consumer.context().lag.clear();
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
                lag: PartitionLag::new(
                    Arc::clone(&metrics),
                    &config.topic,
                    config.label(),
                    &config.auto_offset_reset,
                ),
            })
            .map_err(|err| format!("Kafka consumer: {err}"))?;
        consumer
            .subscribe(&[config.topic.as_str()])
            .map_err(|err| format!("cannot subscribe to {}: {err}", config.topic))?;
        // Sized for any record this consumer can read: an invalid record is
        // dead-lettered whole, whatever its size.
        let dead_letters = config
            .ingest_dlq_kafka
            .create_producer_for(
                DEAD_LETTER_DELIVERY_TIMEOUT,
                config
                    .kafka
                    .max_fetched_record_bytes()
                    .saturating_add(PRODUCER_HEADROOM_BYTES),
            )
            .map_err(|err| format!("Kafka producer: {err}"))?;
        Ok(ConsumeLoop {
            label: config.label(),
            config,
            consumer,
            ownership,
            dead_letters,
            forwarder: None,
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
            inflight_bytes: 0,
            #[cfg(feature = "test-hooks")]
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
                            let (payload, position) = record_of(&self.config, &message);
                            self.read(payload, position);
                            // Take whatever else librdkafka already holds, up
                            // to a full batch: with INSERT_BATCH_MAX_MS = 0
                            // the batch is written as soon as nothing more is
                            // ready, so it grows with the load (records pile
                            // up while the previous insert runs).
                            while !self.batch.is_full(self.config.batch_size, self.config.batch_bytes) {
                                match self.consumer.recv().now_or_never() {
                                    Some(Ok(message)) => {
                                        let (payload, position) = record_of(&self.config, &message);
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
                    if self.batch.is_full(self.config.batch_size, self.config.batch_bytes)
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
        self.metrics
            .partitions_assigned
            .with_label_values(&[&self.label])
            .set(assigned as i64);
        match event {
            Rebalanced::Assigned => {
                tracing::info!(topic = %self.label, partitions = assigned, "Kafka partitions assigned");
                self.metrics
                    .consumer_assignments
                    .with_label_values(&[&self.label])
                    .inc();
                self.config.health.consumer_assigned(&self.label);
            }
            // Rows already read are still stored (inserts are idempotent);
            // their offsets are left to the partition's next owner.
            Rebalanced::Revoked => {
                tracing::info!(topic = %self.label, partitions = assigned, "Kafka partitions revoked")
            }
        }
        // The callback paused new partitions already; this keeps the gauge
        // (and any partition it could not pause) in step.
        if self.paused {
            self.pause_assigned();
        }
    }

    fn show_pending(&self) {
        self.metrics
            .consumer_pending_records
            .with_label_values(&[&self.label])
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
        self.check_after_flush().await;
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
            killswitched,
            mut demoted,
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
            demoted.retain(|(row, _)| kept(&row.topic, row.partition));
        }
        let read = rows.len() as u64;
        // Duplicates are counted too: the estimate only errs high, which
        // at worst reads the store's sum early.
        let read_bytes: u64 = rows.iter().map(|row| row.activation.len() as u64).sum();
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
        let forwarded = demoted.len() as u64;
        if self.forward_demoted(demoted).await.is_err() {
            return Flushed::GaveUp;
        }
        let metrics = &self.metrics.consumer_records;
        let topic = self.label.as_str();
        metrics
            .with_label_values(&[topic, "expired"])
            .inc_by(expired);
        metrics
            .with_label_values(&[topic, "killswitched"])
            .inc_by(killswitched);
        metrics
            .with_label_values(&[topic, "demoted"])
            .inc_by(forwarded);
        metrics.with_label_values(&[topic, "stored"]).inc_by(stored);
        metrics
            .with_label_values(&[topic, "duplicate"])
            .inc_by(read - refused - stored);
        #[cfg(feature = "test-hooks")]
        {
            // Only batches that stored rows count: a batch whose records
            // all went to another consumer (a rebalance while they were
            // read) stores nothing, and crashing after it proves nothing.
            if stored > 0 {
                self.batches_stored += 1;
            }
            if self
                .config
                .crash_before_commit_after
                .is_some_and(|limit| self.batches_stored >= limit)
            {
                tracing::warn!("test switch: stopping between insert and commit");
                return Flushed::Crashed;
            }
        }
        self.ownership.settled(&offsets);
        self.commit(&offsets, mode);
        if stored > 0 {
            for fetcher in &self.wake {
                let _ = fetcher.try_send(WakeFetch);
            }
        }
        self.inflight += stored;
        if stored > 0 {
            self.inflight_bytes += read_bytes;
        }
        Flushed::Committed
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
                        let (payload, position) = record_of(&self.config, &message);
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
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
