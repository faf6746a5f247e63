//! Property tests for the sweep planner: over many small made-up universes — a pool of repos and
//! tags spelled every way Docker and containerd spell them, images labeled and not, host and node
//! stores in both removal modes, roots of every kind — the plan never removes what a root names,
//! never touches what this farm did not build, honours CRI's all-or-nothing rule and the grace
//! generation, and leaves nothing for a second plan to do.
//!
//! The checks parse refs with their own deliberately plain normalization rather than the
//! planner's, so a bug in the planner's normalization cannot hide itself.
//!
//! No property may pass vacuously: each one counts what its cases really exercised (removals
//! planned, names kept by a root, ids kept whole, grace given, bytes freed per owner) and the run
//! fails when a count it relies on stays at zero — a planner that plans nothing, or an
//! `apply_to` that returns nothing, must fail these tests, not slip through their loops.
//!
//! Runs 2,000 cases by default (`PROPTEST_CASES` overrides). The release run:
//!
//! ```text
//! PROPTEST_CASES=100000 cargo test --release -p kiln-core --test sweep_props
//! ```

use std::collections::{BTreeMap, HashSet};

use std::sync::Mutex;

use kiln_core::sweep::{
    canonical_name, farm_key, hold_key, hold_ref, plan, InstanceRecord, Layer, ListedImage, Plan, Policy, RemovalMode,
    RemovalTarget, Roots, StoreId, StoreKind, StoreListing, KIND_SHARED, LABEL_FARM, LABEL_INSTANCE, LABEL_KIND,
    UNOWNED,
};
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};

const FARM: &str = "farm-a";
// `import-tool` is a user's repository whose name merely starts like kind's `import-<date>` alias,
// and `sha256:beef` a repository and tag that merely look like containerd's `sha256:<id>` alias.
// `my.org/db`, `localhost/base` and `Team/cron` are other registries when written short and Hub
// repositories when written behind `docker.io/`; `library/x/lint` is no official image.
const REPOS: [&str; 9] =
    ["api", "web", "import-tool", "localhost/base", "team/cron", "Team/cron", "my.org/db", "library/x/lint", "sha256"];
const TAGS: [&str; 3] = ["latest", "t1", "beef"];
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
    /// `library/x` without a domain.
    Library,
    Hub,
    Index,
}

fn spelled(repo: &str, spelling: Spelling) -> String {
    let hub_path = if repo.contains('/') { repo.to_owned() } else { format!("library/{repo}") };
    match spelling {
        Spelling::Short => repo.to_owned(),
        Spelling::Library => hub_path,
        Spelling::Hub => format!("docker.io/{hub_path}"),
        Spelling::Index => format!("index.docker.io/{hub_path}"),
    }
}

fn spelling() -> impl Strategy<Value = Spelling> {
    prop_oneof![Just(Spelling::Short), Just(Spelling::Library), Just(Spelling::Hub), Just(Spelling::Index)]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Label {
    None,
    KindOnly,
    ThisFarm,
    OtherFarm,
    /// `kiln.dev/kind=` — how a derived image clears the label it inherited.
    ClearedKind,
    /// This farm's, with an empty `kiln.dev/instance`: owned by no instance.
    EmptyInstance,
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
    /// The same, untagged: the registry's port must not be read as a tag.
    ForeignUntagged(usize),
}

fn image_spec() -> impl Strategy<Value = ImageSpec> {
    let label = prop_oneof![
        1 => Just(Label::None),
        1 => Just(Label::KindOnly),
        5 => Just(Label::ThisFarm),
        1 => Just(Label::OtherFarm),
        1 => Just(Label::ClearedKind),
        1 => Just(Label::EmptyInstance),
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
        1 => (repo.clone(), tag).prop_map(|(r, t)| RootForm::Foreign(r, t)),
        1 => repo.prop_map(RootForm::ForeignUntagged),
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
                Label::ThisFarm | Label::OtherFarm | Label::ClearedKind | Label::EmptyInstance => {
                    let farm = if image.label == Label::OtherFarm { "farm-b" } else { FARM };
                    let kind = if image.label == Label::ClearedKind { "" } else { kind };
                    labels.insert(LABEL_KIND.to_owned(), kind.to_owned());
                    labels.insert(LABEL_FARM.to_owned(), farm.to_owned());
                }
            }
            if image.label == Label::EmptyInstance {
                labels.insert(LABEL_INSTANCE.to_owned(), String::new());
            } else if !image.shared && image.label != Label::None {
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
            RootForm::ForeignUntagged(r) => format!("reg.example.com:5000/{}", REPOS[r]),
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
    let hub_spelled;
    if let Some(rest) = ["index.docker.io/", "docker.io/"].iter().find_map(|hub| path.strip_prefix(hub)) {
        path = rest;
        // `docker.io/my.org/x` stays whole: `my.org/x` would be another registry's.
        let first = rest.split('/').next().unwrap();
        let domain_like =
            first.contains(['.', ':']) || first == "localhost" || first.bytes().any(|b| b.is_ascii_uppercase());
        if rest.contains('/') && domain_like {
            hub_spelled = format!("docker.io/{rest}");
            path = &hub_spelled;
        }
    }
    if let Some(official) = path.strip_prefix("library/") {
        let repository = official.split(':').next().unwrap();
        if !official.contains('/') && repository != "sha256" {
            path = official;
        }
    }
    // The official `sha256` keeps `library/`: `sha256:<hex>` is how an image id is spelled.
    let with_namespace;
    if path == "sha256" || path.starts_with("sha256:") {
        with_namespace = format!("library/{path}");
        path = &with_namespace;
    }
    // kind's alias is `import-<date>`: digits and dashes only, and never tagged.
    let import_date = path.strip_prefix("import-").filter(|date| !date.is_empty());
    if import_date.is_some_and(|date| date.bytes().all(|b| b.is_ascii_digit() || b == b'-')) && digest.is_some() {
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

/// What the cases of one property really exercised, summed over the run.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    /// Removals planned (refs or ids).
    removals: u64,
    /// Candidate names a root kept.
    kept_names: u64,
    /// Ids a CRI-only store kept whole and reported.
    kept_whole: u64,
    /// Names of the previous generation kept by grace where images run.
    grace_kept: u64,
    /// Names of the previous generation swept on a plain build host.
    grace_swept: u64,
    /// Bytes freed in an instance's bucket, in the shared one, and in the unowned one.
    freed_instance: u64,
    freed_shared: u64,
    freed_unowned: u64,
    /// Refs whose two normalizations were compared.
    refs_compared: u64,
    /// Images of this farm another farm holds; this farm's own holds released, and kept.
    held_by_others: u64,
    own_released: u64,
    own_kept: u64,
    /// Names in the hold namespace that are no holds, swept as the names they are.
    lookalikes_removed: u64,
    /// Layers a going image shares with one that stays: not counted as freed.
    shared_layers_kept: u64,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.removals += other.removals;
        self.kept_names += other.kept_names;
        self.kept_whole += other.kept_whole;
        self.grace_kept += other.grace_kept;
        self.grace_swept += other.grace_swept;
        self.freed_instance += other.freed_instance;
        self.freed_shared += other.freed_shared;
        self.freed_unowned += other.freed_unowned;
        self.refs_compared += other.refs_compared;
        self.held_by_others += other.held_by_others;
        self.own_released += other.own_released;
        self.own_kept += other.own_kept;
        self.lookalikes_removed += other.lookalikes_removed;
        self.shared_layers_kept += other.shared_layers_kept;
    }
}

/// Runs `property` over `cases()` universes and returns what they exercised together.
fn run(property: fn(&Universe, &mut Tally) -> Result<(), TestCaseError>) -> Tally {
    let total = Mutex::new(Tally::default());
    let mut runner = TestRunner::new(ProptestConfig { cases: cases(), ..ProptestConfig::default() });
    let outcome = runner.run(&universe(), |u| {
        let mut tally = Tally::default();
        property(&u, &mut tally)?;
        total.lock().unwrap().add(tally);
        Ok(())
    });
    if let Err(failure) = outcome {
        panic!("{failure}");
    }
    let tally = *total.lock().unwrap();
    tally
}

fn count_removals(plan: &Plan) -> u64 {
    plan.stores.iter().map(|store| store.removals.len() as u64).sum()
}

fn no_plan_removes_what_a_root_names_(u: &Universe, tally: &mut Tally) -> Result<(), TestCaseError> {
    let plan = plan(&u.listings, &u.roots, &policy());
    tally.removals += count_removals(&plan);
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
            if is_candidate(image) {
                let kept = image.refs.iter().filter(|raw| !removed.contains(raw.as_str()));
                tally.kept_names +=
                    kept.filter(|raw| parse(raw).name.is_some_and(|n| applicable.names.contains(&n))).count() as u64;
            }
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
                        "alias {raw} removed while {} keeps a name",
                        image.id
                    ),
                }
            }
        }
    }
    Ok(())
}

#[test]
fn no_plan_removes_what_a_root_names() {
    let tally = run(no_plan_removes_what_a_root_names_);
    assert!(tally.removals > 0 && tally.kept_names > 0, "vacuous run: {tally:?}");
}

fn every_garbage_name_goes_where_the_store_can_untag_(u: &Universe, tally: &mut Tally) -> Result<(), TestCaseError> {
    let plan = plan(&u.listings, &u.roots, &policy());
    for listing in &u.listings {
        let (mut applicable, previous) = roots_for(&u.roots, listing);
        if gets_grace(listing) {
            applicable.names.extend(previous.names);
            applicable.digests.extend(previous.digests);
        }
        let per_id = listing.kind == StoreKind::Node && listing.removal == RemovalMode::PerId;
        let store_plan = plan.stores.iter().find(|s| s.store == listing.store).unwrap();
        for removal in store_plan.removals.iter().filter(|_| !per_id) {
            // A store that can untag names what it removes ref by ref; an id only for an image
            // that has no ref at all.
            if let RemovalTarget::Id(id) = &removal.target {
                let image = listing.images.iter().find(|i| &i.id == id).unwrap();
                prop_assert!(image.refs.is_empty(), "{id} removed by id on {} although it has refs", listing.store);
            }
        }
        for image in listing.images.iter().filter(|i| is_candidate(i) && !applicable.names_by_digest(i)) {
            let removed = removed_refs(&plan, &listing.store, image);
            let names: Vec<&String> = image.refs.iter().filter(|raw| parse(raw).name.is_some()).collect();
            let garbage: Vec<&&String> =
                names.iter().filter(|raw| !applicable.names.contains(&parse(raw).name.unwrap())).collect();
            if per_id && garbage.len() < names.len() {
                continue;
            }
            for raw in &garbage {
                prop_assert!(removed.contains(raw.as_str()), "garbage {raw} stays on {}", listing.store);
                tally.removals += 1;
            }
            if garbage.len() == names.len() {
                // Nothing names it any more: every alias goes too, and the id with them.
                prop_assert!(image.refs.iter().all(|r| removed.contains(r.as_str())), "{} stays in part", image.id);
                prop_assert!(is_removed_whole(&plan, &listing.store, image), "{} is not freed", image.id);
            }
        }
    }
    Ok(())
}

#[test]
fn every_garbage_name_goes_where_the_store_can_untag() {
    let tally = run(every_garbage_name_goes_where_the_store_can_untag_);
    assert!(tally.removals > 0, "vacuous run: {tally:?}");
}

fn only_this_farms_labeled_images_are_touched_(u: &Universe, tally: &mut Tally) -> Result<(), TestCaseError> {
    let plan = plan(&u.listings, &u.roots, &policy());
    tally.removals += count_removals(&plan);
    let after = plan.apply_to(&u.listings);
    prop_assert_eq!(after.len(), u.listings.len(), "apply_to lost or invented stores");
    for (listing, after) in u.listings.iter().zip(&after) {
        prop_assert_eq!(&listing.store, &after.store);
        let store_plan = plan.stores.iter().find(|s| s.store == listing.store).unwrap();
        let touched = store_plan.removals.iter().map(|r| &r.id).chain(store_plan.kept_whole.iter().map(|k| &k.id));
        for id in touched {
            let image = listing.images.iter().find(|i| &i.id == id).unwrap();
            prop_assert!(is_candidate(image), "{id} is not this farm's: {:?}", image.labels);
        }
        let untouchable = |images: &[ListedImage]| -> Vec<ListedImage> {
            images.iter().filter(|i| !is_candidate(i)).cloned().collect()
        };
        prop_assert_eq!(untouchable(&listing.images), untouchable(&after.images));
    }
    Ok(())
}

#[test]
fn only_this_farms_labeled_images_are_touched() {
    let tally = run(only_this_farms_labeled_images_are_touched_);
    assert!(tally.removals > 0, "vacuous run: {tally:?}");
}

fn cri_stores_remove_only_all_garbage_ids_and_report_mixed_ones_(
    u: &Universe,
    tally: &mut Tally,
) -> Result<(), TestCaseError> {
    let plan = plan(&u.listings, &u.roots, &policy());
    for listing in u.listings.iter().filter(|l| l.kind == StoreKind::Node && l.removal == RemovalMode::PerId) {
        let (mut applicable, previous) = roots_for(&u.roots, listing);
        applicable.names.extend(previous.names);
        applicable.digests.extend(previous.digests);
        let store_plan = plan.stores.iter().find(|s| s.store == listing.store).unwrap();
        tally.removals += store_plan.removals.len() as u64;
        tally.kept_whole += store_plan.kept_whole.len() as u64;
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
    Ok(())
}

#[test]
fn cri_stores_remove_only_all_garbage_ids_and_report_mixed_ones() {
    let tally = run(cri_stores_remove_only_all_garbage_ids_and_report_mixed_ones_);
    assert!(tally.removals > 0 && tally.kept_whole > 0, "vacuous run: {tally:?}");
}

fn the_previous_generation_is_grace_only_where_images_run_(
    u: &Universe,
    tally: &mut Tally,
) -> Result<(), TestCaseError> {
    let plan = plan(&u.listings, &u.roots, &policy());
    for listing in &u.listings {
        let (others, previous) = roots_for(&u.roots, listing);
        for image in listing.images.iter().filter(|i| is_candidate(i)) {
            let removed = removed_refs(&plan, &listing.store, image);
            for raw in &image.refs {
                let Some(name) = parse(raw).name else { continue };
                let only_previous =
                    previous.names.contains(&name) && !others.names.contains(&name) && !others.names_by_digest(image);
                if !only_previous {
                    continue;
                }
                if gets_grace(listing) {
                    prop_assert!(!removed.contains(raw.as_str()), "{raw} lost its grace on {}", listing.store);
                    tally.grace_kept += 1;
                } else {
                    prop_assert!(removed.contains(raw.as_str()), "{raw} kept by grace on host {}", listing.store);
                    tally.grace_swept += 1;
                }
            }
        }
    }
    Ok(())
}

#[test]
fn the_previous_generation_is_grace_only_where_images_run() {
    let tally = run(the_previous_generation_is_grace_only_where_images_run_);
    assert!(tally.grace_kept > 0 && tally.grace_swept > 0, "vacuous run: {tally:?}");
}

/// The bucket a removed image's bytes belong to, read off its labels the plain way.
fn bucket(image: &ListedImage) -> String {
    if image.labels.get(LABEL_KIND).map(String::as_str) == Some(KIND_SHARED) {
        return KIND_SHARED.to_owned();
    }
    match image.labels.get(LABEL_INSTANCE) {
        Some(instance) if !instance.is_empty() => instance.clone(),
        _ => UNOWNED.to_owned(),
    }
}

fn a_second_plan_has_nothing_left_to_do_(u: &Universe, tally: &mut Tally) -> Result<(), TestCaseError> {
    let first = plan(&u.listings, &u.roots, &policy());
    tally.removals += count_removals(&first);
    prop_assert_eq!(first.is_empty(), count_removals(&first) == 0);
    let after = first.apply_to(&u.listings);
    prop_assert_eq!(after.len(), u.listings.len(), "apply_to lost or invented stores");
    prop_assert_eq!(first.stores.len(), u.listings.len());
    let second = plan(&after, &u.roots, &policy());
    prop_assert!(second.is_empty(), "left over: {:?}", second);
    prop_assert_eq!(count_removals(&second), 0);
    let mut freed_total = 0;
    for ((before, after), store_plan) in u.listings.iter().zip(&after).zip(&first.stores) {
        prop_assert_eq!(&before.store, &store_plan.store);
        prop_assert_eq!(store_plan.store.to_string(), before.store.0.clone());
        let gone: Vec<&ListedImage> =
            before.images.iter().filter(|i| !after.images.iter().any(|a| a.id == i.id)).collect();
        let gone_bytes: u64 = gone.iter().map(|i| i.bytes).sum();
        prop_assert_eq!(gone_bytes, store_plan.freed_bytes);
        freed_total += gone_bytes;
        let mut by_bucket: BTreeMap<String, u64> = BTreeMap::new();
        for image in &gone {
            *by_bucket.entry(bucket(image)).or_default() += image.bytes;
            for removal in store_plan.removals.iter().filter(|r| r.id == image.id) {
                let instance = image.labels.get(LABEL_INSTANCE).filter(|i| !i.is_empty());
                prop_assert_eq!(removal.instance.as_ref(), instance, "{}", image.id);
            }
        }
        prop_assert_eq!(&by_bucket, &store_plan.freed_by_instance);
        for (bucket, bytes) in by_bucket {
            match bucket.as_str() {
                KIND_SHARED => tally.freed_shared += bytes,
                UNOWNED => tally.freed_unowned += bytes,
                _ => tally.freed_instance += bytes,
            }
        }
    }
    prop_assert_eq!(first.freed_bytes(), freed_total);
    Ok(())
}

#[test]
fn a_second_plan_has_nothing_left_to_do() {
    let tally = run(a_second_plan_has_nothing_left_to_do_);
    assert!(tally.removals > 0, "vacuous run: {tally:?}");
    assert!(tally.freed_instance > 0 && tally.freed_shared > 0 && tally.freed_unowned > 0, "{tally:?}");
}

fn the_plan_does_not_depend_on_input_order_(u: &Universe, tally: &mut Tally) -> Result<(), TestCaseError> {
    let forward = plan(&u.listings, &u.roots, &policy());
    tally.removals += count_removals(&forward);
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
    Ok(())
}

#[test]
fn the_plan_does_not_depend_on_input_order() {
    let tally = run(the_plan_does_not_depend_on_input_order_);
    assert!(tally.removals > 0, "vacuous run: {tally:?}");
}

fn the_planner_normalizes_every_spelling_as_the_plain_reading_does_(
    u: &Universe,
    tally: &mut Tally,
) -> Result<(), TestCaseError> {
    let listed = u.listings.iter().flat_map(|l| l.images.iter().flat_map(|i| i.refs.iter()));
    let records = u.roots.records.iter().flat_map(|r| r.current.iter().chain(&r.previous));
    let workloads = u.roots.workloads.values().flatten();
    for raw in listed.chain(records).chain(&u.roots.claims).chain(workloads) {
        prop_assert_eq!(canonical_name(raw), parse(raw).name, "{}", raw);
        tally.refs_compared += 1;
    }
    Ok(())
}

#[test]
fn the_planner_normalizes_every_spelling_as_the_plain_reading_does() {
    let tally = run(the_planner_normalizes_every_spelling_as_the_plain_reading_does_);
    assert!(tally.refs_compared > 0, "vacuous run: {tally:?}");
}

/// The farm whose holds this farm's images may wear (the generator labels its images `farm-b`).
const OTHER_FARM: &str = "farm-b";

/// Names in the hold namespace that are no holds: a key of 12 characters that are not hex, and a
/// hex key too short.
const LOOKALIKES: [&str; 2] = ["kiln-hold/zzzzzzzzzzzz/app:t1", "kiln-hold/abc/app:t1"];

/// `u` with holds on every second image that has a tagged ref: another farm's on this farm's
/// images, this farm's own on Kiln images of another farm (where the store can untag). This
/// farm's other images wear the hold look-alikes.
fn with_holds(u: &Universe) -> Universe {
    let mut u = u.clone();
    for listing in &mut u.listings {
        let per_id = listing.kind == StoreKind::Node && listing.removal == RemovalMode::PerId;
        for image in listing.images.iter_mut().skip(1).step_by(2).filter(|image| is_candidate(image)) {
            image.refs.extend(LOOKALIKES.iter().map(|raw| (*raw).to_owned()));
        }
        for image in listing.images.iter_mut().step_by(2) {
            let kiln = image.labels.get(LABEL_KIND).is_some_and(|kind| !kind.is_empty());
            let holder = match (is_candidate(image), kiln && !per_id) {
                (true, _) => OTHER_FARM,
                (false, true) => FARM,
                (false, false) => continue,
            };
            if let Some(hold) = image.refs.iter().find_map(|raw| hold_ref(holder, raw)) {
                image.refs.push(hold);
            }
        }
    }
    u
}

fn holds_are_kept_while_relied_on_(u: &Universe, tally: &mut Tally) -> Result<(), TestCaseError> {
    let u = with_holds(u);
    let plan = plan(&u.listings, &u.roots, &policy());
    let (own, other) = (farm_key(FARM), farm_key(OTHER_FARM));
    for listing in &u.listings {
        let (mut applicable, previous) = roots_for(&u.roots, listing);
        if gets_grace(listing) {
            applicable.names.extend(previous.names);
            applicable.digests.extend(previous.digests);
        }
        for image in &listing.images {
            let holds: HashSet<&str> =
                image.refs.iter().map(String::as_str).filter(|raw| hold_key(raw).is_some()).collect();
            let removed = removed_refs(&plan, &listing.store, image);
            let Some(first) = holds.iter().next() else {
                // A look-alike is a name like any other: unrooted, it goes where the store can untag.
                let per_id = listing.kind == StoreKind::Node && listing.removal == RemovalMode::PerId;
                if is_candidate(image) && !per_id && !applicable.names_by_digest(image) {
                    for raw in image.refs.iter().filter(|raw| LOOKALIKES.contains(&raw.as_str())) {
                        prop_assert!(removed.contains(raw.as_str()), "{raw} is no hold, yet it stays on {}", image.id);
                        tally.lookalikes_removed += 1;
                    }
                }
                continue;
            };
            if hold_key(first) == Some(other.as_str()) {
                // Another farm relies on this image: its owner's sweep leaves every ref of it.
                prop_assert!(removed.is_empty(), "{} is held by {OTHER_FARM}, yet {removed:?} go", image.id);
                prop_assert!(!is_removed_whole(&plan, &listing.store, image), "{} held, removed whole", image.id);
                tally.held_by_others += 1;
                continue;
            }
            prop_assert_eq!(hold_key(first), Some(own.as_str()));
            // This farm's own hold goes, alone, once no root of this farm names another ref of the
            // image or its content.
            let by_digest = applicable.names_by_digest(image)
                || image.refs.iter().filter_map(|raw| parse(raw).digest).any(|d| applicable.digests.contains(&d));
            let by_name = image
                .refs
                .iter()
                .filter(|raw| hold_key(raw).is_none())
                .any(|raw| parse(raw).name.is_some_and(|name| applicable.names.contains(&name)));
            if by_digest || by_name {
                prop_assert!(removed.is_empty(), "{} is relied on, yet {removed:?} go", image.id);
                tally.own_kept += 1;
            } else {
                prop_assert_eq!(&removed, &holds, "{}: exactly its own holds go", image.id);
                tally.own_released += 1;
            }
        }
    }
    Ok(())
}

#[test]
fn holds_are_kept_while_relied_on() {
    let tally = run(holds_are_kept_while_relied_on_);
    assert!(tally.held_by_others > 0 && tally.own_released > 0 && tally.own_kept > 0, "vacuous run: {tally:?}");
    assert!(tally.lookalikes_removed > 0, "vacuous run: {tally:?}");
}

/// Layers the images of a store share: image `i` is built of layers `i % 4` and `i % 4 + 1`, so
/// neighbours share one. Layer `n` weighs `10^n` bytes, so every sum names its layers.
fn with_layers(u: &Universe) -> Universe {
    let mut u = u.clone();
    for listing in &mut u.listings {
        for image in &mut listing.images {
            let i = (0..IDS).find(|&i| id(i) == image.id).unwrap();
            image.layers = [i % 4, i % 4 + 1]
                .iter()
                .map(|&n| Layer { chain: format!("sha256:layer{n}"), bytes: 10u64.pow(n as u32) })
                .collect();
            image.bytes = image.layers.iter().map(|l| l.bytes).sum();
        }
    }
    u
}

fn a_layer_an_image_that_stays_uses_is_never_counted_freed_(
    u: &Universe,
    tally: &mut Tally,
) -> Result<(), TestCaseError> {
    let u = with_layers(u);
    let plan = plan(&u.listings, &u.roots, &policy());
    for listing in &u.listings {
        let store_plan = plan.stores.iter().find(|s| s.store == listing.store).unwrap();
        let going: HashSet<&str> = store_plan.removals.iter().filter(|r| r.frees).map(|r| r.id.as_str()).collect();
        let staying: HashSet<&str> = listing
            .images
            .iter()
            .filter(|i| !going.contains(i.id.as_str()))
            .flat_map(|i| i.layers.iter().map(|l| l.chain.as_str()))
            .collect();
        let mut freed: BTreeMap<&str, u64> = BTreeMap::new();
        for image in listing.images.iter().filter(|i| going.contains(i.id.as_str())) {
            for layer in &image.layers {
                if staying.contains(layer.chain.as_str()) {
                    tally.shared_layers_kept += 1;
                } else {
                    freed.insert(&layer.chain, layer.bytes);
                }
            }
        }
        prop_assert_eq!(store_plan.freed_bytes, freed.values().sum::<u64>(), "on {}", listing.store);
    }
    Ok(())
}

#[test]
fn a_layer_an_image_that_stays_uses_is_never_counted_freed() {
    let tally = run(a_layer_an_image_that_stays_uses_is_never_counted_freed_);
    assert!(tally.shared_layers_kept > 0, "vacuous run: {tally:?}");
}
