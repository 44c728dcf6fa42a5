//! The `taskbroker` binary's own modules: what its commands need that the
//! broker library does not: `demo` (`taskbroker demo` and `taskbroker
//! demo-worker`), `inspect` (`taskbroker inspect`) and `dlq` (`taskbroker
//! dlq list|show|redrive`); the broker commands
//! themselves (`run`, `migrate`, `config`, `healthcheck`) are small enough
//! to stay in main.rs.

pub mod demo;
pub mod dlq;
pub mod inspect;
