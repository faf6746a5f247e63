//! Harness for the node store's tests: one real containerd per simulated node, and test images
//! built `FROM scratch` on the machine's real Docker daemon and exported with `docker save`.
//!
//! Each [`Containerd`] has its own root, state and sockets under a temp dir and is killed by its
//! PID when dropped; each [`SavedImage`] has a unique name and is removed from Docker when dropped.

#![allow(dead_code)] // each test uses a different part of the harness

use bytes::Bytes;
use containerd_client::services::v1::containers_client::ContainersClient;
use containerd_client::services::v1::content_client::ContentClient;
use containerd_client::services::v1::images_client::ImagesClient;
use containerd_client::services::v1::{
    CreateContainerRequest, CreateImageRequest, GetImageRequest, Image, ListContentRequest,
};
use containerd_client::types::Descriptor;
use kiln_agent::node::{ContainerdStore, CriNodeStore, ImportBody, K8S_NAMESPACE};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tempfile::TempDir;
use tonic::transport::Channel;
use tonic::Request;

/// One containerd, as on one node: v2 config, CRI plugin on overlayfs, everything under a temp dir.
#[derive(Debug)]
pub struct Containerd {
    child: Child,
    pub socket: PathBuf,
    dir: TempDir,
}

impl Containerd {
    pub async fn start() -> Containerd {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let socket = root.join("containerd.sock");
        let config = root.join("config.toml");
        fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{root}/root\"\nstate = \"{root}/state\"\n\
                 [grpc]\n  address = \"{sock}\"\n[ttrpc]\n  address = \"{sock}.ttrpc\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"overlayfs\"\n",
                root = root.display(),
                sock = socket.display(),
            ),
        )
        .unwrap();
        let log = File::create(root.join("containerd.log")).unwrap();
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("`containerd` is missing — run scripts/setup (apt-get install containerd)");
        let node = Containerd { child, socket, dir };
        for _ in 0..200 {
            if ContainerdStore::connect(&node.socket, K8S_NAMESPACE).await.is_ok() {
                return node;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("containerd on {} never answered; its log: {}", node.socket.display(), node.log());
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    pub async fn store(&self) -> ContainerdStore {
        ContainerdStore::connect(&self.socket, K8S_NAMESPACE).await.unwrap()
    }

    pub async fn cri(&self) -> CriNodeStore {
        CriNodeStore::connect(&self.socket).await.unwrap()
    }

    pub async fn channel(&self) -> Channel {
        containerd_client::connect(&self.socket).await.unwrap()
    }

    /// Every blob digest the namespace's content store holds.
    pub async fn content(&self) -> BTreeSet<String> {
        let mut client = ContentClient::new(self.channel().await);
        let mut answers = client.list(ns(ListContentRequest { filters: vec![] })).await.unwrap().into_inner();
        let mut digests = BTreeSet::new();
        while let Some(answer) = answers.message().await.unwrap() {
            digests.extend(answer.info.into_iter().map(|info| info.digest));
        }
        digests
    }

    /// The target of image record `name`.
    pub async fn target(&self, name: &str) -> Descriptor {
        let mut client = ImagesClient::new(self.channel().await);
        let image = client.get(ns(GetImageRequest { name: name.to_string() })).await.unwrap().into_inner();
        image.image.unwrap().target.unwrap()
    }

    /// Creates image record `name` on `target`, as `ctr images tag` or kind's import would.
    pub async fn create_ref(&self, name: &str, target: Descriptor) {
        let mut client = ImagesClient::new(self.channel().await);
        let image = Image { name: name.to_string(), target: Some(target), ..Default::default() };
        client.create(ns(CreateImageRequest { image: Some(image), ..Default::default() })).await.unwrap();
    }

    /// A container record using `image` — no task, no snapshot: only what the Containers service keeps.
    pub async fn create_container(&self, id: &str, image: &str) {
        let mut client = ContainersClient::new(self.channel().await);
        let mut container = containerd_client::services::v1::Container {
            id: id.to_string(),
            image: image.to_string(),
            runtime: Some(Default::default()),
            spec: Some(Default::default()),
            ..Default::default()
        };
        if let Some(runtime) = container.runtime.as_mut() {
            runtime.name = "io.containerd.runc.v2".to_string();
        }
        if let Some(spec) = container.spec.as_mut() {
            spec.type_url = "types.containerd.io/opencontainers/runtime-spec/1/Spec".to_string();
            spec.value = b"{}".to_vec();
        }
        client.create(ns(CreateContainerRequest { container: Some(container) })).await.unwrap();
    }

    /// `ctr -n k8s.io images import --all-platforms --digests -`, exactly as `kind load` runs it on
    /// a node: the named ref plus an `import-<date>@sha256:<manifest>` ref.
    pub fn ctr_import(&self, archive: &[u8]) {
        use std::io::Write;
        let mut child = Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(["--namespace", K8S_NAMESPACE, "images", "import", "--all-platforms", "--digests", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("`ctr` is missing — it ships with containerd");
        child.stdin.take().unwrap().write_all(archive).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "ctr import: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `message` in namespace `k8s.io`.
pub fn ns<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("containerd-namespace", K8S_NAMESPACE.parse().unwrap());
    request
}

/// A test image on the Docker daemon and its `docker save` archive.
#[derive(Debug)]
pub struct SavedImage {
    /// As Docker names it (`kiln-test/node-…:1`).
    pub tag: String,
    /// As containerd names it (`docker.io/kiln-test/node-…:1`).
    pub qualified: String,
    pub id: String,
    pub archive: Vec<u8>,
    pub labels: BTreeMap<String, String>,
}

impl SavedImage {
    /// Builds `FROM scratch` with the classic builder: a layer of `big` random bytes (several import
    /// chunks), a small layer, and Kiln's labels; then `docker save`s it.
    pub fn build(big: usize) -> SavedImage {
        let dir = tempfile::tempdir().unwrap();
        let noise: Vec<u8> = (0..big).map(|_| fastrand::u8(..)).collect();
        fs::write(dir.path().join("big.bin"), noise).unwrap();
        fs::write(dir.path().join("small.txt"), format!("{:016x}\n", fastrand::u64(..))).unwrap();
        let labels = BTreeMap::from([
            ("kiln.dev/kind".to_string(), "image".to_string()),
            ("kiln.dev/farm".to_string(), "node-tests".to_string()),
            ("kiln.dev/instance".to_string(), "tests".to_string()),
        ]);
        let mut dockerfile = "FROM scratch\nCOPY big.bin /big.bin\nCOPY small.txt /small.txt\nLABEL".to_string();
        for (key, value) in &labels {
            dockerfile.push_str(&format!(" {key}={value}"));
        }
        fs::write(dir.path().join("Dockerfile"), dockerfile + "\n").unwrap();
        let tag = format!("kiln-test/node-{:016x}:1", fastrand::u64(..));
        let built = Command::new("docker")
            .args(["build", "-q", "-t", &tag])
            .arg(dir.path())
            .env("DOCKER_BUILDKIT", "0")
            .output()
            .expect("these tests need the docker CLI and daemon");
        assert!(built.status.success(), "docker build: {}", String::from_utf8_lossy(&built.stderr));
        let id = docker(&["inspect", "-f", "{{.Id}}", &tag]).trim().to_string();
        let saved = Command::new("docker").args(["save", &tag]).output().unwrap();
        assert!(saved.status.success(), "docker save: {}", String::from_utf8_lossy(&saved.stderr));
        let qualified = format!("docker.io/{tag}");
        SavedImage { tag, qualified, id, archive: saved.stdout, labels }
    }

    /// The archive as a stream of small chunks, the way it arrives over the network.
    pub fn body(&self) -> ImportBody {
        body(self.archive.clone())
    }

    /// Config plus layer bytes, read from the archive itself.
    pub fn bytes(&self) -> u64 {
        let mut total = 0;
        for entry in tar::Archive::new(self.archive.as_slice()).entries().unwrap() {
            let entry = entry.unwrap();
            let path = entry.path().unwrap().to_string_lossy().into_owned();
            let is_config = path == format!("{}.json", self.id.trim_start_matches("sha256:"));
            if (path.ends_with("/layer.tar") && entry.header().entry_type().is_file()) || is_config {
                total += entry.size();
            }
        }
        total
    }

    /// The archive's layer tars' digests, in archive order.
    pub fn layer_digests(&self) -> BTreeSet<String> {
        use sha2::Digest;
        let mut digests = BTreeSet::new();
        for entry in tar::Archive::new(self.archive.as_slice()).entries().unwrap() {
            let mut entry = entry.unwrap();
            if entry.path().unwrap().to_string_lossy().ends_with("/layer.tar") {
                let mut bytes = Vec::new();
                entry.read_to_end(&mut bytes).unwrap();
                digests.insert(format!("sha256:{:x}", sha2::Sha256::digest(&bytes)));
            }
        }
        digests
    }
}

impl Drop for SavedImage {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rmi", &self.tag]).output();
    }
}

/// `archive` in 64 KiB chunks.
pub fn body(archive: Vec<u8>) -> ImportBody {
    let chunks: Vec<std::io::Result<Bytes>> =
        archive.chunks(64 << 10).map(|chunk| Ok(Bytes::copy_from_slice(chunk))).collect();
    Box::pin(futures_util::stream::iter(chunks))
}

fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().unwrap();
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}
