//! Prometheus metrics, prefix `taskbroker_`. Each broker (and each test) owns
//! its own [`Metrics`] and registry, so nothing is global and tests can read
//! exact values. Label values are bounded: operations, statuses, reasons.
//!
//! A leaf: it imports nothing of the crate, so every layer can record into
//! it. Callers hand it label names and numbers, not their own types.

use std::time::Duration;

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The stages of a task's way through the broker, timed in
/// `taskbroker_stage_seconds{stage}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// `received_at` until its row is stored (consumer).
    ReceivedToStored,
    /// Stored until claimed (FetchActor).
    StoredToClaimed,
    /// Claimed until a worker accepted the push (push pool).
    ClaimedToPushed,
    /// The push sent until the worker's report arrived (StoreActor).
    PushedToReported,
}

impl Stage {
    pub const ALL: [Stage; 4] = [
        Stage::ReceivedToStored,
        Stage::StoredToClaimed,
        Stage::ClaimedToPushed,
        Stage::PushedToReported,
    ];

    /// The `stage` label value.
    pub fn label(self) -> &'static str {
        match self {
            Stage::ReceivedToStored => "received_to_stored",
            Stage::StoredToClaimed => "stored_to_claimed",
            Stage::ClaimedToPushed => "claimed_to_pushed",
            Stage::PushedToReported => "pushed_to_reported",
        }
    }
}

pub struct Metrics {
    registry: Registry,
    /// Store operation latency, by operation (its count is the number of calls).
    pub store_duration: HistogramVec,
    /// Store operation errors, by operation and error kind.
    pub store_errors: IntCounterVec,
    /// Activations in the store by status (refreshed by upkeep).
    pub activations: IntGaugeVec,
    /// Age of the oldest first-attempt Pending or Claimed activation.
    pub max_lag_seconds: Gauge,
    /// Constant 1, labelled with the running version.
    pub build_info: IntGaugeVec,
    /// Activations claimed for push delivery.
    pub claims: IntCounter,
    /// FetchActor submissions to the push pool, by result (ok, full, timeout, closed).
    pub submits: IntCounterVec,
    /// Claims returned to Pending, by reason (queue_timeout, queue_closed,
    /// push_failed, lease_expired, shutdown, dropped).
    pub claims_released: IntCounterVec,
    /// PushTask outcomes, by result (ok, error, busy, timeout, unroutable,
    /// undecodable, too_large, lease_expired: not pushed, its claim had too
    /// little lease left; not_live: not pushed, this broker's heartbeat was
    /// overdue or it was taken over); `stale`: accepted pushes whose row had moved on
    /// before the mark-processing write (claimed again, or already reported).
    pub pushes: IntCounterVec,
    /// Duration of PushTask RPCs.
    pub push_duration: Histogram,
    /// Activations deferred because no worker endpoint serves their
    /// application (a `WORKER_ENDPOINTS` mistake, alerted on).
    pub push_no_route: IntCounter,
    /// Silent peers this broker took over (their claims released).
    pub broker_takeovers: IntCounter,
    /// Time from `received_at` until the activation was claimed.
    pub received_to_claimed: Histogram,
    /// Time from `received_at` until a worker accepted the push.
    pub received_to_pushed: Histogram,
    /// Time a task spends in each stage of its way, by stage (see
    /// [`Stage`]), so a slow end-to-end figure can be explained.
    pub stages: HistogramVec,
    /// The series of `stages`, one per [`Stage`], resolved once so timing a
    /// task looks up no label.
    stage_series: [Histogram; 4],
    /// Accepted pushes whose Claimed → Processing write was not needed: the
    /// worker's report had already arrived.
    pub marks_skipped: IntCounter,
    /// Consumed records by topic and result (stored, duplicate, invalid,
    /// expired).
    pub consumer_records: IntCounterVec,
    /// Invalid consumed records by topic and reason.
    pub invalid_records: IntCounterVec,
    /// Records written to the ingest dead-letter topic, by result (ok, error).
    pub ingest_dead_letters: IntCounterVec,
    /// Dead letters Kafka refused whole as too large and took cut short, by
    /// kind (ingest, deadletter).
    pub dead_letters_truncated: IntCounterVec,
    /// Bytes of the activations the store holds, by consumed topic.
    pub inflight_bytes: IntGaugeVec,
    /// Partitions each topic's consumer holds, by topic.
    pub partitions_assigned: IntGaugeVec,
    /// Assignments each consumer received (readiness needs one, even empty),
    /// by topic.
    pub consumer_assignments: IntCounterVec,
    /// Partitions paused for backpressure, by topic.
    pub partitions_paused: IntGaugeVec,
    /// Records read from Kafka whose offsets are not committed yet (the
    /// batch being built and the one being written), by topic.
    pub consumer_pending_records: IntGaugeVec,
    /// Completed upkeep cycles.
    pub upkeep_cycles: IntCounter,
    /// Upkeep step durations, by step.
    pub upkeep_duration: HistogramVec,
    /// Rows each upkeep step moved or removed, by step.
    pub upkeep_transitions: IntCounterVec,
    /// Upkeep step failures, by step.
    pub upkeep_errors: IntCounterVec,
    /// Records upkeep produced to Kafka, by kind (retry, deadletter) and
    /// result (ok, error, too_large).
    pub published: IntCounterVec,
    /// Rows an upkeep step left for a later cycle, by step: 0 when its last
    /// pass found less than a full batch, else a lower bound (the batch
    /// limit).
    pub upkeep_backlog: IntGaugeVec,
    /// Addresses each worker URL resolves to (1 until its host name is
    /// resolved, and for a URL naming an address), by endpoint.
    pub worker_addresses: IntGaugeVec,
    /// Connections to each worker URL, by endpoint and state (ready,
    /// backing_off).
    pub worker_connections: IntGaugeVec,
    /// Pushes outstanding to each worker URL, by endpoint.
    pub worker_pushes_in_flight: IntGaugeVec,
    /// Records on each assigned partition past the consumer group's
    /// committed offset, by topic and partition (librdkafka's statistics).
    pub consumer_lag: IntGaugeVec,
    /// Worker status reports as the gRPC API received them, by status
    /// (complete, retry, failure; invalid: rejected).
    pub status_reports: IntCounterVec,
    /// What the store write of each valid report did, by result (updated,
    /// ignored, missing): one result per report.
    pub status_updates: IntCounterVec,
    /// Of the updated reports, those that likely came from an earlier
    /// delivery (protocol.md, "Late reports").
    pub status_updates_late: IntCounter,
    /// gRPC TLS files re-read after a change, by result (ok, error).
    pub grpc_tls_reloads: IntCounterVec,
    /// Unix time the gRPC TLS certificate in use was loaded.
    pub grpc_tls_loaded: IntGauge,
    /// gRPC connections dropped in the TLS handshake (refused or timed out).
    pub grpc_tls_handshake_failures: IntCounter,
    /// Unix time the runtime file in force was loaded (0: none is set).
    pub runtime_config_loaded: IntGauge,
    /// Versions of the runtime file that were refused (unreadable or
    /// invalid); the previous one stayed in force.
    pub runtime_config_errors: IntCounter,
    /// Unfinished rows per namespace (the top K by count, the rest as
    /// `other`) and status (pending, delay, claimed, processing).
    pub namespace_activations: IntGaugeVec,
    /// Seconds the oldest first-attempt Pending task of each namespace (top
    /// K, the rest as `other`) has been runnable.
    pub namespace_max_lag: prometheus::GaugeVec,
    /// Worker reports that applied, per namespace (those the per-namespace
    /// gauges show, the rest as `other`) and status (complete, retry,
    /// failure): per-namespace result rates.
    pub namespace_results: IntCounterVec,
    /// The namespaces the per-namespace gauges show now; reports on others
    /// count as `other`, so the series stay bounded.
    shown_namespaces: std::sync::RwLock<std::collections::HashSet<String>>,
    /// Rules in force from the runtime file, by kind (killswitches, paused,
    /// demoted_namespaces).
    pub runtime_rules: IntGaugeVec,
    /// The SQLite store's files in bytes, by kind (file, wal, free); set by
    /// upkeep's space reclaim, 0 on PostgreSQL.
    pub sqlite_bytes: IntGaugeVec,
}

pub mod labels;

/// Latency buckets (seconds) for end-to-end task latencies.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Finer at the low end than [`LATENCY_BUCKETS`]: a stage of a healthy
/// broker takes milliseconds, and its p99 is read from these.
const STAGE_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 300.0,
];

fn counter(name: &str, help: &str) -> IntCounter {
    IntCounter::new(name, help).expect("valid metric definition")
}

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric definition")
}

fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric definition")
}

fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("valid metric definition")
}

fn histogram_vec(name: &str, help: &str, buckets: &[f64], labels: &[&str]) -> HistogramVec {
    HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("valid metric definition")
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        // The standard `process_*` series (CPU seconds, resident and virtual
        // memory, open and maximum file descriptors, start time), read from
        // /proc at each scrape. The prometheus crate has the collector on
        // Linux only.
        #[cfg(target_os = "linux")]
        registry
            .register(Box::new(
                prometheus::process_collector::ProcessCollector::for_self(),
            ))
            .expect("the process collector registers once");
        let store_duration = histogram_vec(
            "taskbroker_store_operation_duration_seconds",
            "Duration of store operations, by operation.",
            &[
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ],
            &["operation"],
        );
        let store_errors = IntCounterVec::new(
            Opts::new(
                "taskbroker_store_operation_errors_total",
                "Store operations that failed, by operation and kind of error.",
            ),
            &["operation", "kind"],
        )
        .expect("valid metric definition");
        let activations = IntGaugeVec::new(
            Opts::new(
                "taskbroker_activations",
                "Activations in the store, by status.",
            ),
            &["status"],
        )
        .expect("valid metric definition");
        let max_lag_seconds = Gauge::new(
            "taskbroker_pending_activation_max_lag_seconds",
            "Age of the oldest Pending or Claimed first-attempt activation, delay-adjusted; 0 when none.",
        )
        .expect("valid metric definition");
        let build_info = IntGaugeVec::new(
            Opts::new(
                "taskbroker_build_info",
                "Always 1; labelled with the version.",
            ),
            &["version"],
        )
        .expect("valid metric definition");
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let claims = counter(
            "taskbroker_claims_total",
            "Activations claimed for push delivery.",
        );
        let submits = counter_vec(
            "taskbroker_push_submits_total",
            "FetchActor submissions to the push pool, by result.",
            &["result"],
        );
        let claims_released = counter_vec(
            "taskbroker_claims_released_total",
            "Claims returned to Pending without consuming an attempt, by reason.",
            &["reason"],
        );
        let pushes = counter_vec(
            "taskbroker_pushes_total",
            "PushTask outcomes, by result (each push counted once); ok and stale are the accepted pushes, stale those whose row had already moved on.",
            &["result"],
        );
        // Fine buckets: push latency on a local network is sub-millisecond.
        let push_buckets =
            prometheus::exponential_buckets(0.0001, 1.5, 32).expect("valid bucket definition");
        let push_duration = histogram(
            "taskbroker_push_duration_seconds",
            "Duration of PushTask RPCs.",
            &push_buckets,
        );
        let push_no_route = counter(
            "taskbroker_push_no_route_total",
            "Activations deferred (Delay, no attempt consumed) because no worker endpoint serves their application.",
        );
        let broker_takeovers = counter(
            "taskbroker_broker_takeovers_total",
            "Peers this broker presumed dead (heartbeat older than TAKEOVER_TIMEOUT_MS) and took over: their row removed, their claims released (counted in taskbroker_claims_released_total{reason=\"takeover\"}).",
        );
        let received_to_claimed = histogram(
            "taskbroker_received_to_claimed_seconds",
            "Time from an activation's received_at until it was claimed.",
            LATENCY_BUCKETS,
        );
        let received_to_pushed = histogram(
            "taskbroker_received_to_pushed_seconds",
            "Time from an activation's received_at until a worker accepted it.",
            LATENCY_BUCKETS,
        );
        let stages = histogram_vec(
            "taskbroker_stage_seconds",
            "Time a task spent in each stage: received_to_stored, stored_to_claimed, \
             claimed_to_pushed, pushed_to_reported.",
            STAGE_BUCKETS,
            &["stage"],
        );
        let stage_series = Stage::ALL.map(|stage| stages.with_label_values(&[stage.label()]));
        let marks_skipped = counter(
            "taskbroker_marks_skipped_total",
            "Accepted pushes whose Claimed to Processing write was skipped: the worker had already reported.",
        );
        let consumer_records = counter_vec(
            "taskbroker_consumer_records_total",
            "Consumed Kafka records, by topic and result.",
            &["topic", "result"],
        );
        let invalid_records = counter_vec(
            "taskbroker_consumer_invalid_records_total",
            "Consumed records that are not valid activations, by topic and reason.",
            &["topic", "reason"],
        );
        let ingest_dead_letters = counter_vec(
            "taskbroker_ingest_dead_letters_total",
            "Invalid records written to the ingest dead-letter topic, by result.",
            &["result"],
        );
        let dead_letters_truncated = counter_vec(
            "taskbroker_dead_letters_truncated_total",
            "Dead letters Kafka refused as too large and that were written cut short instead, by kind.",
            &["kind"],
        );
        let inflight_bytes = gauge_vec(
            "taskbroker_inflight_bytes",
            "Bytes of the activations the store holds (every status, until upkeep removes the row), by consumed topic; MAX_INFLIGHT_BYTES bounds it.",
            &["topic"],
        );
        let partitions_assigned = gauge_vec(
            "taskbroker_consumer_partitions_assigned",
            "Kafka partitions assigned to this broker, by consumed topic.",
            &["topic"],
        );
        let consumer_assignments = counter_vec(
            "taskbroker_consumer_assignments_total",
            "Partition assignments received by each topic's consumer (rebalances it took part in).",
            &["topic"],
        );
        let partitions_paused = gauge_vec(
            "taskbroker_consumer_partitions_paused",
            "Kafka partitions paused, by topic: the topic's rows in the store reached MAX_INFLIGHT, or a batch waits for the store or the ingest dead-letter topic.",
            &["topic"],
        );
        let consumer_pending_records = gauge_vec(
            "taskbroker_consumer_pending_records",
            "Records read from Kafka and not yet stored (or dead-lettered) and committed, by topic.",
            &["topic"],
        );
        let upkeep_cycles = counter("taskbroker_upkeep_cycles_total", "Completed upkeep cycles.");
        let upkeep_duration = histogram_vec(
            "taskbroker_upkeep_step_duration_seconds",
            "Duration of each upkeep step.",
            LATENCY_BUCKETS,
            &["step"],
        );
        let upkeep_transitions = counter_vec(
            "taskbroker_upkeep_transitions_total",
            "Rows moved or removed by upkeep, by step.",
            &["step"],
        );
        let upkeep_errors = counter_vec(
            "taskbroker_upkeep_errors_total",
            "Upkeep steps that failed, by step.",
            &["step"],
        );
        let published = counter_vec(
            "taskbroker_published_total",
            "Retry and dead-letter records produced by upkeep, by kind and result.",
            &["kind", "result"],
        );
        let upkeep_backlog = IntGaugeVec::new(
            Opts::new(
                "taskbroker_upkeep_backlog",
                "Rows an upkeep step left for the next cycle: 0 when it caught up, else at least this many.",
            ),
            &["step"],
        )
        .expect("valid metric definition");
        let worker_connections = gauge_vec(
            "taskbroker_worker_connections",
            "Connections to each worker URL, by state: ready (pushes go to it) or backing_off (its last push failed; one probe at a time until a push succeeds).",
            &["endpoint", "state"],
        );
        let worker_pushes_in_flight = gauge_vec(
            "taskbroker_worker_pushes_in_flight",
            "PushTask calls outstanding to each worker URL.",
            &["endpoint"],
        );
        let consumer_lag = gauge_vec(
            "taskbroker_consumer_lag",
            "Records on each partition this broker consumes that are past its consumer group's committed offset (not yet stored and committed), from librdkafka's statistics (every 5 s unless KAFKA_CONFIG sets statistics.interval.ms).",
            &["topic", "partition"],
        );
        let worker_addresses = IntGaugeVec::new(
            Opts::new(
                "taskbroker_worker_addresses",
                "Addresses each worker URL resolves to; pushes are spread over connections to all of them.",
            ),
            &["endpoint"],
        )
        .expect("valid metric definition");
        let status_reports = counter_vec(
            "taskbroker_status_reports_total",
            "Worker status reports as received, by status; invalid: rejected (a bad status or id).",
            &["status"],
        );
        let status_updates = counter_vec(
            "taskbroker_status_updates_total",
            "What writing each valid worker report did, by result: updated, ignored (task not Claimed or Processing), missing (no such task).",
            &["result"],
        );
        let status_updates_late = counter(
            "taskbroker_status_updates_late_total",
            "Updated worker reports that likely came from an earlier delivery: the task was past its processing deadline or had been delivered before.",
        );
        let grpc_tls_reloads = counter_vec(
            "taskbroker_grpc_tls_reloads_total",
            "Changes to the gRPC TLS files, by whether they loaded (ok) or the previous certificate was kept (error).",
            &["result"],
        );
        let grpc_tls_loaded = IntGauge::new(
            "taskbroker_grpc_tls_loaded_timestamp_seconds",
            "Unix time the gRPC server's TLS certificate in use was loaded; 0 without TLS.",
        )
        .expect("valid metric definition");
        let grpc_tls_handshake_failures = IntCounter::new(
            "taskbroker_grpc_tls_handshake_failures_total",
            "gRPC connections that failed or did not finish the TLS handshake in time.",
        )
        .expect("valid metric definition");
        let runtime_config_loaded = IntGauge::new(
            "taskbroker_runtime_config_loaded_timestamp_seconds",
            "Unix time the runtime file (TASKBROKER_RUNTIME_CONFIG) in force was loaded; 0 when none is set.",
        )
        .expect("valid metric definition");
        let runtime_config_errors = counter(
            "taskbroker_runtime_config_errors_total",
            "Versions of the runtime file refused as unreadable or invalid (the previous one stayed in force).",
        );
        let namespace_activations = gauge_vec(
            "taskbroker_namespace_activations",
            "Unfinished activations per namespace (the top TASKBROKER_METRICS_TOP_NAMESPACES, the rest as \"other\") and status.",
            &["namespace", "status"],
        );
        let namespace_max_lag = prometheus::GaugeVec::new(
            Opts::new(
                "taskbroker_namespace_max_lag_seconds",
                "Seconds the oldest first-attempt Pending activation of each namespace (top K, the rest as \"other\") has been runnable.",
            ),
            &["namespace"],
        )
        .expect("valid metric definition");
        let namespace_results = counter_vec(
            "taskbroker_namespace_results_total",
            "Worker reports that applied, per namespace (those taskbroker_namespace_activations shows, the rest as \"other\") and status.",
            &["namespace", "status"],
        );
        let runtime_rules = gauge_vec(
            "taskbroker_runtime_rules",
            "Rules in force from the runtime file, by kind.",
            &["kind"],
        );
        let sqlite_bytes = gauge_vec(
            "taskbroker_sqlite_bytes",
            "The SQLite store's files in bytes, by kind: file (the database file), wal (its write-ahead log), free (free-list pages inside the file, reused by new rows or given back by the incremental vacuum); 0 on PostgreSQL.",
            &["kind"],
        );
        for collector in [
            Box::new(sqlite_bytes.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(runtime_config_loaded.clone()),
            Box::new(runtime_config_errors.clone()),
            Box::new(runtime_rules.clone()),
            Box::new(namespace_activations.clone()),
            Box::new(namespace_max_lag.clone()),
            Box::new(namespace_results.clone()),
            Box::new(grpc_tls_reloads.clone()),
            Box::new(grpc_tls_loaded.clone()),
            Box::new(grpc_tls_handshake_failures.clone()),
            Box::new(status_reports.clone()),
            Box::new(status_updates.clone()),
            Box::new(status_updates_late.clone()),
            Box::new(consumer_records.clone()),
            Box::new(invalid_records.clone()),
            Box::new(ingest_dead_letters.clone()),
            Box::new(dead_letters_truncated.clone()),
            Box::new(inflight_bytes.clone()),
            Box::new(partitions_assigned.clone()),
            Box::new(consumer_assignments.clone()),
            Box::new(partitions_paused.clone()),
            Box::new(consumer_pending_records.clone()),
            Box::new(upkeep_cycles.clone()),
            Box::new(upkeep_duration.clone()),
            Box::new(upkeep_transitions.clone()),
            Box::new(upkeep_errors.clone()),
            Box::new(published.clone()),
            Box::new(upkeep_backlog.clone()),
            Box::new(worker_addresses.clone()),
            Box::new(worker_connections.clone()),
            Box::new(worker_pushes_in_flight.clone()),
            Box::new(consumer_lag.clone()),
        ] {
            registry
                .register(collector)
                .expect("metric names are unique");
        }
        for collector in [
            Box::new(store_duration.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(store_errors.clone()),
            Box::new(activations.clone()),
            Box::new(max_lag_seconds.clone()),
            Box::new(build_info.clone()),
            Box::new(claims.clone()),
            Box::new(submits.clone()),
            Box::new(claims_released.clone()),
            Box::new(pushes.clone()),
            Box::new(push_duration.clone()),
            Box::new(push_no_route.clone()),
            Box::new(broker_takeovers.clone()),
            Box::new(received_to_claimed.clone()),
            Box::new(received_to_pushed.clone()),
            Box::new(stages.clone()),
            Box::new(marks_skipped.clone()),
        ] {
            registry
                .register(collector)
                .expect("metric names are unique");
        }
        let metrics = Metrics {
            registry,
            store_duration,
            store_errors,
            activations,
            max_lag_seconds,
            build_info,
            claims,
            submits,
            claims_released,
            pushes,
            push_duration,
            push_no_route,
            broker_takeovers,
            received_to_claimed,
            received_to_pushed,
            stages,
            stage_series,
            marks_skipped,
            consumer_records,
            invalid_records,
            ingest_dead_letters,
            dead_letters_truncated,
            inflight_bytes,
            partitions_assigned,
            consumer_assignments,
            partitions_paused,
            consumer_pending_records,
            upkeep_cycles,
            upkeep_duration,
            upkeep_transitions,
            upkeep_errors,
            published,
            upkeep_backlog,
            worker_addresses,
            worker_connections,
            worker_pushes_in_flight,
            consumer_lag,
            status_reports,
            status_updates,
            status_updates_late,
            grpc_tls_reloads,
            grpc_tls_loaded,
            grpc_tls_handshake_failures,
            runtime_config_loaded,
            runtime_config_errors,
            runtime_rules,
            namespace_activations,
            namespace_max_lag,
            namespace_results,
            shown_namespaces: Default::default(),
            sqlite_bytes,
        };
        metrics.initialise_label_values();
        metrics
    }

    /// Creates every series the code can emit at zero, so each family is on
    /// `/metrics` from the start: `rate()` and alerts see 0 rather than no
    /// data until the first event, and dashboards show every outcome.
    fn initialise_label_values(&self) {
        use labels::*;
        for (counter, values) in [
            (&self.submits, SUBMIT_RESULTS),
            (&self.claims_released, RELEASE_REASONS),
            (&self.pushes, PUSH_RESULTS),
            (&self.ingest_dead_letters, PUBLISH_RESULTS),
            (&self.dead_letters_truncated, DEAD_LETTER_KINDS),
            (&self.upkeep_transitions, UPKEEP_TRANSITIONS),
            (&self.upkeep_errors, UPKEEP_ERROR_STEPS),
            (&self.grpc_tls_reloads, TLS_RELOAD_RESULTS),
        ] {
            for value in values {
                counter.with_label_values(&[value]);
            }
        }
        for step in UPKEEP_STEPS {
            self.upkeep_duration.with_label_values(&[step]);
            self.upkeep_backlog.with_label_values(&[step]);
        }
        for kind in PUBLISH_KINDS {
            for result in PUBLISHED_RESULTS {
                self.published.with_label_values(&[kind, result]);
            }
        }
        for status in STATUS_REPORTS {
            self.status_reports.with_label_values(&[status]);
        }
        for result in STATUS_UPDATE_RESULTS {
            self.status_updates.with_label_values(&[result]);
        }
        for operation in STORE_OPERATIONS {
            self.store_duration.with_label_values(&[operation]);
            for kind in STORE_ERROR_KINDS {
                self.store_errors.with_label_values(&[operation, kind]);
            }
        }
        for status in ACTIVATION_STATUSES {
            self.activations.with_label_values(&[status]);
        }
        for kind in RUNTIME_RULE_KINDS {
            self.runtime_rules.with_label_values(&[kind]);
        }
        for kind in SQLITE_BYTES_KINDS {
            self.sqlite_bytes.with_label_values(&[kind]);
        }
        self.initialise_namespace_gauges();
    }

    /// Counts what a status write did. `counts` are `(result, count)`
    /// pairs: `updated`, `ignored`, `missing`, and `late` (a share of the
    /// updated ones, counted apart).
    pub fn record_status_outcome(&self, counts: impl IntoIterator<Item = (&'static str, u64)>) {
        for (result, count) in counts {
            if result == "late" {
                self.status_updates_late.inc_by(count);
            } else {
                self.status_updates
                    .with_label_values(&[result])
                    .inc_by(count);
            }
        }
    }

    /// The `q` quantile (0..=1) of a histogram, interpolated linearly inside
    /// its bucket: an estimate as fine as the buckets.
    pub fn quantile(histogram: &Histogram, q: f64) -> f64 {
        let metric = prometheus::core::Metric::metric(histogram);
        let proto = metric.get_histogram();
        let total = proto.get_sample_count() as f64;
        if total == 0.0 {
            return 0.0;
        }
        let target = q.clamp(0.0, 1.0) * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for bucket in proto.get_bucket() {
            let (upper, count) = (bucket.upper_bound(), bucket.cumulative_count() as f64);
            if count >= target {
                let share = if count > below {
                    (target - below) / (count - below)
                } else {
                    1.0
                };
                return lower + (upper - lower) * share;
            }
            (lower, below) = (upper, count);
        }
        lower
    }

    /// Current value of a labelled counter (tests and the load harness).
    pub fn count(counter: &IntCounterVec, label: &str) -> u64 {
        counter.with_label_values(&[label]).get()
    }

    /// Creates the series of a consumed topic's consumer at zero (see
    /// `initialise_label_values`); `topic` is its label value.
    pub fn initialise_topic(&self, topic: &str) {
        use labels::{CONSUMER_RESULTS, INVALID_REASONS};
        for result in CONSUMER_RESULTS {
            self.consumer_records.with_label_values(&[topic, result]);
        }
        for reason in INVALID_REASONS {
            self.invalid_records.with_label_values(&[topic, reason]);
        }
        self.partitions_assigned.with_label_values(&[topic]);
        self.partitions_paused.with_label_values(&[topic]);
        self.consumer_pending_records.with_label_values(&[topic]);
        self.consumer_assignments.with_label_values(&[topic]);
        // Rows keep the topic's name, not its cluster: so does this gauge.
        let stored_as = topic.split('@').next().unwrap_or(topic);
        self.inflight_bytes.with_label_values(&[stored_as]);
    }

    /// `taskbroker_inflight_bytes` from the store's per-topic sums: the
    /// topics listed get their figure, every other series shown so far 0.
    pub fn set_inflight_bytes(&self, sums: &[(String, u64)]) {
        use prometheus::core::Collector as _;
        let shown: Vec<String> = self
            .inflight_bytes
            .collect()
            .iter()
            .flat_map(|family| family.get_metric().iter())
            .filter_map(|metric| {
                metric
                    .get_label()
                    .first()
                    .map(|label| label.value().to_owned())
            })
            .collect();
        for topic in shown {
            if !sums.iter().any(|(name, _)| *name == topic) {
                self.inflight_bytes.with_label_values(&[&topic]).set(0);
            }
        }
        for (topic, bytes) in sums {
            self.inflight_bytes
                .with_label_values(&[topic])
                .set(i64::try_from(*bytes).unwrap_or(i64::MAX));
        }
    }

    /// Consumed records with `result`, every topic together.
    pub fn consumed(&self, result: &str) -> u64 {
        sum_where(&self.consumer_records, "result", result) as u64
    }

    /// Invalid consumed records with `reason`, every topic together.
    pub fn invalid(&self, reason: &str) -> u64 {
        sum_where(&self.invalid_records, "reason", reason) as u64
    }

    /// Partitions assigned to this broker, every topic together.
    pub fn assigned_partitions(&self) -> i64 {
        sum_where(&self.partitions_assigned, "", "") as i64
    }

    /// Partitions paused, every topic together.
    pub fn paused_partitions(&self) -> i64 {
        sum_where(&self.partitions_paused, "", "") as i64
    }

    /// Records read and not yet committed, every topic together.
    pub fn pending_records(&self) -> i64 {
        sum_where(&self.consumer_pending_records, "", "") as i64
    }

    /// Connections to workers in `state` (ready, backing_off), every
    /// endpoint together.
    pub fn worker_connections_in(&self, state: &str) -> i64 {
        sum_where(&self.worker_connections, "state", state) as i64
    }

    /// Pushes outstanding, every endpoint together.
    pub fn worker_pushes_in_flight(&self) -> i64 {
        sum_where(&self.worker_pushes_in_flight, "", "") as i64
    }

    /// One run of a store operation; `error_kind` is the failed run's
    /// `StoreError::kind`.
    pub fn observe_store(&self, operation: &str, elapsed: Duration, error_kind: Option<&str>) {
        self.store_duration
            .with_label_values(&[operation])
            .observe(elapsed.as_secs_f64());
        if let Some(kind) = error_kind {
            self.store_errors
                .with_label_values(&[operation, kind])
                .inc();
        }
    }

    /// One task's time in `stage`; a negative span (clocks of different
    /// hosts) counts as zero.
    pub fn observe_stage(&self, stage: Stage, seconds: f64) {
        self.stage_series[stage as usize].observe(seconds.max(0.0));
    }

    /// How many times a store operation ran (successfully or not).
    pub fn store_calls(&self, operation: &str) -> u64 {
        self.store_duration
            .with_label_values(&[operation])
            .get_sample_count()
    }

    /// Rows per status, as `(stored status name, count)` (`Pending`, …);
    /// each is set on its lower-case series.
    pub fn set_status_counts(&self, counts: impl IntoIterator<Item = (&'static str, u64)>) {
        for (status, count) in counts {
            if let Some(label) = labels::activation_status(status) {
                self.activations
                    .with_label_values(&[label])
                    .set(i64::try_from(count).unwrap_or(i64::MAX));
            }
        }
    }

    /// The SQLite store's files: the database file's and its WAL's
    /// lengths, and the free pages inside the file, in bytes.
    pub fn set_sqlite_bytes(&self, file: u64, wal: u64, free: u64) {
        for (kind, bytes) in [("file", file), ("wal", wal), ("free", free)] {
            self.sqlite_bytes
                .with_label_values(&[kind])
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }

    /// The `other` line of the per-namespace gauges, always present (at 0
    /// while no namespace has tasks), so the families are on every scrape.
    fn initialise_namespace_gauges(&self) {
        for status in labels::NAMESPACE_STATUSES {
            self.namespace_activations
                .with_label_values(&[labels::OTHER_NAMESPACES, status]);
        }
        self.namespace_max_lag
            .with_label_values(&[labels::OTHER_NAMESPACES]);
        for status in labels::NAMESPACE_RESULT_STATUSES {
            self.namespace_results
                .with_label_values(&[labels::OTHER_NAMESPACES, status]);
        }
    }

    /// Counts the reports a status write applied, per namespace: under its
    /// own name while the per-namespace gauges show it, else as `other`.
    /// `results` are (namespace, status label, reports).
    pub fn record_namespace_results<'a>(
        &self,
        results: impl IntoIterator<Item = (&'a str, &'a str, u64)>,
    ) {
        let shown = self
            .shown_namespaces
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for (namespace, status, count) in results {
            let namespace = if shown.contains(namespace) {
                namespace
            } else {
                labels::OTHER_NAMESPACES
            };
            self.namespace_results
                .with_label_values(&[namespace, status])
                .inc_by(count);
        }
    }

    /// Replaces the per-namespace gauges: `counts` as (namespace, status,
    /// rows), `lags` as (namespace, seconds). Namespaces no longer listed
    /// disappear, so the series stay bounded by what the caller passes.
    pub fn set_namespace_gauges<'a>(
        &self,
        counts: impl IntoIterator<Item = (&'a str, &'a str, u64)>,
        lags: impl IntoIterator<Item = (&'a str, f64)>,
    ) {
        self.namespace_activations.reset();
        self.namespace_max_lag.reset();
        self.initialise_namespace_gauges();
        let mut shown = self
            .shown_namespaces
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        shown.clear();
        for (namespace, status, count) in counts {
            if !shown.contains(namespace) {
                shown.insert(namespace.to_owned());
            }
            self.namespace_activations
                .with_label_values(&[namespace, status])
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
        for (namespace, lag) in lags {
            self.namespace_max_lag
                .with_label_values(&[namespace])
                .set(lag);
        }
    }

    /// The text exposition format served on `/metrics`.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        let encoder = TextEncoder::new();
        if let Err(err) = encoder.encode(&self.registry.gather(), &mut buffer) {
            tracing::error!(error = %err, "cannot encode metrics");
        }
        String::from_utf8(buffer).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// The sum of a family's series whose label `name` is `value` (every series
/// when `name` is empty).
fn sum_where(collector: &impl prometheus::core::Collector, name: &str, value: &str) -> f64 {
    use prometheus::proto::MetricType;
    collector
        .collect()
        .iter()
        .flat_map(|family| {
            let counter = family.get_field_type() == MetricType::COUNTER;
            family
                .get_metric()
                .iter()
                .map(move |metric| (counter, metric))
        })
        .filter(|(_, metric)| {
            name.is_empty()
                || metric
                    .get_label()
                    .iter()
                    .any(|label| label.name() == name && label.value() == value)
        })
        .map(|(counter, metric)| {
            if counter {
                metric.get_counter().get_value()
            } else {
                metric.get_gauge().get_value()
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_exposed_before_its_first_event() {
        let metrics = Metrics::new();
        // What each consumer does as it starts: its topic's series exist from then on.
        metrics.initialise_topic("tasks");
        let text = metrics.render();
        let families = text
            .lines()
            .filter(|line| line.starts_with("# TYPE taskbroker_"))
            .count();
        assert_eq!(families, 44, "{text}");
        assert!(text.contains("taskbroker_status_reports_total{status=\"invalid\"} 0"));
        assert!(text.contains("taskbroker_status_updates_total{result=\"missing\"} 0"));
        assert!(text.contains("taskbroker_status_updates_late_total 0"));
        #[cfg(target_os = "linux")]
        for process in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
        ] {
            assert!(
                text.contains(&format!("# TYPE {process} ")),
                "{process}:\n{text}"
            );
        }
        assert!(text.contains("taskbroker_push_no_route_total 0"));
        assert!(text.contains("taskbroker_broker_takeovers_total 0"));
        assert!(text.contains("taskbroker_claims_released_total{reason=\"takeover\"} 0"));
        assert!(text.contains("taskbroker_claims_released_total{reason=\"lease_expired\"} 0"));
        assert!(text.contains("taskbroker_published_total{kind=\"deadletter\",result=\"ok\"} 0"));
        assert!(text.contains("taskbroker_activations{status=\"claimed\"} 0"));
        assert!(text.contains("taskbroker_sqlite_bytes{kind=\"free\"} 0"));
        assert!(
            text.contains("taskbroker_consumer_records_total{result=\"stored\",topic=\"tasks\"} 0")
        );
    }
}
