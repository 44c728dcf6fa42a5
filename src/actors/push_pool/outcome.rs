//! What a push's result means for its claim and its endpoint: the
//! classification of a PushTask RPC's outcome (sent or provably not, too
//! large, unknown), kept apart from the pool so the rules (PROTOCOL.md, the
//! push pool's module docs) can be read and tested on their own.

use tonic::Code;

/// How a push ended, as far as the broker can tell.
#[derive(Debug, PartialEq)]
pub(super) enum PushOutcome {
    Ok,
    /// Provably never reached the worker's handler: safe to push again.
    NotSent(NotSent),
    /// The worker may have received (and may run) the task.
    Unknown(Unknown),
    /// The request is larger than the worker (or the client) accepts.
    TooLarge(String),
}

#[derive(Debug, PartialEq)]
pub(super) enum NotSent {
    /// The endpoint's backoff outlasted the admission wait.
    AdmissionTimeout,
    /// The connection could not be made; the request was never written.
    Unreachable(String),
    /// RESOURCE_EXHAUSTED from the worker: its queue is full.
    Busy,
}

#[derive(Debug, PartialEq)]
pub(super) enum Unknown {
    /// No answer within the push timeout, after the request was sent.
    Timeout,
    Error(String),
}

impl PushOutcome {
    /// Classifies a failed RPC's status.
    pub(super) fn of_status(status: &tonic::Status) -> PushOutcome {
        if is_too_large(status) {
            return PushOutcome::TooLarge(status.message().to_owned());
        }
        if status.code() == Code::ResourceExhausted {
            return PushOutcome::NotSent(NotSent::Busy);
        }
        if failed_to_connect(status) {
            return PushOutcome::NotSent(NotSent::Unreachable(error_chain(status)));
        }
        match status.code() {
            Code::DeadlineExceeded | Code::Cancelled => PushOutcome::Unknown(Unknown::Timeout),
            _ => PushOutcome::Unknown(Unknown::Error(error_chain(status))),
        }
    }

    /// The `result` label of `taskbroker_pushes_total`: one per way a push
    /// ends, so a refused connection is never counted as a timeout.
    pub(super) fn label(&self) -> &'static str {
        match self {
            PushOutcome::Ok => "ok",
            PushOutcome::NotSent(NotSent::Busy) => "busy",
            PushOutcome::NotSent(NotSent::AdmissionTimeout) => "backoff",
            PushOutcome::NotSent(NotSent::Unreachable(_)) => "unreachable",
            PushOutcome::Unknown(Unknown::Timeout) => "timeout",
            PushOutcome::Unknown(Unknown::Error(_)) => "error",
            PushOutcome::TooLarge(_) => "too_large",
        }
    }

    pub(super) fn detail(&self) -> &str {
        match self {
            PushOutcome::NotSent(NotSent::Unreachable(detail))
            | PushOutcome::Unknown(Unknown::Error(detail))
            | PushOutcome::TooLarge(detail) => detail,
            _ => "",
        }
    }

    /// Whether the endpoint answered as a healthy worker does (a request
    /// too large is the message's fault, not the endpoint's).
    pub(super) fn endpoint_healthy(&self) -> bool {
        matches!(self, PushOutcome::Ok | PushOutcome::TooLarge(_))
    }
}

/// A message-size refusal: tonic's own limits answer OUT_OF_RANGE ("decoded
/// message length too large" from a Rust worker, "encoded message length
/// too large" from this client), gRPC C-core and Python workers answer
/// RESOURCE_EXHAUSTED ("Received message larger than max"). A busy worker's
/// RESOURCE_EXHAUSTED says nothing of the kind.
fn is_too_large(status: &tonic::Status) -> bool {
    if !matches!(status.code(), Code::ResourceExhausted | Code::OutOfRange) {
        return false;
    }
    let message = status.message().to_ascii_lowercase();
    ["too large", "larger than max", "more than 4gb"]
        .iter()
        .any(|phrase| message.contains(phrase))
}

/// The status's message and every cause under it ("tcp connect error:
/// Connection refused (os error 111)"), each said once: tonic's message
/// alone names the stage that failed, not why.
fn error_chain(status: &tonic::Status) -> String {
    let mut text = status.message().to_owned();
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        let cause = err.to_string();
        if !cause.is_empty() && !text.contains(&cause) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&cause);
        }
        source = err.source();
    }
    text
}

/// Whether the RPC failed while connecting, before any request was written:
/// tonic keeps the transport's `ConnectError` in the status's source chain.
fn failed_to_connect(status: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        if err.is::<tonic::ConnectError>() {
            return true;
        }
        source = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Status;

    #[test]
    fn size_refusals_are_too_large_not_busy() {
        for status in [
            // tonic server (a Rust worker) and tonic client limits.
            Status::out_of_range(
                "Error, decoded message length too large: found 5000 bytes, the limit is: 1024 bytes",
            ),
            Status::out_of_range(
                "Error, encoded message length too large: found 5000 bytes, the limit is: 1024 bytes",
            ),
            // gRPC C-core (a Python worker).
            Status::resource_exhausted("Received message larger than max (5000 vs. 4194304)"),
        ] {
            assert!(
                matches!(PushOutcome::of_status(&status), PushOutcome::TooLarge(_)),
                "{status:?}"
            );
        }
    }

    #[test]
    fn a_busy_worker_is_not_sent_and_other_errors_are_unknown() {
        assert_eq!(
            PushOutcome::of_status(&Status::resource_exhausted("queue full")),
            PushOutcome::NotSent(NotSent::Busy)
        );
        assert_eq!(
            PushOutcome::of_status(&Status::deadline_exceeded("late")),
            PushOutcome::Unknown(Unknown::Timeout)
        );
        // Without a connection error in its source chain, UNAVAILABLE may
        // come from a worker that received the task (shutting down).
        assert!(matches!(
            PushOutcome::of_status(&Status::unavailable("worker shutting down")),
            PushOutcome::Unknown(Unknown::Error(_))
        ));
        assert!(matches!(
            PushOutcome::of_status(&Status::out_of_range("attempt out of range")),
            PushOutcome::Unknown(Unknown::Error(_))
        ));
    }
}
