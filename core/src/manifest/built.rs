//! Resolving one `[built.<name>]` table: its context, its Dockerfile (inside the context or not),
//! its build args, target stage, repository and staging command.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

use toml::Spanned;

use super::error::{ManifestError, Problem};
use super::raw::RawBuilt;
use super::resolve::Ctx;
use super::root::Root;
use super::stage::resolve_stage;
use super::{BuiltImage, DockerfileLoc, Target};
use crate::refs;

pub(super) fn resolve_built(
    ctx: &Ctx<'_>,
    root: &Root,
    instance: &str,
    target: &Target,
    name: &str,
    span: Range<usize>,
    raw: RawBuilt,
) -> Result<BuiltImage, ManifestError> {
    let image = || name.to_string();
    let context_raw = raw.context.ok_or_else(|| {
        let example = "\"<dir>\" (relative to this file's folder)";
        ctx.at(span.clone(), Problem::MissingKey { kind: "built", image: image(), key: "context", example })
    })?;
    let given = context_raw.get_ref().clone();
    let at_context = |problem| ctx.at(context_raw.span(), problem);
    let joined = relative_path(ctx, name, "context", &context_raw)?;
    let looked = std::path::absolute(&joined).unwrap_or_else(|_| joined.clone());
    match std::fs::metadata(&joined) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => return Err(at_context(Problem::ContextNotDir { image: image(), given, looked })),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(at_context(Problem::ContextMissing { image: image(), given, looked }));
        }
        Err(err) => {
            return Err(at_context(Problem::Unresolvable { image: image(), key: "context", given, looked, err }));
        }
    }
    let context = std::fs::canonicalize(&joined).map_err(|err| {
        at_context(Problem::Unresolvable { image: image(), key: "context", given: given.clone(), looked, err })
    })?;
    // After canonicalize, so a symlinked context is judged by where it really is.
    root.contain(ctx, context_raw.span(), "context", section(name), &given, &context)?;

    let dockerfile = resolve_dockerfile(ctx, root, name, &context, &given, raw.dockerfile.as_ref(), span.clone())?;

    let mut args = BTreeMap::new();
    if let Some(raw_args) = raw.args {
        let args_span = raw_args.span();
        for (key, value) in raw_args.into_inner() {
            // `--build-arg K=V` splits at the first '='; a key holding one would set another arg.
            if key.is_empty() || key.contains('=') || key.contains(char::is_whitespace) {
                return Err(ctx.at(args_span, Problem::BadArg { image: image(), key }));
            }
            args.insert(key, value);
        }
    }

    let stage = match raw.target {
        Some(stage) => {
            let s = stage.get_ref();
            let ok = s.starts_with(|c: char| c.is_ascii_alphabetic())
                && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
            if !ok {
                return Err(ctx.at(stage.span(), Problem::BadStage { image: image(), stage: s.clone() }));
            }
            Some(stage.into_inner())
        }
        None => None,
    };

    let (repository, repo_span) = match raw.repository {
        Some(repo) => (repo.get_ref().clone(), repo.span()),
        None => (format!("{instance}-{name}"), span),
    };
    check_repository(target, &repository, name).map_err(|problem| ctx.at(repo_span, problem))?;

    let staged = raw.stage.map(|raw| resolve_stage(ctx, name, raw)).transpose()?;

    // Its bases are read once every image is known (`from::resolve_bases`).
    let shared = raw.shared.unwrap_or(false);
    Ok(BuiltImage { context, dockerfile, args, target: stage, shared, repository, from: Vec::new(), stage: staged })
}

/// A repository must be a bare path (the target adds the registry) and stay a valid name once
/// the target has qualified it.
fn check_repository(target: &Target, repository: &str, image: &str) -> Result<(), Problem> {
    let first = repository.split('/').next().unwrap_or_default();
    let has_domain = repository.contains('/') && (first.contains('.') || first == "localhost");
    if repository.contains([':', '@']) || has_domain {
        return Err(Problem::RepositoryNotPlain { image: image.to_string(), repository: repository.to_string() });
    }
    let checked = refs::check_path(repository)
        .map_err(|problem| refs::RefError::new(repository, problem))
        .and_then(|()| refs::parse_parts(&target.qualify(repository)).map(drop));
    checked.map_err(|err| Problem::BadRepository { image: image.to_string(), repository: repository.to_string(), err })
}

fn resolve_dockerfile(
    ctx: &Ctx<'_>,
    root: &Root,
    name: &str,
    context: &Path,
    context_given: &str,
    raw: Option<&Spanned<String>>,
    span: Range<usize>,
) -> Result<DockerfileLoc, ManifestError> {
    let image = || name.to_string();
    let (joined, problem_span) = match raw {
        Some(raw) => (relative_path(ctx, name, "dockerfile", raw)?, raw.span()),
        None => (context.join("Dockerfile"), span),
    };
    let looked = std::path::absolute(&joined).unwrap_or_else(|_| joined.clone());
    let missing = || match raw {
        Some(raw) => {
            Problem::DockerfileMissing { image: image(), given: raw.get_ref().clone(), looked: looked.clone() }
        }
        None => Problem::DefaultDockerfileMissing {
            image: image(),
            context: context_given.to_string(),
            looked: looked.clone(),
        },
    };
    let given = || raw.map(|r| r.get_ref().clone()).unwrap_or_else(|| format!("{context_given}/Dockerfile"));
    match std::fs::metadata(&joined) {
        Ok(meta) if meta.is_file() => {}
        Ok(_) => {
            let problem = Problem::DockerfileNotFile { image: image(), given: given(), looked: looked.clone() };
            return Err(ctx.at(problem_span, problem));
        }
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Err(ctx.at(problem_span, missing())),
        Err(err) => {
            let problem = Problem::Unresolvable {
                image: image(),
                key: "dockerfile",
                given: given(),
                looked: looked.clone(),
                err,
            };
            return Err(ctx.at(problem_span, problem));
        }
    }
    let path = std::fs::canonicalize(&joined).map_err(|err| {
        let problem = Problem::Unresolvable { image: image(), key: "dockerfile", given: given(), looked, err };
        ctx.at(problem_span.clone(), problem)
    })?;
    root.contain(ctx, problem_span, "dockerfile", section(name), &given(), &path)?;
    let rel = relative_from(context, &path);
    // A path the walk cannot name as UTF-8 is treated as outside: its contents then enter the
    // address directly instead of relying on the walk to cover it.
    match (path.starts_with(context), rel) {
        (true, Some(rel)) => Ok(DockerfileLoc::Inside { rel }),
        (_, rel) => {
            let rel = rel.unwrap_or_else(|| path.to_string_lossy().into_owned());
            Ok(DockerfileLoc::Outside { path, rel })
        }
    }
}

fn section(name: &str) -> String {
    super::raw::section("built", name)
}

/// `raw` joined to the manifest's folder; absolute paths are refused so a manifest means the same
/// on every checkout.
fn relative_path(
    ctx: &Ctx<'_>,
    name: &str,
    key: &'static str,
    raw: &Spanned<String>,
) -> Result<PathBuf, ManifestError> {
    let given = raw.get_ref();
    if Path::new(given).is_absolute() {
        let problem = Problem::AbsolutePath { image: name.to_string(), key, value: given.clone() };
        return Err(ctx.at(raw.span(), problem));
    }
    Ok(ctx.dir.join(given))
}

/// The `/`-separated path from directory `base` to `target` (both absolute and resolved), with
/// `..` where it climbs; `None` when a component is not UTF-8.
pub(super) fn relative_from(base: &Path, target: &Path) -> Option<String> {
    let base: Vec<Component<'_>> = base.components().collect();
    let target: Vec<Component<'_>> = target.components().collect();
    let common = base.iter().zip(&target).take_while(|(a, b)| a == b).count();
    let mut parts: Vec<&str> = vec![".."; base.len() - common];
    for component in &target[common..] {
        parts.push(component.as_os_str().to_str()?);
    }
    Some(parts.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_climb_and_descend() {
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(relative_from(&p("/a/b"), &p("/a/b/Dockerfile")).unwrap(), "Dockerfile");
        assert_eq!(relative_from(&p("/a/b"), &p("/a/b/d/x.Dockerfile")).unwrap(), "d/x.Dockerfile");
        assert_eq!(relative_from(&p("/a/b"), &p("/a/w.Dockerfile")).unwrap(), "../w.Dockerfile");
        assert_eq!(relative_from(&p("/a/b/c"), &p("/a/x/y")).unwrap(), "../../x/y");
    }
}
