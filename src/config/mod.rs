//! Configuration: every `TASKBROKER_*` environment variable, declared once in `settings.rs`.
//!
//! One declaration per setting (the `settings!` macro, `declare.rs`) yields its table entry in
//! [`SETTINGS`], its [`Config`] field, how it is parsed into the field and how it renders back,
//! so a setting cannot be named differently in two places. Parsing reads every entry
//! generically (each [`Allowed`] constraint knows how to parse and how to describe itself),
//! `docs/configuration.md` is generated from the table by [`reference_markdown`] (a test keeps
//! the committed file in sync), and [`Config::render_effective`] walks it to print what the
//! broker runs with, secrets redacted.
//!
//! Validation reports every problem at once, each naming the variable, the value and what is
//! allowed, so an operator fixes a deployment in one round trip instead of one per typo.
//!
//! The files, by job: `settings.rs` the declarations; `declare.rs` the macros; `allowed.rs`
//! what a value may be; `parse.rs` reading values and the checks across settings; `error.rs`
//! the refusal; `endpoints.rs` the worker routing format; `reference.rs` the generated docs;
//! `test_hooks.rs` (feature `test-hooks` only) switches for tests and benchmarks, which are
//! not settings. This file: [`Config`]'s methods and the values derived from several settings.
//!
//! This module is a leaf: it imports nothing from the rest of the crate.

mod allowed;
mod declare;
mod endpoints;
mod error;
mod parse;
mod reference;
mod settings;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;
mod topics;

pub use allowed::{Allowed, LOG_LEVELS, Setting, check_log_filter};
pub use endpoints::{WorkerEndpoints, redact_url};
pub use error::{ConfigError, Problem};
pub use reference::reference_markdown;
pub use settings::{
    AutoOffsetReset, Config, DeliveryMode, LogFormat, RawCompression, SETTINGS, setting,
    unknown_variables,
};
pub use topics::{
    ConsumedTopic, DEFAULT_CLUSTER, KafkaCluster, RawMode, RawTaskName, TopicAt, Topology,
    cluster_config_variable, valid_topic_name,
};

use std::fmt::{self, Write as _};
use std::time::Duration;

use parse::Values;
use settings::key;

/// Prefix of every variable the broker reads.
pub const ENV_PREFIX: &str = "TASKBROKER_";

/// Slack added to the derived claim lease for the mark-processing write after a push succeeds.
pub const CLAIM_LEASE_MARGIN: Duration = Duration::from_millis(5000);

/// Shown instead of the value of a secret setting.
pub const REDACTED: &str = "<redacted>";

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
        values.read_cluster_properties(&lookup);
        Self::from_values(values.checked()?)
    }

    /// [`Config::from_env`] for the commands that do not run the broker (`config`,
    /// `migrate`): every setting is checked as for running it, except that push mode may
    /// leave `WORKER_ENDPOINTS` unset (a migration Job has no workers to name).
    pub fn from_env_without_running() -> Result<Self, ConfigError> {
        Self::from_lookup_without_running(|variable| {
            std::env::var_os(variable).map(|value| value.to_string_lossy().into_owned())
        })
    }

    /// [`Config::from_env_without_running`] through `lookup`.
    pub fn from_lookup_without_running(
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let mut values = Values::read(&lookup);
        values.read_cluster_properties(&lookup);
        Self::from_values(values.not_for_running().checked()?)
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

    /// The topic retries are produced to, as `topic` or `topic@cluster` (see
    /// [`Config::retry_topic_at`]).
    pub fn retry_topic(&self) -> String {
        self.retry_topic_at().to_string()
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

    /// This broker's id in the store: `BROKER_ID` when set; else, in Kubernetes
    /// (`KUBERNETES_SERVICE_HOST` set), the pod name `HOSTNAME`, which a container restart
    /// keeps; else a fresh id, unique to this start. `env` reads the process environment.
    pub fn broker_id(&self, env: impl Fn(&str) -> Option<String>) -> String {
        if let Some(id) = &self.broker_id {
            return id.clone();
        }
        let in_kubernetes = env("KUBERNETES_SERVICE_HOST").is_some_and(|host| !host.is_empty());
        env("HOSTNAME")
            .filter(|pod| in_kubernetes && parse::check_broker_id(pod).is_ok())
            .unwrap_or_else(fresh_broker_id)
    }

    /// Every setting as `TASKBROKER_NAME=value`, one per line in table order: secrets that are
    /// set show as `<redacted>`, unset settings with a derived value show it with `(derived)`.
    pub fn render_effective(&self) -> String {
        self.render_effective_on(HOST_NAME_PLACEHOLDER)
    }

    /// [`Config::render_effective`] on the machine called `host_name`, so the derived
    /// `GRPC_ADVERTISED_ADDR` shows the address workers will be sent.
    pub fn render_effective_on(&self, host_name: &str) -> String {
        let mut out = String::new();
        for (setting, value) in self.effective(host_name) {
            let _ = writeln!(out, "{}={value}", setting.variable());
        }
        for (cluster, _) in &self.kafka_cluster_properties {
            let _ = writeln!(out, "{}={REDACTED}", cluster_config_variable(cluster));
        }
        out
    }

    /// The displayed value of every setting, in table order.
    fn effective<'a>(
        &'a self,
        host_name: &'a str,
    ) -> impl Iterator<Item = (&'static Setting, String)> + 'a {
        SETTINGS
            .iter()
            .zip(self.written_values())
            .map(|(setting, value)| {
                let shown = match value {
                    Some(_) if setting.secret => REDACTED.to_owned(),
                    Some(value) => value,
                    None => self
                        .derived_value_of(setting.name, host_name)
                        .map(|value| format!("{value} (derived)"))
                        .unwrap_or_default(),
                };
                (setting, shown)
            })
    }

    /// What an unset setting resolves to, for settings whose default is derived.
    fn derived_value_of(&self, name: &str, host_name: &str) -> Option<String> {
        if name == key::CLAIM_LEASE_MS.name() {
            Some(self.claim_lease().as_millis().to_string())
        } else if name == key::KAFKA_RETRY_TOPIC.name() {
            Some(self.retry_topic())
        } else if name == key::GRPC_ADVERTISED_ADDR.name() {
            Some(self.advertised_addr(host_name))
        } else {
            None
        }
    }
}

/// Where the host name goes in a rendering that does not know it.
const HOST_NAME_PLACEHOLDER: &str = "<host name>";

/// Secrets never reach `{:?}`: this prints what `render_effective` prints.
impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("Config");
        for (setting, value) in self.effective(HOST_NAME_PLACEHOLDER) {
            debug.field(setting.name, &value);
        }
        debug.finish()
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

/// `TASKBROKER_LOG` and `TASKBROKER_LOG_FORMAT` alone, checked as [`Config`] checks them, for
/// the commands that read no other setting (`demo`, `demo-worker`); `default_filter` when
/// `LOG` is unset or empty.
pub fn log_settings(
    lookup: impl Fn(&str) -> Option<String>,
    default_filter: &str,
) -> Result<(String, LogFormat), String> {
    let read = |name: &str| {
        lookup(&format!("{ENV_PREFIX}{name}"))
            .map(|value| value.trim().to_owned())
            .filter(|value| !value.is_empty())
    };
    let filter = read("LOG").unwrap_or_else(|| default_filter.to_owned());
    check_log_filter(&filter).map_err(|why| {
        format!(
            "{ENV_PREFIX}LOG={filter}: must be {}: {why}",
            Allowed::LogFilter.describe()
        )
    })?;
    let format = match read("LOG_FORMAT") {
        None => LogFormat::Text,
        Some(word) => LogFormat::from_word(&word.to_ascii_lowercase()).ok_or_else(|| {
            format!(
                "{ENV_PREFIX}LOG_FORMAT={word}: must be {}",
                Allowed::OneOf(LogFormat::WORDS).describe()
            )
        })?,
    };
    Ok((filter, format))
}

/// A broker id no other process has: for a broker with nothing stable to
/// call itself, and for stores opened by tools and tests.
pub fn fresh_broker_id() -> String {
    format!("broker-{}", uuid::Uuid::new_v4().simple())
}
