//! `e2e --workers-after-pause`: the broker with its workers away, so the
//! store fills until the consumer pauses, and what the store then holds.
//!
//! The broker starts with no worker listening (push: its worker ports
//! refuse connections; pull: nobody asks), the tasks are produced (feed.rs
//! keeps Kafka ahead of the consumer, so the pause is the broker's doing,
//! not a lack of records), and the run waits until the broker's consumer
//! reports paused partitions and the store has stopped growing for
//! [`SETTLED`]. The store's rows and activation bytes are sampled all the
//! while (storesize.rs), and the broker's `taskbroker_inflight_bytes`
//! gauge where it has one. Then the workers start, and the run goes on as
//! a burn-down until every task is delivered and completed, still
//! sampling, so the report has the peak while held and over the run.

use std::time::{Duration, Instant};

use crate::harness::BrokerProcess;
use crate::procstat;
use crate::scrape::{metric, metric_if_present};
use crate::storesize::{StoreProbe, StoreSize};

/// How long the store must stay the same size, partitions paused, before
/// the workers are let in.
pub const SETTLED: Duration = Duration::from_secs(2);

/// How often the store is measured.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// Partitions the consumer holds paused (backpressure), every topic.
const PAUSED_PARTITIONS: &str = "taskbroker_consumer_partitions_paused";

/// The bytes of activations the broker counts as in its store (issue 32);
/// older brokers have no such gauge.
const INFLIGHT_BYTES: &str = "taskbroker_inflight_bytes";

/// The store's size over a run, as sampled.
pub struct StoreWatch {
    probe: StoreProbe,
    /// The sample with the most activation bytes.
    pub peak: StoreSize,
    /// Highest `taskbroker_inflight_bytes` seen; `None` if never exposed.
    pub peak_inflight_bytes: Option<f64>,
    last: Option<Instant>,
}

/// One sample: the store, and the broker's metrics at that moment.
struct Sample {
    store: StoreSize,
    paused_partitions: f64,
    inflight_bytes: Option<f64>,
}

impl StoreWatch {
    pub fn new(probe: StoreProbe) -> StoreWatch {
        StoreWatch {
            probe,
            peak: StoreSize::default(),
            peak_inflight_bytes: None,
            last: None,
        }
    }

    /// Samples if [`SAMPLE_EVERY`] has passed since the last sample.
    pub async fn sample_if_due(&mut self, broker: &BrokerProcess) -> Result<(), String> {
        if self.last.is_none_or(|last| last.elapsed() >= SAMPLE_EVERY) {
            self.sample(broker).await?;
        }
        Ok(())
    }

    async fn sample(&mut self, broker: &BrokerProcess) -> Result<Sample, String> {
        self.last = Some(Instant::now());
        let store = self.probe.size().await?;
        let metrics = broker.scrape().await?;
        let sample = Sample {
            store,
            paused_partitions: metric(&metrics, PAUSED_PARTITIONS, ""),
            inflight_bytes: metric_if_present(&metrics, INFLIGHT_BYTES, ""),
        };
        if store.activation_bytes >= self.peak.activation_bytes {
            self.peak = store;
        }
        if let Some(bytes) = sample.inflight_bytes {
            self.peak_inflight_bytes = Some(self.peak_inflight_bytes.unwrap_or(0.0).max(bytes));
        }
        Ok(sample)
    }
}

/// The broker once its consumer paused with the workers away.
pub struct Held {
    /// From the broker's start to the pause settling.
    pub after: Duration,
    /// Whether the consumer paused at all (or the store simply took every
    /// task).
    pub paused_partitions: f64,
    pub store: StoreSize,
    pub inflight_bytes: Option<f64>,
    pub broker_rss_kib: u64,
}

/// Waits, sampling, until the consumer has paused partitions and the store
/// has not changed for [`SETTLED`], or the store holds all `tasks`.
pub async fn wait_for_pause(
    broker: &BrokerProcess,
    watch: &mut StoreWatch,
    tasks: u64,
    started: Instant,
    deadline: Instant,
) -> Result<Held, String> {
    eprintln!("workers away: waiting for the consumer to pause…");
    let mut last_change = Instant::now();
    let mut previous: Option<StoreSize> = None;
    let mut last_progress = Instant::now();
    loop {
        let sample = watch.sample(broker).await?;
        let store = sample.store;
        if previous
            .is_none_or(|p| (p.rows, p.activation_bytes) != (store.rows, store.activation_bytes))
        {
            last_change = Instant::now();
        }
        previous = Some(store);
        let settled = last_change.elapsed() >= SETTLED;
        if settled && (sample.paused_partitions > 0.0 || store.rows >= tasks) {
            return Ok(Held {
                after: started.elapsed(),
                paused_partitions: sample.paused_partitions,
                store,
                inflight_bytes: sample.inflight_bytes,
                broker_rss_kib: procstat::rss_kib(&broker.pid()),
            });
        }
        if Instant::now() > deadline {
            return Err(format!(
                "timed out waiting for the consumer to pause: the store holds {} rows, {} of activations; {} partitions paused (broker log: {})",
                store.rows,
                mib(store.activation_bytes),
                sample.paused_partitions,
                broker.log.display()
            ));
        }
        if last_progress.elapsed() > Duration::from_secs(5) {
            eprintln!(
                "  store {} rows, {}; {} partitions paused",
                store.rows,
                mib(store.activation_bytes),
                sample.paused_partitions
            );
            last_progress = Instant::now();
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
}

/// `bytes` in MiB, one decimal.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}
