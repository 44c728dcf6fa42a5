//! A worker that is killed (connection refused) for a while and comes back.
//! Its own test binary because it captures the process's log output.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::worker::{FakeWorker, Mode};
use common::{TestDb, rows, wait_for_status, wait_until};
use taskbroker::actors::fetch::FetchConfig;
use taskbroker::actors::push_pool::PushPoolConfig;
use taskbroker::broker::{PushPipeline, PushPipelineConfig};
use taskbroker::config::WorkerEndpoints;
use taskbroker::metrics::Metrics;
use taskbroker::model::ActivationStatus;
use taskbroker::store::{ActivationStore, PostgresStore};

const FAILURE_LOG: &str = "push to worker failed; backing off";
/// Connections per worker URL (`WORKER_CONNECTIONS`' default).
const CONNECTIONS: i64 = 8;

/// Log output, kept for the test to count lines in.
#[derive(Clone, Default)]
struct CapturedLogs(Arc<Mutex<Vec<u8>>>);

impl Write for CapturedLogs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLogs {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    fn count(&self, needle: &str) -> usize {
        self.text()
            .lines()
            .filter(|line| line.contains(needle))
            .count()
    }
}

#[actix_rt::test]
async fn killed_worker_is_probed_at_a_bounded_rate_and_served_again_when_back() {
    let logs = CapturedLogs::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();

    let db = TestDb::new().await;
    let store = Arc::new(PostgresStore::connect(&db.store_config()).unwrap());
    store.migrate().await.unwrap();
    let metrics = Arc::new(Metrics::new());
    let store_actor = common::start_store_actor(store.clone(), Arc::clone(&metrics));
    let mut worker = FakeWorker::start(Mode::accept()).await;
    let config = PushPipelineConfig {
        fetch_actors: 2,
        fetch: FetchConfig {
            batch_size: 32,
            batch_bytes: 16 << 20,
            backoff: Duration::from_millis(20),
            queue_timeout: Duration::from_millis(200),
            lease: Duration::from_secs(30),
            fair_dispatch: true,
            #[cfg(feature = "test-hooks")]
            release_on_full: true,
        },
        push: PushPoolConfig {
            concurrency: 32,
            queue_size: 64,
            queue_bytes: 64 << 20,
            push_timeout: Duration::from_secs(1),
            deadline_grace: Duration::from_secs(3),
            max_attempts: 5,
            callback_url: "broker.test:50051".to_owned(),
            signing_secret: None,
            // Credentials in the URL must never reach a log line.
            endpoints: WorkerEndpoints::parse(&format!(
                "*={}",
                worker.url().replace("http://", "http://svc:hunter2@")
            ))
            .unwrap(),
            tls: Default::default(),
            spread: Default::default(),
        },
    };
    let pipeline = PushPipeline::start(config, store_actor, Arc::clone(&metrics)).unwrap();
    let all = rows("down", 600);
    store.insert_batch(&all[..100]).await.unwrap();
    pipeline.wake();
    wait_for_status(
        "the first rows are pushed",
        Duration::from_secs(30),
        store.as_ref(),
        ActivationStatus::Processing,
        100,
    )
    .await;

    // Kill the worker, keep the inflow coming for 3 s.
    worker.kill();
    let refused_before = Metrics::count(&metrics.pushes, "unreachable");
    let timeouts_before = Metrics::count(&metrics.pushes, "timeout");
    let logs_before = logs.count(FAILURE_LOG);
    for chunk in all[100..].chunks(100) {
        store.insert_batch(chunk).await.unwrap();
        pipeline.wake();
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    // Every connection to the dead worker is backing off: the endpoint is
    // down on /metrics.
    wait_until(
        "every connection to the dead worker backs off",
        Duration::from_secs(10),
        || {
            let ready = metrics.worker_connections_in("ready");
            let backing_off = metrics.worker_connections_in("backing_off");
            async move { ready == 0 && backing_off == CONNECTIONS }
        },
    )
    .await;
    let attempts_while_down = Metrics::count(&metrics.pushes, "unreachable") - refused_before;
    let timeouts_while_down = Metrics::count(&metrics.pushes, "timeout") - timeouts_before;
    let log_lines_while_down = logs.count(FAILURE_LOG) - logs_before;

    let seen_before = worker.seen.attempts();
    let back = tokio::time::Instant::now();
    worker.restart().expect("worker restarts");
    wait_until(
        "the worker receives pushes again",
        Duration::from_secs(10),
        || {
            let seen = worker.seen.attempts();
            async move { seen > seen_before }
        },
    )
    .await;
    let back_after = back.elapsed();
    wait_for_status(
        "every row is pushed",
        Duration::from_secs(60),
        store.as_ref(),
        ActivationStatus::Processing,
        600,
    )
    .await;
    // Connections that carried a push since are ready again; the others
    // say backing off until their next push.
    assert!(metrics.worker_connections_in("ready") > 0);
    assert_eq!(
        metrics.worker_connections_in("ready") + metrics.worker_connections_in("backing_off"),
        CONNECTIONS
    );
    pipeline.stop().await;

    // How many attempts a dead worker gets (the first burst, then one probe
    // per backoff pause) is pinned without a clock by the unit test
    // `a_burst_for_a_down_endpoint_gets_one_probe_per_pause` in
    // src/actors/push_pool/endpoints_tests.rs; here only that the pool kept
    // trying.
    assert!(attempts_while_down > 0);
    // A refused connection is `unreachable`, and a push held back while the
    // endpoint backs off is `backoff`: neither is a timeout (issue 20 saw
    // 819 of 950 refused pushes counted as timeouts).
    assert_eq!(timeouts_while_down, 0);
    assert!(Metrics::count(&metrics.pushes, "backoff") > 0);
    let text = logs.text();
    // The failure line keeps the cause, not only tonic's "tcp connect error".
    assert!(
        text.lines()
            .any(|line| line.contains(FAILURE_LOG) && line.contains("Connection refused")),
        "{text}"
    );
    assert!(!text.contains("hunter2"), "credentials logged: {text}");
    assert!(
        text.lines()
            .any(|line| line.contains(FAILURE_LOG) && line.contains("http://<redacted>@127.0.0.1")),
        "{text}"
    );
    assert!(
        log_lines_while_down <= 1,
        "{log_lines_while_down} failure log lines in 3 s"
    );
    assert!(
        back_after < Duration::from_secs(1),
        "pushes resumed {back_after:?} after the worker came back"
    );
    assert_eq!(
        store
            .count_by_status()
            .await
            .unwrap()
            .get(ActivationStatus::Claimed),
        0
    );
}
