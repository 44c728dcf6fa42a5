//! The StoreActor's write combiner: frequent small writes (mark processing
//! after each push, workers' status reports) are queued and written together,
//! one statement for everything that arrived while the previous one ran.
//!
//! This is the only path for these two intents: [`MarkPushed`] is the one
//! way to mark a claim Processing, [`ReportStatus`] the one way to write
//! workers' results (a single report or a batch: one request is one caller's
//! updates).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::StreamExt;
use tokio::sync::oneshot;

use super::{StoreActor, StoreMessage};
use crate::metrics::Metrics;
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

/// A push succeeded: fenced Claimed → Processing, combined with other
/// pushes' writes into one statement. Answers whether this claim still held
/// the row (`false`: stale, the row was claimed again or released).
#[derive(Debug)]
pub struct MarkPushed {
    pub claim: ClaimToken,
    pub deadline_grace: Duration,
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
        let answer = self
            .pushed
            .push((msg.claim, msg.deadline_grace), MarkPushed::OPERATION);
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

impl ReportStatus {
    /// A single worker's report.
    pub fn one(update: StatusUpdate) -> Self {
        ReportStatus {
            updates: vec![update],
        }
    }
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
        let answer = self.reported.push(msg.updates, ReportStatus::OPERATION);
        self.flush_reported(ctx);
        answer
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
                    futures::stream::iter(&requests)
                        .map(|one| write_reports(store.as_ref(), &metrics, one))
                        .buffered(SEPARATE_WRITES_AT_ONCE)
                        .collect::<Vec<_>>()
                        .await
                }
                combined => vec![combined; requests.len()],
            }
        };
        ctx.spawn(write.into_actor(self).map(move |results, act, ctx| {
            for (reply, result) in replies.into_iter().zip(results) {
                let _ = reply.send(result);
            }
            act.reported.flushing = false;
            act.flush_reported(ctx);
        }));
    }

    fn flush_pushed(&mut self, ctx: &mut Context<Self>) {
        let Some(batch) = self.pushed.take_batch(|_| 1) else {
            return;
        };
        // Grace is a broker-wide setting; use the largest so no deadline is
        // shortened if callers ever differ.
        let grace = batch
            .iter()
            .map(|((_, grace), _)| *grace)
            .max()
            .unwrap_or_default();
        let claims: Vec<ClaimToken> = batch.iter().map(|((claim, _), _)| claim.clone()).collect();
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
        ctx.spawn(write.into_actor(self).map(move |result, act, ctx| {
            match result {
                Ok(moved) => {
                    let moved: HashSet<String> = moved.into_iter().collect();
                    for ((claim, _), reply) in batch {
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
    Ok(())
}
