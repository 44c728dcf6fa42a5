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

use crate::metrics::Metrics;
use crate::model::{Glob, Killswitch, PauseRule, TaskRules};

/// How often the file is read for changes; a change is in force within
/// this plus the time the parts take to look again (the next claim, batch
/// or upkeep cycle).
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

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

    /// Whether a killswitch in force drops this task (no copy of the rules).
    pub fn killed(&self, namespace: &str, taskname: &str) -> bool {
        self.rules.borrow().killed(namespace, taskname)
    }
}

/// Reads the file at `path` and keeps [`RuntimeRules`] up to date with it
/// while [`RuntimeFile::watch`] runs.
pub struct RuntimeFile {
    path: PathBuf,
    rules: watch::Sender<TaskRules>,
    /// The bytes last read, good or bad (`None`: the last read failed), so
    /// each change is handled once.
    seen: Option<Vec<u8>>,
    metrics: Arc<Metrics>,
}

impl RuntimeFile {
    /// Loads the file, refusing to start on one that cannot be read or is
    /// invalid.
    pub fn open(path: &Path, metrics: Arc<Metrics>) -> Result<(RuntimeFile, RuntimeRules), String> {
        let bytes = read(path)?;
        let rules = parse(&bytes).map_err(|err| describe(path, &err))?;
        let (sender, receiver) = watch::channel(rules.clone());
        let file = RuntimeFile {
            path: path.to_owned(),
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
        let parsed = parse(&bytes);
        self.seen = Some(bytes);
        match parsed {
            Ok(rules) => {
                tracing::info!(path = %self.path.display(),
                    killswitches = rules.killswitches.len(), paused = rules.paused.len(),
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
    }

    fn refuse(&self, reason: String) {
        self.metrics.runtime_config_errors.inc();
        tracing::warn!(error = %reason, "runtime file refused; the previous rules stay in force");
    }
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
    // Parsed so that a file written for a broker that applies them gets a
    // clear refusal instead of "unknown field".
    #[serde(default)]
    demoted_namespaces: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    demoted_topic: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    concurrency_limits: Option<BTreeMap<String, serde::de::IgnoredAny>>,
    #[serde(default)]
    weights: Option<BTreeMap<String, serde::de::IgnoredAny>>,
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
pub fn parse(bytes: &[u8]) -> Result<TaskRules, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "the file is not UTF-8".to_owned())?;
    // An empty document (or only comments) is no rules.
    let file: Option<FileRules> = serde_norway::from_str(text).map_err(|err| err.to_string())?;
    let file = file.unwrap_or_default();
    for (key, present) in [
        ("demoted_namespaces", file.demoted_namespaces.is_some()),
        ("demoted_topic", file.demoted_topic.is_some()),
        ("concurrency_limits", file.concurrency_limits.is_some()),
        ("weights", file.weights.is_some()),
    ] {
        if present {
            return Err(format!(
                "`{key}` is not supported by this version of taskbroker; remove it"
            ));
        }
    }
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
    Ok(TaskRules {
        killswitches: killswitches.into(),
        paused: paused.into(),
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
        assert_eq!(parse(b"").unwrap(), TaskRules::default());
        assert_eq!(parse(b"# nothing yet\n").unwrap(), TaskRules::default());
        assert_eq!(parse(b"{}").unwrap(), TaskRules::default());
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
"#,
        )
        .unwrap();
        assert!(rules.killed("billing-eu", "billing.send_mail"));
        assert!(!rules.killed("billing-eu", "billing.receive"));
        assert!(rules.killed("anything", "poison.task"));
        assert!(rules.paused("billing", "invoices"));
        assert!(rules.paused("other", "reports"));
        assert!(!rules.paused("billing", "refunds"));
    }

    #[test]
    fn bad_versions_are_refused_with_the_reason() {
        let refused = |text: &str| parse(text.as_bytes()).unwrap_err();
        assert!(refused("killswitches: [{}]").contains("killswitches[0] names neither"));
        assert!(
            refused("killswitches:\n  - namespace: ''\n")
                .contains("killswitches[0].namespace is empty")
        );
        assert!(refused("killswitch: []").contains("unknown field `killswitch`"));
        assert!(refused("paused: [{app: x}]").contains("unknown field `app`"));
        assert!(refused("paused: yes").contains("paused"));
        assert!(refused("weights: {a: 2}").contains("`weights` is not supported"));
        assert!(parse(&[0xff, 0xfe]).unwrap_err().contains("not UTF-8"));
        let long = "x".repeat(MAX_NAME + 1);
        assert!(refused(&format!("paused: [{{namespace: {long}}}]")).contains("longer than"));
    }
}
