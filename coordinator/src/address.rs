//! A tag cannot lie: the coordinator recomputes every built image's content ref from what it
//! verifies, and refuses the ref a client sent unless it is exactly that.
//!
//! A content tag promises "present implies current": whoever finds it may use it without a build.
//! Taken as the client computed it, one raw `Up` could build any bytes under any name — a tag
//! another instance owns (rebuilt with `force` from other bytes, after which its owner's converge
//! said "recorded" over them), a ref Kiln never built (`victim:latest`, later untagged by a sweep or
//! `down`), or a push to whatever registry the ref named. So the address is computed here from the
//! inputs the build will use — the context's tree digest (verified on upload and again by the
//! agent), the Dockerfile path it hashed and the bytes of a Dockerfile sent beside the context
//! (built from exactly those), the build args, the target stage and the platform set — with the same `kiln_core`
//! functions the CLI uses, and the ref must be that address in the target's registry.
//!
//! An image built FROM another built image of the converge needs nothing more here: its Dockerfile
//! travels in `dockerfile_outside` with the base's content ref written into the `FROM` (the CLI
//! rewrites it), so the bytes hashed are the bytes the agent builds, and the base's address is part
//! of the child's. `plan::check_bases` makes sure `from` is what those bytes build FROM.

use kiln_core::refs::{content_ref, image_address, AddressInputs, ImageRef, Platform, PlatformSet};
use kiln_core::sweep::hold_key;
use kiln_proto::v1 as pb;
use tonic::Status;

use crate::plan::{BuildInputs, Target};

/// The request's platforms as the set a content tag names: canonical, sorted, without repeats.
pub(crate) fn platform_set(platforms: &[String]) -> Result<PlatformSet, Status> {
    let parsed = platforms
        .iter()
        .map(|p| Platform::parse(p).map_err(|e| Status::invalid_argument(format!("UpRequest.platforms: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    PlatformSet::new(parsed).map_err(|e| Status::invalid_argument(format!("UpRequest.platforms: {e}")))
}

/// The Dockerfile path a built image's address hashed: `dockerfile_path`, which an outside
/// Dockerfile needs (its path is not `dockerfile`, which the agent ignores then), and which must
/// be `dockerfile` for one inside the context — the path the agent builds from.
fn hashed_dockerfile_path<'a>(image: &'a pb::ImageSpec, at: &dyn Fn(&str) -> String) -> Result<&'a str, Status> {
    let path = &image.dockerfile_path;
    if !image.dockerfile_outside.is_empty() {
        if path.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{}: dockerfile_path is missing — the Dockerfile lies outside the context, and its path is part of \
                 the address the coordinator recomputes; upgrade the kiln CLI that sent it",
                at("dockerfile_path")
            )));
        }
        return Ok(path);
    }
    if !path.is_empty() && *path != image.dockerfile {
        return Err(Status::invalid_argument(format!(
            "{}: sent {path:?}, but the Dockerfile built is dockerfile {:?} inside the context — an address hashes \
             the path it is built from",
            at("dockerfile_path"),
            image.dockerfile
        )));
    }
    Ok(&image.dockerfile)
}

/// Refuses `sent`, a built image's ref, unless it is the content ref the coordinator computes from
/// `inputs` in the repository `sent` names, and that repository lies where `target` puts images.
pub(crate) fn check_built_ref(
    image: &pb::ImageSpec,
    sent: &ImageRef,
    inputs: &BuildInputs,
    platforms: &PlatformSet,
    target: &Target,
) -> Result<(), Status> {
    let at = |field: &str| format!("UpRequest image {:?}: {field}", image.name);
    check_placement(image, sent, target, &at)?;
    let dockerfile_path = hashed_dockerfile_path(image, &at)?;
    let address = image_address(&AddressInputs {
        tree: inputs.context,
        dockerfile_outside: (!inputs.dockerfile_outside.is_empty()).then_some(inputs.dockerfile_outside.as_slice()),
        dockerfile_path,
        build_args: &inputs.args,
        target: Some(inputs.target_stage.as_str()).filter(|stage| !stage.is_empty()),
        platforms,
    });
    let computed = content_ref(&sent.repository(), &address, platforms)
        .map_err(|e| Status::invalid_argument(format!("{}: {e}", at("reference"))))?;
    if computed != *sent {
        return Err(Status::invalid_argument(format!(
            "{}: sent {:?}, but its context digest, Dockerfile, build args, target stage and platforms address \
             {:?} — a built image's tag is the address the coordinator computes, so it names exactly the bytes \
             built; re-run `kiln up` with a CLI that computes refs as this coordinator does",
            at("reference"),
            image.reference,
            computed.to_string()
        )));
    }
    Ok(())
}

/// The ref's registry and repository: the target's registry and prefix for `registry` (where it is
/// pushed), none for the other targets, and never Kiln's own hold namespace.
fn check_placement(
    image: &pb::ImageSpec,
    sent: &ImageRef,
    target: &Target,
    at: &dyn Fn(&str) -> String,
) -> Result<(), Status> {
    if hold_key(&sent.normalized()).is_some() {
        return Err(Status::invalid_argument(format!(
            "{}: sent {:?}, which lies in kiln-hold/, the namespace Kiln marks other farms' holds with — name \
             another repository",
            at("reference"),
            image.reference
        )));
    }
    match target {
        Target::Registry { registry } => {
            let (domain, prefix) = registry_parts(registry).ok_or_else(|| {
                Status::invalid_argument(format!("UpRequest.target.registry: {registry:?} is not host[:port][/prefix]"))
            })?;
            let inside = sent.domain() == domain
                && prefix
                    .is_none_or(|prefix| sent.path().strip_prefix(prefix).is_some_and(|rest| rest.starts_with('/')));
            if !inside {
                return Err(Status::invalid_argument(format!(
                    "{}: sent {:?}, outside the target's registry {registry} — a built image is pushed to \
                     {registry}/<repository>:<content tag> and nowhere else",
                    at("reference"),
                    image.reference
                )));
            }
        }
        Target::Kind { .. } | Target::Nodes { .. } | Target::Local => {
            // Docker's default domain is what a ref without one names: nothing is pushed anywhere.
            if sent.domain() != kiln_core::refs::DEFAULT_DOMAIN {
                return Err(Status::invalid_argument(format!(
                    "{}: sent {:?}, which names registry {}, but target kind {} names none — a built image's ref is \
                     <repository>:<content tag>",
                    at("reference"),
                    image.reference,
                    sent.domain(),
                    match target {
                        Target::Kind { .. } => "kind",
                        Target::Nodes { .. } => "nodes",
                        _ => "local",
                    }
                )));
            }
        }
    }
    Ok(())
}

/// `host[:port][/prefix]` as a normalized domain (`index.docker.io` is `docker.io`) and the prefix,
/// or `None` when it is not one.
fn registry_parts(registry: &str) -> Option<(String, Option<&str>)> {
    let trimmed = registry.trim_end_matches('/');
    let (host, prefix) = match trimmed.split_once('/') {
        Some((host, prefix)) => (host, Some(prefix)),
        None => (trimmed, None),
    };
    // Parsed as a ref under the registry, so the domain is normalized exactly as refs are.
    // (Two components, or Docker Hub would put a lone name under `library/`.)
    let probe = ImageRef::parse(&format!("{host}/kiln/probe")).ok()?;
    if probe.path() != "kiln/probe" || prefix.is_some_and(|p| ImageRef::parse(&format!("{host}/{p}/probe")).is_err()) {
        return None;
    }
    Some((probe.domain().to_string(), prefix))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::digest::TreeDigest;
    use std::collections::BTreeMap;

    fn inputs(tree: u8) -> BuildInputs {
        BuildInputs {
            context: TreeDigest([tree; 32]),
            dockerfile: "Dockerfile".into(),
            dockerfile_outside: Vec::new(),
            args: BTreeMap::from([("V".to_string(), "1".to_string())]),
            target_stage: String::new(),
            shared: false,
            dockerfile_digest: String::new(),
            from: Vec::new(),
        }
    }

    fn spec(reference: &str) -> pb::ImageSpec {
        pb::ImageSpec {
            name: "web".into(),
            reference: reference.into(),
            dockerfile: "Dockerfile".into(),
            ..Default::default()
        }
    }

    fn amd64() -> PlatformSet {
        platform_set(&["linux/amd64".to_string()]).unwrap()
    }

    /// The ref the CLI computes for `inputs` under `repo`.
    fn honest(repo: &str, inputs: &BuildInputs, dockerfile_path: &str) -> String {
        let outside = (!inputs.dockerfile_outside.is_empty()).then_some(inputs.dockerfile_outside.as_slice());
        let address = image_address(&AddressInputs {
            tree: inputs.context,
            dockerfile_outside: outside,
            dockerfile_path,
            build_args: &inputs.args,
            target: None,
            platforms: &amd64(),
        });
        content_ref(repo, &address, &amd64()).unwrap().to_string()
    }

    fn check(image: &pb::ImageSpec, inputs: &BuildInputs, target: &Target) -> Result<(), Status> {
        let sent = ImageRef::parse(&image.reference).unwrap();
        check_built_ref(image, &sent, inputs, &amd64(), target)
    }

    #[test]
    fn the_address_the_cli_computes_passes() {
        let ok = honest("x-web", &inputs(1), "Dockerfile");
        check(&spec(&ok), &inputs(1), &Target::Local).unwrap();
        let registry = Target::Registry { registry: "127.0.0.1:5000/team".into() };
        check(&spec(&honest("127.0.0.1:5000/team/x-web", &inputs(1), "Dockerfile")), &inputs(1), &registry).unwrap();
        let hub = Target::Registry { registry: "index.docker.io".into() };
        check(&spec(&honest("docker.io/x-web", &inputs(1), "Dockerfile")), &inputs(1), &hub).unwrap();
    }

    #[test]
    fn a_tag_other_than_the_address_is_refused_naming_both() {
        let err = check(&spec("x-web:000000000000-amd64"), &inputs(1), &Target::Local).unwrap_err();
        let computed = honest("x-web", &inputs(1), "Dockerfile");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        for part in ["image \"web\": reference", "sent \"x-web:000000000000-amd64\"", &format!("address {computed:?}")]
        {
            assert!(err.message().contains(part), "{part:?} in {}", err.message());
        }
        // Another context's honest tag: a force over it would put other bytes under it.
        let theirs = honest("x-web", &inputs(2), "Dockerfile");
        assert!(check(&spec(&theirs), &inputs(1), &Target::Local).is_err());
        assert!(check(&spec("victim:latest"), &inputs(1), &Target::Local).is_err());
        let pinned = format!("{computed}@sha256:{}", "a".repeat(64));
        assert!(check(&spec(&pinned), &inputs(1), &Target::Local).is_err(), "a digest is not a content ref");
    }

    #[test]
    fn an_outside_dockerfile_is_addressed_by_its_path_and_bytes() {
        let mut outside = inputs(1);
        outside.dockerfile_outside = b"FROM scratch\n".to_vec();
        let ok = honest("x-worker", &outside, "../worker.Dockerfile");
        let mut image = pb::ImageSpec { dockerfile: String::new(), ..spec(&ok) };
        image.dockerfile_outside = outside.dockerfile_outside.clone();
        let err = check(&image, &outside, &Target::Local).unwrap_err();
        assert!(err.message().contains("dockerfile_path is missing"), "{}", err.message());
        image.dockerfile_path = "../worker.Dockerfile".into();
        check(&image, &outside, &Target::Local).unwrap();
        let mut other_bytes = outside.clone();
        other_bytes.dockerfile_outside = b"FROM scratch\nCOPY x /\n".to_vec();
        assert!(check(&image, &other_bytes, &Target::Local).is_err());

        // Inside the context, the path hashed is the one built.
        let mut inside = spec(&honest("x-web", &inputs(1), "Dockerfile"));
        inside.dockerfile_path = "other.Dockerfile".into();
        let err = check(&inside, &inputs(1), &Target::Local).unwrap_err();
        assert!(err.message().contains("dockerfile_path: sent \"other.Dockerfile\""), "{}", err.message());
    }

    #[test]
    fn a_ref_outside_the_targets_registry_is_refused_naming_it() {
        let registry = Target::Registry { registry: "127.0.0.1:5000/team".into() };
        for repo in ["evil.io:5000/team/x-web", "127.0.0.1:5000/other/x-web", "127.0.0.1:5000/teamx/x-web", "x-web"] {
            let err = check(&spec(&honest(repo, &inputs(1), "Dockerfile")), &inputs(1), &registry).unwrap_err();
            assert!(err.message().contains("outside the target's registry 127.0.0.1:5000/team"), "{}", err.message());
        }
        let err = check(&spec(&honest("127.0.0.1:5000/x-web", &inputs(1), "Dockerfile")), &inputs(1), &Target::Local)
            .unwrap_err();
        assert!(err.message().contains("names registry 127.0.0.1:5000, but target kind local"), "{}", err.message());
    }

    #[test]
    fn kilns_hold_namespace_is_not_a_repository() {
        let hold = format!("kiln-hold/{}/x-web", "0".repeat(12));
        let err = check(&spec(&honest(&hold, &inputs(1), "Dockerfile")), &inputs(1), &Target::Local).unwrap_err();
        assert!(err.message().contains("kiln-hold/"), "{}", err.message());
    }

    #[test]
    fn platforms_become_the_set_a_tag_names() {
        let set = platform_set(&["linux/arm64".into(), "x86_64".into(), "linux/amd64".into()]).unwrap();
        assert_eq!(set.to_string(), "amd64.arm64");
        assert!(platform_set(&["linux/sparc".into()]).unwrap_err().message().contains("UpRequest.platforms"));
    }
}
