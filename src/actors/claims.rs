//! Claims held in memory: every activation a FetchActor claimed is carried
//! by a [`ClaimGuard`] until the store write that ends the claim (mark
//! processing, undo, release) has completed.
//!
//! A guard that is dropped while still armed (a mailbox dropped when the
//! push pool stopped, a task cancelled at shutdown) releases its claim, so
//! no claim is left for the lease to clean up. The [`ClaimRegistry`] lists
//! every live guard: it is what shutdown releases in one statement, and what
//! tests compare with the table to prove no Claimed row is unheld.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use actix::Addr;

use super::store::{ReleaseClaims, StoreActor};
use crate::metrics::Metrics;
use crate::store::ClaimToken;

/// The claims this broker currently holds.
#[derive(Debug, Default, Clone)]
pub struct ClaimRegistry {
    held: Arc<Mutex<HashSet<ClaimToken>>>,
}

impl ClaimRegistry {
    pub fn new() -> Self {
        Self::default()
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
    registry: ClaimRegistry,
    store: Addr<StoreActor>,
    metrics: Arc<Metrics>,
}

impl ClaimGuard {
    pub fn new(
        token: ClaimToken,
        registry: ClaimRegistry,
        store: Addr<StoreActor>,
        metrics: Arc<Metrics>,
    ) -> Self {
        registry.insert(token.clone());
        ClaimGuard {
            token: Some(token),
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
        self.registry.remove(&token);
        self.metrics
            .claims_released
            .with_label_values(&["dropped"])
            .inc();
        // Fire and forget: if the store is gone too, the lease returns it.
        let _ = self.store.try_send(ReleaseClaims {
            claims: vec![token],
        });
    }
}
