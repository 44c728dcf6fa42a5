//! `taskbroker-bench sqlite-soak`: the embedded store over a long run.
//!
//! ```sh
//! cargo run --release --bin taskbroker-bench -- sqlite-soak --tasks 1000000
//! ```
//!
//! Passes N tasks through the embedded SQLite store (insert, claim, mark
//! processing, complete, in batches) while an upkeep loop removes completed
//! rows as the UpkeepActor does, and reports the database file's size
//! (main file + WAL) over the run: it must track the rows in flight, not
//! the history.

use std::sync::Arc;
use std::time::{Duration, Instant};

use taskbroker::model::BucketRange;
use taskbroker::store::{ActivationStore, SqliteStore, SqliteStoreConfig};

use crate::{fill, floor, peak_rss_kib};

#[derive(clap::Args)]
pub struct SoakArgs {
    /// Tasks to pass through.
    #[arg(long, default_value_t = 1_000_000)]
    tasks: usize,
    /// Rows per insert / claim / mark / complete call.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// UPKEEP_INTERVAL_MS.
    #[arg(long, default_value_t = 100)]
    upkeep_interval_ms: u64,
    /// UPKEEP_BATCH_LIMIT.
    #[arg(long, default_value_t = 1000)]
    upkeep_limit: usize,
    /// Database file (default: a new file in the temporary directory,
    /// removed afterwards).
    #[arg(long)]
    path: Option<std::path::PathBuf>,
}

pub async fn run(args: SoakArgs) -> Result<(), String> {
    let scratch = args.path.is_none();
    let path = args.path.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!(
            "taskbroker_soak_{}.sqlite",
            uuid::Uuid::new_v4().simple()
        ))
    });
    // Main file + WAL: what the store occupies on disk.
    let on_disk = |path: &std::path::Path| -> u64 {
        SqliteStore::files(path)
            .iter()
            .take(2)
            .filter_map(|file| std::fs::metadata(file).ok())
            .map(|meta| meta.len())
            .sum()
    };
    let store = Arc::new(
        SqliteStore::open(&SqliteStoreConfig::new(path.clone())).map_err(|e| e.to_string())?,
    );
    store.migrate().await.map_err(|e| e.to_string())?;

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let upkeep = {
        let (store, stop) = (Arc::clone(&store), Arc::clone(&stop));
        let interval = Duration::from_millis(args.upkeep_interval_ms);
        let limit = args.upkeep_limit;
        actix_rt::spawn(async move {
            let mut removed = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                removed += store.remove_completed(limit).await.unwrap_or(0);
                tokio::time::sleep(interval).await;
            }
            removed
        })
    };

    println!(
        "sqlite-soak: {} tasks, batch {}, upkeep every {} ms removing up to {} rows, file {}",
        args.tasks,
        args.batch,
        args.upkeep_interval_ms,
        args.upkeep_limit,
        path.display()
    );
    println!("| tasks done | tasks/s (interval) | rows in store | file + WAL (MiB) |");
    println!("|---:|---:|---:|---:|");
    let started = Instant::now();
    let mut interval_started = Instant::now();
    let mut peak = 0u64;
    let report_every = (args.tasks / 10).max(args.batch);
    let mut next_report = report_every;
    let mut done = 0usize;
    while done < args.tasks {
        let n = args.batch.min(args.tasks - done);
        fill(store.as_ref(), n).await?;
        let claimed = store
            .claim_for_push(BucketRange::ALL, n, Duration::from_secs(60))
            .await
            .map_err(|e| e.to_string())?;
        floor::process_and_complete(store.as_ref(), claimed).await?;
        done += n;
        peak = peak.max(on_disk(&path));
        if done >= next_report || done == args.tasks {
            let rows = store
                .count_by_status()
                .await
                .map_err(|e| e.to_string())?
                .total();
            let rate = report_every as f64 / interval_started.elapsed().as_secs_f64();
            println!(
                "| {done} | {rate:.0} | {rows} | {:.1} |",
                on_disk(&path) as f64 / 1048576.0
            );
            interval_started = Instant::now();
            next_report += report_every;
        }
    }
    let elapsed = started.elapsed();
    // Let upkeep catch up, as it would on an idle broker.
    while store
        .count_by_status()
        .await
        .map_err(|e| e.to_string())?
        .total()
        > 0
    {
        tokio::time::sleep(Duration::from_millis(args.upkeep_interval_ms)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let removed = upkeep.await.map_err(|e| e.to_string())?;
    let settled = on_disk(&path);
    println!(
        "\n{} tasks in {:.1} s ({:.0} tasks/s); upkeep removed {removed} rows",
        args.tasks,
        elapsed.as_secs_f64(),
        args.tasks as f64 / elapsed.as_secs_f64()
    );
    println!(
        "file + WAL: peak {:.1} MiB, after upkeep emptied the table {:.1} MiB; peak RSS {} MiB",
        peak as f64 / 1048576.0,
        settled as f64 / 1048576.0,
        peak_rss_kib() / 1024
    );
    drop(store);
    if scratch {
        for file in SqliteStore::files(&path) {
            let _ = std::fs::remove_file(file);
        }
    }
    Ok(())
}
