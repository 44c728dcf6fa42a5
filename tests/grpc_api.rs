//! The worker API over real tonic servers and clients on loopback, with the
//! store on real PostgreSQL: every row of PROTOCOL.md's status-code table,
//! in both delivery modes, single and batch, and request signing.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{Backend, TestStore, insert, row, rows};
use prost::Message as _;
use taskbroker::config::DeliveryMode;
use taskbroker::grpc::consumer_service::ConsumerApi;
use taskbroker::grpc::server::{ServerConfig, serve};
use taskbroker::metrics::Metrics;
use taskbroker::model::{ActivationStatus, BucketRange};
use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
use taskbroker::proto::{
    FetchNextTask, GetTaskRequest, SetBatchActivationStatusRequest, SetTaskStatusRequest,
    TaskActivationStatus,
};
use taskbroker::store::{ActivationStore, PostgresStore, PostgresStoreConfig};
use taskbroker::wire::signing::{SIGNATURE_METADATA, sign};
use tonic::Code;
use tonic::transport::Channel;

const GET_TASK: &str = "/sentry_protos.taskbroker.v1.ConsumerService/GetTask";
const SET_STATUS: &str = "/sentry_protos.taskbroker.v1.ConsumerService/SetTaskStatus";

struct Api {
    _db: Option<TestStore>,
    store: Arc<dyn ActivationStore>,
    metrics: Arc<Metrics>,
    addr: SocketAddr,
    _shutdown: tokio::sync::oneshot::Sender<()>,
}

impl Api {
    async fn start(mode: DeliveryMode, secrets: Vec<String>) -> Api {
        Api::on(Backend::Postgres, mode, secrets).await
    }

    async fn on(backend: Backend, mode: DeliveryMode, secrets: Vec<String>) -> Api {
        let db = TestStore::new(backend).await;
        let store = db.store().await;
        Self::serve(Some(db), store, mode, secrets).await
    }

    async fn serve(
        db: Option<TestStore>,
        store: Arc<dyn ActivationStore>,
        mode: DeliveryMode,
        secrets: Vec<String>,
    ) -> Api {
        let metrics = Arc::new(Metrics::new());
        let store_actor = common::start_store_actor(store.clone(), Arc::clone(&metrics));
        let api = ConsumerApi::new(
            store_actor,
            mode,
            Duration::from_secs(3),
            Arc::clone(&metrics),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
        let (health, _reporter) = tokio::sync::oneshot::channel();
        tokio::spawn(serve(
            listener,
            api,
            ServerConfig {
                shared_secrets: secrets,
                max_request_bytes: 1 << 20,
                tls: None,
            },
            health,
            async move {
                let _ = stop.await;
            },
        ));
        Api {
            _db: db,
            store,
            metrics,
            addr,
            _shutdown: shutdown,
        }
    }

    async fn client(&self) -> ConsumerServiceClient<Channel> {
        ConsumerServiceClient::connect(format!("http://{}", self.addr))
            .await
            .expect("connect to the broker")
    }

    /// A GetTask on a new connection that the broker refuses.
    async fn get_task_error(&self) -> tonic::Status {
        self.client()
            .await
            .get_task(GetTaskRequest::default())
            .await
            .expect_err("GetTask is refused")
    }

    async fn status(&self, id: &str) -> Option<ActivationStatus> {
        self.store.get(id).await.unwrap().map(|row| row.status)
    }
}

fn set_status(id: &str, status: TaskActivationStatus) -> SetTaskStatusRequest {
    SetTaskStatusRequest {
        id: id.to_owned(),
        status: status as i32,
        ..Default::default()
    }
}

fn signed<T: prost::Message>(message: T, secret: &str, path: &str) -> tonic::Request<T> {
    let signature = sign(secret, path, &message.encode_to_vec());
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert(SIGNATURE_METADATA, signature.parse().unwrap());
    request
}

// ------------------------------------------------------------ GetTask

on_both_backends!(
    one_bad_report_fails_only_its_own_request,
    get_task_hands_out_pending_work_and_not_found_when_none,
    set_task_status_completes_and_is_idempotent_for_unknown_ids,
    fetch_next_task_hands_out_the_next_task_or_nothing,
    a_six_mib_task_is_pulled_byte_identical,
);

/// Issue 32: GetTask hands out a 6 MiB task (over tonic's default 4 MiB)
/// byte-identical to a worker whose receive limit takes it.
async fn a_six_mib_task_is_pulled_byte_identical(backend: Backend) {
    let api = Api::on(backend, DeliveryMode::Pull, vec![]).await;
    let mut task = common::task("six-mib");
    task.parameters_bytes = common::incompressible(6, 6 << 20);
    let stored = common::row_from(&task);
    let sent = stored.activation.clone();
    insert(api.store.as_ref(), &[stored]).await;
    let mut client = api.client().await.max_decoding_message_size(16 << 20);
    let pulled = client
        .get_task(GetTaskRequest::default())
        .await
        .expect("GetTask")
        .into_inner()
        .task
        .expect("a task");
    assert!(pulled.encode_to_vec() == sent, "pulled byte-identical");
    assert_eq!(
        api.status("six-mib").await,
        Some(ActivationStatus::Processing)
    );
}

#[actix_rt::test]
async fn get_task_in_push_mode_is_permission_denied() {
    let api = Api::start(DeliveryMode::Push, vec![]).await;
    let err = api.get_task_error().await;
    assert_eq!(err.code(), Code::PermissionDenied);
}

async fn get_task_hands_out_pending_work_and_not_found_when_none(backend: Backend) {
    let api = Api::on(backend, DeliveryMode::Pull, vec![]).await;
    let mut client = api.client().await;
    let err = client
        .get_task(GetTaskRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);

    insert(api.store.as_ref(), &[row("pull-1")]).await;
    // A namespace without an application matches nothing.
    let err = client
        .get_task(GetTaskRequest {
            namespace: Some("test-ns".into()),
            application: None,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    let err = client
        .get_task(GetTaskRequest {
            namespace: None,
            application: Some("other-app".into()),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);

    let task = client
        .get_task(GetTaskRequest {
            namespace: Some("test-ns".into()),
            application: Some("app".into()),
        })
        .await
        .unwrap()
        .into_inner()
        .task
        .expect("a task");
    assert_eq!(task.id, "pull-1");
    assert_eq!(
        api.status("pull-1").await,
        Some(ActivationStatus::Processing)
    );
    let err = client
        .get_task(GetTaskRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "handed out once");
}

// ------------------------------------------------------------ SetTaskStatus

#[actix_rt::test]
async fn set_task_status_rejects_statuses_a_worker_cannot_report() {
    let api = Api::start(DeliveryMode::Pull, vec![]).await;
    let mut client = api.client().await;
    for status in [0, 1, 2, 6, 99, -1] {
        let request = SetTaskStatusRequest {
            id: "any".into(),
            status,
            ..Default::default()
        };
        let err = client.set_task_status(request).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "status {status}");
    }
}

async fn set_task_status_completes_and_is_idempotent_for_unknown_ids(backend: Backend) {
    let api = Api::on(backend, DeliveryMode::Pull, vec![]).await;
    let mut client = api.client().await;
    insert(api.store.as_ref(), &[row("done")]).await;
    client.get_task(GetTaskRequest::default()).await.unwrap();
    let complete = set_status("done", TaskActivationStatus::Complete);
    let response = client.set_task_status(complete.clone()).await.unwrap();
    assert!(response.into_inner().task.is_none(), "no fetch_next asked");
    // Finished for good: the report deleted the row.
    assert_eq!(api.status("done").await, None);
    // The same report again, and one for an id that never existed: OK.
    client.set_task_status(complete).await.unwrap();
    client
        .set_task_status(set_status("never-stored", TaskActivationStatus::Complete))
        .await
        .unwrap();
    client
        .set_task_status(set_status("", TaskActivationStatus::Failure))
        .await
        .unwrap();
}

/// Each report is counted once as received (by its status, or as
/// invalid) and each valid one once by what its write did, so summing
/// either counter counts reports; late reports are counted apart.
#[actix_rt::test]
async fn each_report_is_counted_once_as_received_and_once_as_written() {
    let api = Api::start(DeliveryMode::Pull, vec![]).await;
    let mut client = api.client().await;
    insert(api.store.as_ref(), &[row("done"), row("again")]).await;
    client.get_task(GetTaskRequest::default()).await.unwrap();
    client.get_task(GetTaskRequest::default()).await.unwrap();
    let reports = [
        set_status("done", TaskActivationStatus::Complete),
        set_status("done", TaskActivationStatus::Complete),
        set_status("again", TaskActivationStatus::Retry),
        set_status("never-stored", TaskActivationStatus::Failure),
    ];
    for report in reports {
        client.set_task_status(report).await.unwrap();
    }
    client
        .set_task_status(set_status("done", TaskActivationStatus::Pending))
        .await
        .expect_err("a worker cannot report Pending");
    let reports = |status| Metrics::count(&api.metrics.status_reports, status);
    let written = |result| Metrics::count(&api.metrics.status_updates, result);
    assert_eq!(
        (
            reports("complete"),
            reports("retry"),
            reports("failure"),
            reports("invalid")
        ),
        (2, 1, 1, 1)
    );
    // The second COMPLETE finds the row gone, as does the unknown id.
    assert_eq!(
        (written("updated"), written("ignored"), written("missing")),
        (2, 0, 2)
    );
    assert_eq!(api.metrics.status_updates_late.get(), 0);
}

#[actix_rt::test]
async fn retry_report_edits_the_retried_retry_state() {
    let api = Api::start(DeliveryMode::Pull, vec![]).await;
    let mut client = api.client().await;
    let original = row("again");
    insert(api.store.as_ref(), std::slice::from_ref(&original)).await;
    client.get_task(GetTaskRequest::default()).await.unwrap();
    let mut retry = set_status("again", TaskActivationStatus::Retry);
    retry.max_attempts = Some(7);
    retry.delay_on_retry = Some(12);
    client.set_task_status(retry).await.unwrap();
    let stored = api.store.get("again").await.unwrap().unwrap();
    assert_eq!(stored.status, ActivationStatus::Retry);
    assert_eq!(stored.activation, original.activation, "stored as received");
    let (_, retried) = stored.retry_activation(chrono::Utc::now()).unwrap();
    let state = taskbroker::proto::TaskActivation::decode(retried.as_slice())
        .unwrap()
        .retry_state
        .unwrap();
    assert_eq!((state.max_attempts, state.delay_on_retry), (7, Some(12)));
}

async fn fetch_next_task_hands_out_the_next_task_or_nothing(backend: Backend) {
    let api = Api::on(backend, DeliveryMode::Pull, vec![]).await;
    let mut client = api.client().await;
    insert(api.store.as_ref(), &rows("chain", 2)).await;
    let first = client
        .get_task(GetTaskRequest::default())
        .await
        .unwrap()
        .into_inner()
        .task
        .unwrap();
    let mut report = set_status(&first.id, TaskActivationStatus::Complete);
    report.fetch_next_task = Some(FetchNextTask::default());
    let next = client
        .set_task_status(report)
        .await
        .unwrap()
        .into_inner()
        .task
        .expect("the next task");
    assert_ne!(next.id, first.id);
    let mut report = set_status(&next.id, TaskActivationStatus::Complete);
    report.fetch_next_task = Some(FetchNextTask::default());
    let none = client.set_task_status(report).await.unwrap().into_inner();
    assert!(
        none.task.is_none(),
        "OK with task unset when nothing is left"
    );
}

#[actix_rt::test]
async fn fetch_next_task_in_push_mode_hands_out_nothing() {
    let api = Api::start(DeliveryMode::Push, vec![]).await;
    let mut client = api.client().await;
    insert(api.store.as_ref(), &rows("push", 2)).await;
    let claimed = api
        .store
        .claim_for_push(BucketRange::ALL, 1, Duration::from_secs(30))
        .await
        .unwrap();
    let mut report = set_status(&claimed[0].id, TaskActivationStatus::Complete);
    report.fetch_next_task = Some(FetchNextTask::default());
    let response = client.set_task_status(report).await.unwrap().into_inner();
    assert!(response.task.is_none());
    assert_eq!(
        api.status(&claimed[0].id).await,
        None,
        "a Claimed row takes the worker's result (COMPLETE: deleted)"
    );
}

async fn one_bad_report_fails_only_its_own_request(backend: Backend) {
    const VALID: usize = 34;
    let api = Api::on(backend, DeliveryMode::Push, vec![]).await;
    insert(api.store.as_ref(), &rows("report", VALID)).await;
    let claimed = api
        .store
        .claim_for_push(BucketRange::ALL, VALID, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(claimed.len(), VALID);
    let mut ids: Vec<String> = claimed.iter().map(|row| row.id.clone()).collect();
    // Two ids no store can keep, among the others so they share their
    // combined write.
    ids.insert(10, "bad\0one".to_owned());
    ids.insert(25, "bad\0two".to_owned());

    let client = api.client().await;
    let calls = ids.iter().map(|id| {
        let mut client = client.clone();
        let request = set_status(id, TaskActivationStatus::Complete);
        async move { client.set_task_status(request).await }
    });
    let answers = futures::future::join_all(calls).await;

    let mut refused = Vec::new();
    for (id, answer) in ids.iter().zip(answers) {
        match answer {
            Ok(_) => assert_eq!(
                api.status(id).await,
                None,
                "{id} answered OK but was not applied (COMPLETE deletes)"
            ),
            Err(status) => {
                assert_eq!(status.code(), Code::InvalidArgument, "{id}: {status:?}");
                refused.push(id.clone());
            }
        }
    }
    assert_eq!(refused, ["bad\0one", "bad\0two"]);
    let overlong = set_status(&"x".repeat(257), TaskActivationStatus::Complete);
    let mut client = client.clone();
    let err = client.set_task_status(overlong.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    // A batch with one bad id is refused whole, before anything is written.
    insert(api.store.as_ref(), &[row("unreported")]).await;
    let held = api
        .store
        .claim_for_push(BucketRange::ALL, 1, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(held.len(), 1);
    let err = client
        .set_batch_activation_status(SetBatchActivationStatusRequest {
            updates: vec![
                set_status("unreported", TaskActivationStatus::Retry),
                overlong,
            ],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(
        api.status("unreported").await,
        Some(ActivationStatus::Claimed)
    );
}

#[actix_rt::test]
async fn store_errors_reach_clients_without_the_databases_text() {
    let api = Api::start(DeliveryMode::Pull, vec![]).await;
    let db = api._db.as_ref().expect("a test database");
    // Every statement now fails with PostgreSQL's "relation ... does not
    // exist": a query error, not an outage.
    db.client()
        .await
        .batch_execute("DROP TABLE inflight_taskactivations")
        .await
        .unwrap();
    let mut client = api.client().await;
    let errors = [
        client
            .get_task(GetTaskRequest::default())
            .await
            .unwrap_err(),
        client
            .set_task_status(set_status("x", TaskActivationStatus::Complete))
            .await
            .unwrap_err(),
        client
            .set_batch_activation_status(SetBatchActivationStatusRequest {
                updates: vec![set_status("x", TaskActivationStatus::Complete)],
            })
            .await
            .unwrap_err(),
    ];
    for status in errors {
        assert_eq!(status.code(), Code::Internal, "{status:?}");
        assert_eq!(status.message(), "internal store error", "{status:?}");
    }
}

// ------------------------------------------------------------ SetBatchActivationStatus

#[actix_rt::test]
async fn batch_with_one_invalid_status_writes_nothing() {
    let api = Api::start(DeliveryMode::Pull, vec![]).await;
    let mut client = api.client().await;
    insert(api.store.as_ref(), &[row("b1")]).await;
    client.get_task(GetTaskRequest::default()).await.unwrap();
    let err = client
        .set_batch_activation_status(SetBatchActivationStatusRequest {
            updates: vec![
                set_status("b1", TaskActivationStatus::Complete),
                set_status("b1", TaskActivationStatus::Pending),
            ],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(api.status("b1").await, Some(ActivationStatus::Processing));
}

#[actix_rt::test]
async fn batch_skips_unknown_and_empty_ids_and_applies_the_rest() {
    let api = Api::start(DeliveryMode::Pull, vec![]).await;
    let mut client = api.client().await;
    insert(api.store.as_ref(), &rows("batch", 3)).await;
    for _ in 0..3 {
        client.get_task(GetTaskRequest::default()).await.unwrap();
    }
    let updates = vec![
        set_status("batch-0", TaskActivationStatus::Complete),
        set_status("batch-1", TaskActivationStatus::Failure),
        set_status("batch-2", TaskActivationStatus::Retry),
        set_status("unknown", TaskActivationStatus::Complete),
        set_status("", TaskActivationStatus::Complete),
    ];
    let request = SetBatchActivationStatusRequest { updates };
    client
        .set_batch_activation_status(request.clone())
        .await
        .unwrap();
    // COMPLETE and FAILURE of a discarding task delete their rows.
    assert_eq!(api.status("batch-0").await, None);
    assert_eq!(api.status("batch-1").await, None);
    assert_eq!(api.status("batch-2").await, Some(ActivationStatus::Retry));
    // Worker runtimes re-send a batch until it succeeds: still OK.
    client.set_batch_activation_status(request).await.unwrap();
}

// ------------------------------------------------------------ store unavailable

#[actix_rt::test]
async fn store_unavailable_is_unavailable_not_a_hang() {
    // Nothing listens on port 1: every connection is refused.
    let mut config = PostgresStoreConfig::new("postgres://postgres@127.0.0.1:1/none");
    config.connect_timeout = Duration::from_secs(1);
    let store = Arc::new(PostgresStore::connect(&config).unwrap());
    let api = Api::serve(None, store, DeliveryMode::Pull, vec![]).await;
    let mut client = api.client().await;
    let err = client
        .get_task(GetTaskRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    let err = client
        .set_task_status(set_status("x", TaskActivationStatus::Complete))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    let err = client
        .set_batch_activation_status(SetBatchActivationStatusRequest {
            updates: vec![set_status("x", TaskActivationStatus::Complete)],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
}

// ------------------------------------------------------------ signing

#[actix_rt::test]
async fn signed_requests_are_accepted_with_any_configured_secret() {
    let api = Api::start(DeliveryMode::Pull, vec!["new".into(), "old".into()]).await;
    let mut client = api.client().await;
    for secret in ["new", "old"] {
        let err = client
            .get_task(signed(GetTaskRequest::default(), secret, GET_TASK))
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Code::NotFound,
            "signed with {secret}: past the check"
        );
    }
    client
        .set_task_status(signed(
            set_status("unknown", TaskActivationStatus::Complete),
            "old",
            SET_STATUS,
        ))
        .await
        .unwrap();
}

#[actix_rt::test]
async fn missing_or_wrong_signatures_are_unauthenticated() {
    let api = Api::start(DeliveryMode::Pull, vec!["right".into()]).await;
    let mut client = api.client().await;
    let err = client
        .get_task(GetTaskRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "missing");
    let err = client
        .get_task(signed(GetTaskRequest::default(), "wrong", GET_TASK))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "wrong secret");
    // Signed for another method: the path is part of the signature.
    let err = client
        .get_task(signed(GetTaskRequest::default(), "right", SET_STATUS))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "wrong path");
}

#[actix_rt::test]
async fn health_checks_need_no_signature() {
    let api = Api::start(DeliveryMode::Pull, vec!["right".into()]).await;
    let channel = Channel::from_shared(format!("http://{}", api.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let response = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "sentry_protos.taskbroker.v1.ConsumerService".into(),
        })
        .await
        .expect("health answers unsigned")
        .into_inner();
    assert_eq!(
        response.status(),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );
}

/// Sends `body` (a gRPC request body, framing included) to `path` over a
/// raw HTTP/2 connection; answers the `grpc-status` of the reply.
async fn raw_call(
    addr: SocketAddr,
    path: &str,
    body: &'static [u8],
    signature: Option<&str>,
) -> Option<String> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let mut request = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(signature) = signature {
        request = request.header(SIGNATURE_METADATA, signature);
    }
    let request = request
        .body(http_body_util::Full::new(bytes::Bytes::from_static(body)))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    // An error before any message is a trailers-only reply: the status is
    // in the headers.
    response
        .headers()
        .get("grpc-status")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
}

#[actix_rt::test]
async fn truncated_bodies_are_invalid_argument_not_a_panic() {
    let api = Api::start(DeliveryMode::Pull, vec!["right".into()]).await;
    // A body of 3 bytes: shorter than a frame header, which no well-behaved
    // client sends.
    let status = raw_call(api.addr, GET_TASK, &[0, 0, 0], Some("00")).await;
    assert_eq!(status.as_deref(), Some("3"), "INVALID_ARGUMENT");
}

#[actix_rt::test]
async fn undecodable_requests_are_invalid_argument() {
    let api = Api::start(DeliveryMode::Pull, vec![]).await;
    // One frame of 3 bytes that are no protobuf message (field 31 with the
    // undefined wire type 7).
    const GARBAGE: &[u8] = &[0, 0, 0, 0, 3, 0xff, 0xff, 0xff];
    // SetTaskStatusRequest whose id (field 1) holds the bytes C3 28: not
    // UTF-8.
    const NOT_UTF8: &[u8] = &[0, 0, 0, 0, 4, 0x0a, 0x02, 0xc3, 0x28];
    for (path, body, what) in [
        (SET_STATUS, GARBAGE, "garbage SetTaskStatus"),
        (GET_TASK, GARBAGE, "garbage GetTask"),
        (SET_STATUS, NOT_UTF8, "id not UTF-8"),
    ] {
        let status = raw_call(api.addr, path, body, None).await;
        assert_eq!(status.as_deref(), Some("3"), "{what}: INVALID_ARGUMENT");
    }
    // The server is still serving.
    let err = api.get_task_error().await;
    assert_eq!(err.code(), Code::NotFound);
}
