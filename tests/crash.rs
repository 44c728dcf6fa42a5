//! The real `taskbroker` binary, killed with SIGKILL in the middle of a run
//! and started again on the same store (SQLite file or PostgreSQL
//! database) under the same `TASKBROKER_BROKER_ID`:
//! nothing is lost, nothing runs twice beyond what at-least-once allows,
//! and every claim the dead process held returns to Pending as soon as the
//! restarted broker joins, long before its lease would have run out.

mod common;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::kafka::MockKafka;
use common::process::{broker_command, encoded_tasks};
use common::worker::{DemoWorker, FakeWorker, Mode};
use common::{Backend, KillOnDrop, TestStore, free_port, http_get};
use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
use taskbroker::proto::{
    SetBatchActivationStatusRequest, SetTaskStatusRequest, TaskActivationStatus,
};

const TASKS: usize = 2_000;
const INSERT_BATCH_SIZE: usize = 100;
/// Far longer than the test runs: a claim that returns to Pending did not
/// return through its lease.
const LEASE_MS: u64 = 600_000;

struct Ports {
    grpc: u16,
    metrics: u16,
}

fn start_broker(db: &TestStore, kafka: &MockKafka, worker: &DemoWorker, ports: &Ports) -> Child {
    crash_broker(db, kafka, worker, ports)
        .spawn()
        .expect("start the broker binary")
}

/// `taskbroker run` set up so a kill always catches claims in flight.
fn crash_broker(db: &TestStore, kafka: &MockKafka, worker: &DemoWorker, ports: &Ports) -> Command {
    let mut command = broker_command(db.env(), kafka, ports.grpc);
    command
        .env("TASKBROKER_WORKER_ENDPOINTS", format!("*={}", worker.url()))
        .env(
            "TASKBROKER_METRICS_ADDR",
            format!("127.0.0.1:{}", ports.metrics),
        )
        // A slow pool behind eager fetchers: claims are always held.
        .env("TASKBROKER_PUSH_CONCURRENCY", "4")
        .env("TASKBROKER_PUSH_QUEUE_SIZE", "8")
        .env("TASKBROKER_FETCH_BATCH_SIZE", "32")
        .env("TASKBROKER_PUSH_QUEUE_TIMEOUT_MS", "200")
        .env("TASKBROKER_PUSH_TIMEOUT_MS", "1000")
        .env("TASKBROKER_CLAIM_LEASE_MS", LEASE_MS.to_string())
        .env(
            "TASKBROKER_INSERT_BATCH_SIZE",
            INSERT_BATCH_SIZE.to_string(),
        )
        .env("TASKBROKER_UPKEEP_INTERVAL_MS", "100")
        .env("TASKBROKER_RESTART_GRACE_SEC", "0")
        // The same id across the restart, as a StatefulSet pod keeps it.
        .env("TASKBROKER_BROKER_ID", "crash-test-broker")
        .stderr(Stdio::piped());
    command
}

/// Waits for the process and returns what it wrote to stderr.
async fn stderr_of(child: Child) -> String {
    let output = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .expect("broker output");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Claimed rows as id → claim_expires_at.
async fn claimed(db: &TestStore) -> HashMap<String, DateTime<Utc>> {
    db.claimed().await.into_iter().collect()
}

async fn count(db: &TestStore, status: &str) -> usize {
    db.rows()
        .await
        .values()
        .filter(|(row_status, _)| row_status == status)
        .count()
}

async fn total(db: &TestStore) -> usize {
    db.rows().await.len()
}

/// The workers' reporting side: every delivery the worker accepted is
/// reported COMPLETE, re-sent until a broker acknowledges it. Returns how
/// many deliveries of each id have been acknowledged.
async fn report_accepted(
    grpc_port: u16,
    worker: &DemoWorker,
    acknowledged: &mut HashMap<String, usize>,
) {
    let Ok(mut client) =
        ConsumerServiceClient::connect(format!("http://127.0.0.1:{grpc_port}")).await
    else {
        return;
    };
    let mut deliveries: HashMap<String, usize> = HashMap::new();
    for id in worker.seen.accepted() {
        *deliveries.entry(id).or_default() += 1;
    }
    let due: Vec<(String, usize)> = deliveries
        .into_iter()
        .filter(|(id, n)| acknowledged.get(id).copied().unwrap_or(0) < *n)
        .collect();
    for chunk in due.chunks(200) {
        let updates = chunk
            .iter()
            .map(|(id, _)| SetTaskStatusRequest {
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
            for (id, n) in chunk {
                acknowledged.insert(id.clone(), *n);
            }
        }
    }
}

on_both_backends!(
    broker_killed_mid_run_loses_nothing_and_its_claims_return_at_restart,
    two_consumers_killed_mid_batch_lose_nothing,
);

async fn broker_killed_mid_run_loses_nothing_and_its_claims_return_at_restart(backend: Backend) {
    let db = TestStore::new(backend).await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 4);
    let worker = FakeWorker::start(Mode::Accept {
        delay: Duration::from_millis(5),
    })
    .await;
    let ids: HashSet<String> = (0..TASKS).map(|i| format!("crash-{i}")).collect();
    let payloads = encoded_tasks(&ids, "crash", 120);
    kafka.produce("tasks", &payloads).await;
    let ports = Ports {
        grpc: free_port(),
        metrics: free_port(),
    };

    // First run: work until a good part is done, reporting as we go.
    let mut leftovers = KillOnDrop::default();
    let mut first = start_broker(&db, &kafka, &worker, &ports);
    leftovers.0.push(first.id());
    let mut acknowledged: HashMap<String, usize> = HashMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while worker.seen.accepted().len() < TASKS / 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "first run made no progress"
        );
        if let Ok(Some(exit)) = first.try_wait() {
            panic!("the broker exited ({exit}):\n{}", stderr_of(first).await);
        }
        report_accepted(ports.grpc, &worker, &mut acknowledged).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill().expect("SIGKILL the broker");
    let first_stderr = stderr_of(first).await;

    // What the dead process left behind, once its last statements landed.
    db.wait_for_dead_broker_backends().await;
    let stranded = claimed(&db).await;
    let processing_at_kill = count(&db, "Processing").await;
    // Records after the committed offsets are read again by the restarted
    // broker; any of them already run may run again.
    let committed_at_kill: i64 = kafka
        .committed("taskbroker", "tasks", 4)
        .iter()
        .map(|offset| (*offset).max(0))
        .sum();
    let uncommitted_at_kill = TASKS - committed_at_kill as usize;
    assert!(
        !stranded.is_empty(),
        "the kill should have caught claims held by fetchers and the pool"
    );

    // Second run on the same file.
    let second = start_broker(&db, &kafka, &worker, &ports);
    leftovers.0.push(second.id());
    // Nothing is reported until the restarted broker has joined: a report
    // would end a stranded claim before the join's release saw it.
    let metrics_addr: std::net::SocketAddr =
        format!("127.0.0.1:{}", ports.metrics).parse().unwrap();
    let released = |reason: &'static str| async move {
        let series = format!("taskbroker_claims_released_total{{reason=\"{reason}\"}} ");
        match tokio::net::TcpStream::connect(metrics_addr).await {
            Err(_) => (0.0, String::new()),
            Ok(_) => {
                let (_, metrics) = http_get(metrics_addr, "/metrics").await;
                let value = metrics
                    .lines()
                    .find_map(|line| line.strip_prefix(series.as_str()))
                    .and_then(|value| value.parse::<f64>().ok())
                    .unwrap_or(0.0);
                (value, metrics)
            }
        }
    };
    common::wait_until(
        "the restarted broker joined and released the claims",
        Duration::from_secs(60),
        || async { released("restart").await.0 > 0.0 },
    )
    .await;
    let mut returned: HashSet<String> = HashSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    loop {
        // Nothing reported on the stranded claims while no broker ran, so
        // each one leaves its claim only through the restarted broker:
        // released when it joined, then claimed and pushed again.
        let rows = db.rows().await;
        for (id, expiry) in &stranded {
            match rows.get(id) {
                Some((status, claim)) if status == "Claimed" && claim.as_ref() == Some(expiry) => {}
                _ => {
                    returned.insert(id.clone());
                }
            }
        }
        report_accepted(ports.grpc, &worker, &mut acknowledged).await;
        let done = ids.iter().all(|id| acknowledged.contains_key(id));
        if done && returned.len() == stranded.len() && total(&db).await == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "after restart: {} of {TASKS} acknowledged, {} of {} stranded claims returned, {} rows left",
            acknowledged.len(),
            returned.len(),
            stranded.len(),
            total(&db).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let earliest_expiry = stranded
        .values()
        .min()
        .copied()
        .expect("claims were stranded");
    assert!(
        Utc::now() < earliest_expiry,
        "the run outlasted the leases: nothing shows the restart released them"
    );

    // The restarted broker released every one of them when it joined, in
    // one statement, and no lease expired.
    let (restart, metrics) = released("restart").await;
    assert_eq!(restart, stranded.len() as f64, "{metrics}");
    assert_eq!(released("lease_expired").await.0, 0.0);

    // Nothing lost: every task ran and was acknowledged. Duplicates only
    // where at-least-once allows: a row Claimed at the kill may already
    // have reached the worker (push done, mark-processing not written), a
    // Processing row's report may not have been acknowledged, and records
    // after the committed offsets are read again.
    let deliveries = worker.seen.accepted();
    let delivered: HashSet<&String> = deliveries.iter().collect();
    assert_eq!(delivered.len(), TASKS, "every task reached the worker");
    let duplicates = deliveries.len() - TASKS;
    let allowed = stranded.len() + processing_at_kill + uncommitted_at_kill;
    assert!(
        duplicates <= allowed,
        "{duplicates} duplicate deliveries; at-least-once allows {allowed}"
    );

    terminate(&second);
    let second_stderr = stderr_of(second).await;
    for (run, stderr) in [("first", &first_stderr), ("second", &second_stderr)] {
        assert!(
            !stderr.contains("panicked"),
            "{run} run panicked:\n{stderr}"
        );
        assert!(
            !stderr.contains("ERROR"),
            "{run} run logged an error:\n{stderr}"
        );
    }
}

/// Two consumers, `tasks` on the default cluster and `side` on a second
/// one, each pausing on its own MAX_INFLIGHT share, killed while both are
/// mid-stream (neither topic fully stored or committed) and started again:
/// every task of both topics reaches the worker and is acknowledged, and
/// the table ends empty.
async fn two_consumers_killed_mid_batch_lose_nothing(backend: Backend) {
    const PER_TOPIC: usize = 800;
    let db = TestStore::new(backend).await;
    let (default, east) = (MockKafka::start(), MockKafka::start());
    default.create_topic("tasks", 2);
    east.create_topic("side", 2);
    let worker = FakeWorker::start(Mode::Accept {
        delay: Duration::from_millis(5),
    })
    .await;
    let task_ids: HashSet<String> = (0..PER_TOPIC).map(|i| format!("tasks-{i}")).collect();
    let side_ids: HashSet<String> = (0..PER_TOPIC).map(|i| format!("side-{i}")).collect();
    default
        .produce("tasks", &encoded_tasks(&task_ids, "tasks", 120))
        .await;
    east.produce("side", &encoded_tasks(&side_ids, "side", 120))
        .await;
    let ids: HashSet<String> = task_ids.union(&side_ids).cloned().collect();
    let ports = Ports {
        grpc: free_port(),
        metrics: free_port(),
    };
    let start = || {
        crash_broker(&db, &default, &worker, &ports)
            .env(
                "TASKBROKER_KAFKA_CLUSTERS",
                format!("east={}", east.bootstrap()),
            )
            .env("TASKBROKER_KAFKA_TOPICS", "tasks,side@east")
            .env("TASKBROKER_MAX_INFLIGHT", "150")
            .env("TASKBROKER_INSERT_BATCH_SIZE", "50")
            .spawn()
            .expect("start the broker binary")
    };

    let mut leftovers = KillOnDrop::default();
    let mut first = start();
    leftovers.0.push(first.id());
    let mut acknowledged: HashMap<String, usize> = HashMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let both_started = |accepted: &[String]| {
        accepted.iter().any(|id| id.starts_with("tasks-"))
            && accepted.iter().any(|id| id.starts_with("side-"))
    };
    loop {
        let accepted = worker.seen.accepted();
        if accepted.len() >= ids.len() / 4 && both_started(&accepted) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "first run made no progress"
        );
        if let Ok(Some(exit)) = first.try_wait() {
            panic!("the broker exited ({exit}):\n{}", stderr_of(first).await);
        }
        report_accepted(ports.grpc, &worker, &mut acknowledged).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.kill().expect("SIGKILL the broker");
    let first_stderr = stderr_of(first).await;
    db.wait_for_dead_broker_backends().await;
    // Both consumers were cut off mid-stream: neither had committed its
    // whole topic (each holds at most MAX_INFLIGHT rows plus a batch).
    let committed = |kafka: &MockKafka, group: &str, topic: &str| -> usize {
        kafka
            .committed(group, topic, 2)
            .iter()
            .map(|offset| (*offset).max(0) as usize)
            .sum()
    };
    assert!(committed(&default, "taskbroker", "tasks") < PER_TOPIC);
    assert!(committed(&east, "taskbroker-side", "side") < PER_TOPIC);

    let second = start();
    leftovers.0.push(second.id());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    loop {
        report_accepted(ports.grpc, &worker, &mut acknowledged).await;
        if ids.iter().all(|id| acknowledged.contains_key(id)) && total(&db).await == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "after restart: {} of {} acknowledged, {} rows left",
            acknowledged.len(),
            ids.len(),
            total(&db).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let delivered: HashSet<String> = worker.seen.accepted().into_iter().collect();
    assert_eq!(
        delivered, ids,
        "every task of both topics reached the worker"
    );
    terminate(&second);
    let second_stderr = stderr_of(second).await;
    for (run, stderr) in [("first", &first_stderr), ("second", &second_stderr)] {
        assert!(
            !stderr.contains("panicked"),
            "{run} run panicked:\n{stderr}"
        );
        assert!(
            !stderr.contains("ERROR"),
            "{run} run logged an error:\n{stderr}"
        );
    }
}

/// SIGTERM via kill(1): the orderly stop.
fn terminate(child: &Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
}
