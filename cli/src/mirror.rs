//! `kiln mirror [DIR]`: copy the instance's pinned images into its `mirror_registry` and nothing
//! else — no walk, no build, no record, no sweep. The copy runs where a converge's would (the
//! coordinator, which reaches the farm's registries); its events stream here through the same
//! renderers as `kiln up`, copies with their bytes. `--dry-run` lists what would be copied.

use std::path::PathBuf;

use kiln_core::manifest::Manifest;

use crate::embedded::with_coordinator;
use crate::error::CliError;
use crate::render::{renderer, OutputMode, Render};
use crate::request::{plan_mirror, UpPlan};
use crate::up::{converge, UpOutcome};
use crate::Connect;

/// What `kiln mirror` is asked.
#[derive(Clone, Debug)]
pub struct MirrorArgs {
    /// The instance folder holding `kiln.toml`.
    pub dir: PathBuf,
    /// Only say what would be copied; copy nothing.
    pub dry_run: bool,
    pub connect: Connect,
    pub output: OutputMode,
}

/// `kiln mirror`, showing events on stdout as `args.output` says.
pub async fn mirror(args: MirrorArgs) -> Result<UpOutcome, CliError> {
    let mut render = renderer(args.output);
    mirror_with(&args, render.as_mut()).await
}

/// `kiln mirror`, showing events through `render`.
pub async fn mirror_with(args: &MirrorArgs, render: &mut dyn Render) -> Result<UpOutcome, CliError> {
    let dir = args.dir.clone();
    let manifest = tokio::task::spawn_blocking(move || Manifest::load(&dir))
        .await
        .map_err(|_| CliError::Panicked { what: "manifest" })??;
    // Said here, before any coordinator starts: a manifest without a mirror has nothing to copy to.
    if manifest.mirror_registry.is_none() {
        return Err(CliError::NoMirror { manifest: manifest.path.clone() });
    }
    let request = plan_mirror(&manifest, args.dry_run, &crate::home::requested_by());
    let plan = UpPlan { request, contexts: Default::default(), staged: Default::default() };
    // No host agent: a copy registry to registry touches no image store, so `kiln mirror` runs
    // where no Docker daemon does.
    let outcome = with_coordinator(&args.connect, false, |link| converge(link, &plan, &mut *render)).await;
    render.finish().map_err(CliError::Output)?;
    outcome
}
