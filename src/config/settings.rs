//! Every setting, declared once: the [`settings!`] list below is the single source of truth
//! for the table ([`SETTINGS`]), the [`Config`] fields, parsing into them and rendering them
//! back. Adding a setting is one entry here (plus, for a check across settings, a few lines in
//! `parse.rs`); `docs/configuration.md` is regenerated from it.

use std::fmt::{self, Display};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::ENV_PREFIX;
use super::allowed::{Allowed, Setting};
use super::declare::{settings, word_enum};
use super::endpoints::WorkerEndpoints;
use super::error::ConfigError;
use super::parse::{FromValue, Key, Value, Values};

word_enum! {
    /// How activations reach workers.
    DeliveryMode {
        /// The broker claims activations and pushes them to `WORKER_ENDPOINTS`.
        Push = "push",
        /// Workers fetch activations with GetTask.
        Pull = "pull",
    }
}

word_enum! {
    /// Format of log lines.
    LogFormat {
        /// Human-readable lines.
        Text = "text",
        /// One JSON object per line.
        Json = "json",
    }
}

word_enum! {
    /// Where the consumer starts on a partition without a committed offset; `as_str` is the
    /// librdkafka `auto.offset.reset` value.
    AutoOffsetReset {
        Earliest = "earliest",
        Latest = "latest",
    }
}

word_enum! {
    /// How the parameters of raw-topic tasks are written.
    RawCompression {
        /// zstd frame carrying its content size; header `compression-type: zstd`.
        Zstd = "zstd",
        /// Plain msgpack.
        None = "none",
    }
}

settings! {
    delivery_mode: DeliveryMode = DELIVERY_MODE {
        default: "push",
        allowed: Allowed::OneOf(DeliveryMode::WORDS),
        secret: false,
        render: text,
        description: "`push`: the broker pushes activations to `WORKER_ENDPOINTS`; `pull`: workers fetch them with GetTask.",
    },
    /// `None` means the embedded SQLite store. Secret.
    database_url: Option<String> = DATABASE_URL {
        default: "",
        allowed: Allowed::Url { schemes: &["postgres", "postgresql"] },
        secret: true,
        render: Option::clone,
        description: "PostgreSQL connection URL shared by all replicas; unset = embedded SQLite at `SQLITE_PATH` (single node). TLS as libpq: `?sslmode=` `disable`, `prefer` (default), `require`, `verify-ca` or `verify-full`, and `sslrootcert=` a PEM file of CA certificates (default: the built-in public roots).",
    },
    sqlite_path: PathBuf = SQLITE_PATH {
        default: "./taskbroker.sqlite",
        allowed: Allowed::Text,
        secret: false,
        render: |path| text(&path.display()),
        description: "File of the embedded SQLite store (WAL mode: `-wal` and `-shm` files sit beside it), created if missing; used only when `DATABASE_URL` is unset. Its directory must exist; one broker process per file (a second one refuses to start: the first holds `<file>.lock`).",
    },
    db_pool_size: usize = DB_POOL_SIZE {
        default: "16",
        allowed: Allowed::Integer { min: 1, max: 512 },
        secret: false,
        render: text,
        description: "Most PostgreSQL connections the broker holds open. With SQLite: read-only connections (at most 8) beside the one writer.",
    },
    db_async_commit: bool = DB_ASYNC_COMMIT {
        default: "false",
        allowed: Allowed::Bool,
        secret: false,
        render: text,
        description: "Commit replayable transitions (claim, mark processing, removal of finished rows) asynchronously: faster, but after a database crash some tasks run twice (none is lost); inserts and worker results stay durable. With SQLite, transactions holding only replayable transitions commit with `synchronous = NORMAL` instead of `FULL`.",
    },
    /// Comma-separated, as librdkafka's `bootstrap.servers` takes it.
    kafka_brokers: String = KAFKA_BROKERS {
        default: "127.0.0.1:9092",
        allowed: Allowed::HostPortList,
        secret: false,
        render: text,
        description: "Kafka bootstrap servers.",
    },
    kafka_topic: String = KAFKA_TOPIC {
        default: "taskworker",
        allowed: Allowed::KafkaTopic,
        secret: false,
        render: text,
        description: "Topic the task activations are consumed from, when `KAFKA_TOPICS` is unset.",
    },
    kafka_consumer_group: String = KAFKA_CONSUMER_GROUP {
        default: "taskbroker",
        allowed: Allowed::Text,
        secret: false,
        render: text,
        description: "Kafka consumer group of the first consumed topic (others: see `KAFKA_TOPICS`); replicas in the same group split the partitions.",
    },
    /// As given; use [`Config::retry_topic`].
    kafka_retry_topic: Option<String> = KAFKA_RETRY_TOPIC {
        default: "",
        allowed: Allowed::KafkaTopicAt,
        secret: false,
        render: Option::clone,
        description: "Topic retried activations are produced to, as `topic` or `topic@cluster`; unset = the first topic of `KAFKA_TOPICS`, or `KAFKA_TOPIC` when that is unset. May not be a raw topic.",
    },
    kafka_dlq_topic: String = KAFKA_DLQ_TOPIC {
        default: "taskworker-dlq",
        allowed: Allowed::KafkaTopicAt,
        secret: false,
        render: text,
        description: "Topic failed activations with `on_attempts_exceeded` = DEADLETTER are produced to, as `topic` or `topic@cluster`.",
    },
    kafka_ingest_dlq_topic: String = KAFKA_INGEST_DLQ_TOPIC {
        default: "taskworker-ingest-dlq",
        allowed: Allowed::KafkaTopicAt,
        secret: false,
        render: text,
        description: "Topic consumed records that cannot be decoded or fail validation are produced to, with their original bytes, as `topic` or `topic@cluster`.",
    },
    /// Validated items `topic[@cluster][#group]`; use [`Config::topology`].
    kafka_topics: Vec<String> = KAFKA_TOPICS {
        default: "",
        allowed: Allowed::TopicList,
        secret: false,
        render: |items| list(items),
        description: "Topics of TaskActivation records to consume, comma-separated, each `topic`, `topic@cluster` (a cluster of `KAFKA_CLUSTERS`) or either with `#group` (its consumer group; default `KAFKA_CONSUMER_GROUP` for the first topic and `KAFKA_CONSUMER_GROUP-<topic>` for each other, so one topic's rebalances never stall another's). Each gets a consumer of its own, with its own backpressure (`MAX_INFLIGHT` counts each topic's rows) and `topic` metrics label. Unset = `KAFKA_TOPIC` alone.",
    },
    /// `(name, bootstrap servers)` in order.
    kafka_clusters: Vec<(String, String)> = KAFKA_CLUSTERS {
        default: "",
        allowed: Allowed::KafkaClusters,
        secret: false,
        render: |items| clusters(items),
        description: "Kafka clusters besides the default one (`KAFKA_BROKERS`, `KAFKA_CONFIG`), as `name=host:port,host:port;name2=host:port`; names are letters, digits and `_`. The librdkafka properties of cluster `name` are `TASKBROKER_KAFKA_CLUSTER_<NAME>_CONFIG` (upper case, the format of `KAFKA_CONFIG`; never printed).",
    },
    /// `(topic[@cluster][#group], application/namespace/taskname)` in order.
    kafka_raw_topics: Vec<(String, String)> = KAFKA_RAW_TOPICS {
        default: "",
        allowed: Allowed::RawTopics,
        secret: false,
        render: |items| pairs(items),
        description: "Topics of plain payloads to consume, comma-separated `topic=application/namespace/taskname` (`topic` as in `KAFKA_TOPICS`): each record becomes a new task of that name whose only argument is the record's bytes, with an id derived from its cluster, topic, partition and offset (a replayed record is stored once). Consumed whether or not `KAFKA_TOPICS` lists the topic.",
    },
    kafka_raw_deadline: Duration = KAFKA_RAW_DEADLINE_SEC {
        default: "30",
        allowed: Allowed::Seconds { min: 1, max: 86_400 },
        secret: false,
        render: secs,
        description: "`processing_deadline_duration` of tasks made from raw-topic records.",
    },
    kafka_raw_compression: RawCompression = KAFKA_RAW_COMPRESSION {
        default: "zstd",
        allowed: Allowed::OneOf(RawCompression::WORDS),
        secret: false,
        render: text,
        description: "`parameters_bytes` of raw-topic tasks: `zstd` (a frame with its content size, header `compression-type: zstd`) or `none` (plain msgpack).",
    },
    kafka_auto_offset_reset: AutoOffsetReset = KAFKA_AUTO_OFFSET_RESET {
        default: "earliest",
        allowed: Allowed::OneOf(AutoOffsetReset::WORDS),
        secret: false,
        render: text,
        description: "Where the consumer starts on a partition without a committed offset.",
    },
    /// In the given order. Secret.
    kafka_config: Vec<(String, String)> = KAFKA_CONFIG {
        default: "",
        allowed: Allowed::KafkaProperties,
        secret: true,
        render: |items| pairs(items),
        description: "Extra librdkafka properties for the consumer and every producer, e.g. `security.protocol=SASL_SSL,sasl.mechanism=SCRAM-SHA-512,sasl.username=u,sasl.password=p,ssl.ca.location=/etc/kafka/ca.pem`. librdkafka is built with TLS and SASL (PLAIN, SCRAM-SHA-256/512, OAUTHBEARER; not GSSAPI or OIDC); with TLS on and no `ssl.ca.location`, the system's CA bundle is used. Values may not contain commas. Never printed.",
    },
    grpc_addr: SocketAddr = GRPC_ADDR {
        default: "0.0.0.0:50051",
        allowed: Allowed::SocketAddr,
        secret: false,
        render: text,
        description: "Address the gRPC server (ConsumerService, health) listens on.",
    },
    grpc_tls_cert: Option<PathBuf> = GRPC_TLS_CERT {
        default: "",
        allowed: Allowed::Text,
        secret: false,
        render: path,
        description: "PEM certificate chain (leaf first) the gRPC server presents; set with `GRPC_TLS_KEY` to serve TLS only (HTTP/2 over TLS, health checks included). Re-read every second: a changed pair that loads is used for new connections without a restart; one that does not is logged and the previous one kept.",
    },
    grpc_tls_key: Option<PathBuf> = GRPC_TLS_KEY {
        default: "",
        allowed: Allowed::Text,
        secret: false,
        render: path,
        description: "PEM private key of `GRPC_TLS_CERT`; set together with it. Only the path is ever printed.",
    },
    grpc_tls_client_ca: Option<PathBuf> = GRPC_TLS_CLIENT_CA {
        default: "",
        allowed: Allowed::Text,
        secret: false,
        render: path,
        description: "PEM file of CA certificates; when set (with `GRPC_TLS_CERT`/`GRPC_TLS_KEY`), every client (workers, health checkers) must present a certificate chaining to one of them (mTLS).",
    },
    /// As given; use [`Config::advertised_addr`].
    grpc_advertised_addr: Option<String> = GRPC_ADVERTISED_ADDR {
        default: "",
        allowed: Allowed::HostPort,
        secret: false,
        render: Option::clone,
        description: "Address workers reach this broker at, sent as `callback_url` in PushTask; unset = host name and the `GRPC_ADDR` port.",
    },
    metrics_addr: SocketAddr = METRICS_ADDR {
        default: "0.0.0.0:9090",
        allowed: Allowed::SocketAddr,
        secret: false,
        render: text,
        description: "Address the Prometheus `/metrics` endpoint listens on.",
    },
    /// Empty means signing is off. Secret.
    grpc_shared_secrets: Vec<String> = GRPC_SHARED_SECRETS {
        default: "",
        allowed: Allowed::List,
        secret: true,
        render: |items| list(items),
        description: "Request-signing secrets: a request signed with any of them is accepted, pushes are signed with the first; unset = signing off.",
    },
    grpc_max_request_bytes: usize = GRPC_MAX_REQUEST_BYTES {
        default: "8454144",
        allowed: Allowed::Bytes { min: 1024, max: 268_435_456 },
        secret: false,
        render: text,
        description: "Largest gRPC request message the broker accepts (8 MiB + 64 KiB: a request carrying a task of `MAX_ACTIVATION_BYTES`). Responses are not limited: `GetTask` sends tasks of any stored size, and the worker's own receive limit must take them (docs/operations.md, \"Task sizes\").",
    },
    worker_endpoints: WorkerEndpoints = WORKER_ENDPOINTS {
        default: "",
        allowed: Allowed::WorkerEndpoints,
        secret: false,
        render: |endpoints| text(&endpoints.redacted()),
        description: "Push mode (required there): worker URLs per application; `*` serves applications without their own entry; pushes are spread over an application's URLs.",
    },
    worker_tls_ca: Option<PathBuf> = WORKER_TLS_CA {
        default: "",
        allowed: Allowed::Text,
        secret: false,
        render: path,
        description: "PEM file of CA certificates that `https://` worker URLs are verified against, besides the system's roots; unset = system roots only. Read at startup: a file that cannot be read or parsed stops the broker.",
    },
    worker_tls_cert: Option<PathBuf> = WORKER_TLS_CERT {
        default: "",
        allowed: Allowed::Text,
        secret: false,
        render: path,
        description: "PEM file of the client certificate (chain) the broker presents to `https://` workers that require one (mTLS); set together with `WORKER_TLS_KEY`.",
    },
    worker_tls_key: Option<PathBuf> = WORKER_TLS_KEY {
        default: "",
        allowed: Allowed::Text,
        secret: false,
        render: path,
        description: "PEM file of the private key of `WORKER_TLS_CERT`; set together with it. Only the path is ever printed.",
    },
    worker_connections: usize = WORKER_CONNECTIONS {
        default: "8",
        allowed: Allowed::Integer { min: 1, max: 256 },
        secret: false,
        render: text,
        description: "Connections kept to each worker URL, spread over the addresses its host name resolves to (at least one per address); each push goes to the less loaded of two drawn at random. Behind a ClusterIP Service (kube-proxy balances per connection) it bounds how many pods one broker reaches; behind a headless Service every pod gets at least one.",
    },
    worker_dns_refresh: Duration = WORKER_DNS_REFRESH_MS {
        default: "5000",
        allowed: Allowed::Millis { min: 100, max: 3_600_000 },
        secret: false,
        render: ms,
        description: "How often worker host names are resolved again: pods added behind a headless Service get pushes, and removed ones are dropped, within this interval. A failed lookup keeps the previous addresses.",
    },
    fetch_actors: usize = FETCH_ACTORS {
        default: "2",
        allowed: Allowed::PowerOfTwo { min: 1, max: 256 },
        secret: false,
        render: text,
        description: "Number of FetchActors; each claims from an equal share of the 256 buckets.",
    },
    fetch_batch_size: usize = FETCH_BATCH_SIZE {
        default: "64",
        allowed: Allowed::Integer { min: 1, max: 1024 },
        secret: false,
        render: text,
        description: "Most Pending activations a FetchActor claims in one statement.",
    },
    fetch_batch_bytes: usize = FETCH_BATCH_BYTES {
        default: "16777216",
        allowed: Allowed::Bytes { min: 1024, max: 1_073_741_824 },
        secret: false,
        render: text,
        description: "Most activation bytes a FetchActor claims in one statement: the claim stops adding rows (oldest first) once their bytes reach this, and always takes at least one, so a FetchActor holds at most this plus one task.",
    },
    fair_dispatch: bool = FAIR_DISPATCH {
        default: "true",
        allowed: Allowed::Bool,
        secret: false,
        render: text,
        description: "Push claims interleave namespaces: each (application, namespace) with Pending tasks gets a share of every batch in proportion to its weight (`weights` in the runtime file; 1 unless listed), so a flood in one namespace does not delay the others; shares left unused are filled oldest first. `false`: oldest first, whatever the namespace. Pull mode always hands out the oldest match.",
    },
    fetch_backoff: Duration = FETCH_BACKOFF_MS {
        default: "100",
        allowed: Allowed::Millis { min: 1, max: 60_000 },
        secret: false,
        render: ms,
        description: "Pause of a FetchActor after a claim that found fewer rows than asked for, or a failed submit to the push pool. While claims keep finding nothing the pause doubles, up to 1 s (or this value, if larger); new rows wake fetchers at once regardless.",
    },
    push_concurrency: usize = PUSH_CONCURRENCY {
        default: "64",
        allowed: Allowed::Integer { min: 1, max: 4096 },
        secret: false,
        render: text,
        description: "Most PushTask RPCs in flight at once.",
    },
    push_queue_size: usize = PUSH_QUEUE_SIZE {
        default: "128",
        allowed: Allowed::Integer { min: 1, max: 65_536 },
        secret: false,
        render: text,
        description: "Mailbox capacity of the push pool: activations waiting for a push slot.",
    },
    push_queue_bytes: usize = PUSH_QUEUE_BYTES {
        default: "67108864",
        allowed: Allowed::Bytes { min: 1024, max: 17_179_869_184 },
        secret: false,
        render: text,
        description: "Most activation bytes in the push pool (64 MiB): waiting in its mailbox and being pushed, together. A FetchActor whose next task would pass it waits as on a full mailbox (`PUSH_QUEUE_TIMEOUT_MS`, then the release); a pool holding nothing always takes one task, whatever its size.",
    },
    push_queue_timeout: Duration = PUSH_QUEUE_TIMEOUT_MS {
        default: "2000",
        allowed: Allowed::Millis { min: 1, max: 300_000 },
        secret: false,
        render: ms,
        description: "How long a FetchActor may take to hand its claimed batch to a full push pool, counted from the claim; what is not handed over by then is released in one statement.",
    },
    push_timeout: Duration = PUSH_TIMEOUT_MS {
        default: "5000",
        allowed: Allowed::Millis { min: 100, max: 300_000 },
        secret: false,
        render: ms,
        description: "Deadline of one PushTask RPC.",
    },
    /// As given; use [`Config::claim_lease`].
    claim_lease_override: Option<Duration> = CLAIM_LEASE_MS {
        default: "",
        allowed: Allowed::Millis { min: 1000, max: 86_400_000 },
        secret: false,
        render: |lease| lease.as_ref().and_then(ms),
        description: "How long a claimed activation stays Claimed without a push result; unset = `PUSH_QUEUE_TIMEOUT_MS` + ⌈(`PUSH_QUEUE_SIZE` + `FETCH_ACTORS` + 1) / `PUSH_CONCURRENCY`⌉ × `PUSH_TIMEOUT_MS` + `PUSH_TIMEOUT_MS` + 5000; at least that without the 5000.",
    },
    insert_batch_size: usize = INSERT_BATCH_SIZE {
        default: "256",
        allowed: Allowed::Integer { min: 1, max: 1024 },
        secret: false,
        render: text,
        description: "Most consumed activations written in one insert statement.",
    },
    insert_batch_bytes: usize = INSERT_BATCH_BYTES {
        default: "16777216",
        allowed: Allowed::Bytes { min: 1024, max: 1_073_741_824 },
        secret: false,
        render: text,
        description: "Most record bytes a consumer collects before it writes the batch: a batch is written once it holds `INSERT_BATCH_SIZE` records or this many bytes, so it holds at most this plus one record.",
    },
    insert_batch_max_wait: Duration = INSERT_BATCH_MAX_MS {
        default: "0",
        allowed: Allowed::Millis { min: 0, max: 10_000 },
        secret: false,
        render: ms,
        description: "Longest a partial insert batch waits for more records. 0: it is written as soon as Kafka has no more records ready, so batches grow with the load (one record at a trickle, up to `INSERT_BATCH_SIZE` when records pile up while the previous insert runs) and a record waits for no timer; a positive value trades that latency for fewer, fuller inserts at low rates.",
    },
    max_activation_bytes: usize = MAX_ACTIVATION_BYTES {
        default: "8388608",
        allowed: Allowed::Bytes { min: 1024, max: 67_108_864 },
        secret: false,
        render: text,
        description: "Largest TaskActivation record accepted from Kafka (8 MiB); larger ones go whole to the ingest dead-letter topic. Retry and dead-letter producers accept records of this size plus 64 KiB (`message.max.bytes`), the ingest dead-letter producer any record a consumer can read, unless `KAFKA_CONFIG` sets it; topics and workers must take this size too (docs/operations.md, \"Task sizes\").",
    },
    max_inflight: usize = MAX_INFLIGHT {
        default: "30000",
        allowed: Allowed::Integer { min: 1, max: 100_000_000 },
        secret: false,
        render: text,
        description: "High watermark of rows in the store; above it the consumer pauses its partitions. A few seconds of delivery is enough: a larger table only makes tasks wait in it instead of in Kafka (see BENCHMARKS.md, issue 16).",
    },
    max_inflight_bytes: u64 = MAX_INFLIGHT_BYTES {
        default: "2147483648",
        allowed: Allowed::Bytes { min: 0, max: 1_099_511_627_776 },
        secret: false,
        render: text,
        description: "High watermark of activation bytes the store holds per consumed topic (2 GiB; every status until upkeep removes the row): at or above it the topic's consumer pauses its partitions, below 90 % of it it resumes, as with `MAX_INFLIGHT`. 0 turns the byte bound off.",
    },
    max_processing_attempts: u32 = MAX_PROCESSING_ATTEMPTS {
        default: "5",
        allowed: Allowed::Integer { min: 1, max: 1000 },
        secret: false,
        render: text,
        description: "Processing attempts after which upkeep fails a Pending activation; releases of a claim never count.",
    },
    processing_deadline_grace: Duration = PROCESSING_DEADLINE_GRACE_SEC {
        default: "3",
        allowed: Allowed::Seconds { min: 0, max: 3600 },
        secret: false,
        render: secs,
        description: "Added to an activation's `processing_deadline_duration` before upkeep treats it as overdue.",
    },
    max_delay: Duration = MAX_DELAY_SEC {
        default: "3600",
        allowed: Allowed::Seconds { min: 0, max: 2_592_000 },
        secret: false,
        render: secs,
        description: "Longest `delay` or `delay_on_retry` honoured; longer delays are shortened to it.",
    },
    upkeep_interval: Duration = UPKEEP_INTERVAL_MS {
        default: "1000",
        allowed: Allowed::Millis { min: 10, max: 600_000 },
        secret: false,
        render: ms,
        description: "Time between upkeep runs.",
    },
    upkeep_batch_limit: usize = UPKEEP_BATCH_LIMIT {
        default: "1000",
        allowed: Allowed::Integer { min: 1, max: 100_000 },
        secret: false,
        render: text,
        description: "LIMIT of every upkeep statement, so one upkeep run stays bounded.",
    },
    restart_grace: Duration = RESTART_GRACE_SEC {
        default: "60",
        allowed: Allowed::Seconds { min: 0, max: 3600 },
        secret: false,
        render: secs,
        description: "After a cold start (no other broker's heartbeat was live when this one registered, as always on SQLite), upkeep waits this long before expiring processing deadlines, so workers can report results held while no broker was up. Claims never wait for it: a restarted broker's own claims are released at startup, a silent peer's at takeover, and expired leases at once.",
    },
    /// `None`: derived at startup (`Config::broker_id`).
    broker_id: Option<String> = BROKER_ID {
        default: "",
        allowed: Allowed::Text,
        secret: false,
        render: Option::clone,
        description: "This broker's identity in the store: every claim records it, and a broker that starts with the id of one that died releases that one's claims at once. Must be unique among running brokers and at most 253 bytes of printable ASCII. Unset = the pod name (`HOSTNAME`) when running in Kubernetes (stable across container restarts; set it from the StatefulSet pod name to keep it across pod restarts too), else a fresh id per start.",
    },
    heartbeat_interval: Duration = HEARTBEAT_INTERVAL_MS {
        default: "1000",
        allowed: Allowed::Millis { min: 100, max: 60_000 },
        secret: false,
        render: ms,
        description: "How often a broker refreshes its heartbeat row and looks for silent peers to take over.",
    },
    takeover_timeout: Duration = TAKEOVER_TIMEOUT_MS {
        default: "3000",
        allowed: Allowed::Millis { min: 300, max: 600_000 },
        secret: false,
        render: ms,
        description: "A broker whose heartbeat is older than this is presumed dead: a peer removes its row and releases its claims at once. At least 3 × `HEARTBEAT_INTERVAL_MS`. A broker stops claiming and pushing when its own last accepted heartbeat is older than this less one interval, so a frozen broker never pushes what a peer took over.",
    },
    metrics_top_namespaces: usize = METRICS_TOP_NAMESPACES {
        default: "10",
        allowed: Allowed::Integer { min: 1, max: 200 },
        secret: false,
        render: text,
        description: "How many namespaces get series of their own on the per-namespace metrics (`taskbroker_namespace_activations`, `taskbroker_namespace_max_lag_seconds`, `taskbroker_namespace_results_total`): those with the most unfinished tasks; the rest are summed as `other`, so the series stay bounded.",
    },
    runtime_config: Option<PathBuf> = RUNTIME_CONFIG {
        default: "",
        allowed: Allowed::Text,
        secret: false,
        render: path,
        description: "YAML file of operators' rules applied while the broker runs (killswitches, paused applications and namespaces, demoted namespaces, concurrency limits; see docs/operations.md, \"Runtime rules\"), re-read within a second of a change; unset = no rules. A file that cannot be read or is invalid stops startup; later, a bad version is logged and counted and the last good one stays in force.",
    },
    shutdown_timeout: Duration = SHUTDOWN_TIMEOUT_MS {
        default: "30000",
        allowed: Allowed::Millis { min: 1000, max: 600_000 },
        secret: false,
        render: ms,
        description: "Longest a graceful shutdown (SIGTERM, SIGINT) may take; must exceed `PUSH_TIMEOUT_MS`.",
    },
    /// Its syntax is checked where the subscriber is built.
    log: String = LOG {
        default: "info",
        allowed: Allowed::LogFilter,
        secret: false,
        render: text,
        description: "What is logged (to stderr): a level, or `tracing` filter directives, e.g. `info,taskbroker=debug`.",
    },
    log_format: LogFormat = LOG_FORMAT {
        default: "text",
        allowed: Allowed::OneOf(LogFormat::WORDS),
        secret: false,
        render: text,
        description: "Log line format.",
    },
}

/// Renders a value with its `Display` form.
fn text(value: &impl Display) -> Option<String> {
    Some(value.to_string())
}

/// A duration in whole milliseconds.
/// A file setting shows its path, never the file's contents.
fn path(path: &Option<PathBuf>) -> Option<String> {
    path.as_ref().map(|path| path.display().to_string())
}

fn ms(duration: &Duration) -> Option<String> {
    Some(duration.as_millis().to_string())
}

/// A duration in whole seconds.
fn secs(duration: &Duration) -> Option<String> {
    Some(duration.as_secs().to_string())
}

/// Comma-separated items; `None` (unset) when there are none.
fn list(items: &[String]) -> Option<String> {
    (!items.is_empty()).then(|| items.join(","))
}

/// `name=servers;name2=servers`; `None` (unset) when there are none.
fn clusters(items: &[(String, String)]) -> Option<String> {
    (!items.is_empty()).then(|| {
        items
            .iter()
            .map(|(name, servers)| format!("{name}={servers}"))
            .collect::<Vec<_>>()
            .join(";")
    })
}

/// Comma-separated `key=value` pairs; `None` (unset) when there are none.
fn pairs(pairs: &[(String, String)]) -> Option<String> {
    list(
        &pairs
            .iter()
            .map(|(key, value)| format!("{key}={value}"))
            .collect::<Vec<_>>(),
    )
}

/// The table entry for `name` (without the prefix).
pub fn setting(name: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|setting| setting.name == name)
}

/// The `TASKBROKER_*` names among `vars` that are not settings (typos), sorted, for a startup
/// warning. `from_lookup` cannot enumerate the environment, so it cannot catch them itself.
/// In a `test-hooks` build the test switches of [`test_hooks`](super::test_hooks) are known
/// too; in any other build they are reported like every other unknown name.
pub fn unknown_variables(vars: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut unknown: Vec<String> = vars
        .into_iter()
        .filter(|var| {
            var.strip_prefix(ENV_PREFIX)
                .is_some_and(|name| setting(name).is_none())
        })
        .filter(|var| !super::topics::is_cluster_config_variable(var))
        .filter(|var| !is_test_hook(var))
        .collect();
    unknown.sort();
    unknown.dedup();
    unknown
}

#[cfg(feature = "test-hooks")]
fn is_test_hook(variable: &str) -> bool {
    super::test_hooks::VARIABLES.contains(&variable)
}

#[cfg(not(feature = "test-hooks"))]
fn is_test_hook(_variable: &str) -> bool {
    false
}
