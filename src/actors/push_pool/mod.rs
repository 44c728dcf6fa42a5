//! PushPoolActor: delivers claimed activations to workers with PushTask.
//!
//! - Owns: lazily connected channels to every worker URL (several per URL,
//!   spread over the addresses its host name resolves to), each channel's
//!   health (backoff after failures), and `PUSH_CONCURRENCY` push slots.
//! - Receives: [`PushActivation`] (bounded mailbox of `PUSH_QUEUE_SIZE`,
//!   plus one per sender handle: actix's rule), [`StopPushPool`],
//!   [`DrainPushPool`].
//! - Sends: PushTask RPCs to workers; [`MarkPushed`], [`UndoClaim`],
//!   [`FailClaims`], [`DeferClaims`] and [`FailClaimAttempt`] to the
//!   StoreActor.
//!
//! Backpressure: each push runs as its own task holding one slot. When every
//! slot is taken the handler waits (`ctx.wait`) for one to free up, holding
//! that one message, and while it waits the actor takes no messages, so its
//! mailbox fills and FetchActors get `SendError::Full` back from
//! `try_send`: that is how "the push pool is saturated" becomes visible to
//! them. An activation accepted last waits behind at most `PUSH_QUEUE_SIZE +
//! FETCH_ACTORS` messages in the mailbox, the held one and the pushes in
//! flight; the derived claim lease (`Config::claim_lease`) covers that, and
//! a push whose claim has less than one push timeout (plus
//! [`MARK_PROCESSING_MARGIN`]) left is not started but undone to Pending.
//! So is a push whose claim the broker's liveness no longer allows
//! (`actors/liveness.rs`), checked last before the request is sent: a
//! broker frozen past the takeover timeout never pushes what a peer has
//! taken over.
//!
//! Outcomes:
//! - OK → fenced Claimed → Processing (combined into batched statements).
//! - Not sent (the endpoint's backoff outlasted the admission wait, the
//!   connection could not be made, or the worker answered
//!   RESOURCE_EXHAUSTED "busy"): the worker never got the task, so a fenced
//!   undo to Pending without consuming an attempt; the endpoint backs off.
//! - Outcome unknown (timeout after the request was sent, any other error):
//!   the worker may be running it. Undone like the above, except for
//!   at_most_once tasks: for them this push was the one attempt, so fenced
//!   Claimed → Failure, and upkeep dead-letters or discards them.
//! - Too large for the worker (or for the client's own limit): no retry can
//!   succeed, so fenced Claimed → Failure, logged and counted.
//! - No endpoint for the application (a `WORKER_ENDPOINTS` typo, a worker
//!   pool not deployed yet): fenced Claimed → Delay for
//!   [`NO_ROUTE_BACKOFF`], no attempt consumed, counted in
//!   `taskbroker_push_no_route_total`; bytes that do not decode consume an
//!   attempt so the task ends in Failure instead of cycling forever.
//!
//! Shutdown ([`ClaimRegistry::begin_shutdown`]): nothing more is pushed.
//! Messages still in the mailbox, and the one held waiting for a slot, are
//! dropped with their claims left in the registry for the final release;
//! pushes in flight end within their push timeout.
//!
//! Beside this file: `outcome.rs` classifies a push's result, `endpoints.rs`
//! routes applications to worker connections (balanced by load, following
//! DNS) and keeps each one's backoff, `resolve.rs` looks host names up.

mod endpoints;
mod outcome;
mod resolve;

pub use self::resolve::{Resolver, StaticHosts};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use actix::prelude::*;
use prost::Message as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use self::endpoints::Router;
use self::outcome::{NotSent, PushOutcome, Unknown};

use super::claims::{ClaimGuard, ClaimRegistry};
use super::store::StoreHandle;
use crate::config::WorkerEndpoints;
use crate::metrics::{Metrics, Stage};
use crate::model::InflightActivation;
use crate::proto::TaskActivation;
use crate::wire::worker_client::{PushTaskBytes, WorkerClient};
use crate::wire::worker_tls::WorkerTlsFiles;

/// How long an activation whose application has no worker endpoint waits in
/// Delay before it is offered again: long enough not to spin on a
/// misconfiguration, short enough that fixing `WORKER_ENDPOINTS` (and
/// restarting) gets the tasks going within half a minute.
pub const NO_ROUTE_BACKOFF: Duration = Duration::from_secs(30);
/// Lease a claim must have left beyond one push timeout for its push to
/// start: room for the mark-processing write. Smaller than the derived
/// lease's 5 s margin, so a `CLAIM_LEASE_MS` at the validated minimum still
/// pushes everything but the very tail of a saturated queue.
const MARK_PROCESSING_MARGIN: Duration = Duration::from_secs(1);
/// At most one "no worker endpoint" log line per application in this
/// interval.
const NO_ROUTE_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Applications whose last "no worker endpoint" line is remembered; names
/// come from the tasks, so the memory of them is bounded.
const NO_ROUTE_LOG_APPLICATIONS: usize = 1024;

/// Settings of the push pool.
#[derive(Debug, Clone)]
pub struct PushPoolConfig {
    pub concurrency: usize,
    pub queue_size: usize,
    /// `PUSH_QUEUE_BYTES`: bytes of activations in the mailbox and in
    /// pushes together (the FetchActors take them from the claim
    /// registry's budget before handing an activation over).
    pub queue_bytes: usize,
    pub push_timeout: Duration,
    /// Added to `processing_deadline_duration` when a push succeeds.
    pub deadline_grace: Duration,
    /// Attempts after which an undeliverable claim becomes Failure.
    pub max_attempts: u32,
    /// Sent as `callback_url`: this broker's gRPC address, `host:port`.
    pub callback_url: String,
    /// Pushes are signed with the first secret, when there is one.
    pub signing_secret: Option<String>,
    pub endpoints: WorkerEndpoints,
    /// CA bundle and client certificate for `https://` worker URLs.
    pub tls: WorkerTlsFiles,
    /// How pushes are spread over the pods behind each worker URL.
    pub spread: SpreadConfig,
}

/// How many connections each worker URL gets and how its host name is
/// followed (see `endpoints.rs`).
#[derive(Debug, Clone)]
pub struct SpreadConfig {
    /// Connections kept to each worker URL (`WORKER_CONNECTIONS`), spread
    /// over the addresses its host name resolves to, at least one each.
    pub connections: usize,
    /// How often host names are resolved again (`WORKER_DNS_REFRESH_MS`).
    pub dns_refresh: Duration,
    pub resolver: Resolver,
}

impl Default for SpreadConfig {
    /// The settings' defaults, with the system resolver.
    fn default() -> Self {
        SpreadConfig {
            connections: 8,
            dns_refresh: Duration::from_secs(5),
            resolver: Resolver::System,
        }
    }
}

/// An activation to push, with the claim it holds.
#[derive(Debug)]
pub struct PushActivation {
    pub activation: InflightActivation,
    pub claim: ClaimGuard,
}

impl Message for PushActivation {
    type Result = ();
}

/// Stop at once: activations still in the mailbox are released by their
/// guards (or, during shutdown, left to the final release); pushes in
/// flight finish on their own.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct StopPushPool;

/// Resolves once every message sent before it has been taken and every push
/// in flight has finished (graceful shutdown).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct DrainPushPool;

pub struct PushPoolActor {
    shared: Arc<PushShared>,
    slots: Arc<Semaphore>,
    concurrency: u32,
    registry: ClaimRegistry,
}

/// What every push task needs.
struct PushShared {
    config: PushPoolConfig,
    router: Router,
    store: StoreHandle,
    metrics: Arc<Metrics>,
    /// Per application: when its last "no worker endpoint" line was
    /// logged, and how many of its activations were deferred since.
    no_route_log: Mutex<HashMap<String, (Instant, u64)>>,
}

impl PushPoolActor {
    /// Checks every worker URL; [`PushPoolActor::new`] cannot fail after it.
    pub fn validate(config: &PushPoolConfig) -> Result<(), String> {
        for url in config.endpoints.all_urls() {
            WorkerClient::check_url(url)?;
        }
        config.tls.load().map(drop)
    }

    /// Builds the worker channels; must run inside the actor's runtime
    /// (e.g. in the `start_in_arbiter` closure) after
    /// [`PushPoolActor::validate`] accepted `config`.
    /// `registry` carries the pipeline's shutdown signal.
    pub fn new(
        config: PushPoolConfig,
        store: StoreHandle,
        metrics: Arc<Metrics>,
        registry: ClaimRegistry,
    ) -> Self {
        let connect_timeout = config.push_timeout.min(Duration::from_secs(1));
        let tls = config
            .tls
            .load()
            .unwrap_or_else(|err| panic!("worker TLS files are validated before start: {err}"));
        let router = Router::new(
            &config.endpoints,
            &config.spread,
            connect_timeout,
            &tls,
            &metrics,
        )
        .unwrap_or_else(|err| panic!("worker URLs are validated before start: {err}"));
        let concurrency = config.concurrency.clamp(1, Semaphore::MAX_PERMITS);
        PushPoolActor {
            slots: Arc::new(Semaphore::new(concurrency)),
            concurrency: u32::try_from(concurrency).unwrap_or(u32::MAX),
            registry,
            shared: Arc::new(PushShared {
                config,
                router,
                store,
                metrics,
                no_route_log: Mutex::new(HashMap::new()),
            }),
        }
    }

    fn start_push(&self, msg: PushActivation, slot: OwnedSemaphorePermit) {
        if self.registry.is_shutting_down() {
            // Not pushed: the guard leaves the claim to the final release.
            return drop(msg);
        }
        let shared = Arc::clone(&self.shared);
        actix_rt::spawn(async move {
            shared.push(msg, slot).await;
        });
    }
}

impl Actor for PushPoolActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(self.shared.config.queue_size.max(1));
    }
}

impl Handler<PushActivation> for PushPoolActor {
    type Result = ();

    fn handle(&mut self, msg: PushActivation, ctx: &mut Self::Context) {
        if self.registry.is_shutting_down() {
            // Not pushed: the guard leaves the claim to the final release.
            return drop(msg);
        }
        match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(slot) => self.start_push(msg, slot),
            Err(_) => {
                // Saturated: hold this message and take no further one until
                // a slot frees up, or shutdown begins.
                let slots = Arc::clone(&self.slots);
                let registry = self.registry.clone();
                let slot = async move {
                    tokio::select! {
                        slot = slots.acquire_owned() => slot.ok(),
                        () = registry.shutting_down() => None,
                    }
                };
                ctx.wait(
                    slot.into_actor(self)
                        .map(move |slot, act, _ctx| match slot {
                            Some(slot) => act.start_push(msg, slot),
                            // Shutdown: the guard in `msg` leaves the claim
                            // to the final release.
                            None => drop(msg),
                        }),
                );
            }
        }
    }
}

impl Handler<StopPushPool> for PushPoolActor {
    type Result = ();

    fn handle(&mut self, _: StopPushPool, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

impl Handler<DrainPushPool> for PushPoolActor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: DrainPushPool, _ctx: &mut Self::Context) -> Self::Result {
        let slots = Arc::clone(&self.slots);
        let all = self.concurrency;
        Box::pin(async move {
            // Holding every slot means no push is in flight.
            if let Ok(permits) = slots.acquire_many(all).await {
                drop(permits);
            }
        })
    }
}

impl PushShared {
    async fn push(&self, msg: PushActivation, slot: OwnedSemaphorePermit) {
        let PushActivation { activation, claim } = msg;
        // The whole push (admission and RPC) ends within one push timeout;
        // the mark-processing write gets the margin. A claim with less left
        // than that may expire while its push runs, and be claimed and
        // pushed by someone else too: release it unpushed instead.
        let needed = self
            .config
            .push_timeout
            .saturating_add(MARK_PROCESSING_MARGIN);
        let left = activation
            .claim_expires_at
            .map(|expires| (expires - chrono::Utc::now()).to_std().unwrap_or_default());
        if left.is_none_or(|left| left < needed) {
            return self.release_unpushed(claim, "lease_expired").await;
        }
        self.router.ready().await;
        let Some(endpoint) = self.router.pick(&activation.application) else {
            return self.defer_unroutable(claim, &activation.application).await;
        };
        let _in_flight = endpoint.begin();
        if TaskActivation::decode(activation.activation.as_slice()).is_err() {
            return self.give_up(claim, "undecodable").await;
        }
        let received_at = activation.received_at;
        let at_most_once = activation.at_most_once;
        let started = Instant::now();
        let deadline = started + self.config.push_timeout;
        // Waiting out an endpoint's backoff may take at most half the push
        // timeout, so an admitted push (often the probe that tells whether
        // the worker is back) always has at least the other half for its RPC,
        // and the whole push still fits the claim lease's push timeout.
        let admit_by = started + self.config.push_timeout / 2;
        let outcome = match endpoint.admit(admit_by).await {
            Err(()) => PushOutcome::NotSent(NotSent::AdmissionTimeout),
            // Checked last before sending: a broker whose heartbeat is
            // overdue may have been taken over, and its claims pushed by a
            // peer (`liveness.rs`).
            Ok(admission) if !claim.may_push() => {
                // Unsent: a probe's slot goes back to the connection.
                drop(admission);
                return self.release_unpushed(claim, "not_live").await;
            }
            Ok(admission) => {
                let request = PushTaskBytes::new(activation.activation, &self.config.callback_url);
                let size = request.len();
                let signature = self
                    .config
                    .signing_secret
                    .as_deref()
                    .map(|secret| request.signature(secret));
                let rpc = endpoint
                    .client
                    .push(request, signature, self.config.push_timeout);
                let outcome = match tokio::time::timeout_at(deadline, rpc).await {
                    Err(_) => PushOutcome::Unknown(Unknown::Timeout),
                    Ok(Ok(())) => PushOutcome::Ok,
                    Ok(Err(status)) => PushOutcome::of_status(&status),
                };
                self.metrics
                    .push_duration
                    .observe(started.elapsed().as_secs_f64());
                admission.record(&outcome);
                if let PushOutcome::TooLarge(detail) = &outcome {
                    tracing::warn!(
                        activation_id = %claim.token().id,
                        size,
                        endpoint = %endpoint.url,
                        detail = %detail,
                        "activation too large for its worker; failing it"
                    );
                }
                outcome
            }
        };
        // The slot is held until the store write below is done, so a drained
        // pool (every slot free) has no push whose outcome is still unwritten:
        // shutdown then releases only claims that were never pushed.
        let _slot = slot;

        // An accepted push is counted once its write says whether the row
        // was still this claim's (`ok`) or had moved on (`stale`), so the
        // results partition the pushes.
        if outcome != PushOutcome::Ok {
            self.metrics
                .pushes
                .with_label_values(&[outcome.label()])
                .inc();
        }
        match outcome {
            PushOutcome::Ok => {
                let age = chrono::Utc::now() - received_at;
                self.metrics
                    .received_to_pushed
                    .observe(age.as_seconds_f64().max(0.0));
                let claimed_for = claim.claimed_at().elapsed().as_secs_f64();
                self.metrics
                    .observe_stage(Stage::ClaimedToPushed, claimed_for);
                self.mark_pushed(claim, started).await;
            }
            PushOutcome::NotSent(_) => self.undo(claim).await,
            PushOutcome::Unknown(_) if at_most_once => {
                // The worker may be running it: this was its one attempt.
                self.fail(claim, "at_most_once push outcome unknown").await;
            }
            PushOutcome::Unknown(_) => self.undo(claim).await,
            PushOutcome::TooLarge(_) => self.fail(claim, "too large").await,
        }
    }

    async fn mark_pushed(&self, claim: ClaimGuard, pushed_at: Instant) {
        let moved = self
            .store
            .mark_pushed(
                claim.token().clone(),
                self.config.deadline_grace,
                pushed_at.into_std(),
            )
            .await;
        let result = match moved {
            Ok(true) => "ok",
            // The row moved on before the write: claimed again after its
            // lease ran out (a duplicate delivery), or already finished by
            // the worker's report. Counted, nothing changed.
            Ok(false) => "stale",
            Err(err) => {
                crate::warn_throttled!(error = %err, "cannot record a successful push; the lease will return it");
                "ok"
            }
        };
        self.metrics.pushes.with_label_values(&[result]).inc();
        claim.settle();
    }

    /// Fenced undo to Pending, no attempt consumed.
    async fn undo(&self, claim: ClaimGuard) {
        let undone = self.store.undo_claim(claim.token().clone()).await;
        match undone {
            Ok(true) => self
                .metrics
                .claims_released
                .with_label_values(&["push_failed"])
                .inc(),
            // Already moved on (lease expired and claimed again).
            Ok(false) => {}
            // Includes the store actor being gone: the guard's own release
            // would be lost too; the lease returns the row.
            Err(err) => {
                crate::warn_throttled!(error = %err, "cannot undo a failed push; the lease will return it");
            }
        }
        claim.settle();
    }

    /// Fenced Claimed → Failure: the push used up the task's delivery.
    async fn fail(&self, claim: ClaimGuard, why: &'static str) {
        let sent = self.store.fail_claims(vec![claim.token().clone()]).await;
        if let Err(err) = sent {
            crate::warn_throttled!(error = %err, why, "cannot fail a claim; the lease will return it");
        }
        claim.settle();
    }

    /// Not pushed: the claim's lease is too short for a push
    /// (`lease_expired`), or this broker may have been taken over
    /// (`not_live`). Fenced return to Pending, no attempt consumed (the
    /// same statement as a failed push's undo); counted by `result`.
    async fn release_unpushed(&self, claim: ClaimGuard, result: &'static str) {
        self.metrics.pushes.with_label_values(&[result]).inc();
        let released = self.store.undo_claim(claim.token().clone()).await;
        if let Err(err) = &released {
            crate::warn_throttled!(error = %err, "cannot release a claim too old to push; its lease will");
        }
        claim.settle();
    }

    /// No worker endpoint serves `application`: park the task in Delay for
    /// [`NO_ROUTE_BACKOFF`] without consuming an attempt.
    async fn defer_unroutable(&self, claim: ClaimGuard, application: &str) {
        self.metrics.pushes.with_label_values(&["unroutable"]).inc();
        self.metrics.push_no_route.inc();
        self.log_no_route(application);
        let until = chrono::Utc::now()
            + chrono::TimeDelta::from_std(NO_ROUTE_BACKOFF).unwrap_or(chrono::TimeDelta::MAX);
        let deferred = self
            .store
            .defer_claims(vec![claim.token().clone()], until)
            .await;
        if let Err(err) = &deferred {
            crate::warn_throttled!(error = %err, "cannot defer an unroutable claim; its lease will return it");
        }
        claim.settle();
    }

    /// One line per application and [`NO_ROUTE_LOG_INTERVAL`].
    fn log_no_route(&self, application: &str) {
        let mut log = self
            .no_route_log
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if let Some((at, deferred)) = log.get_mut(application)
            && now.duration_since(*at) < NO_ROUTE_LOG_INTERVAL
        {
            *deferred += 1;
            return;
        }
        if log.len() >= NO_ROUTE_LOG_APPLICATIONS && !log.contains_key(application) {
            log.retain(|_, (at, _)| now.duration_since(*at) < NO_ROUTE_LOG_INTERVAL);
            if log.len() >= NO_ROUTE_LOG_APPLICATIONS {
                // That many misrouted applications within one interval:
                // the counter and the lines already logged tell the story.
                return;
            }
        }
        let deferred = log
            .insert(application.to_owned(), (now, 0))
            .map_or(0, |(_, deferred)| deferred);
        tracing::warn!(
            application,
            deferred_since_last_log = deferred,
            backoff_s = NO_ROUTE_BACKOFF.as_secs(),
            "no worker endpoint for this application (check TASKBROKER_WORKER_ENDPOINTS); \
             its activations wait in Delay"
        );
    }

    /// The activation can never be delivered by this broker: consume an
    /// attempt so it ends in Failure like any poison task.
    async fn give_up(&self, claim: ClaimGuard, reason: &'static str) {
        self.metrics.pushes.with_label_values(&[reason]).inc();
        tracing::warn!(
            activation_id = %claim.token().id,
            reason,
            "activation cannot be pushed; consuming an attempt"
        );
        let sent = self
            .store
            .fail_claim_attempt(vec![claim.token().clone()], self.config.max_attempts)
            .await;
        if let Err(err) = &sent {
            crate::warn_throttled!(error = %err, "cannot record an undeliverable claim; the lease will return it");
        }
        claim.settle();
    }
}
