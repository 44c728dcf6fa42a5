//! `taskbroker_consumer_lag{topic, partition}`: how far each partition this
//! broker consumes is behind its end, from librdkafka's statistics, against
//! the mock Kafka cluster and real PostgreSQL.

mod common;

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use common::kafka::MockKafka;
use common::{Backend, wait_until};
use prost::Message as _;
use taskbroker::actors::consumer::{ConsumerActor, StopConsuming};
use taskbroker::metrics::Metrics;
use taskbroker::proto::TaskActivation;

const TOPIC: &str = "lagging";
const PARTITIONS: i32 = 2;
const RECORDS: usize = 600;
const GROUP: &str = "taskbroker";

/// The lag series of every partition, as `/metrics` shows it; `None`
/// where there is none.
fn lag(metrics: &Metrics) -> Vec<Option<i64>> {
    let text = metrics.render();
    (0..PARTITIONS)
        .map(|partition| {
            let series =
                format!("taskbroker_consumer_lag{{partition=\"{partition}\",topic=\"{TOPIC}\"}} ");
            text.lines()
                .find_map(|line| line.strip_prefix(&series))
                .map(|value| value.parse().expect("an integer gauge"))
        })
        .collect()
}

#[actix_rt::test]
async fn lag_per_partition_follows_what_is_left_to_consume_and_goes_with_the_consumer() {
    let fixture = common::StoreFixture::on(Backend::Postgres).await;
    let kafka = MockKafka::start();
    kafka.create_topic(TOPIC, PARTITIONS);
    kafka.create_topic("ingest-dlq", 1);
    let payloads: Vec<Vec<u8>> = (0..RECORDS)
        .map(|i| {
            TaskActivation {
                id: format!("lag-{i}"),
                namespace: "lag".to_owned(),
                taskname: "tests.lag".to_owned(),
                received_at: Some(prost_types::Timestamp {
                    seconds: chrono::Utc::now().timestamp(),
                    nanos: 0,
                }),
                processing_deadline_duration: 30,
                ..Default::default()
            }
            .encode_to_vec()
        })
        .collect();
    kafka.produce(TOPIC, &payloads).await;

    // Backpressure holds the consumer after about 100 rows: the rest is lag.
    let mut config = kafka.consumer_config(TOPIC, GROUP, "ingest-dlq");
    config.max_inflight = 100;
    config.batch_size = 50;
    config
        .kafka
        .properties
        .push(("statistics.interval.ms".to_owned(), "100".to_owned()));
    let metrics = Arc::new(Metrics::new());
    let consumer = ConsumerActor::new(
        config,
        fixture.store_actor.clone(),
        vec![],
        Arc::clone(&metrics),
    )
    .start();
    let limit = Duration::from_secs(30);
    wait_until("the consumer pauses every partition", limit, || {
        let paused = metrics.paused_partitions();
        async move { paused == i64::from(PARTITIONS) }
    })
    .await;

    // Each partition's lag is its end offset minus the group's committed
    // offset, as Kafka itself says.
    let ends = kafka.end_offsets(TOPIC, PARTITIONS);
    let committed = kafka.committed(GROUP, TOPIC, PARTITIONS);
    let expected: Vec<Option<i64>> = ends
        .iter()
        .zip(&committed)
        .map(|(end, done)| Some(end - (*done).max(0)))
        .collect();
    assert!(
        expected.iter().flatten().sum::<i64>() >= (RECORDS - 200) as i64,
        "the consumer is held back: ends {ends:?}, committed {committed:?}"
    );
    wait_until("the lag gauges show what is left", limit, || {
        let shown = lag(&metrics);
        let expected = expected.clone();
        async move { shown == expected }
    })
    .await;

    // Drain the store, as workers would: consumption resumes and the lag
    // of every partition goes to zero.
    let client = fixture.db.client().await;
    wait_until("every record is stored", Duration::from_secs(60), || {
        let client = &client;
        let stored = metrics.consumed("stored");
        async move {
            client
                .execute("DELETE FROM inflight_taskactivations", &[])
                .await
                .expect("drain");
            stored == RECORDS as u64
        }
    })
    .await;
    wait_until("the lag of every partition is 0", limit, || {
        let shown = lag(&metrics);
        async move { shown == vec![Some(0); PARTITIONS as usize] }
    })
    .await;

    // A stopped consumer holds no partition: no series is left behind.
    consumer.send(StopConsuming).await.expect("stop");
    assert_eq!(lag(&metrics), vec![None; PARTITIONS as usize]);
}
