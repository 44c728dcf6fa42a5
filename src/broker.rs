//! Assembling the actors into a running broker, and taking them down again.
//!
//! Each group of actors gets an Arbiter (a thread with its own event loop) so
//! the broker uses every core: the StoreActor and its queries on one, the
//! push pool and its RPCs on another, the FetchActors on a third.
//!
//! Stopping a push pipeline goes in the order that strands nothing: the
//! FetchActors finish their current batch (submitted or released) and stop;
//! the push pool takes everything already in its mailbox and lets in-flight
//! pushes finish; then any claim still held is released in one statement.

use std::sync::Arc;

use actix::prelude::*;

use crate::actors::claims::ClaimRegistry;
use crate::actors::fetch::{FetchConfig, StopFetching, WakeFetch};
use crate::actors::push_pool::{DrainPushPool, PushPoolConfig, StopPushPool};
use crate::actors::store::ReleaseClaims;
use crate::actors::{FetchActor, PushPoolActor, StoreActor};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::store::BucketRange;

/// What a push pipeline needs from the configuration.
#[derive(Debug, Clone)]
pub struct PushPipelineConfig {
    pub fetch_actors: usize,
    pub fetch: FetchConfig,
    pub push: PushPoolConfig,
}

impl PushPipelineConfig {
    /// `host_name` fills in the advertised gRPC address when it is not set.
    pub fn from_config(config: &Config, host_name: &str) -> Self {
        PushPipelineConfig {
            fetch_actors: config.fetch_actors,
            fetch: FetchConfig {
                batch_size: config.fetch_batch_size,
                backoff: config.fetch_backoff,
                queue_timeout: config.push_queue_timeout,
                lease: config.claim_lease(),
            },
            push: PushPoolConfig {
                concurrency: config.push_concurrency,
                queue_size: config.push_queue_size,
                push_timeout: config.push_timeout,
                deadline_grace: config.processing_deadline_grace,
                max_attempts: config.max_processing_attempts,
                callback_url: config.advertised_addr(host_name),
                signing_secret: config.grpc_shared_secrets.first().cloned(),
                endpoints: config.worker_endpoints.clone(),
            },
        }
    }
}

/// FetchActors and the PushPoolActor, running.
pub struct PushPipeline {
    pub push_pool: Addr<PushPoolActor>,
    pub fetchers: Vec<Addr<FetchActor>>,
    /// Every claim currently held in memory.
    pub registry: ClaimRegistry,
    store: Addr<StoreActor>,
    metrics: Arc<Metrics>,
    arbiters: Vec<Arbiter>,
}

impl PushPipeline {
    /// Starts the push pool and `fetch_actors` FetchActors, actor i owning
    /// bucket range i of `fetch_actors`.
    pub fn start(
        config: PushPipelineConfig,
        store: Addr<StoreActor>,
        metrics: Arc<Metrics>,
    ) -> Result<PushPipeline, String> {
        PushPoolActor::validate(&config.push)?;
        let registry = ClaimRegistry::new();
        let push_arbiter = Arbiter::new();
        let push_pool = {
            let (push, store, metrics) = (config.push.clone(), store.clone(), Arc::clone(&metrics));
            PushPoolActor::start_in_arbiter(&push_arbiter.handle(), move |_| {
                PushPoolActor::new(push, store, metrics)
            })
        };
        let fetch_arbiter = Arbiter::new();
        let count = u16::try_from(config.fetch_actors.clamp(1, 256)).unwrap_or(1);
        let fetchers = (0..count)
            .map(|index| {
                let actor = FetchActor::new(
                    BucketRange::slice(index, count),
                    config.fetch.clone(),
                    store.clone(),
                    push_pool.clone(),
                    registry.clone(),
                    Arc::clone(&metrics),
                );
                FetchActor::start_in_arbiter(&fetch_arbiter.handle(), move |_| actor)
            })
            .collect();
        Ok(PushPipeline {
            push_pool,
            fetchers,
            registry,
            store,
            metrics,
            arbiters: vec![push_arbiter, fetch_arbiter],
        })
    }

    /// New rows were stored: let idle FetchActors claim them now.
    pub fn wake(&self) {
        for fetcher in &self.fetchers {
            fetcher.do_send(WakeFetch);
        }
    }

    /// Stops fetching and pushing without stranding a claim (see the module
    /// docs for the order).
    pub async fn stop(self) {
        for fetcher in &self.fetchers {
            // Resolves after the current batch is submitted or released.
            let _ = fetcher.send(StopFetching).await;
        }
        let _ = self.push_pool.send(DrainPushPool).await;
        let _ = self.push_pool.send(StopPushPool).await;
        let left: Vec<_> = self.registry.snapshot().into_iter().collect();
        if !left.is_empty() {
            let count = left.len() as u64;
            match self.store.send(ReleaseClaims { claims: left }).await {
                Ok(Ok(released)) => {
                    self.metrics
                        .claims_released
                        .with_label_values(&["shutdown"])
                        .inc_by(released);
                }
                _ => tracing::warn!(count, "cannot release claims at shutdown; leases will"),
            }
        }
        for arbiter in self.arbiters {
            arbiter.stop();
        }
    }
}
