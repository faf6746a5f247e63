//! Fake kind nodes: no kind node image can be pulled here, so the harness builds one from the
//! machine's Debian `containerd` package — a rootfs holding `/usr/bin/containerd`, `/usr/bin/ctr`
//! and the shared libraries `ldd` lists for them, a static busybox, plus a containerd config —
//! `docker import`s it,
//! and runs it with CAP_SYS_ADMIN (kind runs nodes `--privileged`, which this machine's
//! runtime refuses; overlayfs needs only that capability), labeled as kind labels its nodes, with command `containerd`.
//!
//! containerd's root is a tmpfs inside the container, so its overlayfs snapshotter never stacks
//! overlay on the daemon's own overlay storage; the import kind runs (`--snapshotter=overlayfs`)
//! then works as on a real node. Each [`KindNode`] is removed (`docker rm -f`) when dropped.

use crate::fixture::{unique, write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

const NODE_IMAGE: &str = "kiln-test/kind-node:containerd-2";
const CONFIG: &str = "version = 2\nroot = \"/var/lib/containerd\"\nstate = \"/run/containerd\"\n\
[grpc]\n  address = \"/run/containerd/containerd.sock\"\n\
[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"overlayfs\"\n";

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The node image, built once per test process (and reused across processes by its tag).
pub fn node_image() -> &'static str {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let exists = Command::new("docker").args(["image", "inspect", NODE_IMAGE]).output().unwrap();
        if exists.status.success() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("rootfs");
        for sub in ["etc/containerd", "run", "tmp", "var/lib/containerd", "usr/bin"] {
            std::fs::create_dir_all(root.join(sub)).unwrap();
        }
        std::fs::write(root.join("etc/containerd/config.toml"), CONFIG).unwrap();
        std::fs::write(root.join("etc/containerd/hidden.toml"), CONFIG.replace("containerd.sock", "real.sock"))
            .unwrap();
        // busybox (static: no libraries) lets a test reshape a node's /run (see `start_hidden`).
        copy_into(&root, Path::new("/bin/busybox"));
        for bin in ["/usr/bin/containerd", "/usr/bin/ctr"] {
            copy_into(&root, Path::new(bin));
            for line in run(Command::new("ldd").arg(bin)).lines() {
                // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` or `/lib64/ld-linux-x86-64.so.2 (0x…)`
                let path = line.split("=>").last().unwrap().split_whitespace().next().unwrap_or("");
                if path.starts_with('/') {
                    copy_into(&root, Path::new(path));
                }
            }
        }
        let tarball = dir.path().join("rootfs.tar");
        run(Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&tarball).arg("."));
        run(Command::new("docker").args(["import"]).arg(&tarball).arg(NODE_IMAGE));
    });
    NODE_IMAGE
}

fn copy_into(root: &Path, file: &Path) {
    let dest = root.join(file.strip_prefix("/").unwrap());
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    std::fs::copy(file, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", file.display()));
}

/// One fake kind node container of a cluster.
#[derive(Debug)]
pub struct KindNode {
    pub name: String,
}

impl KindNode {
    /// Starts node `name` of kind cluster `cluster` and waits until its containerd answers.
    pub fn start(cluster: &str, name: &str) -> KindNode {
        KindNode::start_at(cluster, name, "/etc/containerd/config.toml")
    }

    /// A node whose containerd the host agent cannot reach through `/proc/<pid>/root`, as when the
    /// agent runs in another PID namespace: containerd listens on `real.sock` and the usual path is an
    /// absolute symlink to it, which resolves inside the container (for `docker exec ctr`) but not
    /// through `/proc` from the host.
    pub fn start_hidden(cluster: &str, name: &str) -> KindNode {
        let node = KindNode::start_at(cluster, name, "/etc/containerd/hidden.toml");
        let link =
            ["exec", name, "/bin/busybox", "ln", "-s", "/run/containerd/real.sock", "/run/containerd/containerd.sock"];
        run(Command::new("docker").args(link));
        node.wait_for_ctr();
        node
    }

    fn start_at(cluster: &str, name: &str, config: &str) -> KindNode {
        let image = node_image();
        run(Command::new("docker").args([
            "run",
            "-d",
            // `--privileged` is refused in this environment (runc: "unable to apply caps"); the
            // overlayfs mounts of an import need CAP_SYS_ADMIN only.
            "--cap-add",
            "SYS_ADMIN",
            "--name",
            name,
            "--label",
            &format!("io.x-k8s.kind.cluster={cluster}"),
            "--label",
            "io.x-k8s.kind.role=control-plane",
            "--tmpfs",
            "/var/lib/containerd:rw,exec",
            "--tmpfs",
            "/run:rw,exec",
            image,
            "/usr/bin/containerd",
            "--config",
            config,
        ]));
        let node = KindNode { name: name.to_string() };
        if config.ends_with("hidden.toml") {
            // Its socket is not where `ctr` looks until `start_hidden` links it; wait for the file.
            for _ in 0..100 {
                let probe = ["exec", name, "/bin/busybox", "test", "-S", "/run/containerd/real.sock"];
                if Command::new("docker").args(probe).output().is_ok_and(|o| o.status.success()) {
                    return node;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        } else {
            node.wait_for_ctr();
        }
        node
    }

    fn wait_for_ctr(&self) {
        for _ in 0..100 {
            let probe = ["exec", &self.name, "ctr", "version"];
            if Command::new("docker").args(probe).output().is_ok_and(|o| o.status.success()) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let logs = Command::new("docker").args(["logs", &self.name]).output().unwrap();
        panic!("containerd in kind node {} never answered: {}", self.name, String::from_utf8_lossy(&logs.stderr));
    }

    /// `ctr -n k8s.io <args>` in the node, its stdout by line.
    pub fn ctr(&self, args: &[&str]) -> Vec<String> {
        run(Command::new("docker").args(["exec", &self.name, "ctr", "-n", "k8s.io"]).args(args))
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// `ctr -n k8s.io images ls -q` in the node: every ref its containerd holds.
    pub fn refs(&self) -> Vec<String> {
        self.ctr(&["images", "ls", "-q"])
    }

    /// Every blob digest the node's containerd holds.
    pub fn content(&self) -> Vec<String> {
        self.ctr(&["content", "ls", "-q"])
    }

    /// `docker save` of `reference` on the host, imported into the node as `kind load` does.
    pub fn load(&self, reference: &str) {
        let save = format!(
            "docker save {reference} | docker exec -i {} ctr -n k8s.io images import --digests --snapshotter=overlayfs -",
            self.name
        );
        run(Command::new("sh").args(["-c", &save]));
    }
}

impl Drop for KindNode {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rm", "-f", "-v", &self.name]).output();
    }
}

/// Writes instance `name` under `into`: one image, `web`, delivered to kind cluster `cluster`, with
/// content no other test builds.
pub fn instance(into: &Path, name: &str, cluster: &str) -> PathBuf {
    let dir = into.join(name);
    write(
        &dir,
        "kiln.toml",
        &format!("instance = \"{name}\"\n\n[target]\nkind = \"kind\"\ncluster = \"{cluster}\"\n\n[built.web]\ncontext = \"web\"\n"),
    );
    write(&dir, "web/Dockerfile", "FROM scratch\nCOPY index.html /srv/index.html\n");
    write(&dir, "web/index.html", &format!("<p>{}</p>\n", unique("kind")));
    dir
}
