//! Health as operators and orchestrators see it: gRPC health, `/health`
//! and `/ready` on the running broker, with the store up and down.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::kafka::MockKafka;
use common::{TestDb, http_get, wait_until};
use taskbroker::broker::Broker;
use taskbroker::config::Config;
use taskbroker::metrics::Metrics;
use taskbroker::store::{ActivationStore, PostgresStore, PostgresStoreConfig};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn config(kafka: &MockKafka, database_url: &str) -> Config {
    let env: HashMap<String, String> = [
        ("DATABASE_URL", database_url.to_owned()),
        ("DELIVERY_MODE", "pull".to_owned()),
        ("KAFKA_BROKERS", kafka.bootstrap()),
        ("GRPC_ADDR", "127.0.0.1:0".to_owned()),
        ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
    ]
    .into_iter()
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
    wait_until(
        "gRPC health turns NOT_SERVING",
        Duration::from_secs(10),
        || {
            let broker = Arc::clone(&broker);
            async move { grpc_health(&broker).await == ServingStatus::NotServing }
        },
    )
    .await;
}
