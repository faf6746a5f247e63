//! Where a pinned image lives once `mirror_registry` re-homes it (ADR-0044, DESIGN.md "pinned
//! image"): `<mirror>/<last path component>:<tag>@<digest>`, so
//! `docker.io/envoyproxy/envoy:v1.30.1@sha256:ab…` behind `registry.farm.internal:5000/mirror`
//! becomes `registry.farm.internal:5000/mirror/envoy:v1.30.1@sha256:ab…`.
//!
//! The digest never moves with the registry: it is what the workloads pull and what the copy is
//! checked against. The tag rides along because the mirror is pushed under it too — a registry's
//! `garbage-collect --delete-untagged` would otherwise free a manifest only a digest names — and
//! because a reader of the record should see which version is pinned, not only a hash.

use super::{ImageRef, RefError, RefProblem};

/// The ref `pinned` (which carries a digest) has in the mirror `mirror` (`host[:port][/prefix]`).
pub fn mirrored(pinned: &ImageRef, mirror: &str) -> Result<ImageRef, RefError> {
    let Some(digest) = pinned.digest() else {
        return Err(RefError::new(&pinned.normalized(), RefProblem::BadDigest { digest: String::new() }));
    };
    let name = pinned.path().rsplit('/').next().unwrap_or(pinned.path());
    let tag = pinned.tag().map(|t| format!(":{t}")).unwrap_or_default();
    let mirror = mirror.trim_end_matches('/');
    let parsed = ImageRef::parse(&format!("{mirror}/{name}{tag}@{digest}"))?;
    // `mirror` must name a registry: without a '.', a port or `localhost` its first component
    // would be read as a Docker Hub user, and the copy would go to Docker Hub.
    let host = mirror.split('/').next().unwrap_or(mirror);
    if parsed.domain() != host {
        let problem = RefProblem::BadDomain {
            domain: host.to_string(),
            why: "a mirror registry's host needs a '.', a port, or to be localhost",
        };
        return Err(RefError::new(mirror, problem));
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "4a77b1c2d3e4f5061728394a5b6c7d8e9f00112233445566778899aabbccddee";

    fn pinned(r: &str) -> ImageRef {
        ImageRef::parse(r).unwrap()
    }

    #[test]
    fn a_pinned_image_keeps_its_name_tag_and_digest_behind_the_mirror() {
        let upstream = pinned(&format!("envoyproxy/envoy:v1.30.1@sha256:{HEX}"));
        let got = mirrored(&upstream, "registry.farm.internal:5000/mirror").unwrap();
        assert_eq!(got.to_string(), format!("registry.farm.internal:5000/mirror/envoy:v1.30.1@sha256:{HEX}"));
        assert_eq!(got.digest(), upstream.digest());
    }

    #[test]
    fn an_official_image_and_a_mirror_without_prefix() {
        let got = mirrored(&pinned(&format!("postgres:16@sha256:{HEX}")), "127.0.0.1:5000").unwrap();
        assert_eq!(got.to_string(), format!("127.0.0.1:5000/postgres:16@sha256:{HEX}"));
    }

    #[test]
    fn a_mirror_that_reads_as_a_docker_hub_user_is_refused() {
        let err = mirrored(&pinned(&format!("envoy:1@sha256:{HEX}")), "mirror/upstream").unwrap_err();
        assert!(err.to_string().contains("needs a '.', a port"), "{err}");
    }

    #[test]
    fn a_ref_without_a_digest_has_no_mirrored_form() {
        assert!(mirrored(&pinned("envoy:1"), "127.0.0.1:5000").is_err());
    }
}
