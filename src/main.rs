//! The `taskbroker` command.
//!
//! `taskbroker run` (the default) reads the configuration from `TASKBROKER_*`
//! variables, refusing to start on any bad value; opens the store and applies
//! migrations; starts the actors, each on an Arbiter (a thread) of its own so
//! the broker uses every core; then waits for SIGTERM or SIGINT and stops
//! the actors in the order `broker.rs` describes (consumer commits, fetchers
//! finish their batch, pushes in flight finish, held claims are released in
//! one statement, the gRPC server drains), exiting 0 within
//! `SHUTDOWN_TIMEOUT_MS`. A second signal exits at once. `taskbroker migrate` only applies migrations, and
//! `taskbroker config` prints the effective configuration (secrets redacted)
//! or, with `--markdown`, the configuration reference in docs/.

use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use taskbroker::actors::store::CountByStatus;
use taskbroker::broker::Broker;
use taskbroker::config::{Config, LogFormat, unknown_variables};
use taskbroker::metrics::Metrics;
use taskbroker::store::{
    ActivationStore, PostgresStore, PostgresStoreConfig, SqliteStore, SqliteStoreConfig,
};
use tracing_subscriber::EnvFilter;

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
    Run,
    /// Apply database migrations, then exit.
    Migrate,
    /// Print the effective configuration, secrets redacted.
    Config {
        /// Print the configuration reference (docs/configuration.md) instead.
        #[arg(long)]
        markdown: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Config { markdown: true }) = cli.command {
        print!("{}", taskbroker::config::reference_markdown());
        return ExitCode::SUCCESS;
    }
    let config = match Config::from_env() {
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
    let outcome = match cli.command.unwrap_or(Command::Run) {
        Command::Config { .. } => {
            print!("{}", config.render_effective());
            Ok(())
        }
        Command::Migrate => actix_rt::System::new().block_on(migrate(&config)),
        Command::Run => actix_rt::System::new().block_on(run(config)),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            tracing::error!("{message}");
            eprintln!("taskbroker: {message}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(config: &Config) -> Result<(), String> {
    let filter = EnvFilter::try_new(&config.log).map_err(|err| {
        format!(
            "TASKBROKER_LOG={}: not a valid log filter: {err}",
            config.log
        )
    })?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match config.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
    Ok(())
}

/// Opens the configured store: PostgreSQL when `DATABASE_URL` is set, else
/// the embedded SQLite store at `SQLITE_PATH`. Logs which one runs.
fn open_store(config: &Config) -> Result<Arc<dyn ActivationStore>, String> {
    let store: Arc<dyn ActivationStore> = match &config.database_url {
        Some(url) => {
            let store = PostgresStore::connect(&PostgresStoreConfig {
                url: url.clone(),
                pool_size: config.db_pool_size,
                async_commit: config.db_async_commit,
                ..PostgresStoreConfig::new(url.clone())
            })
            .map_err(|err| err.to_string())?;
            tracing::info!(backend = store.backend(), "store: PostgreSQL");
            Arc::new(store)
        }
        None => {
            let store = SqliteStore::open(&SqliteStoreConfig {
                async_commit: config.db_async_commit,
                readers: config.db_pool_size.min(8),
                ..SqliteStoreConfig::new(config.sqlite_path.clone())
            })
            .map_err(|err| err.to_string())?;
            tracing::info!(
                backend = store.backend(),
                path = %config.sqlite_path.display(),
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
    match broker.store.send(CountByStatus {}).await {
        Ok(Ok(counts)) => {
            metrics.set_status_counts(&counts);
            tracing::info!(inflight = counts.inflight(), "store ready");
        }
        Ok(Err(err)) => tracing::warn!(error = %err, "store not answering yet"),
        Err(err) => return Err(format!("store actor stopped: {err}")),
    }

    wait_for_shutdown_signal().await;
    tracing::info!(
        timeout_ms = config.shutdown_timeout.as_millis() as u64,
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
