//! gRPC: request signing shared by the broker's server and its push client.

pub mod signing;
