//! Example-based tests for the cases the property tests reach only by luck: mixed ids on CRI,
//! kind's `import-*` alias, dangling host images, digest roots, and the grace generation.

use std::collections::BTreeMap;

use super::*;

const FARM: &str = "farm-a";

fn hex(n: u8) -> String {
    format!("{:064x}", u64::from(n) + 0xa000)
}

fn id(n: u8) -> String {
    format!("sha256:{}", hex(n))
}

fn labels(instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_KIND.to_owned(), "image".to_owned()),
        (LABEL_INSTANCE.to_owned(), instance.to_owned()),
        (LABEL_FARM.to_owned(), FARM.to_owned()),
    ])
}

fn image(n: u8, refs: &[&str], bytes: u64) -> ListedImage {
    ListedImage {
        id: id(n),
        refs: refs.iter().map(|r| (*r).to_owned()).collect(),
        digests: vec![format!("sha256:{:064x}", u64::from(n) + 0xd000)],
        labels: labels("shop"),
        bytes,
        layers: Vec::new(),
    }
}

fn store(name: &str, kind: StoreKind, removal: RemovalMode, images: Vec<ListedImage>) -> StoreListing {
    StoreListing { store: StoreId(name.to_owned()), kind, removal, runs_workloads: false, images }
}

fn policy() -> Policy {
    Policy { farm: FARM.to_owned() }
}

fn claims(refs: &[&str]) -> Roots {
    Roots { claims: refs.iter().map(|r| (*r).to_owned()).collect(), ..Roots::default() }
}

fn targets(plan: &StorePlan) -> Vec<(RemovalTarget, bool)> {
    plan.removals.iter().map(|removal| (removal.target.clone(), removal.frees)).collect()
}

fn r(raw: &str) -> RemovalTarget {
    RemovalTarget::Ref(raw.to_owned())
}

#[test]
fn a_mixed_id_on_a_cri_store_is_kept_whole_and_reported() {
    let node = store(
        "node-1",
        StoreKind::Node,
        RemovalMode::PerId,
        vec![image(1, &["docker.io/library/api:new", "docker.io/library/api:old"], 100)],
    );
    let plan = plan(&[node], &claims(&["api:new"]), &policy());
    let store = &plan.stores[0];
    assert!(store.removals.is_empty());
    assert_eq!(
        store.kept_whole,
        vec![KeptWhole {
            id: id(1),
            kept_by: "docker.io/library/api:new".to_owned(),
            garbage_refs: vec!["docker.io/library/api:old".to_owned()],
        }]
    );
    assert_eq!(store.freed_bytes, 0);
}

#[test]
fn an_all_garbage_id_on_a_cri_store_goes_as_one_removal_by_id() {
    let node = store(
        "node-1",
        StoreKind::Node,
        RemovalMode::PerId,
        vec![image(1, &["docker.io/library/api:old", "docker.io/library/api:older"], 100)],
    );
    let plan = plan(&[node], &Roots::default(), &policy());
    assert_eq!(targets(&plan.stores[0]), vec![(RemovalTarget::Id(id(1)), true)]);
    assert_eq!(plan.stores[0].freed_bytes, 100);
    assert_eq!(plan.stores[0].freed_by_instance, BTreeMap::from([("shop".to_owned(), 100)]));
}

#[test]
fn the_import_alias_goes_last_with_its_named_ref() {
    let import = format!("import-2026-11-29@{}", id(9));
    let id_ref = id(1);
    let node = store(
        "node-1",
        StoreKind::Node,
        RemovalMode::PerRef,
        vec![image(1, &[&import, "docker.io/library/api:old", &id_ref], 100)],
    );
    let plan = plan(&[node], &Roots::default(), &policy());
    assert_eq!(
        targets(&plan.stores[0]),
        vec![(r("docker.io/library/api:old"), false), (r(&import), false), (r(&id_ref), true),]
    );
    assert_eq!(plan.stores[0].removals[2].bytes, 100);
}

#[test]
fn aliases_stay_while_a_named_ref_of_their_id_is_kept() {
    let import = format!("import-2026-11-29@{}", id(9));
    let node = store(
        "node-1",
        StoreKind::Node,
        RemovalMode::PerRef,
        vec![image(1, &[&import, "docker.io/library/api:new", "docker.io/library/api:old"], 100)],
    );
    let plan = plan(&[node], &claims(&["docker.io/library/api:new"]), &policy());
    assert_eq!(targets(&plan.stores[0]), vec![(r("docker.io/library/api:old"), false)]);
    assert_eq!(plan.stores[0].freed_bytes, 0);
}

#[test]
fn a_dangling_host_image_is_removed_by_id_unless_its_id_is_a_root() {
    let host = store("host", StoreKind::Host, RemovalMode::PerRef, vec![image(1, &[], 70)]);
    let swept = plan(std::slice::from_ref(&host), &Roots::default(), &policy());
    assert_eq!(targets(&swept.stores[0]), vec![(RemovalTarget::Id(id(1)), true)]);
    assert_eq!(swept.stores[0].freed_bytes, 70);

    let used = Roots { workloads: BTreeMap::from([(StoreId("host".to_owned()), vec![id(1)])]), ..Roots::default() };
    assert!(plan(&[host], &used, &policy()).is_empty());
}

#[test]
fn a_digest_root_keeps_the_image_whatever_its_names() {
    let pinned = image(1, &["api:old", "api:older"], 100);
    let digest = pinned.digests[0].clone();
    let host = store("host", StoreKind::Host, RemovalMode::PerRef, vec![pinned]);
    for root in [format!("other/name@{digest}"), digest.clone(), id(1), format!("api:t@{}", id(1))] {
        let plan = plan(std::slice::from_ref(&host), &claims(&[&root]), &policy());
        assert!(plan.is_empty(), "{root} did not keep the image: {plan:?}");
    }
}

#[test]
fn the_previous_generation_is_grace_only_where_images_run() {
    let roots = Roots {
        records: vec![InstanceRecord {
            instance: "shop".to_owned(),
            current: vec!["api:new".to_owned()],
            previous: vec!["api:old".to_owned()],
        }],
        ..Roots::default()
    };
    let images = || vec![image(1, &["api:new"], 10), image(2, &["api:old"], 20)];
    let host = store("host", StoreKind::Host, RemovalMode::PerRef, images());
    let mut local = store("local", StoreKind::Host, RemovalMode::PerRef, images());
    local.runs_workloads = true;
    let node = store("node", StoreKind::Node, RemovalMode::PerRef, images());

    let plan = plan(&[node, local, host], &roots, &policy());
    let by_store: BTreeMap<&str, Vec<(RemovalTarget, bool)>> =
        plan.stores.iter().map(|store| (store.store.0.as_str(), targets(store))).collect();
    assert_eq!(by_store["host"], vec![(r("api:old"), true)]);
    assert!(by_store["local"].is_empty());
    assert!(by_store["node"].is_empty());
}

#[test]
fn only_this_farms_labeled_images_are_candidates() {
    let mut other_farm = image(1, &["api:a"], 1);
    other_farm.labels.insert(LABEL_FARM.to_owned(), "farm-b".to_owned());
    let mut unlabeled = image(2, &["api:b"], 1);
    unlabeled.labels.clear();
    let mut cleared = image(3, &["api:c"], 1);
    cleared.labels.insert(LABEL_KIND.to_owned(), String::new());
    let mut shared = image(4, &["base:d"], 5);
    shared.labels.insert(LABEL_KIND.to_owned(), KIND_SHARED.to_owned());
    shared.labels.remove(LABEL_INSTANCE);
    let host = store("host", StoreKind::Host, RemovalMode::PerRef, vec![other_farm, unlabeled, cleared, shared]);
    let plan = plan(&[host], &Roots::default(), &policy());
    assert_eq!(targets(&plan.stores[0]), vec![(r("base:d"), true)]);
    assert_eq!(plan.stores[0].removals[0].instance, None);
    assert_eq!(plan.stores[0].freed_by_instance, BTreeMap::from([(KIND_SHARED.to_owned(), 5)]));
}

#[test]
fn workloads_keep_only_on_their_own_store() {
    let images = || vec![image(1, &["api:t"], 10)];
    let a = store("a", StoreKind::Host, RemovalMode::PerRef, images());
    let b = store("b", StoreKind::Host, RemovalMode::PerRef, images());
    let roots = Roots {
        workloads: BTreeMap::from([(StoreId("a".to_owned()), vec!["docker.io/library/api:t".to_owned()])]),
        ..Roots::default()
    };
    let plan = plan(&[b, a], &roots, &policy());
    assert_eq!(plan.stores[0].store.0, "a");
    assert!(plan.stores[0].removals.is_empty());
    assert_eq!(targets(&plan.stores[1]), vec![(r("api:t"), true)]);
}

#[test]
fn applying_a_plan_drops_removed_refs_and_emptied_images() {
    let listings = vec![store(
        "host",
        StoreKind::Host,
        RemovalMode::PerRef,
        vec![image(1, &["api:new", "api:old"], 10), image(2, &["api:gone"], 20)],
    )];
    let plan = plan(&listings, &claims(&["api:new"]), &policy());
    let after = plan.apply_to(&listings);
    assert_eq!(after[0].images.len(), 1);
    assert_eq!(after[0].images[0].refs, vec!["api:new".to_owned()]);
    assert!(super::plan(&after, &claims(&["api:new"]), &policy()).is_empty());
}

fn layered(n: u8, refs: &[&str], layers: &[(&str, u64)]) -> ListedImage {
    let layers: Vec<Layer> =
        layers.iter().map(|(chain, bytes)| Layer { chain: (*chain).to_owned(), bytes: *bytes }).collect();
    let bytes = layers.iter().map(|l| l.bytes).sum();
    ListedImage { layers, ..image(n, refs, bytes) }
}

#[test]
fn two_doomed_images_sharing_a_layer_free_it_once() {
    // b is a built FROM a: Docker lists both at 100 kB + their own, but the base layer is on disk once.
    let host = store(
        "host",
        StoreKind::Host,
        RemovalMode::PerRef,
        vec![layered(1, &["a:old"], &[("base", 100_000)]), layered(2, &["b:old"], &[("base", 100_000), ("base+b", 5)])],
    );
    let plan = plan(&[host], &Roots::default(), &policy());
    let store = &plan.stores[0];
    assert_eq!(store.freed_bytes, 100_005);
    let bytes: Vec<u64> = store.removals.iter().map(|r| r.bytes).collect();
    assert_eq!(bytes, vec![100_000, 5], "each layer is counted against the first image that frees it");
    assert_eq!(store.freed_by_instance, BTreeMap::from([("shop".to_owned(), 100_005)]));
}

#[test]
fn a_layer_an_image_outside_kiln_still_uses_is_not_freed() {
    // The busybox base nobody labeled is listed by its layers alone: no refs, no labels.
    let base = ListedImage {
        id: id(7),
        refs: vec![],
        digests: vec![],
        labels: BTreeMap::new(),
        bytes: 0,
        layers: vec![Layer { chain: "busybox".into(), bytes: 0 }],
    };
    let host = store(
        "host",
        StoreKind::Host,
        RemovalMode::PerRef,
        vec![base, layered(1, &["a:old"], &[("busybox", 900_000), ("busybox+a", 10)])],
    );
    let plan = plan(&[host], &Roots::default(), &policy());
    assert_eq!(targets(&plan.stores[0]), vec![(r("a:old"), true)], "the base itself is never a candidate");
    assert_eq!(plan.stores[0].freed_bytes, 10);
}

fn of_farm(image: ListedImage, farm: &str) -> ListedImage {
    let mut labels = image.labels.clone();
    labels.insert(LABEL_FARM.to_owned(), farm.to_owned());
    ListedImage { labels, ..image }
}

#[test]
fn another_farms_hold_keeps_every_ref_of_the_owners_image() {
    let hold = hold_ref("farm-b", "app:4a77b1c2d3e4-amd64").unwrap();
    let host =
        store("host", StoreKind::Host, RemovalMode::PerRef, vec![image(1, &["app:4a77b1c2d3e4-amd64", &hold], 50)]);
    // farm-a (the owner) has no root left for it: without the hold, its sweep would take the tag.
    let plan_a = plan(std::slice::from_ref(&host), &Roots::default(), &policy());
    assert!(plan_a.stores[0].removals.is_empty(), "{:?}", plan_a.stores[0].removals);
    let unheld = store("host", StoreKind::Host, RemovalMode::PerRef, vec![image(1, &["app:4a77b1c2d3e4-amd64"], 50)]);
    assert_eq!(
        targets(&plan(&[unheld], &Roots::default(), &policy()).stores[0]),
        vec![(r("app:4a77b1c2d3e4-amd64"), true)]
    );
}

#[test]
fn a_farm_drops_its_own_hold_once_no_root_of_its_own_names_the_image() {
    let tag = "app:4a77b1c2d3e4-amd64";
    let hold = hold_ref("farm-b", tag).unwrap();
    let host = store("host", StoreKind::Host, RemovalMode::PerRef, vec![image(1, &[tag, &hold], 50)]);
    let b = Policy { farm: "farm-b".into() };
    // farm-b's record still names the tag: the hold stays, and farm-b never touches farm-a's tag.
    let kept = plan(std::slice::from_ref(&host), &claims(&[tag]), &b);
    assert!(kept.stores[0].removals.is_empty());
    // Its reliance ended: only its hold goes, freeing nothing; the owner's tag is not farm-b's.
    let released = plan(&[host], &Roots::default(), &b);
    assert_eq!(targets(&released.stores[0]), vec![(r(&hold), false)]);
    assert_eq!(released.stores[0].freed_bytes, 0);
    // A third farm's hold on the same image is not farm-b's either.
    let c_hold = hold_ref("farm-c", tag).unwrap();
    let third =
        store("host", StoreKind::Host, RemovalMode::PerRef, vec![of_farm(image(1, &[tag, &c_hold], 50), "farm-a")]);
    assert!(plan(&[third], &Roots::default(), &b).stores[0].removals.is_empty());
}

#[test]
fn a_plan_with_removals_is_not_empty_and_frees_the_sum_of_its_stores() {
    let host = store("host", StoreKind::Host, RemovalMode::PerRef, vec![image(1, &["api:old"], 70)]);
    let node = store("node", StoreKind::Node, RemovalMode::PerId, vec![image(2, &["api:older"], 30)]);
    let plan = plan(&[host, node], &Roots::default(), &policy());
    assert!(!plan.is_empty());
    assert_eq!(plan.freed_bytes(), 100);
    assert_eq!(plan.stores.iter().map(|store| store.freed_bytes).collect::<Vec<_>>(), vec![70, 30]);
}

#[test]
fn a_plan_that_only_reports_ids_kept_whole_is_empty() {
    let node = store("node", StoreKind::Node, RemovalMode::PerId, vec![image(1, &["api:new", "api:old"], 100)]);
    let plan = plan(&[node], &claims(&["api:new"]), &policy());
    assert_eq!(plan.stores[0].kept_whole.len(), 1);
    assert!(plan.is_empty());
    assert_eq!(plan.freed_bytes(), 0);
}

#[test]
fn a_store_id_displays_as_its_name() {
    assert_eq!(StoreId("kind:worker@agent-1".to_owned()).to_string(), "kind:worker@agent-1");
}

#[test]
fn the_exposed_normalization_names_names_and_not_aliases() {
    assert_eq!(canonical_name("docker.io/library/api").as_deref(), Some("api:latest"));
    assert_eq!(canonical_name(&id(1)), None);
}

#[test]
fn a_rooted_digest_a_ref_carries_keeps_the_image_though_the_listing_left_it_out() {
    // Some stores list a pinned ref (`repo@sha256:…`) without the digest in the digest column.
    let digest = format!("sha256:{:064x}", 0xbeef_u64);
    let mut pinned = image(1, &["api:old"], 100);
    pinned.digests.clear();
    pinned.refs.push(format!("api@{digest}"));
    let host = store("host", StoreKind::Host, RemovalMode::PerRef, vec![pinned]);
    assert!(plan(std::slice::from_ref(&host), &claims(&[&digest]), &policy()).is_empty());
    // And it is that digest that keeps it: another one does not.
    let other = format!("sha256:{:064x}", 0xcafe_u64);
    assert!(!plan(&[host], &claims(&[&other]), &policy()).is_empty());
}

#[test]
fn a_rooted_digest_an_import_alias_carries_keeps_the_image_though_the_listing_left_it_out() {
    let digest = format!("sha256:{:064x}", 0xbeef_u64);
    let mut loaded = image(1, &["api:old"], 100);
    loaded.digests.clear();
    loaded.refs.push(format!("import-2024-05-01@{digest}"));
    let node = store("node-1", StoreKind::Node, RemovalMode::PerRef, vec![loaded]);
    assert!(plan(std::slice::from_ref(&node), &claims(&[&digest]), &policy()).is_empty());
    let other = format!("sha256:{:064x}", 0xcafe_u64);
    assert!(!plan(&[node], &claims(&[&other]), &policy()).is_empty());
}

#[test]
fn applying_a_plan_keeps_a_dangling_image_that_lost_nothing() {
    let host = store("host", StoreKind::Host, RemovalMode::PerRef, vec![image(1, &[], 70), image(2, &["api:new"], 10)]);
    let used = Roots {
        claims: vec!["api:new".to_owned()],
        workloads: BTreeMap::from([(StoreId("host".to_owned()), vec![id(1)])]),
        ..Roots::default()
    };
    let plan = plan(std::slice::from_ref(&host), &used, &policy());
    assert!(plan.is_empty(), "{plan:?}");
    let after = plan.apply_to(&[host]);
    let ids: Vec<&str> = after[0].images.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(ids, vec![id(1).as_str(), id(2).as_str()], "a dangling image a root keeps stays listed");
}
