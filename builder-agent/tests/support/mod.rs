//! Harness for the host store's tests against the machine's real Docker daemon and a real
//! registry (`docker-registry`, started here on a free loopback port).
//!
//! Every test names its images with a random suffix so tests run in parallel without meeting, and
//! holds a [`Cleanup`] that removes exactly the tags it created, even when the test fails.

#![allow(dead_code)] // each test file uses a different part of the harness

use bollard::Docker;
use futures_util::TryStreamExt;
use kiln_agent::host::{BuildSpec, Built, DockerStore, HostError, HostStore};
use kiln_core::archive::pack;
use kiln_core::digest::{digest_dir, TreeDigest, WalkOptions};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;
use tempfile::TempDir;

pub async fn store() -> DockerStore {
    DockerStore::connect_local()
        .await
        .expect("these tests need the Docker daemon (DOCKER_HOST or /var/run/docker.sock)")
}

/// A fresh repository name under `kiln-test/`, unique to this call.
pub fn unique(name: &str) -> String {
    format!("kiln-test/{name}-{:016x}", fastrand::u64(..))
}

/// Removes the tags a test created when it ends, pass or fail.
#[derive(Debug, Default)]
pub struct Cleanup {
    tags: Mutex<Vec<String>>,
}

impl Cleanup {
    /// Registers `tag` for removal and returns it.
    pub fn tag(&self, tag: impl Into<String>) -> String {
        let tag = tag.into();
        self.tags.lock().unwrap().push(tag.clone());
        tag
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let tags = std::mem::take(&mut *self.tags.lock().unwrap());
        if tags.is_empty() {
            return;
        }
        // Drop runs inside the test's runtime, which cannot block on itself: clean up from a
        // thread with a runtime of its own.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(async {
                let Ok(store) = DockerStore::connect_local().await else { return };
                for tag in tags {
                    let _ = store.remove_tag(&tag).await;
                }
            });
        })
        .join()
        .unwrap();
    }
}

/// A build context on disk and its canonical archive.
#[derive(Debug)]
pub struct Context {
    _dir: TempDir,
    pub root: PathBuf,
    pub archive: PathBuf,
    pub digest: TreeDigest,
}

/// Writes `files` (path → contents) into a fresh context and packs it as the CLI would.
pub fn context(files: &[(&str, &str)]) -> Context {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ctx");
    fs::create_dir(&root).unwrap();
    for (path, body) in files {
        let path = root.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, body).unwrap();
    }
    let (tree, digest) = digest_dir(&root, &WalkOptions::default()).unwrap();
    let archive = dir.path().join("ctx.tar");
    let packed = pack(&tree, File::create(&archive).unwrap()).unwrap();
    assert_eq!(packed.digest, digest);
    Context { _dir: dir, root, archive, digest }
}

/// A spec building `Dockerfile` from the context to `tag`, nothing else set.
pub fn spec(tag: &str) -> BuildSpec {
    BuildSpec { tag: tag.to_string(), dockerfile: "Dockerfile".to_string(), ..BuildSpec::default() }
}

/// The four labels a Kiln build stamps.
pub fn kiln_labels(farm: &str, context: &TreeDigest) -> BTreeMap<String, String> {
    use kiln_core::sweep::{LABEL_CONTEXT, LABEL_FARM, LABEL_INSTANCE, LABEL_KIND};
    BTreeMap::from([
        (LABEL_KIND.to_string(), "image".to_string()),
        (LABEL_INSTANCE.to_string(), "tests".to_string()),
        (LABEL_FARM.to_string(), farm.to_string()),
        (LABEL_CONTEXT.to_string(), context.to_string()),
    ])
}

/// Builds and collects the log lines the build streamed.
///
/// Once more when the classic builder fails with "unable to find image": its cache probe reads every
/// image of the same parent (for `FROM scratch`, every parentless image on the daemon) and fails
/// when a parallel test removes one of them mid-probe — a race between tests, not the build under
/// test. The converge engine retries the same way.
pub async fn build(store: &DockerStore, archive: &Path, spec: &BuildSpec) -> (Result<Built, HostError>, Vec<String>) {
    let (built, log) = build_once(store, archive, spec).await;
    match &built {
        Err(HostError::BuildFailed { step, .. }) if step.contains("unable to find image") => {
            build_once(store, archive, spec).await
        }
        _ => (built, log),
    }
}

async fn build_once(store: &DockerStore, archive: &Path, spec: &BuildSpec) -> (Result<Built, HostError>, Vec<String>) {
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    let collector = tokio::spawn(async move {
        let mut lines = Vec::new();
        while let Some(line) = rx.recv().await {
            lines.push(line);
        }
        lines
    });
    let built = store.build(archive, spec, tx).await;
    (built, collector.await.unwrap())
}

/// A bollard client of the test's own, for what the store does not offer (tagging, exporting).
pub async fn docker() -> Docker {
    Docker::connect_with_local_defaults().unwrap().negotiate_version().await.unwrap()
}

/// Every path in the image's filesystem (all layers), as `docker save` exports it.
pub async fn image_files(reference: &str) -> BTreeSet<String> {
    let saved: Vec<bytes::Bytes> = docker().await.export_image(reference).try_collect().await.unwrap();
    let saved = saved.concat();
    let mut files = BTreeSet::new();
    let mut outer = tar::Archive::new(saved.as_slice());
    for entry in outer.entries().unwrap() {
        let mut entry = entry.unwrap();
        if !entry.path_bytes().ends_with(b"layer.tar") {
            continue;
        }
        let mut layer = Vec::new();
        entry.read_to_end(&mut layer).unwrap();
        for inner in tar::Archive::new(layer.as_slice()).entries().unwrap() {
            let inner = inner.unwrap();
            files.insert(String::from_utf8_lossy(&inner.path_bytes()).trim_end_matches('/').to_string());
        }
    }
    files
}

/// A `docker-registry` (Docker's distribution registry) on a free 127.0.0.1 port with its storage
/// in a temp dir; killed by its PID when dropped.
#[derive(Debug)]
pub struct Registry {
    child: Child,
    pub addr: String,
    _dir: TempDir,
}

impl Registry {
    pub fn start() -> Registry {
        let dir = tempfile::tempdir().unwrap();
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let config = dir.path().join("config.yml");
        fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
                dir.path().join("storage").display()
            ),
        )
        .unwrap();
        let log = File::create(dir.path().join("registry.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("`docker-registry` is missing — run scripts/setup (apt-get install docker-registry)");
        let registry = Registry { child, addr, _dir: dir };
        for _ in 0..200 {
            if registry.get("/v2/", &[]).is_some_and(|r| r.status == 200) {
                return registry;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("docker-registry on {} never answered GET /v2/", registry.addr);
    }

    /// A plain HTTP/1.0 GET; `None` when nothing listens yet.
    pub fn get(&self, path: &str, headers: &[(&str, &str)]) -> Option<Response> {
        let mut stream = TcpStream::connect(&self.addr).ok()?;
        let mut request = format!("GET {path} HTTP/1.0\r\nHost: {}\r\n", self.addr);
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        stream.write_all(request.as_bytes()).ok()?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).ok()?;
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let mut lines = head.lines();
        let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
        let headers = lines
            .filter_map(|line| line.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        Some(Response { status, headers, body: raw[split + 4..].to_vec() })
    }

    /// GETs `path` and parses a 200 answer as JSON.
    pub fn get_json(&self, path: &str, headers: &[(&str, &str)]) -> (Response, serde_json::Value) {
        let response =
            self.get(path, headers).unwrap_or_else(|| panic!("registry {} did not answer {path}", self.addr));
        assert_eq!(response.status, 200, "GET {path}: {}", String::from_utf8_lossy(&response.body));
        let json = serde_json::from_slice(&response.body).unwrap();
        (response, json)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}
