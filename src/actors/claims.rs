//! Claims held in memory: every activation a FetchActor claimed is carried
//! by a [`ClaimGuard`] until the store write that ends the claim (mark
//! processing, undo, release) has completed.
//!
//! A guard that is dropped while still armed (a mailbox dropped when the
//! push pool stopped, a task cancelled) releases its claim, so no claim is
//! left for the lease to clean up. The [`ClaimRegistry`] lists every live
//! guard: it is what shutdown releases in one statement, and what tests
//! compare with the table to prove no Claimed row is unheld.
//!
//! The registry also carries the pipeline's shutdown signal
//! ([`ClaimRegistry::begin_shutdown`]): FetchActors stop claiming and the
//! push pool stops pushing as soon as it is raised, and from then on a guard
//! dropped while armed stays registered instead of releasing its claim on
//! its own, so everything not pushed is released by the one final statement.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

use super::liveness::Liveness;
use super::store::{ReleaseClaims, StoreHandle};
use crate::metrics::Metrics;
use crate::model::ClaimToken;

/// The claims this broker currently holds, and whether the pipeline holding
/// them is shutting down.
#[derive(Debug, Clone)]
pub struct ClaimRegistry {
    held: Arc<Mutex<HashSet<ClaimToken>>>,
    shutdown: Arc<watch::Sender<bool>>,
    /// Whether this broker may still claim and push (`liveness.rs`).
    liveness: Liveness,
}

impl Default for ClaimRegistry {
    /// Unfenced: for a pipeline run without a broker row.
    fn default() -> Self {
        ClaimRegistry::fenced_by(Liveness::unfenced())
    }
}

impl ClaimRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry whose holders claim and push only while `liveness` allows.
    pub fn fenced_by(liveness: Liveness) -> Self {
        ClaimRegistry {
            held: Arc::default(),
            shutdown: Arc::new(watch::Sender::new(false)),
            liveness,
        }
    }

    pub fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    /// Shutdown begins: holders stop claiming and pushing, and a guard
    /// dropped from now on leaves its claim here for [`Self::take_all`].
    pub fn begin_shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// Resolves once [`Self::begin_shutdown`] has been called.
    pub async fn shutting_down(&self) {
        let mut signal = self.shutdown.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = signal.wait_for(|stopping| *stopping).await;
    }

    /// Removes and returns every held claim (the final release at shutdown).
    pub fn take_all(&self) -> Vec<ClaimToken> {
        self.lock().drain().collect()
    }

    fn insert(&self, token: ClaimToken) {
        self.lock().insert(token);
    }

    fn remove(&self, token: &ClaimToken) {
        self.lock().remove(token);
    }

    /// A snapshot of every held claim.
    pub fn snapshot(&self) -> HashSet<ClaimToken> {
        self.lock().clone()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<ClaimToken>> {
        // The set stays consistent even if a holder panicked mid-insert.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One claimed activation's fence, releasing itself if dropped while armed.
pub struct ClaimGuard {
    token: Option<ClaimToken>,
    /// The liveness generation the claim was made in (`liveness.rs`).
    generation: u64,
    /// When the claim was handed to this guard (just after the claim
    /// statement returned), for the claimed → pushed stage.
    claimed_at: std::time::Instant,
    registry: ClaimRegistry,
    store: StoreHandle,
    metrics: Arc<Metrics>,
}

impl ClaimGuard {
    pub fn new(
        token: ClaimToken,
        registry: ClaimRegistry,
        store: StoreHandle,
        metrics: Arc<Metrics>,
    ) -> Self {
        registry.insert(token.clone());
        ClaimGuard {
            token: Some(token),
            generation: 0,
            claimed_at: std::time::Instant::now(),
            registry,
            store,
            metrics,
        }
    }

    pub fn token(&self) -> &ClaimToken {
        self.token
            .as_ref()
            .unwrap_or_else(|| unreachable!("a guard holds its token until it is consumed"))
    }

    pub fn claimed_at(&self) -> std::time::Instant {
        self.claimed_at
    }

    /// The claim was made in liveness `generation` (read before the claim
    /// statement was sent).
    pub fn in_generation(mut self, generation: u64) -> Self {
        self.generation = generation;
        self
    }

    /// Whether this claim may be pushed now: its generation is current
    /// and this broker's heartbeat is recent (`liveness.rs`). No query.
    pub fn may_push(&self) -> bool {
        self.registry.liveness.may_push(self.generation)
    }

    /// The write ending this claim completed (or was handed to a statement
    /// that covers it): stop holding it, release nothing.
    pub fn settle(mut self) {
        if let Some(token) = self.token.take() {
            self.registry.remove(&token);
        }
    }
}

impl std::fmt::Debug for ClaimGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimGuard")
            .field("token", &self.token)
            .finish_non_exhaustive()
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        let Some(token) = self.token.take() else {
            return;
        };
        if self.registry.is_shutting_down() {
            // Left registered: the final release at shutdown covers it, in
            // one statement with every other claim not pushed.
            return;
        }
        self.registry.remove(&token);
        self.metrics
            .claims_released
            .with_label_values(&["dropped"])
            .inc();
        // Fire and forget: if the store is gone too, the lease returns it.
        let _ = self.store.send_and_forget(ReleaseClaims {
            claims: vec![token],
        });
    }
}
