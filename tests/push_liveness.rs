//! The push pool and the broker's liveness (`actors/liveness.rs`) meeting a
//! worker connection that backs off.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::worker::{FakeWorker, Mode};
use common::{TestDb, rows, wait_for_count, wait_for_status, wait_until};
use taskbroker::actors::fetch::FetchConfig;
use taskbroker::actors::liveness::Liveness;
use taskbroker::actors::push_pool::{PushPoolConfig, SpreadConfig};
use taskbroker::broker::{PushPipeline, PushPipelineConfig};
use taskbroker::config::WorkerEndpoints;
use taskbroker::metrics::Metrics;
use taskbroker::model::ActivationStatus;
use taskbroker::store::{ActivationStore, PostgresStore};

/// While a worker is down, its connection lets one probe through per
/// pause. A probe the broker's liveness then refuses (the broker may have
/// been taken over) is released unsent; that must free the probe slot, or
/// the connection stays backing off for good and nothing reaches the worker
/// once it is back. One connection, so no other one can hide it.
#[actix_rt::test]
async fn a_probe_refused_by_liveness_leaves_the_connection_free_to_recover() {
    let db = TestDb::new().await;
    let store = Arc::new(PostgresStore::connect(&db.store_config()).unwrap());
    store.migrate().await.unwrap();
    let metrics = Arc::new(Metrics::new());
    let store_actor = common::start_store_actor(store.clone(), Arc::clone(&metrics));
    let mut worker = FakeWorker::start(Mode::accept()).await;
    let liveness = Liveness::fenced(Duration::from_secs(600));
    liveness.confirmed(Instant::now());
    let config = PushPipelineConfig {
        fetch_actors: 1,
        fetch: FetchConfig {
            batch_size: 16,
            batch_bytes: 16 << 20,
            backoff: Duration::from_millis(20),
            queue_timeout: Duration::from_millis(200),
            lease: Duration::from_secs(30),
            fair_dispatch: true,
            #[cfg(feature = "test-hooks")]
            release_on_full: true,
        },
        push: PushPoolConfig {
            concurrency: 8,
            queue_size: 16,
            queue_bytes: 64 << 20,
            // Admission waits up to half of it (1 s), longer than the
            // longest backoff pause (0.5 s): a claim waiting while the
            // worker is down is admitted as a probe.
            push_timeout: Duration::from_secs(2),
            deadline_grace: Duration::from_secs(3),
            max_attempts: 100,
            callback_url: "broker.test:50051".to_owned(),
            signing_secret: None,
            endpoints: WorkerEndpoints::parse(&format!("*={}", worker.url())).unwrap(),
            tls: Default::default(),
            spread: SpreadConfig {
                connections: 1,
                ..Default::default()
            },
        },
    };
    let pipeline =
        PushPipeline::start_fenced(config, store_actor, Arc::clone(&metrics), liveness.clone())
            .unwrap();
    let all = rows("probe", 200);
    store.insert_batch(&all[..20]).await.unwrap();
    pipeline.wake();
    wait_for_status(
        "the first rows are pushed",
        Duration::from_secs(30),
        store.as_ref(),
        ActivationStatus::Processing,
        20,
    )
    .await;

    // The worker goes away while claims keep coming: the connection backs
    // off, and the pool holds claims waiting for its next probe.
    worker.kill();
    store.insert_batch(&all[20..]).await.unwrap();
    pipeline.wake();
    wait_until("the connection backs off", Duration::from_secs(10), || {
        let backing_off = metrics.worker_connections_in("backing_off");
        async move { backing_off == 1 }
    })
    .await;
    wait_for_count(
        "a push fails against the dead worker",
        Duration::from_secs(10),
        &metrics.pushes,
        "unreachable",
        1,
    )
    .await;
    // The broker is taken over: every claim it holds is refused.
    liveness.taken_over();
    wait_for_count(
        "a probe is refused by liveness",
        Duration::from_secs(10),
        &metrics.pushes,
        "not_live",
        1,
    )
    .await;

    // It joins again and the worker comes back: everything is pushed.
    liveness.confirmed(Instant::now());
    worker.restart().expect("worker restarts");
    pipeline.wake();
    wait_for_status(
        "every row is pushed after the worker is back",
        Duration::from_secs(30),
        store.as_ref(),
        ActivationStatus::Processing,
        200,
    )
    .await;
    pipeline.stop().await;
}
