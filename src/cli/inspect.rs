//! `taskbroker inspect`: what the store holds, for an operator, without
//! SQL. Counts by status, namespace and task name, the oldest Pending task
//! per namespace, claims and deadlines about to run out, and one activation
//! by id, decoded (its parameters shown when they are JSON or msgpack).
//! Read-only against PostgreSQL (`TASKBROKER_DATABASE_URL`) or an SQLite
//! file (`TASKBROKER_SQLITE_PATH`), so it is safe while brokers run.
//! `--json` prints one JSON object for scripts.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Duration;

use chrono::{DateTime, Utc};
use prost::Message;
use serde_json::{Value, json};
use taskbroker::config::Config;
use taskbroker::model::{ActivationStatus, InflightActivation};
use taskbroker::proto::TaskActivation;
use taskbroker::store::{
    Inspection, PostgresStore, PostgresStoreConfig, SqliteView, StoreError, StoreView,
};

#[derive(clap::Args)]
pub struct InspectArgs {
    /// Print one JSON object instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// List Claimed and Processing tasks whose lease or deadline runs out
    /// within this many seconds.
    #[arg(long, default_value_t = 30)]
    near_expiry_sec: u64,
    /// At most this many of them.
    #[arg(long, default_value_t = 20)]
    limit: usize,
    #[command(subcommand)]
    what: Option<InspectWhat>,
}

#[derive(clap::Subcommand)]
enum InspectWhat {
    /// One activation by id, decoded.
    Task {
        /// The activation's id.
        id: String,
    },
}

pub fn inspect(args: InspectArgs) -> ExitCode {
    super::run_tool("inspect", |config| async move {
        let output = run(&config, &args).await?;
        println!("{output}");
        Ok(())
    })
}

async fn run(config: &Config, args: &InspectArgs) -> Result<String, String> {
    let view: Box<dyn StoreView> = match &config.database_url {
        Some(url) => Box::new(
            PostgresStore::connect(&PostgresStoreConfig {
                pool_size: 1,
                ..PostgresStoreConfig::new(url.clone())
            })
            .map_err(|err| err.to_string())?,
        ),
        None => Box::new(SqliteView::open(&config.sqlite_path).map_err(|err| err.to_string())?),
    };
    let failed = |err: StoreError| err.to_string();
    match &args.what {
        None => {
            let inspection = view
                .inspect(Duration::from_secs(args.near_expiry_sec), args.limit)
                .await
                .map_err(failed)?;
            let now = Utc::now();
            Ok(if args.json {
                summary_json(&inspection, now).to_string()
            } else {
                summary_text(&inspection, now, args.near_expiry_sec)
            })
        }
        Some(InspectWhat::Task { id }) => {
            let row = view
                .row(id)
                .await
                .map_err(failed)?
                .ok_or_else(|| format!("no activation with id {id:?} in the store"))?;
            let task = task_json(&row);
            Ok(if args.json {
                task.to_string()
            } else {
                serde_json::to_string_pretty(&task).unwrap_or_default()
            })
        }
    }
}

fn status_key(status: ActivationStatus) -> String {
    status.as_str().to_ascii_lowercase()
}

fn counts_json(counts: &BTreeMap<ActivationStatus, u64>) -> Value {
    Value::Object(
        counts
            .iter()
            .map(|(status, count)| (status_key(*status), json!(count)))
            .collect(),
    )
}

fn age_seconds(now: DateTime<Utc>, at: DateTime<Utc>) -> f64 {
    (now - at).num_milliseconds().max(0) as f64 / 1000.0
}

/// The `--json` summary: `by_status` (lowercase status → count, every
/// status), `by_namespace` (namespace → status → count), `bytes_by_status`
/// and `bytes_by_namespace` (the same, in activation bytes), `by_taskname`
/// (namespace → task name → status → count), `oldest_pending_age_seconds`
/// (namespace → age) and `near_expiry` (soonest first).
pub fn summary_json(inspection: &Inspection, now: DateTime<Utc>) -> Value {
    let mut by_taskname: BTreeMap<String, serde_json::Map<String, Value>> = BTreeMap::new();
    for ((namespace, taskname), counts) in inspection.by_taskname() {
        by_taskname
            .entry(namespace)
            .or_default()
            .insert(taskname, counts_json(&counts));
    }
    json!({
        "by_status": counts_json(&inspection.by_status()),
        "by_namespace": inspection
            .by_namespace()
            .iter()
            .map(|(namespace, counts)| (namespace.clone(), counts_json(counts)))
            .collect::<serde_json::Map<_, _>>(),
        "bytes_by_status": counts_json(&inspection.bytes_by_status()),
        "bytes_by_namespace": inspection
            .bytes_by_namespace()
            .iter()
            .map(|(namespace, bytes)| (namespace.clone(), counts_json(bytes)))
            .collect::<serde_json::Map<_, _>>(),
        "by_taskname": by_taskname,
        "oldest_pending_age_seconds": inspection
            .oldest_pending()
            .into_iter()
            .map(|(namespace, at)| (namespace, json!(age_seconds(now, at))))
            .collect::<serde_json::Map<_, _>>(),
        "near_expiry": inspection
            .near_expiry
            .iter()
            .map(|row| json!({
                "id": row.id,
                "namespace": row.namespace,
                "taskname": row.taskname,
                "status": status_key(row.status),
                "due": row.due.to_rfc3339(),
                "due_in_seconds": (row.due - now).num_milliseconds() as f64 / 1000.0,
            }))
            .collect::<Vec<_>>(),
    })
}

/// `1234` → `1.2 KiB`, in powers of 1024 (`0 B`, `512 B`, `8.0 MiB`).
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

fn summary_text(inspection: &Inspection, now: DateTime<Utc>, near_secs: u64) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let by_status = inspection.by_status();
    let total: u64 = by_status.values().sum();
    let _ = writeln!(out, "{total} activations in the store");
    let statuses: Vec<ActivationStatus> = ActivationStatus::ALL.into_iter().collect();
    let header: Vec<String> = statuses.iter().map(|s| status_key(*s)).collect();
    let _ = writeln!(
        out,
        "\n{:<32} {}",
        "namespace / task name",
        header
            .iter()
            .map(|name| format!("{name:>11}"))
            .collect::<String>()
            + "  oldest pending"
    );
    let row = |counts: &BTreeMap<ActivationStatus, u64>| -> String {
        statuses
            .iter()
            .map(|status| format!("{:>11}", counts.get(status).copied().unwrap_or(0)))
            .collect()
    };
    let _ = writeln!(out, "{:<32} {}", "(all)", row(&by_status));
    let oldest = inspection.oldest_pending();
    let by_taskname = inspection.by_taskname();
    for (namespace, counts) in inspection.by_namespace() {
        let age = oldest
            .get(&namespace)
            .map(|at| format!("  {:.1} s", age_seconds(now, *at)))
            .unwrap_or_default();
        let _ = writeln!(out, "{namespace:<32} {}{age}", row(&counts));
        for ((_, taskname), counts) in by_taskname
            .range((namespace.clone(), String::new())..=(namespace.clone(), char::MAX.to_string()))
        {
            let _ = writeln!(out, "  {taskname:<30} {}", row(counts));
        }
    }
    let bytes = inspection.bytes_by_status();
    let sizes = |sums: &BTreeMap<ActivationStatus, u64>| -> String {
        statuses
            .iter()
            .map(|status| {
                format!(
                    "{:>11}",
                    human_bytes(sums.get(status).copied().unwrap_or(0))
                )
            })
            .collect()
    };
    let _ = writeln!(
        out,
        "\n{} of activations in the store\n\n{:<32} {}",
        human_bytes(bytes.values().sum()),
        "namespace (bytes)",
        header
            .iter()
            .map(|name| format!("{name:>11}"))
            .collect::<String>()
    );
    let _ = writeln!(out, "{:<32} {}", "(all)", sizes(&bytes));
    for (namespace, sums) in inspection.bytes_by_namespace() {
        let _ = writeln!(out, "{namespace:<32} {}", sizes(&sums));
    }
    if inspection.near_expiry.is_empty() {
        let _ = writeln!(
            out,
            "\nno Claimed or Processing task runs out within {near_secs} s"
        );
    } else {
        let _ = writeln!(
            out,
            "\nClaimed or Processing within {near_secs} s of their lease or deadline:"
        );
        for row in &inspection.near_expiry {
            let _ = writeln!(
                out,
                "  {} {} {}/{} due in {:.1} s",
                row.id,
                status_key(row.status),
                row.namespace,
                row.taskname,
                (row.due - now).num_milliseconds() as f64 / 1000.0
            );
        }
    }
    out
}

/// One activation: the row's state and the decoded TaskActivation.
pub fn task_json(row: &InflightActivation) -> Value {
    let time = |at: Option<DateTime<Utc>>| at.map(|at| at.to_rfc3339());
    let mut value = json!({
        "id": row.id,
        "status": status_key(row.status),
        "application": row.application,
        "namespace": row.namespace,
        "taskname": row.taskname,
        "topic": row.topic,
        "partition": row.partition,
        "offset": row.kafka_offset,
        "processing_attempts": row.processing_attempts,
        "received_at": row.received_at.to_rfc3339(),
        "added_at": row.added_at.to_rfc3339(),
        "expires_at": time(row.expires_at),
        "delay_until": time(row.delay_until),
        "claim_expires_at": time(row.claim_expires_at),
        "processing_deadline": time(row.processing_deadline),
        "processing_deadline_duration": row.processing_deadline_duration,
        "at_most_once": row.at_most_once,
    });
    match TaskActivation::decode(row.activation.as_slice()) {
        Ok(task) => {
            let mut decoded = activation_json(&task);
            for key in ["headers", "retry_state", "parameters"] {
                value[key] = decoded[key].take();
            }
        }
        Err(err) => value["decode_error"] = json!(err.to_string()),
    }
    value
}

/// A TaskActivation as read off Kafka: its fields, retry state and decoded
/// arguments.
pub fn activation_json(task: &TaskActivation) -> Value {
    json!({
        "id": task.id,
        "application": task.application,
        "namespace": task.namespace,
        "taskname": task.taskname,
        "received_at": task.received_at.as_ref().and_then(|at| {
            DateTime::<Utc>::from_timestamp(at.seconds, u32::try_from(at.nanos).unwrap_or(0))
                .map(|at| at.to_rfc3339())
        }),
        "processing_deadline_duration": task.processing_deadline_duration,
        "expires": task.expires,
        "delay": task.delay,
        "headers": task.headers,
        "retry_state": task.retry_state.as_ref().map_or(Value::Null, |retry| {
            json!({
                "attempts": retry.attempts,
                "max_attempts": retry.max_attempts,
                "on_attempts_exceeded": retry.on_attempts_exceeded,
                "at_most_once": retry.at_most_once,
                "delay_on_retry": retry.delay_on_retry,
            })
        }),
        "parameters": parameters(task),
    })
}

/// The task's arguments: `parameters` (JSON text) parsed, else
/// `parameters_bytes` (msgpack, zstd-compressed when the header says so)
/// decoded; what cannot be decoded is said, not hidden.
fn parameters(task: &TaskActivation) -> Value {
    if !task.parameters.is_empty() {
        return serde_json::from_str(&task.parameters)
            .unwrap_or_else(|_| json!({ "text": task.parameters }));
    }
    if task.parameters_bytes.is_empty() {
        return Value::Null;
    }
    let compressed = task.headers.get("compression-type").map(String::as_str) == Some("zstd");
    let bytes = if compressed {
        // Bounded like the store's own limit on an activation's size.
        match zstd::bulk::decompress(&task.parameters_bytes, 64 << 20) {
            Ok(bytes) => bytes,
            Err(err) => return json!({ "undecodable": format!("zstd: {err}") }),
        }
    } else {
        task.parameters_bytes.clone()
    };
    match rmpv::decode::read_value(&mut bytes.as_slice()) {
        Ok(value) => msgpack_json(&value),
        Err(err) => json!({ "undecodable": format!("msgpack: {err}"), "bytes": bytes.len() }),
    }
}

/// A msgpack value as JSON: binary as text when it is UTF-8, else hex.
fn msgpack_json(value: &rmpv::Value) -> Value {
    use rmpv::Value as M;
    match value {
        M::Nil => Value::Null,
        M::Boolean(b) => json!(b),
        M::Integer(n) => n
            .as_i64()
            .map(|n| json!(n))
            .or_else(|| n.as_u64().map(|n| json!(n)))
            .unwrap_or(Value::Null),
        M::F32(f) => json!(f),
        M::F64(f) => json!(f),
        M::String(s) => json!(s.as_str().map_or_else(|| s.to_string(), str::to_owned)),
        M::Binary(bytes) => match std::str::from_utf8(bytes) {
            Ok(text) => json!(text),
            Err(_) => json!(format!("0x{}", hex(bytes))),
        },
        M::Array(items) => Value::Array(items.iter().map(msgpack_json).collect()),
        M::Map(entries) => Value::Object(
            entries
                .iter()
                .map(|(key, value)| {
                    let key = match key {
                        M::String(s) => s.as_str().map_or_else(|| s.to_string(), str::to_owned),
                        other => other.to_string(),
                    };
                    (key, msgpack_json(value))
                })
                .collect(),
        ),
        M::Ext(kind, bytes) => json!({ "ext": kind, "data": format!("0x{}", hex(bytes)) }),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msgpack_arguments_are_shown_as_json() {
        let args = taskbroker::kafka::raw::msgpack_args(b"hello");
        let value = rmpv::decode::read_value(&mut args.as_slice()).unwrap();
        assert_eq!(
            msgpack_json(&value),
            json!({ "args": ["hello"], "kwargs": {} })
        );
        let binary = taskbroker::kafka::raw::msgpack_args(&[0xff, 0x00]);
        let value = rmpv::decode::read_value(&mut binary.as_slice()).unwrap();
        assert_eq!(msgpack_json(&value)["args"][0], json!("0xff00"));
    }

    #[test]
    fn parameters_are_json_text_or_zstd_msgpack() {
        let mut task = TaskActivation {
            parameters: r#"{"args": [1], "kwargs": {"a": "b"}}"#.to_owned(),
            ..Default::default()
        };
        assert_eq!(
            parameters(&task),
            json!({ "args": [1], "kwargs": { "a": "b" } })
        );
        task.parameters.clear();
        let packed = taskbroker::kafka::raw::msgpack_args(b"x");
        task.parameters_bytes = zstd::bulk::compress(&packed, 3).unwrap();
        task.headers
            .insert("compression-type".to_owned(), "zstd".to_owned());
        assert_eq!(parameters(&task), json!({ "args": ["x"], "kwargs": {} }));
        task.parameters_bytes = vec![0x92, 0x01]; // an array of two holding one
        task.headers.clear();
        assert!(parameters(&task)["undecodable"].is_string());
    }
}
