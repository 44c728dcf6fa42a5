//! ConsumerService: the API workers call (PROTOCOL.md). Handlers only send
//! typed messages to the StoreActor (through its `StoreHandle`); tonic runs
//! them concurrently. Every status write, a single report or a batch, goes
//! through the StoreActor's write combiner (`ReportStatus`).
//!
//! Status codes (PROTOCOL.md's table): GetTask in push mode →
//! PERMISSION_DENIED; nothing claimable → NOT_FOUND; a status that is not
//! FAILURE, RETRY or COMPLETE, an id with a NUL character or longer than
//! `MAX_ID_BYTES`, or a request that does not decode (`codec.rs`) →
//! INVALID_ARGUMENT for that request only (a batch is validated whole before
//! anything is written); unknown ids → OK (counted: the task was already
//! finished or removed, and worker runtimes re-send a failed call forever);
//! the store unavailable → UNAVAILABLE; any other store failure → INTERNAL.
//! Store failures reach the client as a fixed message: the database's own
//! text (which may quote other requests' data) is only logged. Every status
//! write is idempotent and durable before the call returns.

use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use tonic::{Request, Response, Status};

use crate::actors::store::StoreHandle;
use crate::config::DeliveryMode;
use crate::metrics::Metrics;
use crate::model::{MAX_ID_BYTES, check_text};
use crate::model::{PullFilter, StatusUpdate, WorkerStatus};
use crate::proto::consumer_service_server::ConsumerService;
use crate::proto::{
    FetchNextTask, GetTaskRequest, GetTaskResponse, SetBatchActivationStatusRequest,
    SetBatchActivationStatusResponse, SetTaskStatusRequest, SetTaskStatusResponse, TaskActivation,
    TaskActivationStatus,
};
use crate::store::StoreError;

pub struct ConsumerApi {
    store: StoreHandle,
    mode: DeliveryMode,
    deadline_grace: Duration,
    metrics: Arc<Metrics>,
}

impl ConsumerApi {
    pub fn new(
        store: StoreHandle,
        mode: DeliveryMode,
        deadline_grace: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        ConsumerApi {
            store,
            mode,
            deadline_grace,
            metrics,
        }
    }

    /// Pull mode: the next task for `filter`, if any.
    async fn next_task(&self, filter: PullFilter) -> Result<Option<TaskActivation>, Status> {
        let claimed = self
            .store
            .claim_for_pull(filter, self.deadline_grace)
            .await
            .map_err(store_status)?;
        let Some(row) = claimed else {
            return Ok(None);
        };
        match TaskActivation::decode(row.activation.as_slice()) {
            Ok(task) => Ok(Some(task)),
            Err(err) => {
                // Cannot happen for rows that passed ingest; fail the task
                // rather than hand it out again and again.
                tracing::error!(activation_id = %row.id, error = %err, "stored activation does not decode; failing it");
                let _ = self
                    .store
                    .report(vec![StatusUpdate::new(row.id, WorkerStatus::Failure)])
                    .await;
                Err(Status::internal("stored activation does not decode"))
            }
        }
    }

    /// A report as received: its status, or `invalid`.
    fn count(&self, status: &str) {
        self.metrics
            .status_reports
            .with_label_values(&[status])
            .inc();
    }
}

/// A worker's report as a store update, or INVALID_ARGUMENT.
fn worker_update(request: &SetTaskStatusRequest) -> Result<StatusUpdate, Status> {
    let status = match TaskActivationStatus::try_from(request.status) {
        Ok(TaskActivationStatus::Complete) => WorkerStatus::Complete,
        Ok(TaskActivationStatus::Retry) => WorkerStatus::Retry,
        Ok(TaskActivationStatus::Failure) => WorkerStatus::Failure,
        Ok(other) => {
            return Err(Status::invalid_argument(format!(
                "status {} is not one a worker can report (FAILURE, RETRY or COMPLETE)",
                other.as_str_name()
            )));
        }
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "unknown status value {}",
                request.status
            )));
        }
    };
    check_text("id", &request.id, MAX_ID_BYTES)
        .map_err(|err| Status::invalid_argument(format!("invalid report: {err}")))?;
    let mut update = StatusUpdate::new(request.id.clone(), status);
    if status == WorkerStatus::Retry {
        update.max_attempts = request.max_attempts;
        update.delay_on_retry = request.delay_on_retry;
    }
    Ok(update)
}

fn status_label(status: WorkerStatus) -> &'static str {
    match status {
        WorkerStatus::Complete => "complete",
        WorkerStatus::Retry => "retry",
        WorkerStatus::Failure => "failure",
    }
}

fn filter(namespace: Option<String>, application: Option<String>) -> PullFilter {
    PullFilter {
        application,
        namespace,
    }
}

/// Messages of the statuses a store failure becomes: fixed, so no driver or
/// database text reaches a client.
const STORE_UNAVAILABLE: &str = "store unavailable";
const STORE_FAILED: &str = "internal store error";

fn store_status(err: StoreError) -> Status {
    if err.is_unavailable() {
        // Every worker call fails alike while the database is away.
        crate::warn_throttled!(error = %err, "worker API call failed: store unavailable");
        Status::unavailable(STORE_UNAVAILABLE)
    } else {
        tracing::error!(error = %err, "worker API call failed in the store");
        Status::internal(STORE_FAILED)
    }
}

#[tonic::async_trait]
impl ConsumerService for ConsumerApi {
    async fn get_task(
        &self,
        request: Request<GetTaskRequest>,
    ) -> Result<Response<GetTaskResponse>, Status> {
        if self.mode == DeliveryMode::Push {
            return Err(Status::permission_denied(
                "this broker pushes tasks to workers; GetTask is for pull mode",
            ));
        }
        let request = request.into_inner();
        match self
            .next_task(filter(request.namespace, request.application))
            .await?
        {
            Some(task) => Ok(Response::new(GetTaskResponse { task: Some(task) })),
            None => Err(Status::not_found("no task to hand out")),
        }
    }

    async fn set_task_status(
        &self,
        request: Request<SetTaskStatusRequest>,
    ) -> Result<Response<SetTaskStatusResponse>, Status> {
        let request = request.into_inner();
        let update = worker_update(&request).inspect_err(|_| self.count("invalid"))?;
        self.count(status_label(update.status));
        if !update.id.is_empty() {
            self.store
                .report(vec![update])
                .await
                .map_err(store_status)?;
        }
        let task = match (self.mode, request.fetch_next_task) {
            (
                DeliveryMode::Pull,
                Some(FetchNextTask {
                    namespace,
                    application,
                }),
            ) => self.next_task(filter(namespace, application)).await?,
            _ => None,
        };
        Ok(Response::new(SetTaskStatusResponse { task }))
    }

    async fn set_batch_activation_status(
        &self,
        request: Request<SetBatchActivationStatusRequest>,
    ) -> Result<Response<SetBatchActivationStatusResponse>, Status> {
        let request = request.into_inner();
        // Validate every update before writing any.
        let updates = request
            .updates
            .iter()
            .map(worker_update)
            .collect::<Result<Vec<_>, _>>()
            .inspect_err(|_| self.count("invalid"))?;
        let updates: Vec<StatusUpdate> = updates
            .into_iter()
            .inspect(|update| self.count(status_label(update.status)))
            .filter(|update| !update.id.is_empty())
            .collect();
        if !updates.is_empty() {
            // The StoreActor counts what the write did (`record_status_outcome`).
            self.store.report(updates).await.map_err(store_status)?;
        }
        Ok(Response::new(SetBatchActivationStatusResponse {}))
    }
}
