//! What the harness produces to Kafka, and how a burn-down's tasks get
//! there without the mock cluster losing any.
//!
//! librdkafka's mock cluster keeps the newest 5 MiB of each partition
//! (`max_size` in rdkafka_mock.c, fixed) and deletes older record batches,
//! consumed or not, without a word: that is the "about 32,000 records per
//! partition" once measured with the small default task (a burn-down lost
//! the first 6,838 records of a partition that held 39,545). Worse, when an
//! append deletes every batch that was there before it, the log's start
//! offset is set past the batch being appended, which is then lost too
//! (rdkafka-sys 4.10 / librdkafka 2.12.1, `rd_kafka_mock_msgset_destroy`
//! taking the new end offset for the start). A record over half the 5 MiB
//! does that to the next one in its partition; seen as a broker that got
//! the first 4 MiB task of each partition and none after. So:
//!
//! - after each record over [`MOCK_PARTITION_BYTES`] / 2 the producer
//!   sends a *spacer*, a tiny task that expired an hour ago, which the
//!   broker counts (`taskbroker_consumer_records_total{result="expired"}`)
//!   and drops as it reads it. The next large record then deletes the
//!   large one before it but not the spacer, and the log stays whole.
//!   Records that do not fit in 5 MiB beside a spacer cannot pass through
//!   the mock cluster at all: they need `--kafka-brokers`.
//! - a burn-down produces every task before the broker starts when the
//!   partitions asked for hold them, a fifth of the 5 MiB to spare;
//! - when up to [`MOST_PARTITIONS_SUGGESTED`] partitions would, a plain
//!   burn-down is refused with the number to ask for (a backlog wholly in
//!   Kafka is its definition, and more partitions keep it); one that holds
//!   the workers back (`--workers-after-pause`) measures the store, not the
//!   rate, and is paced as below;
//! - past that (large tasks: 1,000 of 4 MiB would need 1,000 partitions)
//!   the partitions are filled up front and the rest is produced as the
//!   broker's consumer group commits, never more unconsumed in a partition
//!   than it keeps. The broker finds tasks waiting in Kafka whenever it
//!   reads, unless the harness falls behind, which the report tells
//!   (polls that found nothing unconsumed while tasks were left to send).
//!
//! A real Kafka (`--kafka-brokers`) takes every task up front, no spacers.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer as _, ThreadedProducer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use taskbroker::proto::TaskActivation;

use crate::harness::Kafka;
use crate::payload::{self, Parameters};

/// What the mock cluster keeps of each partition.
pub const MOCK_PARTITION_BYTES: usize = 5 << 20;

/// Room a record batch of one record takes besides the record (batch and
/// record headers), rounded up generously.
const BATCH_FRAMING_BYTES: usize = 1 << 10;

/// Most partitions a refused burn-down is told to ask for; beyond, it is
/// paced instead.
pub const MOST_PARTITIONS_SUGGESTED: u64 = 64;

/// Records per partition of the small default task the harness always
/// allowed (32,000 were kept).
const SMALL_TASKS_PER_PARTITION: u64 = 25_000;

/// Produces bench activations (payload.rs), `received_at` = the moment
/// each is sent, to the partitions round-robin or to the one asked for,
/// each large one followed by a spacer on the mock cluster.
pub struct Producer {
    inner: ThreadedProducer<DefaultProducerContext>,
    topic: String,
    parameters: Parameters,
    spacers: bool,
    next: AtomicUsize,
    /// Tasks (not spacers) handed to librdkafka, by partition.
    sent: Vec<AtomicU64>,
}

impl Producer {
    pub fn new(
        kafka: &Kafka,
        topic: &str,
        partitions: i32,
        linger_ms: u64,
        parameters: Parameters,
    ) -> Result<Producer, String> {
        let record = payload::encoded_len(parameters) + BATCH_FRAMING_BYTES;
        let spacer = prost::Message::encoded_len(&spacer()) + BATCH_FRAMING_BYTES;
        if kafka.is_mock() && record + spacer > MOCK_PARTITION_BYTES {
            return Err(format!(
                "tasks of {} bytes do not pass through the mock Kafka cluster, which keeps 5 MiB per partition (feed.rs): use --kafka-brokers",
                payload::encoded_len(parameters)
            ));
        }
        // librdkafka refuses records over `message.max.bytes` (1,000,000 by
        // default) before sending them; room as the broker's own producers
        // have (taskbroker::kafka). `batch.size` stays at 1,000,000, so a
        // large record is a batch of its own, and a spacer never shares it.
        let max_record = (payload::encoded_len(parameters)
            + taskbroker::kafka::PRODUCER_HEADROOM_BYTES)
            .max(1_000_000);
        let inner = ClientConfig::new()
            .set("bootstrap.servers", &kafka.brokers)
            .set("linger.ms", linger_ms.to_string())
            .set("message.max.bytes", max_record.to_string())
            .set("queue.buffering.max.messages", "1000000")
            .set("queue.buffering.max.kbytes", "1048576")
            .create()
            .map_err(|err| format!("cannot create a producer: {err}"))?;
        Ok(Producer {
            inner,
            topic: topic.to_owned(),
            parameters,
            spacers: kafka.is_mock() && record > MOCK_PARTITION_BYTES / 2,
            next: AtomicUsize::new(0),
            sent: (0..partitions.max(1)).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    pub fn partitions(&self) -> usize {
        self.sent.len()
    }

    /// Whether each task is followed by a spacer.
    pub fn sends_spacers(&self) -> bool {
        self.spacers
    }

    /// Tasks among the first `records` of a partition: every other one is
    /// a spacer when they are sent.
    fn tasks_in(&self, records: u64) -> u64 {
        if self.spacers {
            records.div_ceil(2)
        } else {
            records
        }
    }

    /// Tasks sent to `partition` so far.
    pub fn sent_to(&self, partition: usize) -> u64 {
        self.sent
            .get(partition)
            .map_or(0, |n| n.load(Ordering::Relaxed))
    }

    /// Sends one task to the next partition in turn.
    pub fn send(&self) -> Result<(), String> {
        let partition = self.next.fetch_add(1, Ordering::Relaxed) % self.partitions();
        self.send_to(partition)
    }

    /// Sends one task to `partition` (below [`Producer::partitions`]), and
    /// its spacer if it needs one.
    pub fn send_to(&self, partition: usize) -> Result<(), String> {
        let index = i32::try_from(partition).map_err(|_| format!("partition {partition}"))?;
        self.send_record(index, &payload::activation(self.parameters))?;
        if let Some(sent) = self.sent.get(partition) {
            sent.fetch_add(1, Ordering::Relaxed);
        }
        if self.spacers {
            self.send_record(index, &spacer())?;
        }
        Ok(())
    }

    /// Sends `task`, waiting while librdkafka's queue is full.
    fn send_record(&self, partition: i32, task: &TaskActivation) -> Result<(), String> {
        let payload = prost::Message::encode_to_vec(task);
        loop {
            let record = BaseRecord::<(), [u8]>::to(&self.topic)
                .partition(partition)
                .payload(&payload[..]);
            match self.inner.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err((err, _)) => return Err(format!("produce: {err}")),
            }
        }
    }

    pub fn flush(&self) -> Result<(), String> {
        self.inner
            .flush(Duration::from_secs(60))
            .map_err(|err| format!("flushing the producer: {err}"))
    }
}

/// A task the broker drops as it reads it: it expired an hour ago.
fn spacer() -> TaskActivation {
    let hour_ago = SystemTime::now() - Duration::from_secs(3600);
    TaskActivation {
        id: format!("spacer-{}", uuid::Uuid::new_v4().simple()),
        namespace: "bench-spacer".to_owned(),
        taskname: "bench.spacer".to_owned(),
        received_at: Some(hour_ago.into()),
        expires: Some(1),
        processing_deadline_duration: 60,
        ..Default::default()
    }
}

/// How often the paced producer reads the group's committed offsets.
const POLL: Duration = Duration::from_millis(10);

/// How a burn-down's tasks are produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backlog {
    /// All of them before the broker starts.
    UpFront,
    /// At most `ahead` records unconsumed in any partition.
    Paced { ahead: u64 },
}

impl Backlog {
    /// The backlog for `tasks` records of `record_bytes` in `partitions`,
    /// or, unless `may_pace`, the refusal that names the partitions to ask
    /// for.
    pub fn plan(
        mock: bool,
        tasks: u64,
        partitions: usize,
        record_bytes: usize,
        may_pace: bool,
    ) -> Result<Backlog, String> {
        if !mock {
            return Ok(Backlog::UpFront);
        }
        let capacity = mock_partition_capacity(record_bytes);
        let needed = tasks.div_ceil(capacity);
        if needed <= partitions as u64 {
            Ok(Backlog::UpFront)
        } else if needed <= MOST_PARTITIONS_SUGGESTED && !may_pace {
            Err(format!(
                "the mock cluster keeps 5 MiB per partition, about {capacity} of these tasks: use --partitions {needed} or more for {tasks} tasks"
            ))
        } else {
            Ok(Backlog::Paced { ahead: capacity })
        }
    }
}

/// Records of `record_bytes` one partition of the mock cluster holds
/// unconsumed, with a fifth to spare for batch framing and spacers; at
/// least one (it always keeps the newest batch).
pub fn mock_partition_capacity(record_bytes: usize) -> u64 {
    let room = MOCK_PARTITION_BYTES - MOCK_PARTITION_BYTES / 5;
    ((room / record_bytes.max(1)) as u64).clamp(1, SMALL_TASKS_PER_PARTITION)
}

/// A burn-down's producing: the up-front part done, the paced rest (if
/// any) running on a thread of its own until every task is sent or the
/// feed is dropped.
pub struct Feed {
    up_front: u64,
    paced: Option<JoinHandle<Result<Pacing, String>>>,
    stop: Arc<AtomicBool>,
}

/// What the paced part saw.
#[derive(Debug, Clone, Copy, Default)]
pub struct Pacing {
    pub ahead: u64,
    pub polls: u64,
    /// Polls that found every record sent so far consumed, tasks left.
    pub dry_polls: u64,
}

impl Feed {
    /// Produces what `backlog` allows before the broker starts and waits
    /// until Kafka has it; the rest is produced as `group`, the broker's
    /// consumer group, commits on `producer`'s topic.
    pub fn start(
        producer: Arc<Producer>,
        brokers: &str,
        topic: &str,
        group: &str,
        total: u64,
        backlog: Backlog,
    ) -> Result<Feed, String> {
        let ahead = match backlog {
            Backlog::UpFront => u64::MAX,
            Backlog::Paced { ahead } => ahead,
        };
        let nothing_consumed = vec![0; producer.partitions()];
        let up_front = top_up(&producer, &nothing_consumed, ahead, total)?;
        producer.flush()?;
        let stop = Arc::new(AtomicBool::new(false));
        let paced = if up_front < total {
            let committed = CommittedOffsets::new(brokers, topic, group, producer.partitions())?;
            let stop = Arc::clone(&stop);
            Some(std::thread::spawn(move || {
                pace(&producer, &committed, ahead, total, &stop)
            }))
        } else {
            None
        };
        Ok(Feed {
            up_front,
            paced,
            stop,
        })
    }

    /// Tasks produced before the broker started.
    pub fn up_front(&self) -> u64 {
        self.up_front
    }

    /// Waits for the paced part to have sent (and flushed) every task;
    /// `None` if everything went up front.
    pub fn finish(mut self) -> Result<Option<Pacing>, String> {
        match self.paced.take() {
            None => Ok(None),
            Some(thread) => thread
                .join()
                .map_err(|_| "the producing thread panicked".to_owned())?
                .map(Some),
        }
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Sends round-robin to every partition with fewer than `ahead` records
/// past `consumed`, until none has or `total` are sent; returns how many
/// it sent.
fn top_up(producer: &Producer, consumed: &[u64], ahead: u64, total: u64) -> Result<u64, String> {
    let partitions = producer.partitions();
    let mut sent: u64 = (0..partitions).map(|p| producer.sent_to(p)).sum();
    let before = sent;
    loop {
        let mut any = false;
        for partition in 0..partitions {
            if sent >= total {
                return Ok(sent - before);
            }
            let done = consumed.get(partition).copied().unwrap_or(0);
            if producer.sent_to(partition) < done.saturating_add(ahead) {
                producer.send_to(partition)?;
                sent += 1;
                any = true;
            }
        }
        if !any {
            return Ok(sent - before);
        }
    }
}

fn pace(
    producer: &Producer,
    committed: &CommittedOffsets,
    ahead: u64,
    total: u64,
    stop: &AtomicBool,
) -> Result<Pacing, String> {
    let mut pacing = Pacing {
        ahead,
        ..Pacing::default()
    };
    let partitions = producer.partitions();
    loop {
        if stop.load(Ordering::Relaxed) {
            return Err("stopped before every task was produced".to_owned());
        }
        // Kafka not answering in time is retried at the next poll.
        if let Some(records) = committed.read() {
            let consumed: Vec<u64> = records.iter().map(|&r| producer.tasks_in(r)).collect();
            pacing.polls += 1;
            if (0..partitions).all(|p| producer.sent_to(p) <= consumed.get(p).copied().unwrap_or(0))
            {
                pacing.dry_polls += 1;
            }
            top_up(producer, &consumed, ahead, total)?;
            let sent: u64 = (0..partitions).map(|p| producer.sent_to(p)).sum();
            if sent >= total {
                producer.flush()?;
                return Ok(pacing);
            }
        }
        std::thread::sleep(POLL);
    }
}

/// The broker's consumer group's committed offsets on one topic, read with
/// a consumer of that group that never joins it (OffsetFetch only).
struct CommittedOffsets {
    consumer: BaseConsumer,
    topic: String,
    partitions: TopicPartitionList,
    count: usize,
}

impl CommittedOffsets {
    fn new(
        brokers: &str,
        topic: &str,
        group: &str,
        count: usize,
    ) -> Result<CommittedOffsets, String> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .map_err(|err| format!("cannot create a consumer to read {group}'s offsets: {err}"))?;
        let mut partitions = TopicPartitionList::new();
        for partition in 0..count {
            let index = i32::try_from(partition).map_err(|_| format!("partition {partition}"))?;
            partitions.add_partition(topic, index);
        }
        Ok(CommittedOffsets {
            consumer,
            topic: topic.to_owned(),
            partitions,
            count,
        })
    }

    /// Records consumed from each partition (the committed offset; 0
    /// before the first commit), or `None` when Kafka did not answer.
    fn read(&self) -> Option<Vec<u64>> {
        let list = self
            .consumer
            .committed_offsets(self.partitions.clone(), Duration::from_secs(2))
            .ok()?;
        let mut consumed = vec![0; self.count];
        for element in list.elements_for_topic(&self.topic) {
            if let (Ok(partition), Offset::Offset(offset)) =
                (usize::try_from(element.partition()), element.offset())
                && let Some(slot) = consumed.get_mut(partition)
            {
                *slot = u64::try_from(offset).unwrap_or(0);
            }
        }
        Some(consumed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_tasks_keep_the_partition_rule_of_before_and_large_ones_are_paced() {
        let small = crate::payload::encoded_len(crate::payload::Parameters::Small);
        assert_eq!(mock_partition_capacity(small), 25_000);
        assert_eq!(
            Backlog::plan(true, 100_000, 4, small, false),
            Ok(Backlog::UpFront)
        );
        let refused = Backlog::plan(true, 100_000, 2, small, false).unwrap_err();
        assert!(refused.contains("--partitions 4 or more"), "{refused}");
        // Holding the workers back, the store is measured, not the rate.
        assert_eq!(
            Backlog::plan(true, 100_000, 2, small, true),
            Ok(Backlog::Paced { ahead: 25_000 })
        );

        // 4 MiB tasks: one per partition is all the mock cluster keeps.
        let large = (4 << 20) + 100;
        assert_eq!(mock_partition_capacity(large), 1);
        assert_eq!(
            Backlog::plan(true, 1000, 8, large, false),
            Ok(Backlog::Paced { ahead: 1 })
        );
        assert_eq!(
            Backlog::plan(true, 8, 8, large, false),
            Ok(Backlog::UpFront)
        );
        // A real Kafka keeps everything.
        assert_eq!(
            Backlog::plan(false, 1000, 1, large, false),
            Ok(Backlog::UpFront)
        );
    }

    /// Twelve tasks of 4 MiB through two partitions of the mock cluster,
    /// which keeps one of them per partition, and loses the next unless a
    /// spacer follows it: paced by a consumer of the group that commits
    /// each as it goes, every task arrives, in order and as produced.
    #[test]
    fn a_paced_backlog_loses_nothing_the_mock_cluster_could_not_keep() {
        use rdkafka::Message;
        use rdkafka::consumer::CommitMode;

        use crate::payload::{Parameters, is_as_produced};

        let parameters = Parameters::Random(4 << 20);
        let kafka = Kafka::start(None, &["paced"], 2).unwrap();
        let brokers = kafka.brokers.clone();
        let producer = Arc::new(Producer::new(&kafka, "paced", 2, 0, parameters).unwrap());
        assert!(producer.sends_spacers());
        let ahead = mock_partition_capacity(crate::payload::encoded_len(parameters));
        assert_eq!(ahead, 1);
        let feed = Feed::start(
            Arc::clone(&producer),
            &brokers,
            "paced",
            "paced-group",
            12,
            Backlog::Paced { ahead },
        )
        .unwrap();
        assert_eq!(feed.up_front(), 2);

        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", "paced-group")
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        let mut partitions = TopicPartitionList::new();
        partitions
            .add_partition_offset("paced", 0, Offset::Beginning)
            .unwrap();
        partitions
            .add_partition_offset("paced", 1, Offset::Beginning)
            .unwrap();
        consumer.assign(&partitions).unwrap();
        let mut offsets = [Vec::new(), Vec::new()];
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while offsets.iter().map(Vec::len).sum::<usize>() < 12 {
            assert!(std::time::Instant::now() < deadline, "received {offsets:?}");
            let Some(message) = consumer.poll(Duration::from_millis(100)) else {
                continue;
            };
            let message = message.unwrap();
            let mut task: TaskActivation =
                prost::Message::decode(message.payload().unwrap()).unwrap();
            if !task.id.starts_with("spacer-") {
                assert!(is_as_produced(&mut task, parameters));
                offsets[message.partition() as usize].push(message.offset());
            }
            consumer.commit_message(&message, CommitMode::Sync).unwrap();
        }
        let pacing = feed.finish().unwrap().unwrap();
        assert_eq!(pacing.ahead, 1);
        // Every other record is a spacer.
        let expected: Vec<i64> = (0..6).map(|task| 2 * task).collect();
        assert_eq!(offsets, [expected.clone(), expected]);
    }
}
