//! The fake workers the tests use are the demo workers of `taskbroker demo`
//! (src/cli/demo/worker.rs), and the fault matrix keeps its books in the
//! demo's ledger (src/cli/demo/scenario.rs). Both files belong to the
//! `taskbroker` binary, not the library, and no test can depend on a
//! binary's modules, so they are compiled into the tests from their source
//! here; `worker.rs` finds the ledger as its sibling `scenario`.

#[path = "../../src/cli/demo/worker.rs"]
mod demo_worker;
#[path = "../../src/cli/demo/scenario.rs"]
pub mod scenario;

pub use demo_worker::{DemoWorker, Mode};

/// Starts demo workers, failing the test if one cannot listen.
pub struct FakeWorker;

impl FakeWorker {
    pub async fn start(mode: Mode) -> DemoWorker {
        DemoWorker::start(mode).await.expect("fake worker listens")
    }

    pub async fn start_signed(mode: Mode, secrets: Vec<String>) -> DemoWorker {
        DemoWorker::start_signed(mode, secrets)
            .await
            .expect("fake worker listens")
    }
}
