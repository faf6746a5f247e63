//! Reachability root 4: what the cluster names. The `kiln-images` ConfigMap of every namespace
//! labeled `kiln.dev/instance`, `spec.image` of the configured custom resources there, and every
//! pod's images there and in the system namespace — as the pod spec names them and as the kubelet
//! resolved them (`imageID` digests), since a tag may have moved since the pod pulled it.
//!
//! Any read that fails fails the whole gathering: a sweep on partial roots could remove an image
//! a namespace it could not read still runs.

use ::kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use ::kube::Client;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};

use super::{instance_label_exists, CustomResource, KubeConfig, KubeError, IMAGES_CONFIGMAP};

/// Every ref the cluster names, in the order read (namespaces by name, then the system namespace).
pub async fn gather_roots(config: &KubeConfig) -> Result<Vec<String>, KubeError> {
    let client = &config.client;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let served = namespaces.list(&instance_label_exists()).await.map_err(KubeError::Namespaces)?;
    let mut names: Vec<String> = served.items.into_iter().filter_map(|ns| ns.metadata.name).collect();
    names.sort();

    let mut refs = Vec::new();
    for namespace in &names {
        refs.extend(config_map_refs(client, namespace).await?);
        for resource in &config.custom_resources {
            refs.extend(custom_resource_refs(client, namespace, resource).await?);
        }
        refs.extend(pod_refs(client, namespace).await?);
    }
    if !names.contains(&config.system_namespace) {
        refs.extend(pod_refs(client, &config.system_namespace).await?);
    }
    Ok(refs)
}

fn read_error(what: impl Into<String>, namespace: &str) -> impl FnOnce(::kube::Error) -> KubeError {
    let what = what.into();
    let namespace = namespace.to_string();
    move |err| KubeError::Read { what, namespace, err }
}

async fn config_map_refs(client: &Client, namespace: &str) -> Result<Vec<String>, KubeError> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let what = format!("ConfigMap {IMAGES_CONFIGMAP}");
    // A labeled namespace without the ConfigMap (its converge has not finished yet) names nothing.
    let found = api.get_opt(IMAGES_CONFIGMAP).await.map_err(read_error(what, namespace))?;
    Ok(found.and_then(|cm| cm.data).map(|data| data.into_values().collect()).unwrap_or_default())
}

async fn custom_resource_refs(
    client: &Client,
    namespace: &str,
    resource: &CustomResource,
) -> Result<Vec<String>, KubeError> {
    let gvk = GroupVersionKind::gvk(&resource.group, &resource.version, &resource.kind);
    let api_resource = ApiResource::from_gvk_with_plural(&gvk, &resource.plural);
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &api_resource);
    let what = format!("{}.{}", resource.plural, resource.group);
    let objects = api.list(&ListParams::default()).await.map_err(read_error(what, namespace))?;
    Ok(objects
        .items
        .iter()
        .filter_map(|object| object.data.get("spec")?.get("image")?.as_str())
        .filter(|image| !image.is_empty())
        .map(str::to_string)
        .collect())
}

async fn pod_refs(client: &Client, namespace: &str) -> Result<Vec<String>, KubeError> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pods = api.list(&ListParams::default()).await.map_err(read_error("pods", namespace))?;
    Ok(pods.items.iter().flat_map(pod_images).collect())
}

/// Every image a pod names: containers, init and ephemeral containers, and the images and image
/// ids its statuses report (`imageID` without the `docker-pullable://` or `docker://` scheme, so
/// it reads as `repo@sha256:…` or a bare `sha256:…`).
pub fn pod_images(pod: &Pod) -> Vec<String> {
    let mut images = Vec::new();
    if let Some(spec) = &pod.spec {
        images.extend(spec.containers.iter().filter_map(|c| c.image.clone()));
        images.extend(spec.init_containers.iter().flatten().filter_map(|c| c.image.clone()));
        images.extend(spec.ephemeral_containers.iter().flatten().filter_map(|c| c.image.clone()));
    }
    if let Some(status) = &pod.status {
        let statuses = status
            .container_statuses
            .iter()
            .flatten()
            .chain(status.init_container_statuses.iter().flatten())
            .chain(status.ephemeral_container_statuses.iter().flatten());
        for s in statuses {
            images.push(s.image.clone());
            let id = s.image_id.trim_start_matches("docker-pullable://").trim_start_matches("docker://");
            images.push(id.to_string());
        }
    }
    images.retain(|image| !image.is_empty());
    images.dedup();
    images
}
