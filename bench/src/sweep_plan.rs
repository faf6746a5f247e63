//! `kiln-bench sweep-plan`: `kiln_core::sweep::plan` over a farm-sized universe — by default
//! 100,000 listed images across 1,000 stores against 10,000 roots — timed in-process. The goal is
//! a plan in ≤ 1 s: a farm plans after every converge, so the planner must never be what a
//! converge waits on. There is no outside baseline (nothing else plans Kiln's sweep); the figure
//! is checked against the goal.
//!
//! The universe is generated from a fixed seed so every run plans the same thing: a pool of
//! distinct images (repos per instance, content tags), each store listing a slice of it the way a
//! farm looks — a few host stores that built everything, many node stores holding delivered copies
//! (with containerd's `sha256:` and kind's `import-…` aliases, a fifth of them CRI-only), labels
//! mostly this farm's with some from another farm and some unlabeled. Roots are records (current
//! and previous generation), claims, pins and per-store workloads, some spelled the long Docker Hub
//! way so normalization is exercised.

use crate::util::{self, Contestant};
use anyhow::{bail, Result};
use kiln_core::sweep::{
    plan, InstanceRecord, ListedImage, Plan, Policy, RemovalMode, Roots, StoreId, StoreKind, StoreListing, LABEL_FARM,
    LABEL_INSTANCE, LABEL_KIND,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Listed images in total, across all stores.
    #[arg(long, default_value_t = 100_000)]
    images: usize,
    /// Stores (one in ten a host store, the rest node stores).
    #[arg(long, default_value_t = 1_000)]
    stores: usize,
    /// Roots in total: records (current and previous), claims, pins, workloads.
    #[arg(long, default_value_t = 10_000)]
    roots: usize,
    /// Measured runs (the median is reported).
    #[arg(long, default_value_t = 7)]
    runs: usize,
}

const FARM: &str = "farm-bench";
const INSTANCES: usize = 200;
const GOAL: Duration = Duration::from_secs(1);

pub fn run(args: &Args) -> Result<()> {
    if args.stores == 0 || args.images < args.stores {
        bail!("need at least one store and one image per store");
    }
    let started = Instant::now();
    let universe = Universe::generate(args);
    eprintln!(
        "generated {} listed images in {} stores, {} roots in {}",
        universe.listed(),
        universe.listings.len(),
        universe.root_count(),
        util::fmt(started.elapsed())
    );
    let policy = Policy { farm: FARM.to_string() };
    let mut shape: Option<(usize, u64)> = None;
    let mut contestants = vec![Contestant::new("kiln_core::sweep::plan", || {
        let started = Instant::now();
        let planned: Plan = plan(&universe.listings, &universe.roots, &policy);
        let took = started.elapsed();
        let removals = planned.stores.iter().map(|s| s.removals.len()).sum();
        let this = (removals, planned.freed_bytes());
        // Same inputs, same plan: a run that differs is a bug, not noise.
        if *shape.get_or_insert(this) != this {
            bail!("plans differ between runs: {this:?} vs {shape:?}");
        }
        Ok(took)
    })];
    util::rounds(&mut contestants, args.runs, 1, || Ok(()))?;
    let median = contestants[0].median();
    println!("## Sweep planning\n");
    println!(
        "{} listed images in {} stores ({} host, {} node), {} roots; {} runs, median; one thread.",
        universe.listed(),
        universe.listings.len(),
        universe.listings.iter().filter(|l| l.kind == StoreKind::Host).count(),
        universe.listings.iter().filter(|l| l.kind == StoreKind::Node).count(),
        universe.root_count(),
        args.runs
    );
    util::print_table("Plan the sweep", &contestants);
    drop(contestants);
    let (removals, freed) = shape.unwrap_or_default();
    println!("\n- plan: {removals} removals freeing {freed} bytes");
    let met = median <= GOAL;
    println!("- goal ≤ {}: {} — {}", util::fmt(GOAL), util::fmt(median), if met { "met" } else { "MISSED" });
    Ok(())
}

struct Universe {
    listings: Vec<StoreListing>,
    roots: Roots,
}

/// One distinct image in the pool the stores draw from.
struct PoolImage {
    id: String,
    reference: String,
    labels: BTreeMap<String, String>,
}

impl Universe {
    fn generate(args: &Args) -> Universe {
        let mut rng = fastrand::Rng::with_seed(0x5eed_0039);
        // Node stores hold copies of what hosts built, so the pool is smaller than the listings.
        let pool: Vec<PoolImage> = (0..(args.images / 4).max(1)).map(|i| pool_image(&mut rng, i)).collect();
        let per_store = args.images / args.stores;
        let listings = (0..args.stores)
            .map(|s| {
                let host = s % 10 == 0;
                let images = (0..per_store)
                    .map(|_| {
                        let image = &pool[rng.usize(..pool.len())];
                        listed(&mut rng, image, host)
                    })
                    .collect();
                StoreListing {
                    store: StoreId(if host { format!("docker@host-{s}") } else { format!("containerd@node-{s}") }),
                    kind: if host { StoreKind::Host } else { StoreKind::Node },
                    removal: if !host && s % 5 == 1 { RemovalMode::PerId } else { RemovalMode::PerRef },
                    runs_workloads: false,
                    images,
                }
            })
            .collect::<Vec<_>>();
        let roots = roots(&mut rng, &pool, &listings, args.roots);
        Universe { listings, roots }
    }

    fn listed(&self) -> usize {
        self.listings.iter().map(|l| l.images.len()).sum()
    }

    fn root_count(&self) -> usize {
        let records: usize = self.roots.records.iter().map(|r| r.current.len() + r.previous.len()).sum();
        let workloads: usize = self.roots.workloads.values().map(Vec::len).sum();
        records + self.roots.claims.len() + self.roots.pins.len() + workloads
    }
}

fn hex(rng: &mut fastrand::Rng, len: usize) -> String {
    (0..len).map(|_| char::from_digit(rng.u32(..16), 16).unwrap_or('0')).collect()
}

fn pool_image(rng: &mut fastrand::Rng, i: usize) -> PoolImage {
    let instance = format!("team{}", i % INSTANCES);
    let reference = match i % 3 {
        0 => format!("reg.example.com:5000/{instance}/app{}:{}-amd64", i % 17, hex(rng, 12)),
        _ => format!("{instance}-svc{}:{}-amd64", i % 23, hex(rng, 12)),
    };
    let mut labels = BTreeMap::new();
    match rng.u32(..20) {
        // Unlabeled: brought, pinned, hand-built.
        0 => {}
        // Another farm's.
        1 => {
            labels.insert(LABEL_KIND.to_string(), "image".to_string());
            labels.insert(LABEL_FARM.to_string(), "farm-other".to_string());
        }
        n => {
            labels.insert(LABEL_KIND.to_string(), if n == 2 { "shared" } else { "image" }.to_string());
            labels.insert(LABEL_FARM.to_string(), FARM.to_string());
            labels.insert(LABEL_INSTANCE.to_string(), instance);
            labels.insert("kiln.dev/context".to_string(), hex(rng, 64));
        }
    }
    PoolImage { id: format!("sha256:{}", hex(rng, 64)), reference, labels }
}

/// A store's copy of `image`: hosts list tags; nodes list containerd names with aliases.
fn listed(rng: &mut fastrand::Rng, image: &PoolImage, host: bool) -> ListedImage {
    let mut refs = vec![image.reference.clone()];
    if !host {
        refs.push(image.id.clone());
        if rng.u32(..4) == 0 {
            refs.push(format!("import-2026-11-29@sha256:{}", hex(rng, 64)));
        }
    }
    ListedImage {
        id: image.id.clone(),
        refs,
        digests: Vec::new(),
        labels: image.labels.clone(),
        bytes: 1_000_000 + rng.u64(..500_000_000),
        layers: Vec::new(),
    }
}

/// `total` roots: most are records (current and previous generations), then claims, pins and
/// per-store workloads. A tenth of the short names are spelled `docker.io/library/…`.
fn roots(rng: &mut fastrand::Rng, pool: &[PoolImage], listings: &[StoreListing], total: usize) -> Roots {
    let pick = |rng: &mut fastrand::Rng| {
        let reference = &pool[rng.usize(..pool.len())].reference;
        if !reference.contains('/') && rng.u32(..10) == 0 {
            format!("docker.io/library/{reference}")
        } else {
            reference.clone()
        }
    };
    let in_records = total * 8 / 10;
    let per_instance = (in_records / INSTANCES / 2).max(1);
    let records = (0..INSTANCES)
        .map(|i| InstanceRecord {
            instance: format!("team{i}"),
            current: (0..per_instance).map(|_| pick(rng)).collect(),
            previous: (0..per_instance).map(|_| pick(rng)).collect(),
        })
        .collect();
    let claims = (0..total / 20).map(|_| pick(rng)).collect();
    let pins = (0..total / 100).map(|_| pick(rng)).collect();
    let mut workloads: BTreeMap<StoreId, Vec<String>> = BTreeMap::new();
    let left = total.saturating_sub(in_records + total / 20 + total / 100);
    for _ in 0..left {
        let listing = &listings[rng.usize(..listings.len())];
        let image = &listing.images[rng.usize(..listing.images.len())];
        workloads.entry(listing.store.clone()).or_default().push(image.id.clone());
    }
    Roots { records, claims, workloads, kubernetes: Vec::new(), pins }
}
