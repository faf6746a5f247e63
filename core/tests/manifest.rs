//! `kiln.toml`: a full valid manifest, each error with its line and fix, and the shipped examples.

use std::path::{Path, PathBuf};

use kiln_core::manifest::{
    BuiltDockerfile, DockerfileLoc, ImageSpec, Manifest, ManifestError, PlatformSource, RegistryPath, Target,
};
use kiln_core::refs::{ImageRef, PlatformSet};
use tempfile::TempDir;

const DIGEST: &str = "sha256:7031c1b283388d2c2e09b57badb803c05ebed362dc88d84b480cc47f72a21097";

/// A folder holding `files` (path, contents) and `kiln.toml` = `manifest`.
fn folder(manifest: &str, files: &[(&str, &str)]) -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (path, contents) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, contents).unwrap();
    }
    std::fs::write(dir.path().join("kiln.toml"), manifest).unwrap();
    dir
}

const API: &[(&str, &str)] = &[("api/Dockerfile", "FROM scratch\n")];

fn load(manifest: &str, files: &[(&str, &str)]) -> Result<(Manifest, TempDir), ManifestError> {
    let dir = folder(manifest, files);
    Manifest::load(dir.path()).map(|m| (m, dir))
}

/// Loads `manifest` expecting an error; returns it with its whole source chain rendered.
fn fail(manifest: &str, files: &[(&str, &str)]) -> (ManifestError, String, TempDir) {
    let dir = folder(manifest, files);
    let err = Manifest::load(dir.path()).expect_err("manifest should be refused");
    let mut chain = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        chain.push_str(" :: ");
        chain.push_str(&s.to_string());
        source = s.source();
    }
    (err, chain, dir)
}

fn assert_has(msg: &str, parts: &[&str]) {
    for part in parts {
        assert!(msg.contains(part), "message lacks {part:?}:\n{msg}");
    }
}

#[test]
fn a_full_manifest_resolves() {
    let text = format!(
        r#"instance = "shop"
platforms = ["linux/arm64", "linux/amd64"]

[target]
kind = "registry"
registry = "127.0.0.1:5000/team"
namespace = "shop"
mirror_registry = "mirror.internal:5000/upstream"

[brought.db]
ref = "postgres:16"

[built.api]
context = "services/api"

[built.worker]
context = "services/worker"
dockerfile = "docker/worker.Dockerfile"
args = {{ VERSION = "1", GREETING = "hi there" }}
target = "runtime"
shared = true
repository = "shared/worker"

[built.tools]
context = "services/tools"
dockerfile = "services/tools/docker/tools.Dockerfile"

[pinned.envoy]
ref = "envoyproxy/envoy:v1.30.1@{DIGEST}"
"#
    );
    let files = [
        ("services/api/Dockerfile", "FROM scratch\n"),
        ("services/worker/main.sh", "echo\n"),
        ("docker/worker.Dockerfile", "FROM scratch\n"),
        ("services/tools/docker/tools.Dockerfile", "FROM scratch\n"),
    ];
    let (m, dir) = load(&text, &files).unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();

    assert_eq!(m.path, dir.path().join("kiln.toml"));
    assert_eq!(m.instance, "shop");
    assert_eq!(m.platforms.to_string(), "amd64.arm64");
    let registry = RegistryPath { host: "127.0.0.1:5000".to_string(), prefix: Some("team".to_string()) };
    assert_eq!(m.target, Target::Registry(registry));
    assert_eq!(m.target.qualify("shop-api"), "127.0.0.1:5000/team/shop-api");
    assert_eq!(m.namespace.as_deref(), Some("shop"));
    assert_eq!(m.mirror_registry.as_ref().map(ToString::to_string).as_deref(), Some("mirror.internal:5000/upstream"));

    // File order, not section order.
    let names: Vec<&str> = m.images.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["db", "api", "worker", "tools", "envoy"]);

    let ImageSpec::Brought(db) = &m.image("db").unwrap().spec else { panic!("db is brought") };
    assert_eq!(db, &ImageRef::parse("docker.io/library/postgres:16").unwrap());

    let built: Vec<_> = m.built().collect();
    assert_eq!(built.len(), 3);
    let (_, api) = built[0];
    assert_eq!(api.context, root.join("services/api"));
    assert!(api.context.is_absolute());
    assert_eq!(api.dockerfile, DockerfileLoc::Inside { rel: "Dockerfile".to_string() });
    assert!(api.args.is_empty());
    assert_eq!(api.target, None);
    assert!(!api.shared);
    assert_eq!(api.repository, "shop-api");

    let (_, worker) = built[1];
    assert_eq!(
        worker.dockerfile,
        DockerfileLoc::Outside {
            path: root.join("docker/worker.Dockerfile"),
            rel: "../../docker/worker.Dockerfile".to_string()
        }
    );
    assert_eq!(worker.args.get("GREETING").map(String::as_str), Some("hi there"));
    assert_eq!(worker.args.get("VERSION").map(String::as_str), Some("1"));
    assert_eq!(worker.target.as_deref(), Some("runtime"));
    assert!(worker.shared);
    assert_eq!(worker.repository, "shared/worker");

    let (_, tools) = built[2];
    assert_eq!(tools.dockerfile, DockerfileLoc::Inside { rel: "docker/tools.Dockerfile".to_string() });

    let ImageSpec::Pinned(envoy) = &m.image("envoy").unwrap().spec else { panic!("envoy is pinned") };
    assert_eq!(envoy.digest(), Some(DIGEST));
    assert_eq!(envoy.normalized(), format!("docker.io/envoyproxy/envoy:v1.30.1@{DIGEST}"));

    // The address inputs carry what the manifest resolved.
    let tree = kiln_core::digest::TreeDigest([1; 32]);
    let dockerfile = BuiltDockerfile { sent: Some(b"FROM scratch\n".to_vec()), digest: String::new() };
    let inputs = worker.address_inputs(tree, &m.platforms, &dockerfile);
    assert_eq!(inputs.dockerfile_path, "../../docker/worker.Dockerfile");
    assert_eq!(inputs.target, Some("runtime"));
    assert_eq!(inputs.build_args.len(), 2);
}

#[test]
fn other_targets_and_defaults() {
    let body = "\n[built.api]\ncontext = \"api\"\n";
    let (m, _d) = load(&format!("instance = \"a\"\n[target]\nkind = \"kind\"\n{body}"), API).unwrap();
    assert_eq!(m.target, Target::Kind { cluster: "kind".to_string() });
    assert_eq!(m.target.qualify("a-api"), "a-api");
    // No platforms key: this host's architecture.
    assert_eq!(m.platforms, PlatformSet::host());

    let (m, _d) =
        load(&format!("instance = \"a\"\n[target]\nkind = \"kind\"\ncluster = \"dev\"\n{body}"), API).unwrap();
    assert_eq!(m.target, Target::Kind { cluster: "dev".to_string() });
    let (m, _d) =
        load(&format!("instance = \"a\"\n[target]\nkind = \"nodes\"\ncluster = \"prod\"\n{body}"), API).unwrap();
    assert_eq!(m.target, Target::Nodes { cluster: "prod".to_string() });
    let (m, _d) = load(&format!("instance = \"a\"\n[target]\nkind = \"local\"\n{body}"), API).unwrap();
    assert_eq!(m.target, Target::Local);
    assert_eq!(m.target.kind_name(), "local");
}

#[test]
#[cfg(unix)]
fn a_dockerfile_linked_out_of_the_context_is_outside() {
    let dir = folder(
        "instance = \"a\"\n[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n",
        &[("api/main.sh", ""), ("real.Dockerfile", "FROM scratch\n")],
    );
    std::os::unix::fs::symlink("../real.Dockerfile", dir.path().join("api/Dockerfile")).unwrap();
    let m = Manifest::load(dir.path()).unwrap();
    let (_, api) = m.built().next().unwrap();
    let root = std::fs::canonicalize(dir.path()).unwrap();
    let want = DockerfileLoc::Outside { path: root.join("real.Dockerfile"), rel: "../real.Dockerfile".to_string() };
    assert_eq!(api.dockerfile, want);
}

#[test]
fn unknown_key_names_its_table_and_the_keys_it_takes() {
    let text = r#"instance = "shop"

[target]
kind = "local"

[built.api]
contxt = "api"
"#;
    let (err, _, dir) = fail(text, API);
    assert_eq!(err.line, Some(7));
    let want = format!(
        "{}:7: unknown key \"contxt\" in [built.api] — expected one of context, dockerfile, args, target, shared, \
         repository, stage",
        dir.path().join("kiln.toml").display()
    );
    assert_eq!(err.to_string(), want);

    let (err, msg, _) = fail("instance = \"a\"\nimages = 1\n", API);
    assert_eq!(err.line, Some(2));
    assert_has(&msg, &["unknown key \"images\" at the top level", "instance, team, platforms, target, built"]);

    let (err, msg, _) = fail("instance = \"a\"\n[target]\nkind = \"kind\"\nclustr = \"x\"\n", API);
    assert_eq!(err.line, Some(4));
    assert_has(&msg, &["unknown key \"clustr\" in [target]", "mirror_registry"]);

    let (err, msg, _) =
        fail("instance = \"a\"\n[target]\nkind = \"local\"\n[pinned.p]\nref = \"x\"\ndigest = \"y\"\n", API);
    assert_eq!(err.line, Some(6));
    assert_has(&msg, &["unknown key \"digest\" in [pinned.p] — expected one of ref"]);
}

#[test]
fn pinned_image_needs_a_digest() {
    let text = r#"instance = "shop"
[target]
kind = "local"

[pinned.envoy]
ref = "envoyproxy/envoy:v1.30.1"
"#;
    let (err, msg, _) = fail(text, &[]);
    assert_eq!(err.line, Some(6));
    assert_has(&msg, &[r#":6: pinned image "envoy" needs a digest: write ref = "envoyproxy/envoy:v1.30.1@sha256:…""#]);
}

#[test]
fn missing_context_says_where_it_looked() {
    let text = "instance = \"shop\"\n[target]\nkind = \"local\"\n[built.api]\ncontext = \"services/apii\"\n";
    let (err, msg, dir) = fail(text, &[("services/api/Dockerfile", "")]);
    assert_eq!(err.line, Some(5));
    let looked = std::path::absolute(dir.path().join("services/apii")).unwrap();
    assert_has(
        &msg,
        &[
            r#":5: built image "api": context "services/apii" does not exist"#,
            &format!("(looked in {})", looked.display()),
        ],
    );

    let (err, msg, _) = fail(text, &[("services/apii", "a file")]);
    assert_eq!(err.line, Some(5));
    assert_has(&msg, &[r#"context "services/apii" is not a directory"#]);

    let (err, msg, _) = fail(&text.replace("services/apii", "/abs/api"), &[]);
    assert_eq!(err.line, Some(5));
    assert_has(&msg, &[r#"context "/abs/api" must be relative to the manifest's folder"#]);

    let (err, msg, _) = fail("instance = \"a\"\n[target]\nkind = \"local\"\n[built.api]\nshared = true\n", API);
    assert_eq!(err.line, Some(4));
    assert_has(&msg, &[r#"built image "api" needs context = "<dir>""#]);
}

#[test]
fn missing_dockerfiles_are_named() {
    let base = "instance = \"a\"\n[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n";
    let (err, msg, _) = fail(base, &[("api/main.sh", "")]);
    assert_eq!(err.line, Some(4));
    assert_has(&msg, &[r#"built image "api": no Dockerfile in context "api""#, "api/Dockerfile", "set dockerfile = "]);

    let (err, msg, _) = fail(&format!("{base}dockerfile = \"api/Dockerfil\"\n"), API);
    assert_eq!(err.line, Some(6));
    assert_has(&msg, &[r#"built image "api": dockerfile "api/Dockerfil" does not exist (looked in "#]);

    let (err, msg, _) = fail(&format!("{base}dockerfile = \"api\"\n"), API);
    assert_eq!(err.line, Some(6));
    assert_has(&msg, &[r#"dockerfile "api" is not a file"#]);
}

#[test]
fn duplicate_names_across_sections() {
    let text = r#"instance = "shop"
[target]
kind = "local"

[built.api]
context = "api"

[brought.api]
ref = "postgres:16"
"#;
    let (err, msg, _) = fail(text, API);
    assert_eq!(err.line, Some(8));
    assert_has(&msg, &[r#":8: two images are named "api" ([built.api] and [brought.api]) — rename one"#]);
}

#[test]
fn no_target_fails_naming_registry() {
    let (err, msg, dir) = fail("instance = \"shop\"\n[built.api]\ncontext = \"api\"\n", API);
    assert_eq!(err.line, None);
    assert_eq!(
        msg,
        format!(
            "{}: no [target] — add one, e.g. [target] kind = \"registry\" with registry = \"host:port\"",
            dir.path().join("kiln.toml").display()
        )
    );
}

#[test]
fn target_errors() {
    let img = "[built.api]\ncontext = \"api\"\n";
    let cases: &[(&str, usize, &[&str])] = &[
        ("[target]\nkind = \"regsitry\"\n", 3, &[r#"unknown target kind "regsitry""#, "registry, kind, nodes, local"]),
        ("[target]\nnamespace = \"x\"\n", 2, &["[target] has no kind", "kind = \"registry\""]),
        ("[target]\nkind = \"registry\"\n", 2, &[r#"target kind "registry" needs registry = "host:port[/prefix]""#]),
        ("[target]\nkind = \"nodes\"\n", 2, &[r#"target kind "nodes" needs cluster = "<cluster name>""#]),
        (
            "[target]\nkind = \"registry\"\nregistry = \"reg.io\"\ncluster = \"x\"\n",
            5,
            &[r#"key "cluster" does not apply to target kind "registry" — remove it"#],
        ),
        (
            "[target]\nkind = \"local\"\nregistry = \"reg.io\"\n",
            4,
            &[r#"key "registry" does not apply to target kind "local""#],
        ),
        (
            "[target]\nkind = \"registry\"\nregistry = \"myreg/team\"\n",
            4,
            &[r#"registry "myreg/team" is invalid"#, "Docker Hub user", "myreg:5000"],
        ),
        (
            "[target]\nkind = \"registry\"\nregistry = \"http://reg.io\"\n",
            4,
            &[r#"registry "http://reg.io" is invalid: drop the scheme"#],
        ),
        (
            "[target]\nkind = \"registry\"\nregistry = \"reg.io:x\"\n",
            4,
            &[r#"registry "reg.io:x" is invalid"#, "the port must be digits"],
        ),
        (
            "[target]\nkind = \"registry\"\nregistry = \"reg.io/Team\"\n",
            4,
            &[r#"registry "reg.io/Team" is invalid: repository name must be lowercase"#],
        ),
        ("[target]\nkind = \"nodes\"\ncluster = \"Prod\"\n", 4, &[r#"cluster "Prod" is invalid"#]),
        ("[target]\nkind = \"local\"\nnamespace = \"Shop\"\n", 4, &[r#"namespace "Shop" is invalid"#]),
        ("[target]\nkind = \"local\"\nmirror_registry = \"mirror\"\n", 4, &[r#"mirror_registry "mirror" is invalid"#]),
    ];
    for (target, line, parts) in cases {
        let (err, msg, _) = fail(&format!("instance = \"a\"\n{target}{img}"), API);
        assert_eq!(err.line, Some(*line), "{msg}");
        assert_has(&msg, parts);
    }
}

#[test]
fn bad_refs_wrap_the_ref_error() {
    let text = "instance = \"a\"\n[target]\nkind = \"local\"\n[brought.db]\nref = \"Postgres:16\"\n";
    let (err, msg, _) = fail(text, &[]);
    assert_eq!(err.line, Some(5));
    assert_has(
        &msg,
        &[
            r#"brought image "db": ref is not a valid image reference"#,
            r#"image ref "Postgres:16": repository name must be lowercase"#,
        ],
    );
    let source = std::error::Error::source(&err).expect("the RefError is the source");
    assert!(source.to_string().starts_with("image ref \"Postgres:16\""));

    let (err, msg, _) = fail(&text.replace("Postgres:16", "postgres@sha256:abc"), &[]);
    assert_eq!(err.line, Some(5));
    assert_has(&msg, &["digest must be sha256:<64 lowercase hex>"]);

    let (err, msg, _) = fail("instance = \"a\"\n[target]\nkind = \"local\"\n[brought.db]\n", &[]);
    assert_eq!(err.line, Some(4));
    assert_has(&msg, &[r#"brought image "db" needs ref = "<image>:<tag>""#]);
}

#[test]
fn bad_platforms() {
    let rest = "[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n";
    let (err, msg, _) =
        fail(&format!("instance = \"a\"\nplatforms = [\n  \"linux/amd64\",\n  \"linux/amd46\",\n]\n{rest}"), API);
    assert_eq!(err.line, Some(4));
    assert_has(
        &msg,
        &["platforms has an invalid entry", r#"platform "linux/amd46": "amd46" is not a known architecture"#],
    );

    let (err, msg, _) = fail(&format!("instance = \"a\"\nplatforms = []\n{rest}"), API);
    assert_eq!(err.line, Some(2));
    assert_has(&msg, &["platforms is empty", "linux/amd64"]);

    let (err, msg, _) = fail(&format!("instance = \"a\"\nplatforms = \"linux/amd64\"\n{rest}"), API);
    assert_eq!(err.line, Some(2));
    assert_has(&msg, &[r#"platforms = "linux/amd64""#, r#"only "cluster" is known"#, r#"platforms = ["linux/amd64""#]);

    let (err, msg, _) = fail(&format!("instance = \"a\"\nplatforms = \"cluster\"\n{rest}"), API);
    assert_eq!(err.line, Some(2));
    assert_has(&msg, &["a local target has none", "deliver to a kind or nodes target"]);
}

#[test]
fn platforms_come_from_the_cluster_when_named_or_left_out_with_a_cluster_target() {
    let nodes = "[target]\nkind = \"nodes\"\ncluster = \"edge\"\n[built.api]\ncontext = \"api\"\n";
    let (named, _dir) = load(&format!("instance = \"a\"\nplatforms = \"cluster\"\n{nodes}"), API).unwrap();
    assert_eq!(named.platform_source, PlatformSource::Cluster { named: true });
    assert_eq!(named.platforms, PlatformSet::host(), "this machine's until the cluster says");
    let (unnamed, _dir) = load(&format!("instance = \"a\"\n{nodes}"), API).unwrap();
    assert_eq!(unnamed.platform_source, PlatformSource::Cluster { named: false });
    let listed = format!("instance = \"a\"\nplatforms = [\"linux/arm64\"]\n{nodes}");
    assert_eq!(load(&listed, API).unwrap().0.platform_source, PlatformSource::Listed);
    let local = "instance = \"a\"\n[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n";
    assert_eq!(load(local, API).unwrap().0.platform_source, PlatformSource::Host);
    let arm = PlatformSet::parse(["linux/arm64", "linux/amd64"]).unwrap();
    assert_eq!(named.with_cluster_platforms(arm.clone()).platforms, arm);
}

#[test]
fn bad_instance_names() {
    let rest = "[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n";
    for bad in ["Shop", "1shop", "shop-", "shop_x", "", &"a".repeat(64)] {
        let (err, msg, _) = fail(&format!("\ninstance = \"{bad}\"\n{rest}"), API);
        assert_eq!(err.line, Some(2), "{msg}");
        assert_has(&msg, &[&format!("instance {bad:?} is invalid"), "start with a letter", "at most 63"]);
    }
    assert!(load(&format!("instance = \"{}\"\n{rest}", "a".repeat(63)), API).is_ok());

    let (err, msg, _) = fail(rest, API);
    assert_eq!(err.line, None);
    assert_has(&msg, &["no instance — add instance = "]);
}

#[test]
fn no_images() {
    let (err, msg, _) = fail("instance = \"a\"\n[target]\nkind = \"local\"\n", &[]);
    assert_eq!(err.line, None);
    assert_has(&msg, &["no images — add a [built.<name>], [brought.<name>] or [pinned.<name>] table"]);
}

#[test]
fn built_image_details() {
    let head = "instance = \"a\"\n[target]\nkind = \"registry\"\nregistry = \"reg.io\"\n";
    let cases: &[(&str, usize, &[&str])] = &[
        ("[built.Api]\ncontext = \"api\"\n", 5, &[r#"image name "Api" in [built.Api] is invalid"#]),
        (
            "[built.api]\ncontext = \"api\"\nrepository = \"ghcr.io/x/api\"\n",
            7,
            &[r#"repository "ghcr.io/x/api" must be a repository path without registry, tag or digest"#],
        ),
        ("[built.api]\ncontext = \"api\"\nrepository = \"api:1\"\n", 7, &["without registry, tag or digest"]),
        (
            "[built.api]\ncontext = \"api\"\nrepository = \"Api\"\n",
            7,
            &[r#"repository "Api" is invalid"#, "repository name must be lowercase"],
        ),
        (
            "[built.api]\ncontext = \"api\"\nrepository = \"a..b\"\n",
            7,
            &[r#"repository "a..b" is invalid"#, r#"name component "a..b""#],
        ),
        (
            &format!("[built.api]\ncontext = \"api\"\nrepository = \"{}\"\n", "a".repeat(250)),
            7,
            &["is invalid", "repository name is 257 characters"],
        ),
        ("[built.api]\ncontext = \"api\"\nargs = { \"A=B\" = \"1\" }\n", 7, &[r#"build arg "A=B" is invalid"#]),
        ("[built.api]\ncontext = \"api\"\nargs = { A = 1 }\n", 7, &["invalid type: integer `1`, expected a string"]),
        ("[built.api]\ncontext = \"api\"\ntarget = \"run time\"\n", 7, &[r#"target stage "run time" is invalid"#]),
        ("[built.api]\ncontext = \"api\"\nshared = \"yes\"\n", 7, &["invalid type", "expected a boolean"]),
        ("[built.api]\ncontext = \"api\"\ncontext = \"api\"\n", 7, &[r#"key "context" appears twice"#]),
        ("[built.api\ncontext = \"api\"\n", 5, &[]),
    ];
    for (body, line, parts) in cases {
        let (err, msg, _) = fail(&format!("{head}{body}"), API);
        assert_eq!(err.line, Some(*line), "{msg}");
        assert_has(&msg, parts);
    }
}

#[test]
fn a_folder_without_a_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let err = Manifest::load(dir.path()).unwrap_err();
    assert_eq!(err.line, None);
    assert_has(&err.to_string(), &[&dir.path().join("kiln.toml").display().to_string(), "not found — create it"]);
}

#[test]
fn parse_takes_paths_from_the_manifest_folder() {
    let dir = folder("", API);
    let text = "instance = \"a\"\n[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n";
    let m = Manifest::parse(text, &dir.path().join("kiln.toml")).unwrap();
    let (_, api) = m.built().next().unwrap();
    assert_eq!(api.context, std::fs::canonicalize(dir.path().join("api")).unwrap());
}

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(name)
}

#[test]
fn the_examples_load() {
    for (name, instance) in [("hello", "hello"), ("registry", "hello-registry")] {
        let m = Manifest::load(&example(name)).unwrap_or_else(|e| panic!("examples/{name}: {e}"));
        assert_eq!(m.instance, instance);
        let names: Vec<&str> = m.images.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["web", "worker", "shell", "pause"], "examples/{name}");
        let built: Vec<_> = m.built().collect();
        assert_eq!(built[0].1.dockerfile, DockerfileLoc::Inside { rel: "Dockerfile".to_string() });
        assert!(matches!(&built[1].1.dockerfile, DockerfileLoc::Outside { rel, .. } if rel == "../worker.Dockerfile"));
        assert_eq!(built[1].1.args.get("GREETING").map(String::as_str), Some("hello from kiln"));
        let ImageSpec::Pinned(pause) = &m.image("pause").unwrap().spec else { panic!("pause is pinned") };
        assert_eq!(pause.digest(), Some(DIGEST));
    }
    assert_eq!(Manifest::load(&example("hello")).unwrap().target, Target::Local);
    let registry = Manifest::load(&example("registry")).unwrap();
    assert_eq!(registry.target.qualify("hello-registry-web"), "127.0.0.1:5000/hello-registry-web");
}

// Containment: a manifest from a cloned repository must not ship files from outside it.

const WEB: &str = "instance = \"a\"\n[target]\nkind = \"local\"\n[built.web]\n";

/// A temp folder holding `outside/` (a context with a Dockerfile), `secret.Dockerfile`, and the
/// instance folder `inst/` with `kiln.toml` = `manifest` and `inst/web/Dockerfile`.
fn beside_outside(manifest: &str) -> (TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    for (path, contents) in [
        ("outside/Dockerfile", "FROM scratch\n"),
        ("outside/secret.txt", "s3cret\n"),
        ("secret.Dockerfile", "FROM scratch\n"),
        ("inst/web/Dockerfile", "FROM scratch\n"),
        ("inst/kiln.toml", manifest),
    ] {
        let path = tmp.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, contents).unwrap();
    }
    let top = std::fs::canonicalize(tmp.path()).unwrap();
    (tmp, top)
}

fn refused(dir: &Path) -> String {
    Manifest::load(dir).expect_err("manifest should be refused").to_string()
}

#[test]
fn a_context_climbing_out_of_the_manifest_folder_is_refused() {
    let (tmp, top) = beside_outside(&format!("{WEB}context = \"../outside\"\n"));
    let msg = refused(&tmp.path().join("inst"));
    assert_has(
        &msg,
        &[
            "kiln.toml:5: context \"../outside\" of [built.web] resolves to ",
            &format!("{}, outside the instance's root {} ", top.join("outside").display(), top.join("inst").display()),
            "(the manifest's folder, as no git work tree holds it)",
            "— move it inside, or widen the root with root = \"..\"",
        ],
    );
}

#[test]
#[cfg(unix)]
fn a_context_symlinked_out_of_the_root_is_refused() {
    let (tmp, top) = beside_outside(&format!("{WEB}context = \"linked\"\n"));
    std::os::unix::fs::symlink(top.join("outside"), tmp.path().join("inst/linked")).unwrap();
    let msg = refused(&tmp.path().join("inst"));
    assert_has(
        &msg,
        &[
            "kiln.toml:5: context \"linked\" of [built.web] resolves to ",
            &top.join("outside").display().to_string(),
            "outside the instance's root",
        ],
    );
    // A relative link climbing out is the same escape.
    std::fs::remove_file(tmp.path().join("inst/linked")).unwrap();
    std::os::unix::fs::symlink("../outside", tmp.path().join("inst/linked")).unwrap();
    assert_has(&refused(&tmp.path().join("inst")), &["context \"linked\" of [built.web] resolves to "]);
}

#[test]
fn a_dockerfile_outside_the_root_is_refused() {
    let (tmp, top) = beside_outside(&format!("{WEB}context = \"web\"\ndockerfile = \"../secret.Dockerfile\"\n"));
    let msg = refused(&tmp.path().join("inst"));
    assert_has(
        &msg,
        &[
            "kiln.toml:6: dockerfile \"../secret.Dockerfile\" of [built.web] resolves to ",
            &format!("{}, outside the instance's root", top.join("secret.Dockerfile").display()),
            "root = \"..\"",
        ],
    );

    // However deep it climbs: the file the issue shipped to a farm.
    let deep = format!("{WEB}context = \"web\"\ndockerfile = \"../../../../../../../../etc/hostname\"\n");
    std::fs::write(tmp.path().join("inst/kiln.toml"), deep).unwrap();
    if Path::new("/etc/hostname").is_file() {
        assert_has(&refused(&tmp.path().join("inst")), &["resolves to /etc/hostname, outside the instance's root"]);
    }
}

#[test]
#[cfg(unix)]
fn a_default_dockerfile_linked_out_of_the_root_is_refused() {
    let (tmp, top) = beside_outside(&format!("{WEB}context = \"web\"\n"));
    std::fs::remove_file(tmp.path().join("inst/web/Dockerfile")).unwrap();
    std::os::unix::fs::symlink("../../secret.Dockerfile", tmp.path().join("inst/web/Dockerfile")).unwrap();
    let msg = refused(&tmp.path().join("inst"));
    assert_has(
        &msg,
        &[
            "kiln.toml:4: dockerfile \"web/Dockerfile\" of [built.web] resolves to ",
            &top.join("secret.Dockerfile").display().to_string(),
        ],
    );
}

#[test]
fn root_widens_what_a_manifest_may_take() {
    let text = format!("root = \"..\"\n{WEB}context = \"../outside\"\ndockerfile = \"../secret.Dockerfile\"\n");
    let (tmp, top) = beside_outside(&text);
    let m = Manifest::load(&tmp.path().join("inst")).unwrap();
    assert_eq!(m.root, top);
    let (_, web) = m.built().next().unwrap();
    assert_eq!(web.context, top.join("outside"));
    assert!(matches!(&web.dockerfile, DockerfileLoc::Outside { rel, .. } if rel == "../secret.Dockerfile"));

    // Widened, it still bounds: a path above the new root is refused naming it.
    let text = format!("root = \"..\"\n{WEB}context = \"web\"\ndockerfile = \"../../x.Dockerfile\"\n");
    std::fs::write(tmp.path().join("inst/kiln.toml"), &text).unwrap();
    std::fs::write(top.parent().unwrap().join("x.Dockerfile"), "FROM scratch\n").ok();
    if top.parent().unwrap().join("x.Dockerfile").is_file() {
        let msg = refused(&tmp.path().join("inst"));
        assert_has(&msg, &[&format!("outside the instance's root {} (root = \"..\")", top.display())]);
        std::fs::remove_file(top.parent().unwrap().join("x.Dockerfile")).unwrap();
    }
}

#[test]
fn a_root_must_be_relative_and_hold_the_manifest() {
    let (tmp, _top) = beside_outside(&format!("root = \"/\"\n{WEB}context = \"web\"\n"));
    let dir = tmp.path().join("inst");
    assert_has(&refused(&dir), &["kiln.toml:1: root \"/\" must be relative to the manifest's folder"]);

    std::fs::write(dir.join("kiln.toml"), format!("root = \"web\"\n{WEB}context = \"web\"\n")).unwrap();
    assert_has(
        &refused(&dir),
        &["kiln.toml:1: root \"web\" resolves to ", "which does not hold the manifest's folder"],
    );

    std::fs::write(dir.join("kiln.toml"), format!("root = \"../nowhere\"\n{WEB}context = \"web\"\n")).unwrap();
    assert_has(&refused(&dir), &["kiln.toml:1: cannot resolve root \"../nowhere\""]);
}

#[test]
fn the_git_work_tree_is_the_default_root() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(repo.join(".git")).unwrap();
    for (path, contents) in [("repo/shared/web/Dockerfile", "FROM scratch\n"), ("outside/Dockerfile", "FROM scratch\n")]
    {
        let path = tmp.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, contents).unwrap();
    }
    let inst = repo.join("apps/inst");
    std::fs::create_dir_all(&inst).unwrap();
    std::fs::write(inst.join("kiln.toml"), format!("{WEB}context = \"../../shared/web\"\n")).unwrap();
    let m = Manifest::load(&inst).unwrap();
    let repo = std::fs::canonicalize(&repo).unwrap();
    assert_eq!(m.root, repo, "contexts anywhere in the work tree are inside");
    assert_eq!(m.built().next().unwrap().1.context, repo.join("shared/web"));

    std::fs::write(inst.join("kiln.toml"), format!("{WEB}context = \"../../../outside\"\n")).unwrap();
    let msg = refused(&inst);
    assert_has(
        &msg,
        &[
            &format!("outside the instance's root {} (the git work tree holding the manifest)", repo.display()),
            "root = \"../../..\"",
        ],
    );

    // A linked worktree or a submodule has a `.git` file, not a folder: it is a work tree too.
    std::fs::remove_dir(repo.join(".git")).unwrap();
    std::fs::write(repo.join("apps/.git"), "gitdir: /elsewhere\n").unwrap();
    std::fs::write(inst.join("kiln.toml"), format!("{WEB}context = \"../../shared/web\"\n")).unwrap();
    assert_has(&refused(&inst), &[&format!("outside the instance's root {} (the git", repo.join("apps").display())]);
}

#[test]
fn a_team_names_the_instances_owner_and_must_be_a_label() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir(tmp.path().join("app")).unwrap();
    std::fs::write(tmp.path().join("app/Dockerfile"), "FROM scratch\n").unwrap();
    let manifest = |team: &str| {
        format!("instance = \"shop\"\nteam = {team}\n[target]\nkind = \"local\"\n[built.app]\ncontext = \"app\"\n")
    };
    std::fs::write(tmp.path().join("kiln.toml"), manifest("\"payments\"")).unwrap();
    assert_eq!(kiln_core::manifest::Manifest::load(tmp.path()).unwrap().team.as_deref(), Some("payments"));
    std::fs::write(tmp.path().join("kiln.toml"), manifest("\"Pay Ments\"")).unwrap();
    let err = kiln_core::manifest::Manifest::load(tmp.path()).unwrap_err().to_string();
    assert!(err.contains("kiln.toml:2:") && err.contains("team"), "{err}");
}
