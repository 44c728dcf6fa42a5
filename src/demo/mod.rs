//! Demo and load-test helpers that run real components: workers that
//! answer PushTask on loopback.

pub mod worker;
