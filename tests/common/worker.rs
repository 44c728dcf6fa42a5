//! The fake workers the tests use are the demo workers of `taskbroker demo`
//! (src/cli/demo/worker.rs), and the fault matrix keeps its books in the
//! demo's ledger (src/cli/demo/scenario.rs). Both files belong to the
//! `taskbroker` binary, not the library, and no test can depend on a
//! binary's modules, so they are compiled into the tests from their source
//! here; `worker.rs` finds the ledger as its sibling `scenario`.

#[path = "../../src/cli/demo/worker.rs"]
mod demo_worker;
#[path = "../../src/cli/demo/scenario.rs"]
pub mod scenario;

pub use demo_worker::{DemoWorker, Mode};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use taskbroker::actors::fetch::FetchConfig;
use taskbroker::actors::push_pool::PushPoolConfig;
use taskbroker::broker::PushPipelineConfig;
use taskbroker::config::WorkerEndpoints;
use taskbroker::proto::worker_service_server::WorkerService;
use taskbroker::proto::{PushTaskRequest, PushTaskResponse};

/// Starts demo workers, failing the test if one cannot listen.
pub struct FakeWorker;

impl FakeWorker {
    pub async fn start(mode: Mode) -> DemoWorker {
        DemoWorker::start(mode).await.expect("fake worker listens")
    }

    pub async fn start_signed(mode: Mode, secrets: Vec<String>) -> DemoWorker {
        DemoWorker::start_signed(mode, secrets)
            .await
            .expect("fake worker listens")
    }
}

/// A WorkerService that accepts every push and counts it in `handled`, for
/// tests that serve it themselves (over TLS, behind a connection limit).
pub struct CountingHandler {
    pub handled: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl WorkerService for CountingHandler {
    async fn push_task(
        &self,
        _request: tonic::Request<PushTaskRequest>,
    ) -> Result<tonic::Response<PushTaskResponse>, tonic::Status> {
        self.handled.fetch_add(1, Ordering::SeqCst);
        Ok(tonic::Response::new(PushTaskResponse {}))
    }
}

/// A WorkerService that accepts every push and keeps the activations it
/// was given, as their encoded bytes.
#[derive(Clone, Default)]
pub struct RecordingHandler {
    pub received: Arc<std::sync::Mutex<Vec<Vec<u8>>>>,
}

#[tonic::async_trait]
impl WorkerService for RecordingHandler {
    async fn push_task(
        &self,
        request: tonic::Request<PushTaskRequest>,
    ) -> Result<tonic::Response<PushTaskResponse>, tonic::Status> {
        use prost::Message as _;
        let task = request.into_inner().task.unwrap_or_default();
        self.received
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(task.encode_to_vec());
        Ok(tonic::Response::new(PushTaskResponse {}))
    }
}

/// Serves `router` on `listener` in the background until the returned
/// sender is dropped: the worker servers tests build themselves.
pub fn serve_until_dropped(
    router: tonic::transport::server::Router,
    listener: tokio::net::TcpListener,
) -> tokio::sync::oneshot::Sender<()> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _ = router
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                async move {
                    let _ = stopped.await;
                },
            )
            .await;
    });
    stop
}

/// The push pipeline the push tests start from: four FetchActors, a pool of
/// 32, pushes to `endpoints` in plaintext; tests adjust what they need.
pub fn push_config(endpoints: WorkerEndpoints) -> PushPipelineConfig {
    PushPipelineConfig {
        fetch_actors: 4,
        fetch: FetchConfig {
            batch_size: 64,
            batch_bytes: 16 << 20,
            backoff: Duration::from_millis(20),
            queue_timeout: Duration::from_millis(500),
            lease: Duration::from_secs(30),
            fair_dispatch: true,
            #[cfg(feature = "test-hooks")]
            release_on_full: true,
        },
        push: PushPoolConfig {
            concurrency: 32,
            queue_size: 64,
            queue_bytes: 64 << 20,
            push_timeout: Duration::from_secs(2),
            deadline_grace: Duration::from_secs(3),
            max_attempts: 5,
            callback_url: "broker.test:50051".to_owned(),
            signing_secret: None,
            endpoints,
            tls: Default::default(),
            spread: Default::default(),
        },
    }
}
