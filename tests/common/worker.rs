//! The fake workers the tests use are the library's demo workers.

pub use taskbroker::demo::worker::{DemoWorker, Mode};

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
