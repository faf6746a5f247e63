//! The image address and the content tag `<repo>:<address12>-<platforms>`.
//!
//! A tag that named only the context's tree digest would go stale whenever anything else that
//! shapes the build changed — a Dockerfile kept outside the context, a build arg, the target stage,
//! the `-f` path, the platform set — and "present implies current" would then serve an old image.
//! That is the failure most reported against tools that tag by content, so the address hashes all of
//! them.
//!
//! # Encoding (`kiln-address-v1`)
//!
//! blake3 over the following, where `str(x)` is the byte length of `x` as a u64 little-endian
//! followed by the bytes, and `opt(x)` is `0x00` for none or `0x01` followed by `str(x)`:
//!
//! 1. `str("kiln-address-v1")` — the version; any change to this list must change it.
//! 2. the 32 raw bytes of the tree digest.
//! 3. `str(dockerfile_path)` — as given relative to the context (`Dockerfile`, `docker/api.Dockerfile`).
//! 4. `opt(dockerfile contents)` — present only for a Dockerfile that travels beside the context
//!    archive: one outside the context, or one whose `FROM` names a built image of the same manifest
//!    and was rewritten to that base's content ref (`manifest::BuiltDockerfile`), so a child's address
//!    covers its base's. A Dockerfile inside the context built as it is is already covered by the tree
//!    digest. (The encoding did not change for bases: an image with none addresses as it always did.)
//! 5. the number of build args as a u64 LE, then for each arg in byte order of its key
//!    `str(key) str(value)`.
//! 6. `opt(target stage)`.
//! 7. the number of platforms as a u64 LE, then `str(oci form)` of each (`linux/arm/v7`) in the
//!    set's order.
//!
//! Every variable-length field is length-prefixed and every optional one flagged, so no two
//! different inputs encode to the same bytes (`{A: "BC"}` and `{AB: "C"}` differ).

use std::collections::BTreeMap;
use std::fmt;

use super::{parse_parts, ImageRef, PlatformSet, RefError, TAG_LENGTH_MAX};
use crate::digest::TreeDigest;

const VERSION: &str = "kiln-address-v1";

/// The 32-byte address of a built image. Displays as 64 lowercase hex characters.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageAddress(pub [u8; 32]);

impl ImageAddress {
    /// The first 12 hex characters: the part of a content tag that names the content.
    pub fn short12(&self) -> String {
        self.to_string()[..12].to_string()
    }
}

impl fmt::Display for ImageAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

impl fmt::Debug for ImageAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ImageAddress({self})")
    }
}

/// Everything a build's result depends on besides the base images it pulls.
#[derive(Clone, Copy, Debug)]
pub struct AddressInputs<'a> {
    pub tree: TreeDigest,
    /// The contents of the Dockerfile built when it travels beside the archive (outside the
    /// context, or rewritten to name its bases' content refs); `None` when the build reads the
    /// context's own file as it is.
    pub dockerfile_outside: Option<&'a [u8]>,
    /// The Dockerfile path as given relative to the context: a different `-f` builds differently.
    pub dockerfile_path: &'a str,
    pub build_args: &'a BTreeMap<String, String>,
    pub target: Option<&'a str>,
    pub platforms: &'a PlatformSet,
}

/// Hashes `inputs` with the `kiln-address-v1` encoding (module docs).
pub fn image_address(inputs: &AddressInputs<'_>) -> ImageAddress {
    let mut h = blake3::Hasher::new();
    put_str(&mut h, VERSION.as_bytes());
    h.update(&inputs.tree.0);
    put_str(&mut h, inputs.dockerfile_path.as_bytes());
    put_opt(&mut h, inputs.dockerfile_outside);
    h.update(&(inputs.build_args.len() as u64).to_le_bytes());
    for (key, value) in inputs.build_args {
        put_str(&mut h, key.as_bytes());
        put_str(&mut h, value.as_bytes());
    }
    put_opt(&mut h, inputs.target.map(str::as_bytes));
    h.update(&(inputs.platforms.len() as u64).to_le_bytes());
    for platform in inputs.platforms.iter() {
        put_str(&mut h, platform.oci().as_bytes());
    }
    ImageAddress(*h.finalize().as_bytes())
}

fn put_str(h: &mut blake3::Hasher, bytes: &[u8]) {
    h.update(&(bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

fn put_opt(h: &mut blake3::Hasher, bytes: Option<&[u8]>) {
    match bytes {
        None => {
            h.update(&[0]);
        }
        Some(bytes) => {
            h.update(&[1]);
            put_str(h, bytes);
        }
    }
}

/// The content tag `<address12>-<platforms>`, e.g. `4a77b1c2d3e4-amd64.arm64`.
pub fn content_tag(address: &ImageAddress, platforms: &PlatformSet) -> Result<String, ContentTagError> {
    let tag = format!("{}-{platforms}", address.short12());
    if tag.len() > TAG_LENGTH_MAX {
        return Err(ContentTagError::TooLong { platforms: platforms.to_string(), len: tag.len() });
    }
    Ok(tag)
}

/// `<repo>:<content tag>`. `repo` is a repository name without tag or digest, with or without a
/// registry (`shop-api`, `127.0.0.1:5000/team/shop-api`).
pub fn content_ref(repo: &str, address: &ImageAddress, platforms: &PlatformSet) -> Result<ImageRef, ContentTagError> {
    let tag = content_tag(address, platforms)?;
    let parsed = parse_parts(repo).map_err(|err| ContentTagError::Repository { repo: repo.to_string(), err })?;
    if parsed.tag.is_some() || parsed.digest.is_some() {
        return Err(ContentTagError::RepositoryHasTag { repo: repo.to_string() });
    }
    parsed.with_tag(&tag).map_err(|err| ContentTagError::Repository { repo: repo.to_string(), err })
}

/// Why a content tag could not be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ContentTagError {
    #[error(
        "content tag for platforms {platforms:?} would be {len} characters, over Docker's {TAG_LENGTH_MAX} — \
         build fewer platforms in one image"
    )]
    TooLong { platforms: String, len: usize },
    #[error("repository {repo:?} cannot carry a content tag")]
    Repository {
        repo: String,
        #[source]
        err: RefError,
    },
    #[error("repository {repo:?} already has a tag or digest — give the repository name alone")]
    RepositoryHasTag { repo: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short12_is_the_hex_prefix() {
        let mut bytes = [0u8; 32];
        bytes[0] = 0x4a;
        bytes[1] = 0x77;
        bytes[5] = 0xff;
        bytes[6] = 0x01;
        let address = ImageAddress(bytes);
        assert_eq!(address.short12(), "4a77000000ff");
        assert_eq!(address.to_string().len(), 64);
        assert!(address.to_string().starts_with("4a77000000ff01"));
    }
}
