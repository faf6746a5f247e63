//! The mirror: every pinned image of a plan with a `mirror_registry` is copied there, whole (the
//! manifest list or index, every platform's manifest and blobs) and at the same digest, before
//! anything is built or recorded; the record and every delivery name the mirrored ref, which the
//! plan computed at the edge (`plan.rs`, `kiln_core::refs::mirrored`).
//!
//! # Where the copy runs: here, in the coordinator
//!
//! Not in the CLI: a CLI may converge from far away (a laptop), where the farm's registries do not
//! resolve, and a copy through it would carry every byte over the slowest link there is. Not on a
//! host agent: agents own image stores, and a pinned image touches none — it would make a converge
//! of pinned images alone wait for a host agent it does not otherwise need. The coordinator is a
//! farm service, placed where the farm's registries are reachable, and in the embedded default it
//! is the same process anyway. The bytes stream through it without landing on disk, and only when
//! a pin is new to the mirror: once per digest, ever.
//!
//! # Present, copied or refused
//!
//! - **One HEAD per image** decides: the mirror answering the pinned digest for the mirrored ref
//!   means present, and a second converge copies nothing.
//! - A copy moves exact bytes and hashes every manifest it pulls; a manifest whose sha256 is not
//!   its digest, or a mirror that then answers another digest, fails the image — the converge
//!   records nothing (`copy`).
//! - `kiln up --dry-run` and `kiln mirror --dry-run` make the same HEAD and say what would be copied.

mod copy;
mod index;

pub use index::{Assembled, IndexError, Part};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kiln_core::refs::ImageRef;

use copy::CopyError;

use crate::engine::Failure;
use crate::events::Events;
use crate::model::EventKind;
use crate::plan::{PlanImage, UpPlan};

/// How often a copy's byte count is sent to the client.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// One registry client per pair of registries, kept for the coordinator's life: its connections
/// stay open and the tokens it was given stay cached between converges. (A registry that asks no
/// auth still gets oci-client's `GET /v2/` version check before each request; it is a ping, not a
/// manifest or blob request.)
#[derive(Default)]
pub struct Registries(Mutex<HashMap<(String, String), oci_client::Client>>);

impl std::fmt::Debug for Registries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registries").finish_non_exhaustive()
    }
}

impl Registries {
    fn client(&self, upstream: &str, mirror: &str) -> oci_client::Client {
        let mut clients = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let key = (upstream.to_string(), mirror.to_string());
        clients.entry(key).or_insert_with(|| copy::client(&[upstream, mirror])).clone()
    }

    /// Assembles the index of a multi-platform image's `parts` in its registry, under `content`
    /// (`index`).
    pub async fn assemble_index(&self, content: &ImageRef, parts: &[Part]) -> Result<Assembled, IndexError> {
        let client = self.client(content.domain(), content.domain());
        index::assemble(&client, content, parts).await
    }
}

/// Brings every pinned image of `plan` into its mirror, or says what it would copy in a dry run.
/// The first image that cannot be brought fails the converge, naming it.
pub async fn mirror_pinned(registries: &Registries, plan: &UpPlan, events: &Events) -> Result<(), Failure> {
    for image in plan.images.iter().filter(|i| i.mirrored_from.is_some()) {
        mirror_one(registries, image, plan.dry_run, events).await.map_err(|err| Failure {
            image: Some(image.name.clone()),
            reason: format!("mirror: {}", kiln_core::error_chain(&err)),
        })?;
    }
    Ok(())
}

async fn mirror_one(
    registries: &Registries,
    image: &PlanImage,
    dry_run: bool,
    events: &Events,
) -> Result<(), CopyError> {
    let name = image.name.as_str();
    let upstream_text = image.mirrored_from.as_deref().unwrap_or_default();
    // Both were parsed at the edge; a pin always carries its digest.
    let (Ok(upstream), Ok(mirrored)) = (ImageRef::parse(upstream_text), ImageRef::parse(&image.reference)) else {
        return Err(CopyError::Unreadable { reference: image.reference.clone(), why: "not a ref".into() });
    };
    let digest = upstream.digest().unwrap_or_default().to_string();
    let (from, to) = (copy::Place::of(&upstream), copy::Place::of(&mirrored));
    let client = registries.client(&from.registry, &to.registry);

    if copy::present(&client, &to, &digest).await? {
        let kind = EventKind::InMirror { reference: image.reference.clone() };
        events.emit(kind, Some(name), format!("in mirror: {}", image.reference));
        return Ok(());
    }
    if dry_run {
        let kind = EventKind::WouldMirror { reference: image.reference.clone(), from: upstream_text.to_string() };
        events.emit(kind, Some(name), format!("would copy {upstream_text} → {}", image.reference));
        return Ok(());
    }

    let (moved, total) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let ticker = {
        let (moved, total, events, name) = (moved.clone(), total.clone(), events.clone(), name.to_string());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROGRESS_EVERY).await;
                events.progress_saying(&name, "copying", moved.load(Ordering::Relaxed), total.load(Ordering::Relaxed));
            }
        })
    };
    let started = Instant::now();
    let copying = copy::copy(&client, &from, &to, &digest, mirrored.tag(), moved, total).await;
    ticker.abort();
    let copied = copying?;
    let millis = started.elapsed().as_millis() as u64;
    let words = match copied.reused {
        0 => format!("copied {} blob(s) from {upstream_text} → {}", copied.blobs, image.reference),
        n => format!("copied {} blob(s), {n} already there, from {upstream_text} → {}", copied.blobs, image.reference),
    };
    let kind =
        EventKind::Mirrored { reference: image.reference.clone(), bytes: copied.bytes, blobs: copied.blobs, millis };
    events.emit(kind, Some(name), words);
    Ok(())
}
