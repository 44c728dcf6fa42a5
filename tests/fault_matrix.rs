//! The fault matrix: the whole broker (Broker::start, as `taskbroker run`
//! starts it) on real PostgreSQL and the mock Kafka cluster, with demo
//! workers that run every pushed task and report its result to the
//! broker, broken on purpose mid-run. Each case checks that every produced
//! task reached exactly one terminal outcome (repeated runs are counted and
//! must stay within what at-least-once allows), that no Claimed row
//! outlived its lease by more than an upkeep pass, and that the metrics
//! agree with what the workers saw.
//!
//! Scaled down to finish in seconds each; the slow, large versions are the
//! load harness's job.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use std::time::Duration;
use tracing_subscriber::Layer as _;

use common::kafka::MockKafka;
use common::worker::scenario::{Kind, Ledger, TaskRecord};
use common::worker::{DemoWorker, Mode};
use common::{TestDb, free_port, http_get, wait_until};
use prost::Message as _;
use taskbroker::broker::Broker;
use taskbroker::config::Config;
use taskbroker::metrics::Metrics;
use taskbroker::store::{ActivationStore, PostgresStore};

const TOPIC: &str = "tasks";

/// ERROR-level events and panics seen anywhere in this test binary (every
/// case expects none, so a shared count is enough).
static ERRORS: AtomicU64 = AtomicU64::new(0);
static PANICS: AtomicU64 = AtomicU64::new(0);

struct CountErrors;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountErrors {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if *event.metadata().level() == tracing::Level::ERROR {
            ERRORS.fetch_add(1, Ordering::Relaxed);
            eprintln!("ERROR event: {event:?}");
        }
    }
}

/// Installs the ERROR and panic counters once per test binary; warnings
/// and above are printed for the failure output.
fn watch_logs_and_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        use tracing_subscriber::layer::SubscriberExt as _;
        let subscriber = tracing_subscriber::registry().with(CountErrors).with(
            tracing_subscriber::fmt::layer()
                .with_test_writer()
                .with_filter(tracing_subscriber::filter::LevelFilter::WARN),
        );
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            // Test threads carry their test's name and fail by panicking;
            // only the broker's own threads (actix arbiters, tokio
            // workers, the SQLite writer, unnamed ones) count.
            let thread = std::thread::current();
            let broker_thread = match thread.name() {
                None => true,
                Some(name) => ["actix", "tokio", "sqlite"]
                    .iter()
                    .any(|prefix| name.starts_with(prefix)),
            };
            if broker_thread {
                PANICS.fetch_add(1, Ordering::Relaxed);
            }
            default_hook(info);
        }));
    });
}

/// No ERROR was logged and nothing panicked (on any thread) so far.
fn assert_no_errors_or_panics() {
    assert_eq!(
        ERRORS.load(Ordering::Relaxed),
        0,
        "ERROR-level events logged"
    );
    assert_eq!(PANICS.load(Ordering::Relaxed), 0, "a thread panicked");
}
/// Claims may outlive their lease by this much: upkeep runs every 100 ms
/// and its statement takes a moment.
const LEASE_SLACK_MS: i64 = 2_000;

/// Scenarios running at once. Each runs up to three brokers, a mock Kafka
/// cluster and workers; all seven at once on two cores starve the timers
/// their bounds (lease slack, backoff rates) are measured against.
static SCENARIO_SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

struct Matrix {
    /// Held for the scenario's whole run (see [`SCENARIO_SLOTS`]).
    _slot: tokio::sync::SemaphorePermit<'static>,
    db: TestDb,
    kafka: MockKafka,
    ledger: Arc<Ledger>,
    workers: Vec<DemoWorker>,
    store: Arc<dyn ActivationStore>,
    grpc_port: u16,
}

impl Matrix {
    async fn new(workers: usize) -> Matrix {
        let slot = SCENARIO_SLOTS
            .acquire()
            .await
            .expect("the scenario semaphore is never closed");
        watch_logs_and_panics();
        let db = TestDb::new().await;
        let store: Arc<dyn ActivationStore> = db.store().await;
        let kafka = MockKafka::start();
        kafka.create_topic(TOPIC, 4);
        kafka.create_topic("taskworker-dlq", 1);
        kafka.create_topic("taskworker-ingest-dlq", 1);
        let ledger = Arc::new(Ledger::default());
        let mut pool = Vec::new();
        for _ in 0..workers {
            pool.push(
                DemoWorker::start_with_ledger(
                    "127.0.0.1:0".parse().unwrap(),
                    Mode::Execute {
                        delay: Duration::from_millis(2),
                    },
                    Vec::new(),
                    Some(Arc::clone(&ledger)),
                )
                .await
                .expect("demo worker listens"),
            );
        }
        Matrix {
            _slot: slot,
            db,
            kafka,
            ledger,
            workers: pool,
            store,
            grpc_port: free_port(),
        }
    }

    /// Broker configuration; every replica shares the database and the
    /// consumer group, each has its own gRPC port.
    fn config(&self, grpc_port: u16, extra: &[(&str, &str)]) -> Config {
        let urls: Vec<String> = self.workers.iter().map(DemoWorker::url).collect();
        let mut env: HashMap<String, String> = [
            ("DATABASE_URL", self.db.url.clone()),
            ("KAFKA_BROKERS", self.kafka.bootstrap()),
            ("KAFKA_TOPIC", TOPIC.to_owned()),
            ("WORKER_ENDPOINTS", format!("*={}", urls.join("|"))),
            ("GRPC_ADDR", format!("127.0.0.1:{grpc_port}")),
            ("GRPC_ADVERTISED_ADDR", format!("127.0.0.1:{grpc_port}")),
            ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
            ("UPKEEP_INTERVAL_MS", "100".to_owned()),
            ("RESTART_GRACE_SEC", "0".to_owned()),
            ("FETCH_ACTORS", "2".to_owned()),
            ("PUSH_QUEUE_TIMEOUT_MS", "200".to_owned()),
            ("PUSH_TIMEOUT_MS", "1000".to_owned()),
            // Above the legitimate path of every case here: queue timeout
            // + push timeout x (1 + queue size / concurrency).
            ("CLAIM_LEASE_MS", "5000".to_owned()),
            ("DB_POOL_SIZE", "8".to_owned()),
            // Short heartbeats, so the mock coordinator finishes a
            // rebalance in about a second instead of three.
            (
                "KAFKA_CONFIG",
                "session.timeout.ms=6000,heartbeat.interval.ms=500".to_owned(),
            ),
        ]
        .into_iter()
        .map(|(name, value)| (format!("TASKBROKER_{name}"), value))
        .collect();
        for (name, value) in extra {
            env.insert(format!("TASKBROKER_{name}"), (*value).to_owned());
        }
        Config::from_lookup(|name| env.get(name).cloned()).expect("test configuration")
    }

    fn start_broker(&self, grpc_port: u16, extra: &[(&str, &str)]) -> (Broker, Arc<Metrics>) {
        let metrics = Arc::new(Metrics::new());
        // A store of its own: each broker has its own id, as each process
        // has (the matrix's store migrated the database already).
        let store: Arc<dyn ActivationStore> =
            Arc::new(PostgresStore::connect(&self.db.store_config()).expect("store config"));
        let broker = Broker::start(
            &self.config(grpc_port, extra),
            store,
            Arc::clone(&metrics),
            "matrix",
        )
        .expect("broker starts");
        (broker, metrics)
    }

    /// Produces `n` tasks that complete, recording them in the ledger.
    async fn produce(&self, prefix: &str, n: usize) -> Vec<String> {
        let ids: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
        let payloads: Vec<Vec<u8>> = ids
            .iter()
            .map(|id| {
                self.ledger.produced(id, Kind::Complete);
                Kind::Complete
                    .activation(id, chrono::Utc::now())
                    .encode_to_vec()
            })
            .collect();
        self.kafka.produce(TOPIC, &payloads).await;
        ids
    }

    /// Watches the table until stopped; returns the most any Claimed row
    /// was past its lease, in milliseconds.
    fn watch_claims(&self) -> (Arc<AtomicBool>, Arc<AtomicI64>) {
        let stop = Arc::new(AtomicBool::new(false));
        let worst = Arc::new(AtomicI64::new(0));
        let (url, stop_flag, worst_seen) =
            (self.db.url.clone(), Arc::clone(&stop), Arc::clone(&worst));
        tokio::spawn(async move {
            let mut client = None;
            while !stop_flag.load(Ordering::Relaxed) {
                if client.is_none() {
                    client = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                        .await
                        .ok()
                        .map(|(client, connection)| {
                            tokio::spawn(connection);
                            client
                        });
                }
                if let Some(c) = &client {
                    match c
                        .query_one(
                            "SELECT COALESCE(max(EXTRACT(EPOCH FROM now() - claim_expires_at) \
                             * 1000), 0)::int8 FROM inflight_taskactivations \
                             WHERE status = 'Claimed'",
                            &[],
                        )
                        .await
                    {
                        Ok(row) => {
                            worst_seen.fetch_max(row.get::<_, i64>(0), Ordering::Relaxed);
                        }
                        // The connection was terminated (a fault under test).
                        Err(_) => client = None,
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        (stop, worst)
    }

    /// Waits until every task completed and the table is empty.
    async fn wait_until_all_done(&self, ids: &[String], limit: Duration) {
        self.wait_until_settled(ids, limit, false).await
    }

    /// As `wait_until_all_done`; with `unacknowledged_ok`, a task that
    /// reached a worker counts as settled once its row is gone even if the
    /// worker died before it saw the broker acknowledge its report.
    async fn wait_until_settled(&self, ids: &[String], limit: Duration, unacknowledged_ok: bool) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let records = self.ledger.snapshot();
            let done = ids
                .iter()
                .filter(|id| {
                    records.get(*id).is_some_and(|r| {
                        r.completions >= 1 || (unacknowledged_ok && r.deliveries >= 1)
                    })
                })
                .count();
            let counts = self.store.count_by_status().await;
            if done == ids.len() && counts.as_ref().is_ok_and(|c| c.total() == 0) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "gave up after {limit:?}: {done} of {} tasks completed; rows by status: {counts:?}",
                ids.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Every task completed exactly once as far as the broker is concerned;
    /// returns how many deliveries repeated a task (at-least-once).
    fn check_outcomes(&self, ids: &[String]) -> u32 {
        assert_no_errors_or_panics();
        let records: HashMap<String, TaskRecord> = self.ledger.snapshot();
        let mut repeats = 0;
        for id in ids {
            let record = records.get(id).unwrap_or_else(|| panic!("{id} unknown"));
            record
                .check(true)
                .unwrap_or_else(|why| panic!("{id}: {why}"));
            assert_eq!(record.failures, 0, "{id} failed");
            repeats += record.deliveries - 1;
        }
        repeats
    }
}

async fn sample(broker: &Broker, series: &str) -> f64 {
    let (status, text) = http_get(broker.metrics_addr, "/metrics").await;
    assert_eq!(status, 200);
    text.lines()
        .find(|line| line.starts_with(series) && line[series.len()..].starts_with(' '))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

/// Every PostgreSQL backend of the test database is terminated, twice,
/// while tasks flow: the pools reconnect, failed statements are retried by
/// their callers, and nothing is lost.
#[actix_rt::test]
async fn every_postgres_backend_terminated_mid_run() {
    let matrix = Matrix::new(4).await;
    let (broker, _metrics) = matrix.start_broker(matrix.grpc_port, &[]);
    let (stop_watch, worst_overdue) = matrix.watch_claims();
    let mut ids = matrix.produce("pgkill-a", 1_000).await;

    let admin = common::connect(&common::admin_url()).await;
    for round in 0..2 {
        wait_until("some tasks are done", Duration::from_secs(60), || async {
            matrix.ledger.totals().1 as usize >= 300 * (round + 1)
        })
        .await;
        let terminated: i64 = admin
            .query_one(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = $1 AND pid <> pg_backend_pid()) t",
                &[&matrix.db.name],
            )
            .await
            .expect("terminate backends")
            .get(0);
        assert!(terminated > 0, "round {round}: no backend to terminate");
        if round == 0 {
            ids.extend(matrix.produce("pgkill-b", 500).await);
        }
    }

    matrix
        .wait_until_all_done(&ids, Duration::from_secs(120))
        .await;
    stop_watch.store(true, Ordering::Relaxed);
    let repeats = matrix.check_outcomes(&ids);
    // A push whose success could not be recorded while the database was
    // away runs again once its claim returns: bounded by what was in
    // flight, far below the batch.
    assert!(repeats <= 200, "{repeats} repeated deliveries");
    assert!(
        worst_overdue.load(Ordering::Relaxed) <= LEASE_SLACK_MS,
        "a Claimed row outlived its lease by {} ms",
        worst_overdue.load(Ordering::Relaxed)
    );
    let stored = sample(
        &broker,
        "taskbroker_consumer_records_total{result=\"stored\",topic=\"tasks\"}",
    )
    .await;
    assert!(stored >= ids.len() as f64);
    broker.stop().await;
}

/// The Kafka broker goes down mid-run and comes back: tasks already stored
/// keep flowing, ingestion resumes, and each record is stored once.
#[actix_rt::test]
async fn kafka_broker_down_then_up() {
    let matrix = Matrix::new(4).await;
    let (broker, metrics) = matrix.start_broker(matrix.grpc_port, &[]);
    let (stop_watch, worst_overdue) = matrix.watch_claims();
    let mut ids = matrix.produce("kafka-a", 800).await;
    wait_until("some tasks are done", Duration::from_secs(60), || async {
        matrix.ledger.totals().1 >= 200
    })
    .await;

    matrix.kafka.cluster.broker_down(1).expect("broker down");
    // While Kafka is away, everything stored still drains to the workers.
    // (Counted against what was stored, not against progress after the
    // outage began: on a fast run every stored task may already be done.)
    let stored = metrics.consumed("stored");
    wait_until(
        "every stored task completes with Kafka down",
        Duration::from_secs(30),
        || async { matrix.ledger.totals().1 >= stored },
    )
    .await;
    matrix.kafka.cluster.broker_up(1).expect("broker up");
    ids.extend(matrix.produce("kafka-b", 400).await);

    matrix
        .wait_until_all_done(&ids, Duration::from_secs(120))
        .await;
    stop_watch.store(true, Ordering::Relaxed);
    let repeats = matrix.check_outcomes(&ids);
    assert_eq!(repeats, 0, "Kafka trouble must not re-run stored tasks");
    assert!(worst_overdue.load(Ordering::Relaxed) <= LEASE_SLACK_MS);
    assert_eq!(
        metrics.consumed("stored"),
        ids.len() as u64,
        "each record stored once"
    );
    broker.stop().await;
}

/// Two brokers share the database and the consumer group; one is stopped
/// and replaced mid-run, as in a rolling deploy. Workers report to
/// whichever broker pushed them the task.
#[actix_rt::test]
async fn two_brokers_one_database_rolling_restart() {
    let matrix = Matrix::new(4).await;
    let second_port = free_port();
    let (first, m1) = matrix.start_broker(matrix.grpc_port, &[]);
    let (second, m2) = matrix.start_broker(second_port, &[]);
    let (stop_watch, worst_overdue) = matrix.watch_claims();
    let mut ids = matrix.produce("roll-a", 1_000).await;
    wait_until("some tasks are done", Duration::from_secs(60), || async {
        matrix.ledger.totals().1 >= 300
    })
    .await;

    // Rolling deploy: the first replica stops cleanly and a new one takes
    // its place (same address, as a restarted pod behind its Service).
    first.stop().await;
    // Everything stored is committed: the stopping replica commits what it
    // stored, the other its own. Under a loaded machine a commit made while
    // the group rebalances can be refused and is made again by the
    // partition's next owner, so this waits (bounded) for the group to
    // settle; what re-reading costs is bounded by the checks below.
    wait_until("offsets committed", Duration::from_secs(30), || async {
        let committed: i64 = matrix.kafka.committed("taskbroker", TOPIC, 4).iter().sum();
        committed == 1_000
    })
    .await;
    ids.extend(matrix.produce("roll-b", 500).await);
    let (replacement, m3) = matrix.start_broker(matrix.grpc_port, &[]);

    matrix
        .wait_until_all_done(&ids, Duration::from_secs(120))
        .await;
    stop_watch.store(true, Ordering::Relaxed);
    // Every record was stored. A record is stored (and run) again only in
    // the window docs/operations.md names: the surviving replica stored
    // and finished it, and its commit had not landed when the joining
    // replica took the partition over. That is bounded by the records read
    // during the rebalance (roll-b), never the whole run.
    let stored: u64 = [&m1, &m2, &m3].iter().map(|m| m.consumed("stored")).sum();
    let again = stored - ids.len() as u64;
    assert!(again <= 500, "{again} records stored twice");
    let repeats = matrix.check_outcomes(&ids);
    // The clean stop itself re-runs nothing: it releases its claims, lets
    // pushes finish and commits what it stored (checked above), and
    // workers retry reports sent to the stopping replica.
    assert!(
        u64::from(repeats) <= again,
        "{repeats} repeated deliveries, {again} records stored twice"
    );
    assert!(worst_overdue.load(Ordering::Relaxed) <= LEASE_SLACK_MS);
    second.stop().await;
    replacement.stop().await;
}

/// Malformed Kafka records and malformed gRPC requests arrive mixed into
/// the load: the good tasks all complete, bad records go to the ingest
/// dead-letter topic, bad requests get INVALID_ARGUMENT, and nothing else
/// changes.
#[actix_rt::test]
async fn malformed_records_and_requests_mixed_into_the_load() {
    use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
    use taskbroker::proto::{SetBatchActivationStatusRequest, SetTaskStatusRequest};

    let matrix = Matrix::new(4).await;
    let (broker, metrics) = matrix.start_broker(matrix.grpc_port, &[]);
    let mut payloads: Vec<Vec<u8>> = Vec::new();
    let mut ids = Vec::new();
    for i in 0..600 {
        let id = format!("mixed-{i}");
        matrix.ledger.produced(&id, Kind::Complete);
        payloads.push(
            Kind::Complete
                .activation(&id, chrono::Utc::now())
                .encode_to_vec(),
        );
        ids.push(id);
        if i % 20 == 0 {
            payloads.push(vec![0xff, 0x00, 0x13, 0x37]); // not a TaskActivation
            payloads.push(Vec::new()); // empty
        }
    }
    matrix.kafka.produce(TOPIC, &payloads).await;

    let mut client = ConsumerServiceClient::connect(format!("http://{}", broker.grpc_addr))
        .await
        .expect("broker gRPC");
    for id in ids.iter().take(50) {
        let bad = SetTaskStatusRequest {
            id: id.clone(),
            status: 99, // no such status
            ..Default::default()
        };
        let err = client.set_task_status(bad).await.expect_err("refused");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        let pending = SetTaskStatusRequest {
            id: id.clone(),
            status: 1, // PENDING: not a worker's outcome
            ..Default::default()
        };
        let err = client
            .set_batch_activation_status(SetBatchActivationStatusRequest {
                updates: vec![pending],
            })
            .await
            .expect_err("refused");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
    }

    matrix
        .wait_until_all_done(&ids, Duration::from_secs(120))
        .await;
    assert_eq!(matrix.check_outcomes(&ids), 0);
    let bad_records = metrics.consumed("invalid");
    assert_eq!(bad_records, 60, "every malformed record counted once");
    assert_eq!(metrics.consumed("stored"), ids.len() as u64);
    let dead = matrix.kafka.read_all("taskworker-ingest-dlq", 1);
    assert_eq!(dead.len(), 60, "every malformed record dead-lettered");
    broker.stop().await;
}

/// Every worker goes away mid-run (its port refuses connections) and comes
/// back: pushes back off instead of spinning, no task uses an attempt or is
/// lost, and delivery resumes when the workers return.
#[actix_rt::test]
async fn all_workers_down_mid_run_then_back() {
    let mut matrix = Matrix::new(2).await;
    let (broker, metrics) = matrix.start_broker(matrix.grpc_port, &[]);
    let (stop_watch, worst_overdue) = matrix.watch_claims();
    let ids = matrix.produce("down", 1_200).await;
    wait_until("some tasks are done", Duration::from_secs(60), || async {
        matrix.ledger.totals().1 >= 200
    })
    .await;

    for worker in &mut matrix.workers {
        worker.kill();
    }
    // Tasks the workers held when they died: accepted, result not yet
    // acknowledged. Only these (and pushes cut mid-call) may run again.
    let held_at_kill = matrix
        .ledger
        .snapshot()
        .values()
        .filter(|r| r.deliveries > 0 && r.completions == 0)
        .count() as u32;
    let failed_before = Metrics::count(&metrics.pushes, "unreachable");
    // Two seconds of outage. How many failed pushes the endpoints' backoff
    // allows in it (one probe per pause per endpoint, not one per claimed
    // task) is pinned without a clock by the unit test
    // `a_burst_for_a_down_endpoint_gets_one_probe_per_pause` in
    // src/actors/push_pool/endpoints_tests.rs; here the outage is only
    // noticed and outlasted.
    wait_until(
        "the broker notices the workers are gone",
        Duration::from_secs(10),
        || async { Metrics::count(&metrics.pushes, "unreachable") > failed_before },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await; // the outage itself
    for worker in &mut matrix.workers {
        worker.restart().expect("worker back on its port");
    }

    matrix
        .wait_until_settled(&ids, Duration::from_secs(120), true)
        .await;
    stop_watch.store(true, Ordering::Relaxed);
    assert_no_errors_or_panics();
    // A task the workers accepted just before they died may have had its
    // report applied without the worker seeing the answer: its row is gone
    // and the ledger has no completion. Rows leave the table only as
    // Complete unless upkeep discarded, expired or failed them, and it did
    // none of that here, so every task completed.
    for step in [
        "discard_failures",
        "fail_exhausted_attempts",
        "remove_expired",
        "processing_deadline_failed",
        "publish_dead_letters",
    ] {
        assert_eq!(
            Metrics::count(&metrics.upkeep_transitions, step),
            0,
            "upkeep step {step} removed or failed tasks"
        );
    }
    let records = matrix.ledger.snapshot();
    let mut repeats = 0;
    for id in &ids {
        let record = &records[id];
        assert!(record.deliveries >= 1, "{id} never ran");
        assert_eq!(record.failures, 0);
        repeats += record.deliveries - 1;
    }
    // Only tasks whose push or report was cut by the kill run again.
    assert!(
        repeats <= held_at_kill,
        "{repeats} repeated deliveries; the workers held {held_at_kill} tasks when killed"
    );
    assert!(worst_overdue.load(Ordering::Relaxed) <= LEASE_SLACK_MS);
    let attempts_after: u64 = matrix.workers.iter().map(|w| w.seen.attempts()).sum();
    assert!(attempts_after > 0);
    broker.stop().await;
}

/// A long stretch with the push pool saturated (slow workers, a tiny pool,
/// eager fetchers): claims that cannot be handed over are released in one
/// statement per batch, none outlives its lease, every task runs once.
#[actix_rt::test]
async fn push_pool_saturated_for_a_long_stretch() {
    let matrix = Matrix::new(1).await;
    matrix.workers[0].set_mode(Mode::ExecuteSlowly {
        accept: Duration::from_millis(50),
    });
    let (broker, metrics) = matrix.start_broker(
        matrix.grpc_port,
        &[
            ("PUSH_CONCURRENCY", "2"),
            ("PUSH_QUEUE_SIZE", "4"),
            ("FETCH_BATCH_SIZE", "32"),
            ("FETCH_ACTORS", "4"),
            // The legitimate path here: 200 + ⌈(4 + 4 + 1) / 2⌉ × 1000 + 1000.
            ("CLAIM_LEASE_MS", "7000"),
        ],
    );
    let (stop_watch, worst_overdue) = matrix.watch_claims();
    let ids = matrix.produce("saturated", 400).await;
    matrix
        .wait_until_all_done(&ids, Duration::from_secs(180))
        .await;
    stop_watch.store(true, Ordering::Relaxed);
    assert_eq!(matrix.check_outcomes(&ids), 0);
    assert!(
        worst_overdue.load(Ordering::Relaxed) <= 0,
        "a claim outlived its lease by {} ms while the pool was full",
        worst_overdue.load(Ordering::Relaxed)
    );
    let timeouts = Metrics::count(&metrics.submits, "timeout");
    assert!(timeouts > 0, "the pool was never full");
    assert_eq!(
        metrics.store_calls("release_claims"),
        timeouts,
        "one release statement per batch the pool could not take"
    );
    assert_eq!(Metrics::count(&metrics.claims_released, "lease_expired"), 0);
    broker.stop().await;
}

/// PostgreSQL refuses every connection while records wait to be inserted,
/// and the broker is stopped: the insert retries give up within the
/// shutdown timeout instead of holding shutdown up, and the offsets of the
/// records that were never stored stay uncommitted for the next owner.
#[actix_rt::test]
async fn stopping_during_a_database_outage_ends_in_time_without_committing_unstored_records() {
    let matrix = Matrix::new(1).await;
    let shutdown_timeout = Duration::from_secs(5);
    let (broker, metrics) =
        matrix.start_broker(matrix.grpc_port, &[("SHUTDOWN_TIMEOUT_MS", "5000")]);
    let ids = matrix.produce("outage-a", 100).await;
    matrix
        .wait_until_all_done(&ids, Duration::from_secs(60))
        .await;
    let ends = matrix.kafka.end_offsets(TOPIC, 4);
    wait_until(
        "the stored records are committed",
        Duration::from_secs(30),
        || {
            let done = matrix.kafka.committed("taskbroker", TOPIC, 4) == ends;
            async move { done }
        },
    )
    .await;

    // The outage: no new connection is accepted, existing ones are cut.
    let admin = common::connect(&common::admin_url()).await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS false",
            matrix.db.name
        ))
        .await
        .expect("refuse connections");
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&matrix.db.name],
        )
        .await
        .expect("terminate backends");
    let unstored = matrix.produce("outage-b", 50).await;
    let failing = Arc::clone(&metrics);
    wait_until(
        "the consumer's inserts fail and its partitions are paused",
        Duration::from_secs(30),
        || {
            let failed = failing
                .store_errors
                .with_label_values(&["insert_batch", "unavailable"])
                .get();
            let paused = failing.paused_partitions();
            async move { failed >= 2 && paused == 4 }
        },
    )
    .await;

    let stopped = tokio::time::timeout(shutdown_timeout, broker.stop()).await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS true",
            matrix.db.name
        ))
        .await
        .expect("accept connections again");
    assert!(
        stopped.is_ok(),
        "Broker::stop took longer than the shutdown timeout"
    );
    assert_eq!(
        matrix.kafka.committed("taskbroker", TOPIC, 4),
        ends,
        "offsets of the {} records that were never stored stay uncommitted",
        unstored.len()
    );
    assert_eq!(metrics.consumed("stored"), 100);
}
