//! What only the SQLite backend has to show, beyond the shared conformance
//! suite: the file gives space back after a burst drains (and a file
//! created without incremental vacuum is switched at open), survives
//! reopening, reports a bad path clearly, one failing operation in a group
//! commit fails alone, and a file from an earlier release migrates with
//! its rows.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{TestSqlite, incompressible, rows};
use taskbroker::model::{ActivationStatus, BucketRange, StatusUpdate, WorkerStatus};
use taskbroker::store::{ActivationStore, SqliteStore, SqliteStoreConfig, StoreError};

/// The length on disk of the database file.
fn file_bytes(db: &TestSqlite) -> u64 {
    std::fs::metadata(&db.path)
        .expect("the database file")
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_burst_of_large_tasks_gives_the_file_space_back() {
    let db = TestSqlite::new();
    let store = db.store().await;
    // 50 MiB: 200 tasks of 256 KiB, in batches as the consumer stores them.
    // Half finish by a worker's report (which deletes the row), half are
    // stored Complete and removed by upkeep's step.
    for chunk in 0..10 {
        let mut batch = rows(&format!("big-{chunk}"), 20);
        for (i, row) in batch.iter_mut().enumerate() {
            row.activation = incompressible(chunk * 100 + i as u64, 256 << 10);
            if chunk % 2 == 1 {
                row.status = ActivationStatus::Complete;
            }
        }
        store.insert_batch(&batch).await.unwrap();
    }
    let peak = file_bytes(&db);
    assert!(peak > 45 << 20, "peak {peak} bytes");
    // Claims stop at FETCH_BATCH_BYTES (16 MiB): claim until none is left.
    let mut claimed = Vec::new();
    loop {
        let batch = store
            .claim_for_push(BucketRange::ALL, 200, Duration::from_secs(60))
            .await
            .unwrap();
        if batch.is_empty() {
            break;
        }
        claimed.extend(batch);
    }
    assert_eq!(claimed.len(), 100);
    let reports: Vec<StatusUpdate> = claimed
        .iter()
        .map(|claim| StatusUpdate::new(claim.token.id.clone(), WorkerStatus::Complete))
        .collect();
    assert_eq!(store.set_status(&reports).await.unwrap().updated, 100);
    assert_eq!(store.remove_completed(1_000).await.unwrap(), 100);
    assert_eq!(store.count_by_status().await.unwrap().total(), 0);
    // Removing alone gives nothing back: the pages wait on the free list.
    assert!(file_bytes(&db) >= peak, "{} < {peak}", file_bytes(&db));

    // Reclaim runs are bounded: run them as upkeep does, until one says
    // there is no more to give back.
    let first = store
        .reclaim_space()
        .await
        .unwrap()
        .expect("SQLite has a file");
    assert!(
        first.before.free_bytes > 45 << 20,
        "the free list held the removed tasks: {first:?}"
    );
    assert!(first.more, "one run gives back at most 4 MiB: {first:?}");
    let mut last = first;
    for _ in 0..40 {
        if !last.more {
            break;
        }
        last = store
            .reclaim_space()
            .await
            .unwrap()
            .expect("SQLite has a file");
    }
    assert!(!last.more, "still more to give back: {last:?}");
    let after = file_bytes(&db);
    assert_eq!(
        last.after.file_bytes, after,
        "the answer is what is on disk"
    );
    // What stays is the slack kept for reuse (8 MiB) and the schema.
    assert!(
        after < 10 << 20,
        "file holds {after} bytes after draining (peak {peak}): {last:?}"
    );
    assert!(last.after.free_bytes <= 8 << 20, "{last:?}");
    assert_eq!(last.after.wal_bytes, 0, "the WAL is truncated: {last:?}");

    // The file still works: a run with nothing to give back is a no-op.
    store.insert_batch(&rows("after", 3)).await.unwrap();
    let idle = store
        .reclaim_space()
        .await
        .unwrap()
        .expect("SQLite has a file");
    assert!(!idle.more, "{idle:?}");
    assert_eq!(idle.before, idle.after);
    assert_eq!(store.count_by_status().await.unwrap().total(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_created_without_incremental_vacuum_is_switched_at_open() {
    // A file with the store's schema, a row, and 20 MiB of free pages,
    // created as SQLite does by default: auto_vacuum NONE.
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
        connection
            .execute_batch("CREATE TABLE filler (bytes BLOB)")
            .expect("a filler table");
        for i in 0..80 {
            connection
                .execute(
                    "INSERT INTO filler VALUES (?1)",
                    [incompressible(i, 256 << 10)],
                )
                .expect("filler");
        }
        connection
            .execute_batch("DROP TABLE filler")
            .expect("free the filler");
    }
    let auto_vacuum = |db: &TestSqlite| db.query("PRAGMA auto_vacuum", |row| row.get::<_, i64>(0));
    assert_eq!(auto_vacuum(&db), [0], "NONE, as created");
    let before = file_bytes(&db);
    assert!(before > 20 << 20, "{before} bytes");

    let store = db.store().await;
    assert_eq!(auto_vacuum(&db), [2], "INCREMENTAL after opening");
    assert!(
        file_bytes(&db) < 1 << 20,
        "the rewrite dropped the free pages: {} bytes",
        file_bytes(&db)
    );
    common::assert_v1_row_reads_back_with_no_edit(store.as_ref()).await;
    drop(store);
    // Once: a switched file opens as it is.
    let store = db.store().await;
    assert_eq!(auto_vacuum(&db), [2]);
    assert!(store.get("old").await.unwrap().is_some());
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
