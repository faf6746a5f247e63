//! The byte ledger the status page shows: what this farm's images hold on each store, by owner,
//! and what a `kiln gc` would free now — the sweep's own dry-run plan ([`super::plan_sweep`]),
//! made by the code that would act on it, so the page can never promise what a gc would not do.
//!
//! Bytes follow the sweep's rule (ARCHITECTURE.md "Bytes are real"): an image's layers, each
//! counted once per owner. Two owners whose images share a base layer both count it, so a store's
//! owners can add up to more than the store holds; what a gc frees is counted once, as the
//! planner counts it.

use std::collections::{BTreeMap, HashSet};

use kiln_core::sweep::{ListedImage, LABEL_FARM, LABEL_KIND};
use serde::Serialize;

use super::Planned;

/// One owner's share of one store.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct OwnerBytes {
    /// An instance, `shared` or `unowned` (the sweep's buckets).
    pub owner: String,
    pub images: u64,
    /// The owner's images' layers, each once.
    pub bytes: u64,
    /// What a gc would free of this owner's images now.
    pub would_free: u64,
}

/// One store, as listed for the plan.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct StoreBytes {
    pub store: String,
    pub agent: String,
    /// Why the store cannot be swept now (its listing failed, or its agent is too old); its
    /// owners are then unknown.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_swept: Option<String>,
    pub owners: Vec<OwnerBytes>,
    /// Removals a gc would send (refs untagged, ids removed).
    pub removals: u64,
    pub would_free: u64,
}

/// The uploaded contexts the coordinator keeps, and what a gc would collect of them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct ContextBytes {
    pub contexts: u64,
    pub bytes: u64,
    pub would_collect: u64,
    pub would_collect_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Ledger {
    pub stores: Vec<StoreBytes>,
    pub would_free: u64,
    pub contexts: ContextBytes,
}

/// The ledger of `planned` for the farm `farm`: only its own Kiln images count as held; the plan
/// never removes anything else anyway.
pub(crate) fn ledger(planned: &Planned, farm: &str) -> Ledger {
    let mut stores = Vec::new();
    for listing in &planned.listings {
        let ours: Vec<&ListedImage> = listing
            .images
            .iter()
            .filter(|i| i.labels.contains_key(LABEL_KIND) && i.labels.get(LABEL_FARM).map(String::as_str) == Some(farm))
            .collect();
        let store_plan = planned.plan.stores.iter().find(|p| p.store == listing.store);
        let mut owners: BTreeMap<String, (u64, HashSet<&str>, u64)> = BTreeMap::new();
        for image in ours {
            let owner = planned.owners.get(&image.id).cloned().unwrap_or_default();
            let (images, layers, whole) = owners.entry(owner).or_default();
            *images += 1;
            if image.layers.is_empty() {
                // Layers unknown: the image counts whole, as the planner counts it.
                *whole += image.bytes;
            }
            for layer in &image.layers {
                layers.insert(layer.chain.as_str());
            }
        }
        let layer_bytes: BTreeMap<&str, u64> =
            listing.images.iter().flat_map(|i| &i.layers).map(|l| (l.chain.as_str(), l.bytes)).collect();
        let mut owners: Vec<OwnerBytes> = owners
            .into_iter()
            .map(|(owner, (images, layers, whole))| OwnerBytes {
                bytes: whole + layers.iter().map(|chain| layer_bytes[chain]).sum::<u64>(),
                would_free: store_plan.and_then(|p| p.freed_by_instance.get(&owner)).copied().unwrap_or(0),
                owner,
                images,
            })
            .collect();
        // An owner the plan frees bytes of but that holds none of this farm's images here
        // (another farm's image, untagged of our hold) still shows what goes.
        for (owner, freed) in store_plan.map(|p| &p.freed_by_instance).into_iter().flatten() {
            if !owners.iter().any(|o| &o.owner == owner) {
                owners.push(OwnerBytes { owner: owner.clone(), would_free: *freed, ..Default::default() });
            }
        }
        stores.push(StoreBytes {
            store: listing.store.to_string(),
            agent: planned.agent_of(&listing.store).unwrap_or_default(),
            not_swept: None,
            owners,
            removals: store_plan.map_or(0, |p| p.removals.len() as u64),
            would_free: store_plan.map_or(0, |p| p.freed_bytes),
        });
    }
    for (store, why) in &planned.skipped {
        stores.push(StoreBytes {
            store: store.to_string(),
            agent: planned.agent_of(store).unwrap_or_default(),
            not_swept: Some(why.clone()),
            ..Default::default()
        });
    }
    stores.sort_by(|a, b| a.store.cmp(&b.store));
    Ledger { would_free: planned.plan.freed_bytes(), stores, contexts: ContextBytes::default() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::sweep::{Layer, Plan, RemovalMode, StoreId, StoreKind, StoreListing, StorePlan, LABEL_INSTANCE};
    use std::collections::HashMap;

    fn image(id: &str, instance: Option<&str>, farm: &str, layers: &[(&str, u64)]) -> ListedImage {
        let mut labels = BTreeMap::from([(LABEL_KIND.to_string(), "image".to_string())]);
        labels.insert(LABEL_FARM.to_string(), farm.to_string());
        if let Some(instance) = instance {
            labels.insert(LABEL_INSTANCE.to_string(), instance.to_string());
        }
        ListedImage {
            id: id.to_string(),
            refs: vec![format!("{id}:1")],
            digests: Vec::new(),
            labels,
            bytes: layers.iter().map(|(_, b)| b).sum(),
            layers: layers.iter().map(|(c, b)| Layer { chain: c.to_string(), bytes: *b }).collect(),
        }
    }

    #[test]
    fn owners_count_their_layers_once_and_show_what_a_gc_frees() {
        let images = vec![
            image("a1", Some("shop"), "f", &[("base", 100), ("a1", 10)]),
            image("a2", Some("shop"), "f", &[("base", 100), ("a2", 20)]),
            image("b1", Some("blog"), "f", &[("base", 100), ("b1", 5)]),
            // Another farm's image on the same daemon: not this farm's bytes.
            image("x1", Some("shop"), "other", &[("x", 1000)]),
        ];
        let owners = images.iter().map(|i| (i.id.clone(), super::super::owner(i))).collect::<HashMap<_, _>>();
        let store = StoreId("docker@h1".into());
        let planned = Planned {
            listings: vec![StoreListing {
                store: store.clone(),
                kind: StoreKind::Host,
                removal: RemovalMode::PerRef,
                runs_workloads: false,
                images,
            }],
            plan: Plan {
                stores: vec![StorePlan {
                    store: store.clone(),
                    removals: Vec::new(),
                    kept_whole: Vec::new(),
                    freed_bytes: 20,
                    freed_by_instance: BTreeMap::from([("shop".to_string(), 20)]),
                }],
            },
            owners,
            records: Vec::new(),
            skipped: vec![(StoreId("containerd@n1".into()), "listing it failed: gone".into())],
            by_store: HashMap::new(),
        };
        let ledger = ledger(&planned, "f");
        assert_eq!(ledger.would_free, 20);
        assert_eq!(ledger.stores.len(), 2);
        assert_eq!(ledger.stores[0].store, "containerd@n1");
        assert_eq!(ledger.stores[0].not_swept.as_deref(), Some("listing it failed: gone"));
        let host = &ledger.stores[1];
        assert_eq!(host.would_free, 20);
        let by = |o: &str| host.owners.iter().find(|x| x.owner == o).cloned().unwrap();
        assert_eq!(by("shop"), OwnerBytes { owner: "shop".into(), images: 2, bytes: 130, would_free: 20 });
        assert_eq!(by("blog"), OwnerBytes { owner: "blog".into(), images: 1, bytes: 105, would_free: 0 });
        assert_eq!(host.owners.len(), 2, "{:?}", host.owners);
    }
}
