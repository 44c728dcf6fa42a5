//! librdkafka's in-process mock cluster (the real Kafka protocol), plus
//! helpers to produce to it and read topics back.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use taskbroker::actors::consumer::{ConsumerConfig, MIN_STOP_GRACE};
use taskbroker::kafka::KafkaSettings;

pub struct MockKafka {
    pub cluster: MockCluster<'static, DefaultProducerContext>,
}

impl MockKafka {
    /// A one-broker cluster (broker id 1).
    pub fn start() -> MockKafka {
        MockKafka {
            cluster: MockCluster::new(1).expect("mock Kafka cluster"),
        }
    }

    pub fn bootstrap(&self) -> String {
        self.cluster.bootstrap_servers()
    }

    /// A consumer of `topic` in `group` on this cluster, with the settings
    /// the ingest tests start from (earliest offsets, no backpressure).
    pub fn consumer_config(&self, topic: &str, group: &str, ingest_dlq: &str) -> ConsumerConfig {
        ConsumerConfig {
            kafka: self.settings(),
            cluster: taskbroker::config::DEFAULT_CLUSTER.to_owned(),
            topic: topic.to_owned(),
            group: group.to_owned(),
            raw: None,
            ingest_dlq_kafka: self.settings(),
            auto_offset_reset: "earliest".to_owned(),
            ingest_dlq_topic: ingest_dlq.to_owned(),
            batch_size: 256,
            batch_bytes: 16 << 20,
            batch_max_wait: Duration::from_millis(20),
            max_inflight: 1_000_000,
            max_inflight_bytes: 0,
            max_delay: Duration::from_secs(3600),
            max_activation_bytes: 8 << 20,
            #[cfg(feature = "test-hooks")]
            crash_before_commit_after: None,
            health: Default::default(),
            rules: taskbroker::runtime::RuntimeRules::none(),
            forward_kafka: self.settings(),
            stop_grace: MIN_STOP_GRACE,
        }
    }

    pub fn settings(&self) -> KafkaSettings {
        KafkaSettings {
            brokers: self.bootstrap(),
            properties: Vec::new(),
            max_activation_bytes: 8 << 20,
        }
    }

    pub fn create_topic(&self, topic: &str, partitions: i32) {
        self.cluster
            .create_topic(topic, partitions, 1)
            .expect("create topic");
    }

    pub fn producer(&self) -> FutureProducer {
        ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("message.timeout.ms", "10000")
            // Tests produce records larger than MAX_ACTIVATION_BYTES.
            .set("message.max.bytes", "16000000")
            .create()
            .expect("producer")
    }

    /// Produces every payload (round robin over partitions by key), waiting
    /// for each acknowledgement.
    pub async fn produce(&self, topic: &str, payloads: &[Vec<u8>]) {
        let producer = self.producer();
        let sends = payloads.iter().enumerate().map(|(i, payload)| {
            let producer = producer.clone();
            let key = i.to_string();
            async move {
                producer
                    .send(
                        FutureRecord::to(topic).key(&key).payload(payload),
                        Timeout::After(Duration::from_secs(10)),
                    )
                    .await
                    .map(drop)
                    .map_err(|(err, _)| err)
            }
        });
        for sent in futures::future::join_all(sends).await {
            sent.expect("produce to the mock cluster");
        }
    }

    /// Produces one record to `partition`. The mock cluster keeps at most
    /// 5 MiB per partition and, past that, drops the oldest record sets: a
    /// record over 5 MiB must be alone (and last) in its partition.
    pub async fn produce_to(&self, topic: &str, partition: i32, payload: &[u8]) {
        self.producer()
            .send(
                FutureRecord::<(), _>::to(topic)
                    .partition(partition)
                    .payload(payload),
                Timeout::After(Duration::from_secs(10)),
            )
            .await
            .map(drop)
            .map_err(|(err, _)| err)
            .expect("produce to the mock cluster");
    }

    /// High watermark per partition.
    pub fn end_offsets(&self, topic: &str, partitions: i32) -> Vec<i64> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()
            .expect("consumer");
        (0..partitions)
            .map(|p| {
                consumer
                    .fetch_watermarks(topic, p, Duration::from_secs(10))
                    .expect("watermarks")
                    .1
            })
            .collect()
    }

    /// Offsets `group` has committed on `topic`, per partition.
    pub fn committed(&self, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("group.id", group)
            .create()
            .expect("consumer");
        let mut list = TopicPartitionList::new();
        for p in 0..partitions {
            list.add_partition(topic, p);
        }
        // The coordinator may answer with a per-partition error (and no
        // offset) while the group rebalances: ask again then, a bounded
        // number of times; an answer without errors is the truth.
        let mut attempts = 0;
        let committed = loop {
            let committed = consumer
                .committed_offsets(list.clone(), Duration::from_secs(10))
                .expect("committed offsets");
            let errors: Vec<String> = committed
                .elements()
                .iter()
                .filter_map(|e| e.error().err().map(|err| err.to_string()))
                .collect();
            attempts += 1;
            if errors.is_empty() {
                break committed;
            }
            assert!(attempts < 50, "committed offsets keep failing: {errors:?}");
            std::thread::sleep(Duration::from_millis(100));
        };
        (0..partitions)
            .map(
                |p| match committed.find_partition(topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(offset)) => offset,
                    _ => -1,
                },
            )
            .collect()
    }

    /// Every record on `topic` right now.
    pub fn read_all(&self, topic: &str, partitions: i32) -> Vec<OwnedMessage> {
        let ends = self.end_offsets(topic, partitions);
        let total: i64 = ends.iter().sum();
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("group.id", "test-reader")
            .set("enable.partition.eof", "false")
            .create()
            .expect("consumer");
        let mut list = TopicPartitionList::new();
        for p in 0..partitions {
            list.add_partition_offset(topic, p, Offset::Beginning)
                .expect("partition");
        }
        consumer.assign(&list).expect("assign");
        let mut records = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while (records.len() as i64) < total {
            assert!(
                std::time::Instant::now() < deadline,
                "read {} of {total} records from {topic}",
                records.len()
            );
            if let Some(message) = consumer.poll(Duration::from_millis(100)) {
                records.push(message.expect("read a record").detach());
            }
        }
        records
    }
}

/// The payload of a record, owned.
pub fn payload(message: &OwnedMessage) -> Vec<u8> {
    message.payload().unwrap_or_default().to_vec()
}
