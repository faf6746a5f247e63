//! The reachability sweep planner (DESIGN.md "Reachability"): the stores' listings, the roots and
//! the farm's policy go in, the removals each store should make come out. It is a pure function so
//! that the one rule that must never break — *no plan removes a ref a root or claim names* — can be
//! property-tested over many made-up universes instead of being trusted to the agents' I/O code.
//!
//! Start at [`plan`]. The agents execute a [`Plan`] as delete-if-present removals and confirm by
//! listing again; [`Plan::apply_to`] is the same change done to the listings in memory, which tests
//! use to check that a second plan has nothing left to do.

mod hold;
mod normalize;
mod plan;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

pub use hold::{farm_key, hold_key, hold_ref, HOLD_NAMESPACE};
pub use plan::{plan, reclaimed};

/// The planner's own ref normalization, exposed for the `refs` fuzz target (`fuzz/`), which holds
/// it to [`crate::refs::ImageRef`] on every ref both accept: the canonical name, or `None` for
/// an alias (`sha256:<id>`, kind's `import-<date>@sha256:…`). Not an API.
#[doc(hidden)]
pub fn canonical_name(raw: &str) -> Option<String> {
    match normalize::normalize(raw) {
        normalize::NormRef::Named { canonical, .. } => Some(canonical),
        normalize::NormRef::Alias { .. } => None,
    }
}

/// Label naming what Kiln built: `image` or `shared`. An image without it is never swept.
pub const LABEL_KIND: &str = "kiln.dev/kind";
/// Label naming the instance that owns a built image (absent on `shared` images).
pub const LABEL_INSTANCE: &str = "kiln.dev/instance";
/// Label naming the farm whose coordinator built the image; another farm's images are not ours.
pub const LABEL_FARM: &str = "kiln.dev/farm";
/// Label carrying the full tree digest of the context an image was built from.
pub const LABEL_CONTEXT: &str = "kiln.dev/context";
/// The `kiln.dev/kind` of a base image many instances share; also its key in
/// [`StorePlan::freed_by_instance`].
pub const KIND_SHARED: &str = "shared";
/// The key in [`StorePlan::freed_by_instance`] for a built image whose instance label is missing.
pub const UNOWNED: &str = "unowned";

/// Names one image store an agent manages: a Docker daemon or a containerd namespace on a node.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StoreId(pub String);

impl fmt::Display for StoreId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether a store is where images are built (host) or where they run (node).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreKind {
    Host,
    Node,
}

/// How a store can remove images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemovalMode {
    /// Refs are removed one by one (containerd reached directly; `docker rmi <tag>` on a host).
    PerRef,
    /// Only whole image ids can be removed (a node reachable through CRI alone, which cannot untag).
    /// Host stores always untag, so this applies to node stores only.
    PerId,
}

/// One image as a store lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedImage {
    /// `sha256:<config digest>`.
    pub id: String,
    /// Every ref the store holds for this image, as the store spells it: host tags, containerd
    /// names, kind's `import-<date>@sha256:…` refs and `sha256:<id>` refs alike.
    pub refs: Vec<String>,
    /// Repo/manifest digests (`sha256:…`) the image answers to.
    pub digests: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub bytes: u64,
    /// The image's layers, bottom first, when the store says; empty otherwise, and then the
    /// image's `bytes` count whole. A store may list images Kiln never touches with their layers
    /// alone (no refs, no labels), so the bytes they share with Kiln's are not counted as freed.
    pub layers: Vec<Layer>,
}

/// One layer of an image: its chain (this layer and every one beneath it, so two images share
/// the layer's bytes exactly when they share the chain) and its own size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layer {
    pub chain: String,
    pub bytes: u64,
}

/// Everything one store holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreListing {
    pub store: StoreId,
    pub kind: StoreKind,
    pub removal: RemovalMode,
    /// A host store that is itself an instance's `local` target: images run there, so it keeps the
    /// node's grace generation.
    pub runs_workloads: bool,
    pub images: Vec<ListedImage>,
}

/// An instance's converged record: its current generation and the one it replaced.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InstanceRecord {
    pub instance: String,
    pub current: Vec<String>,
    /// Kept on stores where images run, so a ConfigMap still propagating cannot name a swept ref.
    pub previous: Vec<String>,
}

/// Everything that keeps an image alive. Refs may be spelled any way Docker accepts, including
/// `repo@sha256:…` and bare `sha256:…` digests.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Roots {
    pub records: Vec<InstanceRecord>,
    /// Live claims, including the refs of the converge that is about to sweep.
    pub claims: Vec<String>,
    /// Per store: refs or `sha256:<id>` image ids its containers use. A root only on that store.
    pub workloads: BTreeMap<StoreId, Vec<String>>,
    /// ConfigMaps, custom resources and pods of the Kubernetes namespaces Kiln serves.
    pub kubernetes: Vec<String>,
    /// `kiln pin <ref>`.
    pub pins: Vec<String>,
}

/// The farm whose images this sweep may touch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Compared with each image's `kiln.dev/farm` label.
    pub farm: String,
}

/// What one removal names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RemovalTarget {
    /// Remove this one ref, spelled exactly as the store listed it.
    Ref(String),
    /// Remove the whole image id with every ref it has.
    Id(String),
}

/// One delete-if-present removal on one store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removal {
    pub target: RemovalTarget,
    /// The image id the target belongs to.
    pub id: String,
    /// The image's `kiln.dev/instance` label.
    pub instance: Option<String>,
    /// True when this removal takes the id's last ref, so its bytes are reclaimed.
    pub frees: bool,
    /// What the image's going reclaims when `frees`, else 0: untagging one of several refs
    /// reclaims nothing. With layers listed, only layers no remaining image uses (and none an
    /// earlier removal of the plan already counted); without, the image's size.
    pub bytes: u64,
}

/// An id a CRI-only store cannot untag: some named refs are garbage but another is kept, so the
/// whole id stays and the garbage is reported instead of removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptWhole {
    pub id: String,
    /// The (smallest) ref a root names.
    pub kept_by: String,
    /// The refs that would have gone had the store been able to untag, sorted.
    pub garbage_refs: Vec<String>,
}

/// What one store should remove.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorePlan {
    pub store: StoreId,
    /// Grouped by id in id order; inside an id, named refs before aliases, so the alias that
    /// releases the content goes last and is the one marked `frees`.
    pub removals: Vec<Removal>,
    /// Sorted by id.
    pub kept_whole: Vec<KeptWhole>,
    pub freed_bytes: u64,
    /// Freed bytes by instance label, [`KIND_SHARED`] for shared images, [`UNOWNED`] otherwise.
    pub freed_by_instance: BTreeMap<String, u64>,
}

/// The removals of every listed store, sorted by store.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    pub stores: Vec<StorePlan>,
}

impl Plan {
    /// True when no store has anything to remove (ids kept whole are reports, not work).
    pub fn is_empty(&self) -> bool {
        self.stores.iter().all(|store| store.removals.is_empty())
    }

    /// Total bytes the plan reclaims across stores.
    pub fn freed_bytes(&self) -> u64 {
        self.stores.iter().map(|store| store.freed_bytes).sum()
    }

    /// The listings as they would read after every removal succeeded: removed refs are gone, an
    /// image that lost its last ref disappears, and an [`RemovalTarget::Id`] removal takes the
    /// whole image. Stores the plan does not mention are returned unchanged.
    pub fn apply_to(&self, listings: &[StoreListing]) -> Vec<StoreListing> {
        let plans: HashMap<&StoreId, &StorePlan> = self.stores.iter().map(|store| (&store.store, store)).collect();
        listings
            .iter()
            .map(|listing| {
                let mut after = listing.clone();
                if let Some(store_plan) = plans.get(&listing.store) {
                    apply_store(store_plan, &mut after.images);
                }
                after
            })
            .collect()
    }
}

fn apply_store(store_plan: &StorePlan, images: &mut Vec<ListedImage>) {
    let mut whole: HashSet<&str> = HashSet::new();
    let mut refs: HashSet<(&str, &str)> = HashSet::new();
    for removal in &store_plan.removals {
        match &removal.target {
            RemovalTarget::Id(id) => {
                whole.insert(id);
            }
            RemovalTarget::Ref(raw) => {
                refs.insert((removal.id.as_str(), raw.as_str()));
            }
        }
    }
    images.retain_mut(|image| {
        if whole.contains(image.id.as_str()) {
            return false;
        }
        let before = image.refs.len();
        image.refs.retain(|raw| !refs.contains(&(image.id.as_str(), raw.as_str())));
        // A dangling image that lost nothing is still there; one whose last ref went is not.
        !(image.refs.is_empty() && before > 0)
    });
}
