//! Supervision and health: what the broker knows about its own parts, kept
//! as explicit state instead of read back from metric counters.
//!
//! Every long-lived actor is watched. One that stops while the broker is not
//! stopping (a panic in a handler, a consumer that could not start, a loop
//! that ended) is a *failure*: the broker logs it, reports NOT_SERVING on
//! gRPC health and 503 on `/ready` at once, stops what is left in the usual
//! order and exits non-zero, so the orchestrator restarts the whole process.
//!
//! Why the process and not the actor: a restarted ConsumerActor would need
//! its group membership, its partitions' generations and its uncommitted
//! batch back, and a restarted StoreActor its combined writes; a fresh
//! process gets all of that right by construction (claims return through
//! their lease, offsets from the last commit). The FetchActors and the
//! UpkeepActor hold nothing that a restart could lose, so restarting them in
//! place would be safe, but one rule for every actor is easier to operate:
//! a broker that lost a part says so and is replaced.
//!
//! The other inputs of health are reported here by their owners: the
//! UpkeepActor after each completed cycle, the consumer when its partition
//! assignment changes. The store is asked with a cheap ping.
//!
//! A leaf apart from actix and tokio: actors report into it, the broker and
//! the endpoints read it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

/// The broker's view of itself, shared by every part (cheap to clone).
#[derive(Clone)]
pub struct Health {
    inner: Arc<Inner>,
}

struct Inner {
    /// Set when an orderly stop begins: actors stopping from then on are
    /// expected.
    stopping: AtomicBool,
    /// The first failure, if any; later ones are only logged.
    failure: watch::Sender<Option<String>>,
    /// When the last upkeep cycle completed (the broker's start before one).
    upkeep_progress: Mutex<Instant>,
    /// The topics whose consumer has had an assignment (possibly empty)
    /// since it joined its group.
    joined: Mutex<std::collections::BTreeSet<String>>,
    /// How many consumers readiness waits for (one per consumed topic).
    consumers: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("stopping", &self.is_stopping())
            .field("failure", &self.failure())
            .field("consumer_joined", &self.consumer_joined())
            .finish()
    }
}

impl Default for Health {
    fn default() -> Self {
        Health::new()
    }
}

impl Health {
    pub fn new() -> Self {
        Health {
            inner: Arc::new(Inner {
                stopping: AtomicBool::new(false),
                failure: watch::channel(None).0,
                upkeep_progress: Mutex::new(Instant::now()),
                joined: Mutex::new(std::collections::BTreeSet::new()),
                consumers: std::sync::atomic::AtomicUsize::new(1),
            }),
        }
    }

    /// The orderly stop began: actors stopping from now on are expected.
    pub fn begin_stop(&self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
    }

    pub fn is_stopping(&self) -> bool {
        self.inner.stopping.load(Ordering::SeqCst)
    }

    /// Records a failure of the broker's own parts. The first one is kept
    /// and wakes [`Health::failed`]; each is logged.
    pub fn fail(&self, what: impl Into<String>) {
        let what = what.into();
        tracing::error!(failure = %what, "broker part failed; the broker stops and exits non-zero");
        self.inner.failure.send_if_modified(|failure| {
            if failure.is_some() {
                return false;
            }
            *failure = Some(what);
            true
        });
    }

    /// The first failure, if any.
    pub fn failure(&self) -> Option<String> {
        self.inner.failure.borrow().clone()
    }

    /// Resolves with the first failure, at once if there already is one.
    pub async fn failed(&self) -> String {
        let mut failures = self.inner.failure.subscribe();
        let failure = failures
            .wait_for(Option::is_some)
            .await
            .map(|failure| failure.clone().unwrap_or_default());
        match failure {
            Ok(failure) => failure,
            // The sender lives in `inner`, which `self` keeps alive.
            Err(_) => std::future::pending().await,
        }
    }

    /// The UpkeepActor completed a cycle.
    pub fn upkeep_cycle_completed(&self) {
        if let Ok(mut progress) = self.inner.upkeep_progress.lock() {
            *progress = Instant::now();
        }
    }

    /// Time since the last completed upkeep cycle (or since the start).
    pub fn since_upkeep_progress(&self) -> Duration {
        self.inner
            .upkeep_progress
            .lock()
            .map(|progress| progress.elapsed())
            .unwrap_or_default()
    }

    /// How many consumers (one per consumed topic) must join before the
    /// broker is ready; one unless the broker says otherwise.
    pub fn expect_consumers(&self, count: usize) {
        self.inner.consumers.store(count.max(1), Ordering::SeqCst);
    }

    /// The consumer of `topic` received an assignment (an empty one counts:
    /// more replicas than partitions).
    pub fn consumer_assigned(&self, topic: &str) {
        self.inner
            .joined
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(topic.to_owned());
    }

    /// Whether every consumer has joined its group and received an
    /// assignment.
    pub fn consumer_joined(&self) -> bool {
        let joined = self
            .inner
            .joined
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len();
        joined >= self.inner.consumers.load(Ordering::SeqCst)
    }
}

/// One watched actor: its name for logs, and whether it is still running.
pub struct Watched {
    pub name: String,
    pub alive: Box<dyn Fn() -> bool + Send>,
}

impl Watched {
    /// Watches a part through a check of whether it still runs.
    pub fn new(name: impl Into<String>, alive: impl Fn() -> bool + Send + 'static) -> Watched {
        Watched {
            name: name.into(),
            alive: Box::new(alive),
        }
    }

    /// Watches an actor through one of its addresses: the actor has stopped
    /// once its mailbox no longer accepts messages.
    pub fn actor<A: actix::Actor>(name: impl Into<String>, addr: &actix::Addr<A>) -> Watched {
        let addr = addr.clone();
        Watched {
            name: name.into(),
            alive: Box::new(move || addr.connected()),
        }
    }
}

/// Checks every `interval` that each watched actor still runs, and records
/// a failure for the first that stopped while the broker was not stopping.
/// Returns once the broker stops or a failure is recorded.
pub async fn watch_actors(health: Health, watched: Vec<Watched>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if health.is_stopping() || health.failure().is_some() {
            return;
        }
        if let Some(stopped) = watched.iter().find(|actor| !(actor.alive)()) {
            // The orderly stop may have begun between the two checks.
            if !health.is_stopping() {
                health.fail(format!("{} stopped unexpectedly", stopped.name));
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_failure_is_kept_and_wakes_waiters() {
        let health = Health::new();
        let waiter = tokio::spawn({
            let health = health.clone();
            async move { health.failed().await }
        });
        health.fail("consumer stopped unexpectedly");
        health.fail("upkeep stopped unexpectedly");
        assert_eq!(waiter.await.unwrap(), "consumer stopped unexpectedly");
        assert_eq!(health.failed().await, "consumer stopped unexpectedly");
    }

    /// The watcher sees an actor whose handler panicked as stopped: tokio
    /// catches the panic in the actor's task, which drops its mailbox.
    #[actix_rt::test]
    async fn an_actor_whose_handler_panics_is_a_failure() {
        use actix::prelude::*;

        struct Fragile;
        impl Actor for Fragile {
            type Context = Context<Self>;
        }
        #[derive(Message)]
        #[rtype(result = "()")]
        struct Break;
        impl Handler<Break> for Fragile {
            type Result = ();
            fn handle(&mut self, _: Break, _: &mut Context<Self>) {
                panic!("a bug in a handler");
            }
        }

        let arbiter = Arbiter::new();
        let addr = Fragile::start_in_arbiter(&arbiter.handle(), |_| Fragile);
        let health = Health::new();
        let watched = vec![Watched::actor("the fragile actor", &addr)];
        addr.do_send(Break);
        tokio::time::timeout(
            Duration::from_secs(10),
            watch_actors(health.clone(), watched, Duration::from_millis(5)),
        )
        .await
        .expect("the watcher notices the panicked actor");
        assert_eq!(
            health.failure().as_deref(),
            Some("the fragile actor stopped unexpectedly")
        );
        arbiter.stop();
    }

    #[tokio::test]
    async fn a_stopped_part_is_a_failure_unless_the_broker_is_stopping() {
        let alive = Arc::new(AtomicBool::new(true));
        let watched = |alive: &Arc<AtomicBool>| {
            let alive = Arc::clone(alive);
            vec![Watched {
                name: "fetch actor 0".into(),
                alive: Box::new(move || alive.load(Ordering::SeqCst)),
            }]
        };

        let health = Health::new();
        health.begin_stop();
        alive.store(false, Ordering::SeqCst);
        watch_actors(health.clone(), watched(&alive), Duration::from_millis(1)).await;
        assert_eq!(health.failure(), None, "stopping parts are expected");

        let health = Health::new();
        watch_actors(health.clone(), watched(&alive), Duration::from_millis(1)).await;
        assert_eq!(
            health.failure().as_deref(),
            Some("fetch actor 0 stopped unexpectedly")
        );
    }
}
