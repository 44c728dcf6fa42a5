//! The endpoint backoff of `endpoints.rs`, driven by explicit instants: no
//! test here waits on a clock. These pin the bound that integration tests
//! used to measure as a rate over seconds of wall clock (push_worker_down,
//! fault_matrix's worker outage): how many pushes a down endpoint gets.

use std::time::Duration;

use tokio::time::Instant;

use super::{FailureLog, Health, MAX_ENDPOINT_BACKOFF, MIN_ENDPOINT_BACKOFF};

const MS: Duration = Duration::from_millis(1);

/// The documented pause after `failures` consecutive failures.
fn pause_after(failures: u32) -> Duration {
    let doubled = MIN_ENDPOINT_BACKOFF.saturating_mul(1 << (failures - 1).min(16));
    doubled.min(MAX_ENDPOINT_BACKOFF)
}

#[test]
fn a_healthy_endpoint_admits_every_push_at_once() {
    let now = Instant::now();
    let mut health = Health::default();
    for _ in 0..100 {
        assert_eq!(health.admit_at(now), Ok(()));
    }
    assert!(!health.probing, "no probe while healthy");
}

#[test]
fn the_pause_starts_at_the_minimum_and_doubles_up_to_the_cap() {
    assert_eq!(MIN_ENDPOINT_BACKOFF, Duration::from_millis(25));
    assert_eq!(MAX_ENDPOINT_BACKOFF, Duration::from_millis(500));
    let expected_ms = [25, 50, 100, 200, 400, 500, 500, 500];
    let mut health = Health::default();
    let mut now = Instant::now();
    for (k, expected) in expected_ms.iter().enumerate() {
        health.record_at(false, now);
        let pause = Duration::from_millis(*expected);
        assert_eq!(pause, pause_after(k as u32 + 1));
        // Not a moment before the pause has passed...
        assert_eq!(health.admit_at(now), Err(now + pause));
        assert_eq!(health.admit_at(now + pause - MS), Err(now + pause));
        // ...and exactly then.
        now += pause;
        assert_eq!(
            health.admit_at(now),
            Ok(()),
            "probe after {} failures",
            k + 1
        );
    }
}

#[test]
fn the_pause_never_exceeds_the_cap() {
    let mut health = Health::default();
    let now = Instant::now();
    for _ in 0..100 {
        health.record_at(false, now);
        let retry_at = health.retry_at.expect("backing off");
        assert!(retry_at - now <= MAX_ENDPOINT_BACKOFF);
    }
    // Even past the exponent's limit and the counter's saturation.
    health.consecutive_failures = u32::MAX - 1;
    health.record_at(false, now);
    health.record_at(false, now);
    assert_eq!(health.consecutive_failures, u32::MAX);
    assert_eq!(health.retry_at, Some(now + MAX_ENDPOINT_BACKOFF));
}

#[test]
fn a_success_resets_the_backoff() {
    let mut health = Health::default();
    let mut now = Instant::now();
    for _ in 0..10 {
        health.record_at(false, now);
    }
    now += MAX_ENDPOINT_BACKOFF;
    assert_eq!(health.admit_at(now), Ok(()), "the probe");
    health.record_at(true, now);
    assert_eq!(health.consecutive_failures, 0);
    assert_eq!(health.retry_at, None);
    // Healthy again: everyone is admitted at once, no probe held.
    for _ in 0..10 {
        assert_eq!(health.admit_at(now), Ok(()));
    }
    // And the next failure starts from the first pause, not the cap.
    health.record_at(false, now);
    assert_eq!(health.retry_at, Some(now + MIN_ENDPOINT_BACKOFF));
}

#[test]
fn while_a_probe_is_out_nobody_else_is_admitted() {
    let mut health = Health::default();
    let mut now = Instant::now();
    health.record_at(false, now);
    now += MIN_ENDPOINT_BACKOFF;
    assert_eq!(health.admit_at(now), Ok(()), "the probe");
    // The probe hangs: however long, the others only poll again after the
    // minimum pause.
    for _ in 0..1000 {
        now += 7 * MS;
        assert_eq!(health.admit_at(now), Err(now + MIN_ENDPOINT_BACKOFF));
    }
    // Its failure ends the probe and starts the next, longer pause.
    health.record_at(false, now);
    assert_eq!(health.admit_at(now), Err(now + pause_after(2)));
}

/// A burst of claims for a down endpoint, each asking again whenever it is
/// told to: at most one probe per pause, and over an outage the count of
/// failed pushes is the number of pauses that fit, not the number of claims.
/// (This replaces push_worker_down's and fault_matrix's wall-clock bounds.)
#[test]
fn a_burst_for_a_down_endpoint_gets_one_probe_per_pause() {
    const CLAIMS: usize = 500;
    let start = Instant::now();
    let outage = Duration::from_secs(3);
    let mut health = Health::default();
    // The first push fails (the burst while healthy is bounded by the pool's
    // concurrency, not by the backoff: see push_pool_actor.rs).
    health.record_at(false, start);
    let mut next_try = vec![start; CLAIMS];
    let mut probes = Vec::new();
    let mut now = start;
    while now <= start + outage {
        for at in &mut next_try {
            if *at > now {
                continue;
            }
            match health.admit_at(now) {
                Ok(()) => {
                    probes.push(now - start);
                    // The worker is down: the probe fails at once.
                    health.record_at(false, now);
                }
                Err(again) => {
                    assert!(again > now, "a refused claim waits");
                    *at = again;
                }
            }
        }
        now += MS;
    }
    // Probes exactly when each pause ends: 25, 50, 100, 200, 400, then 500.
    let expected: Vec<Duration> = [25, 75, 175, 375, 775, 1275, 1775, 2275, 2775]
        .into_iter()
        .map(Duration::from_millis)
        .collect();
    assert_eq!(probes, expected);
    for pair in probes.windows(2) {
        assert!(pair[1] - pair[0] >= MIN_ENDPOINT_BACKOFF);
        assert!(pair[1] - pair[0] <= MAX_ENDPOINT_BACKOFF);
    }
}

#[test]
fn failure_lines_are_throttled_and_count_what_they_skipped() {
    let mut log = FailureLog::default();
    let start = Instant::now();
    assert_eq!(log.failure_at(start), Some(0));
    for i in 1..=9 {
        assert_eq!(log.failure_at(start + i * 100 * MS), None);
    }
    assert_eq!(log.failure_at(start + super::FAILURE_LOG_INTERVAL), Some(9));
}

#[test]
fn draws_spread_over_every_index() {
    // The two choices come from `splitmix` of a counter: over many pushes
    // every connection is drawn about equally often.
    let mut seen = [0u32; 7];
    for counter in 0..7_000u64 {
        seen[(super::splitmix(counter) % 7) as usize] += 1;
    }
    assert!(seen.iter().all(|&n| (800..1200).contains(&n)), "{seen:?}");
}

#[test]
fn a_probe_given_back_unsent_lets_the_next_push_probe_after_the_same_pause() {
    let mut health = Health::default();
    let now = Instant::now();
    health.record_at(false, now);
    let pause = pause_after(1);
    assert_eq!(health.admit_at(now + pause), Ok(()), "the probe");
    assert_eq!(
        health.admit_at(now + pause),
        Err(now + pause + MIN_ENDPOINT_BACKOFF)
    );
    health.abandon_probe();
    // The backoff stands (nothing was learnt), and the next push probes.
    assert_eq!(health.consecutive_failures, 1);
    assert_eq!(health.admit_at(now + pause), Ok(()), "the next probe");
}
