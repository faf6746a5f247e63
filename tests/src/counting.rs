//! [`Counting`]: the real Docker host store, counting every call it sends to Docker and timing the
//! builds, with sabotage a test can arm. The end-to-end [`crate::Farm`] and the converge
//! benchmarks both run their agent over it: a test asserts how many builds and pushes a converge
//! really sent, a benchmark splits a converge's wall time into Docker's share and Kiln's, and a
//! no-op converge (which claims to send Docker nothing) is checked by its listings and inspects.

use async_trait::async_trait;
use kiln_agent::host::{BuildSpec, Built, DockerStore, HostError, HostStore, ImageInfo, PushProgress, Pushed, Removal};
use kiln_core::sweep::ListedImage;
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};

/// The real Docker host store, counting its calls.
#[derive(Debug)]
pub struct Counting {
    inner: DockerStore,
    pub builds: AtomicUsize,
    pub pushes: AtomicUsize,
    /// Listings: labeled images, and the images containers use.
    pub lists: AtomicUsize,
    pub inspects: AtomicUsize,
    /// Untags and image removals.
    pub removes: AtomicUsize,
    /// Wall time inside Docker's build call, in nanoseconds.
    build_nanos: AtomicU64,
    /// `docker save`s sent to Docker, for a delivery to nodes.
    pub exports: AtomicUsize,
    /// Pushes still to sabotage: each untags its image first, as a sweep elsewhere might between
    /// a build and its delivery.
    pub sweep_before_push: AtomicUsize,
    /// Builds still to sabotage: each untags its image right after Docker built it, as a sweep
    /// elsewhere might before the converge reads it back.
    pub sweep_after_build: AtomicUsize,
    /// Refs whose removal fails, as a daemon refusing one untag would.
    pub refuse_removal_of: Mutex<HashSet<String>>,
    /// Holds every finished build until the test lets it go; see [`BuildPause`].
    pub pause: BuildPause,
}

/// A window between a build and the rest of its converge, held open by the test: with it armed,
/// each build, once Docker has the tag, signals `built` and waits for `gate` before the agent
/// answers. A test holds the gate's lock, runs whatever must race the converge, then drops it.
#[derive(Debug, Default)]
pub struct BuildPause {
    pub armed: AtomicBool,
    pub built: Notify,
    pub gate: tokio::sync::Mutex<()>,
}

#[async_trait]
impl HostStore for Counting {
    async fn build(
        &self,
        context_archive: &Path,
        spec: &BuildSpec,
        log: mpsc::Sender<String>,
    ) -> Result<Built, HostError> {
        self.builds.fetch_add(1, Ordering::SeqCst);
        let started = Instant::now();
        let built = self.inner.build(context_archive, spec, log).await;
        self.build_nanos.fetch_add(started.elapsed().as_nanos() as u64, Ordering::SeqCst);
        let sabotage = self.sweep_after_build.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if built.is_ok() && sabotage.is_ok() {
            self.inner.remove_tag(&spec.tag).await?;
        }
        if self.pause.armed.load(Ordering::SeqCst) {
            self.pause.built.notify_one();
            let _open = self.pause.gate.lock().await;
        }
        built
    }
    async fn list_labeled(&self) -> Result<Vec<ListedImage>, HostError> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.list_labeled().await
    }
    async fn list_with_layers(&self) -> Result<Vec<ListedImage>, HostError> {
        self.inner.list_with_layers().await
    }
    async fn tag(&self, id: &str, reference: &str) -> Result<(), HostError> {
        self.inner.tag(id, reference).await
    }
    async fn inspect(&self, reference: &str) -> Result<Option<ImageInfo>, HostError> {
        self.inspects.fetch_add(1, Ordering::SeqCst);
        self.inner.inspect(reference).await
    }
    async fn push(&self, reference: &str, progress: mpsc::Sender<PushProgress>) -> Result<Pushed, HostError> {
        self.pushes.fetch_add(1, Ordering::SeqCst);
        let sabotage = self.sweep_before_push.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if sabotage.is_ok() {
            self.inner.remove_tag(reference).await?;
        }
        self.inner.push(reference, progress).await
    }
    async fn remove_tag(&self, reference: &str) -> Result<Removal, HostError> {
        self.removes.fetch_add(1, Ordering::SeqCst);
        if self.refuse_removal_of.lock().unwrap().contains(reference) {
            return Err(HostError::Refused {
                host: self.inner.host().to_string(),
                op: "untag",
                object: reference.to_string(),
                source: bollard::errors::Error::DockerResponseServerError {
                    status_code: 409,
                    message: format!("conflict: the test refuses to untag {reference}"),
                },
            });
        }
        self.inner.remove_tag(reference).await
    }
    async fn remove_image(&self, id: &str) -> Result<Removal, HostError> {
        self.removes.fetch_add(1, Ordering::SeqCst);
        self.inner.remove_image(id).await
    }
    async fn images_in_use(&self) -> Result<Vec<String>, HostError> {
        self.lists.fetch_add(1, Ordering::SeqCst);
        self.inner.images_in_use().await
    }
    async fn ping(&self) -> Result<(), HostError> {
        self.inner.ping().await
    }
    async fn kind_load(
        &self,
        cluster: &str,
        reference: &str,
        id: &str,
        name: &str,
    ) -> Result<kiln_agent::host::KindLoad, HostError> {
        self.inner.kind_load(cluster, reference, id, name).await
    }
    async fn kind_nodes(&self) -> Result<Vec<kiln_agent::host::KindNode>, HostError> {
        self.inner.kind_nodes().await
    }
    async fn export(&self, reference: &str) -> Result<kiln_agent::host::ExportStream, HostError> {
        self.exports.fetch_add(1, Ordering::Relaxed);
        self.inner.export(reference).await
    }
}

impl Counting {
    /// Over the local Docker daemon, every count at zero and nothing armed.
    pub async fn connect() -> Result<Counting, HostError> {
        Ok(Counting {
            inner: DockerStore::connect_local().await?,
            builds: AtomicUsize::new(0),
            pushes: AtomicUsize::new(0),
            lists: AtomicUsize::new(0),
            inspects: AtomicUsize::new(0),
            removes: AtomicUsize::new(0),
            build_nanos: AtomicU64::new(0),
            exports: AtomicUsize::new(0),
            sweep_before_push: AtomicUsize::new(0),
            sweep_after_build: AtomicUsize::new(0),
            refuse_removal_of: Mutex::new(HashSet::new()),
            pause: BuildPause::default(),
        })
    }

    /// The calls so far.
    pub fn calls(&self) -> Calls {
        let n = |a: &AtomicUsize| a.load(Ordering::SeqCst) as u64;
        Calls {
            builds: n(&self.builds),
            pushes: n(&self.pushes),
            lists: n(&self.lists),
            inspects: n(&self.inspects),
            removes: n(&self.removes),
            build_time: Duration::from_nanos(self.build_nanos.load(Ordering::SeqCst)),
        }
    }
}

/// The calls a store received, or received between two snapshots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Calls {
    pub builds: u64,
    pub pushes: u64,
    pub lists: u64,
    pub inspects: u64,
    pub removes: u64,
    /// Wall time spent inside Docker's build call (bollard's request until its stream ends).
    pub build_time: Duration,
}

impl Calls {
    pub fn since(self, before: Calls) -> Calls {
        Calls {
            builds: self.builds - before.builds,
            pushes: self.pushes - before.pushes,
            lists: self.lists - before.lists,
            inspects: self.inspects - before.inspects,
            removes: self.removes - before.removes,
            build_time: self.build_time - before.build_time,
        }
    }
}

impl std::fmt::Display for Calls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} build(s), {} push(es), {} listing(s), {} inspect(s), {} removal(s)",
            self.builds, self.pushes, self.lists, self.inspects, self.removes
        )
    }
}
