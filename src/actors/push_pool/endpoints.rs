//! Worker endpoints: which connection a push goes to, and each
//! connection's health.
//!
//! Every worker URL is a [`Target`]: a set of connections (`WORKER_CONNECTIONS`
//! of them, at least one per address) to the addresses its host name
//! resolves to, resolved again every `WORKER_DNS_REFRESH_MS`. Behind a
//! ClusterIP Service (one virtual address, balanced per TCP connection by
//! kube-proxy) the connections land on different pods; behind a headless
//! Service (one address per pod) each pod gets its own, pods that appear
//! are used and pods that disappear are dropped at the next refresh.
//!
//! A push goes to the less loaded of two connections drawn at random from
//! its application's URLs (power of two choices, by pushes outstanding), so
//! a slow pod, which holds its pushes longer, is offered fewer; connections
//! backing off are skipped while any other is available. Each connection has
//! its own backoff after failures (one probe at a time while it lasts); the
//! failure log lines are throttled per URL. The backoff's rules live in
//! `Health` as a state machine over explicit instants, so
//! `endpoints_tests.rs` checks them without a clock.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::Duration;

use tokio::time::Instant;

use super::SpreadConfig;
use super::outcome::PushOutcome;
use super::resolve::Resolver;
use crate::config::WorkerEndpoints;
use crate::metrics::Metrics;
use crate::wire::worker_client::WorkerClient;
use tonic::transport::ClientTlsConfig;

/// First pause after a connection fails; doubles per failure up to
/// [`MAX_ENDPOINT_BACKOFF`], and resets on the first success.
const MIN_ENDPOINT_BACKOFF: Duration = Duration::from_millis(25);
/// Longest pause between attempts on a failing connection: short enough that
/// a worker coming back gets pushes again within a second.
const MAX_ENDPOINT_BACKOFF: Duration = Duration::from_millis(500);
/// At most one failure log line per worker URL in this interval.
const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(5);
/// At most one "cannot resolve" line per worker URL in this interval.
const RESOLVE_LOG_INTERVAL: Duration = Duration::from_secs(60);
/// How long the first pushes wait for the first resolution of their URL's
/// host name before using a connection that resolves it by itself.
const FIRST_RESOLUTION_WAIT: Duration = Duration::from_secs(1);

/// Application → worker URLs, each a set of connections.
pub(super) struct Router {
    by_application: HashMap<String, Vec<Arc<Target>>>,
    fallback: Option<Vec<Arc<Target>>>,
    /// Drives the random draws of the two choices.
    draws: AtomicU64,
    /// True once every URL's host name was resolved (or failed to) once.
    resolved: tokio::sync::watch::Receiver<bool>,
    /// The task that resolves host names again; ends with the router.
    refresher: Option<tokio::task::AbortHandle>,
}

impl Drop for Router {
    fn drop(&mut self) {
        if let Some(refresher) = &self.refresher {
            refresher.abort();
        }
    }
}

impl Router {
    /// Must run inside a Tokio runtime: it spawns the resolution task.
    pub(super) fn new(
        endpoints: &WorkerEndpoints,
        spread: &SpreadConfig,
        connect_timeout: Duration,
        tls: &ClientTlsConfig,
        metrics: &Arc<Metrics>,
    ) -> Result<Self, String> {
        let mut by_url: HashMap<String, Arc<Target>> = HashMap::new();
        let mut target = |url: &str| -> Result<Arc<Target>, String> {
            if let Some(existing) = by_url.get(url) {
                return Ok(Arc::clone(existing));
            }
            let created = Arc::new(Target::new(
                url,
                spread.connections.max(1),
                connect_timeout,
                tls,
                Arc::clone(metrics),
            )?);
            by_url.insert(url.to_owned(), Arc::clone(&created));
            Ok(created)
        };
        let mut by_application = HashMap::new();
        for (application, urls) in endpoints.applications() {
            let list = urls
                .iter()
                .map(|url| target(url))
                .collect::<Result<Vec<_>, _>>()?;
            by_application.insert(application.to_owned(), list);
        }
        let fallback = endpoints
            .fallback()
            .map(|urls| urls.iter().map(|url| target(url)).collect())
            .transpose()?;
        let named: Vec<Weak<Target>> = by_url
            .values()
            .filter(|target| target.host.is_some())
            .map(Arc::downgrade)
            .collect();
        let (done, resolved) = tokio::sync::watch::channel(named.is_empty());
        let refresher = (!named.is_empty()).then(|| {
            let resolver = spread.resolver.clone();
            let interval = spread.dns_refresh;
            tokio::spawn(refresh(named, resolver, interval, done)).abort_handle()
        });
        let seed = u64::from(std::process::id()) ^ (uuid::Uuid::new_v4().as_u64_pair().0);
        Ok(Router {
            by_application,
            fallback,
            draws: AtomicU64::new(seed),
            resolved,
            refresher,
        })
    }

    /// Waits (briefly, and only at startup) until host names were resolved
    /// once, so the first pushes already spread over every address.
    pub(super) async fn ready(&self) {
        if *self.resolved.borrow() {
            return;
        }
        let mut resolved = self.resolved.clone();
        let _ = tokio::time::timeout(FIRST_RESOLUTION_WAIT, resolved.wait_for(|done| *done)).await;
    }

    /// The connection for `application`'s next push: of two drawn at
    /// random, the one not backing off with the fewest pushes outstanding;
    /// when both are backing off, any other that is not; when all are, the
    /// one whose backoff ends first.
    pub(super) fn pick(&self, application: &str) -> Option<Arc<WorkerEndpoint>> {
        let targets = self
            .by_application
            .get(application)
            .or(self.fallback.as_ref())?;
        let sets: Vec<Arc<[Arc<WorkerEndpoint>]>> =
            targets.iter().map(|target| target.connections()).collect();
        let all = || sets.iter().flat_map(|set| set.iter());
        let count = sets.iter().map(|set| set.len()).sum::<usize>();
        let nth = |n: usize| all().nth(n);
        let now = Instant::now();
        let load =
            |endpoint: &WorkerEndpoint| (endpoint.available_at() > now, endpoint.in_flight());
        let draw = splitmix(self.draws.fetch_add(1, Ordering::Relaxed));
        let first = (draw % count as u64) as usize;
        let mut best = nth(first)?;
        if count > 1 {
            let offset = 1 + ((draw >> 32) % (count as u64 - 1)) as usize;
            let second = nth((first + offset) % count)?;
            if load(second) < load(best) {
                best = second;
            }
        }
        if best.available_at() <= now {
            return Some(Arc::clone(best));
        }
        all()
            .filter(|endpoint| endpoint.available_at() <= now)
            .min_by_key(|endpoint| endpoint.in_flight())
            .or_else(|| all().min_by_key(|endpoint| endpoint.available_at()))
            .cloned()
    }
}

/// A 64-bit mix of a counter (SplitMix64's finaliser): cheap, well-spread
/// draws without a random-number crate or a lock.
fn splitmix(counter: u64) -> u64 {
    let mut z = counter.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Resolves every named worker URL now, then every `interval`, until the
/// router is dropped. `done` turns true after the first round.
async fn refresh(
    targets: Vec<Weak<Target>>,
    resolver: Resolver,
    interval: Duration,
    done: tokio::sync::watch::Sender<bool>,
) {
    loop {
        let mut alive = false;
        for target in &targets {
            if let Some(target) = target.upgrade() {
                alive = true;
                target.refresh(&resolver).await;
            }
        }
        done.send_replace(true);
        if !alive {
            return;
        }
        tokio::time::sleep(interval).await;
    }
}

/// One worker URL: its connections, and where its host name points.
pub(super) struct Target {
    /// As configured (credentials included): what channels are built from.
    url: String,
    /// For logs and metrics: credentials never reach them.
    label: String,
    /// The host name to resolve; `None` when the URL names an address.
    host: Option<String>,
    port: u16,
    wanted: usize,
    connect_timeout: Duration,
    tls: ClientTlsConfig,
    metrics: Arc<Metrics>,
    connections: RwLock<Arc<[Arc<WorkerEndpoint>]>>,
    /// The addresses the connections go to, once resolved.
    addresses: Mutex<Option<Vec<IpAddr>>>,
    failures: Arc<Mutex<FailureLog>>,
    last_resolve_warning: Mutex<Option<Instant>>,
    gauges: EndpointGauges,
}

/// A worker URL's series of the health gauges, shared by its connections
/// (each a handle to one value): `taskbroker_worker_connections{endpoint,
/// state}` and `taskbroker_worker_pushes_in_flight{endpoint}`.
#[derive(Clone)]
struct EndpointGauges {
    ready: prometheus::IntGauge,
    backing_off: prometheus::IntGauge,
    in_flight: prometheus::IntGauge,
}

impl EndpointGauges {
    fn new(metrics: &Metrics, label: &str) -> Self {
        EndpointGauges {
            ready: metrics
                .worker_connections
                .with_label_values(&[label, "ready"]),
            backing_off: metrics
                .worker_connections
                .with_label_values(&[label, "backing_off"]),
            in_flight: metrics.worker_pushes_in_flight.with_label_values(&[label]),
        }
    }

    /// The connection's state gauge: backing off, or ready.
    fn state(&self, backing_off: bool) -> &prometheus::IntGauge {
        if backing_off {
            &self.backing_off
        } else {
            &self.ready
        }
    }
}

impl Target {
    fn new(
        url: &str,
        wanted: usize,
        connect_timeout: Duration,
        tls: &ClientTlsConfig,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let uri: http::Uri = url.parse().map_err(|err| {
            format!(
                "invalid worker URL {}: {err}",
                crate::config::redact_url(url)
            )
        })?;
        let https = uri.scheme_str() == Some("https");
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let bare = uri.host().unwrap_or_default();
        let bare = bare.trim_start_matches('[').trim_end_matches(']');
        let host = bare.parse::<IpAddr>().is_err().then(|| bare.to_owned());
        let label = crate::config::redact_url(url).into_owned();
        let gauges = EndpointGauges::new(&metrics, &label);
        let target = Target {
            url: url.to_owned(),
            label,
            host,
            port,
            wanted,
            connect_timeout,
            tls: tls.clone(),
            metrics,
            connections: RwLock::new(Arc::from(Vec::new())),
            addresses: Mutex::new(None),
            failures: Arc::default(),
            last_resolve_warning: Mutex::new(None),
            gauges,
        };
        // Until the first resolution: connections that resolve the name
        // themselves (for an address in the URL, these are final).
        let initial = (0..wanted)
            .map(|_| target.connect(None))
            .collect::<Result<Vec<_>, _>>()?;
        *target
            .connections
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::from(initial);
        target.gauge(1);
        Ok(target)
    }

    fn connections(&self) -> Arc<[Arc<WorkerEndpoint>]> {
        Arc::clone(
            &self
                .connections
                .read()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    fn connect(&self, address: Option<SocketAddr>) -> Result<Arc<WorkerEndpoint>, String> {
        let endpoint = Arc::new(WorkerEndpoint {
            url: self.label.clone(),
            address,
            client: WorkerClient::connect_lazy(
                &self.url,
                address,
                self.connect_timeout,
                &self.tls,
            )?,
            health: Mutex::new(Health::default()),
            in_flight: AtomicUsize::new(0),
            failures: Arc::clone(&self.failures),
            gauges: self.gauges.clone(),
        });
        endpoint.gauges.ready.inc();
        Ok(endpoint)
    }

    fn gauge(&self, addresses: usize) {
        self.metrics
            .worker_addresses
            .with_label_values(&[self.label.as_str()])
            .set(i64::try_from(addresses).unwrap_or(i64::MAX));
    }

    /// Resolves the host name and, when its addresses changed, keeps the
    /// connections to addresses still there (and their health), opens
    /// connections to new ones and drops the rest (pushes in flight on them
    /// finish). A failed lookup keeps what there is.
    async fn refresh(&self, resolver: &Resolver) {
        let Some(host) = &self.host else { return };
        let addresses = match resolver.lookup(host, self.port).await {
            Ok(addresses) => addresses,
            Err(err) => return self.warn_unresolved(&err),
        };
        let previous = {
            let mut current = self
                .addresses
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if current.as_ref() == Some(&addresses) {
                return;
            }
            current.replace(addresses.clone())
        };
        let per_address = self.wanted.div_ceil(addresses.len()).max(1);
        let existing = self.connections();
        let mut next = Vec::with_capacity(per_address * addresses.len());
        for ip in &addresses {
            let address = SocketAddr::new(*ip, self.port);
            let mut kept: Vec<Arc<WorkerEndpoint>> = existing
                .iter()
                .filter(|endpoint| endpoint.address == Some(address))
                .take(per_address)
                .cloned()
                .collect();
            while kept.len() < per_address {
                match self.connect(Some(address)) {
                    Ok(endpoint) => kept.push(endpoint),
                    // The URL was valid at startup; an address cannot make
                    // it invalid, but never leave the URL without a channel.
                    Err(err) => {
                        tracing::warn!(endpoint = %self.label, %address, error = %err, "cannot open a worker connection");
                        break;
                    }
                }
            }
            next.extend(kept);
        }
        if next.is_empty() {
            return;
        }
        *self
            .connections
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::from(next);
        self.gauge(addresses.len());
        let before = previous.as_ref().map_or(0, Vec::len);
        let removed = previous.as_ref().map_or(0, |old| {
            old.iter().filter(|ip| !addresses.contains(ip)).count()
        });
        let added = addresses
            .iter()
            .filter(|ip| previous.as_ref().is_none_or(|old| !old.contains(ip)))
            .count();
        tracing::info!(
            endpoint = %self.label,
            addresses = addresses.len(),
            before,
            added,
            removed,
            connections_per_address = per_address,
            "worker endpoint addresses changed"
        );
    }

    fn warn_unresolved(&self, err: &std::io::Error) {
        let now = Instant::now();
        let mut last = self
            .last_resolve_warning
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if last.is_some_and(|at| now.duration_since(at) < RESOLVE_LOG_INTERVAL) {
            return;
        }
        *last = Some(now);
        tracing::warn!(
            endpoint = %self.label,
            error = %err,
            "cannot resolve the worker host name; keeping the connections it had"
        );
    }
}

/// One connection to a worker URL (to one of its addresses, once resolved)
/// and its health.
pub(super) struct WorkerEndpoint {
    /// The worker URL, redacted.
    pub(super) url: String,
    /// The address this connection goes to; `None` while the URL's host
    /// name is resolved by the connection itself.
    pub(super) address: Option<SocketAddr>,
    pub(super) client: WorkerClient,
    health: Mutex<Health>,
    in_flight: AtomicUsize,
    /// Shared by the URL's connections: one log line per URL and interval.
    failures: Arc<Mutex<FailureLog>>,
    gauges: EndpointGauges,
}

/// A connection dropped (its address went away, or the pool stopped) no
/// longer counts in its URL's gauges.
impl Drop for WorkerEndpoint {
    fn drop(&mut self) {
        let backing_off = self.health().retry_at.is_some();
        self.gauges.state(backing_off).dec();
    }
}

/// Marks a push outstanding on a connection until dropped.
pub(super) struct InFlight<'a>(&'a WorkerEndpoint);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.gauges.in_flight.dec();
    }
}

#[derive(Default)]
struct Health {
    consecutive_failures: u32,
    /// While backing off: no push before this instant.
    retry_at: Option<Instant>,
    /// While backing off, one push at a time probes the endpoint.
    probing: bool,
}

/// When a worker URL's last failure line was logged, and how many failures
/// went unlogged since.
#[derive(Default)]
struct FailureLog {
    last_logged: Option<Instant>,
    unlogged_failures: u64,
}

impl FailureLog {
    /// Counts a failure at `now`; when a line is due, how many failures
    /// went unlogged before it.
    fn failure_at(&mut self, now: Instant) -> Option<u64> {
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

impl WorkerEndpoint {
    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Counts a push outstanding on this connection for the guard's life.
    pub(super) fn begin(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.gauges.in_flight.inc();
        InFlight(self)
    }

    fn available_at(&self) -> Instant {
        let health = self.health();
        match health.retry_at {
            Some(at) if health.probing => at.max(Instant::now() + MIN_ENDPOINT_BACKOFF),
            Some(at) => at,
            None => Instant::now() - Duration::from_millis(1),
        }
    }

    /// Waits until this connection may be tried: at once while healthy;
    /// while backing off, one probe at a time once the backoff has passed.
    /// Gives up at `deadline`.
    pub(super) async fn admit(&self, deadline: Instant) -> Result<Admission<'_>, ()> {
        loop {
            let admitted = {
                let mut health = self.health();
                let probing = health.probing;
                health
                    .admit_at(Instant::now())
                    .map(|()| !probing && health.probing)
            };
            let wait_until = match admitted {
                Ok(probe) => {
                    return Ok(Admission {
                        endpoint: self,
                        probe,
                        settled: false,
                    });
                }
                Err(at) => at,
            };
            if wait_until >= deadline {
                tokio::time::sleep_until(deadline).await;
                return Err(());
            }
            tokio::time::sleep_until(wait_until).await;
        }
    }

    fn record(&self, outcome: &PushOutcome) {
        let healthy = outcome.endpoint_healthy();
        let now = Instant::now();
        let recovered = {
            let mut health = self.health();
            let recovered = healthy && health.consecutive_failures > 0;
            let was_backing_off = health.retry_at.is_some();
            health.record_at(healthy, now);
            let backing_off = health.retry_at.is_some();
            if backing_off != was_backing_off {
                self.gauges.state(was_backing_off).dec();
                self.gauges.state(backing_off).inc();
            }
            recovered
        };
        if healthy {
            if recovered {
                tracing::info!(endpoint = %self.url, address = ?self.address, "worker endpoint recovered");
            }
            return;
        }
        let due = self
            .failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .failure_at(now);
        let Some(unlogged) = due else { return };
        let detail = outcome.detail();
        tracing::warn!(
            endpoint = %self.url,
            address = ?self.address,
            result = outcome.label(),
            detail,
            failures_since_last_log = unlogged,
            "push to worker failed; backing off"
        );
    }
}

/// A push [`WorkerEndpoint::admit`] let through. Recording its outcome
/// settles it. Dropped unrecorded (the push was not sent after all: the
/// broker's liveness refused it, or the pool stopped), it gives back the
/// probe slot it may hold, so the connection's next push probes instead of
/// the connection waiting for an outcome that never comes.
pub(super) struct Admission<'a> {
    endpoint: &'a WorkerEndpoint,
    /// This push is the one probe of a connection that is backing off.
    probe: bool,
    settled: bool,
}

impl Admission<'_> {
    pub(super) fn record(mut self, outcome: &PushOutcome) {
        self.settled = true;
        self.endpoint.record(outcome);
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if self.probe && !self.settled {
            self.endpoint.health().abandon_probe();
        }
    }
}

/// A connection's backoff as a state machine over explicit instants (the
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

    /// The probe was not sent: the backoff stands, and the next push after
    /// it may probe.
    fn abandon_probe(&mut self) {
        self.probing = false;
    }

    /// Records a push's outcome at `now`: success resets the backoff, a
    /// failure doubles it (from [`MIN_ENDPOINT_BACKOFF`] up to
    /// [`MAX_ENDPOINT_BACKOFF`]).
    fn record_at(&mut self, healthy: bool, now: Instant) {
        self.probing = false;
        if healthy {
            self.consecutive_failures = 0;
            self.retry_at = None;
            return;
        }
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        let exponent = self.consecutive_failures.saturating_sub(1).min(16);
        let backoff = MIN_ENDPOINT_BACKOFF
            .saturating_mul(1 << exponent)
            .min(MAX_ENDPOINT_BACKOFF);
        self.retry_at = Some(now + backoff);
    }
}

#[cfg(test)]
#[path = "endpoints_tests.rs"]
mod tests;
