//! The `taskbroker` binary's own modules: what its commands need that the
//! broker library does not. Only `demo` so far (`taskbroker demo` and
//! `taskbroker demo-worker`); the broker commands themselves (`run`,
//! `migrate`, `config`, `healthcheck`) are small enough to stay in main.rs.

pub mod demo;
