//! PostgreSQL backend: deadpool-postgres pool, prepared (cached) statements,
//! one statement per batch. Timestamps come from the database clock (`now()`),
//! so replicas sharing the database agree on expiry.
//!
//! This file is the store itself (configuration, pools, migrations and the
//! `ActivationStore` operations); the statements are in `sql.rs`, row
//! mapping in `rows.rs`, pool building and error classification in
//! `pool.rs`.

mod brokers;
mod notify;
mod pool;
mod rows;
mod sql;
mod tls;

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use tokio_postgres::Row;

use self::pool::{build_pool, connect_config, describe, only_row, pool_error, query_error};
use self::rows::{
    activation_from_row, activations_from_rows, limit, micros, named_counts, split_tokens,
};
use self::sql::*;
use super::view::{GroupCount, Inspection, NearExpiry, StoreView};
use super::{ActivationStore, StoreError, StoreResult, claimed_rows};
use crate::model::{
    ActivationStatus, BucketRange, ClaimToken, ClaimedActivation, DeadlineOutcome, Dispatch,
    InflightActivation, Killswitch, NamespaceCount, NamespaceResult, PauseRule, PublishKind,
    PullFilter, StatusCounts, StatusUpdate, StatusUpdateOutcome,
};

mod embedded {
    refinery::embed_migrations!("migrations/postgres");
}

/// Key of the session advisory lock that serializes migrations across
/// replicas starting at the same moment ("taskbroker" in ASCII, truncated).
const MIGRATION_LOCK_KEY: i64 = 0x7461_736b_6272_6f6b;

/// Settings for [`PostgresStore::connect`].
#[derive(Debug, Clone)]
pub struct PostgresStoreConfig {
    pub url: String,
    pub pool_size: usize,
    /// Run the transitions a lease or deadline would replay anyway (claims,
    /// mark processing, removal of finished rows) with
    /// `synchronous_commit = off`. After a database crash some tasks may run
    /// twice; none is lost.
    pub async_commit: bool,
    /// Bound on connecting and on waiting for a pooled connection, so callers
    /// get `Unavailable` instead of hanging while the database is away.
    pub connect_timeout: Duration,
    /// The broker this store claims for (`claimed_by`, its row in
    /// `taskbroker_brokers`): `TASKBROKER_BROKER_ID`.
    pub broker_id: String,
    /// Most activation bytes one push claim returns (`FETCH_BATCH_BYTES`;
    /// always at least one row).
    pub claim_max_bytes: usize,
}

impl PostgresStoreConfig {
    /// Defaults, with a fresh broker id (see [`fresh_broker_id`]).
    pub fn new(url: impl Into<String>) -> Self {
        PostgresStoreConfig {
            url: url.into(),
            pool_size: 16,
            async_commit: false,
            connect_timeout: Duration::from_secs(5),
            broker_id: super::fresh_broker_id(),
            claim_max_bytes: super::DEFAULT_CLAIM_MAX_BYTES,
        }
    }
}

pub struct PostgresStore {
    url: String,
    connect_timeout: Duration,
    /// Durable commits: inserts, worker results, upkeep that publishes.
    pool: Pool,
    /// Transitions that may use asynchronous commit (same pool unless
    /// `async_commit` is on).
    replayable: Pool,
    /// Names this store's inserts in their new-row announcements, so its
    /// own listener skips them (see `notify.rs`).
    announcer: String,
    /// Written into every claim (`claimed_by`).
    broker_id: String,
    /// The byte budget of a push claim (`within_bytes!` in sql.rs).
    claim_max_bytes: i64,
}

/// Where `config` connects, as `host:port` (several joined by commas),
/// for errors: never the user or password.
fn target_of(config: &tokio_postgres::Config) -> String {
    let ports = config.get_ports();
    if config.get_hosts().is_empty() {
        return format!("localhost:{}", ports.first().copied().unwrap_or(5432));
    }
    config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(index, host)| {
            let port = ports.get(index).or(ports.first()).copied().unwrap_or(5432);
            match host {
                tokio_postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                tokio_postgres::config::Host::Unix(path) => {
                    format!("{}/.s.PGSQL.{port}", path.display())
                }
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

impl PostgresStore {
    /// Builds the pools. Connections are opened lazily, so a database that
    /// is down at startup shows up as `Unavailable` on first use.
    pub fn connect(config: &PostgresStoreConfig) -> StoreResult<Self> {
        let pool = build_pool(config, false)?;
        let replayable = if config.async_commit {
            build_pool(config, true)?
        } else {
            pool.clone()
        };
        Ok(PostgresStore {
            url: config.url.clone(),
            connect_timeout: config.connect_timeout,
            pool,
            replayable,
            announcer: uuid::Uuid::new_v4().to_string(),
            broker_id: config.broker_id.clone(),
            claim_max_bytes: i64::try_from(config.claim_max_bytes).unwrap_or(i64::MAX),
        })
    }

    async fn client(
        &self,
        pool: &Pool,
        operation: &'static str,
    ) -> StoreResult<deadpool_postgres::Object> {
        pool.get().await.map_err(|err| pool_error(operation, err))
    }
}

impl PostgresStore {
    /// Runs one prepared statement and returns its rows.
    async fn query(
        &self,
        pool: &Pool,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<Vec<Row>> {
        let client = self.client(pool, operation).await?;
        let statement = client
            .prepare_cached(sql)
            .await
            .map_err(|e| query_error(operation, e))?;
        client
            .query(&statement, params)
            .await
            .map_err(|e| query_error(operation, e))
    }

    /// Runs one prepared statement and returns the rows it affected.
    async fn execute(
        &self,
        pool: &Pool,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> StoreResult<u64> {
        let client = self.client(pool, operation).await?;
        let statement = client
            .prepare_cached(sql)
            .await
            .map_err(|e| query_error(operation, e))?;
        client
            .execute(&statement, params)
            .await
            .map_err(|e| query_error(operation, e))
    }
}

#[async_trait]
impl ActivationStore for PostgresStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    async fn migrate(&self) -> StoreResult<()> {
        let migration_error = |err: tokio_postgres::Error| StoreError::Migration(describe(&err));
        let (mut pg_config, connector) = connect_config(&self.url)?;
        pg_config.connect_timeout(self.connect_timeout);
        let (mut client, connection) =
            pg_config
                .connect(connector)
                .await
                .map_err(|err| StoreError::Connect {
                    target: target_of(&pg_config),
                    message: describe(&err),
                })?;
        let driver = tokio::spawn(connection);
        // A session lock, held by this connection only: if this process dies
        // mid-migration the lock goes with its connection.
        client
            .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY])
            .await
            .map_err(migration_error)?;
        let outcome = embedded::migrations::runner()
            .run_async(&mut client)
            .await
            .map(|_| ())
            .map_err(|err| StoreError::Migration(err.to_string()));
        let unlocked = client
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY])
            .await;
        drop(client);
        let _ = driver.await;
        outcome?;
        unlocked.map_err(migration_error)?;
        Ok(())
    }

    fn new_rows(&self) -> Option<futures::stream::BoxStream<'static, ()>> {
        // The URL was checked when the pools were built.
        let (mut config, connector) = connect_config(&self.url).ok()?;
        config.connect_timeout(self.connect_timeout);
        if config.get_application_name().is_none() {
            config.application_name("taskbroker");
        }
        Some(notify::listen(config, connector, self.announcer.clone()))
    }

    async fn ping(&self) -> StoreResult<()> {
        const OP: &str = "ping";
        let client = self.client(&self.pool, OP).await?;
        client
            .simple_query("SELECT 1")
            .await
            .map(drop)
            .map_err(|e| query_error(OP, e))
    }

    async fn insert_batch(&self, rows: &[InflightActivation]) -> StoreResult<u64> {
        const OP: &str = "insert_batch";
        if rows.is_empty() {
            return Ok(0);
        }
        let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        let activations: Vec<&[u8]> = rows.iter().map(|r| r.activation.as_slice()).collect();
        let topics: Vec<&str> = rows.iter().map(|r| r.topic.as_str()).collect();
        let partitions: Vec<i32> = rows.iter().map(|r| r.partition).collect();
        let offsets: Vec<i64> = rows.iter().map(|r| r.kafka_offset).collect();
        let added: Vec<DateTime<Utc>> = rows.iter().map(|r| r.added_at).collect();
        let received: Vec<DateTime<Utc>> = rows.iter().map(|r| r.received_at).collect();
        let attempts: Vec<i32> = rows.iter().map(|r| r.processing_attempts).collect();
        let expires: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.expires_at).collect();
        let delays: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.delay_until).collect();
        let durations: Vec<i32> = rows
            .iter()
            .map(|r| r.processing_deadline_duration)
            .collect();
        let deadlines: Vec<Option<DateTime<Utc>>> =
            rows.iter().map(|r| r.processing_deadline).collect();
        let claims: Vec<Option<DateTime<Utc>>> = rows.iter().map(|r| r.claim_expires_at).collect();
        let statuses: Vec<&str> = rows.iter().map(|r| r.status.as_str()).collect();
        let at_most_once: Vec<bool> = rows.iter().map(|r| r.at_most_once).collect();
        let applications: Vec<&str> = rows.iter().map(|r| r.application.as_str()).collect();
        let namespaces: Vec<&str> = rows.iter().map(|r| r.namespace.as_str()).collect();
        let tasknames: Vec<&str> = rows.iter().map(|r| r.taskname.as_str()).collect();
        let exceeded: Vec<i32> = rows
            .iter()
            .map(|r| r.on_attempts_exceeded.as_i32())
            .collect();
        let buckets: Vec<i16> = rows.iter().map(|r| r.bucket).collect();
        let (edit_attempts, edit_delays): (Vec<Option<i64>>, Vec<Option<i64>>) = rows
            .iter()
            .map(|r| super::retry_edit_columns(&r.retry_edit))
            .unzip();

        let inserted = self
            .query(
                &self.pool,
                OP,
                INSERT,
                &[
                    &ids,
                    &activations,
                    &topics,
                    &partitions,
                    &offsets,
                    &added,
                    &received,
                    &attempts,
                    &expires,
                    &delays,
                    &durations,
                    &deadlines,
                    &claims,
                    &statuses,
                    &at_most_once,
                    &applications,
                    &namespaces,
                    &tasknames,
                    &exceeded,
                    &buckets,
                    &edit_attempts,
                    &edit_delays,
                    &self.announcer,
                ],
            )
            .await?;
        let row = inserted.first().ok_or(StoreError::Query {
            operation: OP,
            message: "insert returned no count".to_owned(),
        })?;
        let count: i64 = row.try_get(0).map_err(|e| query_error(OP, e))?;
        Ok(u64::try_from(count).unwrap_or(0))
    }

    async fn claim_for_push_except(
        &self,
        buckets: BucketRange,
        limit_rows: usize,
        lease: Duration,
        paused: &[PauseRule],
        dispatch: Dispatch<'_>,
    ) -> StoreResult<Vec<ClaimedActivation>> {
        const OP: &str = "claim_for_push";
        if limit_rows == 0 {
            return Ok(Vec::new());
        }
        let (first, last, limit_rows, lease) = (
            buckets.first,
            buckets.last,
            limit(limit_rows),
            micros(lease),
        );
        let rows = if let Dispatch::Fair(weights) = dispatch {
            let (applications, namespaces) = pause_columns(paused);
            let (weighted, weights): (Vec<&str>, Vec<i32>) = weights
                .iter()
                .map(|(namespace, weight)| {
                    (
                        namespace.as_str(),
                        i32::try_from(*weight).unwrap_or(i32::MAX),
                    )
                })
                .unzip();
            self.query(
                &self.replayable,
                OP,
                CLAIM_FOR_PUSH_FAIR,
                &[
                    &first,
                    &last,
                    &limit_rows,
                    &lease,
                    &applications,
                    &namespaces,
                    &weighted,
                    &weights,
                    &self.broker_id,
                    &self.claim_max_bytes,
                ],
            )
            .await?
        } else if paused.is_empty() {
            self.query(
                &self.replayable,
                OP,
                CLAIM_FOR_PUSH,
                &[
                    &first,
                    &last,
                    &limit_rows,
                    &lease,
                    &self.broker_id,
                    &self.claim_max_bytes,
                ],
            )
            .await?
        } else {
            let (applications, namespaces) = pause_columns(paused);
            self.query(
                &self.replayable,
                OP,
                CLAIM_FOR_PUSH_UNPAUSED,
                &[
                    &first,
                    &last,
                    &limit_rows,
                    &lease,
                    &self.broker_id,
                    &applications,
                    &namespaces,
                    &self.claim_max_bytes,
                ],
            )
            .await?
        };
        claimed_rows(activations_from_rows(&rows)?)
    }

    async fn claim_limited(
        &self,
        namespace: &str,
        max_in_flight: u32,
        limit_rows: usize,
        lease: Duration,
    ) -> StoreResult<Vec<ClaimedActivation>> {
        const OP: &str = "claim_limited";
        if limit_rows == 0 {
            return Ok(Vec::new());
        }
        let failed = |err| query_error(OP, err);
        let mut client = self.client(&self.pool, OP).await?;
        let transaction = client.transaction().await.map_err(failed)?;
        transaction
            .execute(LOCK_NAMESPACE_LIMIT, &[&namespace])
            .await
            .map_err(failed)?;
        let in_flight: i64 = transaction
            .query_one(COUNT_NAMESPACE_IN_FLIGHT, &[&namespace])
            .await
            .map_err(failed)?
            .get(0);
        let room = i64::from(max_in_flight).saturating_sub(in_flight);
        if room <= 0 {
            transaction.commit().await.map_err(failed)?;
            return Ok(Vec::new());
        }
        let rows = transaction
            .query(
                CLAIM_LIMITED,
                &[
                    &namespace,
                    &room.min(limit(limit_rows)),
                    &micros(lease),
                    &self.broker_id,
                    &self.claim_max_bytes,
                ],
            )
            .await
            .map_err(failed)?;
        transaction.commit().await.map_err(failed)?;
        claimed_rows(activations_from_rows(&rows)?)
    }

    async fn claim_for_pull_except(
        &self,
        filter: &PullFilter,
        deadline_grace: Duration,
        paused: &[PauseRule],
    ) -> StoreResult<Option<InflightActivation>> {
        const OP: &str = "claim_for_pull";
        let sql = match (&filter.application, &filter.namespace, paused.is_empty()) {
            (None, Some(_), _) => return Ok(None),
            (None, None, true) => CLAIM_FOR_PULL_ANY,
            (Some(_), None, true) => CLAIM_FOR_PULL_APPLICATION,
            (Some(_), Some(_), true) => CLAIM_FOR_PULL_NAMESPACE,
            (None, None, false) => CLAIM_FOR_PULL_ANY_UNPAUSED,
            (Some(_), None, false) => CLAIM_FOR_PULL_APPLICATION_UNPAUSED,
            (Some(_), Some(_), false) => CLAIM_FOR_PULL_NAMESPACE_UNPAUSED,
        };
        let grace = deadline_grace.as_secs_f64();
        let rows = if paused.is_empty() {
            self.query(
                &self.pool,
                OP,
                sql,
                &[&grace, &filter.application, &filter.namespace],
            )
            .await?
        } else {
            let (applications, namespaces) = pause_columns(paused);
            self.query(
                &self.pool,
                OP,
                sql,
                &[
                    &grace,
                    &filter.application,
                    &filter.namespace,
                    &applications,
                    &namespaces,
                ],
            )
            .await?
        };
        rows.first().map(activation_from_row).transpose()
    }

    async fn release_claims(&self, claims: &[ClaimToken]) -> StoreResult<u64> {
        const OP: &str = "release_claims";
        if claims.is_empty() {
            return Ok(0);
        }
        let (ids, expiries) = split_tokens(claims);
        self.execute(&self.pool, OP, RELEASE_CLAIMS, &[&ids, &expiries])
            .await
    }

    async fn mark_processing(
        &self,
        claims: &[ClaimToken],
        deadline_grace: Duration,
    ) -> StoreResult<Vec<String>> {
        const OP: &str = "mark_processing";
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let (ids, expiries) = split_tokens(claims);
        let rows = self
            .query(
                &self.replayable,
                OP,
                MARK_PROCESSING,
                &[&ids, &expiries, &deadline_grace.as_secs_f64()],
            )
            .await?;
        rows.iter()
            .map(|row| row.try_get(0).map_err(|e| query_error(OP, e)))
            .collect()
    }

    async fn fail_claim_attempt(
        &self,
        claims: &[ClaimToken],
        max_attempts: u32,
    ) -> StoreResult<u64> {
        const OP: &str = "fail_claim_attempt";
        if claims.is_empty() {
            return Ok(0);
        }
        let (ids, expiries) = split_tokens(claims);
        let max_attempts = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        self.execute(
            &self.pool,
            OP,
            FAIL_CLAIM_ATTEMPT,
            &[&ids, &expiries, &max_attempts],
        )
        .await
    }

    async fn set_status(&self, updates: &[StatusUpdate]) -> StoreResult<StatusUpdateOutcome> {
        const OP: &str = "set_status";
        if updates.is_empty() {
            return Ok(StatusUpdateOutcome::default());
        }
        let ids: Vec<&str> = updates.iter().map(|u| u.id.as_str()).collect();
        let statuses: Vec<&str> = updates
            .iter()
            .map(|u| u.status.as_status().as_str())
            .collect();
        // One statement either way; only a batch with edits names them.
        let rows = if updates.iter().any(StatusUpdate::edits_retry_state) {
            let (edit_attempts, edit_delays): (Vec<Option<i64>>, Vec<Option<i64>>) = updates
                .iter()
                .map(|u| super::retry_edit_columns(&u.retry_edit()))
                .unzip();
            self.query(
                &self.pool,
                OP,
                SET_STATUS_WITH_EDITS,
                &[&ids, &statuses, &edit_attempts, &edit_delays],
            )
            .await?
        } else {
            self.query(&self.pool, OP, SET_STATUS, &[&ids, &statuses])
                .await?
        };
        let row = only_row(OP, rows)?;
        let count = |index: usize| -> StoreResult<u64> {
            let value: i64 = row.try_get(index).map_err(|e| query_error(OP, e))?;
            Ok(u64::try_from(value).unwrap_or(0))
        };
        let (distinct, existing, updated) = (count(0)?, count(1)?, count(2)?);
        let namespaces: Vec<String> = row.try_get(4).map_err(|e| query_error(OP, e))?;
        let statuses: Vec<String> = row.try_get(5).map_err(|e| query_error(OP, e))?;
        let counts: Vec<i64> = row.try_get(6).map_err(|e| query_error(OP, e))?;
        let by_namespace = namespaces
            .into_iter()
            .zip(statuses)
            .zip(counts)
            .map(|((namespace, status), count)| {
                Ok(NamespaceResult {
                    namespace,
                    status: super::parse_status(status)?,
                    count: u64::try_from(count).unwrap_or(0),
                })
            })
            .collect::<StoreResult<Vec<_>>>()?;
        Ok(StatusUpdateOutcome {
            updated,
            ignored: existing.saturating_sub(updated),
            missing: distinct.saturating_sub(existing),
            late: count(3)?,
            by_namespace,
        })
    }

    async fn delete_batch(&self, ids: &[String]) -> StoreResult<u64> {
        const OP: &str = "delete_batch";
        if ids.is_empty() {
            return Ok(0);
        }
        self.execute(&self.replayable, OP, DELETE_BATCH, &[&ids])
            .await
    }

    async fn release_expired_claims(&self, limit_rows: usize) -> StoreResult<u64> {
        self.execute(
            &self.pool,
            "release_expired_claims",
            RELEASE_EXPIRED_CLAIMS,
            &[&limit(limit_rows)],
        )
        .await
    }

    async fn handle_processing_deadlines(&self, limit_rows: usize) -> StoreResult<DeadlineOutcome> {
        const OP: &str = "handle_processing_deadlines";
        let rows = self
            .query(
                &self.pool,
                OP,
                HANDLE_PROCESSING_DEADLINES,
                &[&limit(limit_rows)],
            )
            .await?;
        let mut outcome = DeadlineOutcome::default();
        for row in &rows {
            let at_most_once: bool = row.try_get(0).map_err(|e| query_error(OP, e))?;
            if at_most_once {
                outcome.failed += 1;
            } else {
                outcome.retried += 1;
            }
        }
        Ok(outcome)
    }

    async fn fail_exhausted_attempts(
        &self,
        max_attempts: u32,
        limit_rows: usize,
    ) -> StoreResult<u64> {
        let max_attempts = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        self.execute(
            &self.pool,
            "fail_exhausted_attempts",
            FAIL_EXHAUSTED_ATTEMPTS,
            &[&max_attempts, &limit(limit_rows)],
        )
        .await
    }

    async fn remove_killswitched(
        &self,
        killswitches: &[Killswitch],
        limit_rows: usize,
    ) -> StoreResult<u64> {
        if killswitches.is_empty() {
            return Ok(0);
        }
        let (namespaces, tasknames): (Vec<String>, Vec<String>) =
            killswitches.iter().map(Killswitch::like_patterns).unzip();
        self.execute(
            &self.pool,
            "remove_killswitched",
            REMOVE_KILLSWITCHED,
            &[&namespaces, &tasknames, &limit(limit_rows)],
        )
        .await
    }

    async fn remove_expired(&self, limit_rows: usize) -> StoreResult<u64> {
        self.execute(
            &self.pool,
            "remove_expired",
            REMOVE_EXPIRED,
            &[&limit(limit_rows)],
        )
        .await
    }

    async fn release_delayed(&self, limit_rows: usize) -> StoreResult<u64> {
        self.execute(
            &self.pool,
            "release_delayed",
            RELEASE_DELAYED,
            &[&limit(limit_rows)],
        )
        .await
    }

    async fn take_for_publish(
        &self,
        kind: PublishKind,
        limit_rows: usize,
        lease: Duration,
    ) -> StoreResult<Vec<InflightActivation>> {
        const OP: &str = "take_for_publish";
        let sql = match kind {
            PublishKind::Retry => TAKE_RETRIES,
            PublishKind::DeadLetter => TAKE_DEAD_LETTERS,
        };
        let rows = self
            .query(&self.pool, OP, sql, &[&limit(limit_rows), &micros(lease)])
            .await?;
        activations_from_rows(&rows)
    }

    async fn take_demoted(
        &self,
        namespaces: &[String],
        demoted_topic: &str,
        limit_rows: usize,
        lease: Duration,
    ) -> StoreResult<Vec<InflightActivation>> {
        if namespaces.is_empty() || limit_rows == 0 {
            return Ok(Vec::new());
        }
        let rows = self
            .query(
                &self.pool,
                "take_demoted",
                TAKE_DEMOTED,
                &[
                    &namespaces,
                    &demoted_topic,
                    &limit(limit_rows),
                    &micros(lease),
                ],
            )
            .await?;
        activations_from_rows(&rows)
    }

    async fn remove_forwarded(&self, ids: &[String]) -> StoreResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        self.execute(&self.pool, "remove_forwarded", REMOVE_FORWARDED, &[&ids])
            .await
    }

    async fn discard_failures(&self, limit_rows: usize) -> StoreResult<u64> {
        self.execute(
            &self.pool,
            "discard_failures",
            DISCARD_FAILURES,
            &[&limit(limit_rows)],
        )
        .await
    }

    async fn mark_published(&self, ids: &[String]) -> StoreResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        self.execute(&self.pool, "mark_published", MARK_PUBLISHED, &[&ids])
            .await
    }

    async fn remove_completed(&self, limit_rows: usize) -> StoreResult<u64> {
        self.execute(
            &self.replayable,
            "remove_completed",
            REMOVE_COMPLETED,
            &[&limit(limit_rows)],
        )
        .await
    }

    async fn count_by_status(&self) -> StoreResult<StatusCounts> {
        const OP: &str = "count_by_status";
        let rows = self.query(&self.pool, OP, COUNT_BY_STATUS, &[]).await?;
        super::status_counts(named_counts(OP, &rows)?)
    }

    async fn count_by_namespace(&self) -> StoreResult<Vec<NamespaceCount>> {
        self.query(&self.pool, "count_by_namespace", COUNT_BY_NAMESPACE, &[])
            .await?
            .iter()
            .map(|row| {
                Ok(NamespaceCount {
                    namespace: row.get(0),
                    status: super::parse_status(row.get(1))?,
                    count: u64::try_from(row.get::<_, i64>(2)).unwrap_or(0),
                    oldest_runnable: row.get(3),
                })
            })
            .collect()
    }

    async fn count_inflight_by_topic(&self) -> StoreResult<Vec<(String, u64)>> {
        const OP: &str = "count_inflight_by_topic";
        let rows = self
            .query(&self.pool, OP, COUNT_INFLIGHT_BY_TOPIC, &[])
            .await?;
        named_counts(OP, &rows)
    }

    async fn inflight_bytes_by_topic(&self) -> StoreResult<Vec<(String, u64)>> {
        const OP: &str = "inflight_bytes_by_topic";
        let rows = self
            .query(&self.pool, OP, INFLIGHT_BYTES_BY_TOPIC, &[])
            .await?;
        named_counts(OP, &rows)
    }

    async fn has_rows(&self) -> StoreResult<bool> {
        const OP: &str = "has_rows";
        let row = only_row(OP, self.query(&self.pool, OP, HAS_ROWS, &[]).await?)?;
        row.try_get(0).map_err(|e| query_error(OP, e))
    }

    async fn max_pending_lag(&self) -> StoreResult<f64> {
        const OP: &str = "max_pending_lag";
        let row = only_row(OP, self.query(&self.pool, OP, MAX_PENDING_LAG, &[]).await?)?;
        row.try_get(0).map_err(|e| query_error(OP, e))
    }

    async fn get(&self, id: &str) -> StoreResult<Option<InflightActivation>> {
        const OP: &str = "get";
        let rows = self.query(&self.pool, OP, GET, &[&id]).await?;
        rows.first().map(activation_from_row).transpose()
    }

    async fn fail_claims(&self, claims: &[ClaimToken]) -> StoreResult<u64> {
        const OP: &str = "fail_claims";
        if claims.is_empty() {
            return Ok(0);
        }
        let (ids, expiries) = split_tokens(claims);
        self.execute(&self.pool, OP, FAIL_CLAIMS, &[&ids, &expiries])
            .await
    }

    async fn defer_claims(&self, claims: &[ClaimToken], until: DateTime<Utc>) -> StoreResult<u64> {
        const OP: &str = "defer_claims";
        if claims.is_empty() {
            return Ok(0);
        }
        let (ids, expiries) = split_tokens(claims);
        self.execute(&self.pool, OP, DEFER_CLAIMS, &[&ids, &expiries, &until])
            .await
    }
}

/// Paused rules as the two array parameters of the `_UNPAUSED` claims.
#[allow(clippy::type_complexity)]
fn pause_columns(paused: &[PauseRule]) -> (Vec<Option<&str>>, Vec<Option<&str>>) {
    paused
        .iter()
        .map(|rule| (rule.application.as_deref(), rule.namespace.as_deref()))
        .unzip()
}

#[async_trait]
impl StoreView for PostgresStore {
    async fn inspect(&self, near: Duration, limit_rows: usize) -> StoreResult<Inspection> {
        const OP: &str = "inspect";
        let status = |id: &str, value: String| {
            value
                .parse::<ActivationStatus>()
                .map_err(|value| StoreError::InvalidRow {
                    id: id.to_owned(),
                    column: "status",
                    value,
                })
        };
        let groups = self
            .query(&self.pool, OP, INSPECT_GROUPS, &[])
            .await?
            .iter()
            .map(|row| {
                Ok(GroupCount {
                    status: status("(count)", row.get(0))?,
                    namespace: row.get(1),
                    taskname: row.get(2),
                    count: u64::try_from(row.get::<_, i64>(3)).unwrap_or(0),
                    oldest_received: row.get(4),
                    bytes: u64::try_from(row.get::<_, i64>(5)).unwrap_or(0),
                })
            })
            .collect::<StoreResult<Vec<_>>>()?;
        let near_expiry = self
            .query(
                &self.pool,
                OP,
                INSPECT_NEAR_EXPIRY,
                &[&micros(near), &limit(limit_rows)],
            )
            .await?
            .iter()
            .map(|row| {
                let id: String = row.get(0);
                Ok(NearExpiry {
                    status: status(&id, row.get(3))?,
                    namespace: row.get(1),
                    taskname: row.get(2),
                    due: row.get(4),
                    id,
                })
            })
            .collect::<StoreResult<Vec<_>>>()?;
        Ok(Inspection {
            groups,
            near_expiry,
        })
    }

    async fn row(&self, id: &str) -> StoreResult<Option<InflightActivation>> {
        self.get(id).await
    }
}
