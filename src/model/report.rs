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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    /// The `updated` reports per namespace and reported status, sorted by
    /// both (only pairs with at least one report): per-namespace result
    /// rates.
    pub by_namespace: Vec<NamespaceResult>,
}

/// How many reports of one status applied to one namespace's rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceResult {
    pub namespace: String,
    pub status: ActivationStatus,
    pub count: u64,
}

impl NamespaceResult {
    pub fn new(namespace: impl Into<String>, status: WorkerStatus, count: u64) -> Self {
        NamespaceResult {
            namespace: namespace.into(),
            status: status.as_status(),
            count,
        }
    }
}

impl StatusUpdateOutcome {
    /// Adds one applied report of `status` on a row of `namespace` to
    /// `updated` and `by_namespace` (kept sorted).
    pub fn add_applied(&mut self, namespace: &str, status: WorkerStatus, late: bool) {
        self.updated += 1;
        self.late += u64::from(late);
        let status = status.as_status();
        let key = (namespace, status.as_str());
        match self
            .by_namespace
            .binary_search_by(|r| (r.namespace.as_str(), r.status.as_str()).cmp(&key))
        {
            Ok(found) => self.by_namespace[found].count += 1,
            Err(at) => self.by_namespace.insert(
                at,
                NamespaceResult {
                    namespace: namespace.to_owned(),
                    status,
                    count: 1,
                },
            ),
        }
    }

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

/// Rows of one namespace in one status, and when its oldest first-attempt
/// Pending row became runnable (`received_at`, or its delay's end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceCount {
    pub namespace: String,
    pub status: ActivationStatus,
    pub count: u64,
    pub oldest_runnable: Option<chrono::DateTime<chrono::Utc>>,
}

/// One namespace's line on the per-namespace gauges.
#[derive(Debug, Clone, PartialEq)]
pub struct NamespaceSummary {
    pub namespace: String,
    pub counts: BTreeMap<ActivationStatus, u64>,
    /// Seconds since its oldest first-attempt Pending row became runnable;
    /// 0 when it has none.
    pub max_lag: f64,
}

/// The label that stands for every namespace outside the top K.
pub const OTHER_NAMESPACES: &str = "other";

/// The `top` namespaces with the most unfinished rows (Pending, Delay,
/// Claimed, Processing; ties by name), each with its counts and lag, and
/// the rest folded into one [`OTHER_NAMESPACES`] line (its lag the largest
/// among them), so the gauges' cardinality stays at `top` + 1 whatever
/// the namespaces. A namespace literally named "other" joins that line.
pub fn top_namespaces(
    counts: &[NamespaceCount],
    top: usize,
    now: chrono::DateTime<chrono::Utc>,
) -> Vec<NamespaceSummary> {
    let mut by_namespace: BTreeMap<&str, NamespaceSummary> = BTreeMap::new();
    for count in counts {
        let summary = by_namespace
            .entry(count.namespace.as_str())
            .or_insert_with(|| NamespaceSummary {
                namespace: count.namespace.clone(),
                counts: BTreeMap::new(),
                max_lag: 0.0,
            });
        *summary.counts.entry(count.status).or_default() += count.count;
        if let Some(at) = count.oldest_runnable {
            let lag = (now - at).num_milliseconds().max(0) as f64 / 1000.0;
            summary.max_lag = summary.max_lag.max(lag);
        }
    }
    let unfinished = |summary: &NamespaceSummary| -> u64 {
        [
            ActivationStatus::Pending,
            ActivationStatus::Delay,
            ActivationStatus::Claimed,
            ActivationStatus::Processing,
        ]
        .iter()
        .filter_map(|status| summary.counts.get(status))
        .sum()
    };
    let mut ranked: Vec<NamespaceSummary> = by_namespace.into_values().collect();
    ranked.sort_by(|a, b| {
        unfinished(b)
            .cmp(&unfinished(a))
            .then_with(|| a.namespace.cmp(&b.namespace))
    });
    let mut other = NamespaceSummary {
        namespace: OTHER_NAMESPACES.to_owned(),
        counts: BTreeMap::new(),
        max_lag: 0.0,
    };
    let mut kept = Vec::new();
    for summary in ranked {
        if kept.len() < top && summary.namespace != OTHER_NAMESPACES {
            kept.push(summary);
        } else {
            for (status, count) in summary.counts {
                *other.counts.entry(status).or_default() += count;
            }
            other.max_lag = other.max_lag.max(summary.max_lag);
        }
    }
    if !other.counts.is_empty() {
        kept.push(other);
    }
    kept
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

#[cfg(test)]
mod namespace_tests {
    use super::*;

    fn count(
        namespace: &str,
        status: ActivationStatus,
        n: u64,
        lag_secs: Option<i64>,
    ) -> NamespaceCount {
        let now = chrono::DateTime::from_timestamp(1_000_000, 0).unwrap();
        NamespaceCount {
            namespace: namespace.to_owned(),
            status,
            count: n,
            oldest_runnable: lag_secs.map(|secs| now - chrono::TimeDelta::seconds(secs)),
        }
    }

    #[test]
    fn the_top_namespaces_keep_their_lines_and_the_rest_fold_into_other() {
        use ActivationStatus::*;
        let now = chrono::DateTime::from_timestamp(1_000_000, 0).unwrap();
        let counts = [
            count("big", Pending, 1000, Some(30)),
            count("big", Processing, 10, None),
            count("mid", Pending, 50, Some(5)),
            count("small", Pending, 3, Some(90)),
            count("tiny", Claimed, 1, None),
            count("done", Complete, 500, None),
        ];
        let top = top_namespaces(&counts, 2, now);
        let names: Vec<&str> = top.iter().map(|s| s.namespace.as_str()).collect();
        assert_eq!(names, ["big", "mid", "other"]);
        assert_eq!(top[0].counts[&Pending], 1000);
        assert_eq!(top[0].max_lag, 30.0);
        // Completed rows do not rank a namespace; they still count in other.
        assert_eq!(top[2].counts[&Pending], 3);
        assert_eq!(top[2].counts[&Claimed], 1);
        assert_eq!(top[2].counts[&Complete], 500);
        assert_eq!(top[2].max_lag, 90.0, "the worst lag of the rest");
        assert!(top_namespaces(&[], 5, now).is_empty());
        let all = top_namespaces(&counts, 10, now);
        assert_eq!(all.len(), 5, "no other line when every namespace fits");
    }
}
