//! `taskbroker dlq list|show|redrive`: the dead-letter topic
//! (`TASKBROKER_KAFKA_DLQ_TOPIC`) for operators.
//!
//! `list` and `show` read the topic from its beginning up to its end as the
//! command starts, and change nothing. `redrive` republishes the matching
//! dead letters to the main topic (`TASKBROKER_KAFKA_TOPIC`, or `--topic`)
//! as new tasks: a fresh id (derived from the dead letter's topic,
//! partition and offset, so a record redriven twice is one task while the
//! first is still stored), attempts reset, `received_at` now, and the
//! header `taskbroker-redriven-from` naming where it came from. It reads
//! as its own consumer group and commits the offsets it has gone through
//! once every republished record is acknowledged, so a second run of the
//! same redrive starts where the first ended and republishes nothing
//! twice. The default group is derived from the filters (the same filters,
//! the same group); `--group` names one. `--dry-run` shows what would go and
//! commits nothing.

use std::collections::HashSet;
use std::process::ExitCode;
use std::time::Duration;

use chrono::{DateTime, Utc};
use prost::Message as _;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use rdkafka::{Offset, TopicPartitionList};
use serde_json::json;
use taskbroker::config::Config;
use taskbroker::kafka::KafkaSettings;
use taskbroker::proto::TaskActivation;

/// The header (on the republished record and in the activation's own
/// headers) naming the dead letter a task was redriven from.
pub const REDRIVEN_FROM_HEADER: &str = "taskbroker-redriven-from";

/// How long a republished record may wait for Kafka's acknowledgement.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct DlqArgs {
    #[command(subcommand)]
    action: DlqAction,
}

#[derive(clap::Args, Clone, Default)]
struct Filters {
    /// Only dead letters of this namespace.
    #[arg(long)]
    namespace: Option<String>,
    /// Only dead letters of this task name.
    #[arg(long)]
    taskname: Option<String>,
    /// Only dead letters written at or after this time (RFC 3339, e.g.
    /// 2026-12-04T00:00:00Z).
    #[arg(long, value_parser = parse_time)]
    since: Option<DateTime<Utc>>,
    /// Only dead letters written before this time (RFC 3339).
    #[arg(long, value_parser = parse_time)]
    until: Option<DateTime<Utc>>,
    /// Only these activation ids (repeat, or separate with commas).
    #[arg(long = "id", value_delimiter = ',')]
    ids: Vec<String>,
}

#[derive(clap::Subcommand)]
enum DlqAction {
    /// One line per matching dead letter (JSON lines with --json).
    List {
        #[command(flatten)]
        filters: Filters,
        #[arg(long)]
        json: bool,
    },
    /// Matching dead letters in full, decoded.
    Show {
        #[command(flatten)]
        filters: Filters,
    },
    /// Republish matching dead letters to the main topic as new tasks.
    Redrive {
        #[command(flatten)]
        filters: Filters,
        /// Show what would be redriven; publish and commit nothing.
        #[arg(long)]
        dry_run: bool,
        /// The consumer group that records what was redriven (default:
        /// derived from the filters).
        #[arg(long)]
        group: Option<String>,
        /// Where to republish (default TASKBROKER_KAFKA_TOPIC), on the
        /// default cluster.
        #[arg(long)]
        topic: Option<String>,
    },
}

fn parse_time(text: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(text)
        .map(|at| at.with_timezone(&Utc))
        .map_err(|err| format!("{text:?} is not an RFC 3339 time (2026-12-04T00:00:00Z): {err}"))
}

impl Filters {
    fn matches(&self, task: &TaskActivation, written: Option<DateTime<Utc>>) -> bool {
        self.namespace.as_ref().is_none_or(|n| *n == task.namespace)
            && self.taskname.as_ref().is_none_or(|t| *t == task.taskname)
            && (self.ids.is_empty() || self.ids.contains(&task.id))
            && self
                .since
                .is_none_or(|since| written.is_some_and(|at| at >= since))
            && self
                .until
                .is_none_or(|until| written.is_some_and(|at| at < until))
    }

    /// A stable name for these filters, for the default redrive group.
    fn digest(&self) -> String {
        let mut ids = self.ids.clone();
        ids.sort();
        let key = format!(
            "{:?}|{:?}|{:?}|{:?}|{}",
            self.namespace,
            self.taskname,
            self.since.map(|at| at.to_rfc3339()),
            self.until.map(|at| at.to_rfc3339()),
            ids.join(",")
        );
        uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, key.as_bytes())
            .simple()
            .to_string()[..12]
            .to_owned()
    }
}

/// One dead letter read off the topic.
struct DeadLetter {
    partition: i32,
    offset: i64,
    written: Option<DateTime<Utc>>,
    task: Result<TaskActivation, String>,
    bytes: Vec<u8>,
}

pub fn dlq(args: DlqArgs) -> ExitCode {
    super::run_tool(
        "dlq",
        |config| async move { run(&config, args.action).await },
    )
}

async fn run(config: &Config, action: DlqAction) -> Result<(), String> {
    let topology = config.topology();
    let dlq = topology.dlq.clone();
    let kafka = taskbroker::broker::cluster_settings(config, &topology, &dlq.cluster);
    match action {
        DlqAction::List { filters, json } => {
            let (letters, _) = read(&kafka, &dlq.topic, None)?;
            for letter in letters.iter().filter(|l| l.matches(&filters)) {
                println!("{}", letter.line(json));
            }
            Ok(())
        }
        DlqAction::Show { filters } => {
            let (letters, _) = read(&kafka, &dlq.topic, None)?;
            for letter in letters.iter().filter(|l| l.matches(&filters)) {
                let shown = match &letter.task {
                    Ok(task) => crate::cli::inspect::activation_json(task),
                    Err(err) => json!({ "undecodable": err, "bytes": letter.bytes.len() }),
                };
                let mut shown = shown;
                shown["dead_letter"] = json!({
                    "partition": letter.partition,
                    "offset": letter.offset,
                    "written": letter.written.map(|at| at.to_rfc3339()),
                });
                println!(
                    "{}",
                    serde_json::to_string_pretty(&shown).unwrap_or_default()
                );
            }
            Ok(())
        }
        DlqAction::Redrive {
            filters,
            dry_run,
            group,
            topic,
        } => {
            let group = group.unwrap_or_else(|| format!("taskbroker-redrive-{}", filters.digest()));
            let target = topic.unwrap_or_else(|| config.kafka_topic.clone());
            redrive(
                config, &kafka, &dlq.topic, &filters, &group, &target, dry_run,
            )
            .await
        }
    }
}

impl DeadLetter {
    fn matches(&self, filters: &Filters) -> bool {
        self.task
            .as_ref()
            .is_ok_and(|task| filters.matches(task, self.written))
    }

    fn line(&self, json: bool) -> String {
        let task = self.task.as_ref().ok();
        let value = json!({
            "partition": self.partition,
            "offset": self.offset,
            "written": self.written.map(|at| at.to_rfc3339()),
            "id": task.map(|t| t.id.clone()),
            "namespace": task.map(|t| t.namespace.clone()),
            "taskname": task.map(|t| t.taskname.clone()),
            "attempts": task.and_then(|t| t.retry_state.as_ref()).map(|r| r.attempts),
        });
        if json {
            return value.to_string();
        }
        format!(
            "{}/{} {} {} {}/{}",
            self.partition,
            self.offset,
            self.written
                .map_or_else(|| "-".to_owned(), |at| at.to_rfc3339()),
            task.map_or("(undecodable)", |t| t.id.as_str()),
            task.map_or("", |t| t.namespace.as_str()),
            task.map_or("", |t| t.taskname.as_str()),
        )
    }
}

/// Reads `topic` from `group`'s committed offsets (from the beginning when
/// `group` is `None` or has none) up to its end as of now. Answers the
/// records and the consumer (to commit with).
fn read(
    kafka: &KafkaSettings,
    topic: &str,
    group: Option<&str>,
) -> Result<(Vec<DeadLetter>, BaseConsumer), String> {
    let reader_group = group.map_or_else(
        || format!("taskbroker-dlq-reader-{}", uuid::Uuid::new_v4().simple()),
        str::to_owned,
    );
    let consumer: BaseConsumer = kafka
        .consumer(&reader_group, "earliest")
        .create()
        .map_err(|err| format!("Kafka consumer: {err}"))?;
    let timeout = Duration::from_secs(10);
    let metadata = consumer
        .fetch_metadata(Some(topic), timeout)
        .map_err(|err| format!("cannot read the metadata of {topic}: {err}"))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default();
    if partitions.is_empty() {
        return Err(format!(
            "the dead-letter topic {topic} does not exist or has no partitions"
        ));
    }
    let mut assignment = TopicPartitionList::new();
    let mut ends = Vec::new();
    let mut starts = Vec::new();
    for partition in &partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, *partition, timeout)
            .map_err(|err| format!("cannot read the end of {topic}/{partition}: {err}"))?;
        ends.push((*partition, high));
        starts.push((*partition, low));
        assignment
            .add_partition_offset(topic, *partition, Offset::Stored)
            .map_err(|err| err.to_string())?;
    }
    if group.is_some() {
        // Where the group left off (Offset::Stored falls back to the
        // beginning through auto.offset.reset when it has no offset).
        let committed = consumer
            .committed_offsets(assignment.clone(), timeout)
            .map_err(|err| format!("cannot read the committed offsets of {reader_group}: {err}"))?;
        assignment = committed;
        for element in assignment.clone().elements() {
            if element.offset() == Offset::Invalid {
                assignment
                    .set_partition_offset(topic, element.partition(), Offset::Beginning)
                    .map_err(|err| err.to_string())?;
            }
        }
    } else {
        for partition in &partitions {
            assignment
                .set_partition_offset(topic, *partition, Offset::Beginning)
                .map_err(|err| err.to_string())?;
        }
    }
    let mut positions: Vec<(i32, i64)> = assignment
        .elements()
        .iter()
        .map(|element| {
            // Records before the low watermark are gone (retention).
            let low = starts
                .iter()
                .find(|(p, _)| *p == element.partition())
                .map_or(0, |(_, low)| *low);
            let start = match element.offset() {
                Offset::Offset(offset) => offset.max(low),
                _ => low,
            };
            (element.partition(), start)
        })
        .collect();
    consumer
        .assign(&assignment)
        .map_err(|err| format!("cannot read {topic}: {err}"))?;
    let mut letters = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let done = |positions: &[(i32, i64)]| {
        positions.iter().all(|(partition, next)| {
            ends.iter()
                .find(|(p, _)| p == partition)
                .is_none_or(|(_, end)| next >= end)
        })
    };
    while !done(&positions) {
        if std::time::Instant::now() > deadline {
            return Err(format!(
                "reading {topic} took longer than a minute; is Kafka reachable?"
            ));
        }
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let message = message.map_err(|err| format!("cannot read {topic}: {err}"))?;
        let partition = message.partition();
        let offset = message.offset();
        if let Some(position) = positions.iter_mut().find(|(p, _)| *p == partition) {
            position.1 = offset + 1;
        }
        let end = ends
            .iter()
            .find(|(p, _)| *p == partition)
            .map_or(0, |(_, end)| *end);
        if offset >= end {
            // Written after the command started: left for the next run.
            continue;
        }
        let bytes = message.payload().unwrap_or_default().to_vec();
        letters.push(DeadLetter {
            partition,
            offset,
            written: message
                .timestamp()
                .to_millis()
                .and_then(DateTime::from_timestamp_millis),
            task: TaskActivation::decode(bytes.as_slice()).map_err(|err| err.to_string()),
            bytes,
        });
    }
    Ok((letters, consumer))
}

async fn redrive(
    config: &Config,
    kafka: &KafkaSettings,
    dlq_topic: &str,
    filters: &Filters,
    group: &str,
    target: &str,
    dry_run: bool,
) -> Result<(), String> {
    let (letters, consumer) = read(kafka, dlq_topic, Some(group))?;
    let chosen: Vec<&DeadLetter> = letters.iter().filter(|l| l.matches(filters)).collect();
    if dry_run {
        for letter in &chosen {
            println!("would redrive {}", letter.line(false));
        }
        println!(
            "dry run: {} of {} dead letters since group {group}'s last redrive match; \
             nothing published or committed",
            chosen.len(),
            letters.len()
        );
        return Ok(());
    }
    let producer = KafkaSettings::from_config(config)
        .create_producer(DELIVERY_TIMEOUT)
        .map_err(|err| format!("Kafka producer: {err}"))?;
    let now = Utc::now();
    let mut seen = HashSet::new();
    let mut sends = Vec::new();
    for letter in &chosen {
        let Ok(original) = &letter.task else { continue };
        let source = format!("{dlq_topic}/{}/{}", letter.partition, letter.offset);
        if !seen.insert(source.clone()) {
            continue;
        }
        let task = redriven(original, &source, now);
        let payload = task.encode_to_vec();
        let headers = OwnedHeaders::new().insert(Header {
            key: REDRIVEN_FROM_HEADER,
            value: Some(source.as_str()),
        });
        let producer = producer.clone();
        sends.push(async move {
            let sent = producer
                .send(
                    FutureRecord::to(target)
                        .key(&task.id)
                        .payload(&payload)
                        .headers(headers),
                    rdkafka::util::Timeout::After(DELIVERY_TIMEOUT),
                )
                .await;
            (task.id, original.id.clone(), sent.map_err(|(err, _)| err))
        });
    }
    let mut failed = 0;
    let mut published = 0;
    for (id, original, sent) in futures::future::join_all(sends).await {
        match sent {
            Ok(_) => {
                published += 1;
                println!("redriven {original} as {id}");
            }
            Err(err) => {
                failed += 1;
                eprintln!("cannot republish {original}: {err}");
            }
        }
    }
    if failed > 0 {
        // Nothing committed: the next run goes through the same records
        // again; those already republished get the same ids.
        return Err(format!(
            "{failed} dead letters could not be republished ({published} were); \
             no offset committed, run the redrive again"
        ));
    }
    if !letters.is_empty() {
        let mut done = TopicPartitionList::new();
        for letter in &letters {
            done.add_partition_offset(
                dlq_topic,
                letter.partition,
                Offset::Offset(letter.offset + 1),
            )
            .map_err(|err| err.to_string())?;
        }
        consumer
            .commit(&done, CommitMode::Sync)
            .map_err(|err| format!("republished {published}, but cannot commit group {group}'s offsets: {err}; a second run republishes them with the same ids"))?;
    }
    println!(
        "redrove {published} of {} dead letters read to {target} (group {group})",
        letters.len()
    );
    Ok(())
}

/// The new task for a dead letter: a fresh id derived from where the dead
/// letter is (so redriving the same record twice makes the same task),
/// attempts reset, received now, and a header naming its source.
pub fn redriven(original: &TaskActivation, source: &str, now: DateTime<Utc>) -> TaskActivation {
    let mut task = original.clone();
    task.id = uuid::Uuid::new_v5(
        &uuid::Uuid::NAMESPACE_OID,
        format!("redrive/{source}").as_bytes(),
    )
    .to_string();
    if let Some(retry) = task.retry_state.as_mut() {
        retry.attempts = 0;
    }
    task.received_at = Some(prost_types::Timestamp {
        seconds: now.timestamp(),
        nanos: i32::try_from(now.timestamp_subsec_nanos()).unwrap_or(0),
    });
    task.headers
        .insert(REDRIVEN_FROM_HEADER.to_owned(), source.to_owned());
    task.headers
        .insert("taskbroker-redriven-id".to_owned(), original.id.clone());
    task
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redriven_task_is_new_and_names_its_source() {
        let original = TaskActivation {
            id: "old".to_owned(),
            namespace: "ns".to_owned(),
            retry_state: Some(taskbroker::proto::RetryState {
                attempts: 3,
                max_attempts: 3,
                ..Default::default()
            }),
            ..Default::default()
        };
        let now = Utc::now();
        let task = redriven(&original, "dlq/0/7", now);
        assert_ne!(task.id, "old");
        assert_eq!(
            task.id,
            redriven(&original, "dlq/0/7", now).id,
            "same source, same id"
        );
        assert_ne!(task.id, redriven(&original, "dlq/0/8", now).id);
        assert_eq!(task.retry_state.unwrap().attempts, 0);
        assert_eq!(task.headers[REDRIVEN_FROM_HEADER], "dlq/0/7");
        assert_eq!(task.headers["taskbroker-redriven-id"], "old");
        assert_eq!(task.received_at.unwrap().seconds, now.timestamp());
    }

    #[test]
    fn filters_combine() {
        let task = TaskActivation {
            id: "a".to_owned(),
            namespace: "ns".to_owned(),
            taskname: "t".to_owned(),
            ..Default::default()
        };
        let at = Utc::now();
        assert!(Filters::default().matches(&task, None));
        let by_id = Filters {
            ids: vec!["b".to_owned()],
            ..Default::default()
        };
        assert!(!by_id.matches(&task, Some(at)));
        let window = Filters {
            namespace: Some("ns".to_owned()),
            since: Some(at - chrono::TimeDelta::hours(1)),
            until: Some(at),
            ..Default::default()
        };
        assert!(window.matches(&task, Some(at - chrono::TimeDelta::minutes(1))));
        assert!(!window.matches(&task, Some(at)), "until is exclusive");
        assert!(!window.matches(&task, None), "no timestamp, no time match");
        assert_ne!(Filters::default().digest(), window.digest());
        assert_eq!(window.digest(), window.clone().digest());
    }
}
