//! `taskbroker demo` (the whole broker on the mock Kafka cluster with a
//! pool of demo workers and a realistic task mix) and `taskbroker
//! demo-worker`. Everything here runs real components: workers are tonic
//! `WorkerService` servers, Kafka speaks the real protocol.
//!
//! These are commands of the binary, not part of the broker library, so the
//! library a deployment links carries no demo. The tests and the load
//! harness (the `tools/` package) also need the demo workers and the
//! ledger; Cargo lets no package depend on a binary, so they include
//! `worker.rs` and `scenario.rs` by path instead (`#[path]`), and those two
//! files use only `taskbroker::` paths and each other (`super::scenario`).

pub mod run;
pub mod scenario;
// Shared with the tests, which use the worker modes and controls (kill,
// restart, `Seen`) the demo commands never do.
#[allow(dead_code)]
pub mod worker;

use std::process::ExitCode;
use std::time::Duration;

use taskbroker::config::DeliveryMode;

use run::DemoOptions;
use worker::{DemoWorker, Mode};

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Tasks to produce.
    #[arg(long, default_value_t = 10_000)]
    tasks: usize,
    /// Demo workers (push: WorkerService servers; pull: GetTask clients).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Delivery mode.
    #[arg(long, default_value = "push", value_parser = ["push", "pull"])]
    mode: String,
    /// Tasks produced per second (default: as fast as possible).
    #[arg(long)]
    rate: Option<u64>,
    /// Keep running after the summary, for browsing /metrics.
    #[arg(long)]
    hold: bool,
    /// Give up after this many seconds (default: 60 + 1 s per 500 tasks).
    #[arg(long)]
    timeout_sec: Option<u64>,
    /// Also consume a raw topic (`demo-raw`, TASKBROKER_KAFKA_RAW_TOPICS): one
    /// in five tasks that should complete is produced as a plain payload,
    /// which the broker turns into a `demo/raw/echo` task.
    #[arg(long)]
    raw: bool,
    /// Also show the runtime rules (TASKBROKER_RUNTIME_CONFIG): one in a
    /// hundred tasks has a killswitched task name and is dropped; one in a
    /// hundred is in a namespace paused until two seconds after the last
    /// task is produced, then delivered.
    #[arg(long)]
    rules: bool,
}

/// The logger of `demo` and `demo-worker`: `TASKBROKER_LOG` (else
/// `default_filter`) and `TASKBROKER_LOG_FORMAT`, checked as `run` checks
/// them.
fn init_logging(default_filter: &str) -> Result<(), ExitCode> {
    taskbroker::config::log_settings(|name| std::env::var(name).ok(), default_filter)
        .and_then(|(filter, format)| taskbroker::logging::init(&filter, format))
        .map_err(|message| {
            eprintln!("taskbroker: {message}");
            ExitCode::from(2)
        })
}

pub fn demo(args: DemoArgs) -> ExitCode {
    if let Err(exit) = init_logging("warn") {
        return exit;
    }
    let mode = if args.mode == "pull" {
        DeliveryMode::Pull
    } else {
        DeliveryMode::Push
    };
    let options = DemoOptions {
        tasks: args.tasks,
        workers: args.workers,
        mode,
        rate: args.rate,
        hold: args.hold,
        raw: args.raw,
        rules: args.rules,
        timeout: Duration::from_secs(
            args.timeout_sec
                .unwrap_or(60 + (args.tasks as u64).div_ceil(500)),
        ),
    };
    match actix_rt::System::new().block_on(run::run(options)) {
        Ok(outcome) if outcome.passed => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("taskbroker demo: {message}");
            ExitCode::from(2)
        }
    }
}

pub fn demo_worker(listen: std::net::SocketAddr, delay_ms: u64) -> ExitCode {
    if let Err(exit) = init_logging("info") {
        return exit;
    }
    let secrets: Vec<String> = std::env::var("TASKBROKER_GRPC_SHARED_SECRETS")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|secret| !secret.is_empty())
        .map(str::to_owned)
        .collect();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("taskbroker demo-worker: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let mode = Mode::Execute {
            delay: Duration::from_millis(delay_ms),
        };
        match DemoWorker::start_on(listen, mode, secrets).await {
            Ok(worker) => {
                tracing::info!(addr = %worker.addr, "demo worker serving");
                crate::wait_for_shutdown_signal().await;
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("taskbroker demo-worker: cannot listen on {listen}: {err}");
                ExitCode::FAILURE
            }
        }
    })
}

// scenario.rs's own unit tests, kept here rather than in scenario.rs:
// tests/common and the tools package include that file too (see
// `worker.rs`), and there they would run again in every test binary.
#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::scenario::{Kind, report_for};
    use taskbroker::model::WorkerStatus;

    #[test]
    fn the_mix_has_every_kind_in_its_share() {
        let mut counts: HashMap<Kind, usize> = HashMap::new();
        for index in 0..1000 {
            *counts.entry(Kind::of_index(index)).or_default() += 1;
        }
        assert_eq!(counts[&Kind::Complete], 800);
        assert_eq!(counts[&Kind::Retry], 50);
        assert_eq!(counts[&Kind::Fail], 50);
        assert_eq!(counts[&Kind::Deadline], 30);
        assert_eq!(counts[&Kind::Delayed], 40);
        assert_eq!(counts[&Kind::Expire], 30);
    }

    #[test]
    fn workers_retry_a_retry_task_until_its_third_run() {
        let now = chrono::Utc::now();
        let mut activation = Kind::Retry.activation("r", now);
        assert_eq!(report_for(&activation), Some(WorkerStatus::Retry));
        activation.retry_state.as_mut().unwrap().attempts = 2;
        assert_eq!(report_for(&activation), Some(WorkerStatus::Complete));
        assert_eq!(
            report_for(&Kind::Deadline.activation("d", now)),
            None,
            "deadline tasks are never reported"
        );
        assert_eq!(
            report_for(&Kind::Fail.activation("f", now)),
            Some(WorkerStatus::Failure)
        );
    }
}
