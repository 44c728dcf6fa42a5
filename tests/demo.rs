//! `taskbroker demo`, the README's first command, as a smoke test of the
//! real binary: it needs no Kafka and no database server (it brings the
//! mock cluster and the embedded store), every task reaches the outcome of
//! its kind, and a run where tasks cannot reach them exits 1.

use std::process::{Command, Output};

fn demo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_taskbroker"))
        .arg("demo")
        .args(args)
        // Nothing to reach: the demo must not need a database server or a
        // Kafka cluster of its own.
        .env_remove("TASKBROKER_DATABASE_URL")
        .env("TASKBROKER_KAFKA_BROKERS", "127.0.0.1:1")
        .env("TASKBROKER_METRICS_ADDR", "127.0.0.1:0")
        .output()
        .expect("run taskbroker demo")
}

fn text(output: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn push_demo_brings_every_task_to_its_outcome_with_nothing_installed() {
    let output = demo(&["--tasks", "600", "--workers", "3"]);
    let log = text(&output);
    assert_eq!(output.status.code(), Some(0), "{log}");
    assert!(
        log.contains("every task reached the outcome its kind should reach"),
        "{log}"
    );
    for kind in ["complete", "retry", "fail", "deadline", "delayed", "expire"] {
        assert!(
            log.contains(&format!("| {kind} (")),
            "no {kind} row:\n{log}"
        );
    }
    assert!(log.contains("SQLite"), "runs on the embedded store:\n{log}");
}

#[test]
fn pull_demo_brings_every_task_to_its_outcome() {
    let output = demo(&["--tasks", "300", "--workers", "4", "--mode", "pull"]);
    let log = text(&output);
    assert_eq!(output.status.code(), Some(0), "{log}");
    assert!(log.contains("(pull mode)"), "{log}");
}

#[test]
fn demo_exits_1_when_tasks_miss_their_outcome() {
    // Produced slowly with a short timeout: delayed and retried tasks cannot
    // settle in time, and the demo must say so and fail.
    let output = demo(&["--tasks", "200", "--rate", "40", "--timeout-sec", "2"]);
    let log = text(&output);
    assert_eq!(output.status.code(), Some(1), "{log}");
    assert!(log.contains("FAILED"), "{log}");
}

/// `demo --raw`: one in five tasks that should complete arrives on a raw
/// topic as a plain payload; the broker turns each into a task the demo
/// workers run and report, and the run checks every outcome as before.
#[test]
fn raw_demo_feeds_tasks_from_a_raw_topic() {
    let output = demo(&["--tasks", "300", "--workers", "2", "--raw"]);
    let log = text(&output);
    assert_eq!(output.status.code(), Some(0), "{log}");
    assert!(log.contains("raw topic:             demo-raw"), "{log}");
    assert!(
        log.contains("every task reached the outcome its kind should reach"),
        "{log}"
    );
}

/// `demo --rules`: a killswitched task name is dropped and never run; a
/// paused namespace is held (the ledger fails any delivery while the pause
/// is in force) and delivered once the demo lifts the pause.
#[test]
fn rules_demo_shows_a_killswitch_and_a_pause() {
    let output = demo(&["--tasks", "500", "--workers", "2", "--rules"]);
    let log = text(&output);
    assert_eq!(output.status.code(), Some(0), "{log}");
    assert!(
        log.contains("| killed (killswitched, never run) | 5 | 5 | 0 |"),
        "{log}"
    );
    assert!(
        log.contains("| paused (held while paused, then completed) | 5 | 5 | 0 |"),
        "{log}"
    );
    assert!(log.contains("resumed namespace demo-paused"), "{log}");
}
