//! The read side of the SQLite store: a small pool of read-only
//! connections for `get`, counts, lag and ping, which WAL lets run
//! concurrently with the writer. Callers use them on tokio's blocking pool.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use super::exec::sql_error;
use crate::store::StoreResult;

/// Read-only connections, opened on demand and kept up to `max_idle`.
pub(super) struct ReaderPool {
    pub(super) path: PathBuf,
    pub(super) busy_timeout: Duration,
    pub(super) max_idle: usize,
    pub(super) idle: Mutex<Vec<Connection>>,
}

impl ReaderPool {
    pub(super) fn take(&self, operation: &'static str) -> StoreResult<Connection> {
        if let Some(connection) = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Ok(connection);
        }
        let connection = Connection::open_with_flags(
            &self.path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| sql_error(operation, e))?;
        connection
            .busy_timeout(self.busy_timeout)
            .map_err(|e| sql_error(operation, e))?;
        Ok(connection)
    }

    pub(super) fn put(&self, connection: Connection) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < self.max_idle {
            idle.push(connection);
        }
    }
}
