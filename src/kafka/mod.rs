//! Kafka clients: how the broker's consumer and producers are configured.
//!
//! The broker owns the properties that its guarantees depend on: offsets are
//! committed by hand, only after the rows they cover are stored, so
//! `enable.auto.commit` and `enable.auto.offset.store` are always off.
//! Everything else (SASL, TLS, timeouts) can be added with `KAFKA_CONFIG`.

use std::time::Duration;

use rdkafka::ClientConfig;

use crate::config::Config;

/// Connection settings shared by every client.
#[derive(Debug, Clone)]
pub struct KafkaSettings {
    pub brokers: String,
    /// Extra librdkafka properties (`KAFKA_CONFIG`), applied last.
    pub properties: Vec<(String, String)>,
}

impl KafkaSettings {
    pub fn from_config(config: &Config) -> Self {
        KafkaSettings {
            brokers: config.kafka_brokers.clone(),
            properties: config.kafka_config.clone(),
        }
    }

    fn base(&self) -> ClientConfig {
        let mut client = ClientConfig::new();
        client.set("bootstrap.servers", &self.brokers);
        for (key, value) in &self.properties {
            client.set(key, value);
        }
        client
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
        client
    }

    /// A producer whose deliveries fail after `delivery_timeout` instead of
    /// librdkafka's default five minutes, so callers learn of an outage in
    /// time to keep their rows for the next attempt.
    pub fn producer(&self, delivery_timeout: Duration) -> ClientConfig {
        let mut client = self.base();
        client
            .set(
                "message.timeout.ms",
                delivery_timeout.as_millis().to_string(),
            )
            .set("acks", "all");
        client
    }
}
