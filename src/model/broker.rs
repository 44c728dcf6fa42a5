//! Broker identity as the store records it: who holds a claim, and what a
//! peer did when it found a broker silent.

use std::time::Duration;

use chrono::{DateTime, Utc};

/// A broker whose heartbeat was older than the takeover timeout, as the
/// peer that took it over found it: its row removed and its claims
/// returned to Pending in the same statement.
#[derive(Debug, Clone, PartialEq)]
pub struct Takeover {
    pub broker_id: String,
    pub host: String,
    /// How long its heartbeat had been silent.
    pub silent_for: Duration,
    /// Its Claimed rows returned to Pending.
    pub released: u64,
}

/// What registering a broker found in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    /// Other brokers whose heartbeat is within the takeover timeout: when
    /// there are some, workers had a broker to report to while this one was
    /// away.
    pub live_peers: u64,
}

/// What the store answered to a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BeatAnswer {
    /// `heartbeat_at` refreshed; `silent_peers` other brokers' heartbeats
    /// were older than the takeover timeout (read in the same statement,
    /// so a beat with nobody to take over costs no second one).
    Accepted { silent_peers: u64 },
    /// The row is gone: a peer found this broker silent and took it over.
    TakenOver,
    /// The row carries another incarnation: another process registered
    /// with the same broker id.
    Replaced,
}

/// A broker's row, as a broker starting under the same id finds it.
#[derive(Debug, Clone, PartialEq)]
pub struct BrokerRow {
    pub incarnation: String,
    pub heartbeat_at: DateTime<Utc>,
    /// How long ago `heartbeat_at` was, by the database's clock.
    pub silent_for: Duration,
}
