//! The broker's actors (DESIGN.md, "Actors"). One file each; they talk only
//! through typed messages.

pub mod claims;
pub mod consumer;
pub mod fetch;
pub mod push_pool;
pub mod store;
pub mod upkeep;

pub use consumer::ConsumerActor;
pub use fetch::FetchActor;
pub use push_pool::PushPoolActor;
pub use store::{StoreActor, StoreHandle};
pub use upkeep::UpkeepActor;
