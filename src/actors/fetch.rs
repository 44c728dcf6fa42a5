//! FetchActor: claims Pending activations in its bucket range and hands
//! them to the push pool.
//!
//! - Owns: its claim loop, its backoff timer, the batch it is submitting.
//! - Receives: [`WakeFetch`] (new rows stored), [`StopFetching`]; it drives
//!   itself with [`FetchNow`].
//! - Sends: [`ClaimBatch`] and [`ReleaseClaims`] to the StoreActor;
//!   [`PushActivation`] to the push pool with `try_send`. The push pool is
//!   a `Recipient<PushActivation>`: the PushPoolActor in the broker, any
//!   actor taking that message in tests.
//! - Mailbox: actix's default; only control messages arrive here.
//!
//! The handoff (DESIGN.md): each activation of a claimed batch goes to the
//! push pool with `try_send`. `Full` hands the activation back and it
//! is retried after a short pause until `PUSH_QUEUE_TIMEOUT_MS` has passed
//! for it; then, or at once on `Closed`, this activation and every one of the
//! batch not yet submitted return to Pending in **one** `ReleaseClaims`
//! message, one SQL statement, fenced by each row's `claim_expires_at`.
//! Because a failed `try_send` returns the message, the pool provably never
//! saw these activations, so releasing them is safe. A batch is submitted or
//! released entirely before the actor handles its next message (the
//! iteration runs under `ctx.wait`), so stopping never strands a claim.
//!
//! One sender handle for the actor's lifetime: actix lets every `Addr` or
//! `Recipient` (each clone is a sender of its own) put one message into a
//! full mailbox, so cloning the pool's recipient per iteration would let the
//! mailbox grow
//! without bound. With one handle each, the pool's mailbox holds at most
//! `PUSH_QUEUE_SIZE + FETCH_ACTORS` messages, plus the one the pool holds
//! while it waits for a slot: the claim lease is derived from that bound.
//!
//! Shutdown ([`ClaimRegistry::begin_shutdown`]) takes effect at once, even
//! in the middle of a submit loop: no further claim, no further submit; the
//! rest of the batch is dropped into the registry, which shutdown releases
//! in one statement.

use std::sync::Arc;
use std::time::Duration;

use actix::dev::SendError;
use actix::prelude::*;
use tokio::time::Instant;

use super::claims::{ClaimGuard, ClaimRegistry};
use super::push_pool::PushActivation;
use super::store::StoreHandle;
use crate::metrics::{Metrics, Stage};
use crate::model::{BucketRange, ClaimedActivation};

/// The longest pause of an idle fetcher (unless `FETCH_BACKOFF_MS` is
/// longer): after each claim that found nothing the pause doubles, from
/// `FETCH_BACKOFF_MS` up to this. New rows wake fetchers at once (this
/// replica's inserts and upkeep, and on PostgreSQL every replica's inserts
/// through LISTEN/NOTIFY), so the poll only catches what no wake-up
/// announces: rows a failed push returned, or a peer's rows while the
/// listening connection is down.
pub const IDLE_BACKOFF_LIMIT: Duration = Duration::from_secs(1);

/// The pause after `empty` claims in a row found nothing (0: the first).
pub fn idle_backoff(base: Duration, empty: u32) -> Duration {
    let limit = base.max(IDLE_BACKOFF_LIMIT);
    base.saturating_mul(1u32 << empty.min(16)).min(limit)
}

/// Pause before retrying a submit that found the push pool's mailbox full.
const SUBMIT_RETRY_PAUSE: Duration = Duration::from_millis(5);

/// Settings of one FetchActor.
#[derive(Debug, Clone)]
pub struct FetchConfig {
    pub batch_size: usize,
    /// `FETCH_BATCH_BYTES`: the store cuts a claim there; a claim holding
    /// that many bytes counts as a full batch (claim again at once).
    pub batch_bytes: usize,
    pub backoff: Duration,
    pub queue_timeout: Duration,
    pub lease: Duration,
    /// Interleave namespaces by weight (FAIR_DISPATCH), else oldest first.
    pub fair_dispatch: bool,
    /// Exists only in a `test-hooks` build, for the stranded-claim benchmark
    /// and its test (`TASKBROKER_TEST_DISABLE_RELEASE_ON_FULL`): `false`
    /// keeps the claims of a batch that cannot be submitted until their
    /// lease runs out, as in the older design. Production always releases.
    #[cfg(feature = "test-hooks")]
    pub release_on_full: bool,
}

/// New rows were stored: fetch now instead of waiting out the backoff.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct WakeFetch;

/// Stop after the current iteration; at shutdown, raise
/// [`ClaimRegistry::begin_shutdown`] first so that iteration ends at once.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct StopFetching;

/// Run one claim-and-submit iteration.
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct FetchNow;

pub struct FetchActor {
    buckets: BucketRange,
    /// Away (inside the running iteration) while an iteration runs.
    submitter: Option<Submitter>,
    registry: ClaimRegistry,
    backoff: Duration,
    /// Claims in a row that found nothing: the idle pause grows with them.
    empty_claims: u32,
    scheduled: Option<SpawnHandle>,
}

impl FetchActor {
    pub fn new(
        buckets: BucketRange,
        config: FetchConfig,
        store: StoreHandle,
        push: Recipient<PushActivation>,
        registry: ClaimRegistry,
        metrics: Arc<Metrics>,
    ) -> Self {
        let backoff = config.backoff;
        FetchActor {
            buckets,
            submitter: Some(Submitter {
                buckets,
                config,
                store,
                push,
                registry: registry.clone(),
                metrics,
            }),
            registry,
            backoff,
            empty_claims: 0,
            scheduled: None,
        }
    }

    fn fetch_now(&mut self, ctx: &mut Context<Self>) {
        if let Some(handle) = self.scheduled.take() {
            ctx.cancel_future(handle);
        }
        ctx.notify(FetchNow);
    }

    fn after(&mut self, outcome: Iteration, ctx: &mut Context<Self>) {
        let pause = match outcome {
            Iteration::Empty => {
                let pause = idle_backoff(self.backoff, self.empty_claims);
                self.empty_claims = self.empty_claims.saturating_add(1);
                pause
            }
            _ => {
                self.empty_claims = 0;
                self.backoff
            }
        };
        match outcome {
            Iteration::FullBatch => ctx.notify(FetchNow),
            Iteration::Closed => {
                tracing::info!(buckets = ?self.buckets, "push pool closed; fetch actor stopping");
                ctx.stop();
            }
            Iteration::Stopped => ctx.stop(),
            Iteration::Empty | Iteration::Idle | Iteration::Backoff => {
                self.scheduled = Some(ctx.run_later(pause, |act, ctx| {
                    act.scheduled = None;
                    ctx.notify(FetchNow);
                }));
            }
        }
    }
}

impl Actor for FetchActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.notify(FetchNow);
    }
}

impl Handler<FetchNow> for FetchActor {
    type Result = ();

    fn handle(&mut self, _: FetchNow, ctx: &mut Self::Context) {
        if self.registry.is_shutting_down() {
            return ctx.stop();
        }
        // Taken: an iteration is already running.
        let Some(submitter) = self.submitter.take() else {
            return;
        };
        ctx.wait(
            submitter
                .run()
                .into_actor(self)
                .map(|(submitter, outcome), act, ctx| {
                    act.submitter = Some(submitter);
                    act.after(outcome, ctx);
                }),
        );
    }
}

impl Handler<WakeFetch> for FetchActor {
    type Result = ();

    fn handle(&mut self, _: WakeFetch, ctx: &mut Self::Context) {
        if self.scheduled.is_some() {
            self.fetch_now(ctx);
        }
    }
}

impl Handler<StopFetching> for FetchActor {
    type Result = ();

    fn handle(&mut self, _: StopFetching, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

/// How an iteration ended, i.e. when to run the next one.
#[derive(Debug, PartialEq, Eq)]
enum Iteration {
    /// A full batch was submitted: there may be more, fetch again at once.
    FullBatch,
    /// No row was claimable: wait for a wake-up or the idle pause, which
    /// grows while claims keep finding nothing.
    Empty,
    /// Fewer rows than asked for: wait for a wake-up or the backoff.
    Idle,
    /// Store error or submit timeout: back off.
    Backoff,
    /// The push pool is gone: stop.
    Closed,
    /// Shutdown began: stop.
    Stopped,
}

/// One iteration's work, detached from the actor so it can run as a future.
struct Submitter {
    buckets: BucketRange,
    config: FetchConfig,
    store: StoreHandle,
    /// The one sender handle to the push pool, kept for the actor's life.
    push: Recipient<PushActivation>,
    registry: ClaimRegistry,
    metrics: Arc<Metrics>,
}

impl Submitter {
    /// One iteration; hands the submitter (and with it the actor's one
    /// sender handle to the push pool) back with the outcome.
    async fn run(self) -> (Self, Iteration) {
        let outcome = self.iterate().await;
        (self, outcome)
    }

    async fn iterate(&self) -> Iteration {
        if self.registry.is_shutting_down() {
            return Iteration::Stopped;
        }
        // Read before the claim: a takeover while the statement runs
        // makes these claims stale, never pushable.
        let Some(generation) = self.registry.liveness().current() else {
            // No heartbeat confirmed lately: a peer may be taking this
            // broker over, so it claims nothing until one is.
            return Iteration::Backoff;
        };
        let claimed = self
            .store
            .claim(
                self.buckets,
                self.config.batch_size,
                self.config.lease,
                self.config.fair_dispatch,
            )
            .await;
        let claimed = match claimed {
            Ok(rows) => rows,
            Err(err) => {
                // Every FetchActor retries every backoff while the store is
                // away: one line per interval for all of them, with the
                // count of those left out (`taskbroker_store_operation_errors_total`
                // counts each).
                crate::warn_throttled!(error = %err, "claim failed; backing off");
                return Iteration::Backoff;
            }
        };
        if claimed.is_empty() {
            return Iteration::Empty;
        }
        let bytes: usize = claimed
            .iter()
            .map(|claimed| claimed.activation.activation.len())
            .sum();
        let full = claimed.len() >= self.config.batch_size || bytes >= self.config.batch_bytes;
        let now = chrono::Utc::now();
        self.metrics.claims.inc_by(claimed.len() as u64);

        let mut batch = claimed.into_iter().map(|claimed| {
            let ClaimedActivation { activation, token } = claimed;
            let age = now - activation.received_at;
            self.metrics
                .received_to_claimed
                .observe(age.as_seconds_f64().max(0.0));
            let stored_for = now - activation.added_at;
            self.metrics
                .observe_stage(Stage::StoredToClaimed, stored_for.as_seconds_f64());
            let claim = ClaimGuard::new(
                token,
                self.registry.clone(),
                self.store.clone(),
                Arc::clone(&self.metrics),
            )
            .in_generation(generation);
            PushActivation { activation, claim }
        });
        // Guards are created lazily by the iterator; collect them now so
        // every claim is registered as held before the first submit.
        let batch: Vec<PushActivation> = batch.by_ref().collect();
        let mut batch = batch.into_iter();

        // The whole batch must be handed over within the queue timeout,
        // counted from the claim: a row later in the batch must not wait
        // for all the rows before it, or its claim could outlive the lease
        // (which allows one queue timeout for submitting) while it is still
        // held here, and be claimed and pushed by someone else too.
        let submit_by = Instant::now() + self.config.queue_timeout;
        while let Some(mut message) = batch.next() {
            loop {
                if self.registry.is_shutting_down() {
                    // The guards stay registered: shutdown's final release
                    // returns them, in one statement with every other claim
                    // not pushed.
                    drop((message, batch));
                    return Iteration::Stopped;
                }
                match self.hand_over(message) {
                    Ok(()) => {
                        self.metrics.submits.with_label_values(&["ok"]).inc();
                        break;
                    }
                    Err(SendError::Full(back)) => {
                        self.metrics.submits.with_label_values(&["full"]).inc();
                        if Instant::now() >= submit_by {
                            self.metrics.submits.with_label_values(&["timeout"]).inc();
                            self.release(back, batch, "queue_timeout").await;
                            return Iteration::Backoff;
                        }
                        message = back;
                        tokio::time::sleep(SUBMIT_RETRY_PAUSE).await;
                    }
                    Err(SendError::Closed(back)) => {
                        self.metrics.submits.with_label_values(&["closed"]).inc();
                        self.release(back, batch, "queue_closed").await;
                        return Iteration::Closed;
                    }
                }
            }
        }
        if full {
            Iteration::FullBatch
        } else {
            Iteration::Idle
        }
    }

    /// `try_send` to the push pool, once the activation's bytes fit the
    /// pool's byte budget (`PUSH_QUEUE_BYTES`): a pool holding too many bytes
    /// answers `Full` as a full mailbox does, and a refused activation gives
    /// its bytes back at once.
    #[expect(
        clippy::result_large_err,
        reason = "the same type as `try_send`'s own result: the message comes back by value"
    )]
    fn hand_over(&self, mut message: PushActivation) -> Result<(), SendError<PushActivation>> {
        let size = message.activation.activation.len();
        let Some(bytes) = self.registry.push_bytes().try_take(size) else {
            return Err(SendError::Full(message));
        };
        message.claim.hold_bytes(bytes);
        self.push.try_send(message).map_err(|err| match err {
            SendError::Full(mut back) => {
                back.claim.give_back_bytes();
                SendError::Full(back)
            }
            SendError::Closed(mut back) => {
                back.claim.give_back_bytes();
                SendError::Closed(back)
            }
        })
    }

    /// Returns `first` and the rest of the batch to Pending: one message, one
    /// fenced statement.
    async fn release(
        &self,
        first: PushActivation,
        rest: impl Iterator<Item = PushActivation>,
        reason: &'static str,
    ) {
        let guards: Vec<ClaimGuard> = std::iter::once(first)
            .chain(rest)
            .map(|message| message.claim)
            .collect();
        #[cfg(feature = "test-hooks")]
        if !self.config.release_on_full {
            // The benchmark's "before" picture: the claims stay until upkeep
            // finds their lease expired (counted then as `lease_expired`).
            guards.into_iter().for_each(ClaimGuard::settle);
            return;
        }
        let claims = guards.iter().map(|guard| guard.token().clone()).collect();
        match self.store.release(claims).await {
            Ok(released) => {
                self.metrics
                    .claims_released
                    .with_label_values(&[reason])
                    .inc_by(released);
            }
            Err(err) => {
                crate::warn_throttled!(error = %err, reason, "cannot release claims; their lease will");
            }
        }
        guards.into_iter().for_each(ClaimGuard::settle);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idle_pause_doubles_up_to_a_second_or_the_configured_backoff() {
        let ms = Duration::from_millis;
        let pauses: Vec<Duration> = (0..7).map(|n| idle_backoff(ms(100), n)).collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1000, 1000, 1000].map(ms));
        assert_eq!(idle_backoff(ms(20), 1_000), ms(1000));
        // A configured pause above the limit is kept, never grown.
        assert_eq!(idle_backoff(ms(5000), 0), ms(5000));
        assert_eq!(idle_backoff(ms(5000), 3), ms(5000));
    }
}
