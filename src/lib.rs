//! taskbroker: consumes task activations from Kafka, keeps each in-flight
//! activation in a SQL store, delivers it to workers over gRPC and tracks its
//! outcome. See DESIGN.md for the architecture; dependencies point one way
//! (tests/architecture.rs checks it):
//!
//! - `broker` assembles everything; `grpc` (the server) and `http` answer
//!   from the actors;
//! - `actors` use `store`, `wire` (signing, the PushTask client), `kafka`,
//!   `runtime` (the operators' rules from the runtime file);
//! - `store` persists and fences `model` values; `model` uses only `proto`;
//! - `config`, `metrics` and `supervisor` are leaves: they import nothing of
//!   the crate.

pub mod actors;
pub mod broker;
pub mod config;
pub mod grpc;
pub mod http;
pub mod kafka;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod net;
pub mod runtime;
pub mod store;
pub mod supervisor;
pub mod wire;

pub mod proto {
    //! Generated from `proto/sentry_protos/taskbroker/v1/taskbroker.proto`.
    #![allow(clippy::all)]
    tonic::include_proto!("sentry_protos.taskbroker.v1");
}
