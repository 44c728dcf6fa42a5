//! The runtime file (`TASKBROKER_RUNTIME_CONFIG`): operators' rules that
//! change while the broker runs, read from a YAML file (in Kubernetes, a
//! ConfigMap mounted as a file) and re-read when it changes.
//!
//! ```yaml
//! killswitches:            # drop matching tasks at ingest and from the store
//!   - namespace: "billing*"
//!     taskname: "billing.tasks.send_*"
//! paused:                  # no claims (push or pull) until removed
//!   - application: billing
//!     namespace: invoices
//! demoted_namespaces: [reports]   # forwarded to the demoted topic
//! demoted_topic: tasks-long       # default: `<KAFKA_TOPIC>-long`
//! concurrency_limits: {exports: 5} # at most 5 in flight, all brokers
//! weights: {checkout: 4}          # 4 turns of push dispatch to others' 1
//! ```
//!
//! Every key is optional; an empty file is no rules. A file is validated
//! as a whole: an unknown key, a wrong type or a rule that would match
//! nothing useful refuses the whole version. At startup that stops the
//! broker with the reason; later, the refused version is logged (once per
//! change) and counted in `taskbroker_runtime_config_errors_total`, and the
//! last good rules stay in force.
//!
//! The file is polled ([`POLL_INTERVAL`]) rather than watched with inotify:
//! a ConfigMap update swaps a symlink of the mount's directory, which a
//! watch on the file itself misses, while a read by path always sees the
//! current version.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::watch;

use crate::config::DeliveryMode;
use crate::metrics::Metrics;
use crate::model::{Glob, Killswitch, PauseRule, TaskRules};

/// How often the file is read for changes; a change is in force within
/// this plus the time the parts take to look again (the next claim, batch
/// or upkeep cycle).
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// The largest dispatch weight a namespace may have (`weights`).
pub const MAX_WEIGHT: u32 = 1000;

/// Longest name a rule may hold (as the store's names).
const MAX_NAME: usize = crate::model::MAX_NAME_BYTES;

/// The rules in force, for the parts that apply them. Cheap to clone; each
/// read sees the latest good version.
#[derive(Debug, Clone)]
pub struct RuntimeRules {
    rules: watch::Receiver<TaskRules>,
}

impl RuntimeRules {
    /// No runtime file: no rules, ever.
    pub fn none() -> RuntimeRules {
        RuntimeRules::fixed(TaskRules::default())
    }

    /// These rules, never changing (tests, and tools).
    pub fn fixed(rules: TaskRules) -> RuntimeRules {
        let (_, receiver) = watch::channel(rules);
        RuntimeRules { rules: receiver }
    }

    /// The rules in force now.
    pub fn current(&self) -> TaskRules {
        self.rules.borrow().clone()
    }

    /// What the consumer does with a task of `namespace`/`taskname` read
    /// from `topic`, under one look at the rules in force.
    pub fn at_ingest(&self, namespace: &str, taskname: &str, topic: &str) -> AtIngest {
        let rules = self.rules.borrow();
        if rules.killed(namespace, taskname) {
            AtIngest::Killed
        } else if rules.demoted(namespace, topic) {
            AtIngest::Demoted(Arc::clone(&rules.demoted_topic))
        } else {
            AtIngest::Store
        }
    }
}

/// The runtime rules' verdict on a consumed task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AtIngest {
    Store,
    /// A killswitch drops it.
    Killed,
    /// Its namespace is demoted: forward it to this topic.
    Demoted(Arc<str>),
}

/// Reads the file at `path` and keeps [`RuntimeRules`] up to date with it
/// while [`RuntimeFile::watch`] runs.
pub struct RuntimeFile {
    path: PathBuf,
    default_demoted_topic: String,
    delivery: DeliveryMode,
    rules: watch::Sender<TaskRules>,
    /// The bytes last read, good or bad (`None`: the last read failed), so
    /// each change is handled once.
    seen: Option<Vec<u8>>,
    metrics: Arc<Metrics>,
}

impl RuntimeFile {
    /// Loads the file, refusing to start on one that cannot be read or is
    /// invalid. `default_demoted_topic` is where demoted namespaces go when
    /// the file names no `demoted_topic`.
    pub fn open(
        path: &Path,
        default_demoted_topic: &str,
        delivery: DeliveryMode,
        metrics: Arc<Metrics>,
    ) -> Result<(RuntimeFile, RuntimeRules), String> {
        let bytes = read(path)?;
        let rules = parse(&bytes, default_demoted_topic)
            .and_then(|rules| for_delivery(rules, delivery))
            .map_err(|err| describe(path, &err))?;
        let (sender, receiver) = watch::channel(rules.clone());
        let file = RuntimeFile {
            path: path.to_owned(),
            default_demoted_topic: default_demoted_topic.to_owned(),
            delivery,
            rules: sender,
            seen: Some(bytes),
            metrics,
        };
        file.loaded(&rules);
        tracing::info!(path = %path.display(), killswitches = rules.killswitches.len(),
            paused = rules.paused.len(), "runtime file loaded");
        Ok((file, RuntimeRules { rules: receiver }))
    }

    /// Re-reads the file every [`POLL_INTERVAL`] until every [`RuntimeRules`]
    /// handed out is dropped (the broker stopped).
    pub async fn watch(mut self) {
        let mut interval = tokio::time::interval(POLL_INTERVAL);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = interval.tick() => self.check(),
                _ = self.rules.closed() => return,
            }
        }
    }

    /// One look at the file: applies a good new version, refuses a bad one.
    pub fn check(&mut self) {
        let bytes = match read(&self.path) {
            Ok(bytes) => bytes,
            Err(err) => {
                // A missing or unreadable file is a change too: refused
                // once, until it can be read again.
                if self.seen.take().is_some() {
                    self.refuse(err);
                }
                return;
            }
        };
        if self.seen.as_ref() == Some(&bytes) {
            return;
        }
        let parsed = parse(&bytes, &self.default_demoted_topic)
            .and_then(|rules| for_delivery(rules, self.delivery));
        self.seen = Some(bytes);
        match parsed {
            Ok(rules) => {
                tracing::info!(path = %self.path.display(),
                    killswitches = rules.killswitches.len(), paused = rules.paused.len(),
                    demoted_namespaces = rules.demoted_namespaces.len(),
                    "runtime file changed; new rules in force");
                self.loaded(&rules);
                self.rules.send_replace(rules);
            }
            Err(err) => self.refuse(describe(&self.path, &err)),
        }
    }

    fn loaded(&self, rules: &TaskRules) {
        self.metrics
            .runtime_config_loaded
            .set(chrono::Utc::now().timestamp());
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.metrics
            .runtime_rules
            .with_label_values(&["killswitches"])
            .set(count(rules.killswitches.len()));
        self.metrics
            .runtime_rules
            .with_label_values(&["paused"])
            .set(count(rules.paused.len()));
        self.metrics
            .runtime_rules
            .with_label_values(&["demoted_namespaces"])
            .set(count(rules.demoted_namespaces.len()));
    }

    fn refuse(&self, reason: String) {
        self.metrics.runtime_config_errors.inc();
        tracing::warn!(error = %reason, "runtime file refused; the previous rules stay in force");
    }
}

/// Refuses what the delivery mode cannot apply: concurrency limits are
/// enforced by push claims only (a pull hands a task straight to a worker).
fn for_delivery(rules: TaskRules, delivery: DeliveryMode) -> Result<TaskRules, String> {
    if delivery == DeliveryMode::Pull && !rules.concurrency_limits.is_empty() {
        return Err(
            "concurrency_limits apply to push delivery only (TASKBROKER_DELIVERY_MODE=push)"
                .to_owned(),
        );
    }
    Ok(rules)
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|err| {
        format!(
            "TASKBROKER_RUNTIME_CONFIG: cannot read {}: {err}",
            path.display()
        )
    })
}

fn describe(path: &Path, err: &str) -> String {
    format!(
        "TASKBROKER_RUNTIME_CONFIG: {} is not a valid runtime file: {err}",
        path.display()
    )
}

/// The file's keys, as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRules {
    #[serde(default)]
    killswitches: Vec<KillswitchEntry>,
    #[serde(default)]
    paused: Vec<PauseEntry>,
    #[serde(default)]
    demoted_namespaces: Vec<String>,
    #[serde(default)]
    demoted_topic: Option<String>,
    #[serde(default)]
    concurrency_limits: BTreeMap<String, u32>,
    #[serde(default)]
    weights: BTreeMap<String, u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KillswitchEntry {
    namespace: Option<String>,
    taskname: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseEntry {
    application: Option<String>,
    namespace: Option<String>,
}

/// Parses and validates one version of the file.
pub fn parse(bytes: &[u8], default_demoted_topic: &str) -> Result<TaskRules, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "the file is not UTF-8".to_owned())?;
    // An empty document (or only comments) is no rules.
    let file: Option<FileRules> = serde_norway::from_str(text).map_err(|err| err.to_string())?;
    let file = file.unwrap_or_default();
    let killswitches = file
        .killswitches
        .into_iter()
        .enumerate()
        .map(|(index, entry)| {
            let at = format!("killswitches[{index}]");
            if entry.namespace.is_none() && entry.taskname.is_none() {
                return Err(format!(
                    "{at} names neither `namespace` nor `taskname` (it would drop every task)"
                ));
            }
            Ok(Killswitch {
                namespace: name(&at, "namespace", entry.namespace)?.map(Glob::new),
                taskname: name(&at, "taskname", entry.taskname)?.map(Glob::new),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let paused = file
        .paused
        .into_iter()
        .enumerate()
        .map(|(index, entry)| {
            let at = format!("paused[{index}]");
            Ok(PauseRule {
                application: name(&at, "application", entry.application)?,
                namespace: name(&at, "namespace", entry.namespace)?,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let demoted_namespaces = file
        .demoted_namespaces
        .into_iter()
        .enumerate()
        .map(|(index, namespace)| {
            name(
                &format!("demoted_namespaces[{index}]"),
                "namespace",
                Some(namespace),
            )
            .map(Option::unwrap_or_default)
        })
        .collect::<Result<Vec<_>, String>>()?;
    let demoted_topic = match file.demoted_topic {
        Some(topic) if !crate::config::valid_topic_name(&topic) => {
            return Err(format!(
                "demoted_topic {topic:?} is not a valid Kafka topic name \
                 (1 to 249 of a-z, A-Z, 0-9, '.', '_', '-')"
            ));
        }
        Some(topic) => topic.into(),
        None => default_demoted_topic.into(),
    };
    let concurrency_limits = file
        .concurrency_limits
        .into_iter()
        .map(|(namespace, limit)| {
            let at = format!("concurrency_limits.{namespace}");
            let namespace =
                name("concurrency_limits", "namespace", Some(namespace))?.unwrap_or_default();
            if limit == 0 {
                return Err(format!(
                    "{at} is 0; to hold a namespace, pause it (`paused`)"
                ));
            }
            Ok((namespace, limit))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let weights = file
        .weights
        .into_iter()
        .map(|(namespace, weight)| {
            let at = format!("weights.{namespace}");
            let namespace = name("weights", "namespace", Some(namespace))?.unwrap_or_default();
            if !(1..=MAX_WEIGHT).contains(&weight) {
                return Err(format!(
                    "{at} is {weight}; a weight is from 1 to {MAX_WEIGHT} (to hold a namespace, pause it)"
                ));
            }
            Ok((namespace, weight))
        })
        .collect::<Result<Vec<_>, String>>()?;
    // The ordinary claims leave out the paused tasks, every demoted
    // namespace (upkeep forwards those rows) and every limited one (claimed
    // by counted claims of their own).
    let unclaimable: Vec<PauseRule> = paused
        .iter()
        .cloned()
        .chain(
            demoted_namespaces
                .iter()
                .chain(concurrency_limits.iter().map(|(namespace, _)| namespace))
                .map(|namespace| PauseRule {
                    application: None,
                    namespace: Some(namespace.clone()),
                }),
        )
        .collect();
    Ok(TaskRules {
        killswitches: killswitches.into(),
        paused: paused.into(),
        demoted_namespaces: demoted_namespaces.into(),
        demoted_topic,
        concurrency_limits: concurrency_limits.into(),
        weights: weights.into(),
        unclaimable: unclaimable.into(),
    })
}

/// A name or pattern of a rule: absent is fine, empty or too long is not.
fn name(at: &str, key: &str, value: Option<String>) -> Result<Option<String>, String> {
    match value {
        Some(value) if value.trim().is_empty() => Err(format!(
            "{at}.{key} is empty (leave the key out to match any)"
        )),
        Some(value) if value.len() > MAX_NAME || value.contains('\0') => Err(format!(
            "{at}.{key} is longer than {MAX_NAME} bytes or holds a NUL character"
        )),
        other => Ok(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_file_or_comments_only_is_no_rules() {
        let none = TaskRules {
            demoted_topic: "tasks-long".into(),
            ..TaskRules::default()
        };
        assert_eq!(parse(b"", "tasks-long").unwrap(), none);
        assert_eq!(parse(b"# nothing yet\n", "tasks-long").unwrap(), none);
        assert_eq!(parse(b"{}", "tasks-long").unwrap(), none);
    }

    #[test]
    fn killswitches_and_pauses_are_read() {
        let rules = parse(
            br#"
killswitches:
  - namespace: "billing*"
    taskname: "billing.send_*"
  - taskname: poison.task
paused:
  - application: billing
    namespace: invoices
  - namespace: reports
demoted_namespaces: [slow]
"#,
            "tasks-long",
        )
        .unwrap();
        assert!(rules.demoted("slow", "tasks"));
        assert!(
            !rules.demoted("slow", "tasks-long"),
            "never from the demoted topic"
        );
        assert!(!rules.demoted("fast", "tasks"));
        assert_eq!(&*rules.demoted_topic, "tasks-long");
        assert_eq!(rules.unclaimable.len(), 3);
        assert!(rules.killed("billing-eu", "billing.send_mail"));
        assert!(!rules.killed("billing-eu", "billing.receive"));
        assert!(rules.killed("anything", "poison.task"));
        assert!(rules.paused("billing", "invoices"));
        assert!(rules.paused("other", "reports"));
        assert!(!rules.paused("billing", "refunds"));
    }

    #[test]
    fn bad_versions_are_refused_with_the_reason() {
        let refused = |text: &str| parse(text.as_bytes(), "tasks-long").unwrap_err();
        assert!(refused("killswitches: [{}]").contains("killswitches[0] names neither"));
        assert!(
            refused("killswitches:\n  - namespace: ''\n")
                .contains("killswitches[0].namespace is empty")
        );
        assert!(refused("killswitch: []").contains("unknown field `killswitch`"));
        assert!(refused("paused: [{app: x}]").contains("unknown field `app`"));
        assert!(refused("paused: yes").contains("paused"));
        assert!(refused("weights: {a: 0}").contains("weights.a is 0; a weight is from 1 to 1000"));
        assert!(refused("weights: {a: 1001}").contains("weights.a is 1001"));
        assert!(refused("weights: {a: 1.5}").contains("weights"));
        let weighted = parse(b"weights: {checkout: 4, reports: 1}", "t").unwrap();
        assert_eq!(
            &*weighted.weights,
            [("checkout".to_owned(), 4), ("reports".to_owned(), 1)]
        );
        assert!(weighted.unclaimable.is_empty(), "weights leave nothing out");
        assert!(refused("concurrency_limits: {a: 0}").contains("concurrency_limits.a is 0"));
        assert!(refused("concurrency_limits: {a: -1}").contains("concurrency_limits"));
        let limited = parse(b"concurrency_limits: {reports: 3}", "t").unwrap();
        assert_eq!(&*limited.concurrency_limits, [("reports".to_owned(), 3)]);
        assert_eq!(limited.unclaimable.len(), 1);
        assert!(parse(&[0xff, 0xfe], "t").unwrap_err().contains("not UTF-8"));
        assert!(refused("demoted_topic: 'bad topic'").contains("not a valid Kafka topic"));
        assert!(
            refused("demoted_namespaces: ['']")
                .contains("demoted_namespaces[0].namespace is empty")
        );
        assert_eq!(
            parse(b"demoted_topic: slow-pool", "tasks-long")
                .unwrap()
                .demoted_topic,
            "slow-pool".into()
        );
        let long = "x".repeat(MAX_NAME + 1);
        assert!(refused(&format!("paused: [{{namespace: {long}}}]")).contains("longer than"));
    }
}
