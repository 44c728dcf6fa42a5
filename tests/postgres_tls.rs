//! PostgreSQL over TLS: real handshakes with libpq's `sslmode`s. The local
//! server (ssl = on, its own certificate) serves `require`; for the
//! verifying modes a small TLS-terminating proxy in front of it presents a
//! certificate signed by a CA this test generates.

mod common;

use std::sync::Arc;

use rustls::ServerConfig;
use taskbroker::store::{ActivationStore, PostgresStore, PostgresStoreConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::TestDb;
use common::tls::TestCa;

/// A CA of this test run: `TestCa` with its certificate's file path as
/// `sslrootcert` takes it.
fn new_ca() -> TestCa {
    TestCa::new("taskbroker test CA")
}

fn pem_path(ca: &TestCa) -> String {
    ca.path("ca.pem").display().to_string()
}

/// The real server's address, from the test database URL.
fn upstream() -> String {
    let url = common::admin_url();
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or(&url);
    let host = rest.split(['/', '?']).next().unwrap_or(rest);
    let host = host.rsplit_once('@').map(|(_, h)| h).unwrap_or(host);
    if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:5432")
    }
}

/// Listens on 127.0.0.1; per client reads the SSLRequest, then either
/// answers `S` and terminates TLS (`tls` set) or answers `N`, and forwards
/// the rest to the real server in plaintext. Returns the port.
async fn start_proxy(tls: Option<Arc<ServerConfig>>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let upstream = upstream();
    tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            let tls = tls.clone();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let mut request = [0u8; 8];
                if client.read_exact(&mut request).await.is_err() {
                    return;
                }
                assert_eq!(request, [0, 0, 0, 8, 4, 210, 22, 47], "an SSLRequest");
                let Ok(mut server) = TcpStream::connect(&upstream).await else {
                    return;
                };
                match tls {
                    Some(config) => {
                        if client.write_all(b"S").await.is_err() {
                            return;
                        }
                        let acceptor = tokio_rustls::TlsAcceptor::from(config);
                        // A client that rejects the certificate ends here.
                        let Ok(mut client) = acceptor.accept(client).await else {
                            return;
                        };
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                    None => {
                        if client.write_all(b"N").await.is_err() {
                            return;
                        }
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                }
            });
        }
    });
    port
}

/// `db`'s URL pointed at `port` with `params` appended.
fn url_via(db: &TestDb, port: Option<u16>, params: &str) -> String {
    let mut url = db.url.clone();
    if let Some(port) = port {
        let upstream = upstream();
        url = url.replacen(&upstream, &format!("127.0.0.1:{port}"), 1);
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{params}")
}

async fn round_trip(url: &str) -> Result<(), String> {
    let store =
        PostgresStore::connect(&PostgresStoreConfig::new(url)).map_err(|e| e.to_string())?;
    store.migrate().await.map_err(|e| e.to_string())?;
    store.ping().await.map_err(|e| e.to_string())?;
    let counts = store.count_by_status().await.map_err(|e| e.to_string())?;
    assert_eq!(counts.inflight(), 0);
    Ok(())
}

fn assert_did_not_verify(outcome: Result<(), String>) {
    let err = outcome.expect_err("the certificate must not verify");
    assert!(err.contains("did not verify"), "{err}");
}

#[tokio::test]
async fn require_against_the_local_server_encrypts_and_works() {
    let db = TestDb::new().await;
    round_trip(&url_via(&db, None, "sslmode=require"))
        .await
        .unwrap();
}

#[tokio::test]
async fn verify_full_with_the_test_ca_succeeds() {
    let db = TestDb::new().await;
    let ca = new_ca();
    let port = start_proxy(Some(ca.server_config(&["localhost", "127.0.0.1"], &[]))).await;
    let params = format!("sslmode=verify-full&sslrootcert={}", pem_path(&ca));
    round_trip(&url_via(&db, Some(port), &params))
        .await
        .unwrap();
}

#[tokio::test]
async fn verify_full_with_another_ca_stops_at_migrate() {
    let db = TestDb::new().await;
    let ca = new_ca();
    let other = new_ca();
    let port = start_proxy(Some(ca.server_config(&["localhost", "127.0.0.1"], &[]))).await;
    let params = format!("sslmode=verify-full&sslrootcert={}", pem_path(&other));
    assert_did_not_verify(round_trip(&url_via(&db, Some(port), &params)).await);
    // Without a root certificate the system roots do not know the test CA.
    assert_did_not_verify(round_trip(&url_via(&db, Some(port), "sslmode=verify-ca")).await);
}

#[tokio::test]
async fn a_name_mismatch_fails_verify_full_but_not_verify_ca() {
    let db = TestDb::new().await;
    let ca = new_ca();
    let port = start_proxy(Some(ca.server_config(&["db.example.invalid"], &[]))).await;
    let full = format!("sslmode=verify-full&sslrootcert={}", pem_path(&ca));
    assert_did_not_verify(round_trip(&url_via(&db, Some(port), &full)).await);
    let ca_only = format!("sslmode=verify-ca&sslrootcert={}", pem_path(&ca));
    round_trip(&url_via(&db, Some(port), &ca_only))
        .await
        .unwrap();
}

#[tokio::test]
async fn disable_connects_in_plaintext() {
    let db = TestDb::new().await;
    round_trip(&url_via(&db, None, "sslmode=disable"))
        .await
        .unwrap();
}

#[tokio::test]
async fn prefer_falls_back_to_plaintext_when_the_server_refuses_ssl() {
    let db = TestDb::new().await;
    let port = start_proxy(None).await;
    round_trip(&url_via(&db, Some(port), "sslmode=prefer"))
        .await
        .unwrap();
    // prefer is the default.
    round_trip(&url_via(&db, Some(port), "application_name=tls-test"))
        .await
        .unwrap();
    // require does not fall back.
    assert!(
        round_trip(&url_via(&db, Some(port), "sslmode=require"))
            .await
            .is_err()
    );
}

#[tokio::test]
async fn bad_tls_settings_are_configuration_errors_naming_the_variable() {
    for params in [
        "sslmode=verify-everything",
        "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
    ] {
        let url = format!("postgres://postgres@127.0.0.1:5432/postgres?{params}");
        let err = PostgresStore::connect(&PostgresStoreConfig::new(url))
            .err()
            .expect("a configuration error");
        let message = err.to_string();
        assert!(message.contains("TASKBROKER_DATABASE_URL"), "{message}");
    }
}
