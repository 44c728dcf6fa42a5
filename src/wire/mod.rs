//! The broker's side of the v1 wire protocol that sits below the actors:
//! request signing (shared by the PushTask client and the gRPC server's
//! signature check), the client that pushes activations to workers, and the
//! TLS settings it uses for `https://` workers.
//!
//! The gRPC *server* (`crate::grpc`) sits above the actors, because it
//! answers workers from the store; keeping the client and signing here lets
//! the push pool use them without an import loop between the two.

pub mod signing;
pub mod worker_client;
pub mod worker_tls;
