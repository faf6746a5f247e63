//! The planner proper. Roots are normalized once into hash sets and each image's refs once, so a
//! plan costs O(roots + refs) however many stores and images there are — a farm sweeps after every
//! converge, and a planner that compared every ref with every root would be the slow part of it.

use std::collections::{BTreeMap, HashSet};

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
    let mut groups: Vec<Vec<Removal>> = Vec::new();
    let mut kept_whole = Vec::new();
    let mut freed_bytes = 0u64;
    let mut freed_by_instance: BTreeMap<String, u64> = BTreeMap::new();

    for image in &listing.images {
        let Some(owner) = owner(image, policy) else {
            continue;
        };
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
            bytes: if frees { image.bytes } else { 0 },
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

        if group.iter().any(|removal| removal.frees) {
            freed_bytes += image.bytes;
            *freed_by_instance.entry(owner.bucket.to_owned()).or_default() += image.bytes;
        }
        if !group.is_empty() {
            groups.push(group);
        }
    }

    groups.sort_by(|a, b| a[0].id.cmp(&b[0].id));
    kept_whole.sort_by(|a: &KeptWhole, b| a.id.cmp(&b.id));
    StorePlan {
        store: listing.store.clone(),
        removals: groups.into_iter().flatten().collect(),
        kept_whole,
        freed_bytes,
        freed_by_instance,
    }
}
