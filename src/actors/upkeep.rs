//! UpkeepActor: the timed transitions of the activation lifecycle.
//!
//! - Owns: the upkeep timer and a Kafka producer for retries and dead letters.
//! - Receives: [`RunUpkeep`] (its own timer, or a caller who wants a cycle
//!   now), [`StopUpkeep`].
//! - Sends: upkeep messages to the StoreActor; retry and dead-letter records
//!   to Kafka; [`WakeFetch`] to FetchActors when rows became runnable.
//! - Mailbox: actix's default; only timer and control messages arrive.
//!
//! One cycle runs at a time: the next is scheduled `UPKEEP_INTERVAL_MS` after
//! the previous one finished. Every step is a bounded statement
//! (`UPKEEP_BATCH_LIMIT`) that the cycle runs again while it finds a full
//! batch, so removal, expiry and publishing keep up with any rate the rest
//! of the broker delivers instead of moving one batch per interval. Each
//! step may repeat for one step budget (the interval) per cycle, so a step
//! with a huge backlog cannot starve the others; what it leaves shows in
//! `taskbroker_upkeep_backlog{step}`. A failing step is counted and logged
//! without stopping the others. Publishing (retries, dead letters) runs beside the
//! cycle, one run at a time, so a Kafka outage never holds back expiry,
//! deadlines or delays. It takes rows under a publish lease, so
//! two brokers never publish the same row, and mark them Complete only after
//! Kafka acknowledged the record: while Kafka is down the rows stay Retry or
//! Failure and are published when it returns. A record Kafka refuses as too
//! large would be refused forever: it is logged, counted and its row
//! completed instead. A retry's id follows from the original id and attempt
//! (`retry_activation`), so a row published twice yields one task.
//!
//! Demoted namespaces (the runtime file) are forwarded beside publishing
//! the same way: their stored rows are taken under a lease, their original
//! bytes produced to the demoted topic, and only rows Kafka acknowledged
//! are deleted.
//!
//! A cycle first asks whether the table holds any row: every step and
//! publishing work on rows, so on an empty store (an idle broker) the cycle
//! is that one statement, and the gauges are set to an empty store's.
//!
//! Each cycle also refreshes the max-lag gauge (from indexes); the
//! per-status and per-namespace counts, which read the whole table (one
//! `GROUP BY namespace, status` for both), are refreshed at most every
//! [`STATUS_COUNT_INTERVAL`].
//!
//! Space: a store with a file of its own (SQLite) gives the pages of
//! removed rows back to the file system here, off the hot path, in bounded
//! runs (`reclaim_space`): one every [`STATUS_COUNT_INTERVAL`], idle or not
//! (a drained store is an empty one), and one each cycle while the last
//! run left more to give back. Each run's answer sets
//! `taskbroker_sqlite_bytes`. A store answering that it has no file
//! (PostgreSQL) is not asked again.
//!
//! The broker's row in the store (`heartbeat.rs`) is kept here too, on a
//! timer of its own so a long cycle never delays a heartbeat: joining at
//! startup (which releases the claims a previous incarnation left), a
//! heartbeat every `HEARTBEAT_INTERVAL_MS`, and the takeover of peers
//! whose heartbeat went silent.
//!
//! After a cold start (no peer was live when this broker joined: all of
//! them were down, or SQLite), processing-deadline expiry waits
//! `RESTART_GRACE_SEC`, so workers can still report results for tasks they
//! received before the restart. With a live peer there is no wait: workers
//! could report to it all along. Claim leases never wait: a lease that
//! expired belongs to a broker that is gone or stuck.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use actix::prelude::*;
use rdkafka::producer::FutureRecord;
use tokio::time::Instant;

/// How often upkeep counts the rows per status for
/// `taskbroker_activations`. Counting reads the whole table (13 % of the
/// database's time at 100,000 rows when it ran every second), so the gauge
/// is refreshed less often than the cycle runs.
pub const STATUS_COUNT_INTERVAL: Duration = Duration::from_secs(10);

use super::fetch::WakeFetch;
use super::heartbeat::{Member, MembershipConfig};
use super::store::StoreHandle;
use crate::kafka::cut::CutDeadLetter;
use crate::kafka::{KafkaSettings, Producer, refused_as_too_large};
use crate::metrics::Metrics;
use crate::model::{
    ActivationStatus, DeadlineOutcome, NamespaceCount, PublishKind, StatusCounts, top_namespaces,
};
use crate::runtime::RuntimeRules;
use crate::store::StoreResult;
use crate::supervisor::Health;

/// Settings of the upkeep.
#[derive(Debug, Clone)]
pub struct UpkeepConfig {
    pub interval: Duration,
    pub batch_limit: usize,
    pub max_attempts: u32,
    pub restart_grace: Duration,
    /// The default cluster: where retries and dead letters go unless the
    /// fields below name another.
    pub kafka: KafkaSettings,
    pub retry_topic: String,
    pub dlq_topic: String,
    /// The retry topic's cluster when it is not `kafka`'s.
    pub retry_kafka: Option<KafkaSettings>,
    /// The dead-letter topic's cluster when it is not `kafka`'s.
    pub dlq_kafka: Option<KafkaSettings>,
    /// How long a publish may wait for Kafka's acknowledgement.
    pub delivery_timeout: Duration,
    /// How long rows taken for publishing stay reserved to this broker;
    /// longer than `delivery_timeout`, so a slow acknowledgement never lets
    /// another broker publish the same row.
    pub publish_lease: Duration,
    /// Where each completed cycle is reported (gRPC health watches it).
    pub health: Health,
    /// The operators' rules: stored rows a killswitch matches are removed.
    pub rules: RuntimeRules,
    /// How many namespaces get series of their own on the per-namespace
    /// gauges; the rest are summed as `other`.
    pub top_namespaces: usize,
    /// The broker's row and heartbeat; `None`: none kept (an upkeep run on
    /// its own, as in tests), and deadlines wait the grace as after a cold
    /// start.
    pub membership: Option<MembershipConfig>,
}

/// Run one upkeep cycle now (unless one is running). Answers whether a cycle
/// ran.
#[derive(Debug, Message)]
#[rtype(result = "bool")]
pub struct RunUpkeep;

/// Stop after the current cycle.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct StopUpkeep;

pub struct UpkeepActor {
    config: UpkeepConfig,
    store: StoreHandle,
    producers: Producers,
    wake: Vec<Recipient<WakeFetch>>,
    metrics: Arc<Metrics>,
    started_at: Instant,
    /// When the rows per status were last counted (and the store's file
    /// space last reclaimed on that cadence).
    counted_at: Option<Instant>,
    /// The store keeps a file whose space upkeep gives back; false once it
    /// answered that it has none.
    store_has_file: bool,
    /// The last space reclaim stopped with more to give back.
    reclaim_more: bool,
    step_budget: Duration,
    running: bool,
    publishing: Arc<AtomicBool>,
    next: Option<SpawnHandle>,
    /// The broker's row and heartbeat (`heartbeat.rs`), when kept.
    member: Option<Member>,
}

impl UpkeepActor {
    pub fn new(
        config: UpkeepConfig,
        store: StoreHandle,
        wake: Vec<Recipient<WakeFetch>>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let create = |kafka: &KafkaSettings| {
            kafka
                .create_producer(config.delivery_timeout)
                .map_err(|err| format!("Kafka producer for upkeep: {err}"))
        };
        let default = create(&config.kafka)?;
        let producers = Producers {
            retry: match &config.retry_kafka {
                Some(kafka) => create(kafka)?,
                None => default.clone(),
            },
            dead_letter: match &config.dlq_kafka {
                Some(kafka) => create(kafka)?,
                None => default.clone(),
            },
            forward: default,
        };
        let interval = config.interval;
        let member = config.membership.clone().map(|membership| {
            Member::new(
                membership,
                store.clone(),
                Arc::clone(&metrics),
                config.health.clone(),
            )
        });
        Ok(UpkeepActor {
            config,
            store,
            producers,
            wake,
            metrics,
            started_at: Instant::now(),
            counted_at: None,
            store_has_file: true,
            reclaim_more: false,
            step_budget: interval,
            running: false,
            publishing: Arc::new(AtomicBool::new(false)),
            next: None,
            member,
        })
    }

    /// How long one step may keep repeating within a cycle; the interval
    /// unless changed here (tests shorten it to see a step cut short).
    pub fn with_step_budget(mut self, budget: Duration) -> Self {
        self.step_budget = budget;
        self
    }

    /// Whether processing deadlines may expire yet (see the module docs).
    fn deadlines_allowed(&self) -> bool {
        let graced = self.started_at.elapsed() >= self.config.restart_grace;
        match self.member.as_ref().map(Member::joined) {
            None => graced,
            Some(None) => false,
            Some(Some(peers_were_live)) => peers_were_live || graced,
        }
    }

    /// One turn of the heartbeat timer (`Member::turn`), unless the last
    /// one is still under way.
    fn keep_membership(&mut self, ctx: &mut Context<Self>) {
        let Some(turn) = self.member.as_mut().and_then(Member::turn) else {
            return;
        };
        ctx.spawn(turn.into_actor(self).map(|result, act, _ctx| {
            if act
                .member
                .as_mut()
                .is_some_and(|member| member.settle(result))
            {
                act.wake_fetchers();
            }
        }));
    }

    fn wake_fetchers(&self) {
        for fetcher in &self.wake {
            let _ = fetcher.try_send(WakeFetch);
        }
    }

    fn schedule(&mut self, ctx: &mut Context<Self>) {
        self.next = Some(ctx.run_later(self.config.interval, |act, ctx| {
            act.next = None;
            ctx.notify(RunUpkeep);
        }));
    }
}

impl Actor for UpkeepActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let Some(interval) = self.member.as_ref().map(Member::interval) {
            self.keep_membership(ctx);
            ctx.run_interval(interval, |act, ctx| act.keep_membership(ctx));
        }
        ctx.notify(RunUpkeep);
    }
}

impl Handler<RunUpkeep> for UpkeepActor {
    type Result = bool;

    fn handle(&mut self, _: RunUpkeep, ctx: &mut Self::Context) -> bool {
        if self.running {
            return false;
        }
        if let Some(next) = self.next.take() {
            ctx.cancel_future(next);
        }
        self.running = true;
        let count_statuses = self
            .counted_at
            .is_none_or(|at| at.elapsed() >= STATUS_COUNT_INTERVAL);
        if count_statuses {
            self.counted_at = Some(Instant::now());
        }
        let cycle = Arc::new(Cycle {
            config: self.config.clone(),
            store: self.store.clone(),
            producers: self.producers.clone(),
            metrics: Arc::clone(&self.metrics),
            deadlines_allowed: self.deadlines_allowed(),
            step_budget: self.step_budget,
            count_statuses,
            reclaim_space: self.store_has_file && (count_statuses || self.reclaim_more),
        });
        let publishing = Arc::clone(&self.publishing);
        let work = async move {
            // Every step works on rows: an empty store (an idle broker) is
            // one cheap question instead of a statement per step. A failed
            // question runs the cycle, whose steps count their own errors.
            let runnable = if matches!(cycle.store.has_rows().await, Ok(false)) {
                cycle.idle_gauges();
                false
            } else {
                // Publishing waits for Kafka's acknowledgements, which take
                // up to the delivery timeout while Kafka is down: it runs
                // beside the cycle (one publishing run at a time) so expiry,
                // deadlines and delays keep their interval meanwhile.
                if !publishing.swap(true, Ordering::AcqRel) {
                    let cycle = Arc::clone(&cycle);
                    actix_rt::spawn(async move {
                        futures::join!(
                            cycle.publish(PublishKind::Retry),
                            cycle.publish(PublishKind::DeadLetter),
                            cycle.forward_demoted()
                        );
                        publishing.store(false, Ordering::Release);
                    });
                }
                Arc::clone(&cycle).run().await
            };
            // After the steps, so the rows they removed are given back; on
            // an empty store too, which is what a drained burst leaves.
            (runnable, cycle.reclaim_space().await)
        };
        ctx.spawn(work.into_actor(self).map(|(runnable, space), act, ctx| {
            match space {
                SpaceAnswer::NotAsked => {}
                SpaceAnswer::NoFile => act.store_has_file = false,
                SpaceAnswer::Ran { more } => act.reclaim_more = more,
                SpaceAnswer::Failed => act.reclaim_more = false,
            }
            act.running = false;
            act.metrics.upkeep_cycles.inc();
            act.config.health.upkeep_cycle_completed();
            if runnable {
                act.wake_fetchers();
            }
            act.schedule(ctx);
        }));
        true
    }
}

impl Handler<StopUpkeep> for UpkeepActor {
    type Result = ResponseActFuture<Self, ()>;

    /// Leaves the brokers table (a clean stop is no takeover), then stops.
    fn handle(&mut self, _: StopUpkeep, _ctx: &mut Self::Context) -> Self::Result {
        let leave = self.member.as_ref().map(Member::leave);
        Box::pin(
            async move {
                if let Some(leave) = leave {
                    leave.await;
                }
            }
            .into_actor(self)
            .map(|(), _act, ctx| ctx.stop()),
        )
    }
}

/// The producers of the retry and dead-letter topics (one client when both
/// are on the same cluster), and of the demoted topic (the default cluster).
#[derive(Clone)]
struct Producers {
    retry: Producer,
    dead_letter: Producer,
    forward: Producer,
}

/// One upkeep cycle's work, detached from the actor.
struct Cycle {
    config: UpkeepConfig,
    store: StoreHandle,
    producers: Producers,
    metrics: Arc<Metrics>,
    /// Processing deadlines may expire (no restart grace in force).
    deadlines_allowed: bool,
    step_budget: Duration,
    /// Whether this cycle counts the rows per status.
    count_statuses: bool,
    /// Whether this cycle gives the store file's free space back.
    reclaim_space: bool,
}

/// What a cycle's space reclaim learnt, for the next cycles.
enum SpaceAnswer {
    /// Not this cycle's turn.
    NotAsked,
    /// The store keeps no file of its own (PostgreSQL).
    NoFile,
    /// One run; `more`: it left more to give back.
    Ran { more: bool },
    /// Counted and logged; asked again on the usual cadence.
    Failed,
}

/// One step's passes within a cycle: whether to run another, and what the
/// step left behind when it stops.
struct Passes<'a> {
    cycle: &'a Cycle,
    step: &'static str,
    until: Instant,
    moved: u64,
}

impl<'a> Passes<'a> {
    fn new(cycle: &'a Cycle, step: &'static str) -> Self {
        Passes {
            cycle,
            step,
            until: Instant::now() + cycle.step_budget,
            moved: 0,
        }
    }

    /// Takes one pass's result (`None`: it failed, already counted) and
    /// answers whether to run another: only after a full batch, and while
    /// the budget lasts. On stopping, sets the step's backlog gauge: 0 when
    /// the last pass found less than a full batch, else the batch limit (at
    /// least that many may be waiting; counting them would scan the table).
    fn again(&mut self, pass: Option<u64>) -> bool {
        let Some(moved) = pass else {
            return false;
        };
        self.moved += moved;
        let limit = u64::try_from(self.cycle.config.batch_limit).unwrap_or(u64::MAX);
        let left = if moved < limit {
            0
        } else if Instant::now() >= self.until {
            limit
        } else {
            return true;
        };
        self.cycle
            .metrics
            .upkeep_backlog
            .with_label_values(&[self.step])
            .set(i64::try_from(left).unwrap_or(i64::MAX));
        false
    }
}

impl Cycle {
    /// Runs every step; answers whether rows became runnable.
    async fn run(self: Arc<Self>) -> bool {
        let limit = self.config.batch_limit;
        self.repeat("discard_failures", |store| store.discard_failures(limit))
            .await;
        let mut runnable = 0;
        let released = self
            .repeat("release_expired_claims", |store| {
                store.release_expired_claims(limit)
            })
            .await;
        self.metrics
            .claims_released
            .with_label_values(&["lease_expired"])
            .inc_by(released);
        runnable += released;
        if self.deadlines_allowed {
            runnable += self.processing_deadlines().await;
        }
        let max_attempts = self.config.max_attempts;
        self.repeat("fail_exhausted_attempts", |store| {
            store.fail_exhausted_attempts(max_attempts, limit)
        })
        .await;
        let killswitches = self.config.rules.current().killswitches;
        if !killswitches.is_empty() {
            self.repeat("remove_killswitched", |store| {
                store.remove_killswitched(Arc::clone(&killswitches), limit)
            })
            .await;
        }
        self.repeat("remove_expired", |store| store.remove_expired(limit))
            .await;
        runnable += self
            .repeat("release_delayed", |store| store.release_delayed(limit))
            .await;
        self.repeat("remove_completed", |store| store.remove_completed(limit))
            .await;
        self.refresh_gauges().await;
        runnable > 0
    }

    /// Runs the store step `call` sends until it catches up (see
    /// [`Passes`]); answers the rows it moved in all.
    async fn repeat<F>(&self, name: &'static str, call: impl Fn(&StoreHandle) -> F) -> u64
    where
        F: Future<Output = StoreResult<u64>>,
    {
        let mut passes = Passes::new(self, name);
        while passes.again(self.step(name, call(&self.store)).await) {}
        passes.moved
    }

    /// Times one store statement, counts what it moved, logs and counts
    /// failures (`None`).
    async fn step(
        &self,
        name: &'static str,
        request: impl Future<Output = StoreResult<u64>>,
    ) -> Option<u64> {
        let started = Instant::now();
        let result = request.await;
        self.metrics
            .upkeep_duration
            .with_label_values(&[name])
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(moved) => {
                self.metrics
                    .upkeep_transitions
                    .with_label_values(&[name])
                    .inc_by(moved);
                Some(moved)
            }
            Err(err) => self.failed(name, &err),
        }
    }

    fn failed<T>(&self, name: &'static str, err: &dyn std::fmt::Display) -> Option<T> {
        self.metrics.upkeep_errors.with_label_values(&[name]).inc();
        // Every step fails every cycle while the store is away: one line per
        // interval, with the count left out (the metric counts each).
        crate::warn_throttled!(step = name, error = %err, "upkeep step failed");
        None
    }

    /// Overdue Processing rows; answers how many became Pending again.
    async fn processing_deadlines(&self) -> u64 {
        const NAME: &str = "processing_deadlines";
        let mut passes = Passes::new(self, NAME);
        let mut retried = 0;
        loop {
            let outcome = self.processing_deadlines_pass(NAME).await;
            retried += outcome.map_or(0, |outcome| outcome.retried);
            if !passes.again(outcome.map(|outcome| outcome.retried + outcome.failed)) {
                return retried;
            }
        }
    }

    async fn processing_deadlines_pass(&self, name: &'static str) -> Option<DeadlineOutcome> {
        let started = Instant::now();
        let result = self
            .store
            .handle_processing_deadlines(self.config.batch_limit)
            .await;
        self.metrics
            .upkeep_duration
            .with_label_values(&[name])
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(outcome) => {
                self.metrics
                    .upkeep_transitions
                    .with_label_values(&["processing_deadline_retried"])
                    .inc_by(outcome.retried);
                self.metrics
                    .upkeep_transitions
                    .with_label_values(&["processing_deadline_failed"])
                    .inc_by(outcome.failed);
                Some(outcome)
            }
            Err(err) => self.failed(name, &err),
        }
    }

    /// Publishes Retry rows (as new activations) or dead letters (the stored
    /// bytes), batch after batch like the other steps, completing each row
    /// only once Kafka acknowledged it.
    async fn publish(&self, kind: PublishKind) {
        let mut passes = Passes::new(self, publish_names(kind).0);
        while passes.again(self.publish_pass(kind).await) {}
    }

    /// One batch of [`Cycle::publish`]. Answers how many rows it took, or
    /// `None` when it failed or Kafka did not acknowledge every record
    /// (publishing more now would only wait on Kafka again).
    async fn publish_pass(&self, kind: PublishKind) -> Option<u64> {
        let (name, label) = publish_names(kind);
        let (topic, producer) = match kind {
            PublishKind::Retry => (&self.config.retry_topic, &self.producers.retry),
            PublishKind::DeadLetter => (&self.config.dlq_topic, &self.producers.dead_letter),
        };
        let started = Instant::now();
        let taken = match self
            .store
            .take_for_publish(kind, self.config.batch_limit, self.config.publish_lease)
            .await
        {
            Ok(rows) => rows,
            Err(err) => return self.failed(name, &err),
        };
        if taken.is_empty() {
            return Some(0);
        }
        let count = u64::try_from(taken.len()).unwrap_or(u64::MAX);
        let now = chrono::Utc::now();
        let deliveries = taken.into_iter().map(|mut row| {
            let producer = producer.clone();
            let metrics = Arc::clone(&self.metrics);
            let timeout = self.config.delivery_timeout;
            let cutter = CutDeadLetter {
                producer: self.producers.dead_letter.clone(),
                topic: &self.config.dlq_topic,
                max_activation_bytes: self.config.kafka.max_activation_bytes,
                timeout,
                metrics: Arc::clone(&self.metrics),
            };
            async move {
                let (key, payload) = match kind {
                    // Dead letters keep the original activation, id and bytes.
                    PublishKind::DeadLetter => (row.id.clone(), std::mem::take(&mut row.activation)),
                    PublishKind::Retry => match row.retry_activation(now) {
                        Ok(retry) => retry,
                        Err(err) => {
                            // Cannot happen for rows that passed ingest;
                            // completing it is the only way not to loop.
                            tracing::error!(activation_id = %row.id, error = %err,
                                "stored activation cannot be retried; completing it");
                            metrics.published.with_label_values(&[label, "error"]).inc();
                            return Delivery::Done(row.id);
                        }
                    },
                };
                let sent = producer
                    .send(
                        FutureRecord::to(topic).key(&key).payload(&payload),
                        rdkafka::util::Timeout::After(timeout),
                    )
                    .await;
                match sent {
                    Ok(_) => {
                        metrics.published.with_label_values(&[label, "ok"]).inc();
                        Delivery::Done(row.id)
                    }
                    // Kafka will never take this record whole: publishing it
                    // again every lease would loop forever. The task's
                    // stored activation goes to the dead-letter topic
                    // instead (a retry that cannot be written ends the
                    // task), cut short only as far as Kafka makes it; the
                    // row completes once that is acknowledged.
                    Err((err, _)) if refused_as_too_large(&err) => {
                        metrics
                            .published
                            .with_label_values(&[label, "too_large"])
                            .inc();
                        let whole = match kind {
                            PublishKind::Retry => Some(std::mem::take(&mut row.activation)),
                            PublishKind::DeadLetter => None,
                        };
                        match cutter.send(&row, whole, payload).await {
                            Ok(()) => Delivery::Done(row.id),
                            Err(err) => {
                                crate::warn_throttled!(activation_id = %row.id, error = %err, topic = %topic,
                                    "dead letter of a record Kafka refused as too large not acknowledged; \
                                     the row stays and is published later");
                                Delivery::Failed
                            }
                        }
                    }
                    Err((err, _)) => {
                        metrics.published.with_label_values(&[label, "error"]).inc();
                        crate::warn_throttled!(activation_id = %row.id, error = %err, topic = %topic,
                            "publish not acknowledged; the row stays and is published later");
                        Delivery::Failed
                    }
                }
            }
        });
        let mut all_delivered = true;
        let mut done = Vec::new();
        for delivery in futures::future::join_all(deliveries).await {
            match delivery {
                Delivery::Done(id) => done.push(id),
                Delivery::Failed => all_delivered = false,
            }
        }
        let marked = match self.store.mark_published(done).await {
            Ok(completed) => {
                self.metrics
                    .upkeep_transitions
                    .with_label_values(&[name])
                    .inc_by(completed);
                Some(count)
            }
            // The records are on Kafka but the rows stay: after the lease they
            // are published again with the same ids (a duplicate that ingest
            // drops, never a loss).
            Err(err) => self.failed(name, &err),
        };
        self.metrics
            .upkeep_duration
            .with_label_values(&[name])
            .observe(started.elapsed().as_secs_f64());
        marked.filter(|_| all_delivered)
    }

    fn set_count_gauges(&self, counts: &[NamespaceCount]) {
        let mut by_status = StatusCounts::default();
        for count in counts {
            by_status.set(count.status, by_status.get(count.status) + count.count);
        }
        self.metrics.set_status_counts(by_status.by_status());
        let top = top_namespaces(counts, self.config.top_namespaces, chrono::Utc::now());
        const SHOWN: [ActivationStatus; 4] = [
            ActivationStatus::Pending,
            ActivationStatus::Delay,
            ActivationStatus::Claimed,
            ActivationStatus::Processing,
        ];
        let labels: Vec<(String, &str, u64)> = top
            .iter()
            .flat_map(|summary| {
                SHOWN.iter().map(|status| {
                    (
                        summary.namespace.clone(),
                        status.metric_label(),
                        summary.counts.get(status).copied().unwrap_or(0),
                    )
                })
            })
            .collect();
        self.metrics.set_namespace_gauges(
            labels
                .iter()
                .map(|(namespace, status, count)| (namespace.as_str(), *status, *count)),
            top.iter()
                .map(|summary| (summary.namespace.as_str(), summary.max_lag)),
        );
    }

    /// Forwards demoted namespaces' stored rows to the demoted topic until
    /// none is left (or the step budget runs out).
    async fn forward_demoted(&self) {
        let mut passes = Passes::new(self, FORWARD_DEMOTED);
        while passes.again(self.forward_pass().await) {}
    }

    /// One batch of [`Cycle::forward_demoted`]: the rows' original bytes go
    /// to the demoted topic unchanged (keyed by id); only rows Kafka
    /// acknowledged are deleted. Answers how many rows it took, or `None`
    /// when it failed or a record was not acknowledged (those rows are
    /// forwarded again after their lease: a duplicate at worst, never a
    /// loss).
    async fn forward_pass(&self) -> Option<u64> {
        let rules = self.config.rules.current();
        if rules.demoted_namespaces.is_empty() {
            return Some(0);
        }
        let started = Instant::now();
        let taken = match self
            .store
            .take_demoted(
                Arc::clone(&rules.demoted_namespaces),
                Arc::clone(&rules.demoted_topic),
                self.config.batch_limit,
                self.config.publish_lease,
            )
            .await
        {
            Ok(rows) => rows,
            Err(err) => return self.failed(FORWARD_DEMOTED, &err),
        };
        if taken.is_empty() {
            return Some(0);
        }
        let count = u64::try_from(taken.len()).unwrap_or(u64::MAX);
        let topic = &*rules.demoted_topic;
        let timeout = rdkafka::util::Timeout::After(self.config.delivery_timeout);
        let sends = taken.iter().map(|row| {
            self.producers.forward.send(
                FutureRecord::to(topic)
                    .key(&row.id)
                    .payload(&row.activation),
                timeout,
            )
        });
        let mut forwarded = Vec::with_capacity(taken.len());
        let mut all_delivered = true;
        for (row, sent) in taken.iter().zip(futures::future::join_all(sends).await) {
            match sent {
                Ok(_) => forwarded.push(row.id.clone()),
                Err((err, _)) => {
                    all_delivered = false;
                    crate::warn_throttled!(activation_id = %row.id, topic, error = %err,
                        "cannot forward a demoted task; it stays and is forwarded again \
                         after its lease");
                }
            }
        }
        let removed = match self.store.remove_forwarded(forwarded).await {
            Ok(removed) => {
                self.metrics
                    .upkeep_transitions
                    .with_label_values(&[FORWARD_DEMOTED])
                    .inc_by(removed);
                Some(count)
            }
            // On Kafka but still stored: forwarded again after the lease
            // (the demoted pool's store drops the duplicate id).
            Err(err) => self.failed(FORWARD_DEMOTED, &err),
        };
        self.metrics
            .upkeep_duration
            .with_label_values(&[FORWARD_DEMOTED])
            .observe(started.elapsed().as_secs_f64());
        removed.filter(|_| all_delivered)
    }

    /// One bounded run giving the store file's free space back, when this
    /// cycle asks for one; its answer sets the file's gauges.
    async fn reclaim_space(&self) -> SpaceAnswer {
        const NAME: &str = "reclaim_space";
        if !self.reclaim_space {
            return SpaceAnswer::NotAsked;
        }
        match self.store.reclaim_space().await {
            Ok(None) => SpaceAnswer::NoFile,
            Ok(Some(run)) => {
                let after = run.after;
                self.metrics
                    .set_sqlite_bytes(after.file_bytes, after.wal_bytes, after.free_bytes);
                if after.file_bytes < run.before.file_bytes {
                    tracing::debug!(
                        given_back = run.before.file_bytes - after.file_bytes,
                        file_bytes = after.file_bytes,
                        free_bytes = after.free_bytes,
                        more = run.more,
                        "SQLite file space given back"
                    );
                }
                SpaceAnswer::Ran { more: run.more }
            }
            Err(err) => {
                self.failed::<()>(NAME, &err);
                SpaceAnswer::Failed
            }
        }
    }

    /// The gauges of an empty store, without asking it again.
    fn idle_gauges(&self) {
        if self.count_statuses {
            self.set_count_gauges(&[]);
        }
        self.metrics.max_lag_seconds.set(0.0);
        self.metrics.set_inflight_bytes(&[]);
    }

    async fn refresh_gauges(&self) {
        if self.count_statuses {
            // One scan gives both the per-status and per-namespace gauges.
            match self.store.count_by_namespace().await {
                Ok(counts) => self.set_count_gauges(&counts),
                Err(err) => self.failed("count_by_namespace", &err).unwrap_or(()),
            }
        }
        match self.store.max_pending_lag().await {
            Ok(lag) => self.metrics.max_lag_seconds.set(lag),
            Err(err) => self.failed("max_pending_lag", &err).unwrap_or(()),
        }
        // A few rows per topic (the sums migration V5's triggers keep).
        match self.store.inflight_bytes_by_topic().await {
            Ok(sums) => self.metrics.set_inflight_bytes(&sums),
            Err(err) => self.failed("inflight_bytes_by_topic", &err).unwrap_or(()),
        }
    }
}

/// What became of one row's record.
enum Delivery {
    /// Acknowledged, or given up for good: the row is completed.
    Done(String),
    /// Not acknowledged: the row stays and is published after its lease.
    Failed,
}

/// The step forwarding demoted namespaces' rows (metrics, logs).
const FORWARD_DEMOTED: &str = "forward_demoted";

/// A publish step's name (metrics, logs) and `kind` label.
fn publish_names(kind: PublishKind) -> (&'static str, &'static str) {
    match kind {
        PublishKind::Retry => ("publish_retries", "retry"),
        PublishKind::DeadLetter => ("publish_dead_letters", "deadletter"),
    }
}
