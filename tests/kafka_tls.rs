//! Kafka over TLS and SASL (issue 15 item 1). librdkafka's mock cluster
//! speaks plaintext only, so a TLS-terminating proxy stands in front of it
//! with a certificate from a CA this test generates, and the mock broker
//! advertises the proxy's address: every connection of every client (the
//! broker's consumer, its retry and dead-letter producers, the test's own
//! producer and reader) is a real TLS handshake. The mock cluster has no
//! SASL handler, so SASL is shown by what the build of librdkafka offers and
//! by clients created with SASL_SSL and SCRAM settings.

mod common;

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::Arc;
use std::time::Duration;

use common::tls::{TestCa, TlsProxy};
use common::worker::scenario::Kind;
use common::worker::{FakeWorker, Mode};
use common::{Backend, TestStore, wait_until};
use prost::Message as _;
use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{BaseProducer, FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;
use taskbroker::broker::Broker;
use taskbroker::config::Config;
use taskbroker::kafka::KafkaSettings;
use taskbroker::metrics::Metrics;

const DLQ_TOPIC: &str = "tls-dlq";

/// A one-broker mock cluster reachable only through a TLS proxy.
struct TlsKafka {
    /// Owns the mock cluster (`test.mock.num.brokers`).
    owner: BaseProducer,
    ca: TestCa,
    proxy: TlsProxy,
}

impl TlsKafka {
    async fn start() -> TlsKafka {
        let owner: BaseProducer = ClientConfig::new()
            .set("test.mock.num.brokers", "1")
            .create()
            .expect("mock cluster");
        let plaintext = {
            let cluster = owner.client().mock_cluster().expect("a mock cluster");
            for topic in ["tasks", DLQ_TOPIC] {
                cluster.create_topic(topic, 2, 1).expect("create topic");
            }
            cluster.bootstrap_servers()
        };
        let ca = TestCa::new("kafka test CA");
        let proxy = TlsProxy::start(ca.server_config(&["localhost"], &[]), plaintext).await;
        let host = CString::new("localhost").unwrap();
        // SAFETY: the mock cluster lives as long as `owner`, and librdkafka
        // copies the host name.
        unsafe {
            let handle =
                rdkafka::bindings::rd_kafka_handle_mock_cluster(owner.client().native_ptr());
            assert!(!handle.is_null());
            rdkafka::bindings::rd_kafka_mock_broker_set_host_port(
                handle,
                1,
                host.as_ptr(),
                i32::from(proxy.port),
            );
        }
        TlsKafka { owner, ca, proxy }
    }

    fn bootstrap(&self) -> String {
        format!("localhost:{}", self.proxy.port)
    }

    /// `KAFKA_CONFIG` for TLS, trusting the test CA when `trust` is set
    /// (else the system's bundle, which does not hold it).
    fn tls_properties(&self, trust: bool) -> Vec<(String, String)> {
        let mut properties = vec![
            ("security.protocol".to_owned(), "SSL".to_owned()),
            ("broker.address.family".to_owned(), "v4".to_owned()),
        ];
        if trust {
            properties.push((
                "ssl.ca.location".to_owned(),
                self.ca.path("ca.pem").to_string_lossy().into_owned(),
            ));
        }
        properties
    }

    fn client(&self) -> ClientConfig {
        let mut client = ClientConfig::new();
        client.set("bootstrap.servers", self.bootstrap());
        for (key, value) in self.tls_properties(true) {
            client.set(key, value);
        }
        client
    }

    async fn produce(&self, activations: &[taskbroker::proto::TaskActivation]) {
        let producer: FutureProducer = self
            .client()
            .set("message.timeout.ms", "10000")
            .create()
            .expect("producer");
        for activation in activations {
            producer
                .send(
                    FutureRecord::to("tasks")
                        .key(&activation.id)
                        .payload(&activation.encode_to_vec()),
                    Timeout::After(Duration::from_secs(10)),
                )
                .await
                .map_err(|(err, _)| err)
                .expect("produce over TLS");
        }
    }

    /// Ids of the first `count` activations on `topic`, read over TLS.
    async fn read_ids(&self, topic: &str, count: usize) -> Vec<String> {
        let consumer: StreamConsumer = self
            .client()
            .set("group.id", format!("reader-{}", uuid::Uuid::new_v4()))
            .set("auto.offset.reset", "earliest")
            .create()
            .expect("reader");
        consumer.subscribe(&[topic]).expect("subscribe");
        let mut ids = Vec::new();
        while ids.len() < count {
            let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
                .await
                .expect("a record in time")
                .expect("a record");
            let activation = taskbroker::proto::TaskActivation::decode(message.payload().unwrap())
                .expect("an activation");
            ids.push(activation.id);
        }
        ids
    }
}

fn broker_config(
    kafka: &TlsKafka,
    db: &TestStore,
    worker_url: &str,
    properties: &[(String, String)],
) -> Config {
    let grpc_port = common::free_port();
    let kafka_config = properties
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(",");
    let env: HashMap<String, String> = [
        db.env(),
        ("KAFKA_BROKERS", kafka.bootstrap()),
        ("KAFKA_CONFIG", kafka_config),
        ("KAFKA_TOPIC", "tasks".to_owned()),
        ("KAFKA_DLQ_TOPIC", DLQ_TOPIC.to_owned()),
        ("WORKER_ENDPOINTS", format!("*={worker_url}")),
        ("GRPC_ADDR", format!("127.0.0.1:{grpc_port}")),
        ("GRPC_ADVERTISED_ADDR", format!("127.0.0.1:{grpc_port}")),
        ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
        ("UPKEEP_INTERVAL_MS", "100".to_owned()),
        ("RESTART_GRACE_SEC", "0".to_owned()),
    ]
    .into_iter()
    .map(|(name, value)| (format!("TASKBROKER_{name}"), value))
    .collect();
    Config::from_lookup(|name| env.get(name).cloned()).expect("test configuration")
}

/// Retries go back through the main topic twice and dead letters to the
/// DLQ topic: the consumer and both producers work over TLS.
#[actix_rt::test]
async fn consumer_and_producers_work_over_tls() {
    let mut kafka = TlsKafka::start().await;
    let db = TestStore::new(Backend::Sqlite).await;
    let worker = FakeWorker::start(Mode::Execute {
        delay: Duration::ZERO,
    })
    .await;
    let store = db.store().await;
    let config = broker_config(&kafka, &db, &worker.url(), &kafka.tls_properties(true));
    let broker = Broker::start(&config, store, Arc::new(Metrics::new()), "test-host")
        .expect("broker starts over TLS");

    let now = chrono::Utc::now();
    let retried: Vec<_> = (0..5)
        .map(|i| Kind::Retry.activation(&format!("tls-retry-{i}"), now))
        .collect();
    let failed: Vec<_> = (0..5)
        .map(|i| Kind::Fail.activation(&format!("tls-fail-{i}"), now))
        .collect();
    kafka.produce(&retried).await;
    kafka.produce(&failed).await;

    let mut dead = kafka.read_ids(DLQ_TOPIC, failed.len()).await;
    dead.sort();
    let mut expected: Vec<String> = failed.iter().map(|a| a.id.clone()).collect();
    expected.sort();
    assert_eq!(dead, expected, "dead letters published over TLS");

    // Each retried task is reported RETRY twice, each time republished
    // (with a new id) to "tasks" by the retry producer and consumed again,
    // then completes: three pushes per retried task, one per failed one.
    let expected_pushes = retried.len() * 3 + failed.len();
    wait_until(
        "every retry consumed and pushed",
        Duration::from_secs(60),
        || {
            let pushed = worker.seen.accepted().len();
            async move { pushed >= expected_pushes }
        },
    )
    .await;
    broker.stop().await;

    let mut outcomes = Vec::new();
    while let Ok(outcome) = kafka.proxy.handshakes.try_recv() {
        outcomes.push(outcome);
    }
    // The only failures are the mock cluster's own client, which follows
    // the advertised address in plaintext: no TLS client refused the
    // certificate.
    assert!(outcomes.iter().filter(|o| o.is_ok()).count() >= 3);
    assert!(
        outcomes.iter().all(|o| o
            .as_ref()
            .map_or_else(|e| e.contains("InvalidContentType"), |_| true)),
        "handshakes: {outcomes:?}"
    );
    drop(kafka.owner);
}

/// With TLS on and no CA named, the test CA is not trusted (the clients use
/// the system's bundle): the handshake fails at the client and nothing is
/// consumed.
#[actix_rt::test]
async fn a_broker_that_does_not_trust_the_certificate_consumes_nothing() {
    let mut kafka = TlsKafka::start().await;
    let db = TestStore::new(Backend::Sqlite).await;
    let store = db.store().await;
    let worker = FakeWorker::start(Mode::accept()).await;
    kafka
        .produce(&[Kind::Complete.activation("untrusted-1", chrono::Utc::now())])
        .await;
    // The test's producer connected with the CA: drain its handshakes.
    while kafka.proxy.handshakes.try_recv().is_ok() {}

    let config = broker_config(&kafka, &db, &worker.url(), &kafka.tls_properties(false));
    let broker = Broker::start(
        &config,
        store.clone(),
        Arc::new(Metrics::new()),
        "test-host",
    )
    .expect("the broker starts; connections fail later");
    // Skipping the mock cluster's own plaintext connections, the broker's
    // clients end their handshakes with an alert: they refused the
    // certificate.
    let mut refused = 0;
    while refused < 2 {
        match kafka.proxy.next_handshake(Duration::from_secs(30)).await {
            Err(err) if err.contains("InvalidContentType") => {}
            Err(err) => {
                assert!(err.contains("alert"), "{err}");
                refused += 1;
            }
            Ok(()) => panic!("an untrusted certificate was accepted"),
        }
    }
    let counts = store.count_by_status().await.unwrap();
    assert_eq!(counts.by_status().map(|(_, n)| n).sum::<u64>(), 0);
    assert!(worker.seen.accepted().is_empty());
    broker.stop().await;
}

/// This build of librdkafka has TLS and the SASL mechanisms managed Kafka
/// services use, and accepts a SASL_SSL/SCRAM configuration for the
/// broker's consumer and producers (a build without them refuses these
/// properties when the client is created).
#[tokio::test]
async fn librdkafka_is_built_with_tls_and_sasl() {
    let native = ClientConfig::new()
        .create_native_config()
        .expect("native config");
    let features = native.get("builtin.features").expect("builtin.features");
    let features: Vec<&str> = features.split(',').collect();
    for wanted in ["ssl", "sasl_plain", "sasl_scram", "sasl_oauthbearer"] {
        assert!(features.contains(&wanted), "{wanted} in {features:?}");
    }

    for mechanism in ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] {
        let settings = KafkaSettings {
            brokers: "localhost:9093".to_owned(),
            properties: [
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanism", mechanism),
                ("sasl.username", "user"),
                ("sasl.password", "secret"),
            ]
            .into_iter()
            .map(|(key, value)| (key.to_owned(), value.to_owned()))
            .collect(),
            max_activation_bytes: 1 << 20,
        };
        let consumer: Result<StreamConsumer, _> = settings.consumer("group", "earliest").create();
        assert!(consumer.is_ok(), "{mechanism}: {:?}", consumer.err());
        let producer: Result<FutureProducer, _> =
            settings.producer(Duration::from_secs(5)).create();
        assert!(producer.is_ok(), "{mechanism}: {:?}", producer.err());
    }
}
