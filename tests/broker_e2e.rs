//! The whole broker (Broker::start, as `taskbroker run` starts it) against
//! the mock Kafka cluster, real PostgreSQL or SQLite and real workers on loopback:
//! every activation handed out once, completed, and gone after upkeep; the
//! metrics endpoint shows it.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use common::kafka::MockKafka;
use common::process::encoded_tasks;
use common::worker::{FakeWorker, Mode};
use common::{Backend, TestStore, http_get, wait_until};
use taskbroker::broker::Broker;
use taskbroker::config::Config;
use taskbroker::metrics::Metrics;
use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
use taskbroker::proto::{
    FetchNextTask, GetTaskRequest, SetBatchActivationStatusRequest, SetTaskStatusRequest,
    TaskActivation, TaskActivationStatus,
};

const TASKS: usize = 2_000;

fn config(kafka: &MockKafka, db: &TestStore, extra: &[(&str, String)]) -> Config {
    let mut env: HashMap<String, String> = [
        db.env(),
        ("KAFKA_BROKERS", kafka.bootstrap()),
        ("KAFKA_TOPIC", "tasks".to_owned()),
        ("GRPC_ADDR", "127.0.0.1:0".to_owned()),
        ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
        ("UPKEEP_INTERVAL_MS", "100".to_owned()),
        ("RESTART_GRACE_SEC", "0".to_owned()),
        ("FETCH_ACTORS", "2".to_owned()),
    ]
    .into_iter()
    .map(|(name, value)| (format!("TASKBROKER_{name}"), value))
    .collect();
    for (name, value) in extra {
        env.insert(format!("TASKBROKER_{name}"), value.clone());
    }
    Config::from_lookup(|name| env.get(name).cloned()).expect("test configuration")
}

async fn produce_tasks(kafka: &MockKafka) -> HashSet<String> {
    let ids: Vec<String> = (0..TASKS).map(|i| format!("e2e-{i}")).collect();
    let payloads = encoded_tasks(&ids, "e2e", 60);
    kafka.produce("tasks", &payloads).await;
    ids.into_iter().collect()
}

async fn scrape(broker: &Broker) -> String {
    let (status, body) = http_get(broker.metrics_addr, "/metrics").await;
    assert_eq!(status, 200);
    body
}

fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|line| line.starts_with(series) && line[series.len()..].starts_with(' '))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}

on_both_backends!(
    push_mode_end_to_end_with_workers_reporting_in_batches,
    pull_mode_end_to_end_with_ten_workers_fetching_next,
);

async fn push_mode_end_to_end_with_workers_reporting_in_batches(backend: Backend) {
    let db = TestStore::new(backend).await;
    let store = db.store().await; // migrated, and for inspecting rows
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 4);
    let workers = [
        FakeWorker::start(Mode::accept()).await,
        FakeWorker::start(Mode::accept()).await,
    ];
    let endpoints = format!(
        "*={}",
        workers
            .iter()
            .map(|w| w.url())
            .collect::<Vec<_>>()
            .join("|")
    );
    let config = config(&kafka, &db, &[("WORKER_ENDPOINTS", endpoints)]);
    let metrics = Arc::new(Metrics::new());
    let broker = Broker::start(&config, store.clone(), Arc::clone(&metrics), "test-host")
        .expect("broker starts");
    let ids = produce_tasks(&kafka).await;

    // The workers' reporting side: every accepted task reported COMPLETE
    // through SetBatchActivationStatus, in batches.
    let mut client = ConsumerServiceClient::connect(format!("http://{}", broker.grpc_addr))
        .await
        .unwrap();
    let mut reported: HashSet<String> = HashSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while reported.len() < TASKS {
        assert!(
            tokio::time::Instant::now() < deadline,
            "reported {} of {TASKS}",
            reported.len()
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
            // Like worker runtimes, re-send a report the broker could not
            // take (e.g. UNAVAILABLE while the machine is loaded).
            match client
                .set_batch_activation_status(SetBatchActivationStatusRequest { updates })
                .await
            {
                Ok(_) => reported.extend(chunk.iter().cloned()),
                Err(status) => eprintln!("report failed, re-sending: {status}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(reported, ids);
    let delivered: usize = workers.iter().map(|w| w.seen.accepted().len()).sum();
    assert_eq!(delivered, TASKS, "none pushed twice");
    wait_until(
        "upkeep empties the table",
        Duration::from_secs(30),
        || async { store.count_by_status().await.unwrap().total() == 0 },
    )
    .await;

    let text = scrape(&broker).await;
    // Each accepted push is counted once: ok, or stale when the worker's
    // report finished the task before the push's own write.
    let accepted = sample(&text, "taskbroker_pushes_total{result=\"ok\"}").unwrap_or(0.0)
        + sample(&text, "taskbroker_pushes_total{result=\"stale\"}").unwrap_or(0.0);
    assert_eq!(accepted, TASKS as f64);
    assert_eq!(
        sample(
            &text,
            "taskbroker_consumer_records_total{result=\"stored\",topic=\"tasks\"}"
        ),
        Some(TASKS as f64)
    );
    assert!(sample(&text, "taskbroker_upkeep_cycles_total").unwrap_or(0.0) >= 1.0);
    assert!(text.contains("taskbroker_build_info{version="));
    broker.stop().await;
}

async fn pull_mode_end_to_end_with_ten_workers_fetching_next(backend: Backend) {
    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 4);
    let config = config(&kafka, &db, &[("DELIVERY_MODE", "pull".to_owned())]);
    let broker = Broker::start(
        &config,
        store.clone(),
        Arc::new(Metrics::new()),
        "test-host",
    )
    .expect("broker starts");
    let ids = produce_tasks(&kafka).await;
    let url = format!("http://{}", broker.grpc_addr);

    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut workers = Vec::new();
    for _ in 0..10 {
        let (url, done) = (url.clone(), Arc::clone(&done));
        workers.push(tokio::spawn(async move {
            let mut client = ConsumerServiceClient::connect(url).await.unwrap();
            let mut handled = Vec::new();
            let mut next: Option<TaskActivation> = None;
            loop {
                let task = match next.take() {
                    Some(task) => task,
                    None => match client.get_task(GetTaskRequest::default()).await {
                        Ok(response) => response.into_inner().task.expect("task"),
                        Err(status) if status.code() == tonic::Code::NotFound => {
                            // Every task handled (by someone): stop.
                            let all = done.load(std::sync::atomic::Ordering::SeqCst);
                            if all >= TASKS || tokio::time::Instant::now() > deadline {
                                return handled;
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                        Err(status) => panic!("GetTask failed: {status}"),
                    },
                };
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                handled.push(task.id.clone());
                let response = client
                    .set_task_status(SetTaskStatusRequest {
                        id: task.id,
                        status: TaskActivationStatus::Complete as i32,
                        fetch_next_task: Some(FetchNextTask::default()),
                        ..Default::default()
                    })
                    .await
                    .expect("report");
                next = response.into_inner().task;
            }
        }));
    }
    let mut handled = Vec::new();
    for worker in workers {
        handled.extend(worker.await.unwrap());
    }
    let distinct: HashSet<String> = handled.iter().cloned().collect();
    assert_eq!(handled.len(), TASKS, "each task handed out exactly once");
    assert_eq!(distinct, ids);
    wait_until(
        "upkeep empties the table",
        Duration::from_secs(30),
        || async { store.count_by_status().await.unwrap().total() == 0 },
    )
    .await;
    broker.stop().await;
}

/// Replicas share the table: a row another replica stored (here, another
/// store on the same database) wakes this broker's idle fetchers through
/// PostgreSQL's LISTEN/NOTIFY, so it is pushed at once, not at the next
/// poll (a minute away in this test).
#[actix_rt::test]
async fn a_row_a_peer_stores_wakes_idle_fetchers_at_once() {
    let db = TestStore::new(Backend::Postgres).await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 1);
    let worker = FakeWorker::start(Mode::accept()).await;
    let config = config(
        &kafka,
        &db,
        &[
            ("WORKER_ENDPOINTS", format!("*={}", worker.url())),
            ("FETCH_BACKOFF_MS", "60000".to_owned()),
            ("UPKEEP_INTERVAL_MS", "60000".to_owned()),
        ],
    );
    let broker = Broker::start(
        &config,
        db.store().await,
        Arc::new(Metrics::new()),
        "test-host",
    )
    .expect("broker starts");
    // Once both fetchers have found nothing, they wait out their backoff.
    let metrics_idle = || async {
        let text = scrape(&broker).await;
        sample(
            &text,
            "taskbroker_store_operation_duration_seconds_count{operation=\"claim_for_push\"}",
        )
        .is_some_and(|claims| claims >= 2.0)
    };
    wait_until(
        "both fetchers went idle",
        Duration::from_secs(20),
        metrics_idle,
    )
    .await;

    let peer = db.store().await;
    common::insert(peer.as_ref(), &common::rows("peer", 3)).await;
    wait_until(
        "the peer's rows are pushed",
        Duration::from_secs(20),
        || {
            let pushed = worker.seen.accepted().len();
            async move { pushed == 3 }
        },
    )
    .await;
    broker.stop().await;
}
