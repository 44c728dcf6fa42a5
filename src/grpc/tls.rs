//! TLS for the broker's gRPC server (`GRPC_TLS_CERT`, `GRPC_TLS_KEY`, and
//! `GRPC_TLS_CLIENT_CA` to require client certificates).
//!
//! The files are read and checked at startup, so a missing or malformed file
//! stops the broker naming its variable. While serving, they are read again
//! every [`RELOAD_INTERVAL`]: when their contents change (cert-manager
//! renewing a Secret, an operator replacing a file), a configuration that
//! loads replaces the current one for every later handshake; connections
//! already open keep theirs. A change that does not load (a key that does
//! not match the certificate, a file caught half written) is logged and
//! counted once, and the previous certificate stays in use.
//!
//! Each accepted connection's handshake runs in a task of its own with a
//! deadline, so a client that connects and sends nothing holds up nobody.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures::Stream;
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::PrivateKeyDer;
use rustls_pki_types::pem::PemObject;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;

use crate::config::ENV_PREFIX;
use crate::metrics::Metrics;
use crate::wire::worker_tls::{certificates, invalid, read};

/// How often the files are checked for changes.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// How long a client has to complete its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Paths of the server's PEM files, as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTlsFiles {
    /// Certificate chain, leaf first (`GRPC_TLS_CERT`).
    pub cert: PathBuf,
    /// Its private key (`GRPC_TLS_KEY`).
    pub key: PathBuf,
    /// CAs client certificates must chain to; when set, clients without
    /// one are refused (`GRPC_TLS_CLIENT_CA`).
    pub client_ca: Option<PathBuf>,
}

/// The contents of the files, as last read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Contents {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl ServerTlsFiles {
    /// From the three optional settings: `None` when TLS is off; an error
    /// when only one of certificate and key is set, or a client CA without
    /// them.
    pub fn from_settings(
        cert: Option<&Path>,
        key: Option<&Path>,
        client_ca: Option<&Path>,
    ) -> Result<Option<ServerTlsFiles>, String> {
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some(ServerTlsFiles {
                cert: cert.to_owned(),
                key: key.to_owned(),
                client_ca: client_ca.map(Path::to_owned),
            })),
            (None, None) if client_ca.is_none() => Ok(None),
            (None, None) => Err(format!(
                "{ENV_PREFIX}GRPC_TLS_CLIENT_CA needs {ENV_PREFIX}GRPC_TLS_CERT and {ENV_PREFIX}GRPC_TLS_KEY"
            )),
            _ => Err(format!(
                "{ENV_PREFIX}GRPC_TLS_CERT and {ENV_PREFIX}GRPC_TLS_KEY must be set together"
            )),
        }
    }

    fn read(&self) -> Result<Contents, String> {
        Ok(Contents {
            cert: read("GRPC_TLS_CERT", &self.cert)?,
            key: read("GRPC_TLS_KEY", &self.key)?,
            client_ca: match &self.client_ca {
                Some(path) => Some(read("GRPC_TLS_CLIENT_CA", path)?),
                None => None,
            },
        })
    }

    /// A server configuration from `contents`; errors name the setting.
    fn configure(&self, contents: &Contents) -> Result<Arc<ServerConfig>, String> {
        let chain = certificates("GRPC_TLS_CERT", &self.cert, &contents.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&contents.key).map_err(|err| {
            invalid(
                "GRPC_TLS_KEY",
                &self.key,
                &format!("holds no PEM private key ({err})"),
            )
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|err| format!("gRPC TLS: {err}"))?;
        let builder = match (&self.client_ca, &contents.client_ca) {
            (Some(path), Some(pem)) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in certificates("GRPC_TLS_CLIENT_CA", path, pem)? {
                    roots.add(cert).map_err(|err| {
                        invalid(
                            "GRPC_TLS_CLIENT_CA",
                            path,
                            &format!("holds a bad CA ({err})"),
                        )
                    })?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|err| {
                            invalid("GRPC_TLS_CLIENT_CA", path, &format!("is unusable ({err})"))
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key).map_err(|err| {
            format!(
                "{ENV_PREFIX}GRPC_TLS_CERT/{ENV_PREFIX}GRPC_TLS_KEY: {} and {} do not make a usable certificate ({err})",
                self.cert.display(),
                self.key.display()
            )
        })?;
        // gRPC is HTTP/2 only.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The server's current TLS configuration, replaced when the files change.
pub struct ServerTls {
    files: ServerTlsFiles,
    current: RwLock<Arc<ServerConfig>>,
    /// What the files held at the last check, loadable or not: a bad
    /// change is reported once, not every second.
    seen: Mutex<Contents>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Loads the files; the error names the setting at fault.
    pub fn load(files: ServerTlsFiles, metrics: Arc<Metrics>) -> Result<ServerTls, String> {
        let contents = files.read()?;
        let config = files.configure(&contents)?;
        metrics.grpc_tls_loaded.set(unix_now());
        Ok(ServerTls {
            files,
            current: RwLock::new(config),
            seen: Mutex::new(contents),
            metrics,
        })
    }

    fn current(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Reads the files once; replaces the configuration when they changed
    /// and load. Returns whether the configuration was replaced.
    pub fn reload_if_changed(&self) -> bool {
        let contents = match self.files.read() {
            Ok(contents) => contents,
            Err(err) => {
                // A file missing for a moment (replaced by delete and
                // create) is not a change yet; a lasting one is logged on
                // every check, at debug level.
                tracing::debug!(error = %err, "gRPC TLS files not readable; keeping the current certificate");
                return false;
            }
        };
        {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if *seen == contents {
                return false;
            }
            seen.clone_from(&contents);
        }
        match self.files.configure(&contents) {
            Ok(config) => {
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = config;
                self.metrics
                    .grpc_tls_reloads
                    .with_label_values(&["ok"])
                    .inc();
                self.metrics.grpc_tls_loaded.set(unix_now());
                tracing::info!(
                    cert = %self.files.cert.display(),
                    "gRPC TLS certificate reloaded"
                );
                true
            }
            Err(err) => {
                self.metrics
                    .grpc_tls_reloads
                    .with_label_values(&["error"])
                    .inc();
                tracing::warn!(error = %err, "gRPC TLS files changed but do not load; keeping the current certificate");
                false
            }
        }
    }

    /// Checks the files every `interval` until the task is aborted.
    pub fn watch(self: Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let tls = Arc::clone(&self);
                // File reads block; keep them off the server's threads.
                let _ = tokio::task::spawn_blocking(move || tls.reload_if_changed()).await;
            }
        })
    }

    /// The TLS connections accepted on `listener`, each after a completed
    /// handshake with the configuration current when it was accepted.
    /// Accepting stops when the stream is dropped.
    pub fn incoming(
        self: Arc<Self>,
        listener: TcpListener,
    ) -> impl Stream<Item = Result<TlsStream<TcpStream>, std::io::Error>> + Send + 'static {
        let (ready, mut streams) = tokio::sync::mpsc::channel::<TlsStream<TcpStream>>(64);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    accepted = listener.accept() => accepted,
                    () = ready.closed() => return,
                };
                let tcp = match accepted {
                    Ok((tcp, _)) => tcp,
                    Err(err) => {
                        // Out of file descriptors and the like: pause
                        // rather than spin on the error.
                        crate::warn_throttled!(error = %err, "gRPC accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = tokio_rustls::TlsAcceptor::from(self.current());
                let ready = ready.clone();
                let metrics = Arc::clone(&self.metrics);
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = ready.send(stream).await;
                        }
                        Ok(Err(err)) => {
                            metrics.grpc_tls_handshake_failures.inc();
                            tracing::debug!(error = %err, "gRPC TLS handshake failed");
                        }
                        Err(_) => {
                            metrics.grpc_tls_handshake_failures.inc();
                            tracing::debug!("gRPC TLS handshake timed out");
                        }
                    }
                });
            }
        });
        futures::stream::poll_fn(move |cx| streams.poll_recv(cx).map(|next| next.map(Ok)))
    }
}

fn unix_now() -> i64 {
    chrono::Utc::now().timestamp()
}
