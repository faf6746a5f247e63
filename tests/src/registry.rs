//! A real registry (Debian's `docker-registry`, distribution 2.8) on a free loopback port, with a
//! temp storage directory, stopped by its PID when dropped. Its access log (one line per request,
//! on its stdout) is kept in that directory, so a test can count the requests a converge made.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

#[derive(Debug)]
pub struct Registry {
    pub addr: String,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Registry {
    pub fn start() -> Registry {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n",
                dir.path().join("data").display()
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("access.log")).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(log)
            .stderr(Stdio::null())
            .spawn()
            .expect("docker-registry must be installed (scripts/setup installs it)");
        let registry = Registry { addr, child, _dir: dir };
        for _ in 0..100 {
            if registry.get("/v2/").is_some_and(|(status, _)| status == 200) {
                return registry;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("registry at {} did not answer /v2/", registry.addr);
    }

    /// Every request the registry answered so far, as its access log says them: `HEAD /v2/…`.
    /// Its log is written as each request ends, so a test reads it after its client is done.
    pub fn requests(&self) -> Vec<String> {
        let log = std::fs::read_to_string(self._dir.path().join("access.log")).unwrap_or_default();
        // Combined log format: `… "METHOD /path HTTP/1.1" status …`.
        log.lines().filter_map(|l| l.split('"').nth(1)).map(|r| r.trim_end_matches(" HTTP/1.1").to_string()).collect()
    }

    /// The file the registry keeps blob `digest` (`sha256:<hex>`) in — manifests are blobs too:
    /// what a test changes to make the registry serve bytes other than the digest names.
    pub fn blob_file(&self, digest: &str) -> std::path::PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self._dir.path().join(format!("data/docker/registry/v2/blobs/sha256/{}/{hex}/data", &hex[..2]))
    }

    /// A plain HTTP/1.0 GET: (status, body).
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        self.get_with(path, &[])
    }

    pub fn get_with(&self, path: &str, headers: &[(&str, &str)]) -> Option<(u16, String)> {
        self.request("GET", path, headers).map(|(status, _, body)| (status, body))
    }

    /// Deletes `repo:tag` the way an operator would through the registry's API: resolve the tag to
    /// its manifest digest, then delete by digest (the registry refuses a delete by tag).
    pub fn delete_tag(&self, repo: &str, tag: &str) {
        let accept = "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json";
        let (status, head, _) =
            self.request("GET", &format!("/v2/{repo}/manifests/{tag}"), &[("Accept", accept)]).unwrap();
        assert_eq!(status, 200, "{repo}:{tag} is in the registry");
        let digest = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .starts_with("docker-content-digest:")
                    .then(|| l.split_once(':').unwrap().1.trim().to_string())
            })
            .expect("the registry names the manifest's digest");
        let (status, _, body) = self.request("DELETE", &format!("/v2/{repo}/manifests/{digest}"), &[]).unwrap();
        assert_eq!(status, 202, "delete {repo}@{digest}: {body}");
    }

    /// A plain HTTP/1.0 request: (status, headers, body).
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)]) -> Option<(u16, String, String)> {
        let mut stream = TcpStream::connect(&self.addr).ok()?;
        let mut req = format!("{method} {path} HTTP/1.0\r\nHost: {}\r\n", self.addr);
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        stream.write_all(req.as_bytes()).ok()?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw).ok()?;
        let status = raw.split_whitespace().nth(1)?.parse().ok()?;
        let (head, body) = raw.split_once("\r\n\r\n").map(|(h, b)| (h.to_string(), b.to_string())).unwrap_or_default();
        Some((status, head, body))
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
