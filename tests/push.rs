//! Push delivery end to end: StoreActor on real PostgreSQL (and SQLite for
//! the cases `on_both_backends!` names), FetchActors,
//! the PushPoolActor, and fake workers that are real tonic servers on
//! loopback.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use chrono::{DateTime, Utc};
use common::worker::{DemoWorker, FakeWorker, Mode};
use common::{Backend, TestStore, rows, wait_until};
use taskbroker::actors::StoreActor;
use taskbroker::actors::fetch::FetchConfig;
use taskbroker::actors::push_pool::{PushPoolConfig, StopPushPool};
use taskbroker::actors::store::{ClaimBatch, MarkPushed, ReleaseClaims};
use taskbroker::broker::{PushPipeline, PushPipelineConfig};
use taskbroker::config::WorkerEndpoints;
use taskbroker::metrics::Metrics;
use taskbroker::store::{ActivationStatus, ActivationStore, BucketRange};

on_both_backends!(
    happy_path_pushes_every_activation_exactly_once,
    saturated_pool_releases_each_unsubmitted_batch_in_one_statement,
    late_push_success_after_a_new_claim_is_stale,
);

/// Margin the derived lease adds for the mark-processing write.
const LEASE_MARGIN: Duration = Duration::from_secs(5);

struct Harness {
    db: TestStore,
    store: Arc<dyn ActivationStore>,
    store_actor: Addr<StoreActor>,
    metrics: Arc<Metrics>,
}

impl Harness {
    async fn new() -> Harness {
        Harness::on(Backend::Postgres).await
    }

    async fn on(backend: Backend) -> Harness {
        let db = TestStore::new(backend).await;
        let store = db.store().await;
        let metrics = Arc::new(Metrics::new());
        let store_actor = common::start_store_actor(store.clone(), Arc::clone(&metrics));
        Harness {
            db,
            store,
            store_actor,
            metrics,
        }
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
    PushPipelineConfig {
        fetch_actors: 4,
        fetch: FetchConfig {
            batch_size: 64,
            backoff: Duration::from_millis(20),
            queue_timeout: Duration::from_millis(500),
            lease: Duration::from_secs(30),
            release_on_full: true,
        },
        push: PushPoolConfig {
            concurrency: 32,
            queue_size: 64,
            push_timeout: Duration::from_secs(2),
            deadline_grace: Duration::from_secs(3),
            max_attempts: 5,
            callback_url: "broker.test:50051".to_owned(),
            signing_secret: None,
            endpoints: endpoints(workers),
        },
    }
}

/// The claim lease as DESIGN.md derives it.
fn derived_lease(config: &PushPipelineConfig) -> Duration {
    let push = &config.push;
    let waits = push.queue_size.div_ceil(push.concurrency) as u32;
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
            let token = taskbroker::store::ClaimToken {
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
    let claim = |lease| ClaimBatch {
        buckets: BucketRange::ALL,
        limit: 10,
        lease,
    };
    let first = harness
        .store_actor
        .send(claim(Duration::ZERO))
        .await
        .unwrap()
        .unwrap();
    let old = first[0].claim_token().unwrap();
    // The lease ran out, upkeep returned it, and another fetch claimed it.
    harness.store.release_expired_claims(10).await.unwrap();
    let second = harness
        .store_actor
        .send(claim(Duration::from_secs(30)))
        .await
        .unwrap()
        .unwrap();
    let current = second[0].claim_token().unwrap();

    let grace = Duration::from_secs(1);
    let late = harness
        .store_actor
        .send(MarkPushed {
            claim: old.clone(),
            deadline_grace: grace,
        })
        .await
        .unwrap();
    assert_eq!(late, Ok(false), "a stale success changes nothing");
    let released = harness
        .store_actor
        .send(ReleaseClaims { claims: vec![old] })
        .await
        .unwrap();
    assert_eq!(released, Ok(0), "a stale release changes nothing");
    let row = harness.store.get("fence-0").await.unwrap().unwrap();
    assert_eq!(row.status, ActivationStatus::Claimed);
    assert_eq!(row.claim_expires_at, Some(current.claim_expires_at));

    let fresh = harness
        .store_actor
        .send(MarkPushed {
            claim: current,
            deadline_grace: grace,
        })
        .await
        .unwrap();
    assert_eq!(fresh, Ok(true));
}

/// The stranded-claim benchmark's "before" switch really restores the older
/// behaviour: with release-on-full off, a batch that cannot be submitted
/// keeps its claims (held by nobody) instead of returning them to Pending.
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

    wait_until(
        "a submit times out on the full pool",
        Duration::from_secs(20),
        || async { Metrics::count(&harness.metrics.submits, "timeout") > 0 },
    )
    .await;
    // A push hangs in the slot and one or two wait in the pool; the rest of
    // the batch stays Claimed with nobody holding it.
    let held = pipeline.registry.snapshot();
    let claimed = harness.claimed().await;
    let unheld = claimed
        .iter()
        .filter(|(id, expires)| {
            !held.contains(&taskbroker::store::ClaimToken {
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
        .send(ClaimBatch {
            buckets: BucketRange::ALL,
            limit: 200,
            lease: Duration::from_secs(30),
        })
        .await
        .unwrap()
        .unwrap();
    let replies = futures::future::join_all(claimed.iter().map(|row| {
        harness.store_actor.send(MarkPushed {
            claim: row.claim_token().unwrap(),
            deadline_grace: Duration::from_secs(1),
        })
    }))
    .await;
    assert!(
        replies
            .into_iter()
            .all(|reply| matches!(reply, Ok(Ok(true))))
    );
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
    wait_until(
        "the fetch actor finds the pool full",
        Duration::from_secs(10),
        || {
            let full = Metrics::count(&metrics.submits, "full");
            async move { full > 0 }
        },
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
    let pipeline = harness.start(config(&[&worker]));

    tokio::time::sleep(Duration::from_secs(3)).await; // the outage itself
    let attempts_while_down = worker.seen.attempts();
    worker.set_mode(Mode::accept());

    harness
        .wait_for(ActivationStatus::Processing, ROWS, Duration::from_secs(30))
        .await;
    pipeline.stop().await;
    // Unthrottled, 32 slots retrying an instant failure make thousands of
    // attempts in 3 s; the backoff allows the first burst and then about
    // one probe per backoff period.
    assert!(
        attempts_while_down < 32 + 40,
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
    let metrics = Arc::clone(&harness.metrics);
    wait_until(
        "pushes are refused as busy",
        Duration::from_secs(10),
        || {
            let busy = Metrics::count(&metrics.pushes, "busy");
            async move { busy > 0 }
        },
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
    // their time budget waiting for the backed-off endpoint count as
    // timeouts too. Each was undone, none consumed an attempt.
    let timeouts = harness.pushes("timeout");
    assert!(timeouts >= ROWS, "{timeouts} timeouts");
    assert_eq!(
        Metrics::count(&harness.metrics.claims_released, "push_failed"),
        timeouts
    );
    assert_eq!(harness.pushes("stale"), 0);
    assert_eq!(harness.attempts_consumed().await, 0);
}

#[actix_rt::test]
async fn unroutable_activations_consume_attempts_until_failure() {
    let harness = Harness::new().await;
    let worker = FakeWorker::start(Mode::accept()).await;
    let mut config = config(&[&worker]);
    config.push.endpoints =
        WorkerEndpoints::parse(&format!("other-app={}", worker.url())).expect("endpoints");
    config.push.max_attempts = 3;
    harness.insert("lost", 10).await; // application "app": no endpoint
    let pipeline = harness.start(config);
    harness
        .wait_for(ActivationStatus::Failure, 10, Duration::from_secs(30))
        .await;
    pipeline.stop().await;
    assert_eq!(harness.pushes("unroutable"), 30);
    assert_eq!(harness.attempts_consumed().await, 30);
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
    let metrics = Arc::clone(&harness.metrics);
    wait_until("pushes fail", Duration::from_secs(10), || {
        let errors = Metrics::count(&metrics.pushes, "error");
        async move { errors >= 5 }
    })
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
    assert_eq!(Metrics::count(&metrics.pushes, "ok"), 10);
    pipeline.stop().await;
}
