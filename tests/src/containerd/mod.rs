//! One real containerd per simulated node, for the node store's adapter tests and the end-to-end
//! node deliveries, and test images built `FROM scratch` on the machine's real Docker daemon and
//! exported with `docker save`.
//!
//! Each [`Containerd`] has its own root, state and sockets under a temp dir and is killed by its
//! PID when dropped; each [`SavedImage`] has a unique name and is removed from Docker when dropped.

pub mod hub;

use bytes::Bytes;
use kiln_agent::node::{ContainerdStore, CriNodeStore, ImportBody, K8S_NAMESPACE};
use kiln_proto::containerd::services::containers::v1::container::Runtime;
use kiln_proto::containerd::services::containers::v1::containers_client::ContainersClient;
use kiln_proto::containerd::services::containers::v1::{Container, CreateContainerRequest};
use kiln_proto::containerd::services::content::v1::content_client::ContentClient;
use kiln_proto::containerd::services::content::v1::ListContentRequest;
use kiln_proto::containerd::services::images::v1::images_client::ImagesClient;
use kiln_proto::containerd::services::images::v1::{CreateImageRequest, GetImageRequest, Image, ListImagesRequest};
use kiln_proto::containerd::types::Descriptor;
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
        kiln_agent::node::unix_channel(&self.socket).await.unwrap()
    }

    /// Every blob digest the namespace's content store holds.
    pub async fn content(&self) -> BTreeSet<String> {
        let mut client = ContentClient::new(self.channel().await);
        let mut answers = client.list(ns(ListContentRequest {})).await.unwrap().into_inner();
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

    /// Creates image record `name` on `target`, as `ctr images tag` or kind's import would, and
    /// waits for the CRI plugin to settle.
    pub async fn create_ref(&self, name: &str, target: Descriptor) {
        let mut client = ImagesClient::new(self.channel().await);
        let image = Image { name: name.to_string(), target: Some(target), ..Default::default() };
        client.create(ns(CreateImageRequest { image: Some(image) })).await.unwrap();
        self.settle().await;
    }

    /// Waits until the CRI plugin has handled every ref in the namespace: it marks each with its
    /// `managed` label (adding the `sha256:<id>` ref as it goes) by a create-then-update that would
    /// re-create a ref a test removed in between. Real nodes have the same window; the tests wait it
    /// out so that each removal they assert on is the only one in flight.
    pub async fn settle(&self) {
        let mut client = ImagesClient::new(self.channel().await);
        let mut images = Vec::new();
        for _ in 0..250 {
            images = client.list(ns(ListImagesRequest {})).await.unwrap().into_inner().images;
            if images.iter().all(|i| i.labels.get("io.cri-containerd.image").map(String::as_str) == Some("managed")) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the CRI plugin never marked every ref: {images:#?}");
    }

    /// A container record using `image` — no task, no snapshot: only what the Containers service keeps.
    pub async fn create_container(&self, id: &str, image: &str) {
        let mut client = ContainersClient::new(self.channel().await);
        let mut container = Container {
            id: id.to_string(),
            image: image.to_string(),
            runtime: Some(Runtime { name: "io.containerd.runc.v2".to_string() }),
            spec: Some(Default::default()),
        };
        if let Some(spec) = container.spec.as_mut() {
            spec.type_url = "types.containerd.io/opencontainers/runtime-spec/1/Spec".to_string();
            spec.value = b"{}".to_vec();
        }
        client.create(ns(CreateContainerRequest { container: Some(container) })).await.unwrap();
    }

    /// `ctr -n k8s.io images import --all-platforms --digests -`, exactly as `kind load` runs it on
    /// a node: the named ref plus an `import-<date>@sha256:<manifest>` ref.
    pub async fn ctr_import(&self, archive: &[u8]) {
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
        self.settle().await;
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

impl SavedImage {
    /// The archive with one byte of its first layer changed: same paths, same sizes, wrong digest.
    pub fn tampered_layer(&self) -> Vec<u8> {
        let mut out = tar::Builder::new(Vec::new());
        let mut tampered = false;
        for entry in tar::Archive::new(self.archive.as_slice()).entries().unwrap() {
            let mut entry = entry.unwrap();
            let header = entry.header().clone();
            let mut data = Vec::new();
            entry.read_to_end(&mut data).unwrap();
            let is_layer = entry.path().unwrap().to_string_lossy().ends_with("/layer.tar");
            if is_layer && !tampered && data.len() > 1024 {
                let middle = data.len() / 2;
                data[middle] ^= 0xff;
                tampered = true;
            }
            out.append(&header, data.as_slice()).unwrap();
        }
        assert!(tampered, "the archive has a layer to tamper with");
        out.into_inner().unwrap()
    }
}

/// A hand-made image archive in one of the two layouts `docker save` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Synthetic {
    /// Docker ≤ 24: `<v1id>/layer.tar`, `<config hex>.json`; a layer that occurs twice is written
    /// once and the second occurrence is a symlink to it, as Docker does.
    LegacyWithLink,
    /// Docker ≥ 25: every layer and the config under `blobs/sha256/`, `manifest.json` first.
    Oci,
}

#[derive(Debug)]
pub struct SyntheticArchive {
    pub bytes: Vec<u8>,
    pub id: String,
    pub layer_digests: BTreeSet<String>,
    /// Config plus every layer occurrence, as the import and a listing count them.
    pub image_bytes: u64,
}

pub fn synthetic_archive(layout: Synthetic) -> SyntheticArchive {
    use sha2::Digest;
    let hex = |bytes: &[u8]| format!("{:x}", sha2::Sha256::digest(bytes));
    let layer = |name: &str, body: &[u8]| {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(body.len() as u64);
        header.set_mode(0o644);
        builder.append_data(&mut header, name, body).unwrap();
        builder.into_inner().unwrap()
    };
    let a = layer("a.txt", format!("a {:016x}", fastrand::u64(..)).as_bytes());
    let b = layer("b.txt", &vec![7u8; 300 << 10]);
    let (da, db) = (hex(&a), hex(&b));
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Labels": { "kiln.dev/kind": "image", "kiln.dev/farm": "node-tests" } },
        "rootfs": { "type": "layers", "diff_ids": match layout {
            Synthetic::LegacyWithLink => vec![format!("sha256:{da}"), format!("sha256:{db}"), format!("sha256:{da}")],
            Synthetic::Oci => vec![format!("sha256:{da}"), format!("sha256:{db}")],
        } },
    });
    let config = serde_json::to_vec(&config).unwrap();
    let config_hex = hex(&config);

    let mut out = tar::Builder::new(Vec::new());
    let file = |out: &mut tar::Builder<Vec<u8>>, path: &str, body: &[u8]| {
        let mut header = tar::Header::new_ustar();
        header.set_size(body.len() as u64);
        header.set_mode(0o644);
        out.append_data(&mut header, path, body).unwrap();
    };
    let image_bytes = match layout {
        Synthetic::LegacyWithLink => {
            let ids = ["1".repeat(64), "2".repeat(64), "3".repeat(64)];
            file(&mut out, &format!("{}/layer.tar", ids[0]), &a);
            file(&mut out, &format!("{}/layer.tar", ids[1]), &b);
            let mut link = tar::Header::new_ustar();
            link.set_entry_type(tar::EntryType::Symlink);
            link.set_size(0);
            out.append_link(&mut link, format!("{}/layer.tar", ids[2]), format!("../{}/layer.tar", ids[0])).unwrap();
            file(&mut out, &format!("{config_hex}.json"), &config);
            let manifest = serde_json::json!([{
                "Config": format!("{config_hex}.json"),
                "RepoTags": ["kiln-test/synthetic:1"],
                "Layers": ids.iter().map(|id| format!("{id}/layer.tar")).collect::<Vec<_>>(),
            }]);
            file(&mut out, "manifest.json", &serde_json::to_vec(&manifest).unwrap());
            config.len() + 2 * a.len() + b.len()
        }
        Synthetic::Oci => {
            let manifest = serde_json::json!([{
                "Config": format!("blobs/sha256/{config_hex}"),
                "RepoTags": ["kiln-test/synthetic:1"],
                "Layers": [format!("blobs/sha256/{da}"), format!("blobs/sha256/{db}")],
            }]);
            file(&mut out, "manifest.json", &serde_json::to_vec(&manifest).unwrap());
            file(&mut out, "oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
            file(&mut out, &format!("blobs/sha256/{da}"), &a);
            file(&mut out, &format!("blobs/sha256/{db}"), &b);
            file(&mut out, &format!("blobs/sha256/{config_hex}"), &config);
            file(&mut out, "index.json", br#"{"schemaVersion":2,"manifests":[]}"#);
            config.len() + a.len() + b.len()
        }
    };
    SyntheticArchive {
        bytes: out.into_inner().unwrap(),
        id: format!("sha256:{config_hex}"),
        layer_digests: [format!("sha256:{da}"), format!("sha256:{db}")].into(),
        image_bytes: image_bytes as u64,
    }
}
