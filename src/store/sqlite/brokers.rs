//! Broker identity and liveness on SQLite (`Membership`). Only one process
//! can open the file (`lock.rs`), so every broker row but this one's, and
//! every claim in the table at startup, belongs to a process that is gone.

use std::time::Duration;

use async_trait::async_trait;
use rusqlite::params;

use super::SqliteStore;
use super::exec::{execute, sql_error};
use super::rows::{duration_micros, now_micros};
use crate::model::{BeatAnswer, BrokerRow, Registration, Takeover};
use crate::store::{Membership, StoreResult};

// `?1` id, `?2` host, `?3` incarnation, `?4` now.
const REGISTER: &str = "INSERT INTO taskbroker_brokers \
       (id, host, incarnation, started_at, heartbeat_at) VALUES (?1, ?2, ?3, ?4, ?4) \
     ON CONFLICT (id) DO UPDATE SET host = excluded.host, incarnation = excluded.incarnation, \
       started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at";
const FORGET_OTHERS: &str = "DELETE FROM taskbroker_brokers WHERE id <> ?1";
const RELEASE_EVERY_CLAIM: &str =
    "UPDATE inflight_taskactivations SET status = 'Pending' WHERE status = 'Claimed'";
const HEARTBEAT: &str = "UPDATE taskbroker_brokers SET heartbeat_at = ?3 \
     WHERE id = ?1 AND incarnation = ?2";
const READ_BROKER: &str = "SELECT incarnation, heartbeat_at FROM taskbroker_brokers WHERE id = ?1";
// `?1` the caller, `?2` the oldest heartbeat still alive.
const COUNT_SILENT: &str =
    "SELECT count(*) FROM taskbroker_brokers WHERE id <> ?1 AND heartbeat_at < ?2";
// `?1` the caller, `?2` the oldest heartbeat still alive.
const REMOVE_SILENT: &str = "DELETE FROM taskbroker_brokers \
     WHERE id <> ?1 AND heartbeat_at < ?2 RETURNING id, host, heartbeat_at";
const RELEASE_CLAIMS_OF: &str = "UPDATE inflight_taskactivations SET status = 'Pending' \
     WHERE status = 'Claimed' AND claimed_by = ?1";
const UNREGISTER: &str = "DELETE FROM taskbroker_brokers WHERE id = ?1 AND incarnation = ?2";

#[async_trait]
impl Membership for SqliteStore {
    fn broker_id(&self) -> &str {
        &self.broker_id
    }

    /// Rows of other brokers are of processes that are gone: removed, and
    /// never counted as live peers.
    async fn register_broker(
        &self,
        host: &str,
        incarnation: &str,
        _live_within: Duration,
    ) -> StoreResult<Registration> {
        const OP: &str = "register_broker";
        let (id, host, incarnation) = (
            self.broker_id.clone(),
            host.to_owned(),
            incarnation.to_owned(),
        );
        self.write(OP, true, move |connection| {
            execute(connection, OP, FORGET_OTHERS, params![id])?;
            execute(
                connection,
                OP,
                REGISTER,
                params![id, host, incarnation, now_micros()],
            )?;
            Ok(Registration { live_peers: 0 })
        })
        .await
    }

    async fn release_previous_claims(&self) -> StoreResult<u64> {
        const OP: &str = "release_previous_claims";
        self.write(OP, true, move |connection| {
            execute(connection, OP, RELEASE_EVERY_CLAIM, [])
        })
        .await
    }

    async fn read_broker(&self) -> StoreResult<Option<BrokerRow>> {
        const OP: &str = "read_broker";
        let id = self.broker_id.clone();
        self.write(OP, false, move |connection| {
            let row = read_row(connection, &id).map_err(|e| sql_error(OP, e))?;
            let now = now_micros();
            Ok(row.map(|(incarnation, heartbeat_at)| BrokerRow {
                incarnation,
                heartbeat_at: chrono::DateTime::from_timestamp_micros(heartbeat_at)
                    .unwrap_or_default(),
                silent_for: Duration::from_micros(
                    u64::try_from(now.saturating_sub(heartbeat_at)).unwrap_or(0),
                ),
            }))
        })
        .await
    }

    async fn heartbeat(
        &self,
        incarnation: &str,
        silent_after: Duration,
    ) -> StoreResult<BeatAnswer> {
        const OP: &str = "heartbeat";
        let (id, incarnation) = (self.broker_id.clone(), incarnation.to_owned());
        let silent_after = duration_micros(silent_after);
        self.write(OP, false, move |connection| {
            let now = now_micros();
            if execute(connection, OP, HEARTBEAT, params![id, incarnation, now])? == 1 {
                let silent_peers: i64 = connection
                    .query_row(
                        COUNT_SILENT,
                        params![id, now.saturating_sub(silent_after)],
                        |row| row.get(0),
                    )
                    .map_err(|e| sql_error(OP, e))?;
                return Ok(BeatAnswer::Accepted {
                    silent_peers: u64::try_from(silent_peers).unwrap_or(0),
                });
            }
            Ok(
                match read_row(connection, &id).map_err(|e| sql_error(OP, e))? {
                    Some(_) => BeatAnswer::Replaced,
                    None => BeatAnswer::TakenOver,
                },
            )
        })
        .await
    }

    async fn take_over_silent(&self, timeout: Duration) -> StoreResult<Vec<Takeover>> {
        const OP: &str = "take_over_silent";
        let id = self.broker_id.clone();
        let timeout = duration_micros(timeout);
        self.write(OP, true, move |connection| {
            let now = now_micros();
            let silent: Vec<(String, String, i64)> = connection
                .prepare_cached(REMOVE_SILENT)
                .and_then(|mut statement| {
                    statement
                        .query_map(params![id, now.saturating_sub(timeout)], |row| {
                            Ok((row.get(0)?, row.get(1)?, row.get(2)?))
                        })?
                        .collect()
                })
                .map_err(|e| sql_error(OP, e))?;
            silent
                .into_iter()
                .map(|(broker_id, host, heartbeat_at)| {
                    let released = execute(connection, OP, RELEASE_CLAIMS_OF, params![broker_id])?;
                    let silent_for = u64::try_from(now.saturating_sub(heartbeat_at)).unwrap_or(0);
                    Ok(Takeover {
                        broker_id,
                        host,
                        silent_for: Duration::from_micros(silent_for),
                        released,
                    })
                })
                .collect()
        })
        .await
    }

    async fn unregister_broker(&self, incarnation: &str) -> StoreResult<bool> {
        const OP: &str = "unregister_broker";
        let (id, incarnation) = (self.broker_id.clone(), incarnation.to_owned());
        self.write(OP, true, move |connection| {
            execute(connection, OP, UNREGISTER, params![id, incarnation]).map(|n| n == 1)
        })
        .await
    }
}

/// This id's row: its incarnation and heartbeat (µs).
fn read_row(
    connection: &rusqlite::Connection,
    id: &str,
) -> rusqlite::Result<Option<(String, i64)>> {
    use rusqlite::OptionalExtension;
    connection
        .prepare_cached(READ_BROKER)?
        .query_row(params![id], |row| Ok((row.get(0)?, row.get(1)?)))
        .optional()
}
