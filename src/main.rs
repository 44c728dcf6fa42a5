//! The `taskbroker` command.
//!
//! `taskbroker run` (the default) reads the configuration from `TASKBROKER_*`
//! variables, refusing to start on any bad value; opens the store and applies
//! migrations; starts the actors, each on an Arbiter (a thread) of its own so
//! the broker uses every core; then waits for SIGTERM or SIGINT and stops
//! the actors in the order `broker.rs` describes (consumer commits, fetchers
//! finish their batch, pushes in flight finish, held claims are released in
//! one statement, the gRPC server drains), exiting 0 within
//! `SHUTDOWN_TIMEOUT_MS`. A second signal exits at once. When one of its
//! actors stops on its own (`src/supervisor.rs`), it stops the rest the same
//! way and exits 1, so the orchestrator restarts it. `taskbroker migrate` only applies
//! migrations, and `taskbroker config` prints the effective configuration (secrets redacted)
//! or, with `--markdown`, the configuration reference in docs/. `taskbroker demo` runs
//! everything on one machine with nothing installed (src/cli/demo/), `taskbroker
//! demo-worker` serves a demo worker, `taskbroker healthcheck` probes `/health` for
//! container health checks, `taskbroker inspect` shows what the store holds
//! (src/cli/inspect.rs), and `taskbroker dlq` lists, shows and redrives dead
//! letters (src/cli/dlq.rs).

mod cli;

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use std::time::Duration;
use taskbroker::broker::Broker;

use taskbroker::config::{Config, unknown_variables};
use taskbroker::metrics::Metrics;
use taskbroker::store::{
    ActivationStore, Membership, PostgresStore, PostgresStoreConfig, SqliteStore, SqliteStoreConfig,
};

#[derive(Parser)]
#[command(
    name = "taskbroker",
    version,
    about = "Kafka-fed task broker delivering to gRPC workers"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the broker (the default).
    #[command(after_help = settings_help())]
    Run,
    /// Apply database migrations, then exit.
    Migrate,
    /// Print the effective configuration, secrets redacted, then the topic table
    /// (every consumed and produced topic, its cluster, group and mode).
    Config {
        /// Print the configuration reference (docs/configuration.md) instead.
        #[arg(long)]
        markdown: bool,
    },
    /// Run the whole broker on an in-process mock Kafka cluster and an
    /// embedded store, with demo workers and a realistic task mix; exits 1
    /// if a task misses the outcome its kind should reach.
    Demo(cli::demo::DemoArgs),
    /// Serve a demo WorkerService: accept pushed tasks, run them, report
    /// the outcome to the broker that pushed them.
    DemoWorker {
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0:50052")]
        listen: std::net::SocketAddr,
        /// How long each task "runs" before its result is reported.
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
    },
    /// Exit 0 if this machine's broker answers /health on
    /// TASKBROKER_METRICS_ADDR, else 1 (for container health checks).
    Healthcheck,
    /// Show what the store holds (counts by status, namespace and task
    /// name, the oldest Pending task per namespace, claims and deadlines
    /// about to run out), or one task by id; read-only, safe while brokers
    /// run. Needs only the store settings.
    Inspect(cli::inspect::InspectArgs),
    /// The dead-letter topic: list or show dead letters (filtered by
    /// namespace, task name, time, ids), or redrive them to the main topic
    /// as new tasks; a second redrive of the same filters republishes
    /// nothing twice.
    Dlq(cli::dlq::DlqArgs),
    /// Send test activations to the broker's Kafka topic (the settings
    /// `run` reads), printing each id once Kafka acknowledged it; run
    /// `taskbroker demo-worker` as the worker to see them complete.
    Produce(cli::produce::ProduceArgs),
}

/// `run --help`: every setting with its default, and where the reference is.
fn settings_help() -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "Settings are environment variables. `taskbroker config` prints their effective values; \
         `taskbroker config --markdown` prints the reference with what each one does and \
         allows (docs/configuration.md).\n",
    );
    for setting in taskbroker::config::SETTINGS {
        let default = if setting.default.is_empty() {
            "unset"
        } else {
            setting.default
        };
        let _ = write!(out, "\n  {} [default: {default}]", setting.variable());
    }
    out
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Config { markdown: true }) => {
            print!("{}", taskbroker::config::reference_markdown());
            return ExitCode::SUCCESS;
        }
        Some(Command::Demo(args)) => return cli::demo::demo(args),
        Some(Command::DemoWorker { listen, delay_ms }) => {
            return cli::demo::demo_worker(listen, delay_ms);
        }
        Some(Command::Healthcheck) => return healthcheck(),
        Some(Command::Inspect(args)) => return cli::inspect::inspect(args),
        Some(Command::Dlq(args)) => return cli::dlq::dlq(args),
        Some(Command::Produce(args)) => return cli::produce::produce(args),
        _ => {}
    }
    // Showing the settings or migrating the store needs no workers.
    let read = match cli.command {
        Some(Command::Config { .. } | Command::Migrate) => Config::from_env_without_running,
        _ => Config::from_env,
    };
    let config = match read() {
        Ok(config) => config,
        Err(err) => {
            eprintln!("taskbroker: {err}");
            return ExitCode::from(2);
        }
    };
    if let Err(message) = init_logging(&config) {
        eprintln!("taskbroker: {message}");
        return ExitCode::from(2);
    }
    for variable in unknown_variables(std::env::vars().map(|(name, _)| name)) {
        tracing::warn!(%variable, "unknown TASKBROKER_ variable ignored (typo?)");
    }
    // The benchmark's text search for this warning is how it knows the switch took effect.
    #[cfg(feature = "test-hooks")]
    if taskbroker::config::test_hooks::disable_release_on_full() {
        tracing::warn!(
            "TASKBROKER_TEST_DISABLE_RELEASE_ON_FULL=true: claims that cannot be handed to the \
             push pool wait for their lease (test-hooks build, benchmark switch, never for \
             production)"
        );
    }
    let outcome = match cli.command.unwrap_or(Command::Run) {
        Command::Config { .. } => {
            print!("{}", config.render_effective_on(&host_name()));
            println!();
            print!("{}", config.topology().render());
            Ok(())
        }
        Command::Migrate => actix_rt::System::new().block_on(migrate(&config)),
        Command::Run => actix_rt::System::new().block_on(run(config)),
        Command::Demo(_)
        | Command::DemoWorker { .. }
        | Command::Healthcheck
        | Command::Inspect(_)
        | Command::Dlq(_)
        | Command::Produce(_) => {
            unreachable!("handled before the configuration is read")
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            // Logs go to stderr too: once there, in the log's format. A
            // failure before logging was set up goes to stderr plainly.
            if tracing::dispatcher::has_been_set() {
                tracing::error!("{message}");
            } else {
                eprintln!("taskbroker: {message}");
            }
            ExitCode::FAILURE
        }
    }
}

fn init_logging(config: &Config) -> Result<(), String> {
    taskbroker::logging::init(&config.log, config.log_format)
}

/// Opens the configured store: PostgreSQL when `DATABASE_URL` is set, else
/// the embedded SQLite store at `SQLITE_PATH`. Logs which one runs.
fn open_store(config: &Config) -> Result<Arc<dyn ActivationStore>, String> {
    let broker_id = config.broker_id(|name| std::env::var(name).ok());
    let store: Arc<dyn ActivationStore> = match &config.database_url {
        Some(url) => {
            let store = PostgresStore::connect(&PostgresStoreConfig {
                url: url.clone(),
                pool_size: config.db_pool_size,
                async_commit: config.db_async_commit,
                broker_id: broker_id.clone(),
                claim_max_bytes: config.fetch_batch_bytes,
                ..PostgresStoreConfig::new(url.clone())
            })
            .map_err(|err| err.to_string())?;
            tracing::info!(backend = store.backend(), broker_id, "store: PostgreSQL");
            Arc::new(store)
        }
        None => {
            let store = SqliteStore::open(&SqliteStoreConfig {
                async_commit: config.db_async_commit,
                readers: config.db_pool_size.min(8),
                broker_id,
                claim_max_bytes: config.fetch_batch_bytes,
                ..SqliteStoreConfig::new(config.sqlite_path.clone())
            })
            .map_err(|err| err.to_string())?;
            tracing::info!(
                backend = store.backend(),
                path = %config.sqlite_path.display(),
                broker_id = store.broker_id(),
                "store: embedded SQLite (single node; set TASKBROKER_DATABASE_URL for PostgreSQL)"
            );
            Arc::new(store)
        }
    };
    Ok(store)
}

async fn migrate(config: &Config) -> Result<(), String> {
    let store = open_store(config)?;
    store.migrate().await.map_err(|err| err.to_string())?;
    tracing::info!("migrations applied");
    Ok(())
}

async fn run(config: Config) -> Result<(), String> {
    let store = open_store(&config)?;
    store.migrate().await.map_err(|err| err.to_string())?;
    let metrics = Arc::new(Metrics::new());
    let broker = Broker::start(&config, store, Arc::clone(&metrics), &host_name())?;
    match broker.store.count_by_status().await {
        Ok(counts) => {
            metrics.set_status_counts(counts.by_status());
            tracing::info!(inflight = counts.inflight(), "store ready");
        }
        Err(err) if !broker.store.is_running() => {
            return Err(format!("store actor stopped: {err}"));
        }
        Err(err) => tracing::warn!(error = %err, "store not answering yet"),
    }

    // Runs until a signal asks it to stop, or one of its parts fails.
    let failure = tokio::select! {
        () = wait_for_shutdown_signal() => None,
        failure = broker.health.failed() => Some(failure),
    };
    tracing::info!(
        timeout_ms = config.shutdown_timeout.as_millis() as u64,
        failure = failure.as_deref().unwrap_or("none"),
        "shutting down (a second signal exits at once)"
    );
    // A second signal means "now": exit without the orderly stop. Claims
    // still held then return through their lease.
    actix_rt::spawn(async {
        wait_for_shutdown_signal().await;
        tracing::warn!("second signal: exiting at once");
        std::process::exit(130);
    });
    match tokio::time::timeout(config.shutdown_timeout, broker.stop()).await {
        // The orchestrator restarts a broker that exits non-zero.
        Ok(()) if failure.is_some() => Err(format!(
            "stopped after a failure: {}; exiting non-zero so the broker is restarted",
            failure.unwrap_or_default()
        )),
        Ok(()) => {
            tracing::info!("stopped cleanly");
            Ok(())
        }
        Err(_) => Err(format!(
            "shutdown took longer than TASKBROKER_SHUTDOWN_TIMEOUT_MS={}; claims still held \
             return through their lease",
            config.shutdown_timeout.as_millis()
        )),
    }
}

/// GET /health on the metrics port over loopback, with plain HTTP/1.0 so
/// the container image needs no curl.
fn healthcheck() -> ExitCode {
    use std::io::{Read, Write};
    let addr = std::env::var("TASKBROKER_METRICS_ADDR").unwrap_or_else(|_| "0.0.0.0:9090".into());
    let port = match addr.parse::<std::net::SocketAddr>() {
        Ok(addr) => addr.port(),
        Err(err) => {
            eprintln!("TASKBROKER_METRICS_ADDR={addr}: {err}");
            return ExitCode::FAILURE;
        }
    };
    let target = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let healthy = (|| -> std::io::Result<bool> {
        let mut stream = std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2))?;
        stream.set_read_timeout(Some(Duration::from_secs(3)))?;
        stream.write_all(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut response = Vec::new();
        stream.take(4096).read_to_end(&mut response)?;
        Ok(response.starts_with(b"HTTP/1.1 200") || response.starts_with(b"HTTP/1.0 200"))
    })();
    match healthy {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("unhealthy: /health on {target} did not answer 200");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("unhealthy: {target}: {err}");
            ExitCode::FAILURE
        }
    }
}

/// This machine's name, for the advertised gRPC address.
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// Resolves on the first SIGTERM or SIGINT.
async fn wait_for_shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(err) => {
                tracing::warn!(error = %err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await
            }
        }
    };
    tokio::select! {
        _ = terminate => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}
