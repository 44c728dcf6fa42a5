//! Pushing to workers over TLS (issue 15 item 3): real handshakes between the
//! push pool and a tonic WorkerService served with certificates this test
//! generates (a test CA, a server certificate for `localhost`, a client
//! certificate for mTLS). The broker trusts the server only through
//! `WORKER_TLS_CA`, and a server that requires client certificates accepts
//! the broker only when `WORKER_TLS_CERT`/`WORKER_TLS_KEY` are set.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::tls::{Leaf, TestCa};
use common::worker::{CountingHandler, push_config};
use common::{Backend, rows, wait_until};
use rcgen::ExtendedKeyUsagePurpose;
use taskbroker::broker::{PushPipeline, PushPipelineConfig};
use taskbroker::config::WorkerEndpoints;
use taskbroker::metrics::Metrics;
use taskbroker::model::ActivationStatus;
use taskbroker::proto::worker_service_server::WorkerServiceServer;
use taskbroker::wire::worker_tls::WorkerTlsFiles;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

/// The test PKI: a CA of this run (its `ca.pem` on disk), a server
/// certificate for `localhost` and a client certificate for mTLS, written
/// as `client.pem` and `client.key` beside it.
struct Pki {
    ca: TestCa,
    server: Leaf,
}

impl Pki {
    fn generate() -> Pki {
        let ca = TestCa::new("taskbroker worker test CA");
        let server = ca.leaf(&["localhost"], ExtendedKeyUsagePurpose::ServerAuth);
        let client = ca.leaf(&["broker.test"], ExtendedKeyUsagePurpose::ClientAuth);
        ca.write("client.pem", &client.cert_pem);
        ca.write("client.key", &client.key_pem);
        Pki { ca, server }
    }

    fn write(&self, name: &str, text: &str) {
        self.ca.write(name, text);
    }

    fn path(&self, name: &str) -> PathBuf {
        self.ca.path(name)
    }

    fn files(&self, ca: bool, client: bool) -> WorkerTlsFiles {
        WorkerTlsFiles {
            ca: ca.then(|| self.path("ca.pem")),
            cert: client.then(|| self.path("client.pem")),
            key: client.then(|| self.path("client.key")),
        }
    }
}

/// A WorkerService on loopback over TLS; with `require_client_cert`, only
/// clients with a certificate from the test CA get through.
struct TlsWorker {
    url: String,
    handled: Arc<AtomicU64>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl TlsWorker {
    async fn start(pki: &Pki, require_client_cert: bool) -> TlsWorker {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let handled = Arc::new(AtomicU64::new(0));
        let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(
            &pki.server.cert_pem,
            &pki.server.key_pem,
        ));
        if require_client_cert {
            tls = tls.client_ca_root(Certificate::from_pem(pki.ca.pem()));
        }
        let service = WorkerServiceServer::new(CountingHandler {
            handled: Arc::clone(&handled),
        });
        let router = tonic::transport::Server::builder()
            .tls_config(tls)
            .expect("server TLS config")
            .add_service(service);
        let stop = common::worker::serve_until_dropped(router, listener);
        TlsWorker {
            url: format!("https://localhost:{port}"),
            handled,
            _stop: stop,
        }
    }
}

fn config(url: &str, tls: WorkerTlsFiles) -> PushPipelineConfig {
    let mut config = push_config(WorkerEndpoints::parse(&format!("*={url}")).expect("endpoints"));
    config.fetch_actors = 1;
    config.fetch.batch_size = 16;
    config.push.concurrency = 8;
    config.push.queue_size = 16;
    config.push.tls = tls;
    config
}

/// Inserts `n` rows and runs a pipeline against `worker` with `tls` until
/// `pushes_total` has counted, across the `expect` results, every row (when
/// `expect` is `["ok"]`) or at least one failed push; returns the fixture to
/// inspect.
async fn run(
    worker: &TlsWorker,
    tls: WorkerTlsFiles,
    n: usize,
    expect: &[&str],
) -> common::StoreFixture {
    let fixture = common::StoreFixture::on(Backend::Postgres).await;
    fixture
        .store
        .insert_batch(&rows("tls", n))
        .await
        .expect("insert");
    let config = config(&worker.url, tls);
    taskbroker::actors::PushPoolActor::validate(&config.push).expect("valid push config");
    let pipeline = PushPipeline::start(
        config,
        fixture.store_actor.clone(),
        Arc::clone(&fixture.metrics),
    )
    .expect("pipeline starts");
    let wanted = if expect == ["ok"] { n as u64 } else { 1 };
    let pushes = fixture.metrics.pushes.clone();
    wait_until(
        &format!("{wanted} pushes counted as {expect:?}"),
        Duration::from_secs(30),
        || {
            let counted: u64 = expect
                .iter()
                .map(|result| pushes.with_label_values(&[result]).get())
                .sum();
            async move { counted >= wanted }
        },
    )
    .await;
    pipeline.stop().await;
    fixture
}

async fn count(fixture: &common::StoreFixture, status: ActivationStatus) -> u64 {
    fixture
        .store
        .count_by_status()
        .await
        .expect("count")
        .get(status)
}

async fn assert_nothing_delivered(fixture: &common::StoreFixture, worker: &TlsWorker) {
    assert_eq!(
        worker.handled.load(Ordering::SeqCst),
        0,
        "no push got through"
    );
    assert_eq!(Metrics::count(&fixture.metrics.pushes, "ok"), 0);
    assert_eq!(count(fixture, ActivationStatus::Processing).await, 0);
    assert_eq!(
        count(fixture, ActivationStatus::Claimed).await,
        0,
        "claims came back"
    );
}

#[actix_rt::test]
async fn pushes_reach_a_tls_worker_trusted_through_worker_tls_ca() {
    let pki = Pki::generate();
    let worker = TlsWorker::start(&pki, false).await;
    let fixture = run(&worker, pki.files(true, false), 20, &["ok"]).await;
    assert_eq!(worker.handled.load(Ordering::SeqCst), 20);
    assert_eq!(count(&fixture, ActivationStatus::Processing).await, 20);
}

#[actix_rt::test]
async fn pushes_to_a_tls_worker_fail_without_its_ca() {
    let pki = Pki::generate();
    let worker = TlsWorker::start(&pki, false).await;
    let fixture = run(&worker, pki.files(false, false), 5, &["unreachable"]).await;
    assert_nothing_delivered(&fixture, &worker).await;
}

#[actix_rt::test]
async fn mtls_worker_accepts_pushes_only_with_the_client_certificate() {
    let pki = Pki::generate();
    let worker = TlsWorker::start(&pki, true).await;
    let fixture = run(&worker, pki.files(true, true), 10, &["ok"]).await;
    assert_eq!(worker.handled.load(Ordering::SeqCst), 10);
    assert_eq!(count(&fixture, ActivationStatus::Processing).await, 10);

    let worker = TlsWorker::start(&pki, true).await;
    // An untrusted server fails the client's own handshake, so the connection
    // never opens (`unreachable`). A missing client certificate is refused by
    // the server after the client has finished its side of a TLS 1.3
    // handshake, so the refusal may only surface on the first request
    // (`error`); either way nothing is delivered.
    let fixture = run(
        &worker,
        pki.files(true, false),
        5,
        &["unreachable", "error"],
    )
    .await;
    assert_nothing_delivered(&fixture, &worker).await;
}

#[test]
fn unreadable_or_malformed_tls_files_are_errors_naming_the_setting() {
    let pki = Pki::generate();
    let missing = WorkerTlsFiles {
        ca: Some(pki.path("absent.pem")),
        ..Default::default()
    };
    let err = missing.load().unwrap_err();
    assert!(err.contains("TASKBROKER_WORKER_TLS_CA"), "{err}");

    pki.write("garbage.pem", "not a certificate");
    let garbage = WorkerTlsFiles {
        ca: Some(pki.path("garbage.pem")),
        ..Default::default()
    };
    let err = garbage.load().unwrap_err();
    assert!(err.contains("TASKBROKER_WORKER_TLS_CA"), "{err}");

    let bad_key = WorkerTlsFiles {
        cert: Some(pki.path("client.pem")),
        key: Some(pki.path("garbage.pem")),
        ..Default::default()
    };
    let err = bad_key.load().unwrap_err();
    assert!(err.contains("TASKBROKER_WORKER_TLS_KEY"), "{err}");

    let half = WorkerTlsFiles {
        cert: Some(pki.path("client.pem")),
        ..Default::default()
    };
    assert!(half.load().is_err());
    assert!(pki.files(true, true).load().is_ok());
}
