//! `stage` in `[built.<name>]`: what it resolves to, and each wrong shape refused on its line with
//! the fix.

use kiln_core::manifest::{ImageSpec, Manifest, ManifestError, Stage};
use tempfile::TempDir;

const HEAD: &str = "instance = \"shop\"\n[target]\nkind = \"local\"\n[built.api]\ncontext = \"api\"\n";

fn folder(manifest: &str) -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("api")).unwrap();
    std::fs::write(dir.path().join("api/Dockerfile"), "FROM scratch\nCOPY . /app/\n").unwrap();
    std::fs::write(dir.path().join("kiln.toml"), manifest).unwrap();
    dir
}

fn stage_of(manifest: &str) -> Stage {
    let dir = folder(manifest);
    let loaded = Manifest::load(dir.path()).unwrap();
    let ImageSpec::Built(built) = &loaded.image("api").unwrap().spec else { panic!("api is built") };
    built.stage.clone().expect("api is staged")
}

/// The error and its line, for `HEAD` + `rest`.
fn refused(rest: &str) -> (ManifestError, String) {
    let dir = folder(&format!("{HEAD}{rest}"));
    let err = Manifest::load(dir.path()).expect_err("the manifest is refused");
    let text = err.to_string();
    assert!(text.starts_with(&dir.path().join("kiln.toml").display().to_string()), "names the file: {text}");
    (err, text)
}

#[test]
fn an_inline_stage_resolves_with_its_command_patterns_and_image_path() {
    let stage = stage_of(&format!(
        "{HEAD}stage = {{ run = [\"pnpm\", \"deploy\", \"--filter\", \"api\", \"{{out}}\"], \
         remove = [\"node_modules/.modules.yaml\", \"**/.bin\"], image_path = \"/app\" }}\n"
    ));
    assert_eq!(stage.run, ["pnpm", "deploy", "--filter", "api", "{out}"]);
    assert_eq!(stage.remove, ["node_modules/.modules.yaml", "**/.bin"]);
    assert_eq!(stage.image_path.as_deref(), Some("/app"));
    assert_eq!(stage.command_line(), "pnpm deploy --filter api {out}");
}

#[test]
fn a_stage_subtable_resolves_too_and_remove_and_image_path_are_optional() {
    let stage = stage_of(&format!("{HEAD}[built.api.stage]\nrun = [\"./stage.sh\", \"{{out}}\"]\n"));
    assert_eq!((stage.remove.len(), stage.image_path), (0, None));
}

#[test]
fn an_unstaged_image_has_no_stage() {
    let dir = folder(HEAD);
    let loaded = Manifest::load(dir.path()).unwrap();
    let ImageSpec::Built(built) = &loaded.image("api").unwrap().spec else { panic!("api is built") };
    assert_eq!(built.stage, None);
    assert!(built.walk().is_ok());
}

#[test]
fn a_staged_image_cannot_be_walked_unstaged() {
    let dir = folder(&format!("{HEAD}stage = {{ run = [\"./stage.sh\", \"{{out}}\"] }}\n"));
    let loaded = Manifest::load(dir.path()).unwrap();
    let err = loaded.walk_and_address().expect_err("the context folder is not what it builds");
    let text = kiln_core::error_chain(&err);
    assert!(text.contains("its context is staged by `./stage.sh {out}`, which must run first"), "{text}");
}

#[test]
fn a_stage_that_is_not_a_table_names_the_form_it_takes() {
    let (err, text) = refused("stage = \"pnpm deploy\"\n");
    assert_eq!(err.line, Some(6));
    assert!(text.contains("built image \"api\": stage must be a table, e.g. stage = { run = ["), "{text}");
}

#[test]
fn each_key_of_the_wrong_type_is_named_with_an_example() {
    let (err, text) = refused("stage = { run = \"pnpm deploy {out}\" }\n");
    assert_eq!(err.line, Some(6));
    assert!(text.contains("stage.run must be an array of strings: the program and its arguments"), "{text}");

    let (_, text) = refused("stage = { run = [\"x\", 1] }\n");
    assert!(text.contains("stage.run must be an array of strings"), "{text}");

    let (_, text) = refused("stage = { run = [\"x\", \"{out}\"], remove = \".modules.yaml\" }\n");
    assert!(text.contains("stage.remove must be an array of .dockerignore patterns"), "{text}");

    let (_, text) = refused("stage = { run = [\"x\", \"{out}\"], image_path = 1 }\n");
    assert!(text.contains("stage.image_path must be a string: the absolute path"), "{text}");
}

#[test]
fn an_unknown_key_in_stage_names_the_keys_it_takes() {
    let (err, text) = refused("[built.api.stage]\nrun = [\"x\", \"{out}\"]\ndelete = [\"a\"]\n");
    assert_eq!(err.line, Some(8));
    assert!(
        text.ends_with("unknown key \"delete\" in stage of [built.api] — expected one of run, remove, image_path"),
        "{text}"
    );
}

#[test]
fn a_command_must_exist_and_name_out() {
    let (err, text) = refused("stage = { remove = [\"a\"] }\n");
    assert_eq!(err.line, Some(6));
    assert!(text.contains("stage needs a command: run = [\"<program>\""), "{text}");
    let (_, text) = refused("stage = { run = [] }\n");
    assert!(text.contains("stage needs a command"), "{text}");

    let (err, text) = refused("[built.api.stage]\nrun = [\"pnpm\", \"deploy\", \"dist\"]\n");
    assert_eq!(err.line, Some(7));
    assert!(text.contains("stage.run never names {out} — pass the command the fresh directory"), "{text}");
}

#[test]
fn bad_patterns_and_image_paths_are_refused_on_their_line() {
    let (err, text) = refused("[built.api.stage]\nrun = [\"x\", \"{out}\"]\nremove = [\n  \"ok\",\n  \"#yaml\",\n]\n");
    assert_eq!(err.line, Some(10));
    assert!(text.contains("stage.remove pattern \"#yaml\" cannot be used: a leading # makes it a comment"), "{text}");

    let (err, text) = refused("[built.api.stage]\nrun = [\"x\", \"{out}\"]\nimage_path = \"app\"\n");
    assert_eq!(err.line, Some(8));
    assert!(text.contains("stage.image_path \"app\" must be an absolute path"), "{text}");
}

#[test]
fn stage_is_listed_among_the_keys_a_built_image_takes() {
    let (_, text) = refused("stag = 1\n");
    assert!(text.contains("expected one of context, dockerfile, args, target, shared, repository, stage"), "{text}");
}
