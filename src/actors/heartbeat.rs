//! The broker's row in the store, kept by the UpkeepActor on a timer of its
//! own (DESIGN.md, "Broker identity and recovery"):
//!
//! - **Join** (startup, and again after being taken over): write the row
//!   with a fresh incarnation, release the claims earlier incarnations of
//!   this broker id left (nobody is pushing them), then confirm the
//!   liveness, which is when the FetchActors start claiming. At startup,
//!   a row of the same id whose heartbeat is recent is either this id's
//!   previous run, dead moments ago, or another live process given the
//!   same id by mistake: the broker watches it for one and a half
//!   heartbeat intervals, and if it moves, refuses to start (releasing a
//!   live broker's claims would have them pushed twice).
//! - **Beat** (every `HEARTBEAT_INTERVAL_MS`): refresh `heartbeat_at`; an
//!   accepted beat extends the liveness (`liveness.rs`). A beat that finds
//!   the row gone or replaced means a peer took this broker over while it
//!   was frozen or cut off: the liveness generation moves on, so no claim
//!   made before is pushed, and the broker joins again. A row another
//!   incarnation wrote means a second process runs with this id: the
//!   broker stops pushing and fails, naming `TASKBROKER_BROKER_ID`.
//! - **Take over** (after each accepted beat): every peer whose heartbeat
//!   is older than `TAKEOVER_TIMEOUT_MS` loses its row, and its claims go
//!   back to Pending in the same statement. Counted, one log line each.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::liveness::Liveness;
use super::store::StoreHandle;
use crate::metrics::Metrics;
use crate::model::{BeatAnswer, Takeover};
use crate::store::{StoreError, StoreResult};
use crate::supervisor::Health;

/// How long a stopping broker waits to remove its row from the brokers
/// table.
const LEAVE_LIMIT: Duration = Duration::from_secs(2);

/// The broker's membership as its owner (the UpkeepActor) keeps it: the
/// incarnation it runs as, whether it has joined, and one turn of work at
/// a time.
pub struct Member {
    config: MembershipConfig,
    store: StoreHandle,
    metrics: Arc<Metrics>,
    /// Told when another process turns out to use this broker id.
    health: Health,
    incarnation: String,
    /// Set once joined: whether a peer was live then.
    joined: Option<bool>,
    /// Joined at least once (the duplicate-id check runs before the first).
    ever_joined: bool,
    /// A turn is under way.
    busy: bool,
    /// The last turn failed (logged once per failing stretch).
    failing: bool,
}

impl Member {
    pub fn new(
        config: MembershipConfig,
        store: StoreHandle,
        metrics: Arc<Metrics>,
        health: Health,
    ) -> Self {
        Member {
            config,
            store,
            metrics,
            health,
            incarnation: new_incarnation(),
            joined: None,
            ever_joined: false,
            busy: false,
            failing: false,
        }
    }

    /// How often [`Member::turn`] should run.
    pub fn interval(&self) -> Duration {
        self.config.heartbeat_interval
    }

    /// `None` until joined; then whether a peer was live when it joined.
    pub fn joined(&self) -> Option<bool> {
        self.joined
    }

    /// The work of one timer turn (join while not joined, else beat), to
    /// be handed to [`Member::settle`]; `None` while the last turn runs.
    pub fn turn(&mut self) -> Option<impl Future<Output = Result<Kept, JoinError>> + 'static> {
        if self.busy {
            return None;
        }
        self.busy = true;
        let (store, config, metrics) = (
            self.store.clone(),
            self.config.clone(),
            Arc::clone(&self.metrics),
        );
        let incarnation = self.incarnation.clone();
        let joining = self.joined.is_none();
        let first_join = joining && !self.ever_joined;
        Some(async move {
            if !joining {
                return Ok(Kept::Beat(
                    beat(&store, &config, &incarnation, &metrics).await?,
                ));
            }
            if first_join {
                check_unique(&store, &config).await?;
            }
            Ok(Kept::Joined(
                join(&store, &config, &incarnation, &metrics).await?,
            ))
        })
    }

    /// Takes a turn's outcome; answers whether rows became claimable (or
    /// claiming became possible), so the FetchActors should look now.
    pub fn settle(&mut self, result: Result<Kept, JoinError>) -> bool {
        self.busy = false;
        let failing = result.is_err();
        let wake = match result {
            Ok(Kept::Joined(joined)) => {
                tracing::info!(
                    broker_id = %self.config.broker_id,
                    live_peers = joined.live_peers,
                    released = joined.released,
                    "broker joined: claims of its previous run released"
                );
                self.joined = Some(joined.live_peers > 0);
                self.ever_joined = true;
                // They backed off while they could not claim.
                true
            }
            Ok(Kept::Beat(Beat::Alive(takeovers))) => {
                takeovers.iter().any(|takeover| takeover.released > 0)
            }
            Ok(Kept::Beat(Beat::TakenOver)) => {
                tracing::error!(
                    broker_id = %self.config.broker_id,
                    "this broker's row was taken over (it was silent past \
                     TASKBROKER_TAKEOVER_TIMEOUT_MS): the claims it holds are released \
                     unpushed and it joins again"
                );
                self.incarnation = new_incarnation();
                self.joined = None;
                false
            }
            Ok(Kept::Beat(Beat::Replaced)) => {
                self.health.fail(format!(
                    "another process registered as this broker (TASKBROKER_BROKER_ID={}): \
                     this one stops pushing; give every broker its own id",
                    self.config.broker_id
                ));
                false
            }
            Err(JoinError::DuplicateId(why)) => {
                self.health.fail(why);
                false
            }
            Err(JoinError::Store(err)) => {
                if !self.failing {
                    tracing::warn!(error = %err, "heartbeat failed; claiming and pushing stop once it is overdue");
                }
                false
            }
        };
        self.failing = failing;
        wake
    }

    /// A clean stop: removes this broker's row (a clean stop is no
    /// takeover), waiting at most [`LEAVE_LIMIT`].
    pub fn leave(&self) -> impl Future<Output = ()> + 'static {
        let leave = self.store.unregister_broker(self.incarnation.clone());
        async move {
            // Bounded: with the database away, stopping must not wait for
            // it; a peer takes the row over instead.
            match tokio::time::timeout(LEAVE_LIMIT, leave).await {
                Ok(Ok(_)) => {}
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, "cannot remove this broker's row; a peer will take it over");
                }
                Err(_) => {
                    tracing::warn!(
                        "removing this broker's row timed out; a peer will take it over"
                    );
                }
            }
        }
    }
}

/// Settings of the broker's membership.
#[derive(Debug, Clone)]
pub struct MembershipConfig {
    /// The store's broker id, for logs.
    pub broker_id: String,
    /// Where this broker runs, for operators reading the brokers table.
    pub host: String,
    pub heartbeat_interval: Duration,
    pub takeover_timeout: Duration,
    /// Shared with the push pipeline's claim registry.
    pub liveness: Liveness,
}

impl MembershipConfig {
    /// How long an accepted heartbeat lets the broker claim and push: the
    /// takeover timeout less one interval (see `liveness.rs`).
    pub fn live_window(heartbeat_interval: Duration, takeover_timeout: Duration) -> Duration {
        takeover_timeout.saturating_sub(heartbeat_interval)
    }
}

/// What joining found.
#[derive(Debug, Clone, Copy)]
pub struct Joined {
    /// Peers that were live: workers had a broker to report to meanwhile.
    pub live_peers: u64,
    /// Claims of earlier incarnations returned to Pending.
    pub released: u64,
}

/// A fresh incarnation: a new one on every join.
pub fn new_incarnation() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Why joining failed.
#[derive(Debug)]
pub enum JoinError {
    /// Retried on the next heartbeat tick.
    Store(StoreError),
    /// Another live process uses this broker id: the broker must not run.
    DuplicateId(String),
}

impl From<StoreError> for JoinError {
    fn from(err: StoreError) -> Self {
        JoinError::Store(err)
    }
}

/// At startup, before joining: fails when a row of this broker id has a
/// heartbeat that is recent and still moving, i.e. another live process
/// uses the id. A recent row that stays still was this id's previous run.
pub async fn check_unique(store: &StoreHandle, config: &MembershipConfig) -> Result<(), JoinError> {
    let Some(first) = store.read_broker().await? else {
        return Ok(());
    };
    if first.silent_for >= config.takeover_timeout {
        return Ok(());
    }
    tokio::time::sleep(config.heartbeat_interval.saturating_mul(3) / 2).await;
    match store.read_broker().await? {
        Some(now)
            if now.incarnation == first.incarnation && now.heartbeat_at > first.heartbeat_at =>
        {
            Err(JoinError::DuplicateId(format!(
                "another running broker uses TASKBROKER_BROKER_ID={} (its heartbeat in \
                 taskbroker_brokers keeps moving); give every broker its own id",
                config.broker_id
            )))
        }
        _ => Ok(()),
    }
}

/// Writes this broker's row as `incarnation`, releases what earlier
/// incarnations claimed, and confirms the liveness from the moment the
/// registration was sent.
pub async fn join(
    store: &StoreHandle,
    config: &MembershipConfig,
    incarnation: &str,
    metrics: &Metrics,
) -> StoreResult<Joined> {
    let sent = Instant::now();
    let registration = store
        .register_broker(
            config.host.clone(),
            incarnation.to_owned(),
            config.takeover_timeout,
        )
        .await?;
    let released = store.release_previous_claims().await?;
    metrics
        .claims_released
        .with_label_values(&["restart"])
        .inc_by(released);
    config.liveness.confirmed(sent);
    Ok(Joined {
        live_peers: registration.live_peers,
        released,
    })
}

/// What one turn of the heartbeat timer did.
#[derive(Debug)]
pub enum Kept {
    Joined(Joined),
    Beat(Beat),
}

/// How a beat went.
#[derive(Debug)]
pub enum Beat {
    /// Accepted; these silent peers were taken over.
    Alive(Vec<Takeover>),
    /// The row was gone: taken over.
    TakenOver,
    /// The row was another incarnation's: a second process uses this id.
    Replaced,
}

/// One heartbeat, then (if it was accepted and counted a silent peer) the
/// takeover of silent peers.
pub async fn beat(
    store: &StoreHandle,
    config: &MembershipConfig,
    incarnation: &str,
    metrics: &Arc<Metrics>,
) -> StoreResult<Beat> {
    let sent = Instant::now();
    let answer = store
        .heartbeat(incarnation.to_owned(), config.takeover_timeout)
        .await?;
    let silent_peers = match answer {
        BeatAnswer::Accepted { silent_peers } => silent_peers,
        BeatAnswer::TakenOver => {
            config.liveness.taken_over();
            return Ok(Beat::TakenOver);
        }
        BeatAnswer::Replaced => {
            config.liveness.taken_over();
            return Ok(Beat::Replaced);
        }
    };
    config.liveness.confirmed(sent);
    // Nobody silent (the usual beat): no takeover statement at all.
    if silent_peers == 0 {
        return Ok(Beat::Alive(Vec::new()));
    }
    // The beat itself was accepted (this broker stays live); a failed
    // takeover is tried again at the next beat that counts a silent peer.
    let takeovers = match store.take_over_silent(config.takeover_timeout).await {
        Ok(takeovers) => takeovers,
        Err(err) => {
            crate::warn_throttled!(error = %err, silent_peers, "cannot take over silent brokers; trying again at the next heartbeat");
            return Ok(Beat::Alive(Vec::new()));
        }
    };
    for takeover in &takeovers {
        metrics.broker_takeovers.inc();
        metrics
            .claims_released
            .with_label_values(&["takeover"])
            .inc_by(takeover.released);
        tracing::warn!(
            broker_id = %takeover.broker_id,
            host = %takeover.host,
            silent_ms = takeover.silent_for.as_millis() as u64,
            released = takeover.released,
            "took over a silent broker: its claims are back to Pending"
        );
    }
    Ok(Beat::Alive(takeovers))
}
