//! The pieces the multi-process scenarios (`e2e`, `stranded`) are built
//! from: Kafka (the in-process mock cluster or a real one), a scratch store,
//! the broker as a child process (the real `taskbroker` binary), the
//! workers as another child process. The producer and what it sends are
//! in feed.rs and payload.rs, PostgreSQL's own counters in pgstat.rs.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;

use crate::feed::Producer;
use crate::payload::Parameters;
use crate::scrape::{http_get, metric};
use crate::{connect, replace_database};

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    Postgres,
    Sqlite,
}

impl StoreKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StoreKind::Postgres => "PostgreSQL",
            StoreKind::Sqlite => "SQLite",
        }
    }
}

/// A short random id naming this run's topic, group, database and files.
pub fn run_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// Kafka for one run: `brokers` given, or librdkafka's mock cluster in this
/// process (a real Kafka protocol endpoint on loopback).
pub struct Kafka {
    _cluster: Option<MockCluster<'static, DefaultProducerContext>>,
    pub brokers: String,
}

impl Kafka {
    /// Settings for the broker's `TASKBROKER_KAFKA_CONFIG` (unless the user
    /// set it). The mock cluster answers a fetch that found no data only
    /// when `fetch.wait.max.ms` (500 by default) runs out, even if records
    /// arrive meanwhile; Kafka answers at once. Measured: 334 ms p50
    /// received→delivered at 500 tasks/s with the default, 39 ms with 5 ms.
    /// So against the mock the wait is shortened to 5 ms.
    pub fn broker_env(&self) -> Vec<(String, String)> {
        if !self.is_mock() || std::env::var_os("TASKBROKER_KAFKA_CONFIG").is_some() {
            return Vec::new();
        }
        vec![(
            "TASKBROKER_KAFKA_CONFIG".to_owned(),
            "fetch.wait.max.ms=5".to_owned(),
        )]
    }

    /// Whether this is the mock cluster (which keeps 5 MiB per partition:
    /// feed.rs).
    pub fn is_mock(&self) -> bool {
        self._cluster.is_some()
    }

    pub fn start(brokers: Option<&str>, topics: &[&str], partitions: i32) -> Result<Kafka, String> {
        match brokers {
            Some(brokers) => {
                create_topics(brokers, topics, partitions)?;
                Ok(Kafka {
                    _cluster: None,
                    brokers: brokers.to_owned(),
                })
            }
            None => {
                let cluster = MockCluster::new(1)
                    .map_err(|err| format!("cannot start the mock Kafka cluster: {err}"))?;
                for topic in topics {
                    cluster
                        .create_topic(topic, partitions, 1)
                        .map_err(|err| format!("cannot create topic {topic}: {err}"))?;
                }
                Ok(Kafka {
                    brokers: cluster.bootstrap_servers(),
                    _cluster: Some(cluster),
                })
            }
        }
    }
}

fn create_topics(brokers: &str, topics: &[&str], partitions: i32) -> Result<(), String> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|err| format!("cannot reach Kafka at {brokers}: {err}"))?;
    let new: Vec<NewTopic> = topics
        .iter()
        .map(|topic| NewTopic::new(topic, partitions, TopicReplication::Fixed(1)))
        .collect();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| err.to_string())?;
    let results = runtime
        .block_on(admin.create_topics(&new, &AdminOptions::new()))
        .map_err(|err| format!("cannot create topics: {err}"))?;
    for result in results {
        if let Err((topic, code)) = result
            && code != RDKafkaErrorCode::TopicAlreadyExists
        {
            return Err(format!("cannot create topic {topic}: {code}"));
        }
    }
    Ok(())
}

/// A fresh store for one run: a scratch PostgreSQL database, or a scratch
/// SQLite file. Removed by [`Scratch::remove`].
pub enum Scratch {
    Postgres {
        admin_url: String,
        name: String,
        url: String,
    },
    Sqlite {
        path: PathBuf,
    },
}

impl Scratch {
    pub async fn create(kind: StoreKind, admin_url: &str, run: &str) -> Result<Scratch, String> {
        match kind {
            StoreKind::Postgres => {
                let name = format!("taskbroker_bench_{run}");
                connect(admin_url)
                    .await?
                    .batch_execute(&format!("CREATE DATABASE {name}"))
                    .await
                    .map_err(|err| format!("cannot create database {name}: {err}"))?;
                Ok(Scratch::Postgres {
                    admin_url: admin_url.to_owned(),
                    url: replace_database(admin_url, &name),
                    name,
                })
            }
            StoreKind::Sqlite => Ok(Scratch::Sqlite {
                path: std::env::temp_dir().join(format!("taskbroker-bench-{run}.sqlite")),
            }),
        }
    }

    /// The broker's store settings.
    pub fn broker_env(&self) -> Vec<(String, String)> {
        match self {
            Scratch::Postgres { url, .. } => {
                vec![("TASKBROKER_DATABASE_URL".to_owned(), url.clone())]
            }
            Scratch::Sqlite { path } => vec![(
                "TASKBROKER_SQLITE_PATH".to_owned(),
                path.display().to_string(),
            )],
        }
    }

    pub async fn remove(self) {
        match self {
            Scratch::Postgres {
                admin_url, name, ..
            } => {
                if let Ok(client) = connect(&admin_url).await {
                    let _ = client
                        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                        .await;
                }
            }
            Scratch::Sqlite { path } => {
                for file in taskbroker::store::SqliteStore::files(&path) {
                    let _ = std::fs::remove_file(file);
                }
            }
        }
    }
}

/// The Kafka names of one run: topic, dead-letter topic, consumer group.
pub struct Topics {
    pub topic: String,
    pub dlq: String,
    pub group: String,
}

impl Topics {
    pub fn new(prefix: &str, run: &str) -> Topics {
        Topics {
            topic: format!("{prefix}-{run}"),
            dlq: format!("{prefix}-{run}-dlq"),
            group: format!("{prefix}-{run}"),
        }
    }
}

/// Runs `scenario` on a scratch PostgreSQL database of its own (given the
/// scratch, its URL and this run's id), removed afterwards whatever the
/// outcome.
pub async fn on_scratch_postgres<F>(admin_url: &str, scenario: F) -> Result<(), String>
where
    F: AsyncFnOnce(&Scratch, &str, &str) -> Result<(), String>,
{
    let run = run_id();
    let scratch = Scratch::create(StoreKind::Postgres, admin_url, &run).await?;
    let result = match &scratch {
        Scratch::Postgres { url, .. } => scenario(&scratch, &url.clone(), &run).await,
        _ => Err("this scenario reads claims from PostgreSQL".to_owned()),
    };
    scratch.remove().await;
    result
}

/// A steady-inflow scenario's Kafka side: this run's topics (named after
/// `prefix`) on the mock cluster or `brokers`, and a producer to the main
/// topic.
pub fn inflow(
    prefix: &str,
    run: &str,
    brokers: Option<&str>,
    partitions: i32,
) -> Result<(Topics, Kafka, Producer), String> {
    let topics = Topics::new(prefix, run);
    let kafka = Kafka::start(brokers, &[&topics.topic, &topics.dlq], partitions)?;
    let producer = Producer::new(&kafka, &topics.topic, partitions, 1, Parameters::Small)?;
    Ok((topics, kafka, producer))
}

/// The broker settings every multi-process scenario starts from: its
/// store, Kafka and this run's topics, read from the earliest offset.
pub fn broker_env(scratch: &Scratch, kafka: &Kafka, topics: &Topics) -> Vec<(String, String)> {
    let mut env = scratch.broker_env();
    env.extend(kafka.broker_env());
    env.extend([
        ("TASKBROKER_KAFKA_BROKERS".to_owned(), kafka.brokers.clone()),
        ("TASKBROKER_KAFKA_TOPIC".to_owned(), topics.topic.clone()),
        ("TASKBROKER_KAFKA_DLQ_TOPIC".to_owned(), topics.dlq.clone()),
        (
            "TASKBROKER_KAFKA_CONSUMER_GROUP".to_owned(),
            topics.group.clone(),
        ),
        (
            "TASKBROKER_KAFKA_AUTO_OFFSET_RESET".to_owned(),
            "earliest".to_owned(),
        ),
    ]);
    env
}

/// A free loopback port (bound, then released).
pub fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|err| format!("no free port: {err}"))
}

/// `chosen` (`--broker-bin`), or else the `taskbroker` binary built beside
/// this one (`cargo build --release` builds both).
fn broker_binary(chosen: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(broker) = chosen {
        return if broker.is_file() {
            Ok(broker.to_owned())
        } else {
            Err(format!("--broker-bin: {} is not a file", broker.display()))
        };
    }
    let me = std::env::current_exe().map_err(|err| err.to_string())?;
    let broker = me.with_file_name("taskbroker");
    if broker.is_file() {
        Ok(broker)
    } else {
        Err(format!(
            "{} not found: build it with `cargo build --release` (the harness runs the real broker binary)",
            broker.display()
        ))
    }
}

/// The real broker, as a child process. Killed if dropped while running.
pub struct BrokerProcess {
    child: Child,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    pub log: PathBuf,
    /// Another broker of the protocol (`--broker-command`): it has no
    /// metrics the harness knows, and it is ready when its gRPC port is.
    external: bool,
}

impl BrokerProcess {
    /// Starts `taskbroker run` (the binary `services` name) with the user's
    /// environment plus `env`, and waits for `/health`. `TASKBROKER_LOG`
    /// defaults to `warn`.
    pub async fn start(
        services: &Services,
        env: &[(String, String)],
        run: &str,
    ) -> Result<BrokerProcess, String> {
        let grpc: SocketAddr = format!("127.0.0.1:{}", free_port()?)
            .parse()
            .map_err(|err| format!("{err}"))?;
        let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()?)
            .parse()
            .map_err(|err| format!("{err}"))?;
        let log = std::env::temp_dir().join(format!("taskbroker-bench-{run}-{}.log", grpc.port()));
        let log_file = std::fs::File::create(&log).map_err(|err| err.to_string())?;
        let mut command = Command::new(broker_binary(services.broker_bin.as_deref())?);
        command
            .arg("run")
            .env_remove("TASKBROKER_DATABASE_URL")
            .env("TASKBROKER_GRPC_ADDR", grpc.to_string())
            .env("TASKBROKER_GRPC_ADVERTISED_ADDR", grpc.to_string())
            .env("TASKBROKER_METRICS_ADDR", metrics.to_string())
            .env("TASKBROKER_RESTART_GRACE_SEC", "0")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().map_err(|err| err.to_string())?)
            .stderr(log_file);
        if std::env::var_os("TASKBROKER_LOG").is_none() {
            command.env("TASKBROKER_LOG", "warn");
        }
        // JSON lines, so warnings and errors can be counted.
        command.env("TASKBROKER_LOG_FORMAT", "json");
        command.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let child = command
            .spawn()
            .map_err(|err| format!("cannot start the broker: {err}"))?;
        let mut broker = BrokerProcess {
            child,
            grpc,
            metrics,
            log,
            external: false,
        };
        broker
            .wait_ready("become healthy", |broker| async move {
                matches!(http_get(broker, "/health").await, Ok((200, _)))
            })
            .await?;
        Ok(broker)
    }

    /// Polls `ready` (given the address it probes) every 50 ms for up to
    /// 60 s; fails at once if the process exits meanwhile.
    async fn wait_ready<F, Fut>(&mut self, what: &str, ready: F) -> Result<(), String>
    where
        F: Fn(SocketAddr) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let probed = if self.external {
            self.grpc
        } else {
            self.metrics
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "the broker exited at startup ({status}); its output: {}",
                    self.log.display()
                ));
            }
            if ready(probed).await {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the broker did not {what} within 60 s; its output: {}",
                    self.log.display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Starts another broker of the protocol: `command` through
    /// `sh -c 'exec …'`, with `env` (the settings this broker would get)
    /// plus `TASKBROKER_BENCH_GRPC_PORT`, and waits until `grpc` accepts
    /// connections. Its output goes to the log file.
    pub async fn start_external(
        command: &str,
        env: &[(String, String)],
        run: &str,
        grpc: SocketAddr,
    ) -> Result<BrokerProcess, String> {
        let log = std::env::temp_dir().join(format!("taskbroker-bench-{run}-external.log"));
        let log_file = std::fs::File::create(&log).map_err(|err| err.to_string())?;
        let child = Command::new("sh")
            .arg("-c")
            .arg(format!("exec {command}"))
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("TASKBROKER_BENCH_GRPC_PORT", grpc.port().to_string())
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().map_err(|err| err.to_string())?)
            .stderr(log_file)
            .spawn()
            .map_err(|err| format!("cannot start the broker command: {err}"))?;
        let mut broker = BrokerProcess {
            child,
            grpc,
            metrics: grpc,
            log,
            external: true,
        };
        broker
            .wait_ready(&format!("listen on {grpc}"), |grpc| async move {
                tokio::net::TcpStream::connect(grpc).await.is_ok()
            })
            .await?;
        Ok(broker)
    }

    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    pub fn is_external(&self) -> bool {
        self.external
    }

    /// This broker's `/metrics`; empty for an external broker.
    pub async fn scrape(&self) -> Result<String, String> {
        if self.external {
            return Ok(String::new());
        }
        match http_get(self.metrics, "/metrics").await {
            Ok((200, body)) => Ok(body),
            Ok((status, _)) => Err(format!("/metrics answered {status}")),
            Err(err) => Err(format!("/metrics: {err}")),
        }
    }

    /// Waits until the broker's consumer has partitions assigned. An
    /// external broker says nothing of it: the run starts at once, and its
    /// group join shows as latency of the first tasks.
    pub async fn wait_assigned(&self, limit: Duration) -> Result<(), String> {
        if self.external {
            return Ok(());
        }
        let deadline = Instant::now() + limit;
        loop {
            let text = self.scrape().await?;
            if metric(&text, "taskbroker_consumer_partitions_assigned", "") > 0.0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("the broker's consumer was assigned no partition".to_owned());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM, then waits for the graceful stop (killing it after 60 s).
    pub async fn stop(mut self) -> Result<(), String> {
        signal(&self.pid(), "TERM")?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => return Err(format!("the broker stopped with {status}")),
                Ok(None) if Instant::now() > deadline => {
                    let _ = self.child.kill();
                    return Err("the broker did not stop within 60 s of SIGTERM".to_owned());
                }
                Ok(None) => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(err) => return Err(err.to_string()),
            }
        }
    }

    /// WARN and ERROR lines in the broker's log so far.
    pub fn log_levels(&self) -> (usize, usize) {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let warn = text
            .lines()
            .filter(|l| l.contains(r#""level":"WARN""#))
            .count();
        let error = text
            .lines()
            .filter(|l| l.contains(r#""level":"ERROR""#))
            .count();
        (warn, error)
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Sends `kill -<name>` to `pid`.
pub fn signal(pid: &str, name: &str) -> Result<(), String> {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid)
        .status()
        .map_err(|err| format!("kill -{name} {pid}: {err}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill -{name} {pid} failed"))
    }
}

enum WorkerLine {
    Url(String),
    Ready,
    Summary(String),
}

/// `taskbroker-bench workers` as a child process.
pub struct WorkersProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    pub urls: Vec<String>,
    lines: mpsc::Receiver<WorkerLine>,
    delivered: Arc<AtomicU64>,
    reported: Arc<AtomicU64>,
}

impl WorkersProcess {
    /// Starts the workers with `args` (after `workers`) and waits for them
    /// to be ready.
    pub fn start(args: &[String]) -> Result<WorkersProcess, String> {
        let me = std::env::current_exe().map_err(|err| err.to_string())?;
        let mut child = Command::new(me)
            .arg("workers")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|err| format!("cannot start the workers: {err}"))?;
        let stdout = child.stdout.take().ok_or("workers without stdout")?;
        let (tx, lines) = mpsc::channel();
        let delivered = Arc::new(AtomicU64::new(0));
        let reported = Arc::new(AtomicU64::new(0));
        {
            let (delivered, reported) = (Arc::clone(&delivered), Arc::clone(&reported));
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let mut words = line.split_whitespace();
                    match words.next() {
                        Some("progress") => {
                            let mut next = || words.next().and_then(|w| w.parse().ok());
                            if let (Some(d), Some(r)) = (next(), next()) {
                                delivered.store(d, Ordering::Relaxed);
                                reported.store(r, Ordering::Relaxed);
                            }
                        }
                        Some("url") => {
                            let _ = tx.send(WorkerLine::Url(words.next().unwrap_or("").into()));
                        }
                        Some("ready") => {
                            let _ = tx.send(WorkerLine::Ready);
                        }
                        Some("summary") => {
                            let _ = tx.send(WorkerLine::Summary(line.clone()));
                        }
                        _ => {}
                    }
                }
            });
        }
        let mut workers = WorkersProcess {
            stdin: child.stdin.take(),
            child,
            urls: Vec::new(),
            lines,
            delivered,
            reported,
        };
        loop {
            match workers.lines.recv_timeout(Duration::from_secs(30)) {
                Ok(WorkerLine::Url(url)) => workers.urls.push(url),
                Ok(WorkerLine::Ready) => return Ok(workers),
                Ok(WorkerLine::Summary(_)) => {}
                Err(_) => return Err("the workers did not become ready".to_owned()),
            }
        }
    }

    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Relaxed)
    }

    pub fn reported(&self) -> u64 {
        self.reported.load(Ordering::Relaxed)
    }

    /// CPU seconds the workers have used so far.
    pub fn cpu_seconds(&self) -> f64 {
        crate::procstat::cpu_seconds(&self.pid())
    }

    /// Closes stdin and returns the summary's `key=value` pairs.
    pub fn finish(mut self) -> Result<HashMap<String, u64>, String> {
        drop(self.stdin.take());
        loop {
            match self.lines.recv_timeout(Duration::from_secs(30)) {
                Ok(WorkerLine::Summary(line)) => {
                    let _ = self.child.wait();
                    return Ok(line
                        .split_whitespace()
                        .filter_map(|pair| pair.split_once('='))
                        .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
                        .collect());
                }
                Ok(_) => {}
                Err(_) => return Err("the workers sent no summary".to_owned()),
            }
        }
    }

    /// SIGKILL: the ports refuse connections until new workers take them.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for WorkersProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The services a scenario runs against, and the broker binary it runs:
/// the same flags for every scenario that starts brokers.
#[derive(clap::Args, Debug, Clone)]
pub struct Services {
    /// A real Kafka instead of the in-process mock cluster.
    #[arg(long, env = "TASKBROKER_BENCH_KAFKA_BROKERS")]
    pub kafka_brokers: Option<String>,
    /// Server the scratch database is created on.
    #[arg(
        long,
        env = "TASKBROKER_TEST_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub admin_url: String,
    /// The broker binary to run: another build, to compare two builds with
    /// the same harness. Default: the `taskbroker` beside this binary.
    #[arg(long, env = "TASKBROKER_BENCH_BROKER")]
    pub broker_bin: Option<PathBuf>,
}
