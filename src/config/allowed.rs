//! What a setting is ([`Setting`]) and what values it accepts ([`Allowed`]): each constraint
//! knows how to parse a raw value and how to describe itself, for error messages and for the
//! "Allowed" column of `docs/configuration.md`.

use std::net::SocketAddr;
use std::time::Duration;

use super::ENV_PREFIX;
use super::endpoints::WorkerEndpoints;
use super::parse::Value;
use super::topics::{
    DEFAULT_CLUSTER, Subscription, TopicAt, parse_raw_item, valid_cluster_name, valid_topic_name,
};

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
    /// A size in bytes in `min..=max`: a whole number, optionally followed by
    /// `KiB`, `MiB` or `GiB` (powers of 1024).
    Bytes { min: u64, max: u64 },
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
    /// A Kafka topic name, optionally `@cluster`.
    KafkaTopicAt,
    /// Comma-separated `topic[@cluster][#group]`.
    TopicList,
    /// `name=host:port,host:port;name2=…`.
    KafkaClusters,
    /// Comma-separated `topic[@cluster][#group]=application/namespace/taskname`.
    RawTopics,
    /// Comma-separated `key=value` librdkafka properties, minus the keys the broker owns.
    KafkaProperties,
    /// Comma-separated items, none empty.
    List,
    /// The [`WorkerEndpoints`] format.
    WorkerEndpoints,
    /// `tracing` filter directives, each a level or `target=level`.
    LogFilter,
    /// Any text.
    Text,
}

impl Allowed {
    /// What is allowed, phrased to follow "must be".
    pub fn describe(&self) -> String {
        match *self {
            Allowed::Integer { min, max } => format!("an integer from {min} to {max}"),
            Allowed::PowerOfTwo { min, max } => {
                format!("a power of two between {min} and {max}")
            }
            Allowed::Bytes { min, max } => format!(
                "a size in bytes from {min} to {max}, optionally with a `KiB`, `MiB` or `GiB` suffix"
            ),
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
            Allowed::KafkaTopicAt => {
                "a Kafka topic name (up to 249 of `a-z A-Z 0-9 . _ -`), optionally `@cluster`"
                    .to_owned()
            }
            Allowed::TopicList => {
                "comma-separated topics, each `topic`, `topic@cluster`, optionally `#group`"
                    .to_owned()
            }
            Allowed::KafkaClusters => {
                "`name=host:port,…;name2=host:port,…` with names of letters, digits and `_`"
                    .to_owned()
            }
            Allowed::RawTopics => {
                "comma-separated `topic=application/namespace/taskname` (`topic` as in `KAFKA_TOPICS`)"
                    .to_owned()
            }
            Allowed::KafkaProperties => format!(
                "comma-separated `key=value` librdkafka properties, except {}",
                code_list(BROKER_OWNED_KAFKA_KEYS, "", ", ")
            ),
            Allowed::List => "a comma-separated list without empty items".to_owned(),
            Allowed::WorkerEndpoints => {
                "`app=url|url;app2=url;*=url` with `http://` or `https://` URLs".to_owned()
            }
            Allowed::LogFilter => format!(
                "a level ({}) or comma-separated `target=level` directives, e.g. \
                 `info,taskbroker=debug`",
                code_list(LOG_LEVELS, "", ", ")
            ),
            Allowed::Text => "any text".to_owned(),
        }
    }

    /// Parses a non-empty, trimmed value. The error may carry a detail; details of secret
    /// settings never quote the value.
    pub(super) fn parse(&self, raw: &str) -> Result<Value, Option<String>> {
        let in_range = |min: u64, max: u64| {
            raw.parse::<u64>()
                .ok()
                .filter(|n| (min..=max).contains(n))
                .ok_or(None)
        };
        match *self {
            Allowed::Integer { min, max } => in_range(min, max).map(Value::Int),
            Allowed::Bytes { min, max } => parse_bytes(raw)
                .filter(|n| (min..=max).contains(n))
                .map(Value::Int)
                .ok_or(None),
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
                if valid_topic_name(raw) {
                    Ok(Value::Text(raw.to_owned()))
                } else {
                    Err(None)
                }
            }
            Allowed::KafkaTopicAt => TopicAt::parse(raw)
                .map(|_| Value::Text(raw.to_owned()))
                .map_err(Some),
            Allowed::TopicList => {
                let items = list_items(raw)?;
                for (i, item) in items.iter().enumerate() {
                    Subscription::parse(item)
                        .map_err(|err| Some(format!("item {} of {}: {err}", i + 1, items.len())))?;
                }
                Ok(Value::List(items))
            }
            Allowed::KafkaClusters => parse_clusters(raw).map(Value::Pairs),
            Allowed::RawTopics => {
                let items = list_items(raw)?;
                let mut pairs = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    parse_raw_item(item)
                        .map_err(|err| Some(format!("item {} of {}: {err}", i + 1, items.len())))?;
                    if let Some((topic, task)) = item.split_once('=') {
                        pairs.push((topic.trim().to_owned(), task.trim().to_owned()));
                    }
                }
                Ok(Value::Pairs(pairs))
            }
            Allowed::KafkaProperties => parse_kafka_properties(raw).map(Value::Pairs),
            Allowed::List => list_items(raw).map(Value::List),
            Allowed::WorkerEndpoints => WorkerEndpoints::parse(raw)
                .map(Value::Endpoints)
                .map_err(Some),
            Allowed::LogFilter => check_log_filter(raw)
                .map(|()| Value::Text(raw.to_owned()))
                .map_err(Some),
            Allowed::Text => Ok(Value::Text(raw.to_owned())),
        }
    }
}

/// The levels a log filter directive may name.
pub const LOG_LEVELS: &[&str] = &["trace", "debug", "info", "warn", "error", "off"];

/// A `tracing` filter as `TASKBROKER_LOG` takes it: every comma-separated
/// directive is a level, or `target=level` (a target may carry span and
/// field filters). A bare word that is not a level (`verbose`, `inf`) would
/// be read by `tracing` as a target to log at every level, which switches
/// everything else off: it is refused, naming the directive.
pub fn check_log_filter(raw: &str) -> Result<(), String> {
    let is_level = |word: &str| LOG_LEVELS.contains(&word.trim().to_ascii_lowercase().as_str());
    for directive in raw.split(',').map(str::trim) {
        let valid = match directive.rsplit_once('=') {
            None => is_level(directive),
            Some((target, level)) => !target.trim().is_empty() && is_level(level),
        };
        if !valid {
            return Err(format!(
                "`{directive}` is neither a level nor a `target=level` directive"
            ));
        }
    }
    tracing_subscriber::EnvFilter::builder()
        .parse(raw)
        .map(drop)
        .map_err(|err| err.to_string())
}

/// Comma-separated items, trimmed, none empty.
fn list_items(raw: &str) -> Result<Vec<String>, Option<String>> {
    let items: Vec<String> = raw.split(',').map(|s| s.trim().to_owned()).collect();
    match items.iter().position(String::is_empty) {
        Some(i) => Err(Some(format!("item {} of {} is empty", i + 1, items.len()))),
        None => Ok(items),
    }
}

/// Parses `KAFKA_CLUSTERS`: `name=servers;name2=servers`.
fn parse_clusters(raw: &str) -> Result<Vec<(String, String)>, Option<String>> {
    let items: Vec<&str> = raw.split(';').map(str::trim).collect();
    let count = items.len();
    let mut clusters: Vec<(String, String)> = Vec::with_capacity(count);
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("cluster {} of {count}", i + 1);
        let Some((name, servers)) = item.split_once('=') else {
            return Err(Some(format!("{at} has no `=`")));
        };
        let (name, servers) = (name.trim(), servers.trim());
        if !valid_cluster_name(name) {
            return Err(Some(format!(
                "{at}: `{name}` is not a cluster name (letters, digits and `_`)"
            )));
        }
        if name.eq_ignore_ascii_case(DEFAULT_CLUSTER) {
            return Err(Some(format!(
                "{at}: `{DEFAULT_CLUSTER}` is the cluster of KAFKA_BROKERS; choose another name"
            )));
        }
        if let Some(first) = clusters
            .iter()
            .position(|(seen, _)| seen.eq_ignore_ascii_case(name))
        {
            return Err(Some(format!(
                "{at} repeats the name of cluster {} (names are compared ignoring case, as \
                 their variables are upper case)",
                first + 1
            )));
        }
        for server in servers.split(',') {
            check_host_port(server.trim()).map_err(|detail| {
                Some(format!(
                    "{at} (`{name}`): {}",
                    detail.unwrap_or_else(|| "bad bootstrap server".to_owned())
                ))
            })?;
        }
        clusters.push((name.to_owned(), servers.to_owned()));
    }
    Ok(clusters)
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
pub(super) fn parse_kafka_properties(raw: &str) -> Result<Vec<(String, String)>, Option<String>> {
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

/// `4096`, `256MiB`, `2 GiB` (suffixes are powers of 1024, ASCII case ignored).
fn parse_bytes(raw: &str) -> Option<u64> {
    let digits = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (number, unit) = raw.split_at(digits);
    let number: u64 = number.parse().ok()?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        _ => return None,
    };
    number.checked_mul(scale)
}
