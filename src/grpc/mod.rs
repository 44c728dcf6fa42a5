//! The broker's gRPC server: ConsumerService (pull delivery and workers'
//! reports), its codec, the signature check in front of it, and
//! grpc.health.v1. Request signing and the PushTask client live in
//! `crate::wire`, below the actors.

pub mod codec;
pub mod consumer_service;
pub mod server;
pub mod tls;
pub mod verify;
