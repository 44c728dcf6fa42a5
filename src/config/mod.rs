//! Configuration: every `TASKBROKER_*` environment variable, described once in [`SETTINGS`].
//!
//! The table is the single source of truth. Parsing reads every entry generically (each
//! [`Allowed`] constraint knows how to parse and how to describe itself), `docs/configuration.md`
//! is generated from it by [`reference_markdown`] (a test keeps the committed file in sync), and
//! [`Config::render_effective`] walks it to print what the broker runs with, secrets redacted.
//!
//! Validation reports every problem at once, each naming the variable, the value and what is
//! allowed, so an operator fixes a deployment in one round trip instead of one per typo.
//!
//! This module is a leaf: it imports nothing from the rest of the crate.

mod endpoints;
mod reference;

pub use endpoints::{WorkerEndpoints, redact_url};
pub use reference::reference_markdown;

use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Prefix of every variable the broker reads.
pub const ENV_PREFIX: &str = "TASKBROKER_";

/// Slack added to the derived claim lease for the mark-processing write after a push succeeds.
pub const CLAIM_LEASE_MARGIN: Duration = Duration::from_millis(5000);

/// Shown instead of the value of a secret setting.
pub const REDACTED: &str = "<redacted>";

/// librdkafka properties the broker sets from its own variables; `KAFKA_CONFIG` may not override
/// them (an `enable.auto.commit=true` would commit offsets before rows are stored).
const BROKER_OWNED_KAFKA_KEYS: &[&str] = &[
    "bootstrap.servers",
    "group.id",
    "auto.offset.reset",
    "enable.auto.commit",
];

/// One environment variable: its name without [`ENV_PREFIX`], default, constraint and docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    /// Name without the prefix, e.g. `FETCH_BATCH_SIZE`.
    pub name: &'static str,
    /// The default as it would be written in the environment; empty means unset (or derived).
    pub default: &'static str,
    /// What values are accepted.
    pub allowed: Allowed,
    /// One line for the docs.
    pub description: &'static str,
    /// Never printed: redacted in errors, `render_effective` and `Debug`.
    pub secret: bool,
}

impl Setting {
    /// The full variable name, e.g. `TASKBROKER_FETCH_BATCH_SIZE`.
    pub fn variable(&self) -> String {
        format!("{ENV_PREFIX}{}", self.name)
    }
}

/// The values a setting accepts. Drives parsing, error messages and the docs' "Allowed" column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowed {
    /// A whole number in `min..=max`.
    Integer { min: u64, max: u64 },
    /// A power of two in `min..=max`.
    PowerOfTwo { min: u64, max: u64 },
    /// A whole number of milliseconds in `min..=max`.
    Millis { min: u64, max: u64 },
    /// A whole number of seconds in `min..=max`.
    Seconds { min: u64, max: u64 },
    /// `true` or `false`.
    Bool,
    /// One of these words (ASCII case ignored).
    OneOf(&'static [&'static str]),
    /// A URL starting with one of these schemes (without `://`).
    Url { schemes: &'static [&'static str] },
    /// An `ip:port` socket address to bind.
    SocketAddr,
    /// A `host:port` address others connect to.
    HostPort,
    /// Comma-separated `host:port` addresses.
    HostPortList,
    /// A Kafka topic name.
    KafkaTopic,
    /// Comma-separated `key=value` librdkafka properties, minus the keys the broker owns.
    KafkaProperties,
    /// Comma-separated items, none empty.
    List,
    /// The [`WorkerEndpoints`] format.
    WorkerEndpoints,
    /// Any text.
    Text,
}

/// Every setting, in the order of the docs and of `render_effective`.
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: "DELIVERY_MODE",
        default: "push",
        allowed: Allowed::OneOf(DeliveryMode::WORDS),
        description: "`push`: the broker pushes activations to `WORKER_ENDPOINTS`; `pull`: workers fetch them with GetTask.",
        secret: false,
    },
    Setting {
        name: "DATABASE_URL",
        default: "",
        allowed: Allowed::Url {
            schemes: &["postgres", "postgresql"],
        },
        description: "PostgreSQL connection URL shared by all replicas; unset = embedded SQLite at `SQLITE_PATH` (single node).",
        secret: true,
    },
    Setting {
        name: "SQLITE_PATH",
        default: "./taskbroker.sqlite",
        allowed: Allowed::Text,
        description: "File of the embedded SQLite store (WAL mode: `-wal` and `-shm` files sit beside it), created if missing; used only when `DATABASE_URL` is unset. Its directory must exist; one broker process per file (a second one refuses to start: the first holds `<file>.lock`).",
        secret: false,
    },
    Setting {
        name: "DB_POOL_SIZE",
        default: "16",
        allowed: Allowed::Integer { min: 1, max: 512 },
        description: "Most PostgreSQL connections the broker holds open. With SQLite: read-only connections (at most 8) beside the one writer.",
        secret: false,
    },
    Setting {
        name: "DB_ASYNC_COMMIT",
        default: "false",
        allowed: Allowed::Bool,
        description: "Commit replayable transitions (claim, mark processing, removal of finished rows) asynchronously: faster, but after a database crash some tasks run twice (none is lost); inserts and worker results stay durable. With SQLite, transactions holding only replayable transitions commit with `synchronous = NORMAL` instead of `FULL`.",
        secret: false,
    },
    Setting {
        name: "KAFKA_BROKERS",
        default: "127.0.0.1:9092",
        allowed: Allowed::HostPortList,
        description: "Kafka bootstrap servers.",
        secret: false,
    },
    Setting {
        name: "KAFKA_TOPIC",
        default: "taskworker",
        allowed: Allowed::KafkaTopic,
        description: "Topic the task activations are consumed from.",
        secret: false,
    },
    Setting {
        name: "KAFKA_CONSUMER_GROUP",
        default: "taskbroker",
        allowed: Allowed::Text,
        description: "Kafka consumer group; replicas in the same group split the partitions.",
        secret: false,
    },
    Setting {
        name: "KAFKA_RETRY_TOPIC",
        default: "",
        allowed: Allowed::KafkaTopic,
        description: "Topic retried activations are produced to; unset = `KAFKA_TOPIC`.",
        secret: false,
    },
    Setting {
        name: "KAFKA_DLQ_TOPIC",
        default: "taskworker-dlq",
        allowed: Allowed::KafkaTopic,
        description: "Topic failed activations with `on_attempts_exceeded` = DEADLETTER are produced to.",
        secret: false,
    },
    Setting {
        name: "KAFKA_INGEST_DLQ_TOPIC",
        default: "taskworker-ingest-dlq",
        allowed: Allowed::KafkaTopic,
        description: "Topic consumed records that cannot be decoded or fail validation are produced to, with their original bytes.",
        secret: false,
    },
    Setting {
        name: "KAFKA_AUTO_OFFSET_RESET",
        default: "earliest",
        allowed: Allowed::OneOf(AutoOffsetReset::WORDS),
        description: "Where the consumer starts on a partition without a committed offset.",
        secret: false,
    },
    Setting {
        name: "KAFKA_CONFIG",
        default: "",
        allowed: Allowed::KafkaProperties,
        description: "Extra librdkafka properties for the consumer and the producers, e.g. `sasl.mechanism=PLAIN,sasl.username=u,sasl.password=p`. TLS (`security.protocol=SSL` or `SASL_SSL`) is not available: this build compiles librdkafka without OpenSSL.",
        secret: true,
    },
    Setting {
        name: "GRPC_ADDR",
        default: "0.0.0.0:50051",
        allowed: Allowed::SocketAddr,
        description: "Address the gRPC server (ConsumerService, health) listens on.",
        secret: false,
    },
    Setting {
        name: "GRPC_ADVERTISED_ADDR",
        default: "",
        allowed: Allowed::HostPort,
        description: "Address workers reach this broker at, sent as `callback_url` in PushTask; unset = host name and the `GRPC_ADDR` port.",
        secret: false,
    },
    Setting {
        name: "METRICS_ADDR",
        default: "0.0.0.0:9090",
        allowed: Allowed::SocketAddr,
        description: "Address the Prometheus `/metrics` endpoint listens on.",
        secret: false,
    },
    Setting {
        name: "GRPC_SHARED_SECRETS",
        default: "",
        allowed: Allowed::List,
        description: "Request-signing secrets: a request signed with any of them is accepted, pushes are signed with the first; unset = signing off.",
        secret: true,
    },
    Setting {
        name: "GRPC_MAX_REQUEST_BYTES",
        default: "4194304",
        allowed: Allowed::Integer {
            min: 1024,
            max: 268_435_456,
        },
        description: "Largest gRPC request message the broker accepts.",
        secret: false,
    },
    Setting {
        name: "WORKER_ENDPOINTS",
        default: "",
        allowed: Allowed::WorkerEndpoints,
        description: "Push mode (required there): worker URLs per application; `*` serves applications without their own entry; pushes are spread over an application's URLs.",
        secret: false,
    },
    Setting {
        name: "FETCH_ACTORS",
        default: "2",
        allowed: Allowed::PowerOfTwo { min: 1, max: 256 },
        description: "Number of FetchActors; each claims from an equal share of the 256 buckets.",
        secret: false,
    },
    Setting {
        name: "FETCH_BATCH_SIZE",
        default: "64",
        allowed: Allowed::Integer { min: 1, max: 1024 },
        description: "Most Pending activations a FetchActor claims in one statement.",
        secret: false,
    },
    Setting {
        name: "FETCH_BACKOFF_MS",
        default: "100",
        allowed: Allowed::Millis {
            min: 1,
            max: 60_000,
        },
        description: "Pause of a FetchActor after an empty claim or a failed submit to the push pool.",
        secret: false,
    },
    Setting {
        name: "PUSH_CONCURRENCY",
        default: "64",
        allowed: Allowed::Integer { min: 1, max: 4096 },
        description: "Most PushTask RPCs in flight at once.",
        secret: false,
    },
    Setting {
        name: "PUSH_QUEUE_SIZE",
        default: "128",
        allowed: Allowed::Integer {
            min: 1,
            max: 65_536,
        },
        description: "Mailbox capacity of the push pool: activations waiting for a push slot.",
        secret: false,
    },
    Setting {
        name: "PUSH_QUEUE_TIMEOUT_MS",
        default: "2000",
        allowed: Allowed::Millis {
            min: 1,
            max: 300_000,
        },
        description: "How long a FetchActor may take to hand its claimed batch to a full push pool, counted from the claim; what is not handed over by then is released in one statement.",
        secret: false,
    },
    Setting {
        name: "PUSH_TIMEOUT_MS",
        default: "5000",
        allowed: Allowed::Millis {
            min: 100,
            max: 300_000,
        },
        description: "Deadline of one PushTask RPC.",
        secret: false,
    },
    Setting {
        name: "CLAIM_LEASE_MS",
        default: "",
        allowed: Allowed::Millis {
            min: 1000,
            max: 86_400_000,
        },
        description: "How long a claimed activation stays Claimed without a push result; unset = `PUSH_QUEUE_TIMEOUT_MS` + ⌈(`PUSH_QUEUE_SIZE` + `FETCH_ACTORS` + 1) / `PUSH_CONCURRENCY`⌉ × `PUSH_TIMEOUT_MS` + `PUSH_TIMEOUT_MS` + 5000; at least that without the 5000.",
        secret: false,
    },
    Setting {
        name: "INSERT_BATCH_SIZE",
        default: "256",
        allowed: Allowed::Integer { min: 1, max: 1024 },
        description: "Most consumed activations written in one insert statement.",
        secret: false,
    },
    Setting {
        name: "INSERT_BATCH_MAX_MS",
        default: "0",
        allowed: Allowed::Millis {
            min: 0,
            max: 10_000,
        },
        description: "Longest a partial insert batch waits for more records. 0: it is written as soon as Kafka has no more records ready, so batches grow with the load (one record at a trickle, up to `INSERT_BATCH_SIZE` when records pile up while the previous insert runs) and a record waits for no timer; a positive value trades that latency for fewer, fuller inserts at low rates.",
        secret: false,
    },
    Setting {
        name: "MAX_ACTIVATION_BYTES",
        default: "1048576",
        allowed: Allowed::Integer {
            min: 1024,
            max: 67_108_864,
        },
        description: "Largest TaskActivation record accepted from Kafka; larger ones go to the ingest dead-letter topic, cut 4 KiB below this size. Every producer accepts records of this size plus 64 KiB (`message.max.bytes`) unless `KAFKA_CONFIG` sets it.",
        secret: false,
    },
    Setting {
        name: "MAX_INFLIGHT",
        default: "100000",
        allowed: Allowed::Integer {
            min: 1,
            max: 100_000_000,
        },
        description: "High watermark of rows in the store; above it the consumer pauses its partitions.",
        secret: false,
    },
    Setting {
        name: "MAX_PROCESSING_ATTEMPTS",
        default: "5",
        allowed: Allowed::Integer { min: 1, max: 1000 },
        description: "Processing attempts after which upkeep fails a Pending activation; releases of a claim never count.",
        secret: false,
    },
    Setting {
        name: "PROCESSING_DEADLINE_GRACE_SEC",
        default: "3",
        allowed: Allowed::Seconds { min: 0, max: 3600 },
        description: "Added to an activation's `processing_deadline_duration` before upkeep treats it as overdue.",
        secret: false,
    },
    Setting {
        name: "MAX_DELAY_SEC",
        default: "3600",
        allowed: Allowed::Seconds {
            min: 0,
            max: 2_592_000,
        },
        description: "Longest `delay` or `delay_on_retry` honoured; longer delays are shortened to it.",
        secret: false,
    },
    Setting {
        name: "UPKEEP_INTERVAL_MS",
        default: "1000",
        allowed: Allowed::Millis {
            min: 10,
            max: 600_000,
        },
        description: "Time between upkeep runs.",
        secret: false,
    },
    Setting {
        name: "UPKEEP_BATCH_LIMIT",
        default: "1000",
        allowed: Allowed::Integer {
            min: 1,
            max: 100_000,
        },
        description: "LIMIT of every upkeep statement, so one upkeep run stays bounded.",
        secret: false,
    },
    Setting {
        name: "RESTART_GRACE_SEC",
        default: "60",
        allowed: Allowed::Seconds { min: 0, max: 3600 },
        description: "After startup, upkeep waits this long before expiring processing deadlines and claim leases, so workers can report results held while the broker was down.",
        secret: false,
    },
    Setting {
        name: "SHUTDOWN_TIMEOUT_MS",
        default: "30000",
        allowed: Allowed::Millis {
            min: 1000,
            max: 600_000,
        },
        description: "Longest a graceful shutdown (SIGTERM, SIGINT) may take; must exceed `PUSH_TIMEOUT_MS`.",
        secret: false,
    },
    Setting {
        name: "LOG",
        default: "info",
        allowed: Allowed::Text,
        description: "tracing filter directives, e.g. `info,taskbroker=debug`.",
        secret: false,
    },
    Setting {
        name: "LOG_FORMAT",
        default: "text",
        allowed: Allowed::OneOf(LogFormat::WORDS),
        description: "Log line format.",
        secret: false,
    },
    Setting {
        name: "BENCH_DISABLE_RELEASE_ON_FULL",
        default: "false",
        allowed: Allowed::Bool,
        description: "For the stranded-claim benchmark only; never in production. When a claimed batch cannot be handed to a full push pool, leave its claims to their lease instead of releasing them (the older design), so the benchmark can show both side by side. The broker logs a warning at startup when it is set.",
        secret: false,
    },
];

/// The table entry for `name` (without the prefix).
pub fn setting(name: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|setting| setting.name == name)
}

/// The `TASKBROKER_*` names among `vars` that are not settings (typos), sorted, for a startup
/// warning. `from_lookup` cannot enumerate the environment, so it cannot catch them itself.
pub fn unknown_variables(vars: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut unknown: Vec<String> = vars
        .into_iter()
        .filter(|var| {
            var.strip_prefix(ENV_PREFIX)
                .is_some_and(|name| setting(name).is_none())
        })
        .collect();
    unknown.sort();
    unknown.dedup();
    unknown
}

/// Defines an enum whose variants are spelled as lowercase words in the environment.
macro_rules! word_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$variant_meta:meta])* $variant:ident = $word:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$variant_meta])* $variant,)+
        }

        impl $name {
            /// The words accepted in the environment.
            pub const WORDS: &'static [&'static str] = &[$($word),+];

            /// The word for this value, as written in the environment.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $word,)+
                }
            }

            fn from_word(word: &str) -> Option<Self> {
                match word {
                    $($word => Some(Self::$variant),)+
                    _ => None,
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromValue for $name {
            fn from_value(value: Value) -> Option<Self> {
                match value {
                    Value::Word(word) => Self::from_word(word),
                    _ => None,
                }
            }
        }
    };
}

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

/// The validated configuration. Built only by [`Config::from_lookup`] / [`Config::from_env`] in
/// production; fields are public so tests can adjust a parsed config.
#[derive(Clone, PartialEq, Eq)]
pub struct Config {
    /// `DELIVERY_MODE`.
    pub delivery_mode: DeliveryMode,
    /// `DATABASE_URL`; `None` means the embedded SQLite store. Secret.
    pub database_url: Option<String>,
    /// `SQLITE_PATH`.
    pub sqlite_path: PathBuf,
    /// `DB_POOL_SIZE`.
    pub db_pool_size: usize,
    /// `DB_ASYNC_COMMIT`.
    pub db_async_commit: bool,
    /// `KAFKA_BROKERS`, comma-separated as librdkafka's `bootstrap.servers` takes it.
    pub kafka_brokers: String,
    /// `KAFKA_TOPIC`.
    pub kafka_topic: String,
    /// `KAFKA_CONSUMER_GROUP`.
    pub kafka_consumer_group: String,
    /// `KAFKA_RETRY_TOPIC` as given; use [`Config::retry_topic`].
    pub kafka_retry_topic: Option<String>,
    /// `KAFKA_DLQ_TOPIC`.
    pub kafka_dlq_topic: String,
    /// `KAFKA_INGEST_DLQ_TOPIC`.
    pub kafka_ingest_dlq_topic: String,
    /// `KAFKA_AUTO_OFFSET_RESET`.
    pub kafka_auto_offset_reset: AutoOffsetReset,
    /// `KAFKA_CONFIG`, in the given order. Secret.
    pub kafka_config: Vec<(String, String)>,
    /// `GRPC_ADDR`.
    pub grpc_addr: SocketAddr,
    /// `GRPC_ADVERTISED_ADDR` as given; use [`Config::advertised_addr`].
    pub grpc_advertised_addr: Option<String>,
    /// `METRICS_ADDR`.
    pub metrics_addr: SocketAddr,
    /// `GRPC_SHARED_SECRETS`; empty means signing is off. Secret.
    pub grpc_shared_secrets: Vec<String>,
    /// `GRPC_MAX_REQUEST_BYTES`.
    pub grpc_max_request_bytes: usize,
    /// `WORKER_ENDPOINTS`.
    pub worker_endpoints: WorkerEndpoints,
    /// `FETCH_ACTORS`, a power of two.
    pub fetch_actors: usize,
    /// `FETCH_BATCH_SIZE`.
    pub fetch_batch_size: usize,
    /// `FETCH_BACKOFF_MS`.
    pub fetch_backoff: Duration,
    /// `PUSH_CONCURRENCY`.
    pub push_concurrency: usize,
    /// `PUSH_QUEUE_SIZE`.
    pub push_queue_size: usize,
    /// `PUSH_QUEUE_TIMEOUT_MS`.
    pub push_queue_timeout: Duration,
    /// `PUSH_TIMEOUT_MS`.
    pub push_timeout: Duration,
    /// `CLAIM_LEASE_MS` as given; use [`Config::claim_lease`].
    pub claim_lease_override: Option<Duration>,
    /// `INSERT_BATCH_SIZE`.
    pub insert_batch_size: usize,
    /// `INSERT_BATCH_MAX_MS`.
    pub insert_batch_max_wait: Duration,
    /// `MAX_ACTIVATION_BYTES`.
    pub max_activation_bytes: usize,
    /// `MAX_INFLIGHT`.
    pub max_inflight: usize,
    /// `MAX_PROCESSING_ATTEMPTS`.
    pub max_processing_attempts: u32,
    /// `PROCESSING_DEADLINE_GRACE_SEC`.
    pub processing_deadline_grace: Duration,
    /// `MAX_DELAY_SEC`.
    pub max_delay: Duration,
    /// `UPKEEP_INTERVAL_MS`.
    pub upkeep_interval: Duration,
    /// `UPKEEP_BATCH_LIMIT`.
    pub upkeep_batch_limit: usize,
    /// `RESTART_GRACE_SEC`.
    pub restart_grace: Duration,
    /// `SHUTDOWN_TIMEOUT_MS`.
    pub shutdown_timeout: Duration,
    /// `LOG`, a tracing filter; its syntax is checked where the subscriber is built.
    pub log: String,
    /// `LOG_FORMAT`.
    pub log_format: LogFormat,
    /// `BENCH_DISABLE_RELEASE_ON_FULL`: a benchmark switch, never for production.
    pub bench_disable_release_on_full: bool,
}

impl Config {
    /// Reads the process environment. A value that is not valid UTF-8 is read lossily, so it
    /// fails validation with a message instead of silently counting as unset.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|variable| {
            std::env::var_os(variable).map(|value| value.to_string_lossy().into_owned())
        })
    }

    /// Reads every setting through `lookup`, which receives the full variable name
    /// (`TASKBROKER_…`). Empty values count as unset, surrounding whitespace is ignored. Every
    /// problem is reported, not just the first.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut values = Values::read(&lookup);
        values.check_combinations();
        if !values.problems.is_empty() {
            return Err(ConfigError {
                problems: values.problems,
            });
        }
        values.into_config()
    }

    /// The claim lease: `CLAIM_LEASE_MS` when set, else derived so that it covers the longest
    /// legitimate time between a claim and its push result:
    ///
    /// `PUSH_QUEUE_TIMEOUT_MS` (submitting to a full push pool)
    /// \+ ⌈(`PUSH_QUEUE_SIZE` + `FETCH_ACTORS` + 1) / `PUSH_CONCURRENCY`⌉ × `PUSH_TIMEOUT_MS`
    /// (waiting behind busy slots: the mailbox takes one message per sender beyond its capacity,
    /// each FetchActor being one sender, and the pool holds one more while it waits for a slot)
    /// \+ `PUSH_TIMEOUT_MS` (its own push) + [`CLAIM_LEASE_MARGIN`] (5000 ms, the
    /// mark-processing write).
    pub fn claim_lease(&self) -> Duration {
        self.claim_lease_override.unwrap_or_else(|| {
            legitimate_push_path(
                self.push_queue_timeout,
                self.push_queue_size,
                self.fetch_actors,
                self.push_concurrency,
                self.push_timeout,
            )
            .saturating_add(CLAIM_LEASE_MARGIN)
        })
    }

    /// The topic retries are produced to: `KAFKA_RETRY_TOPIC`, else `KAFKA_TOPIC`.
    pub fn retry_topic(&self) -> &str {
        self.kafka_retry_topic
            .as_deref()
            .unwrap_or(&self.kafka_topic)
    }

    /// The `host:port` workers reach this broker at: `GRPC_ADVERTISED_ADDR` when set; else
    /// `host_name` with the `GRPC_ADDR` port when `GRPC_ADDR` binds every interface; else
    /// `GRPC_ADDR` itself.
    pub fn advertised_addr(&self, host_name: &str) -> String {
        match &self.grpc_advertised_addr {
            Some(addr) => addr.clone(),
            None if self.grpc_addr.ip().is_unspecified() => {
                format!("{host_name}:{}", self.grpc_addr.port())
            }
            None => self.grpc_addr.to_string(),
        }
    }

    /// Every setting as `TASKBROKER_NAME=value`, one per line in table order: secrets that are
    /// set show as `<redacted>`, unset settings with a derived value show it with `(derived)`.
    pub fn render_effective(&self) -> String {
        let mut out = String::new();
        for (setting, value) in self.effective() {
            let _ = writeln!(out, "{}={value}", setting.variable());
        }
        out
    }

    /// The displayed value of every setting, in table order.
    fn effective(&self) -> impl Iterator<Item = (&'static Setting, String)> + '_ {
        SETTINGS.iter().map(|setting| {
            let shown = match self.value_of(setting.name) {
                Some(_) if setting.secret => REDACTED.to_owned(),
                Some(value) => value,
                None => self
                    .derived_value_of(setting.name)
                    .map(|value| format!("{value} (derived)"))
                    .unwrap_or_default(),
            };
            (setting, shown)
        })
    }

    /// The value as it would be written in the environment; `None` when unset.
    fn value_of(&self, name: &str) -> Option<String> {
        fn ms(duration: Duration) -> Option<String> {
            Some(duration.as_millis().to_string())
        }
        fn secs(duration: Duration) -> Option<String> {
            Some(duration.as_secs().to_string())
        }
        fn text(value: impl ToString) -> Option<String> {
            Some(value.to_string())
        }
        fn list(items: &[String]) -> Option<String> {
            (!items.is_empty()).then(|| items.join(","))
        }
        match name {
            "DELIVERY_MODE" => text(self.delivery_mode),
            "DATABASE_URL" => self.database_url.clone(),
            "SQLITE_PATH" => text(self.sqlite_path.display()),
            "DB_POOL_SIZE" => text(self.db_pool_size),
            "DB_ASYNC_COMMIT" => text(self.db_async_commit),
            "KAFKA_BROKERS" => text(&self.kafka_brokers),
            "KAFKA_TOPIC" => text(&self.kafka_topic),
            "KAFKA_CONSUMER_GROUP" => text(&self.kafka_consumer_group),
            "KAFKA_RETRY_TOPIC" => self.kafka_retry_topic.clone(),
            "KAFKA_DLQ_TOPIC" => text(&self.kafka_dlq_topic),
            "KAFKA_INGEST_DLQ_TOPIC" => text(&self.kafka_ingest_dlq_topic),
            "KAFKA_AUTO_OFFSET_RESET" => text(self.kafka_auto_offset_reset),
            "KAFKA_CONFIG" => list(
                &self
                    .kafka_config
                    .iter()
                    .map(|(key, value)| format!("{key}={value}"))
                    .collect::<Vec<_>>(),
            ),
            "GRPC_ADDR" => text(self.grpc_addr),
            "GRPC_ADVERTISED_ADDR" => self.grpc_advertised_addr.clone(),
            "METRICS_ADDR" => text(self.metrics_addr),
            "GRPC_SHARED_SECRETS" => list(&self.grpc_shared_secrets),
            "GRPC_MAX_REQUEST_BYTES" => text(self.grpc_max_request_bytes),
            "WORKER_ENDPOINTS" => text(self.worker_endpoints.redacted()),
            "FETCH_ACTORS" => text(self.fetch_actors),
            "FETCH_BATCH_SIZE" => text(self.fetch_batch_size),
            "FETCH_BACKOFF_MS" => ms(self.fetch_backoff),
            "PUSH_CONCURRENCY" => text(self.push_concurrency),
            "PUSH_QUEUE_SIZE" => text(self.push_queue_size),
            "PUSH_QUEUE_TIMEOUT_MS" => ms(self.push_queue_timeout),
            "PUSH_TIMEOUT_MS" => ms(self.push_timeout),
            "CLAIM_LEASE_MS" => self.claim_lease_override.and_then(ms),
            "INSERT_BATCH_SIZE" => text(self.insert_batch_size),
            "INSERT_BATCH_MAX_MS" => ms(self.insert_batch_max_wait),
            "MAX_ACTIVATION_BYTES" => text(self.max_activation_bytes),
            "MAX_INFLIGHT" => text(self.max_inflight),
            "MAX_PROCESSING_ATTEMPTS" => text(self.max_processing_attempts),
            "PROCESSING_DEADLINE_GRACE_SEC" => secs(self.processing_deadline_grace),
            "MAX_DELAY_SEC" => secs(self.max_delay),
            "UPKEEP_INTERVAL_MS" => ms(self.upkeep_interval),
            "UPKEEP_BATCH_LIMIT" => text(self.upkeep_batch_limit),
            "RESTART_GRACE_SEC" => secs(self.restart_grace),
            "SHUTDOWN_TIMEOUT_MS" => ms(self.shutdown_timeout),
            "LOG" => text(&self.log),
            "LOG_FORMAT" => text(self.log_format),
            "BENCH_DISABLE_RELEASE_ON_FULL" => text(self.bench_disable_release_on_full),
            // A setting added to the table but not here; a test catches it.
            _ => text("<not rendered>"),
        }
    }

    /// What an unset setting resolves to, for settings whose default is derived.
    fn derived_value_of(&self, name: &str) -> Option<String> {
        match name {
            "CLAIM_LEASE_MS" => Some(self.claim_lease().as_millis().to_string()),
            "KAFKA_RETRY_TOPIC" => Some(self.retry_topic().to_owned()),
            "GRPC_ADVERTISED_ADDR" => Some(self.advertised_addr("<host name>")),
            _ => None,
        }
    }
}

/// Secrets never reach `{:?}`: this prints what `render_effective` prints.
impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("Config");
        for (setting, value) in self.effective() {
            debug.field(setting.name, &value);
        }
        debug.finish()
    }
}

/// Why the configuration was refused: every problem found, one per line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:{}", lines(.problems))]
pub struct ConfigError {
    pub problems: Vec<Problem>,
}

/// One refused value: `TASKBROKER_NAME=value: what is allowed`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{variable}={value}: {message}")]
pub struct Problem {
    /// Full variable name.
    pub variable: String,
    /// The value as shown: [`REDACTED`] for secrets, control characters escaped.
    pub value: String,
    /// What is allowed, and what exactly is wrong when that helps.
    pub message: String,
}

impl Problem {
    fn new(setting: &Setting, value: &str, message: String) -> Self {
        // Worker URLs may carry credentials (`user:pass@`): never echo them.
        let value = if setting.secret {
            REDACTED.to_owned()
        } else {
            printable(&redact_url(value))
        };
        Self {
            variable: setting.variable(),
            value,
            message: printable(&redact_url(&message)),
        }
    }

    /// A table or struct mismatch inside this module, reported rather than panicking.
    fn internal(name: &str, message: &str) -> Self {
        Self {
            variable: format!("{ENV_PREFIX}{name}"),
            value: String::new(),
            message: format!("internal error in src/config/mod.rs: {message}"),
        }
    }
}

/// Escapes control characters so a stray newline or NUL cannot forge or hide an error line.
fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

fn lines(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|problem| format!("\n  {problem}"))
        .collect()
}

/// A parsed value before it is moved into its typed `Config` field.
#[derive(Debug, Clone)]
enum Value {
    Unset,
    Int(u64),
    Duration(Duration),
    Bool(bool),
    Word(&'static str),
    Text(String),
    List(Vec<String>),
    Pairs(Vec<(String, String)>),
    Addr(SocketAddr),
    Endpoints(WorkerEndpoints),
}

/// Conversion from a parsed [`Value`] into a `Config` field type; `None` means the table and
/// the field disagree (a bug in this module).
trait FromValue: Sized {
    fn from_value(value: Value) -> Option<Self>;
}

impl<T: FromValue> FromValue for Option<T> {
    fn from_value(value: Value) -> Option<Self> {
        match value {
            Value::Unset => Some(None),
            value => T::from_value(value).map(Some),
        }
    }
}

/// Implements [`FromValue`] for a field type from the `Value` variants it accepts.
macro_rules! from_value {
    ($($ty:ty { $($pattern:pat => $convert:expr),+ $(,)? })+) => {
        $(impl FromValue for $ty {
            fn from_value(value: Value) -> Option<Self> {
                match value {
                    $($pattern => $convert,)+
                    _ => None,
                }
            }
        })+
    };
}

from_value! {
    u32 { Value::Int(n) => u32::try_from(n).ok() }
    usize { Value::Int(n) => usize::try_from(n).ok() }
    Duration { Value::Duration(duration) => Some(duration) }
    bool { Value::Bool(flag) => Some(flag) }
    String { Value::Text(text) => Some(text) }
    PathBuf { Value::Text(text) => Some(PathBuf::from(text)) }
    SocketAddr { Value::Addr(addr) => Some(addr) }
    WorkerEndpoints {
        Value::Unset => Some(WorkerEndpoints::default()),
        Value::Endpoints(endpoints) => Some(endpoints),
    }
    Vec<String> {
        Value::Unset => Some(Vec::new()),
        Value::List(items) => Some(items),
    }
    Vec<(String, String)> {
        Value::Unset => Some(Vec::new()),
        Value::Pairs(pairs) => Some(pairs),
    }
}

/// The longest legitimate time from a claim to its push result, without the mark-processing
/// margin (see [`Config::claim_lease`]); an explicit `CLAIM_LEASE_MS` may not be shorter.
fn legitimate_push_path(
    queue_timeout: Duration,
    queue_size: usize,
    fetch_actors: usize,
    concurrency: usize,
    push_timeout: Duration,
) -> Duration {
    let waiting = queue_size.saturating_add(fetch_actors).saturating_add(1);
    let rounds = u32::try_from(waiting.div_ceil(concurrency.max(1))).unwrap_or(u32::MAX);
    queue_timeout
        .saturating_add(push_timeout.saturating_mul(rounds))
        .saturating_add(push_timeout)
}

/// Every setting parsed on its own, plus the problems found so far.
struct Values {
    parsed: HashMap<&'static str, Value>,
    problems: Vec<Problem>,
}

impl Values {
    fn read(lookup: &dyn Fn(&str) -> Option<String>) -> Self {
        let mut values = Values {
            parsed: HashMap::with_capacity(SETTINGS.len()),
            problems: Vec::new(),
        };
        for setting in SETTINGS {
            let given = lookup(&setting.variable())
                .map(|value| value.trim().to_owned())
                .filter(|value| !value.is_empty());
            let raw = given.as_deref().unwrap_or(setting.default);
            if raw.is_empty() {
                values.parsed.insert(setting.name, Value::Unset);
                continue;
            }
            match setting.allowed.parse(raw) {
                Ok(value) => {
                    values.parsed.insert(setting.name, value);
                }
                Err(detail) => {
                    let mut message = format!("must be {}", setting.allowed.describe());
                    if let Some(detail) = detail {
                        let _ = write!(message, " ({detail})");
                    }
                    values.problems.push(Problem::new(setting, raw, message));
                }
            }
        }
        values
    }

    /// A valid value converted to `T`; `None` when the setting itself was invalid.
    fn peek<T: FromValue>(&self, name: &str) -> Option<T> {
        self.parsed.get(name).cloned().and_then(T::from_value)
    }

    /// Checks that involve more than one setting, on whichever of them parsed.
    fn check_combinations(&mut self) {
        let push_timeout = self.peek::<Duration>("PUSH_TIMEOUT_MS");
        let queue_timeout = self.peek::<Duration>("PUSH_QUEUE_TIMEOUT_MS");

        let lease = self.peek::<Duration>("CLAIM_LEASE_MS");
        // A queue setting that is itself invalid (and reported) counts at its
        // smallest, so the lease is still checked against a lower bound.
        let queue_size = self.peek::<usize>("PUSH_QUEUE_SIZE").unwrap_or(0);
        let fetch_actors = self.peek::<usize>("FETCH_ACTORS").unwrap_or(0);
        let concurrency = self
            .peek::<usize>("PUSH_CONCURRENCY")
            .unwrap_or(queue_size + fetch_actors + 1);
        if let (Some(lease), Some(queue_timeout), Some(push_timeout)) =
            (lease, queue_timeout, push_timeout)
        {
            let minimum = legitimate_push_path(
                queue_timeout,
                queue_size,
                fetch_actors,
                concurrency,
                push_timeout,
            );
            if lease < minimum {
                self.conflict(
                    "CLAIM_LEASE_MS",
                    lease.as_millis().to_string(),
                    format!(
                        "must be at least {ENV_PREFIX}PUSH_QUEUE_TIMEOUT_MS + \
                         ⌈({ENV_PREFIX}PUSH_QUEUE_SIZE + {ENV_PREFIX}FETCH_ACTORS + 1) / \
                         {ENV_PREFIX}PUSH_CONCURRENCY⌉ × {ENV_PREFIX}PUSH_TIMEOUT_MS + \
                         {ENV_PREFIX}PUSH_TIMEOUT_MS = {} + ⌈({} + {} + 1) / {}⌉ × {} + {} = {} ms, \
                         or unset to derive it, so a claim cannot expire while its push may \
                         still succeed",
                        queue_timeout.as_millis(),
                        queue_size,
                        fetch_actors,
                        concurrency,
                        push_timeout.as_millis(),
                        push_timeout.as_millis(),
                        minimum.as_millis(),
                    ),
                );
            }
        }

        let mode = self.peek::<DeliveryMode>("DELIVERY_MODE");
        let endpoints = self.peek::<WorkerEndpoints>("WORKER_ENDPOINTS");
        if let (Some(DeliveryMode::Push), Some(endpoints)) = (mode, endpoints)
            && endpoints.is_empty()
        {
            self.conflict(
                "WORKER_ENDPOINTS",
                String::new(),
                format!(
                    "is required when {ENV_PREFIX}DELIVERY_MODE=push: name the workers to push \
                     to, e.g. `*=http://worker:50052`, or set {ENV_PREFIX}DELIVERY_MODE=pull"
                ),
            );
        }

        let shutdown_timeout = self.peek::<Duration>("SHUTDOWN_TIMEOUT_MS");
        if let (Some(shutdown_timeout), Some(push_timeout)) = (shutdown_timeout, push_timeout)
            && shutdown_timeout <= push_timeout
        {
            self.conflict(
                "SHUTDOWN_TIMEOUT_MS",
                shutdown_timeout.as_millis().to_string(),
                format!(
                    "must be greater than {ENV_PREFIX}PUSH_TIMEOUT_MS={}, so pushes in flight \
                     can finish and claims be released before the deadline",
                    push_timeout.as_millis(),
                ),
            );
        }

        let grpc = self.peek::<SocketAddr>("GRPC_ADDR");
        let metrics = self.peek::<SocketAddr>("METRICS_ADDR");
        if let (Some(grpc), Some(metrics)) = (grpc, metrics)
            && grpc.port() == metrics.port()
            // Port 0 asks the system for a free port: never the same one.
            && grpc.port() != 0
            && (grpc.ip() == metrics.ip()
                || grpc.ip().is_unspecified()
                || metrics.ip().is_unspecified())
        {
            self.conflict(
                "METRICS_ADDR",
                metrics.to_string(),
                format!("must not take the port of {ENV_PREFIX}GRPC_ADDR={grpc}"),
            );
        }
    }

    fn conflict(&mut self, name: &str, value: String, message: String) {
        let problem = match setting(name) {
            Some(setting) => Problem::new(setting, &value, message),
            None => Problem::internal(name, "checked setting is not in SETTINGS"),
        };
        self.problems.push(problem);
    }

    /// Moves the value of `name` into its typed field.
    fn take<T: FromValue>(&mut self, name: &str) -> Result<T, Problem> {
        let value = self
            .parsed
            .remove(name)
            .ok_or_else(|| Problem::internal(name, "read twice or not in SETTINGS"))?;
        T::from_value(value)
            .ok_or_else(|| Problem::internal(name, "value does not fit its Config field"))
    }

    fn into_config(mut self) -> Result<Config, ConfigError> {
        let config = Config {
            delivery_mode: self.take("DELIVERY_MODE")?,
            database_url: self.take("DATABASE_URL")?,
            sqlite_path: self.take("SQLITE_PATH")?,
            db_pool_size: self.take("DB_POOL_SIZE")?,
            db_async_commit: self.take("DB_ASYNC_COMMIT")?,
            kafka_brokers: self.take("KAFKA_BROKERS")?,
            kafka_topic: self.take("KAFKA_TOPIC")?,
            kafka_consumer_group: self.take("KAFKA_CONSUMER_GROUP")?,
            kafka_retry_topic: self.take("KAFKA_RETRY_TOPIC")?,
            kafka_dlq_topic: self.take("KAFKA_DLQ_TOPIC")?,
            kafka_ingest_dlq_topic: self.take("KAFKA_INGEST_DLQ_TOPIC")?,
            kafka_auto_offset_reset: self.take("KAFKA_AUTO_OFFSET_RESET")?,
            kafka_config: self.take("KAFKA_CONFIG")?,
            grpc_addr: self.take("GRPC_ADDR")?,
            grpc_advertised_addr: self.take("GRPC_ADVERTISED_ADDR")?,
            metrics_addr: self.take("METRICS_ADDR")?,
            grpc_shared_secrets: self.take("GRPC_SHARED_SECRETS")?,
            grpc_max_request_bytes: self.take("GRPC_MAX_REQUEST_BYTES")?,
            worker_endpoints: self.take("WORKER_ENDPOINTS")?,
            fetch_actors: self.take("FETCH_ACTORS")?,
            fetch_batch_size: self.take("FETCH_BATCH_SIZE")?,
            fetch_backoff: self.take("FETCH_BACKOFF_MS")?,
            push_concurrency: self.take("PUSH_CONCURRENCY")?,
            push_queue_size: self.take("PUSH_QUEUE_SIZE")?,
            push_queue_timeout: self.take("PUSH_QUEUE_TIMEOUT_MS")?,
            push_timeout: self.take("PUSH_TIMEOUT_MS")?,
            claim_lease_override: self.take("CLAIM_LEASE_MS")?,
            insert_batch_size: self.take("INSERT_BATCH_SIZE")?,
            insert_batch_max_wait: self.take("INSERT_BATCH_MAX_MS")?,
            max_activation_bytes: self.take("MAX_ACTIVATION_BYTES")?,
            max_inflight: self.take("MAX_INFLIGHT")?,
            max_processing_attempts: self.take("MAX_PROCESSING_ATTEMPTS")?,
            processing_deadline_grace: self.take("PROCESSING_DEADLINE_GRACE_SEC")?,
            max_delay: self.take("MAX_DELAY_SEC")?,
            upkeep_interval: self.take("UPKEEP_INTERVAL_MS")?,
            upkeep_batch_limit: self.take("UPKEEP_BATCH_LIMIT")?,
            restart_grace: self.take("RESTART_GRACE_SEC")?,
            shutdown_timeout: self.take("SHUTDOWN_TIMEOUT_MS")?,
            log: self.take("LOG")?,
            log_format: self.take("LOG_FORMAT")?,
            bench_disable_release_on_full: self.take("BENCH_DISABLE_RELEASE_ON_FULL")?,
        };
        // A setting in the table that no field took would be silently ignored.
        if let Some(name) = self.parsed.keys().next() {
            return Err(
                Problem::internal(name, "setting is parsed but no Config field reads it").into(),
            );
        }
        Ok(config)
    }
}

impl From<Problem> for ConfigError {
    fn from(problem: Problem) -> Self {
        Self {
            problems: vec![problem],
        }
    }
}

impl Allowed {
    /// What is allowed, phrased to follow "must be".
    pub fn describe(&self) -> String {
        match *self {
            Allowed::Integer { min, max } => format!("an integer from {min} to {max}"),
            Allowed::PowerOfTwo { min, max } => {
                format!("a power of two between {min} and {max}")
            }
            Allowed::Millis { min, max } => {
                format!("a whole number of milliseconds from {min} to {max}")
            }
            Allowed::Seconds { min, max } => {
                format!("a whole number of seconds from {min} to {max}")
            }
            Allowed::Bool => "`true` or `false`".to_owned(),
            Allowed::OneOf(words) => format!("one of {}", code_list(words, "", ", ")),
            Allowed::Url { schemes } => {
                format!("a URL starting with {}", code_list(schemes, "://", " or "))
            }
            Allowed::SocketAddr => {
                "an `ip:port` address to listen on, e.g. `0.0.0.0:50051` or `[::]:50051`".to_owned()
            }
            Allowed::HostPort => "a `host:port` address".to_owned(),
            Allowed::HostPortList => "comma-separated `host:port` addresses".to_owned(),
            Allowed::KafkaTopic => {
                "a Kafka topic name: up to 249 of `a-z A-Z 0-9 . _ -`".to_owned()
            }
            Allowed::KafkaProperties => format!(
                "comma-separated `key=value` librdkafka properties, except {}",
                code_list(BROKER_OWNED_KAFKA_KEYS, "", ", ")
            ),
            Allowed::List => "a comma-separated list without empty items".to_owned(),
            Allowed::WorkerEndpoints => {
                "`app=url|url;app2=url;*=url` with `http://` URLs".to_owned()
            }
            Allowed::Text => "any text".to_owned(),
        }
    }

    /// Parses a non-empty, trimmed value. The error may carry a detail; details of secret
    /// settings never quote the value.
    fn parse(&self, raw: &str) -> Result<Value, Option<String>> {
        let in_range = |min: u64, max: u64| {
            raw.parse::<u64>()
                .ok()
                .filter(|n| (min..=max).contains(n))
                .ok_or(None)
        };
        match *self {
            Allowed::Integer { min, max } => in_range(min, max).map(Value::Int),
            Allowed::PowerOfTwo { min, max } => in_range(min, max)
                .and_then(|n| {
                    if n.is_power_of_two() {
                        Ok(n)
                    } else {
                        Err(None)
                    }
                })
                .map(Value::Int),
            Allowed::Millis { min, max } => {
                in_range(min, max).map(|n| Value::Duration(Duration::from_millis(n)))
            }
            Allowed::Seconds { min, max } => {
                in_range(min, max).map(|n| Value::Duration(Duration::from_secs(n)))
            }
            Allowed::Bool => match raw.to_ascii_lowercase().as_str() {
                "true" => Ok(Value::Bool(true)),
                "false" => Ok(Value::Bool(false)),
                _ => Err(None),
            },
            Allowed::OneOf(words) => words
                .iter()
                .find(|word| word.eq_ignore_ascii_case(raw))
                .map(|word| Value::Word(word))
                .ok_or(None),
            Allowed::Url { schemes } => {
                let scheme_ok = raw
                    .split_once("://")
                    .is_some_and(|(scheme, _)| schemes.contains(&scheme));
                if scheme_ok {
                    Ok(Value::Text(raw.to_owned()))
                } else {
                    Err(url_scheme_detail(raw))
                }
            }
            Allowed::SocketAddr => raw.parse::<SocketAddr>().map(Value::Addr).map_err(|_| None),
            Allowed::HostPort => check_host_port(raw).map(|()| Value::Text(raw.to_owned())),
            Allowed::HostPortList => {
                for item in raw.split(',') {
                    check_host_port(item.trim())?;
                }
                Ok(Value::Text(raw.to_owned()))
            }
            Allowed::KafkaTopic => {
                let valid_chars = raw
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
                if valid_chars && raw.len() <= 249 && raw != "." && raw != ".." {
                    Ok(Value::Text(raw.to_owned()))
                } else {
                    Err(None)
                }
            }
            Allowed::KafkaProperties => parse_kafka_properties(raw).map(Value::Pairs),
            Allowed::List => {
                let items: Vec<String> = raw.split(',').map(|s| s.trim().to_owned()).collect();
                match items.iter().position(String::is_empty) {
                    Some(i) => Err(Some(format!("item {} of {} is empty", i + 1, items.len()))),
                    None => Ok(Value::List(items)),
                }
            }
            Allowed::WorkerEndpoints => WorkerEndpoints::parse(raw)
                .map(Value::Endpoints)
                .map_err(Some),
            Allowed::Text => Ok(Value::Text(raw.to_owned())),
        }
    }
}

/// Names the scheme that was given, but only when it looks like one: a URL without `://` may be
/// a bare password.
fn url_scheme_detail(raw: &str) -> Option<String> {
    let (scheme, _) = raw.split_once("://")?;
    let looks_like_scheme = scheme.len() <= 16
        && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    looks_like_scheme.then(|| format!("the scheme is `{scheme}`"))
}

fn check_host_port(item: &str) -> Result<(), Option<String>> {
    let Some((host, port)) = item.rsplit_once(':') else {
        return Err(Some(format!("`{item}` has no `:port`")));
    };
    if host.is_empty() || host.contains(|c: char| c.is_whitespace() || c == '/') {
        return Err(Some(format!("`{item}` has no valid host")));
    }
    match port.parse::<u16>() {
        Ok(port) if port > 0 => Ok(()),
        _ => Err(Some(format!("`{item}` has no port from 1 to 65535"))),
    }
}

/// Parses `KAFKA_CONFIG`. It usually holds credentials, so errors name item positions and
/// broker-owned keys only, never text from the value.
fn parse_kafka_properties(raw: &str) -> Result<Vec<(String, String)>, Option<String>> {
    let items: Vec<&str> = raw.split(',').map(str::trim).collect();
    let count = items.len();
    let mut pairs: Vec<(String, String)> = Vec::with_capacity(count);
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("item {} of {count}", i + 1);
        let Some((key, value)) = item.split_once('=') else {
            return Err(Some(format!("{at} has no `=`")));
        };
        let key = key.trim();
        if key.is_empty() {
            return Err(Some(format!("{at} has no key before `=`")));
        }
        if !key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            return Err(Some(format!("{at} has a key that is not a property name")));
        }
        if let Some(owned) = BROKER_OWNED_KAFKA_KEYS.iter().find(|owned| **owned == key) {
            return Err(Some(format!(
                "{at} sets `{owned}`, which the broker sets itself"
            )));
        }
        if let Some(first) = pairs.iter().position(|(seen, _)| seen == key) {
            return Err(Some(format!("{at} repeats the key of item {}", first + 1)));
        }
        pairs.push((key.to_owned(), value.trim().to_owned()));
    }
    Ok(pairs)
}

/// `` `a`, `b` `` with each word in backticks followed by `suffix`.
fn code_list(words: &[&str], suffix: &str, separator: &str) -> String {
    words
        .iter()
        .map(|word| format!("`{word}{suffix}`"))
        .collect::<Vec<_>>()
        .join(separator)
}
