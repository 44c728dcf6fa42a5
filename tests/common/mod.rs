//! Shared test fixtures: a fresh PostgreSQL database per test, so tests run
//! in parallel without seeing each other's rows.
#![allow(dead_code)]

pub mod kafka;
pub mod process;
pub mod tls;
pub mod worker;

use std::sync::Arc;

use chrono::{DateTime, SubsecRound, Utc};
use prost::Message;
use taskbroker::model::InflightActivation;
use taskbroker::model::{KafkaPosition, inflight_from_record};
use taskbroker::proto::{RetryState, TaskActivation};
use taskbroker::store::{
    ActivationStore, PostgresStore, PostgresStoreConfig, SqliteStore, SqliteStoreConfig,
};

/// Where tests find a PostgreSQL server they may create databases on.
pub fn admin_url() -> String {
    std::env::var("TASKBROKER_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// A database created for one test and dropped when the value is dropped.
pub struct TestDb {
    pub name: String,
    pub url: String,
}

impl TestDb {
    pub async fn new() -> TestDb {
        let name = format!("taskbroker_test_{}", uuid::Uuid::new_v4().simple());
        let admin = admin_client().await;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap_or_else(|err| panic!("cannot create test database {name}: {err}"));
        let url = url_for_database(&admin_url(), &name);
        TestDb { name, url }
    }

    pub fn store_config(&self) -> PostgresStoreConfig {
        PostgresStoreConfig::new(self.url.clone())
    }

    /// A migrated PostgreSQL store on this database.
    pub async fn store(&self) -> Arc<PostgresStore> {
        let store = PostgresStore::connect(&self.store_config()).expect("store config");
        store.migrate().await.expect("migrations apply");
        Arc::new(store)
    }

    /// A plain client on this database, for inspecting rows.
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        admin_execute_from_drop(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        ));
    }
}

/// Runs `sql` on the admin database, ignoring failure, from a `Drop` that
/// runs inside the test's runtime, which cannot be blocked on: on a thread
/// with a runtime of its own.
pub fn admin_execute_from_drop(sql: String) {
    let _ = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("cleanup runtime");
        runtime.block_on(async {
            let admin = admin_client().await;
            let _ = admin.batch_execute(&sql).await;
        });
    })
    .join();
}

/// A SQLite database file of one test's own, removed (with its WAL and
/// shared-memory files) when the value is dropped.
pub struct TestSqlite {
    pub path: std::path::PathBuf,
}

impl TestSqlite {
    pub fn new() -> TestSqlite {
        let path = std::env::temp_dir().join(format!(
            "taskbroker_test_{}.sqlite",
            uuid::Uuid::new_v4().simple()
        ));
        TestSqlite { path }
    }

    pub fn store_config(&self) -> SqliteStoreConfig {
        SqliteStoreConfig::new(self.path.clone())
    }

    /// A migrated SQLite store on this file.
    pub async fn store(&self) -> Arc<SqliteStore> {
        let store = SqliteStore::open(&self.store_config()).expect("open SQLite store");
        store.migrate().await.expect("migrations apply");
        Arc::new(store)
    }
}

impl Drop for TestSqlite {
    fn drop(&mut self) {
        for file in SqliteStore::files(&self.path) {
            let _ = std::fs::remove_file(file);
        }
    }
}

/// Which store a backend-parameterised test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

/// A store of one test's own on either backend, with the inspection
/// queries tests need beyond the store interface.
pub enum TestStore {
    Postgres(TestDb),
    Sqlite(TestSqlite),
}

impl TestStore {
    pub async fn new(backend: Backend) -> TestStore {
        match backend {
            Backend::Postgres => TestStore::Postgres(TestDb::new().await),
            Backend::Sqlite => TestStore::Sqlite(TestSqlite::new()),
        }
    }

    /// A migrated store on this database.
    pub async fn store(&self) -> Arc<dyn ActivationStore> {
        match self {
            TestStore::Postgres(db) => {
                let mut config = db.store_config();
                config.pool_size = 16;
                let store = PostgresStore::connect(&config).expect("store config");
                store.migrate().await.expect("migrations apply");
                Arc::new(store)
            }
            TestStore::Sqlite(db) => db.store().await,
        }
    }

    /// The `TASKBROKER_*` variable (without prefix) that selects this store.
    pub fn env(&self) -> (&'static str, String) {
        match self {
            TestStore::Postgres(db) => ("DATABASE_URL", db.url.clone()),
            TestStore::Sqlite(db) => ("SQLITE_PATH", db.path.display().to_string()),
        }
    }

    /// Claimed rows: (id, claim_expires_at).
    pub async fn claimed(&self) -> Vec<(String, DateTime<Utc>)> {
        match self {
            TestStore::Postgres(db) => db
                .client()
                .await
                .query(
                    "SELECT id, claim_expires_at FROM inflight_taskactivations \
                     WHERE status = 'Claimed'",
                    &[],
                )
                .await
                .expect("read claimed rows")
                .iter()
                .map(|row| (row.get(0), row.get(1)))
                .collect(),
            TestStore::Sqlite(db) => db.query(
                "SELECT id, claim_expires_at FROM inflight_taskactivations \
                 WHERE status = 'Claimed'",
                |row| {
                    let micros: i64 = row.get(1)?;
                    Ok((
                        row.get(0)?,
                        DateTime::from_timestamp_micros(micros).expect("valid timestamp"),
                    ))
                },
            ),
        }
    }

    /// Every row as id → (status, claim_expires_at).
    pub async fn rows(&self) -> std::collections::HashMap<String, (String, Option<DateTime<Utc>>)> {
        const SQL: &str = "SELECT id, status, claim_expires_at FROM inflight_taskactivations";
        match self {
            TestStore::Postgres(db) => db
                .client()
                .await
                .query(SQL, &[])
                .await
                .expect("read rows")
                .iter()
                .map(|row| (row.get(0), (row.get(1), row.get(2))))
                .collect(),
            TestStore::Sqlite(db) => db
                .query(SQL, |row| {
                    let micros: Option<i64> = row.get(2)?;
                    Ok((
                        row.get(0)?,
                        (
                            row.get(1)?,
                            micros.map(|m| DateTime::from_timestamp_micros(m).expect("timestamp")),
                        ),
                    ))
                })
                .into_iter()
                .collect(),
        }
    }

    /// After a broker process died: waits until PostgreSQL has finished
    /// the statements it had sent (its server backends exit once they see
    /// the closed connection). A statement already running when the
    /// process died still commits, so the table is only settled after this.
    pub async fn wait_for_dead_broker_backends(&self) {
        let TestStore::Postgres(db) = self else {
            return; // SQLite dies with the process.
        };
        let admin = connect(&admin_url()).await;
        wait_until(
            "the killed broker's PostgreSQL backends are gone",
            std::time::Duration::from_secs(30),
            || async {
                admin
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity \
                         WHERE datname = $1 AND application_name = 'taskbroker'",
                        &[&db.name],
                    )
                    .await
                    .map(|row| row.get::<_, i64>(0) == 0)
                    .unwrap_or(false)
            },
        )
        .await;
    }

    /// A plain PostgreSQL client, for tests that only run on PostgreSQL.
    pub async fn client(&self) -> tokio_postgres::Client {
        match self {
            TestStore::Postgres(db) => db.client().await,
            TestStore::Sqlite(_) => panic!("this test inspects PostgreSQL only"),
        }
    }

    /// Attempts consumed over all rows.
    pub async fn attempts_consumed(&self) -> i64 {
        const SQL: &str = "SELECT CAST(COALESCE(sum(processing_attempts), 0) AS BIGINT) FROM inflight_taskactivations";
        match self {
            TestStore::Postgres(db) => db
                .client()
                .await
                .query_one(SQL, &[])
                .await
                .expect("sum attempts")
                .get(0),
            TestStore::Sqlite(db) => db.query(SQL, |row| row.get(0))[0],
        }
    }
}

impl TestSqlite {
    /// Runs a read-only query on a connection of its own.
    pub fn query<T>(
        &self,
        sql: &str,
        map: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Vec<T> {
        let connection = rusqlite::Connection::open_with_flags(
            &self.path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .expect("open the test SQLite file");
        let mut statement = connection.prepare(sql).expect("prepare");
        statement
            .query_map([], map)
            .expect("query")
            .collect::<Result<Vec<T>, _>>()
            .expect("rows")
    }
}

/// Runs each named `async fn case(backend: Backend)` as two tests,
/// `case::postgres` and `case::sqlite`.
#[macro_export]
macro_rules! on_both_backends {
    ($($case:ident),* $(,)?) => {
        $(
            mod $case {
                #[actix_rt::test]
                async fn postgres() {
                    super::$case(super::common::Backend::Postgres).await
                }
                #[actix_rt::test]
                async fn sqlite() {
                    super::$case(super::common::Backend::Sqlite).await
                }
            }
        )*
    };
}

pub async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|err| {
            panic!(
                "cannot connect to PostgreSQL at {url}: {err}. \
                 Set TASKBROKER_TEST_DATABASE_URL or run scripts/test."
            )
        });
    tokio::spawn(connection);
    client
}

async fn admin_client() -> tokio_postgres::Client {
    connect(&admin_url()).await
}

/// `admin_url` with its database name replaced.
pub fn url_for_database(admin_url: &str, database: &str) -> String {
    let (base, query) = match admin_url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (admin_url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_part = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{host_part}/{database}?{query}"),
        None => format!("{host_part}/{database}"),
    }
}

/// Now, truncated to the microseconds the databases keep.
pub fn now() -> DateTime<Utc> {
    Utc::now().trunc_subsecs(6)
}

/// A wire activation with sensible test values.
pub fn task(id: &str) -> TaskActivation {
    TaskActivation {
        id: id.to_owned(),
        namespace: "test-ns".to_owned(),
        taskname: "tests.do_work".to_owned(),
        received_at: Some(prost_types::Timestamp {
            seconds: now().timestamp(),
            nanos: 0,
        }),
        retry_state: Some(RetryState {
            attempts: 0,
            max_attempts: 3,
            ..Default::default()
        }),
        processing_deadline_duration: 30,
        application: Some("app".to_owned()),
        ..Default::default()
    }
}

/// The store row for `activation`, as the consumer would build it.
pub fn row_from(activation: &TaskActivation) -> InflightActivation {
    inflight_from_record(
        &activation.encode_to_vec(),
        KafkaPosition {
            topic: "taskworker".to_owned(),
            partition: 0,
            offset: 0,
        },
        now(),
        std::time::Duration::from_secs(3600),
    )
    .expect("valid test activation")
}

/// A Pending row with id `id`.
pub fn row(id: &str) -> InflightActivation {
    row_from(&task(id))
}

/// `n` Pending rows with ids `{prefix}-{i}` and strictly increasing `added_at`.
pub fn rows(prefix: &str, n: usize) -> Vec<InflightActivation> {
    let base = now();
    (0..n)
        .map(|i| {
            let mut row = row(&format!("{prefix}-{i}"));
            row.added_at = base + chrono::TimeDelta::microseconds(i as i64);
            row
        })
        .collect()
}

/// `n` bytes no compression would shrink (splitmix64 from `seed`), so a
/// row or a file holding them is as large as they are.
pub fn incompressible(seed: u64, n: usize) -> Vec<u8> {
    let mut state = seed;
    let mut bytes = Vec::with_capacity(n + 8);
    while bytes.len() < n {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        bytes.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    bytes.truncate(n);
    bytes
}

/// SQL inserting a Retry row `old` as the first schema (V1) knew it, on
/// either backend: `activation` and `at` are that backend's literals for the
/// bytes `0a 03 'old'` and for a timestamp.
pub fn v1_row_sql(activation: &str, at: &str) -> String {
    format!(
        "INSERT INTO inflight_taskactivations (id, activation, topic, partition, kafka_offset, \
         added_at, received_at, processing_deadline_duration, status, namespace, taskname, \
         bucket) VALUES ('old', {activation}, 't', 0, 0, {at}, {at}, 30, 'Retry', 'ns', 'task', 1)"
    )
}

/// The row of [`v1_row_sql`], read back after the migrations: its bytes as
/// stored and no retry edit (the columns V2 added are NULL).
pub async fn assert_v1_row_reads_back_with_no_edit(store: &dyn ActivationStore) {
    let row = store.get("old").await.unwrap().expect("the row is kept");
    assert_eq!(row.activation, b"\x0a\x03old");
    assert_eq!(
        row.retry_edit,
        taskbroker::model::RetryEdit::default(),
        "NULL columns: no edit"
    );
}

pub async fn insert(store: &dyn ActivationStore, rows: &[InflightActivation]) {
    store.insert_batch(rows).await.expect("insert");
}

/// Kills the listed processes when dropped, so a test that fails halfway
/// leaves no broker binary running behind it.
#[derive(Default)]
pub struct KillOnDrop(pub Vec<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in &self.0 {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
}

/// A loopback port nobody listens on right now, for a server the test
/// starts later (a broker binary, a restarted replica), held back from
/// other tests' servers and connections until it is bound.
pub fn free_port() -> u16 {
    taskbroker::net::reserve_loopback_port().expect("a free port")
}

/// Polls `condition` every 20 ms until it holds, failing the test after
/// `limit`: for waiting on a state the system reaches by itself.
pub async fn wait_until<F, Fut>(what: &str, limit: std::time::Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "gave up after {limit:?} waiting until {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Waits until `counter{label}` has counted at least `at_least`, failing the
/// test after `limit`.
pub async fn wait_for_count(
    what: &str,
    limit: std::time::Duration,
    counter: &prometheus::IntCounterVec,
    label: &str,
    at_least: u64,
) {
    wait_until(what, limit, || {
        let counted = counter.with_label_values(&[label]).get();
        async move { counted >= at_least }
    })
    .await;
}

/// Waits until exactly `n` rows of `store` are in `status`, failing the
/// test after `limit`.
pub async fn wait_for_status(
    what: &str,
    limit: std::time::Duration,
    store: &dyn ActivationStore,
    status: taskbroker::model::ActivationStatus,
    n: u64,
) {
    wait_until(what, limit, || async {
        store.count_by_status().await.expect("count").get(status) == n
    })
    .await;
}

/// GET `path` from an HTTP/1 server at `addr`: (status, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("HTTP handshake");
    tokio::spawn(connection);
    let request = http::Request::get(path)
        .header("host", "localhost")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    let response = sender.send_request(request).await.expect("response");
    let status = response.status().as_u16();
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .expect("body")
        .to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A store of one test's own, its StoreActor (on an arbiter of its own) and
/// the metrics that actor counts in: the setup the actor tests' harnesses
/// share. They wrap it and reach its fields through `Deref`.
pub struct StoreFixture {
    pub db: TestStore,
    pub store: Arc<dyn ActivationStore>,
    pub store_actor: taskbroker::actors::StoreHandle,
    pub metrics: Arc<taskbroker::metrics::Metrics>,
}

impl StoreFixture {
    pub async fn on(backend: Backend) -> StoreFixture {
        let db = TestStore::new(backend).await;
        let store = db.store().await;
        let metrics = Arc::new(taskbroker::metrics::Metrics::new());
        let store_actor = start_store_actor(store.clone(), Arc::clone(&metrics));
        StoreFixture {
            db,
            store,
            store_actor,
            metrics,
        }
    }
}

/// A StoreActor on an Arbiter (thread) of its own, as the broker runs it.
pub fn start_store_actor(
    store: Arc<dyn ActivationStore>,
    metrics: Arc<taskbroker::metrics::Metrics>,
) -> taskbroker::actors::StoreHandle {
    taskbroker::actors::StoreHandle::start_in_arbiter(
        &actix::Arbiter::new().handle(),
        store,
        metrics,
        taskbroker::runtime::RuntimeRules::none(),
    )
    .expect("store threads start")
}
