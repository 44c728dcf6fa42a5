//! The broker's gRPC server over TLS (issue 15 item 4): the whole broker
//! (Broker::start) serving with certificates this test generates; real
//! tonic clients and raw rustls handshakes on loopback.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::kafka::MockKafka;
use common::tls::{Leaf, TestCa};
use common::{Backend, TestStore, wait_until};
use rcgen::ExtendedKeyUsagePurpose;
use rustls::pki_types::{CertificateDer, ServerName};
use taskbroker::broker::Broker;
use taskbroker::config::Config;
use taskbroker::grpc::tls::{ServerTls, ServerTlsFiles};
use taskbroker::metrics::Metrics;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

struct TlsBroker {
    broker: Broker,
    metrics: Arc<Metrics>,
    _kafka: MockKafka,
    _db: TestStore,
}

/// Writes `leaf` as `server.pem`/`server.key` by rename, as cert-manager's
/// atomic Secret updates do.
fn install(ca: &TestCa, leaf: &Leaf) {
    for (name, text) in [
        ("server.key", &leaf.key_pem),
        ("server.pem", &leaf.cert_pem),
    ] {
        let staged = ca.write(&format!("{name}.new"), text);
        std::fs::rename(staged, ca.path(name)).unwrap();
    }
}

fn server_leaf(ca: &TestCa) -> Leaf {
    ca.leaf(&["localhost"], ExtendedKeyUsagePurpose::ServerAuth)
}

async fn start(ca: &TestCa, client_ca: bool) -> TlsBroker {
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 1);
    let db = TestStore::new(Backend::Sqlite).await;
    let store = db.store().await;
    let path = |name: &str| ca.path(name).to_string_lossy().into_owned();
    let mut env: HashMap<String, String> = [
        db.env(),
        ("KAFKA_BROKERS", kafka.bootstrap()),
        ("KAFKA_TOPIC", "tasks".to_owned()),
        ("DELIVERY_MODE", "pull".to_owned()),
        ("GRPC_ADDR", "127.0.0.1:0".to_owned()),
        ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
        ("GRPC_TLS_CERT", path("server.pem")),
        ("GRPC_TLS_KEY", path("server.key")),
    ]
    .into_iter()
    .map(|(name, value)| (format!("TASKBROKER_{name}"), value))
    .collect();
    if client_ca {
        env.insert("TASKBROKER_GRPC_TLS_CLIENT_CA".to_owned(), path("ca.pem"));
    }
    let config = Config::from_lookup(|name| env.get(name).cloned()).expect("test configuration");
    let metrics = Arc::new(Metrics::new());
    let broker = Broker::start(&config, store, Arc::clone(&metrics), "test-host")
        .expect("broker starts with TLS");
    TlsBroker {
        broker,
        metrics,
        _kafka: kafka,
        _db: db,
    }
}

fn endpoint(broker: &TlsBroker, scheme: &str) -> Endpoint {
    Channel::from_shared(format!(
        "{scheme}://localhost:{}",
        broker.broker.grpc_addr.port()
    ))
    .unwrap()
    .connect_timeout(Duration::from_secs(5))
    .timeout(Duration::from_secs(5))
}

/// grpc.health.v1 Check over TLS trusting `ca`, with `identity` if given.
async fn health(
    broker: &TlsBroker,
    ca: &TestCa,
    identity: Option<&Leaf>,
) -> Result<ServingStatus, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.pem()))
        .domain_name("localhost");
    if let Some(leaf) = identity {
        tls = tls.identity(Identity::from_pem(&leaf.cert_pem, &leaf.key_pem));
    }
    let endpoint = endpoint(broker, "https").tls_config(tls).unwrap();
    check(endpoint).await
}

async fn check(endpoint: Endpoint) -> Result<ServingStatus, String> {
    let channel = endpoint.connect().await.map_err(|err| format!("{err:?}"))?;
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map_err(|status| format!("{status:?}"))?;
    Ok(response.into_inner().status())
}

/// The certificate the server presents to a plain rustls client.
async fn served_certificate(broker: &TlsBroker, ca: &TestCa) -> CertificateDer<'static> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(broker.broker.grpc_addr)
        .await
        .unwrap();
    let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("handshake");
    stream.get_ref().1.peer_certificates().unwrap()[0].clone()
}

#[actix_rt::test]
async fn health_and_the_consumer_service_answer_over_tls_and_plaintext_is_refused() {
    let ca = TestCa::new("grpc test CA");
    install(&ca, &server_leaf(&ca));
    let broker = start(&ca, false).await;

    assert_eq!(health(&broker, &ca, None).await, Ok(ServingStatus::Serving));

    // A ConsumerService call goes through TLS to the service itself.
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.pem()))
        .domain_name("localhost");
    let channel = endpoint(&broker, "https")
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let answer = taskbroker::proto::consumer_service_client::ConsumerServiceClient::new(channel)
        .get_task(taskbroker::proto::GetTaskRequest::default())
        .await;
    match answer {
        Ok(_) => {}
        Err(status) => assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}"),
    }

    // A plaintext client never gets an answer.
    let plaintext = check(endpoint(&broker, "http")).await;
    assert!(plaintext.is_err(), "{plaintext:?}");
    // Nor does a client that does not trust the server's CA.
    let other = TestCa::new("another CA");
    assert!(health(&broker, &other, None).await.is_err());
    broker.broker.stop().await;
}

#[actix_rt::test]
async fn with_a_client_ca_only_clients_with_its_certificates_get_through() {
    let ca = TestCa::new("grpc test CA");
    install(&ca, &server_leaf(&ca));
    let broker = start(&ca, true).await;

    let refused = health(&broker, &ca, None).await;
    assert!(refused.is_err(), "no client certificate: {refused:?}");
    let stranger =
        TestCa::new("stranger CA").leaf(&["intruder"], ExtendedKeyUsagePurpose::ClientAuth);
    assert!(health(&broker, &ca, Some(&stranger)).await.is_err());

    let client = ca.leaf(&["worker.test"], ExtendedKeyUsagePurpose::ClientAuth);
    assert_eq!(
        health(&broker, &ca, Some(&client)).await,
        Ok(ServingStatus::Serving)
    );
    assert!(broker.metrics.grpc_tls_handshake_failures.get() >= 2);
    broker.broker.stop().await;
}

#[actix_rt::test]
async fn a_renewed_certificate_is_served_without_a_restart_and_a_broken_one_is_not() {
    let ca = TestCa::new("grpc test CA");
    let first = server_leaf(&ca);
    install(&ca, &first);
    let broker = start(&ca, false).await;
    assert_eq!(served_certificate(&broker, &ca).await, first.cert_der);

    // A certificate file that does not parse: counted, and the first
    // certificate is still served.
    let staged = ca.write(
        "server.pem.new",
        "-----BEGIN CERTIFICATE-----\nnot base64\n",
    );
    std::fs::rename(staged, ca.path("server.pem")).unwrap();
    let errors = broker
        .metrics
        .grpc_tls_reloads
        .with_label_values(&["error"]);
    wait_until(
        "the broken file is noticed",
        Duration::from_secs(10),
        || {
            let seen = errors.get();
            async move { seen >= 1 }
        },
    )
    .await;
    assert_eq!(served_certificate(&broker, &ca).await, first.cert_der);
    assert_eq!(health(&broker, &ca, None).await, Ok(ServingStatus::Serving));

    // The renewed pair replaces it for new connections.
    let renewed = server_leaf(&ca);
    install(&ca, &renewed);
    wait_until(
        "the renewed certificate is served",
        Duration::from_secs(10),
        || {
            let broker = &broker;
            let ca = &ca;
            let renewed = renewed.cert_der.clone();
            async move { served_certificate(broker, ca).await == renewed }
        },
    )
    .await;
    assert!(
        broker
            .metrics
            .grpc_tls_reloads
            .with_label_values(&["ok"])
            .get()
            >= 1
    );
    assert_eq!(health(&broker, &ca, None).await, Ok(ServingStatus::Serving));
    broker.broker.stop().await;
}

fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<ServerTls, String> {
    let files = ServerTlsFiles::from_settings(Some(cert), Some(key), client_ca)?.unwrap();
    ServerTls::load(files, Arc::new(Metrics::new()))
}

#[test]
fn bad_tls_settings_stop_startup_naming_the_variable() {
    let ca = TestCa::new("grpc test CA");
    let leaf = server_leaf(&ca);
    let cert = ca.write("server.pem", &leaf.cert_pem);
    let key = ca.write("server.key", &leaf.key_pem);
    assert!(load(&cert, &key, None).is_ok());

    let half = ServerTlsFiles::from_settings(Some(&cert), None, None).unwrap_err();
    assert!(
        half.contains("TASKBROKER_GRPC_TLS_CERT and TASKBROKER_GRPC_TLS_KEY"),
        "{half}"
    );
    let ca_alone = ServerTlsFiles::from_settings(None, None, Some(&cert)).unwrap_err();
    assert!(
        ca_alone.contains("TASKBROKER_GRPC_TLS_CLIENT_CA"),
        "{ca_alone}"
    );

    let missing = ca.path("missing.pem");
    let err = load(&missing, &key, None).unwrap_err();
    assert!(
        err.starts_with("TASKBROKER_GRPC_TLS_CERT: cannot read"),
        "{err}"
    );
    let garbage = ca.write("garbage.pem", "not a certificate");
    let err = load(&garbage, &key, None).unwrap_err();
    assert!(err.starts_with("TASKBROKER_GRPC_TLS_CERT:"), "{err}");
    let err = load(&cert, &garbage, None).unwrap_err();
    assert!(err.starts_with("TASKBROKER_GRPC_TLS_KEY:"), "{err}");
    let err = load(&cert, &key, Some(&garbage)).unwrap_err();
    assert!(err.starts_with("TASKBROKER_GRPC_TLS_CLIENT_CA:"), "{err}");

    // A key that belongs to another certificate.
    let other = server_leaf(&ca);
    let other_key = ca.write("other.key", &other.key_pem);
    let err = load(&cert, &other_key, None).unwrap_err();
    assert!(err.contains("do not make a usable certificate"), "{err}");
}
