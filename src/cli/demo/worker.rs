//! Demo workers: real tonic `WorkerService` servers on loopback whose
//! behaviour can be switched at run time and which record what they
//! received. The tests' fake workers, the load harness's `push` workers and
//! the demo's worker pool are all this one implementation.
//!
//! Part of the `taskbroker` binary, and also compiled into tests/common and
//! the tools package from its path (`#[path]`), since neither can depend on
//! a binary. So this file names the library only as `taskbroker::` and
//! expects the ledger as its sibling module `scenario`, wherever it is
//! included.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::scenario::{Ledger, report_for, wire_status};
use std::collections::HashMap;
use taskbroker::grpc::verify::VerifySignatureLayer;
use taskbroker::model::WorkerStatus;
use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
use taskbroker::proto::worker_service_server::{WorkerService, WorkerServiceServer};
use taskbroker::proto::{PushTaskRequest, PushTaskResponse, SetTaskStatusRequest, TaskActivation};
use taskbroker::wire::signing::{SIGNATURE_METADATA, sign};
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

/// The largest push a demo worker accepts: the largest `MAX_ACTIVATION_BYTES`
/// allowed plus room for the request around the task.
const DEMO_WORKER_MAX_TASK_BYTES: usize = (64 << 20) + (64 << 10);

/// How a fake worker answers PushTask.
#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    /// OK after `delay`.
    Accept { delay: Duration },
    /// UNAVAILABLE at once.
    Unavailable,
    /// RESOURCE_EXHAUSTED at once, as a Python worker with a full queue.
    Busy,
    /// Never answers.
    Hang,
    /// Never answers the first push of an id; accepts later ones.
    HangOnFirstDelivery,
    /// OK at once, then "runs" the task for `delay` and reports the outcome
    /// its demo kind calls for ([`report_for`]) to the push's callback
    /// address, as a real worker does.
    Execute { delay: Duration },
    /// As `Execute` with no run time, but answers each push only after
    /// `accept`: a worker slow to take work, which fills the push pool.
    ExecuteSlowly { accept: Duration },
}

impl Mode {
    pub fn accept() -> Mode {
        Mode::Accept {
            delay: Duration::ZERO,
        }
    }
}

/// What a worker saw.
#[derive(Debug, Default)]
pub struct Seen {
    /// PushTask calls that reached the handler.
    pub attempts: AtomicU64,
    /// Ids the worker accepted (answered OK), in order.
    pub accepted: Mutex<Vec<String>>,
    /// Every callback_url received.
    pub callback_urls: Mutex<HashSet<String>>,
    /// Each push as it arrived: the task's namespace and milliseconds from
    /// its `received_at` to the arrival (the load harness's latency).
    pub arrivals: Mutex<Vec<(String, f64)>>,
    /// Each push as it arrived: which task, from which broker (its
    /// `callback_url`), when. What recovery tests and benchmarks count
    /// duplicates by.
    pub deliveries: Mutex<Vec<Delivery>>,
    first_deliveries: Mutex<HashSet<String>>,
}

/// One PushTask that reached the worker.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub id: String,
    pub callback_url: String,
    pub at: std::time::Instant,
}

impl Seen {
    pub fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::SeqCst)
    }

    pub fn accepted(&self) -> Vec<String> {
        self.accepted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn deliveries(&self) -> Vec<Delivery> {
        self.deliveries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

struct Handler {
    mode: Arc<Mutex<Mode>>,
    seen: Arc<Seen>,
    reporter: Arc<Reporter>,
}

/// Reports task outcomes back to the broker that pushed them.
struct Reporter {
    /// Requests are signed with the first, when there is one.
    secrets: Vec<String>,
    clients: Mutex<HashMap<String, ConsumerServiceClient<Channel>>>,
    ledger: Option<Arc<Ledger>>,
}

const SET_TASK_STATUS_PATH: &str = "/sentry_protos.taskbroker.v1.ConsumerService/SetTaskStatus";

impl Reporter {
    fn client(&self, callback_url: &str) -> Result<ConsumerServiceClient<Channel>, String> {
        let mut clients = self.clients.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(client) = clients.get(callback_url) {
            return Ok(client.clone());
        }
        let url = if callback_url.contains("://") {
            callback_url.to_owned()
        } else {
            format!("http://{callback_url}")
        };
        let channel = Channel::from_shared(url)
            .map_err(|err| format!("bad callback address {callback_url}: {err}"))?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(5))
            .connect_lazy();
        let client = ConsumerServiceClient::new(channel);
        clients.insert(callback_url.to_owned(), client.clone());
        Ok(client)
    }

    /// Sends the report, re-sending it while the broker cannot take it (a
    /// worker runtime does the same), for up to about a minute.
    async fn report(&self, callback_url: &str, task: &TaskActivation, status: WorkerStatus) {
        let Ok(mut client) = self.client(callback_url) else {
            return;
        };
        let message = SetTaskStatusRequest {
            id: task.id.clone(),
            status: wire_status(status) as i32,
            ..Default::default()
        };
        let mut backoff = Duration::from_millis(50);
        for _ in 0..60 {
            let mut request = Request::new(message.clone());
            if let Some(secret) = self.secrets.first() {
                let signature = sign(
                    secret,
                    SET_TASK_STATUS_PATH,
                    &prost::Message::encode_to_vec(&message),
                );
                if let Ok(value) = signature.parse() {
                    request.metadata_mut().insert(SIGNATURE_METADATA, value);
                }
            }
            match client.set_task_status(request).await {
                Ok(_) => {
                    if let Some(ledger) = &self.ledger {
                        ledger.reported(task, status);
                    }
                    return;
                }
                Err(err) if err.code() == tonic::Code::InvalidArgument => {
                    tracing::warn!(id = %task.id, error = %err, "broker refused a report");
                    return;
                }
                Err(_) => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
        tracing::warn!(id = %task.id, "gave up reporting a task result");
    }
}

impl Handler {
    /// Records the delivery and reports the task's outcome after `delay`,
    /// on the worker's own runtime: killing the worker drops reports not
    /// yet acknowledged, as a killed worker process would.
    fn execute(&self, task: TaskActivation, callback_url: String, delay: Duration) {
        if let Some(ledger) = &self.reporter.ledger {
            ledger.delivered(&task);
        }
        let reporter = Arc::clone(&self.reporter);
        tokio::spawn(async move {
            let Some(status) = report_for(&task) else {
                return;
            };
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            reporter.report(&callback_url, &task, status).await;
        });
    }
}

#[tonic::async_trait]
impl WorkerService for Handler {
    async fn push_task(
        &self,
        request: Request<PushTaskRequest>,
    ) -> Result<Response<PushTaskResponse>, Status> {
        self.seen.attempts.fetch_add(1, Ordering::SeqCst);
        let request = request.into_inner();
        let task = request
            .task
            .ok_or_else(|| Status::invalid_argument("no task"))?;
        if let Some(received) = &task.received_at {
            let received_us = received.seconds as f64 * 1e6 + f64::from(received.nanos) / 1e3;
            let waited_ms = (chrono::Utc::now().timestamp_micros() as f64 - received_us) / 1e3;
            self.seen
                .arrivals
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((task.namespace.clone(), waited_ms));
        }
        let id = task.id.clone();
        let callback_url = request.callback_url.clone();
        self.seen
            .deliveries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Delivery {
                id: id.clone(),
                callback_url: callback_url.clone(),
                at: std::time::Instant::now(),
            });
        self.seen
            .callback_urls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(request.callback_url);
        let mode = self
            .mode
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match mode {
            Mode::Accept { delay } => {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
            }
            Mode::Execute { delay } => self.execute(task, callback_url, delay),
            Mode::ExecuteSlowly { accept } => {
                tokio::time::sleep(accept).await;
                self.execute(task, callback_url, Duration::ZERO);
            }
            Mode::Unavailable => return Err(Status::unavailable("worker shutting down")),
            Mode::Busy => return Err(Status::resource_exhausted("queue full")),
            Mode::Hang => std::future::pending::<()>().await,
            Mode::HangOnFirstDelivery => {
                let first = self
                    .seen
                    .first_deliveries
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(id.clone());
                if first {
                    std::future::pending::<()>().await;
                }
            }
        }
        self.seen
            .accepted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(id);
        Ok(Response::new(PushTaskResponse {}))
    }
}

/// A running fake worker. Each serves from a thread and runtime of its own,
/// so killing it drops every connection at once, as a killed process would.
pub struct DemoWorker {
    pub addr: SocketAddr,
    pub seen: Arc<Seen>,
    mode: Arc<Mutex<Mode>>,
    secrets: Vec<String>,
    ledger: Option<Arc<Ledger>>,
    server: Option<(oneshot::Sender<()>, std::thread::JoinHandle<()>)>,
}

impl DemoWorker {
    pub async fn start(mode: Mode) -> std::io::Result<DemoWorker> {
        Self::start_signed(mode, Vec::new()).await
    }

    /// A worker that requires requests signed with one of `secrets`.
    pub async fn start_signed(mode: Mode, secrets: Vec<String>) -> std::io::Result<DemoWorker> {
        Self::start_on(
            "127.0.0.1:0".parse().map_err(std::io::Error::other)?,
            mode,
            secrets,
        )
        .await
    }

    /// A worker on `addr` (port 0: any free port).
    pub async fn start_on(
        addr: SocketAddr,
        mode: Mode,
        secrets: Vec<String>,
    ) -> std::io::Result<DemoWorker> {
        Self::start_with_ledger(addr, mode, secrets, None).await
    }

    /// As [`DemoWorker::start_on`], recording deliveries and acknowledged
    /// reports of demo tasks in `ledger`.
    pub async fn start_with_ledger(
        addr: SocketAddr,
        mode: Mode,
        secrets: Vec<String>,
        ledger: Option<Arc<Ledger>>,
    ) -> std::io::Result<DemoWorker> {
        let mut worker = DemoWorker {
            addr,
            seen: Arc::new(Seen::default()),
            mode: Arc::new(Mutex::new(mode)),
            secrets,
            ledger,
            server: None,
        };
        worker.addr = worker.serve()?;
        Ok(worker)
    }

    /// Serves on `self.addr` (port 0: any), returning the bound address.
    fn serve(&mut self) -> std::io::Result<SocketAddr> {
        let handler = Handler {
            mode: Arc::clone(&self.mode),
            seen: Arc::clone(&self.seen),
            reporter: Arc::new(Reporter {
                secrets: self.secrets.clone(),
                clients: Mutex::new(HashMap::new()),
                ledger: self.ledger.clone(),
            }),
        };
        let layer = VerifySignatureLayer::new(self.secrets.clone(), 4 * 1024 * 1024);
        let addr = self.addr;
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(err) => {
                    let _ = bound_tx.send(Err(err));
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match listen(addr) {
                    Ok(listener) => listener,
                    Err(err) => {
                        let _ = bound_tx.send(Err(err));
                        return;
                    }
                };
                let _ = bound_tx.send(listener.local_addr());
                let server = Server::builder()
                    .layer(layer)
                    // Takes any task the broker may send (MAX_ACTIVATION_BYTES
                    // is at most 64 MiB), where tonic's default is 4 MiB.
                    .add_service(
                        WorkerServiceServer::new(handler)
                            .max_decoding_message_size(DEMO_WORKER_MAX_TASK_BYTES),
                    )
                    .serve_with_incoming(TcpIncoming::from(listener));
                tokio::select! {
                    _ = server => {}
                    _ = stop_rx => {}
                }
            });
            // Dropping the runtime drops every connection task with it.
            runtime.shutdown_background();
        });
        self.server = Some((stop_tx, thread));
        bound_rx
            .recv()
            .map_err(|_| std::io::Error::other("worker thread exited before listening"))?
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set_mode(&self, mode: Mode) {
        *self.mode.lock().unwrap_or_else(PoisonError::into_inner) = mode;
    }

    /// Kills the server: the port refuses connections until `restart`.
    pub fn kill(&mut self) {
        if let Some((stop, thread)) = self.server.take() {
            let _ = stop.send(());
            let _ = thread.join();
        }
    }

    /// Serves again on the same port.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.serve().map(drop)
    }
}

/// SO_REUSEADDR, so a restarted worker takes its old port back.
fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

impl Drop for DemoWorker {
    fn drop(&mut self) {
        self.kill();
    }
}
