//! `taskbroker-bench floor`: the SQL floor. The store work the broker does
//! for one task (insert, claim, mark processing, complete, delete), driven
//! straight at the database through the same store code and statements,
//! in full batches, with `--concurrency` loops so commits overlap as the
//! broker's do. No Kafka, no gRPC, no actors: what is left is the
//! database's own cost, and e2e throughput over this is the broker's
//! efficiency.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use taskbroker::model::{BucketRange, StatusUpdate, WorkerStatus};
use taskbroker::model::{KafkaPosition, inflight_from_record};
use taskbroker::store::{
    ActivationStore, PostgresStore, PostgresStoreConfig, SqliteStore, SqliteStoreConfig,
};

use crate::harness::{Scratch, StoreKind, run_id};
use crate::payload::{Parameters, activation};
use crate::pgstat::{PgCounters, print_top_statements};
use crate::procstat;

#[derive(clap::Args, Debug, Clone)]
pub struct FloorArgs {
    #[arg(long, value_enum, default_value_t = StoreKind::Postgres)]
    pub store: StoreKind,
    #[arg(long, default_value_t = 200_000)]
    pub tasks: u64,
    /// Rows per statement.
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Loops running at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Connections (PostgreSQL) or readers (SQLite).
    #[arg(long, default_value_t = 16)]
    pub pool: usize,
    #[arg(
        long,
        env = "TASKBROKER_TEST_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub admin_url: String,
}

pub async fn run(args: FloorArgs) -> Result<(), String> {
    let run = run_id();
    let scratch = Scratch::create(args.store, &args.admin_url, &run).await?;
    let result = run_in(&args, &scratch).await;
    scratch.remove().await;
    result
}

async fn run_in(args: &FloorArgs, scratch: &Scratch) -> Result<(), String> {
    let store: Arc<dyn ActivationStore> = match scratch {
        Scratch::Postgres { url, .. } => {
            let mut config = PostgresStoreConfig::new(url);
            config.pool_size = args.pool;
            Arc::new(PostgresStore::connect(&config).map_err(|e| e.to_string())?)
        }
        Scratch::Sqlite { path } => {
            let mut config = SqliteStoreConfig::new(path.clone());
            config.readers = args.pool.min(8);
            Arc::new(SqliteStore::open(&config).map_err(|e| e.to_string())?)
        }
    };
    store.migrate().await.map_err(|e| e.to_string())?;
    let pg = match scratch {
        Scratch::Postgres {
            admin_url, name, ..
        } => Some(PgCounters::start(admin_url, name).await?),
        Scratch::Sqlite { .. } => None,
    };

    let inserted = Arc::new(AtomicU64::new(0));
    let completed = Arc::new(AtomicU64::new(0));
    let cpu_before = procstat::cpu_seconds("self");
    let machine_before = procstat::machine_busy_seconds();
    let started = Instant::now();
    let loops: Vec<_> = (0..args.concurrency.max(1))
        .map(|_| {
            let (store, inserted, completed) = (
                Arc::clone(&store),
                Arc::clone(&inserted),
                Arc::clone(&completed),
            );
            let (tasks, batch) = (args.tasks, args.batch);
            actix_rt::spawn(async move { one_loop(store, inserted, completed, tasks, batch).await })
        })
        .collect();
    for handle in loops {
        handle.await.map_err(|err| err.to_string())??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = procstat::cpu_seconds("self") - cpu_before;
    let machine = procstat::machine_busy_seconds() - machine_before;
    let tasks = completed.load(Ordering::Relaxed);
    let throughput = tasks as f64 / elapsed;
    println!(
        "\nfloor, {} store: {tasks} tasks in batches of {}, {} loops",
        args.store.as_str(),
        args.batch,
        args.concurrency
    );
    println!("  throughput: {throughput:.0} tasks/s ({elapsed:.1} s)");
    println!(
        "  CPU: this process {cpu:.1} s ({:.3} s per 1,000 tasks), whole machine {machine:.1} s of {:.1} s available",
        cpu * 1000.0 / tasks.max(1) as f64,
        elapsed * 2.0
    );
    let mut statements = "–".to_owned();
    let mut wal = "–".to_owned();
    if let Some(pg) = &pg {
        let usage = pg.finish().await?;
        wal = format!("{:.0}", usage.wal_bytes as f64 / tasks.max(1) as f64);
        if let Some(count) = usage.statements {
            statements = format!("{:.3}", count as f64 / tasks.max(1) as f64);
        }
        println!(
            "  PostgreSQL: {statements} statements per task, {wal} WAL bytes per task; most execution time:"
        );
        print_top_statements(&usage, tasks, 8);
    }
    println!("\n| store | batch | loops | tasks/s | stmts/task | WAL B/task |");
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {} | {} | {throughput:.0} | {statements} | {wal} |",
        args.store.as_str(),
        args.batch,
        args.concurrency
    );
    Ok(())
}

async fn one_loop(
    store: Arc<dyn ActivationStore>,
    inserted: Arc<AtomicU64>,
    completed: Arc<AtomicU64>,
    tasks: u64,
    batch: usize,
) -> Result<(), String> {
    let lease = Duration::from_secs(60);
    loop {
        // Take a share of the inserts while any are left.
        let start = inserted.fetch_add(batch as u64, Ordering::Relaxed);
        if start < tasks {
            let n = (tasks - start).min(batch as u64) as usize;
            let rows = (0..n)
                .map(|i| {
                    let bytes = prost::Message::encode_to_vec(&activation(Parameters::Small));
                    let position = KafkaPosition {
                        topic: "floor".to_owned(),
                        partition: 0,
                        offset: (start + i as u64) as i64,
                    };
                    inflight_from_record(&bytes, position, chrono::Utc::now(), Duration::ZERO)
                        .map_err(|e| e.to_string())
                })
                .collect::<Result<Vec<_>, _>>()?;
            store.insert_batch(&rows).await.map_err(|e| e.to_string())?;
        }
        let claimed = store
            .claim_for_push(BucketRange::ALL, batch, lease)
            .await
            .map_err(|e| e.to_string())?;
        if claimed.is_empty() {
            if completed.load(Ordering::Relaxed) >= tasks {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        }
        let done = process_and_complete(store.as_ref(), claimed).await?;
        store
            .remove_completed(batch)
            .await
            .map_err(|e| e.to_string())?;
        completed.fetch_add(done, Ordering::Relaxed);
    }
}

/// What a worker's run does to claimed rows, in one statement each: mark
/// them Processing, then Complete. Returns how many rows there were.
pub async fn process_and_complete(
    store: &dyn ActivationStore,
    claimed: Vec<taskbroker::model::ClaimedActivation>,
) -> Result<u64, String> {
    let tokens: Vec<_> = claimed.iter().map(|row| row.token.clone()).collect();
    store
        .mark_processing(&tokens, Duration::from_secs(5))
        .await
        .map_err(|e| e.to_string())?;
    let updates: Vec<StatusUpdate> = claimed
        .into_iter()
        .map(|row| StatusUpdate::new(row.activation.id, WorkerStatus::Complete))
        .collect();
    store
        .set_status(&updates)
        .await
        .map_err(|e| e.to_string())?;
    Ok(updates.len() as u64)
}
