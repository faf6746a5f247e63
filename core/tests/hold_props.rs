//! Property tests for two farms on one Docker daemon (DESIGN.md "A Docker daemon shared by several
//! farms"): each farm's images carry its label, content tags are shared by address, and a farm
//! relying on a tag another farm's image wears holds that image under its own hold tag — the
//! invariant the converge maintains. Over many such daemons, neither farm's plan ever removes a
//! ref the other farm's roots name, and once both plans ran every tag either farm's roots name is
//! still on the daemon.
//!
//! Generated cases are counted, so the property cannot pass vacuously: a good share of them must
//! have a tag only the *other* farm names, on an image its owner would otherwise sweep.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};

use kiln_core::sweep::{
    hold_key, hold_ref, plan, ListedImage, Plan, Policy, RemovalMode, RemovalTarget, Roots, StoreId, StoreKind,
    StoreListing, LABEL_FARM, LABEL_INSTANCE, LABEL_KIND,
};
use proptest::prelude::*;

const FARMS: [&str; 2] = ["farm-a", "farm-b"];
const TAGS: usize = 6;

fn tag(i: usize) -> String {
    format!("app:{:012x}-amd64", 0xabc000 + i)
}

/// One image per tag: built by `owner`, named by the roots of the farms in `named_by`.
#[derive(Debug, Clone)]
struct Case {
    owner: usize,
    named_by: [bool; 2],
    present: bool,
    /// The other farm held the image once and its reliance has since ended (its record moved on).
    stale_hold: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (0..2usize, any::<[bool; 2]>(), prop::bool::weighted(0.9), any::<bool>())
        .prop_map(|(owner, named_by, present, stale_hold)| Case { owner, named_by, present, stale_hold })
}

fn daemon(cases: &[Case]) -> StoreListing {
    let mut images = Vec::new();
    for (i, c) in cases.iter().enumerate().filter(|(_, c)| c.present) {
        let mut refs = vec![tag(i)];
        let other = 1 - c.owner;
        // The converge's invariant: a farm that names a tag another farm's image wears holds it.
        if c.named_by[other] || c.stale_hold {
            refs.push(hold_ref(FARMS[other], &tag(i)).unwrap());
        }
        let labels = BTreeMap::from([
            (LABEL_KIND.to_owned(), "image".to_owned()),
            (LABEL_INSTANCE.to_owned(), "app".to_owned()),
            (LABEL_FARM.to_owned(), FARMS[c.owner].to_owned()),
        ]);
        images.push(ListedImage {
            id: format!("sha256:{:064x}", 0x5000 + i),
            refs,
            digests: vec![],
            labels,
            bytes: 10,
            layers: vec![],
        });
    }
    StoreListing {
        store: StoreId("docker@shared".into()),
        kind: StoreKind::Host,
        removal: RemovalMode::PerRef,
        runs_workloads: false,
        images,
    }
}

fn roots(cases: &[Case], farm: usize) -> Roots {
    let claims = cases.iter().enumerate().filter(|(_, c)| c.named_by[farm]).map(|(i, _)| tag(i)).collect();
    Roots { claims, ..Roots::default() }
}

fn removed_refs(plan: &Plan) -> BTreeSet<String> {
    plan.stores
        .iter()
        .flat_map(|s| &s.removals)
        .filter_map(|r| match &r.target {
            RemovalTarget::Ref(raw) => Some(raw.clone()),
            RemovalTarget::Id(_) => None,
        })
        .collect()
}

static CASES: AtomicUsize = AtomicUsize::new(0);
static HELD_FOR_OTHER: AtomicUsize = AtomicUsize::new(0);
static HOLDS_RELEASED: AtomicUsize = AtomicUsize::new(0);

proptest! {
    #[test]
    fn neither_farm_removes_what_the_others_roots_name(cases in prop::collection::vec(case(), TAGS)) {
        let listing = daemon(&cases);
        let policies = FARMS.map(|farm| Policy { farm: farm.to_owned() });
        let roots = [roots(&cases, 0), roots(&cases, 1)];
        let plans = [plan(std::slice::from_ref(&listing), &roots[0], &policies[0]), plan(std::slice::from_ref(&listing), &roots[1], &policies[1])];
        CASES.fetch_add(1, Ordering::Relaxed);

        for farm in 0..2 {
            let other = 1 - farm;
            let removed = removed_refs(&plans[farm]);
            for (i, c) in cases.iter().enumerate().filter(|(_, c)| c.present) {
                if c.named_by[other] {
                    prop_assert!(!removed.contains(&tag(i)), "{} removed {} which {} names", FARMS[farm], tag(i), FARMS[other]);
                    if c.owner == farm && !c.named_by[farm] {
                        HELD_FOR_OTHER.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            // A farm only ever removes its own images' refs and its own holds.
            for raw in &removed {
                if let Some(key) = hold_key(raw) {
                    prop_assert_eq!(key, kiln_core::sweep::farm_key(FARMS[farm]));
                    HOLDS_RELEASED.fetch_add(1, Ordering::Relaxed);
                } else {
                    let i = (0..TAGS).find(|i| &tag(*i) == raw).unwrap();
                    prop_assert_eq!(cases[i].owner, farm, "{} removed {} of another farm", FARMS[farm], raw);
                }
            }
        }

        // Both sweeps ran, in either order: every tag either farm names is still there.
        for order in [[0, 1], [1, 0]] {
            let mut now = vec![listing.clone()];
            for farm in order {
                now = plans[farm].apply_to(&now);
            }
            let left: BTreeSet<&String> = now[0].images.iter().flat_map(|i| &i.refs).collect();
            for (i, _) in cases.iter().enumerate().filter(|(_, c)| c.present && (c.named_by[0] || c.named_by[1])) {
                prop_assert!(left.contains(&tag(i)), "{} gone after both sweeps", tag(i));
            }
        }
    }
}

#[test]
fn the_generated_daemons_exercise_holds() {
    neither_farm_removes_what_the_others_roots_name();
    let cases = CASES.load(Ordering::Relaxed);
    assert!(HELD_FOR_OTHER.load(Ordering::Relaxed) > cases / 4, "too few cases where only the other farm names a tag");
    assert!(HOLDS_RELEASED.load(Ordering::Relaxed) > 0, "no case released a hold");
}
