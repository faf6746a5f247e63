//! Where a converge and `kiln down` meet the cluster: after the record is written, publish the
//! instance's images in its namespace and report the workloads still on older refs; on down,
//! delete its ConfigMap. Without a configured client or a namespace in the manifest, nothing.

use crate::engine::Failure;
use crate::events::Events;
use crate::model::EventKind;
use crate::plan::UpPlan;
use crate::Config;

use super::{delete_images, stale_workloads, write_images, IMAGES_CONFIGMAP};

/// After the record: write `kiln-images`, then report (never touch) workloads on older refs.
///
/// A failed write fails the converge although its record stands, so the user hears that readers
/// of the ConfigMap still see the old refs; `kiln up` again skips every image by record and
/// retries the write.
pub(crate) async fn published(config: &Config, plan: &UpPlan, generation: u64, events: &Events) -> Result<(), Failure> {
    let (Some(kube), Some(namespace)) = (&config.kubernetes, &plan.namespace) else { return Ok(()) };
    let images: Vec<(String, String)> =
        plan.images.iter().map(|image| (image.name.clone(), image.reference.clone())).collect();
    if let Err(err) = write_images(&kube.client, namespace, &plan.instance, &images).await {
        return Err(Failure {
            image: None,
            reason: format!(
                "recorded generation {generation}, but its images are not published: {} — run `kiln up` again",
                kiln_core::error_chain(&err)
            ),
        });
    }
    events.emit(
        EventKind::Note,
        None,
        format!("ConfigMap {IMAGES_CONFIGMAP} in namespace {namespace} names {} image(s)", images.len()),
    );
    match stale_workloads(&kube.client, namespace, &images).await {
        Ok(notes) => notes.into_iter().for_each(|note| events.emit(EventKind::Note, None, note)),
        Err(err) => events.emit(
            EventKind::Note,
            None,
            format!("workloads on older refs not reported: {}", kiln_core::error_chain(&err)),
        ),
    }
    Ok(())
}

/// `kiln down`: the instance's ConfigMap goes with its record, so its refs stop being roots.
pub(crate) async fn unpublished(config: &Config, instance: &str, events: &Events) -> Result<(), Failure> {
    let Some(kube) = &config.kubernetes else { return Ok(()) };
    let deleted = delete_images(&kube.client, instance)
        .await
        .map_err(|err| Failure { image: None, reason: kiln_core::error_chain(&err) })?;
    for namespace in deleted {
        events.emit(EventKind::Note, None, format!("deleted ConfigMap {IMAGES_CONFIGMAP} in namespace {namespace}"));
    }
    Ok(())
}
