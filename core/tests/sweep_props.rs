//! Property tests for the sweep planner: over many small made-up universes — a pool of repos and
//! tags spelled every way Docker and containerd spell them, images labeled and not, host and node
//! stores in both removal modes, roots of every kind — the plan never removes what a root names,
//! never touches what this farm did not build, honours CRI's all-or-nothing rule and the grace
//! generation, and leaves nothing for a second plan to do.
//!
//! The checks parse refs with their own deliberately plain normalization rather than the
//! planner's, so a bug in the planner's normalization cannot hide itself.
//!
//! Runs 2,000 cases by default (`PROPTEST_CASES` overrides). The release run:
//!
//! ```text
//! PROPTEST_CASES=100000 cargo test --release -p kiln-core --test sweep_props
//! ```

use std::collections::{BTreeMap, HashSet};

use kiln_core::sweep::{
    plan, InstanceRecord, ListedImage, Plan, Policy, RemovalMode, RemovalTarget, Roots, StoreId, StoreKind,
    StoreListing, LABEL_FARM, LABEL_INSTANCE, LABEL_KIND,
};
use proptest::prelude::*;

const FARM: &str = "farm-a";
const REPOS: [&str; 8] = ["api", "web", "worker", "base", "team/cron", "team/db", "tools/lint", "jobs"];
const TAGS: [&str; 3] = ["latest", "t1", "t2"];
const REF_SLOTS: usize = REPOS.len() * TAGS.len();
const IDS: usize = 10;
const MAX_IMAGES: usize = 5;
const STORES: usize = 3;
const RECORDS: usize = 2;

fn id(i: usize) -> String {
    format!("sha256:{:064x}", 0x1000 + i)
}

/// The repo/manifest digest image `i` answers to (also what kind's import alias carries).
fn digest(i: usize) -> String {
    format!("sha256:{:064x}", 0x2000 + i)
}

#[derive(Debug, Clone, Copy)]
enum Spelling {
    Short,
    Hub,
    Index,
}

fn spelled(repo: &str, spelling: Spelling) -> String {
    let hub_path = if repo.contains('/') { repo.to_owned() } else { format!("library/{repo}") };
    match spelling {
        Spelling::Short => repo.to_owned(),
        Spelling::Hub => format!("docker.io/{hub_path}"),
        Spelling::Index => format!("index.docker.io/{hub_path}"),
    }
}

fn spelling() -> impl Strategy<Value = Spelling> {
    prop_oneof![Just(Spelling::Short), Just(Spelling::Hub), Just(Spelling::Index)]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Label {
    None,
    KindOnly,
    ThisFarm,
    OtherFarm,
    /// `kiln.dev/kind=` — how a derived image clears the label it inherited.
    ClearedKind,
}

#[derive(Debug, Clone)]
struct ImageSpec {
    label: Label,
    shared: bool,
    import_alias: bool,
    id_alias: bool,
    digest_ref: bool,
    bytes: u64,
}

#[derive(Debug, Clone)]
struct StoreSpec {
    kind: StoreKind,
    mode: RemovalMode,
    runs_workloads: bool,
    ids: Vec<usize>,
    images: Vec<ImageSpec>,
    /// For each (repo, tag) of the pool: which of this store's images wears it, if any.
    slots: Vec<Option<usize>>,
    spellings: Vec<Spelling>,
}

#[derive(Debug, Clone)]
enum Place {
    Claim,
    Current(usize),
    Previous(usize),
    Kubernetes,
    Pin,
    Workload(usize),
}

#[derive(Debug, Clone)]
enum RootForm {
    Name(usize, usize, Spelling),
    /// `x` with no tag, meaning `x:latest`.
    Untagged(usize, Spelling),
    RepoAtId(usize, usize),
    RepoAtDigest(usize, usize),
    TagAtDigest(usize, usize, usize),
    BareId(usize),
    BareDigest(usize),
    /// The same repo and tag on another registry: must keep nothing here.
    Foreign(usize, usize),
}

fn image_spec() -> impl Strategy<Value = ImageSpec> {
    let label = prop_oneof![
        1 => Just(Label::None),
        1 => Just(Label::KindOnly),
        5 => Just(Label::ThisFarm),
        1 => Just(Label::OtherFarm),
        1 => Just(Label::ClearedKind),
    ];
    (label, any::<bool>(), any::<bool>(), any::<bool>(), prop::bool::weighted(0.2), 1u64..1000).prop_map(
        |(label, shared, import_alias, id_alias, digest_ref, bytes)| ImageSpec {
            label,
            shared,
            import_alias,
            id_alias,
            digest_ref,
            bytes,
        },
    )
}

fn store_spec() -> impl Strategy<Value = StoreSpec> {
    (
        prop_oneof![Just(StoreKind::Host), Just(StoreKind::Node)],
        prop_oneof![Just(RemovalMode::PerRef), Just(RemovalMode::PerId)],
        any::<bool>(),
        prop::sample::subsequence((0..IDS).collect::<Vec<_>>(), 0..=MAX_IMAGES),
        prop::collection::vec(image_spec(), MAX_IMAGES),
        prop::collection::vec(prop::option::weighted(0.5, 0..MAX_IMAGES), REF_SLOTS),
        prop::collection::vec(spelling(), REF_SLOTS),
    )
        .prop_map(|(kind, mode, runs_workloads, ids, images, slots, spellings)| StoreSpec {
            kind,
            mode,
            runs_workloads,
            ids,
            images,
            slots,
            spellings,
        })
}

fn root() -> impl Strategy<Value = (Place, RootForm)> {
    let place = prop_oneof![
        2 => Just(Place::Claim),
        2 => (0..RECORDS).prop_map(Place::Current),
        4 => (0..RECORDS).prop_map(Place::Previous),
        1 => Just(Place::Kubernetes),
        1 => Just(Place::Pin),
        2 => (0..STORES).prop_map(Place::Workload),
    ];
    let repo = 0..REPOS.len();
    let tag = 0..TAGS.len();
    let image = 0..IDS;
    let form = prop_oneof![
        8 => (repo.clone(), tag.clone(), spelling()).prop_map(|(r, t, s)| RootForm::Name(r, t, s)),
        2 => (repo.clone(), spelling()).prop_map(|(r, s)| RootForm::Untagged(r, s)),
        1 => (repo.clone(), image.clone()).prop_map(|(r, i)| RootForm::RepoAtId(r, i)),
        1 => (repo.clone(), image.clone()).prop_map(|(r, i)| RootForm::RepoAtDigest(r, i)),
        1 => (repo.clone(), tag.clone(), image.clone()).prop_map(|(r, t, i)| RootForm::TagAtDigest(r, t, i)),
        1 => image.clone().prop_map(RootForm::BareId),
        1 => image.prop_map(RootForm::BareDigest),
        1 => (repo, tag).prop_map(|(r, t)| RootForm::Foreign(r, t)),
    ];
    (place, form)
}

#[derive(Debug, Clone)]
struct Universe {
    listings: Vec<StoreListing>,
    roots: Roots,
}

fn universe() -> impl Strategy<Value = Universe> {
    (prop::collection::vec(store_spec(), 1..=STORES), prop::collection::vec(root(), 0..16)).prop_map(
        |(stores, roots)| Universe {
            listings: stores.iter().enumerate().map(|(n, spec)| listing(n, spec)).collect(),
            roots: build_roots(&roots),
        },
    )
}

fn store_id(n: usize) -> StoreId {
    StoreId(format!("s{n}"))
}

fn listing(n: usize, spec: &StoreSpec) -> StoreListing {
    let images = spec
        .ids
        .iter()
        .zip(&spec.images)
        .enumerate()
        .map(|(slot, (&i, image))| {
            let mut refs: Vec<String> = (0..REF_SLOTS)
                .filter(|&s| spec.slots[s] == Some(slot))
                .map(|s| {
                    let (repo, tag) = (REPOS[s / TAGS.len()], TAGS[s % TAGS.len()]);
                    format!("{}:{tag}", spelled(repo, spec.spellings[s]))
                })
                .collect();
            if image.digest_ref {
                refs.push(format!("{}@{}", spelled(REPOS[i % REPOS.len()], Spelling::Hub), digest(i)));
            }
            if spec.kind == StoreKind::Node {
                if image.import_alias {
                    refs.push(format!("import-2026-11-29@{}", digest(i)));
                }
                if image.id_alias {
                    refs.push(id(i));
                }
            }
            let mut labels = BTreeMap::new();
            let kind = if image.shared { "shared" } else { "image" };
            match image.label {
                Label::None => {}
                Label::KindOnly => {
                    labels.insert(LABEL_KIND.to_owned(), kind.to_owned());
                }
                Label::ThisFarm | Label::OtherFarm | Label::ClearedKind => {
                    let farm = if image.label == Label::OtherFarm { "farm-b" } else { FARM };
                    let kind = if image.label == Label::ClearedKind { "" } else { kind };
                    labels.insert(LABEL_KIND.to_owned(), kind.to_owned());
                    labels.insert(LABEL_FARM.to_owned(), farm.to_owned());
                }
            }
            if !image.shared && image.label != Label::None {
                labels.insert(LABEL_INSTANCE.to_owned(), format!("inst{}", i % 3));
            }
            ListedImage { id: id(i), refs, digests: vec![digest(i)], labels, bytes: image.bytes, layers: Vec::new() }
        })
        .collect();
    StoreListing {
        store: store_id(n),
        kind: spec.kind,
        removal: spec.mode,
        runs_workloads: spec.runs_workloads,
        images,
    }
}

fn build_roots(roots: &[(Place, RootForm)]) -> Roots {
    let mut built = Roots {
        records: (0..RECORDS)
            .map(|n| InstanceRecord { instance: format!("inst{n}"), ..InstanceRecord::default() })
            .collect(),
        ..Roots::default()
    };
    for (place, form) in roots {
        let raw = match *form {
            RootForm::Name(r, t, s) => format!("{}:{}", spelled(REPOS[r], s), TAGS[t]),
            RootForm::Untagged(r, s) => spelled(REPOS[r], s),
            RootForm::RepoAtId(r, i) => format!("{}@{}", REPOS[r], id(i)),
            RootForm::RepoAtDigest(r, i) => {
                format!("{}@{}", spelled(REPOS[r], Spelling::Hub), digest(i))
            }
            RootForm::TagAtDigest(r, t, i) => format!("{}:{}@{}", REPOS[r], TAGS[t], digest(i)),
            RootForm::BareId(i) => id(i),
            RootForm::BareDigest(i) => digest(i),
            RootForm::Foreign(r, t) => format!("reg.example.com:5000/{}:{}", REPOS[r], TAGS[t]),
        };
        match *place {
            Place::Claim => built.claims.push(raw),
            Place::Current(n) => built.records[n].current.push(raw),
            Place::Previous(n) => built.records[n].previous.push(raw),
            Place::Kubernetes => built.kubernetes.push(raw),
            Place::Pin => built.pins.push(raw),
            Place::Workload(n) => built.workloads.entry(store_id(n)).or_default().push(raw),
        }
    }
    built
}

/// A ref read the plain way: its canonical name (None for containerd's id-shaped aliases) and
/// the digest it carries.
struct Parsed {
    name: Option<String>,
    digest: Option<String>,
}

fn parse(raw: &str) -> Parsed {
    if raw.starts_with("sha256:") && raw.len() == 71 {
        return Parsed { name: None, digest: Some(raw.to_owned()) };
    }
    let (mut path, digest) = match raw.split_once('@') {
        Some((path, digest)) => (path, Some(digest.to_owned())),
        None => (raw, None),
    };
    for hub in ["index.docker.io/", "docker.io/"] {
        path = path.strip_prefix(hub).unwrap_or(path);
    }
    if let Some(official) = path.strip_prefix("library/") {
        if !official.contains('/') {
            path = official;
        }
    }
    if path.starts_with("import-") && digest.is_some() {
        return Parsed { name: None, digest };
    }
    let tagged = path.rsplit('/').next().unwrap().contains(':');
    let mut name = path.to_owned();
    if !tagged && digest.is_none() {
        name.push_str(":latest");
    }
    if let Some(digest) = &digest {
        name = format!("{name}@{digest}");
    }
    Parsed { name: Some(name), digest }
}

#[derive(Default)]
struct Names {
    names: HashSet<String>,
    digests: HashSet<String>,
}

impl Names {
    fn add(&mut self, raws: &[String]) {
        for raw in raws {
            let parsed = parse(raw);
            self.names.extend(parsed.name);
            self.digests.extend(parsed.digest);
        }
    }

    fn names_by_digest(&self, image: &ListedImage) -> bool {
        self.digests.contains(&image.id) || image.digests.iter().any(|d| self.digests.contains(d))
    }
}

/// The roots that apply to one store, split into the grace generation and everything else.
fn roots_for(roots: &Roots, listing: &StoreListing) -> (Names, Names) {
    let mut others = Names::default();
    let mut previous = Names::default();
    for record in &roots.records {
        others.add(&record.current);
        previous.add(&record.previous);
    }
    others.add(&roots.claims);
    others.add(&roots.kubernetes);
    others.add(&roots.pins);
    if let Some(used) = roots.workloads.get(&listing.store) {
        others.add(used);
    }
    (others, previous)
}

fn gets_grace(listing: &StoreListing) -> bool {
    listing.kind == StoreKind::Node || listing.runs_workloads
}

fn is_candidate(image: &ListedImage) -> bool {
    image.labels.get(LABEL_KIND).is_some_and(|kind| !kind.is_empty())
        && image.labels.get(LABEL_FARM).map(String::as_str) == Some(FARM)
}

fn policy() -> Policy {
    Policy { farm: FARM.to_owned() }
}

fn removed_refs<'a>(plan: &'a Plan, store: &StoreId, image: &'a ListedImage) -> HashSet<&'a str> {
    let store_plan = plan.stores.iter().find(|s| &s.store == store).unwrap();
    let mut removed = HashSet::new();
    for removal in store_plan.removals.iter().filter(|r| r.id == image.id) {
        match &removal.target {
            RemovalTarget::Id(_) => removed.extend(image.refs.iter().map(String::as_str)),
            RemovalTarget::Ref(raw) => {
                removed.insert(raw.as_str());
            }
        }
    }
    removed
}

fn is_removed_whole(plan: &Plan, store: &StoreId, image: &ListedImage) -> bool {
    let store_plan = plan.stores.iter().find(|s| &s.store == store).unwrap();
    store_plan.removals.iter().any(|r| r.id == image.id && (r.frees || r.target == RemovalTarget::Id(image.id.clone())))
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|cases| cases.parse().ok()).unwrap_or(2_000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn no_plan_removes_what_a_root_names(u in universe()) {
        let plan = plan(&u.listings, &u.roots, &policy());
        for listing in &u.listings {
            let (mut applicable, previous) = roots_for(&u.roots, listing);
            if gets_grace(listing) {
                applicable.names.extend(previous.names);
                applicable.digests.extend(previous.digests);
            }
            let store_plan = plan.stores.iter().find(|s| s.store == listing.store).unwrap();
            for removal in &store_plan.removals {
                let image = listing.images.iter().find(|i| i.id == removal.id);
                prop_assert!(image.is_some(), "removal of an unlisted id {}", removal.id);
            }
            for image in &listing.images {
                let removed = removed_refs(&plan, &listing.store, image);
                let whole = is_removed_whole(&plan, &listing.store, image);
                if removed.is_empty() && !whole {
                    continue;
                }
                prop_assert!(!applicable.names_by_digest(image), "{} is named by digest", image.id);
                for raw in &removed {
                    let parsed = parse(raw);
                    match parsed.name {
                        Some(name) => prop_assert!(!applicable.names.contains(&name), "{raw} is a root"),
                        // An alias goes only with the whole id: every name of it goes too.
                        None => prop_assert!(
                            image.refs.iter().all(|r| removed.contains(r.as_str())),
                            "alias {raw} removed while {} keeps a name", image.id
                        ),
                    }
                }
            }
        }
    }

    #[test]
    fn only_this_farms_labeled_images_are_touched(u in universe()) {
        let plan = plan(&u.listings, &u.roots, &policy());
        let after = plan.apply_to(&u.listings);
        for (listing, after) in u.listings.iter().zip(&after) {
            let store_plan = plan.stores.iter().find(|s| s.store == listing.store).unwrap();
            let touched = store_plan.removals.iter().map(|r| &r.id)
                .chain(store_plan.kept_whole.iter().map(|k| &k.id));
            for id in touched {
                let image = listing.images.iter().find(|i| &i.id == id).unwrap();
                prop_assert!(is_candidate(image), "{id} is not this farm's: {:?}", image.labels);
            }
            let untouchable = |images: &[ListedImage]| -> Vec<ListedImage> {
                images.iter().filter(|i| !is_candidate(i)).cloned().collect()
            };
            prop_assert_eq!(untouchable(&listing.images), untouchable(&after.images));
        }
    }

    #[test]
    fn cri_stores_remove_only_all_garbage_ids_and_report_mixed_ones(u in universe()) {
        let plan = plan(&u.listings, &u.roots, &policy());
        for listing in u.listings.iter().filter(|l| l.kind == StoreKind::Node && l.removal == RemovalMode::PerId) {
            let (mut applicable, previous) = roots_for(&u.roots, listing);
            applicable.names.extend(previous.names);
            applicable.digests.extend(previous.digests);
            let store_plan = plan.stores.iter().find(|s| s.store == listing.store).unwrap();
            for removal in &store_plan.removals {
                prop_assert_eq!(&removal.target, &RemovalTarget::Id(removal.id.clone()));
            }
            for image in listing.images.iter().filter(|i| is_candidate(i)) {
                let names: Vec<String> = image.refs.iter().filter_map(|r| parse(r).name).collect();
                let kept = names.iter().filter(|n| applicable.names.contains(*n)).count();
                let removed = store_plan.removals.iter().any(|r| r.id == image.id);
                let reported = store_plan.kept_whole.iter().find(|k| k.id == image.id);
                if kept > 0 {
                    prop_assert!(!removed, "{} has a kept name and was removed", image.id);
                }
                let mixed = kept > 0 && kept < names.len() && !applicable.names_by_digest(image);
                prop_assert_eq!(mixed, reported.is_some(), "{} mixed={}", image.id, mixed);
                if let Some(report) = reported {
                    prop_assert!(applicable.names.contains(&parse(&report.kept_by).name.unwrap()));
                    prop_assert_eq!(report.garbage_refs.len(), names.len() - kept);
                }
            }
        }
    }

    #[test]
    fn the_previous_generation_is_grace_only_where_images_run(u in universe()) {
        let plan = plan(&u.listings, &u.roots, &policy());
        for listing in &u.listings {
            let (others, previous) = roots_for(&u.roots, listing);
            for image in listing.images.iter().filter(|i| is_candidate(i)) {
                let removed = removed_refs(&plan, &listing.store, image);
                for raw in &image.refs {
                    let Some(name) = parse(raw).name else { continue };
                    let only_previous = previous.names.contains(&name)
                        && !others.names.contains(&name)
                        && !others.names_by_digest(image);
                    if !only_previous {
                        continue;
                    }
                    if gets_grace(listing) {
                        prop_assert!(!removed.contains(raw.as_str()), "{raw} lost its grace on {}", listing.store);
                    } else {
                        prop_assert!(removed.contains(raw.as_str()), "{raw} kept by grace on host {}", listing.store);
                    }
                }
            }
        }
    }

    #[test]
    fn a_second_plan_has_nothing_left_to_do(u in universe()) {
        let first = plan(&u.listings, &u.roots, &policy());
        let after = first.apply_to(&u.listings);
        let second = plan(&after, &u.roots, &policy());
        prop_assert!(second.is_empty(), "left over: {:?}", second);
        for ((before, after), store_plan) in u.listings.iter().zip(&after).zip(&first.stores) {
            let gone: u64 = before.images.iter()
                .filter(|i| !after.images.iter().any(|a| a.id == i.id))
                .map(|i| i.bytes)
                .sum();
            prop_assert_eq!(gone, store_plan.freed_bytes);
            prop_assert_eq!(store_plan.freed_by_instance.values().sum::<u64>(), store_plan.freed_bytes);
        }
    }

    #[test]
    fn the_plan_does_not_depend_on_input_order(u in universe()) {
        let forward = plan(&u.listings, &u.roots, &policy());
        let mut listings = u.listings.clone();
        listings.reverse();
        for listing in &mut listings {
            listing.images.reverse();
            for image in &mut listing.images {
                image.refs.reverse();
            }
        }
        let mut roots = u.roots.clone();
        roots.records.reverse();
        roots.claims.reverse();
        roots.pins.reverse();
        prop_assert_eq!(forward, plan(&listings, &roots, &policy()));
    }
}
