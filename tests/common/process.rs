//! The real `taskbroker` binary in a test: the settings every process test
//! starts it with, and the encoded activations they produce for it.

use std::process::{Command, Stdio};

use prost::Message;
use taskbroker::proto::TaskActivation;

use super::kafka::MockKafka;

/// `taskbroker run` on the store named by `store_env` (`TestStore::env`,
/// or `("DATABASE_URL", url)`) and mock Kafka, consuming topic
/// `tasks`, serving gRPC on `grpc_port` and metrics on a free port, logging
/// warnings only, stdout discarded. Tests add their own settings with
/// `.env(…)` (a later value of the same variable wins).
pub fn broker_command(store_env: (&str, String), kafka: &MockKafka, grpc_port: u16) -> Command {
    let (store_variable, store_value) = store_env;
    let mut command = Command::new(env!("CARGO_BIN_EXE_taskbroker"));
    command
        .arg("run")
        .env_remove("TASKBROKER_DATABASE_URL")
        .env(format!("TASKBROKER_{store_variable}"), store_value)
        .env("TASKBROKER_KAFKA_BROKERS", kafka.bootstrap())
        .env("TASKBROKER_KAFKA_TOPIC", "tasks")
        .env("TASKBROKER_GRPC_ADDR", format!("127.0.0.1:{grpc_port}"))
        .env(
            "TASKBROKER_METRICS_ADDR",
            format!("127.0.0.1:{}", super::free_port()),
        )
        .env("TASKBROKER_LOG", "warn")
        .stdout(Stdio::null());
    command
}

/// Encoded activations with the given ids, in `namespace` (task name
/// `tests.<namespace>`), application `app`, received now, with a processing
/// deadline of `deadline_secs`.
pub fn encoded_tasks<'a>(
    ids: impl IntoIterator<Item = &'a String>,
    namespace: &str,
    deadline_secs: u64,
) -> Vec<Vec<u8>> {
    ids.into_iter()
        .map(|id| {
            TaskActivation {
                id: id.clone(),
                namespace: namespace.to_owned(),
                taskname: format!("tests.{namespace}"),
                received_at: Some(prost_types::Timestamp {
                    seconds: chrono::Utc::now().timestamp(),
                    nanos: 0,
                }),
                processing_deadline_duration: deadline_secs,
                application: Some("app".to_owned()),
                ..Default::default()
            }
            .encode_to_vec()
        })
        .collect()
}
