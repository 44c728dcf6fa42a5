//! Push delivery end to end: StoreActor on real PostgreSQL (and SQLite for
//! the cases `on_both_backends!` names), FetchActors,
//! the PushPoolActor, and fake workers that are real tonic servers on
//! loopback.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::worker::{
    CountingHandler, DemoWorker, FakeWorker, Mode, RecordingHandler, push_config,
};
use common::{Backend, rows, wait_for_count, wait_until};
use taskbroker::actors::push_pool::{NO_ROUTE_BACKOFF, StopPushPool};
use taskbroker::broker::{PushPipeline, PushPipelineConfig};
use taskbroker::config::WorkerEndpoints;
use taskbroker::metrics::Metrics;
use taskbroker::model::{ActivationStatus, BucketRange, InflightActivation};
use taskbroker::proto::worker_service_server::WorkerServiceServer;
use taskbroker::store::ActivationStore;

on_both_backends!(
    happy_path_pushes_every_activation_exactly_once,
    saturated_pool_releases_each_unsubmitted_batch_in_one_statement,
    late_push_success_after_a_new_claim_is_stale,
);

/// Margin the derived lease adds for the mark-processing write.
const LEASE_MARGIN: Duration = Duration::from_secs(5);

struct Harness(common::StoreFixture);

impl std::ops::Deref for Harness {
    type Target = common::StoreFixture;

    fn deref(&self) -> &common::StoreFixture {
        &self.0
    }
}

impl Harness {
    async fn new() -> Harness {
        Harness::on(Backend::Postgres).await
    }

    async fn on(backend: Backend) -> Harness {
        Harness(common::StoreFixture::on(backend).await)
    }

    async fn insert(&self, prefix: &str, n: usize) -> Vec<String> {
        let batch = rows(prefix, n);
        for chunk in batch.chunks(500) {
            self.store.insert_batch(chunk).await.expect("insert");
        }
        batch.into_iter().map(|row| row.id).collect()
    }

    fn start(&self, config: PushPipelineConfig) -> PushPipeline {
        PushPipeline::start(config, self.store_actor.clone(), Arc::clone(&self.metrics))
            .expect("pipeline starts")
    }

    async fn count(&self, status: ActivationStatus) -> u64 {
        self.store
            .count_by_status()
            .await
            .expect("count")
            .get(status)
    }

    async fn wait_for(&self, status: ActivationStatus, n: u64, limit: Duration) {
        wait_until(&format!("{n} rows are {status}"), limit, || async {
            self.count(status).await == n
        })
        .await;
    }

    /// Claimed rows: (id, claim_expires_at).
    async fn claimed(&self) -> Vec<(String, DateTime<Utc>)> {
        self.db.claimed().await
    }

    async fn attempts_consumed(&self) -> i64 {
        self.db.attempts_consumed().await
    }

    fn pushes(&self, result: &str) -> u64 {
        Metrics::count(&self.metrics.pushes, result)
    }
}

fn endpoints(workers: &[&DemoWorker]) -> WorkerEndpoints {
    let urls: Vec<String> = workers.iter().map(|worker| worker.url()).collect();
    WorkerEndpoints::parse(&format!("*={}", urls.join("|"))).expect("endpoints")
}

fn config(workers: &[&DemoWorker]) -> PushPipelineConfig {
    config_with(endpoints(workers))
}

fn config_with(endpoints: WorkerEndpoints) -> PushPipelineConfig {
    push_config(endpoints)
}

/// The claim lease as `Config::claim_lease` derives it: the mailbox holds
/// the queue size plus one message per FetchActor (one sender handle each),
/// and the pool holds one more while it waits for a slot.
fn derived_lease(config: &PushPipelineConfig) -> Duration {
    let push = &config.push;
    let waiting = push.queue_size + config.fetch_actors + 1;
    let waits = waiting.div_ceil(push.concurrency) as u32;
    config.fetch.queue_timeout + push.push_timeout * waits + push.push_timeout + LEASE_MARGIN
}

async fn happy_path_pushes_every_activation_exactly_once(backend: Backend) {
    let harness = Harness::on(backend).await;
    let mut workers = Vec::new();
    for _ in 0..8 {
        workers.push(FakeWorker::start(Mode::accept()).await);
    }
    let ids = harness.insert("happy", 5_000).await;
    let pipeline = harness.start(config(&workers.iter().collect::<Vec<_>>()));

    harness
        .wait_for(
            ActivationStatus::Processing,
            5_000,
            Duration::from_secs(120),
        )
        .await;
    pipeline.stop().await;

    let mut accepted: HashMap<String, u32> = HashMap::new();
    for worker in &workers {
        assert!(
            !worker.seen.accepted().is_empty(),
            "pushes are spread over every worker"
        );
        for id in worker.seen.accepted() {
            *accepted.entry(id).or_default() += 1;
        }
        assert_eq!(
            *worker.seen.callback_urls.lock().unwrap(),
            HashSet::from(["broker.test:50051".to_owned()])
        );
    }
    assert_eq!(
        accepted.len(),
        ids.len(),
        "every activation reached a worker"
    );
    assert!(accepted.values().all(|&n| n == 1), "none pushed twice");
    assert_eq!(harness.count(ActivationStatus::Claimed).await, 0);
    assert_eq!(harness.pushes("ok"), 5_000);
    assert_eq!(harness.pushes("stale"), 0);
    assert_eq!(harness.attempts_consumed().await, 0);
}

async fn saturated_pool_releases_each_unsubmitted_batch_in_one_statement(backend: Backend) {
    let harness = Harness::on(backend).await;
    let slow = FakeWorker::start(Mode::Accept {
        delay: Duration::from_millis(100),
    })
    .await;
    let mut config = config(&[&slow]);
    config.fetch_actors = 2;
    config.fetch.queue_timeout = Duration::from_millis(50);
    config.push.concurrency = 2;
    config.push.queue_size = 4;
    config.push.push_timeout = Duration::from_secs(2);
    let legitimate = derived_lease(&config) - LEASE_MARGIN;
    config.fetch.lease = derived_lease(&config);
    const ROWS: u64 = 300;
    harness.insert("sat", ROWS as usize).await;
    let pipeline = harness.start(config);

    // Poll the table while the pool is saturated: a Claimed row must be held
    // by a FetchActor or the push pool (its guard is registered), and none
    // may be older than its legitimate path. A row claimed a moment ago may
    // not be registered yet, so only a row seen unheld for a whole second
    // counts as stranded; stranded claims last a whole lease.
    let mut unheld_since: HashMap<(String, DateTime<Utc>), tokio::time::Instant> = HashMap::new();
    let mut polls = 0;
    let mut seen_claimed = 0;
    loop {
        let before = pipeline.registry.snapshot();
        let claimed = harness.claimed().await;
        let after = pipeline.registry.snapshot();
        let now = Utc::now();
        let mut still_unheld = HashMap::new();
        for (id, expires) in claimed.iter().cloned() {
            // Claimed at expires - lease; its legitimate path ends at
            // expires - margin.
            let age_left = expires - now;
            assert!(
                age_left > chrono::TimeDelta::from_std(LEASE_MARGIN).unwrap(),
                "claim {id} outlived its legitimate path of {legitimate:?}"
            );
            let token = taskbroker::model::ClaimToken {
                id: id.clone(),
                claim_expires_at: expires,
            };
            if before.contains(&token) || after.contains(&token) {
                continue;
            }
            let key = (id, expires);
            let since = unheld_since
                .get(&key)
                .copied()
                .unwrap_or_else(tokio::time::Instant::now);
            assert!(
                since.elapsed() < Duration::from_secs(1),
                "claim {} is Claimed but held by nobody",
                key.0
            );
            still_unheld.insert(key, since);
        }
        unheld_since = still_unheld;
        seen_claimed += claimed.len();
        polls += 1;
        if harness.count(ActivationStatus::Processing).await == ROWS {
            break;
        }
        assert!(polls < 6_000, "the saturated run did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pipeline.stop().await;

    let timeouts = Metrics::count(&harness.metrics.submits, "timeout");
    assert!(timeouts > 0, "the pool was never saturated");
    assert!(seen_claimed > 0);
    // One release statement per failed submit, each covering the rest of
    // its batch, and nothing released any other way.
    assert_eq!(harness.metrics.store_calls("release_claims"), timeouts);
    assert!(Metrics::count(&harness.metrics.claims_released, "queue_timeout") >= timeouts);
    assert_eq!(
        Metrics::count(&harness.metrics.claims_released, "dropped"),
        0
    );
    assert_eq!(harness.pushes("ok"), ROWS);
    assert_eq!(slow.seen.accepted().len() as u64, ROWS);
    assert_eq!(
        harness.attempts_consumed().await,
        0,
        "releases never consume attempts"
    );
}

async fn late_push_success_after_a_new_claim_is_stale(backend: Backend) {
    let harness = Harness::on(backend).await;
    harness.insert("fence", 1).await;
    let claim = |lease| harness.store_actor.claim(BucketRange::ALL, 10, lease, true);
    let first = claim(Duration::ZERO).await.unwrap();
    let old = first[0].claim_token().unwrap();
    // The lease ran out, upkeep returned it, and another fetch claimed it.
    harness.store.release_expired_claims(10).await.unwrap();
    let second = claim(Duration::from_secs(30)).await.unwrap();
    let current = second[0].claim_token().unwrap();

    let grace = Duration::from_secs(1);
    let late = harness
        .store_actor
        .mark_pushed(old.clone(), grace, std::time::Instant::now())
        .await;
    assert_eq!(late, Ok(false), "a stale success changes nothing");
    let released = harness.store_actor.release(vec![old]).await;
    assert_eq!(released, Ok(0), "a stale release changes nothing");
    let row = harness.store.get("fence-0").await.unwrap().unwrap();
    assert_eq!(row.status, ActivationStatus::Claimed);
    assert_eq!(row.claim_expires_at, Some(current.claim_expires_at));

    let fresh = harness
        .store_actor
        .mark_pushed(current, grace, std::time::Instant::now())
        .await;
    assert_eq!(fresh, Ok(true));
}

/// The stranded-claim benchmark's "before" switch really restores the older
/// behaviour: with release-on-full off, a batch that cannot be submitted
/// keeps its claims (held by nobody) instead of returning them to Pending.
/// The switch is read only in a `test-hooks` build.
#[cfg(feature = "test-hooks")]
#[actix_rt::test]
async fn bench_switch_leaves_unsubmitted_claims_to_their_lease() {
    let harness = Harness::new().await;
    let hang = FakeWorker::start(Mode::Hang).await;
    let mut config = config(&[&hang]);
    config.fetch_actors = 1;
    config.fetch.batch_size = 16;
    config.fetch.queue_timeout = Duration::from_millis(50);
    config.fetch.release_on_full = false;
    config.push.concurrency = 1;
    config.push.queue_size = 1;
    config.push.push_timeout = Duration::from_secs(3);
    harness.insert("strand", 16).await;
    let pipeline = harness.start(config);

    wait_for_count(
        "a submit times out on the full pool",
        Duration::from_secs(20),
        &harness.metrics.submits,
        "timeout",
        1,
    )
    .await;
    // A push hangs in the slot and one or two wait in the pool; the rest of
    // the batch stays Claimed with nobody holding it.
    let held = pipeline.registry.snapshot();
    let claimed = harness.claimed().await;
    let unheld = claimed
        .iter()
        .filter(|(id, expires)| {
            !held.contains(&taskbroker::model::ClaimToken {
                id: id.clone(),
                claim_expires_at: *expires,
            })
        })
        .count();
    assert_eq!(claimed.len(), 16);
    assert!(unheld >= 13, "only {unheld} claims were left unheld");
    assert_eq!(harness.metrics.store_calls("release_claims"), 0);
    assert_eq!(harness.count(ActivationStatus::Pending).await, 0);
    pipeline.stop().await;
}

#[actix_rt::test]
async fn concurrent_push_successes_are_combined_into_few_statements() {
    let harness = Harness::new().await;
    harness.insert("combine", 200).await;
    let claimed = harness
        .store_actor
        .claim(BucketRange::ALL, 200, Duration::from_secs(30), true)
        .await
        .unwrap();
    let replies = futures::future::join_all(claimed.iter().map(|row| {
        harness.store_actor.mark_pushed(
            row.claim_token().unwrap(),
            Duration::from_secs(1),
            std::time::Instant::now(),
        )
    }))
    .await;
    assert!(replies.into_iter().all(|reply| matches!(reply, Ok(true))));
    assert_eq!(harness.count(ActivationStatus::Processing).await, 200);
    let statements = harness.metrics.store_calls("mark_processing");
    assert!(
        statements < 200,
        "200 successes took {statements} statements: they were not combined"
    );
}

#[actix_rt::test]
async fn closed_push_pool_releases_the_unsent_batch_and_stops_fetching() {
    let harness = Harness::new().await;
    let slow = FakeWorker::start(Mode::Accept {
        delay: Duration::from_millis(300),
    })
    .await;
    let mut config = config(&[&slow]);
    config.fetch_actors = 1;
    config.fetch.queue_timeout = Duration::from_secs(60); // keep retrying Full
    config.push.concurrency = 1;
    config.push.queue_size = 1;
    harness.insert("closed", 64).await;
    let pipeline = harness.start(config);

    let metrics = Arc::clone(&harness.metrics);
    wait_for_count(
        "the fetch actor finds the pool full",
        Duration::from_secs(10),
        &metrics.submits,
        "full",
        1,
    )
    .await;
    pipeline.push_pool.do_send(StopPushPool);
    let fetcher = pipeline.fetchers[0].clone();
    wait_until("the fetch actor stops", Duration::from_secs(10), || {
        let connected = fetcher.connected();
        async move { !connected }
    })
    .await;

    let submitted = Metrics::count(&harness.metrics.submits, "ok");
    let unsent = Metrics::count(&harness.metrics.claims_released, "queue_closed");
    assert_eq!(Metrics::count(&harness.metrics.submits, "closed"), 1);
    assert_eq!(
        submitted + unsent,
        64,
        "every activation submitted or released"
    );
    // The unsent rest went back in one statement; the few that were waiting
    // in the stopped pool's mailbox released themselves.
    let dropped = Metrics::count(&harness.metrics.claims_released, "dropped");
    wait_until(
        "dropped claims are released",
        Duration::from_secs(10),
        || {
            let calls = harness.metrics.store_calls("release_claims");
            async move { calls == 1 + dropped }
        },
    )
    .await;
    // Whatever was in flight finishes; nothing stays Claimed.
    wait_until("no claim is left", Duration::from_secs(10), || async {
        harness.count(ActivationStatus::Claimed).await == 0
    })
    .await;
    let accepted = slow.seen.accepted().len() as u64;
    assert_eq!(harness.count(ActivationStatus::Processing).await, accepted);
    assert_eq!(
        harness.count(ActivationStatus::Pending).await,
        64 - accepted
    );
    assert!(pipeline.registry.is_empty());
    assert_eq!(harness.attempts_consumed().await, 0);
    pipeline.stop().await;
}

#[actix_rt::test]
async fn unavailable_workers_are_backed_off_and_nothing_is_lost() {
    let harness = Harness::new().await;
    let worker = FakeWorker::start(Mode::Unavailable).await;
    const ROWS: u64 = 200;
    harness.insert("unavail", ROWS as usize).await;
    let config = config(&[&worker]);
    let connections = config.push.spread.connections as u64;
    let pipeline = harness.start(config);

    tokio::time::sleep(Duration::from_secs(3)).await; // the outage itself
    let attempts_while_down = worker.seen.attempts();
    worker.set_mode(Mode::accept());

    harness
        .wait_for(ActivationStatus::Processing, ROWS, Duration::from_secs(30))
        .await;
    pipeline.stop().await;
    // Unthrottled, 32 slots retrying an instant failure make thousands of
    // attempts in 3 s; the backoff allows the first burst and then one
    // probe per backoff period on each of the URL's connections (9 in 3 s:
    // `a_burst_for_a_down_endpoint_gets_one_probe_per_pause`).
    assert!(
        attempts_while_down < 32 + 12 * connections,
        "{attempts_while_down} pushes to a failing endpoint in 3 s"
    );
    assert!(attempts_while_down > 0);
    assert_eq!(harness.attempts_consumed().await, 0, "no attempt consumed");
    let accepted: HashSet<String> = worker.seen.accepted().into_iter().collect();
    assert_eq!(accepted.len() as u64, ROWS, "nothing lost");
    assert_eq!(harness.pushes("ok"), ROWS);
}

#[actix_rt::test]
async fn busy_workers_are_retried_without_consuming_attempts() {
    let harness = Harness::new().await;
    let worker = FakeWorker::start(Mode::Busy).await;
    harness.insert("busy", 50).await;
    let pipeline = harness.start(config(&[&worker]));
    wait_for_count(
        "pushes are refused as busy",
        Duration::from_secs(10),
        &harness.metrics.pushes,
        "busy",
        1,
    )
    .await;
    worker.set_mode(Mode::accept());
    harness
        .wait_for(ActivationStatus::Processing, 50, Duration::from_secs(30))
        .await;
    pipeline.stop().await;
    assert_eq!(harness.attempts_consumed().await, 0);
}

#[actix_rt::test]
async fn hanging_push_times_out_and_is_undone_without_duplicates() {
    let harness = Harness::new().await;
    let worker = FakeWorker::start(Mode::HangOnFirstDelivery).await;
    let mut config = config(&[&worker]);
    config.push.push_timeout = Duration::from_millis(500);
    config.push.concurrency = 8;
    const ROWS: u64 = 20;
    harness.insert("hang", ROWS as usize).await;
    let pipeline = harness.start(config);

    harness
        .wait_for(ActivationStatus::Processing, ROWS, Duration::from_secs(60))
        .await;
    pipeline.stop().await;
    let accepted = worker.seen.accepted();
    let distinct: HashSet<&String> = accepted.iter().collect();
    assert_eq!(distinct.len() as u64, ROWS, "every activation delivered");
    // Each row went to Processing exactly once. (A worker may still see an
    // extra delivery if its OK arrives after the push timeout on a loaded
    // machine: the at-least-once case, counted as a timeout, not a second
    // Processing.)
    assert_eq!(harness.pushes("ok"), ROWS);
    // Every first delivery hung until the push timeout; pushes that spent
    // their time budget waiting for the backed-off endpoint were never sent
    // and count as `backoff`. Each was undone, none consumed an attempt.
    let timeouts = harness.pushes("timeout");
    assert!(timeouts >= ROWS, "{timeouts} timeouts");
    assert_eq!(
        Metrics::count(&harness.metrics.claims_released, "push_failed"),
        timeouts + harness.pushes("backoff")
    );
    assert_eq!(harness.pushes("stale"), 0);
    assert_eq!(harness.attempts_consumed().await, 0);
}

/// Issue 13 item 5: a `WORKER_ENDPOINTS` typo must not burn every attempt
/// in a tight loop and discard the tasks within seconds.
#[actix_rt::test]
async fn activations_without_an_endpoint_wait_in_delay_without_consuming_attempts() {
    let harness = Harness::new().await;
    let worker = FakeWorker::start(Mode::accept()).await;
    let mut config = config(&[&worker]);
    config.push.endpoints =
        WorkerEndpoints::parse(&format!("other-app={}", worker.url())).expect("endpoints");
    config.push.max_attempts = 3;
    harness.insert("lost", 10).await; // application "app": no endpoint
    let pipeline = harness.start(config);
    harness
        .wait_for(ActivationStatus::Delay, 10, Duration::from_secs(30))
        .await;
    pipeline.stop().await;
    let now = Utc::now();
    for id in (0..10).map(|i| format!("lost-{i}")) {
        let row = harness.store.get(&id).await.unwrap().expect("row kept");
        assert_eq!(row.status, ActivationStatus::Delay);
        assert_eq!(row.processing_attempts, 0, "no attempt consumed");
        let until = row.delay_until.expect("deferred until a time");
        let backoff = chrono::TimeDelta::from_std(NO_ROUTE_BACKOFF).unwrap();
        assert!(
            until > now + backoff - chrono::TimeDelta::seconds(10),
            "{until}"
        );
        assert!(until <= now + backoff, "{until}");
    }
    assert_eq!(harness.metrics.push_no_route.get(), 10);
    assert_eq!(harness.pushes("unroutable"), 10);
    assert_eq!(harness.count(ActivationStatus::Failure).await, 0);
    assert_eq!(worker.seen.attempts(), 0);
}

#[actix_rt::test]
async fn pushes_are_signed_and_workers_verify_them() {
    let harness = Harness::new().await;
    let secret = "super secret".to_owned();
    let verifying = FakeWorker::start_signed(Mode::accept(), vec![secret.clone()]).await;
    let mut config = config(&[&verifying]);
    config.push.signing_secret = Some(secret);
    harness.insert("signed", 100).await;
    let pipeline = harness.start(config);
    harness
        .wait_for(ActivationStatus::Processing, 100, Duration::from_secs(30))
        .await;
    pipeline.stop().await;
    assert_eq!(verifying.seen.accepted().len(), 100);
    assert_eq!(harness.pushes("error"), 0);
}

#[actix_rt::test]
async fn pushes_with_the_wrong_secret_are_refused_by_the_worker() {
    let harness = Harness::new().await;
    let verifying = FakeWorker::start_signed(Mode::accept(), vec!["right".to_owned()]).await;
    let mut config = config(&[&verifying]);
    config.push.signing_secret = Some("wrong".to_owned());
    harness.insert("unsigned", 5).await;
    let pipeline = harness.start(config);
    wait_for_count(
        "pushes fail",
        Duration::from_secs(10),
        &harness.metrics.pushes,
        "error",
        5,
    )
    .await;
    pipeline.stop().await;
    assert_eq!(verifying.seen.attempts(), 0, "the handler never saw them");
    assert_eq!(harness.count(ActivationStatus::Processing).await, 0);
    assert_eq!(harness.attempts_consumed().await, 0);
}

#[actix_rt::test]
async fn idle_fetch_actors_are_woken_when_rows_are_stored() {
    let harness = Harness::new().await;
    let worker = FakeWorker::start(Mode::accept()).await;
    let mut config = config(&[&worker]);
    config.fetch.backoff = Duration::from_secs(600); // only a wake-up can help
    let pipeline = harness.start(config);
    let metrics = Arc::clone(&harness.metrics);
    wait_until(
        "every fetch actor found nothing",
        Duration::from_secs(10),
        || {
            let claims = harness.metrics.store_calls("claim_for_push");
            async move { claims >= 4 }
        },
    )
    .await;
    harness.insert("woken", 10).await;
    pipeline.wake();
    harness
        .wait_for(ActivationStatus::Processing, 10, Duration::from_secs(10))
        .await;
    // Counted once the push's write returned: final once the pool drained.
    pipeline.stop().await;
    assert_eq!(Metrics::count(&metrics.pushes, "ok"), 10);
}

/// Fetchers that keep finding nothing poll less and less (the pause
/// doubles from FETCH_BACKOFF_MS up to a second), yet a wake-up still
/// claims at once. Asserted as a lower bound on the time the empty claims
/// took, which a slow machine can only lengthen.
#[actix_rt::test]
async fn idle_fetch_actors_poll_less_and_less_yet_wake_at_once() {
    let harness = Harness::new().await;
    let worker = FakeWorker::start(Mode::accept()).await;
    let mut config = config(&[&worker]);
    config.fetch.backoff = Duration::from_millis(20);
    let actors = config.fetch_actors as u64;
    let started = std::time::Instant::now();
    let pipeline = harness.start(config);
    // Six empty claims per actor: pauses of 20, 40, 80, 160 and 320 ms
    // between them (100 ms in all without the growth).
    wait_until(
        "six empty claims per actor",
        Duration::from_secs(30),
        || {
            let claims = harness.metrics.store_calls("claim_for_push");
            async move { claims >= 6 * actors }
        },
    )
    .await;
    assert!(
        started.elapsed() >= Duration::from_millis(600),
        "idle claims came every {:?}",
        started.elapsed() / 6
    );
    harness.insert("after-idle", 5).await;
    pipeline.wake();
    harness
        .wait_for(ActivationStatus::Processing, 5, Duration::from_secs(10))
        .await;
    pipeline.stop().await;
}

// ------------------------------------------------------------ issue 13

impl Harness {
    async fn insert_rows(&self, rows: &[InflightActivation]) {
        self.store.insert_batch(rows).await.expect("insert");
    }
}

/// `n` Pending at_most_once rows `{prefix}-{i}`.
fn at_most_once_rows(prefix: &str, n: usize) -> Vec<InflightActivation> {
    (0..n)
        .map(|i| {
            let mut task = common::task(&format!("{prefix}-{i}"));
            if let Some(retry) = task.retry_state.as_mut() {
                retry.at_most_once = Some(true);
            }
            common::row_from(&task)
        })
        .collect()
}

/// Calls upkeep's expired-claim step every 50 ms until dropped, counting
/// what it returns: a claim that expired while this broker held it.
struct ExpiryWatch {
    released: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl ExpiryWatch {
    fn start(store: Arc<dyn ActivationStore>) -> ExpiryWatch {
        let released = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&released);
        let task = tokio::spawn(async move {
            loop {
                if let Ok(n) = store.release_expired_claims(1000).await {
                    counter.fetch_add(n, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        ExpiryWatch { released, task }
    }

    fn released(&self) -> u64 {
        self.released.load(Ordering::SeqCst)
    }
}

impl Drop for ExpiryWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Issue 13 item 3: each sender handle may put one message beyond the
/// mailbox's capacity, so FetchActors that took a fresh handle per
/// iteration grew the queue without bound. With one handle each, the pool
/// accepts at most queue + fetch actors (mailbox) + 1 (held) + concurrency
/// (in flight), however long it stays saturated.
#[actix_rt::test]
async fn saturating_fetch_actors_never_overfill_the_push_pool_mailbox() {
    let harness = Harness::new().await;
    let mut hang = FakeWorker::start(Mode::Hang).await;
    let mut config = config(&[&hang]);
    config.fetch_actors = 4;
    config.fetch.batch_size = 8;
    config.fetch.queue_timeout = Duration::from_millis(20);
    config.fetch.backoff = Duration::from_millis(5);
    config.fetch.lease = Duration::from_secs(600);
    config.push.concurrency = 1;
    config.push.queue_size = 2;
    config.push.push_timeout = Duration::from_secs(60);
    harness.insert("flood", 200).await;
    let pipeline = harness.start(config);

    wait_for_count(
        "the fetch actors have found the pool full many times over",
        Duration::from_secs(60),
        &harness.metrics.submits,
        "timeout",
        40,
    )
    .await;
    let accepted = Metrics::count(&harness.metrics.submits, "ok");
    assert!(
        accepted <= 2 + 4 + 1 + 1,
        "the saturated pool accepted {accepted} activations"
    );
    hang.kill(); // ends the hung push, so the pipeline stops at once
    pipeline.stop().await;
    assert_eq!(harness.count(ActivationStatus::Claimed).await, 0);
}

/// Issue 13 item 3's reproduction, scaled down: one push slot, a queue of
/// one, a worker that answers just inside the push timeout. No claim may
/// expire while this broker holds it, and no task may be pushed twice.
#[actix_rt::test]
async fn slow_worker_behind_a_tiny_pool_never_gets_a_task_twice() {
    let harness = Harness::new().await;
    let slow = FakeWorker::start(Mode::Accept {
        delay: Duration::from_millis(500),
    })
    .await;
    let mut config = config(&[&slow]);
    config.fetch_actors = 2;
    config.fetch.batch_size = 10;
    config.fetch.queue_timeout = Duration::from_millis(200);
    config.push.concurrency = 1;
    config.push.queue_size = 1;
    config.push.push_timeout = Duration::from_secs(1);
    config.fetch.lease = derived_lease(&config);
    const ROWS: u64 = 30;
    harness.insert("slow", ROWS as usize).await;
    let upkeep = ExpiryWatch::start(Arc::clone(&harness.store));
    let pipeline = harness.start(config);

    harness
        .wait_for(ActivationStatus::Processing, ROWS, Duration::from_secs(120))
        .await;
    pipeline.stop().await;
    assert_eq!(
        upkeep.released(),
        0,
        "claims expired while the broker held them"
    );
    let accepted = slow.seen.accepted();
    let distinct: HashSet<&String> = accepted.iter().collect();
    assert_eq!(distinct.len() as u64, ROWS, "every task delivered");
    assert_eq!(accepted.len() as u64, ROWS, "no task pushed twice");
    assert_eq!(harness.pushes("stale"), 0);
    assert_eq!(harness.pushes("lease_expired"), 0);
}

/// An accepted push whose row moved on before the mark-processing write is
/// counted once, as `stale`, not also as `ok`: the results partition the
/// pushes, so summing them counts each push once.
#[actix_rt::test]
async fn a_stale_accepted_push_is_counted_once_as_stale() {
    let harness = Harness::new().await;
    // Answers each push a second after it arrives (the push timeout is
    // longer).
    let slow = FakeWorker::start(Mode::Accept {
        delay: Duration::from_secs(1),
    })
    .await;
    let ids = harness.insert("moved", 1).await;
    let mut config = config(&[&slow]);
    config.push.push_timeout = Duration::from_secs(10);
    config.fetch.lease = derived_lease(&config);
    let pipeline = harness.start(config);
    wait_until(
        "the push reached the worker",
        Duration::from_secs(30),
        || {
            let arrived = slow.seen.attempts();
            async move { arrived == 1 }
        },
    )
    .await;
    // While the worker holds its answer, the row goes away (as when the
    // worker's report of an earlier delivery finished it).
    assert_eq!(harness.store.delete_batch(&ids).await.unwrap(), 1);
    wait_until("the push is counted", Duration::from_secs(30), || {
        let counted = harness.pushes("ok") + harness.pushes("stale");
        async move { counted >= 1 }
    })
    .await;
    pipeline.stop().await;
    assert_eq!(harness.pushes("stale"), 1);
    assert_eq!(harness.pushes("ok"), 0, "a stale push is not also ok");
    assert_eq!(slow.seen.accepted().len(), 1);
}

/// A claim whose lease cannot cover one more push is never pushed: it is
/// returned to Pending (fenced, no attempt consumed) and counted.
#[actix_rt::test]
async fn claims_too_close_to_their_expiry_are_not_pushed() {
    let harness = Harness::new().await;
    let worker = FakeWorker::start(Mode::accept()).await;
    let mut config = config(&[&worker]);
    config.fetch_actors = 1;
    config.push.push_timeout = Duration::from_secs(2);
    config.fetch.lease = Duration::from_secs(2); // shorter than one push
    harness.insert("short", 5).await;
    let pipeline = harness.start(config);
    wait_until(
        "every claim is refused a push",
        Duration::from_secs(20),
        || async { harness.pushes("lease_expired") >= 10 },
    )
    .await;
    pipeline.stop().await;
    assert_eq!(worker.seen.attempts(), 0, "nothing pushed on a short lease");
    assert_eq!(harness.pushes("ok"), 0);
    assert_eq!(harness.count(ActivationStatus::Pending).await, 5);
    assert_eq!(harness.attempts_consumed().await, 0);
}

/// Issue 13 item 4: a push that timed out may be running on the worker; for
/// an at_most_once task that was its one attempt.
#[actix_rt::test]
async fn at_most_once_push_that_times_out_fails_the_task_after_one_delivery() {
    let harness = Harness::new().await;
    let hang = FakeWorker::start(Mode::Hang).await;
    let mut config = config(&[&hang]);
    config.push.push_timeout = Duration::from_millis(500);
    const ROWS: u64 = 4;
    harness
        .insert_rows(&at_most_once_rows("once", ROWS as usize))
        .await;
    let pipeline = harness.start(config);
    harness
        .wait_for(ActivationStatus::Failure, ROWS, Duration::from_secs(30))
        .await;
    pipeline.stop().await;
    assert_eq!(hang.seen.attempts(), ROWS, "each pushed exactly once");
    assert_eq!(harness.pushes("timeout"), ROWS);
    assert_eq!(harness.attempts_consumed().await, ROWS as i64);
    assert_eq!(
        Metrics::count(&harness.metrics.claims_released, "push_failed"),
        0
    );
}

/// Issue 13 item 4: a refused connection proves the worker never got the
/// task, so even an at_most_once task is undone and pushed again later.
#[actix_rt::test]
async fn at_most_once_push_to_a_refused_connection_is_retried_later() {
    let harness = Harness::new().await;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .unwrap();
    let config =
        config_with(WorkerEndpoints::parse(&format!("*=http://{addr}")).expect("endpoints"));
    const ROWS: u64 = 3;
    harness
        .insert_rows(&at_most_once_rows("refused", ROWS as usize))
        .await;
    let pipeline = harness.start(config);
    wait_until(
        "each push was refused at least twice",
        Duration::from_secs(20),
        || async { harness.pushes("unreachable") >= 2 * ROWS },
    )
    .await;
    // Refused connections are `unreachable` (never sent), and pushes held
    // back by the endpoint's backoff are `backoff`: neither is a timeout
    // nor an error that may have reached the worker.
    assert_eq!(harness.pushes("timeout"), 0);
    assert_eq!(harness.pushes("error"), 0);
    assert_eq!(harness.count(ActivationStatus::Failure).await, 0);
    assert_eq!(harness.attempts_consumed().await, 0);

    let worker = DemoWorker::start_on(addr, Mode::accept(), Vec::new())
        .await
        .expect("worker on the refused port");
    harness
        .wait_for(ActivationStatus::Processing, ROWS, Duration::from_secs(30))
        .await;
    pipeline.stop().await;
    assert_eq!(worker.seen.attempts(), ROWS, "delivered once each");
    assert_eq!(harness.attempts_consumed().await, 0);
}

/// A worker whose gRPC server accepts requests up to `limit` bytes and
/// counts the ones that reached its handler.
struct SmallWorker {
    addr: std::net::SocketAddr,
    handled: Arc<AtomicU64>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl SmallWorker {
    async fn start(limit: usize) -> SmallWorker {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handled = Arc::new(AtomicU64::new(0));
        let service = WorkerServiceServer::new(CountingHandler {
            handled: Arc::clone(&handled),
        })
        .max_decoding_message_size(limit);
        let stop = common::worker::serve_until_dropped(
            tonic::transport::Server::builder().add_service(service),
            listener,
        );
        SmallWorker {
            addr,
            handled,
            _stop: stop,
        }
    }
}

/// Issue 13 item 5: "too large" is not "busy". The oversized task fails
/// after one push; the small one beside it is delivered.
#[actix_rt::test]
async fn activation_too_large_for_the_worker_fails_once() {
    let harness = Harness::new().await;
    let worker = SmallWorker::start(1024).await;
    let config = config_with(
        WorkerEndpoints::parse(&format!("*=http://{}", worker.addr)).expect("endpoints"),
    );
    let mut big = common::task("big");
    big.parameters_bytes = vec![7; 4096];
    harness
        .insert_rows(&[common::row_from(&big), common::row("small")])
        .await;
    let pipeline = harness.start(config);
    harness
        .wait_for(ActivationStatus::Failure, 1, Duration::from_secs(20))
        .await;
    harness
        .wait_for(ActivationStatus::Processing, 1, Duration::from_secs(20))
        .await;
    pipeline.stop().await;
    let big = harness.store.get("big").await.unwrap().expect("row");
    assert_eq!(big.status, ActivationStatus::Failure);
    assert_eq!(harness.pushes("too_large"), 1, "failed on its first push");
    assert_eq!(harness.pushes("busy"), 0);
    assert_eq!(harness.pushes("ok"), 1);
    assert_eq!(
        worker.handled.load(Ordering::SeqCst),
        1,
        "only the small one"
    );
}

/// Issue 32: a 6 MiB task (incompressible, over tonic's default 4 MiB
/// limit) is stored and pushed byte-identical to a worker whose receive
/// limit takes it.
async fn a_six_mib_task_is_stored_and_pushed_byte_identical(backend: Backend) {
    let harness = Harness::on(backend).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let recorder = RecordingHandler::default();
    let _stop = common::worker::serve_until_dropped(
        tonic::transport::Server::builder().add_service(
            WorkerServiceServer::new(recorder.clone()).max_decoding_message_size(16 << 20),
        ),
        listener,
    );
    let mut task = common::task("six-mib");
    task.parameters_bytes = common::incompressible(6, 6 << 20);
    let row = common::row_from(&task);
    let sent = row.activation.clone();
    harness.insert_rows(&[row]).await;
    let stored = harness.store.get("six-mib").await.unwrap().expect("stored");
    assert!(stored.activation == sent, "stored byte-identical");
    let pipeline = harness.start(config_with(
        WorkerEndpoints::parse(&format!("*=http://{addr}")).expect("endpoints"),
    ));
    harness
        .wait_for(ActivationStatus::Processing, 1, Duration::from_secs(30))
        .await;
    pipeline.stop().await;
    let received = recorder.received.lock().unwrap().clone();
    assert_eq!(received.len(), 1);
    assert!(received[0] == sent, "pushed byte-identical");
    assert_eq!(harness.pushes("ok"), 1);
}

on_both_backends!(a_six_mib_task_is_stored_and_pushed_byte_identical);
