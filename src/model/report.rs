//! What workers report and what the store answers about many rows at once:
//! status reports and their outcome, upkeep outcomes, counts per status and
//! the pull filter.

use std::collections::BTreeMap;

use super::retry::RetryEdit;
use super::row::ActivationStatus;

/// Pull-mode filter from GetTask / FetchNextTask.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PullFilter {
    pub application: Option<String>,
    pub namespace: Option<String>,
}

/// The outcomes a worker may report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerStatus {
    Complete,
    Retry,
    Failure,
}

impl WorkerStatus {
    pub fn as_status(self) -> ActivationStatus {
        match self {
            WorkerStatus::Complete => ActivationStatus::Complete,
            WorkerStatus::Retry => ActivationStatus::Retry,
            WorkerStatus::Failure => ActivationStatus::Failure,
        }
    }
}

/// One status report from a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusUpdate {
    pub id: String,
    pub status: WorkerStatus,
    /// With RETRY: replaces `retry_state.max_attempts` in the retry upkeep
    /// publishes (the store keeps it beside the row).
    pub max_attempts: Option<u32>,
    /// With RETRY: replaces `retry_state.delay_on_retry` in the retry upkeep
    /// publishes (the store keeps it beside the row).
    pub delay_on_retry: Option<u64>,
}

impl StatusUpdate {
    pub fn new(id: impl Into<String>, status: WorkerStatus) -> Self {
        StatusUpdate {
            id: id.into(),
            status,
            max_attempts: None,
            delay_on_retry: None,
        }
    }

    /// Whether applying this update stores a retry edit with the row.
    pub fn edits_retry_state(&self) -> bool {
        !self.retry_edit().is_empty()
    }

    /// The edit this report asks the retry to carry: empty unless the
    /// status is RETRY (PROTOCOL.md: other statuses ignore the fields).
    pub fn retry_edit(&self) -> RetryEdit {
        if self.status == WorkerStatus::Retry {
            RetryEdit {
                max_attempts: self.max_attempts,
                delay_on_retry: self.delay_on_retry,
            }
        } else {
            RetryEdit::default()
        }
    }
}

/// What a batch of status updates did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatusUpdateOutcome {
    /// Rows that were Claimed or Processing and took the new status.
    pub updated: u64,
    /// Rows that exist but were in another status (already finished, not yet
    /// handed out): left unchanged.
    pub ignored: u64,
    /// Ids with no row (already removed, or never stored).
    pub missing: u64,
    /// Of `updated`, reports that likely came from an earlier delivery of
    /// the task: the row was Processing past its deadline, or had been
    /// delivered before (`processing_attempts` > 0). Reports carry only the
    /// id, so such a report still sets the status (PROTOCOL.md).
    pub late: u64,
}

impl StatusUpdateOutcome {
    /// Each count with its metrics label.
    pub fn counts(&self) -> [(&'static str, u64); 4] {
        [
            ("updated", self.updated),
            ("ignored", self.ignored),
            ("missing", self.missing),
            ("late", self.late),
        ]
    }
}

/// What the processing-deadline upkeep step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeadlineOutcome {
    /// Back to Pending with one more attempt.
    pub retried: u64,
    /// at_most_once tasks moved to Failure.
    pub failed: u64,
}

/// Which rows `take_for_publish` hands out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishKind {
    /// Retry rows: a new activation goes to the retry topic.
    Retry,
    /// Failure rows of dead-letter tasks: the stored bytes go to the DLQ.
    DeadLetter,
}

/// Row counts per status; statuses with no rows count 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatusCounts(BTreeMap<ActivationStatus, u64>);

impl StatusCounts {
    pub fn get(&self, status: ActivationStatus) -> u64 {
        self.0.get(&status).copied().unwrap_or(0)
    }

    pub fn set(&mut self, status: ActivationStatus, count: u64) {
        self.0.insert(status, count);
    }

    /// Every status by its stored name with its count, zeros included.
    pub fn by_status(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        ActivationStatus::ALL
            .into_iter()
            .map(|status| (status.as_str(), self.get(status)))
    }

    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// Rows the broker still has to deliver or finish: the figure the
    /// consumer's backpressure compares with `MAX_INFLIGHT`.
    pub fn inflight(&self) -> u64 {
        [
            ActivationStatus::Pending,
            ActivationStatus::Delay,
            ActivationStatus::Claimed,
            ActivationStatus::Processing,
        ]
        .into_iter()
        .map(|status| self.get(status))
        .sum()
    }
}
