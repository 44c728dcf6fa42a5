//! Worker endpoints: which endpoint serves an application (round-robin,
//! preferring endpoints not backing off), and each endpoint's health: an
//! exponential backoff after failures, one probe at a time while it lasts,
//! and throttled failure logs. The push pool asks here where to push and
//! reports every push's outcome back. The backoff's rules live in `Health`
//! as a state machine over explicit instants, so `endpoints_tests.rs`
//! checks them without a clock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::outcome::PushOutcome;
use crate::config::WorkerEndpoints;
use crate::wire::worker_client::WorkerClient;
use tonic::transport::ClientTlsConfig;

/// First pause after an endpoint fails; doubles per failure up to
/// [`MAX_ENDPOINT_BACKOFF`], and resets on the first success.
const MIN_ENDPOINT_BACKOFF: Duration = Duration::from_millis(25);
/// Longest pause between attempts to a failing endpoint: short enough that a
/// worker coming back gets pushes again within a second.
const MAX_ENDPOINT_BACKOFF: Duration = Duration::from_millis(500);
/// At most one failure log line per endpoint in this interval.
const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(5);

/// Application → worker endpoints, spread round-robin.
pub(super) struct Router {
    by_application: HashMap<String, Vec<Arc<WorkerEndpoint>>>,
    fallback: Option<Vec<Arc<WorkerEndpoint>>>,
    next: AtomicUsize,
}

impl Router {
    pub(super) fn new(
        endpoints: &WorkerEndpoints,
        connect_timeout: Duration,
        tls: &ClientTlsConfig,
    ) -> Result<Self, String> {
        let mut by_url: HashMap<String, Arc<WorkerEndpoint>> = HashMap::new();
        let mut endpoint = |url: &str| -> Result<Arc<WorkerEndpoint>, String> {
            if let Some(existing) = by_url.get(url) {
                return Ok(Arc::clone(existing));
            }
            let created = Arc::new(WorkerEndpoint {
                // Only for logs: credentials in the URL never reach them.
                url: crate::config::redact_url(url).into_owned(),
                client: WorkerClient::connect_lazy(url, connect_timeout, tls)?,
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
    pub(super) fn pick(&self, application: &str) -> Option<Arc<WorkerEndpoint>> {
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
pub(super) struct WorkerEndpoint {
    pub(super) url: String,
    pub(super) client: WorkerClient,
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
    pub(super) async fn admit(&self, deadline: Instant) -> Result<(), ()> {
        loop {
            let Err(wait_until) = self.health().admit_at(Instant::now()) else {
                return Ok(());
            };
            if wait_until >= deadline {
                tokio::time::sleep_until(deadline).await;
                return Err(());
            }
            tokio::time::sleep_until(wait_until).await;
        }
    }

    pub(super) fn record(&self, outcome: &PushOutcome) {
        let mut health = self.health();
        let recovered = outcome.endpoint_healthy() && health.consecutive_failures > 0;
        let Some(unlogged) = health.record_at(outcome.endpoint_healthy(), Instant::now()) else {
            if recovered {
                tracing::info!(endpoint = %self.url, "worker endpoint recovered");
            }
            return;
        };
        let detail = outcome.detail();
        tracing::warn!(
            endpoint = %self.url,
            result = outcome.label(),
            detail,
            failures_since_last_log = unlogged,
            "push to worker failed; backing off"
        );
    }
}

/// The endpoint's backoff as a state machine over explicit instants (the
/// callers pass tokio's clock), so its rules are tested without waiting.
impl Health {
    /// `Ok` admits a push now (marking it the probe while backing off);
    /// `Err(at)` says when to ask again.
    fn admit_at(&mut self, now: Instant) -> Result<(), Instant> {
        match self.retry_at {
            None => Ok(()),
            Some(at) if !self.probing && now >= at => {
                self.probing = true;
                Ok(())
            }
            Some(_) if self.probing => Err(now + MIN_ENDPOINT_BACKOFF),
            Some(at) => Err(at),
        }
    }

    /// Records a push's outcome at `now`: success resets the backoff, a
    /// failure doubles it (from [`MIN_ENDPOINT_BACKOFF`] up to
    /// [`MAX_ENDPOINT_BACKOFF`]). Returns, when a failure line is due, how
    /// many failures went unlogged before it.
    fn record_at(&mut self, healthy: bool, now: Instant) -> Option<u64> {
        self.probing = false;
        if healthy {
            self.consecutive_failures = 0;
            self.retry_at = None;
            return None;
        }
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        let exponent = self.consecutive_failures.saturating_sub(1).min(16);
        let backoff = MIN_ENDPOINT_BACKOFF
            .saturating_mul(1 << exponent)
            .min(MAX_ENDPOINT_BACKOFF);
        self.retry_at = Some(now + backoff);
        let log_now = self
            .last_logged
            .is_none_or(|at| now.duration_since(at) >= FAILURE_LOG_INTERVAL);
        if log_now {
            self.last_logged = Some(now);
            Some(std::mem::take(&mut self.unlogged_failures))
        } else {
            self.unlogged_failures += 1;
            None
        }
    }
}

#[cfg(test)]
#[path = "endpoints_tests.rs"]
mod tests;
