//! The operator's HTTP endpoint on `METRICS_ADDR`: `/metrics` (Prometheus
//! text format), `/health` (liveness: the process answers) and `/ready`
//! (readiness: no part of the broker has failed and it is not stopping,
//! migrations ran before the broker started, the store answers a ping, and
//! the Kafka consumer has joined its group and received an assignment,
//! possibly empty when there are more replicas than partitions).

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::actors::store::StoreHandle;
use crate::metrics::Metrics;
use crate::supervisor::Health;

#[derive(Clone)]
struct Endpoint {
    metrics: Arc<Metrics>,
    store: StoreHandle,
    health: Health,
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    store: StoreHandle,
    health: Health,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(render))
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready))
        .with_state(Endpoint {
            metrics,
            store,
            health,
        });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn render(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        endpoint.metrics.render(),
    )
}

async fn ready(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    let unready = |why: String| (StatusCode::SERVICE_UNAVAILABLE, why);
    if let Some(failure) = endpoint.health.failure() {
        return unready(format!("failed: {failure}\n"));
    }
    if endpoint.health.is_stopping() {
        return unready("stopping\n".to_owned());
    }
    if !endpoint.health.consumer_joined() {
        return unready("kafka: no partition assignment yet\n".to_owned());
    }
    match store_answers(&endpoint.store).await {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(err) => unready(format!("store: {err}\n")),
    }
}

/// Whether the store answers: a cheap round trip through the StoreActor to
/// the database, no table scan.
pub async fn store_answers(store: &StoreHandle) -> Result<(), String> {
    store.ping().await.map_err(|err| err.to_string())
}
