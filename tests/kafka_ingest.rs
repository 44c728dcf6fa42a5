//! Kafka ingestion through the ConsumerActor, against librdkafka's
//! in-process mock cluster (the real Kafka protocol) and real PostgreSQL.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use common::kafka::{MockKafka, payload};
use common::worker::{FakeWorker, Mode};
use common::{Backend, TestStore, incompressible, wait_until};
use prost::Message as _;
use rdkafka::message::{Headers, Message as _};
use taskbroker::actors::consumer::{
    ConsumerActor, ConsumerConfig, ORIGINAL_BYTES_HEADER, REASON_HEADER, SOURCE_HEADER,
    StopConsuming, dead_letter_cut,
};
use taskbroker::actors::fetch::FetchConfig;
use taskbroker::actors::push_pool::PushPoolConfig;
use taskbroker::actors::upkeep::{UpkeepActor, UpkeepConfig};
use taskbroker::broker::{PushPipeline, PushPipelineConfig};
use taskbroker::config::WorkerEndpoints;
use taskbroker::metrics::Metrics;
use taskbroker::model::{ActivationStatus, BucketRange, PullFilter, StatusUpdate, WorkerStatus};
use taskbroker::proto::{RetryState, TaskActivation};

const TOPIC: &str = "tasks";
const INGEST_DLQ: &str = "ingest-dlq";
const PARTITIONS: i32 = 4;

struct Harness {
    base: common::StoreFixture,
    kafka: MockKafka,
}

impl std::ops::Deref for Harness {
    type Target = common::StoreFixture;

    fn deref(&self) -> &common::StoreFixture {
        &self.base
    }
}

impl Harness {
    async fn new() -> Harness {
        Harness::on(Backend::Postgres).await
    }

    async fn on(backend: Backend) -> Harness {
        let base = common::StoreFixture::on(backend).await;
        let kafka = MockKafka::start();
        kafka.create_topic(TOPIC, PARTITIONS);
        kafka.create_topic(INGEST_DLQ, 1);
        Harness { base, kafka }
    }

    fn consumer_config(&self) -> ConsumerConfig {
        self.kafka.consumer_config(TOPIC, "taskbroker", INGEST_DLQ)
    }

    /// A consumer with its own metrics.
    fn consume(&self, config: ConsumerConfig) -> (Addr<ConsumerActor>, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        let actor = ConsumerActor::new(
            config,
            self.store_actor.clone(),
            vec![],
            Arc::clone(&metrics),
        );
        (actor.start(), metrics)
    }

    async fn total(&self) -> u64 {
        self.store.count_by_status().await.expect("count").total()
    }

    /// Deletes `step` rows whenever the consumer behind `metrics` has
    /// paused, as workers would, until it has stored `records`; the store
    /// never holds more than `limit` rows meanwhile. Returns the most seen.
    async fn drain_until_stored(
        &self,
        metrics: &Metrics,
        records: u64,
        limit: u64,
        step: usize,
    ) -> u64 {
        let mut peak = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while metrics.consumed("stored") < records {
            assert!(
                tokio::time::Instant::now() < deadline,
                "consumption did not resume"
            );
            let total = self.total().await;
            peak = peak.max(total);
            assert!(total <= limit, "{total} rows in the store, limit {limit}");
            if metrics.paused_partitions() > 0 {
                // As workers would: claim some rows and finish them.
                let claimed = self
                    .store
                    .claim_for_push(BucketRange::ALL, step, Duration::from_secs(60))
                    .await
                    .expect("claim rows to drain");
                let ids: Vec<String> = claimed.into_iter().map(|c| c.token.id).collect();
                self.store.delete_batch(&ids).await.expect("drain rows");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        peak
    }

    async fn wait_for_total(&self, n: u64) {
        wait_until(
            &format!("{n} rows are stored"),
            Duration::from_secs(60),
            || async { self.total().await == n },
        )
        .await;
    }
}

/// Waits until the consumer behind `metrics` has paused every partition.
async fn wait_until_paused(metrics: &Metrics) {
    wait_until(
        "the consumer pauses its partitions",
        Duration::from_secs(30),
        || {
            let paused = metrics.paused_partitions();
            async move { paused == i64::from(PARTITIONS) }
        },
    )
    .await;
}

fn activation(id: String) -> TaskActivation {
    TaskActivation {
        id,
        namespace: "ingest".to_owned(),
        taskname: "tests.ingest".to_owned(),
        received_at: Some(prost_types::Timestamp {
            seconds: chrono::Utc::now().timestamp(),
            nanos: 0,
        }),
        processing_deadline_duration: 30,
        application: Some("app".to_owned()),
        ..Default::default()
    }
}

/// The value of header `key` on a record, as text.
fn header(record: &rdkafka::message::OwnedMessage, key: &str) -> Option<String> {
    record
        .headers()?
        .iter()
        .find(|header| header.key == key)
        .and_then(|header| header.value)
        .map(|value| String::from_utf8_lossy(value).into_owned())
}

fn valid_payloads(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| activation(format!("{prefix}-{i}")).encode_to_vec())
        .collect()
}

async fn every_record_is_stored_once_and_offsets_are_committed_to_the_end(backend: Backend) {
    let harness = Harness::on(backend).await;
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("bulk", 10_000))
        .await;
    let (consumer, metrics) = harness.consume(harness.consumer_config());
    harness.wait_for_total(10_000).await;
    let ends = harness.kafka.end_offsets(TOPIC, PARTITIONS);
    assert_eq!(ends.iter().sum::<i64>(), 10_000);
    wait_until(
        "committed offsets reach the end offsets",
        Duration::from_secs(30),
        || {
            let committed = harness.kafka.committed("taskbroker", TOPIC, PARTITIONS);
            let done = committed == ends;
            async move { done }
        },
    )
    .await;
    assert_eq!(metrics.consumed("stored"), 10_000);
    consumer.send(StopConsuming).await.expect("consumer stops");

    // A restarted consumer resumes after the committed offsets: the only
    // record it reads is a new one.
    let (_consumer, metrics) = harness.consume(harness.consumer_config());
    harness
        .kafka
        .produce(TOPIC, &[activation("sentinel".to_owned()).encode_to_vec()])
        .await;
    harness.wait_for_total(10_001).await;
    assert_eq!(metrics.consumed("stored"), 1);
    assert_eq!(metrics.consumed("duplicate"), 0);
}

/// Needs the consumer's crash switch, compiled in only with `test-hooks`.
#[cfg(feature = "test-hooks")]
async fn consumer_dying_between_insert_and_commit_rereads_without_duplicates(backend: Backend) {
    let harness = Harness::on(backend).await;
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("crash", 500))
        .await;
    let mut config = harness.consumer_config();
    config.batch_size = 100;
    config.batch_max_wait = Duration::from_secs(10); // batches close by size
    config.crash_before_commit_after = Some(1);
    let (crashed, _) = harness.consume(config);
    wait_until(
        "the consumer dies after its first insert",
        Duration::from_secs(30),
        || {
            let alive = crashed.connected();
            async move { !alive }
        },
    )
    .await;
    let stored_before_crash = harness.total().await;
    assert_eq!(stored_before_crash, 100);
    assert_eq!(
        harness.kafka.committed("taskbroker", TOPIC, PARTITIONS),
        vec![-1; PARTITIONS as usize],
        "nothing was committed"
    );

    let (_consumer, metrics) = harness.consume(harness.consumer_config());
    harness.wait_for_total(500).await;
    // The rows are visible once their insert commits; the consumer counts
    // them after the store's reply reaches it.
    let counted = Arc::clone(&metrics);
    wait_until(
        "every record read again is counted",
        Duration::from_secs(30),
        || {
            let read = counted.consumed("stored") + counted.consumed("duplicate");
            async move { read == 500 }
        },
    )
    .await;
    assert_eq!(metrics.consumed("duplicate"), 100);
    assert_eq!(metrics.consumed("stored"), 400);
}

on_both_backends!(
    every_record_is_stored_once_and_offsets_are_committed_to_the_end,
    kafka_to_workers_end_to_end,
);

#[cfg(feature = "test-hooks")]
on_both_backends!(consumer_dying_between_insert_and_commit_rereads_without_duplicates);

#[actix_rt::test]
async fn malformed_records_go_to_the_ingest_dlq_and_consumption_goes_on() {
    let harness = Harness::new().await;
    let mut config = harness.consumer_config();
    config.max_activation_bytes = 2048;
    let mut bad: Vec<(&str, Vec<u8>)> = Vec::new();
    for i in 0..50 {
        bad.push(("empty_payload", Vec::new()));
        bad.push(("undecodable", vec![0xff, 0xff, 0xff, i as u8]));
        bad.push(("empty_id", activation(String::new()).encode_to_vec()));
        let mut unknown_enum = activation(format!("enum-{i}"));
        unknown_enum.retry_state = Some(RetryState {
            on_attempts_exceeded: 7,
            ..Default::default()
        });
        bad.push(("unknown_enum", unknown_enum.encode_to_vec()));
        let mut huge = activation(format!("huge-{i}"));
        huge.parameters_bytes = vec![1; 4096];
        bad.push(("too_large", huge.encode_to_vec()));
    }
    let good = valid_payloads("good", 500);
    // Interleave: good and bad records share partitions and batches.
    let mut mixed = Vec::new();
    let mut good_iter = good.iter();
    for (_, bytes) in &bad {
        mixed.push(bytes.clone());
        mixed.extend(good_iter.by_ref().take(2).cloned());
    }
    mixed.extend(good_iter.cloned());
    harness.kafka.produce(TOPIC, &mixed).await;

    let (_consumer, metrics) = harness.consume(config);
    harness.wait_for_total(500).await;
    wait_until(
        "every bad record is dead-lettered",
        Duration::from_secs(30),
        || {
            let done = Metrics::count(&metrics.ingest_dead_letters, "ok") == 250;
            async move { done }
        },
    )
    .await;
    for reason in [
        "empty_payload",
        "undecodable",
        "empty_id",
        "unknown_enum",
        "too_large",
    ] {
        assert_eq!(metrics.invalid(reason), 50, "{reason}");
    }
    let dead = harness.kafka.read_all(INGEST_DLQ, 1);
    assert_eq!(dead.len(), 250);
    let mut by_reason: HashMap<String, usize> = HashMap::new();
    // Every dead letter is the record as read, those over
    // MAX_ACTIVATION_BYTES included: nothing is cut unless Kafka refuses it.
    let expected: HashSet<Vec<u8>> = bad.iter().map(|(_, bytes)| bytes.clone()).collect();
    for record in &dead {
        assert!(expected.contains(&payload(record)), "original bytes kept");
        let reason = header(record, REASON_HEADER).expect("reason header");
        assert_eq!(header(record, ORIGINAL_BYTES_HEADER), None);
        *by_reason.entry(reason).or_default() += 1;
    }
    assert_eq!(Metrics::count(&metrics.dead_letters_truncated, "ingest"), 0);
    assert!(by_reason.values().all(|&n| n == 50), "{by_reason:?}");

    // The partitions did not stall: later records still arrive.
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("later", 10))
        .await;
    harness.wait_for_total(510).await;
}

#[actix_rt::test]
async fn backpressure_pauses_at_max_inflight_and_resumes_when_rows_drain() {
    let harness = Harness::new().await;
    let mut config = harness.consumer_config();
    config.max_inflight = 1_000;
    config.batch_size = 100;
    let limit = config.max_inflight + config.batch_size as u64;
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("bp", 3_000))
        .await;
    let (_consumer, metrics) = harness.consume(config);

    wait_until_paused(&metrics).await;
    // Drain in steps, as workers would, until every record was stored once;
    // the store never holds more than the limit plus one batch.
    let peak = harness
        .drain_until_stored(&metrics, 3_000, limit, 300)
        .await;
    assert!(peak >= 1_000, "the limit was reached ({peak})");
    assert_eq!(metrics.consumed("duplicate"), 0);
}

/// MAX_INFLIGHT_BYTES: the consumer pauses once its topic's stored bytes
/// reach the bound, and resumes once they drop below 90 % of it; the store
/// never holds more than the bound plus one insert batch. Every record is
/// the same size, so the rows the store holds measure its bytes.
async fn backpressure_pauses_at_max_inflight_bytes_and_resumes_when_bytes_drain(backend: Backend) {
    let harness = Harness::on(backend).await;
    let mut config = harness.consumer_config();
    let records: Vec<Vec<u8>> = (0..200u64)
        .map(|i| {
            let mut task = activation(format!("bytes-{i:03}"));
            task.parameters_bytes = incompressible(i, 64 << 10);
            task.encode_to_vec()
        })
        .collect();
    let size = records[0].len() as u64;
    assert!(records.iter().all(|record| record.len() as u64 == size));
    config.max_inflight_bytes = 2 << 20;
    config.batch_size = 8;
    let bound = config.max_inflight_bytes / size + config.batch_size as u64;
    harness.kafka.produce(TOPIC, &records).await;
    let (_consumer, metrics) = harness.consume(config);

    wait_until_paused(&metrics).await;
    let shown = metrics.inflight_bytes.with_label_values(&[TOPIC]).get() as u64;
    assert!(shown >= 2 << 20, "taskbroker_inflight_bytes shows {shown}");
    let peak = harness.drain_until_stored(&metrics, 200, bound, 8).await;
    assert!(
        peak * size >= 2 << 20,
        "the bound was reached ({peak} rows)"
    );
    assert_eq!(metrics.consumed("duplicate"), 0);
}

on_both_backends!(backpressure_pauses_at_max_inflight_bytes_and_resumes_when_bytes_drain);

#[actix_rt::test]
async fn activations_expired_on_arrival_are_dropped_and_delayed_ones_wait() {
    let harness = Harness::new().await;
    let mut expired = activation("expired".to_owned());
    expired.received_at = Some(prost_types::Timestamp {
        seconds: chrono::Utc::now().timestamp() - 100,
        nanos: 0,
    });
    expired.expires = Some(10);
    let mut delayed = activation("delayed".to_owned());
    delayed.delay = Some(600);
    harness
        .kafka
        .produce(
            TOPIC,
            &[
                expired.encode_to_vec(),
                delayed.encode_to_vec(),
                activation("now".to_owned()).encode_to_vec(),
            ],
        )
        .await;
    let (_consumer, metrics) = harness.consume(harness.consumer_config());
    harness.wait_for_total(2).await;
    let consumed = Arc::clone(&metrics);
    wait_until(
        "the expired record is counted",
        Duration::from_secs(10),
        || {
            let expired = consumed.consumed("expired");
            async move { expired == 1 }
        },
    )
    .await;
    assert!(harness.store.get("expired").await.unwrap().is_none());
    let delayed = harness.store.get("delayed").await.unwrap().unwrap();
    assert_eq!(delayed.status, ActivationStatus::Delay);
    let now = harness.store.get("now").await.unwrap().unwrap();
    assert_eq!(now.status, ActivationStatus::Pending);
}

#[actix_rt::test]
async fn a_task_retried_three_times_yields_three_new_activations() {
    let harness = Harness::new().await;
    let metrics = Arc::new(Metrics::new());
    // Retries go back to the topic the broker consumes.
    let upkeep = UpkeepActor::new(
        UpkeepConfig {
            interval: Duration::from_millis(50),
            batch_limit: 1000,
            max_attempts: 5,
            restart_grace: Duration::ZERO,
            kafka: harness.kafka.settings(),
            retry_topic: TOPIC.to_owned(),
            dlq_topic: "dlq".to_owned(),
            retry_kafka: None,
            dlq_kafka: None,
            delivery_timeout: Duration::from_secs(5),
            publish_lease: Duration::from_secs(10),
            health: Default::default(),
            rules: taskbroker::runtime::RuntimeRules::none(),
            top_namespaces: 10,
            membership: None,
        },
        harness.store_actor.clone(),
        vec![],
        Arc::clone(&metrics),
    )
    .expect("upkeep starts")
    .start();
    let originals: Vec<Vec<u8>> = (0..10)
        .map(|i| {
            let mut task = activation(format!("orig-{i}"));
            task.taskname = format!("lineage-{i}");
            task.retry_state = Some(RetryState {
                attempts: 0,
                max_attempts: 5,
                delay_on_retry: Some(1),
                ..Default::default()
            });
            task.encode_to_vec()
        })
        .collect();
    harness.kafka.produce(TOPIC, &originals).await;
    let (_consumer, _) = harness.consume(harness.consumer_config());

    // The worker: RETRY until the task has been attempted three times, then
    // COMPLETE.
    let mut handled = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while handled < 40 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "handled only {handled} of 40"
        );
        let Some(row) = harness
            .store
            .claim_for_pull(&PullFilter::default(), Duration::from_secs(30))
            .await
            .unwrap()
        else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let task = TaskActivation::decode(row.activation.as_slice()).unwrap();
        let status = if task.retry_state.unwrap_or_default().attempts < 3 {
            WorkerStatus::Retry
        } else {
            WorkerStatus::Complete
        };
        harness
            .store
            .set_status(&[StatusUpdate::new(row.id, status)])
            .await
            .unwrap();
        handled += 1;
    }
    upkeep.do_send(taskbroker::actors::upkeep::StopUpkeep);

    let records = harness.kafka.read_all(TOPIC, PARTITIONS);
    assert_eq!(records.len(), 40, "10 originals and exactly 3 retries each");
    let mut lineages: HashMap<String, Vec<TaskActivation>> = HashMap::new();
    for record in &records {
        let task = TaskActivation::decode(payload(record).as_slice()).unwrap();
        lineages
            .entry(task.taskname.clone())
            .or_default()
            .push(task);
    }
    let ids: HashSet<String> = lineages
        .values()
        .flatten()
        .map(|task| task.id.clone())
        .collect();
    assert_eq!(ids.len(), 40, "every retry has a fresh id");
    for (lineage, mut tasks) in lineages {
        tasks.sort_by_key(|task| task.retry_state.unwrap_or_default().attempts);
        let attempts: Vec<u32> = tasks
            .iter()
            .map(|task| task.retry_state.unwrap_or_default().attempts)
            .collect();
        assert_eq!(attempts, [0, 1, 2, 3], "{lineage}");
        let delays: Vec<Option<u64>> = tasks.iter().map(|task| task.delay).collect();
        assert_eq!(delays, [None, Some(1), Some(1), Some(1)], "{lineage}");
    }
}

async fn kafka_to_workers_end_to_end(backend: Backend) {
    let harness = Harness::on(backend).await;
    let metrics = Arc::new(Metrics::new());
    let workers = [
        FakeWorker::start(Mode::accept()).await,
        FakeWorker::start(Mode::accept()).await,
    ];
    let urls: Vec<String> = workers.iter().map(|worker| worker.url()).collect();
    let pipeline = PushPipeline::start(
        PushPipelineConfig {
            fetch_actors: 2,
            fetch: FetchConfig {
                batch_size: 64,
                batch_bytes: 16 << 20,
                backoff: Duration::from_secs(600), // only wake-ups from the consumer
                queue_timeout: Duration::from_millis(500),
                lease: Duration::from_secs(30),
                fair_dispatch: true,
                #[cfg(feature = "test-hooks")]
                release_on_full: true,
            },
            push: PushPoolConfig {
                concurrency: 16,
                queue_size: 32,
                queue_bytes: 64 << 20,
                push_timeout: Duration::from_secs(2),
                deadline_grace: Duration::from_secs(3),
                max_attempts: 5,
                callback_url: "broker.test:50051".to_owned(),
                signing_secret: None,
                endpoints: WorkerEndpoints::parse(&format!("*={}", urls.join("|"))).unwrap(),
                tls: Default::default(),
                spread: Default::default(),
            },
        },
        harness.store_actor.clone(),
        Arc::clone(&metrics),
    )
    .expect("pipeline");
    let wake = pipeline
        .fetchers
        .iter()
        .map(|fetcher| fetcher.clone().recipient())
        .collect();
    let consumer = ConsumerActor::new(
        harness.consumer_config(),
        harness.store_actor.clone(),
        wake,
        Arc::new(Metrics::new()),
    )
    .start();
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("e2e", 1_000))
        .await;
    wait_until(
        "every task reached a worker",
        Duration::from_secs(60),
        || {
            let pushed = Metrics::count(&metrics.pushes, "ok");
            async move { pushed == 1_000 }
        },
    )
    .await;
    consumer.send(StopConsuming).await.unwrap();
    pipeline.stop().await;
    let counts = harness.store.count_by_status().await.unwrap();
    assert_eq!(counts.get(ActivationStatus::Processing), 1_000);
    let accepted: usize = workers
        .iter()
        .map(|worker| worker.seen.accepted().len())
        .sum();
    assert_eq!(accepted, 1_000);
}

#[actix_rt::test]
async fn consumers_joining_and_leaving_the_group_store_each_record_once() {
    let harness = Harness::new().await;
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("rb-a", 2_000))
        .await;
    // Short heartbeats so the mock coordinator finishes rebalances in
    // seconds (with librdkafka's defaults one takes over 30 s).
    let mut config = harness.consumer_config();
    config.kafka.properties = vec![
        ("session.timeout.ms".to_owned(), "6000".to_owned()),
        ("heartbeat.interval.ms".to_owned(), "500".to_owned()),
    ];
    let (first, first_metrics) = harness.consume(config.clone());
    wait_until(
        "the first consumer stores records",
        Duration::from_secs(30),
        || async { first_metrics.consumed("stored") >= 1 },
    )
    .await;
    // A second member joins: partitions are split (a rebalance mid-stream).
    let (_second, second_metrics) = harness.consume(config);
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("rb-b", 2_000))
        .await;
    wait_until(
        "both consumers hold partitions",
        Duration::from_secs(30),
        || {
            let (a, b) = (
                first_metrics.assigned_partitions(),
                second_metrics.assigned_partitions(),
            );
            async move { a > 0 && b > 0 && a + b == i64::from(PARTITIONS) }
        },
    )
    .await;
    // The first leaves: the second takes every partition over from the
    // committed offsets.
    first
        .send(StopConsuming)
        .await
        .expect("first consumer stops");
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("rb-c", 2_000))
        .await;
    harness.wait_for_total(6_000).await;
    let ends = harness.kafka.end_offsets(TOPIC, PARTITIONS);
    wait_until(
        "the group committed every offset",
        Duration::from_secs(30),
        || {
            let done = harness.kafka.committed("taskbroker", TOPIC, PARTITIONS) == ends;
            async move { done }
        },
    )
    .await;
    let read: u64 = [&first_metrics, &second_metrics]
        .iter()
        .map(|m| m.consumed("stored") + m.consumed("duplicate"))
        .sum();
    assert!(read >= 6_000, "every record was read ({read})");
}

#[actix_rt::test]
async fn a_paused_consumer_stays_in_the_group_past_max_poll_interval() {
    let harness = Harness::new().await;
    let mut config = harness.consumer_config();
    config.max_inflight = 200;
    config.batch_size = 50;
    // librdkafka evicts a member that does not poll for max.poll.interval.ms;
    // a paused consumer must keep polling.
    config.kafka.properties = vec![
        ("session.timeout.ms".to_owned(), "3000".to_owned()),
        ("heartbeat.interval.ms".to_owned(), "500".to_owned()),
        ("max.poll.interval.ms".to_owned(), "3000".to_owned()),
    ];
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("idle", 1_000))
        .await;
    let (_consumer, metrics) = harness.consume(config);
    wait_until_paused(&metrics).await;
    // Stay paused for twice max.poll.interval.ms, watching the assignment.
    let until = tokio::time::Instant::now() + Duration::from_secs(6);
    while tokio::time::Instant::now() < until {
        assert_eq!(
            metrics.assigned_partitions(),
            i64::from(PARTITIONS),
            "the paused consumer lost its partitions"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stored_while_paused = harness.total().await;
    assert!(stored_while_paused <= 250, "{stored_while_paused} rows");
    // Drain: it resumes and reads the rest without a rejoin.
    let client = harness.db.client().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while metrics.consumed("stored") < 1_000 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "consumption did not resume"
        );
        client
            .execute("DELETE FROM inflight_taskactivations", &[])
            .await
            .expect("drain");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metrics.consumed("duplicate"), 0);
}

// ------------------------------------------------ issue 13: ingest never stalls

/// Waits until `group` committed exactly the end offsets of `TOPIC`.
async fn wait_for_commits_to_the_end(harness: &Harness) {
    let ends = harness.kafka.end_offsets(TOPIC, PARTITIONS);
    wait_until(
        "committed offsets reach the end offsets",
        Duration::from_secs(30),
        || {
            let done = harness.kafka.committed("taskbroker", TOPIC, PARTITIONS) == ends;
            async move { done }
        },
    )
    .await;
}

/// `n` records, round robin over the partitions by key, so every partition
/// holds some of `bad` among good records.
fn mixed_with(bad: &[Vec<u8>], prefix: &str, good: usize) -> Vec<Vec<u8>> {
    let mut good = valid_payloads(prefix, good).into_iter();
    let mut mixed = Vec::new();
    for bytes in bad {
        mixed.extend(good.by_ref().take(7));
        mixed.push(bytes.clone());
    }
    mixed.extend(good);
    mixed
}

/// Reasons of the ingest DLQ's records, counted.
fn dead_letter_reasons(harness: &Harness) -> HashMap<String, usize> {
    let total: i64 = harness.kafka.end_offsets(INGEST_DLQ, 1).iter().sum();
    let mut reasons = HashMap::new();
    if total == 0 {
        return reasons;
    }
    for record in harness.kafka.read_all(INGEST_DLQ, 1) {
        let reason = header(&record, REASON_HEADER).expect("reason header");
        *reasons.entry(reason).or_default() += 1;
    }
    reasons
}

/// The original stall: records that decode but that PostgreSQL refuses (a
/// NUL in a name, an id past the index limit, timestamps out of range) used
/// to fail their whole insert batch forever. They are invalid at decode now.
async fn records_a_store_would_refuse_are_dead_lettered_and_the_rest_stored(backend: Backend) {
    let harness = Harness::on(backend).await;
    let mut bad = Vec::new();
    let mut nul = activation("nul-namespace".to_owned());
    nul.namespace = "ingest\0".to_owned();
    bad.push(nul.encode_to_vec());
    let mut nul_task = activation("nul-taskname".to_owned());
    nul_task.taskname = "a\0b".to_owned();
    bad.push(nul_task.encode_to_vec());
    bad.push(activation("x".repeat(3_000)).encode_to_vec());
    let mut future = activation("year-10000".to_owned());
    future.received_at = Some(prost_types::Timestamp {
        seconds: 253_402_300_800,
        nanos: 0,
    });
    bad.push(future.encode_to_vec());
    let mut past = activation("before-1970".to_owned());
    past.received_at = Some(prost_types::Timestamp {
        seconds: -86_400,
        nanos: 0,
    });
    bad.push(past.encode_to_vec());
    let mut far_expiry = activation("far-expiry".to_owned());
    far_expiry.expires = Some(400_000_000_000);
    bad.push(far_expiry.encode_to_vec());
    // Invalid UTF-8 in a string field: prost refuses it at decode.
    let mut utf8 = activation("bad-utf8".to_owned()).encode_to_vec();
    let at = utf8
        .windows(b"ingest".len())
        .position(|window| window == b"ingest")
        .expect("the namespace is in the encoding");
    utf8[at] = 0xff;
    bad.push(utf8);

    harness
        .kafka
        .produce(TOPIC, &mixed_with(&bad, "nul", 200))
        .await;
    let (_consumer, metrics) = harness.consume(harness.consumer_config());
    harness.wait_for_total(200).await;
    wait_for_commits_to_the_end(&harness).await;
    assert_eq!(Metrics::count(&metrics.ingest_dead_letters, "ok"), 7);
    let reasons = dead_letter_reasons(&harness);
    let expected: HashMap<String, usize> = [
        ("invalid_text", 3),
        ("invalid_timestamp", 2),
        ("out_of_range", 1),
        ("undecodable", 1),
    ]
    .into_iter()
    .map(|(reason, n)| (reason.to_owned(), n))
    .collect();
    assert_eq!(reasons, expected);
    assert_eq!(metrics.consumed("stored"), 200);
    assert_eq!(metrics.consumed("invalid"), 7);
}

/// Makes the test's store refuse rows whose task name is `poison`, as a
/// store refuses data the decode checks did not foresee: a CHECK constraint
/// in PostgreSQL, an aborting trigger (SQLITE_CONSTRAINT) in SQLite.
async fn refuse_poison_tasks(db: &TestStore) {
    match db {
        TestStore::Postgres(db) => {
            db.client()
                .await
                .batch_execute(
                    "ALTER TABLE inflight_taskactivations \
                     ADD CONSTRAINT test_refuses_poison CHECK (taskname <> 'poison')",
                )
                .await
                .expect("add the constraint");
        }
        TestStore::Sqlite(db) => {
            let connection = rusqlite::Connection::open(&db.path).expect("open the SQLite file");
            connection
                .execute_batch(
                    "CREATE TRIGGER test_refuses_poison BEFORE INSERT ON inflight_taskactivations \
                     WHEN NEW.taskname = 'poison' BEGIN SELECT RAISE(ABORT, 'poison'); END;",
                )
                .expect("add the trigger");
        }
    }
}

/// Defence in depth: a row that passes decoding but that the store refuses
/// is isolated by splitting its batch; the good rows are stored, the
/// refused one is dead-lettered, and the offsets move on.
async fn rows_the_store_refuses_are_isolated_and_dead_lettered(backend: Backend) {
    let harness = Harness::on(backend).await;
    refuse_poison_tasks(&harness.db).await;
    let poison: Vec<Vec<u8>> = (0..3)
        .map(|i| {
            let mut task = activation(format!("poison-{i}"));
            task.taskname = "poison".to_owned();
            task.encode_to_vec()
        })
        .collect();
    harness
        .kafka
        .produce(TOPIC, &mixed_with(&poison, "fine", 300))
        .await;
    let mut config = harness.consumer_config();
    config.batch_max_wait = Duration::from_millis(200); // batches mix both
    let (_consumer, metrics) = harness.consume(config);
    harness.wait_for_total(300).await;
    wait_for_commits_to_the_end(&harness).await;
    assert_eq!(metrics.invalid("store_rejected"), 3);
    assert_eq!(Metrics::count(&metrics.ingest_dead_letters, "ok"), 3);
    assert_eq!(metrics.consumed("stored"), 300);
    assert_eq!(metrics.consumed("duplicate"), 0);
    let dead = harness.kafka.read_all(INGEST_DLQ, 1);
    let dead_ids: HashSet<String> = dead
        .iter()
        .map(|record| {
            TaskActivation::decode(payload(record).as_slice())
                .expect("original bytes")
                .id
        })
        .collect();
    assert_eq!(
        dead_ids,
        HashSet::from(["poison-0".into(), "poison-1".into(), "poison-2".into()])
    );
    for record in &dead {
        assert_eq!(
            header(record, REASON_HEADER).as_deref(),
            Some("store_rejected")
        );
    }
}

on_both_backends!(
    records_a_store_would_refuse_are_dead_lettered_and_the_rest_stored,
    rows_the_store_refuses_are_isolated_and_dead_lettered,
);

/// A record over MAX_ACTIVATION_BYTES (a 9 MiB activation against the
/// 8 MiB default) reaches the ingest DLQ whole, byte-identical, before its
/// offset is committed.
#[actix_rt::test]
async fn a_record_over_the_limit_reaches_the_ingest_dlq_whole_before_its_offset_is_committed() {
    let harness = Harness::new().await;
    let config = over_limit_consumer_config(&harness);
    assert_eq!(config.max_activation_bytes, 8 << 20);
    let oversized = incompressible_activation("oversized", 9 << 20);
    harness
        .kafka
        .produce_to(TOPIC, BIG_PARTITION, &oversized)
        .await;
    produce_beside_the_big_one(&harness, "big", 20).await;
    let (_consumer, metrics) = harness.consume(config);
    harness.wait_for_total(20).await;
    wait_for_commits_to_the_end(&harness).await;
    assert_eq!(Metrics::count(&metrics.ingest_dead_letters, "ok"), 1);
    assert_eq!(Metrics::count(&metrics.ingest_dead_letters, "error"), 0);
    assert_eq!(Metrics::count(&metrics.dead_letters_truncated, "ingest"), 0);
    let dead = harness.kafka.read_all(INGEST_DLQ, 1);
    assert_eq!(dead.len(), 1);
    assert_eq!(
        header(&dead[0], REASON_HEADER).as_deref(),
        Some("too_large")
    );
    assert!(
        payload(&dead[0]) == oversized,
        "the 9 MiB record is kept whole"
    );
    assert_eq!(header(&dead[0], ORIGINAL_BYTES_HEADER), None);
}

/// At the default settings a 6 MiB activation (what real producers send)
/// is consumed and stored whole: the consumer fetches a whole activation
/// and MAX_ACTIVATION_BYTES is 8 MiB.
#[actix_rt::test]
async fn a_six_mib_activation_is_consumed_and_stored_whole_at_the_defaults() {
    let harness = Harness::new().await;
    let six = incompressible_activation("six-mib", 6 << 20);
    harness.kafka.produce_to(TOPIC, BIG_PARTITION, &six).await;
    produce_beside_the_big_one(&harness, "six", 5).await;
    let (_consumer, metrics) = harness.consume(harness.consumer_config());
    harness.wait_for_total(6).await;
    wait_for_commits_to_the_end(&harness).await;
    let stored = harness.store.get("six-mib").await.unwrap().expect("stored");
    assert!(stored.activation == six, "stored byte-identical");
    assert_eq!(metrics.invalid("too_large"), 0);
}

/// When Kafka itself refuses an ingest dead letter as too large, it is cut
/// short (the original size in a header), counted, and written; the
/// record's offset is committed only after the cut record is acknowledged,
/// so a cut record that cannot be written yet holds the partition.
#[actix_rt::test]
async fn a_dead_letter_kafka_refuses_as_too_large_is_cut_counted_and_committed_after_it() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let harness = Harness::new().await;
    let config = over_limit_consumer_config(&harness);
    let oversized = incompressible_activation("refused", 9 << 20);
    harness
        .kafka
        .produce_to(TOPIC, BIG_PARTITION, &oversized)
        .await;
    produce_beside_the_big_one(&harness, "refused", 20).await;
    // The next produce request (the whole dead letter) is refused as too
    // large, as a topic with a smaller max.message.bytes answers; the cut
    // record's first writes then fail (not retried inside librdkafka).
    let mut errors = vec![RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE];
    errors.extend([RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED; 3]);
    harness
        .kafka
        .cluster
        .request_errors(RDKafkaApiKey::Produce, &errors);
    let (_consumer, metrics) = harness.consume(config);
    let watched = Arc::clone(&metrics);
    wait_until(
        "the dead letter was cut and its first write failed",
        Duration::from_secs(30),
        || {
            let cut = Metrics::count(&watched.dead_letters_truncated, "ingest");
            let failed = Metrics::count(&watched.ingest_dead_letters, "error");
            async move { cut == 1 && failed >= 1 }
        },
    )
    .await;
    let record = harness
        .kafka
        .read_all(TOPIC, PARTITIONS)
        .into_iter()
        .find(|record| payload(record) == oversized)
        .expect("the oversized record is on the topic");
    let committed = harness.kafka.committed("taskbroker", TOPIC, PARTITIONS);
    assert!(
        committed[record.partition() as usize] <= record.offset(),
        "committed {committed:?} past the record at {}/{} before its dead letter was written",
        record.partition(),
        record.offset()
    );
    wait_for_commits_to_the_end(&harness).await;
    assert_eq!(Metrics::count(&metrics.dead_letters_truncated, "ingest"), 1);
    assert_eq!(Metrics::count(&metrics.ingest_dead_letters, "ok"), 1);
    let dead = harness.kafka.read_all(INGEST_DLQ, 1);
    assert_eq!(dead.len(), 1);
    let cut = &dead[0];
    assert!(payload(cut) == oversized[..dead_letter_cut(8 << 20)]);
    assert_eq!(
        header(cut, ORIGINAL_BYTES_HEADER),
        Some(oversized.len().to_string())
    );
    assert_eq!(
        header(cut, SOURCE_HEADER),
        Some(format!(
            "{TOPIC}/{}/{}",
            record.partition(),
            record.offset()
        ))
    );
    harness.wait_for_total(20).await;
}

/// The partition the tests of records over 5 MiB keep for the big record
/// alone (see `MockKafka::produce_to`).
const BIG_PARTITION: i32 = 3;

/// Produces `n` valid records to every partition but [`BIG_PARTITION`].
async fn produce_beside_the_big_one(harness: &Harness, prefix: &str, n: usize) {
    for (i, record) in valid_payloads(prefix, n).iter().enumerate() {
        let partition = (i as i32) % BIG_PARTITION;
        harness.kafka.produce_to(TOPIC, partition, record).await;
    }
}

/// The consumer's settings for reading records over MAX_ACTIVATION_BYTES
/// from the mock cluster: unlike Kafka (KIP-74), it returns nothing for a
/// batch larger than the partition's fetch size, which the consumer sizes
/// for the largest valid activation.
fn over_limit_consumer_config(harness: &Harness) -> ConsumerConfig {
    let mut config = harness.consumer_config();
    config
        .kafka
        .properties
        .push(("fetch.message.max.bytes".to_owned(), (16 << 20).to_string()));
    config
        .kafka
        .properties
        .push(("fetch.max.bytes".to_owned(), (16 << 20).to_string()));
    config
}

/// An encoded activation of about `bytes` bytes whose parameters do not
/// compress.
fn incompressible_activation(id: &str, bytes: usize) -> Vec<u8> {
    let mut activation = activation(id.to_owned());
    activation.parameters_bytes = incompressible(bytes as u64, bytes);
    activation.encode_to_vec()
}

/// While the ingest DLQ refuses writes, no offset moves past the invalid
/// record and the partitions stay paused; once it accepts them, the
/// records are dead-lettered and the offsets move on.
#[actix_rt::test]
async fn an_unwritable_ingest_dlq_pauses_the_partitions_and_commits_nothing() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let harness = Harness::new().await;
    harness
        .kafka
        .produce(
            TOPIC,
            &mixed_with(&[vec![0xff, 0xff, 0xff]], "dlq-down", 40),
        )
        .await;
    // Every produce request from here on fails (authorization errors are
    // not retried inside librdkafka): the DLQ is unwritable.
    harness.kafka.cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED; 100_000],
    );
    let (_consumer, metrics) = harness.consume(harness.consumer_config());
    let watched = Arc::clone(&metrics);
    wait_until(
        "the dead-letter write failed twice and the partitions are paused",
        Duration::from_secs(30),
        || {
            let failed = Metrics::count(&watched.ingest_dead_letters, "error");
            let paused = watched.paused_partitions();
            async move { failed >= 2 && paused == i64::from(PARTITIONS) }
        },
    )
    .await;
    // Batches written before the invalid record was read may have committed
    // their partitions; its own partition never moves past it.
    let invalid = harness
        .kafka
        .read_all(TOPIC, PARTITIONS)
        .into_iter()
        .find(|record| payload(record) == [0xff, 0xff, 0xff])
        .expect("the invalid record is on the topic");
    let committed = harness.kafka.committed("taskbroker", TOPIC, PARTITIONS);
    assert!(
        committed[invalid.partition() as usize] <= invalid.offset(),
        "committed {committed:?} past the record at {}/{} that is not dead-lettered",
        invalid.partition(),
        invalid.offset()
    );
    assert_eq!(Metrics::count(&metrics.ingest_dead_letters, "ok"), 0);

    harness
        .kafka
        .cluster
        .clear_request_errors(RDKafkaApiKey::Produce);
    wait_for_commits_to_the_end(&harness).await;
    assert_eq!(Metrics::count(&metrics.ingest_dead_letters, "ok"), 1);
    assert_eq!(dead_letter_reasons(&harness)["undecodable"], 1);
    assert_eq!(metrics.paused_partitions(), 0);
    // Consumption goes on.
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("after", 10))
        .await;
    harness.wait_for_total(50).await;
}

/// A broker restarted on a store already holding MAX_INFLIGHT rows pauses
/// before inserting anything, and never holds more than the limit plus one
/// batch while it drains.
#[actix_rt::test]
async fn a_consumer_started_on_a_full_store_inserts_nothing_until_it_drains() {
    let harness = Harness::new().await;
    let mut config = harness.consumer_config();
    config.max_inflight = 500;
    config.batch_size = 100;
    let limit = config.max_inflight + config.batch_size as u64;
    // The consumer counts the rows of its own topic.
    let mut old = common::rows("old", 500);
    for row in &mut old {
        row.topic = TOPIC.to_owned();
    }
    common::insert(harness.store.as_ref(), &old).await;
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("new", 300))
        .await;
    let (_consumer, metrics) = harness.consume(config);
    wait_until_paused(&metrics).await;
    assert_eq!(
        harness.total().await,
        500,
        "nothing inserted into a full store"
    );
    assert_eq!(metrics.consumed("stored"), 0);

    harness.drain_until_stored(&metrics, 300, limit, 100).await;
}

/// A batch read before a rebalance and written after it commits no offset
/// for the partitions this consumer lost: their new owner has not
/// committed, so any commit seen there came from the old owner.
#[actix_rt::test]
async fn a_batch_pending_across_a_rebalance_commits_only_partitions_still_owned() {
    let harness = Harness::new().await;
    harness
        .kafka
        .produce(TOPIC, &valid_payloads("revoke", 400))
        .await;
    let mut config = harness.consumer_config();
    // Batches are written only when a consumer stops.
    config.batch_size = 1_000_000;
    config.batch_max_wait = Duration::from_secs(3600);
    config.kafka.properties = vec![
        ("session.timeout.ms".to_owned(), "6000".to_owned()),
        ("heartbeat.interval.ms".to_owned(), "500".to_owned()),
    ];
    let (first, first_metrics) = harness.consume(config.clone());
    let pending = Arc::clone(&first_metrics);
    wait_until(
        "the first consumer read every record",
        Duration::from_secs(30),
        || {
            let read = pending.pending_records();
            async move { read == 400 }
        },
    )
    .await;
    let (_second, second_metrics) = harness.consume(config);
    wait_until(
        "the partitions are split between both consumers",
        Duration::from_secs(30),
        || {
            let (a, b) = (
                first_metrics.assigned_partitions(),
                second_metrics.assigned_partitions(),
            );
            async move { a > 0 && b > 0 && a + b == i64::from(PARTITIONS) }
        },
    )
    .await;
    let lost = second_metrics.assigned_partitions() as usize;
    first
        .send(StopConsuming)
        .await
        .expect("first consumer stops");
    let committed = harness.kafka.committed("taskbroker", TOPIC, PARTITIONS);
    let uncommitted = committed.iter().filter(|offset| **offset == -1).count();
    assert!(
        uncommitted >= lost,
        "the first consumer committed partitions it no longer owned: {committed:?}"
    );
    // The records of the partitions it kept were stored and committed (an
    // offset counts the records before it); those of the partitions that
    // went to the second consumer were left to it, not stored here too.
    let kept: i64 = committed.iter().filter(|offset| **offset >= 0).sum();
    assert_eq!(harness.total().await, kept as u64, "{committed:?}");
}
