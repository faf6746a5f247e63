//! Step 1 of the converge: every built image's address and content ref, bases first.
//!
//! The one way to address a manifest's images, shared by `kiln up`, `kiln refs` and the tests, so
//! no caller can forget an input: the tree digest, the Dockerfile as built (an outside one's bytes,
//! or any one's rewritten to its bases' content refs — see `from`), the Dockerfile path, build
//! args, target stage and platforms.

use std::collections::BTreeMap;

use super::{AddressError, BuiltDockerfile, BuiltImage, Manifest};
use crate::digest::{Tree, TreeDigest};
use crate::refs::{content_ref, image_address, ImageAddress, ImageRef};

/// One built image, addressed.
#[derive(Clone, Debug)]
pub struct Addressed<'a> {
    pub name: &'a str,
    pub image: &'a BuiltImage,
    pub tree: TreeDigest,
    /// What the agent builds from, and what travels beside the context archive.
    pub dockerfile: BuiltDockerfile,
    pub address: ImageAddress,
    /// `<repository on the target>:<content tag>`.
    pub reference: ImageRef,
}

/// A built image that could not be addressed, by name.
#[derive(Debug, thiserror::Error)]
#[error("built image {image:?} cannot be addressed")]
pub struct ImageAddressError {
    pub image: String,
    #[source]
    pub err: AddressError,
}

impl Manifest {
    /// Addresses every built image from its context's tree digest (`trees`, by image name), in
    /// [`Manifest::build_order`] — a child's Dockerfile names its bases' content refs, so those are
    /// computed first — and returns them in that order. Reads each Dockerfile once; the walks are
    /// the caller's (`kiln up` runs them in parallel).
    pub fn address(&self, trees: &BTreeMap<&str, TreeDigest>) -> Result<Vec<Addressed<'_>>, ImageAddressError> {
        let mut refs: BTreeMap<String, ImageRef> = BTreeMap::new();
        let mut out = Vec::new();
        for (name, image) in self.build_order() {
            let fail = |err| ImageAddressError { image: name.to_string(), err };
            let tree = *trees.get(name).ok_or_else(|| fail(AddressError::NotWalked))?;
            let dockerfile = image.dockerfile_as_built(&refs).map_err(fail)?;
            let address = image_address(&image.address_inputs(tree, &self.platforms, &dockerfile));
            let reference = content_ref(&self.target.qualify(&image.repository), &address, &self.platforms)
                .map_err(|err| fail(err.into()))?;
            refs.insert(name.to_string(), reference.clone());
            out.push(Addressed { name, image, tree, dockerfile, address, reference });
        }
        Ok(out)
    }

    /// Walks every built image's context one after another, then addresses them (build order):
    /// for `kiln refs` and tests. Also returns each walk's entries, by image name.
    pub fn walk_and_address(&self) -> Result<(Vec<Addressed<'_>>, BTreeMap<String, Tree>), ImageAddressError> {
        let mut trees = BTreeMap::new();
        let mut walked = BTreeMap::new();
        for (name, image) in self.built() {
            let (tree, digest) = image.walk().map_err(|err| ImageAddressError { image: name.to_string(), err })?;
            trees.insert(name, digest);
            walked.insert(name.to_string(), tree);
        }
        Ok((self.address(&trees)?, walked))
    }
}
