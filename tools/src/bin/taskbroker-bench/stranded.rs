//! `taskbroker-bench stranded`: the scenario release-on-full exists for.
//!
//! Tasks flow in at a steady `--rate`; after `--before-sec` every worker
//! goes away for `--outage-sec`, then comes back, and the run goes on for
//! `--after-sec`. `--outage kill` SIGKILLs the workers process (connections
//! are refused) and starts a new one on the same ports; `--outage freeze`
//! SIGSTOPs it (the kernel still accepts connections, so pushes hang until
//! their timeout and fill the push pool) and SIGCONTs it.
//! `--no-release-on-full` runs the broker with
//! `TASKBROKER_TEST_DISABLE_RELEASE_ON_FULL=true`: claims the full pool
//! cannot take wait for their lease, as in the older design. Only a broker
//! built with `--features test-hooks` reads that switch; the run stops when
//! the broker does not confirm it at startup.
//!
//! Sampled every `--sample-ms`: the broker's
//! `taskbroker_pending_activation_max_lag_seconds`, the oldest Claimed
//! row's age (from PostgreSQL: claim_expires_at − lease), Claimed and
//! Pending rows, and push attempts per second. Reported: the series (per
//! second), the oldest claim against the legitimate path, and the time from
//! the workers' return until max lag is back to its baseline.

use std::time::{Duration, Instant};

use taskbroker::config::Config;

use crate::connect;
use crate::harness::{
    BrokerProcess, Scratch, Services, WorkersProcess, broker_env, inflow, on_scratch_postgres,
    signal,
};
use crate::scrape::metric;

/// The broker's test switch behind `--no-release-on-full` (read only by a
/// broker built with the `test-hooks` feature).
const DISABLE_RELEASE_ON_FULL: &str = "TASKBROKER_TEST_DISABLE_RELEASE_ON_FULL";

/// A broker built without `test-hooks` ignores the switch (it warns about an
/// unknown variable) and would release claims as usual, so the "before"
/// picture would silently show the "after" one. A broker that reads it says
/// so in its startup warning, which the log holds by the time `/health`
/// answers.
fn confirm_release_on_full_is_off(broker: &BrokerProcess) -> Result<(), String> {
    let log = std::fs::read_to_string(&broker.log).unwrap_or_default();
    if log.contains(&format!("{DISABLE_RELEASE_ON_FULL}=true")) {
        return Ok(());
    }
    Err(format!(
        "--no-release-on-full needs a broker built with the `test-hooks` feature \
         (`cargo build --release --features test-hooks`): this broker did not confirm \
         {DISABLE_RELEASE_ON_FULL}=true at startup (or TASKBROKER_LOG hides its warnings); \
         its log: {}",
        broker.log.display()
    ))
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    /// SIGKILL: connections refused, pushes fail at once.
    Kill,
    /// SIGSTOP: connections accepted, pushes hang until their timeout.
    Freeze,
}

#[derive(clap::Args, Debug, Clone)]
pub struct StrandedArgs {
    #[arg(long, value_enum)]
    pub outage: Outage,
    /// Leave claims the full pool cannot take to their lease (older design).
    /// Needs a broker built with `cargo build --release --features test-hooks`.
    #[arg(long)]
    pub no_release_on_full: bool,
    #[arg(long, default_value_t = 500)]
    pub rate: u64,
    #[arg(long, default_value_t = 10)]
    pub before_sec: u64,
    #[arg(long, default_value_t = 10)]
    pub outage_sec: u64,
    #[arg(long, default_value_t = 30)]
    pub after_sec: u64,
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    #[arg(long, default_value_t = 4)]
    pub partitions: i32,
    #[arg(long, default_value_t = 250)]
    pub sample_ms: u64,
    #[command(flatten)]
    pub services: Services,
}

struct Sample {
    at: f64,
    lag: f64,
    oldest_claim: f64,
    claimed: i64,
    pending: i64,
    pushes: f64,
}

pub async fn run(args: StrandedArgs) -> Result<(), String> {
    on_scratch_postgres(&args.services.admin_url, async |scratch, url, run| {
        run_in(&args, run, scratch, url).await
    })
    .await
}

async fn run_in(
    args: &StrandedArgs,
    run: &str,
    scratch: &Scratch,
    url: &str,
) -> Result<(), String> {
    let (topics, kafka, producer) = inflow(
        "stranded",
        run,
        args.services.kafka_brokers.as_deref(),
        args.partitions,
    )?;
    let worker_args = |ports: &[String]| -> Vec<String> {
        let mut list = vec!["--count".to_owned(), args.workers.to_string()];
        if !ports.is_empty() {
            list.push("--ports".to_owned());
            list.push(ports.join(","));
        }
        list
    };
    let mut workers = Some(WorkersProcess::start(&worker_args(&[]))?);
    let urls = workers.as_ref().map(|w| w.urls.clone()).unwrap_or_default();
    let ports: Vec<String> = urls
        .iter()
        .filter_map(|url| url.rsplit(':').next().map(str::to_owned))
        .collect();

    let mut env = broker_env(scratch, &kafka, &topics);
    env.push((
        "TASKBROKER_WORKER_ENDPOINTS".to_owned(),
        format!("*={}", urls.join("|")),
    ));
    if args.no_release_on_full {
        env.push((DISABLE_RELEASE_ON_FULL.to_owned(), "true".to_owned()));
    }
    if std::env::var_os("TASKBROKER_UPKEEP_INTERVAL_MS").is_none() {
        env.push(("TASKBROKER_UPKEEP_INTERVAL_MS".to_owned(), "250".to_owned()));
    }
    // The broker's own view of its settings: the user's environment with
    // this run's on top.
    let config = Config::from_lookup(|name| {
        env.iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var(name).ok())
    })
    .map_err(|err| err.to_string())?;
    let lease = config.claim_lease();
    let rounds = config
        .push_queue_size
        .div_ceil(config.push_concurrency.max(1)) as u32;
    let legitimate = config.push_queue_timeout + config.push_timeout * (1 + rounds);

    let broker = BrokerProcess::start(&args.services, &env, run).await?;
    if args.no_release_on_full {
        confirm_release_on_full_is_off(&broker)?;
    }
    broker.wait_assigned(Duration::from_secs(60)).await?;
    let db = connect(url).await?;

    let phase_out = Duration::from_secs(args.before_sec);
    let phase_back = phase_out + Duration::from_secs(args.outage_sec);
    let end = phase_back + Duration::from_secs(args.after_sec);
    let sample_every = Duration::from_millis(args.sample_ms);
    let mut samples: Vec<Sample> = Vec::new();
    let mut reported_before_kill = 0u64;
    let mut out = false;
    let mut back = false;
    let started = Instant::now();
    let mut sent = 0u64;
    let mut next_sample = Duration::ZERO;
    let mut first_metrics: Option<String> = None;
    eprintln!(
        "stranded: {:?} outage, release-on-full {}, {} tasks/s; workers out at {} s, back at {} s, end at {} s",
        args.outage,
        if args.no_release_on_full { "off" } else { "on" },
        args.rate,
        phase_out.as_secs(),
        phase_back.as_secs(),
        end.as_secs()
    );
    while started.elapsed() < end {
        let now = started.elapsed();
        let due = (args.rate as f64 * now.as_secs_f64()) as u64;
        while sent < due {
            producer.send()?;
            sent += 1;
        }
        if !out && now >= phase_out {
            out = true;
            match (args.outage, workers.take()) {
                (Outage::Kill, Some(w)) => {
                    reported_before_kill += w.reported();
                    w.kill();
                }
                (Outage::Freeze, Some(w)) => {
                    signal(&w.pid(), "STOP")?;
                    workers = Some(w);
                }
                (_, None) => {}
            }
        }
        if !back && now >= phase_back {
            back = true;
            match args.outage {
                Outage::Kill => workers = Some(WorkersProcess::start(&worker_args(&ports))?),
                Outage::Freeze => {
                    if let Some(w) = &workers {
                        signal(&w.pid(), "CONT")?;
                    }
                }
            }
        }
        if now >= next_sample {
            next_sample += sample_every;
            let text = broker.scrape().await?;
            if first_metrics.is_none() {
                first_metrics = Some(text.clone());
            }
            let row = db
                .query_one(
                    "SELECT count(*) FILTER (WHERE status = 'Claimed'), \
                            count(*) FILTER (WHERE status = 'Pending'), \
                            EXTRACT(EPOCH FROM now() - min(claim_expires_at) FILTER (WHERE status = 'Claimed'))::float8 \
                     FROM inflight_taskactivations",
                    &[],
                )
                .await
                .map_err(|err| err.to_string())?;
            let since_expiry: Option<f64> = row.get(2);
            samples.push(Sample {
                at: now.as_secs_f64(),
                lag: metric(&text, "taskbroker_pending_activation_max_lag_seconds", ""),
                oldest_claim: since_expiry.map_or(0.0, |s| (lease.as_secs_f64() + s).max(0.0)),
                claimed: row.get(0),
                pending: row.get(1),
                // Each push is counted once, under one result.
                pushes: metric(&text, "taskbroker_pushes_total", ""),
            });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    producer.flush()?;
    let final_metrics = broker.scrape().await?;
    let first_metrics = first_metrics.unwrap_or_default();
    let (warnings, errors) = broker.log_levels();
    let log = broker.log.clone();
    let summary = match workers {
        Some(w) => w.finish()?,
        None => Default::default(),
    };
    broker.stop().await?;

    // Per-second series: the worst sample of each second.
    println!(
        "\nstranded-claim scenario: workers {} at {} s for {} s; release-on-full {}; {} tasks/s offered",
        match args.outage {
            Outage::Kill => "killed",
            Outage::Freeze => "frozen (SIGSTOP)",
        },
        args.before_sec,
        args.outage_sec,
        if args.no_release_on_full { "OFF" } else { "on" },
        args.rate
    );
    println!(
        "lease {:.1} s; legitimate path {:.1} s (queue timeout {:.1} s + push timeout {:.1} s × (1 + {rounds}))",
        lease.as_secs_f64(),
        legitimate.as_secs_f64(),
        config.push_queue_timeout.as_secs_f64(),
        config.push_timeout.as_secs_f64()
    );
    println!(
        "\n| t (s) | phase | max lag (s) | oldest Claimed (s) | Claimed | Pending | push attempts/s |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|");
    let mut second = 0u64;
    let mut previous_pushes = samples.first().map_or(0.0, |s| s.pushes);
    while (second as f64) < end.as_secs_f64() {
        let window: Vec<&Sample> = samples
            .iter()
            .filter(|s| s.at >= second as f64 && s.at < (second + 1) as f64)
            .collect();
        if let Some(last) = window.last() {
            let lag = window.iter().map(|s| s.lag).fold(0.0, f64::max);
            let oldest = window.iter().map(|s| s.oldest_claim).fold(0.0, f64::max);
            let claimed = window.iter().map(|s| s.claimed).max().unwrap_or(0);
            let pending = window.iter().map(|s| s.pending).max().unwrap_or(0);
            let phase = if second < args.before_sec {
                "up"
            } else if second < args.before_sec + args.outage_sec {
                "OUT"
            } else {
                "back"
            };
            println!(
                "| {second} | {phase} | {lag:.2} | {oldest:.2} | {claimed} | {pending} | {:.0} |",
                last.pushes - previous_pushes
            );
            previous_pushes = last.pushes;
        }
        second += 1;
    }

    // Baseline: the highest max lag of the steady second half before the
    // outage (the gauge moves with each upkeep pass, so its steady-state
    // ceiling, not its median, is what "normal" looks like).
    let baseline = samples
        .iter()
        .filter(|s| s.at >= args.before_sec as f64 / 2.0 && s.at < args.before_sec as f64)
        .map(|s| s.lag)
        .fold(0.0, f64::max);
    let back_at = phase_back.as_secs_f64();
    let recovery = samples
        .iter()
        .find(|s| s.at >= back_at && s.lag <= baseline + 0.05)
        .map_or("not within the run".to_owned(), |s| {
            format!("{:.2} s", s.at - back_at)
        });
    let oldest = samples.iter().map(|s| s.oldest_claim).fold(0.0, f64::max);
    let out_pushes = |from: f64, to: f64| {
        let at = |t: f64| {
            samples
                .iter()
                .rfind(|s| s.at <= t)
                .map_or(0.0, |s| s.pushes)
        };
        (at(to) - at(from)) / (to - from).max(1e-6)
    };
    println!("\nmax lag baseline (highest in the second half before the outage): {baseline:.2} s");
    println!("max lag back to the baseline after the workers returned: {recovery}");
    println!(
        "oldest Claimed row at any sample: {oldest:.2} s (legitimate path {:.1} s: {})",
        legitimate.as_secs_f64(),
        if oldest <= legitimate.as_secs_f64() {
            "within"
        } else {
            "EXCEEDED"
        }
    );
    println!(
        "push attempts during the outage: {:.0}/s (before it: {:.0}/s)",
        out_pushes(phase_out.as_secs_f64() + 1.0, phase_back.as_secs_f64()),
        out_pushes(1.0, phase_out.as_secs_f64())
    );
    println!(
        "pushes by result over the run: {}",
        crate::scrape::push_results(&first_metrics, &final_metrics)
    );
    println!(
        "claims released: queue_timeout {}, push_failed {}, lease_expired {}",
        metric(
            &final_metrics,
            "taskbroker_claims_released_total",
            "queue_timeout"
        ),
        metric(
            &final_metrics,
            "taskbroker_claims_released_total",
            "push_failed"
        ),
        metric(
            &final_metrics,
            "taskbroker_claims_released_total",
            "lease_expired"
        ),
    );
    println!(
        "tasks produced {sent}; reports acknowledged {} ; duplicate deliveries {}; broker log: {warnings} warnings, {errors} errors ({})",
        reported_before_kill + summary.get("reported").copied().unwrap_or(0),
        summary.get("duplicates").copied().unwrap_or(0),
        log.display()
    );
    Ok(())
}
