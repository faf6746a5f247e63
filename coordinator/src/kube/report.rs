//! Step 9, "report, never re-image": after a converge records, the pods of its namespace still
//! running an older ref of one of its images (same repository, another tag) are counted and named,
//! and left alone — restarting them is the user's rollout, not Kiln's.

use std::collections::BTreeMap;

use ::kube::api::{Api, ListParams};
use ::kube::Client;
use k8s_openapi::api::core::v1::Pod;
use kiln_core::refs::ImageRef;

use super::KubeError;

/// Reads the pods of `namespace` and returns one note per image some of them run an older ref of.
pub async fn stale_workloads(
    client: &Client,
    namespace: &str,
    images: &[(String, String)],
) -> Result<Vec<String>, KubeError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pods = api.list(&ListParams::default()).await.map_err(|err| KubeError::Read {
        what: "pods".to_string(),
        namespace: namespace.to_string(),
        err,
    })?;
    Ok(stale_notes(&pods.items, images))
}

/// One note per image of `images` (name → ref, as recorded) that running pods run an older tag
/// of: `2 running workloads keep shop-api:9c1e02; new ones use :4a77b1`. A pod counts once per
/// old ref however many of its containers run it. Finished pods run nothing; a container naming
/// its image by digest alone is not compared, since a digest cannot say whether it is older.
pub fn stale_notes(pods: &[Pod], images: &[(String, String)]) -> Vec<String> {
    let running: Vec<&Pod> = pods
        .iter()
        .filter(|pod| {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            !matches!(phase, Some("Succeeded") | Some("Failed"))
        })
        .collect();
    let mut notes = Vec::new();
    for (_, reference) in images {
        let Ok(new) = ImageRef::parse(reference) else { continue };
        // Old ref (familiar spelling) → how many running pods keep it.
        let mut kept: BTreeMap<String, usize> = BTreeMap::new();
        for pod in &running {
            let Some(spec) = &pod.spec else { continue };
            let mut olds: Vec<String> = spec
                .containers
                .iter()
                .filter_map(|c| ImageRef::parse(c.image.as_deref()?).ok())
                .filter(|old| old.repository() == new.repository() && old.tag().is_some() && *old != new)
                .map(|old| old.familiar())
                .collect();
            olds.sort();
            olds.dedup();
            for old in olds {
                *kept.entry(old).or_default() += 1;
            }
        }
        if kept.is_empty() {
            continue;
        }
        let keeps: Vec<String> = kept
            .iter()
            .map(|(old, n)| match n {
                1 => format!("1 running workload keeps {old}"),
                n => format!("{n} running workloads keep {old}"),
            })
            .collect();
        let now = match (new.tag(), new.digest()) {
            (_, Some(digest)) => format!("@{digest}"),
            (Some(tag), None) => format!(":{tag}"),
            (None, None) => new.familiar(),
        };
        notes.push(format!("{}; new ones use {now}", keeps.join(", ")));
    }
    notes
}
