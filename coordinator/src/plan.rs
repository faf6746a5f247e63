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
    /// The images of this converge it builds FROM (manifest names): built before it, on the
    /// agent that holds them.
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
    /// As the client wrote it; brought and pinned refs pass into the record untouched.
    pub reference: String,
    pub kind: PlanKind,
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
        let target = match target.kind() {
            pb::target::Kind::Registry if !target.registry.is_empty() => Target::Registry { registry: target.registry },
            pb::target::Kind::Registry => return Err(missing("target.registry")),
            pb::target::Kind::Kind => Target::Kind { cluster: target.cluster },
            pb::target::Kind::Nodes => Target::Nodes { cluster: target.cluster },
            pb::target::Kind::Local => Target::Local,
            pb::target::Kind::Unspecified => {
                return Err(Status::invalid_argument(format!(
                    "instance {} names no target kind — set kind = \"registry\" (or kind, nodes, local) in [target]",
                    req.instance
                )))
            }
        };
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
                    let inputs = BuildInputs {
                        context,
                        dockerfile: image.dockerfile.clone(),
                        dockerfile_outside: image.dockerfile_outside.clone(),
                        args: image.args.clone().into_iter().collect(),
                        target_stage: image.target_stage.clone(),
                        shared: image.shared,
                        dockerfile_digest: image.dockerfile_digest.clone(),
                        from: Vec::new(),
                    };
                    // The client's ref is checked, never trusted: a tag cannot lie (`address`).
                    crate::address::check_built_ref(&image, &sent, &inputs, &platform_set, &target)?;
                    PlanKind::Built(inputs)
                }
                pb::image_spec::Kind::Brought => PlanKind::Brought,
                pb::image_spec::Kind::Pinned => PlanKind::Pinned,
                pb::image_spec::Kind::Unspecified => return Err(Status::invalid_argument(at("kind is unspecified"))),
            };
            images.push(PlanImage { name: image.name, reference: image.reference, kind });
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
        })
    }
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
}
