//! The PushPoolActor against a fake neighbour: a real tonic WorkerService on
//! loopback that accepts every PushTask and never answers, counting the
//! requests it holds. The store is a real SQLite store in a temporary file.
//! This pins, without a clock, what a hung worker may cost: never more than
//! `concurrency` pushes in flight to it, every push ends as `timeout`, each
//! claim goes back to Pending with no attempt consumed (or to Failure for an
//! at_most_once task the worker may have received), and no activation is
//! pushed twice while its claim is held.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use actix::prelude::*;
use taskbroker::actors::StoreHandle;
use taskbroker::actors::claims::{ClaimGuard, ClaimRegistry};
use taskbroker::actors::push_pool::{PushActivation, PushPoolActor, PushPoolConfig};
use taskbroker::config::WorkerEndpoints;
use taskbroker::metrics::Metrics;
use taskbroker::model::{ActivationStatus, BucketRange};
use taskbroker::proto::worker_service_server::{WorkerService, WorkerServiceServer};
use taskbroker::proto::{PushTaskRequest, PushTaskResponse};
use taskbroker::store::ActivationStore;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

const CONCURRENCY: usize = 4;
/// Three pool-fulls: the first all reach the worker at once, the rest meet
/// the endpoint's backoff.
const TASKS: usize = 3 * CONCURRENCY;
/// Of which the first this many are at_most_once, so some of those are in
/// the first wave that certainly reaches the worker.
const AT_MOST_ONCE: usize = 2;
/// Bound on every wait for an event; reaching it fails the test.
const WAIT: Duration = Duration::from_secs(30);

/// What the hung worker holds and has held.
#[derive(Default)]
struct Held {
    now: AtomicUsize,
    most: AtomicUsize,
    /// Task id → how many PushTask requests for it arrived.
    received: Mutex<HashMap<String, usize>>,
}

impl Held {
    fn received(&self) -> HashMap<String, usize> {
        self.received
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Counts a request as held until the client gives up on it (its stream is
/// reset and the handler's future dropped).
struct Holding(Arc<Held>);

impl Drop for Holding {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
}

struct HungWorker(Arc<Held>);

#[tonic::async_trait]
impl WorkerService for HungWorker {
    async fn push_task(
        &self,
        request: Request<PushTaskRequest>,
    ) -> Result<Response<PushTaskResponse>, Status> {
        let held = Arc::clone(&self.0);
        let now = held.now.fetch_add(1, Ordering::SeqCst) + 1;
        held.most.fetch_max(now, Ordering::SeqCst);
        let _holding = Holding(Arc::clone(&held));
        let id = request
            .into_inner()
            .task
            .map(|task| task.id)
            .unwrap_or_default();
        *held
            .received
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(id)
            .or_default() += 1;
        std::future::pending::<()>().await;
        unreachable!("a hung worker never answers")
    }
}

/// Serves the hung worker on a loopback port; returns its URL.
async fn start_hung_worker(held: Arc<Held>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("listen on loopback");
    let addr = listener.local_addr().expect("bound address");
    tokio::spawn(
        Server::builder()
            .add_service(WorkerServiceServer::new(HungWorker(held)))
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    format!("http://{addr}")
}

#[actix_rt::test]
async fn a_hung_worker_gets_at_most_concurrency_pushes_and_every_claim_comes_back() {
    let held = Arc::new(Held::default());
    let url = start_hung_worker(Arc::clone(&held)).await;

    let db = common::TestSqlite::new();
    let store: Arc<dyn ActivationStore> = db.store().await;
    let mut rows = common::rows("hung", TASKS);
    for row in &mut rows[..AT_MOST_ONCE] {
        row.at_most_once = true;
    }
    common::insert(store.as_ref(), &rows).await;
    let metrics = Arc::new(Metrics::new());
    let handle =
        StoreHandle::start(Arc::clone(&store), Arc::clone(&metrics)).expect("store threads start");
    let registry = ClaimRegistry::new();
    let config = PushPoolConfig {
        concurrency: CONCURRENCY,
        queue_size: TASKS,
        queue_bytes: 64 << 20,
        push_timeout: Duration::from_millis(500),
        deadline_grace: Duration::from_secs(3),
        max_attempts: 5,
        callback_url: "broker.test:50051".to_owned(),
        signing_secret: None,
        endpoints: WorkerEndpoints::parse(&format!("*={url}")).expect("worker endpoints"),
        tls: Default::default(),
        spread: Default::default(),
    };
    PushPoolActor::validate(&config).expect("valid push config");
    let pool = PushPoolActor::new(
        config,
        handle.clone(),
        Arc::clone(&metrics),
        registry.clone(),
    )
    .start();

    // Claimed in `added_at` order, so the at_most_once rows come first and
    // are in the first wave.
    let claimed = store
        .claim_for_push(BucketRange::ALL, TASKS, Duration::from_secs(60))
        .await
        .expect("claim");
    assert_eq!(claimed.len(), TASKS);
    let at_most_once: Vec<String> = claimed
        .iter()
        .filter(|c| c.activation.at_most_once)
        .map(|c| c.activation.id.clone())
        .collect();
    assert_eq!(at_most_once.len(), AT_MOST_ONCE);
    for claimed in claimed {
        let claim = ClaimGuard::new(
            claimed.token,
            registry.clone(),
            handle.clone(),
            Arc::clone(&metrics),
        );
        pool.do_send(PushActivation {
            activation: claimed.activation,
            claim,
        });
    }

    // The first wave: every slot's push reaches the worker and hangs there.
    common::wait_until("a pool-full of pushes hangs on the worker", WAIT, || {
        let now = held.now.load(Ordering::SeqCst);
        async move { now == CONCURRENCY }
    })
    .await;
    assert_eq!(
        metrics.worker_pushes_in_flight(),
        CONCURRENCY as i64,
        "taskbroker_worker_pushes_in_flight shows the hung pushes"
    );
    // Every push ends, and every claim is settled by its store write.
    common::wait_until("every push has ended and been written", WAIT, || {
        // Pushes that spent their time budget waiting for the endpoint's
        // backoff were never sent: `backoff`, not `timeout`.
        let ended =
            Metrics::count(&metrics.pushes, "timeout") + Metrics::count(&metrics.pushes, "backoff");
        let settled = registry.is_empty();
        async move { ended == TASKS as u64 && settled }
    })
    .await;

    assert_eq!(metrics.worker_pushes_in_flight(), 0);
    assert_eq!(
        held.most.load(Ordering::SeqCst),
        CONCURRENCY,
        "never more than `concurrency` pushes in flight to the hung worker"
    );
    for label in [
        "ok",
        "error",
        "unreachable",
        "busy",
        "too_large",
        "lease_expired",
        "unroutable",
    ] {
        assert_eq!(Metrics::count(&metrics.pushes, label), 0, "{label}");
    }
    let received = held.received();
    assert!(
        received.values().all(|&times| times == 1),
        "pushed twice while its claim was held: {received:?}"
    );
    for id in &at_most_once {
        assert!(received.contains_key(id), "{id} was in the first wave");
    }

    // Per claim: an at_most_once task the worker received has had its one
    // attempt (Failure); every other claim is back in Pending, untouched.
    let mut failed = 0;
    for row in &rows {
        let now = store.get(&row.id).await.expect("get").expect("row stored");
        if row.at_most_once && received.contains_key(&row.id) {
            assert_eq!(now.status, ActivationStatus::Failure, "{}", row.id);
            assert_eq!(now.processing_attempts, 1, "{}: its one attempt", row.id);
            failed += 1;
        } else {
            assert_eq!(now.status, ActivationStatus::Pending, "{}", row.id);
            assert_eq!(
                now.processing_attempts, 0,
                "{}: no attempt consumed",
                row.id
            );
        }
    }
    assert_eq!(
        Metrics::count(&metrics.claims_released, "push_failed"),
        (TASKS - failed) as u64,
        "each undo is one fenced release"
    );
    assert_eq!(Metrics::count(&metrics.claims_released, "dropped"), 0);
    assert_eq!(
        store
            .count_by_status()
            .await
            .expect("count")
            .get(ActivationStatus::Claimed),
        0
    );
}
