//! Multi-platform images (issue 11): an image whose platform set names several platforms is built
//! as one task per platform, each placed on an agent that builds that platform natively — or,
//! failing that, on one that runs it through emulation, or on any host when the Dockerfile runs
//! nothing (`FROM scratch` + `COPY`, which BuildKit builds for any platform). Each platform's image
//! wears its platform ref on its build host (`kiln_core::refs::platform_ref`); then
//!
//! - `registry`: each is pushed under its platform ref and the index naming them all is put under
//!   the content tag (`mirror::Registries::assemble_index`) — the ref the record names;
//! - `nodes`: each node agent imports the image of the platform it announced, under the content
//!   ref; a node whose platform is not in the set fails the converge before anything is built;
//! - `kind`: a node container runs its daemon's platform, which is its host agent's: that
//!   platform is built on that host and loaded into the nodes under the content ref (the other
//!   platforms are built for the address and go nowhere); a node whose platform is not in the set
//!   fails the converge before anything is built, as for `nodes` (`platform_kind`);
//! - `local`: refused before anything is claimed — a Docker daemon runs one platform, so a second
//!   one would be built for nobody.
//!
//! An image built `FROM` a base of the same converge builds each platform FROM the base's image of
//! that platform (its `FROM` rewritten to the platform ref, [`on_bases`]), on the agent holding it.
//!
//! Emulation preflight: before any build, every platform that no connected host builds natively
//! and whose Dockerfile runs a command must be run by some host's binfmt_misc handlers (agents
//! announce them in their hello), or the converge fails naming the platform and the fix.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::future::try_join_all;
use kiln_core::refs::{platform_ref, ImageRef, Platform};

use super::decide::{address_inputs, Decision};
use super::parallel::{Graph, Holders};
use super::{Engine, Failure};
use crate::deliver::{self, DeliverError, NodesDelivered};
use crate::events::Events;
use crate::hub::{AgentConn, HeldRef};
use crate::model::{Action, ConvergeId, EventKind, Reason, RecordedImage, RecordedKind};
use crate::plan::{BuildInputs, Target, UpPlan};
use crate::schedule::Via;

/// Per built image name: each platform of the set and how it may be built.
pub(super) type Placements = BTreeMap<String, Vec<(String, Via)>>;

/// Whether `plan` builds several platforms per image.
pub(super) fn multi(plan: &UpPlan) -> bool {
    plan.platforms.len() > 1
}

/// The targets that cannot take several platforms, refused before anything is claimed.
pub(super) fn refuse_target(plan: &UpPlan) -> Result<(), Failure> {
    let set = plan.platforms.join(", ");
    match &plan.target {
        Target::Local => Err(Failure::whole(format!(
            "target local cannot take platforms {set}: a Docker daemon runs one platform, and every other one \
             would be built for nobody — list one platform (platforms = [\"{}\"]), or converge to a registry \
             or nodes target",
            kiln_core::refs::PlatformSet::host().oci()
        ))),
        Target::Registry { .. } | Target::Nodes { .. } | Target::Kind { .. } => Ok(()),
    }
}

impl Engine {
    /// `nodes` and `kind`: every node of the cluster must run a platform of the set, or the
    /// converge fails naming it — before anything is built.
    pub(super) fn check_nodes(&self, plan: &UpPlan) -> Result<(), Failure> {
        let cluster = match &plan.target {
            Target::Nodes { cluster } => cluster,
            Target::Kind { cluster } => return self.check_kind_nodes(plan, cluster),
            _ => return Ok(()),
        };
        for node in deliver::cluster_nodes(&self.hub, cluster) {
            if !node.platforms.iter().any(|p| plan.platforms.contains(p)) {
                return Err(Failure::whole(format!(
                    "node {} of cluster {cluster} runs {}, which the platforms {} do not include — add it to \
                     `platforms` in kiln.toml, or take that node out of the cluster",
                    node.id,
                    node.platforms.join(", "),
                    plan.platforms.join(", ")
                )));
            }
        }
        Ok(())
    }

    /// How each platform of each image to be built or delivered may be built, from the host
    /// agents connected now: the emulation preflight. Fails on the first image with a platform
    /// nobody can build, naming the platform and the fix, before any build starts.
    pub(super) async fn place_platforms(
        &self,
        plan: &UpPlan,
        decisions: &[Decision<'_>],
    ) -> Result<Placements, Failure> {
        let hosts: Vec<Arc<AgentConn>> = self.hub.connected().into_iter().filter(|a| a.is_host()).collect();
        let mut placements = Placements::new();
        for d in decisions.iter().filter(|d| d.action != Action::Skip) {
            let name = d.image.name.as_str();
            let mut runs: Option<bool> = None;
            let mut vias = Vec::new();
            for platform in &plan.platforms {
                let native = hosts.iter().any(|h| h.platforms.is_empty() || h.platforms.contains(platform));
                let via = if native {
                    Via::Native
                } else {
                    let runs = match runs {
                        Some(runs) => runs,
                        None => *runs.insert(self.dockerfile_runs(d.inputs).await),
                    };
                    if !runs {
                        Via::AnyHost
                    } else if hosts.iter().any(|h| h.emulates.contains(platform)) {
                        Via::Emulation
                    } else {
                        let arch = Platform::parse(platform).map(|p| p.token()).unwrap_or_else(|_| platform.clone());
                        return Err(Failure::of(
                            name,
                            format!(
                                "platform {platform}: its Dockerfile has RUN steps, and no connected host agent runs \
                                 {platform}, natively or through emulation — install qemu-user-static and register \
                                 binfmt handlers, or add an {arch} build host"
                            ),
                        ));
                    }
                };
                vias.push((platform.clone(), via));
            }
            placements.insert(name.to_string(), vias);
        }
        Ok(placements)
    }

    /// Whether the Dockerfile of `inputs` runs a command; one that cannot be read counts as
    /// running one, so the preflight never lets a RUN through on a guess.
    async fn dockerfile_runs(&self, inputs: &BuildInputs) -> bool {
        if !inputs.dockerfile_outside.is_empty() {
            return kiln_core::dockerfile::runs_commands(&String::from_utf8_lossy(&inputs.dockerfile_outside));
        }
        let (contexts, digest, wanted) = (self.contexts.clone(), inputs.context, inputs.dockerfile.clone());
        let read = tokio::task::spawn_blocking(move || contexts.read_file(&digest, &wanted)).await;
        match read.ok().flatten().map(String::from_utf8) {
            Some(Ok(text)) => kiln_core::dockerfile::runs_commands(&text),
            _ => true,
        }
    }

    /// Builds (or re-delivers) every platform of `d` and puts them together under its content
    /// ref; returns the image's record entry and the agent holding each platform's image (for
    /// the images built FROM it).
    ///
    /// An image built FROM a base of the converge waits for it, and builds each platform FROM
    /// the base's image of that platform, on the agent that holds it.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_platforms(
        &self,
        home: &Arc<AgentConn>,
        id: &ConvergeId,
        plan: &UpPlan,
        d: &Decision<'_>,
        vias: &[(String, Via)],
        generation: u64,
        events: &Events,
        graph: &Graph,
    ) -> Result<(RecordedImage, Holders), Failure> {
        let name = d.image.name.as_str();
        let content = d.image.reference.as_str();
        let mut bases = Vec::with_capacity(d.inputs.from.len());
        for base in &d.inputs.from {
            let Ok(holders) = graph.wait(base).await else {
                return Err(Failure::of(name, format!("not built: the image it builds FROM, {base}, failed")));
            };
            let reference = plan.images.iter().find(|i| &i.name == base).map(|i| i.reference.clone());
            bases.push(Base { reference: reference.unwrap_or_default(), holders });
        }
        let mut images = Vec::with_capacity(vias.len());
        for (platform, _) in vias {
            let parsed = Platform::parse(platform).map_err(|err| Failure::of(name, err.to_string()))?;
            let mut image = d.image.clone();
            image.reference = platform_ref(content, &parsed);
            images.push((image, parsed));
        }
        let connected = self.hub.connected();
        let hosts = connected.as_slice();
        let bases = bases.as_slice();
        let runs = images.iter().zip(vias).map(|((image, parsed), (platform, via))| async move {
            let inputs = on_bases(d.inputs, bases, parsed);
            let mut pd = Decision {
                image,
                inputs: &inputs,
                action: d.action,
                reason: d.reason.clone(),
                recorded: None,
                confirming: d.confirming,
                platform: platform.clone(),
                via: *via,
                index: Some(content),
            };
            // `kind`: the platform its nodes run is built on, and loaded from, the host agent
            // whose daemon runs them.
            let kind_host = match &plan.target {
                Target::Kind { cluster } => super::platform_kind::kind_host(hosts, cluster, platform),
                _ => None,
            };
            // Built FROM a base of the converge: where the base's image of this platform is.
            let base_host = bases.iter().find_map(|b| b.holder(platform, parsed, |r| self.holder(home, r)));
            // A delivery again (a recorded `nodes` or `kind` image) reads the platform's image
            // from a host that holds it; none does: it is built again, and the reason says it
            // was gone.
            let holder = match (pd.action, &kind_host) {
                (Action::Build, _) => None,
                (_, Some(k)) => k.holds(&HeldRef::of(&pd.image.reference)).then(|| k.clone()),
                (_, None) => self.holder(home, &pd.image.reference),
            };
            match holder {
                Some(host) => {
                    let entry = self.deliver_from(&host, &mut None, id, plan, &pd, generation, events).await?;
                    Ok::<_, Failure>((entry, (platform.clone(), host.id.clone())))
                }
                None => {
                    if pd.action != Action::Build {
                        pd.action = Action::Build;
                        pd.reason = Reason::Gone { store: crate::sweep::host_store_of(home), generation };
                    }
                    let required = kind_host.as_ref().map(|k| k.id.clone()).or(base_host);
                    let grant = self.build_placed(id, plan, &pd, &pd.reason, required, events).await?;
                    let agent = grant.agent.clone();
                    let mut slot = Some(grant);
                    let entry = self.deliver_from(&agent, &mut slot, id, plan, &pd, generation, events).await?;
                    Ok((entry, (platform.clone(), agent.id.clone())))
                }
            }
        });
        let built: Vec<(RecordedImage, (String, String))> = try_join_all(runs).await?;
        let (entries, holders): (Vec<RecordedImage>, Holders) = built.into_iter().unzip();
        if let Target::Registry { .. } = plan.target {
            self.push_index(name, content, &images, events).await?;
        }
        let entry = RecordedImage {
            name: d.image.name.clone(),
            reference: content.to_string(),
            kind: RecordedKind::Built,
            target: plan.target.identity(),
            context: Some(d.inputs.context.to_string()),
            user: entries.first().and_then(|e| e.user.clone()),
            inputs: Some(address_inputs(d.inputs, &plan.platforms)),
            // Each platform is its own image: no one id names them.
            image_id: None,
        };
        Ok((entry, holders))
    }

    /// The connected host that holds `reference` by the inventories the coordinator keeps:
    /// `home` first.
    fn holder(&self, home: &Arc<AgentConn>, reference: &str) -> Option<Arc<AgentConn>> {
        let held = HeldRef::of(reference);
        if home.holds(&held) {
            return Some(home.clone());
        }
        let holding = self.hub.inventory.holders(&held);
        self.hub.connected().into_iter().find(|a| a.is_host() && holding.contains(&a.stream))
    }

    async fn push_index(
        &self,
        name: &str,
        content: &str,
        images: &[(crate::plan::PlanImage, Platform)],
        events: &Events,
    ) -> Result<(), Failure> {
        let unreadable = |r: &str, err: kiln_core::refs::RefError| Failure::of(name, format!("{r}: {err}"));
        let content_ref = ImageRef::parse(content).map_err(|e| unreadable(content, e))?;
        let mut parts = Vec::with_capacity(images.len());
        for (image, platform) in images {
            let reference = ImageRef::parse(&image.reference).map_err(|e| unreadable(&image.reference, e))?;
            parts.push(crate::mirror::Part { platform: platform.clone(), reference });
        }
        let assembled = self
            .registries
            .assemble_index(&content_ref, &parts)
            .await
            .map_err(|err| Failure::of(name, format!("index of {content}: {}", kiln_core::error_chain(&err))))?;
        let tokens: Vec<String> = images.iter().map(|(_, p)| p.token()).collect();
        events.emit(
            EventKind::Note,
            Some(name),
            format!("index {content} ({}) → {}", tokens.join(", "), assembled.digest),
        );
        Ok(())
    }

    /// `nodes`, one platform of a multi-platform image: the nodes that run `d.platform` import
    /// the host's platform image under the content ref.
    pub(super) async fn platform_to_nodes(
        &self,
        host: &AgentConn,
        id: &ConvergeId,
        cluster: &str,
        d: &Decision<'_>,
        narrate: bool,
        events: &Events,
    ) -> Result<NodesDelivered, DeliverError> {
        let content = d.index.unwrap_or(&d.image.reference);
        let all = deliver::cluster_nodes(&self.hub, cluster);
        if all.is_empty() {
            return Err(deliver::no_nodes(cluster));
        }
        let nodes: Vec<Arc<AgentConn>> = all.into_iter().filter(|n| n.platforms.contains(&d.platform)).collect();
        if nodes.is_empty() {
            if narrate {
                let words = format!("no node of {cluster} runs {}: {} goes nowhere", d.platform, d.image.reference);
                events.emit(EventKind::Note, Some(&d.image.name), words);
            }
            return Ok(NodesDelivered::default());
        }
        let to = deliver::Nodes { nodes: &nodes, cluster, source: &d.image.reference, reference: content };
        deliver::deliver_to(&self.relay, host, id.as_str(), to, &d.image.name, narrate, events).await
    }
}

/// A base of the converge that a multi-platform image builds FROM.
struct Base {
    /// Its content ref: what the child's Dockerfile names in its `FROM`.
    reference: String,
    /// Where this converge left each platform's image of it.
    holders: Holders,
}

impl Base {
    /// The agent holding the base's image of `platform`: where this converge built it, else (a
    /// base this converge skipped) whichever host's inventory holds its platform ref.
    fn holder(
        &self,
        platform: &str,
        parsed: &Platform,
        held: impl Fn(&str) -> Option<Arc<AgentConn>>,
    ) -> Option<String> {
        let built = self.holders.iter().find(|(p, _)| p == platform).map(|(_, agent)| agent.clone());
        built.or_else(|| held(&platform_ref(&self.reference, parsed)).map(|a| a.id.clone()))
    }
}

/// `inputs` as built for `platform`: each `FROM` naming a base's content ref names the base's
/// image of that platform instead (`<base ref>-<token>`, the tag it wears on its build host and in
/// a registry). A daemon holds each platform of a base under its own tag, so the content ref —
/// an index in a registry, nothing on a host — cannot be built on. The address is not touched: it
/// covers the Dockerfile naming the content ref, which names every platform's image.
fn on_bases(inputs: &BuildInputs, bases: &[Base], platform: &Platform) -> BuildInputs {
    let mut built = inputs.clone();
    let Ok(text) = std::str::from_utf8(&inputs.dockerfile_outside) else { return built };
    let swaps: Vec<_> = kiln_core::dockerfile::from_images(text)
        .into_iter()
        .filter(|f| bases.iter().any(|b| b.reference == f.image))
        .map(|f| (f.span, platform_ref(&f.image, platform)))
        .collect();
    if !swaps.is_empty() {
        built.dockerfile_outside = kiln_core::dockerfile::rewrite(text, &swaps).into_bytes();
    }
    built
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::digest::TreeDigest;

    #[test]
    fn a_from_naming_a_base_names_its_platform_image_and_nothing_else_moves() {
        let base = "127.0.0.1:5000/shop-base:4a77b1c2d3e4-amd64.arm64";
        let text = format!(
            "FROM busybox:1.36 AS tools\nFROM {base} AS app\nCOPY --from=tools /bin/sh /sh\nFROM {base}-amd64\n"
        );
        let inputs = BuildInputs {
            context: TreeDigest([7; 32]),
            dockerfile: "Dockerfile".to_string(),
            dockerfile_outside: text.clone().into_bytes(),
            args: Default::default(),
            target_stage: String::new(),
            shared: false,
            dockerfile_digest: String::new(),
            from: vec!["base".to_string()],
        };
        let bases = [Base { reference: base.to_string(), holders: Vec::new() }];
        let arm = on_bases(&inputs, &bases, &Platform::parse("linux/arm64").unwrap());
        let expected = format!(
            "FROM busybox:1.36 AS tools\nFROM {base}-arm64 AS app\nCOPY --from=tools /bin/sh /sh\nFROM {base}-amd64\n"
        );
        assert_eq!(String::from_utf8(arm.dockerfile_outside).unwrap(), expected);
        assert_eq!(inputs.dockerfile_outside, text.as_bytes(), "the addressed bytes are left as they were");
        // No base named: the bytes are built as sent.
        let alone = on_bases(&inputs, &[], &Platform::parse("linux/arm64").unwrap());
        assert_eq!(alone.dockerfile_outside, text.as_bytes());
    }
}
