//! The FetchActor against a fake neighbour: its push pool is any actor that
//! takes `PushActivation`, here one whose mailbox (capacity 1) is never
//! drained because the actor never runs. The store is a real SQLite store in
//! a temporary file. This pins the handoff rule of `fetch.rs`: what the pool
//! never took goes back to Pending in one release statement once the queue
//! timeout has passed, and with one sender handle the stuck pool takes
//! exactly one message.

mod common;

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use taskbroker::actors::FetchActor;
use taskbroker::actors::StoreHandle;
use taskbroker::actors::claims::ClaimRegistry;
use taskbroker::actors::fetch::{FetchConfig, StopFetching};
use taskbroker::actors::push_pool::PushActivation;
use taskbroker::metrics::Metrics;
use taskbroker::model::{ActivationStatus, BucketRange};
use taskbroker::store::ActivationStore;

const BATCH: usize = 8;
/// Bound on every wait for an event; reaching it fails the test.
const WAIT: Duration = Duration::from_secs(10);

/// A push pool that accepts `PushActivation` and never handles one.
struct StuckPool;

impl Actor for StuckPool {
    type Context = Context<Self>;
}

impl Handler<PushActivation> for StuckPool {
    type Result = ();

    fn handle(&mut self, _: PushActivation, _: &mut Self::Context) {
        unreachable!("the stuck pool never runs");
    }
}

/// A FetchActor over every bucket, handing its claims to `pool`: no second
/// claim within a test (the first iteration is the one under test), and a
/// 50 ms queue timeout.
fn start_fetcher(
    handle: &StoreHandle,
    pool: Recipient<PushActivation>,
    registry: &ClaimRegistry,
    metrics: &Arc<Metrics>,
) -> Addr<FetchActor> {
    FetchActor::new(
        BucketRange::ALL,
        FetchConfig {
            batch_size: BATCH,
            batch_bytes: 16 << 20,
            backoff: Duration::from_secs(3600),
            queue_timeout: Duration::from_millis(50),
            lease: Duration::from_secs(60),
            fair_dispatch: true,
            #[cfg(feature = "test-hooks")]
            release_on_full: true,
        },
        handle.clone(),
        pool,
        registry.clone(),
        Arc::clone(metrics),
    )
    .start()
}

/// Waits until the fetcher's submit timed out on `why`, then stops it: the
/// release runs before the iteration ends, so once the actor answers a
/// message sent after the timeout, the iteration is done.
async fn until_the_submit_times_out(fetcher: &Addr<FetchActor>, metrics: &Metrics, why: &str) {
    common::wait_for_count(
        &format!("the submit times out on {why}"),
        WAIT,
        &metrics.submits,
        "timeout",
        1,
    )
    .await;
    fetcher
        .send(StopFetching)
        .await
        .expect("fetch actor answers");
}

#[actix_rt::test]
async fn a_stuck_push_pool_gets_the_batch_released_in_one_statement() {
    let db = common::TestSqlite::new();
    let store: Arc<dyn ActivationStore> = db.store().await;
    common::insert(store.as_ref(), &common::rows("stuck", BATCH)).await;
    let metrics = Arc::new(Metrics::new());
    let handle =
        StoreHandle::start(Arc::clone(&store), Arc::clone(&metrics)).expect("store threads start");

    // Never started: its mailbox takes messages and nothing takes them out.
    let mut pool: Context<StuckPool> = Context::new();
    pool.set_mailbox_capacity(1);
    let registry = ClaimRegistry::new();
    let fetcher = start_fetcher(&handle, pool.address().recipient(), &registry, &metrics);

    until_the_submit_times_out(&fetcher, &metrics, "the stuck pool").await;

    // One sender handle: a mailbox of capacity 1 took one message, the
    // sender was then parked and every later try got `Full` back.
    assert_eq!(Metrics::count(&metrics.submits, "ok"), 1);
    assert_eq!(Metrics::count(&metrics.submits, "timeout"), 1);
    assert_eq!(
        registry.len(),
        1,
        "only the message in the mailbox holds a claim"
    );
    // The rest of the batch went back in one statement.
    assert_eq!(metrics.store_calls("release_claims"), 1);
    assert_eq!(
        Metrics::count(&metrics.claims_released, "queue_timeout"),
        BATCH as u64 - 1
    );
    let counts = store.count_by_status().await.expect("count");
    assert_eq!(counts.get(ActivationStatus::Pending), BATCH as u64 - 1);
    assert_eq!(counts.get(ActivationStatus::Claimed), 1);
    let held = registry.snapshot();
    let still_claimed = db_claimed(&db).await;
    assert_eq!(
        still_claimed,
        held.iter()
            .map(|token| token.id.clone())
            .collect::<Vec<_>>(),
        "the one Claimed row is the one the pool's mailbox holds"
    );
    assert_eq!(
        attempts_consumed(store.as_ref()).await,
        0,
        "releasing consumes no attempt"
    );

    // The pool goes away with the message still in its mailbox: the guard
    // releases its claim itself, and nothing stays Claimed or held.
    drop(pool);
    common::wait_until("the dropped message's claim is released", WAIT, || {
        let store = Arc::clone(&store);
        async move {
            let counts = store.count_by_status().await.expect("count");
            counts.get(ActivationStatus::Pending) == BATCH as u64
        }
    })
    .await;
    assert!(registry.is_empty());
    assert_eq!(metrics.store_calls("release_claims"), 2);
    assert_eq!(Metrics::count(&metrics.claims_released, "dropped"), 1);
    assert_eq!(attempts_consumed(store.as_ref()).await, 0);
}

/// PUSH_QUEUE_BYTES: however roomy the pool's mailbox, a FetchActor hands
/// it no more activation bytes than the budget (plus one activation when
/// it holds none); the rest waits as on a full mailbox and is released
/// after the queue timeout, and the bytes come back when the guards go.
#[actix_rt::test]
async fn the_push_pool_takes_no_more_bytes_than_its_budget() {
    let db = common::TestSqlite::new();
    let store: Arc<dyn ActivationStore> = db.store().await;
    let size = 100 << 10;
    let rows: Vec<_> = common::rows("stuck", BATCH)
        .into_iter()
        .map(|mut row| {
            row.activation = vec![1; size];
            row
        })
        .collect();
    common::insert(store.as_ref(), &rows).await;
    let metrics = Arc::new(Metrics::new());
    let handle =
        StoreHandle::start(Arc::clone(&store), Arc::clone(&metrics)).expect("store threads start");
    let mut pool: Context<StuckPool> = Context::new();
    pool.set_mailbox_capacity(100);
    // Room for two of the activations, not three.
    let registry = ClaimRegistry::new().with_push_bytes(2 * size + size / 2);
    let fetcher = start_fetcher(&handle, pool.address().recipient(), &registry, &metrics);
    until_the_submit_times_out(&fetcher, &metrics, "the full byte budget").await;
    assert_eq!(Metrics::count(&metrics.submits, "ok"), 2);
    assert_eq!(registry.push_bytes().held(), 2 * size);
    assert_eq!(
        Metrics::count(&metrics.claims_released, "queue_timeout"),
        BATCH as u64 - 2
    );
    drop(pool);
    common::wait_until("the pool's claims are released", WAIT, || {
        let store = Arc::clone(&store);
        async move {
            let counts = store.count_by_status().await.expect("count");
            counts.get(ActivationStatus::Pending) == BATCH as u64
        }
    })
    .await;
    assert_eq!(registry.push_bytes().held(), 0, "the bytes came back");
}

/// Ids of the Claimed rows.
async fn db_claimed(db: &common::TestSqlite) -> Vec<String> {
    db.query(
        "SELECT id FROM inflight_taskactivations WHERE status = 'Claimed'",
        |row| row.get(0),
    )
}

async fn attempts_consumed(store: &dyn ActivationStore) -> i32 {
    let mut attempts = 0;
    for i in 0..BATCH {
        let row = store
            .get(&format!("stuck-{i}"))
            .await
            .expect("get")
            .expect("row stored");
        attempts += row.processing_attempts;
    }
    attempts
}

/// Counts the events of this thread whose message contains `needle`.
struct CountMessages {
    needle: &'static str,
    seen: Arc<std::sync::atomic::AtomicU64>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountMessages {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        if message.0.contains(self.needle) {
            self.seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// While the store is away every claim fails and is retried every backoff;
/// the warning is logged once per interval, not once per attempt (the
/// store metrics count each failure).
#[actix_rt::test]
async fn claims_failing_during_an_outage_are_logged_once_per_interval() {
    use tracing_subscriber::layer::SubscriberExt as _;
    let seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let subscriber = tracing_subscriber::registry().with(CountMessages {
        needle: "claim failed",
        seen: Arc::clone(&seen),
    });
    // This thread runs the test's actors (actix's test runtime).
    let _logs = tracing::subscriber::set_default(subscriber);

    // Nothing listens on port 1: every connection is refused at once.
    let store: Arc<dyn ActivationStore> = Arc::new(
        taskbroker::store::PostgresStore::connect(&taskbroker::store::PostgresStoreConfig {
            connect_timeout: Duration::from_millis(200),
            ..taskbroker::store::PostgresStoreConfig::new("postgres://postgres@127.0.0.1:1/none")
        })
        .expect("store config"),
    );
    let metrics = Arc::new(Metrics::new());
    let handle =
        StoreHandle::start(Arc::clone(&store), Arc::clone(&metrics)).expect("store threads start");
    let pool: Context<StuckPool> = Context::new();
    let fetcher = FetchActor::new(
        BucketRange::ALL,
        FetchConfig {
            batch_size: BATCH,
            batch_bytes: 16 << 20,
            backoff: Duration::from_millis(5),
            queue_timeout: Duration::from_millis(50),
            lease: Duration::from_secs(60),
            fair_dispatch: true,
            #[cfg(feature = "test-hooks")]
            release_on_full: true,
        },
        handle,
        pool.address().recipient(),
        ClaimRegistry::new(),
        Arc::clone(&metrics),
    )
    .start();
    const ATTEMPTS: u64 = 20;
    common::wait_until("claims keep failing", WAIT, || {
        let failed = metrics
            .store_errors
            .with_label_values(&["claim_for_push", "unavailable"])
            .get();
        async move { failed >= ATTEMPTS }
    })
    .await;
    fetcher
        .send(StopFetching)
        .await
        .expect("fetch actor answers");
    let lines = seen.load(std::sync::atomic::Ordering::SeqCst);
    // At most one: the first failure (another test of this binary may have
    // used the process's line for this interval).
    assert!(
        lines <= 1,
        "{lines} 'claim failed' lines for {ATTEMPTS}+ failed claims"
    );
}
