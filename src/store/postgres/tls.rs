//! PostgreSQL over TLS with rustls, following libpq's `sslmode` and
//! `sslrootcert` conventions in the connection URL. tokio-postgres only
//! knows `disable`/`prefer`/`require` and ships no TLS stack, so this module
//! reads those two parameters itself, hands the rest of the URL to
//! tokio-postgres, and supplies the connector that does the handshake.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

/// libpq's `sslmode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// The URL split into what tokio-postgres parses and the TLS settings.
#[derive(Debug)]
pub(super) struct TlsUrl {
    /// The URL without `sslmode`/`sslrootcert`.
    pub url: String,
    pub mode: Mode,
    pub root_cert: Option<String>,
}

/// Pulls `sslmode` and `sslrootcert` out of the URL's query string.
pub(super) fn split_url(url: &str) -> Result<TlsUrl, String> {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, query),
        None => (url, ""),
    };
    let mut mode = Mode::Prefer;
    let mut root_cert = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "sslmode" => {
                mode = match percent_decode(value).as_str() {
                    "disable" => Mode::Disable,
                    "prefer" => Mode::Prefer,
                    "require" => Mode::Require,
                    "verify-ca" => Mode::VerifyCa,
                    "verify-full" => Mode::VerifyFull,
                    other => {
                        return Err(format!(
                            "invalid sslmode {other:?} (expected disable, prefer, require, verify-ca or verify-full)"
                        ));
                    }
                }
            }
            "sslrootcert" => root_cert = Some(percent_decode(value)),
            _ => kept.push(pair),
        }
    }
    let url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok(TlsUrl {
        url,
        mode,
        root_cert,
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
            if let Ok(byte) = u8::from_str_radix(hex, 16) {
                out.push(byte);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl TlsUrl {
    /// tokio-postgres's own mode: the verifying ones are `require` to it.
    pub fn ssl_mode(&self) -> SslMode {
        match self.mode {
            Mode::Disable => SslMode::Disable,
            Mode::Prefer => SslMode::Prefer,
            Mode::Require | Mode::VerifyCa | Mode::VerifyFull => SslMode::Require,
        }
    }

    /// The connector for this mode. As libpq: `require` with a root
    /// certificate verifies the chain (like `verify-ca`); `prefer` never
    /// verifies.
    pub fn connector(&self) -> Result<RustlsConnect, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|err| format!("TLS set-up: {err}"))?;
        let verify = match self.mode {
            Mode::Disable | Mode::Prefer => None,
            Mode::Require if self.root_cert.is_none() => None,
            Mode::Require | Mode::VerifyCa => Some(false),
            Mode::VerifyFull => Some(true),
        };
        let config = match verify {
            None => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
                .with_no_client_auth(),
            Some(check_name) => {
                let roots = Arc::new(self.roots()?);
                let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider)
                    .build()
                    .map_err(|err| format!("TLS set-up: {err}"))?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(Verify { webpki, check_name }))
                    .with_no_client_auth()
            }
        };
        Ok(RustlsConnect {
            config: Arc::new(config),
        })
    }

    fn roots(&self) -> Result<RootCertStore, String> {
        let mut roots = RootCertStore::empty();
        match &self.root_cert {
            Some(path) => {
                let pem = std::fs::read(path)
                    .map_err(|err| format!("cannot read sslrootcert {path:?}: {err}"))?;
                for cert in CertificateDer::pem_slice_iter(&pem) {
                    let cert =
                        cert.map_err(|err| format!("invalid sslrootcert {path:?}: {err}"))?;
                    roots
                        .add(cert)
                        .map_err(|err| format!("invalid sslrootcert {path:?}: {err}"))?;
                }
                if roots.is_empty() {
                    return Err(format!("sslrootcert {path:?} holds no certificate"));
                }
            }
            None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        }
        Ok(roots)
    }
}

/// `require`/`prefer` without a root certificate: encrypt, trust any
/// certificate (signatures are still checked).
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca` (chain only) and `verify-full` (chain and host name).
#[derive(Debug)]
struct Verify {
    webpki: Arc<WebPkiServerVerifier>,
    check_name: bool,
}

impl ServerCertVerifier for Verify {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // webpki checks the chain before the name, so a name error means
        // the chain verified.
        match self
            .webpki
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// The `MakeTlsConnect` handed to tokio-postgres and deadpool.
#[derive(Clone)]
pub(super) struct RustlsConnect {
    config: Arc<ClientConfig>,
}

pub(super) struct RustlsHandshake {
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
}

impl<S> MakeTlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsHandshake;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsHandshake, io::Error> {
        let name = ServerName::try_from(domain.to_string())
            .map_err(|err| io::Error::new(io::ErrorKind::InvalidInput, err))?;
        Ok(RustlsHandshake {
            config: Arc::clone(&self.config),
            name,
        })
    }
}

impl<S> TlsConnect<S> for RustlsHandshake
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        let connector = tokio_rustls::TlsConnector::from(self.config);
        Box::pin(async move {
            match connector.connect(self.name, stream).await {
                Ok(tls) => Ok(RustlsStream(tls)),
                Err(err) => Err(explain(err)),
            }
        })
    }
}

/// Says in words that the server's certificate did not verify, so the
/// startup error is plain about it.
fn explain(err: io::Error) -> io::Error {
    let invalid = err
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .is_some_and(|inner| matches!(inner, rustls::Error::InvalidCertificate(_)));
    if invalid {
        io::Error::new(
            err.kind(),
            format!("the server's TLS certificate did not verify ({err})"),
        )
    } else {
        err
    }
}

pub(super) struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_libpq_parameters_and_keeps_the_rest() {
        let split = split_url(
            "postgres://u@h/db?application_name=x&sslmode=verify-full&sslrootcert=%2Fca.pem",
        )
        .unwrap();
        assert_eq!(split.url, "postgres://u@h/db?application_name=x");
        assert_eq!(split.mode, Mode::VerifyFull);
        assert_eq!(split.root_cert.as_deref(), Some("/ca.pem"));
        let plain = split_url("postgres://u@h/db").unwrap();
        assert_eq!(plain.mode, Mode::Prefer);
        assert_eq!(plain.url, "postgres://u@h/db");
        assert!(split_url("postgres://h/db?sslmode=bogus").is_err());
    }
}
