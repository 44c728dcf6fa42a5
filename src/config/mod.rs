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

pub use allowed::{Allowed, Setting};
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

    /// Every setting as `TASKBROKER_NAME=value`, one per line in table order: secrets that are
    /// set show as `<redacted>`, unset settings with a derived value show it with `(derived)`.
    pub fn render_effective(&self) -> String {
        let mut out = String::new();
        for (setting, value) in self.effective() {
            let _ = writeln!(out, "{}={value}", setting.variable());
        }
        for (cluster, _) in &self.kafka_cluster_properties {
            let _ = writeln!(out, "{}={REDACTED}", cluster_config_variable(cluster));
        }
        out
    }

    /// The displayed value of every setting, in table order.
    fn effective(&self) -> impl Iterator<Item = (&'static Setting, String)> + '_ {
        SETTINGS
            .iter()
            .zip(self.written_values())
            .map(|(setting, value)| {
                let shown = match value {
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

    /// What an unset setting resolves to, for settings whose default is derived.
    fn derived_value_of(&self, name: &str) -> Option<String> {
        if name == key::CLAIM_LEASE_MS.name() {
            Some(self.claim_lease().as_millis().to_string())
        } else if name == key::KAFKA_RETRY_TOPIC.name() {
            Some(self.retry_topic())
        } else if name == key::GRPC_ADVERTISED_ADDR.name() {
            Some(self.advertised_addr("<host name>"))
        } else {
            None
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
