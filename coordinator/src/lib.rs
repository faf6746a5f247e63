//! `kiln-coordinator`: holds converge state and image records and drives converges. The gRPC
//! services, the `Store` trait with its SQLite and PostgreSQL backends and the converge engine land
//! with the converge issue; today this crate only fixes its place in the workspace.

mod server;

pub use server::{serve, Config, ServeError};
