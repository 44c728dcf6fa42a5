//! The consumer's side of rebalances: librdkafka runs the callback inside
//! the poll that delivers the rebalance, and what must hold before the next
//! record (pausing new partitions while the consumer holds back, forgetting
//! offsets of revoked ones) is done right there, not when the loop gets to
//! the event.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rdkafka::Offset;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::{ClientContext, Statistics, TopicPartitionList};
use tokio::sync::mpsc;

use crate::kafka::ThrottledLog;
use crate::metrics::Metrics;

/// Rebalance events, forwarded from librdkafka's callback to the loop (for
/// logs and metrics; what must not wait is done in the callback itself).
#[derive(Debug)]
pub(super) enum Rebalanced {
    Assigned,
    Revoked,
}

/// What the rebalance callback changes at once, inside the poll that runs
/// it, so the loop never commits or fetches on a stale view of its
/// partitions.
#[derive(Debug, Default)]
pub(super) struct Ownership {
    state: Mutex<OwnershipState>,
}

#[derive(Debug, Default)]
pub(super) struct OwnershipState {
    /// How often each partition was revoked from this consumer. Offsets
    /// read under an earlier count belong to an ownership that ended (the
    /// partition may have had another owner since) and are never committed.
    revocations: HashMap<(String, i32), u64>,
    /// Partitions revoked in the rebalance under way. One that comes straight
    /// back to this consumer in the same rebalance had no other owner in
    /// between (it was unassigned), so its ownership never really ended.
    just_revoked: HashSet<(String, i32)>,
    /// Per partition: the generation and highest offset of records already
    /// stored (or dead-lettered) under it. Committed synchronously when the
    /// partition is revoked, before librdkafka lets it go, so its next owner
    /// starts after them even when the asynchronous commit has not landed.
    settled: HashMap<(String, i32), (u64, i64)>,
    /// The consumer is being closed: its last flush already committed, and a
    /// synchronous commit from inside librdkafka's close would wait forever.
    closing: bool,
    /// Pause partitions the moment they are assigned.
    pub(super) hold: bool,
}

impl Ownership {
    pub(super) fn lock(&self) -> MutexGuard<'_, OwnershipState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn generation(&self, topic: &str, partition: i32) -> u64 {
        let state = self.lock();
        if state.revocations.is_empty() {
            return 0; // never revoked: no key to build per record
        }
        state
            .revocations
            .get(&(topic.to_owned(), partition))
            .copied()
            .unwrap_or(0)
    }

    /// Records the batch's offsets as settled (stored or dead-lettered),
    /// for partitions still held under the generation they were read in.
    pub(super) fn settled(&self, offsets: &BTreeMap<(String, i32), (u64, i64)>) {
        let mut state = self.lock();
        for (key, &(generation, offset)) in offsets {
            let current = state.revocations.get(key).copied().unwrap_or(0);
            if current != generation {
                continue;
            }
            state
                .settled
                .entry(key.clone())
                .and_modify(|entry| {
                    if entry.0 == generation {
                        entry.1 = entry.1.max(offset);
                    } else {
                        *entry = (generation, offset);
                    }
                })
                .or_insert((generation, offset));
        }
    }

    /// Called before the consumer is dropped (see `closing`).
    pub(super) fn closing(&self) {
        let mut state = self.lock();
        state.closing = true;
        state.settled.clear();
    }

    /// Takes the settled offsets of `partitions` that belong to their
    /// current generation, as the commit to make before letting them go.
    fn take_settled(&self, partitions: &TopicPartitionList) -> TopicPartitionList {
        let mut state = self.lock();
        let mut commit = TopicPartitionList::new();
        if state.closing {
            return commit;
        }
        for element in partitions.elements() {
            let key = (element.topic().to_owned(), element.partition());
            let current = state.revocations.get(&key).copied().unwrap_or(0);
            if let Some((generation, offset)) = state.settled.remove(&key)
                && generation == current
                && let Err(err) =
                    commit.add_partition_offset(&key.0, key.1, Offset::Offset(offset + 1))
            {
                tracing::warn!(error = %err, "cannot build the offset commit");
            }
        }
        commit
    }

    fn revoke(&self, partitions: &TopicPartitionList) {
        let mut state = self.lock();
        for element in partitions.elements() {
            let key = (element.topic().to_owned(), element.partition());
            *state.revocations.entry(key.clone()).or_default() += 1;
            state.just_revoked.insert(key);
        }
    }

    /// A partition revoked and assigned back within one rebalance keeps its
    /// generation: what was read from it before may still be committed (an
    /// eager rebalance revokes every partition, and most come back).
    /// Partitions revoked and not assigned back belong to another consumer.
    fn assign(&self, partitions: &TopicPartitionList) {
        let mut state = self.lock();
        for element in partitions.elements() {
            let key = (element.topic().to_owned(), element.partition());
            if state.just_revoked.remove(&key)
                && let Some(count) = state.revocations.get_mut(&key)
            {
                *count = count.saturating_sub(1);
            }
        }
        state.just_revoked.clear();
    }
}

pub(super) struct RebalanceContext {
    pub(super) events: mpsc::UnboundedSender<Rebalanced>,
    pub(super) ownership: Arc<Ownership>,
    pub(super) log: ThrottledLog,
    pub(super) lag: PartitionLag,
}

impl ClientContext for RebalanceContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.log.error(error, reason);
    }

    fn stats(&self, statistics: Statistics) {
        self.lag.update(&statistics);
    }
}

/// `taskbroker_consumer_lag{topic, partition}` from librdkafka's statistics:
/// a series for each partition the consumer holds, removed when it no
/// longer does. The `topic` label is the consumer's own (`topic@cluster`
/// off the default cluster), as on every consumer metric: two consumers of
/// one topic name on two clusters keep apart.
pub(super) struct PartitionLag {
    metrics: Arc<Metrics>,
    /// The topic this consumer subscribes to, as librdkafka names it.
    topic: String,
    /// Its label on the metrics.
    label: String,
    /// Where a partition the group never committed on starts
    /// (`auto.offset.reset`): at its first record, or at its end.
    from_start: Option<bool>,
    shown: Mutex<HashSet<i32>>,
}

impl PartitionLag {
    pub(super) fn new(
        metrics: Arc<Metrics>,
        topic: &str,
        label: String,
        auto_offset_reset: &str,
    ) -> Self {
        let from_start = match auto_offset_reset {
            "smallest" | "earliest" | "beginning" => Some(true),
            "largest" | "latest" | "end" => Some(false),
            _ => None,
        };
        PartitionLag {
            metrics,
            topic: topic.to_owned(),
            label,
            from_start,
            shown: Mutex::default(),
        }
    }

    pub(super) fn update(&self, statistics: &Statistics) {
        let mut now = HashSet::new();
        if let Some(stats) = statistics.topics.get(&self.topic) {
            for (partition, stats) in &stats.partitions {
                // -1 is librdkafka's internal "unassigned" partition;
                // `desired` marks the partitions this consumer was assigned.
                if *partition < 0 || !stats.desired {
                    continue;
                }
                let Some(lag) = partition_lag(stats, self.from_start) else {
                    continue;
                };
                self.metrics
                    .consumer_lag
                    .with_label_values(&[self.label.as_str(), &partition.to_string()])
                    .set(lag);
                now.insert(*partition);
            }
        }
        let mut shown = self.shown.lock().unwrap_or_else(PoisonError::into_inner);
        for partition in shown.difference(&now) {
            self.remove(*partition);
        }
        *shown = now;
    }

    /// Removes every series (the consumer stopped).
    pub(super) fn clear(&self) {
        let mut shown = self.shown.lock().unwrap_or_else(PoisonError::into_inner);
        for partition in shown.drain() {
            self.remove(partition);
        }
    }

    fn remove(&self, partition: i32) {
        let _ = self
            .metrics
            .consumer_lag
            .remove_label_values(&[self.label.as_str(), &partition.to_string()]);
    }
}

/// Records past the committed offset; else past the offset the consumer
/// stored (read and written, commit under way); for a partition the group
/// never committed on, once the consumer fetches from it, every record from
/// where `auto.offset.reset` starts it. `None` while librdkafka does not
/// know the partition's offsets yet: right after an assignment the
/// committed offset is still being looked up, and the whole partition is
/// no lag of this group's.
fn partition_lag(stats: &rdkafka::statistics::Partition, from_start: Option<bool>) -> Option<i64> {
    if let Some(lag) = [stats.consumer_lag, stats.consumer_lag_stored]
        .into_iter()
        .find(|lag| *lag >= 0)
    {
        return Some(lag);
    }
    if stats.fetch_state != "active" {
        return None;
    }
    let (first, end) = (stats.lo_offset, stats.hi_offset);
    match from_start? {
        true if first >= 0 && end >= first => Some(end - first),
        false if end >= 0 => Some(0),
        _ => None,
    }
}

impl ConsumerContext for RebalanceContext {
    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        // Asynchronous commits report here; a failed one is re-covered by the
        // next batch's commit, or by the partition's next owner re-reading
        // (inserts are idempotent), but it must not go unseen.
        if let Err(err) = result {
            tracing::warn!(error = %err, "Kafka offset commit failed");
        }
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        // Before librdkafka lets the partitions go: commit again what this
        // consumer already stored from them (the commit after their batch
        // may not have landed, and the next owner would read, and run, those
        // tasks again once they are finished and removed). Queued, not
        // waited for: a synchronous commit from inside the rebalance
        // callback can wait forever. From here on, offsets read from them
        // are not ours to commit.
        if let Rebalance::Revoke(partitions) = rebalance {
            let settled = self.ownership.take_settled(partitions);
            if settled.count() > 0
                && let Err(err) = consumer.commit(&settled, CommitMode::Async)
            {
                tracing::warn!(error = %err, "cannot commit stored offsets of revoked partitions; their next owner reads those records again");
            }
            self.ownership.revoke(partitions);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let event = match rebalance {
            Rebalance::Assign(partitions) => {
                self.ownership.assign(partitions);
                // Paused while the store is full or a batch is blocked: a
                // new assignment must not deliver a record first.
                if self.ownership.lock().hold
                    && let Err(err) = consumer.pause(partitions)
                {
                    tracing::warn!(error = %err, "cannot pause newly assigned partitions");
                }
                Rebalanced::Assigned
            }
            Rebalance::Revoke(_) => Rebalanced::Revoked,
            Rebalance::Error(err) => {
                tracing::warn!(error = %err, "Kafka rebalance failed");
                return;
            }
        };
        let _ = self.events.send(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::statistics::{Partition, Topic};

    fn partition(fetch_state: &str, committed_lag: i64) -> Partition {
        Partition {
            desired: true,
            fetch_state: fetch_state.to_owned(),
            consumer_lag: committed_lag,
            consumer_lag_stored: -1,
            lo_offset: 0,
            hi_offset: 1_000_000,
            ..Default::default()
        }
    }

    fn statistics_of(topic: &str, partitions: &[(i32, Partition)]) -> Statistics {
        let mut statistics = Statistics::default();
        statistics.topics.insert(
            topic.to_owned(),
            Topic {
                topic: topic.to_owned(),
                partitions: partitions.iter().cloned().collect(),
                ..Default::default()
            },
        );
        statistics
    }

    #[test]
    fn no_lag_is_shown_for_a_partition_whose_committed_offset_is_still_looked_up() {
        // Right after an assignment: neither lag is known yet, and the
        // retained records are no measure of this group's lag.
        assert_eq!(
            partition_lag(&partition("offset-query", -1), Some(true)),
            None
        );
        assert_eq!(
            partition_lag(&partition("offset-wait", -1), Some(true)),
            None
        );
        // Fetching with no committed offset: everything from the start.
        assert_eq!(
            partition_lag(&partition("active", -1), Some(true)),
            Some(1_000_000)
        );
        assert_eq!(
            partition_lag(&partition("active", -1), Some(false)),
            Some(0)
        );
        assert_eq!(
            partition_lag(&partition("active", 42), Some(true)),
            Some(42)
        );
    }

    #[test]
    fn consumers_of_one_topic_name_on_two_clusters_keep_their_own_series() {
        let metrics = Arc::new(Metrics::new());
        let on_a = PartitionLag::new(
            Arc::clone(&metrics),
            "tasks",
            "tasks".to_owned(),
            "earliest",
        );
        let on_b = PartitionLag::new(
            Arc::clone(&metrics),
            "tasks",
            "tasks@b".to_owned(),
            "earliest",
        );
        on_a.update(&statistics_of("tasks", &[(0, partition("active", 5))]));
        on_b.update(&statistics_of("tasks", &[(0, partition("active", 9))]));
        let series = |label: &str| {
            metrics.render().lines().find_map(|line| {
                line.strip_prefix(&format!(
                    "taskbroker_consumer_lag{{partition=\"0\",topic=\"{label}\"}} "
                ))
                .map(str::to_owned)
            })
        };
        assert_eq!(series("tasks").as_deref(), Some("5"));
        assert_eq!(series("tasks@b").as_deref(), Some("9"));
        // One consumer giving the partition up leaves the other's series.
        on_b.update(&statistics_of("tasks", &[]));
        assert_eq!(series("tasks@b"), None);
        assert_eq!(series("tasks").as_deref(), Some("5"));
        on_a.clear();
        assert_eq!(series("tasks"), None);
    }

    #[test]
    fn each_revocation_starts_a_new_generation_of_that_partition_only() {
        let ownership = Ownership::default();
        assert_eq!(ownership.generation("tasks", 0), 0);
        let mut revoked = TopicPartitionList::new();
        revoked.add_partition("tasks", 0);
        ownership.revoke(&revoked);
        ownership.revoke(&revoked);
        assert_eq!(ownership.generation("tasks", 0), 2);
        assert_eq!(ownership.generation("tasks", 1), 0);
        assert_eq!(ownership.generation("other", 0), 0);
    }

    #[test]
    fn stored_offsets_are_handed_over_once_when_their_partition_is_revoked() {
        let ownership = Ownership::default();
        let offsets: BTreeMap<(String, i32), (u64, i64)> = [
            (("tasks".to_owned(), 0), (0, 41)),
            (("tasks".to_owned(), 1), (0, 7)),
        ]
        .into();
        ownership.settled(&offsets);
        let mut first = TopicPartitionList::new();
        first.add_partition("tasks", 0);
        let commit = ownership.take_settled(&first);
        let element = commit.find_partition("tasks", 0).expect("partition 0");
        assert_eq!(
            element.offset(),
            Offset::Offset(42),
            "the next offset to read"
        );
        assert_eq!(commit.count(), 1, "only the revoked partition");
        assert_eq!(ownership.take_settled(&first).count(), 0, "taken once");
        // Offsets recorded under a generation that has since ended are
        // never handed over.
        let mut second = TopicPartitionList::new();
        second.add_partition("tasks", 1);
        ownership.revoke(&second);
        ownership.assign(&TopicPartitionList::new());
        assert_eq!(ownership.take_settled(&second).count(), 0);
    }

    #[test]
    fn a_partition_assigned_straight_back_keeps_its_generation() {
        let ownership = Ownership::default();
        let mut both = TopicPartitionList::new();
        both.add_partition("tasks", 0);
        both.add_partition("tasks", 1);
        // An eager rebalance: both revoked, only partition 0 comes back.
        ownership.revoke(&both);
        let mut back = TopicPartitionList::new();
        back.add_partition("tasks", 0);
        ownership.assign(&back);
        assert_eq!(
            ownership.generation("tasks", 0),
            0,
            "never left this consumer"
        );
        assert_eq!(
            ownership.generation("tasks", 1),
            1,
            "went to another consumer"
        );
        // Partition 1 assigned back in a later rebalance: someone else may
        // have owned it meanwhile, so the old generation stays ended.
        let mut later = TopicPartitionList::new();
        later.add_partition("tasks", 1);
        ownership.assign(&later);
        assert_eq!(ownership.generation("tasks", 1), 1);
    }
}
