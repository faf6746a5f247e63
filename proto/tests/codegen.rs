//! The generated code is committed, so building Kiln needs no protoc. This test regenerates it
//! from the `.proto` files (with a vendored protoc) and fails if the committed copy differs.
//! After editing a proto, run `KILN_REGENERATE=1 cargo test -p kiln-proto --test codegen`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The hand-written subsets of containerd's and the CRI's APIs; Kiln only calls them.
const FOREIGN: &[&str] = &[
    "containerd/types/descriptor.proto",
    "containerd/services/containers/v1/containers.proto",
    "containerd/services/content/v1/content.proto",
    "containerd/services/images/v1/images.proto",
    "containerd/services/leases/v1/leases.proto",
    "containerd/services/version/v1/version.proto",
    "cri/v1/api.proto",
];

#[test]
fn committed_code_matches_the_protos() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    // prost-build finds protoc through PROTOC; the vendored one needs nothing installed, and its
    // own include directory holds the `google/protobuf` imports.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path().unwrap());
    let includes = [root.to_path_buf(), protoc_bin_vendored::include_path().unwrap()];

    tonic_prost_build::configure()
        .out_dir(out.path())
        // The agent RPC is named `Connect`, which would collide with the generated
        // `Client::connect(dst)`; clients are built from a `Channel` instead.
        .build_transport(false)
        .bytes(".kiln.v1.UploadChunk.data")
        .bytes(".kiln.v1.DownloadChunk.data")
        .bytes(".kiln.v1.BlobPiece.data")
        .bytes(".kiln.v1.ContextListChunk.entries")
        .bytes(".kiln.v1.RelayChunk.data")
        .compile_protos(&[root.join("kiln/v1/kiln.proto")], &includes)
        .unwrap();
    // Clients only: Kiln serves neither API. Their channels are unix sockets, made by the agent.
    tonic_prost_build::configure()
        .out_dir(out.path())
        .build_server(false)
        .build_transport(false)
        .compile_protos(&FOREIGN.iter().map(|proto| root.join(proto)).collect::<Vec<_>>(), &includes)
        .unwrap();

    let fresh = read_dir(out.path());
    let committed_dir = root.join("src/gen");
    if std::env::var_os("KILN_REGENERATE").is_some() {
        for name in read_dir(&committed_dir).keys() {
            std::fs::remove_file(committed_dir.join(name)).unwrap();
        }
        for (name, code) in &fresh {
            std::fs::write(committed_dir.join(name), code).unwrap();
        }
        return;
    }
    let committed = read_dir(&committed_dir);
    let names: BTreeSet<&String> = fresh.keys().chain(committed.keys()).collect();
    let stale: Vec<&String> = names.into_iter().filter(|name| fresh.get(*name) != committed.get(*name)).collect();
    assert!(
        stale.is_empty(),
        "proto/src/gen/ is stale ({stale:?}) — run `KILN_REGENERATE=1 cargo test -p kiln-proto --test codegen` and commit it"
    );
}

/// Every `.rs` file in `dir`, by name.
fn read_dir(dir: &Path) -> BTreeMap<String, String> {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|ext| ext == "rs") {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            files.insert(name, std::fs::read_to_string(&path).unwrap());
        }
    }
    files
}
