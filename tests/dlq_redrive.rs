//! `taskbroker dlq`, the real binary, against dead letters the broker
//! itself wrote: tasks a worker fails are dead-lettered by upkeep;
//! `dlq redrive` republishes them to the main topic as new tasks, which the
//! broker stores and a worker completes; a second redrive of the same
//! filters republishes nothing. PostgreSQL or SQLite, the mock Kafka
//! cluster, a pulling worker on loopback.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::kafka::MockKafka;
use common::{Backend, TestStore, wait_until};
use prost::Message;
use taskbroker::broker::Broker;
use taskbroker::config::Config;
use taskbroker::metrics::Metrics;
use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
use taskbroker::proto::{
    GetTaskRequest, OnAttemptsExceeded, RetryState, SetTaskStatusRequest, TaskActivation,
    TaskActivationStatus,
};

const TASKS: usize = 30;

fn kafka_env(kafka: &MockKafka) -> Vec<(&'static str, String)> {
    vec![
        ("KAFKA_BROKERS", kafka.bootstrap()),
        ("KAFKA_TOPIC", "tasks".to_owned()),
        ("KAFKA_DLQ_TOPIC", "dead".to_owned()),
    ]
}

fn config(db: &TestStore, kafka: &MockKafka) -> Config {
    let env: HashMap<String, String> = [
        db.env(),
        ("GRPC_ADDR", "127.0.0.1:0".to_owned()),
        ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
        ("UPKEEP_INTERVAL_MS", "100".to_owned()),
        ("RESTART_GRACE_SEC", "0".to_owned()),
        ("DELIVERY_MODE", "pull".to_owned()),
    ]
    .into_iter()
    .chain(kafka_env(kafka))
    .map(|(name, value)| (format!("TASKBROKER_{name}"), value))
    .collect();
    Config::from_lookup(|name| env.get(name).cloned()).expect("test configuration")
}

/// `taskbroker dlq <args>` against the mock cluster; its stdout.
fn dlq(kafka: &MockKafka, args: &[&str]) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_taskbroker"));
    command.arg("dlq").args(args);
    for (name, value) in kafka_env(kafka) {
        command.env(format!("TASKBROKER_{name}"), value);
    }
    let output = command
        .env_remove("TASKBROKER_WORKER_ENDPOINTS")
        .output()
        .expect("run taskbroker dlq");
    assert!(
        output.status.success(),
        "dlq {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

fn doomed(i: usize) -> Vec<u8> {
    TaskActivation {
        id: format!("doomed-{i}"),
        namespace: "doomed".to_owned(),
        taskname: "tests.doomed".to_owned(),
        received_at: Some(prost_types::Timestamp {
            seconds: chrono::Utc::now().timestamp(),
            nanos: 0,
        }),
        processing_deadline_duration: 60,
        application: Some("app".to_owned()),
        retry_state: Some(RetryState {
            attempts: 0,
            max_attempts: 1,
            on_attempts_exceeded: OnAttemptsExceeded::Deadletter as i32,
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Pulls every task there is and reports `status` for each; answers them.
async fn pull_and_report(
    client: &mut ConsumerServiceClient<tonic::transport::Channel>,
    want: usize,
    status: TaskActivationStatus,
) -> Vec<TaskActivation> {
    let mut pulled = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while pulled.len() < want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "pulled {} of {want}",
            pulled.len()
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
                status: status as i32,
                ..Default::default()
            })
            .await
            .expect("report");
        pulled.push(task);
    }
    pulled
}

on_both_backends!(dead_letters_redriven_run_to_completion_and_a_second_redrive_republishes_nothing);

async fn dead_letters_redriven_run_to_completion_and_a_second_redrive_republishes_nothing(
    backend: Backend,
) {
    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 2);
    kafka.create_topic("dead", 1);
    let broker = Broker::start(
        &config(&db, &kafka),
        store.clone(),
        Arc::new(Metrics::new()),
        "test-host",
    )
    .expect("broker starts");
    let mut client = ConsumerServiceClient::connect(format!("http://{}", broker.grpc_addr))
        .await
        .unwrap();

    // A worker fails every task; upkeep dead-letters them.
    let payloads: Vec<Vec<u8>> = (0..TASKS).map(doomed).collect();
    kafka.produce("tasks", &payloads).await;
    pull_and_report(&mut client, TASKS, TaskActivationStatus::Failure).await;
    wait_until(
        "every task is dead-lettered",
        Duration::from_secs(30),
        || async {
            kafka.end_offsets("dead", 1)[0] == TASKS as i64
                && store.count_by_status().await.unwrap().total() == 0
        },
    )
    .await;

    let listed = dlq(&kafka, &["list", "--json", "--namespace", "doomed"]);
    assert_eq!(listed.lines().count(), TASKS, "{listed}");
    let other = dlq(&kafka, &["redrive", "--dry-run", "--namespace", "other"]);
    assert!(other.contains(&format!("0 of {TASKS}")), "{other}");
    assert_eq!(
        kafka.end_offsets("tasks", 2).iter().sum::<i64>(),
        TASKS as i64
    );

    // Redrive: new tasks on the main topic, run to completion.
    let out = dlq(&kafka, &["redrive", "--namespace", "doomed"]);
    assert!(
        out.contains(&format!("redrove {TASKS} of {TASKS}")),
        "{out}"
    );
    let redriven = pull_and_report(&mut client, TASKS, TaskActivationStatus::Complete).await;
    let originals: BTreeSet<String> = (0..TASKS).map(|i| format!("doomed-{i}")).collect();
    let from: BTreeSet<String> = redriven
        .iter()
        .map(|task| task.headers["taskbroker-redriven-id"].clone())
        .collect();
    assert_eq!(from, originals, "each dead letter redriven once");
    for task in &redriven {
        assert!(!originals.contains(&task.id), "a fresh id");
        assert!(task.headers["taskbroker-redriven-from"].starts_with("dead/0/"));
        assert_eq!(task.retry_state.as_ref().unwrap().attempts, 0);
    }
    wait_until(
        "the redriven tasks complete",
        Duration::from_secs(30),
        || async { store.count_by_status().await.unwrap().total() == 0 },
    )
    .await;

    // The same redrive again: nothing left to republish.
    let again = dlq(&kafka, &["redrive", "--namespace", "doomed"]);
    assert!(again.contains("redrove 0 of 0"), "{again}");
    assert_eq!(
        kafka.end_offsets("tasks", 2).iter().sum::<i64>(),
        2 * TASKS as i64,
        "nothing republished twice"
    );
    assert_eq!(
        kafka.end_offsets("dead", 1)[0],
        TASKS as i64,
        "no new dead letters"
    );
    broker.stop().await;
}
