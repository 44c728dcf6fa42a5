//! The consumer's side of rebalances: librdkafka runs the callback inside
//! the poll that delivers the rebalance, and what must hold before the next
//! record (pausing new partitions while the consumer holds back, forgetting
//! offsets of revoked ones) is done right there, not when the loop gets to
//! the event.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::{ClientContext, TopicPartitionList};
use tokio::sync::mpsc;

use crate::kafka::ThrottledLog;

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

    fn revoke(&self, partitions: &TopicPartitionList) {
        let mut state = self.lock();
        for element in partitions.elements() {
            *state
                .revocations
                .entry((element.topic().to_owned(), element.partition()))
                .or_default() += 1;
        }
    }
}

pub(super) struct RebalanceContext {
    pub(super) events: mpsc::UnboundedSender<Rebalanced>,
    pub(super) ownership: Arc<Ownership>,
    pub(super) log: ThrottledLog,
}

impl ClientContext for RebalanceContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.log.error(error, reason);
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

    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        // Before librdkafka lets the partitions go: from here on, offsets
        // read from them are not ours to commit.
        if let Rebalance::Revoke(partitions) = rebalance {
            self.ownership.revoke(partitions);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let event = match rebalance {
            Rebalance::Assign(partitions) => {
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
}
