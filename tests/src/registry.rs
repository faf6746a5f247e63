//! A real registry (Debian's `docker-registry`, distribution 2.8) on a free loopback port, with a
//! temp storage directory, stopped by its PID when dropped.

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
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
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
