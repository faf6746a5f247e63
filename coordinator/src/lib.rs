//! `kiln-coordinator`: holds converge state and image records and drives converges.
//!
//! Where to start:
//! - [`model`] — the coordinator's state as domain types: records by generation, converges and their
//!   events, claims, agents, the context index, store inventories.
//! - [`state`] — the [`state::StateStore`] trait every backend implements, and [`state::SqliteStore`], the
//!   embedded default. Records are written by compare-and-set; one converge runs per instance.
//!
//! - [`serve`] — start here: opens the state, fails converges a crash left running, and serves
//!   the three gRPC services on a listener the caller bound.
//! - `engine` — the converge, step by step (DESIGN.md "The converge"); `plan` converts the request.
//! - `mirror` — pinned images copied into `mirror_registry` at their digest (and why the copy runs
//!   here, in the coordinator).
//! - `hub` — agents' `Connect` streams and the tasks sent over them, as `task`'s domain types
//!   (prost stops at the hub); `contexts` — the content store.
//! - `api` — the CLI-facing `Kiln` service; `events` — each converge's persisted, streamed log.
//! - `sweep` — reachability garbage collection: list the stores, gather the roots, plan with
//!   `kiln_core::sweep::plan`, remove through the agents, confirm by listing again.
//! - [`metrics`] — the Prometheus instruments, served by `web` at `/metrics` (`--http`), beside
//!   the read-only status page at `/` (behind a token login when the coordinator serves TLS).
//! - [`kube`] — the cluster, when one is configured: the `kiln-images` ConfigMap, Kubernetes roots,
//!   and the report of workloads on older refs.

pub mod kube;
pub mod model;
pub mod state;
pub mod trust;

mod address;
/// The `UpRequest` → `UpPlan` conversion, public only for the `up_request` fuzz target (`fuzz/`):
/// not an API.
#[doc(hidden)]
pub mod plan;

mod api;
mod blobs;
mod cluster;
mod contexts;
mod convert;
mod deliver;
mod engine;
mod events;
mod hub;
mod listen;
pub mod metrics;
mod mirror;
mod relay;
mod schedule;
mod server;
mod sweep;
mod task;
mod web;
mod why;

pub use listen::{listen, listen_on, BACKLOG};
pub use server::{serve, Config, ServeError, ServerTls, DEFAULT_MAX_UPLOAD_BYTES};
