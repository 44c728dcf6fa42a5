//! The `taskbroker` binary's commands as an operator meets them: what each
//! needs, where logs go and what they look like, and the errors for bad
//! logging settings or an unreachable database.

mod common;

use std::process::{Command, Output};

use common::kafka::{MockKafka, payload};
use prost::Message as _;
use rdkafka::message::Message as _;
use taskbroker::proto::TaskActivation;

/// `taskbroker <args>` with only the given `TASKBROKER_*` variables (and
/// `extra` others) set, stdin closed, output captured.
fn taskbroker(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_taskbroker"));
    for (name, _) in std::env::vars() {
        if name.starts_with("TASKBROKER_") || name == "NO_COLOR" {
            command.env_remove(name);
        }
    }
    command
        .args(args)
        .envs(vars.iter().copied())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run the taskbroker binary")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A fresh SQLite path in the temp directory (removed with its side files).
struct TempStore(std::path::PathBuf);

impl TempStore {
    fn new() -> TempStore {
        TempStore(std::env::temp_dir().join(format!(
            "taskbroker_cmd_{}.sqlite",
            uuid::Uuid::new_v4().simple()
        )))
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temp path")
    }
}

impl Drop for TempStore {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", ".lock"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.0.display()));
        }
    }
}

#[test]
fn run_help_lists_every_setting_and_points_to_the_reference() {
    let output = taskbroker(&["run", "--help"], &[]);
    assert!(output.status.success());
    let help = text(&output.stdout);
    assert!(help.contains("config --markdown"), "{help}");
    for setting in taskbroker::config::SETTINGS {
        assert!(
            help.contains(&setting.variable()),
            "{} missing:\n{help}",
            setting.variable()
        );
    }
}

#[test]
fn config_needs_no_worker_endpoints_and_shows_the_advertised_address_it_resolves_to() {
    let output = taskbroker(&["config"], &[("HOSTNAME", "broker-test-7")]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let printed = text(&output.stdout);
    assert!(
        printed.contains("TASKBROKER_GRPC_ADVERTISED_ADDR=broker-test-7:50051 (derived)"),
        "{printed}"
    );
    assert!(!printed.contains("<host name>"), "{printed}");
    // Running still needs them.
    let run = taskbroker(&["run"], &[]);
    assert!(!run.status.success());
    assert!(text(&run.stderr).contains("TASKBROKER_WORKER_ENDPOINTS"));
}

#[test]
fn migrate_needs_no_worker_endpoints_and_logs_to_stderr_without_colour() {
    let store = TempStore::new();
    let output = taskbroker(
        &["migrate"],
        &[
            ("TASKBROKER_SQLITE_PATH", store.path()),
            ("TASKBROKER_LOG", "info"),
        ],
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(stderr.contains("migrations applied"), "{stderr}");
    assert!(
        !stdout.contains("migrations applied"),
        "logs went to stdout: {stdout}"
    );
    assert!(
        !stderr.contains('\u{1b}'),
        "escape codes in a pipe: {stderr:?}"
    );
}

#[test]
fn json_logs_are_one_object_per_line_on_stderr() {
    let store = TempStore::new();
    let output = taskbroker(
        &["migrate"],
        &[
            ("TASKBROKER_SQLITE_PATH", store.path()),
            ("TASKBROKER_LOG", "info"),
            ("TASKBROKER_LOG_FORMAT", "json"),
        ],
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stderr = text(&output.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(!lines.is_empty());
    for line in lines {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|err| panic!("not a JSON line ({err}): {line}"));
        assert!(value.get("level").is_some(), "{line}");
    }
}

#[test]
fn a_log_value_that_is_no_level_is_refused_naming_the_variable() {
    for value in ["verbose", "inf", "info,verbose"] {
        for args in [
            &["config"][..],
            &["demo-worker", "--listen", "127.0.0.1:0"][..],
        ] {
            let output = taskbroker(args, &[("TASKBROKER_LOG", value)]);
            assert_eq!(output.status.code(), Some(2), "{args:?} {value}");
            let stderr = text(&output.stderr);
            assert!(
                stderr.contains(&format!("TASKBROKER_LOG={value}")),
                "{stderr}"
            );
            assert!(stderr.contains("neither a level"), "{stderr}");
        }
    }
    // Levels and target directives pass.
    let output = taskbroker(&["config"], &[("TASKBROKER_LOG", "warn,taskbroker=debug")]);
    assert!(output.status.success(), "{}", text(&output.stderr));
}

#[test]
fn demo_commands_read_the_log_format() {
    for args in [
        &["demo", "--tasks", "1"][..],
        &["demo-worker", "--listen", "127.0.0.1:0"][..],
    ] {
        let output = taskbroker(args, &[("TASKBROKER_LOG_FORMAT", "yaml")]);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let stderr = text(&output.stderr);
        assert!(stderr.contains("TASKBROKER_LOG_FORMAT=yaml"), "{stderr}");
    }
}

#[test]
fn an_unreachable_database_is_named_by_host_and_port() {
    // Port 1 on loopback: nothing listens, the connection is refused.
    let output = taskbroker(
        &["migrate"],
        &[(
            "TASKBROKER_DATABASE_URL",
            "postgres://postgres:secret@127.0.0.1:1/postgres",
        )],
    );
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("cannot connect to PostgreSQL at 127.0.0.1:1: "),
        "{stderr}"
    );
    // Once: the log line, not the log line and a plain copy beside it.
    assert_eq!(
        stderr.matches("cannot connect to PostgreSQL at").count(),
        1,
        "{stderr}"
    );
    assert!(!stderr.contains("secret"), "{stderr}");
}

/// `taskbroker produce` sends test activations to the topic the broker
/// consumes, with the broker's own Kafka settings, and prints each id once
/// Kafka acknowledged it.
#[test]
fn produce_sends_decodable_activations_to_the_brokers_topic() {
    let kafka = MockKafka::start();
    kafka.create_topic("tasks-in", 2);
    let bootstrap = kafka.bootstrap();
    let output = taskbroker(
        &[
            "produce",
            "--count",
            "5",
            "--kind",
            "retry",
            "--namespace",
            "orders",
        ],
        &[
            ("TASKBROKER_KAFKA_BROKERS", &bootstrap),
            ("TASKBROKER_KAFKA_TOPIC", "tasks-in"),
        ],
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    let ids: Vec<String> = text(&output.stdout).lines().map(str::to_owned).collect();
    assert_eq!(ids.len(), 5, "{ids:?}");
    assert!(text(&output.stderr).contains("5 retry activation(s)"));

    let records = kafka.read_all("tasks-in", 2);
    let mut seen: Vec<String> = records
        .iter()
        .map(|record| {
            let task = TaskActivation::decode(payload(record).as_slice()).expect("an activation");
            assert_eq!(task.namespace, "orders");
            assert_eq!(task.taskname, "demo.retry");
            assert_eq!(task.application.as_deref(), Some("demo"));
            assert_eq!(
                task.headers.get("demo-kind").map(String::as_str),
                Some("retry")
            );
            assert_eq!(record.key(), Some(task.id.as_bytes()));
            task.id
        })
        .collect();
    seen.sort();
    let mut printed = ids.clone();
    printed.sort();
    assert_eq!(seen, printed, "every printed id is on the topic, once");
}

#[test]
fn produce_to_an_unreachable_kafka_fails_naming_brokers_and_topic() {
    let port = common::free_port();
    let brokers = format!("127.0.0.1:{port}");
    let output = taskbroker(
        &["produce", "--timeout-sec", "1"],
        &[("TASKBROKER_KAFKA_BROKERS", &brokers)],
    );
    assert_eq!(output.status.code(), Some(1));
    assert!(output.stdout.is_empty(), "no id printed for an unsent task");
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("1 of 1 activations not acknowledged by Kafka")
            && stderr.contains(&brokers)
            && stderr.contains("topic taskworker"),
        "{stderr}"
    );
}

#[test]
fn produce_refuses_bad_arguments_before_connecting() {
    for args in [
        &["produce", "--count", "0"][..],
        &["produce", "--kind", "explode"][..],
        &["produce", "--topic", "bad topic!"][..],
    ] {
        let output = taskbroker(args, &[("TASKBROKER_KAFKA_BROKERS", "127.0.0.1:1")]);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&output.stderr)
        );
        assert!(output.stdout.is_empty());
    }
}

/// Kills a child process when the test ends, passed or not.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The README's walk-through: `taskbroker run` with `taskbroker demo-worker`
/// as its worker, then `taskbroker produce`; the tasks complete.
#[actix_rt::test]
async fn tasks_sent_by_produce_complete_on_a_running_broker_and_demo_worker() {
    let kafka = MockKafka::start();
    kafka.create_topic("tasks", 1);
    let store = common::TestSqlite::new();
    let worker_port = common::free_port();
    let _worker = Running(
        Command::new(env!("CARGO_BIN_EXE_taskbroker"))
            .args([
                "demo-worker",
                "--listen",
                &format!("127.0.0.1:{worker_port}"),
            ])
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("start demo-worker"),
    );
    let metrics: std::net::SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .unwrap();
    let _broker = Running(
        common::process::broker_command(
            ("SQLITE_PATH", store.path.display().to_string()),
            &kafka,
            common::free_port(),
        )
        .env(
            "TASKBROKER_WORKER_ENDPOINTS",
            format!("*=http://127.0.0.1:{worker_port}"),
        )
        .env("TASKBROKER_METRICS_ADDR", metrics.to_string())
        .spawn()
        .expect("start the broker"),
    );
    let limit = std::time::Duration::from_secs(60);
    common::wait_until("the broker is ready", limit, || async move {
        tokio::net::TcpStream::connect(metrics).await.is_ok()
            && common::http_get(metrics, "/ready").await.0 == 200
    })
    .await;

    let output = taskbroker(
        &["produce", "--count", "3"],
        &[
            ("TASKBROKER_KAFKA_BROKERS", &kafka.bootstrap()),
            ("TASKBROKER_KAFKA_TOPIC", "tasks"),
        ],
    );
    assert!(output.status.success(), "{}", text(&output.stderr));
    common::wait_until("the worker reported 3 completions", limit, || async move {
        let body = common::http_get(metrics, "/metrics").await.1;
        body.lines()
            .any(|line| line == "taskbroker_status_reports_total{status=\"complete\"} 3")
    })
    .await;
}
