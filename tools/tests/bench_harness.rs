//! The load harness, scaled down so it runs in CI: each scenario of
//! `taskbroker-bench` that BENCHMARKS.md quotes runs end to end against
//! the real broker binary, the mock Kafka cluster and PostgreSQL or SQLite,
//! and must finish with every task delivered once. Figures are not checked
//! here (they are measured, not asserted); what is checked is that the
//! commands in BENCHMARKS.md work and report what they claim to.
//!
//! The harness runs the `taskbroker` binary it finds beside its own, and
//! this test is in another package (`taskbroker-tools`), so Cargo gives it
//! no `CARGO_BIN_EXE_taskbroker`. Both binaries land in the same directory
//! of the workspace's one target dir, and `cargo test --workspace`
//! (scripts/test) or plain `cargo test` builds the broker binary in the
//! same run, because the broker package's own integration tests need it.
//! Run alone (`cargo test -p taskbroker-tools --test bench_harness`), the
//! test uses whatever `taskbroker` was built last: build it first with
//! `cargo build -p taskbroker`. [`bench`] fails, saying so, when it is
//! missing.

use std::path::PathBuf;
use std::process::Command;

/// The broker binary the harness will run: beside `taskbroker-bench`.
fn broker_binary() -> PathBuf {
    let broker = PathBuf::from(env!("CARGO_BIN_EXE_taskbroker-bench")).with_file_name("taskbroker");
    assert!(
        broker.is_file(),
        "{} is missing: run `cargo test --workspace`, or `cargo build -p taskbroker` first",
        broker.display()
    );
    broker
}

fn bench(args: &[&str]) -> String {
    broker_binary();
    let output = Command::new(env!("CARGO_BIN_EXE_taskbroker-bench"))
        .args(args)
        .env_remove("TASKBROKER_DATABASE_URL")
        .output()
        .expect("taskbroker-bench runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "taskbroker-bench {args:?} failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    stdout
}

#[test]
fn e2e_push_on_postgres_delivers_every_task_once_and_counts_statements() {
    let out = bench(&[
        "e2e",
        "--tasks",
        "400",
        "--partitions",
        "2",
        "--workers",
        "2",
        "--failure-rate",
        "0.1",
        "--timeout-sec",
        "120",
    ]);
    assert!(
        out.contains("deliveries 400 (unique 400, duplicates 0)"),
        "{out}"
    );
    assert!(out.contains("reports acknowledged 400"), "{out}");
    // Statements per task need pg_stat_statements preloaded; WAL bytes are
    // always there.
    assert!(out.contains("WAL bytes per task"), "{out}");
    assert!(
        out.contains("| push | PostgreSQL | burn-down 400 |"),
        "{out}"
    );
}

/// Tasks past the broker's default `MAX_ACTIVATION_BYTES`, given a larger
/// one through `--broker-env`: each reaches a worker as produced.
#[test]
fn e2e_large_tasks_reach_the_workers_byte_identical() {
    let out = bench(&[
        "e2e",
        "--tasks",
        "20",
        "--payload-bytes",
        "1048576",
        "--partitions",
        "8",
        "--workers",
        "2",
        "--broker-env",
        "TASKBROKER_MAX_ACTIVATION_BYTES=2097152",
        "--timeout-sec",
        "120",
    ]);
    assert!(out.contains("byte-identical: 20 of 20 deliveries"), "{out}");
    assert!(
        out.contains("| push | PostgreSQL | burn-down 20 × 1 MiB |"),
        "{out}"
    );
}

/// With the workers away the consumer pauses at `MAX_INFLIGHT` (plus at
/// most one insert batch), and once they come back every task is
/// delivered.
#[test]
fn e2e_with_workers_away_pauses_the_consumer_then_delivers_everything() {
    let out = bench(&[
        "e2e",
        "--store",
        "sqlite",
        "--workers-after-pause",
        "--tasks",
        "60",
        "--payload-bytes",
        "65536",
        "--partitions",
        "2",
        "--workers",
        "2",
        "--broker-env",
        "TASKBROKER_MAX_INFLIGHT=10",
        "--broker-env",
        "TASKBROKER_INSERT_BATCH_SIZE=4",
        "--timeout-sec",
        "120",
    ]);
    assert!(out.contains("partitions paused after"), "{out}");
    let held: u64 = out
        .split("the store held ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|rows| rows.parse().ok())
        .unwrap_or_else(|| panic!("no rows held in {out}"));
    assert!((10..=14).contains(&held), "{held} rows held:\n{out}");
    assert!(out.contains("byte-identical: 60 of 60 deliveries"), "{out}");
    assert!(out.contains("| SQLite | 60 × 64 KiB |"), "{out}");
}

#[test]
fn e2e_pull_open_loop_on_sqlite_delivers_every_task_once() {
    let out = bench(&[
        "e2e",
        "--mode",
        "pull",
        "--store",
        "sqlite",
        "--rate",
        "100",
        "--duration-sec",
        "3",
        "--workers",
        "4",
        "--partitions",
        "2",
        "--timeout-sec",
        "120",
    ]);
    assert!(out.contains("duplicates 0)"), "{out}");
    assert!(
        out.contains("| pull | SQLite | open 100/s × 3 s |"),
        "{out}"
    );
}

#[test]
fn floor_runs_on_both_stores() {
    for store in ["postgres", "sqlite"] {
        let out = bench(&["floor", "--store", store, "--tasks", "2000"]);
        assert!(out.contains("2000 tasks in batches of 256"), "{out}");
    }
}

#[test]
fn stranded_scenario_keeps_claims_within_their_path_when_workers_freeze() {
    let out = bench(&[
        "stranded",
        "--outage",
        "freeze",
        "--rate",
        "100",
        "--before-sec",
        "2",
        "--outage-sec",
        "3",
        "--after-sec",
        "5",
        "--workers",
        "2",
        "--partitions",
        "2",
    ]);
    assert!(out.contains("legitimate path 17.0 s: within"), "{out}");
    assert!(out.contains("| 3 | OUT |"), "{out}");
}

#[test]
fn e2e_refuses_a_burn_down_the_mock_cluster_cannot_hold() {
    let output = Command::new(env!("CARGO_BIN_EXE_taskbroker-bench"))
        .args(["e2e", "--tasks", "100000", "--partitions", "2"])
        .output()
        .expect("taskbroker-bench runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--partitions 4 or more"), "{stderr}");
}

/// `--broker-command` runs another broker under the same harness: here
/// this build's own binary, started by a shell command as a user would
/// start a different broker, on the port the harness hands it.
#[test]
fn e2e_drives_an_external_broker_command() {
    let command = format!(
        "env TASKBROKER_GRPC_ADDR=127.0.0.1:$TASKBROKER_BENCH_GRPC_PORT \
         TASKBROKER_GRPC_ADVERTISED_ADDR=127.0.0.1:$TASKBROKER_BENCH_GRPC_PORT \
         TASKBROKER_METRICS_ADDR=127.0.0.1:0 TASKBROKER_RESTART_GRACE_SEC=0 {} run",
        broker_binary().display()
    );
    let out = bench(&[
        "e2e",
        "--tasks",
        "200",
        "--partitions",
        "2",
        "--workers",
        "2",
        "--timeout-sec",
        "120",
        "--broker-command",
        &command,
    ]);
    assert!(
        out.contains("deliveries 200 (unique 200, duplicates 0)"),
        "{out}"
    );
    assert!(out.contains("reports acknowledged 200"), "{out}");
}
