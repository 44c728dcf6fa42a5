//! The broker's actors (DESIGN.md, "Actors"). One file each; they talk only
//! through typed messages.

pub mod store;

pub use store::StoreActor;
