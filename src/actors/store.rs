//! StoreActor: owns the store (the PostgreSQL pool or the SQLite connection)
//! and answers one typed message per store operation.
//!
//! - Receives: the messages below, one per `ActivationStore` operation.
//! - Sends: nothing; every message is answered with `StoreResult<T>`.
//! - Mailbox: `MAILBOX_CAPACITY`. The actor never waits on the database
//!   itself: each handler returns a future that actix spawns, so queries from
//!   many senders run concurrently over the pool instead of one at a time.
//!
//! Frequent small writes (mark processing after each push, workers' single
//! reports) are combined: see [`MarkPushed`] and [`ReportStatus`].
//!
//! Every operation's latency and errors are recorded in [`Metrics`], which is
//! also how tests count the statements an operation ran.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures::StreamExt;
use tokio::sync::oneshot;

use crate::metrics::Metrics;
use crate::model::{
    BucketRange, ClaimToken, ClaimedActivation, DeadlineOutcome, InflightActivation, PublishKind,
    PullFilter, StatusCounts, StatusUpdate, StatusUpdateOutcome,
};
use crate::store::{ActivationStore, StoreError, StoreResult};

/// Messages queue here only while actix hands them to their futures, so a
/// modest bound is enough; senders using `send` wait when it is full.
pub const MAILBOX_CAPACITY: usize = 1024;

/// Most claims one combined mark-processing statement carries.
const MAX_COMBINED: usize = 1024;

/// Reports written at once when a combined report write failed and each is
/// retried on its own: enough to finish quickly, few enough to leave pool
/// connections to everyone else.
const SEPARATE_WRITES_AT_ONCE: usize = 8;

pub struct StoreActor {
    store: Arc<dyn ActivationStore>,
    metrics: Arc<Metrics>,
    pushed: CombinedWrites<(ClaimToken, Duration), bool>,
    reported: CombinedWrites<StatusUpdate, ()>,
}

impl StoreActor {
    pub fn new(store: Arc<dyn ActivationStore>, metrics: Arc<Metrics>) -> Self {
        StoreActor {
            store,
            metrics,
            pushed: CombinedWrites::default(),
            reported: CombinedWrites::default(),
        }
    }
}

/// Small writes waiting to be combined into one statement. One combined
/// statement runs at a time; whatever arrives meanwhile forms the next one,
/// so the batch size follows the load with no timer and no added latency
/// when the system is quiet.
struct CombinedWrites<T, R> {
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

    /// The next batch to write, if none is being written.
    fn take_batch(&mut self) -> Option<Vec<(T, oneshot::Sender<StoreResult<R>>)>> {
        if self.flushing || self.waiting.is_empty() {
            return None;
        }
        self.flushing = true;
        let rest = self.waiting.split_off(self.waiting.len().min(MAX_COMBINED));
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

impl Handler<MarkPushed> for StoreActor {
    type Result = ResponseFuture<StoreResult<bool>>;

    fn handle(&mut self, msg: MarkPushed, ctx: &mut Self::Context) -> Self::Result {
        let answer = self
            .pushed
            .push((msg.claim, msg.deadline_grace), "mark_processing");
        self.flush_pushed(ctx);
        answer
    }
}

/// A worker reported one result (SetTaskStatus): written together with other
/// concurrent reports in one statement. Resolves once the write is durable.
/// If the combined statement fails for a reason other than the store being
/// unavailable, each report is written again on its own, so one report the
/// database refuses fails only its own request.
#[derive(Debug)]
pub struct ReportStatus {
    pub update: StatusUpdate,
}

impl Message for ReportStatus {
    type Result = StoreResult<()>;
}

impl Handler<ReportStatus> for StoreActor {
    type Result = ResponseFuture<StoreResult<()>>;

    fn handle(&mut self, msg: ReportStatus, ctx: &mut Self::Context) -> Self::Result {
        let answer = self.reported.push(msg.update, "set_status");
        self.flush_reported(ctx);
        answer
    }
}

impl StoreActor {
    fn flush_reported(&mut self, ctx: &mut Context<Self>) {
        let Some(batch) = self.reported.take_batch() else {
            return;
        };
        let updates: Vec<StatusUpdate> = batch.iter().map(|(update, _)| update.clone()).collect();
        let store = Arc::clone(&self.store);
        let metrics = Arc::clone(&self.metrics);
        let write = async move {
            let combined = write_reports(store.as_ref(), &metrics, &updates).await;
            match combined {
                // An outage fails every report alike: re-running them one by
                // one would only wait on the database again.
                Err(err) if updates.len() > 1 && !err.is_unavailable() => {
                    tracing::warn!(error = %err, reports = updates.len(),
                        "combined status write failed; writing each report on its own");
                    futures::stream::iter(updates.chunks(1))
                        .map(|one| write_reports(store.as_ref(), &metrics, one))
                        .buffered(SEPARATE_WRITES_AT_ONCE)
                        .collect::<Vec<_>>()
                        .await
                }
                combined => vec![combined; updates.len()],
            }
        };
        ctx.spawn(write.into_actor(self).map(move |results, act, ctx| {
            for ((_, reply), result) in batch.into_iter().zip(results) {
                let _ = reply.send(result);
            }
            act.reported.flushing = false;
            act.flush_reported(ctx);
        }));
    }

    fn flush_pushed(&mut self, ctx: &mut Context<Self>) {
        let Some(batch) = self.pushed.take_batch() else {
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
                "mark_processing",
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
        "set_status",
        started.elapsed(),
        result.as_ref().err().map(StoreError::kind),
    );
    let outcome = result?;
    metrics.record_status_outcome(outcome.counts());
    Ok(())
}

impl Actor for StoreActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(MAILBOX_CAPACITY);
    }
}

/// Declares one message per store operation: the struct, its result type and
/// a handler that runs the operation concurrently and records its metrics.
macro_rules! store_messages {
    ($(
        $(#[$doc:meta])*
        $name:ident { $($field:ident : $ty:ty),* $(,)? } -> $ret:ty,
        $op:literal, |$store:ident, $msg:ident| $call:expr;
    )*) => {$(
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name { $(pub $field: $ty),* }

        impl Message for $name {
            type Result = StoreResult<$ret>;
        }

        impl Handler<$name> for StoreActor {
            type Result = ResponseFuture<StoreResult<$ret>>;

            fn handle(&mut self, $msg: $name, _ctx: &mut Self::Context) -> Self::Result {
                let store = Arc::clone(&self.store);
                let metrics = Arc::clone(&self.metrics);
                Box::pin(async move {
                    let started = Instant::now();
                    let $store = store.as_ref();
                    let result = $call.await;
                    metrics.observe_store($op, started.elapsed(), result.as_ref().err().map(StoreError::kind));
                    result
                })
            }
        }
    )*};
}

store_messages! {
    /// Store newly consumed activations (idempotent); answers how many were new.
    /// Shared, so a sender retrying after an error keeps the rows without
    /// copying the activation bytes for each attempt.
    InsertBatch { rows: Arc<Vec<InflightActivation>> } -> u64,
        "insert_batch", |store, msg| store.insert_batch(&msg.rows);

    /// Claim Pending rows of a bucket range for push delivery.
    ClaimBatch { buckets: BucketRange, limit: usize, lease: Duration } -> Vec<ClaimedActivation>,
        "claim_for_push", |store, msg| store.claim_for_push(msg.buckets, msg.limit, msg.lease);

    /// Pull mode: hand the oldest matching Pending row to a worker.
    ClaimForPull { filter: PullFilter, deadline_grace: Duration } -> Option<InflightActivation>,
        "claim_for_pull", |store, msg| store.claim_for_pull(&msg.filter, msg.deadline_grace);

    /// Return claims to Pending in one fenced statement.
    ReleaseClaims { claims: Vec<ClaimToken> } -> u64,
        "release_claims", |store, msg| store.release_claims(&msg.claims);

    /// A push failed: fenced return of one claim to Pending.
    UndoClaim { claim: ClaimToken } -> bool,
        "undo_claim", |store, msg| store.undo_claim(&msg.claim);

    /// Pushes succeeded: fenced Claimed → Processing.
    MarkProcessing { claims: Vec<ClaimToken>, deadline_grace: Duration } -> Vec<String>,
        "mark_processing", |store, msg| store.mark_processing(&msg.claims, msg.deadline_grace);

    /// An undeliverable claim consumes an attempt (fenced).
    FailClaimAttempt { claims: Vec<ClaimToken>, max_attempts: u32 } -> u64,
        "fail_claim_attempt",
        |store, msg| store.fail_claim_attempt(&msg.claims, msg.max_attempts);

    /// Worker results (one or a batch).
    SetStatus { updates: Vec<StatusUpdate> } -> StatusUpdateOutcome,
        "set_status", |store, msg| store.set_status(&msg.updates);

    /// Delete rows by id.
    DeleteBatch { ids: Vec<String> } -> u64,
        "delete_batch", |store, msg| store.delete_batch(&msg.ids);

    /// Upkeep: expired claims back to Pending.
    ReleaseExpiredClaims { limit: usize } -> u64,
        "release_expired_claims", |store, msg| store.release_expired_claims(msg.limit);

    /// Upkeep: processing deadlines passed.
    HandleProcessingDeadlines { limit: usize } -> DeadlineOutcome,
        "handle_processing_deadlines", |store, msg| store.handle_processing_deadlines(msg.limit);

    /// Upkeep: Pending rows out of attempts → Failure.
    FailExhaustedAttempts { max_attempts: u32, limit: usize } -> u64,
        "fail_exhausted_attempts",
        |store, msg| store.fail_exhausted_attempts(msg.max_attempts, msg.limit);

    /// Upkeep: delete expired Pending rows.
    RemoveExpired { limit: usize } -> u64,
        "remove_expired", |store, msg| store.remove_expired(msg.limit);

    /// Upkeep: due Delay rows → Pending.
    ReleaseDelayed { limit: usize } -> u64,
        "release_delayed", |store, msg| store.release_delayed(msg.limit);

    /// Upkeep: take Retry or dead-letter rows to publish, leased.
    TakeForPublish { kind: PublishKind, limit: usize, lease: Duration } -> Vec<InflightActivation>,
        "take_for_publish", |store, msg| store.take_for_publish(msg.kind, msg.limit, msg.lease);

    /// Upkeep: discard Failure rows that are not dead-lettered.
    DiscardFailures { limit: usize } -> u64,
        "discard_failures", |store, msg| store.discard_failures(msg.limit);

    /// Upkeep: Kafka acknowledged these rows' records.
    MarkPublished { ids: Vec<String> } -> u64,
        "mark_published", |store, msg| store.mark_published(&msg.ids);

    /// Upkeep: delete Complete rows.
    RemoveCompleted { limit: usize } -> u64,
        "remove_completed", |store, msg| store.remove_completed(msg.limit);

    /// Row counts per status.
    CountByStatus {} -> StatusCounts,
        "count_by_status", |store, _msg| store.count_by_status();

    /// Age of the oldest first-attempt Pending or Claimed row.
    MaxPendingLag {} -> f64,
        "max_pending_lag", |store, _msg| store.max_pending_lag();

    /// One row by id.
    GetActivation { id: String } -> Option<InflightActivation>,
        "get", |store, msg| store.get(&msg.id);

    /// A push used up an at_most_once task's delivery, or was too large:
    /// fenced Claimed → Failure.
    FailClaims { claims: Vec<ClaimToken> } -> u64,
        "fail_claims", |store, msg| store.fail_claims(&msg.claims);

    /// No worker serves the application: fenced Claimed → Delay until `until`.
    DeferClaims { claims: Vec<ClaimToken>, until: chrono::DateTime<chrono::Utc> } -> u64,
        "defer_claims", |store, msg| store.defer_claims(&msg.claims, msg.until);
}
