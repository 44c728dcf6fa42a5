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
//!
//! And it carries the push pool's byte budget ([`PushBytes`],
//! `PUSH_QUEUE_BYTES`): a FetchActor takes an activation's bytes from it
//! before handing the activation over, the guard holds them, and they come
//! back when the guard goes (the push's outcome written, or the claim
//! released), so the activations queued in the pool's mailbox and being
//! pushed never add up to more than the budget plus one.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;

use super::liveness::Liveness;
use super::store::StoreHandle;
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
    /// Bytes of the activations handed to the push pool.
    push_bytes: PushBytes,
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
            push_bytes: PushBytes::new(usize::MAX),
        }
    }

    /// The same registry, its push pool bounded to `limit` bytes of
    /// activations (`PUSH_QUEUE_BYTES`).
    pub fn with_push_bytes(mut self, limit: usize) -> Self {
        self.push_bytes = PushBytes::new(limit);
        self
    }

    pub fn liveness(&self) -> &Liveness {
        &self.liveness
    }

    pub fn push_bytes(&self) -> &PushBytes {
        &self.push_bytes
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

/// The push pool's byte budget: bytes taken by the activations in its
/// mailbox and in its pushes, at most `limit` unless a single activation is
/// larger (a pool holding nothing always takes one).
#[derive(Debug, Clone)]
pub struct PushBytes {
    budget: Arc<Budget>,
}

#[derive(Debug)]
struct Budget {
    held: AtomicUsize,
    limit: usize,
}

impl PushBytes {
    pub fn new(limit: usize) -> Self {
        PushBytes {
            budget: Arc::new(Budget {
                held: AtomicUsize::new(0),
                limit,
            }),
        }
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.budget.held.load(Ordering::Acquire)
    }

    /// Takes `bytes` from the budget, unless that would pass the limit while
    /// something is held already.
    pub fn try_take(&self, bytes: usize) -> Option<HeldBytes> {
        let held = &self.budget.held;
        let mut current = held.load(Ordering::Acquire);
        loop {
            if current > 0 && current.saturating_add(bytes) > self.budget.limit {
                return None;
            }
            match held.compare_exchange_weak(
                current,
                current.saturating_add(bytes),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Some(HeldBytes {
                        budget: Arc::clone(&self.budget),
                        bytes,
                    });
                }
                Err(actual) => current = actual,
            }
        }
    }
}

/// Bytes taken from a [`PushBytes`] budget, given back when dropped.
#[derive(Debug)]
pub struct HeldBytes {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// One claimed activation's fence, releasing itself if dropped while armed.
pub struct ClaimGuard {
    token: Option<ClaimToken>,
    /// The push pool's bytes this activation holds while handed over.
    bytes: Option<HeldBytes>,
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
            bytes: None,
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

    /// Holds `bytes` of the push pool's budget until the guard goes (or
    /// [`ClaimGuard::give_back_bytes`]).
    pub fn hold_bytes(&mut self, bytes: HeldBytes) {
        self.bytes = Some(bytes);
    }

    /// The push pool refused the activation: its bytes go back at once.
    pub fn give_back_bytes(&mut self) {
        self.bytes = None;
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
        let _ = self.store.release_in_background(vec![token]);
    }
}
