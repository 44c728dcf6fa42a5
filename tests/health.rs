//! Health as operators and orchestrators see it: gRPC health, `/health`
//! and `/ready` on the running broker, with the store up and down.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::kafka::MockKafka;
use common::process::broker_command;
use common::{KillOnDrop, TestDb, TestSqlite, http_get, wait_until};
use taskbroker::actors::fetch::StopFetching;
use taskbroker::broker::Broker;
use taskbroker::config::Config;
use taskbroker::metrics::Metrics;
use taskbroker::store::{ActivationStore, PostgresStore, PostgresStoreConfig};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn config(kafka: &MockKafka, database_url: &str) -> Config {
    config_with(kafka, database_url, &[("DELIVERY_MODE", "pull")])
}

fn config_with(kafka: &MockKafka, database_url: &str, extra: &[(&str, &str)]) -> Config {
    let env: HashMap<String, String> = [
        ("DATABASE_URL", database_url.to_owned()),
        ("KAFKA_BROKERS", kafka.bootstrap()),
        ("GRPC_ADDR", "127.0.0.1:0".to_owned()),
        ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
    ]
    .into_iter()
    .chain(
        extra
            .iter()
            .map(|(name, value)| (*name, (*value).to_owned())),
    )
    .map(|(name, value)| (format!("TASKBROKER_{name}"), value))
    .collect();
    Config::from_lookup(|name| env.get(name).cloned()).expect("test configuration")
}

async fn http_status(broker: &Broker, path: &str) -> u16 {
    http_get(broker.metrics_addr, path).await.0
}

async fn grpc_health(broker: &Broker) -> ServingStatus {
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", broker.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    client
        .check(HealthCheckRequest {
            service: "sentry_protos.taskbroker.v1.ConsumerService".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status()
}

#[actix_rt::test]
async fn healthy_broker_is_live_ready_and_serving() {
    let db = TestDb::new().await;
    let store = db.store().await;
    let kafka = MockKafka::start();
    kafka.create_topic("taskworker", 2);
    let broker = Broker::start(
        &config(&kafka, &db.url),
        store,
        Arc::new(Metrics::new()),
        "h",
    )
    .expect("broker starts");
    assert_eq!(http_status(&broker, "/health").await, 200);
    let broker = Arc::new(broker);
    // Ready once the consumer has joined its group.
    wait_until("the broker is ready", Duration::from_secs(30), || {
        let broker = Arc::clone(&broker);
        async move { http_status(&broker, "/ready").await == 200 }
    })
    .await;
    assert_eq!(http_status(&broker, "/metrics").await, 200);
    assert_eq!(grpc_health(&broker).await, ServingStatus::Serving);

    // The container health check: `taskbroker healthcheck` probes the
    // same /health over loopback, and fails on a port nobody serves.
    assert_eq!(healthcheck(broker.metrics_addr.to_string()).await, Some(0));
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    assert_eq!(healthcheck(closed.to_string()).await, Some(1));

    // An orderly stop is not a failure.
    let health = broker.health.clone();
    Arc::into_inner(broker).expect("one owner").stop().await;
    assert_eq!(health.failure(), None);
}

/// A replica restarted in place (same process, same addresses) binds its
/// ports the moment the old one's `stop` returns: the servers have
/// finished and closed their listeners by then, even with a client still
/// connected.
#[actix_rt::test]
async fn stop_frees_the_ports_so_a_replacement_binds_them_at_once() {
    let db = TestDb::new().await;
    let kafka = MockKafka::start();
    kafka.create_topic("taskworker", 2);
    let first = Broker::start(
        &config(&kafka, &db.url),
        db.store().await,
        Arc::new(Metrics::new()),
        "h",
    )
    .expect("broker starts");
    let (grpc_addr, metrics_addr) = (first.grpc_addr, first.metrics_addr);
    // A client keeps its HTTP/2 connection open across the stop.
    let channel = tonic::transport::Channel::from_shared(format!("http://{grpc_addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connects");
    let mut client = HealthClient::new(channel);
    client
        .check(HealthCheckRequest::default())
        .await
        .expect("serving");
    first.stop().await;

    let (grpc, metrics) = (grpc_addr.to_string(), metrics_addr.to_string());
    let replacement = Broker::start(
        &config_with(
            &kafka,
            &db.url,
            &[
                ("DELIVERY_MODE", "pull"),
                ("GRPC_ADDR", &grpc),
                ("METRICS_ADDR", &metrics),
            ],
        ),
        db.store().await,
        Arc::new(Metrics::new()),
        "h",
    )
    .expect("the replacement binds the same addresses");
    assert_eq!(replacement.grpc_addr, grpc_addr);
    assert_eq!(http_status(&replacement, "/health").await, 200);
    assert_eq!(grpc_health(&replacement).await, ServingStatus::Serving);
    replacement.stop().await;
}

#[actix_rt::test]
async fn an_actor_that_stops_on_its_own_fails_health_and_readiness_at_once() {
    let db = TestDb::new().await;
    let kafka = MockKafka::start();
    kafka.create_topic("taskworker", 2);
    let config = config_with(
        &kafka,
        &db.url,
        &[
            ("DELIVERY_MODE", "push"),
            ("WORKER_ENDPOINTS", "*=http://127.0.0.1:1"),
            ("FETCH_ACTORS", "2"),
        ],
    );
    let broker = Broker::start(&config, db.store().await, Arc::new(Metrics::new()), "h")
        .expect("broker starts");
    let broker = Arc::new(broker);
    wait_until("the broker is ready", Duration::from_secs(30), || {
        let broker = Arc::clone(&broker);
        async move { http_status(&broker, "/ready").await == 200 }
    })
    .await;
    assert_eq!(grpc_health(&broker).await, ServingStatus::Serving);

    // A FetchActor stops while the broker is not stopping: nothing else
    // would notice, and its buckets would never be pushed again.
    let fetcher = &broker.pipeline.as_ref().expect("push mode").fetchers[1];
    fetcher.do_send(StopFetching);
    let failure = tokio::time::timeout(Duration::from_secs(10), broker.health.failed())
        .await
        .expect("the supervisor notices the stopped actor");
    assert_eq!(failure, "fetch actor 1 stopped unexpectedly");

    let (status, body) = http_get(broker.metrics_addr, "/ready").await;
    assert_eq!(status, 503);
    assert!(
        body.contains("fetch actor 1 stopped unexpectedly"),
        "{body}"
    );
    assert_eq!(http_status(&broker, "/health").await, 200, "still live");
    wait_for_not_serving(&broker, Duration::from_secs(5)).await;
}

/// `taskbroker run` whose Kafka consumer cannot start (librdkafka refuses its
/// configuration when the consumer is created) exits non-zero on its own and
/// says why, instead of running on without ingesting anything.
#[actix_rt::test]
async fn the_binary_exits_non_zero_when_its_consumer_cannot_start() {
    let kafka = MockKafka::start();
    let sqlite = TestSqlite::new();
    let sqlite_env = ("SQLITE_PATH", sqlite.path.display().to_string());
    let mut broker = broker_command(sqlite_env, &kafka, 0)
        .env("TASKBROKER_DELIVERY_MODE", "pull")
        // Accepted by producers (a consumer-only property), refused by the
        // consumer: max.poll.interval.ms must be at least session.timeout.ms.
        .env("TASKBROKER_KAFKA_CONFIG", "max.poll.interval.ms=1")
        .env("TASKBROKER_LOG", "error")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the broker binary");
    let _leftover = KillOnDrop(vec![broker.id()]);
    let stderr = broker.stderr.take().expect("stderr");
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut { stderr }, &mut text).ok();
            (broker.wait().expect("wait"), text)
        }),
    )
    .await
    .expect("the broker exits on its own")
    .expect("join");
    let (status, stderr) = output;
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("the Kafka consumer of ") && stderr.contains("stopped unexpectedly"),
        "{stderr}"
    );
}

/// Exit code of `taskbroker healthcheck` with `TASKBROKER_METRICS_ADDR`.
async fn healthcheck(metrics_addr: String) -> Option<i32> {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_taskbroker"))
            .arg("healthcheck")
            .env("TASKBROKER_METRICS_ADDR", metrics_addr)
            .output()
            .expect("run taskbroker healthcheck")
            .status
            .code()
    })
    .await
    .unwrap()
}

#[actix_rt::test]
async fn broker_without_its_store_is_live_but_not_ready_nor_serving() {
    let kafka = MockKafka::start();
    let url = "postgres://postgres@127.0.0.1:1/none"; // refuses connections
    let mut store_config = PostgresStoreConfig::new(url);
    store_config.connect_timeout = Duration::from_millis(500);
    let store: Arc<dyn ActivationStore> = Arc::new(PostgresStore::connect(&store_config).unwrap());
    let broker = Broker::start(&config(&kafka, url), store, Arc::new(Metrics::new()), "h")
        .expect("broker starts without its database");
    assert_eq!(http_status(&broker, "/health").await, 200, "still live");
    assert_eq!(http_status(&broker, "/ready").await, 503);
    let broker = Arc::new(broker);
    wait_for_not_serving(&broker, Duration::from_secs(10)).await;
}

async fn wait_for_not_serving(broker: &Arc<Broker>, limit: Duration) {
    wait_until("gRPC health turns NOT_SERVING", limit, || {
        let broker = Arc::clone(broker);
        async move { grpc_health(&broker).await == ServingStatus::NotServing }
    })
    .await;
}
