//! `taskbroker-bench workers`: the simulated workers of the end-to-end
//! harness, in a process of their own so the broker's CPU and memory are
//! measured alone and the stranded-claim scenario can kill or freeze them.
//!
//! Push mode serves `--count` WorkerService servers; each push is accepted
//! at once, "runs" for `--latency-ms`, and its outcome (FAILURE for a
//! `--failure-rate` share, else COMPLETE) goes back to the push's callback
//! address in SetBatchActivationStatus calls of up to `--report-batch`
//! updates. Brokers of the protocol that send an empty `callback_url` get
//! their reports at `--broker` (and every broker does with
//! `--report-to-broker`), so any broker can be measured. Pull mode runs `--count` loops of GetTask, then SetTaskStatus
//! with `fetch_next_task`.
//!
//! The parent reads stdout: `url <url>` per server and `ready`, then
//! `progress <delivered> <reported>` every 100 ms. Closing stdin ends the
//! process after one `summary key=value ...` line with the latencies, as
//! seen from the task's `received_at` (set by the producer) on this
//! machine's clock.
//!
//! Every delivered task is checked against what was produced: the whole
//! activation rebuilt from its id and `received_at`, its parameters
//! regenerated from the id (`--payload-bytes`, payload.rs), and counted
//! as identical or mismatched. Servers and clients take messages of up to
//! [`MAX_MESSAGE_BYTES`], so the largest tasks reach the check rather
//! than a size refusal.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use taskbroker::proto::consumer_service_client::ConsumerServiceClient;
use taskbroker::proto::worker_service_server::{WorkerService, WorkerServiceServer};
use taskbroker::proto::{
    FetchNextTask, GetTaskRequest, PushTaskRequest, PushTaskResponse,
    SetBatchActivationStatusRequest, SetTaskStatusRequest, TaskActivation, TaskActivationStatus,
};
use tokio::sync::{Semaphore, mpsc};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};

use crate::payload::{Parameters, is_as_produced};

/// Largest gRPC message a worker takes (tonic's default is 4 MiB): twice
/// the 8 MiB activations issue 32 lets the broker carry.
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

#[derive(clap::Args, Debug, Clone)]
pub struct WorkersArgs {
    #[arg(long, value_enum, default_value_t = Delivery::Push)]
    pub mode: Delivery,
    /// Servers (push) or GetTask loops (pull).
    #[arg(long, default_value_t = 8)]
    pub count: usize,
    /// Push mode: the servers' ports, comma-separated (a restarted worker
    /// process takes its ports back); default any free ports.
    #[arg(long, value_delimiter = ',')]
    pub ports: Vec<u16>,
    /// Pull mode: the broker's gRPC address (`host:port`). Push mode: where
    /// reports go when a push names no `callback_url`.
    #[arg(long)]
    pub broker: Option<String>,
    /// Push mode: report every task to `--broker`, whatever its push's
    /// `callback_url` says.
    #[arg(long, requires = "broker")]
    pub report_to_broker: bool,
    /// Simulated run time of every task.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Share of tasks reported FAILURE instead of COMPLETE (0.0 to 1.0).
    #[arg(long, default_value_t = 0.0)]
    pub failure_rate: f64,
    /// Most updates in one SetBatchActivationStatus call (push mode).
    #[arg(long, default_value_t = 100)]
    pub report_batch: usize,
    /// The tasks' parameters are this many bytes made from their ids
    /// (payload.rs); default the small parameters of `e2e` without it.
    #[arg(long)]
    pub payload_bytes: Option<usize>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    Push,
    Pull,
}

impl Delivery {
    pub fn as_str(self) -> &'static str {
        match self {
            Delivery::Push => "push",
            Delivery::Pull => "pull",
        }
    }
}

/// What the workers saw, shared by every server and loop.
struct Stats {
    delivered: AtomicU64,
    reported: AtomicU64,
    failed: AtomicU64,
    report_errors: AtomicU64,
    first_delivery_us: AtomicU64,
    last_report_us: AtomicU64,
    /// received_at → delivered to a worker, µs.
    delivery: Mutex<Vec<u64>>,
    /// received_at → the worker's report acknowledged, µs.
    completion: Mutex<Vec<u64>>,
    seen: Mutex<HashSet<u64>>,
    duplicates: AtomicU64,
    /// Deliveries byte for byte as produced, and the others.
    identical: AtomicU64,
    mismatched: AtomicU64,
}

impl Stats {
    fn new() -> Stats {
        Stats {
            delivered: AtomicU64::new(0),
            reported: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            report_errors: AtomicU64::new(0),
            first_delivery_us: AtomicU64::new(u64::MAX),
            last_report_us: AtomicU64::new(0),
            delivery: Mutex::new(Vec::new()),
            completion: Mutex::new(Vec::new()),
            seen: Mutex::new(HashSet::new()),
            duplicates: AtomicU64::new(0),
            identical: AtomicU64::new(0),
            mismatched: AtomicU64::new(0),
        }
    }

    /// Counts a delivery, checking it against what was produced with
    /// `parameters`; returns its `received_at` in µs.
    fn delivered(&self, task: &mut TaskActivation, parameters: Parameters) -> u64 {
        let now = now_us();
        let received = received_us(task);
        if is_as_produced(task, parameters) {
            self.identical.fetch_add(1, Ordering::Relaxed);
        } else if self.mismatched.fetch_add(1, Ordering::Relaxed) < 5 {
            // The first few named; the summary counts them all.
            eprintln!(
                "workers: task {} is not as produced ({} bytes of parameters)",
                task.id,
                task.parameters_bytes.len()
            );
        }
        self.delivered.fetch_add(1, Ordering::Relaxed);
        self.first_delivery_us.fetch_min(now, Ordering::Relaxed);
        lock(&self.delivery).push(now.saturating_sub(received));
        if !lock(&self.seen).insert(hash_of(&task.id)) {
            self.duplicates.fetch_add(1, Ordering::Relaxed);
        }
        received
    }

    fn reported(&self, received: &[u64], failed: u64) {
        let now = now_us();
        self.reported
            .fetch_add(received.len() as u64, Ordering::Relaxed);
        self.failed.fetch_add(failed, Ordering::Relaxed);
        self.last_report_us.fetch_max(now, Ordering::Relaxed);
        lock(&self.completion).extend(received.iter().map(|r| now.saturating_sub(*r)));
    }

    fn summary(&self) -> String {
        let mut delivery = lock(&self.delivery).clone();
        let mut completion = lock(&self.completion).clone();
        delivery.sort_unstable();
        completion.sort_unstable();
        let first = self.first_delivery_us.load(Ordering::Relaxed);
        let mut line = format!(
            "summary delivered={} unique={} duplicates={} identical={} mismatched={} reported={} failed={} report_errors={} first_delivery_us={} last_report_us={}",
            self.delivered.load(Ordering::Relaxed),
            lock(&self.seen).len(),
            self.duplicates.load(Ordering::Relaxed),
            self.identical.load(Ordering::Relaxed),
            self.mismatched.load(Ordering::Relaxed),
            self.reported.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.report_errors.load(Ordering::Relaxed),
            if first == u64::MAX { 0 } else { first },
            self.last_report_us.load(Ordering::Relaxed),
        );
        for (name, samples) in [("deliver", &delivery), ("complete", &completion)] {
            for (label, q) in [("p50", 0.5), ("p99", 0.99), ("p999", 0.999), ("max", 1.0)] {
                line.push_str(&format!(" {name}_{label}_us={}", percentile(samples, q)));
            }
        }
        line
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let index = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[index]
}

fn hash_of(id: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    id.hash(&mut hasher);
    hasher.finish()
}

pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn received_us(task: &TaskActivation) -> u64 {
    task.received_at.as_ref().map_or(0, |at| {
        (at.seconds.max(0) as u64) * 1_000_000 + (at.nanos.max(0) as u64) / 1_000
    })
}

/// FAILURE for a stable `rate` share of ids, else COMPLETE.
fn outcome(id: &str, rate: f64) -> TaskActivationStatus {
    if (hash_of(id) % 10_000) < (rate.clamp(0.0, 1.0) * 10_000.0) as u64 {
        TaskActivationStatus::Failure
    } else {
        TaskActivationStatus::Complete
    }
}

fn update(id: String, status: TaskActivationStatus) -> SetTaskStatusRequest {
    SetTaskStatusRequest {
        id,
        status: status as i32,
        ..Default::default()
    }
}

fn client(address: &str) -> Result<ConsumerServiceClient<Channel>, String> {
    let url = if address.contains("://") {
        address.to_owned()
    } else {
        format!("http://{address}")
    };
    let channel = Channel::from_shared(url)
        .map_err(|err| format!("bad broker address {address}: {err}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(10))
        .connect_lazy();
    Ok(ConsumerServiceClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES))
}

/// One finished task waiting to be reported.
struct Report {
    callback: String,
    id: String,
    received_us: u64,
    status: TaskActivationStatus,
}

struct PushHandler {
    stats: Arc<Stats>,
    reports: mpsc::UnboundedSender<Report>,
    latency: Duration,
    failure_rate: f64,
    parameters: Parameters,
    /// `--broker`, and whether every report goes there.
    broker: Option<String>,
    always_to_broker: bool,
}

impl PushHandler {
    /// Where the report of a push goes: its callback, unless told otherwise
    /// or it names none.
    fn report_address(&self, callback_url: String) -> Result<String, Status> {
        match &self.broker {
            Some(broker) if self.always_to_broker || callback_url.is_empty() => Ok(broker.clone()),
            _ if callback_url.is_empty() => Err(Status::invalid_argument(
                "push without a callback_url, and no --broker to report to",
            )),
            _ => Ok(callback_url),
        }
    }
}

#[tonic::async_trait]
impl WorkerService for PushHandler {
    async fn push_task(
        &self,
        request: Request<PushTaskRequest>,
    ) -> Result<Response<PushTaskResponse>, Status> {
        let request = request.into_inner();
        let mut task = request
            .task
            .ok_or_else(|| Status::invalid_argument("PushTaskRequest without a task"))?;
        let callback = self.report_address(request.callback_url)?;
        let received_us = self.stats.delivered(&mut task, self.parameters);
        let report = Report {
            callback,
            status: outcome(&task.id, self.failure_rate),
            id: task.id,
            received_us,
        };
        if self.latency.is_zero() {
            let _ = self.reports.send(report);
        } else {
            let (reports, latency) = (self.reports.clone(), self.latency);
            tokio::spawn(async move {
                tokio::time::sleep(latency).await;
                let _ = reports.send(report);
            });
        }
        Ok(Response::new(PushTaskResponse {}))
    }
}

/// Gathers finished tasks into SetBatchActivationStatus calls: whatever has
/// queued up while the previous calls were in flight, up to `batch`, with
/// at most four calls in flight. A call that fails is sent again.
async fn reporter(mut reports: mpsc::UnboundedReceiver<Report>, stats: Arc<Stats>, batch: usize) {
    let in_flight = Arc::new(Semaphore::new(4));
    let mut clients = std::collections::HashMap::<String, ConsumerServiceClient<Channel>>::new();
    let mut client_for = |callback: &str| -> Option<ConsumerServiceClient<Channel>> {
        if let Some(client) = clients.get(callback) {
            return Some(client.clone());
        }
        match client(callback) {
            Ok(new) => {
                clients.insert(callback.to_owned(), new.clone());
                Some(new)
            }
            Err(err) => {
                eprintln!("workers: {err}");
                None
            }
        }
    };
    while let Some(first) = reports.recv().await {
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
            return;
        };
        let callback = first.callback.clone();
        let mut group = vec![first];
        while group.len() < batch.max(1) {
            match reports.try_recv() {
                Ok(report) if report.callback == callback => group.push(report),
                // Another broker: report it on its own.
                Ok(report) => match client_for(&report.callback) {
                    Some(client) => {
                        tokio::spawn(send_reports(client, vec![report], Arc::clone(&stats)));
                    }
                    None => {
                        stats.report_errors.fetch_add(1, Ordering::Relaxed);
                    }
                },
                Err(_) => break,
            }
        }
        let Some(client) = client_for(&callback) else {
            stats.report_errors.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let stats = Arc::clone(&stats);
        tokio::spawn(async move {
            send_reports(client, group, stats).await;
            drop(permit);
        });
    }
}

async fn send_reports(
    mut client: ConsumerServiceClient<Channel>,
    group: Vec<Report>,
    stats: Arc<Stats>,
) {
    let received: Vec<u64> = group.iter().map(|r| r.received_us).collect();
    let failed = group
        .iter()
        .filter(|r| r.status == TaskActivationStatus::Failure)
        .count() as u64;
    let request = SetBatchActivationStatusRequest {
        updates: group.into_iter().map(|r| update(r.id, r.status)).collect(),
    };
    let mut backoff = Duration::from_millis(20);
    loop {
        match client.set_batch_activation_status(request.clone()).await {
            Ok(_) => {
                stats.reported(&received, failed);
                return;
            }
            Err(status) => {
                stats.report_errors.fetch_add(1, Ordering::Relaxed);
                if status.code() == Code::InvalidArgument {
                    eprintln!("workers: broker refused a report: {status}");
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// One pull worker: GetTask, run, SetTaskStatus asking for the next task.
async fn pull_loop(
    mut client: ConsumerServiceClient<Channel>,
    stats: Arc<Stats>,
    latency: Duration,
    failure_rate: f64,
    parameters: Parameters,
) {
    let mut next: Option<TaskActivation> = None;
    loop {
        let mut task = match next.take() {
            Some(task) => task,
            None => match client.get_task(GetTaskRequest::default()).await {
                Ok(response) => match response.into_inner().task {
                    Some(task) => task,
                    None => {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                },
                Err(status) if status.code() == Code::NotFound => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                Err(_) => {
                    stats.report_errors.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let received = stats.delivered(&mut task, parameters);
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let status = outcome(&task.id, failure_rate);
        let mut request = update(task.id, status);
        request.fetch_next_task = Some(FetchNextTask::default());
        loop {
            match client.set_task_status(request.clone()).await {
                Ok(response) => {
                    let failed = u64::from(status == TaskActivationStatus::Failure);
                    stats.reported(&[received], failed);
                    next = response.into_inner().task;
                    break;
                }
                Err(status) if status.code() == Code::InvalidArgument => {
                    eprintln!("workers: broker refused a report: {status}");
                    break;
                }
                Err(_) => {
                    stats.report_errors.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

fn listen(port: u16) -> std::io::Result<tokio::net::TcpListener> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::from(([127, 0, 0, 1], port)))?;
    socket.listen(1024)
}

pub fn run(args: WorkersArgs) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|err| format!("cannot start a runtime: {err}"))?;
    runtime.block_on(serve(args))
}

async fn serve(args: WorkersArgs) -> Result<(), String> {
    let stats = Arc::new(Stats::new());
    let latency = Duration::from_millis(args.latency_ms);
    let parameters = Parameters::from_flag(args.payload_bytes);
    let mut stdout = std::io::stdout();
    match args.mode {
        Delivery::Push => {
            let (reports, queue) = mpsc::unbounded_channel();
            tokio::spawn(reporter(queue, Arc::clone(&stats), args.report_batch));
            for i in 0..args.count.max(1) {
                let port = args.ports.get(i).copied().unwrap_or(0);
                let listener =
                    listen(port).map_err(|err| format!("cannot listen on port {port}: {err}"))?;
                let addr = listener.local_addr().map_err(|err| err.to_string())?;
                let handler = PushHandler {
                    stats: Arc::clone(&stats),
                    reports: reports.clone(),
                    latency,
                    failure_rate: args.failure_rate,
                    parameters,
                    broker: args.broker.clone(),
                    always_to_broker: args.report_to_broker,
                };
                let service =
                    WorkerServiceServer::new(handler).max_decoding_message_size(MAX_MESSAGE_BYTES);
                tokio::spawn(
                    Server::builder()
                        .add_service(service)
                        .serve_with_incoming(TcpIncoming::from(listener)),
                );
                let _ = writeln!(stdout, "url http://{addr}");
            }
        }
        Delivery::Pull => {
            let broker = args
                .broker
                .as_deref()
                .ok_or("pull mode needs --broker host:port")?;
            for _ in 0..args.count.max(1) {
                tokio::spawn(pull_loop(
                    client(broker)?,
                    Arc::clone(&stats),
                    latency,
                    args.failure_rate,
                    parameters,
                ));
            }
        }
    }
    let _ = writeln!(stdout, "ready");
    let _ = stdout.flush();

    // Stdin closing (the parent is done, or died) ends the run.
    let (closed_tx, mut closed) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        for line in stdin.lock().lines() {
            if line.is_err() {
                break;
            }
        }
        let _ = closed_tx.send(());
    });
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let _ = writeln!(
                    stdout,
                    "progress {} {}",
                    stats.delivered.load(Ordering::Relaxed),
                    stats.reported.load(Ordering::Relaxed)
                );
                let _ = stdout.flush();
            }
            _ = &mut closed => break,
        }
    }
    let _ = writeln!(stdout, "{}", stats.summary());
    let _ = stdout.flush();
    std::process::exit(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handler(broker: Option<&str>, always_to_broker: bool) -> PushHandler {
        PushHandler {
            stats: Arc::new(Stats::new()),
            reports: mpsc::unbounded_channel().0,
            latency: Duration::ZERO,
            failure_rate: 0.0,
            parameters: Parameters::Small,
            broker: broker.map(str::to_owned),
            always_to_broker,
        }
    }

    #[test]
    fn reports_go_to_the_callback_else_to_the_broker_given() {
        let callback = || "10.0.0.1:50051".to_owned();
        let to = |handler: &PushHandler, url: String| handler.report_address(url).ok();
        let own = handler(None, false);
        assert_eq!(to(&own, callback()), Some(callback()));
        let empty = own.report_address(String::new()).unwrap_err();
        assert_eq!(empty.code(), Code::InvalidArgument);

        // Another broker of the protocol sends no callback_url.
        let broker = Some("127.0.0.1:7000".to_owned());
        let fallback = handler(Some("127.0.0.1:7000"), false);
        assert_eq!(to(&fallback, callback()), Some(callback()));
        assert_eq!(to(&fallback, String::new()), broker);
        let always = handler(Some("127.0.0.1:7000"), true);
        assert_eq!(to(&always, callback()), broker);
    }
}
