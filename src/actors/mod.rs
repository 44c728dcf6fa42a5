//! The broker's actors (DESIGN.md, "Actors"). One module each (a folder
//! where an actor has parts of its own); they talk only through typed
//! messages, and reach the store only through a [`StoreHandle`]. The broker
//! watches every one of them (`crate::supervisor`).

pub mod claims;
pub mod consumer;
pub mod fetch;
pub mod heartbeat;
pub mod liveness;
pub mod push_pool;
pub mod store;
pub mod upkeep;

pub use consumer::ConsumerActor;
pub use fetch::FetchActor;
pub use push_pool::PushPoolActor;
pub use store::{StoreActor, StoreHandle};
pub use upkeep::UpkeepActor;
