//! Step 1 of the converge on the CLI's side: stage the contexts the manifest says are staged, walk
//! and address every built image and say what the instance wants as an `UpRequest`. Nothing is
//! sent to Docker; a steady-state converge costs this walk (and any staging command) and one RPC.
//!
//! The CLI computes each content ref, and the coordinator recomputes it from the same inputs
//! (carried here: the context digest, the Dockerfile path the address hashed and the bytes of a
//! Dockerfile that travels — one outside the context, or one rewritten to name its bases by
//! content ref — args, stage, platforms) and refuses any other. So the ref here must be exactly the
//! one `kiln refs` prints — both come from `Manifest::address`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_core::digest::{Summary, Tree, TreeDigest, WalkOptions};
use kiln_core::manifest::{Addressed, BuiltImage, ImageSpec, Manifest, Target};
use kiln_proto::v1::{image_spec, target, ImageSpec as WireImage, Target as WireTarget, UpRequest};
use rayon::prelude::*;

use crate::error::CliError;
use crate::stage::Staged;

/// What `kiln up` will ask for, and where each context it may have to upload lives.
#[derive(Clone, Debug)]
pub struct UpPlan {
    pub request: UpRequest,
    /// By tree digest (64 hex): the coordinator asks for contexts by digest alone.
    pub contexts: BTreeMap<String, ContextSource>,
    /// The sealed trees of staged images, by image name: a staged context's `dir` lives as long
    /// as the plan holds it here.
    pub staged: BTreeMap<String, Staged>,
}

/// A context directory the CLI can pack on demand.
#[derive(Clone, Debug)]
pub struct ContextSource {
    pub dir: PathBuf,
    pub walk: WalkOptions,
    /// The built images whose context this is (two images may share one).
    pub images: Vec<String>,
    /// About how many bytes its archive takes (each entry's 512-byte header and padded content),
    /// so an upload can show a total, a percentage and a rate.
    pub archive_bytes: u64,
    /// The addressing walk's entry list, hashed, when it was kept: the per-file upload names its
    /// blobs from it instead of walking and hashing the context again (each blob is hashed again
    /// as it is read, so a file edited since is still caught).
    pub tree: Option<std::sync::Arc<Tree>>,
    /// Where its stat cache is, for an upload that must walk it (`tree` is `None`: `kiln watch`
    /// vouched for it, so it was not walked): unchanged files are then not read again.
    pub stat_cache: Option<PathBuf>,
}

/// Every built image's context walked: staged first where the manifest says so.
#[derive(Debug)]
pub struct Walked {
    /// By image name.
    pub contexts: BTreeMap<String, WalkedContext>,
    /// The sealed trees, by image name; each is removed when the last clone is dropped.
    pub staged: BTreeMap<String, Staged>,
}

/// One built image's context, walked.
#[derive(Clone, Debug)]
pub struct WalkedContext {
    /// The directory walked: the image's context folder, or its sealed staged tree.
    pub dir: PathBuf,
    pub digest: TreeDigest,
    pub entries: usize,
    /// See [`ContextSource::archive_bytes`].
    pub archive_bytes: u64,
    /// The walk's entry list, hashed: only from [`walk_built_keeping_trees`] (`kiln why`), since
    /// `kiln up` has no use for it once the digest is known.
    pub tree: Option<Tree>,
}

impl Walked {
    /// The tree digests, by image name, as [`Manifest::address`] takes them.
    pub fn trees(&self) -> BTreeMap<&str, TreeDigest> {
        self.contexts.iter().map(|(name, c)| (name.as_str(), c.digest)).collect()
    }
}

/// Step 1's first half, shared by `kiln up` and `kiln refs` so they address the same trees:
/// stages the staged images' contexts (one after another, [`crate::stage`]), then walks every
/// built image's context in parallel — the sealed tree for a staged one, else its folder, with
/// the stat cache under `stat_cache` when given.
pub fn walk_built(manifest: &Manifest, stat_cache: Option<&Path>) -> Result<Walked, CliError> {
    walk(manifest, stat_cache, Trees::Drop)
}

/// [`walk_built`], keeping each context's entry list ([`WalkedContext::tree`]).
pub fn walk_built_keeping_trees(manifest: &Manifest, stat_cache: Option<&Path>) -> Result<Walked, CliError> {
    walk(manifest, stat_cache, Trees::Keep)
}

/// What a walk does with each context's entry list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Trees {
    Drop,
    Keep,
    /// Keep it when the context was walked; a context `kiln watch` vouches for is not walked at
    /// all, and has none (an upload walks it then).
    KeepIfWalked,
}

fn walk(manifest: &Manifest, stat_cache: Option<&Path>, trees: Trees) -> Result<Walked, CliError> {
    let staged = crate::stage::stage_all(manifest)?;
    let built: Vec<(&str, &BuiltImage)> = manifest.built().collect();
    // Asked before any context is walked: a change made after the question moves the tag.
    let tags = match (stat_cache, trees) {
        (Some(_), Trees::KeepIfWalked) => watch_tags(&built, &staged),
        _ => BTreeMap::new(),
    };
    let contexts = built
        .par_iter()
        .map(|&(name, image)| {
            let walked = match (staged.get(name), stat_cache, tags.get(name)) {
                (Some(tree), _, _) => image.walk_staged(tree.path()).map(summarized),
                (None, Some(dir), Some(tag)) => image.walk_vouched(dir, tag.as_deref()),
                (None, stat_cache, _) => image.walk_with(stat_cache).map(summarized),
            };
            let (tree, summary) = walked.map_err(|err| CliError::Address { image: name.to_string(), err })?;
            let dir = staged.get(name).map_or_else(|| image.context.clone(), |t| t.path().to_path_buf());
            let walked = WalkedContext {
                dir,
                digest: summary.digest,
                entries: summary.entries as usize,
                archive_bytes: summary.archive_bytes,
                tree: tree.filter(|_| trees != Trees::Drop),
            };
            Ok((name.to_string(), walked))
        })
        .collect::<Result<_, CliError>>()?;
    Ok(Walked { contexts, staged })
}

fn summarized((tree, digest): (Tree, TreeDigest)) -> (Option<Tree>, Summary) {
    let summary = Summary::of(&tree, digest);
    (Some(tree), summary)
}

/// The watcher's tag of each unstaged context, by image name; an image is missing when no
/// watcher answers (its context is walked as without one), and has `None` when the watcher
/// cannot watch its context (it is walked, and nothing is recorded for the next run).
fn watch_tags(built: &[(&str, &BuiltImage)], staged: &BTreeMap<String, Staged>) -> BTreeMap<String, Option<Vec<u8>>> {
    let mut names = Vec::new();
    let mut roots = Vec::new();
    for &(name, image) in built {
        if staged.contains_key(name) {
            continue;
        }
        if let Ok(root) = std::fs::canonicalize(&image.context) {
            names.push(name.to_string());
            roots.push((root, image.walk_options().dockerfile));
        }
    }
    match crate::watch::tags(&roots) {
        Some(tags) => names.into_iter().zip(tags).collect(),
        None => BTreeMap::new(),
    }
}

/// Stages and walks every built image's context ([`walk_built`]), addresses the images in build
/// order (a base's ref is part of the Dockerfile of an image built FROM it), and builds the
/// request. Brought and pinned images pass through with their refs (in Docker's familiar form,
/// which normalizes to the ref as written); nothing about them is checked or touched.
///
/// The request lists the images in file order, except that the built ones take the built images'
/// places in build order, so every base comes before the images built FROM it: a coordinator that
/// builds in request order (one older than `ImageSpec.from`) then builds bases first too.
///
/// With `stat_cache` (a directory), files whose stat has not moved since the last walk are not
/// read again (`kiln_core::digest::digest_dir_cached`).
pub fn plan_up(
    manifest: &Manifest,
    force: bool,
    requested_by: &str,
    stat_cache: Option<&Path>,
) -> Result<UpPlan, CliError> {
    let platforms = &manifest.platforms;
    // The trees are kept: an upload names its blobs from them (or walks, for a context the
    // watcher vouched for, which was not walked).
    let mut walked = walk(manifest, stat_cache, Trees::KeepIfWalked)?;
    let mut addressed = manifest.address(&walked.trees())?.into_iter();
    let mut images = Vec::with_capacity(manifest.images.len());
    let mut contexts: BTreeMap<String, ContextSource> = BTreeMap::new();
    for image in &manifest.images {
        let passthrough = |kind: image_spec::Kind, reference: String| WireImage {
            name: image.name.clone(),
            kind: kind as i32,
            reference,
            ..Default::default()
        };
        match &image.spec {
            ImageSpec::Built(_) => {
                let done = addressed.next().expect("one address per built image");
                let context = walked.contexts.get_mut(done.name).expect("every built image walked");
                let tree = context.tree.take().map(std::sync::Arc::new);
                contexts
                    .entry(done.tree.to_string())
                    .and_modify(|known| known.images.push(done.name.to_string()))
                    .or_insert_with(|| ContextSource {
                        dir: context.dir.clone(),
                        walk: done.image.walk_options(),
                        images: vec![done.name.to_string()],
                        archive_bytes: context.archive_bytes,
                        tree,
                        stat_cache: stat_cache.map(Path::to_path_buf),
                    });
                images.push(wire_built(done));
            }
            ImageSpec::Brought(r) => images.push(passthrough(image_spec::Kind::Brought, r.to_string())),
            ImageSpec::Pinned(r) => images.push(passthrough(image_spec::Kind::Pinned, r.to_string())),
        }
    }

    let request = UpRequest {
        instance: manifest.instance.clone(),
        target: Some(wire_target(manifest)),
        platforms: platforms.iter().map(|p| p.oci()).collect(),
        images,
        force,
        requested_by: requested_by.to_string(),
        dry_run: false,
        team: manifest.team.clone().unwrap_or_default(),
        mirror_only: false,
    };
    Ok(UpPlan { request, contexts, staged: walked.staged })
}

/// A built image's wire spec: what the coordinator recomputes its address from and the agent builds.
pub(crate) fn wire_built(done: Addressed<'_>) -> WireImage {
    let image = done.image;
    // The Dockerfile as built: an outside one, or one whose FROMs now name its bases' content refs,
    // travels by contents (the archive carries only the context), and `dockerfile` stays empty;
    // the context's own file as it is travels in the archive, named by `dockerfile`.
    let (dockerfile, dockerfile_outside) = match done.dockerfile.sent {
        Some(bytes) => (String::new(), bytes),
        None => (image.dockerfile.rel().to_string(), Vec::new()),
    };
    WireImage {
        // The Dockerfile's own hash, so a rebuild can say "Dockerfile changed" apart from the rest
        // of the context (a base's new ref is such a change).
        dockerfile_digest: done.dockerfile.digest,
        // What the address hashed, so the coordinator can recompute it: a sent Dockerfile's path
        // is not `dockerfile`, which stays empty for one.
        dockerfile_path: image.dockerfile.rel().to_string(),
        name: done.name.to_string(),
        kind: image_spec::Kind::Built as i32,
        reference: done.reference.to_string(),
        context_digest: done.tree.to_string(),
        dockerfile,
        dockerfile_outside,
        args: image.args.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        target_stage: image.target.clone().unwrap_or_default(),
        shared: image.shared,
        from: image.base_names().into_iter().map(str::to_string).collect(),
    }
}

pub(crate) fn wire_target(manifest: &Manifest) -> WireTarget {
    let namespace = manifest.namespace.clone().unwrap_or_default();
    let (kind, registry, cluster) = match &manifest.target {
        Target::Registry(registry) => (target::Kind::Registry, registry.to_string(), String::new()),
        Target::Kind { cluster } => (target::Kind::Kind, String::new(), cluster.clone()),
        Target::Nodes { cluster } => (target::Kind::Nodes, String::new(), cluster.clone()),
        Target::Local => (target::Kind::Local, String::new(), String::new()),
    };
    let mirror_registry = manifest.mirror_registry.as_ref().map(ToString::to_string).unwrap_or_default();
    WireTarget { kind: kind as i32, registry, cluster, namespace, mirror_registry }
}

/// `kiln mirror`: the manifest's pinned images alone, to be copied into its `mirror_registry` —
/// no context is walked or staged, since nothing is built.
pub fn plan_mirror(manifest: &Manifest, dry_run: bool, requested_by: &str) -> UpRequest {
    let images = manifest
        .images
        .iter()
        .filter_map(|image| match &image.spec {
            ImageSpec::Pinned(r) => Some(WireImage {
                name: image.name.clone(),
                kind: image_spec::Kind::Pinned as i32,
                reference: r.to_string(),
                ..Default::default()
            }),
            _ => None,
        })
        .collect();
    UpRequest {
        instance: manifest.instance.clone(),
        target: Some(wire_target(manifest)),
        platforms: manifest.platforms.iter().map(|p| p.oci()).collect(),
        images,
        force: false,
        requested_by: requested_by.to_string(),
        dry_run,
        team: manifest.team.clone().unwrap_or_default(),
        mirror_only: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::refs::{content_ref, image_address};
    use std::path::Path;

    fn example(name: &str) -> Manifest {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name);
        Manifest::load(&dir).unwrap()
    }

    /// The refs `kiln refs examples/hello` prints, computed the same way from the same core calls.
    fn expected_ref(manifest: &Manifest, name: &str) -> String {
        let ImageSpec::Built(built) = &manifest.image(name).unwrap().spec else { panic!("{name} is built") };
        let (_, tree) = built.walk().unwrap();
        let dockerfile = built.dockerfile_as_built(&BTreeMap::new()).unwrap();
        let address = image_address(&built.address_inputs(tree, &manifest.platforms, &dockerfile));
        content_ref(&manifest.target.qualify(&built.repository), &address, &manifest.platforms).unwrap().to_string()
    }

    #[test]
    fn hello_asks_for_two_built_images_with_their_refs_and_passes_the_rest_through() {
        let manifest = example("hello");
        let plan = plan_up(&manifest, false, "ana@box", None).unwrap();
        let r = &plan.request;
        assert_eq!(r.instance, "hello");
        assert_eq!(r.requested_by, "ana@box");
        assert!(!r.force);
        assert_eq!(r.target, Some(WireTarget { kind: target::Kind::Local as i32, ..Default::default() }));
        assert_eq!(r.platforms, manifest.platforms.iter().map(|p| p.oci()).collect::<Vec<_>>());
        assert!(r.platforms.iter().all(|p| p.starts_with("linux/")), "{:?}", r.platforms);

        let names: Vec<&str> = r.images.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["web", "worker", "shell", "pause"], "file order");

        let web = &r.images[0];
        assert_eq!(web.kind, image_spec::Kind::Built as i32);
        assert_eq!(web.reference, expected_ref(&manifest, "web"));
        assert!(
            web.reference.starts_with("hello-web:") && web.reference.ends_with(&format!("-{}", manifest.platforms))
        );
        assert_eq!(web.dockerfile, "Dockerfile");
        assert!(web.dockerfile_outside.is_empty());
        assert_eq!(web.context_digest.len(), 64);

        let worker = &r.images[1];
        assert_eq!(worker.reference, expected_ref(&manifest, "worker"));
        assert_eq!(worker.dockerfile, "", "an outside Dockerfile travels by contents, not by path");
        assert_eq!(worker.dockerfile_path, "../worker.Dockerfile", "the path its address hashed");
        assert_eq!(web.dockerfile_path, web.dockerfile);
        let outside = std::fs::read(manifest.path.parent().unwrap().join("worker.Dockerfile")).unwrap();
        assert_eq!(worker.dockerfile_outside, outside);
        assert_eq!(worker.args.get("GREETING").map(String::as_str), Some("hello from kiln"));
        assert_eq!(worker.target_stage, "");
        assert!(!worker.shared);

        let shell = &r.images[2];
        assert_eq!((shell.kind, shell.reference.as_str()), (image_spec::Kind::Brought as i32, "busybox:1.36"));
        assert!(shell.context_digest.is_empty() && shell.dockerfile.is_empty());
        let pause = &r.images[3];
        assert_eq!(pause.kind, image_spec::Kind::Pinned as i32);
        assert_eq!(
            pause.reference,
            "registry.k8s.io/pause:3.9@sha256:7031c1b283388d2c2e09b57badb803c05ebed362dc88d84b480cc47f72a21097"
        );

        assert_eq!(plan.contexts.len(), 2);
        let web_ctx = &plan.contexts[&web.context_digest];
        assert_eq!(web_ctx.images, ["web"]);
        assert_eq!(web_ctx.dir, manifest.path.parent().unwrap().join("web").canonicalize().unwrap());
        assert_eq!(plan.contexts[&worker.context_digest].images, ["worker"]);
    }

    #[test]
    fn a_registry_target_qualifies_the_refs_and_force_is_carried() {
        let manifest = example("registry");
        let plan = plan_up(&manifest, true, "ana@box", None).unwrap();
        assert!(plan.request.force);
        let target = plan.request.target.as_ref().unwrap();
        assert_eq!((target.kind, target.registry.as_str()), (target::Kind::Registry as i32, "127.0.0.1:5000"));
        assert!(plan.request.images[0].reference.starts_with("127.0.0.1:5000/hello-registry-web:"));
        assert_eq!(plan.request.images[0].reference, expected_ref(&manifest, "web"));
    }

    #[test]
    fn two_images_of_one_context_share_one_upload() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("app")).unwrap();
        std::fs::write(tmp.path().join("app/Dockerfile"), "FROM scratch\nCOPY . /\n").unwrap();
        let text = "instance = \"pair\"\n[target]\nkind = \"local\"\n\
                    [built.a]\ncontext = \"app\"\n[built.b]\ncontext = \"app\"\nargs = { X = \"1\" }\n";
        std::fs::write(tmp.path().join("kiln.toml"), text).unwrap();
        let plan = plan_up(&Manifest::load(tmp.path()).unwrap(), false, "u@h", None).unwrap();
        let [a, b] = &plan.request.images[..] else { panic!("two images") };
        assert_eq!(a.context_digest, b.context_digest);
        assert_ne!(a.reference, b.reference, "the build arg is part of the address");
        assert_eq!(plan.contexts.len(), 1);
        assert_eq!(plan.contexts[&a.context_digest].images, ["a", "b"]);
    }

    #[test]
    fn a_base_comes_first_and_its_child_sends_its_dockerfile_rewritten_to_the_bases_ref() {
        let tmp = tempfile::tempdir().unwrap();
        for (path, contents) in [
            ("api/Dockerfile", "FROM base AS run\nCOPY app /app\n"),
            ("api/app", "app\n"),
            ("base/Dockerfile", "FROM scratch\nCOPY hello /hello\n"),
            ("base/hello", "hello\n"),
        ] {
            std::fs::create_dir_all(tmp.path().join(path).parent().unwrap()).unwrap();
            std::fs::write(tmp.path().join(path), contents).unwrap();
        }
        // The child first in the file, a brought image between them.
        let text = "instance = \"shop\"\n[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n\
                    [brought.db]\nref = \"postgres:16\"\n[built.base]\ncontext = \"base\"\nshared = true\n";
        std::fs::write(tmp.path().join("kiln.toml"), text).unwrap();
        let plan = plan_up(&Manifest::load(tmp.path()).unwrap(), false, "u@h", None).unwrap();
        let names: Vec<&str> = plan.request.images.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["base", "db", "api"], "the base takes the first built place");
        let [base, _, api] = &plan.request.images[..] else { panic!("three images") };

        assert!(base.from.is_empty() && base.dockerfile_outside.is_empty());
        assert_eq!(base.dockerfile, "Dockerfile");
        assert_eq!(api.from, ["base"]);
        let sent = String::from_utf8(api.dockerfile_outside.clone()).unwrap();
        assert_eq!(sent, format!("FROM {} AS run\nCOPY app /app\n", base.reference));
        assert_eq!(api.dockerfile, "", "a rewritten Dockerfile travels by contents, as an outside one does");
        assert_eq!(api.dockerfile_path, "Dockerfile", "the path its address hashed");
        assert_eq!(api.dockerfile_digest, blake3::hash(sent.as_bytes()).to_hex().to_string());
        assert_eq!(plan.contexts[&api.context_digest].images, ["api"]);
    }

    #[test]
    fn a_staged_image_addresses_its_sealed_tree_the_same_from_any_staging_directory() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("api")).unwrap();
        std::fs::write(tmp.path().join("api/Dockerfile"), "FROM scratch\nCOPY . /app/\n").unwrap();
        std::fs::write(tmp.path().join("api/source.txt"), "the folder itself is not what is built\n").unwrap();
        // As a package manager does: the output path recorded in a state file (declared) and in
        // a config the seal rewrites to the in-image path.
        let script = "echo app > \"$1/app.txt\"\nprintf 'at %s %s\\n' \"$1\" \"$$\" > \"$1/.state\"\n\
                      printf '{\"root\":\"%s/lib\"}' \"$1\" > \"$1/config.json\"\n";
        std::fs::write(tmp.path().join("api/stage.sh"), script).unwrap();
        let text = "instance = \"shop\"\n[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n\
                    stage = { run = [\"sh\", \"stage.sh\", \"{out}\"], remove = [\".state\"], image_path = \"/app\" }\n";
        std::fs::write(tmp.path().join("kiln.toml"), text).unwrap();
        let manifest = Manifest::load(tmp.path()).unwrap();

        let first = plan_up(&manifest, false, "u@h", None).unwrap();
        let second = plan_up(&manifest, false, "u@h", None).unwrap();
        let (a, b) = (&first.request.images[0], &second.request.images[0]);
        assert_eq!(a.reference, b.reference, "one input staged twice is one address");
        let (dir_a, dir_b) = (&first.contexts[&a.context_digest].dir, &second.contexts[&b.context_digest].dir);
        assert_ne!(dir_a, dir_b, "two fresh staging directories");
        assert_eq!(dir_a, first.staged["api"].path(), "the context uploaded is the sealed tree");
        assert!(!dir_a.join("source.txt").exists() && !dir_a.join(".state").exists());
        assert_eq!(std::fs::read_to_string(dir_a.join("config.json")).unwrap(), "{\"root\":\"/app/lib\"}");

        // The Dockerfile is the manifest's, travelling beside the tree; the tree has none.
        assert_eq!((a.dockerfile.as_str(), a.dockerfile_path.as_str()), ("", "Dockerfile"));
        assert_eq!(a.dockerfile_outside, b"FROM scratch\nCOPY . /app/\n");
        assert_eq!(first.contexts[&a.context_digest].walk.dockerfile, None);

        let dir = dir_a.clone();
        drop(first);
        assert!(!dir.exists(), "a staged tree lives as long as its plan");
    }

    #[test]
    fn an_unaddressable_context_names_the_image_and_is_a_usage_error() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("app")).unwrap();
        std::fs::write(tmp.path().join("app/Dockerfile"), "FROM scratch\n").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", tmp.path().join("app/escape")).unwrap();
        let text = "instance = \"bad\"\n[target]\nkind = \"local\"\n[built.app]\ncontext = \"app\"\n";
        std::fs::write(tmp.path().join("kiln.toml"), text).unwrap();
        let err = plan_up(&Manifest::load(tmp.path()).unwrap(), false, "u@h", None).unwrap_err();
        assert_eq!(err.exit(), crate::Exit::Usage);
        assert!(crate::error::report(&err).contains("built image \"app\" cannot be addressed: context"), "{err}");
    }
}
