//! The threads a StoreActor's database calls run on.
//!
//! The actor itself is one thread: if each call's future ran there (as
//! actix runs a handler's `ResponseFuture`), every query's client work —
//! building the statement, encoding the rows, decoding the answer — and,
//! because deadpool opens each PostgreSQL connection from inside the
//! `pool.get()` that needs it, the I/O of every connection would run on
//! that one thread too, and the broker would stop scaling at one core. So
//! the actor hands each call to a multi-threaded runtime of its own and
//! only waits for the answer; the actor keeps what must be ordered (the
//! write combiner's queues), which is a few map operations per message.

use std::future::Future;

use actix::ResponseFuture;
use tokio::runtime::{Builder, Handle, Runtime};

use crate::store::{StoreError, StoreResult};

/// Threads' name, as `top -H` and `/proc/<pid>/task/*/comm` show them.
const THREAD_NAME: &str = "tb-store-io";

/// A multi-threaded tokio runtime owned by one StoreActor; it is shut down
/// (without waiting for calls still running) when the actor is dropped.
pub(super) struct StoreIo {
    runtime: Option<Runtime>,
    handle: Handle,
}

impl StoreIo {
    /// One thread per core (at least two, so a slow call never holds the
    /// rest), named [`THREAD_NAME`].
    pub(super) fn start() -> std::io::Result<StoreIo> {
        let threads = std::thread::available_parallelism()
            .map_or(2, usize::from)
            .clamp(2, 16);
        let runtime = Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(THREAD_NAME)
            .enable_all()
            .build()?;
        Ok(StoreIo {
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
        })
    }

    /// Runs `call` on the store's threads; the actor's future only waits
    /// for its answer. A call that cannot finish (the runtime shut down
    /// under it, or it panicked) answers `Unavailable` for `operation`.
    pub(super) fn run<T, F>(
        &self,
        operation: &'static str,
        call: F,
    ) -> ResponseFuture<StoreResult<T>>
    where
        T: Send + 'static,
        F: Future<Output = StoreResult<T>> + Send + 'static,
    {
        let task = self.handle.spawn(call);
        Box::pin(async move {
            task.await.unwrap_or_else(|err| {
                Err(StoreError::Unavailable {
                    operation,
                    message: format!("store call did not finish: {err}"),
                })
            })
        })
    }

    /// Runs `write` on the store's threads and resolves with its output, or
    /// `None` if it could not finish (see [`StoreIo::run`]).
    pub(super) fn spawn<T, F>(&self, write: F) -> impl Future<Output = Option<T>> + 'static
    where
        T: Send + 'static,
        F: Future<Output = T> + Send + 'static,
    {
        let task = self.handle.spawn(write);
        async move { task.await.ok() }
    }
}

impl Drop for StoreIo {
    fn drop(&mut self) {
        // The actor is dropped on its Arbiter's thread, inside a runtime,
        // where blocking on a shutdown is not allowed.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}
