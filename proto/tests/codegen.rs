//! The generated code is committed, so building Kiln needs no protoc. This test regenerates it
//! from `kiln/v1/kiln.proto` (with a vendored protoc) and fails if the committed copy differs.
//! After editing the proto, run `KILN_REGENERATE=1 cargo test -p kiln-proto --test codegen`.

use std::path::Path;

#[test]
fn committed_code_matches_the_proto() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    let protoc = protoc_bin_vendored::protoc_bin_path().unwrap();
    // prost-build finds protoc through PROTOC; the vendored one needs nothing installed.
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure()
        .out_dir(out.path())
        // The agent RPC is named `Connect`, which would collide with the generated
        // `Client::connect(dst)`; clients are built from a `Channel` instead.
        .build_transport(false)
        .bytes(".kiln.v1.UploadChunk.data")
        .bytes(".kiln.v1.DownloadChunk.data")
        .bytes(".kiln.v1.RelayChunk.data")
        .compile_protos(&[root.join("kiln/v1/kiln.proto")], &[root.to_path_buf()])
        .unwrap();
    let fresh = std::fs::read_to_string(out.path().join("kiln.v1.rs")).unwrap();
    let committed_path = root.join("src/gen/kiln.v1.rs");
    if std::env::var_os("KILN_REGENERATE").is_some() {
        std::fs::write(&committed_path, &fresh).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    assert!(
        committed == fresh,
        "proto/src/gen/kiln.v1.rs is stale — run `KILN_REGENERATE=1 cargo test -p kiln-proto --test codegen` and commit it"
    );
}
