//! `kiln-proto`: the `kiln.v1` wire protocol (`kiln/v1/kiln.proto`) as generated tonic/prost code,
//! the clients of the two foreign gRPC APIs the node store speaks, and the handful of BuildKit status
//! messages a Docker build reports in (`buildkit`). It is the only crate that knows prost: the
//! coordinator, the agent and the CLI convert these messages into `kiln-core` domain types at the
//! gRPC edge.
//!
//! The modules, each named after its protobuf package:
//! - [`v1`]: `kiln.v1`, Kiln's own protocol. The proto's header says how versions are tolerated.
//! - [`containerd`]: containerd's API — `containerd::types` (the `Descriptor`) and
//!   `containerd::services::{containers, content, images, leases, version}::v1`, clients only.
//! - [`cri`]: the Kubernetes CRI, `runtime.v1`, as `cri::v1` (`RuntimeService` and `ImageService`
//!   clients).
//!
//! containerd's and the CRI's protos (`containerd/`, `cri/`) are hand-written subsets of the upstream
//! APIs: only the RPCs, messages and fields Kiln uses, with upstream's names and field numbers, so
//! they reach the same gRPC paths and decode the same bytes (prost skips the fields left out).
//!
//! The generated code is committed (`src/gen/`), so a build needs no protoc; `tests/codegen.rs`
//! regenerates it with a vendored protoc and fails when the commit is stale.

#[allow(clippy::all, missing_debug_implementations)]
pub mod v1 {
    include!("gen/kiln.v1.rs");
}

/// containerd's own gRPC API (one namespace per request, named in the `containerd-namespace`
/// metadata header). The modules mirror the protobuf packages, so the generated code's relative
/// paths (`super::super::super::types::Descriptor`) resolve as they are.
#[allow(clippy::all, missing_debug_implementations)]
pub mod containerd {
    /// `containerd.types`.
    pub mod types {
        include!("gen/containerd.types.rs");
    }

    pub mod services {
        /// `containerd.services.containers.v1`: container records (the images they use).
        pub mod containers {
            pub mod v1 {
                include!("gen/containerd.services.containers.v1.rs");
            }
        }

        /// `containerd.services.content.v1`: blobs by digest.
        pub mod content {
            pub mod v1 {
                include!("gen/containerd.services.content.v1.rs");
            }
        }

        /// `containerd.services.images.v1`: named refs to a target descriptor.
        pub mod images {
            pub mod v1 {
                include!("gen/containerd.services.images.v1.rs");
            }
        }

        /// `containerd.services.leases.v1`: what holds content against the garbage collector.
        pub mod leases {
            pub mod v1 {
                include!("gen/containerd.services.leases.v1.rs");
            }
        }

        /// `containerd.services.version.v1`: the "does it answer?" probe.
        pub mod version {
            pub mod v1 {
                include!("gen/containerd.services.version.v1.rs");
            }
        }
    }
}

/// The Kubernetes Container Runtime Interface.
#[allow(clippy::all, missing_debug_implementations)]
pub mod cri {
    /// `runtime.v1`.
    pub mod v1 {
        include!("gen/runtime.v1.rs");
    }
}

/// The few BuildKit messages the host agent reads from a Docker build's `moby.buildkit.trace`
/// records (`moby/buildkit` `api/services/control/control.proto`, `StatusResponse`), written by
/// hand with only the fields Kiln uses; prost skips the others. Tags are BuildKit's.
pub mod buildkit {
    /// One progress update of a build: steps (vertexes) started, finished or failed, and their output.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct StatusResponse {
        #[prost(message, repeated, tag = "1")]
        pub vertexes: Vec<Vertex>,
        #[prost(message, repeated, tag = "3")]
        pub logs: Vec<VertexLog>,
    }

    impl StatusResponse {
        /// Decodes one trace record's bytes; `None` when they are not a `StatusResponse`.
        pub fn parse(bytes: &[u8]) -> Option<StatusResponse> {
            <StatusResponse as prost::Message>::decode(bytes).ok()
        }

        pub fn to_bytes(&self) -> Vec<u8> {
            prost::Message::encode_to_vec(self)
        }
    }

    /// One step, named as the user reads it (`[2/3] COPY app /srv`).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Vertex {
        #[prost(string, tag = "1")]
        pub digest: String,
        #[prost(string, tag = "3")]
        pub name: String,
        #[prost(bool, tag = "4")]
        pub cached: bool,
        #[prost(message, optional, tag = "5")]
        pub started: Option<Timestamp>,
        #[prost(message, optional, tag = "6")]
        pub completed: Option<Timestamp>,
        #[prost(string, tag = "7")]
        pub error: String,
    }

    /// `google.protobuf.Timestamp`; Kiln only asks whether it is set.
    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct Timestamp {
        #[prost(int64, tag = "1")]
        pub seconds: i64,
        #[prost(int32, tag = "2")]
        pub nanos: i32,
    }

    /// Output a step wrote (a `RUN`'s stdout or stderr), in arbitrary pieces.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct VertexLog {
        #[prost(string, tag = "1")]
        pub vertex: String,
        #[prost(bytes = "vec", tag = "4")]
        pub msg: Vec<u8>,
    }
}
