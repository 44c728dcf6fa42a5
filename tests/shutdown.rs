//! The real `taskbroker` binary with load in flight, stopped with SIGTERM:
//! exits 0, leaves no Claimed row, has committed what it stored, and lost
//! no status report it acknowledged.

mod common;

use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

use common::kafka::MockKafka;
use common::process::{broker_command, encoded_tasks};
use common::worker::{FakeWorker, Mode};
use common::{Backend, KillOnDrop, TestDb, TestStore, free_port, wait_until};
use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
use taskbroker::proto::{
    SetBatchActivationStatusRequest, SetTaskStatusRequest, TaskActivationStatus,
};

on_both_backends!(sigterm_with_a_hung_worker_exits_within_one_push_timeout);

#[actix_rt::test]
async fn sigterm_with_load_in_flight_stops_cleanly() {
    let db = TestDb::new().await;
    let store = db.store().await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 4);
    let worker = FakeWorker::start(Mode::Accept {
        delay: Duration::from_millis(20),
    })
    .await;
    let ids: Vec<String> = (0..3_000).map(|i| format!("term-{i}")).collect();
    let payloads = encoded_tasks(&ids, "term", 60);
    kafka.produce("tasks", &payloads).await;

    let grpc_port = free_port();
    let mut broker = broker_command(("DATABASE_URL", db.url.clone()), &kafka, grpc_port)
        .env("TASKBROKER_WORKER_ENDPOINTS", format!("*={}", worker.url()))
        .env("TASKBROKER_PUSH_CONCURRENCY", "8")
        .env("TASKBROKER_SHUTDOWN_TIMEOUT_MS", "20000")
        .spawn()
        .expect("start the broker binary");
    let _leftover = KillOnDrop(vec![broker.id()]);

    // Report results for what the worker accepted, until a few hundred are
    // done; keep the load going while the signal arrives.
    let mut acknowledged: HashSet<String> = HashSet::new();
    wait_until("the broker pushes", Duration::from_secs(60), || {
        let n = worker.seen.accepted().len();
        async move { n >= 300 }
    })
    .await;
    let mut client = ConsumerServiceClient::connect(format!("http://127.0.0.1:{grpc_port}"))
        .await
        .expect("broker gRPC");
    let report = |ids: Vec<String>| SetBatchActivationStatusRequest {
        updates: ids
            .into_iter()
            .map(|id| SetTaskStatusRequest {
                id,
                status: TaskActivationStatus::Complete as i32,
                ..Default::default()
            })
            .collect(),
    };
    let first: Vec<String> = worker.seen.accepted();
    client
        .set_batch_activation_status(report(first.clone()))
        .await
        .expect("report");
    acknowledged.extend(first);

    let pid = broker.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    // Reports keep arriving during shutdown; those acknowledged must stick.
    for _ in 0..5 {
        let fresh: Vec<String> = worker
            .seen
            .accepted()
            .into_iter()
            .filter(|id| !acknowledged.contains(id))
            .collect();
        if client
            .set_batch_activation_status(report(fresh.clone()))
            .await
            .is_ok()
        {
            acknowledged.extend(fresh);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let status = tokio::task::spawn_blocking(move || broker.wait())
        .await
        .unwrap()
        .expect("broker exit status");
    assert_eq!(status.code(), Some(0), "clean exit");

    let client = db.client().await;
    let claimed: i64 = client
        .query_one(
            "SELECT count(*) FROM inflight_taskactivations WHERE status = 'Claimed'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(claimed, 0, "no Claimed row left");
    for id in &acknowledged {
        let row = taskbroker::store::ActivationStore::get(store.as_ref(), id)
            .await
            .unwrap();
        if let Some(row) = row {
            assert_eq!(
                row.status,
                taskbroker::model::ActivationStatus::Complete,
                "acknowledged report for {id} lost"
            );
        }
    }
    // Every stored record's offset is committed.
    let committed = kafka.committed("taskbroker", "tasks", 4);
    for (partition, committed) in committed.iter().enumerate() {
        let max_stored: Option<i64> = client
            .query_one(
                "SELECT max(kafka_offset) FROM inflight_taskactivations WHERE partition = $1",
                &[&(partition as i32)],
            )
            .await
            .unwrap()
            .get(0);
        if let Some(max_stored) = max_stored {
            assert!(
                *committed > max_stored,
                "partition {partition}: committed {committed}, stored up to {max_stored}"
            );
        }
    }
}

/// Issue 13 item 10, the reference broker's own scenario: a worker that
/// accepts pushes and never answers, one push slot, a queue of one. After
/// SIGTERM nothing more is claimed or pushed, the push in flight ends
/// within its timeout, every claim is released, and the broker exits 0
/// within about one push timeout (not after SHUTDOWN_TIMEOUT_MS, exit 1).
async fn sigterm_with_a_hung_worker_exits_within_one_push_timeout(backend: Backend) {
    const PUSH_TIMEOUT: Duration = Duration::from_millis(1000);
    let db = TestStore::new(backend).await;
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 1);
    let worker = FakeWorker::start(Mode::Hang).await;
    let ids: Vec<String> = (0..50).map(|i| format!("hung-{i}")).collect();
    let payloads = encoded_tasks(&ids, "hung", 60);
    kafka.produce("tasks", &payloads).await;

    let broker = broker_command(db.env(), &kafka, free_port())
        .env("TASKBROKER_WORKER_ENDPOINTS", format!("*={}", worker.url()))
        .env(
            "TASKBROKER_PUSH_TIMEOUT_MS",
            PUSH_TIMEOUT.as_millis().to_string(),
        )
        .env("TASKBROKER_PUSH_CONCURRENCY", "1")
        .env("TASKBROKER_PUSH_QUEUE_SIZE", "1")
        .env("TASKBROKER_FETCH_BATCH_SIZE", "10")
        .env("TASKBROKER_SHUTDOWN_TIMEOUT_MS", "20000")
        .spawn()
        .expect("start the broker binary");
    let _leftover = KillOnDrop(vec![broker.id()]);

    // A push has timed out and the next one hangs: the pool is saturated.
    wait_until(
        "the broker pushes to the hung worker",
        Duration::from_secs(60),
        || {
            let attempts = worker.seen.attempts();
            async move { attempts >= 2 }
        },
    )
    .await;
    let pushed_before = worker.seen.attempts();
    let pid = broker.id().to_string();
    let signalled = tokio::time::Instant::now();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let mut broker = broker;
    let status = tokio::task::spawn_blocking(move || broker.wait())
        .await
        .unwrap()
        .expect("broker exit status");
    let took = signalled.elapsed();

    assert_eq!(status.code(), Some(0), "clean exit after {took:?}");
    assert!(
        // About 1 s here; the unfixed broker took 4 s or more.
        took < PUSH_TIMEOUT + Duration::from_millis(1500),
        "shutdown took {took:?} with a {PUSH_TIMEOUT:?} push timeout"
    );
    // At most the push that was already on its way when the signal came.
    assert!(
        worker.seen.attempts() <= pushed_before + 1,
        "{} pushes after SIGTERM",
        worker.seen.attempts() - pushed_before
    );
    db.wait_for_dead_broker_backends().await;
    assert_eq!(db.claimed().await, Vec::new(), "no Claimed row left");
}
