//! Where and how every command logs: to stderr, so stdout carries only what
//! a command prints (and a container's log stream is the logs); as text or
//! JSON lines (`TASKBROKER_LOG_FORMAT`); coloured only when stderr is a
//! terminal and `NO_COLOR` is unset or empty (no-color.org), so files and
//! pipes get no escape codes.

use std::io::IsTerminal;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Whether text log lines are coloured.
pub fn coloured(stderr_is_terminal: bool, no_color: Option<&str>) -> bool {
    stderr_is_terminal && no_color.is_none_or(str::is_empty)
}

/// Installs the process's logger: `filter` as `TASKBROKER_LOG` gives it
/// (already checked by the configuration), in `format`.
pub fn init(filter: &str, format: LogFormat) -> Result<(), String> {
    let filter = EnvFilter::try_new(filter)
        .map_err(|err| format!("TASKBROKER_LOG={filter}: not a valid log filter: {err}"))?;
    let ansi = coloured(
        std::io::stderr().is_terminal(),
        std::env::var("NO_COLOR").ok().as_deref(),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    }
    .map_err(|err| format!("cannot install the logger: {err}"))
}

/// How often a repeating warning is logged at most.
pub const REPEAT_INTERVAL: Duration = Duration::from_secs(10);

/// A warning that repeats while a fault lasts (a failed claim on every
/// retry during a database outage): logged at most once per `every`, each
/// line saying how many were left out since the previous one. The metrics
/// still count every occurrence.
#[derive(Debug)]
pub struct Throttle {
    every: Duration,
    /// When the last line was let through, and how many were held back
    /// since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub const fn new(every: Duration) -> Self {
        Throttle {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(left out since the last line)` when this occurrence is to be
    /// logged, else `None` (and it is counted as left out).
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    /// [`Throttle::admit`] at `now`.
    pub fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (last, held) = &mut *state;
        match last {
            Some(at) if now.saturating_duration_since(*at) < self.every => {
                *held += 1;
                None
            }
            _ => {
                *last = Some(now);
                Some(std::mem::take(held))
            }
        }
    }
}

/// `tracing::warn!` through a [`Throttle`] of its own call site: a warning
/// that repeats for every push, batch or row while a database or Kafka is
/// away is logged at most once per [`REPEAT_INTERVAL`], with `left_out`.
#[macro_export]
macro_rules! warn_throttled {
    ($($arg:tt)+) => {{
        static THROTTLE: $crate::logging::Throttle =
            $crate::logging::Throttle::new($crate::logging::REPEAT_INTERVAL);
        if let Some(left_out) = THROTTLE.admit() {
            ::tracing::warn!(left_out, $($arg)+);
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeating_warning_is_let_through_once_per_interval_with_the_count_left_out() {
        let throttle = Throttle::new(Duration::from_secs(10));
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        assert_eq!(throttle.admit_at(at(0)), Some(0));
        assert_eq!(throttle.admit_at(at(100)), None);
        assert_eq!(throttle.admit_at(at(9_999)), None);
        assert_eq!(throttle.admit_at(at(10_000)), Some(2));
        assert_eq!(throttle.admit_at(at(10_001)), None);
        assert_eq!(throttle.admit_at(at(30_000)), Some(1));
    }

    /// Log lines written under a test's own subscriber.
    #[derive(Clone, Default)]
    struct Lines(std::sync::Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn failing_write(attempt: u32) {
        crate::warn_throttled!(attempt, "cannot record a push");
    }

    #[test]
    fn a_throttled_call_site_logs_once_per_interval_however_often_it_runs() {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            for attempt in 0..50 {
                failing_write(attempt);
            }
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let logged: Vec<&str> = text.lines().collect();
        assert_eq!(logged.len(), 1, "{text}");
        assert!(logged[0].contains("cannot record a push"), "{text}");
        assert!(logged[0].contains("left_out=0"), "{text}");
        assert!(logged[0].contains("attempt=0"), "{text}");
    }

    #[test]
    fn colour_only_on_a_terminal_and_never_with_no_color() {
        assert!(coloured(true, None));
        assert!(coloured(true, Some("")));
        assert!(!coloured(true, Some("1")));
        assert!(!coloured(false, None));
    }
}
