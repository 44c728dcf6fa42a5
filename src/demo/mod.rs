//! The demo: `taskbroker demo` (the whole broker on the mock Kafka cluster
//! with a pool of demo workers and a realistic task mix) and
//! `taskbroker demo-worker`; also the workers the tests and the load harness
//! use. Everything here runs real components: workers are tonic
//! `WorkerService` servers, Kafka speaks the real protocol.

pub mod run;
pub mod scenario;
pub mod worker;
