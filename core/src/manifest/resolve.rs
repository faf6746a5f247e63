//! From the raw TOML to a [`Manifest`]: every rule of the format, each failure placed on its line.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use toml::Spanned;

use super::built::resolve_built;
use super::error::{ManifestError, Problem};
use super::from::resolve_bases;
use super::raw::{self, RawBuilt, RawRef, RawTarget};
use super::root::resolve_root;
use super::{Image, ImageSpec, Manifest, PlatformSource, RegistryPath, Target};
use crate::refs::{self, ImageRef, Platform, PlatformSet};

/// The file being resolved: where errors point and where relative paths start.
pub(super) struct Ctx<'a> {
    path: &'a Path,
    text: &'a str,
    pub(super) dir: PathBuf,
}

impl Ctx<'_> {
    pub(super) fn at(&self, span: Range<usize>, problem: Problem) -> ManifestError {
        let start = span.start.min(self.text.len());
        let line = self.text.as_bytes()[..start].iter().filter(|&&b| b == b'\n').count() + 1;
        ManifestError { path: self.path.to_path_buf(), line: Some(line), problem: Box::new(problem) }
    }

    fn whole(&self, problem: Problem) -> ManifestError {
        ManifestError { path: self.path.to_path_buf(), line: None, problem: Box::new(problem) }
    }
}

pub(super) fn resolve(text: &str, manifest_path: &Path) -> Result<Manifest, ManifestError> {
    let dir = match manifest_path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let ctx = Ctx { path: manifest_path, text, dir };
    let raw = raw::parse(text).map_err(|(span, problem)| match span {
        Some(span) => ctx.at(span, *problem),
        None => ctx.whole(*problem),
    })?;
    let instance = resolve_instance(&ctx, raw.instance)?;
    let team = match raw.team {
        Some(team) if is_dns_label(team.get_ref()) => Some(team.into_inner()),
        Some(team) => {
            let why = "a team is lowercase letters, digits and '-', at most 63 characters";
            return Err(ctx.at(team.span(), Problem::BadName { what: "team", value: team.into_inner(), why }));
        }
        None => None,
    };
    let listed = raw.platforms.is_some();
    let platforms = resolve_platforms(&ctx, raw.platforms)?;
    let root = resolve_root(&ctx, raw.root.as_ref())?;
    let (target, namespace, mirror_registry) = resolve_target(&ctx, raw.target)?;
    let cluster_target = matches!(target, Target::Kind { .. } | Target::Nodes { .. });
    let platform_source = match (raw.platforms_from_cluster, listed) {
        (Some(span), _) if !cluster_target => {
            return Err(ctx.at(span, Problem::ClusterWithoutCluster { target: target.kind_name() }));
        }
        (Some(_), _) => PlatformSource::Cluster { named: true },
        (None, true) => PlatformSource::Listed,
        (None, false) if cluster_target => PlatformSource::Cluster { named: false },
        (None, false) => PlatformSource::Host,
    };

    let mut entries: Vec<(&'static str, Spanned<String>, Range<usize>, Body)> = Vec::new();
    for (name, built) in raw.built {
        entries.push(("built", name, built.span(), Body::Built(Box::new(built.into_inner()))));
    }
    for (name, brought) in raw.brought {
        entries.push(("brought", name, brought.span(), Body::Ref(brought.into_inner())));
    }
    for (name, pinned) in raw.pinned {
        entries.push(("pinned", name, pinned.span(), Body::Ref(pinned.into_inner())));
    }
    if entries.is_empty() {
        return Err(ctx.whole(Problem::NoImages));
    }
    entries.sort_by_key(|(_, _, span, _)| span.start);

    let mut seen: HashMap<String, String> = HashMap::new();
    let mut images = Vec::with_capacity(entries.len());
    let mut spans = Vec::with_capacity(entries.len());
    for (kind, name_spanned, span, body) in entries {
        let name = name_spanned.get_ref().clone();
        let section = raw::section(kind, &name);
        if !is_dns_label(&name) {
            return Err(ctx.at(name_spanned.span(), Problem::BadImageName { name, section }));
        }
        if let Some(first) = seen.insert(name.clone(), section.clone()) {
            let problem = Problem::DuplicateName { name, first, second: section };
            return Err(ctx.at(name_spanned.span(), problem));
        }
        let spec = match body {
            Body::Built(built) => {
                ImageSpec::Built(resolve_built(&ctx, &root, &instance, &target, &name, span.clone(), *built)?)
            }
            Body::Ref(r) if kind == "brought" => ImageSpec::Brought(resolve_ref(&ctx, kind, &name, span.clone(), r)?),
            Body::Ref(r) => ImageSpec::Pinned(resolve_ref(&ctx, kind, &name, span.clone(), r)?),
        };
        images.push(Image { name, spec });
        spans.push(span);
    }
    resolve_bases(&ctx, &mut images, &spans, &target)?;

    Ok(Manifest {
        path: manifest_path.to_path_buf(),
        instance,
        team,
        root: root.path,
        platforms,
        platform_source,
        target,
        namespace,
        mirror_registry,
        images,
    })
}

enum Body {
    /// Boxed: a built table is many times the size of a ref.
    Built(Box<RawBuilt>),
    Ref(RawRef),
}

fn resolve_instance(ctx: &Ctx<'_>, raw: Option<Spanned<String>>) -> Result<String, ManifestError> {
    let raw = raw.ok_or_else(|| ctx.whole(Problem::MissingInstance))?;
    let name = raw.get_ref();
    // It becomes the kiln.dev/instance label value and part of repository names.
    if !is_dns_label(name) || !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        return Err(ctx.at(raw.span(), Problem::BadInstance { name: name.clone() }));
    }
    Ok(raw.into_inner())
}

fn resolve_platforms(ctx: &Ctx<'_>, raw: Option<Spanned<Vec<Spanned<String>>>>) -> Result<PlatformSet, ManifestError> {
    let Some(raw) = raw else {
        return Ok(PlatformSet::host());
    };
    if raw.get_ref().is_empty() {
        return Err(ctx.at(raw.span(), Problem::EmptyPlatforms));
    }
    let mut platforms = Vec::new();
    for item in raw.into_inner() {
        let platform =
            Platform::parse(item.get_ref()).map_err(|err| ctx.at(item.span(), Problem::BadPlatform { err }))?;
        platforms.push(platform);
    }
    Ok(PlatformSet::new(platforms).expect("checked non-empty above"))
}

type TargetParts = (Target, Option<String>, Option<RegistryPath>);

fn resolve_target(ctx: &Ctx<'_>, raw: Option<Spanned<RawTarget>>) -> Result<TargetParts, ManifestError> {
    let raw = raw.ok_or_else(|| ctx.whole(Problem::NoTarget))?;
    let span = raw.span();
    let t = raw.into_inner();
    let kind = t.kind.ok_or_else(|| ctx.at(span.clone(), Problem::MissingTargetKind))?;
    let refuse = |key: &'static str, value: &Option<Spanned<String>>, kind: &'static str| match value {
        Some(value) => Err(ctx.at(value.span(), Problem::KeyNotForKind { key, kind })),
        None => Ok(()),
    };
    let target = match kind.get_ref().as_str() {
        "registry" => {
            refuse("cluster", &t.cluster, "registry")?;
            let registry = t.registry.ok_or_else(|| ctx.at(span.clone(), Problem::MissingRegistry))?;
            Target::Registry(resolve_registry(ctx, "registry", &registry)?)
        }
        "kind" => {
            refuse("registry", &t.registry, "kind")?;
            let cluster = match &t.cluster {
                Some(cluster) => resolve_cluster(ctx, cluster)?,
                None => "kind".to_string(),
            };
            Target::Kind { cluster }
        }
        "nodes" => {
            refuse("registry", &t.registry, "nodes")?;
            let cluster = t.cluster.as_ref().ok_or_else(|| ctx.at(span.clone(), Problem::MissingCluster))?;
            Target::Nodes { cluster: resolve_cluster(ctx, cluster)? }
        }
        "local" => {
            refuse("registry", &t.registry, "local")?;
            refuse("cluster", &t.cluster, "local")?;
            Target::Local
        }
        other => {
            return Err(ctx.at(kind.span(), Problem::UnknownTargetKind { kind: other.to_string() }));
        }
    };
    let namespace = match t.namespace {
        Some(ns) if !is_dns_label(ns.get_ref()) => {
            let why = "a Kubernetes namespace is lowercase letters, digits and '-', at most 63 characters";
            return Err(ctx.at(ns.span(), Problem::BadName { what: "namespace", value: ns.into_inner(), why }));
        }
        other => other.map(Spanned::into_inner),
    };
    let mirror = t.mirror_registry.map(|m| resolve_registry(ctx, "mirror_registry", &m)).transpose()?;
    Ok((target, namespace, mirror))
}

fn resolve_cluster(ctx: &Ctx<'_>, raw: &Spanned<String>) -> Result<String, ManifestError> {
    let name = raw.get_ref();
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
    {
        let why = "a cluster name is lowercase letters, digits, '.' and '-'";
        return Err(ctx.at(raw.span(), Problem::BadName { what: "cluster", value: name.clone(), why }));
    }
    Ok(name.clone())
}

/// `host[:port][/prefix]`. The host must be one Docker reads as a registry: `team/api` would
/// otherwise be pushed to Docker Hub's user `team`.
fn resolve_registry(ctx: &Ctx<'_>, key: &'static str, raw: &Spanned<String>) -> Result<RegistryPath, ManifestError> {
    let value = raw.get_ref();
    let fail = |why: String| ctx.at(raw.span(), Problem::BadRegistry { key, value: value.clone(), why });
    if value.contains("://") {
        return Err(fail("drop the scheme: write host[:port][/prefix]".to_string()));
    }
    let trimmed = value.trim_end_matches('/');
    let (host, prefix) = match trimmed.split_once('/') {
        Some((host, prefix)) => (host, Some(prefix)),
        None => (trimmed, None),
    };
    if host.is_empty() {
        return Err(fail("it names no host: write host[:port][/prefix]".to_string()));
    }
    refs::check_domain(host).map_err(|problem| fail(problem.to_string()))?;
    if !refs::looks_like_domain(host) {
        return Err(fail(format!(
            "Docker would read {host:?} as a Docker Hub user, not a registry — add the port ({host}:5000) or a \
             domain, or use localhost"
        )));
    }
    if let Some(prefix) = prefix {
        refs::check_path(prefix).map_err(|problem| fail(problem.to_string()))?;
    }
    Ok(RegistryPath { host: host.to_string(), prefix: prefix.map(str::to_string) })
}

fn resolve_ref(
    ctx: &Ctx<'_>,
    kind: &'static str,
    name: &str,
    span: Range<usize>,
    raw: RawRef,
) -> Result<ImageRef, ManifestError> {
    let reference = raw.reference.ok_or_else(|| {
        let example = if kind == "pinned" { "\"<image>:<tag>@sha256:<64 hex>\"" } else { "\"<image>:<tag>\"" };
        ctx.at(span, Problem::MissingKey { kind, image: name.to_string(), key: "ref", example })
    })?;
    let parsed = ImageRef::parse(reference.get_ref())
        .map_err(|err| ctx.at(reference.span(), Problem::BadRef { kind, image: name.to_string(), err }))?;
    if kind == "pinned" && parsed.digest().is_none() {
        let problem = Problem::PinnedWithoutDigest { image: name.to_string(), given: reference.get_ref().clone() };
        return Err(ctx.at(reference.span(), problem));
    }
    Ok(parsed)
}

/// A DNS-1123 label: what Kubernetes accepts as a label value, a namespace and a name.
pub(super) fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-';
    !b.is_empty() && b.len() <= 63 && b.iter().all(inner) && b[0] != b'-' && b[b.len() - 1] != b'-'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_labels() {
        for ok in ["a", "shop", "shop-api", "a1", "1a"] {
            assert!(is_dns_label(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", &"a".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad}");
        }
    }
}
