//! taskbroker: consumes task activations from Kafka, keeps each in-flight
//! activation in a SQL store, delivers it to workers over gRPC and tracks its
//! outcome. See DESIGN.md for the architecture; dependencies point one way:
//! `actors` → `store` → (`activation`, `proto`), and `config` is a leaf.

pub mod activation;
pub mod actors;
pub mod broker;
pub mod config;
pub mod grpc;
pub mod http;
pub mod kafka;
pub mod metrics;
pub mod store;

pub mod proto {
    //! Generated from `proto/sentry_protos/taskbroker/v1/taskbroker.proto`.
    #![allow(clippy::all)]
    tonic::include_proto!("sentry_protos.taskbroker.v1");
}
