//! `kiln-agent`: executes builds, deliveries, listings and removals on one host or node.
//!
//! Where to start:
//! - [`host`] — the host store: the narrow [`host::HostStore`] trait the agent's tasks call, its
//!   domain types, [`host::verify_context`] (the check that a tag never names bytes it does not
//!   address), and [`host::DockerStore`], the real adapter over the Docker Engine API (bollard).
//!
//! The node store (containerd) and the task loop that talks to the coordinator land with the
//! converge; they will sit beside `host` and reach it only through the trait.

pub mod host;
