//! Everything that keeps an image alive, gathered from the coordinator's state into `core`'s
//! [`Roots`]: every instance's current record and the generation it replaced, every live claim,
//! every pin, the refs the caller names (a converge's own), and per store the images its workloads
//! use. Pure, so the one decision made here that the planner cannot make — which host stores are
//! where images run — is tested without a daemon.

use std::collections::BTreeMap;

use kiln_core::sweep::{InstanceRecord, Roots, StoreId};

use crate::model::{Claim, Pin, Record};

/// The record target that means "the build host is where the images run".
const LOCAL_TARGET: &str = "local";

/// The roots of one sweep, and whether host stores keep the grace generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Gathered {
    pub roots: Roots,
    /// True when some instance's current record delivers to the `local` target. Kiln records which
    /// target an image went to but not which host built it, so with one `local` instance every
    /// host store is treated as a place images run and keeps the generation its records replaced:
    /// sweeping it aggressively could take the ref a just-replaced container is restarted from.
    pub hosts_run_workloads: bool,
}

pub(super) fn gather(
    records: &[(Record, Option<Record>)],
    claims: &[Claim],
    pins: &[Pin],
    keep: &[String],
    workloads: BTreeMap<StoreId, Vec<String>>,
) -> Gathered {
    // A multi-platform image is kept on the build hosts as one image per platform, under refs
    // derived from its content ref: the record keeps those too.
    let refs = |record: &Record| {
        record
            .images
            .iter()
            .flat_map(|image| {
                std::iter::once(image.reference.clone()).chain(kiln_core::refs::platform_refs(&image.reference))
            })
            .collect::<Vec<_>>()
    };
    let hosts_run_workloads =
        records.iter().any(|(current, _)| current.images.iter().any(|image| image.target == LOCAL_TARGET));
    let records = records
        .iter()
        .map(|(current, previous)| InstanceRecord {
            instance: current.instance.clone(),
            current: refs(current),
            previous: previous.as_ref().map(refs).unwrap_or_default(),
        })
        .collect();
    // A converge also claims its contexts; those are the content store's roots, not refs.
    let mut held: Vec<String> = claims
        .iter()
        .filter(|claim| !claim.reference.starts_with(crate::engine::CONTEXT_CLAIM_PREFIX))
        .map(|claim| claim.reference.clone())
        .collect();
    held.extend(keep.iter().cloned());
    let platforms: Vec<String> = held.iter().flat_map(|r| kiln_core::refs::platform_refs(r)).collect();
    held.extend(platforms);
    let roots = Roots {
        records,
        claims: held,
        workloads,
        kubernetes: Vec::new(),
        pins: pins.iter().map(|pin| pin.reference.clone()).collect(),
    };
    Gathered { roots, hosts_run_workloads }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ConvergeId, Generation, RecordedImage, RecordedKind};

    fn record(instance: &str, generation: u64, images: &[(&str, &str)]) -> Record {
        Record {
            instance: instance.into(),
            generation: Generation(generation),
            images: images
                .iter()
                .map(|(reference, target)| RecordedImage {
                    name: "app".into(),
                    reference: (*reference).into(),
                    kind: RecordedKind::Built,
                    target: (*target).into(),
                    context: None,
                    user: None,
                    inputs: None,
                    image_id: None,
                })
                .collect(),
            written_at_ms: 0,
        }
    }

    #[test]
    fn records_claims_pins_and_kept_refs_all_become_roots() {
        let records = vec![(
            record("shop", 2, &[("shop-api:new", "registry:r:5000")]),
            Some(record("shop", 1, &[("shop-api:old", "registry:r:5000")])),
        )];
        let claims = vec![
            Claim { converge: ConvergeId::from("c1"), reference: "shop-api:next".into(), expires_ms: 9 },
            Claim {
                converge: ConvergeId::from("c1"),
                reference: format!("kiln-context:{}", "a".repeat(64)),
                expires_ms: 9,
            },
        ];
        let pins = vec![Pin { reference: "tool:1".into(), pinned_at_ms: 0, pinned_by: "ana".into() }];
        let workloads = BTreeMap::from([(StoreId("docker@a".into()), vec!["sha256:ab".into()])]);
        let gathered = gather(&records, &claims, &pins, &["shop-web:own".into()], workloads.clone());
        assert_eq!(
            gathered.roots.records,
            vec![InstanceRecord {
                instance: "shop".into(),
                current: vec!["shop-api:new".into()],
                previous: vec!["shop-api:old".into()],
            }]
        );
        assert_eq!(gathered.roots.claims, vec!["shop-api:next".to_string(), "shop-web:own".to_string()]);
        assert_eq!(gathered.roots.pins, vec!["tool:1".to_string()]);
        assert_eq!(gathered.roots.workloads, workloads);
        assert!(!gathered.hosts_run_workloads, "a registry target runs nothing on the build host");
    }

    #[test]
    fn one_current_local_record_gives_host_stores_the_grace_and_an_old_one_does_not() {
        let registry = (record("a", 1, &[("a:1", "registry:r")]), None);
        let local_now = (record("b", 3, &[("b:3", "local")]), Some(record("b", 2, &[("b:2", "registry:r")])));
        let local_before = (record("c", 5, &[("c:5", "kind:k")]), Some(record("c", 4, &[("c:4", "local")])));
        let grace = |records: &[(Record, Option<Record>)]| gather(records, &[], &[], &[], BTreeMap::new());
        assert!(grace(&[registry.clone(), local_now]).hosts_run_workloads);
        assert!(!grace(&[registry, local_before]).hosts_run_workloads);
        assert!(!grace(&[]).hosts_run_workloads);
    }
}
