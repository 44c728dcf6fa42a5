//! The store conformance suite: every operation and transition of
//! `ActivationStore`, written once and run against every backend on a real
//! database (never a mock). Each test gets a database of its own.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeDelta, Utc};
use common::{insert, now, row, row_from, rows, task};
use prost::Message;
use taskbroker::model::{
    ActivationStatus, BucketRange, ClaimToken, ClaimedActivation, Dispatch, Glob,
    InflightActivation, Killswitch, NamespaceResult, OnAttemptsExceeded, PauseRule, PublishKind,
    PullFilter, RetryEdit, StatusUpdate, StatusUpdateOutcome, WorkerStatus,
};
use taskbroker::proto::TaskActivation;
use taskbroker::store::{ActivationStore, PostgresStore, PostgresStoreConfig, StoreError};

const LEASE: Duration = Duration::from_secs(30);
const NO_GRACE: Duration = Duration::ZERO;

type Store = Arc<dyn ActivationStore>;

/// Generates one `#[tokio::test]` per case for each backend: the same case
/// body runs on PostgreSQL and on SQLite, each on a database of its own. No
/// case is skipped for either backend.
macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let db = crate::common::TestDb::new().await;
                    let store: crate::Store = db.store().await;
                    crate::$case(store).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let db = crate::common::TestSqlite::new();
                    let store: crate::Store = db.store().await;
                    crate::$case(store).await;
                }
            )*
        }
    };
}

conformance!(
    insert_is_idempotent_and_counts_new_rows,
    insert_keeps_every_column,
    empty_batches_are_noops,
    insert_of_a_row_the_store_refuses_is_rejected_and_stores_nothing,
    text_only_one_store_refuses_is_rejected_there_not_unavailable,
    claim_returns_oldest_first_with_the_stored_expiry,
    claim_only_takes_its_bucket_range,
    claim_skips_expired_and_non_pending_rows,
    concurrent_claims_hand_out_distinct_ids,
    release_returns_claims_to_pending_without_an_attempt,
    release_skips_rows_claimed_again,
    every_claim_writes_a_later_expiry,
    release_leaves_processing_rows_alone,
    mark_processing_sets_the_deadline,
    mark_processing_after_release_changes_nothing,
    undo_claim_is_fenced,
    undeliverable_claims_consume_attempts_until_failure,
    pull_claim_filters_by_application_and_namespace,
    pull_claim_skips_expired_rows,
    status_updates_apply_only_to_claimed_or_processing,
    a_report_that_finishes_the_task_deletes_its_row_and_leaves_upkeep_nothing,
    repeated_status_updates_are_idempotent,
    reports_on_overdue_or_redelivered_rows_count_as_late,
    retry_update_stores_the_edit_and_leaves_the_bytes,
    retry_edit_ignored_for_rows_not_handed_out,
    retry_edits_are_kept_per_row_and_only_with_retry,
    published_retry_carries_the_edit,
    delete_batch_removes_rows,
    expired_claims_return_to_pending_without_an_attempt,
    deadline_overrun_returns_to_pending_with_an_attempt,
    at_most_once_deadline_overrun_fails,
    exhausted_attempts_fail,
    expired_pending_rows_are_removed,
    delayed_rows_become_pending_when_due,
    retries_are_taken_published_and_removed,
    failures_are_dead_lettered_or_discarded,
    concurrent_publish_takers_never_share_rows,
    taken_rows_are_offered_again_after_the_lease,
    upkeep_statements_respect_their_limit,
    counts_by_status,
    inflight_rows_are_counted_per_topic,
    stored_bytes_are_summed_per_topic_through_inserts_and_every_kind_of_removal,
    every_push_claim_stops_at_its_byte_budget_and_takes_at_least_one_row,
    max_pending_lag_is_delay_adjusted_and_first_attempt_only,
    batch_operations_take_ids_with_quotes_backslashes_and_control_characters,
    failed_claims_become_failure_with_the_attempt_consumed,
    fail_claims_is_fenced,
    deferred_claims_wait_in_delay_without_an_attempt,
    defer_claims_is_fenced,
    ping_answers,
    claims_leave_out_paused_applications_and_namespaces,
    pull_claims_leave_out_paused_applications_and_namespaces,
    killswitched_rows_are_removed_except_processing,
    killswitch_patterns_take_sql_wildcards_literally,
    demoted_rows_are_taken_under_a_lease_and_removed_once_forwarded,
    limited_claims_never_exceed_the_limit_even_when_claimers_race,
    fair_claims_share_the_batch_between_namespaces_by_weight,
    fair_claims_fill_the_batch_and_keep_to_the_bucket_range,
    fair_claims_take_every_flow_of_every_application,
);

// ---------------------------------------------------------------- helpers

async fn status_of(store: &Store, id: &str) -> ActivationStatus {
    store
        .get(id)
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("row {id} missing"))
        .status
}

async fn fetch(store: &Store, id: &str) -> InflightActivation {
    store
        .get(id)
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("row {id} missing"))
}

async fn claim_all(store: &Store, lease: Duration) -> Vec<ClaimedActivation> {
    store
        .claim_for_push(BucketRange::ALL, 1000, lease)
        .await
        .expect("claim")
}

fn tokens(claimed: &[ClaimedActivation]) -> Vec<ClaimToken> {
    claimed.iter().map(|row| row.token.clone()).collect()
}

fn ids<R: AsRef<InflightActivation>>(rows: &[R]) -> Vec<String> {
    rows.iter().map(|row| row.as_ref().id.clone()).collect()
}

/// Rows in Processing: claimed then marked.
async fn processing(store: &Store, prefix: &str, n: usize) -> Vec<String> {
    insert(store.as_ref(), &rows(prefix, n)).await;
    let claimed = claim_all(store, LEASE).await;
    store
        .mark_processing(&tokens(&claimed), Duration::from_secs(60))
        .await
        .expect("mark processing");
    ids(&claimed)
}

/// Runs `tasks` takers at once, each calling `take` until it gets nothing
/// back; returns every id any of them got, in no particular order.
async fn take_concurrently<F, Fut>(store: &Store, tasks: usize, take: F) -> Vec<String>
where
    F: Fn(Store) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Vec<String>> + Send,
{
    let mut takers = Vec::new();
    for _ in 0..tasks {
        let (store, take) = (Arc::clone(store), take.clone());
        takers.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let got = take(Arc::clone(&store)).await;
                if got.is_empty() {
                    return mine;
                }
                mine.extend(got);
            }
        }));
    }
    let mut all = Vec::new();
    for taker in takers {
        all.extend(taker.await.unwrap());
    }
    all
}

fn with_status(mut row: InflightActivation, status: ActivationStatus) -> InflightActivation {
    row.status = status;
    row
}

// ---------------------------------------------------------------- inserts

async fn insert_is_idempotent_and_counts_new_rows(store: Store) {
    let batch = rows("a", 3);
    assert_eq!(store.insert_batch(&batch).await.unwrap(), 3);
    let mut again = rows("a", 3)[1..].to_vec();
    again.push(row("b"));
    assert_eq!(store.insert_batch(&again).await.unwrap(), 1);
    // Duplicates inside one batch are fine too.
    assert_eq!(store.insert_batch(&[row("c"), row("c")]).await.unwrap(), 1);
    assert_eq!(store.count_by_status().await.unwrap().total(), 5);
}

async fn insert_keeps_every_column(store: Store) {
    let mut activation = task("full");
    activation.expires = Some(600);
    activation.delay = Some(120);
    let mut original = row_from(&activation);
    original.partition = 7;
    original.kafka_offset = 12_345;
    original.processing_attempts = 2;
    original.at_most_once = true;
    original.on_attempts_exceeded = OnAttemptsExceeded::Deadletter;
    original.activation = activation.encode_to_vec();
    original.retry_edit = RetryEdit {
        max_attempts: Some(u32::MAX),
        delay_on_retry: Some(u64::MAX),
    };
    insert(store.as_ref(), std::slice::from_ref(&original)).await;
    assert_eq!(fetch(&store, "full").await, original);
    assert_eq!(original.status, ActivationStatus::Delay);
}

async fn insert_of_a_row_the_store_refuses_is_rejected_and_stores_nothing(store: Store) {
    // A row built by hand past the decode checks: both schemas refuse a
    // bucket outside 0..=255 with a CHECK constraint.
    let mut batch = rows("refused", 5);
    batch[2].bucket = 999;
    let err = store.insert_batch(&batch).await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Rejected {
                operation: "insert_batch",
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.kind(), "rejected");
    assert!(!err.is_unavailable(), "retrying cannot help");
    assert_eq!(store.count_by_status().await.unwrap().total(), 0);
    // The good rows alone go in.
    batch.remove(2);
    assert_eq!(store.insert_batch(&batch).await.unwrap(), 4);
}

async fn text_only_one_store_refuses_is_rejected_there_not_unavailable(store: Store) {
    // PostgreSQL cannot keep a NUL character in TEXT (SQLSTATE 22021) and
    // refuses an index entry over its B-tree limit (54000); SQLite keeps
    // both. Decoding refuses both long before (activation::check_text);
    // this is the defence behind it.
    let mut nul = row("nul-namespace");
    nul.namespace = "ns\0with-nul".to_owned();
    // Varied text, so compression cannot shrink the key under the limit.
    let long_id: String = (0..3_000u32)
        .map(|i| char::from(b'!' + ((i.wrapping_mul(7919) ^ (i >> 3)) % 90) as u8))
        .collect();
    let mut long = row("long-id");
    long.id = long_id;
    for refused in [nul, long] {
        let result = store.insert_batch(std::slice::from_ref(&refused)).await;
        match store.backend() {
            "postgres" => assert!(
                matches!(result, Err(StoreError::Rejected { .. })),
                "{result:?}"
            ),
            _ => assert_eq!(result, Ok(1)),
        }
    }
}

async fn empty_batches_are_noops(store: Store) {
    assert_eq!(store.insert_batch(&[]).await.unwrap(), 0);
    assert_eq!(store.release_claims(&[]).await.unwrap(), 0);
    assert!(
        store
            .mark_processing(&[], NO_GRACE)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        store.set_status(&[]).await.unwrap(),
        StatusUpdateOutcome::default()
    );
    assert_eq!(store.delete_batch(&[]).await.unwrap(), 0);
    assert_eq!(store.mark_published(&[]).await.unwrap(), 0);
    assert_eq!(store.fail_claim_attempt(&[], 5).await.unwrap(), 0);
    assert!(
        store
            .claim_for_push(BucketRange::ALL, 0, LEASE)
            .await
            .unwrap()
            .is_empty()
    );
}

// ---------------------------------------------------------------- push claims

async fn claim_returns_oldest_first_with_the_stored_expiry(store: Store) {
    let mut batch = rows("r", 5);
    batch.reverse(); // insertion order must not matter, added_at does
    insert(store.as_ref(), &batch).await;
    let before = Utc::now();
    let claimed = store
        .claim_for_push(BucketRange::ALL, 3, LEASE)
        .await
        .unwrap();
    assert_eq!(ids(&claimed), ["r-0", "r-1", "r-2"]);
    for row in &claimed {
        assert_eq!(row.status, ActivationStatus::Claimed);
        let stored = fetch(&store, &row.id).await;
        assert_eq!(stored.status, ActivationStatus::Claimed);
        assert_eq!(stored.claim_expires_at, row.claim_expires_at);
        let expiry = row.claim_expires_at.unwrap();
        let lease = TimeDelta::from_std(LEASE).unwrap();
        assert!(expiry > before + lease - TimeDelta::seconds(5));
        assert!(expiry < Utc::now() + lease + TimeDelta::seconds(5));
    }
    assert_eq!(status_of(&store, "r-3").await, ActivationStatus::Pending);
}

async fn claim_only_takes_its_bucket_range(store: Store) {
    let batch = rows("b", 200);
    insert(store.as_ref(), &batch).await;
    let range = BucketRange::slice(1, 4);
    let claimed = store.claim_for_push(range, 1000, LEASE).await.unwrap();
    let expected: HashSet<String> = batch
        .iter()
        .filter(|row| (range.first..=range.last).contains(&row.bucket))
        .map(|row| row.id.clone())
        .collect();
    assert!(!expected.is_empty());
    assert_eq!(ids(&claimed).into_iter().collect::<HashSet<_>>(), expected);
}

async fn claim_skips_expired_and_non_pending_rows(store: Store) {
    let mut expired = task("expired");
    expired.received_at = Some(prost_types::Timestamp {
        seconds: (now() - TimeDelta::seconds(100)).timestamp(),
        nanos: 0,
    });
    expired.expires = Some(10);
    let mut delayed = task("delayed");
    delayed.delay = Some(600);
    insert(
        store.as_ref(),
        &[
            row_from(&expired),
            row_from(&delayed),
            with_status(row("done"), ActivationStatus::Complete),
            with_status(row("retry"), ActivationStatus::Retry),
            row("ok"),
        ],
    )
    .await;
    assert_eq!(ids(&claim_all(&store, LEASE).await), ["ok"]);
}

async fn concurrent_claims_hand_out_distinct_ids(store: Store) {
    const ROWS: usize = 2000;
    for chunk in rows("c", ROWS).chunks(500) {
        insert(store.as_ref(), chunk).await;
    }
    let all = take_concurrently(&store, 16, |store| async move {
        let claimed = store
            .claim_for_push(BucketRange::ALL, 16, LEASE)
            .await
            .expect("claim");
        ids(&claimed)
    })
    .await;
    let distinct: HashSet<&String> = all.iter().collect();
    assert_eq!(all.len(), ROWS, "every row claimed once");
    assert_eq!(distinct.len(), ROWS, "no row claimed twice");
}

// ---------------------------------------------------------------- fenced transitions

async fn release_returns_claims_to_pending_without_an_attempt(store: Store) {
    insert(store.as_ref(), &rows("rel", 4)).await;
    let claimed = claim_all(&store, LEASE).await;
    assert_eq!(store.release_claims(&tokens(&claimed)).await.unwrap(), 4);
    for id in ids(&claimed) {
        let row = fetch(&store, &id).await;
        assert_eq!(row.status, ActivationStatus::Pending);
        assert_eq!(row.processing_attempts, 0);
    }
    // Released rows can be claimed again at once.
    assert_eq!(claim_all(&store, LEASE).await.len(), 4);
}

async fn release_skips_rows_claimed_again(store: Store) {
    insert(store.as_ref(), &[row("x")]).await;
    let first = claim_all(&store, Duration::ZERO).await;
    // The lease ran out and upkeep returned it; another fetch claims it again.
    assert_eq!(store.release_expired_claims(100).await.unwrap(), 1);
    let second = claim_all(&store, LEASE).await;
    assert_eq!(ids(&second), ["x"]);

    // The late release from the first claim must not undo the second.
    assert_eq!(store.release_claims(&tokens(&first)).await.unwrap(), 0);
    let stored = fetch(&store, "x").await;
    assert_eq!(stored.status, ActivationStatus::Claimed);
    assert_eq!(stored.claim_expires_at, second[0].claim_expires_at);
    // The current holder's release still works.
    assert_eq!(store.release_claims(&tokens(&second)).await.unwrap(), 1);
}

async fn every_claim_writes_a_later_expiry(store: Store) {
    insert(store.as_ref(), &[row("m")]).await;
    let long = claim_all(&store, Duration::from_secs(3600)).await;
    store.release_claims(&tokens(&long)).await.unwrap();
    // A shorter lease must still produce a strictly later expiry, or the
    // first claim's token would match the second claim.
    let short = claim_all(&store, Duration::ZERO).await;
    assert!(short[0].claim_expires_at > long[0].claim_expires_at);
    assert_eq!(store.release_claims(&tokens(&long)).await.unwrap(), 0);
    assert_eq!(status_of(&store, "m").await, ActivationStatus::Claimed);
}

async fn release_leaves_processing_rows_alone(store: Store) {
    insert(store.as_ref(), &rows("p", 2)).await;
    let claimed = claim_all(&store, LEASE).await;
    store
        .mark_processing(&tokens(&claimed[..1]), NO_GRACE)
        .await
        .unwrap();
    assert_eq!(store.release_claims(&tokens(&claimed)).await.unwrap(), 1);
    assert_eq!(status_of(&store, "p-0").await, ActivationStatus::Processing);
    assert_eq!(status_of(&store, "p-1").await, ActivationStatus::Pending);
}

async fn mark_processing_sets_the_deadline(store: Store) {
    insert(store.as_ref(), &[row("d")]).await; // processing_deadline_duration 30 s
    let claimed = claim_all(&store, LEASE).await;
    let before = Utc::now();
    let grace = Duration::from_secs(5);
    assert_eq!(
        store
            .mark_processing(&tokens(&claimed), grace)
            .await
            .unwrap(),
        ["d"]
    );
    let stored = fetch(&store, "d").await;
    assert_eq!(stored.status, ActivationStatus::Processing);
    assert_eq!(stored.processing_attempts, 0);
    let deadline = stored.processing_deadline.expect("deadline set");
    assert!(deadline > before + TimeDelta::seconds(33));
    assert!(deadline < Utc::now() + TimeDelta::seconds(37));
}

async fn mark_processing_after_release_changes_nothing(store: Store) {
    insert(store.as_ref(), &[row("late")]).await;
    let claimed = claim_all(&store, LEASE).await;
    store.release_claims(&tokens(&claimed)).await.unwrap();
    assert_eq!(
        store
            .mark_processing(&tokens(&claimed), NO_GRACE)
            .await
            .unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(status_of(&store, "late").await, ActivationStatus::Pending);

    // Nor after the row was claimed again by someone else.
    let again = claim_all(&store, LEASE).await;
    assert_eq!(
        store
            .mark_processing(&tokens(&claimed), NO_GRACE)
            .await
            .unwrap(),
        Vec::<String>::new()
    );
    let stored = fetch(&store, "late").await;
    assert_eq!(stored.status, ActivationStatus::Claimed);
    assert_eq!(stored.claim_expires_at, again[0].claim_expires_at);
}

async fn undo_claim_is_fenced(store: Store) {
    insert(store.as_ref(), &[row("u")]).await;
    let first = claim_all(&store, LEASE).await;
    let token = first[0].claim_token().unwrap();
    assert!(store.undo_claim(&token).await.unwrap());
    assert_eq!(status_of(&store, "u").await, ActivationStatus::Pending);
    let _second = claim_all(&store, LEASE).await;
    assert!(!store.undo_claim(&token).await.unwrap());
    assert_eq!(status_of(&store, "u").await, ActivationStatus::Claimed);
}

async fn undeliverable_claims_consume_attempts_until_failure(store: Store) {
    insert(store.as_ref(), &[row("poison")]).await;
    for attempt in 1..=2 {
        let claimed = claim_all(&store, LEASE).await;
        assert_eq!(
            store
                .fail_claim_attempt(&tokens(&claimed), 3)
                .await
                .unwrap(),
            1
        );
        let stored = fetch(&store, "poison").await;
        assert_eq!(stored.status, ActivationStatus::Pending);
        assert_eq!(stored.processing_attempts, attempt);
    }
    let claimed = claim_all(&store, LEASE).await;
    // A stale token changes nothing.
    let mut stale = tokens(&claimed);
    stale[0].claim_expires_at -= TimeDelta::microseconds(1);
    assert_eq!(store.fail_claim_attempt(&stale, 3).await.unwrap(), 0);
    assert_eq!(
        store
            .fail_claim_attempt(&tokens(&claimed), 3)
            .await
            .unwrap(),
        1
    );
    let stored = fetch(&store, "poison").await;
    assert_eq!(stored.status, ActivationStatus::Failure);
    assert_eq!(stored.processing_attempts, 3);
    assert!(claim_all(&store, LEASE).await.is_empty());
}

// ---------------------------------------------------------------- pull claims

async fn pull_claim_filters_by_application_and_namespace(store: Store) {
    let mut other_app = task("other-app");
    other_app.application = Some("other".into());
    let mut other_ns = task("other-ns");
    other_ns.namespace = "elsewhere".into();
    insert(store.as_ref(), &[row_from(&other_app), row_from(&other_ns)]).await;
    let filter = |application: Option<&str>, namespace: Option<&str>| PullFilter {
        application: application.map(str::to_owned),
        namespace: namespace.map(str::to_owned),
    };
    // A namespace without an application matches nothing.
    assert!(
        store
            .claim_for_pull(&filter(None, Some("elsewhere")), NO_GRACE)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        store
            .claim_for_pull(&filter(Some("app"), Some("nowhere")), NO_GRACE)
            .await
            .unwrap()
            .is_none()
    );
    let got = store
        .claim_for_pull(
            &filter(Some("app"), Some("elsewhere")),
            Duration::from_secs(2),
        )
        .await
        .unwrap()
        .expect("matching row");
    assert_eq!(got.id, "other-ns");
    assert_eq!(got.status, ActivationStatus::Processing);
    assert!(got.processing_deadline.unwrap() > Utc::now() + TimeDelta::seconds(30));

    let got = store
        .claim_for_pull(&filter(Some("other"), None), NO_GRACE)
        .await
        .unwrap()
        .expect("matching row");
    assert_eq!(got.id, "other-app");
    assert!(
        store
            .claim_for_pull(&PullFilter::default(), NO_GRACE)
            .await
            .unwrap()
            .is_none()
    );
}

async fn pull_claim_skips_expired_rows(store: Store) {
    let mut expired = task("gone");
    expired.received_at = Some(prost_types::Timestamp {
        seconds: (now() - TimeDelta::seconds(100)).timestamp(),
        nanos: 0,
    });
    expired.expires = Some(1);
    insert(store.as_ref(), &[row_from(&expired)]).await;
    assert!(
        store
            .claim_for_pull(&PullFilter::default(), NO_GRACE)
            .await
            .unwrap()
            .is_none()
    );
    insert(store.as_ref(), &[row("fresh")]).await;
    let got = store
        .claim_for_pull(&PullFilter::default(), NO_GRACE)
        .await
        .unwrap();
    assert_eq!(got.map(|row| row.id), Some("fresh".to_owned()));
}

// ---------------------------------------------------------------- worker results

async fn status_updates_apply_only_to_claimed_or_processing(store: Store) {
    // One row in each status a worker might report on.
    let processing = processing(&store, "proc", 2).await;
    let mut claimed = row("claimed");
    claimed.namespace = "billing".to_owned();
    insert(store.as_ref(), &[claimed]).await;
    let held = claim_all(&store, LEASE).await;
    assert_eq!(ids(&held), ["claimed"]);
    insert(
        store.as_ref(),
        &[
            row("pending"),
            with_status(row("complete"), ActivationStatus::Complete),
        ],
    )
    .await;

    let outcome = store
        .set_status(&[
            StatusUpdate::new("claimed", WorkerStatus::Complete),
            StatusUpdate::new(processing[0].clone(), WorkerStatus::Failure),
            StatusUpdate::new(processing[1].clone(), WorkerStatus::Retry),
            StatusUpdate::new("complete", WorkerStatus::Retry),
            StatusUpdate::new("pending", WorkerStatus::Complete),
            StatusUpdate::new("missing", WorkerStatus::Complete),
        ])
        .await
        .unwrap();
    assert_eq!(
        outcome,
        StatusUpdateOutcome {
            updated: 3,
            ignored: 2,
            missing: 1,
            late: 0,
            // Only the reports that applied, per namespace and status.
            by_namespace: vec![
                NamespaceResult::new("billing", WorkerStatus::Complete, 1),
                NamespaceResult::new("test-ns", WorkerStatus::Failure, 1),
                NamespaceResult::new("test-ns", WorkerStatus::Retry, 1),
            ],
        }
    );
    // COMPLETE, and FAILURE of a task that discards (the default), need
    // nothing more: their rows are gone.
    assert_eq!(store.get("claimed").await.unwrap(), None);
    assert_eq!(store.get(&processing[0]).await.unwrap(), None);
    assert_eq!(
        status_of(&store, &processing[1]).await,
        ActivationStatus::Retry
    );
    assert_eq!(
        status_of(&store, "complete").await,
        ActivationStatus::Complete
    );
    assert_eq!(
        status_of(&store, "pending").await,
        ActivationStatus::Pending
    );
}

async fn reports_on_overdue_or_redelivered_rows_count_as_late(store: Store) {
    // Delivered before: its report may come from the earlier delivery.
    let mut redelivered = row("redelivered");
    redelivered.processing_attempts = 1;
    insert(store.as_ref(), &[redelivered]).await;
    assert_eq!(ids(&claim_all(&store, LEASE).await), ["redelivered"]);
    let processing_until = |id: &str, deadline| {
        let mut row = with_status(row(id), ActivationStatus::Processing);
        row.processing_deadline = Some(deadline);
        row
    };
    let mut finished_retry = with_status(row("finished"), ActivationStatus::Complete);
    finished_retry.processing_attempts = 2;
    insert(
        store.as_ref(),
        &[
            processing_until("on-time", now() + TimeDelta::seconds(60)),
            processing_until("overdue", now() - TimeDelta::seconds(60)),
            finished_retry,
        ],
    )
    .await;

    let outcome = store
        .set_status(&[
            StatusUpdate::new("redelivered", WorkerStatus::Complete),
            StatusUpdate::new("on-time", WorkerStatus::Complete),
            StatusUpdate::new("overdue", WorkerStatus::Retry),
            StatusUpdate::new("finished", WorkerStatus::Failure),
        ])
        .await
        .unwrap();
    assert_eq!(
        outcome,
        StatusUpdateOutcome {
            updated: 3,
            ignored: 1,
            missing: 0,
            late: 2,
            by_namespace: vec![
                NamespaceResult::new("test-ns", WorkerStatus::Complete, 2),
                NamespaceResult::new("test-ns", WorkerStatus::Retry, 1),
            ],
        },
        "late: the redelivered and the overdue row, not the ignored one"
    );
    assert_eq!(status_of(&store, "overdue").await, ActivationStatus::Retry);
    assert_eq!(
        status_of(&store, "finished").await,
        ActivationStatus::Complete
    );
    assert_eq!(store.get("redelivered").await.unwrap(), None);
}

/// The rows a report finishes for good are deleted by the report's own
/// statement; those still to be published stay for upkeep, and upkeep finds
/// nothing else to do.
async fn a_report_that_finishes_the_task_deletes_its_row_and_leaves_upkeep_nothing(store: Store) {
    let mut rows = rows("end", 5);
    rows[3].on_attempts_exceeded = OnAttemptsExceeded::Deadletter;
    rows[4].on_attempts_exceeded = OnAttemptsExceeded::Discard;
    insert(store.as_ref(), &rows).await;
    let claimed = claim_all(&store, LEASE).await;
    // One report on a row still Claimed (the worker was faster than the
    // mark), the others on Processing rows.
    store
        .mark_processing(&tokens(&claimed[1..]), Duration::from_secs(60))
        .await
        .unwrap();
    let outcome = store
        .set_status(&[
            StatusUpdate::new("end-0", WorkerStatus::Complete),
            StatusUpdate::new("end-1", WorkerStatus::Complete),
            StatusUpdate::new("end-2", WorkerStatus::Retry),
            StatusUpdate::new("end-3", WorkerStatus::Failure),
            StatusUpdate::new("end-4", WorkerStatus::Failure),
        ])
        .await
        .unwrap();
    assert_eq!(outcome.updated, 5);
    let left: Vec<(String, ActivationStatus)> = {
        let mut left = Vec::new();
        for row in &rows {
            if let Some(stored) = store.get(&row.id).await.unwrap() {
                left.push((stored.id, stored.status));
            }
        }
        left
    };
    assert_eq!(
        left,
        [
            ("end-2".to_owned(), ActivationStatus::Retry),
            ("end-3".to_owned(), ActivationStatus::Failure),
        ],
        "only the rows upkeep must still publish remain"
    );
    assert_eq!(store.discard_failures(100).await.unwrap(), 0);
    assert_eq!(store.remove_completed(100).await.unwrap(), 0);
    // A report arriving after the delete finds no row.
    let again = store
        .set_status(&[StatusUpdate::new("end-0", WorkerStatus::Complete)])
        .await
        .unwrap();
    assert_eq!((again.updated, again.missing), (0, 1));
}

async fn repeated_status_updates_are_idempotent(store: Store) {
    let ids = processing(&store, "twice", 1).await;
    let update = [StatusUpdate::new(ids[0].clone(), WorkerStatus::Complete)];
    let first = store.set_status(&update).await.unwrap();
    let second = store.set_status(&update).await.unwrap();
    // The first report finished (and deleted) the row.
    assert_eq!((first.updated, second.updated, second.missing), (1, 0, 1));
    let retry = [StatusUpdate::new(ids[0].clone(), WorkerStatus::Retry)];
    assert_eq!(store.set_status(&retry).await.unwrap().missing, 1);
    // A RETRY leaves its row; a second report on it is ignored.
    let kept = processing(&store, "twice-retry", 1).await;
    let retry = [StatusUpdate::new(kept[0].clone(), WorkerStatus::Retry)];
    let first = store.set_status(&retry).await.unwrap();
    let second = store.set_status(&retry).await.unwrap();
    assert_eq!((first.updated, second.updated, second.ignored), (1, 0, 1));
}

async fn retry_update_stores_the_edit_and_leaves_the_bytes(store: Store) {
    let ids = processing(&store, "edit", 2).await;
    let before = fetch(&store, &ids[0]).await;
    let mut edit = StatusUpdate::new(ids[0].clone(), WorkerStatus::Retry);
    edit.max_attempts = Some(9);
    edit.delay_on_retry = Some(30);
    let outcome = store
        .set_status(&[edit, StatusUpdate::new(ids[1].clone(), WorkerStatus::Retry)])
        .await
        .unwrap();
    assert_eq!(outcome.updated, 2);
    let edited = fetch(&store, &ids[0]).await;
    assert_eq!(edited.status, ActivationStatus::Retry);
    assert_eq!(
        edited.activation, before.activation,
        "the stored bytes stay exactly as received"
    );
    assert_eq!(
        edited.retry_edit,
        RetryEdit {
            max_attempts: Some(9),
            delay_on_retry: Some(30),
        }
    );
    let plain = fetch(&store, &ids[1]).await;
    assert_eq!(plain.status, ActivationStatus::Retry);
    assert_eq!(plain.retry_edit, RetryEdit::default());
    let state = TaskActivation::decode(plain.activation.as_slice())
        .unwrap()
        .retry_state
        .unwrap();
    assert_eq!((state.max_attempts, state.delay_on_retry), (3, None));
}

async fn retry_edit_ignored_for_rows_not_handed_out(store: Store) {
    let original = row("idle");
    insert(store.as_ref(), std::slice::from_ref(&original)).await;
    let mut edit = StatusUpdate::new("idle", WorkerStatus::Retry);
    edit.max_attempts = Some(99);
    let outcome = store.set_status(&[edit]).await.unwrap();
    assert_eq!(outcome.ignored, 1);
    assert_eq!(fetch(&store, "idle").await, original);
}

async fn retry_edits_are_kept_per_row_and_only_with_retry(store: Store) {
    let ids = processing(&store, "edits", 4).await;
    let report = |i: usize, status, max_attempts, delay_on_retry| {
        let mut update = StatusUpdate::new(ids[i].clone(), status);
        update.max_attempts = max_attempts;
        update.delay_on_retry = delay_on_retry;
        update
    };
    let outcome = store
        .set_status(&[
            report(0, WorkerStatus::Retry, Some(4), None),
            report(1, WorkerStatus::Retry, None, Some(u64::MAX)),
            // Other statuses ignore the fields (PROTOCOL.md).
            report(2, WorkerStatus::Failure, Some(8), Some(8)),
            report(3, WorkerStatus::Complete, Some(8), None),
            // A second report for a row: the first one given applies.
            report(0, WorkerStatus::Retry, Some(99), Some(99)),
        ])
        .await
        .unwrap();
    assert_eq!(outcome.updated, 4);
    let edit_of = |id: &str| {
        let store = Arc::clone(&store);
        let id = id.to_owned();
        async move { fetch(&store, &id).await.retry_edit }
    };
    assert_eq!(
        edit_of(&ids[0]).await,
        RetryEdit {
            max_attempts: Some(4),
            delay_on_retry: None,
        }
    );
    assert_eq!(
        edit_of(&ids[1]).await,
        RetryEdit {
            max_attempts: None,
            delay_on_retry: Some(u64::MAX),
        },
        "every u64 delay reads back exactly"
    );
    // FAILURE (of a task that discards) and COMPLETE finished their rows.
    assert_eq!(store.get(&ids[2]).await.unwrap(), None);
    assert_eq!(store.get(&ids[3]).await.unwrap(), None);

    // A late report for a row no longer handed out edits nothing.
    let late = store
        .set_status(&[report(0, WorkerStatus::Retry, Some(1), Some(1))])
        .await
        .unwrap();
    assert_eq!(late.ignored, 1);
    assert_eq!(edit_of(&ids[0]).await.max_attempts, Some(4));
}

async fn published_retry_carries_the_edit(store: Store) {
    let published = processing(&store, "published", 1).await;
    let stored = fetch(&store, &published[0]).await.activation;
    let mut report = StatusUpdate::new(published[0].clone(), WorkerStatus::Retry);
    report.max_attempts = Some(9);
    report.delay_on_retry = Some(30);
    store.set_status(&[report]).await.unwrap();
    let taken = store
        .take_for_publish(PublishKind::Retry, 10, LEASE)
        .await
        .unwrap();
    assert_eq!(ids(&taken), published);
    assert_eq!(taken[0].activation, stored, "taken as stored");
    let (_, bytes) = taken[0].retry_activation(Utc::now()).unwrap();
    let retried = TaskActivation::decode(bytes.as_slice()).unwrap();
    let state = retried.retry_state.unwrap();
    assert_eq!(
        (state.attempts, state.max_attempts, state.delay_on_retry),
        (1, 9, Some(30))
    );
    assert_eq!(retried.delay, Some(30));
}

async fn delete_batch_removes_rows(store: Store) {
    insert(store.as_ref(), &rows("del", 3)).await;
    let deleted = store
        .delete_batch(&["del-0".into(), "del-2".into(), "nope".into()])
        .await
        .unwrap();
    assert_eq!(deleted, 2);
    assert!(store.get("del-0").await.unwrap().is_none());
    assert!(store.get("del-1").await.unwrap().is_some());
}

// ---------------------------------------------------------------- upkeep

async fn expired_claims_return_to_pending_without_an_attempt(store: Store) {
    insert(store.as_ref(), &rows("e", 2)).await;
    let short = store
        .claim_for_push(BucketRange::ALL, 1, Duration::ZERO)
        .await
        .unwrap();
    let long = store
        .claim_for_push(BucketRange::ALL, 1, LEASE)
        .await
        .unwrap();
    assert_eq!(store.release_expired_claims(100).await.unwrap(), 1);
    let released = fetch(&store, &short[0].id).await;
    assert_eq!(released.status, ActivationStatus::Pending);
    assert_eq!(released.processing_attempts, 0);
    assert_eq!(
        status_of(&store, &long[0].id).await,
        ActivationStatus::Claimed
    );
}

async fn deadline_overrun_returns_to_pending_with_an_attempt(store: Store) {
    let mut quick = task("quick");
    quick.processing_deadline_duration = 0;
    insert(store.as_ref(), &[row_from(&quick), row("slow")]).await;
    let claimed = claim_all(&store, LEASE).await;
    store
        .mark_processing(&tokens(&claimed), NO_GRACE)
        .await
        .unwrap();
    let outcome = store.handle_processing_deadlines(100).await.unwrap();
    assert_eq!((outcome.retried, outcome.failed), (1, 0));
    let overrun = fetch(&store, "quick").await;
    assert_eq!(overrun.status, ActivationStatus::Pending);
    assert_eq!(overrun.processing_attempts, 1);
    assert_eq!(overrun.processing_deadline, None);
    assert_eq!(
        status_of(&store, "slow").await,
        ActivationStatus::Processing
    );
}

async fn at_most_once_deadline_overrun_fails(store: Store) {
    let mut once = task("once");
    once.processing_deadline_duration = 0;
    once.retry_state.as_mut().unwrap().at_most_once = Some(true);
    insert(store.as_ref(), &[row_from(&once)]).await;
    store
        .claim_for_pull(&PullFilter::default(), NO_GRACE)
        .await
        .unwrap()
        .expect("claimed");
    let outcome = store.handle_processing_deadlines(100).await.unwrap();
    assert_eq!((outcome.retried, outcome.failed), (0, 1));
    assert_eq!(status_of(&store, "once").await, ActivationStatus::Failure);
}

async fn exhausted_attempts_fail(store: Store) {
    let mut worn = row("worn");
    worn.processing_attempts = 5;
    let mut fresh = row("fresh");
    fresh.processing_attempts = 4;
    insert(store.as_ref(), &[worn, fresh]).await;
    assert_eq!(store.fail_exhausted_attempts(5, 100).await.unwrap(), 1);
    assert_eq!(status_of(&store, "worn").await, ActivationStatus::Failure);
    assert_eq!(status_of(&store, "fresh").await, ActivationStatus::Pending);
}

async fn expired_pending_rows_are_removed(store: Store) {
    let old = now() - TimeDelta::seconds(100);
    let mut expired = task("expired");
    expired.received_at = Some(prost_types::Timestamp {
        seconds: old.timestamp(),
        nanos: 0,
    });
    expired.expires = Some(10);
    let mut lasting = task("lasting");
    lasting.expires = Some(3600);
    // An expired row that is already Processing is not removed: it started in time.
    let started = with_status(
        row_from(&{
            let mut t = expired.clone();
            t.id = "started".into();
            t
        }),
        ActivationStatus::Processing,
    );
    insert(
        store.as_ref(),
        &[
            row_from(&expired),
            row_from(&lasting),
            row("forever"),
            started,
        ],
    )
    .await;
    assert_eq!(store.remove_expired(100).await.unwrap(), 1);
    assert!(store.get("expired").await.unwrap().is_none());
    assert!(store.get("lasting").await.unwrap().is_some());
    assert!(store.get("forever").await.unwrap().is_some());
    assert!(store.get("started").await.unwrap().is_some());
}

async fn delayed_rows_become_pending_when_due(store: Store) {
    let mut due = row("due");
    due.status = ActivationStatus::Delay;
    due.delay_until = Some(now() - TimeDelta::seconds(1));
    let mut later = row("later");
    later.status = ActivationStatus::Delay;
    later.delay_until = Some(now() + TimeDelta::seconds(600));
    insert(store.as_ref(), &[due, later]).await;
    assert_eq!(store.release_delayed(100).await.unwrap(), 1);
    assert_eq!(status_of(&store, "due").await, ActivationStatus::Pending);
    assert_eq!(status_of(&store, "later").await, ActivationStatus::Delay);
    assert_eq!(ids(&claim_all(&store, LEASE).await), ["due"]);
}

async fn retries_are_taken_published_and_removed(store: Store) {
    insert(
        store.as_ref(),
        &[
            with_status(row("retry-1"), ActivationStatus::Retry),
            with_status(row("retry-2"), ActivationStatus::Retry),
            with_status(row("pending"), ActivationStatus::Pending),
        ],
    )
    .await;
    let taken = store
        .take_for_publish(PublishKind::Retry, 100, LEASE)
        .await
        .unwrap();
    let mut taken_ids = ids(&taken);
    taken_ids.sort();
    assert_eq!(taken_ids, ["retry-1", "retry-2"]);
    // Nothing is complete until the caller says Kafka acknowledged it.
    assert_eq!(status_of(&store, "retry-1").await, ActivationStatus::Retry);
    assert_eq!(store.mark_published(&["retry-1".into()]).await.unwrap(), 1);
    assert_eq!(
        status_of(&store, "retry-1").await,
        ActivationStatus::Complete
    );
    assert_eq!(status_of(&store, "retry-2").await, ActivationStatus::Retry);
    assert_eq!(store.remove_completed(100).await.unwrap(), 1);
    assert!(store.get("retry-1").await.unwrap().is_none());
    // mark_published never completes rows that are not Retry or Failure.
    assert_eq!(store.mark_published(&["pending".into()]).await.unwrap(), 0);
}

async fn failures_are_dead_lettered_or_discarded(store: Store) {
    let mut dead = with_status(row("dead"), ActivationStatus::Failure);
    dead.on_attempts_exceeded = OnAttemptsExceeded::Deadletter;
    let mut dropped = with_status(row("dropped"), ActivationStatus::Failure);
    dropped.on_attempts_exceeded = OnAttemptsExceeded::Discard;
    let unspecified = with_status(row("unspecified"), ActivationStatus::Failure);
    insert(store.as_ref(), &[dead, dropped, unspecified]).await;

    let taken = store
        .take_for_publish(PublishKind::DeadLetter, 100, LEASE)
        .await
        .unwrap();
    assert_eq!(ids(&taken), ["dead"]);
    assert_eq!(store.discard_failures(100).await.unwrap(), 2);
    assert_eq!(
        status_of(&store, "dropped").await,
        ActivationStatus::Complete
    );
    assert_eq!(
        status_of(&store, "unspecified").await,
        ActivationStatus::Complete
    );
    assert_eq!(status_of(&store, "dead").await, ActivationStatus::Failure);
    assert_eq!(store.mark_published(&ids(&taken)).await.unwrap(), 1);
    assert_eq!(status_of(&store, "dead").await, ActivationStatus::Complete);
}

/// One publisher's take of up to 25 Retry rows.
async fn take_retries(store: Store) -> Vec<String> {
    ids(&store
        .take_for_publish(PublishKind::Retry, 25, LEASE)
        .await
        .expect("take"))
}

async fn concurrent_publish_takers_never_share_rows(store: Store) {
    const ROWS: usize = 500;
    let batch: Vec<_> = rows("pub", ROWS)
        .into_iter()
        .map(|row| with_status(row, ActivationStatus::Retry))
        .collect();
    insert(store.as_ref(), &batch).await;
    let all = take_concurrently(&store, 8, take_retries).await;
    let distinct: HashSet<&String> = all.iter().collect();
    assert_eq!(all.len(), ROWS);
    assert_eq!(distinct.len(), ROWS);
}

async fn taken_rows_are_offered_again_after_the_lease(store: Store) {
    insert(
        store.as_ref(),
        &[with_status(row("crashy"), ActivationStatus::Retry)],
    )
    .await;
    // A publisher took it with a lease that has run out (it crashed).
    let first = store
        .take_for_publish(PublishKind::Retry, 10, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(first.len(), 1);
    let again = store
        .take_for_publish(PublishKind::Retry, 10, LEASE)
        .await
        .unwrap();
    assert_eq!(ids(&again), ["crashy"]);
    // While that lease holds, nobody else gets it.
    assert!(
        store
            .take_for_publish(PublishKind::Retry, 10, LEASE)
            .await
            .unwrap()
            .is_empty()
    );
}

async fn upkeep_statements_respect_their_limit(store: Store) {
    let batch: Vec<_> = rows("lim", 10)
        .into_iter()
        .map(|row| with_status(row, ActivationStatus::Complete))
        .collect();
    insert(store.as_ref(), &batch).await;
    assert_eq!(store.remove_completed(3).await.unwrap(), 3);
    assert_eq!(store.remove_completed(100).await.unwrap(), 7);

    insert(store.as_ref(), &rows("claim", 10)).await;
    store
        .claim_for_push(BucketRange::ALL, 10, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(store.release_expired_claims(4).await.unwrap(), 4);
    let retries: Vec<_> = rows("r", 10)
        .into_iter()
        .map(|row| with_status(row, ActivationStatus::Retry))
        .collect();
    insert(store.as_ref(), &retries).await;
    assert_eq!(
        store
            .take_for_publish(PublishKind::Retry, 6, LEASE)
            .await
            .unwrap()
            .len(),
        6
    );
}

async fn counts_by_status(store: Store) {
    insert(
        store.as_ref(),
        &[
            row("p1"),
            row("p2"),
            with_status(row("f"), ActivationStatus::Failure),
            with_status(row("c"), ActivationStatus::Complete),
        ],
    )
    .await;
    store
        .claim_for_push(BucketRange::ALL, 1, LEASE)
        .await
        .unwrap();
    let counts = store.count_by_status().await.unwrap();
    assert_eq!(counts.get(ActivationStatus::Pending), 1);
    assert_eq!(counts.get(ActivationStatus::Claimed), 1);
    assert_eq!(counts.get(ActivationStatus::Failure), 1);
    assert_eq!(counts.get(ActivationStatus::Complete), 1);
    assert_eq!(counts.get(ActivationStatus::Processing), 0);
    assert_eq!(counts.inflight(), 2);
    assert_eq!(counts.total(), 4);
}

/// Each consumed topic's backpressure reads its own in-flight rows: Pending,
/// Delay, Claimed and Processing count, finished rows do not.
async fn inflight_rows_are_counted_per_topic(store: Store) {
    assert!(store.count_inflight_by_topic().await.unwrap().is_empty());
    let on = |id: &str, topic: &str, status: ActivationStatus| {
        let mut row = with_status(row(id), status);
        row.topic = topic.to_owned();
        row
    };
    insert(
        store.as_ref(),
        &[
            on("a1", "main", ActivationStatus::Pending),
            on("a2", "main", ActivationStatus::Delay),
            on("a3", "main", ActivationStatus::Processing),
            on("a4", "main", ActivationStatus::Complete),
            on("b1", "side", ActivationStatus::Pending),
            on("b2", "side", ActivationStatus::Failure),
            on("c1", "done", ActivationStatus::Complete),
        ],
    )
    .await;
    store
        .claim_for_push(BucketRange::ALL, 1, LEASE)
        .await
        .unwrap();
    let mut counts = store.count_inflight_by_topic().await.unwrap();
    counts.sort();
    assert_eq!(counts, vec![("main".to_owned(), 3), ("side".to_owned(), 1)]);
}

/// The byte bound's figure: the bytes of every stored activation per topic,
/// kept exact through inserts (duplicates add nothing), a completion that
/// removes its row at once, upkeep's removals and deletes by id.
async fn stored_bytes_are_summed_per_topic_through_inserts_and_every_kind_of_removal(store: Store) {
    assert!(store.inflight_bytes_by_topic().await.unwrap().is_empty());
    let sized = |id: &str, topic: &str, bytes: usize| {
        let mut row = row(id);
        row.topic = topic.to_owned();
        row.activation = vec![7; bytes];
        row
    };
    let sums = || async {
        let mut sums = store.inflight_bytes_by_topic().await.unwrap();
        sums.retain(|(_, bytes)| *bytes > 0);
        sums.sort();
        sums
    };
    insert(
        store.as_ref(),
        &[
            sized("a1", "main", 1000),
            sized("a2", "main", 20_000),
            sized("a3", "main", 300_000),
            sized("b1", "side", 4_000_000),
        ],
    )
    .await;
    // A duplicate id stores nothing and adds nothing.
    insert(store.as_ref(), &[sized("a1", "main", 55)]).await;
    assert_eq!(
        sums().await,
        vec![("main".to_owned(), 321_000), ("side".to_owned(), 4_000_000)]
    );
    // A worker's COMPLETE removes the row at once.
    let claimed = store
        .claim_for_push(BucketRange::ALL, 10, LEASE)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 4);
    store
        .set_status(&[StatusUpdate::new("a3", WorkerStatus::Complete)])
        .await
        .unwrap();
    store.delete_batch(&["b1".to_owned()]).await.unwrap();
    assert_eq!(sums().await, vec![("main".to_owned(), 21_000)]);
    // Finished rows count until upkeep removes them.
    insert(
        store.as_ref(),
        &[with_status(
            sized("c1", "main", 500),
            ActivationStatus::Complete,
        )],
    )
    .await;
    assert_eq!(sums().await, vec![("main".to_owned(), 21_500)]);
    store.remove_completed(100).await.unwrap();
    assert_eq!(sums().await, vec![("main".to_owned(), 21_000)]);
}

/// FETCH_BATCH_BYTES (16 MiB by default): a push claim, whichever way it
/// picks its rows (oldest first, around paused rules, fair shares, a
/// namespace's concurrency limit), keeps rows while the ones before them add
/// up to less than the budget; a single row larger than it is still taken.
async fn every_push_claim_stops_at_its_byte_budget_and_takes_at_least_one_row(store: Store) {
    let mb4 = 4 << 20;
    let big = |id: &str, namespace: &str, bytes: usize| {
        let mut row = row(id);
        row.namespace = namespace.to_owned();
        row.activation = vec![3; bytes];
        row
    };
    let batch: Vec<_> = (0..6)
        .map(|i| big(&format!("a{i}"), "alpha", mb4))
        .collect();
    insert(store.as_ref(), &batch).await;
    let claimed = store
        .claim_for_push(BucketRange::ALL, 64, LEASE)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 4, "4 x 4 MiB reach the 16 MiB budget");
    let paused = [pause(Some("other-app"), None)];
    let claimed = store
        .claim_for_push_except(BucketRange::ALL, 64, LEASE, &paused, Dispatch::OldestFirst)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 2, "what is left");

    let flows: Vec<_> = (0..3)
        .flat_map(|i| {
            [
                big(&format!("f{i}"), "fair-1", mb4),
                big(&format!("g{i}"), "fair-2", mb4),
            ]
        })
        .collect();
    insert(store.as_ref(), &flows).await;
    let weights: Vec<(String, u32)> = Vec::new();
    let claimed = store
        .claim_for_push_except(BucketRange::ALL, 64, LEASE, &[], Dispatch::Fair(&weights))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 4, "fair shares are cut at the budget too");

    insert(
        store.as_ref(),
        &(0..3)
            .map(|i| big(&format!("l{i}"), "limited", 9 << 20))
            .collect::<Vec<_>>(),
    )
    .await;
    let claimed = store.claim_limited("limited", 10, 64, LEASE).await.unwrap();
    assert_eq!(claimed.len(), 2, "9 MiB, then 18 MiB reached the budget");

    insert(store.as_ref(), &[big("huge", "huge", 20 << 20)]).await;
    let claimed = store.claim_limited("huge", 10, 64, LEASE).await.unwrap();
    assert_eq!(claimed.len(), 1, "one row over the budget is still claimed");
    assert_eq!(claimed[0].activation.activation.len(), 20 << 20);
}

async fn max_pending_lag_is_delay_adjusted_and_first_attempt_only(store: Store) {
    assert_eq!(store.max_pending_lag().await.unwrap(), 0.0);
    let at = |secs_ago: i64| {
        let mut t = task(&format!("ago-{secs_ago}"));
        t.received_at = Some(prost_types::Timestamp {
            seconds: (now() - TimeDelta::seconds(secs_ago)).timestamp(),
            nanos: 0,
        });
        t
    };
    insert(store.as_ref(), &[row_from(&at(100))]).await;
    let lag = store.max_pending_lag().await.unwrap();
    assert!((99.0..110.0).contains(&lag), "lag {lag}");

    // Older, but retried once: not a first attempt, not counted.
    let mut retried = row_from(&at(500));
    retried.processing_attempts = 1;
    // Older, but only runnable since its delay ended 20 s ago.
    let mut delayed = at(1000);
    delayed.delay = Some(980);
    // Older, but finished.
    let done = with_status(row_from(&at(2000)), ActivationStatus::Complete);
    insert(store.as_ref(), &[retried, row_from(&delayed), done]).await;
    let lag = store.max_pending_lag().await.unwrap();
    assert!((99.0..110.0).contains(&lag), "lag {lag}");

    // Claimed rows still count: they are not delivered yet.
    claim_all(&store, LEASE).await;
    let lag = store.max_pending_lag().await.unwrap();
    assert!((99.0..110.0).contains(&lag), "lag {lag}");
}

async fn batch_operations_take_ids_with_quotes_backslashes_and_control_characters(store: Store) {
    // Ids come from producers; batch statements must pass any of them.
    let odd = [
        "quote\"d",
        "back\\slash",
        "new\nline",
        "tab\tand\u{1}",
        "ünïcødé ✓",
        "[\"]",
    ];
    let batch: Vec<InflightActivation> = odd.iter().map(|id| row(id)).collect();
    insert(store.as_ref(), &batch).await;

    let claimed = claim_all(&store, LEASE).await;
    assert_eq!(claimed.len(), odd.len());
    assert_eq!(
        store.release_claims(&tokens(&claimed)).await.unwrap(),
        odd.len() as u64
    );
    let claimed = claim_all(&store, LEASE).await;
    let mut moved = store
        .mark_processing(&tokens(&claimed), NO_GRACE)
        .await
        .unwrap();
    moved.sort();
    let mut expected: Vec<String> = odd.iter().map(|id| id.to_string()).collect();
    expected.sort();
    assert_eq!(moved, expected);
    assert_eq!(
        store.delete_batch(&expected).await.unwrap(),
        odd.len() as u64
    );
    assert_eq!(store.count_by_status().await.unwrap().total(), 0);
}

// ------------------------------------------------- push outcomes (issue 13)

async fn failed_claims_become_failure_with_the_attempt_consumed(store: Store) {
    insert(store.as_ref(), &rows("once", 3)).await;
    assert_eq!(store.fail_claims(&[]).await.unwrap(), 0);
    let claimed = claim_all(&store, LEASE).await;
    let failed = tokens(&claimed[..2]);
    assert_eq!(store.fail_claims(&failed).await.unwrap(), 2);
    for token in &failed {
        let stored = fetch(&store, &token.id).await;
        assert_eq!(stored.status, ActivationStatus::Failure);
        assert_eq!(stored.processing_attempts, 1, "the push used the attempt");
    }
    assert_eq!(status_of(&store, "once-2").await, ActivationStatus::Claimed);
    // Failure rows are upkeep's to dead-letter or discard, never claimed.
    assert_eq!(store.release_expired_claims(100).await.unwrap(), 0);
    assert!(claim_all(&store, LEASE).await.is_empty());
}

async fn fail_claims_is_fenced(store: Store) {
    insert(store.as_ref(), &[row("f"), row("p")]).await;
    let first = claim_all(&store, LEASE).await;
    let old = tokens(&first);
    // "f" is released and claimed again; "p" moves on to Processing.
    let f_old: Vec<ClaimToken> = old.iter().filter(|t| t.id == "f").cloned().collect();
    let p_old: Vec<ClaimToken> = old.iter().filter(|t| t.id == "p").cloned().collect();
    assert_eq!(store.release_claims(&f_old).await.unwrap(), 1);
    store.mark_processing(&p_old, NO_GRACE).await.unwrap();
    let again = claim_all(&store, LEASE).await;
    assert_eq!(ids(&again), ["f"]);
    assert_eq!(store.fail_claims(&old).await.unwrap(), 0, "stale tokens");
    assert_eq!(status_of(&store, "f").await, ActivationStatus::Claimed);
    assert_eq!(status_of(&store, "p").await, ActivationStatus::Processing);
    assert_eq!(fetch(&store, "f").await.processing_attempts, 0);
    assert_eq!(store.fail_claims(&tokens(&again)).await.unwrap(), 1);
    assert_eq!(status_of(&store, "f").await, ActivationStatus::Failure);
}

async fn deferred_claims_wait_in_delay_without_an_attempt(store: Store) {
    insert(store.as_ref(), &[row("later"), row("soon")]).await;
    let claimed = claim_all(&store, LEASE).await;
    assert_eq!(store.defer_claims(&[], Utc::now()).await.unwrap(), 0);
    let until = now() + TimeDelta::seconds(60);
    let later: Vec<ClaimToken> = tokens(&claimed)
        .into_iter()
        .filter(|t| t.id == "later")
        .collect();
    let soon: Vec<ClaimToken> = tokens(&claimed)
        .into_iter()
        .filter(|t| t.id == "soon")
        .collect();
    assert_eq!(store.defer_claims(&later, until).await.unwrap(), 1);
    assert_eq!(
        store
            .defer_claims(&soon, now() - TimeDelta::seconds(1))
            .await
            .unwrap(),
        1
    );
    let stored = fetch(&store, "later").await;
    assert_eq!(stored.status, ActivationStatus::Delay);
    assert_eq!(stored.delay_until, Some(until));
    assert_eq!(
        stored.processing_attempts, 0,
        "deferring never consumes an attempt"
    );
    assert!(
        claim_all(&store, LEASE).await.is_empty(),
        "Delay rows are not claimed"
    );
    // Upkeep's Delay → Pending step brings back the one that is due.
    assert_eq!(store.release_delayed(100).await.unwrap(), 1);
    assert_eq!(status_of(&store, "soon").await, ActivationStatus::Pending);
    assert_eq!(status_of(&store, "later").await, ActivationStatus::Delay);
    assert_eq!(fetch(&store, "soon").await.processing_attempts, 0);
}

async fn defer_claims_is_fenced(store: Store) {
    insert(store.as_ref(), &[row("d")]).await;
    let first = tokens(&claim_all(&store, LEASE).await);
    assert_eq!(store.release_claims(&first).await.unwrap(), 1);
    let second = tokens(&claim_all(&store, LEASE).await);
    let until = now() + TimeDelta::seconds(60);
    assert_eq!(
        store.defer_claims(&first, until).await.unwrap(),
        0,
        "stale token"
    );
    assert_eq!(status_of(&store, "d").await, ActivationStatus::Claimed);
    store.mark_processing(&second, NO_GRACE).await.unwrap();
    assert_eq!(
        store.defer_claims(&second, until).await.unwrap(),
        0,
        "a Processing row is not deferred"
    );
    assert_eq!(status_of(&store, "d").await, ActivationStatus::Processing);
}

// ---------------------------------------------------------------- ping

async fn ping_answers(store: Store) {
    store.ping().await.expect("a running database answers");
    // Cheap and repeatable: no state, nothing left behind.
    store.ping().await.expect("again");
    assert_eq!(store.count_by_status().await.unwrap().total(), 0);
}

#[tokio::test]
async fn ping_of_an_unreachable_postgres_is_unavailable() {
    // A port nothing listens on: bound, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut config =
        PostgresStoreConfig::new(format!("postgres://postgres@127.0.0.1:{port}/postgres"));
    config.connect_timeout = Duration::from_millis(500);
    let store = PostgresStore::connect(&config).expect("connecting is lazy");
    let started = std::time::Instant::now();
    let err = store.ping().await.unwrap_err();
    assert!(
        matches!(
            err,
            StoreError::Unavailable {
                operation: "ping",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "bounded by the connect timeout"
    );
}

// ---------------------------------------------------------------- runtime rules

/// A Pending row of `application`/`namespace` with task name `taskname`.
fn row_of(id: &str, application: &str, namespace: &str, taskname: &str) -> InflightActivation {
    let mut activation = task(id);
    activation.application = Some(application.to_owned());
    activation.namespace = namespace.to_owned();
    activation.taskname = taskname.to_owned();
    row_from(&activation)
}

fn pause(application: Option<&str>, namespace: Option<&str>) -> PauseRule {
    PauseRule {
        application: application.map(str::to_owned),
        namespace: namespace.map(str::to_owned),
    }
}

/// The rows of the pause tests: (id, application, namespace).
const PAUSE_ROWS: &[(&str, &str, &str)] = &[
    ("billing-invoices", "billing", "invoices"),
    ("billing-refunds", "billing", "refunds"),
    ("mail-invoices", "mail", "invoices"),
    ("mail-welcome", "mail", "welcome"),
];

async fn insert_pause_rows(store: &Store) {
    let rows: Vec<InflightActivation> = PAUSE_ROWS
        .iter()
        .map(|(id, application, namespace)| row_of(id, application, namespace, "t"))
        .collect();
    insert(store.as_ref(), &rows).await;
}

async fn claims_leave_out_paused_applications_and_namespaces(store: Store) {
    insert_pause_rows(&store).await;
    // Both ways of choosing rows leave the same ones out.
    let claim = |paused: Vec<PauseRule>| {
        let store = Arc::clone(&store);
        async move {
            let mut answers = Vec::new();
            for dispatch in [Dispatch::OldestFirst, Dispatch::Fair(&[])] {
                let claimed = store
                    .claim_for_push_except(BucketRange::ALL, 100, LEASE, &paused, dispatch)
                    .await
                    .expect("claim");
                let mut got = ids(&claimed);
                got.sort();
                store.release_claims(&tokens(&claimed)).await.unwrap();
                answers.push(got);
            }
            assert_eq!(answers[0], answers[1], "oldest first, then fair");
            answers.remove(0)
        }
    };
    // An application, a namespace, a pair, and everything.
    assert_eq!(
        claim(vec![pause(Some("billing"), None)]).await,
        ["mail-invoices", "mail-welcome"]
    );
    assert_eq!(
        claim(vec![pause(None, Some("invoices"))]).await,
        ["billing-refunds", "mail-welcome"]
    );
    assert_eq!(
        claim(vec![pause(Some("billing"), Some("invoices"))]).await,
        ["billing-refunds", "mail-invoices", "mail-welcome"]
    );
    assert_eq!(
        claim(vec![
            pause(Some("mail"), None),
            pause(None, Some("refunds"))
        ])
        .await,
        ["billing-invoices"]
    );
    assert!(claim(vec![pause(None, None)]).await.is_empty());
    // Paused rows stay Pending, untouched, and are claimed once resumed.
    for (id, _, _) in PAUSE_ROWS {
        assert_eq!(status_of(&store, id).await, ActivationStatus::Pending);
    }
    assert_eq!(claim(Vec::new()).await.len(), PAUSE_ROWS.len());
}

async fn pull_claims_leave_out_paused_applications_and_namespaces(store: Store) {
    insert_pause_rows(&store).await;
    let filter = |application: Option<&str>| PullFilter {
        application: application.map(str::to_owned),
        namespace: None,
    };
    let paused = [pause(Some("billing"), None), pause(None, Some("welcome"))];
    let mut pulled = Vec::new();
    while let Some(row) = store
        .claim_for_pull_except(&filter(None), NO_GRACE, &paused)
        .await
        .unwrap()
    {
        pulled.push(row.id);
    }
    assert_eq!(pulled, ["mail-invoices"]);
    // A worker asking for the paused application gets nothing either.
    assert!(
        store
            .claim_for_pull_except(&filter(Some("billing")), NO_GRACE, &paused)
            .await
            .unwrap()
            .is_none()
    );
    // With the namespace filter too.
    let namespace = PullFilter {
        application: Some("mail".to_owned()),
        namespace: Some("welcome".to_owned()),
    };
    assert!(
        store
            .claim_for_pull_except(&namespace, NO_GRACE, &paused)
            .await
            .unwrap()
            .is_none()
    );
    let resumed = store
        .claim_for_pull_except(&namespace, NO_GRACE, &[])
        .await
        .unwrap()
        .expect("resumed");
    assert_eq!(resumed.id, "mail-welcome");
}

fn killswitch(namespace: Option<&str>, taskname: Option<&str>) -> Killswitch {
    Killswitch {
        namespace: namespace.map(Glob::new),
        taskname: taskname.map(Glob::new),
    }
}

async fn killswitched_rows_are_removed_except_processing(store: Store) {
    // Matching rows in every status, one Processing among them, and rows
    // that match one pattern of the killswitch but not the other.
    let killed = |id: &str, status| {
        with_status(row_of(id, "app", "billing-eu", "billing.send_mail"), status)
    };
    insert(
        store.as_ref(),
        &[killed("running", ActivationStatus::Pending)],
    )
    .await;
    let running = claim_all(&store, LEASE).await;
    store
        .mark_processing(&tokens(&running), Duration::from_secs(60))
        .await
        .unwrap();
    insert(
        store.as_ref(),
        &[killed("claimed", ActivationStatus::Pending)],
    )
    .await;
    let claimed = claim_all(&store, LEASE).await;
    assert_eq!(ids(&claimed), ["claimed"]);
    insert(
        store.as_ref(),
        &[
            killed("pending", ActivationStatus::Pending),
            killed("delay", ActivationStatus::Delay),
            killed("retry", ActivationStatus::Retry),
            killed("failure", ActivationStatus::Failure),
            row_of("other-task", "app", "billing-eu", "billing.refund"),
            row_of("other-ns", "app", "mail", "billing.send_mail"),
        ],
    )
    .await;

    let rules = [killswitch(Some("billing-*"), Some("billing.send_*"))];
    assert_eq!(store.remove_killswitched(&[], 100).await.unwrap(), 0);
    // Bounded by the limit, then the rest.
    assert_eq!(store.remove_killswitched(&rules, 3).await.unwrap(), 3);
    assert_eq!(store.remove_killswitched(&rules, 100).await.unwrap(), 2);
    assert_eq!(store.remove_killswitched(&rules, 100).await.unwrap(), 0);
    for gone in ["pending", "delay", "retry", "failure", "claimed"] {
        assert!(store.get(gone).await.unwrap().is_none(), "{gone} removed");
    }
    for kept in ["other-task", "other-ns"] {
        assert_eq!(status_of(&store, kept).await, ActivationStatus::Pending);
    }
    // The worker running it still reports it; the push of the removed
    // claim finds it gone, like any stale claim.
    assert_eq!(
        status_of(&store, "running").await,
        ActivationStatus::Processing
    );
    assert!(
        store
            .mark_processing(&tokens(&claimed), NO_GRACE)
            .await
            .unwrap()
            .is_empty()
    );

    // A killswitch naming only the task name matches every namespace.
    let by_name = [killswitch(None, Some("billing.send_mail"))];
    assert_eq!(store.remove_killswitched(&by_name, 100).await.unwrap(), 1);
    assert!(store.get("other-ns").await.unwrap().is_none());
}

async fn killswitch_patterns_take_sql_wildcards_literally(store: Store) {
    insert(
        store.as_ref(),
        &[
            row_of("percent", "app", "ns", "100%_done"),
            row_of("lookalike", "app", "ns", "100xxdone"),
            row_of("bracket", "app", "ns", "[x]task"),
            row_of("x-task", "app", "ns", "xtask"),
            row_of("backslash", "app", "ns", "a\\b"),
            row_of("ab", "app", "ns", "ab"),
        ],
    )
    .await;
    let remove = |pattern: &str| {
        let store = Arc::clone(&store);
        let rules = [killswitch(None, Some(pattern))];
        async move { store.remove_killswitched(&rules, 100).await.unwrap() }
    };
    assert_eq!(remove("100%_done").await, 1);
    assert!(store.get("lookalike").await.unwrap().is_some());
    assert_eq!(remove("[x]task").await, 1);
    assert!(store.get("x-task").await.unwrap().is_some());
    assert_eq!(remove("a\\b").await, 1);
    assert!(store.get("ab").await.unwrap().is_some());
    // `?` is one character, `*` any run.
    assert_eq!(remove("?task").await, 1);
    assert_eq!(remove("100*").await, 1);
    assert!(store.get("ab").await.unwrap().is_some());
}

async fn demoted_rows_are_taken_under_a_lease_and_removed_once_forwarded(store: Store) {
    let slow = |id: &str| row_of(id, "app", "slow", "t");
    // A Processing and a Claimed row of the namespace: not taken.
    insert(store.as_ref(), &[slow("running")]).await;
    let running = claim_all(&store, LEASE).await;
    store
        .mark_processing(&tokens(&running), Duration::from_secs(60))
        .await
        .unwrap();
    insert(store.as_ref(), &[slow("claimed")]).await;
    claim_all(&store, LEASE).await;
    let mut from_demoted_topic = slow("already-demoted");
    from_demoted_topic.topic = "tasks-long".to_owned();
    insert(
        store.as_ref(),
        &[
            slow("pending"),
            with_status(slow("delayed"), ActivationStatus::Delay),
            row_of("fast", "app", "fast", "t"),
            from_demoted_topic,
        ],
    )
    .await;
    let namespaces = ["slow".to_owned()];
    let take = |lease: Duration| {
        let store = Arc::clone(&store);
        let namespaces = namespaces.clone();
        async move {
            let mut taken = ids(&store
                .take_demoted(&namespaces, "tasks-long", 100, lease)
                .await
                .unwrap());
            taken.sort();
            taken
        }
    };
    assert!(
        store
            .take_demoted(&[], "tasks-long", 100, LEASE)
            .await
            .unwrap()
            .is_empty()
    );
    // Taken once, with the bytes as stored; a second taker finds them leased.
    assert_eq!(take(Duration::ZERO).await, ["delayed", "pending"]);
    // A lease that ran out offers them again (the forward was not acknowledged).
    assert_eq!(take(LEASE).await, ["delayed", "pending"]);
    assert!(take(LEASE).await.is_empty());
    let taken = ["delayed".to_owned(), "pending".to_owned()];
    assert_eq!(store.remove_forwarded(&taken).await.unwrap(), 2);
    assert_eq!(store.remove_forwarded(&taken).await.unwrap(), 0);
    for kept in ["running", "claimed", "fast", "already-demoted"] {
        assert!(store.get(kept).await.unwrap().is_some(), "{kept} kept");
    }
    // A forwarded row that was claimed meanwhile is not removed.
    assert_eq!(
        store
            .remove_forwarded(&["claimed".to_owned()])
            .await
            .unwrap(),
        0
    );
}

async fn limited_claims_never_exceed_the_limit_even_when_claimers_race(store: Store) {
    let rows: Vec<InflightActivation> = (0..20)
        .map(|i| row_of(&format!("capped-{i}"), "app", "capped", "t"))
        .chain((0..5).map(|i| row_of(&format!("free-{i}"), "app", "free", "t")))
        .collect();
    insert(store.as_ref(), &rows).await;
    // Eight claimers race, each asking for up to 10 until it gets none.
    let claimed = take_concurrently(&store, 8, |store| async move {
        ids(&store
            .claim_limited("capped", 3, 10, LEASE)
            .await
            .expect("limited claim"))
    })
    .await;
    assert_eq!(claimed.len(), 3, "{claimed:?}");
    assert!(claimed.iter().all(|id| id.starts_with("capped-")));
    // Oldest first.
    let mut sorted = claimed.clone();
    sorted.sort();
    assert_eq!(sorted, ["capped-0", "capped-1", "capped-2"]);

    // Processing rows count too; a released claim makes room for one.
    let held: Vec<ClaimToken> = futures::future::join_all(claimed.iter().map(|id| {
        let store = Arc::clone(&store);
        async move { store.get(id).await.unwrap().unwrap().claim_token().unwrap() }
    }))
    .await;
    store
        .mark_processing(&held[..1], Duration::from_secs(60))
        .await
        .unwrap();
    assert!(
        store
            .claim_limited("capped", 3, 10, LEASE)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(store.release_claims(&held[1..2]).await.unwrap(), 1);
    assert_eq!(
        store
            .claim_limited("capped", 3, 10, LEASE)
            .await
            .unwrap()
            .len(),
        1
    );
    // A higher limit makes more room; other namespaces are untouched.
    assert_eq!(
        store
            .claim_limited("capped", 5, 10, LEASE)
            .await
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        store
            .claim_limited("free", 100, 2, LEASE)
            .await
            .unwrap()
            .len(),
        2,
        "bounded by the batch"
    );
}

/// Rows `{namespace}-{i}` of application "app", the namespaces' rows
/// stored one after the other (so oldest first would take `first` only).
async fn insert_flows(store: &Store, flows: &[(&str, usize)]) {
    let base = now();
    let mut rows = Vec::new();
    for (namespace, count) in flows {
        for i in 0..*count {
            let mut row = row_of(&format!("{namespace}-{i}"), "app", namespace, "t");
            row.added_at = base + TimeDelta::microseconds(rows.len() as i64);
            rows.push(row);
        }
    }
    insert(store.as_ref(), &rows).await;
}

/// How many of `claimed` belong to each namespace, by name.
fn per_namespace(claimed: &[ClaimedActivation]) -> Vec<(String, usize)> {
    let mut counts = std::collections::BTreeMap::new();
    for claim in claimed {
        *counts
            .entry(claim.activation.namespace.clone())
            .or_insert(0) += 1;
    }
    counts.into_iter().collect()
}

async fn fair_claims_share_the_batch_between_namespaces_by_weight(store: Store) {
    // A flood stored first, then two namespaces with a few tasks each.
    insert_flows(&store, &[("flood", 100), ("small", 5), ("heavy", 20)]).await;
    let claim = |dispatch| {
        let store = Arc::clone(&store);
        async move {
            let claimed = store
                .claim_for_push_except(BucketRange::ALL, 10, LEASE, &[], dispatch)
                .await
                .expect("claim");
            store.release_claims(&tokens(&claimed)).await.unwrap();
            claimed
        }
    };
    let oldest = claim(Dispatch::OldestFirst).await;
    assert_eq!(per_namespace(&oldest), [("flood".to_owned(), 10)]);
    // Equal weights: ⌈10 / 3⌉ each, interleaved, the first 10 kept.
    let equal = claim(Dispatch::Fair(&[])).await;
    let equal_counts = per_namespace(&equal);
    assert_eq!(equal.len(), 10);
    assert!(
        equal_counts.iter().all(|(_, n)| (3..=4).contains(n)),
        "{equal_counts:?}"
    );
    // heavy weighs 3 of 5: 6 places, the others 2 each.
    let weights = [("heavy".to_owned(), 3)];
    let weighted = claim(Dispatch::Fair(&weights)).await;
    assert_eq!(
        per_namespace(&weighted),
        [
            ("flood".to_owned(), 2),
            ("heavy".to_owned(), 6),
            ("small".to_owned(), 2)
        ]
    );
    // Each namespace's own tasks still go oldest first.
    let mut heavy: Vec<String> = ids(&weighted)
        .into_iter()
        .filter(|id| id.starts_with("heavy"))
        .collect();
    heavy.sort();
    assert_eq!(
        heavy,
        (0..6).map(|i| format!("heavy-{i}")).collect::<Vec<_>>()
    );
}

async fn fair_claims_take_every_flow_of_every_application(store: Store) {
    // Flows are (application, namespace): the same namespace under two
    // applications is two flows, and a flood in the first application must
    // not hide the second application's flows.
    let base = now();
    let mut rows = Vec::new();
    for (application, namespace, count) in [("a1", "x", 50), ("a2", "x", 2), ("a2", "y", 2)] {
        for i in 0..count {
            let id = format!("{application}-{namespace}-{i}");
            let mut row = row_of(&id, application, namespace, "t");
            row.added_at = base + TimeDelta::microseconds(rows.len() as i64);
            rows.push(row);
        }
    }
    insert(store.as_ref(), &rows).await;
    let claimed = store
        .claim_for_push_except(BucketRange::ALL, 6, LEASE, &[], Dispatch::Fair(&[]))
        .await
        .unwrap();
    let mut flows: Vec<(String, String)> = claimed
        .iter()
        .map(|c| {
            (
                c.activation.application.clone(),
                c.activation.namespace.clone(),
            )
        })
        .collect();
    flows.sort();
    flows.dedup();
    assert_eq!(
        flows,
        [("a1", "x"), ("a2", "x"), ("a2", "y")].map(|(a, n)| (a.to_owned(), n.to_owned())),
        "a share for each flow: {:?}",
        ids(&claimed)
    );
}

async fn fair_claims_fill_the_batch_and_keep_to_the_bucket_range(store: Store) {
    insert_flows(&store, &[("flood", 200), ("small", 1)]).await;
    // The small namespace's one task leaves most of its share unused: the
    // flood fills the batch, oldest first.
    let claimed = store
        .claim_for_push_except(BucketRange::ALL, 10, LEASE, &[], Dispatch::Fair(&[]))
        .await
        .unwrap();
    assert_eq!(
        per_namespace(&claimed),
        [("flood".to_owned(), 9), ("small".to_owned(), 1)]
    );
    let flood: Vec<String> = ids(&claimed)
        .into_iter()
        .filter(|id| id.starts_with("flood"))
        .collect();
    assert_eq!(
        flood,
        (0..9).map(|i| format!("flood-{i}")).collect::<Vec<_>>()
    );
    // A fetcher's half of the buckets: only rows there, still a full batch.
    let half = BucketRange::slice(1, 2);
    let claimed = store
        .claim_for_push_except(half, 20, LEASE, &[], Dispatch::Fair(&[]))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 20);
    assert!(
        claimed
            .iter()
            .all(|c| (half.first..=half.last).contains(&c.activation.bucket)),
        "every row in the fetcher's buckets"
    );
    // Nothing is claimed twice: the rows left are exactly the others.
    let rest = store
        .claim_for_push_except(BucketRange::ALL, 1000, LEASE, &[], Dispatch::Fair(&[]))
        .await
        .unwrap();
    assert_eq!(rest.len(), 201 - 10 - 20);
}
