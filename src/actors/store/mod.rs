//! StoreActor: owns the store (the PostgreSQL pool or the SQLite connection)
//! and answers one typed message per intent.
//!
//! - Receives: the messages below (one per store operation the broker
//!   uses), and the combined writes [`MarkPushed`] and [`ReportStatus`].
//! - Sends: nothing; every message is answered with `StoreResult<T>`.
//! - Mailbox: `MAILBOX_CAPACITY`. The actor never waits on the database
//!   and never runs a query itself: each handler hands its call to the
//!   store's own multi-threaded runtime (`io.rs`) and answers when it
//!   completes, so queries from many senders run concurrently over the pool
//!   and on every core, and the actor's thread keeps only what must be
//!   ordered: the write combiner's queues.
//!
//! Callers hold a [`StoreHandle`] (`handle.rs`), never the actor's address:
//! one method per intent (`claim`, `release`, `mark_pushed`, `report`, …),
//! each answered with `StoreResult<T>`. Frequent small writes (mark
//! processing after each push, workers' reports) are combined into few
//! statements (`combined.rs`); that is why the StoreActor exists rather
//! than callers using the store directly.
//!
//! Every operation's latency and errors are recorded in [`Metrics`], which is
//! also how tests count the statements an operation ran.

mod combined;
mod handle;
mod io;

pub use combined::{MarkPushed, ReportStatus};
pub use handle::StoreHandle;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;

use crate::metrics::Metrics;
use crate::model::{
    BeatAnswer, BrokerRow, BucketRange, ClaimToken, ClaimedActivation, DeadlineOutcome, Dispatch,
    InflightActivation, Killswitch, NamespaceCount, PublishKind, PullFilter, Registration,
    StatusCounts, StatusUpdate, Takeover, TaskRules,
};
use crate::runtime::RuntimeRules;
use crate::store::{ActivationStore, SpaceReclaim, StoreError, StoreResult};

/// A push claim under the operators' rules: each namespace under a
/// concurrency limit first, up to the room its limit leaves (counted
/// claims, every bucket), then the ordinary claim of the bucket range for
/// the rest of the batch, leaving out paused, demoted and limited
/// namespaces, fairly across namespaces unless the fetcher asks for oldest
/// first. Rows already claimed are answered even when a later step fails,
/// so no claim is stranded.
async fn claim_batch(
    store: &dyn ActivationStore,
    msg: ClaimBatch,
    rules: TaskRules,
) -> StoreResult<Vec<ClaimedActivation>> {
    let dispatch = if msg.fair {
        Dispatch::Fair(&rules.weights)
    } else {
        Dispatch::OldestFirst
    };
    if rules.concurrency_limits.is_empty() {
        // The common case: one statement.
        return store
            .claim_for_push_except(
                msg.buckets,
                msg.limit,
                msg.lease,
                &rules.unclaimable,
                dispatch,
            )
            .await;
    }
    let mut claimed = Vec::new();
    // `Some`: a limited namespace's counted claim; `None`: the ordinary one.
    let steps: Vec<Option<(&str, u32)>> = rules
        .limited_claims()
        .map(Some)
        .chain(std::iter::once(None))
        .collect();
    for limited in steps {
        let room = msg.limit.saturating_sub(claimed.len());
        if room == 0 {
            break;
        }
        let step = match limited {
            Some((namespace, max)) => store.claim_limited(namespace, max, room, msg.lease).await,
            None => {
                store
                    .claim_for_push_except(
                        msg.buckets,
                        room,
                        msg.lease,
                        &rules.unclaimable,
                        dispatch,
                    )
                    .await
            }
        };
        match step {
            Ok(rows) => claimed.extend(rows),
            Err(err) if claimed.is_empty() => return Err(err),
            Err(err) => {
                tracing::warn!(error = %err, claimed = claimed.len(),
                    "claim step failed; handing out what was claimed");
                break;
            }
        }
    }
    Ok(claimed)
}

/// Messages queue here only while actix hands them to their futures, so a
/// modest bound is enough; senders using `send` wait when it is full.
pub const MAILBOX_CAPACITY: usize = 1024;

pub struct StoreActor {
    store: Arc<dyn ActivationStore>,
    metrics: Arc<Metrics>,
    /// The operators' rules every claim obeys (paused applications and
    /// namespaces), whoever asks for it.
    rules: RuntimeRules,
    pushed: combined::CombinedWrites<(ClaimToken, Duration, Instant), bool>,
    reported: combined::CombinedWrites<Vec<StatusUpdate>, ()>,
    recent: combined::Recent,
    /// Where every database call runs (`io.rs`).
    io: io::StoreIo,
}

impl StoreActor {
    /// Started only through [`StoreHandle`], so no caller holds its address.
    fn new(
        store: Arc<dyn ActivationStore>,
        metrics: Arc<Metrics>,
        rules: RuntimeRules,
        io: io::StoreIo,
    ) -> Self {
        StoreActor {
            store,
            metrics,
            rules,
            pushed: Default::default(),
            reported: Default::default(),
            recent: Default::default(),
            io,
        }
    }
}

impl Actor for StoreActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(MAILBOX_CAPACITY);
    }
}

/// A message the StoreActor answers with `StoreResult<Self::Output>`, named
/// by its operation: the label of its metrics and of the `Unavailable`
/// error a [`StoreHandle`] answers when the actor cannot be reached.
pub trait StoreMessage: Message<Result = StoreResult<Self::Output>> + Send + 'static {
    type Output: Send + 'static;
    const OPERATION: &'static str;
}

/// Declares one message per store operation: the struct, its result type,
/// its operation name and a handler that runs the operation concurrently and
/// records its metrics.
macro_rules! store_messages {
    ($(
        $(#[$doc:meta])*
        $name:ident { $($field:ident : $ty:ty),* $(,)? } -> $ret:ty as $method:ident,
        $op:literal, |$store:ident, $msg:ident $(, $rules:ident)?| $call:expr;
    )*) => {$(
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name { $(pub $field: $ty),* }

        impl Message for $name {
            type Result = StoreResult<$ret>;
        }

        impl StoreMessage for $name {
            type Output = $ret;
            const OPERATION: &'static str = $op;
        }

        impl Handler<$name> for StoreActor {
            type Result = ResponseFuture<StoreResult<$ret>>;

            fn handle(&mut self, $msg: $name, _ctx: &mut Self::Context) -> Self::Result {
                let store = Arc::clone(&self.store);
                let metrics = Arc::clone(&self.metrics);
                $(let $rules = self.rules.current();)?
                self.io.run(<$name as StoreMessage>::OPERATION, async move {
                    let started = Instant::now();
                    let $store = store.as_ref();
                    let result = $call.await;
                    metrics.observe_store(<$name as StoreMessage>::OPERATION, started.elapsed(), result.as_ref().err().map(StoreError::kind));
                    result
                })
            }
        }

        impl StoreHandle {
            $(#[$doc])*
            ///
            #[doc = concat!("Sends [`", stringify!($name), "`] now; see [`StoreHandle::call`] for when it queues.")]
            pub fn $method(&self, $($field: $ty),*) -> impl Future<Output = StoreResult<$ret>> + Send + use<> {
                self.call($name { $($field),* })
            }
        }
    )*

        /// Every operation the StoreActor runs and records in the store
        /// metrics: one per message, and the two combined writes.
        pub const OPERATIONS: &[&str] = &[
            $($op,)*
            <MarkPushed as StoreMessage>::OPERATION,
            <ReportStatus as StoreMessage>::OPERATION,
        ];
    };
}

store_messages! {
    /// Store newly consumed activations (idempotent); answers how many were new.
    /// Shared, so a sender retrying after an error keeps the rows without
    /// copying the activation bytes for each attempt.
    InsertBatch { rows: Arc<Vec<InflightActivation>> } -> u64 as insert,
        "insert_batch", |store, msg| store.insert_batch(&msg.rows);

    /// Claim Pending rows for push delivery under the operators' rules (see
    /// [`claim_batch`]); `fair`: interleave namespaces by weight, else
    /// oldest first.
    ClaimBatch { buckets: BucketRange, limit: usize, lease: Duration, fair: bool } -> Vec<ClaimedActivation> as claim,
        "claim_for_push", |store, msg, rules| claim_batch(store, msg, rules);

    /// Pull mode: hand the oldest matching Pending row to a worker, leaving
    /// out paused applications and namespaces and demoted namespaces.
    ClaimForPull { filter: PullFilter, deadline_grace: Duration } -> Option<InflightActivation> as claim_for_pull,
        "claim_for_pull", |store, msg, rules| store.claim_for_pull_except(&msg.filter, msg.deadline_grace, &rules.unclaimable);

    /// Return claims to Pending in one fenced statement.
    ReleaseClaims { claims: Vec<ClaimToken> } -> u64 as release,
        "release_claims", |store, msg| store.release_claims(&msg.claims);

    /// A push failed: fenced return of one claim to Pending.
    UndoClaim { claim: ClaimToken } -> bool as undo_claim,
        "undo_claim", |store, msg| store.undo_claim(&msg.claim);

    /// An undeliverable claim consumes an attempt (fenced).
    FailClaimAttempt { claims: Vec<ClaimToken>, max_attempts: u32 } -> u64 as fail_claim_attempt,
        "fail_claim_attempt",
        |store, msg| store.fail_claim_attempt(&msg.claims, msg.max_attempts);

    /// Upkeep: expired claims back to Pending.
    ReleaseExpiredClaims { limit: usize } -> u64 as release_expired_claims,
        "release_expired_claims", |store, msg| store.release_expired_claims(msg.limit);

    /// Upkeep: processing deadlines passed.
    HandleProcessingDeadlines { limit: usize } -> DeadlineOutcome as handle_processing_deadlines,
        "handle_processing_deadlines", |store, msg| store.handle_processing_deadlines(msg.limit);

    /// Upkeep: Pending rows out of attempts → Failure.
    FailExhaustedAttempts { max_attempts: u32, limit: usize } -> u64 as fail_exhausted_attempts,
        "fail_exhausted_attempts",
        |store, msg| store.fail_exhausted_attempts(msg.max_attempts, msg.limit);

    /// Upkeep: delete rows a killswitch matches (Processing ones excepted).
    RemoveKillswitched { killswitches: Arc<[Killswitch]>, limit: usize } -> u64 as remove_killswitched,
        "remove_killswitched", |store, msg| store.remove_killswitched(&msg.killswitches, msg.limit);

    /// Upkeep: delete expired Pending rows.
    RemoveExpired { limit: usize } -> u64 as remove_expired,
        "remove_expired", |store, msg| store.remove_expired(msg.limit);

    /// Upkeep: due Delay rows → Pending.
    ReleaseDelayed { limit: usize } -> u64 as release_delayed,
        "release_delayed", |store, msg| store.release_delayed(msg.limit);

    /// Upkeep: take Retry or dead-letter rows to publish, leased.
    TakeForPublish { kind: PublishKind, limit: usize, lease: Duration } -> Vec<InflightActivation> as take_for_publish,
        "take_for_publish", |store, msg| store.take_for_publish(msg.kind, msg.limit, msg.lease);

    /// Upkeep: take demoted namespaces' stored rows to forward, leased.
    TakeDemoted { namespaces: Arc<[String]>, demoted_topic: Arc<str>, limit: usize, lease: Duration } -> Vec<InflightActivation> as take_demoted,
        "take_demoted",
        |store, msg| store.take_demoted(&msg.namespaces, &msg.demoted_topic, msg.limit, msg.lease);

    /// Upkeep: Kafka acknowledged forwarded rows; delete them.
    RemoveForwarded { ids: Vec<String> } -> u64 as remove_forwarded,
        "remove_forwarded", |store, msg| store.remove_forwarded(&msg.ids);

    /// Upkeep: discard Failure rows that are not dead-lettered.
    DiscardFailures { limit: usize } -> u64 as discard_failures,
        "discard_failures", |store, msg| store.discard_failures(msg.limit);

    /// Upkeep: Kafka acknowledged these rows' records.
    MarkPublished { ids: Vec<String> } -> u64 as mark_published,
        "mark_published", |store, msg| store.mark_published(&msg.ids);

    /// Upkeep: delete Complete rows.
    RemoveCompleted { limit: usize } -> u64 as remove_completed,
        "remove_completed", |store, msg| store.remove_completed(msg.limit);

    /// Upkeep: give free space in the store's file back, one bounded run
    /// (SQLite; `None` from PostgreSQL, which has no file of its own).
    ReclaimSpace {} -> Option<SpaceReclaim> as reclaim_space,
        "reclaim_space", |store, _msg| store.reclaim_space();

    /// Row counts per status.
    CountByStatus {} -> StatusCounts as count_by_status,
        "count_by_status", |store, _msg| store.count_by_status();

    /// Rows per namespace and status (upkeep's gauges).
    CountByNamespace {} -> Vec<NamespaceCount> as count_by_namespace,
        "count_by_namespace", |store, _msg| store.count_by_namespace();

    /// In-flight rows per consumed topic (each consumer's backpressure).
    CountInflightByTopic {} -> Vec<(String, u64)> as count_inflight_by_topic,
        "count_inflight_by_topic", |store, _msg| store.count_inflight_by_topic();

    /// Bytes of stored activations per consumed topic (byte backpressure,
    /// the `taskbroker_inflight_bytes` gauge).
    InflightBytesByTopic {} -> Vec<(String, u64)> as inflight_bytes_by_topic,
        "inflight_bytes_by_topic", |store, _msg| store.inflight_bytes_by_topic();

    /// A cheap check that the store answers (health, readiness).
    Ping {} -> () as ping,
        "ping", |store, _msg| store.ping();

    /// Whether the table holds any row (upkeep skips an empty store).
    HasRows {} -> bool as has_rows,
        "has_rows", |store, _msg| store.has_rows();

    /// Age of the oldest first-attempt Pending or Claimed row.
    MaxPendingLag {} -> f64 as max_pending_lag,
        "max_pending_lag", |store, _msg| store.max_pending_lag();

    /// A push used up an at_most_once task's delivery, or was too large:
    /// fenced Claimed → Failure.
    FailClaims { claims: Vec<ClaimToken> } -> u64 as fail_claims,
        "fail_claims", |store, msg| store.fail_claims(&msg.claims);

    /// No worker serves the application: fenced Claimed → Delay until `until`.
    DeferClaims { claims: Vec<ClaimToken>, until: chrono::DateTime<chrono::Utc> } -> u64 as defer_claims,
        "defer_claims", |store, msg| store.defer_claims(&msg.claims, msg.until);
    /// Startup: this broker's row, replacing its previous incarnation's.
    RegisterBroker { host: String, incarnation: String, live_within: Duration } -> Registration as register_broker,
        "register_broker", |store, msg| store.register_broker(&msg.host, &msg.incarnation, msg.live_within);

    /// Startup: the claims earlier incarnations of this broker left.
    ReleasePreviousClaims {} -> u64 as release_previous_claims,
        "release_previous_claims", |store, _msg| store.release_previous_claims();

    /// This broker id's row, if any (a live process with the same id?).
    ReadBroker {} -> Option<BrokerRow> as read_broker,
        "read_broker", |store, _msg| store.read_broker();

    /// Refresh this broker's heartbeat, or learn it was taken over or
    /// replaced.
    Heartbeat { incarnation: String, silent_after: Duration } -> BeatAnswer as heartbeat,
        "heartbeat", |store, msg| store.heartbeat(&msg.incarnation, msg.silent_after);

    /// Take over brokers silent for longer than `timeout`.
    TakeOverSilent { timeout: Duration } -> Vec<Takeover> as take_over_silent,
        "take_over_silent", |store, msg| store.take_over_silent(msg.timeout);

    /// Clean shutdown: remove this broker's row.
    UnregisterBroker { incarnation: String } -> bool as unregister_broker,
        "unregister_broker", |store, msg| store.unregister_broker(&msg.incarnation);
}
