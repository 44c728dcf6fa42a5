//! The operator's HTTP endpoint on `METRICS_ADDR`: `/metrics` (Prometheus
//! text format), `/health` (liveness: the process answers) and `/ready`
//! (readiness: migrations ran before the broker started, the store answers,
//! and the Kafka consumer has joined its group and received an assignment,
//! possibly empty when there are more replicas than partitions).

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::actors::store::{CountByStatus, StoreHandle};
use crate::metrics::Metrics;

#[derive(Clone)]
struct Endpoint {
    metrics: Arc<Metrics>,
    store: StoreHandle,
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    store: StoreHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(render))
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready))
        .with_state(Endpoint { metrics, store });
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
    if endpoint.metrics.consumer_assignments.get() == 0 {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "kafka: no partition assignment yet\n".to_owned(),
        );
    }
    match endpoint.store.call(CountByStatus {}).await {
        Ok(_) => (StatusCode::OK, "ready\n".to_owned()),
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, format!("store: {err}\n")),
    }
}
