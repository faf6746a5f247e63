//! What a client asks a converge for, as domain types: the `UpRequest` is checked and converted here,
//! at the edge, and a missing or malformed field becomes `InvalidArgument` naming it.

use kiln_core::digest::TreeDigest;
use kiln_core::refs::ImageRef;
use kiln_proto::v1 as pb;
use std::collections::BTreeMap;
use tonic::Status;

/// Where the images go, with the identity a record stores beside each ref.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Registry { registry: String },
    Kind { cluster: String },
    Nodes { cluster: String },
    Local,
}

impl Target {
    /// The target's identity in a record: a record names "this ref at this target".
    pub fn identity(&self) -> String {
        match self {
            Target::Registry { registry } => format!("registry:{registry}"),
            Target::Kind { cluster } => format!("kind:{cluster}"),
            Target::Nodes { cluster } => format!("nodes:{cluster}"),
            Target::Local => "local".to_string(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct BuildInputs {
    pub context: TreeDigest,
    pub dockerfile: String,
    pub dockerfile_outside: Vec<u8>,
    pub args: BTreeMap<String, String>,
    pub target_stage: String,
    pub shared: bool,
    /// blake3 of the Dockerfile's bytes; empty from a client that does not say.
    pub dockerfile_digest: String,
    /// The names of the built images of this converge this image builds `FROM`, each once: it
    /// must be built after them, and on a store that holds them (its Dockerfile, sent in
    /// `dockerfile_outside`, names their content refs). Checked at the edge ([`check_bases`]):
    /// every name is a built image of the plan whose ref that Dockerfile builds FROM, every built
    /// image's ref it builds FROM is named, and the graph has no cycle — so the engine may follow
    /// it without looking at a Dockerfile.
    pub from: Vec<String>,
}

#[derive(Clone, Debug)]
pub enum PlanKind {
    Built(BuildInputs),
    Brought,
    Pinned,
}

#[derive(Clone, Debug)]
pub struct PlanImage {
    pub name: String,
    /// As the client wrote it; brought and pinned refs pass into the record untouched — except a
    /// pinned ref re-homed by `mirror_registry`, which is its mirrored ref from the edge on, so the
    /// record, the `kiln-images` ConfigMap and every root name the mirror.
    pub reference: String,
    pub kind: PlanKind,
    /// A pinned image re-homed by `mirror_registry`: the upstream ref it is copied from.
    pub mirrored_from: Option<String>,
}

#[derive(Clone, Debug)]
pub struct UpPlan {
    pub instance: String,
    pub target: Target,
    /// The Kubernetes namespace of the instance's `kiln-images` ConfigMap, when its manifest names one.
    pub namespace: Option<String>,
    pub platforms: Vec<String>,
    pub images: Vec<PlanImage>,
    pub force: bool,
    pub requested_by: String,
    /// Plan only: say what would happen to each image and why; change nothing anywhere.
    pub dry_run: bool,
    /// The team the manifest names as the instance's owner.
    pub team: Option<String>,
    /// `host[:port][/prefix]` the pinned images are copied into, when the manifest names one.
    pub mirror_registry: Option<String>,
    /// `kiln mirror`: copy the pinned images and nothing else — no claim, build, record or sweep.
    pub mirror_only: bool,
}

impl Target {
    /// The wire's target of `instance`; a kind left unset is refused naming the manifest's fix.
    pub fn of(instance: &str, target: pb::Target) -> Result<Target, Status> {
        Ok(match target.kind() {
            pb::target::Kind::Registry if !target.registry.is_empty() => Target::Registry { registry: target.registry },
            pb::target::Kind::Registry => return Err(missing("target.registry")),
            pb::target::Kind::Kind => Target::Kind { cluster: target.cluster },
            pb::target::Kind::Nodes => Target::Nodes { cluster: target.cluster },
            pb::target::Kind::Local => Target::Local,
            pb::target::Kind::Unspecified => {
                return Err(Status::invalid_argument(format!(
                    "instance {instance} names no target kind — set kind = \"registry\" (or kind, nodes, local) in [target]"
                )))
            }
        })
    }
}

fn missing(field: &str) -> Status {
    Status::invalid_argument(format!("UpRequest.{field} is missing"))
}

impl TryFrom<pb::UpRequest> for UpPlan {
    type Error = Status;

    fn try_from(req: pb::UpRequest) -> Result<UpPlan, Status> {
        if req.instance.is_empty() {
            return Err(missing("instance"));
        }
        let target = req.target.ok_or_else(|| {
            Status::invalid_argument(format!(
                "instance {} names no target — add [target] with kind = \"registry\" and registry = \"host:port\" to its kiln.toml",
                req.instance
            ))
        })?;
        let namespace = Some(target.namespace.clone()).filter(|ns| !ns.is_empty());
        let mirror_registry = Some(target.mirror_registry.clone()).filter(|m| !m.is_empty());
        let target = Target::of(&req.instance, target)?;
        if req.platforms.is_empty() {
            return Err(missing("platforms"));
        }
        let platform_set = crate::address::platform_set(&req.platforms)?;
        let mut images = Vec::with_capacity(req.images.len());
        for image in req.images {
            let kind = image.kind();
            let at = |field: &str| format!("UpRequest image {:?}: {field}", image.name);
            if image.name.is_empty() {
                return Err(missing("images[].name"));
            }
            let sent = ImageRef::parse(&image.reference)
                .map_err(|e| Status::invalid_argument(format!("{}: {e}", at("reference"))))?;
            let kind = match kind {
                pb::image_spec::Kind::Built => {
                    let context = image.context_digest.parse().map_err(|e: kiln_core::digest::DigestParseError| {
                        Status::invalid_argument(format!("{}: {e}", at("context_digest")))
                    })?;
                    if image.dockerfile.is_empty() && image.dockerfile_outside.is_empty() {
                        return Err(Status::invalid_argument(at("neither dockerfile nor dockerfile_outside is set")));
                    }
                    let mut from: Vec<String> = Vec::with_capacity(image.from.len());
                    for name in &image.from {
                        if !from.contains(name) {
                            from.push(name.clone());
                        }
                    }
                    let inputs = BuildInputs {
                        context,
                        dockerfile: image.dockerfile.clone(),
                        dockerfile_outside: image.dockerfile_outside.clone(),
                        args: image.args.clone().into_iter().collect(),
                        target_stage: image.target_stage.clone(),
                        shared: image.shared,
                        dockerfile_digest: image.dockerfile_digest.clone(),
                        from,
                    };
                    // The client's ref is checked, never trusted: a tag cannot lie (`address`).
                    crate::address::check_built_ref(&image, &sent, &inputs, &platform_set, &target)?;
                    PlanKind::Built(inputs)
                }
                pb::image_spec::Kind::Brought => PlanKind::Brought,
                pb::image_spec::Kind::Pinned => PlanKind::Pinned,
                pb::image_spec::Kind::Unspecified => return Err(Status::invalid_argument(at("kind is unspecified"))),
            };
            let (reference, mirrored_from) = match (&kind, &mirror_registry) {
                (PlanKind::Pinned, Some(mirror)) => {
                    let mirrored = kiln_core::refs::mirrored(&sent, mirror).map_err(|e| {
                        Status::invalid_argument(format!(
                            "target.mirror_registry {mirror:?}: {e} — write host[:port][/prefix], e.g. \
                             registry.farm.internal:5000/mirror"
                        ))
                    })?;
                    (mirrored.to_string(), Some(image.reference))
                }
                _ => (image.reference, None),
            };
            images.push(PlanImage { name: image.name, reference, kind, mirrored_from });
        }
        check_bases(&images)?;
        if req.mirror_only {
            check_mirror_only(&req.instance, &images, mirror_registry.as_deref())?;
        }
        Ok(UpPlan {
            instance: req.instance,
            target,
            namespace,
            // As the set the tags name: what is built is what is addressed.
            platforms: platform_set.iter().map(|p| p.oci()).collect(),
            images,
            force: req.force,
            requested_by: req.requested_by,
            dry_run: req.dry_run,
            team: Some(req.team).filter(|t| !t.is_empty()),
            mirror_registry,
            mirror_only: req.mirror_only,
        })
    }
}

/// `kiln mirror` copies pinned images into a mirror: it needs one, and it carries nothing else (a
/// built image in it would be silently skipped, and the CLI never sends one).
fn check_mirror_only(instance: &str, images: &[PlanImage], mirror: Option<&str>) -> Result<(), Status> {
    if mirror.is_none() {
        return Err(Status::invalid_argument(format!(
            "instance {instance} names no mirror_registry — add mirror_registry = \"host:port/prefix\" under \
             [target] in its kiln.toml"
        )));
    }
    if let Some(other) = images.iter().find(|i| !matches!(i.kind, PlanKind::Pinned)) {
        return Err(Status::invalid_argument(format!(
            "UpRequest image {:?}: mirror_only carries pinned images only — send the others with `kiln up`",
            other.name
        )));
    }
    Ok(())
}

/// Refuses a `from` graph the engine could not follow, or one that is not what the Dockerfiles
/// build: a name that is no built image of the plan, a base whose content ref the image's
/// Dockerfile as sent does not build FROM (the child's address would not cover the base's), a
/// built image's ref it builds FROM without naming it (the engine would not wait for it), and a
/// cycle. Only a Dockerfile sent in `dockerfile_outside` can be read here; one inside the context
/// names no base, since the CLI sends every Dockerfile it rewrote.
fn check_bases(images: &[PlanImage]) -> Result<(), Status> {
    let built: Vec<(&PlanImage, &BuildInputs)> = images
        .iter()
        .filter_map(|image| match &image.kind {
            PlanKind::Built(inputs) => Some((image, inputs)),
            _ => None,
        })
        .collect();
    let at = |image: &PlanImage| format!("UpRequest image {:?}: from", image.name);
    let mut deps: Vec<Vec<usize>> = Vec::with_capacity(built.len());
    for (image, inputs) in &built {
        let mut waits = Vec::with_capacity(inputs.from.len());
        for name in &inputs.from {
            let Some(base) = built.iter().position(|(other, _)| other.name == *name) else {
                let what = match images.iter().find(|other| other.name == *name).map(|other| &other.kind) {
                    Some(PlanKind::Brought) => "a brought image",
                    Some(_) => "a pinned image",
                    None => "no image of this request",
                };
                return Err(Status::invalid_argument(format!(
                    "{}: names {name:?}, {what} — an image waits only for built images of the same converge",
                    at(image)
                )));
            };
            waits.push(base);
        }
        deps.push(waits);
    }
    if let Err(cycle) = kiln_core::order::topological(&deps) {
        let path: Vec<&str> = cycle.iter().map(|&i| built[i].0.name.as_str()).collect();
        return Err(Status::invalid_argument(format!(
            "UpRequest images[].from: built images build FROM each other in a cycle: {} — a base is built before \
             the images built FROM it",
            path.join(" → ")
        )));
    }

    // Refs were parsed when the plan was made; one that did not parse could not be here.
    let refs: Vec<Option<ImageRef>> = built.iter().map(|(image, _)| ImageRef::parse(&image.reference).ok()).collect();
    for ((image, inputs), waits) in built.iter().zip(&deps) {
        let named = dockerfile_from_refs(inputs);
        for (other, (other_image, _)) in built.iter().enumerate() {
            let names_it = refs[other].as_ref().is_some_and(|r| named.contains(r));
            if waits.contains(&other) && !names_it {
                return Err(Status::invalid_argument(format!(
                    "{}: names {:?}, but the Dockerfile sent in dockerfile_outside has no FROM {} — an image built \
                     FROM a base names the base's content ref, so that its address covers the base's",
                    at(image),
                    other_image.name,
                    other_image.reference
                )));
            }
            // Two built images of one ref (same repository and inputs) are one image to wait for.
            let waited = waits.iter().any(|&w| refs[w].is_some() && refs[w] == refs[other]);
            if names_it && !waited {
                return Err(Status::invalid_argument(format!(
                    "{}: its Dockerfile builds FROM {}, built image {:?} of this converge, which from does not name \
                     — name it, so that it is built first",
                    at(image),
                    other_image.reference,
                    other_image.name
                )));
            }
        }
    }
    Ok(())
}

/// The images the Dockerfile sent in `dockerfile_outside` builds FROM, as refs (a FROM that is
/// not a valid ref names no image of the converge).
fn dockerfile_from_refs(inputs: &BuildInputs) -> Vec<ImageRef> {
    let Ok(text) = std::str::from_utf8(&inputs.dockerfile_outside) else { return Vec::new() };
    kiln_core::dockerfile::from_images(text).iter().filter_map(|f| ImageRef::parse(&f.image).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(namespace: &str) -> pb::UpRequest {
        pb::UpRequest {
            instance: "shop".into(),
            target: Some(pb::Target {
                kind: pb::target::Kind::Local as i32,
                namespace: namespace.into(),
                ..Default::default()
            }),
            platforms: vec!["linux/amd64".into()],
            ..Default::default()
        }
    }

    #[test]
    fn the_manifest_namespace_reaches_the_plan_and_an_empty_one_is_none() {
        assert_eq!(UpPlan::try_from(request("shop")).unwrap().namespace.as_deref(), Some("shop"));
        assert_eq!(UpPlan::try_from(request("")).unwrap().namespace, None);
    }

    /// A built image as the CLI sends it, with the ref it computes: `dockerfile`, when not empty,
    /// is the Dockerfile sent in `dockerfile_outside` (rewritten to its bases' refs).
    fn built(name: &str, tree: u8, dockerfile: &str, from: &[&str]) -> pb::ImageSpec {
        use kiln_core::refs::{content_ref, image_address, AddressInputs};
        let platforms = crate::address::platform_set(&["linux/amd64".to_string()]).unwrap();
        let sent = !dockerfile.is_empty();
        let address = image_address(&AddressInputs {
            tree: TreeDigest([tree; 32]),
            dockerfile_outside: sent.then_some(dockerfile.as_bytes()),
            dockerfile_path: "Dockerfile",
            build_args: &BTreeMap::new(),
            target: None,
            platforms: &platforms,
        });
        pb::ImageSpec {
            name: name.into(),
            kind: pb::image_spec::Kind::Built as i32,
            reference: content_ref(&format!("shop-{name}"), &address, &platforms).unwrap().to_string(),
            context_digest: TreeDigest([tree; 32]).to_string(),
            dockerfile: if sent { String::new() } else { "Dockerfile".into() },
            dockerfile_outside: dockerfile.as_bytes().to_vec(),
            dockerfile_path: "Dockerfile".into(),
            from: from.iter().map(|name| name.to_string()).collect(),
            ..Default::default()
        }
    }

    fn up(images: Vec<pb::ImageSpec>) -> Result<UpPlan, Status> {
        UpPlan::try_from(pb::UpRequest { images, ..request("") })
    }

    fn refused(images: Vec<pb::ImageSpec>) -> String {
        let err = up(images).expect_err("refused");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        err.message().to_string()
    }

    fn from_of(plan: &UpPlan, name: &str) -> Vec<String> {
        match &plan.images.iter().find(|i| i.name == name).unwrap().kind {
            PlanKind::Built(inputs) => inputs.from.clone(),
            _ => panic!("{name} is built"),
        }
    }

    #[test]
    fn an_image_built_from_its_base_carries_the_bases_name_once() {
        let base = built("base", 1, "", &[]);
        let child = format!("FROM {} AS run\nCOPY x /x\nFROM {}\n", base.reference, base.reference);
        let api = built("api", 2, &child, &["base", "base"]);
        let plan = up(vec![api, base]).unwrap();
        assert_eq!(from_of(&plan, "api"), ["base"]);
        assert!(from_of(&plan, "base").is_empty());
    }

    #[test]
    fn a_name_that_is_no_built_image_of_the_request_is_refused_naming_it() {
        let db = pb::ImageSpec {
            name: "db".into(),
            kind: pb::image_spec::Kind::Brought as i32,
            reference: "postgres:16".into(),
            ..Default::default()
        };
        let pinned = pb::ImageSpec {
            name: "envoy".into(),
            kind: pb::image_spec::Kind::Pinned as i32,
            reference: format!("envoyproxy/envoy:v1@sha256:{}", "a".repeat(64)),
            ..Default::default()
        };
        for (name, what) in
            [("nope", "no image of this request"), ("db", "a brought image"), ("envoy", "a pinned image")]
        {
            let message = refused(vec![built("api", 2, "FROM x\n", &[name]), db.clone(), pinned.clone()]);
            let expected = format!("UpRequest image \"api\": from: names {name:?}, {what}");
            assert!(message.contains(&expected), "{expected:?} in {message}");
        }
    }

    #[test]
    fn an_image_from_itself_is_a_cycle() {
        let message = refused(vec![built("api", 2, "FROM shop-api\n", &["api"])]);
        assert!(message.contains("build FROM each other in a cycle: api → api"), "{message}");
    }

    /// A cycle of honest refs cannot be sent (each ref hashes the Dockerfile naming the other), so
    /// the graph is checked before the Dockerfiles are, and tested here on the plan itself.
    #[test]
    fn a_cycle_is_refused_naming_it() {
        let image = |name: &str, from: &[&str]| PlanImage {
            mirrored_from: None,
            name: name.to_string(),
            reference: format!("shop-{name}:0123456789ab-amd64"),
            kind: PlanKind::Built(BuildInputs {
                context: TreeDigest([1; 32]),
                dockerfile: "Dockerfile".into(),
                dockerfile_outside: from
                    .iter()
                    .map(|base| format!("FROM shop-{base}:0123456789ab-amd64\n"))
                    .collect::<String>()
                    .into_bytes(),
                args: BTreeMap::new(),
                target_stage: String::new(),
                shared: false,
                dockerfile_digest: String::new(),
                from: from.iter().map(|name| name.to_string()).collect(),
            }),
        };
        let images = [image("lone", &["a"]), image("a", &["b"]), image("b", &["c"]), image("c", &["a"])];
        let err = check_bases(&images).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("in a cycle: a → b → c → a"), "{}", err.message());
        assert!(check_bases(&[image("a", &[]), image("b", &["a"]), image("c", &["a", "b"])]).is_ok());
    }

    #[test]
    fn from_must_be_exactly_the_built_images_the_dockerfile_sent_builds_from() {
        let base = built("base", 1, "", &[]);
        // Named, but the Dockerfile builds FROM something else: the child's address would not
        // cover the base's.
        let message = refused(vec![base.clone(), built("api", 2, "FROM scratch\n", &["base"])]);
        let expected = format!(
            "from: names \"base\", but the Dockerfile sent in dockerfile_outside has no FROM {}",
            base.reference
        );
        assert!(message.contains(&expected), "{expected:?} in {message}");
        // Built FROM, but not named: the engine would not wait for it.
        let child = format!("FROM {}\n", base.reference);
        let message = refused(vec![base.clone(), built("api", 2, &child, &[])]);
        let expected = format!(
            "its Dockerfile builds FROM {}, built image \"base\" of this converge, which from does not name",
            base.reference
        );
        assert!(message.contains(&expected), "{expected:?} in {message}");
    }

    fn pinned_request(mirror: &str, mirror_only: bool) -> pb::UpRequest {
        let mut req = request("");
        if let Some(target) = req.target.as_mut() {
            target.mirror_registry = mirror.into();
        }
        let digest = format!("sha256:{}", "ab".repeat(32));
        let envoy = pb::ImageSpec {
            name: "envoy".into(),
            kind: pb::image_spec::Kind::Pinned as i32,
            reference: format!("envoyproxy/envoy:v1.30.1@{digest}"),
            ..Default::default()
        };
        pb::UpRequest { images: vec![envoy], mirror_only, ..req }
    }

    #[test]
    fn a_mirror_re_homes_a_pinned_ref_at_the_same_digest_and_keeps_the_upstream() {
        let plan = UpPlan::try_from(pinned_request("registry.farm.internal:5000/mirror", false)).unwrap();
        let digest = "ab".repeat(32);
        assert_eq!(
            plan.images[0].reference,
            format!("registry.farm.internal:5000/mirror/envoy:v1.30.1@sha256:{digest}")
        );
        assert_eq!(
            plan.images[0].mirrored_from.as_deref(),
            Some(format!("envoyproxy/envoy:v1.30.1@sha256:{digest}").as_str())
        );
        let plain = UpPlan::try_from(pinned_request("", false)).unwrap();
        assert_eq!((plain.images[0].mirrored_from.as_ref(), plain.mirror_registry), (None, None));
    }

    #[test]
    fn a_mirror_that_names_no_registry_is_refused_with_the_form_to_write() {
        let err = UpPlan::try_from(pinned_request("mirror/upstream", false)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("write host[:port][/prefix]"), "{}", err.message());
    }

    #[test]
    fn mirror_only_needs_a_mirror_and_carries_pinned_images_alone() {
        let err = UpPlan::try_from(pinned_request("", true)).unwrap_err();
        assert!(err.message().contains("names no mirror_registry — add mirror_registry"), "{}", err.message());
        let mut req = pinned_request("127.0.0.1:5000", true);
        req.images.push(pb::ImageSpec {
            name: "db".into(),
            kind: pb::image_spec::Kind::Brought as i32,
            reference: "postgres:16".into(),
            ..Default::default()
        });
        let err = UpPlan::try_from(req).unwrap_err();
        assert!(err.message().contains("\"db\": mirror_only carries pinned images only"), "{}", err.message());
        assert!(UpPlan::try_from(pinned_request("127.0.0.1:5000", true)).unwrap().mirror_only);
    }
}
