//! The planner proper. Roots are normalized once into hash sets and each image's refs once, so a
//! plan costs O(roots + refs) however many stores and images there are — a farm sweeps after every
//! converge, and a planner that compared every ref with every root would be the slow part of it.

use std::collections::{BTreeMap, HashSet};

use super::hold::{farm_key, hold_key};
use super::normalize::{normalize, NormRef};
use super::{
    KeptWhole, ListedImage, Plan, Policy, Removal, RemovalMode, RemovalTarget, Roots, StoreKind, StoreListing,
    StorePlan, KIND_SHARED, LABEL_FARM, LABEL_INSTANCE, LABEL_KIND, UNOWNED,
};

/// Plans the sweep of every listed store. See DESIGN.md "Reachability" for the rules; in short:
/// only images labeled with a kind and this farm are candidates; a candidate ref goes when no
/// root names it; a root naming an image by digest keeps every ref of that image; host stores and
/// `PerRef` node stores untag, `PerId` node stores remove an id only when all its names are garbage.
pub fn plan(listings: &[StoreListing], roots: &Roots, policy: &Policy) -> Plan {
    let mut everywhere = RootSet::default();
    let mut grace = RootSet::default();
    for record in &roots.records {
        everywhere.extend(&record.current);
        grace.extend(&record.previous);
    }
    everywhere.extend(&roots.claims);
    everywhere.extend(&roots.kubernetes);
    everywhere.extend(&roots.pins);

    let mut stores: Vec<StorePlan> = listings
        .iter()
        .map(|listing| {
            let mut workloads = RootSet::default();
            if let Some(used) = roots.workloads.get(&listing.store) {
                workloads.extend(used);
            }
            // Where images run, the generation a converge replaced may still be provisioned while
            // the new record propagates; on a plain build host nothing runs, so it is scratch.
            let gets_grace = listing.kind == StoreKind::Node || listing.runs_workloads;
            let keep = Keep {
                sets: if gets_grace { vec![&everywhere, &grace, &workloads] } else { vec![&everywhere, &workloads] },
            };
            plan_store(listing, &keep, policy)
        })
        .collect();
    stores.sort_by(|a, b| a.store.cmp(&b.store));
    Plan { stores }
}

/// Roots in normalized form: the names they spell and the digests they pin.
#[derive(Debug, Default)]
struct RootSet {
    names: HashSet<String>,
    digests: HashSet<String>,
}

impl RootSet {
    fn extend(&mut self, raws: &[String]) {
        for raw in raws {
            match normalize(raw) {
                NormRef::Named { canonical, digest } => {
                    self.names.insert(canonical);
                    if let Some(digest) = digest {
                        self.digests.insert(digest);
                    }
                }
                NormRef::Alias { digest } => {
                    self.digests.insert(digest);
                }
            }
        }
    }
}

/// The root sets that apply to one store.
struct Keep<'a> {
    sets: Vec<&'a RootSet>,
}

impl Keep<'_> {
    fn names(&self, canonical: &str) -> bool {
        self.sets.iter().any(|set| set.names.contains(canonical))
    }

    fn digest(&self, digest: &str) -> bool {
        self.sets.iter().any(|set| set.digests.contains(digest))
    }
}

/// A candidate image's refs, split and judged.
struct Judged<'a> {
    /// Named refs with whether a root names them, sorted and deduplicated.
    named: Vec<(&'a str, bool)>,
    aliases: Vec<&'a str>,
    /// A root pins this image's content by digest.
    digest_rooted: bool,
}

fn judge<'a>(image: &'a ListedImage, keep: &Keep<'_>) -> Judged<'a> {
    let mut digest_rooted = keep.digest(&image.id) || image.digests.iter().any(|d| keep.digest(d));
    let mut named = Vec::with_capacity(image.refs.len());
    let mut aliases = Vec::new();
    for raw in &image.refs {
        match normalize(raw) {
            NormRef::Named { canonical, digest } => {
                // A digest a ref carries is one the image answers to, even if the listing's
                // digest column left it out.
                digest_rooted |= digest.is_some_and(|d| keep.digest(&d));
                named.push((raw.as_str(), keep.names(&canonical)));
            }
            NormRef::Alias { digest } => {
                digest_rooted |= keep.digest(&digest);
                aliases.push(raw.as_str());
            }
        }
    }
    named.sort_unstable();
    named.dedup();
    aliases.sort_unstable();
    aliases.dedup();
    Judged { named, aliases, digest_rooted }
}

/// Who a candidate belongs to, or `None` when the image is not ours to touch.
struct Owner<'a> {
    instance: Option<&'a str>,
    bucket: &'a str,
}

fn owner<'a>(image: &'a ListedImage, policy: &Policy) -> Option<Owner<'a>> {
    // An empty kind is how a derived image clears the label it inherited from a Kiln base.
    let kind = image.labels.get(LABEL_KIND).filter(|kind| !kind.is_empty())?;
    if image.labels.get(LABEL_FARM) != Some(&policy.farm) {
        return None;
    }
    let instance = image.labels.get(LABEL_INSTANCE).map(String::as_str).filter(|instance| !instance.is_empty());
    let bucket = if kind == KIND_SHARED { KIND_SHARED } else { instance.unwrap_or(UNOWNED) };
    Some(Owner { instance, bucket })
}

fn plan_store(listing: &StoreListing, keep: &Keep<'_>, policy: &Policy) -> StorePlan {
    // `docker rmi <tag>` untags, so a host store never needs the all-or-nothing rule.
    let per_id = listing.kind == StoreKind::Node && listing.removal == RemovalMode::PerId;
    let own_key = farm_key(&policy.farm);
    // Each group is one image's removals, with the bucket its bytes are counted under.
    let mut groups: Vec<(Vec<Removal>, &str)> = Vec::new();
    let mut kept_whole = Vec::new();

    for image in &listing.images {
        let Some(owner) = owner(image, policy) else {
            if !per_id {
                if let Some(group) = released_holds(image, keep, &own_key) {
                    groups.push((group, UNOWNED));
                }
            }
            continue;
        };
        // Another farm relies on this image (it is equivalent by address to what that farm's record
        // names): the owner leaves every ref of it until that farm's own sweep drops its hold.
        if image.refs.iter().any(|raw| hold_key(raw).is_some_and(|key| key != own_key)) {
            continue;
        }
        let judged = judge(image, keep);
        if judged.digest_rooted {
            // Its names cost no bytes and a digest-pinned pull may resolve through them.
            continue;
        }
        let garbage: Vec<&str> = judged.named.iter().filter(|(_, kept)| !kept).map(|(raw, _)| *raw).collect();
        let all_garbage = garbage.len() == judged.named.len();
        let removal = |target: RemovalTarget, frees: bool| Removal {
            target,
            id: image.id.clone(),
            instance: owner.instance.map(str::to_owned),
            frees,
            bytes: 0,
        };

        let group: Vec<Removal> = if !all_garbage {
            if per_id {
                if !garbage.is_empty() {
                    let kept_by = judged.named.iter().find(|(_, kept)| *kept);
                    kept_whole.push(KeptWhole {
                        id: image.id.clone(),
                        kept_by: kept_by.map(|(raw, _)| (*raw).to_owned()).unwrap_or_default(),
                        garbage_refs: garbage.iter().map(|raw| (*raw).to_owned()).collect(),
                    });
                }
                Vec::new()
            } else {
                // The aliases stay: a kept name still needs the content they hold.
                garbage.iter().map(|raw| removal(RemovalTarget::Ref((*raw).to_owned()), false)).collect()
            }
        } else if per_id || (judged.named.is_empty() && judged.aliases.is_empty()) {
            // CRI removes by id; a host image with no tags at all can only be named by its id.
            vec![removal(RemovalTarget::Id(image.id.clone()), true)]
        } else {
            // Names first, aliases last: on containerd the content is released with the last ref,
            // and kind's `import-*` ref is the one CRI never shows.
            let every_ref: Vec<&str> =
                judged.named.iter().map(|(raw, _)| *raw).chain(judged.aliases.iter().copied()).collect();
            let last = every_ref.len() - 1;
            every_ref
                .iter()
                .enumerate()
                .map(|(i, raw)| removal(RemovalTarget::Ref((*raw).to_owned()), i == last))
                .collect()
        };
        if !group.is_empty() {
            groups.push((group, owner.bucket));
        }
    }

    // Bytes last, once every image that goes is known: layers two doomed images share are counted
    // once, and layers an image that stays still uses are not counted at all.
    let going: HashSet<&str> =
        groups.iter().flat_map(|(group, _)| group).filter(|r| r.frees).map(|r| r.id.as_str()).collect();
    let mut freeing: Vec<&ListedImage> = listing.images.iter().filter(|i| going.contains(i.id.as_str())).collect();
    freeing.sort_by(|a, b| a.id.cmp(&b.id));
    freeing.dedup_by(|a, b| a.id == b.id);
    let staying: Vec<&ListedImage> = listing.images.iter().filter(|i| !going.contains(i.id.as_str())).collect();
    let bytes: BTreeMap<&str, u64> = freeing.iter().map(|i| i.id.as_str()).zip(reclaimed(&freeing, &staying)).collect();
    let mut freed_bytes = 0u64;
    let mut freed_by_instance: BTreeMap<String, u64> = BTreeMap::new();
    for (group, bucket) in &mut groups {
        for removal in group.iter_mut().filter(|r| r.frees) {
            removal.bytes = bytes.get(removal.id.as_str()).copied().unwrap_or(0);
            freed_bytes += removal.bytes;
            *freed_by_instance.entry((*bucket).to_owned()).or_default() += removal.bytes;
        }
    }

    groups.sort_by(|a, b| a.0[0].id.cmp(&b.0[0].id));
    kept_whole.sort_by(|a: &KeptWhole, b| a.id.cmp(&b.id));
    StorePlan {
        store: listing.store.clone(),
        removals: groups.into_iter().flat_map(|(group, _)| group).collect(),
        kept_whole,
        freed_bytes,
        freed_by_instance,
    }
}

/// This farm's holds on an image another farm built, once none of this farm's roots names any
/// other ref of it (or its content by digest): the reliance the holds marked has ended.
fn released_holds(image: &ListedImage, keep: &Keep<'_>, own_key: &str) -> Option<Vec<Removal>> {
    // Holds are only ever put on Kiln's images; anything else is not this planner's to touch.
    image.labels.get(LABEL_KIND).filter(|kind| !kind.is_empty())?;
    let mine: Vec<&str> = image.refs.iter().map(String::as_str).filter(|raw| hold_key(raw) == Some(own_key)).collect();
    if mine.is_empty() {
        return None;
    }
    let judged = judge(image, keep);
    let relied = judged.digest_rooted || judged.named.iter().any(|(raw, kept)| *kept && hold_key(raw).is_none());
    if relied {
        return None;
    }
    let removal = |raw: &str| Removal {
        target: RemovalTarget::Ref(raw.to_owned()),
        id: image.id.clone(),
        instance: None,
        frees: false,
        bytes: 0,
    };
    Some(mine.into_iter().map(removal).collect())
}

/// What each image of `going` reclaims when all of them leave and `staying` stays, in `going`'s
/// order: its layers that no staying image uses and no earlier going image already counted. An
/// image whose layers the store did not list counts its whole size (it cannot be told apart).
pub fn reclaimed(going: &[&ListedImage], staying: &[&ListedImage]) -> Vec<u64> {
    let mut used: HashSet<&str> = staying.iter().flat_map(|i| &i.layers).map(|l| l.chain.as_str()).collect();
    going
        .iter()
        .map(|image| {
            if image.layers.is_empty() {
                return image.bytes;
            }
            image.layers.iter().filter(|layer| used.insert(layer.chain.as_str())).map(|layer| layer.bytes).sum()
        })
        .collect()
}
