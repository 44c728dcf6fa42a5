//! `taskbroker-bench recovery`: how fast a dead broker's work is back in
//! flight, and whether a frozen one pushes twice (issue 19).
//!
//! Two brokers (`bench-victim`, `bench-peer`) share one PostgreSQL
//! database and one consumer group; tasks flow in at a steady `--rate` to
//! demo workers in this process, which take `--accept-ms` to accept each
//! push and then report the task done to the broker that pushed it. After `--before-sec` the victim
//! is SIGKILLed (`--fault kill`) or SIGSTOPped for `--freeze-sec` and then
//! SIGCONTed (`--fault freeze`); the run goes on for `--after-sec`, then
//! waits (up to `--drain-sec`) for every task to finish.
//!
//! Measured: the claims the victim held at the fault (read from
//! `claimed_by`), and the time until every one of them was pushed again
//! (its row Processing or finished); duplicate deliveries (a task
//! delivered more than once), and among them those the victim sent after
//! it resumed of a task its peer had already been sent; tasks lost
//! (produced, never delivered). `--takeover-ms` sets both brokers'
//! `TASKBROKER_TAKEOVER_TIMEOUT_MS`: a value above the claim lease shows
//! the recovery that only the lease provides.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::connect;
use crate::demo::{DemoWorker, Mode};
use crate::harness::{
    BrokerProcess, Scratch, Services, broker_env, inflow, on_scratch_postgres, signal,
};
use crate::scrape::metric;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL: the victim is gone for good.
    Kill,
    /// SIGSTOP for `--freeze-sec`, then SIGCONT.
    Freeze,
}

#[derive(clap::Args, Debug, Clone)]
pub struct RecoveryArgs {
    #[arg(long, value_enum)]
    pub fault: Fault,
    /// Tasks produced per second.
    #[arg(long, default_value_t = 500)]
    pub rate: u64,
    #[arg(long, default_value_t = 10)]
    pub before_sec: u64,
    /// How long the victim stays frozen (`--fault freeze`).
    #[arg(long, default_value_t = 10)]
    pub freeze_sec: u64,
    #[arg(long, default_value_t = 20)]
    pub after_sec: u64,
    /// Longest wait for the last tasks to finish after the inflow stops.
    #[arg(long, default_value_t = 120)]
    pub drain_sec: u64,
    /// How long a worker takes to accept a push (then it reports the task
    /// done at once): the time each claim spends being pushed.
    #[arg(long, default_value_t = 50)]
    pub accept_ms: u64,
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    #[arg(long, default_value_t = 4)]
    pub partitions: i32,
    /// TASKBROKER_HEARTBEAT_INTERVAL_MS of both brokers.
    #[arg(long, default_value_t = 1000)]
    pub heartbeat_ms: u64,
    /// TASKBROKER_TAKEOVER_TIMEOUT_MS of both brokers.
    #[arg(long, default_value_t = 3000)]
    pub takeover_ms: u64,
    #[command(flatten)]
    pub services: Services,
}

const VICTIM: &str = "bench-victim";
const PEER: &str = "bench-peer";

pub async fn run(args: RecoveryArgs) -> Result<(), String> {
    on_scratch_postgres(&args.services.admin_url, async |scratch, url, run| {
        run_in(&args, run, scratch, url).await
    })
    .await
}

async fn run_in(
    args: &RecoveryArgs,
    run: &str,
    scratch: &Scratch,
    url: &str,
) -> Result<(), String> {
    let (topics, kafka, producer) = inflow(
        "recovery",
        run,
        args.services.kafka_brokers.as_deref(),
        args.partitions,
    )?;
    let mut workers = Vec::new();
    for _ in 0..args.workers.max(1) {
        workers.push(
            DemoWorker::start(Mode::ExecuteSlowly {
                accept: Duration::from_millis(args.accept_ms),
            })
            .await
            .map_err(|err| format!("worker: {err}"))?,
        );
    }
    let urls: Vec<String> = workers.iter().map(DemoWorker::url).collect();
    let mut env = broker_env(scratch, &kafka, &topics);
    env.extend([
        (
            "TASKBROKER_WORKER_ENDPOINTS".to_owned(),
            format!("*={}", urls.join("|")),
        ),
        (
            "TASKBROKER_HEARTBEAT_INTERVAL_MS".to_owned(),
            args.heartbeat_ms.to_string(),
        ),
        (
            "TASKBROKER_TAKEOVER_TIMEOUT_MS".to_owned(),
            args.takeover_ms.to_string(),
        ),
    ]);
    let with_id = |id: &str| {
        let mut env = env.clone();
        env.push(("TASKBROKER_BROKER_ID".to_owned(), id.to_owned()));
        env
    };
    let victim = BrokerProcess::start(&args.services, &with_id(VICTIM), run).await?;
    let peer = BrokerProcess::start(&args.services, &with_id(PEER), &format!("{run}-peer")).await?;
    victim.wait_assigned(Duration::from_secs(60)).await?;
    peer.wait_assigned(Duration::from_secs(60)).await?;
    let db = connect(url).await?;

    eprintln!(
        "recovery: {:?} of the victim at {} s, {} tasks/s, takeover {} ms, heartbeat {} ms",
        args.fault, args.before_sec, args.rate, args.takeover_ms, args.heartbeat_ms
    );
    let started = Instant::now();
    let fault_at = Duration::from_secs(args.before_sec);
    let thaw_at = fault_at + Duration::from_secs(args.freeze_sec);
    let end = match args.fault {
        Fault::Kill => fault_at,
        Fault::Freeze => thaw_at,
    } + Duration::from_secs(args.after_sec);
    let mut sent = 0u64;
    let mut victim = Some(victim);
    let mut held: Option<(Instant, HashSet<String>)> = None;
    let mut recovered_after: Option<Duration> = None;
    let mut resumed_at: Option<Instant> = None;
    while started.elapsed() < end {
        let now = started.elapsed();
        let due = (args.rate as f64 * now.as_secs_f64()) as u64;
        while sent < due {
            producer.send()?;
            sent += 1;
        }
        if held.is_none() && now >= fault_at {
            let Some(process) = victim.as_ref() else {
                break;
            };
            match args.fault {
                Fault::Kill => signal(&process.pid(), "KILL")?,
                Fault::Freeze => signal(&process.pid(), "STOP")?,
            }
            let at = Instant::now();
            held = Some((at, claimed_by(&db, VICTIM).await?));
        }
        if args.fault == Fault::Freeze && resumed_at.is_none() && now >= thaw_at {
            if let Some(process) = &victim {
                signal(&process.pid(), "CONT")?;
            }
            resumed_at = Some(Instant::now());
        }
        if let Some((at, ids)) = &held
            && recovered_after.is_none()
            && not_yet_pushed_again(&db, ids).await? == 0
        {
            recovered_after = Some(at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    producer.flush()?;
    let produced = sent;
    let drain_until = Instant::now() + Duration::from_secs(args.drain_sec);
    let mut left = i64::MAX;
    while Instant::now() < drain_until {
        if let Some((at, ids)) = &held
            && recovered_after.is_none()
            && not_yet_pushed_again(&db, ids).await? == 0
        {
            recovered_after = Some(at.elapsed());
        }
        left = db
            .query_one("SELECT count(*) FROM inflight_taskactivations", &[])
            .await
            .map_err(|err| err.to_string())?
            .get(0);
        let delivered: HashSet<String> = workers
            .iter()
            .flat_map(|worker| worker.seen.deliveries())
            .map(|delivery| delivery.id)
            .collect();
        if left == 0 && delivered.len() as u64 >= produced && recovered_after.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let peer_metrics = peer.scrape().await?;
    let victim_metrics = match (args.fault, &victim) {
        (Fault::Freeze, Some(process)) => process.scrape().await.unwrap_or_default(),
        _ => String::new(),
    };
    let deliveries: Vec<_> = workers
        .iter()
        .flat_map(|worker| worker.seen.deliveries())
        .collect();
    let mut per_task: HashMap<&str, usize> = HashMap::new();
    for delivery in &deliveries {
        *per_task.entry(delivery.id.as_str()).or_default() += 1;
    }
    let duplicates: usize = per_task.values().map(|n| n - 1).sum();
    let held_ids = held
        .as_ref()
        .map(|(_, ids)| ids.clone())
        .unwrap_or_default();
    let held_duplicates: usize = per_task
        .iter()
        .filter(|(id, _)| held_ids.contains(**id))
        .map(|(_, n)| n - 1)
        .sum();
    let lost = produced.saturating_sub(per_task.len() as u64);
    let victim_url = victim
        .as_ref()
        .map(|process| process.grpc.to_string())
        .unwrap_or_default();
    let peer_url = peer.grpc.to_string();
    // Of the claims the victim held, those its peer was sent and the victim
    // sent again after resuming: the double pushes the fence must prevent.
    let resumed_doubles = resumed_at.map_or(0, |resumed| {
        let by_peer: HashSet<&str> = deliveries
            .iter()
            .filter(|delivery| delivery.callback_url == peer_url)
            .map(|delivery| delivery.id.as_str())
            .collect();
        deliveries
            .iter()
            .filter(|delivery| {
                delivery.callback_url == victim_url
                    && delivery.at > resumed
                    && held_ids.contains(&delivery.id)
                    && by_peer.contains(delivery.id.as_str())
            })
            .count()
    });

    println!(
        "\nrecovery scenario: victim {} at {} s{}; {} tasks/s; heartbeat {} ms, takeover {} ms",
        match args.fault {
            Fault::Kill => "SIGKILLed",
            Fault::Freeze => "SIGSTOPped",
        },
        args.before_sec,
        match args.fault {
            Fault::Kill => String::new(),
            Fault::Freeze => format!(" for {} s", args.freeze_sec),
        },
        args.rate,
        args.heartbeat_ms,
        args.takeover_ms
    );
    println!("claims the victim held at the fault: {}", held_ids.len());
    println!(
        "every one of them pushed again after: {}",
        match recovered_after {
            _ if held_ids.is_empty() => "n/a (it held none)".to_owned(),
            Some(after) => format!("{:.2} s", after.as_secs_f64()),
            None => "not within the run".to_owned(),
        }
    );
    println!(
        "peer: takeovers {}, claims released by takeover {}, by lease {}",
        metric(&peer_metrics, "taskbroker_broker_takeovers_total", ""),
        metric(
            &peer_metrics,
            "taskbroker_claims_released_total",
            "reason=\"takeover\""
        ),
        metric(
            &peer_metrics,
            "taskbroker_claims_released_total",
            "reason=\"lease_expired\""
        ),
    );
    if args.fault == Fault::Freeze {
        println!(
            "victim after resuming: pushes refused by its liveness (not_live) {}, \
             claims it held pushed again by it after its peer: {resumed_doubles}",
            metric(
                &victim_metrics,
                "taskbroker_pushes_total",
                "result=\"not_live\""
            ),
        );
    }
    println!(
        "tasks produced {produced}; delivered {}; lost {lost}; rows left {left}",
        per_task.len()
    );
    println!(
        "duplicate deliveries {duplicates}: {held_duplicates} of claims the victim held \
         (pushes it had sent before the fault), {} others (records read again after the \
         partitions moved, Processing tasks whose report went to the victim)",
        duplicates - held_duplicates
    );
    if let Some(process) = victim.take() {
        if args.fault == Fault::Freeze {
            process.stop().await?;
        } else {
            drop(process);
        }
    }
    peer.stop().await?;
    drop(workers);
    Ok(())
}

/// Ids of the rows `broker` holds Claimed.
async fn claimed_by(db: &tokio_postgres::Client, broker: &str) -> Result<HashSet<String>, String> {
    Ok(db
        .query(
            "SELECT id FROM inflight_taskactivations \
             WHERE status = 'Claimed' AND claimed_by = $1",
            &[&broker],
        )
        .await
        .map_err(|err| err.to_string())?
        .iter()
        .map(|row| row.get(0))
        .collect())
}

/// How many of `ids` have not been pushed again yet: still Pending or
/// Claimed (a row Processing, or gone because it finished, was pushed).
async fn not_yet_pushed_again(
    db: &tokio_postgres::Client,
    ids: &HashSet<String>,
) -> Result<i64, String> {
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    Ok(db
        .query_one(
            "SELECT count(*) FROM inflight_taskactivations \
             WHERE id = ANY($1) AND status IN ('Pending', 'Claimed')",
            &[&ids],
        )
        .await
        .map_err(|err| err.to_string())?
        .get(0))
}
