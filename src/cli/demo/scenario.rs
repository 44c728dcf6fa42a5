//! The demo's task mix and its ledger: which kinds of task the demo
//! produces, what a demo worker does with each, and the record of what
//! happened to every task, from which the demo checks that each reached the
//! outcome its kind should reach.
//!
//! A task carries its kind and its demo id in the activation headers
//! (`demo-kind`, `demo-id`); retries keep the headers, so a retried chain of
//! activations (each with a new id) is tracked as one demo task.
//!
//! Included by path into tests/common and the tools package as well (see
//! worker.rs), so it names the library only as `taskbroker::`; its unit
//! tests are in the demo's mod.rs.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use taskbroker::model::WorkerStatus;
use taskbroker::proto::{OnAttemptsExceeded, RetryState, TaskActivation, TaskActivationStatus};

pub const KIND_HEADER: &str = "demo-kind";
pub const ID_HEADER: &str = "demo-id";

/// Attempts a `Retry` task fails before it completes.
pub const RETRIES_BEFORE_SUCCESS: u32 = 2;
/// `Delayed` tasks wait this long before they may run.
pub const DELAY_SECS: u64 = 2;
/// `Deadline` tasks may run this long; the worker never reports them.
pub const DEADLINE_SECS: u64 = 1;
/// The namespace of `Paused` tasks (`demo --rules` pauses it), and the
/// task name of `Killed` ones (`demo --rules` killswitches it).
pub const PAUSED_NAMESPACE: &str = "demo-paused";
pub const KILLED_TASKNAME: &str = "demo.killed";

/// `Expire` tasks expire after this long, inside their (longer) delay.
pub const EXPIRES_SECS: u64 = 1;

/// What a demo task is meant to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Runs once and completes.
    Complete,
    /// Reports RETRY twice (through the retry topic), then completes.
    Retry,
    /// Reports FAILURE; dead-lettered to the DLQ topic.
    Fail,
    /// at_most_once; the worker never reports, so it overruns its
    /// processing deadline and is failed (discarded), not run again.
    Deadline,
    /// Delayed by `DELAY_SECS`; must not be pushed before that.
    Delayed,
    /// Expires while still delayed; must never be pushed.
    Expire,
    /// `demo --rules`: its task name is killswitched; dropped at ingest,
    /// never run.
    Killed,
    /// `demo --rules`: its namespace is paused while the demo produces;
    /// must not be delivered before the pause is lifted, then completes.
    Paused,
}

impl Kind {
    pub const ALL: [Kind; 8] = [
        Kind::Complete,
        Kind::Retry,
        Kind::Fail,
        Kind::Deadline,
        Kind::Delayed,
        Kind::Expire,
        Kind::Killed,
        Kind::Paused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Complete => "complete",
            Kind::Retry => "retry",
            Kind::Fail => "fail",
            Kind::Deadline => "deadline",
            Kind::Delayed => "delayed",
            Kind::Expire => "expire",
            Kind::Killed => "killed",
            Kind::Paused => "paused",
        }
    }

    pub fn parse(text: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|kind| kind.as_str() == text)
    }

    /// The outcome a task of this kind must reach.
    pub fn expected(self) -> &'static str {
        match self {
            Kind::Complete => "completed once",
            Kind::Retry => "completed on its 3rd run",
            Kind::Fail => "dead-lettered",
            Kind::Deadline => "failed at its deadline, not re-run",
            Kind::Delayed => "completed after its delay",
            Kind::Expire => "expired, never run",
            Kind::Killed => "killswitched, never run",
            Kind::Paused => "held while paused, then completed",
        }
    }

    /// Kind of the `index`-th task: out of every 100, 80 complete, 5 retry,
    /// 5 fail, 3 overrun their deadline, 4 are delayed, 3 expire.
    pub fn of_index(index: usize) -> Kind {
        match index % 100 {
            0..=4 => Kind::Retry,
            5..=9 => Kind::Fail,
            10..=12 => Kind::Deadline,
            13..=16 => Kind::Delayed,
            17..=19 => Kind::Expire,
            _ => Kind::Complete,
        }
    }

    /// The activation a producer sends for demo task `id`.
    pub fn activation(self, id: &str, now: chrono::DateTime<chrono::Utc>) -> TaskActivation {
        let mut activation = TaskActivation {
            id: id.to_owned(),
            namespace: "demo".to_owned(),
            taskname: format!("demo.{}", self.as_str()),
            parameters: "{}".to_owned(),
            headers: HashMap::from([
                (KIND_HEADER.to_owned(), self.as_str().to_owned()),
                (ID_HEADER.to_owned(), id.to_owned()),
            ]),
            received_at: Some(prost_types::Timestamp {
                seconds: now.timestamp(),
                nanos: i32::try_from(now.timestamp_subsec_nanos()).unwrap_or(0),
            }),
            retry_state: Some(RetryState {
                attempts: 0,
                max_attempts: RETRIES_BEFORE_SUCCESS + 3,
                on_attempts_exceeded: OnAttemptsExceeded::Discard as i32,
                at_most_once: None,
                delay_on_retry: None,
            }),
            processing_deadline_duration: 30,
            expires: None,
            delay: None,
            application: Some("demo".to_owned()),
            parameters_bytes: Vec::new(),
        };
        let retry_state = activation.retry_state.as_mut().expect("set above");
        match self {
            Kind::Complete | Kind::Retry => {}
            Kind::Fail => {
                retry_state.on_attempts_exceeded = OnAttemptsExceeded::Deadletter as i32;
            }
            Kind::Deadline => {
                retry_state.at_most_once = Some(true);
                activation.processing_deadline_duration = DEADLINE_SECS;
            }
            Kind::Delayed => activation.delay = Some(DELAY_SECS),
            Kind::Expire => {
                activation.expires = Some(EXPIRES_SECS);
                activation.delay = Some(EXPIRES_SECS + 3);
            }
            Kind::Killed => {}
            Kind::Paused => activation.namespace = PAUSED_NAMESPACE.to_owned(),
        }
        activation
    }
}

/// What a demo worker reports for `activation`; `None`: never report.
pub fn report_for(activation: &TaskActivation) -> Option<WorkerStatus> {
    let kind = activation
        .headers
        .get(KIND_HEADER)
        .and_then(|kind| Kind::parse(kind))
        .unwrap_or(Kind::Complete);
    let attempts = activation
        .retry_state
        .as_ref()
        .map_or(0, |state| state.attempts);
    match kind {
        Kind::Retry if attempts < RETRIES_BEFORE_SUCCESS => Some(WorkerStatus::Retry),
        Kind::Fail => Some(WorkerStatus::Failure),
        Kind::Deadline => None,
        _ => Some(WorkerStatus::Complete),
    }
}

/// The wire status a worker sends for `status`.
pub fn wire_status(status: WorkerStatus) -> TaskActivationStatus {
    match status {
        WorkerStatus::Complete => TaskActivationStatus::Complete,
        WorkerStatus::Retry => TaskActivationStatus::Retry,
        WorkerStatus::Failure => TaskActivationStatus::Failure,
    }
}

/// What happened to one demo task.
#[derive(Debug, Clone)]
pub struct TaskRecord {
    pub kind: Kind,
    pub produced_at: Option<Instant>,
    /// Pushes (or pull hand-outs) the workers received, of any activation
    /// of this task's chain.
    pub deliveries: u32,
    pub first_delivery: Option<Instant>,
    /// Workers' reports the broker acknowledged, by status.
    pub completed_at: Option<Instant>,
    pub completions: u32,
    pub retries: u32,
    pub failures: u32,
    pub dead_lettered: bool,
    /// Delivered while its namespace was paused (a `Paused` task must not be).
    pub delivered_while_paused: bool,
}

impl TaskRecord {
    fn new(kind: Kind) -> TaskRecord {
        TaskRecord {
            kind,
            produced_at: None,
            deliveries: 0,
            first_delivery: None,
            completed_at: None,
            completions: 0,
            retries: 0,
            failures: 0,
            dead_lettered: false,
            delivered_while_paused: false,
        }
    }

    /// Whether the task reached its kind's outcome; `Err` says how not.
    /// `settled`: the broker holds no row of it any more.
    pub fn check(&self, settled: bool) -> Result<(), String> {
        let delay_kept = |delay: u64| match (self.produced_at, self.first_delivery) {
            (Some(produced), Some(first)) => {
                first.duration_since(produced) + Duration::from_millis(50)
                    >= Duration::from_secs(delay)
            }
            _ => false,
        };
        let ok = match self.kind {
            Kind::Complete => self.completions >= 1 && self.failures == 0,
            Kind::Retry => {
                self.completions >= 1
                    && self.retries >= RETRIES_BEFORE_SUCCESS
                    && self.deliveries > RETRIES_BEFORE_SUCCESS
            }
            Kind::Fail => self.dead_lettered && self.completions == 0,
            Kind::Deadline => {
                settled && self.deliveries >= 1 && self.completions == 0 && !self.dead_lettered
            }
            Kind::Delayed => self.completions >= 1 && delay_kept(DELAY_SECS),
            Kind::Expire | Kind::Killed => settled && self.deliveries == 0,
            Kind::Paused => self.completions >= 1 && !self.delivered_while_paused,
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "{} task should be {}, but: {} deliveries, {} completions, {} retries, {} \
                 failures, dead-lettered {}, settled {settled}",
                self.kind.as_str(),
                self.kind.expected(),
                self.deliveries,
                self.completions,
                self.retries,
                self.failures,
                self.dead_lettered
            ))
        }
    }
}

/// Every demo task's record, shared by the producer, the workers and the
/// DLQ reader.
#[derive(Debug, Default)]
pub struct Ledger {
    tasks: Mutex<HashMap<String, TaskRecord>>,
    /// Whether the demo's pause of [`PAUSED_NAMESPACE`] is in force.
    paused: std::sync::atomic::AtomicBool,
}

impl Ledger {
    fn with<R>(&self, id: &str, kind: Kind, change: impl FnOnce(&mut TaskRecord) -> R) -> R {
        let mut tasks = self.tasks.lock().unwrap_or_else(PoisonError::into_inner);
        change(
            tasks
                .entry(id.to_owned())
                .or_insert_with(|| TaskRecord::new(kind)),
        )
    }

    /// The demo id and kind an activation belongs to, if it is a demo task.
    fn key(activation: &TaskActivation) -> Option<(String, Kind)> {
        let id = activation.headers.get(ID_HEADER)?;
        let kind = Kind::parse(activation.headers.get(KIND_HEADER)?)?;
        Some((id.clone(), kind))
    }

    pub fn produced(&self, id: &str, kind: Kind) {
        self.with(id, kind, |record| record.produced_at = Some(Instant::now()));
    }

    pub fn delivered(&self, activation: &TaskActivation) {
        if let Some((id, kind)) = Self::key(activation) {
            let paused = self.paused.load(std::sync::atomic::Ordering::SeqCst);
            self.with(&id, kind, |record| {
                record.deliveries += 1;
                record.first_delivery.get_or_insert_with(Instant::now);
                record.delivered_while_paused |= paused;
            });
        }
    }

    /// The demo paused (true) or resumed (false) [`PAUSED_NAMESPACE`]; a
    /// resume counts only once the broker has the new rules, which the
    /// caller waits for before calling this.
    pub fn set_paused(&self, paused: bool) {
        self.paused
            .store(paused, std::sync::atomic::Ordering::SeqCst);
    }

    /// The broker acknowledged a report.
    pub fn reported(&self, activation: &TaskActivation, status: WorkerStatus) {
        if let Some((id, kind)) = Self::key(activation) {
            self.with(&id, kind, |record| match status {
                WorkerStatus::Complete => {
                    record.completions += 1;
                    record.completed_at.get_or_insert_with(Instant::now);
                }
                WorkerStatus::Retry => record.retries += 1,
                WorkerStatus::Failure => record.failures += 1,
            });
        }
    }

    pub fn dead_lettered(&self, activation: &TaskActivation) {
        if let Some((id, kind)) = Self::key(activation) {
            self.with(&id, kind, |record| record.dead_lettered = true);
        }
    }

    pub fn snapshot(&self) -> HashMap<String, TaskRecord> {
        self.tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// (deliveries, completions) over all tasks, for progress.
    pub fn totals(&self) -> (u64, u64) {
        let tasks = self.tasks.lock().unwrap_or_else(PoisonError::into_inner);
        tasks.values().fold((0, 0), |(pushed, completed), record| {
            (
                pushed + u64::from(record.deliveries.min(1)),
                completed + u64::from(record.completions.min(1)),
            )
        })
    }
}
