//! PushPoolActor: delivers claimed activations to workers with PushTask.
//!
//! - Owns: one lazily connected channel per worker URL, each endpoint's
//!   health (backoff after failures), and `PUSH_CONCURRENCY` push slots.
//! - Receives: [`PushActivation`] (bounded mailbox of `PUSH_QUEUE_SIZE`),
//!   [`StopPushPool`], [`DrainPushPool`].
//! - Sends: PushTask RPCs to workers; [`MarkPushed`], [`UndoClaim`] and
//!   [`FailClaimAttempt`] to the StoreActor.
//!
//! Backpressure: each push runs as its own task holding one slot. When every
//! slot is taken the handler waits (`ctx.wait`) for one to free up, and while
//! it waits the actor takes no messages, so its mailbox fills and
//! FetchActors get `SendError::Full` back from `try_send`: that is how "the
//! push pool is saturated" becomes visible to them.
//!
//! Outcomes: OK → fenced Claimed → Processing (combined into batched
//! statements by the StoreActor); error, timeout or RESOURCE_EXHAUSTED →
//! fenced undo to Pending without consuming an attempt, and the endpoint
//! backs off; no endpoint for the application, or bytes that do not decode →
//! the claim consumes an attempt so the task ends in Failure instead of
//! cycling forever.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use actix::prelude::*;
use prost::Message as _;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tonic::Code;

use super::claims::ClaimGuard;
use super::store::{FailClaimAttempt, MarkPushed, StoreActor, UndoClaim};
use crate::config::WorkerEndpoints;
use crate::grpc::worker_client::{PushTaskBytes, WorkerClient};
use crate::metrics::Metrics;
use crate::proto::TaskActivation;
use crate::store::InflightActivation;

/// First pause after an endpoint fails; doubles per failure up to
/// [`MAX_ENDPOINT_BACKOFF`], and resets on the first success.
const MIN_ENDPOINT_BACKOFF: Duration = Duration::from_millis(25);
/// Longest pause between attempts to a failing endpoint: short enough that a
/// worker coming back gets pushes again within a second.
const MAX_ENDPOINT_BACKOFF: Duration = Duration::from_millis(500);
/// At most one failure log line per endpoint in this interval.
const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(5);

/// Settings of the push pool.
#[derive(Debug, Clone)]
pub struct PushPoolConfig {
    pub concurrency: usize,
    pub queue_size: usize,
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
/// guards; pushes in flight finish on their own.
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
}

/// What every push task needs.
struct PushShared {
    config: PushPoolConfig,
    router: Router,
    store: Addr<StoreActor>,
    metrics: Arc<Metrics>,
}

impl PushPoolActor {
    /// Checks every worker URL; [`PushPoolActor::new`] cannot fail after it.
    pub fn validate(config: &PushPoolConfig) -> Result<(), String> {
        for url in config.endpoints.all_urls() {
            WorkerClient::check_url(url)?;
        }
        Ok(())
    }

    /// Builds the worker channels; must run inside the actor's runtime
    /// (e.g. in the `start_in_arbiter` closure) after
    /// [`PushPoolActor::validate`] accepted `config`.
    pub fn new(config: PushPoolConfig, store: Addr<StoreActor>, metrics: Arc<Metrics>) -> Self {
        let connect_timeout = config.push_timeout.min(Duration::from_secs(1));
        let router = Router::new(&config.endpoints, connect_timeout)
            .unwrap_or_else(|err| panic!("worker URLs are validated before start: {err}"));
        let concurrency = config.concurrency.clamp(1, Semaphore::MAX_PERMITS);
        PushPoolActor {
            slots: Arc::new(Semaphore::new(concurrency)),
            concurrency: u32::try_from(concurrency).unwrap_or(u32::MAX),
            shared: Arc::new(PushShared {
                config,
                router,
                store,
                metrics,
            }),
        }
    }

    fn start_push(&self, msg: PushActivation, slot: OwnedSemaphorePermit) {
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
        match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(slot) => self.start_push(msg, slot),
            Err(_) => {
                // Saturated: take no further message until a slot frees up.
                let slots = Arc::clone(&self.slots);
                ctx.wait(
                    async move { slots.acquire_owned().await }
                        .into_actor(self)
                        .map(move |slot, act, _ctx| match slot {
                            Ok(slot) => act.start_push(msg, slot),
                            // Closed semaphore: the pool is stopping; the guard
                            // in `msg` releases the claim.
                            Err(_) => drop(msg),
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
        let Some(endpoint) = self.router.pick(&activation.application) else {
            return self.give_up(claim, "unroutable").await;
        };
        if TaskActivation::decode(activation.activation.as_slice()).is_err() {
            return self.give_up(claim, "undecodable").await;
        }
        let received_at = activation.received_at;
        let started = Instant::now();
        let deadline = started + self.config.push_timeout;
        // Waiting out an endpoint's backoff may take at most half the push
        // timeout, so an admitted push (often the probe that tells whether
        // the worker is back) always has at least the other half for its RPC,
        // and the whole push still fits the claim lease's push timeout.
        let admit_by = started + self.config.push_timeout / 2;
        let outcome = match endpoint.admit(admit_by).await {
            Err(()) => PushOutcome::Timeout,
            Ok(()) => {
                let request = PushTaskBytes::new(activation.activation, &self.config.callback_url);
                let signature = self
                    .config
                    .signing_secret
                    .as_deref()
                    .map(|secret| request.signature(secret));
                let rpc = endpoint
                    .client
                    .push(request, signature, self.config.push_timeout);
                let outcome = match tokio::time::timeout_at(deadline, rpc).await {
                    Err(_) => PushOutcome::Timeout,
                    Ok(Ok(())) => PushOutcome::Ok,
                    Ok(Err(status)) => match status.code() {
                        Code::ResourceExhausted => PushOutcome::Busy,
                        Code::DeadlineExceeded | Code::Cancelled => PushOutcome::Timeout,
                        _ => PushOutcome::Error(status.message().to_owned()),
                    },
                };
                self.metrics
                    .push_duration
                    .observe(started.elapsed().as_secs_f64());
                endpoint.record(&outcome);
                outcome
            }
        };
        // The slot is held until the store write below is done, so a drained
        // pool (every slot free) has no push whose outcome is still unwritten:
        // shutdown then releases only claims that were never pushed.
        let _slot = slot;

        let token = claim.token().clone();
        match outcome {
            PushOutcome::Ok => {
                self.metrics.pushes.with_label_values(&["ok"]).inc();
                let age = chrono::Utc::now() - received_at;
                self.metrics
                    .received_to_pushed
                    .observe(age.as_seconds_f64().max(0.0));
                let moved = self
                    .store
                    .send(MarkPushed {
                        claim: token,
                        deadline_grace: self.config.deadline_grace,
                    })
                    .await;
                match moved {
                    Ok(Ok(true)) => {}
                    // The row moved on before the write: claimed again after
                    // its lease ran out (a duplicate delivery), or already
                    // finished by the worker's report. Counted, nothing
                    // changed.
                    Ok(Ok(false)) => self.metrics.pushes.with_label_values(&["stale"]).inc(),
                    Ok(Err(err)) => {
                        tracing::warn!(error = %err, "cannot record a successful push; the lease will return it");
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "store actor gone; the lease will return the pushed claim");
                    }
                }
                claim.settle();
            }
            failed => {
                self.metrics
                    .pushes
                    .with_label_values(&[failed.label()])
                    .inc();
                match self.store.send(UndoClaim { claim: token }).await {
                    Ok(Ok(true)) => {
                        self.metrics
                            .claims_released
                            .with_label_values(&["push_failed"])
                            .inc();
                        claim.settle();
                    }
                    // Already moved on (lease expired and claimed again).
                    Ok(Ok(false)) => claim.settle(),
                    Ok(Err(err)) => {
                        tracing::warn!(error = %err, "cannot undo a failed push; the lease will return it");
                        claim.settle();
                    }
                    // The store actor is gone: the guard's own release is
                    // lost too; the lease returns the row.
                    Err(_) => claim.settle(),
                }
            }
        }
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
            .send(FailClaimAttempt {
                claims: vec![claim.token().clone()],
                max_attempts: self.config.max_attempts,
            })
            .await;
        if let Ok(Err(err)) = &sent {
            tracing::warn!(error = %err, "cannot record an undeliverable claim; the lease will return it");
        }
        claim.settle();
    }
}

#[derive(Debug)]
enum PushOutcome {
    Ok,
    Busy,
    Timeout,
    Error(String),
}

impl PushOutcome {
    fn label(&self) -> &'static str {
        match self {
            PushOutcome::Ok => "ok",
            PushOutcome::Busy => "busy",
            PushOutcome::Timeout => "timeout",
            PushOutcome::Error(_) => "error",
        }
    }
}

/// Application → worker endpoints, spread round-robin.
struct Router {
    by_application: HashMap<String, Vec<Arc<WorkerEndpoint>>>,
    fallback: Option<Vec<Arc<WorkerEndpoint>>>,
    next: AtomicUsize,
}

impl Router {
    fn new(endpoints: &WorkerEndpoints, connect_timeout: Duration) -> Result<Self, String> {
        let mut by_url: HashMap<String, Arc<WorkerEndpoint>> = HashMap::new();
        let mut endpoint = |url: &str| -> Result<Arc<WorkerEndpoint>, String> {
            if let Some(existing) = by_url.get(url) {
                return Ok(Arc::clone(existing));
            }
            let created = Arc::new(WorkerEndpoint {
                // Only for logs: credentials in the URL never reach them.
                url: crate::config::redact_url(url).into_owned(),
                client: WorkerClient::connect_lazy(url, connect_timeout)?,
                health: Mutex::new(Health::default()),
            });
            by_url.insert(url.to_owned(), Arc::clone(&created));
            Ok(created)
        };
        let mut by_application = HashMap::new();
        for (application, urls) in endpoints.applications() {
            let list = urls
                .iter()
                .map(|url| endpoint(url))
                .collect::<Result<Vec<_>, _>>()?;
            by_application.insert(application.to_owned(), list);
        }
        let fallback = endpoints
            .fallback()
            .map(|urls| urls.iter().map(|url| endpoint(url)).collect())
            .transpose()?;
        Ok(Router {
            by_application,
            fallback,
            next: AtomicUsize::new(0),
        })
    }

    /// The next endpoint for `application`, preferring ones not backing off.
    fn pick(&self, application: &str) -> Option<Arc<WorkerEndpoint>> {
        let list = self
            .by_application
            .get(application)
            .or(self.fallback.as_ref())?;
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let rotated = (0..list.len()).map(|i| &list[(start + i) % list.len()]);
        rotated
            .clone()
            .find(|endpoint| endpoint.available_at() <= now)
            .or_else(|| rotated.min_by_key(|endpoint| endpoint.available_at()))
            .cloned()
    }
}

/// One worker URL and its health.
struct WorkerEndpoint {
    url: String,
    client: WorkerClient,
    health: Mutex<Health>,
}

#[derive(Default)]
struct Health {
    consecutive_failures: u32,
    /// While backing off: no push before this instant.
    retry_at: Option<Instant>,
    /// While backing off, one push at a time probes the endpoint.
    probing: bool,
    last_logged: Option<Instant>,
    unlogged_failures: u64,
}

impl WorkerEndpoint {
    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn available_at(&self) -> Instant {
        let health = self.health();
        match health.retry_at {
            Some(at) if health.probing => at.max(Instant::now() + MIN_ENDPOINT_BACKOFF),
            Some(at) => at,
            None => Instant::now() - Duration::from_millis(1),
        }
    }

    /// Waits until this endpoint may be tried: at once while healthy; while
    /// backing off, one probe at a time once the backoff has passed. Gives
    /// up at `deadline`.
    async fn admit(&self, deadline: Instant) -> Result<(), ()> {
        loop {
            let wait_until = {
                let mut health = self.health();
                match health.retry_at {
                    None => return Ok(()),
                    Some(at) if !health.probing && Instant::now() >= at => {
                        health.probing = true;
                        return Ok(());
                    }
                    Some(_) if health.probing => Instant::now() + MIN_ENDPOINT_BACKOFF,
                    Some(at) => at,
                }
            };
            if wait_until >= deadline {
                tokio::time::sleep_until(deadline).await;
                return Err(());
            }
            tokio::time::sleep_until(wait_until).await;
        }
    }

    fn record(&self, outcome: &PushOutcome) {
        let mut health = self.health();
        health.probing = false;
        if matches!(outcome, PushOutcome::Ok) {
            if health.consecutive_failures > 0 {
                tracing::info!(endpoint = %self.url, "worker endpoint recovered");
            }
            health.consecutive_failures = 0;
            health.retry_at = None;
            return;
        }
        health.consecutive_failures = health.consecutive_failures.saturating_add(1);
        let exponent = health.consecutive_failures.saturating_sub(1).min(16);
        let backoff = MIN_ENDPOINT_BACKOFF
            .saturating_mul(1 << exponent)
            .min(MAX_ENDPOINT_BACKOFF);
        let now = Instant::now();
        health.retry_at = Some(now + backoff);
        let log_now = health
            .last_logged
            .is_none_or(|at| now.duration_since(at) >= FAILURE_LOG_INTERVAL);
        if log_now {
            let detail = match outcome {
                PushOutcome::Error(message) => message.as_str(),
                _ => "",
            };
            tracing::warn!(
                endpoint = %self.url,
                result = outcome.label(),
                detail,
                failures_since_last_log = health.unlogged_failures,
                "push to worker failed; backing off"
            );
            health.last_logged = Some(now);
            health.unlogged_failures = 0;
        } else {
            health.unlogged_failures += 1;
        }
    }
}
