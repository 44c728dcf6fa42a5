//! gRPC: request signing shared by the broker's server and its push client,
//! and the PushTask client.

pub mod signing;
pub mod worker_client;
