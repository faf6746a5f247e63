//! `kiln-coordinator`: holds converge state and image records and drives converges.
//!
//! Where to start:
//! - [`model`] — the coordinator's state as domain types: records by generation, converges and their
//!   events, claims, agents, the context index, store inventories.
//! - [`store`] — the [`store::Store`] trait every backend implements, and [`store::SqliteStore`], the
//!   embedded default. Records are written by compare-and-set; one converge runs per instance.
//!
//! The gRPC services and the converge engine land with the converge issue.

pub mod model;
pub mod store;

mod server;

pub use server::{serve, Config, ServeError};
