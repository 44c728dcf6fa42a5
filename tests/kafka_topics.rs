//! Several consumed topics on several clusters, and raw-mode topics, through
//! the whole broker (Broker::start) against two mock Kafka clusters (one per
//! "cluster"), PostgreSQL or SQLite, and workers on loopback.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::kafka::MockKafka;
use common::process::encoded_tasks;
use common::worker::{FakeWorker, Mode};
use common::{Backend, TestStore, wait_until};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::util::Timeout;
use taskbroker::broker::Broker;
use taskbroker::config::Config;
use taskbroker::kafka::raw::{msgpack_args, raw_task_id};
use taskbroker::metrics::Metrics;
use taskbroker::model::KafkaPosition;
use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
use taskbroker::proto::worker_service_server::{WorkerService, WorkerServiceServer};
use taskbroker::proto::{
    GetTaskRequest, PushTaskRequest, PushTaskResponse, SetBatchActivationStatusRequest,
    SetTaskStatusRequest, TaskActivation, TaskActivationStatus,
};
use taskbroker::store::ActivationStore;

fn config(db: &TestStore, settings: &[(&str, String)]) -> Config {
    let mut env: HashMap<String, String> = [
        db.env(),
        ("GRPC_ADDR", "127.0.0.1:0".to_owned()),
        ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
        ("UPKEEP_INTERVAL_MS", "100".to_owned()),
        ("RESTART_GRACE_SEC", "0".to_owned()),
        ("DELIVERY_MODE", "pull".to_owned()),
    ]
    .into_iter()
    .map(|(name, value)| (format!("TASKBROKER_{name}"), value))
    .collect();
    for (name, value) in settings {
        env.insert(format!("TASKBROKER_{name}"), value.clone());
    }
    Config::from_lookup(|name| env.get(name).cloned()).expect("test configuration")
}

/// Rows in the store consumed from `topic`, in flight.
async fn inflight_of(store: &Arc<dyn ActivationStore>, topic: &str) -> u64 {
    store
        .count_inflight_by_topic()
        .await
        .expect("count by topic")
        .into_iter()
        .find(|(t, _)| t == topic)
        .map_or(0, |(_, count)| count)
}

on_both_backends!(
    two_topics_on_two_clusters_flow_while_one_is_paused_by_its_own_backpressure,
    a_raw_record_reaches_a_pushed_worker_with_its_exact_bytes,
    a_raw_record_reaches_a_pulling_worker_and_a_replay_is_stored_once,
    push_mode_end_to_end_across_two_clusters_and_a_raw_topic,
);

/// `main` on the default cluster fills its share of the store
/// (MAX_INFLIGHT) and pauses; `side` on the `east` cluster keeps flowing;
/// once workers drain `main` it resumes, and every task of both arrives.
async fn two_topics_on_two_clusters_flow_while_one_is_paused_by_its_own_backpressure(
    backend: Backend,
) {
    const MAIN: usize = 300;
    const SIDE: usize = 60;
    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let (default, east) = (MockKafka::start(), MockKafka::start());
    default.create_topic("main", 2);
    east.create_topic("side", 2);
    let config = config(
        &db,
        &[
            ("KAFKA_BROKERS", default.bootstrap()),
            ("KAFKA_CLUSTERS", format!("east={}", east.bootstrap())),
            ("KAFKA_TOPICS", "main,side@east".to_owned()),
            ("MAX_INFLIGHT", "100".to_owned()),
            ("INSERT_BATCH_SIZE", "20".to_owned()),
        ],
    );
    let metrics = Arc::new(Metrics::new());
    let broker = Broker::start(&config, store.clone(), Arc::clone(&metrics), "test-host")
        .expect("broker starts");
    let main_ids: Vec<String> = (0..MAIN).map(|i| format!("main-{i}")).collect();
    default
        .produce("main", &encoded_tasks(&main_ids, "main", 60))
        .await;
    let paused = || metrics.partitions_paused.with_label_values(&["main"]).get();
    wait_until(
        "main's consumer pauses",
        Duration::from_secs(30),
        || async { paused() > 0 },
    )
    .await;
    let main_stored = inflight_of(&store, "main").await;
    assert!(
        (100..=120).contains(&main_stored),
        "main holds MAX_INFLIGHT plus at most one batch, not {main_stored}"
    );

    let side_ids: Vec<String> = (0..SIDE).map(|i| format!("side-{i}")).collect();
    east.produce("side", &encoded_tasks(&side_ids, "side", 60))
        .await;
    wait_until(
        "every side task is stored while main is paused",
        Duration::from_secs(30),
        || async { inflight_of(&store, "side").await == SIDE as u64 },
    )
    .await;
    assert!(paused() > 0, "main stays paused");
    assert_eq!(inflight_of(&store, "main").await, main_stored);
    assert_eq!(
        metrics
            .partitions_paused
            .with_label_values(&["side@east"])
            .get(),
        0,
        "side is never paused"
    );

    // Workers pull and complete everything: main resumes, nothing is lost.
    let mut client = ConsumerServiceClient::connect(format!("http://{}", broker.grpc_addr))
        .await
        .unwrap();
    let mut done = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while done.len() < MAIN + SIDE {
        assert!(
            tokio::time::Instant::now() < deadline,
            "completed {} of {}",
            done.len(),
            MAIN + SIDE
        );
        let Some(task) = client
            .get_task(GetTaskRequest::default())
            .await
            .ok()
            .and_then(|response| response.into_inner().task)
        else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        client
            .set_task_status(SetTaskStatusRequest {
                id: task.id.clone(),
                status: TaskActivationStatus::Complete as i32,
                ..Default::default()
            })
            .await
            .expect("report");
        assert!(done.insert(task.id), "a task delivered twice");
    }
    let expected: BTreeSet<String> = main_ids.into_iter().chain(side_ids).collect();
    assert_eq!(done, expected);
    assert_eq!(metrics.consumed("stored"), (MAIN + SIDE) as u64);
    broker.stop().await;
}

/// Raw payloads with every byte value, one empty, and headers.
fn raw_payloads() -> Vec<Vec<u8>> {
    vec![
        (0..=255u8).collect(),
        b"plain text".to_vec(),
        Vec::new(),
        vec![0xc4; 70_000],
    ]
}

async fn produce_raw(kafka: &MockKafka, topic: &str, payloads: &[Vec<u8>]) {
    let producer = kafka.producer();
    for (i, payload) in payloads.iter().enumerate() {
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "trace-id",
                value: Some(&format!("t{i}")),
            })
            .insert(Header {
                key: "binary",
                value: Some(&[0xffu8, 0xfe][..]),
            });
        producer
            .send(
                FutureRecord::to(topic)
                    .key("k")
                    .payload(payload)
                    .headers(headers),
                Timeout::After(Duration::from_secs(10)),
            )
            .await
            .map_err(|(err, _)| err)
            .expect("produce");
    }
}

/// What the Python worker does with `parameters_bytes` up to msgpack.
fn arguments_of(task: &TaskActivation) -> Vec<u8> {
    assert_eq!(
        task.headers.get("compression-type").map(String::as_str),
        Some("zstd")
    );
    zstd::bulk::decompress(&task.parameters_bytes, 1 << 24).expect("a zstd frame with its size")
}

fn check_raw_task(task: &TaskActivation, payloads: &[Vec<u8>]) -> usize {
    assert_eq!(task.application.as_deref(), Some("app"));
    assert_eq!(task.namespace, "raw");
    assert_eq!(task.taskname, "ingest.event");
    assert_eq!(task.processing_deadline_duration, 45);
    assert!(task.retry_state.is_none());
    assert!(task.headers["trace-id"].starts_with('t'));
    assert!(
        !task.headers.contains_key("binary"),
        "non-UTF-8 headers are left out"
    );
    let index: usize = task.headers["trace-id"][1..].parse().unwrap();
    assert_eq!(arguments_of(task), msgpack_args(&payloads[index]));
    // A single partition: the offset is the index.
    let position = KafkaPosition {
        topic: "events".to_owned(),
        partition: 0,
        offset: index as i64,
    };
    assert_eq!(task.id, raw_task_id("default", &position));
    index
}

fn raw_settings(kafka: &MockKafka, group: &str) -> Vec<(&'static str, String)> {
    vec![
        ("KAFKA_BROKERS", kafka.bootstrap()),
        ("KAFKA_TOPIC", "tasks".to_owned()),
        ("KAFKA_CONSUMER_GROUP", group.to_owned()),
        ("KAFKA_RAW_TOPICS", "events=app/raw/ingest.event".to_owned()),
        ("KAFKA_RAW_DEADLINE_SEC", "45".to_owned()),
    ]
}

/// Records every pushed activation.
#[derive(Default, Clone)]
struct Recorder {
    pushed: Arc<Mutex<Vec<TaskActivation>>>,
}

#[tonic::async_trait]
impl WorkerService for Recorder {
    async fn push_task(
        &self,
        request: tonic::Request<PushTaskRequest>,
    ) -> Result<tonic::Response<PushTaskResponse>, tonic::Status> {
        if let Some(task) = request.into_inner().task {
            self.pushed.lock().unwrap().push(task);
        }
        Ok(tonic::Response::new(PushTaskResponse {}))
    }
}

async fn a_raw_record_reaches_a_pushed_worker_with_its_exact_bytes(backend: Backend) {
    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 1);
    kafka.create_topic("events", 1);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let worker = format!("http://{}", listener.local_addr().unwrap());
    let recorder = Recorder::default();
    let _serving = common::worker::serve_until_dropped(
        tonic::transport::Server::builder().add_service(WorkerServiceServer::new(recorder.clone())),
        listener,
    );
    let mut settings = raw_settings(&kafka, "push");
    settings.push(("DELIVERY_MODE", "push".to_owned()));
    settings.push(("WORKER_ENDPOINTS", format!("*={worker}")));
    let config = config(&db, &settings);
    let metrics = Arc::new(Metrics::new());
    let broker = Broker::start(&config, store.clone(), Arc::clone(&metrics), "test-host")
        .expect("broker starts");
    let payloads = raw_payloads();
    produce_raw(&kafka, "events", &payloads).await;
    wait_until(
        "every raw task is pushed",
        Duration::from_secs(30),
        || async { recorder.pushed.lock().unwrap().len() >= payloads.len() },
    )
    .await;
    let pushed = recorder.pushed.lock().unwrap().clone();
    let seen: BTreeSet<usize> = pushed
        .iter()
        .map(|task| check_raw_task(task, &payloads))
        .collect();
    assert_eq!(seen.len(), payloads.len());
    assert_eq!(
        metrics
            .consumer_records
            .with_label_values(&["events", "stored"])
            .get(),
        payloads.len() as u64
    );
    broker.stop().await;
}

/// A worker pulls raw tasks; a second broker whose consumer group has no
/// committed offsets reads the same records again (as after a crash before
/// the commit) and the store keeps one row per record.
async fn a_raw_record_reaches_a_pulling_worker_and_a_replay_is_stored_once(backend: Backend) {
    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 1);
    kafka.create_topic("events", 1);
    let payloads = raw_payloads();
    produce_raw(&kafka, "events", &payloads).await;

    let first_metrics = Arc::new(Metrics::new());
    let first = Broker::start(
        &config(&db, &raw_settings(&kafka, "first")),
        store.clone(),
        Arc::clone(&first_metrics),
        "test-host",
    )
    .expect("broker starts");
    wait_until(
        "the raw records are stored",
        Duration::from_secs(30),
        || async { inflight_of(&store, "events").await == payloads.len() as u64 },
    )
    .await;
    first.stop().await;

    let second_metrics = Arc::new(Metrics::new());
    let second = Broker::start(
        &config(&db, &raw_settings(&kafka, "second")),
        store.clone(),
        Arc::clone(&second_metrics),
        "test-host",
    )
    .expect("broker starts");
    wait_until("the replay is read", Duration::from_secs(30), || async {
        second_metrics.consumed("duplicate") == payloads.len() as u64
    })
    .await;
    assert_eq!(second_metrics.consumed("stored"), 0);
    assert_eq!(inflight_of(&store, "events").await, payloads.len() as u64);

    let mut client = ConsumerServiceClient::connect(format!("http://{}", second.grpc_addr))
        .await
        .unwrap();
    let mut seen = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while seen.len() < payloads.len() {
        assert!(tokio::time::Instant::now() < deadline, "pulled {seen:?}");
        let task = client
            .get_task(GetTaskRequest::default())
            .await
            .expect("GetTask")
            .into_inner()
            .task;
        let Some(task) = task else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        assert!(
            seen.insert(check_raw_task(&task, &payloads)),
            "pulled twice"
        );
    }
    second.stop().await;
}

/// Push mode over everything at once: `main` on the default cluster,
/// `side` on `east`, and the raw topic `events` on `east`. Two workers
/// accept every push and report COMPLETE in batches, as worker runtimes do;
/// every task of every topic is pushed exactly once, completed, and gone
/// from the table, and each topic's consumer counts its own records.
async fn push_mode_end_to_end_across_two_clusters_and_a_raw_topic(backend: Backend) {
    const MAIN: usize = 400;
    const SIDE: usize = 200;
    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let (default, east) = (MockKafka::start(), MockKafka::start());
    default.create_topic("main", 2);
    east.create_topic("side", 2);
    east.create_topic("events", 1);
    let workers = [
        FakeWorker::start(Mode::accept()).await,
        FakeWorker::start(Mode::accept()).await,
    ];
    let endpoints = format!("*={}|{}", workers[0].url(), workers[1].url());
    let config = config(
        &db,
        &[
            ("DELIVERY_MODE", "push".to_owned()),
            ("WORKER_ENDPOINTS", endpoints),
            ("KAFKA_BROKERS", default.bootstrap()),
            ("KAFKA_CLUSTERS", format!("east={}", east.bootstrap())),
            ("KAFKA_TOPICS", "main,side@east".to_owned()),
            (
                "KAFKA_RAW_TOPICS",
                "events@east=app/raw/ingest.event".to_owned(),
            ),
        ],
    );
    let metrics = Arc::new(Metrics::new());
    let broker = Broker::start(&config, store.clone(), Arc::clone(&metrics), "test-host")
        .expect("broker starts");
    let main_ids: Vec<String> = (0..MAIN).map(|i| format!("main-{i}")).collect();
    let side_ids: Vec<String> = (0..SIDE).map(|i| format!("side-{i}")).collect();
    default
        .produce("main", &encoded_tasks(&main_ids, "main", 60))
        .await;
    east.produce("side", &encoded_tasks(&side_ids, "side", 60))
        .await;
    let payloads = raw_payloads();
    produce_raw(&east, "events", &payloads).await;
    let raw_ids = (0..payloads.len()).map(|offset| {
        raw_task_id(
            "east",
            &KafkaPosition {
                topic: "events".to_owned(),
                partition: 0,
                offset: offset as i64,
            },
        )
    });
    let expected: BTreeSet<String> = main_ids
        .iter()
        .chain(&side_ids)
        .cloned()
        .chain(raw_ids)
        .collect();

    let mut client = ConsumerServiceClient::connect(format!("http://{}", broker.grpc_addr))
        .await
        .unwrap();
    let mut reported = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while reported.len() < expected.len() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "reported {} of {}",
            reported.len(),
            expected.len()
        );
        let accepted: Vec<String> = workers
            .iter()
            .flat_map(|worker| worker.seen.accepted())
            .filter(|id| !reported.contains(id))
            .collect();
        for chunk in accepted.chunks(100) {
            let updates = chunk
                .iter()
                .map(|id| SetTaskStatusRequest {
                    id: id.clone(),
                    status: TaskActivationStatus::Complete as i32,
                    ..Default::default()
                })
                .collect();
            if client
                .set_batch_activation_status(SetBatchActivationStatusRequest { updates })
                .await
                .is_ok()
            {
                reported.extend(chunk.iter().cloned());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(reported, expected);
    let pushed: usize = workers.iter().map(|w| w.seen.accepted().len()).sum();
    assert_eq!(pushed, expected.len(), "none pushed twice");
    wait_until("the table empties", Duration::from_secs(30), || async {
        store.count_by_status().await.unwrap().total() == 0
    })
    .await;
    for (topic, records) in [
        ("main", MAIN),
        ("side@east", SIDE),
        ("events@east", payloads.len()),
    ] {
        assert_eq!(
            metrics
                .consumer_records
                .with_label_values(&[topic, "stored"])
                .get(),
            records as u64,
            "records stored from {topic}"
        );
    }
    broker.stop().await;
}
