//! PostgreSQL's own counters for a run of the multi-process scenarios
//! (`e2e`, `floor`): statements per task from pg_stat_statements and WAL
//! bytes from the WAL position, both read on the server, so they count what
//! the broker's store did, not what the harness thinks it asked for.

use crate::connect;

/// PostgreSQL's view of a run: statements (pg_stat_statements, when it is
/// loaded) and WAL bytes written (cluster-wide) since [`PgCounters::start`].
pub struct PgCounters {
    client: tokio_postgres::Client,
    database: String,
    lsn: String,
    statements: bool,
}

pub struct PgUse {
    /// `None` when pg_stat_statements is not loaded.
    pub statements: Option<u64>,
    pub wal_bytes: u64,
    /// (calls, rows, total execution ms, query), most time first.
    pub top: Vec<(i64, i64, f64, String)>,
}

impl PgCounters {
    pub async fn start(admin_url: &str, database: &str) -> Result<PgCounters, String> {
        let client = connect(admin_url).await?;
        let statements = client
            .batch_execute(
                "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()",
            )
            .await
            .is_ok();
        if !statements {
            eprintln!(
                "taskbroker-bench: pg_stat_statements is not loaded; statements per task will be missing \
                 (ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements', then restart PostgreSQL)"
            );
        }
        let lsn: String = client
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .map_err(|err| err.to_string())?
            .get(0);
        Ok(PgCounters {
            client,
            database: database.to_owned(),
            lsn,
            statements,
        })
    }

    pub async fn finish(&self) -> Result<PgUse, String> {
        let wal_bytes: i64 = self
            .client
            .query_one(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::bigint",
                &[&self.lsn],
            )
            .await
            .map_err(|err| err.to_string())?
            .get(0);
        let mut top = Vec::new();
        let mut statements = None;
        if self.statements {
            let rows = self
                .client
                .query(
                    "SELECT s.calls, s.rows, s.total_exec_time, regexp_replace(s.query, '\\s+', ' ', 'g') \
                     FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
                     WHERE d.datname = $1 ORDER BY s.total_exec_time DESC",
                    &[&self.database],
                )
                .await
                .map_err(|err| err.to_string())?;
            statements = Some(rows.iter().map(|row| row.get::<_, i64>(0) as u64).sum());
            top = rows
                .iter()
                .map(|row| (row.get(0), row.get(1), row.get(2), row.get(3)))
                .collect();
        }
        Ok(PgUse {
            statements,
            wal_bytes: wal_bytes.max(0) as u64,
            top,
        })
    }
}

/// Prints the statements that took the most execution time, shortened.
pub fn print_top_statements(usage: &PgUse, tasks: u64, limit: usize) {
    for (calls, rows, total_ms, query) in usage.top.iter().take(limit) {
        let query: String = query.chars().take(80).collect();
        println!(
            "    {:>6.3}/task {:>7.1} rows/call {:>7.3} ms/call {:>6.0} ms total  {query}",
            *calls as f64 / tasks.max(1) as f64,
            *rows as f64 / (*calls).max(1) as f64,
            total_ms / (*calls).max(1) as f64,
            total_ms
        );
    }
}
