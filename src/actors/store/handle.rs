//! [`StoreHandle`]: how every other part of the broker talks to the
//! StoreActor. It answers each message with the store's own
//! `StoreResult<T>`, folding a StoreActor that cannot be reached (stopped,
//! or its mailbox closed) into `StoreError::Unavailable` for the message's
//! operation, so callers handle one error type and never see actix's
//! `MailboxError` or the actor's address.

use std::future::Future;
use std::sync::Arc;

use actix::dev::SendError;
use actix::prelude::*;

use super::io::StoreIo;
use super::{ReleaseClaims, StoreActor, StoreMessage};
use crate::metrics::Metrics;
use crate::model::ClaimToken;
use crate::runtime::RuntimeRules;
use crate::store::{ActivationStore, StoreError, StoreResult};

/// A typed, cloneable handle on a running StoreActor.
#[derive(Clone)]
pub struct StoreHandle {
    addr: Addr<StoreActor>,
}

impl StoreHandle {
    /// Starts a StoreActor for `store` on `arbiter` (a thread of its own, as
    /// the broker runs it), with its database calls on threads of their own
    /// (`io.rs`). Fails only if those threads cannot be started.
    pub fn start_in_arbiter(
        arbiter: &ArbiterHandle,
        store: Arc<dyn ActivationStore>,
        metrics: Arc<Metrics>,
        rules: RuntimeRules,
    ) -> std::io::Result<StoreHandle> {
        let io = StoreIo::start()?;
        Ok(StoreHandle {
            addr: StoreActor::start_in_arbiter(arbiter, move |_| {
                StoreActor::new(store, metrics, rules, io)
            }),
        })
    }

    /// Starts a StoreActor for `store` on the current Arbiter.
    pub fn start(
        store: Arc<dyn ActivationStore>,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<StoreHandle> {
        StoreHandle::start_with_rules(store, metrics, RuntimeRules::none())
    }

    /// Starts a StoreActor whose claims obey `rules`, on the current Arbiter.
    pub fn start_with_rules(
        store: Arc<dyn ActivationStore>,
        metrics: Arc<Metrics>,
        rules: RuntimeRules,
    ) -> std::io::Result<StoreHandle> {
        let io = StoreIo::start()?;
        Ok(StoreHandle {
            addr: StoreActor::new(store, metrics, rules, io).start(),
        })
    }

    /// Sends `msg` now (it queues behind the messages sent before it) and
    /// resolves with the StoreActor's answer. Not an `async fn` on purpose:
    /// while the mailbox has room the message is queued when `call` is
    /// called, not when the future is first polled, so callers' calls keep
    /// their order. With the mailbox full (`MAILBOX_CAPACITY`), actix holds
    /// the message in the returned future until it is polled.
    pub(super) fn call<M>(
        &self,
        msg: M,
    ) -> impl Future<Output = StoreResult<M::Output>> + Send + use<M>
    where
        M: StoreMessage,
        StoreActor: Handler<M>,
    {
        let request = self.addr.send(msg);
        async move {
            request.await.unwrap_or_else(|err| {
                Err(StoreError::Unavailable {
                    operation: M::OPERATION,
                    message: format!("store actor not reachable: {err}"),
                })
            })
        }
    }

    /// Queues the release of `claims` without waiting for its answer, for
    /// callers that cannot wait (a guard's `Drop`). Fails at once,
    /// `Unavailable`, when the StoreActor's mailbox is full or closed.
    pub fn release_in_background(&self, claims: Vec<ClaimToken>) -> StoreResult<()> {
        self.addr.try_send(ReleaseClaims { claims }).map_err(|err| {
            let message = match err {
                SendError::Full(_) => "store actor mailbox full",
                SendError::Closed(_) => "store actor stopped",
            };
            StoreError::Unavailable {
                operation: ReleaseClaims::OPERATION,
                message: message.to_owned(),
            }
        })
    }

    /// Whether the StoreActor is still running (it stops only with its
    /// Arbiter).
    pub fn is_running(&self) -> bool {
        self.addr.connected()
    }
}

impl std::fmt::Debug for StoreHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreHandle")
            .field("running", &self.is_running())
            .finish()
    }
}
