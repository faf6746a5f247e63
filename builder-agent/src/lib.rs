//! `kiln-agent`: executes builds, deliveries, listings and removals on one host or node.
//!
//! Where to start:
//! - [`host`] — the host store: the narrow [`host::HostStore`] trait the agent's tasks call, its
//!   domain types, [`host::verify_context`] (the check that a tag never names bytes it does not
//!   address), and [`host::DockerStore`], the real adapter over the Docker Engine API (bollard).
//!
//! - [`node`] — the node store: the narrow [`node::NodeStore`] trait, [`node::ContainerdStore`]
//!   over containerd's own API (lists every ref grouped by image id, imports a `docker save`
//!   stream by digest, removes per ref) and [`node::CriNodeStore`] over the CRI alone (removes
//!   whole ids only).
//! - [`run`] — the agent's loop: connect, hello, execute tasks (`tasks`), reconnect on the ladder;
//!   [`run_node`] is the same loop for a node agent. `metrics` is its `/metrics` (`--metrics ADDR`),
//!   `health` its gRPC health service (`--health ADDR`).

mod contexts;
pub mod emulation;
pub mod enroll;
mod health;
pub mod host;
mod metrics;
pub mod node;
mod registry;

mod runner;
pub mod stores;
mod tasks;

pub use contexts::DEFAULT_BUDGET as DEFAULT_CONTEXT_CACHE;
pub use health::READY_SERVICE;
pub use runner::{
    coordinator_urls, node_store_id, run, run_node, run_node_with, run_with, AgentConfig, Platforms, RunError,
    DRAIN_GRACE,
};
