//! The StoreActor's write combiner: frequent small writes (mark processing
//! after each push, workers' status reports) are queued and written together,
//! one statement for everything that arrived while the previous one ran.
//!
//! This is the only path for these two intents: [`MarkPushed`] is the one
//! way to mark a claim Processing, [`ReportStatus`] the one way to write
//! workers' results (a single report or a batch: one request is one caller's
//! updates).
//!
//! Marks and reports meet here, which saves most marks: a worker usually
//! reports a short task before its push's answer has come back and been
//! marked. A mark whose task's report arrived after the push was sent is
//! answered at once without a write ([`Recent`]): the report, which
//! applies to Claimed and Processing rows alike, ends the row either way, so
//! writing Processing first would only be undone. Fences are untouched: a
//! skipped mark writes nothing, so it cannot let a stale claim win.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::StreamExt;
use tokio::sync::oneshot;

use super::{StoreActor, StoreHandle, StoreMessage};
use crate::metrics::{Metrics, Stage};
use crate::model::{ClaimToken, StatusUpdate};
use crate::store::{ActivationStore, StoreError, StoreResult};

/// Most claims (or status updates) one combined statement carries; a single
/// request larger than this still goes in one statement of its own.
const MAX_COMBINED: usize = 1024;

/// Requests written at once when a combined report write failed and each is
/// retried on its own: enough to finish quickly, few enough to leave pool
/// connections to everyone else.
const SEPARATE_WRITES_AT_ONCE: usize = 8;

/// Small writes waiting to be combined into one statement. One combined
/// statement runs at a time; whatever arrives meanwhile forms the next one,
/// so the batch size follows the load with no timer and no added latency
/// when the system is quiet.
pub(super) struct CombinedWrites<T, R> {
    waiting: Vec<(T, oneshot::Sender<StoreResult<R>>)>,
    flushing: bool,
}

impl<T, R> Default for CombinedWrites<T, R> {
    fn default() -> Self {
        CombinedWrites {
            waiting: Vec::new(),
            flushing: false,
        }
    }
}

type Waiting<T, R> = Vec<(T, oneshot::Sender<StoreResult<R>>)>;

impl<T, R> CombinedWrites<T, R> {
    /// Queues `item`; the returned future resolves with its own result.
    fn push(&mut self, item: T, operation: &'static str) -> ResponseFuture<StoreResult<R>>
    where
        R: Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        self.waiting.push((item, reply));
        Box::pin(async move {
            answer.await.unwrap_or_else(|_| {
                Err(StoreError::Unavailable {
                    operation,
                    message: "store actor stopped before the write ran".to_owned(),
                })
            })
        })
    }

    /// Answers the waiting requests that `early` settles without a write,
    /// and takes them out of the queue. Returns how many it answered.
    fn answer_early(&mut self, early: impl Fn(&T) -> Option<R>) -> usize {
        let mut answered = 0;
        let waiting = std::mem::take(&mut self.waiting);
        for (item, reply) in waiting {
            match early(&item) {
                Some(result) => {
                    let _ = reply.send(Ok(result));
                    answered += 1;
                }
                None => self.waiting.push((item, reply)),
            }
        }
        answered
    }

    /// The next batch to write, if none is being written: requests in order
    /// until their `weight` would pass [`MAX_COMBINED`], at least one.
    fn take_batch(&mut self, weight: impl Fn(&T) -> usize) -> Option<Waiting<T, R>> {
        if self.flushing || self.waiting.is_empty() {
            return None;
        }
        self.flushing = true;
        let mut total = 0;
        let mut taken = 0;
        for (item, _) in &self.waiting {
            let weight = weight(item);
            if taken > 0 && total + weight > MAX_COMBINED {
                break;
            }
            total += weight;
            taken += 1;
        }
        let rest = self.waiting.split_off(taken);
        Some(std::mem::replace(&mut self.waiting, rest))
    }
}

/// How many workers' reports [`Recent`] remembers, and for how long.
/// A mark comes within one push of its report, milliseconds at most
/// seconds, so a short memory saves nearly every mark it can; a report
/// forgotten too early only costs the write it would have saved.
const RECENT_REPORTS_KEPT: usize = 4_096;
const RECENT_REPORTS_FOR: Duration = Duration::from_secs(10);
/// How many marked pushes are remembered until their report, for the
/// pushed → reported stage; a task running longer than this, or beyond
/// this many in flight, is not measured.
const RECENT_PUSHES_KEPT: usize = 16_384;
const RECENT_PUSHES_FOR: Duration = Duration::from_secs(300);

/// Task ids with an instant each, remembered up to a count and an age. The
/// map and the queue share one copy of each id.
pub(super) struct RecentIds {
    at: HashMap<Arc<str>, Instant>,
    order: VecDeque<(Instant, Arc<str>)>,
    kept: usize,
    kept_for: Duration,
}

impl RecentIds {
    fn new(kept: usize, kept_for: Duration) -> Self {
        RecentIds {
            at: HashMap::new(),
            order: VecDeque::new(),
            kept,
            kept_for,
        }
    }

    fn record(&mut self, id: &str, at: Instant, now: Instant) {
        let id: Arc<str> = Arc::from(id);
        self.at.insert(Arc::clone(&id), at);
        self.order.push_back((at, id));
        while let Some((oldest, _)) = self.order.front() {
            if self.order.len() <= self.kept
                && now.saturating_duration_since(*oldest) < self.kept_for
            {
                break;
            }
            let (oldest, id) = self.order.pop_front().expect("front exists");
            // A later entry for the same id keeps its own instant.
            if self.at.get(&id) == Some(&oldest) {
                self.at.remove(&id);
            }
        }
    }

    fn get(&self, id: &str) -> Option<Instant> {
        self.at.get(id).copied()
    }

    /// Forgets `id` (its queue entry goes when it reaches the front).
    fn take(&mut self, id: &str) -> Option<Instant> {
        self.at.remove(id)
    }
}

/// What the write combiner remembers across messages: when recent reports
/// arrived (to skip marks they make moot) and when marked pushes were sent
/// (to time the pushed → reported stage).
pub(super) struct Recent {
    reports: RecentIds,
    pushes: RecentIds,
}

impl Default for Recent {
    fn default() -> Self {
        Recent {
            reports: RecentIds::new(RECENT_REPORTS_KEPT, RECENT_REPORTS_FOR),
            pushes: RecentIds::new(RECENT_PUSHES_KEPT, RECENT_PUSHES_FOR),
        }
    }
}

impl Recent {
    /// When a report for `id` arrived, if at or after `since`.
    fn reported_since(&self, id: &str, since: Instant) -> Option<Instant> {
        self.reports.get(id).filter(|arrived| *arrived >= since)
    }

    fn reports_arrived<'a>(&mut self, ids: impl IntoIterator<Item = &'a str>, metrics: &Metrics) {
        let now = Instant::now();
        for id in ids {
            self.reports.record(id, now, now);
            if let Some(pushed_at) = self.pushes.take(id) {
                metrics.observe_stage(Stage::PushedToReported, (now - pushed_at).as_secs_f64());
            }
        }
    }
}

/// A push succeeded: fenced Claimed → Processing, combined with other
/// pushes' writes into one statement. Answers whether this claim still held
/// the row (`false`: stale, the row was claimed again or released). A mark
/// whose task was reported after `pushed_at` is answered `true` without a
/// write (see the module docs).
#[derive(Debug)]
pub struct MarkPushed {
    pub claim: ClaimToken,
    pub deadline_grace: Duration,
    /// When the push was sent: a report arriving later belongs to this
    /// delivery or an earlier one, and is written after this claim was made.
    pub pushed_at: Instant,
}

impl Message for MarkPushed {
    type Result = StoreResult<bool>;
}

impl StoreMessage for MarkPushed {
    type Output = bool;
    const OPERATION: &'static str = "mark_processing";
}

impl Handler<MarkPushed> for StoreActor {
    type Result = ResponseFuture<StoreResult<bool>>;

    fn handle(&mut self, msg: MarkPushed, ctx: &mut Self::Context) -> Self::Result {
        if let Some(arrived) = self.recent.reported_since(&msg.claim.id, msg.pushed_at) {
            self.metrics.marks_skipped.inc();
            let waited = arrived.saturating_duration_since(msg.pushed_at);
            self.metrics
                .observe_stage(Stage::PushedToReported, waited.as_secs_f64());
            return Box::pin(async { Ok(true) });
        }
        let now = Instant::now();
        self.recent.pushes.record(&msg.claim.id, msg.pushed_at, now);
        let answer = self.pushed.push(
            (msg.claim, msg.deadline_grace, msg.pushed_at),
            MarkPushed::OPERATION,
        );
        self.flush_pushed(ctx);
        answer
    }
}

/// Workers' results (SetTaskStatus: one update; SetBatchActivationStatus:
/// the batch): written together with other concurrent requests in one
/// statement. Resolves once the write is durable. If the combined statement
/// fails for a reason other than the store being unavailable, each request
/// is written again on its own, so a request the database refuses fails
/// only itself. What the writes did is counted in the metrics
/// (`record_status_outcome`), once per statement.
#[derive(Debug)]
pub struct ReportStatus {
    pub updates: Vec<StatusUpdate>,
}

impl Message for ReportStatus {
    type Result = StoreResult<()>;
}

impl StoreMessage for ReportStatus {
    type Output = ();
    const OPERATION: &'static str = "set_status";
}

impl Handler<ReportStatus> for StoreActor {
    type Result = ResponseFuture<StoreResult<()>>;

    fn handle(&mut self, msg: ReportStatus, ctx: &mut Self::Context) -> Self::Result {
        if msg.updates.is_empty() {
            return Box::pin(async { Ok(()) });
        }
        self.recent.reports_arrived(
            msg.updates.iter().map(|update| update.id.as_str()),
            &self.metrics,
        );
        let answer = self.reported.push(msg.updates, ReportStatus::OPERATION);
        self.flush_reported(ctx);
        answer
    }
}

impl StoreHandle {
    /// A push succeeded: mark its claim Processing (see [`MarkPushed`]).
    /// Answers whether the claim still held the row.
    pub fn mark_pushed(
        &self,
        claim: ClaimToken,
        deadline_grace: Duration,
        pushed_at: Instant,
    ) -> impl Future<Output = StoreResult<bool>> + Send + use<> {
        self.call(MarkPushed {
            claim,
            deadline_grace,
            pushed_at,
        })
    }

    /// Write workers' results (see [`ReportStatus`]); resolves once they
    /// are durable.
    pub fn report(
        &self,
        updates: Vec<StatusUpdate>,
    ) -> impl Future<Output = StoreResult<()>> + Send + use<> {
        self.call(ReportStatus { updates })
    }
}

impl StoreActor {
    fn flush_reported(&mut self, ctx: &mut Context<Self>) {
        let Some(batch) = self.reported.take_batch(Vec::len) else {
            return;
        };
        let (requests, replies): (Vec<Vec<StatusUpdate>>, Vec<_>) = batch.into_iter().unzip();
        let store = Arc::clone(&self.store);
        let metrics = Arc::clone(&self.metrics);
        let write = async move {
            let combined = match requests.as_slice() {
                [one] => write_reports(store.as_ref(), &metrics, one).await,
                all => write_reports(store.as_ref(), &metrics, &all.concat()).await,
            };
            match combined {
                // An outage fails every request alike: re-running them one
                // by one would only wait on the database again.
                Err(err) if requests.len() > 1 && !err.is_unavailable() => {
                    tracing::warn!(error = %err, requests = requests.len(),
                        "combined status write failed; writing each request on its own");
                    // Built before the stream, not by a closure inside it:
                    // a closure over borrowed requests held across the await
                    // is not provably `Send` for the store's threads.
                    let separate: Vec<_> = requests
                        .iter()
                        .map(|one| write_reports(store.as_ref(), &metrics, one))
                        .collect();
                    futures::stream::iter(separate)
                        .buffered(SEPARATE_WRITES_AT_ONCE)
                        .collect::<Vec<_>>()
                        .await
                }
                combined => vec![combined; requests.len()],
            }
        };
        let requests_count = replies.len();
        let write = self.io.spawn(write);
        ctx.spawn(write.into_actor(self).map(move |results, act, ctx| {
            let results = results
                .unwrap_or_else(|| vec![Err(stopped(ReportStatus::OPERATION)); requests_count]);
            for (reply, result) in replies.into_iter().zip(results) {
                let _ = reply.send(result);
            }
            act.reported.flushing = false;
            act.flush_reported(ctx);
        }));
    }

    fn flush_pushed(&mut self, ctx: &mut Context<Self>) {
        if self.pushed.flushing {
            return;
        }
        // Reports that came in while these marks waited make them moot
        // (their stage was timed when the report arrived).
        let recent = &self.recent;
        let skipped = self.pushed.answer_early(|(claim, _, pushed_at)| {
            recent.reported_since(&claim.id, *pushed_at).map(|_| true)
        });
        self.metrics.marks_skipped.inc_by(skipped as u64);
        let Some(batch) = self.pushed.take_batch(|_| 1) else {
            return;
        };
        // Grace is a broker-wide setting; use the largest so no deadline is
        // shortened if callers ever differ.
        let grace = batch
            .iter()
            .map(|((_, grace, _), _)| *grace)
            .max()
            .unwrap_or_default();
        let claims: Vec<ClaimToken> = batch
            .iter()
            .map(|((claim, _, _), _)| claim.clone())
            .collect();
        let store = Arc::clone(&self.store);
        let metrics = Arc::clone(&self.metrics);
        let write = async move {
            let started = Instant::now();
            let result = store.mark_processing(&claims, grace).await;
            metrics.observe_store(
                MarkPushed::OPERATION,
                started.elapsed(),
                result.as_ref().err().map(StoreError::kind),
            );
            result
        };
        let write = self.io.spawn(write);
        ctx.spawn(write.into_actor(self).map(move |result, act, ctx| {
            match result.unwrap_or_else(|| Err(stopped(MarkPushed::OPERATION))) {
                Ok(moved) => {
                    let moved: HashSet<String> = moved.into_iter().collect();
                    for ((claim, _, _), reply) in batch {
                        let _ = reply.send(Ok(moved.contains(&claim.id)));
                    }
                }
                Err(err) => {
                    for (_, reply) in batch {
                        let _ = reply.send(Err(err.clone()));
                    }
                }
            }
            act.pushed.flushing = false;
            act.flush_pushed(ctx);
        }));
    }
}

/// The answer to a combined write that could not finish (the store's
/// threads were shut down under it).
fn stopped(operation: &'static str) -> StoreError {
    StoreError::Unavailable {
        operation,
        message: "store stopped before the write finished".to_owned(),
    }
}

/// One `set_status` statement for workers' reports, with its metrics.
async fn write_reports(
    store: &dyn ActivationStore,
    metrics: &Metrics,
    updates: &[StatusUpdate],
) -> StoreResult<()> {
    let started = Instant::now();
    let result = store.set_status(updates).await;
    metrics.observe_store(
        ReportStatus::OPERATION,
        started.elapsed(),
        result.as_ref().err().map(StoreError::kind),
    );
    let outcome = result?;
    metrics.record_status_outcome(outcome.counts());
    metrics.record_namespace_results(outcome.by_namespace.iter().map(|result| {
        (
            result.namespace.as_str(),
            result.status.metric_label(),
            result.count,
        )
    }));
    Ok(())
}
