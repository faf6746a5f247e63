//! `kiln-agent`: executes builds, loads, listings and removals on one host or node. The Docker
//! (bollard) and containerd adapters land with the converge and node issues; today this crate only
//! fixes its place in the workspace.

mod runner;

pub use runner::{run, AgentConfig, RunError};
