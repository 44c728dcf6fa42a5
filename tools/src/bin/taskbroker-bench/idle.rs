//! `taskbroker-bench idle`: what a broker with nothing to do costs its
//! database (issue 20). One broker on a scratch PostgreSQL database and an
//! empty topic, `--brokers` of them sharing it if asked; after `--warmup-sec`
//! the run counts, for `--seconds`, the database's committed transactions
//! (`pg_stat_database.xact_commit`, which counts every statement outside an
//! explicit transaction as one), the statements by kind
//! (pg_stat_statements, when loaded) and the brokers' CPU time.

use std::time::Duration;

use crate::connect;
use crate::harness::{BrokerProcess, Services, broker_env, inflow, on_scratch_postgres};
use crate::pgstat::PgCounters;
use crate::procstat::cpu_seconds;

#[derive(clap::Args, Debug, Clone)]
pub struct IdleArgs {
    /// How long the idle brokers are measured.
    #[arg(long, default_value_t = 30)]
    pub seconds: u64,
    /// Time after the brokers got their partitions before measuring.
    #[arg(long, default_value_t = 5)]
    pub warmup_sec: u64,
    /// Brokers sharing the database and consumer group.
    #[arg(long, default_value_t = 1)]
    pub brokers: usize,
    #[command(flatten)]
    pub services: Services,
}

pub async fn run(args: IdleArgs) -> Result<(), String> {
    let admin_url = args.services.admin_url.clone();
    on_scratch_postgres(&admin_url, async |scratch, url, run| {
        let (topics, kafka, _producer) =
            inflow("idle", run, args.services.kafka_brokers.as_deref(), 4)?;
        let database = url
            .rsplit('/')
            .next()
            .and_then(|tail| tail.split('?').next())
            .unwrap_or_default()
            .to_owned();
        let mut env = broker_env(scratch, &kafka, &topics);
        // Push mode with a worker nobody listens on: nothing is pushed.
        env.push((
            "TASKBROKER_WORKER_ENDPOINTS".to_owned(),
            format!("*=http://127.0.0.1:{}", crate::harness::free_port()?),
        ));
        let mut brokers = Vec::with_capacity(args.brokers);
        for index in 0..args.brokers {
            let mut env = env.clone();
            env.push((
                "TASKBROKER_BROKER_ID".to_owned(),
                format!("bench-idle-{index}"),
            ));
            brokers.push(BrokerProcess::start(&args.services, &env, run).await?);
        }
        for broker in &brokers {
            broker.wait_assigned(Duration::from_secs(60)).await?;
        }
        tokio::time::sleep(Duration::from_secs(args.warmup_sec)).await;

        let admin = connect(&admin_url).await?;
        let commits = async || -> Result<i64, String> {
            admin
                .query_one(
                    "SELECT xact_commit FROM pg_stat_database WHERE datname = $1",
                    &[&database],
                )
                .await
                .map(|row| row.get(0))
                .map_err(|err| err.to_string())
        };
        // pg_stat_database is refreshed when a backend reports; a forced
        // flush keeps the two readings comparable.
        let _ = admin
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await;
        let counters = PgCounters::start(&admin_url, &database).await?;
        let cpu_before: f64 = brokers.iter().map(|b| cpu_seconds(&b.pid())).sum();
        let before = commits().await?;
        tokio::time::sleep(Duration::from_secs(args.seconds)).await;
        let _ = admin
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await;
        let after = commits().await?;
        let cpu_after: f64 = brokers.iter().map(|b| cpu_seconds(&b.pid())).sum();
        let usage = counters.finish().await?;
        for broker in brokers {
            broker.stop().await?;
        }

        let seconds = args.seconds as f64;
        println!(
            "idle: {} broker(s), {} s measured after {} s warm-up",
            args.brokers, args.seconds, args.warmup_sec
        );
        println!("| measure | per second |");
        println!("|---|---|");
        println!(
            "| committed transactions (pg_stat_database) | {:.1} |",
            (after - before) as f64 / seconds
        );
        if let Some(statements) = usage.statements {
            println!(
                "| statements (pg_stat_statements) | {:.1} |",
                statements as f64 / seconds
            );
        }
        println!(
            "| broker CPU (all brokers) | {:.1} ms |",
            (cpu_after - cpu_before) * 1000.0 / seconds
        );
        println!("| WAL | {:.0} B |", usage.wal_bytes as f64 / seconds);
        if !usage.top.is_empty() {
            println!("\nstatements by calls per second:");
            let mut top = usage.top.clone();
            top.sort_by_key(|(calls, ..)| std::cmp::Reverse(*calls));
            for (calls, _, total_ms, query) in top.iter().take(15) {
                let query: String = query.chars().take(90).collect();
                println!(
                    "  {:>6.2}/s {:>8.2} ms total  {query}",
                    *calls as f64 / seconds,
                    total_ms
                );
            }
        }
        Ok(())
    })
    .await
}
