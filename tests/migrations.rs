//! PostgreSQL migrations: safe when several replicas start at once, and the
//! schema they build is the operator-facing contract of DESIGN.md ("Store"),
//! reached from an earlier release's table without losing its rows.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use common::TestDb;
use taskbroker::store::{ActivationStore, PostgresStore};

const MIGRATORS: usize = 6;
const TABLE: &str = "inflight_taskactivations";

/// The migration files as (version, name), e.g. `V1__create_x.sql` →
/// (1, "create_x"), which is how refinery records them.
fn migration_files() -> BTreeSet<(i32, String)> {
    migration_sql()
        .into_iter()
        .map(|(file, _)| {
            let stem = file.strip_suffix(".sql").expect("a .sql file");
            let (version, name) = stem
                .strip_prefix('V')
                .and_then(|rest| rest.split_once("__"))
                .unwrap_or_else(|| panic!("{file} is not named V<version>__<name>.sql"));
            let version = version
                .parse()
                .unwrap_or_else(|err| panic!("{file} has a bad version: {err}"));
            (version, name.to_owned())
        })
        .collect()
}

/// Every `migrations/postgres/*.sql` file, as (file name, contents).
fn migration_sql() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("migrations/postgres");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|err| panic!("cannot read {}: {err}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "sql"))
        .map(|path| {
            let name = path
                .file_name()
                .and_then(|name| name.to_str())
                .expect("UTF-8 file name")
                .to_owned();
            let sql = std::fs::read_to_string(&path)
                .unwrap_or_else(|err| panic!("cannot read {}: {err}", path.display()));
            (name, sql)
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no migrations in {}", dir.display());
    files
}

/// Index names the migrations create (and do not drop again), so the test
/// follows new migrations without being edited.
fn indexes_in_migrations() -> BTreeSet<String> {
    let mut indexes = BTreeSet::new();
    for (_, sql) in migration_sql() {
        let words: Vec<String> = sql
            .lines()
            .map(|line| line.split("--").next().unwrap_or(""))
            .flat_map(str::split_whitespace)
            .map(|word| word.trim_end_matches(';').to_lowercase())
            .collect();
        for (i, word) in words.iter().enumerate() {
            if word != "index" || i == 0 {
                continue;
            }
            let after_if_exists = |at: usize| match words.get(at).map(String::as_str) {
                Some("if") => {
                    at + if words.get(at + 1).map(String::as_str) == Some("not") {
                        3
                    } else {
                        2
                    }
                }
                _ => at,
            };
            let name_at = match words.get(i + 1).map(String::as_str) {
                Some("concurrently") => after_if_exists(i + 2),
                _ => after_if_exists(i + 1),
            };
            let Some(name) = words.get(name_at).cloned() else {
                continue;
            };
            match words[i - 1].as_str() {
                "create" | "unique" => {
                    indexes.insert(name);
                }
                "drop" => {
                    indexes.remove(&name);
                }
                _ => {}
            }
        }
    }
    indexes
}

async fn schema_history(client: &tokio_postgres::Client) -> Vec<(i32, String, String, String)> {
    client
        .query(
            "SELECT version, name, applied_on, checksum FROM refinery_schema_history \
             ORDER BY version",
            &[],
        )
        .await
        .expect("read refinery_schema_history")
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2), row.get(3)))
        .collect()
}

async fn table_indexes(client: &tokio_postgres::Client) -> BTreeSet<String> {
    client
        .query(
            "SELECT indexname::text FROM pg_indexes WHERE tablename = $1",
            &[&TABLE],
        )
        .await
        .expect("read pg_indexes")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrators_all_succeed_once() {
    let db = TestDb::new().await;
    // Each migrator is its own store, as separate replicas would be; the
    // barrier releases them together so their migrations really overlap.
    let start = Arc::new(tokio::sync::Barrier::new(MIGRATORS));
    let migrators: Vec<_> = (0..MIGRATORS)
        .map(|_| {
            let store = PostgresStore::connect(&db.store_config()).expect("store config");
            let start = Arc::clone(&start);
            tokio::spawn(async move {
                start.wait().await;
                store.migrate().await
            })
        })
        .collect();
    for (i, migrator) in futures::future::join_all(migrators)
        .await
        .into_iter()
        .enumerate()
    {
        migrator
            .expect("migrator task")
            .unwrap_or_else(|err| panic!("migrator {i} failed: {err}"));
    }

    let client = db.client().await;
    let history = schema_history(&client).await;
    let applied: Vec<(i32, String)> = history
        .iter()
        .map(|(version, name, _, _)| (*version, name.clone()))
        .collect();
    let expected: Vec<(i32, String)> = migration_files().into_iter().collect();
    assert_eq!(applied, expected, "one history row per migration file");

    let table: Option<String> = client
        .query_one("SELECT to_regclass($1)::text", &[&TABLE])
        .await
        .expect("look up the table")
        .get(0);
    assert_eq!(table.as_deref(), Some(TABLE));
    let indexes = table_indexes(&client).await;
    let mut expected_indexes = indexes_in_migrations();
    expected_indexes.insert(format!("{TABLE}_pkey"));
    assert!(expected_indexes.len() > 1, "the migrations create indexes");
    assert_eq!(indexes, expected_indexes);

    // A replica that starts later finds nothing to do.
    PostgresStore::connect(&db.store_config())
        .expect("store config")
        .migrate()
        .await
        .expect("migrating a migrated database");
    assert_eq!(schema_history(&client).await, history);
    assert_eq!(table_indexes(&client).await, indexes);
}

#[tokio::test]
async fn table_has_the_design_columns_with_their_types() {
    // DESIGN.md, "Store": name, information_schema type, nullable.
    const TIMESTAMPTZ: &str = "timestamp with time zone";
    let expected: [(&str, &str, bool); 22] = [
        ("id", "text", false),
        ("activation", "bytea", false),
        ("topic", "text", false),
        ("partition", "integer", false),
        ("kafka_offset", "bigint", false),
        ("added_at", TIMESTAMPTZ, false),
        ("received_at", TIMESTAMPTZ, false),
        ("processing_attempts", "integer", false),
        ("expires_at", TIMESTAMPTZ, true),
        ("delay_until", TIMESTAMPTZ, true),
        ("processing_deadline_duration", "integer", false),
        ("processing_deadline", TIMESTAMPTZ, true),
        ("claim_expires_at", TIMESTAMPTZ, true),
        ("status", "text", false),
        ("at_most_once", "boolean", false),
        ("application", "text", false),
        ("namespace", "text", false),
        ("taskname", "text", false),
        ("on_attempts_exceeded", "integer", false),
        ("bucket", "smallint", false),
        ("retry_max_attempts", "bigint", true),
        ("retry_delay_on_retry", "bigint", true),
    ];
    let db = TestDb::new().await;
    let _store = db.store().await;
    let client = db.client().await;

    let rows = client
        .query(
            "SELECT column_name::text, data_type::text, is_nullable::text \
             FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name = $1",
            &[&TABLE],
        )
        .await
        .expect("read information_schema.columns");
    let columns: std::collections::BTreeMap<String, (String, bool)> = rows
        .iter()
        .map(|row| {
            let nullable: String = row.get(2);
            (row.get(0), (row.get(1), nullable == "YES"))
        })
        .collect();
    for (name, data_type, nullable) in expected {
        let Some((actual_type, actual_nullable)) = columns.get(name) else {
            panic!("column {name} is missing; the table has {columns:?}");
        };
        assert_eq!(actual_type, data_type, "type of column {name}");
        assert_eq!(*actual_nullable, nullable, "nullability of column {name}");
    }

    let primary_key: Vec<String> = client
        .query(
            "SELECT a.attname::text FROM pg_index i \
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
             WHERE i.indrelid = $1::text::regclass AND i.indisprimary",
            &[&TABLE],
        )
        .await
        .expect("read the primary key")
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(primary_key, ["id"]);
}

#[tokio::test]
async fn rows_stored_before_the_retry_edit_columns_read_back_with_no_edit() {
    // A table as the first release left it, holding a row, then migrated.
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(include_str!(
            "../migrations/postgres/V1__create_inflight_taskactivations.sql"
        ))
        .await
        .expect("the V1 schema");
    client
        .batch_execute(&common::v1_row_sql("'\\x0a036f6c64'", "now()"))
        .await
        .expect("a V1 row");
    let store = db.store().await;
    common::assert_v1_row_reads_back_with_no_edit(store.as_ref()).await;
}
