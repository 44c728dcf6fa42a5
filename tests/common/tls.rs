//! A test PKI (a CA this test run generates, leaf certificates it signs,
//! PEM files in a scratch directory) and a TLS-terminating TCP proxy, for
//! the tests that need real handshakes.

use std::path::PathBuf;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use rustls::ServerConfig;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// A certificate authority, with a scratch directory for PEM files that is
/// removed when the CA is dropped.
pub struct TestCa {
    cert: rcgen::Certificate,
    issuer: Issuer<'static, KeyPair>,
    pub dir: PathBuf,
}

/// A leaf certificate and its key.
pub struct Leaf {
    pub cert_der: CertificateDer<'static>,
    pub cert_pem: String,
    pub key_pem: String,
    key_der: Vec<u8>,
}

impl TestCa {
    /// A new CA named `name`; its certificate is written to `ca.pem`.
    pub fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        let dir = std::env::temp_dir().join(format!("taskbroker-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = TestCa {
            cert,
            issuer: Issuer::new(params, key),
            dir,
        };
        ca.write("ca.pem", &ca.pem());
        ca
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    pub fn der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// Where `name` lives in the scratch directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// A certificate for `names` (DNS names or IP addresses) for `usage`.
    pub fn leaf(&self, names: &[&str], usage: ExtendedKeyUsagePurpose) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_der: cert.der().clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            key_der: key.serialize_der(),
        }
    }

    /// A rustls server configuration presenting a certificate for `names`,
    /// with the CA in its chain, speaking `alpn` if given.
    pub fn server_config(&self, names: &[&str], alpn: &[&[u8]]) -> Arc<ServerConfig> {
        let leaf = self.leaf(names, ExtendedKeyUsagePurpose::ServerAuth);
        let chain = vec![leaf.cert_der.clone(), self.der()];
        let mut config =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(chain, leaf.private_key())
                .unwrap();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }
}

impl Leaf {
    pub fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A TCP proxy on 127.0.0.1 that terminates TLS with `config` and forwards
/// the plaintext to `upstream`. Every handshake's outcome is sent on
/// `handshakes` (`Err` with rustls's reason when the client gave up), so a
/// test can await a refused handshake instead of waiting for a timeout.
pub struct TlsProxy {
    pub port: u16,
    pub handshakes: mpsc::UnboundedReceiver<Result<(), String>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TlsProxy {
    /// Runs on a thread and runtime of its own, so clients that block
    /// their caller's thread (librdkafka's, when they are destroyed) never
    /// stall the proxy they are talking through.
    pub async fn start(config: Arc<ServerConfig>, upstream: String) -> TlsProxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (events, handshakes) = mpsc::unbounded_channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = TcpListener::from_std(listener).unwrap();
                let serve = async move {
                    while let Ok((client, _)) = listener.accept().await {
                        let acceptor = acceptor.clone();
                        let upstream = upstream.clone();
                        let events = events.clone();
                        tokio::spawn(async move {
                            let mut client = match acceptor.accept(client).await {
                                Ok(client) => {
                                    let _ = events.send(Ok(()));
                                    client
                                }
                                Err(err) => {
                                    let _ = events.send(Err(err.to_string()));
                                    return;
                                }
                            };
                            let Ok(mut server) = TcpStream::connect(&upstream).await else {
                                return;
                            };
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        });
                    }
                };
                tokio::select! {
                    () = serve => {}
                    _ = stopped => {}
                }
            });
        });
        TlsProxy {
            port,
            handshakes,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// The next handshake's outcome, failing the test after `limit`.
    pub async fn next_handshake(&mut self, limit: std::time::Duration) -> Result<(), String> {
        tokio::time::timeout(limit, self.handshakes.recv())
            .await
            .expect("a TLS handshake at the proxy in time")
            .expect("the proxy runs")
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
