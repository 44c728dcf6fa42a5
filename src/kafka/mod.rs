//! Kafka clients: how the broker's consumer and producers are configured.
//!
//! The broker owns the properties that its guarantees depend on: offsets are
//! committed by hand, only after the rows they cover are stored, so
//! `enable.auto.commit` and `enable.auto.offset.store` are always off.
//! Everything else (SASL, TLS, timeouts) can be added with `KAFKA_CONFIG`.
//!
//! librdkafka is built with its own OpenSSL (`ssl-vendored`), whose default
//! certificate directory is the build's install prefix, not the system's.
//! So when TLS is on (`security.protocol` `SSL` or `SASL_SSL`) and
//! `KAFKA_CONFIG` names no CA (`ssl.ca.location` or `ssl.ca.pem`), the
//! clients look for the system's CA bundle themselves (`ssl.ca.location=
//! probe`), which is what a broker with a publicly signed certificate (most
//! managed Kafka services) needs.
//!
//! The consumer prefetches at most [`CONSUMER_PREFETCH_KIB`] in all
//! (librdkafka's `queued.max.messages.kbytes`, 64 MiB by default), unless
//! `KAFKA_CONFIG` sets it: the table, not the client's queue, is where a
//! backlog waits (`MAX_INFLIGHT`), and a 64 MiB prefetch was most of the
//! broker's memory during a burn-down.
//!
//! A consumer that dies without leaving its group (SIGKILL, node loss)
//! holds its partitions until the group's session times out: 10 s here
//! (heartbeats every 3 s) instead of librdkafka's 45 s, unless
//! `KAFKA_CONFIG` sets `session.timeout.ms` or `heartbeat.interval.ms`.
//!
//! Producers are sized for the records they carry: librdkafka's default
//! `message.max.bytes` (1,000,000) is far below the default
//! `MAX_ACTIVATION_BYTES` (8 MiB), and a record it refuses is never written.
//! The ingest dead-letter producer carries records over that limit too (a
//! dead letter keeps the whole record), so it is sized for the largest
//! record a consumer can fetch. Producers compress (`lz4`) unless
//! `KAFKA_CONFIG` chooses a codec: a Kafka broker checks a topic's
//! `max.message.bytes` against the compressed batch, so compression is what
//! lets a large but compressible record in.

pub mod cut;
pub mod raw;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;

use crate::config::{Config, KafkaCluster};

/// Connection settings shared by every client.
#[derive(Debug, Clone)]
pub struct KafkaSettings {
    pub brokers: String,
    /// Extra librdkafka properties (`KAFKA_CONFIG`), applied last.
    pub properties: Vec<(String, String)>,
    /// `MAX_ACTIVATION_BYTES`: the largest activation any producer writes.
    pub max_activation_bytes: usize,
}

/// The consumer's prefetch bound (its one queue, every partition), in KiB, unless
/// `KAFKA_CONFIG` sets `queued.max.messages.kbytes`: several insert
/// batches of typical activations, far below librdkafka's 64 MiB.
pub const CONSUMER_PREFETCH_KIB: usize = 8 * 1024;

/// The consumer's group session timeout and heartbeat interval, unless
/// `KAFKA_CONFIG` sets them: a broker that dies without leaving the group
/// (SIGKILL, node loss) keeps its partitions until the group coordinator
/// stops hearing from it, and librdkafka's default (45 s) left them
/// unconsumed that long. 10 s is within every Kafka broker's default
/// `group.min.session.timeout.ms` (6 s) to `group.max.session.timeout.ms`
/// range; heartbeats come from librdkafka's own thread, so a busy broker
/// does not miss them, and three fit in a session.
pub const CONSUMER_SESSION_TIMEOUT_MS: u32 = 10_000;
pub const CONSUMER_HEARTBEAT_INTERVAL_MS: u32 = 3_000;

/// How often the consumer's librdkafka statistics arrive, unless
/// `KAFKA_CONFIG` sets `statistics.interval.ms`: they carry each
/// partition's lag (`taskbroker_consumer_lag`) at no request to Kafka.
pub const CONSUMER_STATISTICS_INTERVAL_MS: u32 = 5_000;

/// Room on top of an activation for a record's key, headers (the ingest
/// dead-letter headers carry an error message) and protocol framing.
pub const PRODUCER_HEADROOM_BYTES: usize = 64 * 1024;

/// librdkafka's default `receive.message.max.bytes`: a fetch response, and so
/// any one record a consumer reads, is at most this large unless
/// `KAFKA_CONFIG` raises it.
pub const DEFAULT_RECEIVE_MAX_BYTES: usize = 100_000_000;

/// The most librdkafka allows for `message.max.bytes`.
const LIBRDKAFKA_MAX_MESSAGE_BYTES: usize = 1_000_000_000;

/// The codec producers use unless `KAFKA_CONFIG` names one.
pub const PRODUCER_COMPRESSION: &str = "lz4";

impl KafkaSettings {
    pub fn from_config(config: &Config) -> Self {
        KafkaSettings {
            brokers: config.kafka_brokers.clone(),
            properties: config.kafka_config.clone(),
            max_activation_bytes: config.max_activation_bytes,
        }
    }

    /// The settings of one cluster of the topology (the default one included).
    pub fn for_cluster(cluster: &KafkaCluster, max_activation_bytes: usize) -> Self {
        KafkaSettings {
            brokers: cluster.brokers.clone(),
            properties: cluster.properties.clone(),
            max_activation_bytes,
        }
    }

    fn base(&self) -> ClientConfig {
        let mut client = ClientConfig::new();
        client.set("bootstrap.servers", &self.brokers);
        for (key, value) in &self.properties {
            client.set(key, value);
        }
        if self.uses_tls() && !self.names_a_ca() {
            client.set("ssl.ca.location", "probe");
        }
        client
    }

    fn property(&self, key: &str) -> Option<&str> {
        self.properties
            .iter()
            .rev()
            .find(|(name, _)| name == key)
            .map(|(_, value)| value.as_str())
    }

    /// Whether `security.protocol` is `SSL` or `SASL_SSL`.
    fn uses_tls(&self) -> bool {
        self.property("security.protocol").is_some_and(|protocol| {
            protocol.eq_ignore_ascii_case("ssl") || protocol.eq_ignore_ascii_case("sasl_ssl")
        })
    }

    fn names_a_ca(&self) -> bool {
        ["ssl.ca.location", "ssl.ca.pem", "ssl.ca.certificate.stores"]
            .iter()
            .any(|key| self.property(key).is_some())
    }

    /// A consumer in `group` that never commits by itself.
    pub fn consumer(&self, group: &str, auto_offset_reset: &str) -> ClientConfig {
        let mut client = self.base();
        client
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", auto_offset_reset)
            .set("enable.partition.eof", "false");
        for (key, default) in [
            (
                "queued.max.messages.kbytes",
                CONSUMER_PREFETCH_KIB.to_string(),
            ),
            // A whole activation of MAX_ACTIVATION_BYTES in one partition
            // fetch (librdkafka's default is 1 MiB). Kafka returns a larger
            // batch anyway (KIP-74), but clusters that do not (librdkafka's
            // mock cluster among them) would stall on it.
            (
                "fetch.message.max.bytes",
                self.max_producer_record_bytes().to_string(),
            ),
            (
                "session.timeout.ms",
                CONSUMER_SESSION_TIMEOUT_MS.to_string(),
            ),
            (
                "heartbeat.interval.ms",
                CONSUMER_HEARTBEAT_INTERVAL_MS.to_string(),
            ),
            (
                "statistics.interval.ms",
                CONSUMER_STATISTICS_INTERVAL_MS.to_string(),
            ),
        ] {
            if self.property(key).is_none() {
                client.set(key, default);
            }
        }
        client
    }

    /// A producer whose deliveries fail after `delivery_timeout` instead of
    /// librdkafka's default five minutes, so callers learn of an outage in
    /// time to keep their rows for the next attempt. It accepts records of
    /// `MAX_ACTIVATION_BYTES` plus [`PRODUCER_HEADROOM_BYTES`], unless
    /// `KAFKA_CONFIG` sets `message.max.bytes` itself.
    pub fn producer(&self, delivery_timeout: Duration) -> ClientConfig {
        self.producer_for(delivery_timeout, self.max_producer_record_bytes())
    }

    /// A producer as [`KafkaSettings::producer`] whose `message.max.bytes`
    /// is `max_record_bytes` (capped at librdkafka's ceiling) unless
    /// `KAFKA_CONFIG` sets it.
    pub fn producer_for(
        &self,
        delivery_timeout: Duration,
        max_record_bytes: usize,
    ) -> ClientConfig {
        let mut client = self.base();
        client
            .set(
                "message.timeout.ms",
                delivery_timeout.as_millis().to_string(),
            )
            .set("acks", "all");
        if self.property("message.max.bytes").is_none() {
            client.set(
                "message.max.bytes",
                max_record_bytes
                    .min(LIBRDKAFKA_MAX_MESSAGE_BYTES)
                    .to_string(),
            );
        }
        if self.property("compression.type").is_none()
            && self.property("compression.codec").is_none()
        {
            client.set("compression.type", PRODUCER_COMPRESSION);
        }
        client
    }

    /// The largest record (payload, key and headers) producers are sized
    /// for by default.
    pub fn max_producer_record_bytes(&self) -> usize {
        self.max_activation_bytes
            .saturating_add(PRODUCER_HEADROOM_BYTES)
    }

    /// The largest record a consumer with these settings can read: a whole
    /// fetch response must fit in `receive.message.max.bytes`.
    pub fn max_fetched_record_bytes(&self) -> usize {
        self.property("receive.message.max.bytes")
            .and_then(|value| value.parse().ok())
            .unwrap_or(DEFAULT_RECEIVE_MAX_BYTES)
    }
}

/// Whether Kafka refused a record for its size: librdkafka's own check
/// against the producer's `message.max.bytes`, or the Kafka broker's answer
/// (the topic's `max.message.bytes`). Never worth retrying as it is.
pub fn refused_as_too_large(err: &KafkaError) -> bool {
    err.rdkafka_error_code() == Some(rdkafka::error::RDKafkaErrorCode::MessageSizeTooLarge)
}

/// How often the same client logs Kafka errors at most. While a broker is
/// down librdkafka reports it continuously; one line per interval (with the
/// number of lines left out) is enough for an operator.
const ERROR_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Logs librdkafka's errors at a bounded rate.
#[derive(Debug, Default)]
pub struct ThrottledLog {
    last: Mutex<Option<(Instant, u64)>>,
}

impl ThrottledLog {
    /// Calls `log` with the number of suppressed lines when it is time to.
    pub fn maybe(&self, log: impl FnOnce(u64)) {
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match last.as_mut() {
            Some((at, suppressed)) if at.elapsed() < ERROR_LOG_INTERVAL => *suppressed += 1,
            _ => {
                let suppressed = last.map_or(0, |(_, suppressed)| suppressed);
                *last = Some((Instant::now(), 0));
                log(suppressed);
            }
        }
    }
}

impl ClientContext for ThrottledLog {
    fn error(&self, error: KafkaError, reason: &str) {
        self.maybe(|suppressed| {
            tracing::warn!(error = %error, reason, suppressed, "Kafka client error");
        });
    }
}

/// A producer that logs its errors through [`ThrottledLog`].
pub type Producer = FutureProducer<ThrottledLog>;

impl KafkaSettings {
    pub fn create_producer(&self, delivery_timeout: Duration) -> Result<Producer, KafkaError> {
        self.producer(delivery_timeout)
            .create_with_context(ThrottledLog::default())
    }

    /// A producer for records of up to `max_record_bytes` (see
    /// [`KafkaSettings::producer_for`]).
    pub fn create_producer_for(
        &self,
        delivery_timeout: Duration,
        max_record_bytes: usize,
    ) -> Result<Producer, KafkaError> {
        self.producer_for(delivery_timeout, max_record_bytes)
            .create_with_context(ThrottledLog::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(properties: &[(&str, &str)]) -> KafkaSettings {
        KafkaSettings {
            brokers: "localhost:9092".to_owned(),
            properties: properties
                .iter()
                .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
                .collect(),
            max_activation_bytes: 1 << 20,
        }
    }

    #[test]
    fn producers_are_sized_from_max_activation_bytes() {
        let producer = settings(&[]).producer(Duration::from_secs(5));
        assert_eq!(
            producer.get("message.max.bytes"),
            Some((1_048_576 + 65_536).to_string().as_str())
        );
    }

    #[test]
    fn librdkafka_accepts_the_sizes_of_every_allowed_max_activation_bytes() {
        // MAX_ACTIVATION_BYTES is validated to 1 KiB ..= 64 MiB.
        for max_activation_bytes in [1024, 1 << 20, 64 << 20] {
            let mut settings = settings(&[]);
            settings.max_activation_bytes = max_activation_bytes;
            if let Err(err) = settings.create_producer(Duration::from_secs(5)) {
                panic!("{max_activation_bytes}: {err}");
            }
        }
    }

    #[test]
    fn tls_without_a_named_ca_probes_for_the_system_bundle() {
        for protocol in ["SSL", "sasl_ssl"] {
            let consumer = settings(&[("security.protocol", protocol)]).consumer("g", "earliest");
            assert_eq!(consumer.get("ssl.ca.location"), Some("probe"), "{protocol}");
        }
        let named = settings(&[
            ("security.protocol", "SSL"),
            ("ssl.ca.location", "/etc/kafka/ca.pem"),
        ])
        .producer(Duration::from_secs(5));
        assert_eq!(named.get("ssl.ca.location"), Some("/etc/kafka/ca.pem"));
        for plaintext in [&[][..], &[("security.protocol", "SASL_PLAINTEXT")][..]] {
            let consumer = settings(plaintext).consumer("g", "earliest");
            assert_eq!(consumer.get("ssl.ca.location"), None);
        }
    }

    #[test]
    fn consumers_fetch_whole_activations_of_every_allowed_size() {
        for max_activation_bytes in [1024, 8 << 20, 64 << 20] {
            let mut settings = settings(&[]);
            settings.max_activation_bytes = max_activation_bytes;
            let consumer = settings.consumer("g", "earliest");
            assert_eq!(
                consumer.get("fetch.message.max.bytes"),
                Some(
                    (max_activation_bytes + PRODUCER_HEADROOM_BYTES)
                        .to_string()
                        .as_str()
                )
            );
            if let Err(err) = consumer.create::<rdkafka::consumer::BaseConsumer>() {
                panic!("{max_activation_bytes}: {err}");
            }
        }
    }

    #[test]
    fn producers_compress_and_the_ingest_dlq_producer_takes_any_record_a_consumer_reads() {
        let settings = settings(&[]);
        let producer = settings.producer(Duration::from_secs(5));
        assert_eq!(producer.get("compression.type"), Some(PRODUCER_COMPRESSION));
        let own = settings_with_codec();
        assert_eq!(own.get("compression.type"), None);
        assert_eq!(own.get("compression.codec"), Some("zstd"));
        let largest = settings.max_fetched_record_bytes() + PRODUCER_HEADROOM_BYTES;
        assert_eq!(largest, DEFAULT_RECEIVE_MAX_BYTES + PRODUCER_HEADROOM_BYTES);
        let dlq = settings.producer_for(Duration::from_secs(5), largest);
        assert_eq!(
            dlq.get("message.max.bytes"),
            Some(largest.to_string().as_str())
        );
        if let Err(err) = settings.create_producer_for(Duration::from_secs(5), largest) {
            panic!("librdkafka refuses the ingest DLQ producer: {err}");
        }
        let raised = KafkaSettings {
            properties: vec![("receive.message.max.bytes".into(), "200000000".into())],
            ..settings
        };
        assert_eq!(raised.max_fetched_record_bytes(), 200_000_000);
    }

    fn settings_with_codec() -> ClientConfig {
        settings(&[("compression.codec", "zstd")]).producer(Duration::from_secs(5))
    }

    #[test]
    fn the_consumer_prefetch_is_bounded_unless_kafka_config_sets_it() {
        let consumer = settings(&[]).consumer("g", "earliest");
        assert_eq!(consumer.get("queued.max.messages.kbytes"), Some("8192"));
        let own = settings(&[("queued.max.messages.kbytes", "65536")]).consumer("g", "earliest");
        assert_eq!(own.get("queued.max.messages.kbytes"), Some("65536"));
    }

    #[test]
    fn a_dead_consumer_leaves_the_group_within_seconds_unless_kafka_config_says_otherwise() {
        let consumer = settings(&[]).consumer("g", "earliest");
        assert_eq!(consumer.get("session.timeout.ms"), Some("10000"));
        assert_eq!(consumer.get("heartbeat.interval.ms"), Some("3000"));
        // librdkafka takes the pair as it is (it refuses out-of-range values
        // when the client is created).
        if let Err(err) = consumer.create::<rdkafka::consumer::BaseConsumer>() {
            panic!("the consumer defaults: {err}");
        }
        let own = settings(&[
            ("session.timeout.ms", "45000"),
            ("heartbeat.interval.ms", "15000"),
        ])
        .consumer("g", "earliest");
        assert_eq!(own.get("session.timeout.ms"), Some("45000"));
        assert_eq!(own.get("heartbeat.interval.ms"), Some("15000"));
    }

    #[test]
    fn kafka_config_may_size_producers_itself() {
        let producer =
            settings(&[("message.max.bytes", "5000000")]).producer(Duration::from_secs(5));
        assert_eq!(producer.get("message.max.bytes"), Some("5000000"));
    }
}
