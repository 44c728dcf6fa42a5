//! The demo workers of `taskbroker demo`, which the `push` scenario drains
//! into: real `WorkerService` servers, each on a thread and runtime of its
//! own, answering every push at once and reporting nothing. The simulated
//! workers of workers.rs always report to the broker and share the caller's
//! runtime, so they would change what `push` measures.
//!
//! The source files belong to the `taskbroker` binary (src/cli/demo/); a
//! package cannot depend on a binary, so they are compiled in here from
//! their path. `worker.rs` finds its ledger as the sibling `scenario`. The
//! harness uses one mode of the worker and none of the ledger, hence the
//! `dead_code` allowance.
#![allow(dead_code)]

#[path = "../../../../src/cli/demo/scenario.rs"]
mod scenario;
#[path = "../../../../src/cli/demo/worker.rs"]
mod worker;

pub use worker::{DemoWorker, Mode};
