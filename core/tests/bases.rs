//! Built images FROM other built images of the manifest: which FROMs name a base, the order they
//! build in, the cycle error, and how the child's address follows its base's.

use std::collections::BTreeMap;

use kiln_core::manifest::{Addressed, Base, ImageSpec, Manifest, ManifestError, Problem};
use tempfile::TempDir;

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

const HEAD: &str = "instance = \"shop\"\nplatforms = [\"linux/amd64\"]\n[target]\nkind = \"local\"\n";

fn built(dir: &TempDir, name: &str) -> kiln_core::manifest::BuiltImage {
    let manifest = Manifest::load(dir.path()).unwrap();
    let ImageSpec::Built(built) = &manifest.image(name).unwrap().spec else { panic!("{name} is built") };
    built.clone()
}

fn bases(dir: &TempDir, name: &str) -> Vec<(String, String, usize)> {
    built(dir, name).from.into_iter().map(|Base { image, written, line }| (image, written, line)).collect()
}

fn base(image: &str, written: &str, line: usize) -> (String, String, usize) {
    (image.to_string(), written.to_string(), line)
}

fn refs(addressed: &[Addressed<'_>]) -> BTreeMap<String, String> {
    addressed.iter().map(|a| (a.name.to_string(), a.reference.to_string())).collect()
}

#[test]
fn a_from_names_a_base_by_its_name_its_repository_or_its_repository_on_the_target() {
    let manifest = "instance = \"shop\"\n[target]\nkind = \"registry\"\nregistry = \"127.0.0.1:5000/team\"\n\
                    [built.base]\ncontext = \"base\"\nshared = true\n\
                    [built.tools]\ncontext = \"tools\"\nrepository = \"shop/tools\"\n\
                    [built.api]\ncontext = \"api\"\n";
    let api = "# the api\nFROM base AS build\nFROM --platform=linux/amd64 shop/tools\n\
               FROM 127.0.0.1:5000/team/shop-base\nFROM base\n";
    let dir = folder(
        manifest,
        &[("base/Dockerfile", "FROM scratch\n"), ("tools/Dockerfile", "FROM scratch\n"), ("api/Dockerfile", api)],
    );
    assert_eq!(
        bases(&dir, "api"),
        [base("base", "base", 2), base("tools", "shop/tools", 3), base("base", "127.0.0.1:5000/team/shop-base", 4)],
        "line 5 names the stage `base` declared on line 2, not the image"
    );
    assert_eq!(built(&dir, "api").base_names(), ["base", "tools"]);
    assert!(bases(&dir, "base").is_empty());
}

#[test]
fn tags_other_registries_variables_stages_and_scratch_name_no_base() {
    let manifest = format!("{HEAD}[built.base]\ncontext = \"base\"\n[built.api]\ncontext = \"api\"\n");
    let api = "ARG B=base\nFROM ${B}\nFROM shop-base:v1\nFROM docker.io/library/base\nFROM base:latest\n\
               FROM busybox AS base\nFROM base\nFROM scratch\n";
    let dir = folder(&manifest, &[("base/Dockerfile", "FROM scratch\n"), ("api/Dockerfile", api)]);
    assert!(bases(&dir, "api").is_empty(), "{:?}", bases(&dir, "api"));
}

#[test]
fn a_name_wins_over_another_images_repository() {
    // `tools`'s repository is the word `base`; `FROM base` still means the image named base.
    let manifest =
        format!("{HEAD}[built.tools]\ncontext = \"tools\"\nrepository = \"base\"\n[built.base]\ncontext = \"b\"\n");
    let dir = folder(&manifest, &[("tools/Dockerfile", "FROM base\n"), ("b/Dockerfile", "FROM scratch\n")]);
    assert_eq!(bases(&dir, "tools"), [base("base", "base", 1)]);
}

#[test]
fn bases_build_first_and_file_order_holds_elsewhere() {
    let manifest = format!(
        "{HEAD}[built.web]\ncontext = \"web\"\n[brought.db]\nref = \"postgres:16\"\n\
         [built.lone]\ncontext = \"lone\"\n[built.mid]\ncontext = \"mid\"\n[built.base]\ncontext = \"base\"\n"
    );
    let files = [
        ("web/Dockerfile", "FROM mid\n"),
        ("lone/Dockerfile", "FROM scratch\n"),
        ("mid/Dockerfile", "FROM shop-base\n"),
        ("base/Dockerfile", "FROM scratch\n"),
    ];
    let dir = folder(&manifest, &files);
    let manifest = Manifest::load(dir.path()).unwrap();
    let order: Vec<&str> = manifest.build_order().into_iter().map(|(name, _)| name).collect();
    assert_eq!(order, ["lone", "base", "mid", "web"]);
    let (addressed, _) = manifest.walk_and_address().unwrap();
    let names: Vec<&str> = addressed.iter().map(|a| a.name).collect();
    assert_eq!(names, order, "addressed in build order");
}

fn cycle_error(manifest: &str, files: &[(&str, &str)]) -> (ManifestError, String) {
    let dir = folder(manifest, files);
    let err = Manifest::load(dir.path()).expect_err("a cycle is refused");
    let text = err.to_string();
    (err, text)
}

#[test]
fn a_cycle_is_a_manifest_error_naming_the_cycle_and_each_dockerfile_line() {
    let manifest = format!(
        "{HEAD}[built.lone]\ncontext = \"lone\"\n[built.a]\ncontext = \"a\"\n\
         [built.b]\ncontext = \"b\"\ndockerfile = \"docker/b.Dockerfile\"\n[built.c]\ncontext = \"c\"\n"
    );
    let files = [
        ("lone/Dockerfile", "FROM a\n"),
        ("a/Dockerfile", "FROM scratch AS tools\nFROM shop-b\n"),
        ("b/x", "x"),
        ("docker/b.Dockerfile", "FROM c\n"),
        ("c/Dockerfile", "# c builds on a\nFROM a\n"),
    ];
    let (err, text) = cycle_error(&manifest, &files);
    let Problem::FromCycle { cycle, .. } = &*err.problem else { panic!("{err:?}") };
    assert_eq!(cycle, &["a", "b", "c", "a"]);
    assert_eq!(err.line, Some(7), "the table of the first image of the cycle: {text}");
    assert!(err.path.ends_with("kiln.toml"));
    for part in [
        "kiln.toml:7: built images build FROM each other in a cycle: a → b → c → a",
        "a: a/Dockerfile:2 FROM shop-b; b: docker/b.Dockerfile:1 FROM c; c: c/Dockerfile:2 FROM a",
        "one of them must build FROM something else",
    ] {
        assert!(text.contains(part), "{part:?} in {text}");
    }
}

#[test]
fn an_image_from_itself_is_a_cycle_and_the_error_says_how_to_name_an_image_from_elsewhere() {
    let manifest = format!("{HEAD}[built.busybox]\ncontext = \"busybox\"\n");
    let (err, text) = cycle_error(&manifest, &[("busybox/Dockerfile", "FROM busybox\nCOPY x /\n")]);
    assert!(matches!(&*err.problem, Problem::FromCycle { cycle, .. } if cycle == &["busybox", "busybox"]));
    for part in [
        "built image \"busybox\" builds FROM itself: busybox → busybox (busybox: busybox/Dockerfile:1 FROM busybox)",
        "FROM docker.io/library/busybox:latest",
    ] {
        assert!(text.contains(part), "{part:?} in {text}");
    }
}

#[test]
fn the_child_builds_from_its_bases_content_ref_and_its_address_follows_the_base() {
    let manifest = format!(
        "{HEAD}[built.base]\ncontext = \"base\"\nshared = true\n[built.api]\ncontext = \"api\"\n\
         [built.plain]\ncontext = \"plain\"\n"
    );
    let files = [
        ("base/Dockerfile", "FROM scratch\nCOPY hello /hello\n"),
        ("base/hello", "one\n"),
        ("api/Dockerfile", "# api\nFROM base AS base\nCOPY app /app\nFROM base\n"),
        ("api/app", "app\n"),
        ("plain/Dockerfile", "FROM scratch\nCOPY p /p\n"),
        ("plain/p", "p\n"),
    ];
    let dir = folder(&manifest, &files);
    let m = Manifest::load(dir.path()).unwrap();
    let (addressed, _) = m.walk_and_address().unwrap();
    let by_name = |name: &str| addressed.iter().find(|a| a.name == name).unwrap();
    let (base, api, plain) = (by_name("base"), by_name("api"), by_name("plain"));

    // The child's Dockerfile travels rewritten; every other byte is the user's.
    let sent = String::from_utf8(api.dockerfile.sent.clone().expect("a rewritten Dockerfile travels")).unwrap();
    // The second FROM names the stage the first declared: it stays as written.
    assert_eq!(sent, format!("# api\nFROM {} AS base\nCOPY app /app\nFROM base\n", base.reference));
    assert!(base.reference.to_string().starts_with("shop-base:"));
    assert_eq!(api.dockerfile.digest, blake3::hash(sent.as_bytes()).to_hex().to_string());
    // An image with no base is sent and addressed exactly as before.
    assert_eq!((base.dockerfile.sent.as_ref(), plain.dockerfile.sent.as_ref()), (None, None));

    // Only the base's context changes: the base's tag moves, so the child's does; the rest stays.
    let before = refs(&addressed);
    std::fs::write(dir.path().join("base/hello"), "two\n").unwrap();
    let (again, _) = m.walk_and_address().unwrap();
    let after = refs(&again);
    assert_ne!(before["base"], after["base"]);
    assert_ne!(before["api"], after["api"], "the child's address covers its base's");
    assert_eq!(before["plain"], after["plain"]);

    // The Dockerfile loses the FROM it was loaded with: addressing refuses rather than drop a base.
    std::fs::write(dir.path().join("api/Dockerfile"), "FROM scratch\n").unwrap();
    let err = m.walk_and_address().unwrap_err();
    assert_eq!(err.image, "api");
    assert!(kiln_core::error_chain(&err).contains("changed while it was read"), "{err}");
}
