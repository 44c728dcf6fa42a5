//! The runtime file (TASKBROKER_RUNTIME_CONFIG) through the whole broker:
//! a killswitch written while tasks flow removes exactly the matching ones
//! (stored rows by upkeep, new records at ingest); a paused namespace holds
//! its tasks and delivers them once resumed; a bad version is refused and
//! the previous rules stay. Real PostgreSQL or SQLite, the mock Kafka
//! cluster, workers on loopback.

mod common;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::kafka::MockKafka;
use common::process::encoded_tasks;
use common::worker::{FakeWorker, Mode};
use common::{Backend, TestStore, wait_until};
use taskbroker::broker::Broker;
use taskbroker::config::{Config, DeliveryMode};
use taskbroker::metrics::Metrics;
use taskbroker::proto::GetTaskRequest;
use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
use taskbroker::runtime::{RuntimeFile, RuntimeRules};
use taskbroker::store::ActivationStore;

/// A runtime file in a directory of its own, removed with it.
struct RuntimeDir {
    dir: PathBuf,
}

impl RuntimeDir {
    fn new() -> RuntimeDir {
        let dir = std::env::temp_dir().join(format!("taskbroker-runtime-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        RuntimeDir { dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.join("runtime.yaml")
    }

    /// Replaces the file as a ConfigMap update does: a new file renamed
    /// over the old, so a reader never sees half of it.
    fn write(&self, text: &str) {
        let next = self.dir.join("next.yaml");
        std::fs::write(&next, text).unwrap();
        std::fs::rename(&next, self.path()).unwrap();
    }
}

impl Drop for RuntimeDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn config(db: &TestStore, kafka: &MockKafka, runtime: &Path, extra: &[(&str, String)]) -> Config {
    let mut env: HashMap<String, String> = [
        db.env(),
        ("KAFKA_BROKERS", kafka.bootstrap()),
        ("KAFKA_TOPIC", "tasks".to_owned()),
        ("GRPC_ADDR", "127.0.0.1:0".to_owned()),
        ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
        ("UPKEEP_INTERVAL_MS", "100".to_owned()),
        ("RESTART_GRACE_SEC", "0".to_owned()),
        ("RUNTIME_CONFIG", runtime.display().to_string()),
    ]
    .into_iter()
    .map(|(name, value)| (format!("TASKBROKER_{name}"), value))
    .collect();
    for (name, value) in extra {
        env.insert(format!("TASKBROKER_{name}"), value.clone());
    }
    Config::from_lookup(|name| env.get(name).cloned()).expect("test configuration")
}

/// Pulls every task the broker hands out (GetTask answers NOT_FOUND once
/// nothing is left), each once; their ids.
async fn pull_all(broker: &Broker) -> BTreeSet<String> {
    let mut client = ConsumerServiceClient::connect(format!("http://{}", broker.grpc_addr))
        .await
        .unwrap();
    let mut pulled = BTreeSet::new();
    while let Some(task) = client
        .get_task(GetTaskRequest::default())
        .await
        .ok()
        .and_then(|response| response.into_inner().task)
    {
        assert!(pulled.insert(task.id.clone()), "{} pulled twice", task.id);
    }
    pulled
}

/// A broker on the test store and cluster, reading `runtime`'s file.
fn start(
    db: &TestStore,
    store: &Arc<dyn ActivationStore>,
    kafka: &MockKafka,
    runtime: &RuntimeDir,
    extra: &[(&str, String)],
    metrics: &Arc<Metrics>,
) -> Broker {
    Broker::start(
        &config(db, kafka, &runtime.path(), extra),
        Arc::clone(store),
        Arc::clone(metrics),
        "test-host",
    )
    .expect("broker starts")
}

/// The runtime file at `path` as a broker of `mode` opens it (demoted
/// topic `tasks-long`).
fn open_runtime(
    path: &Path,
    mode: DeliveryMode,
    metrics: Arc<Metrics>,
) -> Result<(RuntimeFile, RuntimeRules), String> {
    RuntimeFile::open(path, "tasks-long", mode, metrics)
}

fn ids(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}-{i}")).collect()
}

on_both_backends!(
    a_killswitch_written_while_tasks_flow_removes_exactly_the_matching_ones,
    a_paused_namespace_holds_its_tasks_until_resumed,
    a_demoted_namespace_reaches_the_demoted_topic_once_stored_or_arriving,
    weights_in_the_runtime_file_steer_push_claims,
);

/// Pull mode, so nothing is delivered until the test pulls: `kill` and
/// `keep` tasks are stored; a killswitch for `kill` is written; upkeep
/// removes the stored `kill` rows and the consumer drops new `kill`
/// records, while every `keep` task is stored and delivered.
async fn a_killswitch_written_while_tasks_flow_removes_exactly_the_matching_ones(backend: Backend) {
    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 2);
    let runtime = RuntimeDir::new();
    runtime.write("# no rules yet\n");
    let metrics = Arc::new(Metrics::new());
    let broker = start(
        &db,
        &store,
        &kafka,
        &runtime,
        &[("DELIVERY_MODE", "pull".to_owned())],
        &metrics,
    );

    let (kill_before, keep_before) = (ids("kill", 0..100), ids("keep", 0..100));
    kafka
        .produce("tasks", &encoded_tasks(&kill_before, "kill", 60))
        .await;
    kafka
        .produce("tasks", &encoded_tasks(&keep_before, "keep", 60))
        .await;
    wait_until("all 200 are stored", Duration::from_secs(30), || async {
        store.count_by_status().await.unwrap().total() == 200
    })
    .await;

    runtime.write("killswitches:\n  - namespace: kill\n");
    wait_until(
        "upkeep removes the stored kill rows",
        Duration::from_secs(30),
        || async { store.count_by_status().await.unwrap().total() == 100 },
    )
    .await;
    for id in &kill_before {
        assert!(store.get(id).await.unwrap().is_none(), "{id} removed");
    }
    for id in &keep_before {
        assert!(store.get(id).await.unwrap().is_some(), "{id} kept");
    }
    let removed = metrics
        .upkeep_transitions
        .with_label_values(&["remove_killswitched"])
        .get();
    assert_eq!(removed, 100);

    let (kill_after, keep_after) = (ids("kill", 100..150), ids("keep", 100..150));
    kafka
        .produce("tasks", &encoded_tasks(&kill_after, "kill", 60))
        .await;
    kafka
        .produce("tasks", &encoded_tasks(&keep_after, "keep", 60))
        .await;
    let records = |result: &str| {
        metrics
            .consumer_records
            .with_label_values(&["tasks", result])
            .get()
    };
    wait_until(
        "new kill records are dropped at ingest and keep ones stored",
        Duration::from_secs(30),
        || async { records("killswitched") == 50 && records("stored") == 250 },
    )
    .await;

    // Every keep task, and nothing else, reaches a worker.
    let pulled = pull_all(&broker).await;
    let keep: BTreeSet<String> = keep_before.into_iter().chain(keep_after).collect();
    assert_eq!(pulled, keep);
    assert_eq!(
        metrics
            .upkeep_transitions
            .with_label_values(&["remove_killswitched"])
            .get(),
        100,
        "nothing else was removed"
    );
    assert_eq!(
        metrics
            .runtime_rules
            .with_label_values(&["killswitches"])
            .get(),
        1
    );
    broker.stop().await;
}

/// Push mode: while `held` is paused its tasks stay Pending and the other
/// namespace's are pushed; once the pause is removed they are pushed too.
async fn a_paused_namespace_holds_its_tasks_until_resumed(backend: Backend) {
    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 2);
    let runtime = RuntimeDir::new();
    runtime.write("paused:\n  - application: app\n    namespace: held\n");
    let worker = FakeWorker::start(Mode::accept()).await;
    let metrics = Arc::new(Metrics::new());
    let broker = start(
        &db,
        &store,
        &kafka,
        &runtime,
        &[("WORKER_ENDPOINTS", format!("*={}", worker.url()))],
        &metrics,
    );
    let (held, free) = (ids("held", 0..50), ids("free", 0..50));
    kafka
        .produce("tasks", &encoded_tasks(&held, "held", 60))
        .await;
    kafka
        .produce("tasks", &encoded_tasks(&free, "free", 60))
        .await;
    let pushed = || worker.seen.accepted().into_iter().collect::<BTreeSet<_>>();
    wait_until(
        "every free task is pushed",
        Duration::from_secs(30),
        || async { pushed().len() >= free.len() },
    )
    .await;
    // Every row is stored; the held ones are still Pending after fetchers
    // have been through the table many times over (each push woke them).
    wait_until("all 100 are stored", Duration::from_secs(30), || async {
        metrics.consumed("stored") == 100
    })
    .await;
    let claims_before = metrics.store_calls("claim_for_push");
    wait_until(
        "fetchers claim again after every row is stored",
        Duration::from_secs(30),
        || async { metrics.store_calls("claim_for_push") > claims_before + 10 },
    )
    .await;
    assert_eq!(pushed(), free.iter().cloned().collect::<BTreeSet<_>>());
    for id in &held {
        let row = store.get(id).await.unwrap().expect("held row stored");
        assert_eq!(row.status, taskbroker::model::ActivationStatus::Pending);
    }

    runtime.write("paused: []\n");
    wait_until(
        "held tasks are pushed once resumed",
        Duration::from_secs(30),
        || async { pushed().len() == held.len() + free.len() },
    )
    .await;
    let expected: BTreeSet<String> = held.iter().chain(&free).cloned().collect();
    assert_eq!(pushed(), expected);
    assert_eq!(worker.seen.accepted().len(), expected.len(), "none twice");
    assert_eq!(
        metrics.runtime_rules.with_label_values(&["paused"]).get(),
        0
    );
    broker.stop().await;
}

/// Pull mode: `slow` and `fast` tasks are stored; `slow` is demoted; upkeep
/// forwards the stored `slow` rows to `tasks-long` (the default demoted
/// topic) and the consumer forwards new `slow` records there at ingest.
/// Each `slow` task reaches the demoted topic exactly once with its bytes
/// unchanged, none is delivered here, and every `fast` one is.
async fn a_demoted_namespace_reaches_the_demoted_topic_once_stored_or_arriving(backend: Backend) {
    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 2);
    kafka.create_topic("tasks-long", 2);
    let runtime = RuntimeDir::new();
    runtime.write("");
    let metrics = Arc::new(Metrics::new());
    let broker = start(
        &db,
        &store,
        &kafka,
        &runtime,
        &[("DELIVERY_MODE", "pull".to_owned())],
        &metrics,
    );
    let (slow_before, fast_before) = (ids("slow", 0..40), ids("fast", 0..40));
    let mut encoded: HashMap<String, Vec<u8>> = HashMap::new();
    for (ids, namespace) in [(&slow_before, "slow"), (&fast_before, "fast")] {
        let payloads = encoded_tasks(ids, namespace, 60);
        encoded.extend(ids.iter().cloned().zip(payloads.iter().cloned()));
        kafka.produce("tasks", &payloads).await;
    }
    wait_until("all 80 are stored", Duration::from_secs(30), || async {
        store.count_by_status().await.unwrap().total() == 80
    })
    .await;

    runtime.write("demoted_namespaces: [slow]\n");
    wait_until(
        "upkeep forwards the stored slow rows",
        Duration::from_secs(30),
        || async { store.count_by_status().await.unwrap().total() == 40 },
    )
    .await;
    assert_eq!(kafka.end_offsets("tasks-long", 2).iter().sum::<i64>(), 40);

    let (slow_after, fast_after) = (ids("slow", 40..60), ids("fast", 40..60));
    for (ids, namespace) in [(&slow_after, "slow"), (&fast_after, "fast")] {
        let payloads = encoded_tasks(ids, namespace, 60);
        encoded.extend(ids.iter().cloned().zip(payloads.iter().cloned()));
        kafka.produce("tasks", &payloads).await;
    }
    let records = |result: &str| {
        metrics
            .consumer_records
            .with_label_values(&["tasks", result])
            .get()
    };
    wait_until(
        "new slow records are forwarded at ingest, fast ones stored",
        Duration::from_secs(30),
        || async { records("demoted") == 20 && records("stored") == 100 },
    )
    .await;

    // Exactly once each, keyed by id, bytes unchanged.
    let forwarded = kafka.read_all("tasks-long", 2);
    assert_eq!(forwarded.len(), 60);
    let mut seen = BTreeSet::new();
    for record in &forwarded {
        let key = String::from_utf8(rdkafka::Message::key(record).unwrap().to_vec()).unwrap();
        assert!(seen.insert(key.clone()), "{key} forwarded twice");
        assert_eq!(
            common::kafka::payload(record),
            encoded[&key],
            "{key} unchanged"
        );
    }
    let slow: BTreeSet<String> = slow_before.into_iter().chain(slow_after).collect();
    assert_eq!(seen, slow);
    assert_eq!(
        metrics
            .upkeep_transitions
            .with_label_values(&["forward_demoted"])
            .get(),
        40
    );

    let pulled = pull_all(&broker).await;
    let fast: BTreeSet<String> = fast_before.into_iter().chain(fast_after).collect();
    assert_eq!(pulled, fast);
    broker.stop().await;
}

/// `concurrency_limits: {capped: 3}` with two brokers sharing PostgreSQL
/// and consuming one topic: however the claims interleave, the table never
/// holds more than 3 `capped` tasks Claimed or Processing, the limit is
/// used, and every task of both namespaces completes.
#[actix_rt::test]
async fn a_concurrency_limit_holds_across_two_brokers_sharing_postgres() {
    const PER_NAMESPACE: usize = 40;
    const LIMIT: u64 = 3;
    let db = TestStore::new(Backend::Postgres).await;
    let store = db.store().await;
    // A store (and so a broker id) of its own for each broker.
    let stores = [db.store().await, db.store().await];
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 2);
    let runtime = RuntimeDir::new();
    runtime.write(&format!("concurrency_limits:\n  capped: {LIMIT}\n"));
    let worker = FakeWorker::start(Mode::accept()).await;
    let brokers: Vec<Broker> = stores
        .iter()
        .map(|store| {
            let endpoints = format!("*={}", worker.url());
            let metrics = Arc::new(Metrics::new());
            start(
                &db,
                store,
                &kafka,
                &runtime,
                &[("WORKER_ENDPOINTS", endpoints)],
                &metrics,
            )
        })
        .collect();
    let (capped, free) = (
        ids("capped", 0..PER_NAMESPACE),
        ids("free", 0..PER_NAMESPACE),
    );
    kafka
        .produce("tasks", &encoded_tasks(&capped, "capped", 60))
        .await;
    kafka
        .produce("tasks", &encoded_tasks(&free, "free", 60))
        .await;

    let mut clients = Vec::new();
    for broker in &brokers {
        clients.push(
            ConsumerServiceClient::connect(format!("http://{}", broker.grpc_addr))
                .await
                .unwrap(),
        );
    }
    let in_flight = |counts: &[taskbroker::model::NamespaceCount]| -> u64 {
        counts
            .iter()
            .filter(|count| count.namespace == "capped")
            .filter(|count| {
                matches!(
                    count.status,
                    taskbroker::model::ActivationStatus::Claimed
                        | taskbroker::model::ActivationStatus::Processing
                )
            })
            .map(|count| count.count)
            .sum()
    };
    // Every delivery is reported, as a worker does: a push the broker gave
    // up on (its answer came after PUSH_TIMEOUT_MS on a loaded machine) is
    // released and pushed again, and a report of the first delivery that
    // arrives while the row is Pending again does not end it.
    let mut reported = BTreeSet::new();
    let mut to_report: VecDeque<String> = VecDeque::new();
    let mut deliveries_seen = 0;
    let mut most = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let counts = store.count_by_namespace().await.unwrap();
        if counts.is_empty() && reported.len() == 2 * PER_NAMESPACE {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "reported {} of {}; the table: {counts:?}",
            reported.len(),
            2 * PER_NAMESPACE
        );
        let now_in_flight = in_flight(&counts);
        assert!(
            now_in_flight <= LIMIT,
            "{now_in_flight} capped tasks in flight, limit {LIMIT}"
        );
        most = most.max(now_in_flight);
        // Report what the worker accepted since, alternating brokers.
        let accepted = worker.seen.accepted();
        to_report.extend(accepted[deliveries_seen..].iter().cloned());
        deliveries_seen = accepted.len();
        for index in 0..to_report.len() {
            let id = to_report.pop_front().expect("counted");
            let client = &mut clients[index % 2];
            if client
                .set_task_status(taskbroker::proto::SetTaskStatusRequest {
                    id: id.clone(),
                    status: taskbroker::proto::TaskActivationStatus::Complete as i32,
                    ..Default::default()
                })
                .await
                .is_ok()
            {
                reported.insert(id);
            } else {
                to_report.push_back(id);
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(most, LIMIT, "the limit was reached, so it was what held");
    let all: BTreeSet<String> = capped.iter().chain(&free).cloned().collect();
    assert_eq!(reported, all);
    for broker in brokers {
        broker.stop().await;
    }
}

/// A bad version is refused, counted once and leaves the rules as they
/// were; a good one replaces them; a file that disappears is refused once.
#[test]
fn bad_versions_of_the_runtime_file_keep_the_last_good_rules() {
    let runtime = RuntimeDir::new();
    runtime.write("killswitches:\n  - taskname: poison\n");
    let metrics = Arc::new(Metrics::new());
    let (mut file, rules) =
        open_runtime(&runtime.path(), DeliveryMode::Push, Arc::clone(&metrics)).unwrap();
    assert!(rules.current().killed("any", "poison"));
    assert!(metrics.runtime_config_loaded.get() > 0);

    runtime.write("killswitches:\n  - {}\n");
    file.check();
    file.check();
    assert_eq!(metrics.runtime_config_errors.get(), 1, "refused once");
    assert!(
        rules.current().killed("any", "poison"),
        "the previous rules stay"
    );

    runtime.write("killswitches:\n  - taskname: other\n");
    file.check();
    assert!(!rules.current().killed("any", "poison"));
    assert!(rules.current().killed("any", "other"));
    assert_eq!(metrics.runtime_config_errors.get(), 1);

    std::fs::remove_file(runtime.path()).unwrap();
    file.check();
    file.check();
    assert_eq!(
        metrics.runtime_config_errors.get(),
        2,
        "a missing file refused once"
    );
    assert!(
        rules.current().killed("any", "other"),
        "the previous rules stay"
    );
    assert_eq!(
        metrics
            .runtime_rules
            .with_label_values(&["killswitches"])
            .get(),
        1
    );
}

/// At startup there is nothing to keep: a bad file stops the broker with a
/// message naming the variable, the file and the problem.
#[test]
fn a_bad_runtime_file_at_startup_is_refused_with_the_reason() {
    let runtime = RuntimeDir::new();
    runtime.write("paused:\n  - aplication: billing\n");
    let err = open_runtime(
        &runtime.path(),
        DeliveryMode::Push,
        Arc::new(Metrics::new()),
    )
    .err()
    .expect("refused");
    assert!(err.starts_with("TASKBROKER_RUNTIME_CONFIG: "), "{err}");
    assert!(err.contains("runtime.yaml"), "{err}");
    assert!(err.contains("unknown field `aplication`"), "{err}");

    // Concurrency limits are enforced by push claims only.
    runtime.write("concurrency_limits: {reports: 2}\n");
    let err = open_runtime(
        &runtime.path(),
        DeliveryMode::Pull,
        Arc::new(Metrics::new()),
    )
    .err()
    .expect("refused in pull mode");
    assert!(err.contains("push delivery only"), "{err}");

    let missing = runtime.dir.join("absent.yaml");
    let err = open_runtime(&missing, DeliveryMode::Push, Arc::new(Metrics::new()))
        .err()
        .expect("refused");
    assert!(err.contains("cannot read"), "{err}");
}

/// Fair dispatch through the StoreActor, weighted by the runtime file: a
/// flood stored first and two smaller namespaces share each claim by
/// weight; a new version of the file changes the shares at the next claim;
/// a fetcher that asks for oldest first (FAIR_DISPATCH=false) gets the
/// flood only.
async fn weights_in_the_runtime_file_steer_push_claims(backend: Backend) {
    use taskbroker::actors::StoreHandle;
    use taskbroker::model::BucketRange;

    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let base = chrono::Utc::now();
    let mut rows = Vec::new();
    for (namespace, count) in [("flood", 100), ("small", 5), ("heavy", 20)] {
        for i in 0..count {
            let mut row = common::row(&format!("{namespace}-{i}"));
            row.namespace = namespace.to_owned();
            row.added_at = base + chrono::TimeDelta::microseconds(rows.len() as i64);
            rows.push(row);
        }
    }
    common::insert(store.as_ref(), &rows).await;
    let runtime = RuntimeDir::new();
    runtime.write("weights: {heavy: 3}\n");
    let metrics = Arc::new(Metrics::new());
    let (mut file, rules) =
        open_runtime(&runtime.path(), DeliveryMode::Push, Arc::clone(&metrics)).unwrap();
    let actor = StoreHandle::start_with_rules(Arc::clone(&store), metrics, rules)
        .expect("store threads start");
    let claim = |fair: bool| {
        let actor = actor.clone();
        async move {
            let claimed = actor
                .claim(BucketRange::ALL, 10, Duration::from_secs(60), fair)
                .await
                .unwrap();
            let tokens = claimed.iter().map(|c| c.token.clone()).collect();
            actor.release(tokens).await.unwrap();
            let mut counts = std::collections::BTreeMap::new();
            for claim in &claimed {
                *counts
                    .entry(claim.activation.namespace.clone())
                    .or_insert(0) += 1;
            }
            counts.into_iter().collect::<Vec<(String, usize)>>()
        }
    };
    let named = |counts: &[(&str, usize)]| -> Vec<(String, usize)> {
        counts.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect()
    };
    // heavy weighs 3 of 5: 6 of 10 places, the others 2 each.
    assert_eq!(
        claim(true).await,
        named(&[("flood", 2), ("heavy", 6), ("small", 2)]),
        "{backend:?}"
    );
    // small weighs 3 now: its share (6) is more than its 5 tasks; the
    // place left over goes to the oldest task, the flood's.
    runtime.write("weights: {small: 3}\n");
    file.check();
    assert_eq!(
        claim(true).await,
        named(&[("flood", 3), ("heavy", 2), ("small", 5)])
    );
    assert_eq!(claim(false).await, named(&[("flood", 10)]));
}
