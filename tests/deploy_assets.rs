//! The deploy assets against the code: every metric the Grafana dashboard
//! and the Prometheus alerts query is exposed by the running broker from its
//! first scrape, every label value they filter on is one the broker
//! reports, and every metric is explained in docs/operations.md. A renamed
//! metric or label value fails here, not silently on a dashboard.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::kafka::MockKafka;
use common::{Backend, TestStore, http_get};
use taskbroker::broker::Broker;
use taskbroker::config::Config;
use taskbroker::metrics::{Metrics, labels};

const DASHBOARD: &str = "deploy/grafana/taskbroker.json";
const ALERTS: &str = "deploy/prometheus/alerts.yml";

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn read(relative: &str) -> String {
    std::fs::read_to_string(repo_path(relative))
        .unwrap_or_else(|err| panic!("cannot read {relative}: {err}"))
}

/// The asset's text with JSON string escapes of quotes undone, so PromQL in
/// the dashboard reads as it does in the alert rules.
fn asset_text(relative: &str) -> String {
    read(relative).replace("\\\"", "\"")
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Every `taskbroker_…` metric name in `text`, as written (histogram series
/// keep their `_bucket`, `_sum`, `_count` suffix), each with the position
/// right after the name.
fn metric_references(text: &str) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(offset) = text[from..].find("taskbroker_") {
        let start = from + offset;
        let end = text[start..]
            .find(|c: char| !is_name_char(c))
            .map_or(text.len(), |len| start + len);
        let preceded_by_name = text[..start].chars().next_back().is_some_and(is_name_char);
        if !preceded_by_name {
            found.push((text[start..end].to_owned(), end));
        }
        from = end;
    }
    found
}

/// The metric family a series name belongs to, and whether the name is one
/// of a histogram's series.
fn family_of(series: &str) -> (&str, bool) {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(family) = series.strip_suffix(suffix) {
            return (family, true);
        }
    }
    (series, false)
}

/// One label matcher of a selector: `metric{label op "value"}`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Matcher {
    metric: String,
    label: String,
    op: &'static str,
    value: String,
}

/// The matchers of the selector starting at `text[at..]`, if it is `{…}`.
fn selector_matchers(metric: &str, text: &str, at: usize) -> Vec<Matcher> {
    let rest = &text[at..];
    if !rest.starts_with('{') {
        return Vec::new();
    }
    // The selector ends at the first `}` outside a quoted value.
    let (mut in_quotes, mut escaped, mut end) = (false, false, None);
    for (i, c) in rest.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => in_quotes = !in_quotes,
            '}' if !in_quotes => {
                end = Some(i);
                break;
            }
            _ => {}
        }
    }
    let body = &rest[1..end.unwrap_or_else(|| panic!("unclosed selector after {metric}"))];
    let mut matchers = Vec::new();
    let mut parts = Vec::new();
    let (mut start, mut in_quotes) = (0, false);
    for (i, c) in body.char_indices() {
        match c {
            '"' => in_quotes = !in_quotes,
            ',' if !in_quotes => {
                parts.push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&body[start..]);
    for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
        let op = ["=~", "!~", "!=", "="]
            .into_iter()
            .find(|op| part.contains(op))
            .unwrap_or_else(|| panic!("no operator in matcher {part:?} of {metric}"));
        let (label, value) = part.split_once(op).expect("operator found above");
        let value = value.trim().trim_matches('"');
        matchers.push(Matcher {
            metric: metric.to_owned(),
            label: label.trim().to_owned(),
            op,
            value: value.to_owned(),
        });
    }
    matchers
}

/// Every matcher in `text` on a label the broker sets (not the target
/// labels Prometheus adds, not histogram buckets, not Grafana variables),
/// with regex alternations of plain words split into their words.
fn code_label_matchers(text: &str) -> Vec<Matcher> {
    let mut matchers = Vec::new();
    for (metric, end) in metric_references(text) {
        for matcher in selector_matchers(&metric, text, end) {
            if ["instance", "job", "le"].contains(&matcher.label.as_str())
                || matcher.value.contains('$')
            {
                continue;
            }
            let words = matcher.value.split('|');
            let plain = matcher.value.split('|').all(|word| {
                !word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            });
            assert!(
                plain,
                "{matcher:?}: only plain values and alternations of words can be checked"
            );
            for word in words {
                matchers.push(Matcher {
                    value: word.to_owned(),
                    ..matcher.clone()
                });
            }
        }
    }
    matchers
}

/// Families in a scrape: name → type.
fn exposed_families(scrape: &str) -> BTreeMap<String, String> {
    scrape
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .map(|(name, kind)| (name.to_owned(), kind.to_owned()))
        .collect()
}

/// Whether the scrape has a sample of `series` carrying `label="value"`.
fn has_series_with(scrape: &str, series: &str, label: &str, value: &str) -> bool {
    let pair = format!("{label}=\"{value}\"");
    scrape.lines().any(|line| {
        line.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix('{'))
            .and_then(|rest| rest.split_once('}'))
            .is_some_and(|(labels, _)| labels.split(',').any(|p| p == pair))
    })
}

/// The broker's source, without src/metrics/labels.rs, the lists of label
/// values that only pre-create series: what is left is the code that emits
/// them.
fn emitting_source() -> String {
    fn collect(dir: &Path, out: &mut String) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|err| panic!("cannot list {}: {err}", dir.display()))
            .map(|entry| entry.expect("directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                collect(&path, out);
            } else if path.extension().is_some_and(|ext| ext == "rs")
                && !path.ends_with("src/metrics/labels.rs")
            {
                out.push_str(&std::fs::read_to_string(&path).expect("read source"));
            }
        }
    }
    let mut source = String::new();
    collect(&repo_path("src"), &mut source);
    source
}

fn broker_config(kafka: &MockKafka, db: &TestStore) -> Config {
    let env: HashMap<String, String> = [
        db.env(),
        ("KAFKA_BROKERS", kafka.bootstrap()),
        ("GRPC_ADDR", "127.0.0.1:0".to_owned()),
        ("METRICS_ADDR", "127.0.0.1:0".to_owned()),
        // Push mode, so the push pipeline's metrics exist too; channels
        // connect lazily and nothing is produced, so nothing is pushed.
        ("WORKER_ENDPOINTS", "*=http://127.0.0.1:9".to_owned()),
        ("KAFKA_CONFIG", "statistics.interval.ms=100".to_owned()),
    ]
    .into_iter()
    .map(|(name, value)| (format!("TASKBROKER_{name}"), value))
    .collect();
    Config::from_lookup(|name| env.get(name).cloned()).expect("test configuration")
}

#[actix_rt::test]
async fn dashboard_and_alerts_query_only_what_the_broker_exposes() {
    let db = TestStore::new(Backend::Sqlite).await;
    let store = db.store().await;
    let kafka = MockKafka::start();
    kafka.create_topic("taskworker", 2);
    let broker = Broker::start(
        &broker_config(&kafka, &db),
        store,
        Arc::new(Metrics::new()),
        "test-host",
    )
    .expect("broker starts");
    // The first scrape, before any task or event: families whose series
    // only appeared on first use would be missing here.
    let (status, scrape) = http_get(broker.metrics_addr, "/metrics").await;
    assert_eq!(status, 200);
    let mut families = exposed_families(&scrape);
    // Series of a Kafka partition exist only while the broker holds it and
    // librdkafka has reported on it (statistics every 100 ms here): those
    // families must appear once the consumer has its partitions.
    let mut late = BTreeSet::from(["taskbroker_consumer_lag"]);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while !late.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{late:?} never appeared on /metrics"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let (_, later) = http_get(broker.metrics_addr, "/metrics").await;
        for (family, kind) in exposed_families(&later) {
            late.remove(family.as_str());
            families.entry(family).or_insert(kind);
        }
    }
    broker.stop().await;

    for asset in [DASHBOARD, ALERTS] {
        let text = asset_text(asset);
        let references = metric_references(&text);
        assert!(
            references.len() >= 10,
            "{asset}: found only {references:?}; is the extraction broken?"
        );
        let mut missing = BTreeSet::new();
        for (series, _) in &references {
            let (family, histogram_series) = family_of(series);
            match families.get(family) {
                Some(kind) if histogram_series && kind != "histogram" => {
                    missing.insert(format!("{series} (a {kind}, not a histogram)"));
                }
                Some(_) => {}
                None => {
                    missing.insert(series.clone());
                }
            }
        }
        assert!(
            missing.is_empty(),
            "{asset} queries metrics the broker does not expose: {missing:?}"
        );

        let mut unseen = BTreeSet::new();
        for matcher in code_label_matchers(&text) {
            if !has_series_with(&scrape, &matcher.metric, &matcher.label, &matcher.value) {
                unseen.insert(format!(
                    "{}{{{}=\"{}\"}}",
                    matcher.metric, matcher.label, matcher.value
                ));
            }
        }
        assert!(
            unseen.is_empty(),
            "{asset} filters on label values the broker does not report: {unseen:?}"
        );
    }

    let operations = read("docs/operations.md");
    let undocumented: Vec<&String> = families
        .keys()
        .filter(|family| !operations.contains(&format!("`{family}`")))
        .collect();
    assert!(
        undocumented.is_empty(),
        "docs/operations.md does not explain {undocumented:?}"
    );
}

#[test]
fn label_values_the_assets_filter_on_are_emitted_by_the_code() {
    let source = emitting_source();
    let mut matchers = Vec::new();
    for asset in [DASHBOARD, ALERTS] {
        matchers.extend(code_label_matchers(&asset_text(asset)));
    }
    // The extraction found the filters that matter most.
    for (metric, label, value) in [
        (
            "taskbroker_claims_released_total",
            "reason",
            "lease_expired",
        ),
        ("taskbroker_published_total", "kind", "deadletter"),
        ("taskbroker_pushes_total", "result", "timeout"),
        ("taskbroker_pushes_total", "result", "too_large"),
        ("taskbroker_activations", "status", "claimed"),
        (
            "taskbroker_upkeep_transitions_total",
            "step",
            "processing_deadline_retried",
        ),
        (
            "taskbroker_store_operation_errors_total",
            "kind",
            "unavailable",
        ),
        ("taskbroker_consumer_records_total", "result", "invalid"),
        ("taskbroker_status_reports_total", "status", "invalid"),
    ] {
        assert!(
            matchers
                .iter()
                .any(|m| m.metric == metric && m.label == label && m.value == value),
            "expected a filter {metric}{{{label}=\"{value}\"}} in the assets"
        );
    }
    let not_emitted: BTreeSet<String> = matchers
        .iter()
        .filter(|m| !source.contains(&format!("\"{}\"", m.value)))
        .map(|m| format!("{}{{{}=\"{}\"}}", m.metric, m.label, m.value))
        .collect();
    assert!(not_emitted.is_empty(), "no code emits {not_emitted:?}");
}

#[test]
fn preinitialised_label_values_are_emitted_by_the_code() {
    let source = emitting_source();
    let values: Vec<&str> = [
        labels::SUBMIT_RESULTS,
        labels::RELEASE_REASONS,
        labels::PUSH_RESULTS,
        labels::CONSUMER_RESULTS,
        labels::INVALID_REASONS,
        labels::PUBLISH_RESULTS,
        labels::PUBLISH_KINDS,
        labels::UPKEEP_STEPS,
        labels::UPKEEP_TRANSITIONS,
        labels::UPKEEP_ERROR_STEPS,
        labels::STORE_OPERATIONS,
        labels::STORE_ERROR_KINDS,
        labels::STATUS_REPORTS,
        labels::STATUS_UPDATE_RESULTS,
        labels::SQLITE_BYTES_KINDS,
    ]
    .concat();
    let unused: BTreeSet<&str> = values
        .into_iter()
        .filter(|value| !source.contains(&format!("\"{value}\"")))
        .collect();
    assert!(
        unused.is_empty(),
        "src/metrics/labels.rs pre-creates label values no code emits: {unused:?}"
    );
}
