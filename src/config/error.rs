//! Why a configuration is refused: [`ConfigError`] holds every [`Problem`], each naming the
//! variable, the value (redacted for secrets, control characters escaped) and what is allowed.

use super::allowed::Setting;
use super::{ENV_PREFIX, REDACTED, redact_url};

/// Why the configuration was refused: every problem found, one per line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:{}", lines(.problems))]
pub struct ConfigError {
    pub problems: Vec<Problem>,
}

/// One refused value: `TASKBROKER_NAME=value: what is allowed`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{variable}={value}: {message}")]
pub struct Problem {
    /// Full variable name.
    pub variable: String,
    /// The value as shown: [`REDACTED`] for secrets, control characters escaped.
    pub value: String,
    /// What is allowed, and what exactly is wrong when that helps.
    pub message: String,
}

impl Problem {
    pub(super) fn new(setting: &Setting, value: &str, message: String) -> Self {
        // Worker URLs may carry credentials (`user:pass@`): never echo them.
        let value = if setting.secret {
            REDACTED.to_owned()
        } else {
            printable(&redact_url(value))
        };
        Self {
            variable: setting.variable(),
            value,
            message: printable(&redact_url(&message)),
        }
    }

    /// A table or struct mismatch inside this module, reported rather than panicking.
    pub(super) fn internal(name: &str, message: &str) -> Self {
        Self {
            variable: format!("{ENV_PREFIX}{name}"),
            value: String::new(),
            message: format!("internal error in src/config: {message}"),
        }
    }
}

/// Escapes control characters so a stray newline or NUL cannot forge or hide an error line.
fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

fn lines(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|problem| format!("\n  {problem}"))
        .collect()
}

impl From<Problem> for ConfigError {
    fn from(problem: Problem) -> Self {
        Self {
            problems: vec![problem],
        }
    }
}
