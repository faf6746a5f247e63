//! From a plan to what a sweep reports: narrowing a plan to one instance (`kiln gc --instance`),
//! naming each image's owner, and judging every planned removal against the store's listing taken
//! *after* the removals. The re-listing, not the agent's answer, decides what went and how many
//! bytes came back: an untag that "succeeded" while a converge re-tagged the image freed nothing,
//! and a removal that "failed" because someone else took the image first freed what it planned.

use std::collections::{HashMap, HashSet};

use kiln_core::sweep::{ListedImage, Plan, RemovalTarget, StorePlan, KIND_SHARED, LABEL_INSTANCE, LABEL_KIND, UNOWNED};

/// The owner a sweep reports for an image: its instance, `shared`, or `unowned` — the same
/// buckets as [`StorePlan::freed_by_instance`].
pub(super) fn owner(image: &ListedImage) -> String {
    if image.labels.get(LABEL_KIND).map(String::as_str) == Some(KIND_SHARED) {
        return KIND_SHARED.to_string();
    }
    match image.labels.get(LABEL_INSTANCE).filter(|instance| !instance.is_empty()) {
        Some(instance) => instance.clone(),
        None => UNOWNED.to_string(),
    }
}

/// Keeps only the removals of images labeled with `instance`, and recounts what the plan frees.
/// Ids kept whole are reports about other owners' refs too, so they stay.
pub(super) fn restrict(plan: &mut Plan, instance: &str) {
    for store in &mut plan.stores {
        store.removals.retain(|removal| removal.instance.as_deref() == Some(instance));
        let freed: u64 = store.removals.iter().filter(|removal| removal.frees).map(|removal| removal.bytes).sum();
        store.freed_bytes = freed;
        store.freed_by_instance.clear();
        if freed > 0 {
            store.freed_by_instance.insert(instance.to_string(), freed);
        }
    }
}

/// The spelling of a removal's target in events and tasks: the ref, or the image id.
pub(super) fn target_text(target: &RemovalTarget) -> &str {
    match target {
        RemovalTarget::Ref(reference) => reference,
        RemovalTarget::Id(id) => id,
    }
}

/// A removal the re-listing confirmed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Done {
    pub target: String,
    pub owner: String,
    /// The image's bytes when this removal took its last ref and the image is gone; else 0.
    pub bytes: u64,
}

/// A removal the re-listing contradicts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct NotDone {
    pub target: String,
    pub why: String,
}

/// One store's sweep as its re-listing shows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) struct Confirmed {
    pub done: Vec<Done>,
    pub not_done: Vec<NotDone>,
    /// Images the plan meant to free that are gone, and their bytes.
    pub images: u64,
    pub bytes: u64,
}

/// Judges `plan`'s removals against `after`, the store's listing once they ran. `owners` maps
/// image ids to their owner (from the listing the plan was made from), `before` is that listing;
/// `failures` holds the agent's reason for each target it could not remove.
///
/// Bytes are what really came back: of the images that went, the layers no image left on the store
/// uses, each counted once (two removed images sharing a base free it once, not twice).
pub(super) fn confirm(
    plan: &StorePlan,
    owners: &HashMap<String, String>,
    before: &[ListedImage],
    after: &[ListedImage],
    failures: &HashMap<String, String>,
) -> Confirmed {
    let present: HashMap<&str, HashSet<&str>> =
        after.iter().map(|image| (image.id.as_str(), image.refs.iter().map(String::as_str).collect())).collect();
    let freed_ids: HashSet<&str> = plan
        .removals
        .iter()
        .filter(|r| r.frees && !present.contains_key(r.id.as_str()))
        .map(|r| r.id.as_str())
        .collect();
    let mut going: Vec<&ListedImage> = before.iter().filter(|i| freed_ids.contains(i.id.as_str())).collect();
    going.sort_by(|a, b| a.id.cmp(&b.id));
    going.dedup_by(|a, b| a.id == b.id);
    let staying: Vec<&ListedImage> = after.iter().collect();
    let reclaimed: HashMap<&str, u64> =
        going.iter().map(|i| i.id.as_str()).zip(kiln_core::sweep::reclaimed(&going, &staying)).collect();
    let mut confirmed = Confirmed::default();
    for removal in &plan.removals {
        let target = target_text(&removal.target).to_string();
        let still = match &removal.target {
            RemovalTarget::Ref(reference) => {
                present.get(removal.id.as_str()).is_some_and(|refs| refs.contains(reference.as_str()))
            }
            RemovalTarget::Id(id) => present.contains_key(id.as_str()),
        };
        if still {
            let why = failures
                .get(&target)
                .cloned()
                .unwrap_or_else(|| "the store still lists it after the removal (re-created meanwhile?)".to_string());
            confirmed.not_done.push(NotDone { target, why });
            continue;
        }
        let freed = removal.frees && !present.contains_key(removal.id.as_str());
        // An image the listing the plan was made from did not show is counted as planned.
        let bytes = match freed {
            true => reclaimed.get(removal.id.as_str()).copied().unwrap_or(removal.bytes),
            false => 0,
        };
        if freed {
            confirmed.images += 1;
            confirmed.bytes += bytes;
        }
        let owner = owners.get(&removal.id).cloned().unwrap_or_else(|| UNOWNED.to_string());
        confirmed.done.push(Done { target, owner, bytes });
    }
    confirmed
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::sweep::{Removal, StoreId};
    use std::collections::BTreeMap;

    fn image(id: &str, refs: &[&str], labels: &[(&str, &str)]) -> ListedImage {
        ListedImage {
            id: id.into(),
            refs: refs.iter().map(|r| r.to_string()).collect(),
            digests: vec![],
            labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            bytes: 100,
            layers: Vec::new(),
        }
    }

    fn removal(id: &str, target: RemovalTarget, instance: Option<&str>, frees: bool, bytes: u64) -> Removal {
        Removal { target, id: id.into(), instance: instance.map(str::to_string), frees, bytes }
    }

    fn store_plan(removals: Vec<Removal>) -> StorePlan {
        StorePlan {
            store: StoreId("docker@a".into()),
            freed_bytes: removals.iter().map(|r| r.bytes).sum(),
            removals,
            kept_whole: vec![],
            freed_by_instance: BTreeMap::new(),
        }
    }

    #[test]
    fn bytes_two_removed_images_share_are_confirmed_once_and_a_layer_still_used_not_at_all() {
        let layered = |id: &str, refs: &[&str], layers: &[(&str, u64)]| ListedImage {
            layers: layers.iter().map(|(c, b)| kiln_core::sweep::Layer { chain: c.to_string(), bytes: *b }).collect(),
            ..image(id, refs, &[])
        };
        let before = vec![
            layered("i1", &["a:1"], &[("base", 100_000), ("base/a", 10)]),
            layered("i2", &["b:1"], &[("base", 100_000), ("base/b", 20)]),
            layered("i3", &["c:1"], &[("other", 7), ("other/c", 3)]),
        ];
        let plan = store_plan(vec![
            removal("i1", RemovalTarget::Ref("a:1".into()), Some("a"), true, 0),
            removal("i2", RemovalTarget::Ref("b:1".into()), Some("a"), true, 0),
            removal("i3", RemovalTarget::Ref("c:1".into()), Some("a"), true, 0),
        ]);
        // c's base is still used by an image Kiln does not own, listed by its layers alone.
        let after = vec![layered("x", &[], &[("other", 7)])];
        let confirmed = confirm(&plan, &HashMap::new(), &before, &after, &HashMap::new());
        assert_eq!(confirmed.images, 3);
        assert_eq!(confirmed.bytes, 100_000 + 10 + 20 + 3);
    }

    #[test]
    fn owners_are_the_instance_shared_or_unowned() {
        assert_eq!(owner(&image("i", &[], &[(LABEL_KIND, "image"), (LABEL_INSTANCE, "shop")])), "shop");
        assert_eq!(owner(&image("i", &[], &[(LABEL_KIND, "shared"), (LABEL_INSTANCE, "shop")])), "shared");
        assert_eq!(owner(&image("i", &[], &[(LABEL_KIND, "image"), (LABEL_INSTANCE, "")])), "unowned");
    }

    #[test]
    fn restricting_keeps_one_instances_removals_and_recounts_bytes() {
        let mut plan = Plan {
            stores: vec![store_plan(vec![
                removal("i1", RemovalTarget::Ref("a:1".into()), Some("a"), true, 10),
                removal("i2", RemovalTarget::Ref("b:1".into()), Some("b"), true, 20),
                removal("i3", RemovalTarget::Ref("s:1".into()), None, true, 40),
                removal("i4", RemovalTarget::Ref("a:2".into()), Some("a"), false, 0),
            ])],
        };
        restrict(&mut plan, "a");
        let store = &plan.stores[0];
        let kept: Vec<&str> = store.removals.iter().map(|r| target_text(&r.target)).collect();
        assert_eq!(kept, vec!["a:1", "a:2"]);
        assert_eq!(store.freed_bytes, 10);
        assert_eq!(store.freed_by_instance, BTreeMap::from([("a".to_string(), 10)]));
    }

    #[test]
    fn the_relisting_decides_what_went_and_what_was_freed() {
        let plan = store_plan(vec![
            // Untag one of two refs: gone, frees nothing.
            removal("i1", RemovalTarget::Ref("a:old".into()), Some("a"), false, 0),
            // Last ref of i2: gone, and i2 with it.
            removal("i2", RemovalTarget::Ref("a:gone".into()), Some("a"), true, 100),
            // The agent failed it and the store still lists it.
            removal("i3", RemovalTarget::Ref("a:stuck".into()), Some("a"), true, 100),
            // The agent said removed, but a converge re-tagged it meanwhile.
            removal("i4", RemovalTarget::Ref("a:again".into()), Some("a"), true, 100),
            // A whole-image removal of an untagged image.
            removal("i5", RemovalTarget::Id("i5".into()), None, true, 100),
        ]);
        let after = vec![image("i1", &["a:kept"], &[]), image("i3", &["a:stuck"], &[]), image("i4", &["a:again"], &[])];
        let owners: HashMap<String, String> =
            ["i1", "i2", "i3", "i4"].iter().map(|id| (id.to_string(), "a".to_string())).collect();
        let failures = HashMap::from([("a:stuck".to_string(), "conflict: a container uses it".to_string())]);
        let before: Vec<ListedImage> = ["i1", "i2", "i3", "i4", "i5"].iter().map(|id| image(id, &[], &[])).collect();
        let confirmed = confirm(&plan, &owners, &before, &after, &failures);
        assert_eq!(
            confirmed.done,
            vec![
                Done { target: "a:old".into(), owner: "a".into(), bytes: 0 },
                Done { target: "a:gone".into(), owner: "a".into(), bytes: 100 },
                Done { target: "i5".into(), owner: "unowned".into(), bytes: 100 },
            ]
        );
        assert_eq!(confirmed.not_done.len(), 2);
        assert_eq!(
            confirmed.not_done[0],
            NotDone { target: "a:stuck".into(), why: "conflict: a container uses it".into() }
        );
        assert_eq!(confirmed.not_done[1].target, "a:again");
        assert!(confirmed.not_done[1].why.contains("still lists"), "{}", confirmed.not_done[1].why);
        assert_eq!((confirmed.images, confirmed.bytes), (2, 200));
    }
}
