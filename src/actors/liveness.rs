//! Whether this broker may still claim and push: the fence a frozen broker
//! meets when it resumes after a peer took it over (DESIGN.md, "Broker
//! identity and recovery").
//!
//! A peer presumes this broker dead once its heartbeat row is older than
//! the takeover timeout, and releases its claims. So this broker may push
//! only while its last heartbeat the store accepted is recent enough that
//! no peer can have done so: until `sent + window`, where `sent` is when
//! that heartbeat was sent (before the store stamped it) and `window` is
//! the takeover timeout less one heartbeat interval, the margin for a push
//! that passed the check to reach its worker. A frozen process (SIGSTOP, a
//! long pause) resumes with that time passed: it pushes nothing until a
//! heartbeat answers. If that heartbeat finds the row gone, the
//! *generation* moves on, and every claim made in an earlier generation is
//! refused for good: its holder releases it (fenced, so a row a peer
//! claimed since is untouched) instead of pushing it.
//!
//! The check is a mutex and a clock read per push: no query.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Liveness {
    state: Arc<Mutex<State>>,
    /// How long an accepted heartbeat lets this broker push; `None`:
    /// unfenced (no membership: single actors under test).
    window: Option<Duration>,
}

#[derive(Debug)]
struct State {
    generation: u64,
    /// Pushes and claims are allowed until then; `None`: not confirmed
    /// since startup or since the last takeover.
    live_until: Option<Instant>,
}

impl Liveness {
    /// Fenced by heartbeats: nothing may be claimed or pushed until the
    /// first one is [`Liveness::confirmed`].
    pub fn fenced(window: Duration) -> Self {
        Liveness {
            state: Arc::new(Mutex::new(State {
                generation: 0,
                live_until: None,
            })),
            window: Some(window),
        }
    }

    /// Always live, generation 0: for a pipeline run without a broker row
    /// (tests of single actors, benchmarks of the pipeline alone).
    pub fn unfenced() -> Self {
        Liveness {
            state: Arc::new(Mutex::new(State {
                generation: 0,
                live_until: None,
            })),
            window: None,
        }
    }

    /// The generation to stamp on claims made now, or `None` while this
    /// broker may not claim (not confirmed, or its heartbeat is overdue).
    pub fn current(&self) -> Option<u64> {
        let state = self.lock();
        self.live(&state, Instant::now())
            .then_some(state.generation)
    }

    /// Whether a claim made in `generation` may be pushed now.
    pub fn may_push(&self, generation: u64) -> bool {
        let state = self.lock();
        state.generation == generation && self.live(&state, Instant::now())
    }

    /// A heartbeat (or the registration) sent at `sent` was accepted.
    pub fn confirmed(&self, sent: Instant) {
        if let Some(window) = self.window {
            let mut state = self.lock();
            let until = sent + window;
            state.live_until = Some(state.live_until.map_or(until, |now| now.max(until)));
        }
    }

    /// This broker's row was taken over: claims of every generation so far
    /// are refused, and nothing more is claimed until the next
    /// confirmation. Answers the new generation.
    pub fn taken_over(&self) -> u64 {
        let mut state = self.lock();
        state.generation += 1;
        state.live_until = None;
        state.generation
    }

    fn live(&self, state: &State, now: Instant) -> bool {
        self.window.is_none() || state.live_until.is_some_and(|until| now < until)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(4);

    #[test]
    fn nothing_is_claimed_before_the_first_confirmation() {
        let liveness = Liveness::fenced(WINDOW);
        assert_eq!(liveness.current(), None);
        assert!(!liveness.may_push(0));
        liveness.confirmed(Instant::now());
        assert_eq!(liveness.current(), Some(0));
        assert!(liveness.may_push(0));
    }

    #[test]
    fn a_broker_silent_past_its_window_pushes_nothing_until_a_heartbeat_answers() {
        let liveness = Liveness::fenced(WINDOW);
        // The last accepted heartbeat was sent longer ago than the window:
        // what a process frozen past the takeover timeout finds on resuming.
        let frozen_since = Instant::now() - WINDOW - Duration::from_millis(1);
        liveness.confirmed(frozen_since);
        assert_eq!(liveness.current(), None);
        assert!(!liveness.may_push(0));
        // Its row was still there: the same claims may go out again.
        liveness.confirmed(Instant::now());
        assert!(liveness.may_push(0));
    }

    #[test]
    fn claims_of_a_generation_that_was_taken_over_are_refused_for_good() {
        let liveness = Liveness::fenced(WINDOW);
        liveness.confirmed(Instant::now());
        let before = liveness.current().unwrap();
        assert_eq!(liveness.taken_over(), before + 1);
        assert!(!liveness.may_push(before));
        assert_eq!(liveness.current(), None);
        liveness.confirmed(Instant::now());
        assert!(!liveness.may_push(before), "an old claim stays refused");
        assert!(liveness.may_push(before + 1));
    }

    #[test]
    fn a_late_answer_never_shortens_a_newer_confirmation() {
        let liveness = Liveness::fenced(WINDOW);
        liveness.confirmed(Instant::now());
        liveness.confirmed(Instant::now() - WINDOW * 2);
        assert!(liveness.may_push(0));
    }

    #[test]
    fn unfenced_is_always_live() {
        let liveness = Liveness::unfenced();
        assert_eq!(liveness.current(), Some(0));
        assert!(liveness.may_push(0));
    }
}
