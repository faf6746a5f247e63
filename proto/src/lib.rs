//! `kiln-proto`: the `kiln.v1` wire protocol. It will hold the generated tonic/prost code and
//! nothing else; it is the only crate that knows prost. The services land with the converge issue;
//! until then this crate is deliberately empty so the workspace layout of DESIGN.md builds.
