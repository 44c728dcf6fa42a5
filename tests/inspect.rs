//! `taskbroker inspect`, the real binary against PostgreSQL or an SQLite
//! file that a store holds open (as a running broker does): its counts
//! equal the table's, claims about to run out are listed, and one task is
//! shown decoded, its msgpack arguments included.

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use common::{Backend, TestStore, insert, row_from, task};
use serde_json::{Value, json};
use taskbroker::model::{ActivationStatus, BucketRange};

/// Runs `taskbroker inspect <args>` on the test store (push mode, the
/// default, with no worker endpoints: inspect needs none).
fn run_inspect(db: &TestStore, args: &[&str]) -> std::process::Output {
    let (variable, value) = db.env();
    Command::new(env!("CARGO_BIN_EXE_taskbroker"))
        .arg("inspect")
        .args(args)
        .env_remove("TASKBROKER_DATABASE_URL")
        .env_remove("TASKBROKER_WORKER_ENDPOINTS")
        .env_remove("TASKBROKER_DELIVERY_MODE")
        .env(format!("TASKBROKER_{variable}"), value)
        .output()
        .expect("run taskbroker inspect")
}

/// `run_inspect`'s stdout as JSON, which it must print.
fn inspect(db: &TestStore, args: &[&str]) -> Value {
    let output = run_inspect(db, args);
    assert!(
        output.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("inspect --json prints JSON")
}

/// `taskbroker inspect` as an operator reads it.
fn inspect_text(db: &TestStore) -> String {
    let output = run_inspect(db, &[]);
    assert!(output.status.success());
    String::from_utf8_lossy(&output.stdout).into_owned()
}

on_both_backends!(inspect_counts_equal_the_table_and_show_one_task_decoded);

async fn inspect_counts_equal_the_table_and_show_one_task_decoded(backend: Backend) {
    let db = TestStore::new(backend).await;
    let store = db.store().await;
    let of = |id: &str, namespace: &str, taskname: &str| {
        let mut activation = task(id);
        activation.namespace = namespace.to_owned();
        activation.taskname = taskname.to_owned();
        activation
    };
    // Claimed soon to expire, and claimed with a long lease.
    insert(
        store.as_ref(),
        &[row_from(&of("soon", "mail", "mail.send"))],
    )
    .await;
    store
        .claim_for_push(BucketRange::ALL, 10, Duration::from_secs(5))
        .await
        .unwrap();
    insert(
        store.as_ref(),
        &[row_from(&of("later", "mail", "mail.send"))],
    )
    .await;
    store
        .claim_for_push(BucketRange::ALL, 10, Duration::from_secs(600))
        .await
        .unwrap();
    // Pending rows in two namespaces; one carries msgpack arguments.
    let mut with_args = of("args", "billing", "billing.charge");
    with_args.parameters_bytes = taskbroker::kafka::raw::msgpack_args(b"invoice-17");
    let mut rows = vec![row_from(&with_args)];
    // One large task: its bytes show in the byte tables.
    let mut large = of("large", "billing", "billing.refund");
    large.parameters_bytes = vec![9; 3 << 20];
    rows.push(row_from(&large));
    for i in 0..5 {
        rows.push(row_from(&of(&format!("b{i}"), "billing", "billing.charge")));
    }
    for i in 0..3 {
        rows.push(row_from(&of(&format!("r{i}"), "billing", "billing.refund")));
    }
    for i in 0..2 {
        rows.push(row_from(&of(&format!("m{i}"), "mail", "mail.digest")));
    }
    insert(store.as_ref(), &rows).await;

    let summary = inspect(&db, &["--json"]);
    // by_status: the table's own counts, every status, lowercase.
    let counts = store.count_by_status().await.unwrap();
    let expected: serde_json::Map<String, Value> = counts
        .by_status()
        .map(|(status, count)| (status.to_ascii_lowercase(), json!(count)))
        .collect();
    assert_eq!(summary["by_status"], Value::Object(expected));
    assert_eq!(summary["by_status"]["pending"], json!(12));
    assert_eq!(summary["by_status"]["claimed"], json!(2));
    // by_namespace from the rows, counted independently of the store.
    let mut by_namespace: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for (id, (status, _)) in db.rows().await {
        let namespace = if id.starts_with('m') || id == "soon" || id == "later" {
            "mail"
        } else {
            "billing"
        };
        *by_namespace
            .entry(namespace.to_owned())
            .or_default()
            .entry(status.to_ascii_lowercase())
            .or_default() += 1;
    }
    assert_eq!(summary["by_namespace"], json!(by_namespace));
    assert_eq!(
        summary["by_taskname"]["billing"]["billing.refund"],
        json!({ "pending": 4 })
    );
    // Bytes by status and namespace: the stored activations' sizes.
    let mut bytes_by_namespace: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let mut pending_bytes = 0;
    for (id, (status, _)) in db.rows().await {
        let row = store.get(&id).await.unwrap().expect("row");
        let size = row.activation.len() as u64;
        if status == "Pending" {
            pending_bytes += size;
        }
        *bytes_by_namespace
            .entry(row.namespace.clone())
            .or_default()
            .entry(status.to_ascii_lowercase())
            .or_default() += size;
    }
    assert!(pending_bytes > 3 << 20);
    assert_eq!(summary["bytes_by_status"]["pending"], json!(pending_bytes));
    assert_eq!(summary["bytes_by_status"]["complete"], json!(0));
    assert_eq!(summary["bytes_by_namespace"], json!(bytes_by_namespace));
    let text = inspect_text(&db);
    assert!(text.contains("of activations in the store"), "{text}");
    assert!(text.contains("3.0 MiB"), "{text}");
    assert!(summary["oldest_pending_age_seconds"]["billing"].is_number());
    assert!(summary["oldest_pending_age_seconds"]["mail"].is_number());
    // The 5 s claim is near expiry; the 600 s one is not.
    let near = summary["near_expiry"].as_array().unwrap();
    assert_eq!(near.len(), 1, "{near:?}");
    assert_eq!(near[0]["id"], "soon");
    assert_eq!(near[0]["status"], "claimed");
    let shorter = inspect(&db, &["--json", "--near-expiry-sec", "1"]);
    assert_eq!(shorter["near_expiry"], json!([]));

    let shown = inspect(&db, &["task", "args", "--json"]);
    assert_eq!(shown["id"], "args");
    assert_eq!(shown["status"], "pending");
    assert_eq!(shown["namespace"], "billing");
    assert_eq!(
        shown["parameters"],
        json!({ "args": ["invoice-17"], "kwargs": {} })
    );
    assert_eq!(
        store.get("args").await.unwrap().unwrap().status,
        ActivationStatus::Pending,
        "inspect changed nothing"
    );
    let unknown = run_inspect(&db, &["task", "nope"]);
    assert!(!unknown.status.success());
    assert!(
        String::from_utf8_lossy(&unknown.stderr).contains("no activation with id \"nope\""),
        "{}",
        String::from_utf8_lossy(&unknown.stderr)
    );
}

/// A store that is not there is a clear error, and nothing is created.
#[test]
fn a_missing_sqlite_file_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("taskbroker-inspect-{}", uuid::Uuid::new_v4()));
    let path = dir.join("absent.sqlite");
    let output = Command::new(env!("CARGO_BIN_EXE_taskbroker"))
        .args(["inspect", "--json"])
        .env_remove("TASKBROKER_DATABASE_URL")
        .env("TASKBROKER_SQLITE_PATH", &path)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no SQLite database at"), "{stderr}");
    assert!(!path.exists(), "inspect creates nothing");
}
