//! The broker's domain: what an in-flight activation is, how a wire
//! `TaskActivation` becomes one, the claim that fences it, what workers
//! report about it and the edits a retry makes to it.
//!
//! Everything else builds on this module and it builds on nothing of the
//! broker's but the generated protobuf types: the store persists and fences
//! these values, the actors move them, and neither rewrites protobuf.

pub mod activation;
mod broker;
mod claim;
mod report;
pub mod retry;
mod row;
mod rules;

pub use activation::{
    ActivationError, KafkaPosition, MAX_ID_BYTES, MAX_NAME_BYTES, TextProblem, check_text,
    inflight_from_record, timestamp_in_range,
};
pub use broker::{BeatAnswer, BrokerRow, Registration, Takeover};
pub use claim::{ClaimToken, ClaimedActivation};
pub use report::{
    DeadlineOutcome, NamespaceCount, NamespaceResult, NamespaceSummary, OTHER_NAMESPACES,
    PublishKind, PullFilter, StatusCounts, StatusUpdate, StatusUpdateOutcome, WorkerStatus,
    top_namespaces,
};
pub use retry::{RetryEdit, retry_activation};
pub use row::{
    ActivationStatus, BUCKET_COUNT, BucketRange, InflightActivation, OnAttemptsExceeded,
    bucket_for_id,
};
pub use rules::{
    Dispatch, Glob, Killswitch, PauseRule, TaskRules, fair_shares, interleave, weight_of,
    within_bytes,
};
