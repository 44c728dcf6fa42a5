//! Broker identity and liveness on PostgreSQL (`Membership`): the rows of
//! `taskbroker_brokers` and the releases keyed by `claimed_by`.

use std::time::Duration;

use async_trait::async_trait;

use super::PostgresStore;
use super::rows::micros;
use crate::model::{BeatAnswer, BrokerRow, Registration, Takeover};
use crate::store::{Membership, StoreResult};

// `$1` id, `$2` host, `$3` incarnation, `$4` the takeover timeout (µs).
const REGISTER: &str = "WITH me AS (INSERT INTO taskbroker_brokers \
       (id, host, incarnation, started_at, heartbeat_at) VALUES ($1, $2, $3, now(), now()) \
       ON CONFLICT (id) DO UPDATE SET host = excluded.host, incarnation = excluded.incarnation, \
         started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at \
       RETURNING id) \
     SELECT (SELECT count(*) FROM taskbroker_brokers \
              WHERE id <> $1 AND heartbeat_at >= now() - $4::int8 * interval '1 microsecond') \
       FROM me";

// Only while the row is still Claimed by this id: a row anyone claimed
// since carries their id. The rows are locked in id order first, as by
// every batch write (sql.rs, `fenced_claims!`), so a worker's reports on
// the same rows cannot deadlock with it.
const RELEASE_PREVIOUS: &str = "WITH held AS MATERIALIZED (SELECT id \
       FROM inflight_taskactivations WHERE status = 'Claimed' AND claimed_by = $1 \
       ORDER BY id FOR UPDATE) \
     UPDATE inflight_taskactivations t SET status = 'Pending', claimed_by = NULL \
     FROM held WHERE t.id = held.id AND t.status = 'Claimed' AND t.claimed_by = $1";

// Whether the row was refreshed, and how many other brokers are silent for
// longer than `$3` µs (read from the statement's snapshot, before the
// UPDATE).
const HEARTBEAT: &str = "WITH beat AS (UPDATE taskbroker_brokers SET heartbeat_at = now() \
       WHERE id = $1 AND incarnation = $2 RETURNING 1) \
     SELECT (SELECT count(*) FROM beat), \
            (SELECT count(*) FROM taskbroker_brokers \
              WHERE id <> $1 AND heartbeat_at < now() - $3::int8 * interval '1 microsecond')";

const READ_BROKER: &str = "SELECT incarnation, heartbeat_at, \
       extract(epoch FROM now() - heartbeat_at)::float8 \
     FROM taskbroker_brokers WHERE id = $1";

// `$1` the caller (never taken over by itself), `$2` the timeout (µs). The
// DELETE locks each silent row, so of peers running this at once one takes
// a broker over and the others find its row gone; a heartbeat that commits
// first makes the row fresh again and the DELETE passes it by. The UPDATE
// returns that broker's claims to Pending in the same statement, having
// locked them in id order (`held`) as every batch write does, so reports or
// the resumed broker's own writes on the same rows cannot deadlock with it.
const TAKE_OVER_SILENT: &str = "WITH dead AS (DELETE FROM taskbroker_brokers \
       WHERE id <> $1 AND heartbeat_at < now() - $2::int8 * interval '1 microsecond' \
       RETURNING id, host, extract(epoch FROM now() - heartbeat_at)::float8 AS silent), \
     held AS MATERIALIZED (SELECT t.id, t.claimed_by FROM inflight_taskactivations t \
       JOIN dead ON t.claimed_by = dead.id WHERE t.status = 'Claimed' \
       ORDER BY t.id FOR UPDATE OF t), \
     released AS (UPDATE inflight_taskactivations t SET status = 'Pending', claimed_by = NULL \
       FROM held WHERE t.id = held.id AND t.status = 'Claimed' \
         AND t.claimed_by = held.claimed_by \
       RETURNING held.claimed_by AS broker) \
     SELECT d.id, d.host, d.silent, \
            (SELECT count(*) FROM released r WHERE r.broker = d.id) \
       FROM dead d ORDER BY d.id";

const UNREGISTER: &str = "DELETE FROM taskbroker_brokers WHERE id = $1 AND incarnation = $2";

#[async_trait]
impl Membership for PostgresStore {
    fn broker_id(&self) -> &str {
        &self.broker_id
    }

    async fn register_broker(
        &self,
        host: &str,
        incarnation: &str,
        live_within: Duration,
    ) -> StoreResult<Registration> {
        const OP: &str = "register_broker";
        let rows = self
            .query(
                &self.pool,
                OP,
                REGISTER,
                &[&self.broker_id, &host, &incarnation, &micros(live_within)],
            )
            .await?;
        let live_peers = rows.first().map_or(0, |row| row.get::<_, i64>(0));
        Ok(Registration {
            live_peers: u64::try_from(live_peers).unwrap_or(0),
        })
    }

    async fn release_previous_claims(&self) -> StoreResult<u64> {
        self.execute(
            &self.pool,
            "release_previous_claims",
            RELEASE_PREVIOUS,
            &[&self.broker_id],
        )
        .await
    }

    async fn read_broker(&self) -> StoreResult<Option<BrokerRow>> {
        let rows = self
            .query(&self.pool, "read_broker", READ_BROKER, &[&self.broker_id])
            .await?;
        Ok(rows.first().map(|row| BrokerRow {
            incarnation: row.get(0),
            heartbeat_at: row.get(1),
            silent_for: Duration::try_from_secs_f64(row.get::<_, f64>(2)).unwrap_or_default(),
        }))
    }

    async fn heartbeat(
        &self,
        incarnation: &str,
        silent_after: Duration,
    ) -> StoreResult<BeatAnswer> {
        let rows = self
            .query(
                &self.pool,
                "heartbeat",
                HEARTBEAT,
                &[&self.broker_id, &incarnation, &micros(silent_after)],
            )
            .await?;
        let (beat, silent) = rows
            .first()
            .map_or((0, 0), |row| (row.get::<_, i64>(0), row.get::<_, i64>(1)));
        if beat > 0 {
            return Ok(BeatAnswer::Accepted {
                silent_peers: u64::try_from(silent).unwrap_or(0),
            });
        }
        // Refused: look again in a statement of its own. The heartbeat's
        // snapshot predates a takeover it waited on, and would still show
        // the row the takeover deleted.
        Ok(match self.read_broker().await? {
            Some(row) if row.incarnation != incarnation => BeatAnswer::Replaced,
            _ => BeatAnswer::TakenOver,
        })
    }

    async fn take_over_silent(&self, timeout: Duration) -> StoreResult<Vec<Takeover>> {
        let rows = self
            .query(
                &self.pool,
                "take_over_silent",
                TAKE_OVER_SILENT,
                &[&self.broker_id, &micros(timeout)],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|row| Takeover {
                broker_id: row.get(0),
                host: row.get(1),
                silent_for: Duration::try_from_secs_f64(row.get::<_, f64>(2)).unwrap_or_default(),
                released: u64::try_from(row.get::<_, i64>(3)).unwrap_or(0),
            })
            .collect())
    }

    async fn unregister_broker(&self, incarnation: &str) -> StoreResult<bool> {
        let removed = self
            .execute(
                &self.pool,
                "unregister_broker",
                UNREGISTER,
                &[&self.broker_id, &incarnation],
            )
            .await?;
        Ok(removed == 1)
    }
}
