//! What only the SQLite backend has to show, beyond the shared conformance
//! suite: the file gives space back, survives reopening, reports a bad path
//! clearly, one failing operation in a group commit fails alone, and a file
//! from an earlier release migrates with its rows.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{TestSqlite, rows};
use taskbroker::model::{ActivationStatus, BucketRange};
use taskbroker::store::{ActivationStore, SqliteStore, SqliteStoreConfig, StoreError};

/// Logical size of the database file in bytes.
fn database_bytes(db: &TestSqlite) -> i64 {
    db.query(
        "SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()",
        |row| row.get(0),
    )[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_completed_rows_gives_the_space_back() {
    let db = TestSqlite::new();
    let store = db.store().await;
    let empty = database_bytes(&db);
    // 40 MiB of finished work: 20,000 rows of 2 KiB.
    for chunk in 0..20 {
        let mut batch = rows(&format!("big-{chunk}"), 1_000);
        for row in &mut batch {
            row.activation = vec![7; 2048];
            row.status = ActivationStatus::Complete;
        }
        store.insert_batch(&batch).await.unwrap();
    }
    let peak = database_bytes(&db);
    assert!(peak > 40 << 20, "peak {peak} bytes");

    while store.remove_completed(1_000).await.unwrap() > 0 {}
    assert_eq!(store.count_by_status().await.unwrap().total(), 0);
    let after = database_bytes(&db);
    // What stays is the slack kept for reuse (8 MiB) and the schema.
    assert!(
        after < empty + (9 << 20),
        "file holds {after} bytes after removing everything (peak {peak}, empty {empty})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_and_claims_survive_reopening_the_file() {
    let db = TestSqlite::new();
    let claim = {
        let store = db.store().await;
        store.insert_batch(&rows("keep", 3)).await.unwrap();
        let claimed = store
            .claim_for_push(BucketRange::ALL, 1, Duration::from_secs(30))
            .await
            .unwrap();
        claimed[0].claim_token().unwrap()
    };
    // Reopened, and migrated again: a no-op on a migrated file.
    let store = db.store().await;
    let row = store.get(&claim.id).await.unwrap().expect("row kept");
    assert_eq!(row.status, ActivationStatus::Claimed);
    assert_eq!(row.claim_expires_at, Some(claim.claim_expires_at));
    assert_eq!(store.count_by_status().await.unwrap().total(), 3);
    assert_eq!(store.release_claims(&[claim]).await.unwrap(), 1);
}

#[tokio::test]
async fn a_path_in_a_missing_directory_is_a_clear_configuration_error() {
    let err = SqliteStore::open(&SqliteStoreConfig::new(
        "/nonexistent-taskbroker-dir/sub/taskbroker.sqlite",
    ))
    .err()
    .expect("cannot open");
    match err {
        StoreError::Config(message) => assert!(
            message.contains("/nonexistent-taskbroker-dir/sub")
                && message.contains("does not exist"),
            "{message}"
        ),
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_store_on_the_same_file_is_refused_until_the_first_closes() {
    let db = TestSqlite::new();
    let first = db.store().await;
    let err = SqliteStore::open(&db.store_config())
        .err()
        .expect("the file is taken");
    match err {
        StoreError::Config(message) => assert!(message.contains("in use"), "{message}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
    drop(first);
    let again = db.store().await;
    assert_eq!(again.count_by_status().await.unwrap().total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_file_reached_through_a_symlink_is_refused_too() {
    let db = TestSqlite::new();
    let _first = db.store().await;
    let link = db.path.with_extension("link.sqlite");
    std::os::unix::fs::symlink(&db.path, &link).expect("symlink");
    let mut config = db.store_config();
    config.path = link.clone();
    let err = SqliteStore::open(&config).err();
    let _ = std::fs::remove_file(&link);
    match err {
        Some(StoreError::Config(message)) => assert!(message.contains("in use"), "{message}"),
        other => panic!("a second process got the file through a symlink: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_operation_rolls_back_alone_within_a_group_commit() {
    let db = TestSqlite::new();
    let store: Arc<dyn ActivationStore> = db.store().await;
    // Twenty inserts queued at once reach the writer together and share a
    // transaction; one of them breaks a constraint halfway through.
    let inserts = (0..20).map(|i| {
        let store = Arc::clone(&store);
        let mut batch = rows(&format!("group-{i}"), 50);
        if i == 7 {
            batch[25].bucket = 999;
        }
        async move { store.insert_batch(&batch).await }
    });
    let results = futures::future::join_all(inserts).await;
    for (i, result) in results.iter().enumerate() {
        if i == 7 {
            assert!(
                matches!(result, Err(StoreError::Rejected { .. })),
                "bad batch: {result:?}"
            );
        } else {
            assert_eq!(result, &Ok(50), "batch {i}");
        }
    }
    assert_eq!(store.count_by_status().await.unwrap().total(), 19 * 50);
    assert!(
        store.get("group-7-0").await.unwrap().is_none(),
        "the failed batch stored none of its rows"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_stored_before_the_retry_edit_columns_read_back_with_no_edit() {
    // A file as the first release left it, holding a row, then migrated.
    let db = TestSqlite::new();
    {
        let connection = rusqlite::Connection::open(&db.path).expect("create the file");
        connection
            .execute_batch(include_str!(
                "../migrations/sqlite/V1__create_inflight_taskactivations.sql"
            ))
            .expect("the V1 schema");
        connection
            .execute_batch(&common::v1_row_sql("x'0a036f6c64'", "0"))
            .expect("a V1 row");
    }
    let store = db.store().await;
    common::assert_v1_row_reads_back_with_no_edit(store.as_ref()).await;
}
