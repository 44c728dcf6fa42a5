//! `taskbroker-bench e2e`: the whole broker under load, three processes.
//!
//! This process runs the mock Kafka cluster (unless `--kafka-brokers`) and
//! the producer; the broker is the real `taskbroker run` binary; the
//! workers are `taskbroker-bench workers` (push: WorkerService servers that
//! report through SetBatchActivationStatus; pull: GetTask loops).
//!
//! - Burn-down (default): `--tasks N` are produced before the broker starts
//!   (or, when they are more than the mock cluster keeps, as the broker
//!   consumes them: feed.rs); throughput is N over the time from the first
//!   delivery to the last acknowledged report.
//! - Open loop (`--rate R`): the broker starts first; once its consumer has
//!   partitions, R tasks/s are produced for `--duration-sec`, whatever the
//!   broker does, and the run waits for all of them to finish.
//! - Workers away (`--workers-after-pause`, a burn-down): the workers start
//!   only once the store has filled and the consumer paused (hold.rs).
//!
//! Tasks carry `--payload-bytes` of parameters (payload.rs), and the
//! workers check each delivery is byte for byte what was produced; a run
//! with a mismatch or a missing task fails. `--broker-env` adds broker
//! settings, `--broker-bin` runs another build of the broker.
//!
//! Reported: tasks/s, received→delivered and received→completed latency
//! (p50/p99/p99.9/max, from each task's `received_at`), the broker's peak
//! RSS and CPU seconds per 1,000 tasks, the other processes' CPU, and with
//! PostgreSQL the statements (pg_stat_statements) and WAL bytes per task.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::feed::{Backlog, Feed, MOCK_PARTITION_BYTES, Pacing, Producer};
use crate::harness::{
    BrokerProcess, Kafka, Scratch, Services, StoreKind, Topics, WorkersProcess, broker_env,
    free_port, run_id,
};
use crate::hold::{Held, StoreWatch, mib, wait_for_pause};
use crate::payload::{self, Parameters};
use crate::pgstat::{PgCounters, print_top_statements};
use crate::procstat;
use crate::scrape::metric;
use crate::storesize::StoreProbe;
use crate::workers::Delivery;

#[derive(clap::Args, Debug, Clone)]
pub struct E2eArgs {
    #[arg(long, value_enum, default_value_t = Delivery::Push)]
    pub mode: Delivery,
    #[arg(long, value_enum, default_value_t = StoreKind::Postgres)]
    pub store: StoreKind,
    /// Burn-down: tasks produced before the broker starts.
    #[arg(long, default_value_t = 100_000)]
    pub tasks: u64,
    /// Open loop: tasks per second offered for `--duration-sec`.
    #[arg(long)]
    pub rate: Option<u64>,
    #[arg(long, default_value_t = 30)]
    pub duration_sec: u64,
    /// The producer's linger.ms (default 1 in open loop, 5 in burn-down).
    /// Each task's latency starts when it is handed to the producer, so
    /// this wait is part of it; shorter lingers cost the mock cluster (in
    /// this process) more CPU.
    #[arg(long)]
    pub linger_ms: Option<u64>,
    /// Worker servers (push) or GetTask loops (pull).
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Simulated run time of each task.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Share of tasks the workers report as FAILURE.
    #[arg(long, default_value_t = 0.0)]
    pub failure_rate: f64,
    /// Partitions of the topic (the mock cluster keeps 5 MiB per
    /// partition, about 32,000 small tasks: feed.rs says what a burn-down
    /// needs).
    #[arg(long, default_value_t = 8)]
    pub partitions: i32,
    /// Bytes of incompressible parameters (`parameters_bytes`) per task,
    /// made from its id so the workers can check them; default the small
    /// task of before (64 bytes).
    #[arg(long)]
    pub payload_bytes: Option<usize>,
    /// A setting for the broker, on top of the harness's and the
    /// environment's: `--broker-env TASKBROKER_MAX_INFLIGHT=50`, repeatable.
    #[arg(long = "broker-env", value_name = "KEY=VALUE", value_parser = setting)]
    pub broker_env: Vec<(String, String)>,
    /// Start the workers only once the broker's consumer has paused and
    /// its store stopped growing; report what the store held then.
    #[arg(long)]
    pub workers_after_pause: bool,
    #[command(flatten)]
    pub services: Services,
    /// Give up after this long.
    #[arg(long, default_value_t = 900)]
    pub timeout_sec: u64,
    /// Run this broker instead of this build's `taskbroker run` (push
    /// mode), to compare brokers of the protocol on the same Kafka,
    /// database and workers: a shell command, run as `sh -c 'exec …'`. It
    /// gets the settings this broker would (`TASKBROKER_DATABASE_URL` or
    /// `TASKBROKER_SQLITE_PATH`, `TASKBROKER_KAFKA_BROKERS`,
    /// `TASKBROKER_KAFKA_TOPIC`, `TASKBROKER_WORKER_ENDPOINTS` as
    /// `*=url|url`) and `TASKBROKER_BENCH_GRPC_PORT`, where it must serve
    /// ConsumerService on 127.0.0.1; workers report there when a push
    /// carries no `callback_url`. Its own metrics are not read.
    #[arg(long)]
    pub broker_command: Option<String>,
}

pub async fn run(args: E2eArgs) -> Result<(), String> {
    let run = run_id();
    let scratch = Scratch::create(args.store, &args.services.admin_url, &run).await?;
    let result = run_in(&args, &run, &scratch).await;
    scratch.remove().await;
    result
}

async fn run_in(args: &E2eArgs, run: &str, scratch: &Scratch) -> Result<(), String> {
    let topics = Topics::new("bench", run);
    let topic = &topics.topic;
    let kafka = Kafka::start(
        args.services.kafka_brokers.as_deref(),
        &[topic, &topics.dlq],
        args.partitions,
    )?;
    let open_loop = args.rate.is_some();
    if args.workers_after_pause && (open_loop || args.broker_command.is_some()) {
        return Err(
            "--workers-after-pause is a burn-down that reads the broker's /metrics: not with --rate or --broker-command"
                .to_owned(),
        );
    }
    let parameters = Parameters::from_flag(args.payload_bytes);
    let producer = Arc::new(Producer::new(
        &kafka,
        topic,
        args.partitions,
        args.linger_ms.unwrap_or(if open_loop { 1 } else { 5 }),
        parameters,
    )?);
    let backlog = if open_loop {
        None
    } else {
        Some(Backlog::plan(
            kafka.is_mock(),
            args.tasks,
            producer.partitions(),
            payload::encoded_len(parameters),
            args.workers_after_pause,
        )?)
    };

    let worker_args = |extra: &[String]| -> Vec<String> {
        let mut list = vec![
            "--mode".to_owned(),
            args.mode.as_str().to_owned(),
            "--count".to_owned(),
            args.workers.to_string(),
            "--latency-ms".to_owned(),
            args.latency_ms.to_string(),
            "--failure-rate".to_owned(),
            args.failure_rate.to_string(),
        ];
        if let Some(bytes) = parameters.as_flag() {
            list.extend(["--payload-bytes".to_owned(), bytes.to_string()]);
        }
        list.extend_from_slice(extra);
        list
    };
    if args.broker_command.is_some() && args.mode != Delivery::Push {
        return Err("--broker-command runs push mode only".to_owned());
    }
    // An external broker's gRPC port is chosen here, so the workers know
    // where to report before it starts.
    let external_grpc: Option<std::net::SocketAddr> = match &args.broker_command {
        Some(_) => Some(
            format!("127.0.0.1:{}", free_port()?)
                .parse()
                .map_err(|err| format!("{err}"))?,
        ),
        None => None,
    };
    // Push workers kept away get their ports now, so the broker has its
    // endpoints; until they start, its pushes are refused.
    let away_ports = match (args.mode, args.workers_after_pause) {
        (Delivery::Push, true) => free_ports(args.workers.max(1))?,
        _ => Vec::new(),
    };
    let mut workers = match (args.mode, external_grpc) {
        _ if args.workers_after_pause => None,
        (Delivery::Push, Some(grpc)) => Some(WorkersProcess::start(&worker_args(&[
            "--broker".to_owned(),
            grpc.to_string(),
        ]))?),
        (Delivery::Push, None) => Some(WorkersProcess::start(&worker_args(&[]))?),
        (Delivery::Pull, _) => None,
    };
    let worker_urls: Vec<String> = match &workers {
        Some(workers) => workers.urls.clone(),
        None => away_ports
            .iter()
            .map(|port| format!("http://127.0.0.1:{port}"))
            .collect(),
    };

    let feed = match backlog {
        Some(backlog) => {
            eprintln!(
                "producing {} tasks of {} bytes to {topic}…",
                args.tasks,
                payload::encoded_len(parameters)
            );
            Some(Feed::start(
                Arc::clone(&producer),
                &kafka.brokers,
                topic,
                &topics.group,
                args.tasks,
                backlog,
            )?)
        }
        None => None,
    };

    let mut env = broker_env(scratch, &kafka, &topics);
    env.push((
        "TASKBROKER_DELIVERY_MODE".to_owned(),
        args.mode.as_str().to_owned(),
    ));
    if args.mode == Delivery::Push {
        env.push((
            "TASKBROKER_WORKER_ENDPOINTS".to_owned(),
            format!("*={}", worker_urls.join("|")),
        ));
    }
    // Last, so they win over the harness's own.
    env.extend(args.broker_env.iter().cloned());
    let broker = match (&args.broker_command, external_grpc) {
        (Some(command), Some(grpc)) => {
            BrokerProcess::start_external(command, &env, run, grpc).await?
        }
        _ => BrokerProcess::start(&args.services, &env, run).await?,
    };
    let broker_started = Instant::now();
    eprintln!(
        "{} pid {} (metrics http://{}/metrics, log {}){}",
        if broker.is_external() {
            "external broker (its metrics are not read)"
        } else {
            "broker"
        },
        broker.pid(),
        broker.metrics,
        broker.log.display(),
        match scratch {
            Scratch::Postgres { name, .. } => format!(", database {name}"),
            Scratch::Sqlite { path } => format!(", store {}", path.display()),
        }
    );
    let pg = match scratch {
        Scratch::Postgres {
            admin_url, name, ..
        } => Some(PgCounters::start(admin_url, name).await?),
        Scratch::Sqlite { .. } => None,
    };
    let before_metrics = broker.scrape().await?;
    let cpu = CpuMarks::take(&broker, workers.as_ref());
    let deadline = broker_started + Duration::from_secs(args.timeout_sec);

    let mut watch = if args.workers_after_pause {
        Some(StoreWatch::new(StoreProbe::open(scratch).await?))
    } else {
        None
    };
    let held = match &mut watch {
        Some(watch) => {
            Some(wait_for_pause(&broker, watch, args.tasks, broker_started, deadline).await?)
        }
        None => None,
    };
    if workers.is_none() {
        let place = match args.mode {
            Delivery::Push => [
                "--ports".to_owned(),
                away_ports
                    .iter()
                    .map(u16::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            ],
            Delivery::Pull => ["--broker".to_owned(), broker.grpc.to_string()],
        };
        workers = Some(WorkersProcess::start(&worker_args(&place))?);
    }
    let Some(workers) = workers else {
        return Err("no workers".to_owned());
    };

    let produced_total = match args.rate {
        None => args.tasks,
        Some(rate) => {
            broker.wait_assigned(Duration::from_secs(60)).await?;
            let duration = Duration::from_secs(args.duration_sec);
            eprintln!("offering {rate} tasks/s for {} s…", args.duration_sec);
            let window = Instant::now();
            let mut sent = 0u64;
            let mut last_progress = Instant::now();
            while window.elapsed() < duration {
                let due = (rate as f64 * window.elapsed().as_secs_f64()) as u64;
                while sent < due {
                    producer.send()?;
                    sent += 1;
                }
                if last_progress.elapsed() > Duration::from_secs(5) {
                    eprintln!(
                        "  {:.0} s: produced {sent}, completed {}",
                        window.elapsed().as_secs_f64(),
                        workers.reported()
                    );
                    last_progress = Instant::now();
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            producer.flush()?;
            sent
        }
    };
    let mut last_progress = Instant::now();
    let mut last_moved = (Instant::now(), workers.delivered(), workers.reported());
    while workers.reported() < produced_total {
        if Instant::now() > deadline {
            return Err(format!(
                "timed out: {} of {produced_total} tasks completed (broker log: {})",
                workers.reported(),
                broker.log.display()
            ));
        }
        let now = (workers.delivered(), workers.reported());
        if now != (last_moved.1, last_moved.2) {
            last_moved = (Instant::now(), now.0, now.1);
        } else if last_moved.0.elapsed() > STALLED {
            return Err(format!(
                "stalled: nothing delivered or completed for {} s, {} of {produced_total} tasks completed (broker log: {})",
                STALLED.as_secs(),
                workers.reported(),
                broker.log.display()
            ));
        }
        if last_progress.elapsed() > Duration::from_secs(5) {
            eprintln!(
                "  delivered {}, completed {} of {produced_total}",
                workers.delivered(),
                workers.reported()
            );
            last_progress = Instant::now();
        }
        if let Some(watch) = &mut watch {
            watch.sample_if_due(&broker).await?;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let wall = broker_started.elapsed();
    let pacing = match feed {
        Some(feed) => Some((feed.up_front(), feed.finish()?)),
        None => None,
    };
    let used = cpu.since(&broker, &workers);
    let rss_kib = procstat::peak_rss_kib(&broker.pid());
    let after_metrics = broker.scrape().await?;
    let pg_use = match &pg {
        Some(pg) => Some(pg.finish().await?),
        None => None,
    };
    let (warnings, errors) = broker.log_levels();
    let log = broker.log.clone();
    let summary = workers.finish()?;
    let external = broker.is_external();
    match broker.stop().await {
        // Another broker's exit code on SIGTERM is its own business.
        Err(err) if external => eprintln!("the external broker: {err}"),
        stopped => stopped?,
    }

    let get = |key: &str| summary.get(key).copied().unwrap_or(0);
    let ms = |key: &str| get(key) as f64 / 1000.0;
    let first = get("first_delivery_us");
    let last = get("last_report_us");
    let busy_secs = (last.saturating_sub(first)) as f64 / 1e6;
    let tasks = produced_total;
    let throughput = tasks as f64 / busy_secs.max(1e-6);
    let store_ops = metric(
        &after_metrics,
        "taskbroker_store_operation_duration_seconds_count",
        "",
    ) - metric(
        &before_metrics,
        "taskbroker_store_operation_duration_seconds_count",
        "",
    );

    let shape = match args.rate {
        None => format!("burn-down of {tasks} tasks"),
        Some(rate) => format!(
            "open loop, {rate} tasks/s offered for {} s ({tasks} tasks)",
            args.duration_sec
        ),
    };
    println!(
        "\ne2e {} mode, {} store, {shape}; {} workers, {} ms per task, {:.0}% failures",
        args.mode.as_str(),
        args.store.as_str(),
        args.workers,
        args.latency_ms,
        args.failure_rate * 100.0
    );
    print_tasks(args, &producer, tasks, pacing);
    println!(
        "  throughput: {throughput:.0} tasks/s (first delivery to last report: {busy_secs:.2} s; whole run {:.1} s)",
        wall.as_secs_f64()
    );
    println!(
        "  received→delivered ms: p50 {:.1}, p99 {:.1}, p99.9 {:.1}, max {:.1}",
        ms("deliver_p50_us"),
        ms("deliver_p99_us"),
        ms("deliver_p999_us"),
        ms("deliver_max_us")
    );
    println!(
        "  received→completed ms: p50 {:.1}, p99 {:.1}, p99.9 {:.1}, max {:.1}",
        ms("complete_p50_us"),
        ms("complete_p99_us"),
        ms("complete_p999_us"),
        ms("complete_max_us")
    );
    println!(
        "  deliveries {} (unique {}, duplicates {}), reports acknowledged {} ({} FAILURE), report retries {}",
        get("delivered"),
        get("unique"),
        get("duplicates"),
        get("reported"),
        get("failed"),
        get("report_errors")
    );
    let mismatched = get("mismatched");
    println!(
        "  byte-identical: {} of {} deliveries{}",
        get("identical"),
        get("delivered"),
        if mismatched > 0 {
            format!(" ({mismatched} NOT as produced)")
        } else {
            String::new()
        }
    );
    let per_k = |secs: f64| secs * 1000.0 / tasks.max(1) as f64;
    println!(
        "  broker: peak RSS {:.1} MiB, CPU {:.1} s ({:.3} s per 1,000 tasks)",
        rss_kib as f64 / 1024.0,
        used.broker,
        per_k(used.broker)
    );
    print_threads(&used);
    println!(
        "  other CPU: workers {:.1} s ({:.3}/1k), harness + Kafka {:.1} s ({:.3}/1k), whole machine {:.1} s of {:.1} s available",
        used.workers,
        per_k(used.workers),
        used.harness,
        per_k(used.harness),
        used.machine,
        wall.as_secs_f64() * 2.0
    );
    if let (Some(held), Some(watch)) = (&held, &watch) {
        print_held(args, &env, held, watch);
    }
    println!(
        "  pushes by result: {}",
        crate::scrape::push_results(&before_metrics, &after_metrics)
    );
    print_stages(&before_metrics, &after_metrics);
    println!(
        "  broker store operations: {:.2} per task",
        store_ops / tasks.max(1) as f64
    );
    if let Some(usage) = &pg_use {
        match usage.statements {
            Some(statements) => println!(
                "  PostgreSQL: {:.2} statements per task, {:.0} WAL bytes per task; most execution time:",
                statements as f64 / tasks.max(1) as f64,
                usage.wal_bytes as f64 / tasks.max(1) as f64
            ),
            None => println!(
                "  PostgreSQL: {:.0} WAL bytes per task (pg_stat_statements not loaded)",
                usage.wal_bytes as f64 / tasks.max(1) as f64
            ),
        }
        print_top_statements(usage, tasks, 8);
    }
    println!(
        "  broker log: {warnings} warnings, {errors} errors ({})",
        log.display()
    );
    let statements = pg_use
        .as_ref()
        .and_then(|u| u.statements)
        .map_or("–".to_owned(), |s| {
            format!("{:.2}", s as f64 / tasks.max(1) as f64)
        });
    let wal = pg_use.as_ref().map_or("–".to_owned(), |u| {
        format!("{:.0}", u.wal_bytes as f64 / tasks.max(1) as f64)
    });
    println!(
        "\n| mode | store | shape | tasks/s | delivered p50 / p99 / p99.9 ms | completed p50 / p99 / p99.9 ms | stmts/task | WAL B/task | peak RSS MiB | broker CPU s/1k |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {} | {} | {throughput:.0} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} / {:.1} | {statements} | {wal} | {:.1} | {:.3} |",
        args.mode.as_str(),
        args.store.as_str(),
        match (args.rate, parameters) {
            (None, parameters) => format!(
                "burn-down {tasks}{}{}",
                match parameters {
                    Parameters::Small => String::new(),
                    Parameters::Random(bytes) => format!(" × {}", size(bytes)),
                },
                if held.is_some() { ", workers away" } else { "" }
            ),
            (Some(rate), _) => format!("open {rate}/s × {} s", args.duration_sec),
        },
        ms("deliver_p50_us"),
        ms("deliver_p99_us"),
        ms("deliver_p999_us"),
        ms("complete_p50_us"),
        ms("complete_p99_us"),
        ms("complete_p999_us"),
        rss_kib as f64 / 1024.0,
        per_k(used.broker)
    );
    if let (Some(held), Some(watch)) = (&held, &watch) {
        println!(
            "\n| store | tasks | workers away: paused after s | store then MiB (rows) | store peak MiB | taskbroker_inflight_bytes MiB | broker peak RSS MiB | broker CPU s/1k | delivered |"
        );
        println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
        println!(
            "| {} | {tasks} × {} | {:.1} | {:.1} ({}) | {:.1} | {} | {:.1} | {:.3} | {} of {tasks} |",
            args.store.as_str(),
            size(parameters.len()),
            held.after.as_secs_f64(),
            mebibytes(held.store.activation_bytes),
            held.store.rows,
            mebibytes(watch.peak.activation_bytes),
            held.inflight_bytes.map_or("n/a".to_owned(), |b| format!(
                "{:.1}",
                b / f64::from(1 << 20)
            )),
            rss_kib as f64 / 1024.0,
            per_k(used.broker),
            get("unique")
        );
    }
    if mismatched > 0 {
        return Err(format!(
            "{mismatched} deliveries were not byte-identical to what was produced"
        ));
    }
    if get("unique") < tasks {
        return Err(format!(
            "only {} of {tasks} tasks reached a worker",
            get("unique")
        ));
    }
    Ok(())
}

/// What was produced, and how: the tasks' size, the up-front or paced
/// backlog (feed.rs), the settings given to the broker.
fn print_tasks(
    args: &E2eArgs,
    producer: &Producer,
    tasks: u64,
    pacing: Option<(u64, Option<Pacing>)>,
) {
    let parameters = Parameters::from_flag(args.payload_bytes);
    let produced = match pacing {
        None => String::new(),
        Some((_, None)) => "; all produced before the broker started".to_owned(),
        Some((up_front, Some(pacing))) => format!(
            "; {up_front} produced before the broker started, the rest as its consumer committed, \
             at most {} unconsumed per partition (the mock cluster keeps {}); Kafka held nothing \
             unconsumed at {} of {} polls",
            pacing.ahead,
            mib(MOCK_PARTITION_BYTES as u64),
            pacing.dry_polls,
            pacing.polls
        ),
    };
    println!(
        "  tasks: {tasks}, parameters {} each (records up to {} bytes{}){produced}",
        size(parameters.len()),
        payload::encoded_len(parameters),
        if producer.sends_spacers() {
            ", each followed by an expired spacer the broker drops: feed.rs"
        } else {
            ""
        }
    );
    if !args.broker_env.is_empty() {
        let given: Vec<String> = args
            .broker_env
            .iter()
            .map(|(key, value)| format!("{key}={value}"))
            .collect();
        println!("  broker settings given: {}", given.join(" "));
    }
}

/// `--workers-after-pause`: what the store held with the workers away.
fn print_held(args: &E2eArgs, env: &[(String, String)], held: &Held, watch: &StoreWatch) {
    let task_bytes = Parameters::from_flag(args.payload_bytes).len();
    let files = |store: &crate::storesize::StoreSize| {
        store
            .file_bytes
            .map_or(String::new(), |bytes| format!(", files {}", mib(bytes)))
    };
    println!(
        "  workers away: {} after {:.1} s; the store held {} rows, {} of activations{}; broker RSS then {}",
        if held.paused_partitions > 0.0 {
            format!("{} partitions paused", held.paused_partitions)
        } else {
            "the consumer never paused (the store took every task)".to_owned()
        },
        held.after.as_secs_f64(),
        held.store.rows,
        mib(held.store.activation_bytes),
        files(&held.store),
        mib(held.broker_rss_kib * 1024)
    );
    println!(
        "  store peak over the run: {} of activations ({} rows{}); taskbroker_inflight_bytes at the pause {}, peak {}",
        mib(watch.peak.activation_bytes),
        watch.peak.rows,
        files(&watch.peak),
        held.inflight_bytes
            .map_or("n/a".to_owned(), |bytes| mib(bytes as u64)),
        watch
            .peak_inflight_bytes
            .map_or("n/a".to_owned(), |bytes| mib(bytes as u64)),
    );
    // The bound the broker was given, and how far past it the store went
    // (an insert batch may land on top of it).
    let setting = |name: &str| {
        env.iter()
            .rev()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
            .or_else(|| std::env::var(name).ok())
    };
    if let Some(bound) =
        setting("TASKBROKER_MAX_INFLIGHT_BYTES").and_then(|v| v.parse::<u64>().ok())
    {
        let over = watch.peak.activation_bytes.saturating_sub(bound);
        println!(
            "  TASKBROKER_MAX_INFLIGHT_BYTES {}: the peak is {} over it ({:.1} tasks of {})",
            mib(bound),
            mib(over),
            over as f64 / task_bytes.max(1) as f64,
            size(task_bytes)
        );
    }
    if let Some(rows) = setting("TASKBROKER_MAX_INFLIGHT") {
        println!("  TASKBROKER_MAX_INFLIGHT {rows} rows");
    }
}

/// Bytes as the table shows them: MiB, one decimal.
fn mebibytes(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// A size as given: `4 MiB`, `1 KiB`, `1000 B`.
fn size(bytes: usize) -> String {
    match bytes {
        0 => "0 B".to_owned(),
        b if b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// `--broker-env KEY=VALUE`.
fn setting(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("{text:?} is not KEY=VALUE")),
    }
}

/// `count` distinct free loopback ports.
fn free_ports(count: usize) -> Result<Vec<u16>, String> {
    let mut ports = Vec::with_capacity(count);
    while ports.len() < count {
        let port = free_port()?;
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    Ok(ports)
}

/// How long a run may go without a delivery or a report before it is given
/// up (tasks lost on the way would otherwise keep it to `--timeout-sec`).
const STALLED: Duration = Duration::from_secs(60);

/// CPU seconds used by each party since [`CpuMarks::take`].
struct CpuMarks {
    broker: f64,
    /// Per broker thread: what `since` reports as used, busiest first.
    threads: std::collections::BTreeMap<u64, (String, f64)>,
    busiest: Vec<(String, f64)>,
    workers: f64,
    harness: f64,
    machine: f64,
}

impl CpuMarks {
    /// Now; workers not started yet count from 0.
    fn take(broker: &BrokerProcess, workers: Option<&WorkersProcess>) -> CpuMarks {
        CpuMarks {
            broker: procstat::cpu_seconds(&broker.pid()),
            threads: procstat::thread_cpu_seconds(&broker.pid()),
            busiest: Vec::new(),
            workers: workers.map_or(0.0, WorkersProcess::cpu_seconds),
            harness: procstat::cpu_seconds("self"),
            machine: procstat::machine_busy_seconds(),
        }
    }

    fn since(&self, broker: &BrokerProcess, workers: &WorkersProcess) -> CpuMarks {
        let now = CpuMarks::take(broker, Some(workers));
        CpuMarks {
            broker: now.broker - self.broker,
            busiest: procstat::threads_since(&self.threads, &now.threads),
            threads: now.threads,
            workers: now.workers - self.workers,
            harness: now.harness - self.harness,
            machine: now.machine - self.machine,
        }
    }
}

/// The broker's busiest threads and their share of its CPU: whether one
/// thread (an actor's Arbiter, say) limits the broker.
fn print_threads(used: &CpuMarks) {
    let share = |secs: f64| 100.0 * secs / used.broker.max(1e-9);
    let top: Vec<String> = used
        .busiest
        .iter()
        .take(6)
        .map(|(name, secs)| format!("{name} {secs:.1} s ({:.0} %)", share(*secs)))
        .collect();
    if !top.is_empty() {
        println!(
            "  broker threads: {} of them used CPU; busiest: {}",
            used.busiest.len(),
            top.join(", ")
        );
    }
}

/// The broker's per-stage latencies over the run (`taskbroker_stage_seconds`,
/// read from its histogram buckets, so p99 is as coarse as they are); a
/// broker without them prints nothing.
fn print_stages(before: &str, after: &str) {
    let mut parts = Vec::new();
    for stage in taskbroker::metrics::Stage::ALL.map(|stage| stage.label()) {
        let labels = format!("stage=\"{stage}\"");
        let quantile = |q| {
            crate::scrape::histogram_quantile(before, after, "taskbroker_stage_seconds", &labels, q)
        };
        if let (Some(p50), Some(p99)) = (quantile(0.5), quantile(0.99)) {
            parts.push(format!("{stage} {:.1} / {:.1}", p50 * 1e3, p99 * 1e3));
        }
    }
    if !parts.is_empty() {
        println!("  broker stages p50 / p99 ms: {}", parts.join(", "));
    }
}
