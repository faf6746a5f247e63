//! Delivery to cluster nodes: the real coordinator, host agent and node agents in-process (the
//! `kiln-e2e` harness), one real containerd per simulated node (`nodes`), fake kind node containers
//! (`kind`, built from Debian's containerd like the e2e tests').
//!
//! A delivery's time is read from the converge's own events: from `Built` (the host holds the
//! image) to `Delivered` (every node holds it) — a forced converge rebuilds from the build cache,
//! so the build itself is not in the figure. Two cases:
//! - an image every node already holds (goal ≤ 50 ms; `kind load` re-imports, ~2.5 s, kind#2413);
//! - a large image none holds, vs `docker save REF | ctr -a SOCK -n k8s.io images import
//!   --all-platforms --digests -` run per node against the same containerd instances.

use crate::util::{self, Contestant};
use anyhow::{bail, Context, Result};
use kiln_e2e::fixture::{reference, write};
use kiln_e2e::kind::KindNode;
use kiln_e2e::wire::{succeeded, up};
use kiln_e2e::Farm;
use kiln_proto::v1::converge_event::Kind;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Simulated nodes (containerd instances) and kind node containers.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Size of the large image, in MB.
    #[arg(long, default_value_t = 200)]
    mb: usize,
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Only the held-image case.
    #[arg(long)]
    skip_large: bool,
}

/// One containerd, as on one node; killed by its PID when dropped.
struct Containerd {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Containerd {
    fn start() -> Result<Containerd> {
        let dir = tempfile::tempdir()?;
        let root = dir.path();
        let socket = root.join("containerd.sock");
        let config = root.join("config.toml");
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{r}/root\"\nstate = \"{r}/state\"\n[grpc]\n  address = \"{s}\"\n[ttrpc]\n  address = \"{s}.ttrpc\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"overlayfs\"\n",
                r = root.display(),
                s = socket.display()
            ),
        )?;
        let log = std::fs::File::create(root.join("containerd.log"))?;
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("`containerd` is missing — run scripts/setup")?;
        let node = Containerd { child, socket, _dir: dir };
        for _ in 0..200 {
            if node.ctr(&["version"]).is_ok() {
                return Ok(node);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("containerd on {} never answered", node.socket.display())
    }

    fn ctr(&self, args: &[&str]) -> Result<String> {
        let out = Command::new("ctr").arg("-a").arg(&self.socket).args(["-n", "k8s.io"]).args(args).output()?;
        if !out.status.success() {
            bail!("ctr {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Removes every ref, so content goes too: the node holds nothing.
    fn clear(&self) -> Result<()> {
        let refs = self.ctr(&["images", "ls", "-q"])?;
        let refs: Vec<&str> = refs.lines().collect();
        if !refs.is_empty() {
            let mut args = vec!["images", "rm", "--sync"];
            args.extend(refs);
            self.ctr(&args)?;
        }
        Ok(())
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn instance(into: &Path, name: &str, kind: &str, cluster: &str, big: usize) -> Result<PathBuf> {
    let dir = into.join(name);
    let cluster = if cluster.is_empty() { String::new() } else { format!("cluster = \"{cluster}\"\n") };
    write(
        &dir,
        "kiln.toml",
        &format!("instance = \"{name}\"\n\n[target]\nkind = \"{kind}\"\n{cluster}\n[built.web]\ncontext = \"web\"\n"),
    );
    write(&dir, "web/Dockerfile", "FROM scratch\nCOPY . /srv/\n");
    write(&dir, "web/index.html", &format!("<p>{:016x}</p>\n", fastrand::u64(..)));
    if big > 0 {
        let noise: Vec<u8> = (0..big).map(|_| fastrand::u8(..)).collect();
        std::fs::write(dir.join("web/big.bin"), noise)?;
    }
    Ok(dir)
}

/// A forced converge's wall time, whole (client side).
async fn converge(farm: &Farm, dir: &Path) -> Result<Duration> {
    let started = std::time::Instant::now();
    let events = up(&farm.url, dir, true).await;
    if !succeeded(&events) {
        bail!("converge failed");
    }
    Ok(started.elapsed())
}

/// A forced converge; its `Built` → `Delivered` interval.
async fn delivery(farm: &Farm, dir: &Path) -> Result<Duration> {
    let events = up(&farm.url, dir, true).await;
    if !succeeded(&events) {
        bail!("converge failed: {:?}", events.iter().map(|e| &e.message).collect::<Vec<_>>());
    }
    let at = |kind: Kind| events.iter().find(|e| e.kind() == kind).map(|e| e.at_ms);
    match (at(Kind::Built), at(Kind::Delivered)) {
        (Some(built), Some(delivered)) => Ok(Duration::from_millis(delivered.saturating_sub(built))),
        _ => bail!("the converge did not build and deliver"),
    }
}

pub fn run(args: &Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let scratch = util::scratch_dir("kiln-bench-delivery")?;
    let mut farm = rt.block_on(Farm::start(&scratch.path().join("home")));
    let cluster = format!("bench{:08x}", fastrand::u32(..));
    let nodes: Vec<Containerd> = (0..args.nodes).map(|_| Containerd::start()).collect::<Result<_>>()?;
    for (i, node) in nodes.iter().enumerate() {
        let store = rt.block_on(kiln_agent::node::ContainerdStore::connect(&node.socket, "k8s.io"))?;
        rt.block_on(farm.start_node(&cluster, &format!("{cluster}-n{i}"), Arc::new(store)));
    }
    let kind_cluster = format!("kb{:08x}", fastrand::u32(..));
    let kind_nodes: Vec<KindNode> =
        (0..args.nodes).map(|i| KindNode::start(&kind_cluster, &format!("{kind_cluster}-n{i}"))).collect();

    // An image every node already holds.
    let small = instance(scratch.path(), "held", "nodes", &cluster, 0)?;
    let small_kind = instance(scratch.path(), "heldkind", "kind", &kind_cluster, 0)?;
    let small_local = instance(scratch.path(), "heldlocal", "local", "", 0)?;
    std::fs::copy(small.join("web/index.html"), small_kind.join("web/index.html"))?;
    std::fs::copy(small.join("web/index.html"), small_local.join("web/index.html"))?;
    rt.block_on(delivery(&farm, &small))?;
    rt.block_on(delivery(&farm, &small_kind))?;
    rt.block_on(converge(&farm, &small_local))?;
    // Event stamps are taken by the event writer, so a short interval can read shorter than it
    // was; whole forced converges against a `local` one (which delivers nothing) bound it.
    let mut whole = [
        Contestant::new("whole forced converge, local (no delivery)", || rt.block_on(converge(&farm, &small_local))),
        Contestant::new("whole forced converge, nodes (all hold it)", || rt.block_on(converge(&farm, &small))),
        Contestant::new("whole forced converge, kind (all hold it)", || rt.block_on(converge(&farm, &small_kind))),
    ];
    util::rounds(&mut whole, args.runs, 1, || Ok(()))?;
    util::print_table("whole forced converges of an image every node already holds", &whole);
    drop(whole);
    let mut held = [
        Contestant::new(format!("kiln nodes, {} nodes hold it", args.nodes), || rt.block_on(delivery(&farm, &small))),
        Contestant::new(format!("kiln kind, {} nodes hold it", args.nodes), || {
            rt.block_on(delivery(&farm, &small_kind))
        }),
    ];
    util::rounds(&mut held, args.runs, 1, || Ok(()))?;
    util::print_table("delivery of an image every node already holds", &held);
    for c in &held {
        let ms = c.median().as_secs_f64() * 1000.0;
        println!("- {}: {ms:.0} ms (goal ≤ 50 ms) — {}", c.name, if ms <= 50.0 { "met" } else { "MISSED" });
    }
    drop(held);

    if args.skip_large {
        rt.block_on(farm.stop());
        return Ok(());
    }
    // A large image none holds.
    let big = instance(scratch.path(), "big", "nodes", &cluster, args.mb << 20)?;
    rt.block_on(delivery(&farm, &big)).ok();
    let big_ref = reference(&big, "web");
    let clear = || nodes.iter().try_for_each(Containerd::clear);
    let mut transfer = [
        Contestant::new(format!("kiln nodes, {} MB to {} nodes", args.mb, args.nodes), || {
            clear()?;
            rt.block_on(delivery(&farm, &big))
        }),
        Contestant::new("docker save | ctr import, per node", || {
            clear()?;
            let started = std::time::Instant::now();
            for node in &nodes {
                let save = Command::new("docker").args(["save", &big_ref]).stdout(Stdio::piped()).spawn()?;
                let status = Command::new("ctr")
                    .arg("-a")
                    .arg(&node.socket)
                    .args(["-n", "k8s.io", "images", "import", "--all-platforms", "--digests", "-"])
                    .stdin(save.stdout.context("docker save's stdout")?)
                    .stdout(Stdio::null())
                    .status()?;
                if !status.success() {
                    bail!("ctr import failed");
                }
            }
            Ok(started.elapsed())
        }),
    ];
    util::rounds(&mut transfer, args.runs, 1, || Ok(()))?;
    util::print_table(&format!("delivery of a {} MB image to {} nodes", args.mb, args.nodes), &transfer);
    println!(
        "kiln vs per-node docker save | ctr import: {:.2}x",
        util::speedup(transfer[1].median(), transfer[0].median())
    );
    drop(transfer);
    rt.block_on(farm.stop());
    let _ = Command::new("docker")
        .args(["rmi", &big_ref, &reference(&small, "web"), &reference(&small_kind, "web")])
        .output();
    drop(kind_nodes);
    Ok(())
}
