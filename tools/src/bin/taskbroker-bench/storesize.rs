//! How much the broker's store holds, read beside the running broker: its
//! rows and the bytes of their activations, the figure a store bounded by
//! bytes is bounded in. PostgreSQL through a connection of the harness's
//! own to the scratch database; SQLite through a read-only connection to
//! the file (WAL lets it read while the broker writes, and it takes
//! neither the writer nor the broker's lock), plus the size of the files.

use std::path::PathBuf;

use rusqlite::{Connection, OpenFlags};

use crate::harness::Scratch;

/// `octet_length` of a TOASTed value reads its header, not the value.
const POSTGRES_SIZE: &str = "SELECT count(*), coalesce(sum(octet_length(activation)), 0)::bigint \
                             FROM inflight_taskactivations";
/// `length` of a BLOB reads the record header, not its overflow pages.
const SQLITE_SIZE: &str =
    "SELECT count(*), coalesce(sum(length(activation)), 0) FROM inflight_taskactivations";

/// What the store holds at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreSize {
    pub rows: u64,
    pub activation_bytes: u64,
    /// SQLite: the files of the database (its WAL included).
    pub file_bytes: Option<u64>,
}

pub enum StoreProbe {
    Postgres(tokio_postgres::Client),
    Sqlite(PathBuf),
}

impl StoreProbe {
    /// A probe of `scratch`, once the broker has created its table.
    pub async fn open(scratch: &Scratch) -> Result<StoreProbe, String> {
        match scratch {
            Scratch::Postgres { url, .. } => Ok(StoreProbe::Postgres(crate::connect(url).await?)),
            Scratch::Sqlite { path } => Ok(StoreProbe::Sqlite(path.clone())),
        }
    }

    pub async fn size(&self) -> Result<StoreSize, String> {
        match self {
            StoreProbe::Postgres(client) => {
                let row = client
                    .query_one(POSTGRES_SIZE, &[])
                    .await
                    .map_err(|err| format!("reading the store's size: {err}"))?;
                Ok(StoreSize {
                    rows: non_negative(row.get(0)),
                    activation_bytes: non_negative(row.get(1)),
                    file_bytes: None,
                })
            }
            StoreProbe::Sqlite(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || sqlite_size(&path))
                    .await
                    .map_err(|err| format!("reading the store's size: {err}"))?
            }
        }
    }
}

fn sqlite_size(path: &std::path::Path) -> Result<StoreSize, String> {
    let failed = |err: rusqlite::Error| format!("reading {}: {err}", path.display());
    let connection = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(failed)?;
    connection
        .busy_timeout(std::time::Duration::from_secs(5))
        .map_err(failed)?;
    let (rows, bytes): (i64, i64) = connection
        .query_row(SQLITE_SIZE, [], |row| Ok((row.get(0)?, row.get(1)?)))
        .map_err(failed)?;
    let files = taskbroker::store::SqliteStore::files(path)
        .iter()
        .filter_map(|file| std::fs::metadata(file).ok())
        .map(|metadata| metadata.len())
        .sum();
    Ok(StoreSize {
        rows: non_negative(rows),
        activation_bytes: non_negative(bytes),
        file_bytes: Some(files),
    })
}

fn non_negative(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}
