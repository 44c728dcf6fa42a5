//! The `taskbroker` binary's own modules: what its commands need that the
//! broker library does not: `demo` (`taskbroker demo` and `taskbroker
//! demo-worker`), `inspect` (`taskbroker inspect`), `dlq` (`taskbroker
//! dlq list|show|redrive`) and `produce` (`taskbroker produce`); the broker commands
//! themselves (`run`, `migrate`, `config`, `healthcheck`) are small enough
//! to stay in main.rs.

pub mod demo;
pub mod dlq;
pub mod inspect;
pub mod produce;

use std::future::Future;
use std::process::ExitCode;

use taskbroker::config::Config;

/// Runs an operator's tool (`inspect`, `dlq`, `produce`): reads the configuration,
/// minus push mode's one requirement (`WORKER_ENDPOINTS`), which a tool
/// that only reads the store or Kafka must not need; runs `tool` on a
/// runtime of its own; prints its error as `taskbroker <name>: …` and exits
/// 2 for a bad configuration, 1 for a failure.
pub fn run_tool<F, Fut>(name: &str, tool: F) -> ExitCode
where
    F: FnOnce(Config) -> Fut,
    Fut: Future<Output = Result<(), String>>,
{
    let config = match Config::from_lookup(|variable| match variable {
        "TASKBROKER_DELIVERY_MODE" => Some("pull".to_owned()),
        _ => std::env::var(variable).ok(),
    }) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("taskbroker {name}: {err}");
            return ExitCode::from(2);
        }
    };
    let outcome = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| err.to_string())
        .and_then(|runtime| runtime.block_on(tool(config)));
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("taskbroker {name}: {message}");
            ExitCode::FAILURE
        }
    }
}
