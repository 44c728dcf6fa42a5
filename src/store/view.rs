//! A read-only view of the store for operators (`taskbroker inspect`):
//! what is queued, by status, namespace and task name, how old the oldest
//! Pending task of each namespace is, which claims and deadlines are about
//! to run out, and one row by id. Only reads: safe beside running brokers.
//! PostgreSQL answers through a [`PostgresStore`](super::PostgresStore);
//! SQLite through [`SqliteView`](super::SqliteView), which opens the file
//! read-only and takes neither the writer nor the one-process lock.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::StoreResult;
use crate::model::{ActivationStatus, InflightActivation};

/// Rows of one (status, namespace, task name) and their activations'
/// bytes, with the oldest Pending one's `received_at` where the status is
/// Pending.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupCount {
    pub status: ActivationStatus,
    pub namespace: String,
    pub taskname: String,
    pub count: u64,
    pub bytes: u64,
    pub oldest_received: Option<DateTime<Utc>>,
}

/// A Claimed row whose lease, or a Processing row whose deadline, runs out
/// soon (or already has).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NearExpiry {
    pub id: String,
    pub namespace: String,
    pub taskname: String,
    pub status: ActivationStatus,
    /// `claim_expires_at` (Claimed) or `processing_deadline` (Processing).
    pub due: DateTime<Utc>,
}

/// What the table holds, read in two statements.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inspection {
    pub groups: Vec<GroupCount>,
    pub near_expiry: Vec<NearExpiry>,
}

impl Inspection {
    /// Rows per status, every status present (0 included).
    pub fn by_status(&self) -> BTreeMap<ActivationStatus, u64> {
        self.per_status(|group| group.count)
    }

    /// Activation bytes per status, every status present (0 included).
    pub fn bytes_by_status(&self) -> BTreeMap<ActivationStatus, u64> {
        self.per_status(|group| group.bytes)
    }

    /// Rows per namespace and status (only the statuses it has).
    pub fn by_namespace(&self) -> BTreeMap<String, BTreeMap<ActivationStatus, u64>> {
        self.per_namespace(|group| group.count)
    }

    /// Activation bytes per namespace and status (only the statuses it has).
    pub fn bytes_by_namespace(&self) -> BTreeMap<String, BTreeMap<ActivationStatus, u64>> {
        self.per_namespace(|group| group.bytes)
    }

    fn per_status(&self, figure: impl Fn(&GroupCount) -> u64) -> BTreeMap<ActivationStatus, u64> {
        let mut sums: BTreeMap<ActivationStatus, u64> = ActivationStatus::ALL
            .into_iter()
            .map(|status| (status, 0))
            .collect();
        for group in &self.groups {
            *sums.entry(group.status).or_default() += figure(group);
        }
        sums
    }

    fn per_namespace(
        &self,
        figure: impl Fn(&GroupCount) -> u64,
    ) -> BTreeMap<String, BTreeMap<ActivationStatus, u64>> {
        let mut sums: BTreeMap<String, BTreeMap<ActivationStatus, u64>> = BTreeMap::new();
        for group in &self.groups {
            *sums
                .entry(group.namespace.clone())
                .or_default()
                .entry(group.status)
                .or_default() += figure(group);
        }
        sums
    }

    /// Rows per (namespace, task name) and status.
    pub fn by_taskname(&self) -> BTreeMap<(String, String), BTreeMap<ActivationStatus, u64>> {
        let mut counts: BTreeMap<(String, String), BTreeMap<ActivationStatus, u64>> =
            BTreeMap::new();
        for group in &self.groups {
            *counts
                .entry((group.namespace.clone(), group.taskname.clone()))
                .or_default()
                .entry(group.status)
                .or_default() += group.count;
        }
        counts
    }

    /// The oldest Pending task's `received_at`, per namespace that has one.
    pub fn oldest_pending(&self) -> BTreeMap<String, DateTime<Utc>> {
        let mut oldest: BTreeMap<String, DateTime<Utc>> = BTreeMap::new();
        for group in &self.groups {
            if let Some(received) = group.oldest_received {
                oldest
                    .entry(group.namespace.clone())
                    .and_modify(|at| *at = (*at).min(received))
                    .or_insert(received);
            }
        }
        oldest
    }
}

/// The read-only operations behind `taskbroker inspect`.
#[async_trait]
pub trait StoreView: Send + Sync {
    /// Counts by status, namespace and task name, and up to `limit`
    /// Claimed/Processing rows due within `near`, soonest first.
    async fn inspect(&self, near: Duration, limit: usize) -> StoreResult<Inspection>;

    /// One row by id.
    async fn row(&self, id: &str) -> StoreResult<Option<InflightActivation>>;
}
