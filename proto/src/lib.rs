//! `kiln-proto`: the `kiln.v1` wire protocol (`kiln/v1/kiln.proto`) as generated tonic/prost code,
//! and nothing else. It is the only crate that knows prost: the coordinator, the agent and the CLI
//! convert these messages into `kiln-core` domain types at the gRPC edge.
//!
//! The generated code is committed (`src/gen/`), so a build needs no protoc; `tests/codegen.rs`
//! regenerates it and fails when the commit is stale. The proto's header says how versions are
//! tolerated.

#[allow(clippy::all, missing_debug_implementations)]
pub mod v1 {
    include!("gen/kiln.v1.rs");
}
