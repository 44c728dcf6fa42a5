//! The UpkeepActor drives the timed transitions of the activation lifecycle
//! (DESIGN.md, "Activation lifecycle") and publishes retries and dead letters
//! (PROTOCOL.md, "Kafka payloads"). Every transition here is made by the
//! actor itself, against a real store (PostgreSQL, and SQLite where the
//! behaviour is the store's) and librdkafka's mock cluster.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use chrono::{TimeDelta, Utc};
use common::kafka::{MockKafka, payload};
use common::{Backend, TestStore, now, row, row_from, rows, task, wait_until};
use prost::Message as _;
use rdkafka::message::Message as _;
use taskbroker::actors::consumer::{
    ConsumerActor, ORIGINAL_BYTES_HEADER, REASON_HEADER, SOURCE_HEADER,
};
use taskbroker::actors::upkeep::{RunUpkeep, UpkeepActor, UpkeepConfig};
use taskbroker::metrics::Metrics;
use taskbroker::model::{
    ActivationStatus, BucketRange, InflightActivation, OnAttemptsExceeded, PullFilter,
    StatusUpdate, WorkerStatus,
};
use taskbroker::proto::{RetryState, TaskActivation};
use taskbroker::store::PostgresStore;

const RETRY_TOPIC: &str = "upkeep-retries";
const DLQ_TOPIC: &str = "upkeep-dead-letters";
const MAX_ATTEMPTS: u32 = 5;
/// Bound on every wait for a state the upkeep reaches by itself.
const WAIT: Duration = Duration::from_secs(10);
/// An interval no test outlives: the actor runs its first cycle at start and
/// then only the cycles a test asks for with [`RunUpkeep`].
const MANUAL: Duration = Duration::from_secs(3600);

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
        kafka.create_topic(RETRY_TOPIC, 1);
        kafka.create_topic(DLQ_TOPIC, 1);
        Harness { base, kafka }
    }

    fn config(&self) -> UpkeepConfig {
        UpkeepConfig {
            interval: Duration::from_millis(50),
            batch_limit: 1000,
            max_attempts: MAX_ATTEMPTS,
            restart_grace: Duration::ZERO,
            kafka: self.kafka.settings(),
            retry_topic: RETRY_TOPIC.to_owned(),
            dlq_topic: DLQ_TOPIC.to_owned(),
            retry_kafka: None,
            dlq_kafka: None,
            delivery_timeout: Duration::from_secs(2),
            publish_lease: Duration::from_secs(3),
            health: Default::default(),
            rules: taskbroker::runtime::RuntimeRules::none(),
            top_namespaces: 10,
            membership: None,
        }
    }

    fn start_upkeep(&self, config: UpkeepConfig) -> Addr<UpkeepActor> {
        self.upkeep(config).start()
    }

    fn upkeep(&self, config: UpkeepConfig) -> UpkeepActor {
        UpkeepActor::new(
            config,
            self.store_actor.clone(),
            vec![],
            Arc::clone(&self.metrics),
        )
        .expect("upkeep starts")
    }

    fn backlog(&self, step: &str) -> i64 {
        self.metrics.upkeep_backlog.with_label_values(&[step]).get()
    }

    async fn insert(&self, rows: &[InflightActivation]) {
        self.store.insert_batch(rows).await.expect("insert");
    }

    async fn get(&self, id: &str) -> Option<InflightActivation> {
        self.store.get(id).await.expect("get")
    }

    async fn status(&self, id: &str) -> Option<ActivationStatus> {
        self.get(id).await.map(|row| row.status)
    }

    async fn total(&self) -> u64 {
        self.store.count_by_status().await.expect("count").total()
    }

    /// Pull-mode claim of the oldest Pending row: it becomes Processing with
    /// `processing_deadline` = now + its `processing_deadline_duration`.
    async fn pull(&self) -> InflightActivation {
        self.store
            .claim_for_pull(&PullFilter::default(), Duration::ZERO)
            .await
            .expect("claim for pull")
            .expect("a Pending row to pull")
    }

    /// Push-mode claim of the oldest Pending row with `lease`.
    async fn claim(&self, lease: Duration) -> InflightActivation {
        let mut claimed = self
            .store
            .claim_for_push(BucketRange::ALL, 1, lease)
            .await
            .expect("claim for push");
        assert_eq!(claimed.len(), 1, "one Pending row to claim");
        claimed.remove(0).activation
    }

    fn transitions(&self, step: &str) -> u64 {
        Metrics::count(&self.metrics.upkeep_transitions, step)
    }

    fn published(&self, kind: &str, result: &str) -> u64 {
        self.metrics
            .published
            .with_label_values(&[kind, result])
            .get()
    }

    /// Task dead letters written cut short.
    fn truncated(&self) -> u64 {
        Metrics::count(&self.metrics.dead_letters_truncated, "deadletter")
    }

    async fn wait_cycles(&self, n: u64) {
        wait_until(&format!("{n} upkeep cycles completed"), WAIT, || {
            let done = self.metrics.upkeep_cycles.get() >= n;
            async move { done }
        })
        .await;
    }

    /// With a [`MANUAL`] interval: waits for the start-up cycle (number
    /// `done`), then has the actor run one more and waits for it.
    async fn run_next_cycle(&self, upkeep: &Addr<UpkeepActor>, done: u64) {
        self.wait_cycles(done).await;
        assert!(
            upkeep.send(RunUpkeep).await.expect("upkeep is running"),
            "no cycle was running, so this one starts"
        );
        self.wait_cycles(done + 1).await;
    }

    async fn wait_for_status(&self, id: &str, status: Option<ActivationStatus>) {
        wait_until(&format!("{id} is {status:?}"), WAIT, || async {
            self.status(id).await == status
        })
        .await;
    }
}

use common::start_store_actor;

fn seconds_ago(seconds: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: now().timestamp() - seconds,
        nanos: 0,
    }
}

/// A Retry row whose task has been attempted once and asks for a 5 s delay
/// on retry; every field the retry must keep has a distinctive value.
fn retry_row(i: usize) -> (TaskActivation, InflightActivation) {
    let mut activation = task(&format!("retry-{i}"));
    activation.taskname = format!("tests.retry_{i}");
    activation.namespace = format!("ns-{i}");
    activation.parameters_bytes = format!("params-{i}").into_bytes();
    activation
        .headers
        .insert("trace-id".to_owned(), format!("trace-{i}"));
    // Old enough that a kept received_at cannot pass for "now".
    activation.received_at = Some(seconds_ago(3600));
    activation.delay = Some(1);
    activation.expires = Some(7200);
    activation.retry_state = Some(RetryState {
        attempts: 1,
        max_attempts: MAX_ATTEMPTS,
        delay_on_retry: Some(5),
        ..Default::default()
    });
    let mut row = row_from(&activation);
    row.status = ActivationStatus::Retry;
    (activation, row)
}

/// A Failure row with `policy`. Its stored bytes end with a field the schema
/// does not know, so any decode and re-encode on the way to Kafka shows.
fn failure_row(id: &str, policy: OnAttemptsExceeded) -> InflightActivation {
    let mut activation = task(id);
    activation.retry_state = Some(RetryState {
        attempts: 3,
        max_attempts: 3,
        on_attempts_exceeded: policy.as_i32(),
        ..Default::default()
    });
    let mut row = row_from(&activation);
    assert_eq!(row.on_attempts_exceeded, policy);
    // Field 99, varint 1.
    row.activation.extend_from_slice(&[0x98, 0x06, 0x01]);
    row.status = ActivationStatus::Failure;
    row
}

#[actix_rt::test]
async fn overdue_processing_rows_are_retried_or_failed_by_upkeep() {
    let harness = Harness::new().await;
    let mut overdue = task("overdue");
    overdue.processing_deadline_duration = 0;
    let mut overdue_once = task("overdue-once");
    overdue_once.processing_deadline_duration = 0;
    overdue_once
        .retry_state
        .as_mut()
        .expect("task has a retry state")
        .at_most_once = Some(true);
    let on_time = task("on-time");
    let mut batch: Vec<InflightActivation> =
        [&overdue, &overdue_once, &on_time].map(row_from).into();
    for (i, row) in batch.iter_mut().enumerate() {
        row.added_at = now() + TimeDelta::microseconds(i as i64);
    }
    harness.insert(&batch).await;
    for id in ["overdue", "overdue-once", "on-time"] {
        assert_eq!(harness.pull().await.id, id);
    }

    // One cycle only: the Failure it produces would be discarded by the next.
    let mut config = harness.config();
    config.interval = MANUAL;
    let _upkeep = harness.start_upkeep(config);
    harness.wait_cycles(1).await;

    let retried = harness.get("overdue").await.expect("overdue row kept");
    assert_eq!(retried.status, ActivationStatus::Pending);
    assert_eq!(retried.processing_attempts, 1);
    assert_eq!(retried.processing_deadline, None);
    let failed = harness.get("overdue-once").await.expect("at_most_once row");
    assert_eq!(failed.status, ActivationStatus::Failure);
    assert_eq!(failed.processing_attempts, 1);
    let running = harness.get("on-time").await.expect("on-time row kept");
    assert_eq!(running.status, ActivationStatus::Processing);
    assert_eq!(running.processing_attempts, 0);
    assert_eq!(harness.transitions("processing_deadline_retried"), 1);
    assert_eq!(harness.transitions("processing_deadline_failed"), 1);
}

#[actix_rt::test]
async fn expired_claims_return_to_pending_without_an_attempt() {
    let harness = Harness::new().await;
    harness.insert(&rows("claim", 2)).await;
    let expired = harness.claim(Duration::ZERO).await;
    let held = harness.claim(Duration::from_secs(60)).await;

    let _upkeep = harness.start_upkeep(harness.config());
    harness
        .wait_for_status(&expired.id, Some(ActivationStatus::Pending))
        .await;

    let released = harness.get(&expired.id).await.expect("released row");
    assert_eq!(
        released.processing_attempts, 0,
        "a lapsed lease is no attempt"
    );
    let still_held = harness.get(&held.id).await.expect("held row");
    assert_eq!(still_held.status, ActivationStatus::Claimed);
    assert_eq!(still_held.claim_expires_at, held.claim_expires_at);
    assert_eq!(harness.transitions("release_expired_claims"), 1);
    assert_eq!(
        Metrics::count(&harness.metrics.claims_released, "lease_expired"),
        1
    );
}

/// After a cold start the grace holds back processing deadlines (a worker
/// may still report), but never a claim lease: a claim whose lease ran out
/// belongs to a broker that is gone or stuck, and nobody reports on claims.
#[actix_rt::test]
async fn restart_grace_holds_back_deadline_expiry_but_not_lease_expiry() {
    let harness = Harness::new().await;
    let mut overdue = task("overdue");
    overdue.processing_deadline_duration = 0;
    let mut overdue_row = row_from(&overdue);
    overdue_row.added_at = now() - TimeDelta::seconds(1);
    let mut finished = row("finished");
    finished.status = ActivationStatus::Complete;
    harness
        .insert(&[overdue_row, row("claimed"), finished])
        .await;
    let processing = harness.pull().await;
    assert_eq!(processing.id, "overdue");
    let claimed = harness.claim(Duration::ZERO).await;
    assert_eq!(claimed.id, "claimed");

    let mut config = harness.config();
    config.restart_grace = Duration::from_secs(60);
    let _upkeep = harness.start_upkeep(config);
    harness
        .wait_for_status("claimed", Some(ActivationStatus::Pending))
        .await;
    harness.wait_cycles(3).await;
    // The cycles did run their other steps.
    harness.wait_for_status("finished", None).await;

    assert_eq!(harness.get("overdue").await, Some(processing));
    assert_eq!(harness.transitions("release_expired_claims"), 1);
    assert_eq!(harness.transitions("processing_deadline_retried"), 0);
}

#[actix_rt::test]
async fn deadline_expiry_resumes_once_the_restart_grace_has_passed() {
    let harness = Harness::new().await;
    let mut overdue = task("overdue");
    overdue.processing_deadline_duration = 0;
    let mut overdue_row = row_from(&overdue);
    overdue_row.added_at = now() - TimeDelta::seconds(1);
    harness.insert(&[overdue_row]).await;
    assert_eq!(harness.pull().await.id, "overdue");

    let grace = Duration::from_secs(1);
    let mut config = harness.config();
    config.restart_grace = grace;
    let started = tokio::time::Instant::now();
    let _upkeep = harness.start_upkeep(config);
    harness
        .wait_for_status("overdue", Some(ActivationStatus::Pending))
        .await;
    assert!(
        started.elapsed() >= grace,
        "deadline expired {:?} after start, within the {grace:?} grace",
        started.elapsed()
    );
    assert!(
        harness.metrics.upkeep_cycles.get() >= 3,
        "cycles ran during the grace"
    );
}

#[actix_rt::test]
async fn exhausted_attempts_fail() {
    let harness = Harness::new().await;
    let mut batch = rows("attempts", 2);
    batch[0].processing_attempts = MAX_ATTEMPTS as i32;
    batch[1].processing_attempts = MAX_ATTEMPTS as i32 - 1;
    let (spent, left) = (batch[0].id.clone(), batch[1].id.clone());
    harness.insert(&batch).await;

    let mut config = harness.config();
    config.interval = MANUAL;
    let upkeep = harness.start_upkeep(config);
    harness.wait_cycles(1).await;
    assert_eq!(
        harness.status(&spent).await,
        Some(ActivationStatus::Failure)
    );
    assert_eq!(harness.status(&left).await, Some(ActivationStatus::Pending));
    assert_eq!(harness.transitions("fail_exhausted_attempts"), 1);

    // The next cycle discards it (UNSPECIFIED behaves as DISCARD).
    harness.run_next_cycle(&upkeep, 1).await;
    assert_eq!(harness.status(&spent).await, None);
    assert_eq!(harness.status(&left).await, Some(ActivationStatus::Pending));
}

#[actix_rt::test]
async fn expired_pending_rows_are_removed() {
    let harness = Harness::new().await;
    let with_expiry = |id: &str, expires: u64| {
        let mut activation = task(id);
        activation.received_at = Some(seconds_ago(100));
        activation.expires = Some(expires);
        row_from(&activation)
    };
    let expired = with_expiry("expired", 10);
    let alive = with_expiry("alive", 3600);
    // An expired task a worker already has is not taken away from it.
    let mut running = with_expiry("running", 10);
    running.status = ActivationStatus::Processing;
    running.processing_deadline = Some(Utc::now() + TimeDelta::seconds(60));
    harness.insert(&[expired, alive, running]).await;

    let _upkeep = harness.start_upkeep(harness.config());
    harness.wait_for_status("expired", None).await;
    let cycles = harness.metrics.upkeep_cycles.get();
    harness.wait_cycles(cycles + 2).await;

    assert_eq!(
        harness.status("alive").await,
        Some(ActivationStatus::Pending)
    );
    assert_eq!(
        harness.status("running").await,
        Some(ActivationStatus::Processing)
    );
    assert_eq!(harness.transitions("remove_expired"), 1);
}

#[actix_rt::test]
async fn due_delays_become_pending() {
    let harness = Harness::new().await;
    let delayed = |id: &str, until: chrono::DateTime<Utc>| {
        let mut row = row(id);
        row.status = ActivationStatus::Delay;
        row.delay_until = Some(until);
        row
    };
    let soon = now() + TimeDelta::milliseconds(1500);
    harness
        .insert(&[
            delayed("due", now() - TimeDelta::seconds(1)),
            delayed("soon", soon),
            delayed("later", now() + TimeDelta::hours(1)),
        ])
        .await;

    let _upkeep = harness.start_upkeep(harness.config());
    harness
        .wait_for_status("due", Some(ActivationStatus::Pending))
        .await;
    harness
        .wait_for_status("soon", Some(ActivationStatus::Pending))
        .await;
    assert!(
        Utc::now() >= soon,
        "a delay was released before its delay_until"
    );
    assert_eq!(harness.status("later").await, Some(ActivationStatus::Delay));
    // Upkeep counts a transition after its statement commits, so the rows
    // can be seen Pending a moment before the counter moves.
    common::wait_until(
        "both delay releases are counted",
        std::time::Duration::from_secs(10),
        || async { harness.transitions("release_delayed") >= 2 },
    )
    .await;
    assert_eq!(harness.transitions("release_delayed"), 2);
}

#[actix_rt::test]
async fn complete_rows_are_removed() {
    let harness = Harness::new().await;
    let mut batch = rows("done", 5);
    for row in &mut batch {
        row.status = ActivationStatus::Complete;
    }
    let mut running = row("running");
    running.status = ActivationStatus::Processing;
    running.processing_deadline = Some(Utc::now() + TimeDelta::seconds(60));
    batch.push(running);
    batch.push(row("waiting"));
    harness.insert(&batch).await;

    let _upkeep = harness.start_upkeep(harness.config());
    wait_until("only unfinished rows are left", WAIT, || async {
        harness.total().await == 2
    })
    .await;
    assert_eq!(
        harness.status("running").await,
        Some(ActivationStatus::Processing)
    );
    assert_eq!(
        harness.status("waiting").await,
        Some(ActivationStatus::Pending)
    );
    assert_eq!(harness.transitions("remove_completed"), 5);
}

#[actix_rt::test]
async fn retries_are_published_as_new_activations() {
    let harness = Harness::new().await;
    let (originals, batch): (Vec<TaskActivation>, Vec<InflightActivation>) =
        (0..3).map(retry_row).unzip();
    harness.insert(&batch).await;

    let published_after = Utc::now().timestamp();
    let _upkeep = harness.start_upkeep(harness.config());
    wait_until("every Retry row is finished", WAIT, || async {
        let mut finished = 0;
        for original in &originals {
            match harness.status(&original.id).await {
                None | Some(ActivationStatus::Complete) => finished += 1,
                Some(ActivationStatus::Retry) => {}
                Some(other) => panic!("{} became {other}", original.id),
            }
        }
        // Read after the rows: a finished row's record was acknowledged
        // before the row changed.
        let acknowledged = harness.published("retry", "ok");
        assert!(
            finished <= acknowledged,
            "{finished} rows finished but only {acknowledged} records acknowledged"
        );
        finished == originals.len() as u64
    })
    .await;
    let published_before = Utc::now().timestamp();

    let records = harness.kafka.read_all(RETRY_TOPIC, 1);
    assert_eq!(records.len(), originals.len(), "one record per Retry row");
    let mut by_taskname: HashMap<String, (TaskActivation, String)> = HashMap::new();
    for record in &records {
        let retried = TaskActivation::decode(payload(record).as_slice()).expect("a TaskActivation");
        let key = String::from_utf8(record.key().expect("record key").to_vec()).expect("utf-8");
        assert!(
            by_taskname
                .insert(retried.taskname.clone(), (retried, key))
                .is_none(),
            "two records for one task"
        );
    }
    let mut ids = HashSet::new();
    for original in &originals {
        let (retried, key) = by_taskname
            .remove(&original.taskname)
            .unwrap_or_else(|| panic!("no retry of {}", original.taskname));
        assert_ne!(retried.id, original.id, "a retry is a new activation");
        assert!(uuid::Uuid::parse_str(&retried.id).is_ok(), "a UUID");
        assert!(ids.insert(retried.id.clone()), "retry ids are unique");
        assert_eq!(key, retried.id, "the record is keyed by the new id");
        let state = retried.retry_state.expect("retry state");
        assert_eq!(state.attempts, 2);
        assert_eq!(state.delay_on_retry, Some(5));
        assert_eq!(retried.delay, Some(5));
        let received = retried.received_at.expect("received_at").seconds;
        assert!(
            (published_after - 1..=published_before + 1).contains(&received),
            "received_at {received} is not the publish time"
        );
        assert_eq!(retried.namespace, original.namespace);
        assert_eq!(retried.taskname, original.taskname);
        assert_eq!(retried.parameters_bytes, original.parameters_bytes);
        assert_eq!(retried.headers, original.headers);
        assert_eq!(retried.application, original.application);
        assert_eq!(
            retried.processing_deadline_duration,
            original.processing_deadline_duration
        );
        assert_eq!(retried.expires, original.expires);
        let original_state = original.retry_state.expect("original retry state");
        assert_eq!(state.max_attempts, original_state.max_attempts);
    }
    assert_eq!(harness.kafka.end_offsets(DLQ_TOPIC, 1), [0]);
}

on_both_backends!(a_workers_retry_edit_reaches_the_retry_topic);

/// A worker's RETRY report with edits: the stored bytes stay as received,
/// and the retry upkeep publishes carries the edited retry state.
async fn a_workers_retry_edit_reaches_the_retry_topic(backend: Backend) {
    let harness = Harness::on(backend).await;
    let (original, row) = retry_row(0);
    let mut pending = row;
    pending.status = ActivationStatus::Pending;
    harness.insert(std::slice::from_ref(&pending)).await;
    assert_eq!(harness.pull().await.id, original.id);
    let mut report = StatusUpdate::new(original.id.clone(), WorkerStatus::Retry);
    report.max_attempts = Some(9);
    report.delay_on_retry = Some(20);
    let outcome = harness.store.set_status(&[report]).await.expect("report");
    assert_eq!(outcome.updated, 1);
    let stored = harness.get(&original.id).await.expect("the row");
    assert_eq!(stored.status, ActivationStatus::Retry);
    assert_eq!(
        stored.activation, pending.activation,
        "stored bytes untouched"
    );

    let _upkeep = harness.start_upkeep(harness.config());
    wait_until("the retry is published", WAIT, || async {
        harness.published("retry", "ok") == 1
    })
    .await;
    let records = harness.kafka.read_all(RETRY_TOPIC, 1);
    assert_eq!(records.len(), 1);
    let retried =
        TaskActivation::decode(payload(&records[0]).as_slice()).expect("a TaskActivation");
    let state = retried.retry_state.expect("retry state");
    assert_eq!(
        (state.attempts, state.max_attempts, state.delay_on_retry),
        (2, 9, Some(20)),
        "the edit replaced max_attempts and delay_on_retry"
    );
    assert_eq!(retried.delay, Some(20), "the edited delay is the retry's");
    assert_eq!(retried.taskname, original.taskname);
    assert_eq!(retried.headers, original.headers);
}

#[actix_rt::test]
async fn dead_letters_are_published_byte_identical_and_discards_are_not() {
    let harness = Harness::new().await;
    let batch = vec![
        failure_row("dead-0", OnAttemptsExceeded::Deadletter),
        failure_row("dead-1", OnAttemptsExceeded::Deadletter),
        failure_row("discard-0", OnAttemptsExceeded::Discard),
        failure_row("discard-1", OnAttemptsExceeded::Discard),
        failure_row("unspecified-0", OnAttemptsExceeded::Unspecified),
        failure_row("unspecified-1", OnAttemptsExceeded::Unspecified),
    ];
    harness.insert(&batch).await;
    let mut stored = HashMap::new();
    for row in &batch {
        let row = harness.get(&row.id).await.expect("stored");
        stored.insert(row.id.clone(), row);
    }

    let _upkeep = harness.start_upkeep(harness.config());
    wait_until("every Failure row is finished", WAIT, || async {
        let mut dead_letters_finished = 0;
        let mut finished = 0;
        for row in &batch {
            match harness.status(&row.id).await {
                None | Some(ActivationStatus::Complete) => {
                    finished += 1;
                    if row.on_attempts_exceeded == OnAttemptsExceeded::Deadletter {
                        dead_letters_finished += 1;
                    }
                }
                Some(ActivationStatus::Failure) => {}
                Some(other) => panic!("{} became {other}", row.id),
            }
        }
        let acknowledged = harness.published("deadletter", "ok");
        assert!(
            dead_letters_finished <= acknowledged,
            "{dead_letters_finished} dead letters finished, {acknowledged} acknowledged"
        );
        finished == batch.len()
    })
    .await;

    let records = harness.kafka.read_all(DLQ_TOPIC, 1);
    let mut published: HashMap<String, Vec<u8>> = HashMap::new();
    for record in &records {
        let key = String::from_utf8(record.key().expect("record key").to_vec()).expect("utf-8");
        assert!(
            published.insert(key.clone(), payload(record)).is_none(),
            "{key} dead-lettered twice"
        );
    }
    let keys: HashSet<&str> = published.keys().map(String::as_str).collect();
    assert_eq!(keys, HashSet::from(["dead-0", "dead-1"]));
    for (id, bytes) in &published {
        assert_eq!(bytes, &stored[id].activation, "{id} is not byte-identical");
    }
    assert_eq!(harness.kafka.end_offsets(RETRY_TOPIC, 1), [0]);
    assert_eq!(harness.transitions("discard_failures"), 4);
}

#[actix_rt::test]
async fn kafka_outage_keeps_rows_until_publish_is_acknowledged() {
    let harness = Harness::new().await;
    let batch: Vec<InflightActivation> = (0..5)
        .map(|i| failure_row(&format!("dead-{i}"), OnAttemptsExceeded::Deadletter))
        .collect();
    harness.insert(&batch).await;
    harness.kafka.cluster.broker_down(1).expect("broker down");

    let mut config = harness.config();
    config.delivery_timeout = Duration::from_secs(1);
    config.publish_lease = Duration::from_secs(2);
    // librdkafka backs reconnects off up to 10 s by default; keep the test short.
    config
        .kafka
        .properties
        .push(("reconnect.backoff.max.ms".to_owned(), "200".to_owned()));
    let _upkeep = harness.start_upkeep(config);
    wait_until("every dead letter failed to publish", WAIT, || {
        let failed = harness.published("deadletter", "error") >= batch.len() as u64
            && harness.metrics.upkeep_cycles.get() >= 1;
        async move { failed }
    })
    .await;
    for row in &batch {
        assert_eq!(
            harness.status(&row.id).await,
            Some(ActivationStatus::Failure),
            "{} left Failure without an acknowledgement",
            row.id
        );
    }
    assert_eq!(harness.published("deadletter", "ok"), 0);

    harness.kafka.cluster.broker_up(1).expect("broker up");
    wait_until("every dead letter is published", WAIT, || async {
        harness.total().await == 0
    })
    .await;

    let mut counts: HashMap<String, usize> = HashMap::new();
    for record in harness.kafka.read_all(DLQ_TOPIC, 1) {
        let id = TaskActivation::decode(payload(&record).as_slice())
            .expect("a TaskActivation")
            .id;
        *counts.entry(id).or_default() += 1;
    }
    let expected: HashMap<String, usize> = batch.iter().map(|row| (row.id.clone(), 1)).collect();
    assert_eq!(counts, expected, "each dead letter exactly once");
}

#[actix_rt::test]
async fn two_upkeep_actors_never_publish_the_same_row() {
    const ROWS: usize = 300;
    let harness = Harness::new().await;
    let batch: Vec<InflightActivation> = (0..ROWS)
        .map(|i| {
            let mut activation = task(&format!("retry-{i}"));
            activation.taskname = format!("tests.lineage_{i}");
            let mut row = row_from(&activation);
            row.status = ActivationStatus::Retry;
            row
        })
        .collect();
    harness.insert(&batch).await;

    // Two brokers: each its own pool, StoreActor, producer and metrics.
    let mut config = harness.config();
    config.interval = Duration::from_millis(20);
    config.batch_limit = 20;
    let brokers: Vec<(Addr<UpkeepActor>, Arc<Metrics>)> = (0..2)
        .map(|_| {
            let TestStore::Postgres(db) = &harness.db else {
                unreachable!("the harness runs on PostgreSQL");
            };
            let store = Arc::new(PostgresStore::connect(&db.store_config()).expect("store"));
            let metrics = Arc::new(Metrics::new());
            let store_actor = start_store_actor(store, Arc::clone(&metrics));
            let upkeep =
                UpkeepActor::new(config.clone(), store_actor, vec![], Arc::clone(&metrics))
                    .expect("upkeep starts")
                    .start();
            (upkeep, metrics)
        })
        .collect();
    wait_until("every Retry row is published", WAIT, || async {
        harness.total().await == 0
    })
    .await;

    let records = harness.kafka.read_all(RETRY_TOPIC, 1);
    let mut lineages: HashMap<String, usize> = HashMap::new();
    for record in &records {
        let retried = TaskActivation::decode(payload(record).as_slice()).expect("a TaskActivation");
        *lineages.entry(retried.taskname).or_default() += 1;
    }
    let twice: Vec<&String> = lineages
        .iter()
        .filter(|(_, count)| **count > 1)
        .map(|(taskname, _)| taskname)
        .collect();
    assert!(twice.is_empty(), "published more than once: {twice:?}");
    assert_eq!(records.len(), ROWS);
    assert_eq!(lineages.len(), ROWS);
    for (i, (_, metrics)) in brokers.iter().enumerate() {
        let published = metrics.published.with_label_values(&["retry", "ok"]).get();
        assert!(
            published > 0,
            "broker {i} published nothing: no contention tested"
        );
    }
}

#[actix_rt::test]
async fn kafka_outage_does_not_hold_back_the_other_steps() {
    let harness = Harness::new().await;
    harness
        .insert(&[failure_row("dead", OnAttemptsExceeded::Deadletter)])
        .await;
    harness.kafka.cluster.broker_down(1).expect("broker down");
    let mut config = harness.config();
    config.delivery_timeout = Duration::from_secs(8);
    config.publish_lease = Duration::from_secs(20);
    let _upkeep = harness.start_upkeep(config);
    // A lease that runs out while the dead letter's publish hangs on the
    // absent broker: upkeep must release it without waiting for Kafka.
    harness.insert(&[common::row("lease")]).await;
    let claimed = harness.claim(Duration::ZERO).await;
    wait_until("the expired claim is released", WAIT, || async {
        harness.status(&claimed.id).await == Some(ActivationStatus::Pending)
    })
    .await;
    assert_eq!(
        harness.published("deadletter", "error"),
        0,
        "the claim was released before the publish gave up"
    );
    assert_eq!(
        harness.status("dead").await,
        Some(ActivationStatus::Failure)
    );
    harness.kafka.cluster.broker_up(1).expect("broker up");
}

// ------------------------------------------------------------ catching up

on_both_backends!(upkeep_catches_up_on_more_than_a_batch_in_one_cycle);

async fn upkeep_catches_up_on_more_than_a_batch_in_one_cycle(backend: Backend) {
    let harness = Harness::on(backend).await;
    let mut finished = rows("done", 55);
    for row in &mut finished {
        row.status = ActivationStatus::Complete;
    }
    let mut due: Vec<InflightActivation> = rows("due", 23);
    for row in &mut due {
        row.status = ActivationStatus::Delay;
        row.delay_until = Some(now() - TimeDelta::seconds(1));
    }
    harness.insert(&finished).await;
    harness.insert(&due).await;

    let mut config = harness.config();
    config.interval = MANUAL;
    config.batch_limit = 10;
    let _upkeep = harness.start_upkeep(config);
    harness.wait_cycles(1).await;

    assert_eq!(harness.transitions("remove_completed"), 55);
    assert_eq!(harness.transitions("release_delayed"), 23);
    let counts = harness.store.count_by_status().await.expect("count");
    assert_eq!(counts.get(ActivationStatus::Complete), 0);
    assert_eq!(counts.get(ActivationStatus::Pending), 23);
    assert_eq!(counts.total(), 23);
    // Five full batches, then one that found the rest.
    assert_eq!(harness.metrics.store_calls("remove_completed"), 6);
    assert_eq!(harness.backlog("remove_completed"), 0);
    assert_eq!(harness.backlog("release_delayed"), 0);
}

/// SQLite: after a burst of large tasks drained, upkeep gives the file's
/// space back, one bounded run per cycle while there is more (the store
/// is empty by then, so these are idle cycles), then only on the slow
/// cadence; `taskbroker_sqlite_bytes` shows the file as it is on disk.
#[actix_rt::test]
async fn a_drained_burst_gives_the_sqlite_file_space_back_and_the_gauges_show_it() {
    let harness = Harness::on(Backend::Sqlite).await;
    let common::TestStore::Sqlite(db) = &harness.db else {
        unreachable!("an SQLite harness")
    };
    // 24 MiB of finished tasks, which the first cycle removes.
    for chunk in 0..4 {
        let mut batch = rows(&format!("big-{chunk}"), 24);
        for (i, row) in batch.iter_mut().enumerate() {
            row.activation = common::incompressible(chunk * 100 + i as u64, 256 << 10);
            row.status = ActivationStatus::Complete;
        }
        harness.insert(&batch).await;
    }
    let on_disk = || {
        std::fs::metadata(&db.path)
            .expect("the database file")
            .len()
    };
    let peak = on_disk();
    assert!(peak > 24 << 20, "peak {peak} bytes");
    let gauge = |kind: &str| {
        harness
            .metrics
            .sqlite_bytes
            .with_label_values(&[kind])
            .get()
    };

    let upkeep = harness.start_upkeep(UpkeepConfig {
        interval: MANUAL,
        ..harness.config()
    });
    harness.wait_cycles(1).await;
    assert_eq!(harness.transitions("remove_completed"), 96);
    assert_eq!(harness.metrics.store_calls("reclaim_space"), 1);
    assert!(
        gauge("free") > 10 << 20 && gauge("file") > 20 << 20,
        "one bounded run gave back part: free {}, file {}",
        gauge("free"),
        gauge("file")
    );
    let mut done = 1;
    while gauge("free") > 8 << 20 {
        assert!(done < 20, "still {} bytes free", gauge("free"));
        harness.run_next_cycle(&upkeep, done).await;
        done += 1;
    }
    assert_eq!(
        harness.metrics.store_calls("reclaim_space"),
        done,
        "one run per cycle"
    );
    let after = on_disk();
    assert_eq!(gauge("file"), after as i64, "the gauge is the file on disk");
    assert!(after < 10 << 20, "{after} bytes left of {peak}");
    assert_eq!(gauge("wal"), 0, "the WAL is truncated");
    // Nothing more to give back: the next cycle does not ask.
    harness.run_next_cycle(&upkeep, done).await;
    assert_eq!(harness.metrics.store_calls("reclaim_space"), done);
}

#[actix_rt::test]
async fn a_step_cut_short_by_its_budget_shows_a_backlog() {
    let harness = Harness::new().await;
    let mut finished = rows("done", 55);
    for row in &mut finished {
        row.status = ActivationStatus::Complete;
    }
    harness.insert(&finished).await;

    let mut config = harness.config();
    config.interval = MANUAL;
    config.batch_limit = 10;
    // No time for a second pass: each step runs one batch per cycle.
    let upkeep = harness
        .upkeep(config)
        .with_step_budget(Duration::ZERO)
        .start();
    harness.wait_cycles(1).await;
    assert_eq!(harness.transitions("remove_completed"), 10);
    assert_eq!(harness.total().await, 45);
    assert_eq!(
        harness.backlog("remove_completed"),
        10,
        "at least a batch left"
    );
    assert_eq!(harness.backlog("release_delayed"), 0, "nothing was due");

    harness.run_next_cycle(&upkeep, 1).await;
    assert_eq!(harness.total().await, 35);
    assert_eq!(harness.backlog("remove_completed"), 10);
}

// ------------------------------------------------------------ republishing

/// A consumer of `topic` into the harness's store, with its own metrics.
fn ingest(harness: &Harness, topic: &str) -> (Addr<ConsumerActor>, Arc<Metrics>) {
    harness.kafka.create_topic("ingest-dlq", 1);
    let metrics = Arc::new(Metrics::new());
    let config = harness.kafka.consumer_config(topic, "ingest", "ingest-dlq");
    let actor = ConsumerActor::new(
        config,
        harness.store_actor.clone(),
        vec![],
        Arc::clone(&metrics),
    );
    (actor.start(), metrics)
}

#[actix_rt::test]
async fn a_retry_published_again_keeps_its_id_and_is_stored_once() {
    let harness = Harness::new().await;
    let (original, row) = retry_row(0);
    harness.insert(std::slice::from_ref(&row)).await;
    let _upkeep = harness.start_upkeep(harness.config());
    wait_until(
        "the retry is published and its row finished",
        WAIT,
        || async {
            harness.published("retry", "ok") == 1
                && harness.status(&original.id).await != Some(ActivationStatus::Retry)
        },
    )
    .await;

    // A broker that died after Kafka's acknowledgement and before marking
    // the row published: the row is still Retry, and is published again.
    harness
        .store
        .delete_batch(std::slice::from_ref(&original.id))
        .await
        .expect("delete");
    harness.insert(std::slice::from_ref(&row)).await;
    wait_until("the retry is published a second time", WAIT, || async {
        harness.published("retry", "ok") == 2
            && harness.status(&original.id).await != Some(ActivationStatus::Retry)
    })
    .await;

    let records = harness.kafka.read_all(RETRY_TOPIC, 1);
    assert_eq!(records.len(), 2);
    let ids: Vec<String> = records
        .iter()
        .map(|record| {
            TaskActivation::decode(payload(record).as_slice())
                .expect("a TaskActivation")
                .id
        })
        .collect();
    assert_eq!(ids[0], ids[1], "both publications carry the same id");
    assert_ne!(ids[0], original.id);
    assert_eq!(records[0].key(), records[1].key());

    let (_consumer, ingested) = ingest(&harness, RETRY_TOPIC);
    wait_until("ingest has read both records", WAIT, || {
        let read = ingested.consumed("stored") + ingested.consumed("duplicate");
        async move { read == 2 }
    })
    .await;
    assert_eq!(ingested.consumed("stored"), 1);
    assert_eq!(ingested.consumed("duplicate"), 1);
    assert!(harness.get(&ids[0]).await.is_some(), "the retry is stored");
}

/// A retry or a dead letter Kafka refuses as too large is never published
/// again and again, and never dropped: the task's stored activation goes to
/// the dead-letter topic cut short (as far as Kafka makes it), with its
/// original size and source position in headers, and the row finishes.
#[actix_rt::test]
async fn records_too_large_for_kafka_go_to_the_dlq_cut_short_not_published_forever() {
    let harness = Harness::new().await;
    let big = vec![7u8; 5_000];
    let (mut large_retry, _) = retry_row(0);
    large_retry.parameters_bytes = big.clone();
    let mut large_retry_row = row_from(&large_retry);
    large_retry_row.status = ActivationStatus::Retry;
    let large_retry_bytes = large_retry_row.activation.clone();
    let (small_retry, small_retry_row) = retry_row(1);
    let mut large_dead = task("dead-large");
    large_dead.parameters_bytes = big;
    large_dead.retry_state = Some(RetryState {
        attempts: 3,
        max_attempts: 3,
        on_attempts_exceeded: OnAttemptsExceeded::Deadletter.as_i32(),
        ..Default::default()
    });
    let mut large_dead_row = row_from(&large_dead);
    large_dead_row.status = ActivationStatus::Failure;
    let large_dead_bytes = large_dead_row.activation.clone();
    harness
        .insert(&[large_retry_row, small_retry_row, large_dead_row])
        .await;

    let mut config = harness.config();
    // librdkafka's smallest allowed limit, well below the large records.
    config
        .kafka
        .properties
        .push(("message.max.bytes".to_owned(), "1000".to_owned()));
    let _upkeep = harness.start_upkeep(config);
    wait_until("every row is finished", WAIT, || async {
        let mut finished = true;
        for id in [&large_retry.id, &small_retry.id, &large_dead.id] {
            let status = harness.status(id).await;
            finished &= matches!(status, None | Some(ActivationStatus::Complete));
        }
        finished
    })
    .await;

    assert_eq!(harness.published("retry", "too_large"), 1);
    assert_eq!(harness.published("deadletter", "too_large"), 1);
    assert_eq!(harness.published("retry", "ok"), 1, "the small retry");
    assert_eq!(harness.published("retry", "error"), 0);
    assert_eq!(harness.published("deadletter", "error"), 0);
    let retries = harness.kafka.read_all(RETRY_TOPIC, 1);
    assert_eq!(retries.len(), 1);
    let retried =
        TaskActivation::decode(payload(&retries[0]).as_slice()).expect("a TaskActivation");
    assert_eq!(retried.taskname, small_retry.taskname);
    let dead = harness.kafka.read_all(DLQ_TOPIC, 1);
    assert_eq!(dead.len(), 2, "both large tasks are dead-lettered");
    let header = |record: &rdkafka::message::OwnedMessage, key: &str| {
        use rdkafka::message::Headers as _;
        record.headers().and_then(|headers| {
            headers
                .iter()
                .find(|header| header.key == key)
                .and_then(|header| header.value)
                .map(|value| String::from_utf8_lossy(value).into_owned())
        })
    };
    for (task, stored) in [
        (&large_retry, &large_retry_bytes),
        (&large_dead, &large_dead_bytes),
    ] {
        let record = dead
            .iter()
            .find(|record| record.key() == Some(task.id.as_bytes()))
            .unwrap_or_else(|| panic!("{} is dead-lettered", task.id));
        let cut = payload(record);
        assert!(
            !cut.is_empty() && cut.len() < stored.len(),
            "{}: {} bytes",
            task.id,
            cut.len()
        );
        assert!(
            stored.starts_with(&cut),
            "the beginning of the stored activation"
        );
        assert_eq!(
            header(record, ORIGINAL_BYTES_HEADER),
            Some(stored.len().to_string())
        );
        assert_eq!(header(record, REASON_HEADER).as_deref(), Some("too_large"));
        assert!(header(record, SOURCE_HEADER).is_some());
    }
    assert_eq!(harness.truncated(), 2);
}

/// The lag gauge is read every cycle, from indexes; the per-status counts
/// read the whole table and are refreshed at most every
/// `STATUS_COUNT_INTERVAL`, however often cycles run.
#[actix_rt::test]
async fn cycles_read_the_lag_each_time_and_count_the_table_at_most_every_interval() {
    let harness = Harness::new().await;
    // A row, so the cycles have a table to read (an empty one is skipped).
    harness.insert(&[row("waiting")]).await;
    let upkeep = harness.start_upkeep(UpkeepConfig {
        interval: MANUAL,
        ..harness.config()
    });
    for done in 1..=5 {
        harness.run_next_cycle(&upkeep, done).await;
    }
    assert_eq!(harness.metrics.store_calls("max_pending_lag"), 6);
    // One scan serves the per-status and the per-namespace gauges.
    assert_eq!(harness.metrics.store_calls("count_by_namespace"), 1);
    assert_eq!(harness.metrics.store_calls("count_by_status"), 0);
}

/// `taskbroker_inflight_bytes` follows the store's per-topic sums every
/// cycle, and drops to 0 once the store is empty, on both stores.
#[actix_rt::test]
async fn the_inflight_bytes_gauge_follows_the_store_each_cycle() {
    for backend in [Backend::Postgres, Backend::Sqlite] {
        let harness = Harness::on(backend).await;
        let sized = |id: &str, topic: &str, bytes: usize| {
            let mut row = row(id);
            row.topic = topic.to_owned();
            row.activation = vec![5; bytes];
            row
        };
        harness
            .insert(&[
                sized("a", "main", 3000),
                sized("b", "main", 4000),
                sized("c", "side", 500),
            ])
            .await;
        let upkeep = harness.start_upkeep(UpkeepConfig {
            interval: MANUAL,
            ..harness.config()
        });
        harness.run_next_cycle(&upkeep, 1).await;
        let gauge = |topic: &str| {
            harness
                .metrics
                .inflight_bytes
                .with_label_values(&[topic])
                .get()
        };
        assert_eq!((gauge("main"), gauge("side")), (7000, 500), "{backend:?}");
        harness
            .store
            .delete_batch(&["a".to_owned(), "c".to_owned()])
            .await
            .unwrap();
        harness.run_next_cycle(&upkeep, 2).await;
        assert_eq!((gauge("main"), gauge("side")), (4000, 0), "{backend:?}");
        harness.store.delete_batch(&["b".to_owned()]).await.unwrap();
        harness.run_next_cycle(&upkeep, 3).await;
        assert_eq!((gauge("main"), gauge("side")), (0, 0), "{backend:?}");
    }
}

/// The per-namespace gauges: the namespaces with the most unfinished rows
/// get series of their own, the rest are summed as `other`, and the
/// per-status gauge is the sum of all; on both stores.
#[actix_rt::test]
async fn namespace_gauges_show_the_top_namespaces_and_the_rest_as_other() {
    for backend in [Backend::Postgres, Backend::Sqlite] {
        let harness = Harness::on(backend).await;
        let in_namespace = |prefix: &str, n: usize, namespace: &str| -> Vec<InflightActivation> {
            common::rows(prefix, n)
                .into_iter()
                .map(|mut row| {
                    row.namespace = namespace.to_owned();
                    row.received_at = chrono::Utc::now() - chrono::TimeDelta::seconds(120);
                    row
                })
                .collect()
        };
        harness.insert(&in_namespace("b", 7, "big")).await;
        harness.insert(&in_namespace("m", 3, "mid")).await;
        harness.insert(&in_namespace("s", 1, "small")).await;
        harness.insert(&in_namespace("t", 1, "tiny")).await;
        let _upkeep = harness.start_upkeep(UpkeepConfig {
            interval: MANUAL,
            top_namespaces: 2,
            ..harness.config()
        });
        harness.wait_cycles(1).await;
        let gauge = |namespace: &str, status: &str| {
            harness
                .metrics
                .namespace_activations
                .with_label_values(&[namespace, status])
                .get()
        };
        assert_eq!(gauge("big", "pending"), 7, "{backend:?}");
        assert_eq!(gauge("mid", "pending"), 3);
        assert_eq!(gauge("other", "pending"), 2, "small and tiny");
        assert_eq!(gauge("big", "claimed"), 0);
        let text = harness.metrics.render();
        assert!(!text.contains("namespace=\"small\""), "{text}");
        let lag = harness
            .metrics
            .namespace_max_lag
            .with_label_values(&["big"])
            .get();
        assert!((119.0..600.0).contains(&lag), "lag {lag}");
        assert_eq!(
            harness
                .metrics
                .activations
                .with_label_values(&["pending"])
                .get(),
            12
        );

        // Worker reports count per namespace: a shown one under its name,
        // the rest as `other`; only reports that applied.
        let claimed = harness
            .store
            .claim_for_push(BucketRange::ALL, 100, Duration::from_secs(60))
            .await
            .unwrap();
        let report = |namespace: &str, status: WorkerStatus| {
            claimed
                .iter()
                .filter(|claim| claim.activation.namespace == namespace)
                .map(|claim| StatusUpdate::new(claim.token.id.clone(), status))
                .collect::<Vec<_>>()
        };
        let mut updates = report("big", WorkerStatus::Complete);
        updates.extend(report("mid", WorkerStatus::Retry));
        updates.extend(report("small", WorkerStatus::Failure));
        updates.extend(report("tiny", WorkerStatus::Complete));
        updates.push(StatusUpdate::new("no-such-row", WorkerStatus::Complete));
        harness.store_actor.report(updates).await.unwrap();
        let results = |namespace: &str, status: &str| {
            harness
                .metrics
                .namespace_results
                .with_label_values(&[namespace, status])
                .get()
        };
        assert_eq!(results("big", "complete"), 7, "{backend:?}");
        assert_eq!(results("mid", "retry"), 3);
        assert_eq!(results("other", "failure"), 1, "small");
        assert_eq!(
            results("other", "complete"),
            1,
            "tiny; the missing row not at all"
        );
        assert!(!harness.metrics.render().contains("namespace=\"tiny\""));
    }
}

/// Idle cost: on an empty store a cycle is one statement (`has_rows`), not
/// one per step, and the gauges read as an empty store's; a row that needs
/// upkeep is still handled by the next cycle.
#[actix_rt::test]
async fn an_empty_store_costs_one_statement_per_cycle() {
    let harness = Harness::new().await;
    let upkeep = harness.start_upkeep(UpkeepConfig {
        interval: MANUAL,
        ..harness.config()
    });
    for done in 1..=4 {
        harness.run_next_cycle(&upkeep, done).await;
    }
    let all_calls = || -> u64 {
        taskbroker::metrics::labels::STORE_OPERATIONS
            .iter()
            .map(|operation| harness.metrics.store_calls(operation))
            .sum()
    };
    assert_eq!(harness.metrics.store_calls("has_rows"), 5);
    // The first cycle also offered to reclaim the store's file space;
    // PostgreSQL has no file of its own and is not asked again.
    assert_eq!(harness.metrics.store_calls("reclaim_space"), 1);
    assert_eq!(all_calls(), 6, "five cycles, one statement each");
    assert_eq!(harness.metrics.max_lag_seconds.get(), 0.0);
    assert_eq!(
        harness
            .metrics
            .activations
            .with_label_values(&["pending"])
            .get(),
        0
    );

    let mut due = row("due");
    due.status = ActivationStatus::Delay;
    due.delay_until = Some(now() - TimeDelta::seconds(1));
    harness.insert(&[due]).await;
    harness.run_next_cycle(&upkeep, 5).await;
    assert_eq!(harness.status("due").await, Some(ActivationStatus::Pending));
    assert!(harness.metrics.store_calls("release_delayed") >= 1);
}
