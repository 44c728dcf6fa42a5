//! Broker identity and liveness in the store (`Membership`), on real
//! databases: claims record their broker, a restarted broker releases what
//! its previous incarnation claimed, a silent broker is taken over once
//! with its claims, and a frozen broker that resumes after its takeover
//! can never push or mark a row a peer has claimed since (the fence).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{TestDb, TestSqlite, insert, row, rows};
use taskbroker::actors::liveness::Liveness;
use taskbroker::model::{
    ActivationStatus, BeatAnswer, BucketRange, Dispatch, PauseRule, StatusUpdate, WorkerStatus,
};
use taskbroker::store::{
    ActivationStore, Membership, PostgresStore, PostgresStoreConfig, SqliteStore, SqliteStoreConfig,
};

const LEASE: Duration = Duration::from_secs(30);
const TAKEOVER: Duration = Duration::from_secs(5);

async fn postgres_as(db: &TestDb, broker_id: &str) -> Arc<PostgresStore> {
    let store = PostgresStore::connect(&PostgresStoreConfig {
        broker_id: broker_id.to_owned(),
        ..db.store_config()
    })
    .expect("store config");
    store.migrate().await.expect("migrations apply");
    Arc::new(store)
}

async fn sqlite_as(db: &TestSqlite, broker_id: &str) -> Arc<SqliteStore> {
    let store = SqliteStore::open(&SqliteStoreConfig {
        broker_id: broker_id.to_owned(),
        ..db.store_config()
    })
    .expect("open SQLite store");
    store.migrate().await.expect("migrations apply");
    Arc::new(store)
}

/// `claimed_by` of every Claimed row, by id.
async fn claimers_pg(db: &TestDb) -> Vec<(String, String)> {
    db.client()
        .await
        .query(
            "SELECT id, claimed_by FROM inflight_taskactivations \
             WHERE status = 'Claimed' ORDER BY id",
            &[],
        )
        .await
        .expect("read claims")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Makes `broker`'s heartbeat an hour old, as if it had been frozen.
async fn silence(db: &TestDb, broker: &str) {
    db.client()
        .await
        .execute(
            "UPDATE taskbroker_brokers SET heartbeat_at = heartbeat_at - interval '1 hour' \
             WHERE id = $1",
            &[&broker],
        )
        .await
        .expect("age the heartbeat");
}

/// Waits until one session of the test's database waits on a lock.
async fn wait_for_a_lock_wait(client: &tokio_postgres::Client, what: &str) {
    common::wait_until(what, Duration::from_secs(10), || async {
        client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;
}

async fn brokers_pg(db: &TestDb) -> Vec<String> {
    db.client()
        .await
        .query("SELECT id FROM taskbroker_brokers ORDER BY id", &[])
        .await
        .expect("read brokers")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

async fn status(store: &dyn ActivationStore, id: &str) -> ActivationStatus {
    store
        .get(id)
        .await
        .expect("get")
        .expect("row exists")
        .status
}

/// Claims through every path a broker claims by (oldest first, with a
/// pause rule, fair across two namespaces, under a concurrency limit);
/// answers how many rows were claimed.
async fn claim_every_way(store: &dyn ActivationStore) -> usize {
    insert(store, &rows("oldest", 4)).await;
    let mut claimed = store
        .claim_for_push(BucketRange::ALL, 1, LEASE)
        .await
        .unwrap()
        .len();
    let pause = [PauseRule {
        application: None,
        namespace: Some("nobody".to_owned()),
    }];
    claimed += store
        .claim_for_push_except(BucketRange::ALL, 1, LEASE, &pause, Dispatch::OldestFirst)
        .await
        .unwrap()
        .len();
    // Two flows, so fair dispatch interleaves (SQLite claims them by id).
    let mut other = row("other");
    other.namespace = "other".to_owned();
    insert(store, &[other]).await;
    claimed += store
        .claim_for_push_except(BucketRange::ALL, 2, LEASE, &[], Dispatch::Fair(&[]))
        .await
        .unwrap()
        .len();
    let mut limited = row("limited");
    limited.namespace = "limited".to_owned();
    insert(store, &[limited]).await;
    let by_limit = store.claim_limited("limited", 5, 5, LEASE).await.unwrap();
    assert_eq!(by_limit.len(), 1);
    claimed + by_limit.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_claim_records_its_broker_on_postgres() {
    let db = TestDb::new().await;
    let store = postgres_as(&db, "broker-a").await;
    assert_eq!(claim_every_way(store.as_ref()).await, 5);
    let claims = claimers_pg(&db).await;
    assert_eq!(claims.len(), 5, "{claims:?}");
    assert!(claims.iter().all(|(_, by)| by == "broker-a"), "{claims:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_claim_records_its_broker_on_sqlite() {
    let db = TestSqlite::new();
    let store = sqlite_as(&db, "broker-a").await;
    assert_eq!(claim_every_way(store.as_ref()).await, 5);
    let claims: Vec<Option<String>> = db.query(
        "SELECT claimed_by FROM inflight_taskactivations WHERE status = 'Claimed'",
        |row| row.get(0),
    );
    assert_eq!(claims.len(), 5, "{claims:?}");
    assert!(
        claims.iter().all(|by| by.as_deref() == Some("broker-a")),
        "{claims:?}"
    );
}

/// A broker restarted under its id releases what its previous run claimed
/// at once, and nothing of its peers'; Processing rows keep their deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_broker_releases_only_its_previous_claims() {
    let db = TestDb::new().await;
    let a = postgres_as(&db, "broker-a").await;
    let b = postgres_as(&db, "broker-b").await;
    a.register_broker("host-a", "first", TAKEOVER)
        .await
        .unwrap();
    b.register_broker("host-b", "first", TAKEOVER)
        .await
        .unwrap();
    insert(a.as_ref(), &rows("t", 6)).await;
    let of_a = a.claim_for_push(BucketRange::ALL, 3, LEASE).await.unwrap();
    let of_b = b.claim_for_push(BucketRange::ALL, 2, LEASE).await.unwrap();
    // One of A's claims was pushed before the crash: Processing.
    let pushed = a
        .mark_processing(std::slice::from_ref(&of_a[0].token), Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(pushed.len(), 1);
    let deadline = a
        .get(&of_a[0].id)
        .await
        .unwrap()
        .unwrap()
        .processing_deadline;

    // A dies; its next run finds its row, then registers under the same id.
    drop(a);
    let again = postgres_as(&db, "broker-a").await;
    let left = again
        .read_broker()
        .await
        .unwrap()
        .expect("the dead run's row");
    assert_eq!(left.incarnation, "first");
    assert!(left.silent_for < TAKEOVER);
    let joined = again
        .register_broker("host-a", "second", TAKEOVER)
        .await
        .unwrap();
    assert_eq!(joined.live_peers, 1, "broker-b's heartbeat is live");
    assert_eq!(again.release_previous_claims().await.unwrap(), 2);

    for claim in &of_a[1..] {
        assert_eq!(
            status(again.as_ref(), &claim.id).await,
            ActivationStatus::Pending
        );
    }
    let kept = again.get(&of_a[0].id).await.unwrap().unwrap();
    assert_eq!(kept.status, ActivationStatus::Processing);
    assert_eq!(kept.processing_deadline, deadline);
    for claim in &of_b {
        let row = b.get(&claim.id).await.unwrap().unwrap();
        assert_eq!(row.status, ActivationStatus::Claimed);
        assert_eq!(row.claim_expires_at, Some(claim.token.claim_expires_at));
    }
    // B's claims are still its own to push.
    let tokens: Vec<_> = of_b.iter().map(|claim| claim.token.clone()).collect();
    assert_eq!(
        b.mark_processing(&tokens, Duration::ZERO)
            .await
            .unwrap()
            .len(),
        2
    );
    // The old incarnation's heartbeat no longer counts.
    assert_eq!(
        again.heartbeat("first", TAKEOVER).await.unwrap(),
        BeatAnswer::Replaced
    );
    assert_eq!(
        again.heartbeat("second", TAKEOVER).await.unwrap(),
        BeatAnswer::Accepted { silent_peers: 0 }
    );
}

/// `claimed_by` names a row's current claim only: every way out of Claimed
/// clears it. A broker of a version before V4 (beside this one during a
/// rolling upgrade) claims without writing the column, so a stale id left
/// on a row it claims would make that broker's restart or takeover release
/// a claim another broker is pushing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_by_a_broker_older_than_v4_is_not_released_under_the_previous_claimer_s_id() {
    let db = TestDb::new().await;
    let a = postgres_as(&db, "broker-a").await;
    a.register_broker("host-a", "first", TAKEOVER)
        .await
        .unwrap();
    insert(a.as_ref(), &rows("t", 8)).await;
    let claims = a.claim_for_push(BucketRange::ALL, 8, LEASE).await.unwrap();
    let token = |i: usize| std::slice::from_ref(&claims[i].token);
    assert_eq!(a.release_claims(token(0)).await.unwrap(), 1);
    assert_eq!(
        a.mark_processing(token(1), Duration::ZERO)
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(a.fail_claim_attempt(token(2), 5).await.unwrap(), 1);
    assert_eq!(a.fail_claims(token(3)).await.unwrap(), 1);
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    assert_eq!(a.defer_claims(token(4), later).await.unwrap(), 1);
    let report = StatusUpdate::new(claims[5].id.clone(), WorkerStatus::Retry);
    assert_eq!(a.set_status(&[report]).await.unwrap().updated, 1);
    let client = db.client().await;
    client
        .execute(
            "UPDATE inflight_taskactivations SET claim_expires_at = now() - interval '1 minute' \
             WHERE id = $1",
            &[&claims[6].id],
        )
        .await
        .unwrap();
    assert_eq!(a.release_expired_claims(10).await.unwrap(), 1);

    let named: Vec<(String, String)> = client
        .query(
            "SELECT id, status FROM inflight_taskactivations \
             WHERE claimed_by IS NOT NULL ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(named, [(claims[7].id.clone(), "Claimed".to_owned())]);

    // An older broker claims the row A released, as its claim statement
    // does: status and lease, no `claimed_by`.
    client
        .execute(
            "UPDATE inflight_taskactivations \
             SET status = 'Claimed', claim_expires_at = now() + interval '1 minute' \
             WHERE id = $1",
            &[&claims[0].id],
        )
        .await
        .unwrap();
    // A restarts under its id: it releases only the claim it held.
    drop(a);
    let again = postgres_as(&db, "broker-a").await;
    again
        .register_broker("host-a", "second", TAKEOVER)
        .await
        .unwrap();
    assert_eq!(again.release_previous_claims().await.unwrap(), 1);
    assert_eq!(
        status(again.as_ref(), &claims[0].id).await,
        ActivationStatus::Claimed
    );
    assert_eq!(
        status(again.as_ref(), &claims[7].id).await,
        ActivationStatus::Pending
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_broker_is_taken_over_once_with_its_claims() {
    let db = TestDb::new().await;
    let a = postgres_as(&db, "broker-a").await;
    let b = postgres_as(&db, "broker-b").await;
    let c = postgres_as(&db, "broker-c").await;
    for (store, host) in [(&a, "host-a"), (&b, "host-b"), (&c, "host-c")] {
        store.register_broker(host, "one", TAKEOVER).await.unwrap();
    }
    insert(a.as_ref(), &rows("t", 5)).await;
    let of_a = a.claim_for_push(BucketRange::ALL, 3, LEASE).await.unwrap();
    let of_c = c.claim_for_push(BucketRange::ALL, 2, LEASE).await.unwrap();

    // Everyone is live: nobody is taken over.
    assert!(b.take_over_silent(TAKEOVER).await.unwrap().is_empty());

    silence(&db, "broker-a").await;
    // A peer's heartbeat counts the silent broker, so it knows to take it
    // over (and a beat with nobody silent costs no takeover statement).
    assert_eq!(
        b.heartbeat("one", TAKEOVER).await.unwrap(),
        BeatAnswer::Accepted { silent_peers: 1 }
    );
    // Its own stale row is never a broker's to take over.
    assert!(a.take_over_silent(TAKEOVER).await.unwrap().is_empty());
    // Two peers at once: exactly one takes it over.
    let (by_b, by_c) = tokio::join!(b.take_over_silent(TAKEOVER), c.take_over_silent(TAKEOVER));
    let mut takeovers = by_b.unwrap();
    takeovers.extend(by_c.unwrap());
    assert_eq!(takeovers.len(), 1, "{takeovers:?}");
    let takeover = &takeovers[0];
    assert_eq!(takeover.broker_id, "broker-a");
    assert_eq!(takeover.host, "host-a");
    assert_eq!(takeover.released, 3);
    assert!(takeover.silent_for >= Duration::from_secs(3600));

    for claim in &of_a {
        assert_eq!(
            status(b.as_ref(), &claim.id).await,
            ActivationStatus::Pending
        );
    }
    for claim in &of_c {
        assert_eq!(
            status(b.as_ref(), &claim.id).await,
            ActivationStatus::Claimed
        );
    }
    assert_eq!(brokers_pg(&db).await, ["broker-b", "broker-c"]);
    // A learns of it on its next heartbeat.
    assert_eq!(
        a.heartbeat("one", TAKEOVER).await.unwrap(),
        BeatAnswer::TakenOver
    );
    assert_eq!(
        b.heartbeat("one", TAKEOVER).await.unwrap(),
        BeatAnswer::Accepted { silent_peers: 0 }
    );
    // A clean stop leaves nothing to take over.
    assert!(b.unregister_broker("one").await.unwrap());
    assert_eq!(brokers_pg(&db).await, ["broker-c"]);
}

/// A heartbeat that meets a peer's takeover in flight (the takeover's DELETE
/// holds the row's lock until it commits) learns that it was taken over, so
/// its broker joins again. Reading the row from the statement's snapshot
/// said instead that another process had registered under its id, and the
/// broker exited. The takeover is held open here in a transaction of its
/// own, so the heartbeat is known to wait on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_racing_its_own_takeover_learns_it_was_taken_over() {
    let db = TestDb::new().await;
    let a = postgres_as(&db, "broker-a").await;
    a.register_broker("host-a", "one", TAKEOVER).await.unwrap();

    let mut peer = db.client().await;
    let takeover = peer.transaction().await.unwrap();
    takeover
        .execute("DELETE FROM taskbroker_brokers WHERE id = 'broker-a'", &[])
        .await
        .unwrap();
    let beat = tokio::spawn({
        let a = Arc::clone(&a);
        async move { a.heartbeat("one", TAKEOVER).await }
    });
    let observer = db.client().await;
    wait_for_a_lock_wait(&observer, "the heartbeat waits on the takeover's row lock").await;
    takeover.commit().await.unwrap();
    assert_eq!(beat.await.unwrap().unwrap(), BeatAnswer::TakenOver);
}

/// A takeover locks the claims it releases in id order, as every batch
/// write does, so it cannot deadlock with one on the same rows (a worker's
/// reports, or the frozen broker's own writes as it resumes). A batch holds
/// the lowest id: the takeover waits for it holding nothing, and the
/// batch's next row, the highest id, is free. The claims are laid out in
/// both orders (table and lease order alike), since the plan may walk them
/// either way round (a hash join probes them in reverse).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_locks_the_claims_it_releases_in_id_order() {
    takeover_beside_a_batch(["t-3", "t-2", "t-1", "t-0"]).await;
    takeover_beside_a_batch(["t-0", "t-1", "t-2", "t-3"]).await;
}

/// Broker A's claims are made in `claim_order` with leases in that order;
/// then A is silent, a batch locks t-0 and B takes A over.
async fn takeover_beside_a_batch(claim_order: [&str; 4]) {
    let db = TestDb::new().await;
    let a = postgres_as(&db, "broker-a").await;
    let b = postgres_as(&db, "broker-b").await;
    for (store, host) in [(&a, "host-a"), (&b, "host-b")] {
        store.register_broker(host, "one", TAKEOVER).await.unwrap();
    }
    insert(a.as_ref(), &rows("t", 4)).await;
    let client = db.client().await;
    for (lease_sec, id) in (60_i64..).zip(claim_order) {
        client
            .execute(
                "UPDATE inflight_taskactivations SET status = 'Claimed', \
                   claimed_by = 'broker-a', \
                   claim_expires_at = now() + $2::int8 * interval '1 second' \
                 WHERE id = $1",
                &[&id, &lease_sec],
            )
            .await
            .unwrap();
    }
    silence(&db, "broker-a").await;

    let mut writer = db.client().await;
    let batch = writer.transaction().await.unwrap();
    batch
        .execute(
            "SELECT id FROM inflight_taskactivations WHERE id = 't-0' FOR UPDATE",
            &[],
        )
        .await
        .unwrap();
    let takeover = tokio::spawn({
        let b = Arc::clone(&b);
        async move { b.take_over_silent(TAKEOVER).await }
    });
    wait_for_a_lock_wait(&client, "the takeover waits on the batch's row lock").await;
    let next = batch
        .query(
            "SELECT id FROM inflight_taskactivations WHERE id = 't-3' FOR UPDATE NOWAIT",
            &[],
        )
        .await;
    assert!(
        next.is_ok(),
        "claims made in the order {claim_order:?}: the takeover locked t-3 before t-0: {next:?}"
    );
    batch.commit().await.unwrap();
    let takeovers = takeover.await.unwrap().unwrap();
    assert_eq!(takeovers.len(), 1, "{takeovers:?}");
    assert_eq!(takeovers[0].released, 4);
}

/// The fence: a broker frozen past the takeover timeout resumes holding a
/// claim a peer has since released and claimed again. Its liveness refuses
/// the push (no query), and the fenced writes it could still attempt leave
/// the peer's claim alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_broker_resuming_after_takeover_never_takes_a_reclaimed_row_as_its_own() {
    let db = TestDb::new().await;
    let frozen = postgres_as(&db, "broker-frozen").await;
    let peer = postgres_as(&db, "broker-peer").await;
    let window = TAKEOVER - Duration::from_secs(1);
    let liveness = Liveness::fenced(window);
    let sent = Instant::now();
    frozen.register_broker("f", "one", TAKEOVER).await.unwrap();
    liveness.confirmed(sent);
    peer.register_broker("p", "one", TAKEOVER).await.unwrap();
    insert(frozen.as_ref(), &[row("task")]).await;

    let generation = liveness.current().expect("live after registering");
    let held = frozen
        .claim_for_push(BucketRange::ALL, 1, LEASE)
        .await
        .unwrap()
        .remove(0);
    assert!(liveness.may_push(generation));

    // Frozen: its heartbeat goes stale and the peer takes over.
    silence(&db, "broker-frozen").await;
    let takeovers = peer.take_over_silent(TAKEOVER).await.unwrap();
    assert_eq!(takeovers.len(), 1);
    let reclaimed = peer
        .claim_for_push(BucketRange::ALL, 1, LEASE)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(reclaimed.id, held.id);

    // Resumes: the heartbeat is refused, the generation moves on.
    assert_eq!(
        frozen.heartbeat("one", TAKEOVER).await.unwrap(),
        BeatAnswer::TakenOver
    );
    liveness.taken_over();
    assert!(
        !liveness.may_push(generation),
        "the held claim is not pushed"
    );
    frozen.register_broker("f", "two", TAKEOVER).await.unwrap();
    liveness.confirmed(Instant::now());
    assert!(
        !liveness.may_push(generation),
        "nor after joining again: it belongs to an older generation"
    );
    // What the frozen broker might still write is fenced off.
    assert!(
        frozen
            .mark_processing(std::slice::from_ref(&held.token), Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        frozen
            .release_claims(std::slice::from_ref(&held.token))
            .await
            .unwrap(),
        0
    );
    assert_eq!(frozen.release_previous_claims().await.unwrap(), 0);
    let row = peer.get(&held.id).await.unwrap().unwrap();
    assert_eq!(row.status, ActivationStatus::Claimed);
    assert_eq!(row.claim_expires_at, Some(reclaimed.token.claim_expires_at));
    assert_eq!(
        claimers_pg(&db).await,
        [(held.id.clone(), "broker-peer".to_owned())]
    );
    assert_eq!(
        peer.mark_processing(std::slice::from_ref(&reclaimed.token), Duration::ZERO)
            .await
            .unwrap(),
        vec![held.id.clone()]
    );
}

/// SQLite, single node: only one process opens the file, so at startup
/// every claim in it was left by a process that is gone, whatever id that
/// one had; Processing rows keep their deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sqlite_broker_releases_every_claim_left_in_the_file() {
    let db = TestSqlite::new();
    let first = sqlite_as(&db, "broker-first").await;
    first.register_broker("h", "one", TAKEOVER).await.unwrap();
    insert(first.as_ref(), &rows("t", 4)).await;
    let claimed = first
        .claim_for_push(BucketRange::ALL, 3, LEASE)
        .await
        .unwrap();
    first
        .mark_processing(std::slice::from_ref(&claimed[0].token), Duration::ZERO)
        .await
        .unwrap();
    let deadline = first
        .get(&claimed[0].id)
        .await
        .unwrap()
        .unwrap()
        .processing_deadline;
    drop(first);

    let second = sqlite_as(&db, "broker-second").await;
    let joined = second.register_broker("h", "one", TAKEOVER).await.unwrap();
    assert_eq!(joined.live_peers, 0, "no peer can share an SQLite file");
    assert_eq!(second.release_previous_claims().await.unwrap(), 2);
    for claim in &claimed[1..] {
        assert_eq!(
            status(second.as_ref(), &claim.id).await,
            ActivationStatus::Pending
        );
    }
    let kept = second.get(&claimed[0].id).await.unwrap().unwrap();
    assert_eq!(kept.status, ActivationStatus::Processing);
    assert_eq!(kept.processing_deadline, deadline);
    let brokers: Vec<String> = db.query("SELECT id FROM taskbroker_brokers", |row| row.get(0));
    assert_eq!(brokers, ["broker-second"]);
    // Nothing is silent but the gone broker's row, which registering removed.
    assert!(
        second
            .take_over_silent(Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        second.heartbeat("one", TAKEOVER).await.unwrap(),
        BeatAnswer::Accepted { silent_peers: 0 }
    );
    let row = second.read_broker().await.unwrap().expect("its row");
    assert_eq!(row.incarnation, "one");
    // Registered again by another incarnation: the first one learns it.
    second.register_broker("h", "two", TAKEOVER).await.unwrap();
    assert_eq!(
        second.heartbeat("one", TAKEOVER).await.unwrap(),
        BeatAnswer::Replaced
    );
    assert!(!second.unregister_broker("one").await.unwrap());
    assert!(second.unregister_broker("two").await.unwrap());
    assert_eq!(
        second.heartbeat("two", TAKEOVER).await.unwrap(),
        BeatAnswer::TakenOver
    );
    assert_eq!(second.read_broker().await.unwrap(), None);
}

/// Idle cost: a heartbeat that finds no silent peer runs no takeover
/// statement (one statement per beat); one that counts a silent peer takes
/// it over at once.
#[actix_rt::test]
async fn a_beat_runs_the_takeover_statement_only_when_a_peer_is_silent() {
    let db = TestDb::new().await;
    let me = postgres_as(&db, "broker-me").await;
    let peer = postgres_as(&db, "broker-peer").await;
    for (store, host) in [(&me, "host-me"), (&peer, "host-peer")] {
        store.register_broker(host, "one", TAKEOVER).await.unwrap();
    }
    insert(peer.as_ref(), &rows("silent", 2)).await;
    peer.claim_for_push(BucketRange::ALL, 2, LEASE)
        .await
        .unwrap();
    let metrics = Arc::new(taskbroker::metrics::Metrics::new());
    let handle = common::start_store_actor(me.clone(), Arc::clone(&metrics));
    let config = taskbroker::actors::heartbeat::MembershipConfig {
        broker_id: "broker-me".to_owned(),
        host: "host-me".to_owned(),
        heartbeat_interval: Duration::from_secs(1),
        takeover_timeout: TAKEOVER,
        liveness: Liveness::fenced(TAKEOVER),
    };
    let beat = || taskbroker::actors::heartbeat::beat(&handle, &config, "one", &metrics);

    for _ in 0..3 {
        let outcome = beat().await.unwrap();
        assert!(
            matches!(&outcome, taskbroker::actors::heartbeat::Beat::Alive(taken) if taken.is_empty()),
            "{outcome:?}"
        );
    }
    assert_eq!(metrics.store_calls("heartbeat"), 3);
    assert_eq!(metrics.store_calls("take_over_silent"), 0);

    silence(&db, "broker-peer").await;
    match beat().await.unwrap() {
        taskbroker::actors::heartbeat::Beat::Alive(taken) => {
            assert_eq!(taken.len(), 1);
            assert_eq!(taken[0].broker_id, "broker-peer");
            assert_eq!(taken[0].released, 2);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(metrics.store_calls("take_over_silent"), 1);
}
