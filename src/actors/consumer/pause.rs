//! Backpressure and pausing: the consumer pauses every assigned partition
//! while the store holds `MAX_INFLIGHT` rows of its topic or more, or
//! `MAX_INFLIGHT_BYTES` of its activations (until both drop below 90 %; other
//! topics' rows do not count, so one topic's backlog never pauses another's
//! consumer), or while a flush waits on the store or the ingest DLQ, and
//! checks the bounds before every insert.
//!
//! The bytes come from sums the store keeps with every insert and delete
//! (a few rows to read, never a scan of the table); the rows from a count
//! the store runs only when the local estimate (last figure read plus what
//! this consumer stored since) reaches a bound, and while paused.

use rdkafka::consumer::Consumer;

use super::{ConsumeLoop, Stopped, TICK};

impl ConsumeLoop {
    /// Waits, paused, while the store holds `MAX_INFLIGHT` rows or more:
    /// the check before every insert.
    pub(super) async fn wait_for_room(&mut self) -> Result<(), Stopped> {
        if !self.estimate_reaches_a_bound() {
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

    /// Whether the local figures (the last read plus what was stored since,
    /// so never below the store's) reach `MAX_INFLIGHT` or
    /// `MAX_INFLIGHT_BYTES`: only then is the store asked.
    pub(super) fn estimate_reaches_a_bound(&self) -> bool {
        let bytes = self.config.max_inflight_bytes;
        self.inflight >= self.config.max_inflight || (bytes > 0 && self.inflight_bytes >= bytes)
    }

    /// After a flush: reads the store when the estimate reached a bound
    /// (rows finished since the last read may have made room), then pauses
    /// or resumes.
    pub(super) async fn check_after_flush(&mut self) {
        if !self.full && self.estimate_reaches_a_bound() {
            self.refresh_inflight().await;
        }
        self.update_backpressure();
    }

    /// Reads this topic's in-flight rows and stored bytes from the store.
    pub(super) async fn refresh_inflight(&mut self) {
        // A failed read keeps the last figures (the estimate only grows,
        // so a full store stays paused); the next tick reads again.
        let count = self.store.count_inflight_by_topic();
        match self.attempt(count).await {
            Some(Ok(counts)) => self.inflight = of_topic(&counts, &self.config.topic),
            Some(Err(err)) => {
                crate::warn_throttled!(error = %err, "cannot count the store's rows for backpressure")
            }
            None => {}
        }
        let bytes = self.store.inflight_bytes_by_topic();
        match self.attempt(bytes).await {
            Some(Ok(sums)) => {
                self.inflight_bytes = of_topic(&sums, &self.config.topic);
                self.metrics.set_inflight_bytes(&sums);
            }
            Some(Err(err)) => {
                crate::warn_throttled!(error = %err, "cannot read the store's bytes for backpressure")
            }
            None => {}
        }
    }

    /// Pauses at `MAX_INFLIGHT` rows or `MAX_INFLIGHT_BYTES`, resumes once
    /// both are below 90 % of their bound.
    pub(super) fn update_backpressure(&mut self) {
        let rows = self.config.max_inflight;
        let bytes = self.config.max_inflight_bytes;
        let over = self.inflight >= rows || (bytes > 0 && self.inflight_bytes >= bytes);
        let under = self.inflight < rows - rows / 10
            && (bytes == 0 || self.inflight_bytes < bytes - bytes / 10);
        if !self.full && over {
            tracing::info!(
                inflight = self.inflight,
                limit = rows,
                inflight_bytes = self.inflight_bytes,
                limit_bytes = bytes,
                "store full; pausing consumption"
            );
            self.full = true;
        } else if self.full && under {
            tracing::info!(
                inflight = self.inflight,
                inflight_bytes = self.inflight_bytes,
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

/// The figure of `topic` in a per-topic list (0 when it has none).
fn of_topic(figures: &[(String, u64)], topic: &str) -> u64 {
    figures
        .iter()
        .find(|(name, _)| name == topic)
        .map_or(0, |(_, figure)| *figure)
}
