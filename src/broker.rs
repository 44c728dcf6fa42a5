//! Assembling the actors into a running broker, and taking them down again.
//!
//! Each group of actors gets an Arbiter (a thread with its own event loop) so
//! the broker uses every core: the StoreActor and its queries on one, the
//! push pool and its RPCs on another, the FetchActors on a third.
//!
//! Stopping goes in the order that loses and strands nothing and waits for
//! nothing it need not: the consumer stores and commits what it read; the
//! push pipeline's shutdown signal stops every FetchActor (even mid-batch)
//! and the push pool at once, so nothing more is claimed or pushed; pushes
//! already in flight end within their push timeout; every claim not pushed
//! (the rest of a batch, the pool's mailbox, the message it held waiting for
//! a slot) is released in one statement; upkeep stops; the store goes last.
//!
//! While it runs, every actor is watched (`crate::supervisor`): one that
//! stops on its own is a failure that turns health NOT_SERVING and unready,
//! and `taskbroker run` then stops the rest and exits non-zero.

use std::sync::Arc;

use actix::prelude::*;
use futures::StreamExt;

use crate::actors::claims::ClaimRegistry;
use crate::actors::consumer::{ConsumerActor, ConsumerConfig, StopConsuming};
use crate::actors::fetch::{FetchConfig, StopFetching, WakeFetch};
use crate::actors::heartbeat::MembershipConfig;
use crate::actors::liveness::Liveness;
use crate::actors::push_pool::{
    DrainPushPool, PushPoolConfig, Resolver, SpreadConfig, StopPushPool,
};
use crate::actors::store::StoreHandle;
use crate::actors::upkeep::{StopUpkeep, UpkeepActor, UpkeepConfig};
use crate::actors::{FetchActor, PushPoolActor};
use crate::config::{Config, ConsumedTopic, DeliveryMode, TopicAt, Topology};
use crate::kafka::KafkaSettings;
use crate::metrics::Metrics;
use crate::model::BucketRange;
use crate::runtime::{RuntimeFile, RuntimeRules};
use crate::store::ActivationStore;
use crate::supervisor::{Health, Watched, watch_actors};
use crate::wire::worker_tls::WorkerTlsFiles;

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
                batch_bytes: config.fetch_batch_bytes,
                backoff: config.fetch_backoff,
                queue_timeout: config.push_queue_timeout,
                lease: config.claim_lease(),
                fair_dispatch: config.fair_dispatch,
                // Only a `test-hooks` build can turn it off (the stranded-claim benchmark).
                #[cfg(feature = "test-hooks")]
                release_on_full: !crate::config::test_hooks::disable_release_on_full(),
            },
            push: PushPoolConfig {
                concurrency: config.push_concurrency,
                queue_size: config.push_queue_size,
                queue_bytes: config.push_queue_bytes,
                push_timeout: config.push_timeout,
                deadline_grace: config.processing_deadline_grace,
                max_attempts: config.max_processing_attempts,
                callback_url: config.advertised_addr(host_name),
                signing_secret: config.grpc_shared_secrets.first().cloned(),
                endpoints: config.worker_endpoints.clone(),
                tls: WorkerTlsFiles {
                    ca: config.worker_tls_ca.clone(),
                    cert: config.worker_tls_cert.clone(),
                    key: config.worker_tls_key.clone(),
                },
                spread: SpreadConfig {
                    connections: config.worker_connections,
                    dns_refresh: config.worker_dns_refresh,
                    resolver: Resolver::System,
                },
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
    store: StoreHandle,
    metrics: Arc<Metrics>,
    arbiters: Vec<Arbiter>,
}

impl PushPipeline {
    /// Starts the push pool and `fetch_actors` FetchActors, actor i owning
    /// bucket range i of `fetch_actors`.
    pub fn start(
        config: PushPipelineConfig,
        store: StoreHandle,
        metrics: Arc<Metrics>,
    ) -> Result<PushPipeline, String> {
        Self::start_fenced(config, store, metrics, Liveness::unfenced())
    }

    /// [`PushPipeline::start`], claiming and pushing only while `liveness`
    /// allows (the broker's heartbeat keeps it).
    pub fn start_fenced(
        config: PushPipelineConfig,
        store: StoreHandle,
        metrics: Arc<Metrics>,
        liveness: Liveness,
    ) -> Result<PushPipeline, String> {
        PushPoolActor::validate(&config.push)?;
        let registry = ClaimRegistry::fenced_by(liveness).with_push_bytes(config.push.queue_bytes);
        let push_arbiter = named_arbiter("tb-push");
        let push_pool = {
            let (push, store, metrics) = (config.push.clone(), store.clone(), Arc::clone(&metrics));
            let registry = registry.clone();
            PushPoolActor::start_in_arbiter(&push_arbiter.handle(), move |_| {
                PushPoolActor::new(push, store, metrics, registry)
            })
        };
        let fetch_arbiter = named_arbiter("tb-fetch");
        let count = u16::try_from(config.fetch_actors.clamp(1, 256)).unwrap_or(1);
        let fetchers = (0..count)
            .map(|index| {
                let actor = FetchActor::new(
                    BucketRange::slice(index, count),
                    config.fetch.clone(),
                    store.clone(),
                    // One recipient (one sender) per FetchActor, for its life.
                    push_pool.clone().recipient(),
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
        // At once: FetchActors stop claiming and submitting (mid-batch too),
        // the push pool stops pushing, and every claim dropped from now on
        // stays registered for the one release below.
        self.registry.begin_shutdown();
        for fetcher in &self.fetchers {
            // Resolves once its current iteration has seen the signal.
            let _ = fetcher.send(StopFetching).await;
        }
        // The mailbox empties at once (nothing in it is pushed); this
        // resolves when the pushes in flight have ended, within their
        // push timeout, and their outcomes are written.
        let _ = self.push_pool.send(DrainPushPool).await;
        let _ = self.push_pool.send(StopPushPool).await;
        let left = self.registry.take_all();
        if !left.is_empty() {
            let count = left.len() as u64;
            match self.store.release(left).await {
                Ok(released) => {
                    self.metrics
                        .claims_released
                        .with_label_values(&["shutdown"])
                        .inc_by(released);
                }
                Err(_) => tracing::warn!(count, "cannot release claims at shutdown; leases will"),
            }
        }
        for arbiter in self.arbiters {
            arbiter.stop();
        }
    }
}

/// The settings of `cluster` (every cluster of a validated topology exists).
pub fn cluster_settings(config: &Config, topology: &Topology, cluster: &str) -> KafkaSettings {
    topology.cluster(cluster).map_or_else(
        || KafkaSettings::from_config(config),
        |cluster| KafkaSettings::for_cluster(cluster, config.max_activation_bytes),
    )
}

impl ConsumerConfig {
    /// The consumer of one consumed topic of the topology.
    pub fn for_topic(
        config: &Config,
        topology: &Topology,
        consumed: &ConsumedTopic,
        health: Health,
        rules: RuntimeRules,
    ) -> Self {
        ConsumerConfig {
            kafka: cluster_settings(config, topology, &consumed.topic.cluster),
            cluster: consumed.topic.cluster.clone(),
            topic: consumed.topic.topic.clone(),
            group: consumed.group.clone(),
            raw: consumed.raw.clone(),
            ingest_dlq_kafka: cluster_settings(config, topology, &topology.ingest_dlq.cluster),
            auto_offset_reset: config.kafka_auto_offset_reset.as_str().to_owned(),
            ingest_dlq_topic: topology.ingest_dlq.topic.clone(),
            batch_size: config.insert_batch_size,
            batch_bytes: config.insert_batch_bytes,
            batch_max_wait: config.insert_batch_max_wait,
            max_inflight: config.max_inflight as u64,
            max_inflight_bytes: config.max_inflight_bytes,
            max_delay: config.max_delay,
            // The consumer stops first; after it the push pipeline needs
            // about one push timeout to end its pushes and release claims.
            // Half of what is left keeps the whole stop inside
            // SHUTDOWN_TIMEOUT_MS even when the database is gone.
            stop_grace: config.shutdown_timeout.saturating_sub(config.push_timeout) / 2,
            max_activation_bytes: config.max_activation_bytes,
            health,
            rules,
            forward_kafka: KafkaSettings::from_config(config),
            #[cfg(feature = "test-hooks")]
            crash_before_commit_after: None,
        }
    }
}

impl UpkeepConfig {
    pub fn from_config(config: &Config, health: Health, rules: RuntimeRules) -> Self {
        let delivery_timeout = std::time::Duration::from_secs(10);
        let topology = config.topology();
        let other_cluster = |topic: &TopicAt| {
            (!topic.on_default_cluster())
                .then(|| cluster_settings(config, &topology, &topic.cluster))
        };
        UpkeepConfig {
            interval: config.upkeep_interval,
            batch_limit: config.upkeep_batch_limit,
            max_attempts: config.max_processing_attempts,
            restart_grace: config.restart_grace,
            kafka: KafkaSettings::from_config(config),
            retry_topic: topology.retry.topic.clone(),
            dlq_topic: topology.dlq.topic.clone(),
            retry_kafka: other_cluster(&topology.retry),
            dlq_kafka: other_cluster(&topology.dlq),
            delivery_timeout,
            publish_lease: delivery_timeout * 3,
            health,
            rules,
            top_namespaces: config.metrics_top_namespaces,
            // Set by `Broker::start`, which knows the store's broker id.
            membership: None,
        }
    }
}

/// The whole broker: store, consumer, upkeep, (push mode) the pipeline, the
/// gRPC server and the metrics endpoint.
pub struct Broker {
    pub store: StoreHandle,
    /// One consumer per consumed topic, in the topology's order.
    pub consumers: Vec<Addr<ConsumerActor>>,
    pub upkeep: Addr<UpkeepActor>,
    pub pipeline: Option<PushPipeline>,
    /// Where the gRPC server and the metrics endpoint listen (resolved, so
    /// port 0 in the configuration shows the port taken).
    pub grpc_addr: std::net::SocketAddr,
    pub metrics_addr: std::net::SocketAddr,
    /// Failures of the broker's parts, upkeep progress and the consumer's
    /// assignment: what health and readiness report.
    pub health: Health,
    grpc_shutdown: tokio::sync::oneshot::Sender<()>,
    http_shutdown: tokio::sync::oneshot::Sender<()>,
    /// Resolve (or close) when the gRPC server and the metrics endpoint
    /// have finished their calls and closed their listeners.
    grpc_closed: tokio::sync::oneshot::Receiver<()>,
    http_closed: tokio::sync::oneshot::Receiver<()>,
    arbiters: Vec<Arbiter>,
}

/// How long `stop` lets the servers finish calls already under way.
const SERVER_DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long `stop` waits for the actors' threads to end once told to.
const ARBITER_JOIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A new Arbiter whose thread is named `name` (at most 15 bytes), so
/// `top -H` and the benchmarks can tell which actors use the CPU: actix
/// names every Arbiter's thread alike. Naming is best effort (Linux only).
fn named_arbiter(name: &'static str) -> Arbiter {
    let arbiter = Arbiter::new();
    arbiter.spawn_fn(move || {
        let _ = std::fs::write("/proc/thread-self/comm", name);
    });
    arbiter
}

/// Binds a listening socket now, so a taken port fails startup with a clear
/// error instead of failing later in a background task.
fn bind(addr: std::net::SocketAddr, what: &str) -> Result<std::net::TcpListener, String> {
    let listener = std::net::TcpListener::bind(addr)
        .map_err(|err| format!("cannot listen on {addr} for {what}: {err}"))?;
    listener
        .set_nonblocking(true)
        .map_err(|err| format!("{what} socket: {err}"))?;
    Ok(listener)
}

impl Broker {
    /// Starts every actor for `config` on `store` (already migrated).
    pub fn start(
        config: &Config,
        store: Arc<dyn ActivationStore>,
        metrics: Arc<Metrics>,
        host_name: &str,
    ) -> Result<Broker, String> {
        // Checked before anything starts: a bad file stops startup.
        let grpc_tls = crate::grpc::tls::ServerTlsFiles::from_settings(
            config.grpc_tls_cert.as_deref(),
            config.grpc_tls_key.as_deref(),
            config.grpc_tls_client_ca.as_deref(),
        )?
        .map(|files| crate::grpc::tls::ServerTls::load(files, Arc::clone(&metrics)).map(Arc::new))
        .transpose()?;
        // Also checked before anything starts: a bad runtime file stops
        // startup; while running, it is re-read on the upkeep's Arbiter.
        let (runtime_file, rules) = match &config.runtime_config {
            Some(path) => {
                let (file, rules) = RuntimeFile::open(
                    path,
                    &format!("{}-long", config.kafka_topic),
                    config.delivery_mode,
                    Arc::clone(&metrics),
                )?;
                (Some(file), rules)
            }
            None => (None, RuntimeRules::none()),
        };
        let health = Health::new();
        // Peers' inserts wake this broker's fetchers (PostgreSQL), so idle
        // fetchers need not poll for them.
        let new_rows = match config.delivery_mode {
            DeliveryMode::Push => store.new_rows(),
            DeliveryMode::Pull => None,
        };
        let membership = MembershipConfig {
            broker_id: store.broker_id().to_owned(),
            host: host_name.to_owned(),
            heartbeat_interval: config.heartbeat_interval,
            takeover_timeout: config.takeover_timeout,
            liveness: Liveness::fenced(MembershipConfig::live_window(
                config.heartbeat_interval,
                config.takeover_timeout,
            )),
        };
        let store_arbiter = named_arbiter("tb-store");
        let store_actor = StoreHandle::start_in_arbiter(
            &store_arbiter.handle(),
            store,
            Arc::clone(&metrics),
            rules.clone(),
        )
        .map_err(|err| format!("cannot start the store's threads: {err}"))?;
        let pipeline = match config.delivery_mode {
            DeliveryMode::Push => {
                let pipeline_config = PushPipelineConfig::from_config(config, host_name);
                tracing::info!(
                    fetch_actors = pipeline_config.fetch_actors,
                    claim_lease_ms = pipeline_config.fetch.lease.as_millis() as u64,
                    callback_url = %pipeline_config.push.callback_url,
                    "push delivery starting"
                );
                Some(PushPipeline::start_fenced(
                    pipeline_config,
                    store_actor.clone(),
                    Arc::clone(&metrics),
                    membership.liveness.clone(),
                )?)
            }
            DeliveryMode::Pull => None,
        };
        let wake: Vec<Recipient<WakeFetch>> = pipeline
            .iter()
            .flat_map(|pipeline| pipeline.fetchers.iter())
            .map(|fetcher| fetcher.clone().recipient())
            .collect();

        let wake_on_new_rows = wake.clone();
        let upkeep_arbiter = named_arbiter("tb-upkeep");
        let upkeep = UpkeepActor::new(
            UpkeepConfig {
                membership: Some(membership),
                ..UpkeepConfig::from_config(config, health.clone(), rules.clone())
            },
            store_actor.clone(),
            wake.clone(),
            Arc::clone(&metrics),
        )?;
        let upkeep = UpkeepActor::start_in_arbiter(&upkeep_arbiter.handle(), move |_| upkeep);
        if let Some(file) = runtime_file {
            // Ends once every holder of the rules has stopped.
            upkeep_arbiter.spawn(file.watch());
        }

        // Every consumer on one Arbiter: they spend their time waiting on
        // Kafka and the store, and each still pauses on its own.
        let consumer_arbiter = named_arbiter("tb-consumer");
        let shared_metrics = Arc::clone(&metrics);
        let topology = config.topology();
        health.expect_consumers(topology.consumed.len());
        let consumers: Vec<Addr<ConsumerActor>> = topology
            .consumed
            .iter()
            .map(|consumed| {
                let consumer = ConsumerActor::new(
                    ConsumerConfig::for_topic(
                        config,
                        &topology,
                        consumed,
                        health.clone(),
                        rules.clone(),
                    ),
                    store_actor.clone(),
                    wake.clone(),
                    Arc::clone(&metrics),
                );
                ConsumerActor::start_in_arbiter(&consumer_arbiter.handle(), move |_| consumer)
            })
            .collect();
        drop(metrics);

        // The gRPC server and the metrics endpoint share an Arbiter of their
        // own, away from the actors.
        let server_arbiter = named_arbiter("tb-server");
        let grpc_listener = bind(config.grpc_addr, "gRPC (TASKBROKER_GRPC_ADDR)")?;
        let metrics_listener = bind(config.metrics_addr, "metrics (TASKBROKER_METRICS_ADDR)")?;
        let grpc_addr = grpc_listener.local_addr().map_err(|err| err.to_string())?;
        let metrics_addr = metrics_listener
            .local_addr()
            .map_err(|err| err.to_string())?;
        let (grpc_shutdown, grpc_stop) = tokio::sync::oneshot::channel::<()>();
        let (http_shutdown, http_stop) = tokio::sync::oneshot::channel::<()>();
        let api = crate::grpc::consumer_service::ConsumerApi::new(
            store_actor.clone(),
            config.delivery_mode,
            config.processing_deadline_grace,
            Arc::clone(&shared_metrics),
        );
        let server_config = crate::grpc::server::ServerConfig {
            shared_secrets: config.grpc_shared_secrets.clone(),
            max_request_bytes: config.grpc_max_request_bytes,
            tls: grpc_tls,
        };
        let (health_tx, health_rx) = tokio::sync::oneshot::channel();
        let (grpc_closed_tx, grpc_closed) = tokio::sync::oneshot::channel::<()>();
        let (http_closed_tx, http_closed) = tokio::sync::oneshot::channel::<()>();
        server_arbiter.spawn(async move {
            let _closed = grpc_closed_tx;
            let listener = match tokio::net::TcpListener::from_std(grpc_listener) {
                Ok(listener) => listener,
                Err(err) => return tracing::error!(error = %err, "gRPC listener"),
            };
            let stop = async move {
                let _ = grpc_stop.await;
            };
            if let Err(err) =
                crate::grpc::server::serve(listener, api, server_config, health_tx, stop).await
            {
                tracing::error!(error = %err, "gRPC server failed");
            }
        });
        let health_store = store_actor.clone();
        // Upkeep counts as stalled after ten missed intervals (at least 30 s).
        let upkeep_stall = (config.upkeep_interval * 10).max(std::time::Duration::from_secs(30));
        let reported = health.clone();
        server_arbiter.spawn(async move {
            if let Ok(reporter) = health_rx.await {
                report_health(reporter, health_store, reported, upkeep_stall).await;
            }
        });
        let mut watched = vec![
            Watched::new("the store actor", {
                let store = store_actor.clone();
                move || store.is_running()
            }),
            Watched::actor("the upkeep actor", &upkeep),
        ];
        for (consumer, consumed) in consumers.iter().zip(&topology.consumed) {
            watched.push(Watched::actor(
                format!("the Kafka consumer of {}", consumed.topic),
                consumer,
            ));
        }
        if let Some(pipeline) = &pipeline {
            watched.push(Watched::actor("the push pool", &pipeline.push_pool));
            for (index, fetcher) in pipeline.fetchers.iter().enumerate() {
                watched.push(Watched::actor(format!("fetch actor {index}"), fetcher));
            }
        }
        server_arbiter.spawn(watch_actors(health.clone(), watched, WATCH_INTERVAL));
        if let Some(mut new_rows) = new_rows {
            server_arbiter.spawn(async move {
                while new_rows.next().await.is_some() {
                    for fetcher in &wake_on_new_rows {
                        let _ = fetcher.try_send(WakeFetch);
                    }
                }
            });
        }
        let (http_metrics, http_store) = (Arc::clone(&shared_metrics), store_actor.clone());
        let http_health = health.clone();
        server_arbiter.spawn(async move {
            let _closed = http_closed_tx;
            let listener = match tokio::net::TcpListener::from_std(metrics_listener) {
                Ok(listener) => listener,
                Err(err) => return tracing::error!(error = %err, "metrics listener"),
            };
            let stop = async move {
                let _ = http_stop.await;
            };
            if let Err(err) =
                crate::http::serve(listener, http_metrics, http_store, http_health, stop).await
            {
                tracing::error!(error = %err, "metrics endpoint failed");
            }
        });
        tracing::info!(%grpc_addr, %metrics_addr, "serving");
        Ok(Broker {
            store: store_actor,
            consumers,
            upkeep,
            pipeline,
            grpc_addr,
            metrics_addr,
            health,
            grpc_shutdown,
            http_shutdown,
            grpc_closed,
            http_closed,
            arbiters: vec![
                server_arbiter,
                consumer_arbiter,
                upkeep_arbiter,
                store_arbiter,
            ],
        })
    }

    /// Stops every actor in the order described in the module docs. The
    /// gRPC server stops after the pushes, so workers can still report the
    /// results of tasks pushed during shutdown; its in-flight calls finish.
    /// When `stop` returns, the broker's threads have ended and its ports
    /// are free, so a replacement can bind them at once.
    pub async fn stop(self) {
        // From here on actors stop because they are told to; health and
        // readiness turn away new work at once.
        self.health.begin_stop();
        futures::future::join_all(
            self.consumers
                .iter()
                .map(|consumer| consumer.send(StopConsuming)),
        )
        .await;
        if let Some(pipeline) = self.pipeline {
            pipeline.stop().await;
        }
        let _ = self.upkeep.send(StopUpkeep).await;
        let _ = self.grpc_shutdown.send(());
        let _ = self.http_shutdown.send(());
        // Each server's task drops its end of the channel when serving has
        // returned: calls finished, listener closed.
        let closed = futures::future::join(self.grpc_closed, self.http_closed);
        if tokio::time::timeout(SERVER_DRAIN_LIMIT, closed)
            .await
            .is_err()
        {
            tracing::warn!(
                limit = ?SERVER_DRAIN_LIMIT,
                "calls still under way when the servers stopped"
            );
        }
        for arbiter in &self.arbiters {
            arbiter.stop();
        }
        let arbiters = self.arbiters;
        let joined = tokio::task::spawn_blocking(move || {
            for arbiter in arbiters {
                let _ = arbiter.join();
            }
        });
        if tokio::time::timeout(ARBITER_JOIN_LIMIT, joined)
            .await
            .is_err()
        {
            tracing::warn!(limit = ?ARBITER_JOIN_LIMIT, "broker threads still running after stop");
        }
    }
}

/// How often the supervisor checks that every actor still runs.
const WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_millis(250);

/// Keeps grpc.health.v1 in step with the broker: SERVING while no part has
/// failed, the broker is not stopping, the store answers a ping and upkeep
/// cycles keep completing (none for `upkeep_stall` means deadlines, expiry
/// and retries have stopped). A failure turns it NOT_SERVING at once.
async fn report_health(
    reporter: tonic_health::server::HealthReporter,
    store: StoreHandle,
    health: Health,
    upkeep_stall: std::time::Duration,
) {
    use crate::proto::consumer_service_server::ConsumerServiceServer;
    type Api = ConsumerServiceServer<crate::grpc::consumer_service::ConsumerApi>;
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = health.failed() => {}
        }
        let healthy = health.failure().is_none()
            && !health.is_stopping()
            && health.since_upkeep_progress() < upkeep_stall
            && tokio::select! {
                // A failure does not wait for a slow ping.
                answered = crate::http::store_answers(&store) => answered.is_ok(),
                _ = health.failed() => false,
            };
        if healthy {
            reporter.set_serving::<Api>().await;
        } else {
            reporter.set_not_serving::<Api>().await;
        }
        if health.failure().is_some() {
            // Failed for good: NOT_SERVING until the process exits.
            return;
        }
    }
}
