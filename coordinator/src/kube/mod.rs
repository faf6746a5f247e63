//! Kiln's side of the Kubernetes API (DESIGN.md "The converge" steps 7 and 9, "Reachability"
//! root 4): the `kiln-images` ConfigMap a converge writes into its instance's namespace (data read
//! per use, never Deployment env — ADR-0038), the refs a sweep must keep because the cluster
//! names them, and the report of workloads still on an older ref.
//!
//! Everything goes through a [`::kube::Client`] the caller builds, so tests hand in a client over
//! `tower-test`'s mock service (no API server can run on these machines) and the coordinator's
//! binary hands in one from `kube::Client::try_default()`. With no client configured — embedded
//! mode — none of this runs and the sweep has no Kubernetes roots.
//!
//! One instance per namespace: the namespace's `kiln.dev/instance` label and its one
//! `kiln-images` ConfigMap name a single instance, so a second instance converging into the same
//! namespace takes both over.

mod converge;
mod nodes;
mod report;
mod roots;

use std::collections::BTreeMap;

use ::kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use ::kube::Client;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kiln_core::sweep::LABEL_INSTANCE;

pub(crate) use converge::{published, unpublished};
pub use nodes::node_platforms;
pub use report::{stale_notes, stale_workloads};
pub use roots::{gather_roots, pod_images};

/// The ConfigMap every instance's namespace holds: image name → ref.
pub const IMAGES_CONFIGMAP: &str = "kiln-images";
/// The field manager Kiln's server-side applies own their fields under.
const FIELD_MANAGER: &str = "kiln";

/// A custom resource whose objects' `spec.image` names an image a workload will run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustomResource {
    pub group: String,
    pub version: String,
    pub kind: String,
    /// The resource's plural, as it appears in the API path (`sandboxes`).
    pub plural: String,
}

/// `--custom-resource group/version/Kind/plural` names a type whose objects' `spec.image` is a root.
#[derive(Debug, thiserror::Error)]
#[error("custom resource {given:?} is not group/version/Kind/plural — e.g. sandbox.example.dev/v1/Sandbox/sandboxes")]
pub struct CustomResourceSyntax {
    given: String,
}

impl std::str::FromStr for CustomResource {
    type Err = CustomResourceSyntax;

    fn from_str(given: &str) -> Result<CustomResource, CustomResourceSyntax> {
        let parts: Vec<&str> = given.split('/').collect();
        match parts.as_slice() {
            [group, version, kind, plural] if parts.iter().all(|part| !part.is_empty()) => Ok(CustomResource {
                group: group.to_string(),
                version: version.to_string(),
                kind: kind.to_string(),
                plural: plural.to_string(),
            }),
            _ => Err(CustomResourceSyntax { given: given.to_string() }),
        }
    }
}

/// How the coordinator reaches a cluster, when it does.
#[derive(Clone)]
pub struct KubeConfig {
    pub client: Client,
    /// Pods here are roots too: the cluster's own workloads may run images Kiln built.
    pub system_namespace: String,
    pub custom_resources: Vec<CustomResource>,
}

impl KubeConfig {
    /// A config for `client` with the system namespace `kube-system` and no custom resources.
    pub fn new(client: Client) -> KubeConfig {
        KubeConfig { client, system_namespace: "kube-system".to_string(), custom_resources: Vec::new() }
    }
}

impl std::fmt::Debug for KubeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeConfig")
            .field("system_namespace", &self.system_namespace)
            .field("custom_resources", &self.custom_resources)
            .finish_non_exhaustive()
    }
}

/// A Kubernetes API call that failed; each names the object and what the coordinator needs.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("cannot list the cluster's nodes for its platforms — the coordinator needs `list` on nodes")]
    Nodes(#[source] ::kube::Error),
    #[error("cannot list the namespaces labeled {LABEL_INSTANCE} — the coordinator needs `list` on namespaces")]
    Namespaces(#[source] ::kube::Error),
    #[error("cannot read {what} in namespace {namespace} — the coordinator needs `get`/`list` on them there")]
    Read {
        what: String,
        namespace: String,
        #[source]
        err: ::kube::Error,
    },
    #[error("cannot label namespace {namespace} with {LABEL_INSTANCE}={instance} — the coordinator needs `patch` on namespaces, or label it by hand")]
    Label {
        namespace: String,
        instance: String,
        #[source]
        err: ::kube::Error,
    },
    #[error("cannot write ConfigMap {IMAGES_CONFIGMAP} in namespace {namespace} — the coordinator needs `patch` on configmaps there")]
    Write {
        namespace: String,
        #[source]
        err: ::kube::Error,
    },
    #[error("cannot delete ConfigMap {IMAGES_CONFIGMAP} of instance {instance} in namespace {namespace}")]
    Delete {
        instance: String,
        namespace: String,
        #[source]
        err: ::kube::Error,
    },
    #[error("cannot find the {IMAGES_CONFIGMAP} ConfigMaps of instance {instance} — the coordinator needs `list` on configmaps")]
    Find {
        instance: String,
        #[source]
        err: ::kube::Error,
    },
}

/// The selector of the namespaces (and ConfigMaps) Kiln serves: any `kiln.dev/instance` label.
fn instance_label_exists() -> ListParams {
    ListParams::default().labels(LABEL_INSTANCE)
}

/// Server-side applies `kiln-images` in `namespace` with `images` (name → ref), labeled with the
/// instance, after labeling the namespace itself so the sweep finds it.
///
/// Applied, not merged: fields Kiln applied before and no longer sends — an image dropped from the
/// manifest — are removed by the apply, so a reader never sees a name the record lost.
pub async fn write_images(
    client: &Client,
    namespace: &str,
    instance: &str,
    images: &[(String, String)],
) -> Result<(), KubeError> {
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let labels = BTreeMap::from([(LABEL_INSTANCE.to_string(), instance.to_string())]);

    let label = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": { "name": namespace, "labels": labels },
    });
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces.patch(namespace, &params, &Patch::Apply(&label)).await.map_err(|err| KubeError::Label {
        namespace: namespace.to_string(),
        instance: instance.to_string(),
        err,
    })?;

    let data: BTreeMap<&str, &str> =
        images.iter().map(|(name, reference)| (name.as_str(), reference.as_str())).collect();
    let config_map = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": { "name": IMAGES_CONFIGMAP, "namespace": namespace, "labels": labels },
        "data": data,
    });
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    config_maps
        .patch(IMAGES_CONFIGMAP, &params, &Patch::Apply(&config_map))
        .await
        .map_err(|err| KubeError::Write { namespace: namespace.to_string(), err })?;
    Ok(())
}

/// Deletes every `kiln-images` ConfigMap labeled with `instance`, wherever it is, and returns the
/// namespaces it was deleted from. Found by label rather than by a stored namespace: the record does
/// not keep the namespace, and a manifest may have moved its instance since.
pub async fn delete_images(client: &Client, instance: &str) -> Result<Vec<String>, KubeError> {
    let all: Api<ConfigMap> = Api::all(client.clone());
    let params = ListParams::default()
        .labels(&format!("{LABEL_INSTANCE}={instance}"))
        .fields(&format!("metadata.name={IMAGES_CONFIGMAP}"));
    let found = all.list(&params).await.map_err(|err| KubeError::Find { instance: instance.to_string(), err })?;
    let mut deleted = Vec::new();
    for config_map in found.items {
        let Some(namespace) = config_map.metadata.namespace else { continue };
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), &namespace);
        match api.delete(IMAGES_CONFIGMAP, &DeleteParams::default()).await {
            Ok(_) => deleted.push(namespace),
            // Gone between the list and the delete: the outcome down wants.
            Err(::kube::Error::Api(status)) if status.code == 404 => {}
            Err(err) => return Err(KubeError::Delete { instance: instance.to_string(), namespace, err }),
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_custom_resource_is_group_version_kind_plural() {
        let parsed: CustomResource = "sandbox.kiln.dev/v1/Sandbox/sandboxes".parse().unwrap();
        assert_eq!(
            parsed,
            CustomResource {
                group: "sandbox.kiln.dev".into(),
                version: "v1".into(),
                kind: "Sandbox".into(),
                plural: "sandboxes".into(),
            }
        );
        for bad in ["sandbox.kiln.dev/v1/Sandbox", "a/b/c/d/e", "a//c/d"] {
            let err = bad.parse::<CustomResource>().unwrap_err();
            assert!(err.to_string().contains(bad), "{err}");
        }
    }
}
