//! Reading the environment into typed values: every setting is parsed on its own by its
//! [`Allowed`] constraint into a [`Value`], the checks across settings run on whichever parsed,
//! and only then are the values moved into their `Config` fields (the `into_config` the
//! `settings!` macro generates, through [`Key`]s typed like the fields).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::allowed::{Allowed, parse_kafka_properties};
use super::endpoints::WorkerEndpoints;
use super::error::{ConfigError, Problem};
use super::settings::{DeliveryMode, key};
use super::topics::{DEFAULT_CLUSTER, Subscription, TopicAt, cluster_config_variable};
use super::{ENV_PREFIX, REDACTED, SETTINGS, legitimate_push_path, setting};

/// A parsed value before it is moved into its typed `Config` field.
#[derive(Debug, Clone)]
pub(super) enum Value {
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
pub(super) trait FromValue: Sized {
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
    u64 { Value::Int(n) => Some(n) }
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

/// One setting's parsed value, typed like its `Config` field: `settings!` generates one per
/// setting in `settings::key`, so a check across settings cannot misspell a name or read a
/// value as the wrong type.
pub(super) struct Key<T> {
    name: &'static str,
    field: PhantomData<fn() -> T>,
}

impl<T> Key<T> {
    pub(super) const fn new(name: &'static str) -> Self {
        Self {
            name,
            field: PhantomData,
        }
    }

    /// The setting's name without the prefix.
    pub(super) const fn name(self) -> &'static str {
        self.name
    }
}

// Not derived: a derive would ask `T: Copy` of the field type.
impl<T> Clone for Key<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Key<T> {}

/// Every setting parsed on its own, plus the problems found so far.
pub(super) struct Values {
    parsed: HashMap<&'static str, Value>,
    problems: Vec<Problem>,
    /// `TASKBROKER_KAFKA_CLUSTER_<NAME>_CONFIG` of each cluster that sets it.
    cluster_properties: Vec<(String, Vec<(String, String)>)>,
    /// Whether what only running the broker needs is required (push mode's
    /// `WORKER_ENDPOINTS`); not for `config` and `migrate`.
    for_running: bool,
}

impl Values {
    pub(super) fn read(lookup: &dyn Fn(&str) -> Option<String>) -> Self {
        let mut values = Values {
            parsed: HashMap::with_capacity(SETTINGS.len()),
            problems: Vec::new(),
            cluster_properties: Vec::new(),
            for_running: true,
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

    /// Reads the librdkafka properties of every cluster `KAFKA_CLUSTERS` declares, from
    /// variables named after them; a bad one is a problem naming its variable (never its
    /// value: it usually holds credentials).
    pub(super) fn read_cluster_properties(&mut self, lookup: &dyn Fn(&str) -> Option<String>) {
        let clusters = self.peek(key::KAFKA_CLUSTERS).unwrap_or_default();
        for (name, _) in clusters {
            let variable = cluster_config_variable(&name);
            let Some(raw) = lookup(&variable)
                .map(|value| value.trim().to_owned())
                .filter(|value| !value.is_empty())
            else {
                continue;
            };
            match parse_kafka_properties(&raw) {
                Ok(properties) => self.cluster_properties.push((name, properties)),
                Err(detail) => self.problems.push(Problem {
                    variable,
                    value: REDACTED.to_owned(),
                    message: format!(
                        "must be {} (the librdkafka properties of cluster `{name}`){}",
                        Allowed::KafkaProperties.describe(),
                        detail.map(|d| format!(" ({d})")).unwrap_or_default()
                    ),
                }),
            }
        }
    }

    pub(super) fn take_cluster_properties(&mut self) -> Vec<(String, Vec<(String, String)>)> {
        std::mem::take(&mut self.cluster_properties)
    }

    /// Every topic names a declared cluster; no topic is consumed twice; retries never go
    /// to a raw topic.
    fn check_topics(&mut self) {
        let declared: Vec<String> = self
            .peek(key::KAFKA_CLUSTERS)
            .unwrap_or_default()
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        let known = |cluster: &str| {
            cluster == DEFAULT_CLUSTER || declared.iter().any(|name| name == cluster)
        };
        let unknown_cluster = |topic: &TopicAt| {
            format!(
                "topic `{}` names cluster `{}`, which {ENV_PREFIX}KAFKA_CLUSTERS does not \
                 declare",
                topic.topic, topic.cluster
            )
        };
        let topics: Vec<Subscription> = self
            .peek(key::KAFKA_TOPICS)
            .unwrap_or_default()
            .iter()
            .filter_map(|item| Subscription::parse(item).ok())
            .collect();
        let raw: Vec<Subscription> = self
            .peek(key::KAFKA_RAW_TOPICS)
            .unwrap_or_default()
            .iter()
            .filter_map(|(topic, _)| Subscription::parse(topic).ok())
            .collect();
        let mut problems: Vec<(&'static str, String, String)> = Vec::new();
        for (name, listed) in [
            (key::KAFKA_TOPICS.name(), &topics),
            (key::KAFKA_RAW_TOPICS.name(), &raw),
        ] {
            for (i, subscription) in listed.iter().enumerate() {
                let shown = subscription.topic.to_string();
                if !known(&subscription.topic.cluster) {
                    problems.push((name, shown.clone(), unknown_cluster(&subscription.topic)));
                }
                if listed[..i]
                    .iter()
                    .any(|seen| seen.topic == subscription.topic)
                {
                    problems.push((name, shown, "lists this topic twice".to_owned()));
                }
            }
        }
        for (i, subscription) in raw.iter().enumerate() {
            let same = topics.iter().find(|t| t.topic == subscription.topic);
            if let Some(listed) = same
                && listed.group != subscription.group
            {
                self.conflict(
                    key::KAFKA_RAW_TOPICS,
                    subscription.topic.to_string(),
                    format!(
                        "item {}: {ENV_PREFIX}KAFKA_TOPICS lists the same topic with another \
                         consumer group; a topic is consumed once, so give both the same group",
                        i + 1
                    ),
                );
            }
        }
        for name in [
            key::KAFKA_RETRY_TOPIC.name(),
            key::KAFKA_DLQ_TOPIC.name(),
            key::KAFKA_INGEST_DLQ_TOPIC.name(),
        ] {
            let Some(Value::Text(value)) = self.parsed.get(name) else {
                continue;
            };
            if let Ok(topic) = TopicAt::parse(value)
                && !known(&topic.cluster)
            {
                problems.push((name, value.clone(), unknown_cluster(&topic)));
            }
        }
        for (name, value, message) in problems {
            self.conflict_named(name, value, message);
        }
        let retry = match self.peek(key::KAFKA_RETRY_TOPIC).flatten() {
            Some(value) => TopicAt::parse(&value).ok(),
            None => topics.first().map(|s| s.topic.clone()).or_else(|| {
                self.peek(key::KAFKA_TOPIC).map(|topic| TopicAt {
                    topic,
                    cluster: DEFAULT_CLUSTER.to_owned(),
                })
            }),
        };
        if let Some(retry) = retry
            && raw.iter().any(|r| r.topic == retry)
        {
            self.conflict(
                key::KAFKA_RAW_TOPICS,
                retry.to_string(),
                format!(
                    "is the retry topic ({ENV_PREFIX}KAFKA_RETRY_TOPIC, or the first consumed \
                     topic when that is unset): retried activations would be read as raw \
                     payloads; set {ENV_PREFIX}KAFKA_RETRY_TOPIC to a topic of activations"
                ),
            );
        }
    }

    /// A valid value converted to `T`; `None` when the setting itself was invalid.
    fn peek<T: FromValue>(&self, key: Key<T>) -> Option<T> {
        self.parsed.get(key.name).cloned().and_then(T::from_value)
    }

    /// The broker id's form, and a takeover timeout that leaves a frozen
    /// broker room to notice before its peers act.
    fn check_membership(&mut self) {
        if let Some(Some(id)) = self.peek(key::BROKER_ID)
            && let Err(why) = check_broker_id(&id)
        {
            self.conflict(key::BROKER_ID, id, why);
        }
        if let (Some(interval), Some(timeout)) = (
            self.peek(key::HEARTBEAT_INTERVAL_MS),
            self.peek(key::TAKEOVER_TIMEOUT_MS),
        ) && timeout < interval * 3
        {
            self.conflict(
                key::TAKEOVER_TIMEOUT_MS,
                timeout.as_millis().to_string(),
                format!(
                    "must be at least 3 × {ENV_PREFIX}HEARTBEAT_INTERVAL_MS = {} ms, so one \
                     late heartbeat does not get a live broker taken over",
                    interval.as_millis() * 3
                ),
            );
        }
    }

    /// Checks that involve more than one setting, on whichever of them parsed.
    fn check_combinations(&mut self) {
        self.check_topics();
        self.check_membership();
        let push_timeout = self.peek(key::PUSH_TIMEOUT_MS);
        let queue_timeout = self.peek(key::PUSH_QUEUE_TIMEOUT_MS);

        let lease = self.peek(key::CLAIM_LEASE_MS).flatten();
        // A queue setting that is itself invalid (and reported) counts at its
        // smallest, so the lease is still checked against a lower bound.
        let queue_size = self.peek(key::PUSH_QUEUE_SIZE).unwrap_or(0);
        let fetch_actors = self.peek(key::FETCH_ACTORS).unwrap_or(0);
        let concurrency = self
            .peek(key::PUSH_CONCURRENCY)
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
                    key::CLAIM_LEASE_MS,
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

        let mode = self.peek(key::DELIVERY_MODE);
        let endpoints = self.peek(key::WORKER_ENDPOINTS);
        if let (true, Some(DeliveryMode::Push), Some(endpoints)) =
            (self.for_running, mode, endpoints)
            && endpoints.is_empty()
        {
            self.conflict(
                key::WORKER_ENDPOINTS,
                String::new(),
                format!(
                    "is required when {ENV_PREFIX}DELIVERY_MODE=push: name the workers to push \
                     to, e.g. `*=http://worker:50052`, or set {ENV_PREFIX}DELIVERY_MODE=pull"
                ),
            );
        }

        let tls_cert = self.peek(key::WORKER_TLS_CERT).flatten();
        let tls_key = self.peek(key::WORKER_TLS_KEY).flatten();
        match (tls_cert, tls_key) {
            (Some(cert), None) => self.conflict(
                key::WORKER_TLS_CERT,
                cert.display().to_string(),
                format!("needs {ENV_PREFIX}WORKER_TLS_KEY: set both for mTLS, or neither"),
            ),
            (None, Some(key)) => self.conflict(
                key::WORKER_TLS_KEY,
                key.display().to_string(),
                format!("needs {ENV_PREFIX}WORKER_TLS_CERT: set both for mTLS, or neither"),
            ),
            _ => {}
        }

        let shutdown_timeout = self.peek(key::SHUTDOWN_TIMEOUT_MS);
        if let (Some(shutdown_timeout), Some(push_timeout)) = (shutdown_timeout, push_timeout)
            && shutdown_timeout <= push_timeout
        {
            self.conflict(
                key::SHUTDOWN_TIMEOUT_MS,
                shutdown_timeout.as_millis().to_string(),
                format!(
                    "must be greater than {ENV_PREFIX}PUSH_TIMEOUT_MS={}, so pushes in flight \
                     can finish and claims be released before the deadline",
                    push_timeout.as_millis(),
                ),
            );
        }

        let grpc = self.peek(key::GRPC_ADDR);
        let metrics = self.peek(key::METRICS_ADDR);
        if let (Some(grpc), Some(metrics)) = (grpc, metrics)
            && grpc.port() == metrics.port()
            // Port 0 asks the system for a free port: never the same one.
            && grpc.port() != 0
            && (grpc.ip() == metrics.ip()
                || grpc.ip().is_unspecified()
                || metrics.ip().is_unspecified())
        {
            self.conflict(
                key::METRICS_ADDR,
                metrics.to_string(),
                format!("must not take the port of {ENV_PREFIX}GRPC_ADDR={grpc}"),
            );
        }
    }

    fn conflict<T>(&mut self, key: Key<T>, value: String, message: String) {
        self.conflict_named(key.name, value, message);
    }

    fn conflict_named(&mut self, name: &str, value: String, message: String) {
        let problem = match setting(name) {
            Some(setting) => Problem::new(setting, &value, message),
            None => Problem::internal(name, "checked setting is not in SETTINGS"),
        };
        self.problems.push(problem);
    }

    /// Moves the value of `key` into its typed field.
    pub(super) fn take<T: FromValue>(&mut self, key: Key<T>) -> Result<T, Problem> {
        let value = self
            .parsed
            .remove(key.name)
            .ok_or_else(|| Problem::internal(key.name, "read twice or not in SETTINGS"))?;
        T::from_value(value)
            .ok_or_else(|| Problem::internal(key.name, "value does not fit its Config field"))
    }

    /// Leaves out the requirements of running the broker (push mode's
    /// `WORKER_ENDPOINTS`): for commands that only show the settings or
    /// migrate the store.
    pub(super) fn not_for_running(mut self) -> Self {
        self.for_running = false;
        self
    }

    /// Runs the checks across settings; the values if nothing was refused, else every
    /// problem: each setting on its own in table order, then the checks across settings.
    pub(super) fn checked(mut self) -> Result<Self, ConfigError> {
        self.check_combinations();
        if self.problems.is_empty() {
            Ok(self)
        } else {
            Err(ConfigError {
                problems: self.problems,
            })
        }
    }
}

/// The longest broker id accepted: a Kubernetes pod name is at most 253
/// bytes.
const MAX_BROKER_ID_BYTES: usize = 253;

/// A broker id as `TASKBROKER_BROKER_ID` may give it: 1 to 253 bytes of
/// printable ASCII without spaces (it appears in logs and in the store).
pub(super) fn check_broker_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_BROKER_ID_BYTES {
        return Err(format!("must be 1 to {MAX_BROKER_ID_BYTES} bytes long"));
    }
    if !id.bytes().all(|byte| byte.is_ascii_graphic()) {
        return Err("must be printable ASCII without spaces".to_owned());
    }
    Ok(())
}
