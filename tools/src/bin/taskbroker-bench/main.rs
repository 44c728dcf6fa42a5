//! `taskbroker-bench`, the load harness (package `taskbroker-tools`, apart
//! from the broker's package: tools/Cargo.toml says why). This file holds
//! the command line and the one-process scenarios `push`, `ingest` and
//! `status`.
//!
//! `push` fills a fresh PostgreSQL database with N activations and
//! drains them through the real push pipeline (StoreActor, FetchActors,
//! PushPoolActor) into K demo workers on loopback that answer at once.
//!
//! ```sh
//! cargo run --release --bin taskbroker-bench -- push --tasks 100000 --workers 8
//! ```
//!
//! Reports drain throughput, push RPC latency p50/p99 (from the broker's
//! histogram), how many statements the claims and mark-processing writes
//! took, and the process's peak RSS. Broker, workers and harness share the
//! process, so RSS and CPU include the workers.
//!
//! ```sh
//! cargo run --release --bin taskbroker-bench -- ingest --records 100000
//! ```
//!
//! Produces N activations to a 4-partition topic on librdkafka's in-process
//! mock cluster, then times the ConsumerActor storing all of them.
//!
//! `sqlite-soak` is in soak.rs; the three-process scenarios in e2e.rs,
//! floor.rs and stranded.rs (what they produce: payload.rs and feed.rs;
//! e2e's workers-away step: hold.rs and storesize.rs).

mod demo;
mod e2e;
mod feed;
mod floor;
mod harness;
mod hold;
mod idle;
mod payload;
mod pgstat;
mod procstat;
mod recovery;
mod scrape;
mod soak;
mod storesize;
mod stranded;
mod workers;

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use clap::{Parser, Subcommand};
use demo::{DemoWorker, Mode};
use taskbroker::actors::StoreHandle;
use taskbroker::actors::fetch::FetchConfig;
use taskbroker::actors::push_pool::PushPoolConfig;
use taskbroker::broker::{PushPipeline, PushPipelineConfig};
use taskbroker::config::WorkerEndpoints;
use taskbroker::metrics::Metrics;
use taskbroker::model::ActivationStatus;
use taskbroker::model::{KafkaPosition, inflight_from_record};
use taskbroker::proto::{RetryState, TaskActivation};
use taskbroker::store::{ActivationStore, PostgresStore, PostgresStoreConfig};

#[derive(Parser)]
#[command(name = "taskbroker-bench", about = "Load harness for taskbroker")]
struct Cli {
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Subcommand)]
enum Scenario {
    /// Pre-fill the store, then drain it through push delivery.
    Push(PushArgs),
    /// Produce to the mock Kafka cluster, then time the consumer storing it.
    Ingest(IngestArgs),
    /// Time workers reporting results: SetTaskStatus and SetBatchActivationStatus.
    Status(StatusArgs),
    /// Pass N tasks through the SQLite store with upkeep; report file size.
    SqliteSoak(soak::SoakArgs),
    /// The whole broker as a separate process, fed through Kafka, with
    /// workers in a third process: burn-down or open loop.
    E2e(e2e::E2eArgs),
    /// The store work of one task driven straight at the database.
    Floor(floor::FloorArgs),
    /// Workers go away and come back under steady inflow: lag and claims.
    Stranded(stranded::StrandedArgs),
    /// One of two brokers is killed or frozen under steady inflow: how
    /// soon its claims are pushed again, duplicates, lost tasks.
    Recovery(recovery::RecoveryArgs),
    /// The simulated workers (started by `e2e` and `stranded`).
    Workers(workers::WorkersArgs),
    /// Brokers with nothing to do: database transactions and CPU per second.
    Idle(idle::IdleArgs),
}

#[derive(clap::Args)]
struct StatusArgs {
    /// Reports per API.
    #[arg(long, default_value_t = 20_000)]
    updates: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Updates per SetBatchActivationStatus call.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    #[arg(
        long,
        env = "TASKBROKER_TEST_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    admin_url: String,
}

#[derive(clap::Args)]
struct IngestArgs {
    /// Records to produce and ingest.
    #[arg(long, default_value_t = 100_000)]
    records: usize,
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// INSERT_BATCH_SIZE.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    #[arg(
        long,
        env = "TASKBROKER_TEST_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    admin_url: String,
}

#[derive(clap::Args)]
struct PushArgs {
    /// Activations to drain.
    #[arg(long, default_value_t = 100_000)]
    tasks: usize,
    /// Demo workers (separate tonic servers).
    #[arg(long, default_value_t = 8)]
    workers: usize,
    #[arg(long, default_value_t = 4)]
    fetch_actors: usize,
    #[arg(long, default_value_t = 64)]
    batch: usize,
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    #[arg(long, default_value_t = 128)]
    queue: usize,
    #[arg(long, default_value_t = 16)]
    pool: usize,
    /// Asynchronous commit for replayable transitions (DB_ASYNC_COMMIT).
    #[arg(long)]
    async_commit: bool,
    /// Claim oldest first (FAIR_DISPATCH=false) instead of interleaving
    /// namespaces.
    #[arg(long)]
    oldest_first: bool,
    /// Tasks of a second namespace ("small") stored one at a time while
    /// the backlog drains; their received → pushed latency is reported.
    #[arg(long, default_value_t = 0)]
    small: usize,
    /// Rate of the small namespace's tasks, per second.
    #[arg(long, default_value_t = 200)]
    small_rate: u32,
    /// Server to create the scratch database on.
    #[arg(
        long,
        env = "TASKBROKER_TEST_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    admin_url: String,
}

fn main() -> Result<(), String> {
    let cli = Cli::parse();
    match cli.scenario {
        Scenario::Push(args) => actix_rt::System::new().block_on(push(args)),
        Scenario::Ingest(args) => actix_rt::System::new().block_on(ingest(args)),
        Scenario::Status(args) => actix_rt::System::new().block_on(status(args)),
        Scenario::SqliteSoak(args) => actix_rt::System::new().block_on(soak::run(args)),
        Scenario::E2e(args) => actix_rt::System::new().block_on(e2e::run(args)),
        Scenario::Floor(args) => actix_rt::System::new().block_on(floor::run(args)),
        Scenario::Stranded(args) => actix_rt::System::new().block_on(stranded::run(args)),
        Scenario::Recovery(args) => actix_rt::System::new().block_on(recovery::run(args)),
        Scenario::Workers(args) => workers::run(args),
        Scenario::Idle(args) => actix_rt::System::new().block_on(idle::run(args)),
    }
}

async fn push(args: PushArgs) -> Result<(), String> {
    with_scratch_database(&args.admin_url.clone(), |database| async move {
        run_push(&args, &database).await
    })
    .await
}

async fn ingest(args: IngestArgs) -> Result<(), String> {
    with_scratch_database(&args.admin_url.clone(), |database| async move {
        run_ingest(&args, &database).await
    })
    .await
}

async fn status(args: StatusArgs) -> Result<(), String> {
    with_scratch_database(&args.admin_url.clone(), |database| async move {
        run_status(&args, &database).await
    })
    .await
}

async fn run_status(args: &StatusArgs, url: &str) -> Result<(), String> {
    use taskbroker::config::DeliveryMode;
    use taskbroker::grpc::consumer_service::ConsumerApi;
    use taskbroker::grpc::server::{ServerConfig, serve};
    use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
    use taskbroker::proto::{
        SetBatchActivationStatusRequest, SetTaskStatusRequest, TaskActivationStatus,
    };

    let mut store_config = PostgresStoreConfig::new(url);
    store_config.pool_size = 16;
    let store = Arc::new(PostgresStore::connect(&store_config).map_err(|e| e.to_string())?);
    store.migrate().await.map_err(|e| e.to_string())?;
    let metrics = Arc::new(Metrics::new());
    let store_actor = {
        let (store, metrics) = (Arc::clone(&store), Arc::clone(&metrics));
        StoreHandle::start_in_arbiter(
            &Arbiter::new().handle(),
            store,
            metrics,
            taskbroker::runtime::RuntimeRules::none(),
        )
        .map_err(|err| format!("cannot start the store's threads: {err}"))?
    };
    // The server on an Arbiter of its own, as in the broker.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let api = ConsumerApi::new(
        store_actor,
        DeliveryMode::Pull,
        Duration::from_secs(3),
        Arc::clone(&metrics),
    );
    let server_arbiter = Arbiter::new();
    server_arbiter.spawn(async move {
        let (health, _) = tokio::sync::oneshot::channel();
        if let Ok(listener) = tokio::net::TcpListener::from_std(listener) {
            let config = ServerConfig {
                shared_secrets: Vec::new(),
                max_request_bytes: 4 << 20,
                tls: None,
            };
            let _ = serve(listener, api, config, health, std::future::pending()).await;
        }
    });
    let url = format!("http://{addr}");
    let report = |id: String| SetTaskStatusRequest {
        id,
        status: TaskActivationStatus::Complete as i32,
        ..Default::default()
    };

    for api_name in ["SetTaskStatus", "SetBatchActivationStatus"] {
        // Processing rows to complete.
        let mut rows = Vec::with_capacity(args.updates);
        let mut ids = Vec::with_capacity(args.updates);
        for i in 0..args.updates {
            let bytes = prost::Message::encode_to_vec(&bench_activation());
            let mut row = inflight_from_record(
                &bytes,
                KafkaPosition {
                    topic: "bench".to_owned(),
                    partition: 0,
                    offset: i as i64,
                },
                chrono::Utc::now(),
                Duration::ZERO,
            )
            .map_err(|e| e.to_string())?;
            row.status = ActivationStatus::Processing;
            ids.push(row.id.clone());
            rows.push(row);
        }
        for chunk in rows.chunks(1000) {
            store.insert_batch(chunk).await.map_err(|e| e.to_string())?;
        }
        let per_client = ids.len().div_ceil(args.clients);
        let started = Instant::now();
        let mut tasks = Vec::new();
        for share in ids.chunks(per_client) {
            let share = share.to_vec();
            let url = url.clone();
            let batch = args.batch;
            let batched = api_name == "SetBatchActivationStatus";
            tasks.push(actix_rt::spawn(async move {
                let mut client = ConsumerServiceClient::connect(url)
                    .await
                    .map_err(|e| e.to_string())?;
                if batched {
                    for chunk in share.chunks(batch) {
                        let updates = chunk.iter().cloned().map(report).collect();
                        client
                            .set_batch_activation_status(SetBatchActivationStatusRequest {
                                updates,
                            })
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                } else {
                    for id in share {
                        client
                            .set_task_status(report(id))
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                }
                Ok::<(), String>(())
            }));
        }
        for task in tasks {
            task.await.map_err(|e| e.to_string())??;
        }
        let secs = started.elapsed().as_secs_f64();
        let complete = store
            .count_by_status()
            .await
            .map_err(|e| e.to_string())?
            .get(ActivationStatus::Complete);
        if complete != args.updates as u64 {
            return Err(format!("{complete} of {} rows completed", args.updates));
        }
        store
            .remove_completed(usize::MAX)
            .await
            .map_err(|e| e.to_string())?;
        println!(
            "{api_name}: {} updates, {} clients{}: {:.2} s, {:.0} updates/s",
            args.updates,
            args.clients,
            if api_name == "SetBatchActivationStatus" {
                format!(", {} per call", args.batch)
            } else {
                String::new()
            },
            secs,
            args.updates as f64 / secs
        );
    }
    println!(
        "  set_status statements: {} for {} updates",
        metrics.store_calls("set_status"),
        2 * args.updates
    );
    server_arbiter.stop();
    Ok(())
}

/// Runs `body` on a database created for it and dropped afterwards.
async fn with_scratch_database<F, Fut>(admin_url: &str, body: F) -> Result<(), String>
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let database = format!("taskbroker_bench_{}", uuid::Uuid::new_v4().simple());
    let admin = connect(admin_url).await?;
    admin
        .batch_execute(&format!("CREATE DATABASE {database}"))
        .await
        .map_err(|err| format!("cannot create {database}: {err}"))?;
    let url = replace_database(admin_url, &database);
    let outcome = body(url).await;
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
        .await
        .map_err(|err| format!("cannot drop {database}: {err}"))?;
    outcome
}

async fn run_ingest(args: &IngestArgs, url: &str) -> Result<(), String> {
    use rdkafka::producer::FutureRecord;
    use taskbroker::actors::ConsumerActor;
    use taskbroker::actors::consumer::{ConsumerConfig, StopConsuming};
    use taskbroker::kafka::KafkaSettings;

    let store = Arc::new(
        PostgresStore::connect(&PostgresStoreConfig::new(url)).map_err(|e| e.to_string())?,
    );
    store.migrate().await.map_err(|e| e.to_string())?;
    let cluster = rdkafka::mocking::MockCluster::new(1).map_err(|e| e.to_string())?;
    cluster
        .create_topic("tasks", args.partitions, 1)
        .map_err(|e| e.to_string())?;
    let kafka = KafkaSettings {
        brokers: cluster.bootstrap_servers(),
        properties: Vec::new(),
        max_activation_bytes: 1 << 20,
    };
    let producer = kafka
        .create_producer(Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    let produced = Instant::now();
    let payloads: Vec<(String, Vec<u8>)> = (0..args.records)
        .map(|i| {
            let activation = bench_activation();
            (i.to_string(), prost::Message::encode_to_vec(&activation))
        })
        .collect();
    for chunk in payloads.chunks(10_000) {
        let sends = chunk.iter().map(|(key, payload)| {
            producer.send(
                FutureRecord::to("tasks").key(key).payload(payload),
                rdkafka::util::Timeout::After(Duration::from_secs(30)),
            )
        });
        for sent in futures::future::join_all(sends).await {
            sent.map_err(|(err, _)| format!("produce: {err}"))?;
        }
    }
    let produce_secs = produced.elapsed().as_secs_f64();

    let metrics = Arc::new(Metrics::new());
    let store_actor = {
        let (store, metrics) = (Arc::clone(&store), Arc::clone(&metrics));
        StoreHandle::start_in_arbiter(
            &Arbiter::new().handle(),
            store,
            metrics,
            taskbroker::runtime::RuntimeRules::none(),
        )
        .map_err(|err| format!("cannot start the store's threads: {err}"))?
    };
    let started = Instant::now();
    let cpu_before = cpu_seconds();
    let consumer = ConsumerActor::new(
        ConsumerConfig {
            ingest_dlq_kafka: kafka.clone(),
            forward_kafka: kafka.clone(),
            kafka,
            cluster: taskbroker::config::DEFAULT_CLUSTER.to_owned(),
            topic: "tasks".to_owned(),
            group: "bench".to_owned(),
            raw: None,
            auto_offset_reset: "earliest".to_owned(),
            ingest_dlq_topic: "ingest-dlq".to_owned(),
            batch_size: args.batch,
            batch_bytes: usize::MAX,
            batch_max_wait: Duration::from_millis(50),
            max_inflight: u64::MAX,
            max_inflight_bytes: 0,
            max_delay: Duration::from_secs(3600),
            max_activation_bytes: 1 << 20,
            #[cfg(feature = "test-hooks")]
            crash_before_commit_after: None,
            health: Default::default(),
            rules: taskbroker::runtime::RuntimeRules::none(),
            stop_grace: Duration::from_secs(1),
        },
        store_actor,
        Vec::new(),
        Arc::clone(&metrics),
    )
    .start();
    let target = args.records as u64;
    let mut first_stored = None;
    while metrics.consumed("stored") < target {
        if first_stored.is_none() && metrics.consumed("stored") > 0 {
            first_stored = Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let total_secs = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_before;
    let _ = consumer.send(StopConsuming).await;
    // Group join and assignment happen before the first record; report the
    // steady rate from the first stored batch as well as the total.
    let join_secs = first_stored.unwrap_or_default().as_secs_f64();
    println!(
        "ingest: {} records, {} partitions, insert batch {}",
        args.records, args.partitions, args.batch
    );
    println!("  produce (not timed below): {produce_secs:.1} s");
    println!(
        "  consume + store: {:.2} s in total, {:.0} records/s; {:.0} records/s after the first batch (group join took {:.2} s)",
        total_secs,
        target as f64 / total_secs,
        target as f64 / (total_secs - join_secs).max(0.001),
        join_secs
    );
    println!(
        "  insert statements: {} ({:.1} rows each)",
        metrics.store_calls("insert_batch"),
        target as f64 / metrics.store_calls("insert_batch").max(1) as f64
    );
    println!(
        "  process CPU: {:.1} s ({:.2} s per 1,000 records, includes the mock cluster); peak RSS {} MiB",
        cpu,
        cpu * 1000.0 / target as f64,
        peak_rss_kib() / 1024
    );
    Ok(())
}

fn bench_activation() -> TaskActivation {
    TaskActivation {
        id: uuid::Uuid::new_v4().simple().to_string(),
        namespace: BACKLOG_NAMESPACE.to_owned(),
        taskname: "bench.noop".to_owned(),
        parameters_bytes: vec![0x80; 64],
        retry_state: Some(RetryState {
            max_attempts: 3,
            ..Default::default()
        }),
        processing_deadline_duration: 60,
        application: Some("bench".to_owned()),
        ..Default::default()
    }
}

/// The namespace of the `push` scenario's backlog; its trickle is `small`.
const BACKLOG_NAMESPACE: &str = "bench";
const SMALL_NAMESPACE: &str = "small";

/// Stores `count` tasks of the small namespace one at a time, `rate` per
/// second, each received as it is stored, and wakes the fetchers after
/// each (as the consumer does).
async fn trickle(
    store: &PostgresStore,
    count: usize,
    rate: u32,
    wake: impl Fn(),
) -> Result<(), String> {
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate.max(1))));
    for i in 0..count {
        ticks.tick().await;
        let received = chrono::Utc::now();
        let mut activation = bench_activation();
        activation.namespace = SMALL_NAMESPACE.to_owned();
        activation.received_at = Some(prost_types::Timestamp {
            seconds: received.timestamp(),
            nanos: received.timestamp_subsec_nanos() as i32,
        });
        let bytes = prost::Message::encode_to_vec(&activation);
        let position = KafkaPosition {
            topic: "bench-small".to_owned(),
            partition: 0,
            offset: i as i64,
        };
        let row = inflight_from_record(&bytes, position, received, Duration::ZERO)
            .map_err(|e| e.to_string())?;
        store
            .insert_batch(&[row])
            .await
            .map_err(|e| e.to_string())?;
        wake();
    }
    Ok(())
}

/// p50 and p99 of the small namespace's received → pushed, in ms, as the
/// workers saw the pushes arrive.
fn small_latency(workers: &[DemoWorker]) -> (f64, f64) {
    let mut waits: Vec<f64> = workers
        .iter()
        .flat_map(|worker| {
            worker
                .seen
                .arrivals
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .filter(|(namespace, _)| namespace == SMALL_NAMESPACE)
                .map(|(_, waited)| *waited)
                .collect::<Vec<_>>()
        })
        .collect();
    waits.sort_by(f64::total_cmp);
    let at = |q: f64| {
        waits
            .get(((waits.len() as f64 * q).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0)
    };
    (at(0.5), at(0.99))
}

async fn run_push(args: &PushArgs, url: &str) -> Result<(), String> {
    let mut store_config = PostgresStoreConfig::new(url);
    store_config.pool_size = args.pool;
    store_config.async_commit = args.async_commit;
    let store = Arc::new(PostgresStore::connect(&store_config).map_err(|e| e.to_string())?);
    store.migrate().await.map_err(|e| e.to_string())?;

    let filled = Instant::now();
    fill(store.as_ref(), args.tasks).await?;
    let fill_secs = filled.elapsed().as_secs_f64();

    let mut workers = Vec::new();
    for _ in 0..args.workers {
        workers.push(
            DemoWorker::start(Mode::accept())
                .await
                .map_err(|e| format!("worker: {e}"))?,
        );
    }
    let urls: Vec<String> = workers.iter().map(DemoWorker::url).collect();
    let metrics = Arc::new(Metrics::new());
    let store_actor = {
        let (store, metrics) = (Arc::clone(&store), Arc::clone(&metrics));
        StoreHandle::start_in_arbiter(
            &Arbiter::new().handle(),
            store,
            metrics,
            taskbroker::runtime::RuntimeRules::none(),
        )
        .map_err(|err| format!("cannot start the store's threads: {err}"))?
    };
    let config = PushPipelineConfig {
        fetch_actors: args.fetch_actors,
        fetch: FetchConfig {
            batch_size: args.batch,
            batch_bytes: 16 << 20,
            backoff: Duration::from_millis(20),
            queue_timeout: Duration::from_millis(2000),
            lease: Duration::from_secs(60),
            fair_dispatch: !args.oldest_first,
            #[cfg(feature = "test-hooks")]
            release_on_full: true,
        },
        push: PushPoolConfig {
            concurrency: args.concurrency,
            queue_size: args.queue,
            queue_bytes: 64 << 20,
            push_timeout: Duration::from_secs(5),
            deadline_grace: Duration::from_secs(3),
            max_attempts: 5,
            callback_url: "127.0.0.1:50051".to_owned(),
            signing_secret: None,
            endpoints: WorkerEndpoints::parse(&format!("*={}", urls.join("|")))?,
            tls: Default::default(),
            spread: Default::default(),
        },
    };

    let started = Instant::now();
    let cpu_before = cpu_seconds();
    let pipeline = PushPipeline::start(config, store_actor, Arc::clone(&metrics))?;
    let target = (args.tasks + args.small) as u64;
    let drained = async {
        loop {
            let pushed = Metrics::count(&metrics.pushes, "ok");
            if pushed >= target {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (small, ()) = tokio::join!(
        trickle(store.as_ref(), args.small, args.small_rate, || pipeline
            .wake()),
        drained
    );
    small?;
    let drain_secs = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_before;
    pipeline.stop().await;
    let counts = store.count_by_status().await.map_err(|e| e.to_string())?;
    if counts.get(ActivationStatus::Processing) != target {
        return Err(format!(
            "expected {target} Processing rows, found {counts:?}"
        ));
    }

    let ms = |q| Metrics::quantile(&metrics.push_duration, q) * 1000.0;
    println!("push drain: {} tasks, {} workers", args.tasks, args.workers);
    println!(
        "  settings: fetch_actors={} batch={} concurrency={} queue={} pool={} async_commit={}",
        args.fetch_actors, args.batch, args.concurrency, args.queue, args.pool, args.async_commit
    );
    println!(
        "  fill (insert batches of 1000): {:.1} s, {:.0} rows/s",
        fill_secs,
        args.tasks as f64 / fill_secs
    );
    println!(
        "  drain: {:.2} s, {:.0} tasks/s",
        drain_secs,
        args.tasks as f64 / drain_secs
    );
    if args.small > 0 {
        let (p50, p99) = small_latency(&workers);
        println!(
            "  small namespace: {} tasks at {}/s beside the backlog ({}): \
             received -> pushed p50 {p50:.1} ms, p99 {p99:.1} ms",
            args.small,
            args.small_rate,
            if args.oldest_first {
                "oldest first"
            } else {
                "fair dispatch"
            },
        );
    }
    println!(
        "  push RPC latency: p50 {:.2} ms, p99 {:.2} ms",
        ms(0.5),
        ms(0.99)
    );
    println!(
        "  statements: claim {} ({:.1} rows each), mark_processing {} ({:.1} rows each)",
        metrics.store_calls("claim_for_push"),
        target as f64 / metrics.store_calls("claim_for_push").max(1) as f64,
        metrics.store_calls("mark_processing"),
        target as f64 / metrics.store_calls("mark_processing").max(1) as f64,
    );
    println!(
        "  process CPU: {:.1} s ({:.2} s per 1,000 tasks); peak RSS {} MiB",
        cpu,
        cpu * 1000.0 / args.tasks as f64,
        peak_rss_kib() / 1024
    );
    Ok(())
}

async fn fill(store: &dyn ActivationStore, tasks: usize) -> Result<(), String> {
    let position = KafkaPosition {
        topic: "bench".to_owned(),
        partition: 0,
        offset: 0,
    };
    let mut batch = Vec::with_capacity(1000);
    for i in 0..tasks {
        let activation = bench_activation();
        let bytes = prost::Message::encode_to_vec(&activation);
        let mut position = position.clone();
        position.offset = i as i64;
        let row = inflight_from_record(&bytes, position, chrono::Utc::now(), Duration::ZERO)
            .map_err(|e| e.to_string())?;
        batch.push(row);
        if batch.len() == 1000 || i + 1 == tasks {
            store
                .insert_batch(&batch)
                .await
                .map_err(|e| e.to_string())?;
            batch.clear();
        }
    }
    Ok(())
}

async fn connect(url: &str) -> Result<tokio_postgres::Client, String> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|err| format!("cannot connect to {url}: {err}"))?;
    actix_rt::spawn(connection);
    Ok(client)
}

/// `url` with its database name replaced.
fn replace_database(url: &str, database: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let host = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    if query.is_empty() {
        format!("{host}/{database}")
    } else {
        format!("{host}/{database}?{query}")
    }
}

fn peak_rss_kib() -> u64 {
    procstat::peak_rss_kib("self")
}

fn cpu_seconds() -> f64 {
    procstat::cpu_seconds("self")
}
