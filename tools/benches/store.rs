//! The push hot path, per task: claim a batch of Pending rows, mark them
//! Processing, complete them — one batched store call each, as FetchActor,
//! PushPoolActor and the status RPC issue them — on each backend:
//!
//! - PostgreSQL: a throwaway database `taskbroker_bench_<uuid>` on the
//!   server named by `TASKBROKER_TEST_DATABASE_URL` (default: local
//!   `postgres`);
//! - SQLite: a throwaway file in the temporary directory.
//!
//! `TASKBROKER_BENCH_ASYNC_COMMIT=1` measures the opt-in asynchronous
//! commit for replayable transitions instead of durable commits.
//!
//! `cargo bench --bench store` (both), `cargo bench --bench store -- sqlite`
//! (one).

use std::hint::black_box;
use std::time::{Duration, Instant};

use chrono::Utc;
use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use prost::Message;
use taskbroker::model::{BucketRange, ClaimToken, InflightActivation, StatusUpdate, WorkerStatus};
use taskbroker::model::{KafkaPosition, inflight_from_record};
use taskbroker::proto::{RetryState, TaskActivation};
use taskbroker::store::{
    ActivationStore, PostgresStore, PostgresStoreConfig, SqliteStore, SqliteStoreConfig,
};

const BATCH_SIZES: [usize; 4] = [1, 16, 64, 256];
const LEASE: Duration = Duration::from_secs(300);
const DEADLINE_GRACE: Duration = Duration::from_secs(5);
/// Rows per insert while preparing (outside the timed section).
const INSERT_CHUNK: usize = 1000;

fn admin_url() -> String {
    std::env::var("TASKBROKER_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// `admin_url` with its database name replaced.
fn url_for_database(admin_url: &str, database: &str) -> String {
    let (base, query) = match admin_url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (admin_url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_part = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{host_part}/{database}?{query}"),
        None => format!("{host_part}/{database}"),
    }
}

async fn admin_client() -> tokio_postgres::Client {
    let url = admin_url();
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|err| panic!("cannot connect to PostgreSQL at {url}: {err}"));
    tokio::spawn(connection);
    client
}

/// A database for this run, dropped (with its connections) when this is dropped.
struct BenchDb {
    name: String,
    url: String,
    runtime: tokio::runtime::Handle,
}

impl BenchDb {
    async fn create() -> BenchDb {
        let name = format!("taskbroker_bench_{}", uuid::Uuid::new_v4().simple());
        admin_client()
            .await
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap_or_else(|err| panic!("cannot create bench database {name}: {err}"));
        let url = url_for_database(&admin_url(), &name);
        BenchDb {
            name,
            url,
            runtime: tokio::runtime::Handle::current(),
        }
    }
}

impl Drop for BenchDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let dropped = self.runtime.block_on(async move {
            admin_client()
                .await
                .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .await
        });
        if let Err(err) = dropped {
            eprintln!("cannot drop bench database {}: {err}", self.name);
        }
    }
}

/// `n` Pending rows as the consumer would store them.
fn pending_rows(n: usize) -> Vec<InflightActivation> {
    let now = Utc::now();
    (0..n)
        .map(|_| {
            let activation = TaskActivation {
                id: uuid::Uuid::new_v4().simple().to_string(),
                namespace: "bench".to_owned(),
                taskname: "bench.noop".to_owned(),
                received_at: Some(prost_types::Timestamp {
                    seconds: now.timestamp(),
                    nanos: 0,
                }),
                retry_state: Some(RetryState {
                    attempts: 0,
                    max_attempts: 3,
                    ..Default::default()
                }),
                processing_deadline_duration: 30,
                application: Some("bench".to_owned()),
                ..Default::default()
            };
            inflight_from_record(
                &activation.encode_to_vec(),
                KafkaPosition {
                    topic: "taskworker".to_owned(),
                    partition: 0,
                    offset: 0,
                },
                now,
                Duration::from_secs(3600),
            )
            .expect("valid bench activation")
        })
        .collect()
}

async fn fill(store: &dyn ActivationStore, n: usize) {
    let mut left = n;
    while left > 0 {
        let chunk = left.min(INSERT_CHUNK);
        let inserted = store
            .insert_batch(&pending_rows(chunk))
            .await
            .expect("insert bench rows");
        assert_eq!(inserted, chunk as u64);
        left -= chunk;
    }
}

async fn remove_finished(store: &dyn ActivationStore) {
    while store
        .remove_completed(10_000)
        .await
        .expect("remove completed rows")
        > 0
    {}
}

/// One pass of the hot path for `batch` tasks: three batched store calls.
async fn claim_push_complete(store: &dyn ActivationStore, batch: usize) {
    let claimed = store
        .claim_for_push(BucketRange::ALL, batch, LEASE)
        .await
        .expect("claim");
    assert_eq!(claimed.len(), batch, "the bench prepared too few rows");
    let tokens: Vec<ClaimToken> = claimed
        .iter()
        .map(|claimed| claimed.token.clone())
        .collect();
    let processing = store
        .mark_processing(&tokens, DEADLINE_GRACE)
        .await
        .expect("mark processing");
    assert_eq!(processing.len(), batch);
    let updates: Vec<StatusUpdate> = claimed
        .into_iter()
        .map(|row| StatusUpdate::new(row.activation.id, WorkerStatus::Complete))
        .collect();
    let outcome = store.set_status(&updates).await.expect("complete");
    assert_eq!(outcome.updated, batch as u64);
    black_box(outcome);
}

fn async_commit() -> bool {
    std::env::var("TASKBROKER_BENCH_ASYNC_COMMIT").is_ok_and(|v| v == "1")
}

fn group_name(backend: &str) -> String {
    if async_commit() {
        format!("{backend}_claim_processing_complete_async_commit")
    } else {
        format!("{backend}_claim_processing_complete")
    }
}

fn postgres(c: &mut Criterion) {
    let runtime = runtime();
    let db = runtime.block_on(BenchDb::create());
    let mut config = PostgresStoreConfig::new(db.url.clone());
    config.async_commit = async_commit();
    let store = PostgresStore::connect(&config).expect("store config");
    runtime
        .block_on(store.migrate())
        .expect("migrate bench database");
    bench_backend(c, &runtime, &group_name("postgres"), &store);
    drop(store);
    drop(db);
}

fn sqlite(c: &mut Criterion) {
    let runtime = runtime();
    let path = std::env::temp_dir().join(format!(
        "taskbroker_bench_{}.sqlite",
        uuid::Uuid::new_v4().simple()
    ));
    let mut config = SqliteStoreConfig::new(path.clone());
    config.async_commit = async_commit();
    let store = SqliteStore::open(&config).expect("open bench SQLite file");
    runtime
        .block_on(store.migrate())
        .expect("migrate bench database");
    bench_backend(c, &runtime, &group_name("sqlite"), &store);
    drop(store);
    for file in SqliteStore::files(&path) {
        let _ = std::fs::remove_file(file);
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn bench_backend(
    c: &mut Criterion,
    runtime: &tokio::runtime::Runtime,
    name: &str,
    store: &dyn ActivationStore,
) {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        // Every sample runs the same number of iterations, so the largest
        // batch fits the measurement time instead of overrunning it.
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for batch in BATCH_SIZES {
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_with_input(BenchmarkId::from_parameter(batch), &batch, |b, &batch| {
            b.to_async(runtime).iter_custom(|iters| async move {
                let rows = usize::try_from(iters).expect("iteration count") * batch;
                fill(store, rows).await;
                let started = Instant::now();
                for _ in 0..iters {
                    claim_push_complete(store, batch).await;
                }
                let elapsed = started.elapsed();
                remove_finished(store).await;
                elapsed
            });
        });
    }
    group.finish();
}

criterion_group!(benches, postgres, sqlite);
criterion_main!(benches);
