//! Server-side signature check, as a tower layer in front of tonic services.
//!
//! The signature covers the serialized request message exactly as sent, so
//! it must be checked on the raw body, before tonic decodes it (re-encoding
//! a decoded message need not reproduce the same bytes: map order, unknown
//! fields). The layer reads the body up to a size limit, checks the gRPC
//! frame and the `sentry-signature` metadata against every configured
//! secret, and hands the same bytes on. Health checks pass unsigned.
//!
//! Answers: missing or wrong signature → UNAUTHENTICATED; a body shorter
//! than the 5-byte frame header, a truncated frame or a compressed frame →
//! INVALID_ARGUMENT; a body over the limit → RESOURCE_EXHAUSTED. Never a
//! panic.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use tonic::Status;
use tonic::body::Body;
use tower_layer::Layer;
use tower_service::Service;

use crate::wire::signing::{SIGNATURE_METADATA, verify};

/// Paths that never need a signature.
const UNSIGNED_PREFIX: &str = "/grpc.health.v1.Health/";

/// Requires a valid `sentry-signature` on every request when `secrets` is
/// not empty.
#[derive(Debug, Clone)]
pub struct VerifySignatureLayer {
    secrets: Arc<Vec<String>>,
    max_body_bytes: usize,
}

impl VerifySignatureLayer {
    pub fn new(secrets: Vec<String>, max_body_bytes: usize) -> Self {
        VerifySignatureLayer {
            secrets: Arc::new(secrets),
            max_body_bytes,
        }
    }
}

impl<S> Layer<S> for VerifySignatureLayer {
    type Service = VerifySignature<S>;

    fn layer(&self, inner: S) -> Self::Service {
        VerifySignature {
            inner,
            secrets: Arc::clone(&self.secrets),
            max_body_bytes: self.max_body_bytes,
        }
    }
}

#[derive(Debug, Clone)]
pub struct VerifySignature<S> {
    inner: S,
    secrets: Arc<Vec<String>>,
    max_body_bytes: usize,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl<S, ResBody> Service<Request<Body>> for VerifySignature<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        if self.secrets.is_empty() || request.uri().path().starts_with(UNSIGNED_PREFIX) {
            return Box::pin(self.inner.call(request));
        }
        // The clone is not necessarily ready; the ready one is `self.inner`
        // (tower's usual swap).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let secrets = Arc::clone(&self.secrets);
        let max_body_bytes = self.max_body_bytes;
        Box::pin(async move {
            match checked(request, &secrets, max_body_bytes).await {
                Ok(request) => inner.call(request).await,
                Err(status) => Ok(status.into_http()),
            }
        })
    }
}

/// The request, rebuilt around the same bytes, if its signature is valid.
async fn checked(
    request: Request<Body>,
    secrets: &[String],
    max_body_bytes: usize,
) -> Result<Request<Body>, Status> {
    let (parts, body) = request.into_parts();
    let signature = parts
        .headers
        .get(SIGNATURE_METADATA)
        .ok_or_else(|| Status::unauthenticated("missing sentry-signature"))?
        .to_str()
        .map_err(|_| Status::unauthenticated("sentry-signature is not text"))?
        .to_owned();
    // Room for the frame header on top of the message limit.
    let limit = max_body_bytes.saturating_add(5);
    let bytes = Limited::new(body, limit)
        .collect()
        .await
        .map_err(|err| {
            if err.is::<http_body_util::LengthLimitError>() {
                Status::resource_exhausted(format!("request larger than {max_body_bytes} bytes"))
            } else {
                Status::invalid_argument(format!("cannot read request body: {err}"))
            }
        })?
        .to_bytes();
    let message = frame_message(&bytes)?;
    if !verify(secrets, parts.uri.path(), message, &signature) {
        return Err(Status::unauthenticated("invalid sentry-signature"));
    }
    Ok(Request::from_parts(parts, Body::new(Full::new(bytes))))
}

/// The message inside one uncompressed gRPC frame.
fn frame_message(bytes: &[u8]) -> Result<&[u8], Status> {
    let Some((header, rest)) = bytes.split_first_chunk::<5>() else {
        return Err(Status::invalid_argument(
            "request body shorter than the 5-byte gRPC frame header",
        ));
    };
    if header[0] != 0 {
        return Err(Status::invalid_argument(
            "compressed requests cannot be verified; send them uncompressed",
        ));
    }
    let length = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    let length = usize::try_from(length).unwrap_or(usize::MAX);
    rest.get(..length)
        .filter(|_| rest.len() == length)
        .ok_or_else(|| Status::invalid_argument("request is not exactly one gRPC frame"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_checked_without_panicking() {
        assert!(frame_message(&[]).is_err());
        assert!(frame_message(&[0, 0, 0]).is_err());
        assert!(frame_message(&[1, 0, 0, 0, 0]).is_err());
        assert!(frame_message(&[0, 0, 0, 0, 3, 1, 2]).is_err());
        assert!(frame_message(&[0, 0, 0, 0, 1, 1, 2]).is_err());
        assert!(frame_message(&[0, 255, 255, 255, 255]).is_err());
        assert_eq!(frame_message(&[0, 0, 0, 0, 2, 7, 8]).unwrap(), &[7, 8]);
        assert_eq!(frame_message(&[0, 0, 0, 0, 0]).unwrap(), &[] as &[u8]);
    }
}
