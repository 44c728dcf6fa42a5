//! ConsumerActor: reads task activations from Kafka into the store.
//!
//! - Owns: the Kafka consumer (group member on `KAFKA_TOPIC`), the batch
//!   being built, a producer for the ingest dead-letter topic.
//! - Receives: [`StopConsuming`]; Kafka records and rebalance events arrive
//!   through its consume loop.
//! - Sends: [`InsertBatch`] and [`CountByStatus`] to the StoreActor;
//!   [`WakeFetch`] to FetchActors after each stored batch.
//!
//! Offsets are committed by hand, and only up to records whose batch the
//! StoreActor acknowledged (rows durable, invalid records acknowledged by
//! the ingest DLQ, expired records counted). A crash between insert and
//! commit re-reads the batch; inserts are idempotent, so each activation is
//! still stored once.
//!
//! Backpressure: when the rows still in flight (Pending, Delay, Claimed,
//! Processing) reach `MAX_INFLIGHT`, every assigned partition is paused;
//! the loop keeps polling (so group membership and rebalances stay alive)
//! and resumes below 90 % of the limit.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use futures::FutureExt as _;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaResult;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::util::Timeout;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::fetch::WakeFetch;
use super::store::{CountByStatus, InsertBatch, StoreActor};
use crate::activation::{ActivationError, KafkaPosition, inflight_from_record};
use crate::kafka::{KafkaSettings, Producer, ThrottledLog};
use crate::metrics::Metrics;
use crate::store::InflightActivation;

/// How often a paused consumer re-reads the in-flight count, and the longest
/// the loop goes without polling Kafka.
const TICK: Duration = Duration::from_millis(250);
/// Pause after a consumer error before polling again.
const CONSUMER_ERROR_PAUSE: Duration = Duration::from_millis(200);
/// Pause between retries of a batch the store refused.
const INSERT_RETRY_PAUSE: Duration = Duration::from_millis(500);
/// Header names on ingest dead-letter records.
pub const ERROR_HEADER: &str = "taskbroker-error";
pub const REASON_HEADER: &str = "taskbroker-error-reason";
pub const SOURCE_HEADER: &str = "taskbroker-source";

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
}

/// Stop consuming: flush and commit what was read, then stop. Resolves when
/// the consumer has left.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct StopConsuming;

pub struct ConsumerActor {
    config: ConsumerConfig,
    store: Addr<StoreActor>,
    wake: Vec<Recipient<WakeFetch>>,
    metrics: Arc<Metrics>,
    stop: watch::Sender<bool>,
    stopped: Vec<oneshot::Sender<()>>,
}

impl ConsumerActor {
    pub fn new(
        config: ConsumerConfig,
        store: Addr<StoreActor>,
        wake: Vec<Recipient<WakeFetch>>,
        metrics: Arc<Metrics>,
    ) -> Self {
        ConsumerActor {
            config,
            store,
            wake,
            metrics,
            stop: watch::channel(false).0,
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
        let _ = self.stop.send(true);
        let (done, stopped) = oneshot::channel();
        self.stopped.push(done);
        Box::pin(async move {
            let _ = stopped.await;
        })
    }
}

/// Rebalance events, forwarded from librdkafka's callback to the loop.
#[derive(Debug)]
enum Rebalanced {
    Assigned(usize),
    Revoked,
}

struct RebalanceContext {
    events: mpsc::UnboundedSender<Rebalanced>,
    log: ThrottledLog,
}

impl ClientContext for RebalanceContext {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        self.log.error(error, reason);
    }
}

impl ConsumerContext for RebalanceContext {
    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        // Asynchronous commits report here; a failed one is re-covered by the
        // next batch's commit, or by the partition's next owner re-reading
        // (inserts are idempotent), but it must not go unseen.
        if let Err(err) = result {
            tracing::warn!(error = %err, "Kafka offset commit failed");
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let event = match rebalance {
            Rebalance::Assign(partitions) => Rebalanced::Assigned(partitions.count()),
            Rebalance::Revoke(_) => Rebalanced::Revoked,
            Rebalance::Error(err) => {
                tracing::warn!(error = %err, "Kafka rebalance failed");
                return;
            }
        };
        let _ = self.events.send(event);
    }
}

/// A record that is not a valid activation, kept for the ingest DLQ.
struct Invalid {
    bytes: Vec<u8>,
    position: KafkaPosition,
    error: ActivationError,
}

/// Records read since the last flush.
#[derive(Default)]
struct Batch {
    rows: Vec<InflightActivation>,
    invalid: Vec<Invalid>,
    expired: u64,
    /// Highest offset read per (topic, partition).
    offsets: BTreeMap<(String, i32), i64>,
    started: Option<Instant>,
}

impl Batch {
    fn records(&self) -> usize {
        self.rows.len() + self.invalid.len() + self.expired as usize
    }
}

struct ConsumeLoop {
    config: ConsumerConfig,
    consumer: StreamConsumer<RebalanceContext>,
    dead_letters: Producer,
    error_log: ThrottledLog,
    rebalances: mpsc::UnboundedReceiver<Rebalanced>,
    store: Addr<StoreActor>,
    wake: Vec<Recipient<WakeFetch>>,
    metrics: Arc<Metrics>,
    stop: watch::Receiver<bool>,
    paused: bool,
    /// In-flight rows: last count read plus rows stored since.
    inflight: u64,
    batches_stored: u64,
}

impl ConsumeLoop {
    fn start(
        config: ConsumerConfig,
        store: Addr<StoreActor>,
        wake: Vec<Recipient<WakeFetch>>,
        metrics: Arc<Metrics>,
        stop: watch::Receiver<bool>,
    ) -> Result<Self, String> {
        let (events, rebalances) = mpsc::unbounded_channel();
        let consumer: StreamConsumer<RebalanceContext> = config
            .kafka
            .consumer(&config.group, &config.auto_offset_reset)
            .create_with_context(RebalanceContext {
                events,
                log: ThrottledLog::default(),
            })
            .map_err(|err| format!("Kafka consumer: {err}"))?;
        consumer
            .subscribe(&[config.topic.as_str()])
            .map_err(|err| format!("cannot subscribe to {}: {err}", config.topic))?;
        let dead_letters = config
            .kafka
            .create_producer(Duration::from_secs(30))
            .map_err(|err| format!("Kafka producer: {err}"))?;
        Ok(ConsumeLoop {
            config,
            consumer,
            dead_letters,
            rebalances,
            store,
            wake,
            metrics,
            stop,
            error_log: ThrottledLog::default(),
            paused: false,
            inflight: 0,
            batches_stored: 0,
        })
    }

    async fn run(mut self) {
        tracing::info!(topic = %self.config.topic, group = %self.config.group, "consuming");
        self.refresh_inflight().await;
        let mut batch = Batch::default();
        let mut tick = tokio::time::interval(TICK);
        loop {
            let flush_at = batch
                .started
                .map(|started| started + self.config.batch_max_wait);
            tokio::select! {
                biased;
                _ = self.stop.changed() => break,
                Some(event) = self.rebalances.recv() => self.rebalanced(event),
                _ = sleep_until(flush_at) => {
                    if !self.flush(&mut batch).await { return; }
                }
                // Also keeps librdkafka polled while paused, so the group
                // does not consider this member dead.
                _ = tick.tick() => {
                    if self.paused {
                        self.refresh_inflight().await;
                        self.apply_backpressure();
                    }
                }
                // Paused partitions deliver nothing; polling goes on regardless.
                message = self.consumer.recv() => {
                    match message {
                        Ok(message) => {
                            self.read_message(&mut batch, &message);
                            // Take whatever else librdkafka already holds, up
                            // to a full batch: with INSERT_BATCH_MAX_MS = 0
                            // the batch is written as soon as nothing more is
                            // ready, so it grows with the load (records pile
                            // up while the previous insert runs).
                            while batch.records() < self.config.batch_size {
                                match self.consumer.recv().now_or_never() {
                                    Some(Ok(message)) => self.read_message(&mut batch, &message),
                                    Some(Err(err)) => {
                                        self.error_log.maybe(|suppressed| {
                                            tracing::warn!(error = %err, suppressed, "Kafka consumer error");
                                        });
                                        break;
                                    }
                                    None => break,
                                }
                            }
                        }
                        Err(err) => {
                            // librdkafka repeats errors such as "all brokers
                            // down" on every poll: log a few, and do not spin.
                            self.error_log.maybe(|suppressed| {
                                tracing::warn!(error = %err, suppressed, "Kafka consumer error");
                            });
                            tokio::time::sleep(CONSUMER_ERROR_PAUSE).await;
                        }
                    }
                    if batch.records() >= self.config.batch_size
                        && !self.flush(&mut batch).await
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
        self.flush_with(&mut batch, CommitMode::Sync).await;
        tracing::info!(topic = %self.config.topic, "consumer stopped");
    }

    fn rebalanced(&mut self, event: Rebalanced) {
        match event {
            Rebalanced::Assigned(count) => {
                tracing::info!(partitions = count, "Kafka partitions assigned");
                self.metrics.partitions_assigned.set(count as i64);
                self.metrics.consumer_assignments.inc();
                if self.paused {
                    self.pause_assigned();
                }
            }
            Rebalanced::Revoked => {
                // Rows already read are still stored (inserts are
                // idempotent); committing them for a partition we lost fails
                // harmlessly and the new owner re-reads them.
                tracing::info!("Kafka partitions revoked");
                self.metrics.partitions_assigned.set(0);
                self.metrics.partitions_paused.set(0);
            }
        }
    }

    fn read_message(&self, batch: &mut Batch, message: &impl rdkafka::message::Message) {
        let position = KafkaPosition {
            topic: message.topic().to_owned(),
            partition: message.partition(),
            offset: message.offset(),
        };
        let payload = message.payload().unwrap_or_default().to_vec();
        self.read(batch, payload, position);
    }

    /// Classifies one record into the batch.
    fn read(&self, batch: &mut Batch, payload: Vec<u8>, position: KafkaPosition) {
        batch.started.get_or_insert_with(Instant::now);
        let key = (position.topic.clone(), position.partition);
        let offset = position.offset;
        let entry = batch.offsets.entry(key).or_insert(offset);
        *entry = (*entry).max(offset);

        if payload.len() > self.config.max_activation_bytes {
            let error = ActivationError::TooLarge {
                bytes: payload.len(),
                limit: self.config.max_activation_bytes,
            };
            batch.invalid.push(Invalid {
                bytes: payload,
                position,
                error,
            });
            return;
        }
        let now = chrono::Utc::now();
        match inflight_from_record(&payload, position.clone(), now, self.config.max_delay) {
            Ok(row) if row.expires_at.is_some_and(|expires| expires <= now) => {
                batch.expired += 1;
            }
            Ok(row) => batch.rows.push(row),
            Err(error) => batch.invalid.push(Invalid {
                bytes: payload,
                position,
                error,
            }),
        }
    }

    /// Stores the batch, dead-letters its invalid records, then commits its
    /// offsets. Returns false when the loop must end (the test-only crash).
    async fn flush(&mut self, batch: &mut Batch) -> bool {
        self.flush_with(batch, CommitMode::Async).await
    }

    async fn flush_with(&mut self, batch: &mut Batch, mode: CommitMode) -> bool {
        if batch.records() == 0 {
            batch.started = None;
            return true;
        }
        let Batch {
            rows,
            invalid,
            expired,
            offsets,
            ..
        } = std::mem::take(batch);
        let read = rows.len() as u64;
        let stored = self.insert(rows).await;
        self.dead_letter(invalid).await;
        if expired > 0 {
            self.metrics
                .consumer_records
                .with_label_values(&["expired"])
                .inc_by(expired);
        }
        self.metrics
            .consumer_records
            .with_label_values(&["stored"])
            .inc_by(stored);
        self.metrics
            .consumer_records
            .with_label_values(&["duplicate"])
            .inc_by(read - stored);
        self.batches_stored += 1;
        if self
            .config
            .crash_before_commit_after
            .is_some_and(|limit| self.batches_stored >= limit)
        {
            tracing::warn!("test switch: stopping between insert and commit");
            return false;
        }
        self.commit(&offsets, mode);
        if stored > 0 {
            for fetcher in &self.wake {
                let _ = fetcher.try_send(WakeFetch);
            }
        }
        self.inflight += stored;
        self.apply_backpressure();
        true
    }

    /// Inserts until the store accepts the batch (or the consumer stops):
    /// offsets never move past rows that are not stored.
    async fn insert(&mut self, rows: Vec<InflightActivation>) -> u64 {
        if rows.is_empty() {
            return 0;
        }
        let rows = Arc::new(rows);
        loop {
            match self
                .store
                .send(InsertBatch {
                    rows: Arc::clone(&rows),
                })
                .await
            {
                Ok(Ok(stored)) => return stored,
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, rows = rows.len(), "cannot store consumed batch; retrying");
                }
                Err(err) => {
                    tracing::warn!(error = %err, "store actor unreachable; retrying");
                }
            }
            tokio::time::sleep(INSERT_RETRY_PAUSE).await;
        }
    }

    async fn dead_letter(&self, invalid: Vec<Invalid>) {
        let sends = invalid.into_iter().map(|record| {
            let producer = self.dead_letters.clone();
            let topic = self.config.ingest_dlq_topic.clone();
            let metrics = Arc::clone(&self.metrics);
            async move {
                let reason = record.error.reason();
                metrics.invalid_records.with_label_values(&[reason]).inc();
                metrics
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
                let source = format!("{}/{}/{}", position.topic, position.partition, position.offset);
                let error = record.error.to_string();
                let headers = OwnedHeaders::new()
                    .insert(Header {
                        key: ERROR_HEADER,
                        value: Some(error.as_str()),
                    })
                    .insert(Header {
                        key: REASON_HEADER,
                        value: Some(reason),
                    })
                    .insert(Header {
                        key: SOURCE_HEADER,
                        value: Some(source.as_str()),
                    });
                let delivery = producer
                    .send(
                        FutureRecord::<(), _>::to(&topic)
                            .payload(&record.bytes)
                            .headers(headers),
                        Timeout::After(Duration::from_secs(5)),
                    )
                    .await;
                let result = if delivery.is_ok() { "ok" } else { "error" };
                metrics
                    .ingest_dead_letters
                    .with_label_values(&[result])
                    .inc();
                if let Err((err, _)) = delivery {
                    tracing::error!(
                        error = %err,
                        %source,
                        "cannot write an invalid record to the ingest dead-letter topic; skipping it"
                    );
                }
            }
        });
        futures::future::join_all(sends).await;
    }

    fn commit(&self, offsets: &BTreeMap<(String, i32), i64>, mode: CommitMode) {
        let mut partitions = TopicPartitionList::new();
        for ((topic, partition), offset) in offsets {
            if let Err(err) =
                partitions.add_partition_offset(topic, *partition, Offset::Offset(offset + 1))
            {
                tracing::warn!(error = %err, "cannot build the offset commit");
            }
        }
        if let Err(err) = self.consumer.commit(&partitions, mode) {
            tracing::warn!(error = %err, "cannot commit offsets; they are committed with the next batch");
        }
    }

    async fn refresh_inflight(&mut self) {
        if let Ok(Ok(counts)) = self.store.send(CountByStatus {}).await {
            self.inflight = counts.inflight();
        }
    }

    fn apply_backpressure(&mut self) {
        let limit = self.config.max_inflight;
        if !self.paused && self.inflight >= limit {
            tracing::info!(
                inflight = self.inflight,
                limit,
                "store full; pausing consumption"
            );
            self.paused = true;
            self.pause_assigned();
        } else if self.paused && self.inflight < limit - limit / 10 {
            tracing::info!(
                inflight = self.inflight,
                "store drained; resuming consumption"
            );
            self.paused = false;
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
