//! Backpressure and pausing: the consumer pauses every assigned partition
//! while the store holds `MAX_INFLIGHT` rows of its topic or more (until they
//! drop below 90 %; other topics' rows do not count, so one topic's backlog
//! never pauses another's consumer) or while a flush waits on the store or the ingest DLQ, and checks
//! the bound before every insert.

use rdkafka::consumer::Consumer;

use super::{ConsumeLoop, Stopped, TICK};
use crate::actors::store::CountInflightByTopic;

impl ConsumeLoop {
    /// Waits, paused, while the store holds `MAX_INFLIGHT` rows or more:
    /// the check before every insert.
    pub(super) async fn wait_for_room(&mut self) -> Result<(), Stopped> {
        if self.inflight < self.config.max_inflight {
            return Ok(());
        }
        // The local count only grows between reads (rows stored, none
        // finished): read the store before pausing on it.
        self.refresh_inflight().await;
        self.update_backpressure();
        while self.full {
            if !self.wait_polling(TICK).await {
                return Err(Stopped);
            }
            self.refresh_inflight().await;
            self.update_backpressure();
        }
        Ok(())
    }

    /// Reads this topic's in-flight rows from the store.
    pub(super) async fn refresh_inflight(&mut self) {
        let count = self.store.call(CountInflightByTopic {});
        if let Some(Ok(counts)) = self.attempt(count).await {
            self.inflight = counts
                .iter()
                .find(|(topic, _)| *topic == self.config.topic)
                .map_or(0, |(_, count)| *count);
        }
    }

    /// Pauses at `MAX_INFLIGHT`, resumes below 90 % of it.
    pub(super) fn update_backpressure(&mut self) {
        let limit = self.config.max_inflight;
        if !self.full && self.inflight >= limit {
            tracing::info!(
                inflight = self.inflight,
                limit,
                "store full; pausing consumption"
            );
            self.full = true;
        } else if self.full && self.inflight < limit - limit / 10 {
            tracing::info!(
                inflight = self.inflight,
                "store drained; resuming consumption"
            );
            self.full = false;
        }
        self.update_pause();
    }

    /// Pauses or resumes every assigned partition to match the state, and
    /// tells the rebalance callback whether to pause new ones.
    pub(super) fn update_pause(&mut self) {
        let hold = self.full || self.held;
        self.ownership.lock().hold = hold;
        if hold == self.paused {
            return;
        }
        self.paused = hold;
        if hold {
            self.pause_assigned();
        } else {
            if let Ok(assigned) = self.consumer.assignment()
                && let Err(err) = self.consumer.resume(&assigned)
            {
                tracing::warn!(error = %err, "cannot resume partitions");
            }
            self.metrics
                .partitions_paused
                .with_label_values(&[&self.label])
                .set(0);
        }
    }

    pub(super) fn pause_assigned(&self) {
        match self.consumer.assignment() {
            Ok(assigned) => {
                if let Err(err) = self.consumer.pause(&assigned) {
                    tracing::warn!(error = %err, "cannot pause partitions");
                }
                self.metrics
                    .partitions_paused
                    .with_label_values(&[&self.label])
                    .set(assigned.count() as i64);
            }
            Err(err) => tracing::warn!(error = %err, "cannot read the assignment"),
        }
    }
}
