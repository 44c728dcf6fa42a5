//! Worker endpoints: which endpoint serves an application (round-robin,
//! preferring endpoints not backing off), and each endpoint's health: an
//! exponential backoff after failures, one probe at a time while it lasts,
//! and throttled failure logs. The push pool asks here where to push and
//! reports every push's outcome back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use super::outcome::PushOutcome;
use crate::config::WorkerEndpoints;
use crate::wire::worker_client::WorkerClient;

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
    ) -> Result<Self, String> {
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

    pub(super) fn record(&self, outcome: &PushOutcome) {
        let mut health = self.health();
        health.probing = false;
        if outcome.endpoint_healthy() {
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
            let detail = outcome.detail();
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
