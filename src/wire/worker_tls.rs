//! TLS for the PushTask client: what `https://` worker URLs connect with.
//!
//! The broker verifies workers against the system's roots plus an optional
//! CA bundle (`WORKER_TLS_CA`), and presents a client certificate for mTLS
//! when `WORKER_TLS_CERT` and `WORKER_TLS_KEY` are set. The files are read
//! and parsed once, when the push pool is checked at startup, so a missing
//! or malformed file stops the broker with the variable it came from rather
//! than failing every push later.

use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use crate::config::ENV_PREFIX;

/// Paths of the PEM files the TLS client uses, as configured.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerTlsFiles {
    /// Extra trusted roots (`WORKER_TLS_CA`), besides the system's.
    pub ca: Option<PathBuf>,
    /// Client certificate chain for mTLS (`WORKER_TLS_CERT`).
    pub cert: Option<PathBuf>,
    /// Its private key (`WORKER_TLS_KEY`).
    pub key: Option<PathBuf>,
}

impl WorkerTlsFiles {
    /// Reads and checks the files: the TLS settings of every `https://`
    /// channel. Errors name the setting whose file is wrong.
    pub fn load(&self) -> Result<ClientTlsConfig, String> {
        let mut tls = ClientTlsConfig::new().with_native_roots();
        if let Some(path) = &self.ca {
            let pem = read("WORKER_TLS_CA", path)?;
            certificates("WORKER_TLS_CA", path, &pem)?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        match (&self.cert, &self.key) {
            (None, None) => {}
            (Some(cert_path), Some(key_path)) => {
                let cert = read("WORKER_TLS_CERT", cert_path)?;
                certificates("WORKER_TLS_CERT", cert_path, &cert)?;
                let key = read("WORKER_TLS_KEY", key_path)?;
                PrivateKeyDer::from_pem_slice(&key).map_err(|err| {
                    invalid(
                        "WORKER_TLS_KEY",
                        key_path,
                        &format!("holds no PEM private key ({err})"),
                    )
                })?;
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(format!(
                    "{ENV_PREFIX}WORKER_TLS_CERT and {ENV_PREFIX}WORKER_TLS_KEY must be set together"
                ));
            }
        }
        Ok(tls)
    }
}

pub(crate) fn read(setting: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|err| {
        format!(
            "{ENV_PREFIX}{setting}: cannot read {}: {err}",
            path.display()
        )
    })
}

/// Every certificate in `pem`; an error naming `setting` when one does
/// not parse or there is none. Shared with the gRPC server's TLS files.
pub(crate) fn certificates(
    setting: &str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| invalid(setting, path, &format!("is not valid PEM ({err})")))?;
    if certs.is_empty() {
        return Err(invalid(setting, path, "holds no PEM certificate"));
    }
    Ok(certs)
}

pub(crate) fn invalid(setting: &str, path: &Path, why: &str) -> String {
    format!("{ENV_PREFIX}{setting}: {} {why}", path.display())
}
