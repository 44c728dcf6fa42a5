//! `taskbroker produce`: sends test activations to the broker's Kafka topic,
//! so a user who started `taskbroker run` (with `taskbroker demo-worker` as
//! its worker, or a real one) sees a task go through without writing a
//! producer. It reads the same settings as the broker (`KAFKA_BROKERS`,
//! `KAFKA_CONFIG`, `KAFKA_TOPIC`, the clusters of `KAFKA_TOPICS`), so TLS
//! and SASL work as they do for the broker.
//!
//! Each activation is a demo task of the chosen kind (the demo worker reads
//! the kind from its headers: `complete` runs once, `retry` goes through
//! the retry topic twice, `fail` is dead-lettered, `delayed` waits two
//! seconds); its id is printed on stdout once Kafka acknowledged it.

use std::process::ExitCode;
use std::time::Duration;

use futures::StreamExt;
use prost::Message;
use rdkafka::producer::FutureRecord;
use taskbroker::config::{Config, TopicAt};

use super::demo::scenario::Kind;

/// The kinds a user may ask for: the demo's, minus those whose meaning
/// needs the demo's runtime rules (`killed`, `paused`).
const KINDS: [&str; 6] = ["complete", "retry", "fail", "deadline", "delayed", "expire"];

#[derive(clap::Args)]
pub struct ProduceArgs {
    /// How many activations to send.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    count: u32,
    /// What the demo worker does with each task.
    #[arg(long, default_value = "complete", value_parser = KINDS)]
    kind: String,
    /// The tasks' namespace.
    #[arg(long, default_value = "demo")]
    namespace: String,
    /// The tasks' application (WORKER_ENDPOINTS routes by it).
    #[arg(long, default_value = "demo")]
    application: String,
    /// The tasks' name (default: demo.<kind>).
    #[arg(long)]
    taskname: Option<String>,
    /// The topic, as `topic` or `topic@cluster` (default: the first topic
    /// of KAFKA_TOPICS, else KAFKA_TOPIC).
    #[arg(long, value_parser = TopicAt::parse)]
    topic: Option<TopicAt>,
    /// Give up on records Kafka has not acknowledged after this long.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    timeout_sec: u64,
}

pub fn produce(args: ProduceArgs) -> ExitCode {
    super::run_tool("produce", |config| async move { run(&config, args).await })
}

async fn run(config: &Config, args: ProduceArgs) -> Result<(), String> {
    let topology = config.topology();
    let target = match &args.topic {
        Some(topic) => topic.clone(),
        None => topology
            .consumed
            .iter()
            .find(|consumed| consumed.raw.is_none())
            .map(|consumed| consumed.topic.clone())
            .ok_or("no activation topic is consumed (only raw topics); name one with --topic")?,
    };
    if topology.cluster(&target.cluster).is_none() {
        return Err(format!(
            "--topic {}@{}: no such cluster in TASKBROKER_KAFKA_CLUSTERS",
            target.topic, target.cluster
        ));
    }
    let kafka = taskbroker::broker::cluster_settings(config, &topology, &target.cluster);
    let timeout = Duration::from_secs(args.timeout_sec);
    let producer = kafka
        .create_producer(timeout)
        .map_err(|err| format!("cannot create a Kafka producer: {err}"))?;
    let kind = Kind::parse(&args.kind).ok_or("unknown --kind")?;
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let now = chrono::Utc::now();
    let sends = (0..args.count).map(|index| {
        let id = format!("produce-{}-{index}", &run_id[..12]);
        let mut activation = kind.activation(&id, now);
        activation.namespace.clone_from(&args.namespace);
        activation.application = Some(args.application.clone());
        if let Some(taskname) = &args.taskname {
            activation.taskname.clone_from(taskname);
        }
        let payload = activation.encode_to_vec();
        let producer = producer.clone();
        let topic = target.topic.as_str();
        async move {
            let sent = producer
                .send(
                    FutureRecord::to(topic).key(&id).payload(&payload),
                    rdkafka::util::Timeout::After(timeout),
                )
                .await;
            (id, sent.map(|_| ()).map_err(|(err, _)| err))
        }
    });
    // At most this many records awaiting acknowledgement; ids are printed
    // in order.
    let mut results = futures::stream::iter(sends).buffered(1000);
    let mut failed = Vec::new();
    while let Some((id, sent)) = results.next().await {
        match sent {
            Ok(()) => println!("{id}"),
            Err(err) => failed.push((id, err)),
        }
    }
    let sent = args.count as usize - failed.len();
    if let Some((_, err)) = failed.first() {
        return Err(format!(
            "{} of {} activations not acknowledged by Kafka at {} (topic {}) within {} s: {err}",
            failed.len(),
            args.count,
            kafka.brokers,
            target.topic,
            args.timeout_sec
        ));
    }
    eprintln!(
        "taskbroker produce: {sent} {} activation(s) acknowledged by topic {} on cluster {} ({})",
        args.kind, target.topic, target.cluster, kafka.brokers
    );
    Ok(())
}
