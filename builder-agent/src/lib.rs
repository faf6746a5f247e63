//! `kiln-agent`: executes builds, deliveries, listings and removals on one host or node.
//!
//! Where to start:
//! - [`host`] — the host store: the narrow [`host::HostStore`] trait the agent's tasks call, its
//!   domain types, [`host::verify_context`] (the check that a tag never names bytes it does not
//!   address), and [`host::DockerStore`], the real adapter over the Docker Engine API (bollard).
//!
//! - [`run`] — the agent's loop: connect, hello, execute tasks (`tasks`), reconnect on the ladder.
//!
//! The node store (containerd) lands with node delivery; it will sit beside `host`.

pub mod host;
pub mod node;

mod runner;
mod tasks;

pub use runner::{run, run_with, AgentConfig, RunError};
