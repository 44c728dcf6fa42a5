//! gRPC: request signing (shared by the broker's server and its push
//! client), the server-side signature check, and the PushTask client.

pub mod codec;
pub mod consumer_service;
pub mod server;
pub mod signing;
pub mod verify;
pub mod worker_client;
