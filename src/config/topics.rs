//! Which Kafka topics the broker consumes and produces to, and on which clusters.
//!
//! A topic is named `topic` (on the default cluster: `KAFKA_BROKERS`, `KAFKA_CONFIG`) or
//! `topic@cluster`, a cluster of `KAFKA_CLUSTERS` (`name=bootstrap;name2=bootstrap2`) whose
//! librdkafka properties are `KAFKA_CLUSTER_<NAME>_CONFIG`. A consumed topic may name its own
//! consumer group: `topic@cluster#group`. By default the first consumed topic's group is
//! `KAFKA_CONSUMER_GROUP` and every other topic's is `KAFKA_CONSUMER_GROUP-topic`: consumers
//! sharing a group rebalance together (each join revokes every member's partitions), which
//! would let one topic's consumer stall another's.
//!
//! `KAFKA_TOPICS` lists the consumed topics of TaskActivation records (unset: `KAFKA_TOPIC`
//! alone); `KAFKA_RAW_TOPICS` (`topic=application/namespace/taskname`) lists topics of plain
//! payloads, each record of which becomes a new task of that name. A topic in both lists is
//! consumed once, as raw. Every consumed topic gets a consumer of its own.
//!
//! This file parses the items (the per-setting checks of `allowed.rs` call it) and resolves the
//! whole table ([`Topology`]) from a validated [`Config`].

use std::fmt;
use std::time::Duration;

use super::ENV_PREFIX;
use super::settings::{Config, RawCompression};

/// The name that stands for the cluster of `KAFKA_BROKERS` and `KAFKA_CONFIG`.
pub const DEFAULT_CLUSTER: &str = "default";

/// The variable holding the librdkafka properties of cluster `name`.
pub fn cluster_config_variable(name: &str) -> String {
    format!(
        "{ENV_PREFIX}KAFKA_CLUSTER_{}_CONFIG",
        name.to_ascii_uppercase()
    )
}

/// Whether `variable` (a full `TASKBROKER_…` name) has the shape of a cluster's properties
/// variable, so it is not reported as unknown.
pub fn is_cluster_config_variable(variable: &str) -> bool {
    variable
        .strip_prefix(ENV_PREFIX)
        .and_then(|name| name.strip_prefix("KAFKA_CLUSTER_"))
        .and_then(|name| name.strip_suffix("_CONFIG"))
        .is_some_and(valid_cluster_name)
}

/// A cluster name: letters, digits and `_`, as it must fit in a variable name.
pub fn valid_cluster_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Kafka's own rule for topic names.
pub fn valid_topic_name(topic: &str) -> bool {
    !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// A topic on a cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TopicAt {
    pub topic: String,
    /// [`DEFAULT_CLUSTER`] or a name of `KAFKA_CLUSTERS`.
    pub cluster: String,
}

impl TopicAt {
    /// Parses `topic` or `topic@cluster`.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let (topic, cluster) = match raw.split_once('@') {
            Some((topic, cluster)) => (topic.trim(), cluster.trim()),
            None => (raw.trim(), DEFAULT_CLUSTER),
        };
        if !valid_topic_name(topic) {
            return Err(format!(
                "`{topic}` is not a Kafka topic name (up to 249 of `a-z A-Z 0-9 . _ -`)"
            ));
        }
        if !valid_cluster_name(cluster) {
            return Err(format!(
                "`{cluster}` is not a cluster name (letters, digits and `_`)"
            ));
        }
        Ok(TopicAt {
            topic: topic.to_owned(),
            cluster: cluster.to_owned(),
        })
    }

    pub fn on_default_cluster(&self) -> bool {
        self.cluster == DEFAULT_CLUSTER
    }
}

impl fmt::Display for TopicAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.on_default_cluster() {
            f.write_str(&self.topic)
        } else {
            write!(f, "{}@{}", self.topic, self.cluster)
        }
    }
}

/// A consumed topic as listed: `topic[@cluster][#group]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subscription {
    pub topic: TopicAt,
    /// `None`: `KAFKA_CONSUMER_GROUP`.
    pub group: Option<String>,
}

impl Subscription {
    pub fn parse(raw: &str) -> Result<Self, String> {
        let (topic, group) = match raw.split_once('#') {
            Some((topic, group)) => {
                let group = group.trim();
                if group.is_empty() {
                    return Err(format!("`{raw}` names an empty consumer group after `#`"));
                }
                (topic, Some(group.to_owned()))
            }
            None => (raw, None),
        };
        Ok(Subscription {
            topic: TopicAt::parse(topic)?,
            group,
        })
    }
}

/// The task a raw topic's records become: `application/namespace/taskname`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTaskName {
    pub application: String,
    pub namespace: String,
    pub taskname: String,
}

impl RawTaskName {
    pub fn parse(raw: &str) -> Result<Self, String> {
        let parts: Vec<&str> = raw.split('/').map(str::trim).collect();
        match parts.as_slice() {
            [application, namespace, taskname]
                if !application.is_empty() && !namespace.is_empty() && !taskname.is_empty() =>
            {
                Ok(RawTaskName {
                    application: (*application).to_owned(),
                    namespace: (*namespace).to_owned(),
                    taskname: (*taskname).to_owned(),
                })
            }
            _ => Err(format!(
                "`{raw}` is not `application/namespace/taskname` with three non-empty parts"
            )),
        }
    }
}

impl fmt::Display for RawTaskName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/{}",
            self.application, self.namespace, self.taskname
        )
    }
}

/// Parses one `KAFKA_RAW_TOPICS` item: `topic[@cluster][#group]=application/namespace/taskname`.
pub fn parse_raw_item(item: &str) -> Result<(Subscription, RawTaskName), String> {
    let Some((topic, task)) = item.split_once('=') else {
        return Err(format!("`{item}` has no `=application/namespace/taskname`"));
    };
    let subscription = Subscription::parse(topic)?;
    let task =
        RawTaskName::parse(task).map_err(|err| format!("topic `{}`: {err}", subscription.topic))?;
    Ok((subscription, task))
}

/// How a raw topic's records are turned into tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawMode {
    pub task: RawTaskName,
    /// `KAFKA_RAW_DEADLINE_SEC`.
    pub deadline: Duration,
    /// `KAFKA_RAW_COMPRESSION`.
    pub compression: RawCompression,
}

/// One consumer: a topic, its group, and (for raw topics) how records become tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumedTopic {
    pub topic: TopicAt,
    pub group: String,
    pub raw: Option<RawMode>,
}

/// A Kafka cluster: bootstrap servers and librdkafka properties.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaCluster {
    pub name: String,
    pub brokers: String,
    pub properties: Vec<(String, String)>,
}

/// Every topic the broker touches and every cluster they are on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The default cluster first, then `KAFKA_CLUSTERS` in order.
    pub clusters: Vec<KafkaCluster>,
    /// In order: `KAFKA_TOPICS` (or `KAFKA_TOPIC`), then raw topics not listed there.
    pub consumed: Vec<ConsumedTopic>,
    pub retry: TopicAt,
    pub dlq: TopicAt,
    pub ingest_dlq: TopicAt,
}

impl Topology {
    /// The cluster called `name`; every name in a validated configuration resolves.
    pub fn cluster(&self, name: &str) -> Option<&KafkaCluster> {
        self.clusters.iter().find(|cluster| cluster.name == name)
    }

    /// The table `taskbroker config` prints: one line per topic.
    pub fn render(&self) -> String {
        let mut lines = vec![format!(
            "{:<10} {:<32} {:<12} {:<20} {}",
            "ROLE", "TOPIC", "CLUSTER", "GROUP", "MODE"
        )];
        for consumed in &self.consumed {
            let mode = match &consumed.raw {
                None => "activations".to_owned(),
                Some(raw) => format!(
                    "raw -> {} (deadline {} s, compression {})",
                    raw.task,
                    raw.deadline.as_secs(),
                    raw.compression
                ),
            };
            lines.push(format!(
                "{:<10} {:<32} {:<12} {:<20} {mode}",
                "consume", consumed.topic.topic, consumed.topic.cluster, consumed.group
            ));
        }
        for (role, topic) in [
            ("retry", &self.retry),
            ("dlq", &self.dlq),
            ("ingest-dlq", &self.ingest_dlq),
        ] {
            lines.push(format!(
                "{role:<10} {:<32} {:<12} {:<20} produce",
                topic.topic, topic.cluster, "-"
            ));
        }
        for cluster in &self.clusters {
            lines.push(format!(
                "cluster {} = {} ({} extra properties)",
                cluster.name,
                cluster.brokers,
                cluster.properties.len()
            ));
        }
        lines.join("\n") + "\n"
    }
}

impl Config {
    /// The consumed topics, the produced topics and their clusters. The configuration was
    /// validated, so every item parses and every cluster is declared.
    pub fn topology(&self) -> Topology {
        let mut clusters = vec![KafkaCluster {
            name: DEFAULT_CLUSTER.to_owned(),
            brokers: self.kafka_brokers.clone(),
            properties: self.kafka_config.clone(),
        }];
        for (name, brokers) in &self.kafka_clusters {
            let properties = self
                .kafka_cluster_properties
                .iter()
                .find(|(cluster, _)| cluster == name)
                .map(|(_, properties)| properties.clone())
                .unwrap_or_default();
            clusters.push(KafkaCluster {
                name: name.clone(),
                brokers: brokers.clone(),
                properties,
            });
        }
        // The first consumed topic keeps `KAFKA_CONSUMER_GROUP` (adding a topic does not move
        // the main topic's offsets); every other topic gets a group of its own, so a join or
        // a rebalance of one topic's consumer never revokes another's partitions.
        let group_of = |subscription: &Subscription, first: bool| {
            subscription.group.clone().unwrap_or_else(|| {
                if first {
                    self.kafka_consumer_group.clone()
                } else {
                    format!("{}-{}", self.kafka_consumer_group, subscription.topic.topic)
                }
            })
        };
        let raw: Vec<(Subscription, RawTaskName)> = self
            .kafka_raw_topics
            .iter()
            .filter_map(|(topic, task)| {
                Some((
                    Subscription::parse(topic).ok()?,
                    RawTaskName::parse(task).ok()?,
                ))
            })
            .collect();
        let raw_mode = |task: &RawTaskName| RawMode {
            task: task.clone(),
            deadline: self.kafka_raw_deadline,
            compression: self.kafka_raw_compression,
        };
        let mut consumed: Vec<ConsumedTopic> = self
            .subscriptions()
            .into_iter()
            .enumerate()
            .map(|(index, subscription)| {
                let raw = raw
                    .iter()
                    .find(|(listed, _)| listed.topic == subscription.topic)
                    .map(|(_, task)| raw_mode(task));
                ConsumedTopic {
                    group: group_of(&subscription, index == 0),
                    topic: subscription.topic,
                    raw,
                }
            })
            .collect();
        for (subscription, task) in &raw {
            if !consumed.iter().any(|c| c.topic == subscription.topic) {
                consumed.push(ConsumedTopic {
                    topic: subscription.topic.clone(),
                    group: group_of(subscription, consumed.is_empty()),
                    raw: Some(raw_mode(task)),
                });
            }
        }
        let parse = |raw: &str| {
            TopicAt::parse(raw).unwrap_or_else(|_| TopicAt {
                topic: raw.to_owned(),
                cluster: DEFAULT_CLUSTER.to_owned(),
            })
        };
        Topology {
            clusters,
            consumed,
            retry: self.retry_topic_at(),
            dlq: parse(&self.kafka_dlq_topic),
            ingest_dlq: parse(&self.kafka_ingest_dlq_topic),
        }
    }

    /// `KAFKA_TOPICS` parsed, or `KAFKA_TOPIC` alone when it is unset.
    fn subscriptions(&self) -> Vec<Subscription> {
        if self.kafka_topics.is_empty() {
            return vec![Subscription {
                topic: TopicAt {
                    topic: self.kafka_topic.clone(),
                    cluster: DEFAULT_CLUSTER.to_owned(),
                },
                group: None,
            }];
        }
        self.kafka_topics
            .iter()
            .filter_map(|item| Subscription::parse(item).ok())
            .collect()
    }

    /// Where retries go: `KAFKA_RETRY_TOPIC`; unset, the first topic of `KAFKA_TOPICS`, or
    /// `KAFKA_TOPIC` when that is unset too.
    pub fn retry_topic_at(&self) -> TopicAt {
        match &self.kafka_retry_topic {
            Some(raw) => TopicAt::parse(raw).unwrap_or_else(|_| TopicAt {
                topic: raw.clone(),
                cluster: DEFAULT_CLUSTER.to_owned(),
            }),
            None => self
                .subscriptions()
                .into_iter()
                .next()
                .map(|subscription| subscription.topic)
                .unwrap_or_else(|| TopicAt {
                    topic: self.kafka_topic.clone(),
                    cluster: DEFAULT_CLUSTER.to_owned(),
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_parse_with_and_without_cluster_and_group() {
        let plain = Subscription::parse("tasks").unwrap();
        assert_eq!(plain.topic.to_string(), "tasks");
        assert!(plain.topic.on_default_cluster());
        assert_eq!(plain.group, None);
        let full = Subscription::parse("tasks-long@east#long-pool").unwrap();
        assert_eq!(full.topic.topic, "tasks-long");
        assert_eq!(full.topic.cluster, "east");
        assert_eq!(full.group.as_deref(), Some("long-pool"));
        for bad in ["", "a b", "t@", "t@x-y", "t#", "@east"] {
            assert!(Subscription::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn raw_items_need_three_named_parts() {
        let (subscription, task) = parse_raw_item("events@east=app/ns/ingest").unwrap();
        assert_eq!(subscription.topic.to_string(), "events@east");
        assert_eq!(task.to_string(), "app/ns/ingest");
        for bad in ["events", "events=app/ns", "events=app//task", "=a/b/c"] {
            assert!(parse_raw_item(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cluster_config_variables_are_recognised() {
        assert!(is_cluster_config_variable(
            "TASKBROKER_KAFKA_CLUSTER_EAST_CONFIG"
        ));
        assert!(!is_cluster_config_variable("TASKBROKER_KAFKA_CLUSTER__X"));
        assert_eq!(
            cluster_config_variable("east"),
            "TASKBROKER_KAFKA_CLUSTER_EAST_CONFIG"
        );
    }
}
