//! The broker's gRPC server: ConsumerService and grpc.health.v1.Health,
//! behind the signature check when secrets are configured.

use std::future::Future;
use std::sync::Arc;

use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic_health::server::HealthReporter;

use super::consumer_service::ConsumerApi;
use super::tls::{RELOAD_INTERVAL, ServerTls};
use super::verify::VerifySignatureLayer;
use crate::proto::consumer_service_server::ConsumerServiceServer;

/// Settings of the gRPC server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub shared_secrets: Vec<String>,
    pub max_request_bytes: usize,
    /// TLS (`GRPC_TLS_*`), loaded and checked; `None`: plaintext.
    pub tls: Option<Arc<ServerTls>>,
}

/// Serves until `shutdown` resolves, then lets in-flight calls finish.
/// Returns the health reporter through `health` before serving, so the
/// caller can flip SERVING / NOT_SERVING.
pub async fn serve(
    listener: tokio::net::TcpListener,
    api: ConsumerApi,
    config: ServerConfig,
    health: tokio::sync::oneshot::Sender<HealthReporter>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<ConsumerServiceServer<ConsumerApi>>()
        .await;
    let _ = health.send(reporter);
    let consumer =
        ConsumerServiceServer::new(api).max_decoding_message_size(config.max_request_bytes);
    let router = Server::builder()
        .layer(VerifySignatureLayer::new(
            config.shared_secrets,
            config.max_request_bytes,
        ))
        .add_service(health_service)
        .add_service(consumer);
    match config.tls {
        None => {
            router
                .serve_with_incoming_shutdown(
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    shutdown,
                )
                .await
        }
        Some(tls) => {
            let watcher = Arc::clone(&tls).watch(RELOAD_INTERVAL);
            let served = router
                .serve_with_incoming_shutdown(tls.incoming(listener), shutdown)
                .await;
            watcher.abort();
            served
        }
    }
}
