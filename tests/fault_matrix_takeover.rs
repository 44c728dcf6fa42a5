//! Fault-matrix cases for broker recovery on PostgreSQL: two real
//! `taskbroker` processes share one database and one consumer group while
//! tasks flow, and one of them is
//!
//! - killed (SIGKILL): its peer takes it over once its heartbeat is older
//!   than the takeover timeout and pushes every claim it held again, long
//!   before their lease (set far beyond the test) could return them;
//! - frozen (SIGSTOP) past the takeover timeout, then resumed (SIGCONT):
//!   its peer takes over and pushes its claims, and the resumed broker
//!   pushes none of them again (its liveness refuses them, counted as
//!   `pushes_total{result="not_live"}`).
//!
//! Deliveries are told apart by the `callback_url` each broker sends.

mod common;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::kafka::MockKafka;
use common::process::{broker_command, encoded_tasks};
use common::worker::{DemoWorker, FakeWorker, Mode};
use common::{Backend, KillOnDrop, TestStore, free_port, http_get, wait_until};

const TASKS: usize = 600;
const HEARTBEAT_MS: u64 = 200;
const TAKEOVER_MS: u64 = 1_000;
/// Far longer than the test: no claim returns through its lease.
const LEASE_MS: u64 = 600_000;
const PUSH_CONCURRENCY: usize = 4;

struct Broker {
    id: &'static str,
    child: Child,
    grpc: u16,
    metrics: u16,
    log: LogFile,
}

/// A broker's output (its log), in a file removed with the value.
struct LogFile(std::path::PathBuf);

impl Drop for LogFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Broker {
    fn start(db: &TestStore, kafka: &MockKafka, worker: &DemoWorker, id: &'static str) -> Broker {
        let (grpc, metrics) = (free_port(), free_port());
        let log = LogFile(std::env::temp_dir().join(format!(
            "taskbroker_{id}_{}.log",
            uuid::Uuid::new_v4().simple()
        )));
        let stderr = std::fs::File::create(&log.0).expect("log file");
        let child = broker_command(db.env(), kafka, grpc)
            .env("TASKBROKER_BROKER_ID", id)
            .env("TASKBROKER_HEARTBEAT_INTERVAL_MS", HEARTBEAT_MS.to_string())
            .env("TASKBROKER_TAKEOVER_TIMEOUT_MS", TAKEOVER_MS.to_string())
            .env("TASKBROKER_CLAIM_LEASE_MS", LEASE_MS.to_string())
            .env("TASKBROKER_WORKER_ENDPOINTS", format!("*={}", worker.url()))
            .env("TASKBROKER_METRICS_ADDR", format!("127.0.0.1:{metrics}"))
            // A slow pool behind eager fetchers: claims are always held.
            .env("TASKBROKER_PUSH_CONCURRENCY", PUSH_CONCURRENCY.to_string())
            .env("TASKBROKER_PUSH_QUEUE_SIZE", "16")
            .env("TASKBROKER_FETCH_BATCH_SIZE", "16")
            .env("TASKBROKER_PUSH_TIMEOUT_MS", "2000")
            .env("TASKBROKER_UPKEEP_INTERVAL_MS", "100")
            .env("TASKBROKER_RESTART_GRACE_SEC", "0")
            .env("TASKBROKER_PROCESSING_DEADLINE_GRACE_SEC", "0")
            .env("TASKBROKER_INSERT_BATCH_MAX_MS", "20")
            .env(
                "TASKBROKER_KAFKA_CONFIG",
                "session.timeout.ms=6000,heartbeat.interval.ms=500",
            )
            .stdout(Stdio::from(stderr.try_clone().expect("log file")))
            .stderr(Stdio::from(stderr))
            .spawn()
            .expect("start the broker binary");
        Broker {
            id,
            child,
            grpc,
            metrics,
            log,
        }
    }

    fn callback_url(&self) -> String {
        format!("127.0.0.1:{}", self.grpc)
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill(1)");
        assert!(status.success(), "kill {signal} {}", self.child.id());
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log.0).unwrap_or_default()
    }

    /// A counter of this broker's `/metrics` (0 when absent).
    async fn counter(&self, series: &str) -> f64 {
        let addr = format!("127.0.0.1:{}", self.metrics).parse().unwrap();
        let (status, text) = http_get(addr, "/metrics").await;
        assert_eq!(status, 200);
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|value| value.parse().ok())
            .unwrap_or(0.0)
    }
}

/// Ids of the rows `broker` holds Claimed.
async fn claims_of(db: &TestStore, broker: &str) -> HashSet<String> {
    let TestStore::Postgres(db) = db else {
        unreachable!("these cases run on PostgreSQL")
    };
    db.client()
        .await
        .query(
            "SELECT id FROM inflight_taskactivations \
             WHERE status = 'Claimed' AND claimed_by = $1",
            &[&broker],
        )
        .await
        .expect("read claims")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

struct Scenario {
    db: TestStore,
    _kafka: MockKafka,
    worker: DemoWorker,
    ids: HashSet<String>,
    victim: Broker,
    peer: Broker,
    _leftovers: KillOnDrop,
}

impl Scenario {
    /// Two brokers working through `TASKS` tasks, until the victim holds
    /// claims it has not pushed yet.
    async fn start(name: &str) -> Scenario {
        let db = TestStore::new(Backend::Postgres).await;
        // Migrated before the brokers start, so the test can read the table.
        drop(db.store().await);
        let kafka = MockKafka::start();
        kafka.create_topic("tasks", 4);
        let worker = FakeWorker::start(Mode::Execute {
            delay: Duration::from_millis(100),
        })
        .await;
        let ids: HashSet<String> = (0..TASKS).map(|i| format!("{name}-{i}")).collect();
        kafka.produce("tasks", &encoded_tasks(&ids, name, 3)).await;
        let victim = Broker::start(&db, &kafka, &worker, "broker-victim");
        let peer = Broker::start(&db, &kafka, &worker, "broker-peer");
        let leftovers = KillOnDrop(vec![victim.child.id(), peer.child.id()]);
        // Every record stored and committed first: a record read again
        // after the group rebalances is a new row (the first run of it
        // finished and was deleted), pushed again by whoever reads it.
        // That is Kafka's at-least-once, not what these cases measure.
        wait_until(
            "every record is committed",
            Duration::from_secs(60),
            || async {
                kafka
                    .committed("taskbroker", "tasks", 4)
                    .iter()
                    .sum::<i64>()
                    == TASKS as i64
            },
        )
        .await;
        wait_until(
            "the victim holds claims beyond its push slots",
            Duration::from_secs(60),
            || async { claims_of(&db, victim.id).await.len() > PUSH_CONCURRENCY * 2 },
        )
        .await;
        Scenario {
            db,
            _kafka: kafka,
            worker,
            ids,
            victim,
            peer,
            _leftovers: leftovers,
        }
    }

    /// Waits until the peer has delivered each of `claims` after `since`.
    async fn wait_for_peer_to_push(&self, claims: &HashSet<String>, since: Instant) {
        let peer = self.peer.callback_url();
        wait_until(
            "the peer pushed every claim of the victim again",
            Duration::from_secs(60),
            || async {
                let pushed: HashSet<String> = self
                    .worker
                    .seen
                    .deliveries()
                    .into_iter()
                    .filter(|delivery| delivery.callback_url == peer && delivery.at > since)
                    .map(|delivery| delivery.id)
                    .collect();
                claims.is_subset(&pushed)
            },
        )
        .await;
    }

    /// Waits until every task was delivered and finished (no row left).
    async fn wait_for_every_task(&self) {
        wait_until(
            "every task delivered and finished",
            Duration::from_secs(120),
            || async {
                let delivered: HashSet<String> = self
                    .worker
                    .seen
                    .deliveries()
                    .into_iter()
                    .map(|delivery| delivery.id)
                    .collect();
                self.ids.is_subset(&delivered) && self.db.rows().await.is_empty()
            },
        )
        .await;
    }
}

#[actix_rt::test]
async fn a_killed_broker_s_claims_are_pushed_again_by_its_peer_after_the_takeover() {
    let mut scenario = Scenario::start("killed").await;
    scenario.victim.child.kill().expect("SIGKILL the victim");
    let killed_at = Instant::now();
    let _ = scenario.victim.child.wait();
    let stranded = claims_of(&scenario.db, scenario.victim.id).await;
    assert!(!stranded.is_empty(), "the kill caught claims");

    scenario.wait_for_peer_to_push(&stranded, killed_at).await;
    let peer = &scenario.peer;
    assert!(
        peer.counter("taskbroker_broker_takeovers_total").await >= 1.0,
        "{}",
        peer.log()
    );
    assert!(
        peer.counter("taskbroker_claims_released_total{reason=\"takeover\"}")
            .await
            >= stranded.len() as f64
    );
    assert_eq!(
        peer.counter("taskbroker_claims_released_total{reason=\"lease_expired\"}")
            .await,
        0.0
    );
    assert!(
        peer.log().contains("took over a silent broker"),
        "one line per takeover:\n{}",
        peer.log()
    );
    // Nothing lost: the peer finishes what the victim held or had read.
    scenario.wait_for_every_task().await;
}

#[actix_rt::test]
async fn a_frozen_broker_resumed_after_its_takeover_pushes_none_of_the_claims_taken_from_it() {
    let scenario = Scenario::start("frozen").await;
    let victim = &scenario.victim;
    victim.signal("-STOP");
    let frozen_at = Instant::now();
    // Its statements in flight have ended or wait on its frozen socket.
    let held = claims_of(&scenario.db, victim.id).await;
    assert!(!held.is_empty(), "the freeze caught claims");

    scenario.wait_for_peer_to_push(&held, frozen_at).await;
    assert!(
        scenario
            .peer
            .counter("taskbroker_broker_takeovers_total")
            .await
            >= 1.0
    );
    victim.signal("-CONT");
    let resumed_at = Instant::now();
    scenario.wait_for_every_task().await;

    // The resumed broker still held those claims in its queue; it pushed
    // none of them. Pushes it had sent before the freeze (at most its
    // push slots) are the at-least-once allowance.
    let mine = victim.callback_url();
    let pushed_again: Vec<String> = scenario
        .worker
        .seen
        .deliveries()
        .into_iter()
        .filter(|delivery| {
            delivery.callback_url == mine && delivery.at > resumed_at && held.contains(&delivery.id)
        })
        .map(|delivery| delivery.id)
        .collect();
    assert!(
        pushed_again.len() <= PUSH_CONCURRENCY,
        "the resumed broker pushed {} claims a peer had taken over: {pushed_again:?}\n{}",
        pushed_again.len(),
        victim.log()
    );
    let refused = victim
        .counter("taskbroker_pushes_total{result=\"not_live\"}")
        .await;
    assert!(refused >= 1.0, "its liveness refused the held claims");
    // Its first heartbeat after resuming finds the row gone (the peer may
    // have finished every task before that heartbeat ran).
    wait_until(
        "the victim says it was taken over",
        Duration::from_secs(30),
        || async { victim.log().contains("this broker's row was taken over") },
    )
    .await;
    // Every task ran; the only duplicates are deliveries whose outcome
    // was still open at the freeze.
    let mut counts: HashMap<String, usize> = HashMap::new();
    for delivery in scenario.worker.seen.deliveries() {
        *counts.entry(delivery.id).or_default() += 1;
    }
    assert_eq!(counts.len(), TASKS);
}

/// Two processes given the same `TASKBROKER_BROKER_ID` (a ConfigMap
/// naming every replica alike): the second sees the first's heartbeat
/// moving and refuses to start, naming the variable, instead of releasing
/// the first's claims as a restart would.
#[actix_rt::test]
async fn a_second_broker_with_a_running_broker_s_id_refuses_to_start() {
    let db = TestStore::new(Backend::Postgres).await;
    drop(db.store().await);
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 1);
    let worker = FakeWorker::start(Mode::accept()).await;
    let mut first = Broker::start(&db, &kafka, &worker, "same-id");
    let mut leftovers = KillOnDrop(vec![first.child.id()]);
    let TestStore::Postgres(pg) = &db else {
        unreachable!()
    };
    let client = pg.client().await;
    wait_until(
        "the first broker registered",
        Duration::from_secs(30),
        || async {
            client
                .query_one("SELECT count(*) FROM taskbroker_brokers", &[])
                .await
                .map(|row| row.get::<_, i64>(0) == 1)
                .unwrap_or(false)
        },
    )
    .await;
    let mut second = Broker::start(&db, &kafka, &worker, "same-id");
    leftovers.0.push(second.child.id());
    let exit = tokio::task::spawn_blocking(move || {
        let exit = second.child.wait().expect("wait for the second broker");
        (exit, second)
    });
    let (exit, second) = tokio::time::timeout(Duration::from_secs(60), exit)
        .await
        .expect("the second broker exits")
        .unwrap();
    assert!(!exit.success(), "{}", second.log());
    assert!(
        second
            .log()
            .contains("another running broker uses TASKBROKER_BROKER_ID=same-id"),
        "{}",
        second.log()
    );
    // The first one kept its row and runs on.
    assert!(
        first
            .child
            .try_wait()
            .expect("poll the first broker")
            .is_none(),
        "the first broker exited:\n{}",
        first.log()
    );
    let row = client
        .query_one(
            "SELECT count(*) FROM taskbroker_brokers WHERE id = 'same-id'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 1);
}
