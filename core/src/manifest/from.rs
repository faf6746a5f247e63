//! Built images that build `FROM` other built images of the same manifest: which ones (read from
//! each Dockerfile when the manifest loads), the order they build in, and each Dockerfile as it is
//! built — its bases' names replaced by their content refs.
//!
//! # How a Dockerfile names a base
//!
//! A `FROM` image (as [`crate::dockerfile`] reads it: not a stage declared above, not a variable,
//! not `scratch`) names built image `b` when it is exactly `b`'s manifest name (`FROM base`), `b`'s
//! repository (`FROM shop-base`), or that repository as the target qualifies it
//! (`FROM 127.0.0.1:5000/team/shop-base`) — with no tag or digest: `b`'s tags are content addresses
//! nobody writes by hand, and a tag written by hand names an image from somewhere else. When a name
//! and another image's repository are the same word, the name wins. Anything else (`busybox:1.36`,
//! `shop-base:v1`, `docker.io/library/base`) is left as written. A Dockerfile that is not UTF-8 names
//! no base.
//!
//! # How the child's address includes the base's
//!
//! Before addressing a child, its Dockerfile is rewritten: each `FROM` naming a base gets the base's
//! full content ref (`FROM shop-base:4a77b1c2d3e4-amd64`), every other byte kept. Those bytes travel
//! beside the context archive exactly as a Dockerfile kept outside the context does
//! (`ImageSpec.dockerfile_outside`): the address hashes them and the agent builds them, appended to
//! the context as `.kiln-dockerfile`. So a child's tag moves whenever its base's does, and nothing
//! new has to be trusted: the coordinator recomputes the address from the bytes it will send to the
//! agent, and the agent verifies the context archive as it always has. A Dockerfile with no base is
//! sent and addressed exactly as before, so its tag does not change. (As for an outside Dockerfile,
//! the build then names `.kiln-dockerfile`, so the context's own Dockerfile is an ordinary file of
//! the context: one `.dockerignore` names stays visible to a `COPY` — it is in the tree digest, so
//! the tag still names exactly what was built.)
//!
//! A base must be built before its children (their `FROM` names its tag), so the images build in
//! [`Manifest::build_order`], and a cycle — including an image naming itself — is a manifest error
//! naming the cycle.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::built::relative_from;
use super::error::{ManifestError, Problem};
use super::resolve::Ctx;
use super::{AddressError, BuiltImage, DockerfileLoc, Image, ImageSpec, Manifest, Target};
use crate::dockerfile::{from_images, rewrite};
use crate::order::topological;
use crate::refs::ImageRef;

/// A built image of the same manifest that an image builds `FROM`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Base {
    /// The base's manifest name.
    pub image: String,
    /// How the Dockerfile names it (`base`, `shop-base`, `127.0.0.1:5000/team/shop-base`): the text
    /// replaced by the base's content ref.
    pub written: String,
    /// The Dockerfile line of the first `FROM` naming it so.
    pub line: usize,
}

/// A built image's Dockerfile as the agent builds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuiltDockerfile {
    /// The bytes that travel beside the context archive (`ImageSpec.dockerfile_outside`) and enter
    /// the address: a Dockerfile outside the context, a staged image's, or any Dockerfile once its
    /// bases are rewritten. `None`: the build reads the Dockerfile inside the context as it is, which the tree
    /// digest already covers.
    pub sent: Option<Vec<u8>>,
    /// blake3 (64 hex) of the bytes built, so a converge can tell "Dockerfile changed" apart from
    /// the rest of the context.
    pub digest: String,
}

impl BuiltImage {
    /// The Dockerfile's absolute path.
    pub fn dockerfile_file(&self) -> PathBuf {
        match &self.dockerfile {
            DockerfileLoc::Inside { rel } => self.context.join(rel),
            DockerfileLoc::Outside { path, .. } => path.clone(),
        }
    }

    /// The manifest names of the built images this one builds `FROM`, each once, in the order the
    /// Dockerfile first names them.
    pub fn base_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for base in &self.from {
            if !names.contains(&base.image.as_str()) {
                names.push(&base.image);
            }
        }
        names
    }

    /// Reads the Dockerfile once and gives it as built: each `FROM` naming a base replaced by that
    /// base's content ref from `bases` (by manifest name). The bytes returned are the ones to send
    /// and to address; reading the file again could give others.
    pub fn dockerfile_as_built(&self, bases: &BTreeMap<String, ImageRef>) -> Result<BuiltDockerfile, AddressError> {
        let path = self.dockerfile_file();
        let bytes = std::fs::read(&path).map_err(|err| AddressError::Dockerfile { path: path.clone(), err })?;
        let sent = if self.from.is_empty() {
            // A staged tree is written by a command, not by the manifest's author: the Dockerfile
            // read here, not any copy the command made, is the one built and addressed.
            let travels = matches!(self.dockerfile, DockerfileLoc::Outside { .. }) || self.stage.is_some();
            travels.then(|| bytes.clone())
        } else {
            // It named these bases when the manifest loaded; if it no longer does, the file was
            // edited in between, and rewriting what is there now could drop a base silently.
            let changed = || AddressError::DockerfileChanged { path: path.clone() };
            let text = std::str::from_utf8(&bytes).map_err(|_| changed())?;
            let found = from_images(text);
            let mut replacements = Vec::new();
            for base in &self.from {
                let reference =
                    bases.get(&base.image).ok_or_else(|| AddressError::BaseUnaddressed { base: base.image.clone() })?;
                let before = replacements.len();
                replacements.extend(
                    found.iter().filter(|f| f.image == base.written).map(|f| (f.span.clone(), reference.to_string())),
                );
                if replacements.len() == before {
                    return Err(changed());
                }
            }
            Some(rewrite(text, &replacements).into_bytes())
        };
        let digest = blake3::hash(sent.as_deref().unwrap_or(&bytes)).to_hex().to_string();
        Ok(BuiltDockerfile { sent, digest })
    }
}

impl Manifest {
    /// The built images, each after the built images it builds `FROM`; otherwise in file order.
    /// A loaded manifest has no cycle; one put together by hand with a cycle keeps file order, and
    /// addressing it fails naming the base not yet addressed.
    pub fn build_order(&self) -> Vec<(&str, &BuiltImage)> {
        let built: Vec<(&str, &BuiltImage)> = self.built().collect();
        let deps = dependencies(&built);
        let order = topological(&deps).unwrap_or_else(|_| (0..built.len()).collect());
        order.into_iter().map(|i| built[i]).collect()
    }
}

/// For each built image, the indices (into `built`) of the images it builds `FROM`. A base that is
/// not a built image of `built` is ignored here (the loader never records one).
fn dependencies(built: &[(&str, &BuiltImage)]) -> Vec<Vec<usize>> {
    let index: HashMap<&str, usize> = built.iter().enumerate().map(|(i, (name, _))| (*name, i)).collect();
    built
        .iter()
        .map(|(_, image)| image.base_names().iter().filter_map(|name| index.get(name).copied()).collect())
        .collect()
}

/// Reads every built image's Dockerfile, records the bases it builds `FROM`, and refuses a cycle.
/// `spans[i]` is the table of `images[i]`, where an error about that image points.
pub(super) fn resolve_bases(
    ctx: &Ctx<'_>,
    images: &mut [Image],
    spans: &[Range<usize>],
    target: &Target,
) -> Result<(), ManifestError> {
    let mut names: HashMap<String, String> = HashMap::new();
    for image in images.iter().filter(|i| matches!(i.spec, ImageSpec::Built(_))) {
        names.insert(image.name.clone(), image.name.clone());
    }
    for image in images.iter() {
        if let ImageSpec::Built(built) = &image.spec {
            for written in [built.repository.clone(), target.qualify(&built.repository)] {
                names.entry(written).or_insert_with(|| image.name.clone());
            }
        }
    }

    for (image, span) in images.iter_mut().zip(spans) {
        let ImageSpec::Built(built) = &mut image.spec else { continue };
        let path = built.dockerfile_file();
        let bytes = std::fs::read(&path).map_err(|err| {
            ctx.at(span.clone(), Problem::DockerfileUnreadable { image: image.name.clone(), path: path.clone(), err })
        })?;
        let Ok(text) = std::str::from_utf8(&bytes) else { continue };
        for found in from_images(text) {
            let Some(base) = names.get(&found.image) else { continue };
            if !built.from.iter().any(|b| b.written == found.image) {
                built.from.push(Base { image: base.clone(), written: found.image, line: found.line });
            }
        }
    }

    let built: Vec<(usize, &str, &BuiltImage)> = images
        .iter()
        .enumerate()
        .filter_map(|(i, image)| match &image.spec {
            ImageSpec::Built(built) => Some((i, image.name.as_str(), built)),
            _ => None,
        })
        .collect();
    let pairs: Vec<(&str, &BuiltImage)> = built.iter().map(|(_, name, image)| (*name, *image)).collect();
    let Err(cycle) = topological(&dependencies(&pairs)) else { return Ok(()) };
    let folder = std::fs::canonicalize(&ctx.dir).ok();
    let steps = cycle
        .windows(2)
        .map(|pair| {
            let (_, from, image) = built[pair[0]];
            let to = built[pair[1]].1;
            let base = image.from.iter().find(|b| b.image == to).expect("an edge of the cycle is a base");
            let file = shown(folder.as_deref(), &image.dockerfile_file());
            format!("{from}: {file}:{} FROM {}", base.line, base.written)
        })
        .collect();
    let names = cycle.iter().map(|&i| built[i].1.to_string()).collect();
    Err(ctx.at(spans[built[cycle[0]].0].clone(), Problem::FromCycle { cycle: names, steps }))
}

/// `path` relative to the manifest's folder when it can be, as a person finds it from there.
fn shown(folder: Option<&Path>, path: &Path) -> String {
    folder.and_then(|folder| relative_from(folder, path)).unwrap_or_else(|| path.display().to_string())
}
