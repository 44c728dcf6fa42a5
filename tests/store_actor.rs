//! StoreActor against a real PostgreSQL database: it runs queries
//! concurrently instead of one at a time, turns a database outage into
//! `Unavailable` errors (never a hang or a panic) and recovers when the
//! database comes back, records every call in its metrics, and combines
//! workers' reports (single ones and batches) so that a request the
//! database refuses fails alone.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use common::TestDb;
use taskbroker::actors::StoreHandle;
use taskbroker::metrics::Metrics;
use taskbroker::model::{ActivationStatus, BucketRange, ClaimToken, StatusUpdate, WorkerStatus};
use taskbroker::store::{ActivationStore, PostgresStore, StoreError};

/// Bound on every wait for the database to reach a state; reaching it is
/// the test's event, running out is a failure.
const DEADLINE: Duration = Duration::from_secs(10);
/// Pause between two looks at a condition we poll.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

fn start_actor(store: Arc<dyn ActivationStore>) -> (StoreHandle, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let addr = StoreHandle::start(store, Arc::clone(&metrics)).expect("store threads start");
    (addr, metrics)
}

/// Awaits `future`, failing the test instead of hanging if it does not
/// finish within `DEADLINE`.
async fn within_deadline<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {DEADLINE:?}"))
}

/// A bounded wait for a condition the test polls: `pause` sleeps briefly
/// between two looks, and fails the test once `DEADLINE` has passed.
struct Deadline {
    what: &'static str,
    until: tokio::time::Instant,
}

impl Deadline {
    fn start(what: &'static str) -> Deadline {
        Deadline {
            what,
            until: tokio::time::Instant::now() + DEADLINE,
        }
    }

    async fn pause(&self) {
        assert!(
            tokio::time::Instant::now() < self.until,
            "gave up after {DEADLINE:?} waiting until {}",
            self.what
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Backends connected to `database` that wait for a heavyweight lock.
async fn backends_waiting_on_locks(admin: &tokio_postgres::Client, database: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = $1 AND wait_event_type = 'Lock'",
            &[&database],
        )
        .await
        .expect("read pg_stat_activity")
        .get(0)
}

async fn backends_on(admin: &tokio_postgres::Client, database: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
            &[&database],
        )
        .await
        .expect("read pg_stat_activity")
        .get(0)
}

#[actix_rt::test]
async fn handlers_run_queries_concurrently() {
    const CONCURRENT: usize = 8;
    let db = TestDb::new().await;
    let mut config = db.store_config();
    config.pool_size = 2 * CONCURRENT;
    let store = PostgresStore::connect(&config).expect("store config");
    store.migrate().await.expect("migrations apply");
    common::insert(&store, &common::rows("concurrent", 5)).await;
    let (addr, metrics) = start_actor(Arc::new(store));

    // Every query on the table now blocks until the lock is released. A
    // StoreActor that ran one query at a time would have exactly one backend
    // waiting, however many messages were sent.
    let locker = db.client().await;
    locker
        .batch_execute("BEGIN; LOCK TABLE inflight_taskactivations IN ACCESS EXCLUSIVE MODE;")
        .await
        .expect("lock the table");

    let requests: Vec<_> = (0..CONCURRENT).map(|_| addr.count_by_status()).collect();
    let replies = actix_rt::spawn(futures::future::join_all(requests));

    let monitor = common::connect(&common::admin_url()).await;
    let deadline = Deadline::start("all the store queries wait on the table lock at once");
    let waiting = loop {
        let waiting = backends_waiting_on_locks(&monitor, &db.name).await;
        if waiting >= CONCURRENT as i64 {
            break waiting;
        }
        deadline.pause().await;
    };
    assert_eq!(
        waiting, CONCURRENT as i64,
        "only the store's queries should be waiting"
    );

    locker.batch_execute("COMMIT").await.expect("unlock");
    let replies = within_deadline("the blocked queries", replies)
        .await
        .expect("reply task");
    assert_eq!(replies.len(), CONCURRENT);
    for reply in replies {
        let counts = reply.expect("count succeeds once the lock is gone");
        assert_eq!(counts.get(ActivationStatus::Pending), 5);
        assert_eq!(counts.total(), 5);
    }
    assert_eq!(metrics.store_calls("count_by_status"), CONCURRENT as u64);
}

/// Re-allows connections to a database when dropped, so a failing outage
/// test never leaves its database locked out (TestDb's Drop still removes
/// it, but this keeps the server in the state other tests expect).
struct AllowConnectionsOnDrop {
    name: String,
}

impl Drop for AllowConnectionsOnDrop {
    fn drop(&mut self) {
        common::admin_execute_from_drop(format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS true",
            self.name
        ));
    }
}

/// Asserts a store call failed as retryable, and tallies it.
fn expect_unavailable<T: std::fmt::Debug>(operation: &str, reply: Result<T, StoreError>) {
    match reply {
        Err(err) => assert!(
            err.is_unavailable(),
            "{operation} during the outage failed with {err:?}, expected Unavailable"
        ),
        Ok(value) => panic!("{operation} succeeded during the outage: {value:?}"),
    }
}

#[actix_rt::test]
async fn database_outage_returns_unavailable_then_recovers() {
    let db = TestDb::new().await;
    let mut config = db.store_config();
    config.connect_timeout = Duration::from_secs(1);
    config.pool_size = 4;
    let store = PostgresStore::connect(&config).expect("store config");
    store.migrate().await.expect("migrations apply");
    let store: Arc<dyn ActivationStore> = Arc::new(store);
    let (addr, metrics) = start_actor(Arc::clone(&store));

    let rows = common::rows("outage", 3);
    let inserted = addr
        .insert(Arc::new(rows.clone()))
        .await
        .expect("insert before the outage");
    assert_eq!(inserted, 3);

    // One query is in flight when the database goes away: it waits behind a
    // table lock, so the termination hits it mid-statement.
    let locker = db.client().await;
    locker
        .batch_execute("BEGIN; LOCK TABLE inflight_taskactivations IN ACCESS EXCLUSIVE MODE;")
        .await
        .expect("lock the table");
    let in_flight = actix_rt::spawn(addr.count_by_status());
    let admin = common::connect(&common::admin_url()).await;
    let deadline = Deadline::start("the in-flight query waits on the table lock");
    while backends_waiting_on_locks(&admin, &db.name).await < 1 {
        deadline.pause().await;
    }

    let _allow_again = AllowConnectionsOnDrop {
        name: db.name.clone(),
    };
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS false",
            db.name
        ))
        .await
        .expect("refuse new connections");
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&db.name],
        )
        .await
        .expect("terminate existing connections");
    let deadline = Deadline::start("no backend is connected to the test database");
    while backends_on(&admin, &db.name).await > 0 {
        deadline.pause().await;
    }

    let reply = within_deadline("the query cut off mid-statement", in_flight)
        .await
        .expect("reply task");
    expect_unavailable("count_by_status in flight", reply);
    // Later calls find the pooled connection dead and have to open new
    // ones, which the database refuses: Unavailable too, and promptly.
    for _ in 0..2 {
        let reply = within_deadline("count_by_status during the outage", async {
            addr.count_by_status().await
        })
        .await;
        expect_unavailable("count_by_status", reply);
    }
    let reply = within_deadline("ping during the outage", addr.ping()).await;
    expect_unavailable("ping", reply);
    let reply = within_deadline("claim_for_push during the outage", async {
        addr.claim(BucketRange::ALL, 10, Duration::from_secs(60), true)
            .await
    })
    .await;
    expect_unavailable("claim_for_push", reply);

    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS true",
            db.name
        ))
        .await
        .expect("allow connections again");

    // Recovery needs no restart: the pool reconnects on its own.
    let mut failures_while_recovering = 0u64;
    let deadline = Deadline::start("max_pending_lag succeeds again");
    loop {
        match addr.max_pending_lag().await {
            Ok(_) => break,
            Err(err) => {
                assert!(
                    err.is_unavailable(),
                    "error while recovering should be Unavailable: {err:?}"
                );
                failures_while_recovering += 1;
            }
        }
        deadline.pause().await;
    }

    let counts = addr.count_by_status().await.expect("count after recovery");
    assert_eq!(counts.get(ActivationStatus::Pending), 3);
    assert_eq!(counts.total(), 3);
    for row in &rows {
        let stored = store.get(&row.id).await.expect("get after recovery");
        assert_eq!(stored.as_ref(), Some(row), "row {} changed", row.id);
    }

    let unavailable = |operation: &str| {
        metrics
            .store_errors
            .with_label_values(&[operation, "unavailable"])
            .get()
    };
    assert_eq!(unavailable("count_by_status"), 3);
    assert_eq!(unavailable("ping"), 1);
    assert_eq!(unavailable("claim_for_push"), 1);
    assert_eq!(unavailable("max_pending_lag"), failures_while_recovering);
    assert_eq!(unavailable("insert_batch"), 0);
    // Calls are counted whether they failed or not.
    assert_eq!(metrics.store_calls("count_by_status"), 4);
    assert_eq!(metrics.store_calls("ping"), 1);
}

#[actix_rt::test]
async fn release_claims_batch_is_one_store_call_and_returns_rows_to_pending() {
    const K: usize = 12;
    let db = TestDb::new().await;
    let store = db.store().await;
    common::insert(store.as_ref(), &common::rows("release", K)).await;
    let (addr, metrics) = start_actor(store.clone());

    let claimed = claim(&addr, K).await;
    assert_eq!(claimed.len(), K);
    let tokens: Vec<ClaimToken> = claimed
        .iter()
        .map(|row| row.claim_token().expect("claimed rows carry their fence"))
        .collect();

    let released = addr.release(tokens).await.expect("release");
    assert_eq!(released, K as u64);
    assert_eq!(metrics.store_calls("release_claims"), 1);

    let counts = addr.count_by_status().await.expect("count");
    assert_eq!(counts.get(ActivationStatus::Pending), K as u64);
    assert_eq!(counts.get(ActivationStatus::Claimed), 0);
    for row in &claimed {
        let stored = store
            .get(&row.id)
            .await
            .expect("get")
            .expect("row still stored");
        assert_eq!(stored.status, ActivationStatus::Pending);
        assert_eq!(
            stored.processing_attempts, 0,
            "releasing must not consume an attempt"
        );
    }
}

/// Claims up to `limit` rows through the StoreActor, with a one-minute lease.
async fn claim(addr: &StoreHandle, limit: usize) -> Vec<taskbroker::model::ClaimedActivation> {
    addr.claim(BucketRange::ALL, limit, Duration::from_secs(60), true)
        .await
        .expect("claim")
}

/// `n` rows of `prefix` stored and claimed, on a store of `db`; their ids.
async fn claimed_rows(db: &TestDb, prefix: &str, n: usize) -> (Arc<PostgresStore>, Vec<String>) {
    let store = db.store().await;
    common::insert(store.as_ref(), &common::rows(prefix, n)).await;
    let claimed = store
        .claim_for_push(BucketRange::ALL, n, Duration::from_secs(60))
        .await
        .expect("claim");
    assert_eq!(claimed.len(), n);
    (
        store,
        claimed.into_iter().map(|row| row.id.clone()).collect(),
    )
}

/// The activations table held under an exclusive lock, so the StoreActor's
/// statements queue behind it: how the report tests make writes combine.
struct HeldTable {
    locker: tokio_postgres::Client,
    monitor: tokio_postgres::Client,
    database: String,
}

impl HeldTable {
    async fn hold(db: &TestDb) -> HeldTable {
        let locker = db.client().await;
        locker
            .batch_execute("BEGIN; LOCK TABLE inflight_taskactivations IN ACCESS EXCLUSIVE MODE;")
            .await
            .expect("lock the table");
        HeldTable {
            locker,
            monitor: common::connect(&common::admin_url()).await,
            database: db.name.clone(),
        }
    }

    /// Waits until `statements` statements wait on the lock.
    async fn wait_for(&self, statements: i64, what: &'static str) {
        let deadline = Deadline::start(what);
        while backends_waiting_on_locks(&self.monitor, &self.database).await < statements {
            deadline.pause().await;
        }
    }

    /// Releases the lock once every message sent to `addr` so far is
    /// queued: the actor handles messages in order, so once a count sent
    /// now waits on the lock too (beside the first write), every report
    /// before it has joined the next combined write.
    async fn release_once_queued(self, addr: &StoreHandle) {
        let count = addr.count_by_status();
        self.wait_for(2, "the reports are queued behind the first")
            .await;
        self.locker.batch_execute("COMMIT").await.expect("unlock");
        within_deadline("the count", count).await.expect("count");
    }
}

#[actix_rt::test]
async fn a_report_the_database_refuses_fails_alone_not_its_combined_write() {
    const VALID: usize = 20;
    let db = TestDb::new().await;
    let (store, claimed) = claimed_rows(&db, "report", VALID).await;
    let (addr, metrics) = start_actor(store.clone());
    let report = |id: &str| addr.report(vec![StatusUpdate::new(id, WorkerStatus::Complete)]);

    // Hold the table so the first report's write waits and every report
    // sent meanwhile joins the next combined write.
    let held = HeldTable::hold(&db).await;
    let first = report(&claimed[0]);
    held.wait_for(1, "the first report waits on the table lock")
        .await;
    // PostgreSQL refuses NUL in text: these two fail any statement they
    // are part of. (The gRPC API refuses such ids before this point.)
    let mut ids: Vec<String> = claimed[1..].to_vec();
    ids.insert(5, "nul\0one".to_owned());
    ids.insert(15, "nul\0two".to_owned());
    let rest: Vec<_> = ids.iter().map(|id| report(id)).collect();
    held.release_once_queued(&addr).await;

    within_deadline("the first report", first)
        .await
        .expect("the first report is written");
    let answers = within_deadline("the combined reports", futures::future::join_all(rest)).await;
    let mut refused = Vec::new();
    for (id, answer) in ids.iter().zip(answers) {
        match answer {
            // Written: COMPLETE deletes the row.
            Ok(()) => assert_eq!(store.get(id).await.expect("get"), None, "{id}"),
            Err(err) => {
                assert!(!err.is_unavailable(), "{id}: {err}");
                refused.push(id.clone());
            }
        }
    }
    assert_eq!(refused, ["nul\0one", "nul\0two"]);
    // The first alone, the combined write that failed, then each of the
    // 21 on its own.
    assert_eq!(metrics.store_calls("set_status"), 1 + 1 + VALID as u64 + 1);
}

#[actix_rt::test]
async fn batch_reports_are_combined_and_a_refused_batch_fails_as_a_whole_alone() {
    const VALID: usize = 20;
    let db = TestDb::new().await;
    let (store, ids) = claimed_rows(&db, "batch", VALID).await;
    let (addr, metrics) = start_actor(store.clone());
    let report = |ids: &[String]| {
        addr.report(
            ids.iter()
                .map(|id| StatusUpdate::new(id.as_str(), WorkerStatus::Complete))
                .collect(),
        )
    };

    // As above: the first write waits on the lock, the rest join the next.
    let held = HeldTable::hold(&db).await;
    let first = report(&ids[..1]);
    held.wait_for(1, "the first report waits on the table lock")
        .await;
    let good = report(&ids[1..8]);
    let refused = report(&[ids[8].clone(), "nul\0batch".to_owned()]);
    let single = report(&ids[9..10]);
    let rest = report(&ids[10..]);
    held.release_once_queued(&addr).await;

    within_deadline("the first report", first)
        .await
        .expect("the first report is written");
    within_deadline("a good batch", good)
        .await
        .expect("a good batch is written");
    let err = within_deadline("the refused batch", refused)
        .await
        .expect_err("a batch with a refused id fails");
    assert!(!err.is_unavailable(), "{err}");
    within_deadline("a single report", single)
        .await
        .expect("a single report is written");
    within_deadline("the last batch", rest)
        .await
        .expect("the last batch is written");

    for (index, id) in ids.iter().enumerate() {
        let expected = if index == 8 {
            // Refused with its batch: a request fails or succeeds whole.
            Some(ActivationStatus::Claimed)
        } else {
            // Written: COMPLETE deletes the row.
            None
        };
        let status = store.get(id).await.expect("get").map(|row| row.status);
        assert_eq!(status, expected, "{id}");
    }
    // The first alone, the combined write that failed, then each of the
    // four requests on its own.
    assert_eq!(metrics.store_calls("set_status"), 1 + 1 + 4);
    // What the writes did is counted once per successful statement.
    let updated = metrics.status_updates.with_label_values(&["updated"]).get();
    assert_eq!(updated, VALID as u64 - 1);
}

/// A worker's report that arrives after its push was sent makes the push's
/// Claimed → Processing write moot: the mark is answered without a
/// statement, whether the report came before the mark or while the mark
/// waited to be combined. A report that came before the push was sent (of
/// an earlier delivery, applied before this claim) saves nothing: that
/// mark is written, so no claim is left unmarked by a report it never saw.
#[actix_rt::test]
async fn marks_of_tasks_already_reported_are_skipped_and_others_written() {
    use std::time::Instant;

    let db = TestDb::new().await;
    let store = db.store().await;
    common::insert(store.as_ref(), &common::rows("skip", 4)).await;
    let (addr, metrics) = start_actor(store.clone());
    // skip-3 is reported while still Pending (ignored), before its claim.
    addr.report(vec![StatusUpdate::new("skip-3", WorkerStatus::Complete)])
        .await
        .expect("report");
    let claimed = claim(&addr, 4).await;
    let token = |id: &str| {
        claimed
            .iter()
            .find(|row| row.id == id)
            .and_then(|row| row.claim_token())
            .expect("claimed")
    };
    let pushed_at = Instant::now();
    let mark = |id: &str| addr.mark_pushed(token(id), Duration::from_secs(1), pushed_at);

    // The report first, then the mark: no statement.
    addr.report(vec![StatusUpdate::new("skip-0", WorkerStatus::Complete)])
        .await
        .expect("report");
    assert_eq!(mark("skip-0").await, Ok(true));
    assert_eq!(metrics.store_calls("mark_processing"), 0);
    assert_eq!(metrics.marks_skipped.get(), 1);

    // A mark waiting behind another mark's write when the report comes.
    let held = HeldTable::hold(&db).await;
    let first = mark("skip-1");
    held.wait_for(1, "the first mark's write waits").await;
    let waiting = mark("skip-2");
    let report = addr.report(vec![StatusUpdate::new("skip-2", WorkerStatus::Complete)]);
    held.wait_for(2, "the report's write waits too").await;
    held.locker.batch_execute("COMMIT").await.expect("unlock");
    assert_eq!(within_deadline("first mark", first).await, Ok(true));
    assert_eq!(within_deadline("waiting mark", waiting).await, Ok(true));
    within_deadline("report", report).await.expect("report");
    assert_eq!(metrics.store_calls("mark_processing"), 1, "skip-1 only");
    assert_eq!(metrics.marks_skipped.get(), 2);

    // Reported before the push was sent: the mark is written.
    assert_eq!(
        addr.mark_pushed(token("skip-3"), Duration::from_secs(1), Instant::now())
            .await,
        Ok(true)
    );
    assert_eq!(metrics.store_calls("mark_processing"), 2);
    let status = |id: &'static str| {
        let store = Arc::clone(&store);
        async move { store.get(id).await.expect("get").map(|row| row.status) }
    };
    assert_eq!(status("skip-0").await, None);
    assert_eq!(status("skip-1").await, Some(ActivationStatus::Processing));
    assert_eq!(status("skip-2").await, None);
    assert_eq!(status("skip-3").await, Some(ActivationStatus::Processing));
    // The two reports that followed their push timed that stage.
    let stage = |name: &str| metrics.stages.with_label_values(&[name]).get_sample_count();
    assert_eq!(stage("pushed_to_reported"), 2, "skip-0 and skip-2");
}

/// The database work one task costs on the common path, counted (not
/// timed) on a fixed workload of 64 tasks through the StoreActor: one
/// insert, one claim, one report statement for the batch; per task one row
/// inserted, one updated (the claim) and one deleted (the report), with
/// the marks of tasks reported first skipped and nothing left for upkeep.
/// PostgreSQL's own table statistics count the rows.
#[actix_rt::test]
async fn a_reported_task_costs_one_insert_one_update_and_one_delete() {
    use std::time::Instant;
    const N: usize = 64;

    let db = TestDb::new().await;
    let store = db.store().await;
    let (addr, metrics) = start_actor(store.clone());
    let rows = common::rows("cost", N);
    addr.insert(Arc::new(rows)).await.expect("insert");
    let claimed = claim(&addr, N).await;
    assert_eq!(claimed.len(), N);
    let pushed_at = Instant::now();
    addr.report(
        claimed
            .iter()
            .map(|row| StatusUpdate::new(row.id.as_str(), WorkerStatus::Complete))
            .collect(),
    )
    .await
    .expect("report");
    for row in &claimed {
        let mark = addr.mark_pushed(
            row.claim_token().expect("fence"),
            Duration::from_secs(1),
            pushed_at,
        );
        assert_eq!(mark.await, Ok(true));
    }
    assert_eq!(store.remove_completed(1000).await, Ok(0));
    assert_eq!(store.discard_failures(1000).await, Ok(0));
    let statements: Vec<u64> = [
        "insert_batch",
        "claim_for_push",
        "mark_processing",
        "set_status",
    ]
    .iter()
    .map(|operation| metrics.store_calls(operation))
    .collect();
    assert_eq!(statements, [1, 1, 0, 1]);

    // A backend flushes its table statistics when it exits: close the pool
    // and wait for its connections to end before reading them.
    drop((addr, store));
    let admin = common::connect(&common::admin_url()).await;
    let deadline = Deadline::start("the store's connections have closed");
    while backends_on(&admin, &db.name).await > 0 {
        deadline.pause().await;
    }
    let client = db.client().await;
    let row = client
        .query_one(
            "SELECT n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables \
             WHERE relname = 'inflight_taskactivations'",
            &[],
        )
        .await
        .expect("read table statistics");
    let rows_touched: (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(rows_touched, (N as i64, N as i64, N as i64));
}

/// Database calls run on the store's own threads, not on the StoreActor's:
/// with the actor's thread blocked, a call it has already handed on still
/// finishes in the database. The insert is the first of its statement on
/// the connection, so it needs two round trips (prepare, then execute);
/// the table lock holds it after the first. Were the call polled on the
/// actor's thread, where its pool connection was also opened, the second
/// round trip could not start until that thread was free again.
#[actix_rt::test]
async fn database_calls_run_off_the_store_actors_thread() {
    let db = TestDb::new().await;
    let observer = db.store().await;
    let arbiter = actix::Arbiter::new();
    let addr = StoreHandle::start_in_arbiter(
        &arbiter.handle(),
        db.store().await,
        Arc::new(Metrics::new()),
        taskbroker::runtime::RuntimeRules::none(),
    )
    .expect("store threads start");
    // Opens the actor's pool connection.
    within_deadline("ping", addr.ping()).await.expect("ping");
    let held = HeldTable::hold(&db).await;
    let insert = addr.insert(Arc::new(common::rows("off-thread", 3)));
    held.wait_for(1, "the insert waits on the lock").await;

    let (blocked, is_blocked) = tokio::sync::oneshot::channel();
    let (unblock, until_unblocked) = std::sync::mpsc::channel::<()>();
    arbiter.spawn_fn(move || {
        let _ = blocked.send(());
        let _ = until_unblocked.recv();
    });
    is_blocked.await.expect("the actor's thread is blocked");
    held.locker.batch_execute("COMMIT").await.expect("unlock");
    let deadline = Deadline::start("the insert is stored while the actor's thread is blocked");
    while observer.count_by_status().await.expect("count").inflight() < 3 {
        deadline.pause().await;
    }
    unblock.send(()).expect("unblock");
    assert_eq!(within_deadline("the insert's answer", insert).await, Ok(3));
    arbiter.stop();
}
