//! The broker's PushTask client.
//!
//! A `PushTaskRequest` is built straight from the stored activation bytes:
//! field 1 (`task`) is the embedded TaskActivation message, so the request is
//! a two-byte-ish prefix, the stored bytes unchanged, and the `callback_url`
//! field. Nothing is decoded and re-encoded, the bytes are copied once (into
//! the HTTP/2 frame), and the signature is computed over exactly the bytes
//! sent.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BufMut;
use http::uri::PathAndQuery;
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

use super::signing::{SIGNATURE_METADATA, sign_parts};
use crate::proto::PushTaskResponse;

/// Full gRPC path of WorkerService.PushTask.
pub const PUSH_TASK_PATH: &str = "/sentry_protos.taskbroker.v1.WorkerService/PushTask";

/// A serialized `PushTaskRequest`, in three consecutive parts.
#[derive(Debug)]
pub struct PushTaskBytes {
    prefix: Vec<u8>,
    activation: Vec<u8>,
    suffix: Vec<u8>,
}

impl PushTaskBytes {
    /// Frames `activation` (serialized TaskActivation bytes) and
    /// `callback_url` as a PushTaskRequest.
    pub fn new(activation: Vec<u8>, callback_url: &str) -> Self {
        let mut prefix = Vec::with_capacity(11);
        prefix.push(0x0a); // field 1, length-delimited
        prost::encoding::encode_varint(activation.len() as u64, &mut prefix);
        let mut suffix = Vec::new();
        if !callback_url.is_empty() {
            suffix.reserve(callback_url.len() + 11);
            suffix.push(0x12); // field 2, length-delimited
            prost::encoding::encode_varint(callback_url.len() as u64, &mut suffix);
            suffix.extend_from_slice(callback_url.as_bytes());
        }
        PushTaskBytes {
            prefix,
            activation,
            suffix,
        }
    }

    pub fn signature(&self, secret: &str) -> String {
        sign_parts(
            secret,
            PUSH_TASK_PATH,
            &[&self.prefix, &self.activation, &self.suffix],
        )
    }

    pub fn len(&self) -> usize {
        self.prefix.len() + self.activation.len() + self.suffix.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole request as one buffer (tests, debugging).
    pub fn to_vec(&self) -> Vec<u8> {
        [&self.prefix[..], &self.activation, &self.suffix].concat()
    }
}

/// Sends pre-encoded requests and decodes prost responses.
#[derive(Debug, Clone, Copy, Default)]
struct PushTaskCodec;

#[derive(Debug, Clone, Copy, Default)]
struct PushTaskEncoder;

#[derive(Debug, Clone, Copy, Default)]
struct PushTaskDecoder;

impl Codec for PushTaskCodec {
    type Encode = PushTaskBytes;
    type Decode = PushTaskResponse;
    type Encoder = PushTaskEncoder;
    type Decoder = PushTaskDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        PushTaskEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        PushTaskDecoder
    }
}

impl Encoder for PushTaskEncoder {
    type Item = PushTaskBytes;
    type Error = Status;

    fn encode(&mut self, item: PushTaskBytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.reserve(item.len());
        dst.put_slice(&item.prefix);
        dst.put_slice(&item.activation);
        dst.put_slice(&item.suffix);
        Ok(())
    }
}

impl Decoder for PushTaskDecoder {
    type Item = PushTaskResponse;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<PushTaskResponse>, Status> {
        PushTaskResponse::decode(src)
            .map(Some)
            .map_err(|err| Status::new(Code::Internal, format!("bad PushTaskResponse: {err}")))
    }
}

/// A lazily connected channel to one worker. Connection failures surface
/// as push errors, never at startup, so brokers and workers can start in
/// any order; tonic reconnects by itself.
#[derive(Debug, Clone)]
pub struct WorkerClient {
    channel: Channel,
}

impl WorkerClient {
    /// Whether `url` can become a channel.
    pub fn check_url(url: &str) -> Result<(), String> {
        Endpoint::from_shared(url.to_owned())
            .map(drop)
            .map_err(|err| {
                format!(
                    "invalid worker URL {}: {err}",
                    crate::config::redact_url(url)
                )
            })
    }

    /// Must be called inside a Tokio runtime (the channel spawns its worker).
    /// `https://` URLs connect over TLS with `tls` (see
    /// [`super::worker_tls::WorkerTlsFiles::load`]); `http://` ones ignore it.
    ///
    /// With `address`, the channel connects to that address instead of
    /// resolving the URL's host, while the request's authority and the TLS
    /// server name stay the URL's host: one channel per pod behind a
    /// name that resolves to several (a headless Service).
    pub fn connect_lazy(
        url: &str,
        address: Option<SocketAddr>,
        connect_timeout: Duration,
        tls: &ClientTlsConfig,
    ) -> Result<Self, String> {
        let invalid = |err: &dyn std::fmt::Display| {
            format!(
                "invalid worker URL {}: {err}",
                crate::config::redact_url(url)
            )
        };
        let mut endpoint = Endpoint::from_shared(url.to_owned()).map_err(|err| invalid(&err))?;
        let uri = endpoint.uri().clone();
        let https = uri.scheme_str() == Some("https");
        let mut tls = tls.clone();
        if let Some(address) = address {
            let scheme = if https { "https" } else { "http" };
            endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
                .map_err(|err| invalid(&err))?
                .origin(uri.clone());
            if let Some(host) = uri.host() {
                // Verify the worker's certificate for the name in the URL,
                // not for the address it was reached at.
                tls = tls.domain_name(host.trim_start_matches('[').trim_end_matches(']'));
            }
        }
        endpoint = endpoint
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true);
        if https {
            endpoint = endpoint.tls_config(tls).map_err(|err| {
                format!(
                    "TLS settings for worker URL {}: {err}",
                    crate::config::redact_url(url)
                )
            })?;
        }
        Ok(WorkerClient {
            channel: endpoint.connect_lazy(),
        })
    }

    /// One PushTask RPC; `signature` goes into `sentry-signature` when set.
    pub async fn push(
        &self,
        request: PushTaskBytes,
        signature: Option<String>,
        timeout: Duration,
    ) -> Result<(), Status> {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|err| Status::unavailable(format!("worker not ready: {err}")))?;
        let mut request = tonic::Request::new(request);
        request.set_timeout(timeout);
        if let Some(signature) = signature {
            let value = signature
                .parse()
                .map_err(|_| Status::internal("signature is not valid metadata"))?;
            request.metadata_mut().insert(SIGNATURE_METADATA, value);
        }
        grpc.unary(
            request,
            PathAndQuery::from_static(PUSH_TASK_PATH),
            PushTaskCodec,
        )
        .await
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{PushTaskRequest, TaskActivation};

    #[test]
    fn framed_bytes_decode_as_push_task_request() {
        let activation = TaskActivation {
            id: "abc".into(),
            namespace: "ns".into(),
            parameters_bytes: vec![7; 300],
            ..Default::default()
        };
        let bytes = PushTaskBytes::new(activation.encode_to_vec(), "broker:50051");
        let decoded = PushTaskRequest::decode(bytes.to_vec().as_slice()).unwrap();
        assert_eq!(decoded.task, Some(activation));
        assert_eq!(decoded.callback_url, "broker:50051");
        assert_eq!(
            bytes.signature("s"),
            crate::wire::signing::sign("s", PUSH_TASK_PATH, &bytes.to_vec())
        );
    }
}
