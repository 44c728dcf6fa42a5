//! `taskbroker demo`: the whole broker on one machine with nothing
//! installed. librdkafka's in-process mock cluster stands in for Kafka (a
//! real Kafka protocol endpoint: any client can produce to the bootstrap
//! address it prints), the embedded SQLite store in a scratch file for the
//! database (or PostgreSQL when `TASKBROKER_DATABASE_URL` is set), and a
//! pool of demo workers, real `WorkerService` servers on loopback, runs the
//! tasks. The demo produces a mix of task kinds ([`Kind`]), shows progress,
//! and at the end checks that every task reached the outcome its kind
//! should reach.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prost::Message as _;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Message as _, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};

use super::scenario::{
    ID_HEADER, KILLED_TASKNAME, KIND_HEADER, Kind, Ledger, PAUSED_NAMESPACE, TaskRecord,
    report_for, wire_status,
};
use super::worker::{DemoWorker, Mode};
use taskbroker::broker::Broker;
use taskbroker::config::{Config, DeliveryMode};
use taskbroker::metrics::Metrics;
use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
use taskbroker::proto::{GetTaskRequest, SetTaskStatusRequest, TaskActivation};
use taskbroker::store::{
    ActivationStore, PostgresStore, PostgresStoreConfig, SqliteStore, SqliteStoreConfig,
};

/// What `taskbroker demo` was asked to do.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub tasks: usize,
    pub workers: usize,
    pub mode: DeliveryMode,
    /// Tasks produced per second; `None`: as fast as Kafka takes them.
    pub rate: Option<u64>,
    /// Keep running after the summary, for browsing `/metrics`.
    pub hold: bool,
    /// Give up (and fail) after this long.
    pub timeout: Duration,
    /// Also feed the raw topic [`RAW_TOPIC`].
    pub raw: bool,
    /// Also show the runtime rules (a killswitch and a pause).
    pub rules: bool,
}

/// The demo's runtime file: the killswitch always, the pause while `paused`.
fn rules_file(paused: bool) -> String {
    let mut text = format!("killswitches:\n  - taskname: {KILLED_TASKNAME}\n");
    if paused {
        text.push_str(&format!("paused:\n  - namespace: {PAUSED_NAMESPACE}\n"));
    }
    text
}

/// Replaces the runtime file as a ConfigMap update does (write, rename).
fn write_rules(path: &std::path::Path, paused: bool) -> Result<(), String> {
    let next = path.with_extension("next");
    std::fs::write(&next, rules_file(paused))
        .and_then(|()| std::fs::rename(&next, path))
        .map_err(|err| {
            format!(
                "cannot write the demo's runtime file {}: {err}",
                path.display()
            )
        })
}

/// The raw topic of `taskbroker demo --raw`, and the task its records become.
pub const RAW_TOPIC: &str = "demo-raw";
const RAW_TASK: &str = "demo/raw/echo";

/// The demo's result: whether every task reached its outcome.
pub struct DemoOutcome {
    pub passed: bool,
}

const TOPIC_PARTITIONS: i32 = 4;

/// Runs the demo inside an actix System. Errors are setup failures; a
/// task that missed its outcome is reported in [`DemoOutcome`].
pub async fn run(options: DemoOptions) -> Result<DemoOutcome, String> {
    let cluster = MockCluster::<DefaultProducerContext>::new(1)
        .map_err(|err| format!("cannot start the mock Kafka cluster: {err}"))?;
    let bootstrap = cluster.bootstrap_servers();
    let grpc_port = free_port()?;
    let metrics_addr = std::env::var("TASKBROKER_METRICS_ADDR")
        .ok()
        .unwrap_or_else(|| match std::net::TcpListener::bind("127.0.0.1:9090") {
            Ok(_) => "127.0.0.1:9090".to_owned(),
            Err(_) => "127.0.0.1:0".to_owned(),
        });
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let scratch = std::env::temp_dir().join(format!("taskbroker-demo-{run_id}.sqlite"));
    let rules_path = std::env::temp_dir().join(format!("taskbroker-demo-{run_id}-rules.yaml"));

    let ledger = Arc::new(Ledger::default());
    // Workers first: the broker's configuration names them.
    let secrets: Vec<String> = std::env::var("TASKBROKER_GRPC_SHARED_SECRETS")
        .map(|value| {
            value
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    let mut workers = Vec::new();
    if options.mode == DeliveryMode::Push {
        for _ in 0..options.workers.max(1) {
            let worker = DemoWorker::start_with_ledger(
                "127.0.0.1:0".parse().expect("loopback address"),
                Mode::Execute {
                    delay: Duration::from_millis(1),
                },
                secrets.clone(),
                Some(Arc::clone(&ledger)),
            )
            .await
            .map_err(|err| format!("cannot start a demo worker: {err}"))?;
            workers.push(worker);
        }
    }
    let endpoints = format!(
        "*={}",
        workers
            .iter()
            .map(DemoWorker::url)
            .collect::<Vec<_>>()
            .join("|")
    );

    // The user's TASKBROKER_* settings apply, except those the demo owns.
    let mut overrides: HashMap<&str, String> = HashMap::from([
        ("TASKBROKER_KAFKA_BROKERS", bootstrap.clone()),
        ("TASKBROKER_KAFKA_CONFIG", String::new()),
        ("TASKBROKER_KAFKA_AUTO_OFFSET_RESET", "earliest".to_owned()),
        ("TASKBROKER_GRPC_ADDR", format!("127.0.0.1:{grpc_port}")),
        (
            "TASKBROKER_GRPC_ADVERTISED_ADDR",
            format!("127.0.0.1:{grpc_port}"),
        ),
        ("TASKBROKER_METRICS_ADDR", metrics_addr),
        ("TASKBROKER_SQLITE_PATH", scratch.display().to_string()),
        ("TASKBROKER_DELIVERY_MODE", options.mode.as_str().to_owned()),
        ("TASKBROKER_RESTART_GRACE_SEC", "0".to_owned()),
        ("TASKBROKER_PROCESSING_DEADLINE_GRACE_SEC", "1".to_owned()),
    ]);
    if options.mode == DeliveryMode::Push {
        overrides.insert("TASKBROKER_WORKER_ENDPOINTS", endpoints);
    }
    if options.raw {
        overrides.insert(
            "TASKBROKER_KAFKA_RAW_TOPICS",
            format!("{RAW_TOPIC}={RAW_TASK}"),
        );
    }
    if options.rules {
        // Paused before the broker starts, so no paused task can slip out.
        ledger.set_paused(true);
        write_rules(&rules_path, true)?;
        overrides.insert(
            "TASKBROKER_RUNTIME_CONFIG",
            rules_path.display().to_string(),
        );
    }
    let defaults: HashMap<&str, &str> = HashMap::from([
        ("TASKBROKER_UPKEEP_INTERVAL_MS", "100"),
        ("TASKBROKER_LOG", "warn"),
    ]);
    let config = Config::from_lookup(|name| {
        overrides
            .get(name)
            .cloned()
            .or_else(|| std::env::var(name).ok())
            .or_else(|| defaults.get(name).map(|v| (*v).to_owned()))
    })
    .map_err(|err| err.to_string())?;
    for topic in [
        config.kafka_topic.as_str(),
        config.kafka_retry_topic.as_deref().unwrap_or(""),
        config.kafka_dlq_topic.as_str(),
        config.kafka_ingest_dlq_topic.as_str(),
        if options.raw { RAW_TOPIC } else { "" },
    ] {
        if !topic.is_empty() {
            cluster
                .create_topic(topic, TOPIC_PARTITIONS, 1)
                .map_err(|err| format!("cannot create topic {topic}: {err}"))?;
        }
    }

    let store = open_store(&config, &scratch)?;
    store.migrate().await.map_err(|err| err.to_string())?;
    let metrics = Arc::new(Metrics::new());
    let broker = Broker::start(&config, Arc::clone(&store), Arc::clone(&metrics), "demo")?;
    println!("taskbroker demo");
    println!(
        "  Kafka (mock cluster):  {bootstrap}   topic {}",
        config.kafka_topic
    );
    println!(
        "  store:                 {}",
        match &config.database_url {
            Some(_) => "PostgreSQL (TASKBROKER_DATABASE_URL)".to_owned(),
            None => format!("SQLite {}", scratch.display()),
        }
    );
    println!("  gRPC:                  {}", broker.grpc_addr);
    println!(
        "  metrics:               http://{}/metrics",
        broker.metrics_addr
    );
    println!(
        "  workers:               {} ({} mode)",
        options.workers.max(1),
        options.mode.as_str()
    );
    println!(
        "  tasks:                 {} (80% complete, 5% retry twice, 5% fail to the DLQ, \
         3% overrun their deadline, 4% delayed {}s, 3% expire)",
        options.tasks,
        super::scenario::DELAY_SECS
    );
    if options.raw {
        println!(
            "  raw topic:             {RAW_TOPIC}: one in five tasks that should complete \
             arrives as a plain payload and becomes a {RAW_TASK} task"
        );
    }
    if options.rules {
        println!(
            "  runtime rules:         {}: 1% of tasks are {KILLED_TASKNAME} (killswitched); \
             1% are in namespace {PAUSED_NAMESPACE}, paused until 2 s after the last task \
             is produced",
            rules_path.display()
        );
    }
    println!();

    let stop = Arc::new(AtomicBool::new(false));
    let dlq_reader = read_dead_letters(
        &bootstrap,
        &config.kafka_dlq_topic,
        Arc::clone(&ledger),
        Arc::clone(&stop),
    )?;
    let mut pullers = Vec::new();
    if options.mode == DeliveryMode::Pull {
        for _ in 0..options.workers.max(1) {
            pullers.push(actix_rt::spawn(pull_worker(
                broker.grpc_addr,
                Arc::clone(&ledger),
                Arc::clone(&stop),
            )));
        }
    }

    // Produce once the consumer holds its partitions, so the figures show
    // the broker at work rather than the consumer group's first join.
    let joined_by = Instant::now() + Duration::from_secs(60);
    while metrics.assigned_partitions() == 0 {
        if Instant::now() >= joined_by {
            return Err("the broker's consumer got no partition within 60 s".to_owned());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let produced = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let producer_task = actix_rt::spawn(produce(
        bootstrap.clone(),
        config.kafka_topic.clone(),
        run_id.clone(),
        Plan {
            tasks: options.tasks,
            rate: options.rate,
            raw: options.raw,
            rules: options.rules,
        },
        Arc::clone(&ledger),
        Arc::clone(&produced),
    ));

    let tty = std::io::stderr().is_terminal();
    let mut last_line = Instant::now() - Duration::from_secs(10);
    let deadline = started + options.timeout;
    let mut paused = options.rules;
    let mut produced_by: Option<Instant> = None;
    let finished = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let done_producing = produced.load(Ordering::Relaxed) as usize >= options.tasks;
        if done_producing {
            let produced_by = *produced_by.get_or_insert_with(Instant::now);
            if paused && produced_by.elapsed() >= Duration::from_secs(2) {
                // The ledger first: from now on a paused task may go out.
                ledger.set_paused(false);
                write_rules(&rules_path, false)?;
                paused = false;
                if !tty {
                    eprintln!("resumed namespace {PAUSED_NAMESPACE}");
                }
            }
        }
        let remaining = store
            .count_by_status()
            .await
            .map(|counts| counts.total())
            .unwrap_or(u64::MAX);
        let (pushed, completed) = ledger.totals();
        let stored = metrics.consumed("stored");
        let line = format!(
            "produced {:>7} / {}   stored {:>7}   pushed {:>7}   completed {:>7}   in store {:>6}",
            produced.load(Ordering::Relaxed),
            options.tasks,
            stored,
            pushed,
            completed,
            remaining
        );
        if tty {
            eprint!("\r{line}");
            let _ = std::io::stderr().flush();
        } else if last_line.elapsed() >= Duration::from_secs(2) {
            eprintln!("{line}");
            last_line = Instant::now();
        }
        if done_producing && remaining == 0 {
            let records = ledger.snapshot();
            if records.values().all(|record| record.check(true).is_ok()) {
                break Some(started.elapsed());
            }
        }
        if Instant::now() >= deadline {
            break None;
        }
    };
    if tty {
        eprintln!();
    }
    let produce_result = producer_task.await.map_err(|err| err.to_string())?;

    let records = ledger.snapshot();
    let settled = store
        .count_by_status()
        .await
        .map(|counts| counts.total() == 0)
        .unwrap_or(false);
    let passed = summarize(&records, finished, settled, options.tasks, &metrics);
    if let Err(err) = produce_result {
        eprintln!("producing failed: {err}");
    }

    if options.hold {
        println!(
            "\nholding: http://{}/metrics stays up; Ctrl-C to stop",
            broker.metrics_addr
        );
        let _ = tokio::signal::ctrl_c().await;
    }
    stop.store(true, Ordering::Relaxed);
    for puller in pullers {
        let _ = puller.await;
    }
    broker.stop().await;
    drop(workers);
    let _ = dlq_reader.join();
    drop(store);
    if config.database_url.is_none() {
        for file in SqliteStore::files(&scratch) {
            let _ = std::fs::remove_file(file);
        }
    }
    if options.rules {
        let _ = std::fs::remove_file(&rules_path);
    }
    // The broker's Kafka clients are dropped by their arbiters after
    // `stop()` returns; the cluster must outlive them, and the process ends
    // right after the demo, so it is left to the exit.
    std::mem::forget(cluster);
    Ok(DemoOutcome { passed })
}

fn free_port() -> Result<u16, String> {
    taskbroker::net::reserve_loopback_port()
        .map_err(|err| format!("no free port on loopback: {err}"))
}

fn open_store(
    config: &Config,
    scratch: &std::path::Path,
) -> Result<Arc<dyn ActivationStore>, String> {
    Ok(match &config.database_url {
        Some(url) => Arc::new(
            PostgresStore::connect(&PostgresStoreConfig {
                pool_size: config.db_pool_size,
                ..PostgresStoreConfig::new(url.clone())
            })
            .map_err(|err| err.to_string())?,
        ),
        None => Arc::new(
            SqliteStore::open(&SqliteStoreConfig::new(scratch)).map_err(|err| err.to_string())?,
        ),
    })
}

/// Produces the demo tasks, paced to `rate` per second when given.
/// What the demo producer sends: how many tasks, how fast, and whether some
/// go to the raw topic.
struct Plan {
    tasks: usize,
    rate: Option<u64>,
    raw: bool,
    /// One in a hundred tasks that should complete is killswitched instead,
    /// one in a hundred paused.
    rules: bool,
}

async fn produce(
    bootstrap: String,
    topic: String,
    run_id: String,
    plan: Plan,
    ledger: Arc<Ledger>,
    produced: Arc<AtomicU64>,
) -> Result<(), String> {
    let Plan {
        tasks,
        rate,
        raw,
        rules,
    } = plan;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("message.timeout.ms", "30000")
        .set("linger.ms", "5")
        .create()
        .map_err(|err| format!("cannot create the demo producer: {err}"))?;
    let started = Instant::now();
    let mut in_flight = futures::stream::FuturesUnordered::new();
    for index in 0..tasks {
        if let Some(rate) = rate.filter(|rate| *rate > 0) {
            let due = started + Duration::from_secs_f64(index as f64 / rate as f64);
            tokio::time::sleep_until(due.into()).await;
        }
        let kind = match Kind::of_index(index) {
            Kind::Complete if rules && index % 100 == 20 => Kind::Killed,
            Kind::Complete if rules && index % 100 == 21 => Kind::Paused,
            kind => kind,
        };
        let id = format!("demo-{run_id}-{index}");
        // --raw: a plain payload whose headers the broker copies into the
        // task it makes, so the workers and the ledger know it as this one.
        let as_raw = raw && kind == Kind::Complete && index % 5 == 0;
        let (topic, payload, headers) = if as_raw {
            let headers = OwnedHeaders::new()
                .insert(Header {
                    key: KIND_HEADER,
                    value: Some(kind.as_str()),
                })
                .insert(Header {
                    key: ID_HEADER,
                    value: Some(id.as_str()),
                });
            (RAW_TOPIC.to_owned(), id.clone().into_bytes(), headers)
        } else {
            let payload = kind.activation(&id, chrono::Utc::now()).encode_to_vec();
            (topic.clone(), payload, OwnedHeaders::new())
        };
        ledger.produced(&id, kind);
        let producer = producer.clone();
        in_flight.push(async move {
            producer
                .send(
                    FutureRecord::to(&topic)
                        .key(&id)
                        .payload(&payload)
                        .headers(headers),
                    Duration::from_secs(30),
                )
                .await
                .map(|_| ())
                .map_err(|(err, _)| format!("producing {id}: {err}"))
        });
        // Bounded: at most 1,000 records awaiting acknowledgement.
        while in_flight.len() >= 1000 {
            if let Some(result) = futures::StreamExt::next(&mut in_flight).await {
                result?;
                produced.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    while let Some(result) = futures::StreamExt::next(&mut in_flight).await {
        result?;
        produced.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Reads the DLQ topic from the start on a thread of its own, marking each
/// dead-lettered demo task in the ledger.
fn read_dead_letters(
    bootstrap: &str,
    topic: &str,
    ledger: Arc<Ledger>,
    stop: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>, String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "taskbroker-demo-dlq-reader")
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .map_err(|err| format!("cannot create the DLQ reader: {err}"))?;
    consumer
        .subscribe(&[topic])
        .map_err(|err| format!("cannot read {topic}: {err}"))?;
    Ok(std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(message)) => {
                    if let Some(activation) = message
                        .payload()
                        .and_then(|bytes| TaskActivation::decode(bytes).ok())
                    {
                        ledger.dead_lettered(&activation);
                    }
                }
                Some(Err(err)) => tracing::debug!(error = %err, "DLQ reader"),
                None => {}
            }
        }
    }))
}

/// A pull-mode worker: GetTask, run, SetTaskStatus, until stopped.
async fn pull_worker(grpc: std::net::SocketAddr, ledger: Arc<Ledger>, stop: Arc<AtomicBool>) {
    let Ok(mut client) = ConsumerServiceClient::connect(format!("http://{grpc}")).await else {
        return;
    };
    while !stop.load(Ordering::Relaxed) {
        let task = match client.get_task(GetTaskRequest::default()).await {
            Ok(response) => response.into_inner().task,
            Err(_) => None,
        };
        let Some(task) = task else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        ledger.delivered(&task);
        let Some(status) = report_for(&task) else {
            continue;
        };
        let request = SetTaskStatusRequest {
            id: task.id.clone(),
            status: wire_status(status) as i32,
            ..Default::default()
        };
        for _ in 0..50 {
            if client.set_task_status(request.clone()).await.is_ok() {
                ledger.reported(&task, status);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn percentile(sorted: &[Duration], q: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted.get(rank).copied()
}

fn millis(duration: Option<Duration>) -> String {
    duration.map_or_else(
        || "-".to_owned(),
        |d| format!("{:.1} ms", d.as_secs_f64() * 1000.0),
    )
}

/// Prints the summary tables; returns whether every task passed.
fn summarize(
    records: &HashMap<String, TaskRecord>,
    elapsed: Option<Duration>,
    settled: bool,
    tasks: usize,
    metrics: &Metrics,
) -> bool {
    let mut to_pushed = Vec::new();
    let mut to_completed = Vec::new();
    for record in records.values().filter(|r| r.kind == Kind::Complete) {
        if let (Some(produced), Some(first)) = (record.produced_at, record.first_delivery) {
            to_pushed.push(first.duration_since(produced));
        }
        if let (Some(produced), Some(done)) = (record.produced_at, record.completed_at) {
            to_completed.push(done.duration_since(produced));
        }
    }
    to_pushed.sort();
    to_completed.sort();

    println!("\n| outcome by kind | tasks | reached it | missed |");
    println!("|---|---:|---:|---:|");
    let mut failures = Vec::new();
    for kind in Kind::ALL {
        let of_kind: Vec<&TaskRecord> = records.values().filter(|r| r.kind == kind).collect();
        if of_kind.is_empty() && matches!(kind, Kind::Killed | Kind::Paused) {
            continue; // only with --rules
        }
        let mut reached = 0;
        for record in &of_kind {
            match record.check(settled) {
                Ok(()) => reached += 1,
                Err(why) => failures.push(why),
            }
        }
        println!(
            "| {} ({}) | {} | {} | {} |",
            kind.as_str(),
            kind.expected(),
            of_kind.len(),
            reached,
            of_kind.len() - reached
        );
    }
    let duplicates: u32 = records
        .values()
        .filter(|r| matches!(r.kind, Kind::Complete | Kind::Delayed))
        .map(|r| r.deliveries.saturating_sub(1))
        .sum();
    println!();
    println!("| figure | value |");
    println!("|---|---:|");
    match elapsed {
        Some(elapsed) => {
            println!(
                "| wall time, first produce to every outcome settled | {:.2} s |",
                elapsed.as_secs_f64()
            );
            println!(
                "| throughput | {:.0} tasks/s |",
                tasks as f64 / elapsed.as_secs_f64()
            );
        }
        None => println!("| wall time | timed out |"),
    }
    println!(
        "| received→pushed p50 / p99 (complete tasks) | {} / {} |",
        millis(percentile(&to_pushed, 0.5)),
        millis(percentile(&to_pushed, 0.99))
    );
    println!(
        "| received→completed p50 / p99 (complete tasks) | {} / {} |",
        millis(percentile(&to_completed, 0.5)),
        millis(percentile(&to_completed, 0.99))
    );
    println!(
        "| pushes ok / failed | {} / {} |",
        Metrics::count(&metrics.pushes, "ok"),
        ["error", "unreachable", "timeout"]
            .iter()
            .map(|result| Metrics::count(&metrics.pushes, result))
            .sum::<u64>()
    );
    println!("| repeated deliveries (at-least-once) | {duplicates} |");

    let passed = elapsed.is_some() && failures.is_empty() && records.len() == tasks;
    if passed {
        println!("\nevery task reached the outcome its kind should reach");
    } else {
        println!(
            "\nFAILED: {} of {tasks} tasks missed their outcome{}",
            failures.len(),
            if elapsed.is_none() {
                " before the timeout"
            } else {
                ""
            }
        );
        for why in failures.iter().take(10) {
            println!("  {why}");
        }
    }
    passed
}
